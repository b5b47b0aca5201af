//! Rewriting a packet's addresses and ports with their checksums.
//!
//! IPv4: the header checksum and the TCP/UDP checksum (whose pseudo-header holds both
//! addresses) are updated incrementally (RFC 1624). A packet without IP options whose
//! headers are in the linear part is rewritten in place ([`rewrite4_at`]: addresses, ports
//! and the header checksum written directly; the L4 checksum by the hook, through
//! `bpf_l4_csum_replace` in its difference form at tc, in place at XDP); any other through
//! the helpers (`bpf_l3_csum_replace`, `bpf_l4_csum_replace` with `BPF_F_PSEUDO_HDR`). A
//! UDP checksum of zero ("none") stays zero (`BPF_F_MARK_MANGLED_0`).
//!
//! IPv6 has no header checksum; the TCP/UDP checksum covers a pseudo-header with both
//! addresses (RFC 8200 section 8.1), so an address rewrite feeds `bpf_csum_diff` of the
//! 16-byte addresses to `bpf_l4_csum_replace` (size 0: the difference form) with
//! `BPF_F_PSEUDO_HDR` and `BPF_F_IPV6` (see the kernel's `bpf_l4_csum_replace`
//! documentation). A computed UDP checksum of zero becomes 0xffff (`BPF_F_MARK_MANGLED_0`,
//! as RFC 8200 wants; a zero UDP checksum is invalid in IPv6).
//!
//! Every failure is counted (`tc_rewrite_failed`) and makes the packet's verdict a drop.

use aya_ebpf::helpers::bpf_csum_diff;
use proxy_common::{
    PROTO_UDP,
    nat::{CtEntry, TcCounter},
};

use crate::{
    mem,
    packet::{
        Buf, ETH_HLEN, IP_CSUM_OFF, IP_DST_OFF, IP_SRC_OFF, IP6_DST_OFF, IP6_SRC_OFF, Pkt,
        l4_csum_off,
    },
    stats::count_tc,
    verdict::Verdict,
};

/// `bpf_l4_csum_replace` flag: the change is part of the pseudo-header.
pub const BPF_F_PSEUDO_HDR: u64 = 1 << 4;
/// `bpf_l4_csum_replace` flag: a UDP checksum of zero stays zero (IPv4) / a computed zero
/// becomes 0xffff.
pub const BPF_F_MARK_MANGLED_0: u64 = 1 << 5;
/// `bpf_l4_csum_replace` flag: the packet is IPv6 (Linux >= 6.16; with CHECKSUM_COMPLETE the
/// pseudo-header is then not folded into `skb->csum`). Older kernels refuse the flag
/// (-EINVAL, nothing changed) and the call is repeated without it.
const BPF_F_IPV6: u64 = 1 << 7;

/// Counts a failed rewrite helper: the packet is dropped.
#[inline(always)]
pub fn failed() -> Verdict {
    count_tc(TcCounter::RewriteFailed);
    Verdict::Drop
}

/// `Ok` when a helper succeeded, else the counted drop.
#[inline(always)]
pub fn ok(done: bool) -> Result<(), Verdict> {
    if done { Ok(()) } else { Err(failed()) }
}

/// Rewrites the packet's tuple to `to`'s (both addresses and ports), fixing the checksums
/// of its family: [`Buf::rewrite`], a global BPF function of each hook (verified once,
/// whatever the caller's state). A failure is counted there and makes the verdict a drop.
#[inline(always)]
pub fn rewrite<B: Buf>(b: &B, pkt: &Pkt, to: &CtEntry) -> Verdict {
    if b.rewrite(pkt, to) == DIRECT_DONE {
        Verdict::Pass
    } else {
        Verdict::Drop
    }
}

/// [`rewrite`] for a tracked packet, the hot path: an IPv4 packet without options is
/// rewritten in place here, in the caller's function ([`Buf::rewrite4_direct`]), saving the
/// call of the global function (each call and return costs more than the rewrite's
/// instructions on CPUs that mitigate return-address speculation); anything else goes
/// through [`rewrite`]. Not for the new-flow path, whose call chain has no stack to spare.
#[inline(always)]
pub fn rewrite_tracked<B: Buf>(b: &B, pkt: &Pkt, to: &CtEntry) -> Verdict {
    if !pkt.v6 && pkt.l4() == FAST_L4_OFF {
        let (saddr, daddr, ports) = entry_words4(to);
        match b.rewrite4_direct(saddr, daddr, ports, pkt.key.proto as u32) {
            DIRECT_DONE => return Verdict::Pass,
            DIRECT_UNFIT => {}
            _ => return failed(),
        }
    }
    rewrite(b, pkt, to)
}

/// The body of each hook's [`Buf::rewrite`]: [`DIRECT_DONE`], or [`DIRECT_FAILED`] after
/// counting the failure.
#[inline(always)]
pub fn rewrite_any<B: Buf>(b: &B, pkt: &Pkt, to: &CtEntry) -> i32 {
    let r = if pkt.v6 {
        rewrite6(b, pkt, to)
    } else {
        rewrite4(b, pkt, to)
    };
    match r {
        Ok(()) => DIRECT_DONE,
        Err(_) => DIRECT_FAILED,
    }
}

/// The UDP flag of [`BPF_F_MARK_MANGLED_0`] for `proto`.
#[inline(always)]
fn mangled(proto: u8) -> u64 {
    if proto == PROTO_UDP {
        BPF_F_MARK_MANGLED_0
    } else {
        0
    }
}

/// Writes IPv4 address `new` (network order in a `u32`) over `old` at `off`, updating the
/// IP header checksum and, with `l4_csum` set, the L4 checksum there (pseudo-header).
#[inline(always)]
pub fn store_addr4<B: Buf>(
    b: &B,
    off: usize,
    old: u32,
    new: u32,
    l4_csum: Option<usize>,
    flags: u64,
) -> Result<(), Verdict> {
    ok(b.store(off, &new))?;
    ok(b.l3_csum_replace(IP_CSUM_OFF, old as u64, new as u64, 4))?;
    if let Some(c) = l4_csum {
        ok(b.l4_csum_replace(c, old as u64, new as u64, BPF_F_PSEUDO_HDR | flags | 4))?;
    }
    Ok(())
}

/// Writes port `new` over `old` at `off`, updating the L4 checksum at `csum` (for IPv6 with
/// [`l4_csum6`]).
#[inline(always)]
pub fn store_port<B: Buf>(
    b: &B,
    off: usize,
    old: u16,
    new: u16,
    csum: usize,
    flags: u64,
    v6: bool,
) -> Result<(), Verdict> {
    ok(b.store(off, &new))?;
    if v6 {
        l4_csum6(b, csum, old as u64, new as u64, flags | 2)
    } else {
        ok(b.l4_csum_replace(csum, old as u64, new as u64, flags | 2))
    }
}

/// [`rewrite`] of an IPv4 packet: each changed address and port written, its checksums
/// updated through the helpers (which also keep `skb->csum` right).
#[inline(always)]
fn rewrite4<B: Buf>(b: &B, pkt: &Pkt, to: &CtEntry) -> Result<(), Verdict> {
    let k = &pkt.key;
    let addr = |a: &[u8; 16]| u32::from_ne_bytes([a[12], a[13], a[14], a[15]]);
    if pkt.l4() == FAST_L4_OFF {
        let (saddr, daddr, ports) = entry_words4(to);
        match b.rewrite4_direct(saddr, daddr, ports, k.proto as u32) {
            DIRECT_DONE => return Ok(()),
            DIRECT_UNFIT => {}
            _ => return Err(failed()),
        }
    }
    let csum = pkt.l4() + l4_csum_off(k.proto);
    let m = mangled(k.proto);
    let port = |p: [u8; 2]| u16::from_ne_bytes(p);
    for (off, old, new) in [
        (IP_SRC_OFF, addr(&k.saddr), addr(&to.saddr)),
        (IP_DST_OFF, addr(&k.daddr), addr(&to.daddr)),
    ] {
        if old != new {
            ok(b.store(off, &new))?;
            ok(b.l3_csum_replace(IP_CSUM_OFF, old as u64, new as u64, 4))?;
            ok(b.l4_csum_replace(csum, old as u64, new as u64, BPF_F_PSEUDO_HDR | m | 4))?;
        }
    }
    for (off, old, new) in [
        (pkt.l4(), port(k.sport), port(to.sport)),
        (pkt.l4() + 2, port(k.dport), port(to.dport)),
    ] {
        if old != new {
            ok(b.store(off, &new))?;
            ok(b.l4_csum_replace(csum, old as u64, new as u64, m | 2))?;
        }
    }
    Ok(())
}

/// The IPv4 addresses (the last words of the IPv4-mapped `saddr` and `daddr`) and the
/// ports (`sport` then `dport`, one word) of `e`, as they lie in memory: three word loads,
/// not twelve byte loads and their shifts.
#[inline(always)]
fn entry_words4(e: &CtEntry) -> (u32, u32, u32) {
    const _: () = assert!(
        core::mem::align_of::<CtEntry>() >= 4
            && core::mem::offset_of!(CtEntry, saddr) % 4 == 0
            && core::mem::offset_of!(CtEntry, daddr) % 4 == 0
            && core::mem::offset_of!(CtEntry, sport) % 4 == 0
            && core::mem::offset_of!(CtEntry, dport) == core::mem::offset_of!(CtEntry, sport) + 2
    );
    // SAFETY: within `e`, at 4-byte aligned addresses (asserted above).
    unsafe {
        (
            (e.saddr.as_ptr().add(12) as *const u32).read(),
            (e.daddr.as_ptr().add(12) as *const u32).read(),
            (e.sport.as_ptr() as *const u32).read(),
        )
    }
}

/// [`rewrite`] of an IPv6 packet: addresses as [`store_addr6`] does (part of the TCP/UDP
/// pseudo-header; inlined here, a call deeper would exceed the combined stack limit under a
/// new flow), ports as for IPv4.
#[inline(always)]
fn rewrite6<B: Buf>(b: &B, pkt: &Pkt, to: &CtEntry) -> Result<(), Verdict> {
    let k = &pkt.key;
    let csum = pkt.l4() + l4_csum_off(k.proto);
    let m = mangled(k.proto);
    let port = |p: [u8; 2]| u16::from_ne_bytes(p);
    if k.saddr != to.saddr {
        try_store_addr6(
            b,
            IP6_SRC_OFF,
            &k.saddr,
            &to.saddr,
            ((csum as u64) << 32) | BPF_F_PSEUDO_HDR | m,
        )?;
    }
    if k.daddr != to.daddr {
        try_store_addr6(
            b,
            IP6_DST_OFF,
            &k.daddr,
            &to.daddr,
            ((csum as u64) << 32) | BPF_F_PSEUDO_HDR | m,
        )?;
    }
    if k.sport != to.sport {
        store_port(b, pkt.l4(), port(k.sport), port(to.sport), csum, m, true)?;
    }
    if k.dport != to.dport {
        store_port(
            b,
            pkt.l4() + 2,
            port(k.dport),
            port(to.dport),
            csum,
            m,
            true,
        )?;
    }
    Ok(())
}

/// `bpf_l4_csum_replace` of an IPv6 packet: with `BPF_F_IPV6`, and again without it on a
/// kernel that does not know the flag (before 6.16; it then changed nothing).
#[inline(always)]
pub fn l4_csum6<B: Buf>(b: &B, off: usize, from: u64, to: u64, flags: u64) -> Result<(), Verdict> {
    if b.l4_csum_replace(off, from, to, flags | BPF_F_IPV6) {
        return Ok(());
    }
    ok(b.l4_csum_replace(off, from, to, flags))
}

/// Writes IPv6 address `new` over `old` at `off` and folds the difference into the
/// checksum at `csum` (`bpf_csum_diff` of the 16-byte addresses, then the difference form
/// of `bpf_l4_csum_replace`: size 0 and `from` 0). `flags`: `BPF_F_PSEUDO_HDR` when the
/// address is part of the checksum's pseudo-header, plus `BPF_F_MARK_MANGLED_0` for UDP.
#[inline(always)]
pub fn store_addr6<B: Buf>(
    b: &B,
    off: usize,
    old: &[u8; 16],
    new: &[u8; 16],
    csum: usize,
    flags: u64,
) -> Result<(), Verdict> {
    match store_addr6_at(b, off, old, new, ((csum as u64) << 32) | flags) {
        Verdict::Pass => Ok(()),
        v => Err(v),
    }
}

/// [`store_addr6`] as its own BPF function (small stack frames for its callers, at most
/// five arguments: the checksum offset travels in the upper half of `csum_flags`, the
/// flags in the lower).
#[inline(never)]
fn store_addr6_at<B: Buf>(
    b: &B,
    off: usize,
    old: &[u8; 16],
    new: &[u8; 16],
    csum_flags: u64,
) -> Verdict {
    match try_store_addr6(b, off, old, new, csum_flags) {
        Ok(()) => Verdict::Pass,
        Err(v) => v,
    }
}

#[inline(always)]
fn try_store_addr6<B: Buf>(
    b: &B,
    off: usize,
    old: &[u8; 16],
    new: &[u8; 16],
    csum_flags: u64,
) -> Result<(), Verdict> {
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
        return Err(failed());
    }
    ok(b.store(off, new))?;
    l4_csum6(b, csum, 0, diff as u64, flags)
}

/// Offset of the L4 header of an IPv4 packet without options: where [`Buf::rewrite4_direct`]
/// applies.
const FAST_L4_OFF: usize = ETH_HLEN + 20;
/// [`Buf::rewrite4_direct`]: the packet was rewritten.
pub const DIRECT_DONE: i32 = 0;
/// [`Buf::rewrite4_direct`]: the frame's linear part does not hold what the rewrite reads
/// (or is no IPv4 packet without options): nothing changed, the helpers' path applies.
pub const DIRECT_UNFIT: i32 = 1;
/// [`Buf::rewrite4_direct`]: a checksum helper failed (the packet may be half rewritten:
/// it is dropped).
pub const DIRECT_FAILED: i32 = -1;

/// Adds a 32-bit word (memory order) to a one's complement accumulator.
#[inline(always)]
fn add32(acc: u64, v: u32) -> u64 {
    acc + (v & 0xffff) as u64 + (v >> 16) as u64
}

/// One's complement sum folded to 16 bits.
#[inline(always)]
pub fn fold16(mut v: u64) -> u16 {
    v = (v & 0xffff) + (v >> 16);
    v = (v & 0xffff) + (v >> 16);
    v = (v & 0xffff) + (v >> 16);
    v as u16
}

/// The IPv4 rewrite of [`Buf::rewrite4_direct`] done in the frame at `data..end` (the
/// linear part, direct packet access): both addresses and ports written and the IP header
/// checksum updated in place (RFC 1624 eq. 3). Returns the one's complement differences
/// the L4 checksum at the returned address still needs, the pseudo-header's (addresses)
/// and the header's own (ports), each folded to 16 bits; `None` when the frame is not an
/// IPv4 packet without options whose L4 header up to its checksum is in `data..end`.
///
/// # Safety
/// `data..end` must be the packet's readable and writable linear part.
#[inline(always)]
pub unsafe fn rewrite4_at(
    data: usize,
    end: usize,
    saddr: u32,
    daddr: u32,
    ports: u32,
    proto: u32,
) -> Option<(u16, u16, usize)> {
    // The whole TCP header, or UDP's: the checksum is inside.
    let need = if proto == PROTO_UDP as u32 { 8 } else { 20 };
    if data + FAST_L4_OFF + need > end {
        return None;
    }
    let at = |off: usize| data + off;
    // SAFETY: every access below is within FAST_L4_OFF + need, checked above.
    unsafe {
        if *(at(ETH_HLEN) as *const u8) != 0x45 {
            return None;
        }
        let (ip_csum, src, dst, l4) = (
            at(IP_CSUM_OFF),
            at(IP_SRC_OFF),
            at(IP_DST_OFF),
            at(FAST_L4_OFF),
        );
        let (os, od, op) = (mem::load32(src), mem::load32(dst), mem::load32(l4));
        let addrs = fold16(add32(add32(add32(add32(0, !os), saddr), !od), daddr));
        let port_diff = fold16(add32(add32(0, !op), ports));
        let old = mem::load16(ip_csum);
        mem::store16(ip_csum, !fold16((!old) as u64 + addrs as u64));
        mem::store32(src, saddr);
        mem::store32(dst, daddr);
        mem::store32(l4, ports);
        let csum = if proto == PROTO_UDP as u32 {
            at(FAST_L4_OFF + 6)
        } else {
            at(FAST_L4_OFF + 16)
        };
        Some((addrs, port_diff, csum))
    }
}
