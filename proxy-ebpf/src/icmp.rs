//! ICMP and ICMPv6 errors quoting a packet of a translated flow, translated like the
//! direction they travel, as the kernel's NAT does (RFC 5508).
//!
//! IPv4: destination unreachable (which includes "fragmentation needed" for path-MTU
//! discovery) and time exceeded. IPv6 (RFC 4443): destination unreachable, packet too big
//! (what IPv6 path-MTU discovery depends on, since IPv6 routers never fragment) and time
//! exceeded. Anything else (echo, neighbour discovery, MLD, ...) is never touched.
//!
//! The quoted packet went the other way, so its tuple reversed is the key of the entry of
//! the direction the error travels (the reply entry for an error from the backend's side,
//! the original entry for one from the client's side). That entry's rewrite gives the new
//! outer destination, the new outer source (when the error comes from the flow's peer
//! itself, not from a router on the way), and the quoted packet as its sender saw it (the
//! reverse of the rewrite). The ICMP checksum covers the quoted bytes (ICMPv4 has no
//! pseudo-header; ICMPv6's covers the outer addresses too, RFC 4443 section 2.3). The quoted
//! TCP/UDP checksum is left as it was (the quote may be truncated, and receivers match
//! errors by addresses and ports). A translated error is passed on at egress and sent on
//! with `fib::redirect_out` at ingress (its source may now be a node address).

// Map keys and values are passed by reference on purpose (a by-value key is copied onto the
// 512-byte BPF stack first).
#![allow(clippy::needless_borrows_for_generic_args)]

use proxy_common::{
    PROTO_TCP, PROTO_UDP,
    nat::{CtKey, TcCounter},
    v4_mapped,
};

use crate::{
    csum::{BPF_F_PSEUDO_HDR, failed, l4_csum6, ok, store_addr4, store_addr6},
    fib::redirect_out,
    maps::{TC_CONNTRACK, TC_SCRATCH},
    mem,
    packet::{
        Buf, ETH_HLEN, IP_DST_OFF, IP_SRC_OFF, IP6_DST_OFF, IP6_HLEN, IP6_SRC_OFF, PROTO_ICMP,
        PROTO_ICMPV6, Pkt,
    },
    stats::count_tc,
    verdict::Verdict,
};

const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
/// ICMPv6 error types (RFC 4443 section 3).
const ICMP6_DEST_UNREACH: u8 = 1;
const ICMP6_PACKET_TOO_BIG: u8 = 2;
const ICMP6_TIME_EXCEEDED: u8 = 3;

/// An ICMP packet (`pkt.l4()` is its header).
#[inline(never)]
pub fn on_icmp<B: Buf>(b: &B, pkt: &Pkt, ingress: bool) -> Verdict {
    match translate4(b, pkt.l4()) {
        Ok(true) if ingress => {
            let (Some(s), Some(d)) = (b.load::<u32>(IP_SRC_OFF), b.load::<u32>(IP_DST_OFF)) else {
                return Verdict::Pass;
            };
            redirect_out(b, &v4_mapped(s), &v4_mapped(d))
        }
        Ok(_) => Verdict::Pass,
        Err(v) => v,
    }
}

/// Translates an ICMP error at `l4` quoting a translated packet; `Ok(true)` when it did.
#[inline(always)]
fn translate4<B: Buf>(b: &B, l4: usize) -> Result<bool, Verdict> {
    let pass = Verdict::Pass;
    let ty: u8 = b.load(l4).ok_or(pass)?;
    if ty != ICMP_DEST_UNREACH && ty != ICMP_TIME_EXCEEDED {
        return Ok(false);
    }
    let inner = l4 + 8;
    let inner_vihl: u8 = b.load(inner).ok_or(pass)?;
    if inner_vihl >> 4 != 4 || inner_vihl & 0x0f < 5 {
        return Ok(false);
    }
    let inner_l4 = inner + ((inner_vihl & 0x0f) as usize) * 4;
    let proto: u8 = b.load(inner + 9).ok_or(pass)?;
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Ok(false);
    }
    let isrc: u32 = b.load(inner + 12).ok_or(pass)?;
    let idst: u32 = b.load(inner + 16).ok_or(pass)?;
    let isport: u16 = b.load(inner_l4).ok_or(pass)?;
    let idport: u16 = b.load(inner_l4 + 2).ok_or(pass)?;
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
        return Ok(false);
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
    let icmp_csum = l4 + 2;
    // Outer header: destination -> the entry's destination; source -> the entry's source
    // when the error comes from the flow's peer itself.
    let outer_src: u32 = b.load(IP_SRC_OFF).ok_or(pass)?;
    let outer_dst: u32 = b.load(IP_DST_OFF).ok_or(pass)?;
    if outer_dst != new_dst {
        store_addr4(b, IP_DST_OFF, outer_dst, new_dst, None, 0)?;
    }
    if outer_src == idst && outer_src != new_src {
        store_addr4(b, IP_SRC_OFF, outer_src, new_src, None, 0)?;
    }
    // Quoted header: source -> the entry's destination, destination -> the entry's source.
    // The ICMP checksum covers the quoted bytes, including the quoted IP checksum, which
    // changes too.
    let iphdr_csum = inner + 10;
    for (off, old, new) in [(inner + 12, isrc, new_dst), (inner + 16, idst, new_src)] {
        if old == new {
            continue;
        }
        let old_ck: u16 = b.load(iphdr_csum).ok_or(pass)?;
        ok(b.store(off, &new))?;
        ok(b.l3_csum_replace(iphdr_csum, old as u64, new as u64, 4))?;
        let new_ck: u16 = b.load(iphdr_csum).ok_or(pass)?;
        ok(b.l4_csum_replace(icmp_csum, old as u64, new as u64, 4))?;
        ok(b.l4_csum_replace(icmp_csum, old_ck as u64, new_ck as u64, 2))?;
    }
    for (off, old, new) in [
        (inner_l4, isport, new_dport),
        (inner_l4 + 2, idport, new_sport),
    ] {
        if old == new {
            continue;
        }
        ok(b.store(off, &new))?;
        ok(b.l4_csum_replace(icmp_csum, old as u64, new as u64, 2))?;
    }
    count_tc(TcCounter::IcmpTranslated);
    if crate::monitor::on() {
        crate::monitor::tuple_event(icmp_word(), &rkey, e);
    }
    Ok(true)
}

/// An ICMPv6 packet (`pkt.l4()` is its header, after any extension headers).
#[inline(never)]
pub fn on_icmp6<B: Buf>(b: &B, pkt: &Pkt, ingress: bool) -> Verdict {
    match translate6(b, pkt.l4(), ingress) {
        Ok(v) | Err(v) => v,
    }
}

#[inline(always)]
fn translate6<B: Buf>(b: &B, l4: usize, ingress: bool) -> Result<Verdict, Verdict> {
    let pass = Verdict::Pass;
    let ty: u8 = b.load(l4).ok_or(pass)?;
    if ty != ICMP6_DEST_UNREACH && ty != ICMP6_PACKET_TOO_BIG && ty != ICMP6_TIME_EXCEEDED {
        return Ok(pass);
    }
    let inner = l4 + 8;
    let inner_ver: u8 = b.load(inner).ok_or(pass)?;
    if inner_ver >> 4 != 6 {
        return Ok(pass);
    }
    let proto: u8 = b.load(inner + 6).ok_or(pass)?;
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Ok(pass);
    }
    let inner_l4 = inner + IP6_HLEN;
    let isport: u16 = b.load(inner_l4).ok_or(pass)?;
    let idport: u16 = b.load(inner_l4 + 2).ok_or(pass)?;
    // The addresses live in the scratch slot, not on the stack (16-byte arrays are copied
    // byte by byte there): `rkey`, the quoted packet reversed, is the key of the direction
    // this error travels (its saddr is the quoted destination, its daddr the quoted
    // source); `ekey` holds the outer addresses. (Both belong to new flows otherwise, which
    // never run during an ICMP error.)
    let Some(sc) = TC_SCRATCH.get_ptr_mut(0) else {
        return Ok(pass);
    };
    // SAFETY: this CPU's slot, used only while this program runs.
    let sc = unsafe { &mut *sc };
    if !b.load16(inner + 8, &mut sc.rkey.daddr) || !b.load16(inner + 24, &mut sc.rkey.saddr) {
        return Ok(pass);
    }
    sc.rkey.sport = idport.to_ne_bytes();
    sc.rkey.dport = isport.to_ne_bytes();
    mem::set_proto(&mut sc.rkey, proto);
    let Some(e) = TC_CONNTRACK.get_ptr(&sc.rkey) else {
        return Ok(pass);
    };
    // SAFETY: a value of the map, valid while this program runs; the addresses of an entry
    // are never written in place.
    let e = unsafe { &*e };
    let (new_sport, new_dport) = (u16::from_ne_bytes(e.sport), u16::from_ne_bytes(e.dport));
    let csum = l4 + 2;
    // Outer header (in the ICMPv6 pseudo-header): destination -> the entry's destination;
    // source -> the entry's source when the error comes from the flow's peer itself.
    if !b.load16(IP6_DST_OFF, &mut sc.ekey.daddr) || !b.load16(IP6_SRC_OFF, &mut sc.ekey.saddr) {
        return Ok(pass);
    }
    if sc.ekey.daddr != e.daddr {
        store_addr6(
            b,
            IP6_DST_OFF,
            &sc.ekey.daddr,
            &e.daddr,
            csum,
            BPF_F_PSEUDO_HDR,
        )?;
        sc.ekey.daddr = e.daddr;
    }
    if sc.ekey.saddr == sc.rkey.saddr && sc.ekey.saddr != e.saddr {
        store_addr6(
            b,
            IP6_SRC_OFF,
            &sc.ekey.saddr,
            &e.saddr,
            csum,
            BPF_F_PSEUDO_HDR,
        )?;
        sc.ekey.saddr = e.saddr;
    }
    // Quoted header (ICMPv6 payload): source -> the entry's destination, destination -> the
    // entry's source; then the ports.
    if sc.rkey.daddr != e.daddr {
        store_addr6(b, inner + 8, &sc.rkey.daddr, &e.daddr, csum, 0)?;
    }
    if sc.rkey.saddr != e.saddr {
        store_addr6(b, inner + 24, &sc.rkey.saddr, &e.saddr, csum, 0)?;
    }
    if isport != new_dport {
        if !b.store(inner_l4, &new_dport) {
            return Err(failed());
        }
        l4_csum6(b, csum, isport as u64, new_dport as u64, 2)?;
    }
    if idport != new_sport {
        if !b.store(inner_l4 + 2, &new_sport) {
            return Err(failed());
        }
        l4_csum6(b, csum, idport as u64, new_sport as u64, 2)?;
    }
    count_tc(TcCounter::IcmpTranslated);
    if crate::monitor::on() {
        crate::monitor::tuple_event(icmp_word(), &sc.rkey, e);
    }
    if ingress {
        return Ok(redirect_out(b, &sc.ekey.saddr, &sc.ekey.daddr));
    }
    Ok(pass)
}

/// The monitor event word of a translated ICMP error (a tuple event, see
/// `monitor::tuple_event`: the quoted flow's entry that matched).
#[inline(always)]
fn icmp_word() -> u64 {
    use proxy_common::monitor::{ALGORITHM_UNKNOWN, EVENT_F_TUPLE, EventKind, EventReason};
    crate::monitor::word(
        EventKind::IcmpTranslate,
        EventReason::None,
        EVENT_F_TUPLE,
        ALGORITHM_UNKNOWN,
        0,
    )
}

// ---------------------------------------------------------------------------------------
// Rejecting a flow: ICMP / ICMPv6 port unreachable built from the packet itself
// ---------------------------------------------------------------------------------------

/// ICMP destination unreachable code "port unreachable" (RFC 792).
const ICMP_PORT_UNREACH: u8 = 3;
/// ICMP destination unreachable code "fragmentation needed and DF set" (RFC 792, RFC 1191).
const ICMP_FRAG_NEEDED: u8 = 4;
/// ICMPv6 destination unreachable code "port unreachable" (RFC 4443 section 3.1).
const ICMP6_PORT_UNREACH: u8 = 4;
/// TTL / hop limit of a generated error (the kernel's `IPDEFTTL`).
const REJECT_TTL: u8 = 64;
/// Bytes of the rejected packet's L4 header quoted: at least the 8 that RFC 792 requires
/// (the ports the client's stack matches the error to its socket by), and for TCP its
/// whole 20-byte fixed header: a packet whose checksum is left to the device
/// (`CHECKSUM_PARTIAL`, e.g. from a local veth) cannot be cut short of its checksum field.
const QUOTED_UDP: usize = 8;
/// See [`QUOTED_UDP`].
const QUOTED_TCP: usize = 20;

/// The first bytes of the L4 header to quote (see [`QUOTED_UDP`]), zero-padded to 20, and
/// how many they are.
#[inline(always)]
fn quoted_l4<B: Buf>(b: &B, pkt: &Pkt) -> Option<([u8; QUOTED_TCP], usize)> {
    if pkt.key.proto == PROTO_TCP {
        Some((b.load::<[u8; QUOTED_TCP]>(pkt.l4())?, QUOTED_TCP))
    } else {
        let a = b.load::<[u8; QUOTED_UDP]>(pkt.l4())?;
        let mut l4 = [0u8; QUOTED_TCP];
        l4[..QUOTED_UDP].copy_from_slice(&a);
        Some((l4, QUOTED_UDP))
    }
}

/// Answers the first packet `pkt` of a flow to a frontend without endpoints, on the
/// interface it came in on, as kube-proxy's nftables mode does (its `reject` sends an
/// ICMP port unreachable for IPv4 and an ICMPv6 port unreachable for IPv6, for TCP too:
/// the client's connect() fails with ECONNREFUSED at once, a UDP socket gets ECONNREFUSED
/// on its next call). The packet becomes the error in place: cut to its IP header and the
/// first bytes of its L4 header ([`QUOTED_UDP`]), an IP and an ICMP header inserted after the
/// Ethernet header (MAC addresses swapped, IP addresses swapped: the error comes from the
/// frontend address the client addressed), and sent back out of the same interface.
///
/// Checksums without reading the quote back: a valid IPv4 header sums to zero in one's
/// complement, so the ICMP checksum of the quote is that of the quoted L4 bytes; the
/// ICMPv6 one adds the quoted IPv6 header, known field by field. An IPv6 packet with
/// extension headers (whose bytes would have to be summed too) is dropped instead. Counted
/// as `RejectedNoEndpoints`, or `DroppedNoEndpoints` when the answer cannot be built.
///
/// With `mtu` other than 0 the answer is an ICMP "fragmentation needed" (type 3, code 4)
/// or ICMPv6 "packet too big" naming that MTU instead (RFC 1191, RFC 8201): a direct server
/// return packet too big for the path once encapsulated (`dsr::encap`, counted there).
///
/// Run by `tc_reject`, the program `tc_ingress` tail-calls after `nat::new_flow` or a
/// tracked DSR flow returned [`Verdict::Reject`], so none of this adds to `tc_ingress`'s
/// verification.
#[inline(never)]
pub fn reject<B: Buf>(b: &B, pkt: &Pkt, mtu: u32) -> Verdict {
    let built = if pkt.v6 {
        reject6(b, pkt, mtu)
    } else {
        reject4(b, pkt, mtu)
    };
    if mtu != 0 {
        return if built {
            b.redirect(b.ifindex())
        } else {
            Verdict::Drop
        };
    }
    crate::klog::rejected(&pkt.key, built);
    if built {
        count_tc(TcCounter::RejectedNoEndpoints);
        b.redirect(b.ifindex())
    } else {
        count_tc(TcCounter::DroppedNoEndpoints);
        Verdict::Drop
    }
}

/// One's complement sum of the big-endian 16-bit words of `a`.
#[inline(always)]
pub(crate) fn sum16<const N: usize>(a: &[u8; N]) -> u32 {
    let mut s = 0u32;
    let mut i = 0;
    while i + 1 < N {
        s += u16::from_be_bytes([a[i], a[i + 1]]) as u32;
        i += 2;
    }
    s
}

/// The Internet checksum (RFC 1071) of a sum of words.
#[inline(always)]
pub(crate) fn finish(mut s: u32) -> [u8; 2] {
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    (!(s as u16)).to_be_bytes()
}

/// The Ethernet header of the answer to a frame whose header was `macs` (destination,
/// source) followed by `ethertype`: the addresses swapped.
#[inline(always)]
fn swapped_eth(macs: &[u8; 12], out: &mut [u8]) {
    out[..6].copy_from_slice(&macs[6..12]);
    out[6..12].copy_from_slice(&macs[..6]);
}

/// Builds the ICMP port unreachable (or, with `mtu`, fragmentation needed) for IPv4 packet
/// `pkt` in place.
#[inline(always)]
fn reject4<B: Buf>(b: &B, pkt: &Pkt, mtu: u32) -> bool {
    // The quote: the IP header (options included) and the first bytes of the L4 header.
    let ip_len = pkt.l4() - ETH_HLEN;
    let (Some(macs), Some((l4, l4_len))) = (b.load::<[u8; 12]>(0), quoted_l4(b, pkt)) else {
        return false;
    };
    let quote = ip_len + l4_len;
    if !b.truncate((ETH_HLEN + quote) as u32) || !b.grow_after_l2(20 + 8) {
        return false;
    }
    let k = &pkt.key;
    // Ethernet (14), IPv4 (20), ICMP (8).
    let mut h = [0u8; ETH_HLEN + 28];
    swapped_eth(&macs, &mut h);
    h[12] = 0x08;
    h[13] = 0x00;
    let total = (28 + quote) as u16;
    h[14] = 0x45;
    h[16..18].copy_from_slice(&total.to_be_bytes());
    h[22] = REJECT_TTL;
    h[23] = PROTO_ICMP;
    // Source: the address the client sent to; destination: the client.
    h[26..30].copy_from_slice(&k.daddr[12..16]);
    h[30..34].copy_from_slice(&k.saddr[12..16]);
    let mut ip = [0u8; 20];
    ip.copy_from_slice(&h[14..34]);
    let c = finish(sum16(&ip));
    h[24] = c[0];
    h[25] = c[1];
    let code = if mtu != 0 {
        ICMP_FRAG_NEEDED
    } else {
        ICMP_PORT_UNREACH
    };
    h[34] = ICMP_DEST_UNREACH;
    h[35] = code;
    // Next-hop MTU (RFC 1191), after 16 unused bits.
    let m = (mtu as u16).to_be_bytes();
    h[40] = m[0];
    h[41] = m[1];
    // The quoted IP header sums to zero; the quoted L4 bytes remain.
    let c = finish(((ICMP_DEST_UNREACH as u32) << 8 | code as u32) + (mtu & 0xffff) + sum16(&l4));
    h[36] = c[0];
    h[37] = c[1];
    b.store(0, &h)
}

/// Builds the ICMPv6 port unreachable (or, with `mtu`, packet too big) for IPv6 packet
/// `pkt` in place.
#[inline(always)]
fn reject6<B: Buf>(b: &B, pkt: &Pkt, mtu: u32) -> bool {
    if pkt.l4() != ETH_HLEN + IP6_HLEN {
        return false; // extension headers: see `reject`
    }
    // The fixed header's first 8 bytes (version .. hop limit), then the L4 bytes.
    let (Some(macs), Some(first), Some((l4, l4_len))) = (
        b.load::<[u8; 12]>(0),
        b.load::<[u8; 8]>(ETH_HLEN),
        quoted_l4(b, pkt),
    ) else {
        return false;
    };
    let quote = IP6_HLEN + l4_len;
    if !b.truncate((ETH_HLEN + quote) as u32) || !b.grow_after_l2((IP6_HLEN + 8) as u32) {
        return false;
    }
    let k = &pkt.key;
    // Ethernet (14), IPv6 (40), ICMPv6 (8).
    let mut h = [0u8; ETH_HLEN + IP6_HLEN + 8];
    swapped_eth(&macs, &mut h);
    h[12] = 0x86;
    h[13] = 0xdd;
    h[14] = 0x60;
    let payload = (8 + quote) as u16;
    h[18..20].copy_from_slice(&payload.to_be_bytes());
    h[20] = PROTO_ICMPV6;
    h[21] = REJECT_TTL;
    h[22..38].copy_from_slice(&k.daddr);
    h[38..54].copy_from_slice(&k.saddr);
    let (ty, code) = if mtu != 0 {
        (ICMP6_PACKET_TOO_BIG, 0)
    } else {
        (ICMP6_DEST_UNREACH, ICMP6_PORT_UNREACH)
    };
    h[54] = ty;
    h[55] = code;
    // The MTU (RFC 4443 section 3.2) where the port unreachable has 32 unused bits.
    h[58..62].copy_from_slice(&mtu.to_be_bytes());
    // Pseudo-header (the answer's addresses, length, next header), the ICMPv6 header, and
    // the quote: the original header (the same two addresses again) and the L4 bytes.
    let addrs = sum16(&k.saddr) + sum16(&k.daddr);
    let s = 2 * addrs
        + payload as u32
        + PROTO_ICMPV6 as u32
        + ((ty as u32) << 8 | code as u32)
        + (mtu >> 16)
        + (mtu & 0xffff)
        + sum16(&first)
        + sum16(&l4);
    let c = finish(s);
    h[56] = c[0];
    h[57] = c[1];
    b.store(0, &h)
}
