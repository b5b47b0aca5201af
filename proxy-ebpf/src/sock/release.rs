//! `sock_release`: a released socket's reverse-NAT entry and least-connections count go.

use aya_ebpf::{
    EbpfContext, helpers::bpf_get_socket_cookie, macros::cgroup_sock, programs::SockContext,
};
use proxy_common::{
    PROTO_TCP, PROTO_UDP, REVNAT_F_CONNECTED, REVNAT_F_COUNTED, RevNatKey, SPILLED_LEGACY,
    bytes_of, v4_mapped,
};

use super::revnat::{hint, take_overflow, take_slot};
use crate::{
    lc,
    maps::{REVNAT_SK, STALE_SOCKETS},
    monitor,
};

const AF_INET6: u32 = 10;

/// Forgets a released socket: its reverse-NAT entry and least-connections count. Runs for
/// every socket of the cgroup. A socket `connect()` translated has its entry in its
/// `SOCK_NAT` slot or, only while some entry went there, in `SOCK_NAT_OVERFLOW`: both
/// found by cookie, whatever the socket's state (a failed blocking connect or a
/// `connect(AF_UNSPEC)` clears the peer before the release). Entries an earlier version
/// wrote to `REVNAT_SK` are looked up by the socket's peer while the agent says some may
/// be left (`SPILLED_LEGACY`).
#[cgroup_sock(sock_release)]
pub fn sock_release(ctx: SockContext) -> i32 {
    let sk = ctx.sock;
    // SAFETY: readable fields of our context (`struct bpf_sock`).
    let (family, dst_port, protocol) = unsafe { ((*sk).family, (*sk).dst_port, (*sk).protocol) };
    if protocol != PROTO_TCP as u32 && protocol != PROTO_UDP as u32 {
        return 1;
    }
    // SAFETY: as above. Both forms are read unconditionally, each field at its constant
    // offset: loads in two branches get merged into one through a computed pointer, a
    // context access the verifier refuses.
    let (ip6, ip4) = unsafe {
        use core::ptr::read_volatile as rd;
        (
            [
                rd(&(*sk).dst_ip6[0]),
                rd(&(*sk).dst_ip6[1]),
                rd(&(*sk).dst_ip6[2]),
                rd(&(*sk).dst_ip6[3]),
            ],
            rd(&(*sk).dst_ip4),
        )
    };
    // SAFETY: helper on our own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let found = match take_slot(cookie).or_else(|| take_overflow(cookie)) {
        Some(e) => Some((e.key, e.value)),
        None if dst_port == 0 || !hint(SPILLED_LEGACY) => None,
        None => {
            let key = RevNatKey {
                cookie,
                addr: if family == AF_INET6 {
                    bytes_of(&ip6)
                } else {
                    v4_mapped(ip4)
                },
                port: dst_port.to_ne_bytes(),
                _pad: [0; 6],
            };
            // SAFETY: copied out at once.
            match unsafe { REVNAT_SK.get(key).copied() } {
                Some(v) if v.flags & REVNAT_F_CONNECTED != 0 => {
                    let _ = REVNAT_SK.remove(key);
                    Some((key, v))
                }
                _ => None,
            }
        }
    };
    if let Some((key, v)) = found {
        if v.flags & REVNAT_F_COUNTED != 0 {
            lc::socket_released(cookie);
        }
        if v.flags & REVNAT_F_CONNECTED != 0 && protocol == PROTO_UDP as u32 {
            // A closed socket is no longer stale: once none is, the agent detaches the
            // egress program.
            let _ = STALE_SOCKETS.remove(cookie);
            if monitor::on() {
                monitor::sock_flow_end(&key, &v);
            }
        }
    }
    // sock_release programs must return 1.
    1
}
