//! `recvmsg4/6` and `getpeername4/6`: the peer a socket reached through a VIP is shown as
//! the VIP again, from the socket's reverse-NAT entries.

use aya_ebpf::{
    EbpfContext, helpers::bpf_ktime_get_ns, macros::cgroup_sock_addr, programs::SockAddrContext,
};
use proxy_common::{Counter, REVNAT_F_CONNECTED, RevNatKey, SPILLED_LEGACY, UdpFlowKey};

use super::{
    hook::{ALLOW, cookie, read_addr, write_addr},
    revnat::{connected_entry, hint},
};
use crate::{
    maps::{REVNAT_SK, UDP_FLOWS},
    monitor,
    stats::count,
};

#[cgroup_sock_addr(recvmsg4)]
pub fn recvmsg4(ctx: SockAddrContext) -> i32 {
    on_reverse::<false, true>(&ctx)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn recvmsg6(ctx: SockAddrContext) -> i32 {
    on_reverse::<true, true>(&ctx)
}

#[cgroup_sock_addr(getpeername4)]
pub fn getpeername4(ctx: SockAddrContext) -> i32 {
    on_reverse::<false, false>(&ctx)
}

#[cgroup_sock_addr(getpeername6)]
pub fn getpeername6(ctx: SockAddrContext) -> i32 {
    on_reverse::<true, false>(&ctx)
}

/// recvmsg (`RECV` = true) and getpeername: show the VIP instead of the backend.
#[inline(always)]
fn on_reverse<const V6: bool, const RECV: bool>(ctx: &SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    let (addr, port) = read_addr::<V6>(sa);
    let cookie = cookie(ctx);
    let key = RevNatKey {
        cookie,
        addr,
        port,
        _pad: [0; 6],
    };
    // `REVNAT_SK`'s entries by connect()ed kind: sendmsg's, or an earlier version's
    // connected ones.
    let revnat = |connected: bool| {
        // SAFETY: copied out at once.
        unsafe { REVNAT_SK.get(key).copied() }
            .filter(|v| (v.flags & REVNAT_F_CONNECTED != 0) == connected)
    };
    let legacy = || hint(SPILLED_LEGACY).then(|| revnat(true)).flatten();
    // A datagram received: the socket's latest datagram with an address to that peer
    // decides, and `sendmsg` writes only `REVNAT_SK` (a UDP socket may send to another VIP
    // than the one it connected to, or send after `connect(AF_UNSPEC)`). `getpeername`:
    // the connected peer.
    let found = if RECV {
        revnat(false)
            .or_else(|| connected_entry(cookie, &addr, port))
            .or_else(legacy)
    } else {
        connected_entry(cookie, &addr, port).or_else(legacy)
    };
    let Some(v) = found else {
        return ALLOW;
    };
    if write_addr::<V6>(sa, &v.addr, v.port) {
        count(Counter::ReverseTranslated);
        if monitor::on() {
            monitor::reverse_event(ctx.as_ptr(), RECV, &key, &v);
        }
    }
    if RECV {
        // A reply keeps the UDP flow active, as it refreshes a conntrack entry.
        let fkey = UdpFlowKey {
            cookie,
            addr: v.addr,
            port: v.port,
            _pad: [0; 6],
        };
        if let Some(f) = UDP_FLOWS.get_ptr_mut(fkey) {
            // SAFETY: in-place timestamp refresh; a torn read elsewhere only shifts expiry.
            unsafe { (*f).last_seen_ns = bpf_ktime_get_ns() };
        }
    }
    // recvmsg and getpeername programs must return 1.
    ALLOW
}
