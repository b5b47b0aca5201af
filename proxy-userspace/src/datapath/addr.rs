//! Conversions between std addresses and the map encodings of `proxy_common`
//! (16-byte network-order addresses, IPv4-mapped; network-order ports).

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

/// `IpAddr` -> 16-byte map address (IPv4 becomes `::ffff:a.b.c.d`).
pub fn ip_to_words(ip: IpAddr) -> [u32; 4] {
    let v6 = match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    let o = v6.octets();
    std::array::from_fn(|i| u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]]))
}

/// 16-byte map address -> `IpAddr` (IPv4-mapped becomes IPv4).
pub fn words_to_ip(w: [u32; 4]) -> IpAddr {
    let mut o = [0u8; 16];
    for (i, word) in w.iter().enumerate() {
        o[4 * i..4 * i + 4].copy_from_slice(&word.to_ne_bytes());
    }
    let v6 = Ipv6Addr::from(o);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

/// Host-order port -> map port (network byte order).
pub fn port_to_map(port: u16) -> u16 {
    port.to_be()
}

/// Map port (network byte order) -> host-order port.
pub fn port_from_map(port: u16) -> u16 {
    u16::from_be(port)
}

/// Map address and port -> `SocketAddr`.
pub fn to_socket_addr(w: [u32; 4], port: u16) -> SocketAddr {
    SocketAddr::new(words_to_ip(w), port_from_map(port))
}

/// Protocol number -> name as Kubernetes spells it.
pub fn proto_name(p: u8) -> &'static str {
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
    fn ipv4_is_mapped_and_word3_is_user_ip4() {
        let ip: Ipv4Addr = "10.96.0.10".parse().unwrap();
        let w = ip_to_words(IpAddr::V4(ip));
        // bpf_sock_addr.user_ip4 holds the address in network order in a u32.
        assert_eq!(w[3], u32::from_ne_bytes(ip.octets()));
        assert!(proxy_common::is_v4_mapped(&w));
        assert_eq!(words_to_ip(w), IpAddr::V4(ip));
    }

    #[test]
    fn ipv6_round_trips() {
        let ip: IpAddr = "fd00:10:96::a".parse().unwrap();
        let w = ip_to_words(ip);
        assert!(!proxy_common::is_v4_mapped(&w));
        assert_eq!(words_to_ip(w), ip);
    }

    #[test]
    fn ports_are_network_order() {
        assert_eq!(port_to_map(80).to_ne_bytes(), [0, 80]);
        assert_eq!(port_from_map(port_to_map(8080)), 8080);
    }
}
