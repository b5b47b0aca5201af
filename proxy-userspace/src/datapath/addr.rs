//! Conversions between std addresses and the map encodings of `proxy_common`
//! (16-byte network-order addresses, IPv4-mapped; network-order ports).

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

/// `IpAddr` -> 16-byte map address (IPv4 becomes `::ffff:a.b.c.d`).
pub fn ip_to_bytes(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// 16-byte map address -> `IpAddr` (IPv4-mapped becomes IPv4).
pub fn bytes_to_ip(o: [u8; 16]) -> IpAddr {
    let v6 = Ipv6Addr::from(o);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

/// Port -> map port (network byte order bytes).
pub(crate) fn port_to_map(port: u16) -> [u8; 2] {
    port.to_be_bytes()
}

/// Map port (network byte order bytes) -> port.
pub(crate) fn port_from_map(port: [u8; 2]) -> u16 {
    u16::from_be_bytes(port)
}

/// Map address and port -> `SocketAddr`.
pub(crate) fn to_socket_addr(a: [u8; 16], port: [u8; 2]) -> SocketAddr {
    SocketAddr::new(bytes_to_ip(a), port_from_map(port))
}

/// Protocol number -> name as Kubernetes spells it.
pub(crate) fn proto_name(p: u8) -> &'static str {
    match p {
        proxy_common::PROTO_TCP => "TCP",
        proxy_common::PROTO_UDP => "UDP",
        0 => "-",
        _ => "?",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn ipv4_is_mapped_and_matches_user_ip4() {
        let ip: Ipv4Addr = "10.96.0.10".parse().unwrap();
        let a = ip_to_bytes(IpAddr::V4(ip));
        // bpf_sock_addr.user_ip4 holds the address in network order in a u32.
        let user_ip4 = u32::from_ne_bytes(ip.octets());
        assert_eq!(a, proxy_common::v4_mapped(user_ip4));
        assert_eq!(proxy_common::v4_of_mapped(&a), user_ip4);
        assert!(proxy_common::is_v4_mapped(&a));
        assert_eq!(bytes_to_ip(a), IpAddr::V4(ip));
    }

    #[test]
    fn words_and_bytes_round_trip() {
        let a = ip_to_bytes("fd00:10:96::a".parse().unwrap());
        assert_eq!(proxy_common::bytes_of(&proxy_common::words_of(&a)), a);
    }

    #[test]
    fn ipv6_round_trips() {
        let ip: IpAddr = "fd00:10:96::a".parse().unwrap();
        let a = ip_to_bytes(ip);
        assert!(!proxy_common::is_v4_mapped(&a));
        assert_eq!(bytes_to_ip(a), ip);
    }

    #[test]
    fn ports_are_network_order() {
        assert_eq!(port_to_map(80), [0, 80]);
        assert_eq!(port_from_map(port_to_map(8080)), 8080);
    }
}
