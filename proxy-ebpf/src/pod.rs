//! tcx entry points on the node side of a bypassed workload's interface (the host end of
//! its veth): per-packet Service translation for workloads that bypass socket-level
//! translation (see `proxy_common::bypass`), as Cilium's per-endpoint programs do.
//!
//! - `pod_ingress` (tcx ingress of the host-side interface: packets leaving the workload):
//!   packets of the workload's tracked flows are rewritten (client -> frontend becomes
//!   client -> backend); a first packet to a frontend starts a flow (`nat::new_pod_flow`:
//!   the frontends and rules of the socket path, no SNAT); anything else passes. A first
//!   packet to a frontend without any endpoint (or to an undefined port of a cluster IP) is
//!   answered with an ICMP / ICMPv6 port unreachable, as kube-proxy's nftables mode rejects
//!   it and as the socket path refuses the `connect()`: `tc_reject` (a tail call through
//!   `TC_TAILS`, the same program as the node's interfaces) builds it in place and sends it
//!   out of this interface's egress, that is into the workload, whose socket then fails
//!   with `ECONNREFUSED` (TCP) or gets the error on its next receive (connected UDP).
//! - `pod_egress` (tcx egress: packets entering the workload): replies of its flows
//!   (backend -> client) become frontend -> client, whichever way they came (a local
//!   backend on the same bridge, or routed from another node).
//! - ICMP and ICMPv6 errors entering the workload that quote a translated packet: `icmp`.
//!
//! The agent attaches these programs to bypassed workloads' interfaces only, so the
//! packets of other pods pay nothing. Conntrack, selection and rewriting are the shared
//! modules' (`nat`, `ct`, `lb`, `csum`, `icmp`); this file maps their [`Verdict`] to tc's
//! return codes.

use aya_ebpf::{macros::classifier, programs::TcContext};
use proxy_common::nat::{TAIL_REJECT, TcCounter};

use crate::{
    ct,
    icmp::{on_icmp, on_icmp6},
    maps::TC_TAILS,
    nat::{count_new_flow, new_pod_flow, tracked_pod},
    packet::{Kind, Pkt, parse, tcp_flags},
    stats::drop_with,
    verdict::Verdict,
};

#[classifier]
pub fn pod_ingress(ctx: TcContext) -> i32 {
    on_packet::<true>(&ctx).tc()
}

#[classifier]
pub fn pod_egress(ctx: TcContext) -> i32 {
    on_packet::<false>(&ctx).tc()
}

/// `FROM_POD`: the packet leaves the workload (ingress of the host-side interface).
#[inline(always)]
fn on_packet<const FROM_POD: bool>(ctx: &TcContext) -> Verdict {
    let mut slot = core::mem::MaybeUninit::uninit();
    let pkt = Pkt::init(&mut slot);
    match parse(ctx, pkt) {
        Kind::Flow => {}
        // Errors about the workload's flows are translated on the way in (a port
        // unreachable from a backend reaches the socket as from the frontend); errors it
        // sends pass, as the north-south programs leave them to their own hooks.
        Kind::Icmp if !FROM_POD => return on_icmp(ctx, pkt, false),
        Kind::Icmp6 if !FROM_POD => return on_icmp6(ctx, pkt, false),
        Kind::Icmp | Kind::Icmp6 | Kind::Encap | Kind::Other => return Verdict::Pass,
    }
    let flags = tcp_flags(ctx, pkt);
    let now = ct::now();
    if let Some(v) = tracked_pod(ctx, pkt, flags, now, FROM_POD) {
        return v;
    }
    if !FROM_POD {
        return Verdict::Pass;
    }
    let v = new_pod_flow(ctx, pkt, flags, now);
    count_new_flow(pkt);
    if v == Verdict::Reject {
        // SAFETY: a tail call with our own context; it returns only when it fails (no
        // `tc_reject` in this load's table), and the packet is then dropped, counted.
        unsafe { TC_TAILS.tail_call(ctx, TAIL_REJECT) };
        return drop_with(TcCounter::DroppedNoEndpoints);
    }
    v
}
