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

use aya_ebpf::{helpers::bpf_get_socket_cookie, macros::cgroup_skb, programs::SkBuffContext};
use proxy_common::Counter;

use crate::{maps::STALE_SOCKETS, stats::count};

/// Verdict "pass" of a cgroup skb program.
const PASS: i32 = 1;
/// Verdict "drop" (the sending syscall fails with EPERM).
const DROP: i32 = 0;

#[cgroup_skb(egress)]
pub fn sock_egress(ctx: SkBuffContext) -> i32 {
    // SAFETY: helper on our own context; 0 when the packet has no socket.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.skb.skb as *mut _) };
    if cookie != 0 && STALE_SOCKETS.get_ptr(cookie).is_some() {
        count(Counter::DroppedStaleSocket);
        return DROP;
    }
    PASS
}
