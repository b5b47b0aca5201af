//! Packet access and parsing, for every packet hook.
//!
//! [`Buf`] is what a hook offers to read and change a packet (the tc context implements it
//! with the skb helpers in `tcbuf`, the XDP context in `xdp` with direct packet access). [`parse`] finds the tuple of an Ethernet frame carrying IPv4 or IPv6:
//! - IPv4: version 4, a header length of at least 20 bytes (options are skipped, never
//!   read), a total length that fits the frame; a fragment other than the first has no ports
//!   and is left alone (its verdict is "other");
//! - IPv6: the fixed header, then up to [`MAX_EXT_HEADERS`] extension headers (hop-by-hop,
//!   destination options, routing without segments left, fragment); a fragment other than
//!   the first, a routing header with segments left (the destination is then not the final
//!   one, which the L4 checksum covers), AH, ESP and unknown headers are "other";
//!   IPv4-mapped addresses are "other" too (never valid on the wire, RFC 4291 2.5.5.2, and
//!   they would alias the IPv4 flows' IPv4-mapped tuples).
//!
//! Anything malformed (truncated, bad lengths) is "other": the hook lets it through
//! untouched and the kernel's own checks drop it.

use aya_ebpf::bindings::bpf_fib_lookup as FibParams;
use proxy_common::{
    PROTO_TCP, PROTO_UDP, is_v4_mapped,
    nat::{CtEntry, CtKey},
};

use crate::{mem, verdict::Verdict};

/// Length of an Ethernet header.
pub const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
/// IANA protocol number of ICMP.
pub const PROTO_ICMP: u8 = 1;
/// IANA protocol number of ICMPv6.
pub const PROTO_ICMPV6: u8 = 58;
/// IANA protocol number of IPv4 encapsulated in IP (RFC 2003): DSR's IPv4 encapsulation.
pub const PROTO_IPIP: u8 = 4;
/// IANA protocol number of IPv6 encapsulated in IP (RFC 2473): DSR's IPv6 encapsulation.
pub const PROTO_IPV6: u8 = 41;
/// Length of the fixed IPv6 header (RFC 8200 section 3).
pub const IP6_HLEN: usize = 40;
/// Offset of the IPv6 source address in the frame.
pub const IP6_SRC_OFF: usize = ETH_HLEN + 8;
/// Offset of the IPv6 destination address in the frame.
pub const IP6_DST_OFF: usize = ETH_HLEN + 24;
/// Offset of the IPv4 header checksum in the frame.
pub const IP_CSUM_OFF: usize = ETH_HLEN + 10;
/// Offset of the IPv4 source address in the frame.
pub const IP_SRC_OFF: usize = ETH_HLEN + 12;
/// Offset of the IPv4 destination address in the frame.
pub const IP_DST_OFF: usize = ETH_HLEN + 16;
/// Most IPv6 extension headers walked before giving up ("other").
pub const MAX_EXT_HEADERS: u32 = 4;
/// IPv6 extension header numbers (RFC 8200 section 4).
const IP6_HOPOPTS: u8 = 0;
const IP6_ROUTING: u8 = 43;
const IP6_FRAGMENT: u8 = 44;
const IP6_DSTOPTS: u8 = 60;
/// TCP flag bits (byte 13 of the header).
pub const TCP_FIN: u8 = 0x01;
/// See [`TCP_FIN`].
pub const TCP_SYN: u8 = 0x02;
/// See [`TCP_FIN`].
pub const TCP_RST: u8 = 0x04;
/// See [`TCP_FIN`].
pub const TCP_ACK: u8 = 0x10;

/// The packet operations the shared modules need from a hook. Offsets count from the start
/// of the frame; multi-byte values are in the packet's (network) byte order.
pub trait Buf {
    /// Reads a `T` at `off`; `None` past the end.
    fn load<T>(&self, off: usize) -> Option<T>;
    /// The part of the frame the program reaches without a helper, as the addresses
    /// `(data, data_end)`: the linear part of an skb, the first buffer of an XDP frame
    /// ([`parse`]'s fast path reads there).
    fn linear(&self) -> (usize, usize);
    /// Reads 16 bytes at `off` straight into `dst` (no stack temporary).
    fn load16(&self, off: usize, dst: &mut [u8; 16]) -> bool;
    /// Writes `v` at `off`.
    fn store<T>(&self, off: usize, v: &T) -> bool;
    /// `bpf_l3_csum_replace`: updates the checksum at `off` for a `size`-byte change.
    fn l3_csum_replace(&self, off: usize, from: u64, to: u64, size: u64) -> bool;
    /// `bpf_l4_csum_replace`: as `l3_csum_replace`, with the `BPF_F_*` flags in `flags`.
    fn l4_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> bool;
    /// Length of the frame in bytes.
    fn len(&self) -> u32;
    /// Index of the interface the packet is on.
    fn ifindex(&self) -> u32;
    /// `bpf_fib_lookup` with `params`; the helper's return value.
    fn fib_lookup(&self, params: &mut FibParams) -> i64;
    /// Sends the packet out of `ifindex` as it is.
    fn redirect(&self, ifindex: u32) -> Verdict;
    /// Sends the packet out of `ifindex`, the kernel resolving the next hop's address.
    fn redirect_neigh(&self, ifindex: u32) -> Verdict;
    /// Sends a packet translated at ingress whose source is now one of this node's
    /// addresses (the stack would drop it as a martian) on to its next hop, the route from
    /// `src` to `dst`. tc: `fib::redirect_out` (FIB lookup, then a redirect; the kernel
    /// resolves a missing neighbour). A hook that must know the next hop before it
    /// translates (XDP: it cannot resolve neighbours, and an untranslated packet is what it
    /// hands to the stack) looks it up first and uses that result here.
    fn send_out(&self, src: &[u8; 16], dst: &[u8; 16]) -> Verdict;
    /// Inserts `len` bytes right after the Ethernet header (their content is undefined until
    /// written); the rest of the frame moves back by `len`.
    fn grow_after_l2(&self, len: u32) -> bool;
    /// Cuts the frame to its first `len` bytes.
    fn truncate(&self, len: u32) -> bool;
    /// Whether the packet is a GSO packet (several segments, cut to size on the way out).
    fn is_gso(&self) -> bool {
        false
    }
    /// The monitor's `HOOK_*` naming this hook in its events; `ingress` tells tc's two
    /// directions apart (XDP has one).
    fn hook(ingress: bool) -> u8;
    /// Whether the hook sends direct server return flows encapsulated itself (`dsr`);
    /// a hook that does not leaves their packets to one that does (XDP to tcx).
    const ENCAPSULATES: bool;
    /// Inserts room for an outer IPv6 (`v6`) or IPv4 header of `len` bytes right after the
    /// Ethernet header, as [`Buf::grow_after_l2`], telling the packet's metadata (GSO) that
    /// it is now encapsulated.
    fn encap_room(&self, len: u32, v6: bool) -> bool;
    /// Removes the `len` bytes of an outer header right after the Ethernet header.
    fn decap_room(&self, len: u32, v6: bool) -> bool;
    /// Rewrites an IPv4 packet without options to the tuple `saddr`, `daddr` (network
    /// order in memory), `ports` (source then destination port, as the packet holds them)
    /// with its checksums, by direct packet access in one global BPF function (verified
    /// once, whatever the caller's state). `proto`: the packet's IANA protocol (TCP or
    /// UDP). [`crate::csum::DIRECT_DONE`], [`crate::csum::DIRECT_UNFIT`] (nothing done) or
    /// [`crate::csum::DIRECT_FAILED`].
    ///
    /// Called only inside [`Buf::rewrite`]'s global function.
    fn rewrite4_direct(&self, saddr: u32, daddr: u32, ports: u32, proto: u32) -> i32;
    /// `crate::csum::rewrite_any` of the packet `pkt` to `to`'s tuple, in a global BPF
    /// function of the hook: the verifier checks it once (its arguments the context and
    /// two pointers to memory of their types' sizes), not once per state of each caller.
    fn rewrite(&self, pkt: &Pkt, to: &CtEntry) -> i32;
}

/// A parsed IPv4 or IPv6 packet: its tuple (for TCP and UDP) and where its fields are.
pub struct Pkt {
    /// The packet's tuple, also the conntrack key of its direction (TCP and UDP only).
    pub key: CtKey,
    /// Offset of the L4 header in the frame ([`Pkt::l4`]): 32 bits, so that the whole
    /// `Pkt` takes 48 bytes of the entry points' frames, not 56 (the packet programs' call
    /// chains share the 512-byte stack).
    l4_off: u32,
    /// An IPv6 packet (plain IPv6 addresses in `key`), else IPv4 (IPv4-mapped).
    pub v6: bool,
}

impl Pkt {
    /// Offset of the L4 header in the frame.
    #[inline(always)]
    pub fn l4(&self) -> usize {
        self.l4_off as usize
    }

    /// An empty packet to parse into, in `slot` (one per program, in its frame): zeroed
    /// in place as six 64-bit words. Plain zeroing would become a call to the byte-by-byte
    /// `memset` (the object is built with in-order memory intrinsics), 45 loop turns per
    /// packet; a zeroed value returned by value would take a second copy in the frame.
    #[inline(always)]
    pub fn init(slot: &mut core::mem::MaybeUninit<Pkt>) -> &mut Pkt {
        let w = slot.as_mut_ptr() as *mut u64;
        // SAFETY: `Pkt` is 48 bytes, 8-byte aligned (its key is), and all-zero is a valid
        // `Pkt` (a zero key, offset 0, `v6` false); volatile so the six stores stay stores.
        unsafe {
            for i in 0..core::mem::size_of::<Pkt>() / 8 {
                w.add(i).write_volatile(0);
            }
            slot.assume_init_mut()
        }
    }
}

/// What [`parse`] found.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// TCP or UDP: `key`, `l4` and `v6` are set.
    Flow,
    /// ICMP over IPv4: `l4` is set.
    Icmp,
    /// ICMPv6: `l4` and `v6` are set.
    Icmp6,
    /// An IP packet carrying an IP packet of the same family (IPIP, IPv6-in-IPv6: direct
    /// server return's encapsulation): `key.saddr` and `key.daddr` are the outer addresses,
    /// `l4` the offset of the inner header, `v6` set for IPv6.
    Encap,
    /// Anything else, malformed input included: left alone.
    Other,
}

/// Offset of the L4 checksum of `proto` relative to the L4 header.
#[inline(always)]
pub fn l4_csum_off(proto: u8) -> usize {
    if proto == PROTO_TCP { 16 } else { 6 }
}

/// Parses the frame into `pkt` (see the module documentation).
#[inline(always)]
pub fn parse<B: Buf>(b: &B, pkt: &mut Pkt) -> Kind {
    if let Some(k) = parse_v4_fast(b, pkt) {
        return k;
    }
    let Some(ethertype) = b.load::<u16>(12) else {
        return Kind::Other;
    };
    match u16::from_be(ethertype) {
        ETH_P_IP => parse_v4(b, pkt).unwrap_or(Kind::Other),
        ETH_P_IPV6 => parse_v6(b, pkt),
        _ => Kind::Other,
    }
}

/// Writes the conntrack key of an IPv4 TCP or UDP packet into `key`: addresses as read
/// from it (network order in memory), IPv4-mapped; the ports' four bytes as they stand.
/// Written as the key's five 64-bit words (the target is little-endian): field by field,
/// the compiler stores the mapped addresses byte by byte and zeroes the rest with calls to
/// the byte-loop `memset`.
#[inline(always)]
fn write_key4(key: &mut CtKey, saddr: u32, daddr: u32, ports: u32, proto: u8) {
    // Bytes 8..16 of an IPv4-mapped address: 0, 0, 0xff, 0xff, then the address.
    let mapped = |a: u32| 0xffff_0000u64 | ((a as u64) << 32);
    let w = key as *mut CtKey as *mut u64;
    // SAFETY: `CtKey` is 40 bytes, 8-byte aligned; any bytes are a valid key.
    unsafe {
        w.write_volatile(0);
        w.add(1).write(mapped(saddr));
        w.add(2).write_volatile(0);
        w.add(3).write(mapped(daddr));
        w.add(4).write(ports as u64 | ((proto as u64) << 32));
    }
}

/// Bytes the fast path reads: Ethernet, an IPv4 header without options, and the ports.
const FAST_V4_LEN: usize = ETH_HLEN + 20 + 4;
/// ... and up to the TCP flags, for [`tcp_flags`].
const FAST_TCP_LEN: usize = ETH_HLEN + 20 + 14;

/// The common packet read in place, without a helper call per field: IPv4 without options,
/// not a later fragment, TCP or UDP, every byte [`parse_v4`] reads within the linear part
/// of the frame. One bounds check, then loads at constant offsets, the pattern the
/// verifier follows whatever the compiler makes of it. `None` for anything else: the full
/// parse through the helpers decides, with the same rules. Inlined: as a BPF function its
/// call and return cost about 10 ns per packet where returns are mitigated
/// (`spec_rstack_overflow`), and every program's stack still fits with it inline.
#[inline(always)]
fn parse_v4_fast<B: Buf>(b: &B, pkt: &mut Pkt) -> Option<Kind> {
    let (data, end) = b.linear();
    if data + FAST_V4_LEN > end {
        return None;
    }
    let at = |off: usize| data + off;
    // SAFETY: every offset below is under FAST_V4_LEN, checked above; unaligned reads.
    let (ethertype, vihl, total, frag, proto, saddr, daddr, ports) = unsafe {
        (
            mem::load16(at(12)),
            *(at(ETH_HLEN) as *const u8),
            mem::load16(at(ETH_HLEN + 2)),
            mem::load16(at(ETH_HLEN + 6)),
            *(at(ETH_HLEN + 9) as *const u8),
            mem::load32(at(IP_SRC_OFF)),
            mem::load32(at(IP_DST_OFF)),
            mem::load32(at(ETH_HLEN + 20)),
        )
    };
    if u16::from_be(ethertype) != ETH_P_IP
        || vihl != 0x45
        || u16::from_be(frag) & 0x1fff != 0
        || (proto != PROTO_TCP && proto != PROTO_UDP)
        || !fits(b, u16::from_be(total) as usize, 20 + min_l4_len(proto))
    {
        return None;
    }
    pkt.l4_off = (ETH_HLEN + 20) as u32;
    pkt.v6 = false;
    write_key4(&mut pkt.key, saddr, daddr, ports, proto);
    Some(Kind::Flow)
}

#[inline(always)]
fn parse_v4<B: Buf>(b: &B, pkt: &mut Pkt) -> Option<Kind> {
    // Version, header length, total length.
    let w0: [u8; 4] = b.load(ETH_HLEN)?;
    if w0[0] >> 4 != 4 {
        return None;
    }
    let ihl = ((w0[0] & 0x0f) as usize) * 4;
    if ihl < 20 {
        return None;
    }
    // Flags and fragment offset, then TTL and protocol.
    let w1: [u8; 4] = b.load(ETH_HLEN + 4)?;
    if u16::from_be_bytes([w1[2], w1[3]]) & 0x1fff != 0 {
        return None; // a later fragment: no ports to translate by
    }
    let w2: [u8; 2] = b.load(ETH_HLEN + 8)?;
    let proto = w2[1];
    let l4 = ETH_HLEN + ihl;
    let total = u16::from_be_bytes([w0[2], w0[3]]) as usize;
    if !fits(b, total, ihl + min_l4_len(proto)) {
        return None;
    }
    pkt.l4_off = l4 as u32;
    pkt.v6 = false;
    if proto == PROTO_ICMP {
        return Some(Kind::Icmp);
    }
    let saddr: u32 = b.load(IP_SRC_OFF)?;
    let daddr: u32 = b.load(IP_DST_OFF)?;
    if proto == PROTO_IPIP {
        write_key4(&mut pkt.key, saddr, daddr, 0, proto);
        return Some(Kind::Encap);
    }
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return None;
    }
    let ports: u32 = b.load(l4)?;
    write_key4(&mut pkt.key, saddr, daddr, ports, proto);
    Some(Kind::Flow)
}

/// The IPv6 parse. Its own BPF function, so the IPv4 path's stack does not grow; `pkt` is in
/// the caller's frame.
#[inline(never)]
fn parse_v6<B: Buf>(b: &B, pkt: &mut Pkt) -> Kind {
    try_parse_v6(b, pkt).unwrap_or(Kind::Other)
}

#[inline(always)]
fn try_parse_v6<B: Buf>(b: &B, pkt: &mut Pkt) -> Option<Kind> {
    // Version ... payload length, next header.
    let w: [u8; 8] = b.load(ETH_HLEN)?;
    if w[0] >> 4 != 6 {
        return None;
    }
    let payload = u16::from_be_bytes([w[4], w[5]]) as usize;
    let mut next = w[6];
    let mut off = ETH_HLEN + IP6_HLEN;
    for _ in 0..MAX_EXT_HEADERS {
        match next {
            PROTO_TCP | PROTO_UDP | PROTO_ICMPV6 | PROTO_IPV6 => break,
            IP6_HOPOPTS | IP6_DSTOPTS | IP6_ROUTING => {
                // Next header, length in 8-octet units after the first 8; for routing, the
                // type and the segments left.
                let h: [u8; 4] = b.load(off)?;
                if next == IP6_ROUTING && h[3] != 0 {
                    return None;
                }
                next = h[0];
                off += (h[1] as usize + 1) * 8;
            }
            IP6_FRAGMENT => {
                let h: [u8; 4] = b.load(off)?;
                if u16::from_be_bytes([h[2], h[3]]) & 0xfff8 != 0 {
                    return None; // a later fragment: no ports
                }
                next = h[0];
                off += 8;
            }
            _ => return None,
        }
    }
    // The IP length as the IPv4 one: payload plus the fixed header.
    let total = if payload == 0 { 0 } else { IP6_HLEN + payload };
    if !fits(b, total, off - ETH_HLEN + min_l4_len(next)) {
        return None;
    }
    pkt.l4_off = off as u32;
    pkt.v6 = true;
    if next == PROTO_ICMPV6 {
        return Some(Kind::Icmp6);
    }
    if next == PROTO_IPV6 {
        if !b.load16(IP6_SRC_OFF, &mut pkt.key.saddr) || !b.load16(IP6_DST_OFF, &mut pkt.key.daddr)
        {
            return None;
        }
        pkt.key.proto = next;
        return Some(Kind::Encap);
    }
    if next != PROTO_TCP && next != PROTO_UDP {
        return None;
    }
    let ports: [u8; 4] = b.load(off)?;
    if !b.load16(IP6_SRC_OFF, &mut pkt.key.saddr) || !b.load16(IP6_DST_OFF, &mut pkt.key.daddr) {
        return None;
    }
    pkt.key.sport = [ports[0], ports[1]];
    pkt.key.dport = [ports[2], ports[3]];
    mem::set_proto(&mut pkt.key, next);
    if is_v4_mapped(&pkt.key.saddr) || is_v4_mapped(&pkt.key.daddr) {
        return None;
    }
    Some(Kind::Flow)
}

/// Smallest header of `proto` (TCP 20, UDP and ICMP 8 bytes; others 0).
#[inline(always)]
fn min_l4_len(proto: u8) -> usize {
    match proto {
        PROTO_TCP => 20,
        PROTO_UDP | PROTO_ICMP | PROTO_ICMPV6 => 8,
        PROTO_IPIP => 20,
        PROTO_IPV6 => IP6_HLEN,
        _ => 0,
    }
}

/// Whether an IP packet whose length field says `total` bytes (from the start of the IP
/// header) is consistent with the frame and holds at least `need` bytes. A length of 0 is
/// what the kernel writes into GSO packets beyond 64 KiB (BIG TCP): accepted only for frames
/// that large.
#[inline(always)]
fn fits<B: Buf>(b: &B, total: usize, need: usize) -> bool {
    let frame = (b.len() as usize).saturating_sub(ETH_HLEN);
    if total == 0 {
        return frame > 0xffff && need <= frame;
    }
    need <= total && total <= frame
}

/// The TCP flags of a parsed TCP packet (0 for UDP, or when unreadable).
#[inline(always)]
pub fn tcp_flags<B: Buf>(b: &B, pkt: &Pkt) -> u8 {
    if pkt.key.proto != PROTO_TCP {
        return 0;
    }
    // IPv4 without options: the fast path's bytes (see `parse_v4_fast`).
    if pkt.l4() == ETH_HLEN + 20 {
        let (data, end) = b.linear();
        if data + FAST_TCP_LEN <= end {
            // SAFETY: within FAST_TCP_LEN, checked just above.
            return unsafe { *((data + ETH_HLEN + 20 + 13) as *const u8) };
        }
    }
    b.load::<u8>(pkt.l4() + 13).unwrap_or(0)
}
