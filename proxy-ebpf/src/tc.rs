//! tcx entry points on the node's external interfaces: NodePorts, external IPs and load
//! balancer IPs for traffic that enters the node from outside (issue 4), IPv4 and IPv6
//! alike (same maps, same conntrack, same rules; see "IPv6" below).
//!
//! Where what happens (one-NIC node: the external interface also leads to the other nodes):
//! - `tc_ingress` (tcx ingress of each external interface):
//!   - a packet of a tracked flow is rewritten as its conntrack entry says: client ->
//!     frontend becomes (client or node address) -> backend; the replies of source-NATed
//!     flows (backend on another node -> node address) become frontend -> client;
//!   - a new packet to a `SCOPE_INGRESS` frontend (node IP:NodePort, external IP, LB IP)
//!     passes `spec.loadBalancerSourceRanges`, gets a backend from `lb::select` (the client
//!     is the packet's source), is source-NATed to the interface's node address when the
//!     policy is Cluster and the backend is not on this node (or always with
//!     `--masquerade-all`), and two conntrack entries are written (reply first; nothing is
//!     rewritten when a write fails);
//!   - the kernel then routes the rewritten packet (`net.ipv4.ip_forward` must be 1, as for
//!     kube-proxy).
//! - `tc_egress` (tcx egress of each external interface): replies of flows that were not
//!   source-NATed (backend on this node) leave through here with the backend as source and
//!   become frontend -> client.
//! - ICMP errors (destination unreachable, including fragmentation needed, and time
//!   exceeded) quoting a translated packet are translated like the reply they stand for: the
//!   outer destination, the quoted header, and the outer source when it is the backend.
//!
//! Drops (each counted in `TC_COUNTERS`): Local policy without a local endpoint (kube-proxy
//! drops, KEP-1672 `externalTrafficPolicy`), a frontend without endpoints (kube-proxy
//! rejects; a tc program cannot answer cheaply, so it drops), a client outside the source
//! ranges of an LB IP, no free SNAT port, a conntrack write failure.
//!
//! IPv6 (ethertype 0x86DD): the same, with 16-byte addresses. There is no IPv6 header
//! checksum; the TCP/UDP checksum covers a pseudo-header with both addresses (RFC 8200
//! section 8.1), so an address rewrite feeds `bpf_csum_diff` of the 16-byte addresses to
//! `bpf_l4_csum_replace` (size 0: the difference form) with `BPF_F_PSEUDO_HDR` and
//! `BPF_F_IPV6` (see the kernel's `bpf_l4_csum_replace` documentation). A computed UDP
//! checksum of zero becomes 0xffff (`BPF_F_MARK_MANGLED_0`, as RFC 8200 wants; a zero UDP
//! checksum is invalid in IPv6 and the receiver drops it anyway). ICMPv6 errors quoting a
//! translated packet (RFC 4443: destination unreachable, packet too big, which path-MTU
//! discovery depends on since IPv6 routers never fragment, and time exceeded) are
//! translated as the IPv4 ones; the ICMPv6 checksum also covers a pseudo-header (unlike
//! ICMPv4), so outer address changes update it too. Replies sent on from ingress use
//! `bpf_fib_lookup` with AF_INET6 (`net.ipv6.conf.all.forwarding` must be 1). Everything else
//! passes untouched: neighbour discovery and other ICMPv6, link-local traffic, anything not
//! addressed to a frontend or a tracked tuple.
//!
//! Not handled: IPv4 fragments after the first (no ports: they pass untranslated), IP
//! options are supported (the header length is read), SCTP. IPv6 packets with extension
//! headers (hop-by-hop, routing, fragment, destination options, ...: any next header other
//! than TCP, UDP or ICMPv6 right after the fixed header) pass untranslated, as do IPv6
//! packets with an IPv4-mapped source or destination (not valid on the wire, RFC 4291
//! section 2.5.5.2).

// Map keys and values are passed by reference on purpose: by value, each 40- or 56-byte
// struct would be copied onto the 512-byte BPF stack first.
#![allow(clippy::needless_borrows_for_generic_args)]

use aya_ebpf::{
    bindings::bpf_fib_lookup,
    bindings::{BPF_ANY, BPF_NOEXIST, TC_ACT_SHOT},
    btf_maps::lpm_trie::Key,
    helpers::{
        bpf_csum_diff, bpf_fib_lookup, bpf_get_prandom_u32, bpf_ktime_get_ns, bpf_redirect,
        bpf_redirect_neigh, bpf_skb_load_bytes,
    },
    macros::classifier,
    programs::TcContext,
};
use proxy_common::{
    Algorithm, FRONTEND_F_EXTERNAL, FRONTEND_F_LOCAL_ONLY, FRONTEND_F_VIP_MARKER, Frontend, FrontendKey,
    PROTO_TCP, PROTO_UDP, SCOPE_INGRESS, SCOPE_NODE,
    nat::{
        CT_F_EGRESS, CT_F_FIN_ORIG, CT_F_FIN_REPLY, CT_F_REPLY, CT_F_RST, CT_F_SEEN_REPLY,
        CT_F_SNAT, CtEntry, CtKey, ct_closed, ct_timeout_ns,
        IFACE_F_POD, SNAT_PORT_COUNT, SNAT_PORT_MIN, SNAT_PORT_TRIES, SOURCE_RANGE_RESTRICTED,
        SourceRange, TC_CFG_CLUSTER_CIDR_V4, TC_CFG_CLUSTER_CIDR_V6, TC_CFG_MASQUERADE_ALL,
        TcCounter,
    },
    is_v4_mapped, v4_mapped,
};

use crate::{
    lb::{
        Client, Request, backend, count_packet, count_service, lc_acquire, lc_release, select,
    },
    maps::FRONTENDS,
    tc_maps::{
        TC_CONFIG, TC_CONNTRACK, TC_COUNTERS, TC_IFACE_ADDRS, TC_LC_FLOWS, TC_LOCAL_ENDPOINTS,
        TC_SCRATCH, TC_SOURCE_RANGES,
    },
};

/// Verdict for a packet these programs let through, translated or not: `TCX_NEXT`
/// (`TC_ACT_UNSPEC`), so programs attached after ours on the same hook (a CNI's) still see
/// it; at the end of the chain it passes. During an agent restart the old and the new
/// generation both run: the second finds nothing to do on a packet the first translated
/// (no entry is keyed by a translated tuple on the same side).
const PASS: i32 = -1;
const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
const PROTO_ICMP: u8 = 1;
const PROTO_ICMPV6: u8 = 58;
/// Length of the fixed IPv6 header (RFC 8200 section 3).
const IP6_HLEN: usize = 40;
const IP6_NEXT_OFF: usize = ETH_HLEN + 6;
const IP6_SRC_OFF: usize = ETH_HLEN + 8;
const IP6_DST_OFF: usize = ETH_HLEN + 24;
/// `bpf_l4_csum_replace`: the packet is IPv6 (Linux >= 6.16; with CHECKSUM_COMPLETE the
/// pseudo-header is then not folded into `skb->csum`). Older kernels refuse the flag
/// (-EINVAL, nothing changed) and the call is repeated without it.
const BPF_F_IPV6: u64 = 1 << 7;
const IP_CSUM_OFF: usize = ETH_HLEN + 10;
const IP_SRC_OFF: usize = ETH_HLEN + 12;
const IP_DST_OFF: usize = ETH_HLEN + 16;
const BPF_F_PSEUDO_HDR: u64 = 1 << 4;
const BPF_F_MARK_MANGLED_0: u64 = 1 << 5;
const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
/// ICMPv6 error types (RFC 4443 section 3).
const ICMP6_DEST_UNREACH: u8 = 1;
const ICMP6_PACKET_TOO_BIG: u8 = 2;
const ICMP6_TIME_EXCEEDED: u8 = 3;
/// `AF_INET` / `AF_INET6` for `bpf_fib_lookup`.
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

#[classifier]
pub fn tc_ingress(ctx: TcContext) -> i32 {
    match on_packet::<true>(&ctx) {
        Ok(v) | Err(v) => v,
    }
}

#[classifier]
pub fn tc_egress(ctx: TcContext) -> i32 {
    match on_packet::<false>(&ctx) {
        Ok(v) | Err(v) => v,
    }
}

#[inline(always)]
fn count(c: TcCounter) {
    if let Some(p) = TC_COUNTERS.get_ptr_mut(c as u32) {
        // SAFETY: per-CPU slot, only this CPU writes it while we run.
        unsafe { *p += 1 };
    }
}

#[inline(always)]
fn drop_with(c: TcCounter) -> Result<i32, i32> {
    count(c);
    Ok(TC_ACT_SHOT)
}

/// A parsed IPv4 or IPv6 packet with TCP or UDP: its tuple and where its fields are.
struct Pkt {
    key: CtKey,
    /// Offset of the L4 header.
    l4: usize,
    /// An IPv6 packet (plain IPv6 addresses in `key`), else IPv4 (IPv4-mapped).
    v6: bool,
}

/// Offset of the L4 checksum of `proto` relative to the L4 header.
#[inline(always)]
fn l4_csum_off(proto: u8) -> usize {
    if proto == PROTO_TCP { 16 } else { 6 }
}

/// Fills `pkt` from an IPv4 packet with TCP or UDP and returns [`PARSED`]; else returns
/// the verdict (passed, or an ICMP error translated by [`on_icmp`]).
#[inline(always)]
fn parse_v4<const INGRESS: bool>(ctx: &TcContext, pkt: &mut Pkt) -> i32 {
    match try_parse_v4::<INGRESS>(ctx, pkt) {
        Ok(()) => PARSED,
        Err(v) => v,
    }
}

#[inline(always)]
fn try_parse_v4<const INGRESS: bool>(ctx: &TcContext, pkt: &mut Pkt) -> Result<(), i32> {
    let ver_ihl: u8 = ctx.load(ETH_HLEN).map_err(|_| PASS)?;
    if ver_ihl >> 4 != 4 {
        return Err(PASS);
    }
    let ihl = ((ver_ihl & 0x0f) as usize) * 4;
    if ihl < 20 {
        return Err(PASS);
    }
    let frag: u16 = u16::from_be(ctx.load(ETH_HLEN + 6).map_err(|_| PASS)?);
    if frag & 0x1fff != 0 {
        return Err(PASS); // a later fragment: no ports to translate by
    }
    let proto: u8 = ctx.load(ETH_HLEN + 9).map_err(|_| PASS)?;
    let l4 = ETH_HLEN + ihl;
    let saddr: [u8; 4] = ctx.load(IP_SRC_OFF).map_err(|_| PASS)?;
    let daddr: [u8; 4] = ctx.load(IP_DST_OFF).map_err(|_| PASS)?;
    if proto == PROTO_ICMP {
        let v = on_icmp(ctx, l4, u32::from_ne_bytes(saddr));
        if v == ICMP_TRANSLATED {
            if INGRESS {
                let (s, d) = (
                    ctx.load::<[u8; 4]>(IP_SRC_OFF).map_err(|_| PASS)?,
                    ctx.load::<[u8; 4]>(IP_DST_OFF).map_err(|_| PASS)?,
                );
                return Err(redirect_out(
                    ctx,
                    &v4_mapped(u32::from_ne_bytes(s)),
                    &v4_mapped(u32::from_ne_bytes(d)),
                ));
            }
            return Err(PASS);
        }
        return Err(v);
    }
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Err(PASS);
    }
    let ports: [u8; 4] = ctx.load(l4).map_err(|_| PASS)?;
    *pkt = Pkt {
        key: CtKey {
            saddr: v4_mapped(u32::from_ne_bytes(saddr)),
            daddr: v4_mapped(u32::from_ne_bytes(daddr)),
            sport: [ports[0], ports[1]],
            dport: [ports[2], ports[3]],
            proto,
            _pad: [0; 3],
        },
        l4,
        v6: false,
    };
    Ok(())
}

#[inline(always)]
fn on_packet<const INGRESS: bool>(ctx: &TcContext) -> Result<i32, i32> {
    let ethertype = u16::from_be(ctx.load::<u16>(12).map_err(|_| PASS)?);
    // One `Pkt` for both families (stack); anything but PARSED is the packet's verdict
    // already (not TCP/UDP, or an ICMP error handled).
    let mut pkt = Pkt {
        key: CtKey::default(),
        l4: 0,
        v6: false,
    };
    let v = if ethertype == ETH_P_IP {
        parse_v4::<INGRESS>(ctx, &mut pkt)
    } else if ethertype == ETH_P_IPV6 {
        parse_v6(ctx, &mut pkt, INGRESS)
    } else {
        PASS
    };
    if v != PARSED {
        return Ok(v);
    }
    let tcp_flags: u8 = if pkt.key.proto == PROTO_TCP {
        ctx.load(pkt.l4 + 13).map_err(|_| PASS)?
    } else {
        0
    };
    let now = unsafe { bpf_ktime_get_ns() };
    let v = tracked(ctx, &pkt, tcp_flags, now, INGRESS);
    if v != NOT_TRACKED || !INGRESS {
        return Ok(if v == NOT_TRACKED { PASS } else { v });
    }
    let v = new_flow(ctx, &pkt, now);
    // Per-service counting happens here, outside new_flow's deep frame (stack limit).
    if let Some(sc) = TC_SCRATCH.get_ptr_mut(0) {
        // SAFETY: this CPU's slot, used only while this program runs.
        let sc = unsafe { &mut *sc };
        if sc.count_sid != 0 {
            count_service(sc.count_sid, sc.count_bid, sc.count_refused);
            // A new flow on this tuple: an earlier flow's count is given back, and this
            // one is counted when its Service uses least-connections.
            lc_flow_started(&pkt.key, if sc.count_lc != 0 { sc.count_bid } else { 0 });
            sc.count_sid = 0;
            sc.count_lc = 0;
        }
    }
    Ok(v)
}

/// Verdict of [`parse_v4`] and [`parse_v6`] for a TCP/UDP packet they parsed.
const PARSED: i32 = -4;

/// Fills `pkt` from an IPv6 packet whose fixed header is directly followed by TCP or UDP
/// and returns [`PARSED`]; else returns the verdict: passed untouched (extension headers,
/// NDP and other ICMPv6, IPv4-mapped addresses), or an ICMPv6 error translated by
/// [`on_icmp6`] (redirected at ingress). Its own BPF function, so the IPv4 path's stack
/// does not grow; `pkt` is in the caller's frame.
#[inline(never)]
fn parse_v6(ctx: &TcContext, pkt: &mut Pkt, ingress: bool) -> i32 {
    match try_parse_v6(ctx, pkt, ingress) {
        Ok(()) => PARSED,
        Err(v) => v,
    }
}

#[inline(always)]
fn try_parse_v6(ctx: &TcContext, pkt: &mut Pkt, ingress: bool) -> Result<(), i32> {
    let ver: u8 = ctx.load(ETH_HLEN).map_err(|_| PASS)?;
    if ver >> 4 != 6 {
        return Err(PASS);
    }
    let proto: u8 = ctx.load(IP6_NEXT_OFF).map_err(|_| PASS)?;
    if proto == PROTO_ICMPV6 {
        return Err(on_icmp6(ctx, ingress));
    }
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Err(PASS);
    }
    let l4 = ETH_HLEN + IP6_HLEN;
    let ports: [u8; 4] = ctx.load(l4).map_err(|_| PASS)?;
    load16(ctx, IP6_SRC_OFF, &mut pkt.key.saddr)?;
    load16(ctx, IP6_DST_OFF, &mut pkt.key.daddr)?;
    pkt.key.sport = [ports[0], ports[1]];
    pkt.key.dport = [ports[2], ports[3]];
    pkt.key.proto = proto;
    pkt.l4 = l4;
    pkt.v6 = true;
    // Never on the wire; would alias the IPv4 flows' IPv4-mapped tuples.
    if is_v4_mapped(&pkt.key.saddr) || is_v4_mapped(&pkt.key.daddr) {
        return Err(PASS);
    }
    Ok(())
}

/// Least-connections accounting of a new tc flow keyed `key` (original direction): gives
/// back the count of an earlier (dead) flow of the same tuple, then counts this one for
/// backend `id` (0: not counted). A map delete succeeds once, so each count is given back
/// once whoever (tc program or agent collection) removes the entry.
#[inline(never)]
fn lc_flow_started(key: &CtKey, id: u32) {
    lc_flow_release(key);
    if id != 0 && TC_LC_FLOWS.insert(key, &id, BPF_NOEXIST as u64).is_ok() {
        lc_acquire(id);
    }
}

/// A tracked flow closed (FIN both ways or RST) as seen through the entry keyed `key`:
/// gives back its least-connections count. The original-direction key is `key` itself for
/// the original entry and the reverse of the rewrite for the reply entry.
#[inline(never)]
fn lc_flow_closed(key: &CtKey, entry: &CtEntry) {
    if entry.flags & CT_F_REPLY != 0 {
        lc_flow_release(&peer_key(entry, key.proto));
    } else {
        lc_flow_release(key);
    }
}

/// Removes `key` from `TC_LC_FLOWS` and, when this call removed it, gives its count back.
#[inline(always)]
fn lc_flow_release(key: &CtKey) {
    // SAFETY: copied out at once.
    if let Some(old) = unsafe { TC_LC_FLOWS.get(key).copied() }
        && TC_LC_FLOWS.remove(key).is_ok()
    {
        lc_release(old);
    }
}

/// Least-connections collection, run by the agent through `BPF_PROG_TEST_RUN` (never
/// attached) for each `TC_LC_FLOWS` key whose flow looks dead from userspace. The packet is
/// 14 bytes of (ignored) Ethernet header followed by the 40-byte [`CtKey`]. Checked again
/// here, atomically with the release: a flow whose original entry is live and open is kept
/// (returns 0); otherwise its count is given back (returns 1; 2 when someone else already
/// released it).
#[classifier]
pub fn tc_lc_gc(ctx: TcContext) -> i32 {
    let Ok(key) = ctx.load::<CtKey>(ETH_HLEN) else {
        return 2;
    };
    // SAFETY: helper without side effects.
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(e) = TC_CONNTRACK.get_ptr(&key) {
        // SAFETY: value of the map, read field by field.
        let (seen, flags) = unsafe { ((*e).last_seen_ns, (*e).flags) };
        if now.saturating_sub(seen) <= timeout_of(flags, key.proto) && !is_closed(flags) {
            return 0;
        }
    }
    // SAFETY: copied out at once.
    let Some(id) = (unsafe { TC_LC_FLOWS.get(&key).copied() }) else {
        return 2;
    };
    if TC_LC_FLOWS.remove(&key).is_err() {
        return 2;
    }
    lc_release(id);
    1
}

/// Verdict of [`tracked`] for a packet without a live conntrack entry.
const NOT_TRACKED: i32 = -2;

/// A packet of a tracked flow: refreshes its entry (and the other direction's), follows
/// the TCP state, and rewrites the packet. [`NOT_TRACKED`] when there is no live entry, or
/// when a TCP SYN reopens a closed flow's tuple. Its own BPF function (stack frame).
#[inline(never)]
fn tracked(ctx: &TcContext, pkt: &Pkt, tcp_flags: u8, now: u64, ingress: bool) -> i32 {
    let proto = pkt.key.proto;
    let Some(e) = TC_CONNTRACK.get_ptr_mut(pkt.key) else {
        return NOT_TRACKED;
    };
    // SAFETY: a value of the map; concurrent writers only touch the flags/time words.
    let entry = unsafe { *e };
    let live = now.saturating_sub(entry.last_seen_ns) <= timeout(&entry, proto);
    let reopened = entry.flags & (CT_F_REPLY | CT_F_EGRESS) == 0
        && tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
        && is_closed(entry.flags);
    // The SNAT stage of a flow is for its packets on their way out only.
    let wrong_side = ingress && entry.flags & CT_F_EGRESS != 0;
    if !live || reopened || wrong_side {
        return NOT_TRACKED;
    }
    if ingress
        && entry.flags & (CT_F_SNAT | CT_F_REPLY | CT_F_EGRESS) == CT_F_SNAT
        && !snat_binding_held(&pkt.key, &entry, now)
    {
        count(TcCounter::SnatBindingLost);
        return TC_ACT_SHOT;
    }
    let flags = track(&entry, tcp_flags);
    // SAFETY: as above; word-sized stores.
    unsafe {
        (*e).last_seen_ns = now;
        (*e).flags = flags;
    }
    touch_peer(&entry, proto, flags, now);
    if entry.flags & CT_F_EGRESS == 0 && is_closed(flags) && !is_closed(entry.flags) {
        // The flow closed: its least-connections count, if any, is given back now.
        lc_flow_closed(&pkt.key, &entry);
    }
    count(TcCounter::Translated);
    // The SNAT stage is a second rewrite of a packet already counted at its DNAT.
    if entry.flags & CT_F_EGRESS == 0 {
        count_packet(entry.service_id, ctx.len());
    }
    let v = rewrite(ctx, pkt, &entry);
    if v == PASS && ingress && entry.flags & (CT_F_REPLY | CT_F_SNAT) == (CT_F_REPLY | CT_F_SNAT) {
        return redirect_out(ctx, &entry.saddr, &entry.daddr);
    }
    v
}

/// For a packet in the original direction of a source-NATed flow (`entry` is its original
/// entry, `key` the packet's tuple): whether the flow still holds its SNAT binding. The SNAT
/// stage is keyed by the original entry's rewritten tuple and names the node address and
/// port; the reply entry keyed (backend -> node address:port) must lead back to this client.
/// - reply entry evicted from the LRU table: written again (only if the port is still free),
///   so a later flow cannot take the port while this one lives;
/// - reply entry of another live flow (the port was taken after an eviction), or SNAT stage
///   evicted: the binding is lost; the flow's entries are removed (and its
///   least-connections count given back) so the client's next packet starts a new flow,
///   and this packet is dropped rather than mixed into the other flow.
///
/// Its own BPF function; keys and entries are built in the per-CPU scratch slot (stack).
#[inline(never)]
fn snat_binding_held(key: &CtKey, entry: &CtEntry, now: u64) -> bool {
    let Some(sc) = TC_SCRATCH.get_ptr_mut(0) else {
        return true;
    };
    // SAFETY: this CPU's slot; `new_flow` does not run for a tracked packet. Fields are
    // written in place and map values read through their pointers: this function's frame
    // adds to `tracked`'s and `on_packet`'s within the 512-byte stack.
    let sc = unsafe { &mut *sc };
    sc.ekey.saddr = entry.saddr;
    sc.ekey.daddr = entry.daddr;
    sc.ekey.sport = entry.sport;
    sc.ekey.dport = entry.dport;
    sc.ekey.proto = key.proto;
    sc.ekey._pad = [0; 3];
    let held = match TC_CONNTRACK.get_ptr(&sc.ekey) {
        None => false,
        Some(eg) => {
            sc.rkey.saddr = entry.daddr;
            sc.rkey.sport = entry.dport;
            // SAFETY: value of the map, fields copied.
            unsafe {
                sc.rkey.daddr = (*eg).saddr;
                sc.rkey.dport = (*eg).sport;
            }
            sc.rkey.proto = key.proto;
            sc.rkey._pad = [0; 3];
            sc.rev.saddr = key.daddr;
            sc.rev.daddr = key.saddr;
            sc.rev.sport = key.dport;
            sc.rev.dport = key.sport;
            sc.rev.flags = CT_F_REPLY
                | CT_F_SNAT
                | (entry.flags & (CT_F_SEEN_REPLY | CT_F_FIN_ORIG | CT_F_FIN_REPLY | CT_F_RST));
            sc.rev._pad = 0;
            sc.rev.service_id = entry.service_id;
            sc.rev.last_seen_ns = now;
            match TC_CONNTRACK.get_ptr(&sc.rkey) {
                // SAFETY: value of the map, read in place.
                Some(r) => unsafe {
                    if (*r).daddr == key.saddr && (*r).dport == key.sport {
                        true
                    } else if now.saturating_sub((*r).last_seen_ns)
                        > timeout_of((*r).flags, key.proto)
                    {
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
        lc_flow_release(key);
    }
    held
}

/// Sends a packet translated at ingress whose source is now one of this node's addresses
/// (a reply of a source-NATed flow, frontend -> client) straight to its next hop. Routing
/// it would drop it as a martian (a local source address arriving from the wire), so the
/// route and the next hop come from `bpf_fib_lookup`, and `bpf_redirect_neigh` resolves a
/// neighbour the node has not talked to yet. When the lookup fails the packet goes to the
/// stack unchanged in course. The family follows `dst`: IPv4-mapped is IPv4 (AF_INET),
/// anything else IPv6 (AF_INET6).
#[inline(never)]
fn redirect_out(ctx: &TcContext, src: &[u8; 16], dst: &[u8; 16]) -> i32 {
    let Some(sc) = TC_SCRATCH.get_ptr_mut(0) else {
        return PASS;
    };
    // SAFETY: this CPU's scratch slot; the FIB parameters are plain integers.
    let f = unsafe { &mut (*sc).fib };
    *f = unsafe { core::mem::zeroed() };
    f.ifindex = unsafe { (*ctx.skb.skb).ifindex };
    if is_v4_mapped(dst) {
        f.family = AF_INET;
        f.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes([src[12], src[13], src[14], src[15]]);
        f.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes([dst[12], dst[13], dst[14], dst[15]]);
    } else {
        f.family = AF_INET6;
        // SAFETY: 16 bytes each way; the union fields are 16 bytes.
        unsafe {
            core::ptr::copy_nonoverlapping(
                src.as_ptr(),
                f.__bindgen_anon_3.ipv6_src.as_mut_ptr() as *mut u8,
                16,
            );
            core::ptr::copy_nonoverlapping(
                dst.as_ptr(),
                f.__bindgen_anon_4.ipv6_dst.as_mut_ptr() as *mut u8,
                16,
            );
        }
    }
    // SAFETY: helper with our context and a buffer of the right size.
    let r = unsafe {
        bpf_fib_lookup(
            ctx.skb.skb as *mut _,
            f,
            core::mem::size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    match r {
        0 => {
            let (smac, dmac, ifindex) = (f.smac, f.dmac, f.ifindex);
            if ctx.store(0, &dmac, 0).is_err() || ctx.store(6, &smac, 0).is_err() {
                return PASS;
            }
            // SAFETY: helper without memory arguments.
            unsafe { bpf_redirect(ifindex, 0) as i32 }
        }
        // BPF_FIB_LKUP_RET_NO_NEIGH: let the kernel resolve the next hop.
        // SAFETY: helper without memory arguments (no explicit next hop).
        7 => unsafe { bpf_redirect_neigh(f.ifindex, core::ptr::null_mut(), 0, 0) as i32 },
        _ => PASS,
    }
}

/// Flags of `entry` after a packet with `tcp_flags` in its direction.
#[inline(always)]
fn track(entry: &CtEntry, tcp_flags: u8) -> u16 {
    let mut f = entry.flags;
    let reply = f & CT_F_REPLY != 0;
    if reply {
        f |= CT_F_SEEN_REPLY;
    }
    if tcp_flags & TCP_RST != 0 {
        f |= CT_F_RST;
    }
    if tcp_flags & TCP_FIN != 0 {
        f |= if reply { CT_F_FIN_REPLY } else { CT_F_FIN_ORIG };
    }
    f
}

#[inline(always)]
fn is_closed(flags: u16) -> bool {
    ct_closed(flags)
}

/// Idle time after which an entry is dead (see `proxy_common::nat::ct_timeout_ns`).
#[inline(always)]
fn timeout(entry: &CtEntry, proto: u8) -> u64 {
    timeout_of(entry.flags, proto)
}

/// [`timeout`] from an entry's flags, with the configured timeouts (`TcConfig`).
#[inline(always)]
fn timeout_of(flags: u16, proto: u8) -> u64 {
    match TC_CONFIG.get(0) {
        Some(c) => ct_timeout_ns(
            flags,
            proto,
            c.tcp_established_ns,
            c.udp_ns,
            c.udp_stream_ns,
        ),
        None => ct_timeout_ns(flags, proto, 0, 0, 0),
    }
}

/// The key of the other direction of the flow `entry` belongs to: its rewritten tuple,
/// reversed.
#[inline(always)]
fn peer_key(entry: &CtEntry, proto: u8) -> CtKey {
    CtKey {
        saddr: entry.daddr,
        daddr: entry.saddr,
        sport: entry.dport,
        dport: entry.sport,
        proto,
        _pad: [0; 3],
    }
}

/// Shares the state bits and liveness with the other direction.
#[inline(always)]
fn touch_peer(entry: &CtEntry, proto: u8, flags: u16, now: u64) {
    let shared = flags & (CT_F_SEEN_REPLY | CT_F_FIN_ORIG | CT_F_FIN_REPLY | CT_F_RST);
    if let Some(p) = TC_CONNTRACK.get_ptr_mut(peer_key(entry, proto)) {
        // SAFETY: value of the map, word-sized stores.
        unsafe {
            (*p).flags |= shared;
            (*p).last_seen_ns = now;
        }
    }
}

/// A first packet towards an ingress frontend: select, maybe SNAT, track, rewrite. Its own
/// BPF function (a stack frame of its own) to stay within the 512-byte stack.
#[inline(never)]
fn new_flow(ctx: &TcContext, pkt: &Pkt, now: u64) -> i32 {
    match try_new_flow(ctx, pkt, now) {
        Ok(v) | Err(v) => v,
    }
}

#[inline(always)]
fn try_new_flow(ctx: &TcContext, pkt: &Pkt, now: u64) -> Result<i32, i32> {
    let k = &pkt.key;
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: value of the map, one word read.
    let iface_flags = TC_IFACE_ADDRS
        .get_ptr(ifindex)
        .map(|p| unsafe { (*p).flags })
        .unwrap_or(0);
    if iface_flags & IFACE_F_POD != 0 {
        return Ok(PASS); // pods start flows at the socket, not here
    }
    let mut fkey = FrontendKey {
        addr: k.daddr,
        port: k.dport,
        proto: k.proto,
        scope: SCOPE_INGRESS,
    };
    // External addresses and node ports first; else a cluster IP reached from outside the
    // node (a router sending the service CIDR to nodes), as kube-proxy serves it too.
    // SAFETY: copied out at once (the agent replaces elements, it never writes into them).
    let (fe, cluster_ip) = match unsafe { FRONTENDS.get(fkey).copied() } {
        Some(fe) => (fe, false),
        None => {
            fkey.scope = SCOPE_NODE;
            match unsafe { FRONTENDS.get(fkey).copied() } {
                Some(fe) if fe.flags & FRONTEND_F_EXTERNAL == 0 => (fe, true),
                _ => return Ok(PASS),
            }
        }
    };
    if fe.flags & FRONTEND_F_VIP_MARKER != 0 {
        return Ok(PASS);
    }
    if denied_by_source_ranges(&k.daddr, &k.saddr) {
        return drop_with(TcCounter::SourceRangeDenied);
    }
    // The request, and below the two entries, live in a per-CPU scratch slot, not on the
    // 512-byte stack.
    let Some(sc) = TC_SCRATCH.get_ptr_mut(0) else {
        return Ok(TC_ACT_SHOT);
    };
    // SAFETY: this CPU's slot, used only while this program runs.
    let sc = unsafe { &mut *sc };
    sc.req = Request {
        addr: k.daddr,
        port: k.dport,
        proto: k.proto,
        client: Client {
            addr: k.saddr,
            port: k.sport,
        },
    };
    let id = select(&fe, &sc.req);
    // Counted by the caller (see `on_packet`).
    sc.count_sid = fe.service_id;
    sc.count_bid = id;
    sc.count_refused = (id == 0) as u32;
    let Some(b) = backend(id).filter(|_| id != 0) else {
        return drop_with(if fe.flags & FRONTEND_F_LOCAL_ONLY != 0 {
            TcCounter::DroppedNoLocalEndpoints
        } else {
            TcCounter::DroppedNoEndpoints
        });
    };
    // A backend of the other family (the model never pairs them; a packet cannot change
    // family here).
    if other_family(&b.addr, pkt.v6) {
        return drop_with(TcCounter::RewriteFailed);
    }
    let snat = needs_snat(&fe, &b.addr, &k.saddr, cluster_ip);
    sc.fwd = CtEntry {
        saddr: k.saddr,
        daddr: b.addr,
        sport: k.sport,
        dport: b.port,
        flags: 0,
        _pad: 0,
        service_id: fe.service_id,
        last_seen_ns: now,
    };
    sc.rev = CtEntry {
        saddr: k.daddr,
        daddr: k.saddr,
        sport: k.dport,
        dport: k.sport,
        flags: CT_F_REPLY,
        _pad: 0,
        service_id: fe.service_id,
        last_seen_ns: now,
    };
    if snat {
        let Some(node) = TC_IFACE_ADDRS.get_ptr(ifindex) else {
            return drop_with(TcCounter::NoSnatAddress);
        };
        // SAFETY: value of the map, read in place.
        let node = unsafe {
            if pkt.v6 {
                &(*node).v6
            } else {
                &(*node).v4
            }
        };
        if !snat_addr_usable(node, pkt.v6) {
            return drop_with(TcCounter::NoSnatAddress);
        }
        sc.fwd.flags = CT_F_SNAT;
        sc.rev.flags = CT_F_REPLY | CT_F_SNAT;
        sc.rkey = CtKey {
            saddr: b.addr,
            daddr: *node,
            sport: b.port,
            dport: [0; 2],
            proto: k.proto,
            _pad: [0; 3],
        };
        let mut bound = false;
        for _ in 0..SNAT_PORT_TRIES {
            let r = unsafe { bpf_get_prandom_u32() } % SNAT_PORT_COUNT as u32;
            sc.rkey.dport = (SNAT_PORT_MIN + r as u16).to_be_bytes();
            // A port is free when no live reply entry holds it; a dead one is replaced.
            let flag = match TC_CONNTRACK.get_ptr(sc.rkey) {
                // SAFETY: value of the map, read field by field.
                Some(old) => {
                    let (seen, flags) = unsafe { ((*old).last_seen_ns, (*old).flags) };
                    if now.saturating_sub(seen) <= timeout_of(flags, k.proto) {
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
            return drop_with(TcCounter::SnatPortsExhausted);
        }
        // The source is rewritten on the way out (egress), after the kernel routed the
        // packet: with a node address as source already at ingress, routing would drop it
        // as a martian (a local source address arriving from the wire).
        sc.ekey = CtKey {
            saddr: k.saddr,
            daddr: b.addr,
            sport: k.sport,
            dport: b.port,
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
            return drop_with(TcCounter::ConntrackFull);
        }
        if TC_CONNTRACK
            .insert(&pkt.key, &sc.fwd, BPF_ANY as u64)
            .is_err()
        {
            let _ = TC_CONNTRACK.remove(&sc.rkey);
            let _ = TC_CONNTRACK.remove(&sc.ekey);
            return drop_with(TcCounter::ConntrackFull);
        }
        count(TcCounter::Snat);
    } else {
        sc.rkey = peer_key(&sc.fwd, k.proto);
        if TC_CONNTRACK
            .insert(&sc.rkey, &sc.rev, BPF_ANY as u64)
            .is_err()
        {
            return drop_with(TcCounter::ConntrackFull);
        }
        if TC_CONNTRACK
            .insert(&pkt.key, &sc.fwd, BPF_ANY as u64)
            .is_err()
        {
            let _ = TC_CONNTRACK.remove(&sc.rkey);
            return drop_with(TcCounter::ConntrackFull);
        }
    }
    count(TcCounter::NewFlow);
    sc.count_lc = (fe.algorithm == Algorithm::LeastConnections as u8) as u32;
    Ok(rewrite(ctx, pkt, &sc.fwd))
}

/// Whether backend address `a` is not of the packet's family. Its own BPF function: inline,
/// the comparison costs `new_flow` about 100 bytes of stack.
#[inline(never)]
fn other_family(a: &[u8; 16], v6: bool) -> bool {
    is_v4_mapped(a) == v6
}

/// Whether `a`, read from `IfaceAddr`, is a node address of the family (all zero: none).
/// For IPv6, the agent writes global or unique-local addresses only, none of them in
/// `::/8` (reserved: the unspecified, loopback and IPv4-mapped addresses live there), so
/// the first byte tells.
#[inline(always)]
fn snat_addr_usable(a: &[u8; 16], v6: bool) -> bool {
    if v6 {
        a[0] != 0
    } else {
        is_v4_mapped(a)
    }
}

/// Whether a new flow of `fe` from `client` to backend `addr` is source-NATed:
/// - never with a Local policy (the client address is kept, KEP-1672 / KEP-2086);
/// - with `--masquerade-all` always (kube-proxy's meaning);
/// - for a cluster IP, when the client is outside `--cluster-cidr`'s prefix of its family
///   (kube-proxy masquerades off-cluster traffic to cluster IPs);
/// - when the backend is on another node: its replies must come back through this node
///   to be translated. (kube-proxy masquerades every Cluster-policy external flow; here a
///   flow to a backend on this node keeps the client address, as Cilium does.)
#[inline(always)]
fn needs_snat(fe: &Frontend, addr: &[u8; 16], client: &[u8; 16], cluster_ip: bool) -> bool {
    if fe.flags & FRONTEND_F_LOCAL_ONLY != 0 {
        return false;
    }
    if let Some(cfg) = TC_CONFIG.get(0) {
        if cfg.flags & TC_CFG_MASQUERADE_ALL != 0 {
            return true;
        }
        let v4 = is_v4_mapped(client);
        if cluster_ip && !v4 && cfg.flags & TC_CFG_CLUSTER_CIDR_V6 != 0 && outside_cidr6(client)
        {
            return true;
        }
        if cluster_ip && v4 && cfg.flags & TC_CFG_CLUSTER_CIDR_V4 != 0 {
            let len = cfg.cluster_cidr_v4_len as u32;
            let mask = if len == 0 {
                0
            } else {
                u32::MAX << (32 - len.min(32))
            };
            let c = u32::from_be_bytes([client[12], client[13], client[14], client[15]]);
            let n = u32::from_be_bytes(cfg.cluster_cidr_v4);
            if c & mask != n & mask {
                return true;
            }
        }
    }
    TC_LOCAL_ENDPOINTS.get_ptr(*addr).is_none()
}

/// Whether IPv6 client `a` is outside the IPv6 `--cluster-cidr` (`TC_CONFIG`). Its own BPF
/// function: the 64-bit halves would otherwise take `new_flow`'s stack.
#[inline(never)]
fn outside_cidr6(a: &[u8; 16]) -> bool {
    match TC_CONFIG.get(0) {
        Some(cfg) => !in_prefix6(a, &cfg.cluster_cidr_v6, cfg.cluster_cidr_v6_len),
        None => false,
    }
}

/// Whether IPv6 address `a` is in `net`/`len` (both network byte order).
#[inline(always)]
fn in_prefix6(a: &[u8; 16], net: &[u8; 16], len: u8) -> bool {
    let len = len.min(128) as u32;
    let (mh, ml) = (mask64(len), mask64(len.saturating_sub(64)));
    let (ah, al) = halves(a);
    let (nh, nl) = halves(net);
    ah & mh == nh & mh && al & ml == nl & ml
}

/// The first `len` (0..=64; more counts as 64) bits set.
#[inline(always)]
fn mask64(len: u32) -> u64 {
    if len == 0 {
        0
    } else if len >= 64 {
        u64::MAX
    } else {
        u64::MAX << (64 - len)
    }
}

/// An address as two big-endian 64-bit halves.
#[inline(always)]
fn halves(a: &[u8; 16]) -> (u64, u64) {
    (
        u64::from_be_bytes([a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]]),
        u64::from_be_bytes([a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]]),
    )
}

/// `spec.loadBalancerSourceRanges`: true when `dst` is a restricted LB IP and `src` is in
/// none of its ranges.
#[inline(always)]
fn denied_by_source_ranges(dst: &[u8; 16], src: &[u8; 16]) -> bool {
    let key = Key::new(
        256,
        SourceRange {
            lb_addr: *dst,
            client: *src,
        },
    );
    matches!(TC_SOURCE_RANGES.get(&key), Some(v) if *v == SOURCE_RANGE_RESTRICTED)
}

/// Rewrites the packet's tuple to `to`'s, fixing the IPv4 and L4 checksums (a UDP checksum
/// of zero stays zero in IPv4: BPF_F_MARK_MANGLED_0), or for IPv6 the L4 checksum (see
/// [`try_rewrite6`]). Returns the verdict: OK, or SHOT (counted) when a helper failed.
#[inline(never)]
fn rewrite(ctx: &TcContext, pkt: &Pkt, to: &CtEntry) -> i32 {
    let r = if pkt.v6 {
        try_rewrite6(ctx, pkt, to)
    } else {
        try_rewrite(ctx, pkt, to)
    };
    match r {
        Ok(()) => PASS,
        Err(v) => v,
    }
}

/// Counts a failed rewrite helper; the packet is dropped.
#[inline(always)]
fn rewrite_failed<E>(_: E) -> i32 {
    count(TcCounter::RewriteFailed);
    TC_ACT_SHOT
}

/// `bpf_l4_csum_replace` of an IPv6 packet: with `BPF_F_IPV6`, and again without it on a
/// kernel that does not know the flag (before 6.16; it then changed nothing).
#[inline(always)]
fn l4_csum6(ctx: &TcContext, off: usize, from: u64, to: u64, flags: u64) -> Result<(), i32> {
    if ctx
        .l4_csum_replace(off, from, to, flags | BPF_F_IPV6)
        .is_ok()
    {
        return Ok(());
    }
    ctx.l4_csum_replace(off, from, to, flags)
        .map_err(rewrite_failed)
}

/// Writes IPv6 address `new` over `old` at `off` and folds the difference into the
/// checksum at `csum` (`bpf_csum_diff` of the 16-byte addresses, then the difference form
/// of `bpf_l4_csum_replace`: size 0 and `from` 0). `flags`: `BPF_F_PSEUDO_HDR` when the
/// address is part of the checksum's pseudo-header, plus `BPF_F_MARK_MANGLED_0` for UDP.
#[inline(always)]
fn store_addr6(
    ctx: &TcContext,
    off: usize,
    old: &[u8; 16],
    new: &[u8; 16],
    csum: usize,
    flags: u64,
) -> Result<(), i32> {
    match store_addr6_at(ctx, off, old, new, ((csum as u64) << 32) | flags) {
        0 => Ok(()),
        v => Err(v),
    }
}

/// [`store_addr6`] as its own BPF function (small stack frames for its callers, at most
/// five arguments: the checksum offset travels in the upper half of `csum_flags`, the
/// flags in the lower). Returns 0, or the verdict of a failure (counted).
#[inline(never)]
fn store_addr6_at(
    ctx: &TcContext,
    off: usize,
    old: &[u8; 16],
    new: &[u8; 16],
    csum_flags: u64,
) -> i32 {
    match try_store_addr6(ctx, off, old, new, csum_flags) {
        Ok(()) => 0,
        Err(v) => v,
    }
}

#[inline(always)]
fn try_store_addr6(
    ctx: &TcContext,
    off: usize,
    old: &[u8; 16],
    new: &[u8; 16],
    csum_flags: u64,
) -> Result<(), i32> {
    let csum = (csum_flags >> 32) as usize;
    let flags = csum_flags & 0xffff_ffff;
    // SAFETY: both buffers are 16 readable bytes (a multiple of 4, as the helper needs); it
    // only reads them.
    let diff = unsafe {
        bpf_csum_diff(
            old.as_ptr() as *mut u32,
            16,
            new.as_ptr() as *mut u32,
            16,
            0,
        )
    };
    if diff < 0 {
        return Err(rewrite_failed(diff));
    }
    ctx.store(off, new, 0).map_err(rewrite_failed)?;
    l4_csum6(ctx, csum, 0, diff as u64, flags)
}

/// [`rewrite`] of an IPv6 packet: addresses as [`store_addr6`] does (part of the TCP/UDP
/// pseudo-header; inlined here, a call deeper would exceed the combined stack limit under
/// `new_flow`), ports as for IPv4; there is no IP header checksum.
#[inline(always)]
fn try_rewrite6(ctx: &TcContext, pkt: &Pkt, to: &CtEntry) -> Result<(), i32> {
    let k = &pkt.key;
    let csum = pkt.l4 + l4_csum_off(k.proto);
    let mangled = if k.proto == PROTO_UDP {
        BPF_F_MARK_MANGLED_0
    } else {
        0
    };
    if k.saddr != to.saddr {
        try_store_addr6(
            ctx,
            IP6_SRC_OFF,
            &k.saddr,
            &to.saddr,
            ((csum as u64) << 32) | BPF_F_PSEUDO_HDR | mangled,
        )?;
    }
    if k.daddr != to.daddr {
        try_store_addr6(
            ctx,
            IP6_DST_OFF,
            &k.daddr,
            &to.daddr,
            ((csum as u64) << 32) | BPF_F_PSEUDO_HDR | mangled,
        )?;
    }
    let port = |p: [u8; 2]| u16::from_ne_bytes(p);
    if k.sport != to.sport {
        let (old, new) = (port(k.sport), port(to.sport));
        ctx.store(pkt.l4, &new, 0).map_err(rewrite_failed)?;
        l4_csum6(ctx, csum, old as u64, new as u64, mangled | 2)?;
    }
    if k.dport != to.dport {
        let (old, new) = (port(k.dport), port(to.dport));
        ctx.store(pkt.l4 + 2, &new, 0).map_err(rewrite_failed)?;
        l4_csum6(ctx, csum, old as u64, new as u64, mangled | 2)?;
    }
    Ok(())
}

#[inline(always)]
fn try_rewrite(ctx: &TcContext, pkt: &Pkt, to: &CtEntry) -> Result<(), i32> {
    let k = &pkt.key;
    let csum = pkt.l4 + l4_csum_off(k.proto);
    let mangled = if k.proto == PROTO_UDP {
        BPF_F_MARK_MANGLED_0
    } else {
        0
    };
    let fail = |_| {
        count(TcCounter::RewriteFailed);
        TC_ACT_SHOT
    };
    let addr = |a: &[u8; 16]| u32::from_ne_bytes([a[12], a[13], a[14], a[15]]);
    let port = |p: [u8; 2]| u16::from_ne_bytes(p);
    if k.saddr != to.saddr {
        let (old, new) = (addr(&k.saddr), addr(&to.saddr));
        ctx.store(IP_SRC_OFF, &new, 0).map_err(fail)?;
        ctx.l3_csum_replace(IP_CSUM_OFF, old as u64, new as u64, 4)
            .map_err(fail)?;
        ctx.l4_csum_replace(csum, old as u64, new as u64, BPF_F_PSEUDO_HDR | mangled | 4)
            .map_err(fail)?;
    }
    if k.daddr != to.daddr {
        let (old, new) = (addr(&k.daddr), addr(&to.daddr));
        ctx.store(IP_DST_OFF, &new, 0).map_err(fail)?;
        ctx.l3_csum_replace(IP_CSUM_OFF, old as u64, new as u64, 4)
            .map_err(fail)?;
        ctx.l4_csum_replace(csum, old as u64, new as u64, BPF_F_PSEUDO_HDR | mangled | 4)
            .map_err(fail)?;
    }
    if k.sport != to.sport {
        let (old, new) = (port(k.sport), port(to.sport));
        ctx.store(pkt.l4, &new, 0).map_err(fail)?;
        ctx.l4_csum_replace(csum, old as u64, new as u64, mangled | 2)
            .map_err(fail)?;
    }
    if k.dport != to.dport {
        let (old, new) = (port(k.dport), port(to.dport));
        ctx.store(pkt.l4 + 2, &new, 0).map_err(fail)?;
        ctx.l4_csum_replace(csum, old as u64, new as u64, mangled | 2)
            .map_err(fail)?;
    }
    Ok(())
}

/// An ICMP error quoting a packet of a translated flow (destination unreachable, which
/// includes "fragmentation needed" for path-MTU discovery, and time exceeded). The quoted
/// packet went the other way, so its tuple reversed is the key of the entry of the
/// direction the error travels (the reply entry for an error from the backend's side, the
/// original entry for one from the client's side). That entry's rewrite gives the new
/// outer destination, the new outer source (when the error comes from the flow's peer
/// itself), and the quoted packet as its sender saw it (the reverse of the rewrite), as
/// the kernel's NAT does (RFC 5508).
#[inline(never)]
fn on_icmp(ctx: &TcContext, l4: usize, outer_src: u32) -> i32 {
    match try_icmp(ctx, l4, outer_src) {
        Ok(v) | Err(v) => v,
    }
}

#[inline(always)]
fn try_icmp(ctx: &TcContext, l4: usize, outer_src: u32) -> Result<i32, i32> {
    let ty: u8 = ctx.load(l4).map_err(|_| PASS)?;
    if ty != ICMP_DEST_UNREACH && ty != ICMP_TIME_EXCEEDED {
        return Ok(PASS);
    }
    let inner = l4 + 8;
    let inner_vihl: u8 = ctx.load(inner).map_err(|_| PASS)?;
    if inner_vihl >> 4 != 4 {
        return Ok(PASS);
    }
    let inner_l4 = inner + ((inner_vihl & 0x0f) as usize) * 4;
    let proto: u8 = ctx.load(inner + 9).map_err(|_| PASS)?;
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Ok(PASS);
    }
    let isrc: u32 = ctx.load(inner + 12).map_err(|_| PASS)?;
    let idst: u32 = ctx.load(inner + 16).map_err(|_| PASS)?;
    let isport: u16 = ctx.load(inner_l4).map_err(|_| PASS)?;
    let idport: u16 = ctx.load(inner_l4 + 2).map_err(|_| PASS)?;
    // The quoted packet reversed: the key of the direction this error travels.
    let rkey = CtKey {
        saddr: v4_mapped(idst),
        daddr: v4_mapped(isrc),
        sport: idport.to_ne_bytes(),
        dport: isport.to_ne_bytes(),
        proto,
        _pad: [0; 3],
    };
    let Some(e) = TC_CONNTRACK.get_ptr(rkey) else {
        return Ok(PASS);
    };
    let w = |a: &[u8; 16]| u32::from_ne_bytes([a[12], a[13], a[14], a[15]]);
    // SAFETY: a value of the map, read field by field.
    let (new_src, new_dst, new_sport, new_dport) = unsafe {
        (
            w(&(*e).saddr),
            w(&(*e).daddr),
            u16::from_ne_bytes((*e).sport),
            u16::from_ne_bytes((*e).dport),
        )
    };
    let fail = |_| {
        count(TcCounter::RewriteFailed);
        TC_ACT_SHOT
    };
    let icmp_csum = l4 + 2;
    // Outer header: destination -> the entry's destination; source -> the entry's source
    // when the error comes from the flow's peer itself (not from a router on the way).
    let outer_dst: u32 = ctx.load(IP_DST_OFF).map_err(|_| PASS)?;
    if outer_dst != new_dst {
        ctx.store(IP_DST_OFF, &new_dst, 0).map_err(fail)?;
        ctx.l3_csum_replace(IP_CSUM_OFF, outer_dst as u64, new_dst as u64, 4)
            .map_err(fail)?;
    }
    if outer_src == idst && outer_src != new_src {
        ctx.store(IP_SRC_OFF, &new_src, 0).map_err(fail)?;
        ctx.l3_csum_replace(IP_CSUM_OFF, outer_src as u64, new_src as u64, 4)
            .map_err(fail)?;
    }
    // Quoted header: source -> the entry's destination, destination -> the entry's source.
    // The ICMP checksum covers the quoted bytes (no pseudo header), including the quoted
    // IP checksum, which changes too.
    let iphdr_csum = inner + 10;
    for (off, old, new) in [(inner + 12, isrc, new_dst), (inner + 16, idst, new_src)] {
        if old == new {
            continue;
        }
        let old_ck: u16 = ctx.load(iphdr_csum).map_err(|_| PASS)?;
        ctx.store(off, &new, 0).map_err(fail)?;
        ctx.l3_csum_replace(iphdr_csum, old as u64, new as u64, 4)
            .map_err(fail)?;
        let new_ck: u16 = ctx.load(iphdr_csum).map_err(|_| PASS)?;
        ctx.l4_csum_replace(icmp_csum, old as u64, new as u64, 4)
            .map_err(fail)?;
        ctx.l4_csum_replace(icmp_csum, old_ck as u64, new_ck as u64, 2)
            .map_err(fail)?;
    }
    for (off, old, new) in [
        (inner_l4, isport, new_dport),
        (inner_l4 + 2, idport, new_sport),
    ] {
        if old == new {
            continue;
        }
        ctx.store(off, &new, 0).map_err(fail)?;
        ctx.l4_csum_replace(icmp_csum, old as u64, new as u64, 2)
            .map_err(fail)?;
    }
    count(TcCounter::IcmpTranslated);
    Ok(ICMP_TRANSLATED)
}

/// An ICMPv6 error (RFC 4443: destination unreachable, packet too big, time exceeded)
/// directly after the fixed IPv6 header, quoting an IPv6 TCP/UDP packet of a translated
/// flow without extension headers: translated as [`on_icmp`] does for IPv4. The ICMPv6
/// checksum covers a pseudo-header with the outer addresses (RFC 4443 section 2.3), so
/// outer address changes update it (`BPF_F_PSEUDO_HDR`) as well as the quoted bytes do.
/// The quoted TCP/UDP checksum is left as it was, as for IPv4 (the quote may be truncated,
/// and receivers match errors by addresses and ports). Returns the verdict: a translated
/// error is passed on at egress and sent on with [`redirect_out`] at ingress.
#[inline(never)]
fn on_icmp6(ctx: &TcContext, ingress: bool) -> i32 {
    match try_icmp6(ctx, ingress) {
        Ok(v) | Err(v) => v,
    }
}

#[inline(always)]
fn try_icmp6(ctx: &TcContext, ingress: bool) -> Result<i32, i32> {
    let l4 = ETH_HLEN + IP6_HLEN;
    let ty: u8 = ctx.load(l4).map_err(|_| PASS)?;
    if ty != ICMP6_DEST_UNREACH && ty != ICMP6_PACKET_TOO_BIG && ty != ICMP6_TIME_EXCEEDED {
        return Ok(PASS); // NDP, echo, MLD, ...: never touched
    }
    let inner = l4 + 8;
    let inner_ver: u8 = ctx.load(inner).map_err(|_| PASS)?;
    if inner_ver >> 4 != 6 {
        return Ok(PASS);
    }
    let proto: u8 = ctx.load(inner + 6).map_err(|_| PASS)?;
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Ok(PASS);
    }
    let inner_l4 = inner + IP6_HLEN;
    let isport: u16 = ctx.load(inner_l4).map_err(|_| PASS)?;
    let idport: u16 = ctx.load(inner_l4 + 2).map_err(|_| PASS)?;
    // The addresses live in the scratch slot, not on the stack (16-byte arrays are copied
    // byte by byte there): `rkey`, the quoted packet reversed, is the key of the direction
    // this error travels (its saddr is the quoted destination, its daddr the quoted
    // source); `ekey` holds the outer addresses. (Both belong to new flows otherwise, which
    // never run during an ICMP error.)
    let Some(sc) = TC_SCRATCH.get_ptr_mut(0) else {
        return Ok(PASS);
    };
    // SAFETY: this CPU's slot, used only while this program runs.
    let sc = unsafe { &mut *sc };
    load16(ctx, inner + 8, &mut sc.rkey.daddr)?;
    load16(ctx, inner + 24, &mut sc.rkey.saddr)?;
    sc.rkey.sport = idport.to_ne_bytes();
    sc.rkey.dport = isport.to_ne_bytes();
    sc.rkey.proto = proto;
    sc.rkey._pad = [0; 3];
    let Some(e) = TC_CONNTRACK.get_ptr(&sc.rkey) else {
        return Ok(PASS);
    };
    // SAFETY: a value of the map, valid while this program runs; the addresses of an entry
    // are never written in place.
    let e = unsafe { &*e };
    let (new_sport, new_dport) = (u16::from_ne_bytes(e.sport), u16::from_ne_bytes(e.dport));
    let csum = l4 + 2;
    // Outer header (in the ICMPv6 pseudo-header): destination -> the entry's destination;
    // source -> the entry's source when the error comes from the flow's peer itself.
    load16(ctx, IP6_DST_OFF, &mut sc.ekey.daddr)?;
    load16(ctx, IP6_SRC_OFF, &mut sc.ekey.saddr)?;
    if sc.ekey.daddr != e.daddr {
        store_addr6(ctx, IP6_DST_OFF, &sc.ekey.daddr, &e.daddr, csum, BPF_F_PSEUDO_HDR)?;
        sc.ekey.daddr = e.daddr;
    }
    if sc.ekey.saddr == sc.rkey.saddr && sc.ekey.saddr != e.saddr {
        store_addr6(ctx, IP6_SRC_OFF, &sc.ekey.saddr, &e.saddr, csum, BPF_F_PSEUDO_HDR)?;
        sc.ekey.saddr = e.saddr;
    }
    // Quoted header (ICMPv6 payload): source -> the entry's destination, destination -> the
    // entry's source; then the ports.
    if sc.rkey.daddr != e.daddr {
        store_addr6(ctx, inner + 8, &sc.rkey.daddr, &e.daddr, csum, 0)?;
    }
    if sc.rkey.saddr != e.saddr {
        store_addr6(ctx, inner + 24, &sc.rkey.saddr, &e.saddr, csum, 0)?;
    }
    if isport != new_dport {
        ctx.store(inner_l4, &new_dport, 0).map_err(rewrite_failed)?;
        l4_csum6(ctx, csum, isport as u64, new_dport as u64, 2)?;
    }
    if idport != new_sport {
        ctx.store(inner_l4 + 2, &new_sport, 0)
            .map_err(rewrite_failed)?;
        l4_csum6(ctx, csum, idport as u64, new_sport as u64, 2)?;
    }
    count(TcCounter::IcmpTranslated);
    if ingress {
        return Ok(redirect_out(ctx, &sc.ekey.saddr, &sc.ekey.daddr));
    }
    Ok(PASS)
}

/// Loads the 16 bytes at `off` straight into `dst` (no stack temporary); `Err(PASS)` when
/// the packet is shorter.
#[inline(always)]
fn load16(ctx: &TcContext, off: usize, dst: &mut [u8; 16]) -> Result<(), i32> {
    // SAFETY: the helper writes exactly 16 bytes into `dst`.
    let r = unsafe {
        bpf_skb_load_bytes(
            ctx.skb.skb as *const _,
            off as u32,
            dst.as_mut_ptr() as *mut _,
            16,
        )
    };
    if r == 0 { Ok(()) } else { Err(PASS) }
}

/// Verdict of `on_icmp` for a translated error (then passed on, or redirected at ingress).
const ICMP_TRANSLATED: i32 = -3;
