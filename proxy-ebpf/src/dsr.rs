//! Direct server return (DSR) for flows entering the node from outside, both ends (the
//! encapsulation, why it carries everything, and the map are described at
//! `proxy_common::nat::DSR`):
//! - entry node: [`applies`] tells `nat::new_flow` to track a new flow to a remote backend
//!   as DSR instead of source-NATing it; [`encap`] sends each of its packets to the backend
//!   inside an outer IP header, unchanged inside, towards the next hop of a FIB lookup. A
//!   packet too big for the path once encapsulated is answered with ICMP "fragmentation
//!   needed" / ICMPv6 "packet too big" naming the MTU left after the outer header (built by
//!   `tc_reject`), so path-MTU discovery works through the encapsulation.
//! - backend's node: [`decap`] takes an encapsulated packet whose outer destination is
//!   one of this node's endpoints and whose (frontend, backend) pair is in `TC_DSR`, strips
//!   the outer header and translates the inner packet to the backend as for a local backend
//!   (two conntrack entries, [`CT_F_DSR_DECAP`]); its replies leave this node from the
//!   frontend address (`tc_egress`, the reply entry), with the MSS of the backend's SYN-ACK
//!   lowered by the encapsulation's overhead ([`clamp_mss`]) so the client's segments fit
//!   once encapsulated.
//!
//! XDP leaves DSR flows to tcx (`Buf::ENCAPSULATES`): it starts their conntrack entries like
//! any new flow, and tcx ingress encapsulates.

// Map keys are passed by reference on purpose (BPF stack).
#![allow(clippy::needless_borrows_for_generic_args)]

use proxy_common::{
    FRONTEND_F_DSR, Frontend, FrontendKey, PROTO_TCP, PROTO_UDP, SCOPE_INGRESS,
    nat::{
        CT_F_DSR_DECAP, CT_F_REPLY, CtEntry, DSR_OVERHEAD_V4, DSR_OVERHEAD_V6, DsrKey,
        TC_CFG_MASQUERADE_ALL, TcCounter,
    },
    v4_mapped,
};

use crate::{
    csum::{failed, rewrite},
    ct::track_pair,
    fib,
    icmp::{finish, sum16},
    maps::{
        FRONTENDS, TC_CONFIG, TC_CONNTRACK, TC_DSR, TC_IFACE_ADDRS, TC_LOCAL_ENDPOINTS, TC_SCRATCH,
    },
    mem,
    packet::{
        Buf, ETH_HLEN, IP6_HLEN, Kind, PROTO_IPIP, PROTO_IPV6, Pkt, TCP_SYN, l4_csum_off, parse,
    },
    stats::{count_packet, count_tc, drop_with},
    verdict::Verdict,
};

/// `bpf_fib_lookup` results: route and neighbour found; no neighbour entry yet; the packet
/// is bigger than the route's MTU (`mtu_result` holds it).
const FIB_OK: i64 = 0;
const FIB_NO_NEIGH: i64 = 7;
const FIB_FRAG_NEEDED: i64 = 8;
/// TTL / hop limit of the outer header (the kernel's `IPDEFTTL`).
const OUTER_TTL: u8 = 64;
/// Most TCP options walked looking for the MSS (40 bytes of options hold at most this many
/// that are not padding).
const MAX_TCP_OPTIONS: usize = 10;
/// TCP option kinds (RFC 9293): end of list, no-op, maximum segment size.
const TCPOPT_EOL: u8 = 0;
const TCPOPT_NOP: u8 = 1;
const TCPOPT_MSS: u8 = 2;

/// Whether a new flow of ingress frontend `fe` to the backend at `addr` goes DSR: the
/// frontend says so ([`FRONTEND_F_DSR`]), it is not a cluster IP reached from outside
/// (kube-proxy masquerades those), `--masquerade-all` is off (it asks for every flow to be
/// masqueraded), and the backend runs on another node (a local one keeps the client address
/// anyway).
#[inline(always)]
pub fn applies(fe: &Frontend, addr: &[u8; 16], cluster_ip: bool) -> bool {
    if fe.flags & FRONTEND_F_DSR == 0 || cluster_ip {
        return false;
    }
    if TC_CONFIG
        .get(0)
        .is_some_and(|c| c.flags & TC_CFG_MASQUERADE_ALL != 0)
    {
        return false;
    }
    TC_LOCAL_ENDPOINTS.get_ptr(addr).is_none()
}

/// Sends packet `pkt` of a DSR flow whose original entry is `e` to its backend: an outer
/// IPv4 (DF set, TOS copied) or IPv6 header (traffic class and flow label copied) from
/// `e.saddr` (this node's address) to `e.daddr` (the backend) inserted after the Ethernet
/// header, then out of the FIB lookup's interface to its next hop (`bpf_redirect_neigh`
/// when the neighbour is not known yet). Too big for the route's MTU once encapsulated
/// (a GSO packet is segmented to fit instead): [`Verdict::Reject`] with the MTU left for
/// the inner packet in the scratch slot's `reject_mtu`, for `tc_reject` to answer; an IPv4
/// packet that allows fragmentation is dropped (counted as [`TcCounter::DsrTooBig`] both
/// ways). Its own BPF function (stack).
#[inline(never)]
pub fn encap<B: Buf>(b: &B, pkt: &Pkt, e: &CtEntry) -> Verdict {
    let v6 = pkt.v6;
    let over = if v6 { DSR_OVERHEAD_V6 } else { DSR_OVERHEAD_V4 };
    let inner = b.len().saturating_sub(ETH_HLEN as u32);
    let total = inner + over;
    if !v6 && total > 0xffff && !b.is_gso() {
        return drop_with(TcCounter::DsrTooBig);
    }
    // The MTU check applies to a packet as it goes on the wire; a GSO packet is cut into
    // segments that fit (the encapsulation flags shrink its segment size).
    let ip_len = if b.is_gso() { 0 } else { total as u16 };
    let Some((r, f)) = fib::lookup(b, &e.saddr, &e.daddr, ip_len) else {
        return Verdict::Drop;
    };
    if r == FIB_FRAG_NEEDED {
        // SAFETY: the union field the helper sets on this result.
        let mtu = unsafe { f.__bindgen_anon_1.mtu_result } as u32;
        count_tc(TcCounter::DsrTooBig);
        let df = v6 || b.load::<u8>(ETH_HLEN + 6).is_some_and(|x| x & 0x40 != 0);
        if !df {
            return Verdict::Drop;
        }
        let Some(sc) = TC_SCRATCH.get_ptr_mut(0) else {
            return Verdict::Drop;
        };
        // SAFETY: this CPU's slot.
        unsafe { (*sc).reject_mtu = mtu.saturating_sub(over) };
        return Verdict::Reject;
    }
    if r != FIB_OK && r != FIB_NO_NEIGH {
        return failed();
    }
    let (ifindex, smac, dmac) = (f.ifindex, f.smac, f.dmac);
    // What the outer header copies from the inner one: IPv4's TOS; IPv6's first word
    // (version, traffic class, flow label).
    let Some(first) = b.load::<[u8; 4]>(ETH_HLEN) else {
        return failed();
    };
    if !b.encap_room(over, v6) {
        return failed();
    }
    let written = if v6 {
        let mut h = [0u8; IP6_HLEN];
        h[..4].copy_from_slice(&first);
        h[4..6].copy_from_slice(&(inner as u16).to_be_bytes());
        h[6] = PROTO_IPV6;
        h[7] = OUTER_TTL;
        h[8..24].copy_from_slice(&e.saddr);
        h[24..40].copy_from_slice(&e.daddr);
        b.store(ETH_HLEN, &h)
    } else {
        let mut h = [0u8; 20];
        h[0] = 0x45;
        h[1] = first[1];
        h[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        h[6] = 0x40; // DF: the path's MTU is handled here, not by fragments
        h[8] = OUTER_TTL;
        h[9] = PROTO_IPIP;
        h[12..16].copy_from_slice(&e.saddr[12..16]);
        h[16..20].copy_from_slice(&e.daddr[12..16]);
        let c = finish(sum16(&h));
        h[10] = c[0];
        h[11] = c[1];
        b.store(ETH_HLEN, &h)
    };
    if !written {
        return failed();
    }
    count_tc(TcCounter::DsrEncapsulated);
    if r == FIB_NO_NEIGH {
        return b.redirect_neigh(ifindex);
    }
    if !b.store(0, &dmac) || !b.store(6, &smac) {
        return failed();
    }
    b.redirect(ifindex)
}

/// An encapsulated packet (`Kind::Encap`, outer addresses in `pkt.key`) at tcx ingress of an
/// external interface. Not for this node's DSR (the outer destination is no endpoint here,
/// or the pair is not in `TC_DSR`, counted as [`TcCounter::DsrUnknown`]): `Some(Pass)`, left
/// alone for whoever tunnels to that address. Otherwise the outer header is removed, `pkt`
/// is parsed anew (the inner packet: a packet of a tracked flow, or one to start with
/// [`accept`]), the backend and its port are left in the scratch slot, and the answer is
/// `None`. Its own BPF function (stack); the caller goes on as for any packet, so the
/// tracked path is not nested under this frame.
#[inline(never)]
pub fn decap<B: Buf>(b: &B, pkt: &mut Pkt) -> Option<Verdict> {
    if TC_LOCAL_ENDPOINTS.get_ptr(&pkt.key.daddr).is_none() {
        return Some(Verdict::Pass);
    }
    let v6 = pkt.v6;
    let over = pkt.l4() - ETH_HLEN;
    if over != if v6 { IP6_HLEN } else { 20 } {
        return Some(Verdict::Pass); // outer options or extension headers: not ours
    }
    let Some(port) = lookup(b, pkt) else {
        count_tc(TcCounter::DsrUnknown);
        return Some(Verdict::Pass);
    };
    let Some(sc) = TC_SCRATCH.get_ptr_mut(0) else {
        return Some(Verdict::Drop);
    };
    // SAFETY: this CPU's slot, used only while this program runs.
    let sc = unsafe { &mut *sc };
    sc.dsr_backend = pkt.key.daddr;
    sc.dsr_port = port;
    if !b.decap_room(over as u32, v6) {
        return Some(failed());
    }
    if parse(b, pkt) != Kind::Flow || pkt.v6 != v6 {
        count_tc(TcCounter::DsrUnknown);
        return Some(Verdict::Drop);
    }
    None
}

/// The backend port `TC_DSR` gives the encapsulated packet `pkt` (outer addresses in
/// `pkt.key`, inner header at `pkt.l4()`): its inner destination and protocol, with the outer
/// destination as the backend; the frontend address as it is (external and LB IPs), else
/// zero (a node port, on whichever node's address). A packet of a flow this node already
/// tracks for that backend ([`CT_F_DSR_DECAP`]) is accepted without the pair: the pair goes
/// when the endpoint stops being ready or the Service leaves DSR, and the connections it
/// carries go on, as they would with SNAT. The inner tuple is left in the scratch slot's
/// `ekey`.
#[inline(always)]
fn lookup<B: Buf>(b: &B, pkt: &Pkt) -> Option<[u8; 2]> {
    let sc = TC_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot, used only while this program runs.
    let sc = unsafe { &mut *sc };
    let inner = pkt.l4();
    let mut key = DsrKey {
        frontend: [0; 16],
        backend: pkt.key.daddr,
        port: [0; 2],
        proto: 0,
        _pad: 0,
    };
    let l4 = if pkt.v6 {
        // The inner IPv6 header without extension headers, then TCP or UDP.
        let w: [u8; 8] = b.load(inner)?;
        if w[0] >> 4 != 6 {
            return None;
        }
        key.proto = w[6];
        if !b.load16(inner + 24, &mut key.frontend) || !b.load16(inner + 8, &mut sc.ekey.saddr) {
            return None;
        }
        inner + IP6_HLEN
    } else {
        let w: [u8; 12] = b.load(inner)?;
        if w[0] >> 4 != 4 || (w[0] & 0x0f) < 5 {
            return None;
        }
        key.proto = w[9];
        let sa: u32 = b.load(inner + 12)?;
        let d: u32 = b.load(inner + 16)?;
        sc.ekey.saddr = v4_mapped(sa);
        key.frontend = v4_mapped(d);
        inner + ((w[0] & 0x0f) as usize) * 4
    };
    if key.proto != PROTO_TCP && key.proto != PROTO_UDP {
        return None;
    }
    let ports: [u8; 4] = b.load(l4)?;
    key.port = [ports[2], ports[3]];
    sc.ekey.daddr = key.frontend;
    sc.ekey.sport = [ports[0], ports[1]];
    sc.ekey.dport = key.port;
    mem::set_proto(&mut sc.ekey, key.proto);
    // SAFETY: the value is copied out at once.
    if let Some(t) = unsafe { TC_DSR.get(&key) } {
        return Some(t.port);
    }
    key.frontend = [0; 16];
    // SAFETY: as above.
    if let Some(t) = unsafe { TC_DSR.get(&key) } {
        return Some(t.port);
    }
    let e = TC_CONNTRACK.get_ptr(&sc.ekey)?;
    // SAFETY: a value of the map, read field by field.
    unsafe {
        ((*e).flags & (CT_F_DSR_DECAP | CT_F_REPLY) == CT_F_DSR_DECAP
            && (*e).daddr == pkt.key.daddr)
            .then_some((*e).dport)
    }
}

/// Starts the flow of a decapsulated packet `pkt` (client -> frontend) to the backend in the
/// scratch slot's `dsr_backend`, listening on `dsr_port` ([`decap`] left both there): the
/// original entry (client ->
/// backend) and the reply entry (backend -> client becomes frontend -> client), both
/// [`CT_F_DSR_DECAP`], then the packet's rewrite. Counted as a new flow of the frontend's
/// Service on this node (found by its address, or for a node port by this node's address on
/// the interface).
/// Its own BPF function (stack).
#[inline(never)]
pub fn accept<B: Buf>(b: &B, pkt: &Pkt, now: u64) -> Verdict {
    let Some(sc) = TC_SCRATCH.get_ptr_mut(0) else {
        return Verdict::Drop;
    };
    // SAFETY: this CPU's slot, used only while this program runs.
    let sc = unsafe { &mut *sc };
    let k = &pkt.key;
    let sid = service_of(b, pkt);
    sc.fwd = CtEntry {
        saddr: k.saddr,
        daddr: sc.dsr_backend,
        sport: k.sport,
        dport: sc.dsr_port,
        flags: CT_F_DSR_DECAP,
        _pad: 0,
        service_id: sid,
        peer_tick: 0,
        last_seen_ns: now,
    };
    sc.rev = CtEntry {
        saddr: k.daddr,
        daddr: k.saddr,
        sport: k.dport,
        dport: k.sport,
        flags: CT_F_REPLY | CT_F_DSR_DECAP,
        _pad: 0,
        service_id: sid,
        peer_tick: 0,
        last_seen_ns: now,
    };
    if let Err(c) = track_pair(&pkt.key, sc) {
        return drop_with(c);
    }
    count_tc(TcCounter::NewFlow);
    count_tc(TcCounter::DsrDecapsulated);
    count_packet(sid, b.len());
    rewrite(b, pkt, &sc.fwd)
}

/// The service id of the ingress frontend a decapsulated packet names on this node: its
/// destination as it is (external and LB IPs), else, for a node port (the packet names the
/// entry node's address), this node's address of the family on the interface. 0 when
/// neither is a frontend here.
#[inline(never)]
fn service_of<B: Buf>(b: &B, pkt: &Pkt) -> u32 {
    let k = &pkt.key;
    let mut key = FrontendKey {
        addr: k.daddr,
        port: k.dport,
        proto: k.proto,
        scope: SCOPE_INGRESS,
    };
    // SAFETY: the value is read at once.
    if let Some(fe) = unsafe { FRONTENDS.get(&key) } {
        return fe.service_id;
    }
    let Some(a) = TC_IFACE_ADDRS.get_ptr(b.ifindex()) else {
        return 0;
    };
    // SAFETY: value of the map, copied.
    key.addr = unsafe { if pkt.v6 { (*a).v6 } else { (*a).v4 } };
    // SAFETY: as above.
    unsafe { FRONTENDS.get(&key) }.map_or(0, |fe| fe.service_id)
}

/// Lowers the MSS option of TCP SYN `pkt` (a backend's SYN-ACK leaving the backend's node
/// on a DSR flow) by the encapsulation's overhead of its family, so that what the client
/// sends in one segment still fits the path once the entry node encapsulates it. The
/// checksum follows. A SYN without an MSS option is left as it is.
#[inline(never)]
pub fn clamp_mss<B: Buf>(b: &B, pkt: &Pkt) {
    if pkt.key.proto != PROTO_TCP || b.load::<u8>(pkt.l4() + 13).is_none_or(|f| f & TCP_SYN == 0) {
        return;
    }
    let Some(doff) = b.load::<u8>(pkt.l4() + 12) else {
        return;
    };
    let end = pkt.l4() + ((doff >> 4) as usize) * 4;
    let over = if pkt.v6 {
        DSR_OVERHEAD_V6
    } else {
        DSR_OVERHEAD_V4
    } as u16;
    let mut off = pkt.l4() + 20;
    for _ in 0..MAX_TCP_OPTIONS {
        if off + 4 > end {
            return;
        }
        let Some(kind) = b.load::<u8>(off) else {
            return;
        };
        match kind {
            TCPOPT_EOL => return,
            TCPOPT_NOP => off += 1,
            _ => {
                let Some(len) = b.load::<u8>(off + 1) else {
                    return;
                };
                if kind == TCPOPT_MSS && len == 4 {
                    let Some(old) = b.load::<u16>(off + 2) else {
                        return;
                    };
                    let mss = u16::from_be(old);
                    if mss <= over + 536 {
                        return; // already small: the IPv4 minimum MSS stays the floor
                    }
                    let new = (mss - over).to_be();
                    if b.store(off + 2, &new) {
                        let _ = b.l4_csum_replace(
                            pkt.l4() + l4_csum_off(PROTO_TCP),
                            old as u64,
                            new as u64,
                            2,
                        );
                    }
                    return;
                }
                if len < 2 {
                    return;
                }
                off += len as usize;
            }
        }
    }
}
