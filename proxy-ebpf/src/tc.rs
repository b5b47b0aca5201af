//! tcx entry points on the node's interfaces: NodePorts, external IPs and load balancer IPs
//! (and cluster IPs routed to the node) for traffic that enters the node from outside, IPv4
//! and IPv6 alike (same maps, same conntrack, same rules).
//!
//! Where what happens (one-NIC node: the external interface also leads to the other nodes):
//! - `tc_ingress` (tcx ingress of each external interface): packets of tracked flows are
//!   rewritten (client -> frontend becomes client or node address -> backend; replies of
//!   source-NATed flows, backend -> node address, become frontend -> client and are sent on
//!   directly); a new packet to an ingress frontend starts a flow (`nat::new_flow`); the
//!   kernel then routes the rewritten packet (`net.ipv4.ip_forward` must be 1, as for
//!   kube-proxy). A TCP packet in the middle of a connection this conntrack does not know
//!   (one kube-proxy's rules translated before ebpf-proxy started) starts no flow unless
//!   the Service's selection is consistent: it goes to the kernel untouched, whose
//!   conntrack carries the connection on (`nat::starts_flow`). A new packet to a frontend
//!   without any endpoint is answered with an ICMP / ICMPv6 port unreachable, sent back
//!   out of the interface it came in on (`tc_reject`, a tail call).
//! - `tc_reject`: reached only by the tail calls of `tc_ingress` and of `pod_ingress` (the
//!   agent fills `TC_TAILS` of each load).
//! - `tc_egress` (tcx egress of each external interface): the SNAT stage of source-NATed
//!   flows, and replies of flows that were not source-NATed (backend on this node), which
//!   become frontend -> client. No flow starts here.
//! - ICMP and ICMPv6 errors quoting a translated packet, on both hooks: `icmp`.
//! - `tc_clock_probe`: never attached; the agent runs it through `BPF_PROG_TEST_RUN` to
//!   calibrate the conntrack clock (`ct::now`).
//! - `tc_lc_gc`: never attached; the agent runs it through `BPF_PROG_TEST_RUN` to give back
//!   least-connections counts of flows that ended silently.
//!
//! The logic lives in the shared modules (`packet`, `nat`, `ct`, `csum`, `icmp`, `lb`,
//! `lc`); this file maps their [`Verdict`] to tc's return codes.

use aya_ebpf::{
    helpers::{bpf_jiffies64, bpf_ktime_get_ns},
    macros::classifier,
    programs::TcContext,
};
use proxy_common::nat::{CtKey, TAIL_REJECT, TcCounter};

use crate::{
    ct, dsr,
    icmp::{on_icmp, on_icmp6, reject},
    lc,
    maps::{TC_SCRATCH, TC_TAILS},
    nat::{count_new_flow, flow_open, new_flow, tracked},
    packet::{ETH_HLEN, Kind, Pkt, parse, tcp_flags},
    stats::drop_with,
    verdict::Verdict,
};

#[classifier]
pub fn tc_ingress(ctx: TcContext) -> i32 {
    on_packet::<true>(&ctx).tc()
}

#[classifier]
pub fn tc_egress(ctx: TcContext) -> i32 {
    on_packet::<false>(&ctx).tc()
}

#[inline(always)]
fn on_packet<const INGRESS: bool>(ctx: &TcContext) -> Verdict {
    // One `Pkt` for both families, in this frame (stack).
    let mut slot = core::mem::MaybeUninit::uninit();
    let pkt = Pkt::init(&mut slot);
    let now = ct::now();
    // A direct server return packet, decapsulated: its flow starts here if it is new.
    let mut decapsulated = false;
    match parse(ctx, pkt) {
        Kind::Flow => {}
        Kind::Icmp => return on_icmp(ctx, pkt, INGRESS),
        Kind::Icmp6 => return on_icmp6(ctx, pkt, INGRESS),
        Kind::Encap if INGRESS => {
            if let Some(v) = dsr::decap(ctx, pkt) {
                return v;
            }
            decapsulated = true;
        }
        Kind::Encap | Kind::Other => return Verdict::Pass,
    }
    let flags = tcp_flags(ctx, pkt);
    if let Some(v) = tracked(ctx, pkt, flags, now, INGRESS) {
        if v == Verdict::Reject {
            // A DSR packet too big once encapsulated: `tc_reject` answers it.
            // SAFETY: a tail call with our own context; it returns only when it fails.
            unsafe { TC_TAILS.tail_call(ctx, TAIL_REJECT) };
            clear_reject_mtu();
            return Verdict::Drop;
        }
        return v;
    }
    if !INGRESS {
        return Verdict::Pass;
    }
    if decapsulated {
        return dsr::accept(ctx, pkt, now);
    }
    let v = new_flow(ctx, pkt, flags, now);
    count_new_flow(pkt);
    if v == Verdict::Reject {
        // SAFETY: a tail call with our own context; it returns only when it fails.
        unsafe { TC_TAILS.tail_call(ctx, TAIL_REJECT) };
        clear_reject_mtu();
        return drop_with(TcCounter::DroppedNoEndpoints);
    }
    v
}

/// Forgets a "fragmentation needed" answer that was not sent, so that the next reject is a
/// port unreachable.
#[inline(always)]
fn clear_reject_mtu() {
    if let Some(sc) = TC_SCRATCH.get_ptr_mut(0) {
        // SAFETY: this CPU's slot.
        unsafe { (*sc).reject_mtu = 0 };
    }
}

/// Answers a packet of a new flow to a frontend without endpoints (`tc_ingress` or
/// `pod_ingress` decided so, see `nat::new_flow` and `nat::new_pod_flow`) with an ICMP /
/// ICMPv6 port unreachable (`icmp::reject`), or a direct server return packet too big once
/// encapsulated with a "fragmentation needed" / "packet too big" (`dsr::encap` left the MTU
/// in the scratch slot's `reject_mtu`), sent out of the egress of the interface the
/// packet came in on: back to the client on a node interface, into the workload on a
/// bypassed pod's. Reached only by those tail calls through `TC_TAILS` (slot
/// `TAIL_REJECT`), so its instructions are verified once, apart from the callers' paths.
#[classifier]
pub fn tc_reject(ctx: TcContext) -> i32 {
    // What to answer: a port unreachable, or the MTU a DSR packet must fit.
    let mtu = match TC_SCRATCH.get_ptr_mut(0) {
        // SAFETY: this CPU's slot, written by the caller before its tail call.
        Some(sc) => unsafe { core::mem::replace(&mut (*sc).reject_mtu, 0) },
        None => 0,
    };
    let mut slot = core::mem::MaybeUninit::uninit();
    let pkt = Pkt::init(&mut slot);
    if parse(&ctx, pkt) != Kind::Flow {
        return drop_with(TcCounter::DroppedNoEndpoints).tc();
    }
    reject(&ctx, pkt, mtu).tc()
}

/// Least-connections collection, run by the agent through `BPF_PROG_TEST_RUN` (never
/// attached) for each `TC_LC_FLOWS` key whose flow looks dead from userspace. The packet is
/// 14 bytes of (ignored) Ethernet header followed by the 40-byte [`CtKey`]. Checked again
/// here, atomically with the release: a flow whose original entry is alive and open is kept
/// (returns 0); otherwise its count is given back (returns 1; 2 when someone else already
/// released it).
#[classifier]
pub fn tc_lc_gc(ctx: TcContext) -> i32 {
    let Ok(key) = ctx.load::<CtKey>(ETH_HLEN) else {
        return 2;
    };
    let now = ct::now();
    if flow_open(&key, now) {
        return 0;
    }
    if lc::flow_released(&key) { 1 } else { 2 }
}

/// The conntrack clock's calibration (`proxy_common::nat::CtClock`), run by the agent
/// through `BPF_PROG_TEST_RUN` (never attached): writes `jiffies` then `CLOCK_MONOTONIC`
/// in nanoseconds, two native-endian u64, at bytes 14..30 of the packet (after 14 bytes
/// standing for an Ethernet header). Returns 0, or 1 when the packet is too short.
#[classifier]
pub fn tc_clock_probe(ctx: TcContext) -> i32 {
    // SAFETY: helpers without arguments or side effects. Jiffies first: the time read
    // after them is at or past their last tick.
    let now = unsafe { [bpf_jiffies64(), bpf_ktime_get_ns()] };
    match ctx.store(ETH_HLEN, &now, 0) {
        Ok(()) => 0,
        Err(_) => 1,
    }
}
