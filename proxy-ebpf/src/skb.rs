//! cgroup `skb` egress entry point: fails the sends of connected UDP sockets whose endpoint
//! left their service.
//!
//! A connected UDP socket was translated once, by `connect()`; its later sends carry no
//! address and pass no `sendmsg` hook, so when its endpoint goes away nothing would redirect
//! it. kube-proxy clears such flows from conntrack so the next packet is balanced anew; at
//! the socket level the agent lists these sockets in `STALE_SOCKETS` (found through their
//! reverse-NAT entries) and this program drops their packets, so `send()` fails with EPERM
//! until the application connects the socket again (`connect4/6` then pick a live endpoint
//! and clear the entry). TCP sockets are never listed: kube-proxy lets established
//! connections to a removed endpoint end on their own.
//!
//! The agent attaches this program only while `STALE_SOCKETS` has entries, and detaches it
//! once none is left (the sockets reconnected or were closed: `sock_release` removes a
//! closed socket's entry), so the packets of a node without stale sockets pay nothing here.

use aya_ebpf::{helpers::bpf_get_socket_cookie, macros::cgroup_skb, programs::SkBuffContext};
use proxy_common::{Counter, PROTO_TCP};

use crate::{maps::STALE_SOCKETS, monitor, stats::count};

/// Verdict "pass" of a cgroup skb program.
const PASS: i32 = 1;
/// Verdict "drop" (the sending syscall fails with EPERM).
const DROP: i32 = 0;

/// `ETH_P_IP` / `ETH_P_IPV6` as `__sk_buff.protocol` holds them (network byte order).
const ETH_P_IP_BE: u32 = 0x0800u16.to_be() as u32;
const ETH_P_IPV6_BE: u32 = 0x86DDu16.to_be() as u32;

#[cgroup_skb(egress)]
pub fn sock_egress(ctx: SkBuffContext) -> i32 {
    // This runs for every packet of every socket of the cgroup; only connected UDP sockets
    // are ever listed, so a TCP packet leaves at once, before the cookie and the map lookup.
    // The data starts at the IP header here; its protocol byte (IPv4) or next header
    // (IPv6; a UDP packet behind extension headers is still checked).
    let proto_off = match ctx.skb.protocol() {
        ETH_P_IP_BE => 9,
        ETH_P_IPV6_BE => 6,
        _ => return PASS,
    };
    if ctx.load::<u8>(proto_off).is_ok_and(|p| p == PROTO_TCP) {
        return PASS;
    }
    // SAFETY: helper on our own context; 0 when the packet has no socket.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.skb.skb as *mut _) };
    if cookie != 0
        && let Some(sid) = STALE_SOCKETS.get_ptr(cookie)
    {
        count(Counter::DroppedStaleSocket);
        if monitor::on() {
            // SAFETY: a value of the map, one word read.
            monitor::stale_event(ctx.skb.skb, cookie, unsafe { *sid });
        }
        return DROP;
    }
    PASS
}
