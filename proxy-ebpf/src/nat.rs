//! DNAT and SNAT of packet flows to `Scope::Ingress` frontends (node ports, external and LB
//! IPs, cluster IPs routed to the node), for any packet hook.
//!
//! - [`tracked`]: a packet of a flow with a live conntrack entry is rewritten as the entry
//!   says, its TCP state followed, its least-connections count given back when it closes;
//! - [`new_flow`]: a first packet towards a frontend passes the LB IP's source ranges, gets
//!   a backend from `lb::select` (the client is the packet's source), is source-NATed when
//!   [`crate::admit::needs_snat`] says so, and its conntrack entries are written (the reply entry first;
//!   nothing is rewritten when a write fails). Only a packet that can start a flow does:
//!   see [`starts_flow`] for TCP packets in the middle of a flow this table does not know.
//!
//! SNAT: the source becomes the node address of the interface the flow arrived on
//! (`TC_IFACE_ADDRS`), the port the client's own when it is free and not below
//! `SNAT_KEEP_PORT_MIN`, else a random free one of `SNAT_PORT_MIN..+SNAT_PORT_COUNT` (free:
//! no live reply entry holds it; [`SNAT_PORT_TRIES`] tries in all). The source is rewritten at
//! egress, after the kernel routed the DNATed packet: with a node address as source already
//! at ingress, routing would drop it as a martian. Replies of source-NATed flows are sent
//! on from ingress (`Buf::send_out`: a FIB lookup and a redirect) for the same reason.
//!
//! A frontend without any endpoint is rejected ([`Verdict::Reject`], answered by
//! `icmp::reject`). Drops, each counted in `TC_COUNTERS`: `Refusal::NoLocalEndpoints`, a
//! client outside the source ranges of an LB IP, no SNAT address
//! on the interface, no free SNAT port, a conntrack write failure, a lost SNAT binding.

// Map keys and values are passed by reference on purpose: by value, each 40- or 56-byte
// struct would be copied onto the 512-byte BPF stack first.
#![allow(clippy::needless_borrows_for_generic_args)]

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST},
    helpers::bpf_get_prandom_u32,
};
use proxy_common::{
    Algorithm, PROTO_TCP, counts_connections,
    monitor::{
        ALGORITHM_UNKNOWN, EVENT_F_DSR, EVENT_F_SNAT, EVENT_F_TUPLE, EventKind, EventReason,
    },
    nat::{
        CT_F_DSR_DECAP, CT_F_DSR_ENCAP, CT_F_EGRESS, CT_F_POD, CT_F_REPLY, CT_F_SEEN_REPLY,
        CT_F_SNAT, CtEntry, CtKey, IFACE_F_POD, SNAT_KEEP_PORT_MIN, SNAT_PORT_COUNT, SNAT_PORT_MIN,
        SNAT_PORT_TRIES, TC_CFG_DRAIN, TcCounter, ct_alive,
    },
};

use crate::{
    addr::L4Addr,
    admit::{denied_by_source_ranges, needs_snat, other_family, snat_addr_usable},
    csum::{rewrite, rewrite_tracked},
    ct::{
        self, SHARED_FLAGS, alive, is_closed, peer_key, timeout_of, touch_peer, track, track_pair,
    },
    dsr, klog,
    lb::{self, select},
    lc,
    maps::{TC_CONFIG, TC_CONNTRACK, TC_IFACE_ADDRS, TC_SCRATCH},
    mem, monitor,
    packet::{Buf, Pkt, TCP_ACK, TCP_SYN},
    stats::{count_packet, count_service, count_tc, drop_with},
    types::{Lookup, NO_BACKEND, Refusal, Request, Scope},
    verdict::Verdict,
};

/// The packet hooks' answer to a [`Refusal`], as kube-proxy's nftables mode answers it
/// (pkg/proxy/nftables/proxier.go, `syncProxyRules`): a Service without any endpoint is
/// rejected (`goto reject-chain`, whose plain `reject` sends an ICMP / ICMPv6 port
/// unreachable whatever the protocol, TCP included), a `Local` policy without local
/// endpoints while other nodes have some is dropped. [`new_flow`] turns the first into
/// [`Verdict::Reject`].
#[inline(always)]
fn refused(r: Refusal) -> TcCounter {
    match r {
        Refusal::NoLocalEndpoints => TcCounter::DroppedNoLocalEndpoints,
        Refusal::NoEndpoints | Refusal::UndefinedPort => TcCounter::DroppedNoEndpoints,
    }
}

/// A packet of a tracked flow: refreshes its entry (and the other direction's), follows
/// the TCP state, and rewrites the packet. `None` when there is no live entry for it (a new
/// flow, if anything), or when a TCP SYN reopens a closed flow's tuple. Its own BPF function
/// (stack frame).
#[inline(always)]
pub fn tracked<B: Buf>(
    b: &B,
    pkt: &Pkt,
    tcp_flags: u8,
    now: u64,
    ingress: bool,
) -> Option<Verdict> {
    let e = TC_CONNTRACK.get_ptr_mut(&pkt.key)?;
    tracked_as::<B, false>(b, pkt, e, side(tcp_flags, ingress), now)
}

/// [`tracked`] with the packet's entry `e` already looked up (keyed by `pkt.key`), so
/// that a caller that read it first does not hash the key again.
#[inline(always)]
pub fn tracked_at<B: Buf>(
    b: &B,
    pkt: &Pkt,
    e: *mut CtEntry,
    tcp_flags: u8,
    now: u64,
    ingress: bool,
) -> Option<Verdict> {
    tracked_as::<B, false>(b, pkt, e, side(tcp_flags, ingress), now)
}

/// [`tracked`] for the programs on a bypassed workload's interface (`pod_ingress` with
/// `from_pod`, `pod_egress` without): only the flows that workload started ([`CT_F_POD`]),
/// their original direction on the way out of it and their replies on the way in.
#[inline(always)]
pub fn tracked_pod<B: Buf>(
    b: &B,
    pkt: &Pkt,
    tcp_flags: u8,
    now: u64,
    from_pod: bool,
) -> Option<Verdict> {
    let e = TC_CONNTRACK.get_ptr_mut(&pkt.key)?;
    tracked_as::<B, true>(b, pkt, e, side(tcp_flags, from_pod), now)
}

/// The TCP flags (bits 0..8) and the side (bit 8: ingress) in one argument: a BPF
/// function takes at most five.
#[inline(always)]
fn side(tcp_flags: u8, ingress: bool) -> u32 {
    tcp_flags as u32 | (ingress as u32) << 8
}

/// [`tracked`] and [`tracked_pod`] on the entry `e` of `pkt.key`: `POD` says which
/// programs ask; `side` holds the TCP flags and the side ([`side`]). Its own BPF function.
#[inline(never)]
fn tracked_as<B: Buf, const POD: bool>(
    b: &B,
    pkt: &Pkt,
    e: *mut CtEntry,
    side: u32,
    now: u64,
) -> Option<Verdict> {
    let (tcp_flags, ingress) = (side as u8, side & 1 << 8 != 0);
    let proto = pkt.key.proto;
    // SAFETY: a value of the map; concurrent writers only touch the flags/time words.
    let entry = unsafe { *e };
    let live = alive(entry.flags, entry.last_seen_ns, proto, now);
    let reopened = entry.flags & (CT_F_REPLY | CT_F_EGRESS) == 0
        && tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
        && is_closed(entry.flags);
    // The SNAT stage of a flow is for its packets on their way out only. A bypassed
    // workload's flow belongs to the programs of its interface, whatever else its packets
    // cross (a remote backend's replies enter through an external interface first): the
    // original direction leaving the workload, the replies entering it.
    let pod_flow = entry.flags & CT_F_POD != 0;
    let wrong_side = (ingress && entry.flags & CT_F_EGRESS != 0)
        || pod_flow != POD
        || (POD && (entry.flags & CT_F_REPLY != 0) == ingress);
    if !live || reopened || wrong_side {
        return None;
    }
    if ingress
        && entry.flags & (CT_F_SNAT | CT_F_REPLY | CT_F_EGRESS) == CT_F_SNAT
        && !snat_binding_held(&pkt.key, &entry, now)
    {
        return Some(drop_with(TcCounter::SnatBindingLost));
    }
    let mut flags = track(&entry, tcp_flags);
    if entry.flags & CT_F_DSR_ENCAP != 0 {
        // The entry node of a DSR flow never sees a reply: the client acknowledging
        // (TCP), or sending again (UDP), shows the flow is established. The backend's FIN
        // is never seen either: after the client's FIN the flow is half-closed, with the
        // shorter timeout of `ct_timeout_ns`, refreshed by every packet.
        if proto != PROTO_TCP || tcp_flags & TCP_ACK != 0 {
            flags |= CT_F_SEEN_REPLY;
        }
    }
    // The other direction's entry is refreshed when the flow's state bits change, else
    // once a tick: a second lookup only then (liveness allows for the lag, `ct_alive`).
    let tick = ct::tick(now);
    let refresh_peer = (flags ^ entry.flags) & SHARED_FLAGS != 0 || entry.peer_tick != tick;
    // SAFETY: as above; word-sized stores.
    unsafe {
        (*e).last_seen_ns = now;
        (*e).flags = flags;
        if refresh_peer {
            (*e).peer_tick = tick;
        }
    }
    if refresh_peer {
        touch_peer(&entry, proto, flags, now);
    }
    if entry.flags & CT_F_EGRESS == 0 && is_closed(flags) && !is_closed(entry.flags) {
        // The flow closed: its least-connections count, if any, is given back now.
        flow_closed(&pkt.key, &entry);
        if monitor::on() {
            let hook = B::hook(ingress);
            let w = monitor::word(
                EventKind::FlowEnd,
                EventReason::None,
                EVENT_F_TUPLE,
                ALGORITHM_UNKNOWN,
                hook,
            );
            monitor::tuple_event(w, &pkt.key, e);
        }
    }
    count_tc(TcCounter::Translated);
    // The SNAT stage is a second rewrite of a packet already counted at its DNAT.
    if entry.flags & CT_F_EGRESS == 0 {
        count_packet(entry.service_id, b.len());
    }
    if entry.flags & CT_F_DSR_ENCAP != 0 {
        // Sent on encapsulated by a hook that can (tcx), untouched by one that cannot.
        return Some(if B::ENCAPSULATES {
            dsr::encap(b, pkt, &entry)
        } else {
            Verdict::Pass
        });
    }
    let v = rewrite_tracked(b, pkt, &entry);
    if v == Verdict::Pass
        && entry.flags & (CT_F_REPLY | CT_F_DSR_DECAP) == (CT_F_REPLY | CT_F_DSR_DECAP)
        && tcp_flags & TCP_SYN != 0
    {
        dsr::clamp_mss(b, pkt);
    }
    if v == Verdict::Pass
        && ingress
        && entry.flags & (CT_F_REPLY | CT_F_SNAT) == (CT_F_REPLY | CT_F_SNAT)
    {
        return Some(b.send_out(&entry.saddr, &entry.daddr));
    }
    Some(v)
}

/// A tracked flow closed (FIN both ways or RST) as seen through the entry keyed `key`:
/// gives back its least-connections count. The original-direction key is `key` itself for
/// the original entry and the reverse of the rewrite for the reply entry.
#[inline(never)]
fn flow_closed(key: &CtKey, entry: &CtEntry) {
    if entry.flags & CT_F_REPLY != 0 {
        lc::flow_released(&peer_key(entry, key.proto));
    } else {
        lc::flow_released(key);
    }
}

/// For a packet in the original direction of a source-NATed flow (`entry` is its original
/// entry, `key` the packet's tuple): whether the flow still holds its SNAT binding. The SNAT
/// stage is keyed by the original entry's rewritten tuple and names the node address and
/// port; the reply entry keyed (backend -> node address:port) must lead back to this client.
/// - reply entry evicted from the LRU table: written again (only if the port is still free),
///   so a later flow cannot take the port while this one lives;
/// - reply entry of another live flow (the port was taken after an eviction), or SNAT stage
///   evicted: the binding is lost; the flow's entries are removed (and its
///   least-connections count given back) so the client's next packet is that of an unknown
///   flow ([`new_flow`] decides), and this packet is dropped rather than mixed into the
///   other flow.
///
/// Its own BPF function; keys and entries are built in the per-CPU scratch slot (stack).
#[inline(never)]
fn snat_binding_held(key: &CtKey, entry: &CtEntry, now: u64) -> bool {
    let Some(sc) = TC_SCRATCH.get_ptr_mut(0) else {
        return true;
    };
    // SAFETY: this CPU's slot; `new_flow` does not run for a tracked packet. Fields are
    // written in place and map values read through their pointers: this function's frame
    // adds to `tracked`'s and the entry point's within the 512-byte stack.
    let sc = unsafe { &mut *sc };
    mem::copy_addr(&mut sc.ekey.saddr, &entry.saddr);
    mem::copy_addr(&mut sc.ekey.daddr, &entry.daddr);
    sc.ekey.sport = entry.sport;
    sc.ekey.dport = entry.dport;
    mem::set_proto(&mut sc.ekey, key.proto);
    let held = match TC_CONNTRACK.get_ptr(&sc.ekey) {
        None => false,
        Some(eg) => {
            mem::copy_addr(&mut sc.rkey.saddr, &entry.daddr);
            sc.rkey.sport = entry.dport;
            // SAFETY: value of the map, fields copied.
            unsafe {
                mem::copy_addr(&mut sc.rkey.daddr, &(*eg).saddr);
                sc.rkey.dport = (*eg).sport;
            }
            mem::set_proto(&mut sc.rkey, key.proto);
            mem::copy_addr(&mut sc.rev.saddr, &key.daddr);
            mem::copy_addr(&mut sc.rev.daddr, &key.saddr);
            sc.rev.sport = key.dport;
            sc.rev.dport = key.sport;
            sc.rev.flags = CT_F_REPLY | CT_F_SNAT | (entry.flags & SHARED_FLAGS);
            sc.rev._pad = 0;
            sc.rev.service_id = entry.service_id;
            sc.rev.last_seen_ns = now;
            match TC_CONNTRACK.get_ptr(&sc.rkey) {
                // SAFETY: value of the map, read in place.
                Some(r) => unsafe {
                    if (*r).daddr == key.saddr && (*r).dport == key.sport {
                        true
                    } else if !alive((*r).flags, (*r).last_seen_ns, key.proto, now) {
                        // The other flow is dead: the port is free, take it back.
                        TC_CONNTRACK
                            .insert(&sc.rkey, &sc.rev, BPF_ANY as u64)
                            .is_ok()
                    } else {
                        false
                    }
                },
                // Only if still free: a new flow that took it meanwhile keeps it.
                None => TC_CONNTRACK
                    .insert(&sc.rkey, &sc.rev, BPF_NOEXIST as u64)
                    .is_ok(),
            }
        }
    };
    if !held {
        let _ = TC_CONNTRACK.remove(&sc.ekey);
        let _ = TC_CONNTRACK.remove(key);
        lc::flow_released(key);
    }
    held
}

/// A first packet from outside: select, maybe SNAT, track, rewrite. `tcp_flags` are the
/// packet's TCP flags (0 for UDP). Its own BPF function (a stack frame of its own) to stay
/// within the 512-byte stack. The per-service counting is left to [`count_new_flow`],
/// outside this deep frame.
#[inline(never)]
pub fn new_flow<B: Buf>(b: &B, pkt: &Pkt, tcp_flags: u8, now: u64) -> Verdict {
    on_new_flow::<B>(try_new_flow::<B, false>(b, pkt, tcp_flags, now))
}

/// A first packet leaving a workload that bypasses socket-level translation, on its
/// interface (`pod_ingress`): the frontends its sockets would have reached
/// ([`Scope::Node`]: cluster IPs, and external IPs, LB IPs and node ports with the Cluster
/// endpoints, kube-proxy's short-circuit for traffic from inside the cluster), the same
/// selection, affinity, policies and refusals (an undefined port of a cluster IP and no
/// endpoints are rejected, [`Verdict::Reject`], as the socket path refuses them; no local
/// endpoint is dropped). Never source-NATed: the replies come back to the
/// pod through this interface, where `pod_egress` reverses them. Both entries carry
/// [`CT_F_POD`]. Its own BPF function, as [`new_flow`].
#[inline(never)]
pub fn new_pod_flow<B: Buf>(b: &B, pkt: &Pkt, tcp_flags: u8, now: u64) -> Verdict {
    on_new_flow::<B>(try_new_flow::<B, true>(b, pkt, tcp_flags, now))
}

/// The verdict of a new flow, a drop counted by reason.
#[inline(always)]
fn on_new_flow<B: Buf>(r: Result<Verdict, TcCounter>) -> Verdict {
    match r {
        Ok(v) => v,
        Err(c) => {
            if monitor::on() {
                monitor::note_flow_drop(c as u32, B::hook(true));
            }
            klog::flow_drop(c as u32);
            if c == TcCounter::DroppedNoEndpoints {
                // Built and counted by the entry point (`icmp::reject`).
                return Verdict::Reject;
            }
            count_tc(c);
            Verdict::Drop
        }
    }
}

/// Whether a packet to a frontend of a Service using `algorithm`, with no tracked flow,
/// starts one. Always for UDP, which has no opening packet to tell. For TCP, a SYN without
/// ACK opens a connection and starts a flow; any other TCP packet belongs to a connection
/// already under way that this conntrack does not know: one the kernel's conntrack
/// translated before ebpf-proxy started (kube-proxy's rules, which tcx ingress runs before),
/// or one whose entries were lost (LRU eviction, an idle timeout, a flow balanced by
/// another node). Picking a backend for it anew would send it mid-stream to a backend
/// that most likely does not know the connection, which resets it. So:
/// - with a consistent selection ([`consistent`]: source-hash, maglev, destination-hash),
///   picking again gives the backend the flow already has (as long as the backend set is
///   the same), so the flow is started again here and carries on, as Maglev-based balancers keep flows
///   across balancers and lost state; counted as `ReselectedUntracked`;
/// - otherwise the packet is left to the kernel untouched (`PassedUntracked`): its
///   conntrack continues a flow it translated itself, and when it knows none, the node
///   answers as it would without ebpf-proxy (a reset from a node port nothing listens on),
///   so the client learns at once that the connection is gone.
#[inline(always)]
fn starts_flow(proto: u8, tcp_flags: u8, algorithm: u8) -> bool {
    if proto != PROTO_TCP || tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN {
        return true;
    }
    if consistent(algorithm) {
        count_tc(TcCounter::ReselectedUntracked);
        true
    } else {
        count_tc(TcCounter::PassedUntracked);
        false
    }
}

/// Whether `algorithm` (a [`proxy_common::Frontend::algorithm`]) picks the same backend for the same
/// flow every time, on every node, while the backend set stays the same: the Maglev table
/// of the client address (source-hash), address and port (maglev) or frontend address
/// (destination-hash). Random, round-robin and the least-load algorithms do not. ClientIP affinity is not taken into account: it applies
/// first and only repeats an earlier pick.
#[inline(always)]
fn consistent(algorithm: u8) -> bool {
    algorithm == Algorithm::SourceHash as u8
        || algorithm == Algorithm::Maglev as u8
        || algorithm == Algorithm::DestinationHash as u8
}

/// A drop is `Err` with the counter of its reason (counted by [`new_flow`]).
/// `POD`: a flow of a bypassed workload ([`new_pod_flow`]).
// Longer than 120 lines on purpose: moving its SNAT part into inlined helpers made
// `new_flow` 10% larger (LLVM lays the one BPF frame out differently).
#[inline(always)]
fn try_new_flow<B: Buf, const POD: bool>(
    b: &B,
    pkt: &Pkt,
    tcp_flags: u8,
    now: u64,
) -> Result<Verdict, TcCounter> {
    let k = &pkt.key;
    let ifindex = b.ifindex();
    if TC_CONFIG
        .get(0)
        .is_some_and(|c| c.flags & TC_CFG_DRAIN != 0)
    {
        return Ok(Verdict::Pass); // `ebpf-proxy cleanup` is draining: no new flow
    }
    if !POD {
        // SAFETY: value of the map, one word read.
        let iface_flags = TC_IFACE_ADDRS
            .get_ptr(ifindex)
            .map(|p| unsafe { (*p).flags })
            .unwrap_or(0);
        if iface_flags & IFACE_F_POD != 0 {
            return Ok(Verdict::Pass); // pods start flows at the socket, not here
        }
    }
    // The request, and below the entries, live in a per-CPU scratch slot, not on the
    // 512-byte stack.
    let Some(sc) = TC_SCRATCH.get_ptr_mut(0) else {
        return Ok(Verdict::Drop);
    };
    // SAFETY: this CPU's slot, used only while this program runs.
    let sc = unsafe { &mut *sc };
    sc.req = Request {
        frontend: L4Addr::new(k.daddr, k.dport, k.proto),
        client: L4Addr::new(k.saddr, k.sport, k.proto),
    };
    let scope = if POD { Scope::Node } else { Scope::Ingress };
    let (fe, cluster_ip) = match lb::lookup(&sc.req.frontend, scope) {
        Lookup::Frontend { fe, cluster_ip } => (fe, cluster_ip),
        // An undefined port of a cluster IP, refused at the socket, is dropped here.
        Lookup::Refused(r) if POD => return Err(refused(r)),
        // Undefined ports of cluster IPs reached from outside are left alone.
        Lookup::NotService | Lookup::Refused(_) => return Ok(Verdict::Pass),
    };
    sc.mon_sid = fe.service_id;
    if !starts_flow(k.proto, tcp_flags, fe.algorithm) {
        return Ok(Verdict::Pass);
    }
    if denied_by_source_ranges(&k.daddr, &k.saddr) {
        return Err(TcCounter::SourceRangeDenied);
    }
    let mut bk = NO_BACKEND;
    let id = select(&fe, &sc.req, &mut bk);
    // Counted by the caller (see `count_new_flow`).
    sc.count_sid = fe.service_id;
    sc.count_bid = id;
    sc.count_refused = (id == 0) as u32;
    if id == 0 {
        return Err(refused(Refusal::no_backend(&fe)));
    }
    // A backend of the other family (the model never pairs them; a packet cannot change
    // family here).
    if other_family(&bk.addr, pkt.v6) {
        return Err(TcCounter::RewriteFailed);
    }
    let snat = !POD && needs_snat(&fe, &bk.addr, &k.saddr, cluster_ip);
    if snat && dsr::applies(&fe, &bk.addr, cluster_ip) {
        sc.fwd.daddr = bk.addr;
        sc.fwd.dport = bk.port;
        if let Some(c) = dsr_flow(b, pkt, fe.service_id, fe.algorithm, now) {
            return Err(c);
        }
        return Ok(if B::ENCAPSULATES {
            dsr::encap(b, pkt, &sc.fwd)
        } else {
            Verdict::Pass
        });
    }
    let pod_flag = if POD { CT_F_POD } else { 0 };
    sc.fwd = CtEntry {
        saddr: k.saddr,
        daddr: bk.addr,
        sport: k.sport,
        dport: bk.port,
        flags: pod_flag,
        _pad: 0,
        service_id: fe.service_id,
        peer_tick: 0,
        last_seen_ns: now,
    };
    sc.rev = CtEntry {
        saddr: k.daddr,
        daddr: k.saddr,
        sport: k.dport,
        dport: k.sport,
        flags: CT_F_REPLY | pod_flag,
        _pad: 0,
        service_id: fe.service_id,
        peer_tick: 0,
        last_seen_ns: now,
    };
    if snat {
        let Some(node) = TC_IFACE_ADDRS.get_ptr(ifindex) else {
            return Err(TcCounter::NoSnatAddress);
        };
        // SAFETY: value of the map, read in place.
        let node = unsafe { if pkt.v6 { &(*node).v6 } else { &(*node).v4 } };
        if !snat_addr_usable(node, pkt.v6) {
            return Err(TcCounter::NoSnatAddress);
        }
        sc.fwd.flags = CT_F_SNAT;
        sc.rev.flags = CT_F_REPLY | CT_F_SNAT;
        sc.rkey = CtKey {
            saddr: bk.addr,
            daddr: *node,
            sport: bk.port,
            dport: [0; 2],
            proto: k.proto,
            _pad: [0; 3],
        };
        let mut bound = false;
        let client_port = u16::from_be_bytes(k.sport);
        for i in 0..SNAT_PORT_TRIES {
            // The client's own port first, as netfilter's masquerade keeps it when free: a
            // client does not reuse its port towards this frontend while its side of an
            // earlier connection is in TIME-WAIT, which outlasts the closed flow's entries
            // here. Then random ones.
            let port = if i == 0 && client_port >= SNAT_KEEP_PORT_MIN {
                client_port
            } else {
                // SAFETY: helper without side effects.
                let r = unsafe { bpf_get_prandom_u32() } % SNAT_PORT_COUNT as u32;
                SNAT_PORT_MIN + r as u16
            };
            sc.rkey.dport = port.to_be_bytes();
            // A port is free when no live reply entry holds it; a dead one is replaced, and
            // so is one that leads back to this very client address and port: the flow
            // this packet starts supersedes that one (a SYN reopening a closed tuple).
            let flag = match TC_CONNTRACK.get_ptr(sc.rkey) {
                // SAFETY: value of the map, read field by field.
                Some(old) => {
                    let (seen, flags) = unsafe { ((*old).last_seen_ns, (*old).flags) };
                    // SAFETY: as above.
                    let same = unsafe { (*old).daddr == k.saddr && (*old).dport == k.sport };
                    if !same && ct_alive(now, seen, timeout_of(flags, k.proto)) {
                        continue;
                    }
                    BPF_ANY
                }
                None => BPF_NOEXIST,
            };
            if TC_CONNTRACK.insert(&sc.rkey, &sc.rev, flag as u64).is_ok() {
                bound = true;
                break;
            }
        }
        if !bound {
            return Err(TcCounter::SnatPortsExhausted);
        }
        // The SNAT stage, applied at egress (see the module documentation).
        sc.ekey = CtKey {
            saddr: k.saddr,
            daddr: bk.addr,
            sport: k.sport,
            dport: bk.port,
            proto: k.proto,
            _pad: [0; 3],
        };
        sc.eg = CtEntry {
            saddr: *node,
            sport: sc.rkey.dport,
            flags: CT_F_SNAT | CT_F_EGRESS,
            ..sc.fwd
        };
        if TC_CONNTRACK
            .insert(&sc.ekey, &sc.eg, BPF_ANY as u64)
            .is_err()
        {
            let _ = TC_CONNTRACK.remove(&sc.rkey);
            return Err(TcCounter::ConntrackFull);
        }
        if TC_CONNTRACK
            .insert(&pkt.key, &sc.fwd, BPF_ANY as u64)
            .is_err()
        {
            let _ = TC_CONNTRACK.remove(&sc.rkey);
            let _ = TC_CONNTRACK.remove(&sc.ekey);
            return Err(TcCounter::ConntrackFull);
        }
        count_tc(TcCounter::Snat);
    } else {
        track_pair(&pkt.key, sc)?;
    }
    count_tc(TcCounter::NewFlow);
    sc.count_lc = counts_connections(fe.algorithm) as u32;
    if monitor::on() {
        let flags = if snat { EVENT_F_SNAT } else { 0 };
        sc.mon = monitor::word(
            EventKind::FlowNew,
            EventReason::None,
            flags,
            fe.algorithm,
            B::hook(true),
        );
        sc.mon_bid = id;
    }
    klog::flow_new(&pkt.key, &bk.addr, bk.port, fe.service_id, snat);
    Ok(rewrite(b, pkt, &sc.fwd))
}

/// A new flow of Service port `service_id` (its frontend's `algorithm`) to the backend in
/// the scratch slot's `fwd.daddr` / `fwd.dport` (on another node; its id in `count_bid`),
/// sent by direct server return ([`dsr::applies`]): one entry in `fwd`, keyed by the
/// client's packet, whose addresses are the outer header's (this node's address on the
/// interface, the backend). The caller then sends the packet out encapsulated
/// (`dsr::encap`), or untouched from a hook that does not encapsulate (XDP: tcx ingress
/// finds the entry). `Some` is the counter of a drop. Its own BPF function (stack).
#[inline(never)]
fn dsr_flow<B: Buf>(
    b: &B,
    pkt: &Pkt,
    service_id: u32,
    algorithm: u8,
    now: u64,
) -> Option<TcCounter> {
    let sc = TC_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot, used only while this program runs.
    let sc = unsafe { &mut *sc };
    let Some(node) = TC_IFACE_ADDRS.get_ptr(b.ifindex()) else {
        return Some(TcCounter::NoSnatAddress);
    };
    // SAFETY: value of the map, read in place.
    let node = unsafe { if pkt.v6 { &(*node).v6 } else { &(*node).v4 } };
    if !snat_addr_usable(node, pkt.v6) {
        return Some(TcCounter::NoSnatAddress);
    }
    // The source port stays zero: the entry's reversed tuple (`ct::peer_key`) must not name
    // another flow's entry, and nothing is rewritten by it.
    sc.fwd.saddr = *node;
    sc.fwd.sport = [0; 2];
    sc.fwd.flags = CT_F_DSR_ENCAP;
    sc.fwd._pad = 0;
    sc.fwd.service_id = service_id;
    sc.fwd.last_seen_ns = now;
    if TC_CONNTRACK
        .insert(&pkt.key, &sc.fwd, BPF_ANY as u64)
        .is_err()
    {
        return Some(TcCounter::ConntrackFull);
    }
    count_tc(TcCounter::NewFlow);
    sc.count_lc = counts_connections(algorithm) as u32;
    if monitor::on() {
        sc.mon = monitor::word(
            EventKind::FlowNew,
            EventReason::None,
            EVENT_F_DSR,
            algorithm,
            B::hook(true),
        );
        sc.mon_bid = sc.count_bid;
    }
    klog::flow_new(&pkt.key, &sc.fwd.daddr, sc.fwd.dport, service_id, false);
    None
}

/// The counting of a new flow [`new_flow`] decided on (per service and backend, and its
/// least-connections record), done by the entry point outside `new_flow`'s deep frame.
#[inline(always)]
pub fn count_new_flow(pkt: &Pkt) {
    let Some(sc) = TC_SCRATCH.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's slot, used only while this program runs.
    let sc = unsafe { &mut *sc };
    if sc.mon != 0 {
        let w = sc.mon;
        sc.mon = 0;
        monitor::flow_event(w, sc);
    }
    if sc.count_sid == 0 {
        return;
    }
    count_service(sc.count_sid, sc.count_bid, sc.count_refused);
    // A new flow on this tuple: an earlier flow's count is given back, and this one is
    // counted when its Service uses a least-load algorithm.
    lc::flow_started(&pkt.key, if sc.count_lc != 0 { sc.count_bid } else { 0 });
    sc.count_sid = 0;
    sc.count_lc = 0;
}

/// Whether the original entry of the flow keyed `key` is alive and open, as the
/// least-connections collection checks before it gives a count back.
#[inline(always)]
pub fn flow_open(key: &CtKey, now: u64) -> bool {
    match TC_CONNTRACK.get_ptr(key) {
        // SAFETY: value of the map, read field by field.
        Some(e) => unsafe {
            let (seen, flags) = ((*e).last_seen_ns, (*e).flags);
            alive(flags, seen, key.proto, now) && !is_closed(flags)
        },
        None => false,
    }
}
