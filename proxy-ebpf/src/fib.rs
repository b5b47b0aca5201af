//! Sending a translated packet on to its next hop without the kernel's routing.

use aya_ebpf::bindings::bpf_fib_lookup as FibParams;

use crate::{
    ct,
    maps::{FIB_HOPS, TC_SCRATCH},
    mem,
    packet::Buf,
    types::FibHop,
    verdict::Verdict,
};

/// Slots of the next-hop cache (`maps::FIB_HOPS`, per CPU), a power of two: 64 KiB per
/// CPU.
pub const FIB_HOP_SLOTS: u32 = 1024;

/// `AF_INET` / `AF_INET6` for `bpf_fib_lookup`.
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
/// `BPF_FIB_LKUP_RET_NO_NEIGH`: a route, but no neighbour entry for the next hop yet.
const FIB_NO_NEIGH: i64 = 7;

/// Sends a packet translated at ingress whose source is now one of this node's addresses
/// (a reply of a source-NATed flow, frontend -> client) straight to its next hop. Routing
/// it would drop it as a martian (a local source address arriving from the wire), so the
/// route and the next hop come from `bpf_fib_lookup`, and `bpf_redirect_neigh` resolves a
/// neighbour the node has not talked to yet. When the lookup fails the packet goes to the
/// stack unchanged in course ([`Verdict::Pass`]). The family follows `dst`: IPv4-mapped is
/// IPv4 (AF_INET), anything else IPv6 (AF_INET6).
#[inline(never)]
pub fn redirect_out<B: Buf>(b: &B, src: &[u8; 16], dst: &[u8; 16]) -> Verdict {
    let Some(f) = lookup(b, src, dst, 0) else {
        return Verdict::Pass;
    };
    match f.0 {
        0 => {
            let (smac, dmac, ifindex) = (f.1.smac, f.1.dmac, f.1.ifindex);
            if !b.store(0, &dmac) || !b.store(6, &smac) {
                return Verdict::Pass;
            }
            b.redirect(ifindex)
        }
        FIB_NO_NEIGH => b.redirect_neigh(f.1.ifindex),
        _ => Verdict::Pass,
    }
}

/// `bpf_fib_lookup` of the route from `src` to `dst` (IPv4-mapped: AF_INET, else AF_INET6)
/// as if the packet arrived on the packet's interface, in this CPU's scratch slot
/// (`Scratch::fib`): the helper's return value (0: route and neighbour found; the next
/// hop's MAC addresses and the output interface are then in the parameters) and the
/// parameters. `ip_len`: the IP packet's length in bytes for the helper's MTU check (0: no
/// check). `None` without a scratch slot.
///
/// A lookup with a length goes through this CPU's next-hop cache (`FIB_HOPS`) first: a
/// successful lookup from `src` to `dst` for a packet from the same interface, in the same
/// tick of the conntrack clock (`ct::tick`, about a second), whose MTU check passed for a
/// packet at least as long, gives the same answer without the helper. The helper costs
/// about as much as the rest of a tracked packet's path (the route, the neighbour, the
/// MTU); a route, neighbour or MTU change reaches the packets of a cached next hop within
/// a tick, as it reaches a neighbour entry the kernel still holds as stale. A failed
/// lookup, and one without a length (the kernel then checks the packet against the
/// device's MTU itself), are never cached.
#[inline(always)]
pub fn lookup<B: Buf>(
    b: &B,
    src: &[u8; 16],
    dst: &[u8; 16],
    ip_len: u16,
) -> Option<(i64, &'static mut FibParams)> {
    let sc = TC_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's scratch slot; the FIB parameters are plain integers.
    let f = unsafe { &mut (*sc).fib };
    // SAFETY: the FIB parameters are plain integers (all-zero is valid); a map value.
    unsafe { mem::zero_words(f) };
    let ifindex = b.ifindex();
    f.ifindex = ifindex;
    let (hop, tick) = if ip_len != 0 {
        (
            FIB_HOPS.get_ptr_mut(slot(src, dst, ifindex)),
            ct::tick(ct::now()),
        )
    } else {
        (None, 0)
    };
    if let Some(h) = hop {
        // SAFETY: this CPU's slot of the cache, plain integers.
        let h = unsafe { &*h };
        if cached(h, src, dst, ifindex, ip_len, tick) {
            f.ifindex = h.ifindex_out;
            f.smac = h.smac;
            f.dmac = h.dmac;
            return Some((0, f));
        }
    }
    f.__bindgen_anon_1.tot_len = ip_len;
    if proxy_common::is_v4_mapped(dst) {
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
    let r = b.fib_lookup(f);
    if r == 0
        && let Some(h) = hop
    {
        // SAFETY: this CPU's slot of the cache, plain integers; only this CPU writes it.
        let h = unsafe { &mut *h };
        // The same next hop again in this tick: the longest length checked so far stays.
        let len = if cached(h, src, dst, ifindex, 0, tick) {
            h.checked_len.max(ip_len)
        } else {
            ip_len
        };
        mem::copy_addr(&mut h.src, src);
        mem::copy_addr(&mut h.dst, dst);
        h.ifindex_in = ifindex;
        h.ifindex_out = f.ifindex;
        h.smac = f.smac;
        h.dmac = f.dmac;
        h.checked_len = len;
        h.tick = tick;
    }
    Some((r, f))
}

/// The cache slot of a lookup from `src` to `dst` for a packet from `ifindex`: a
/// multiplicative hash of the addresses' words and the interface.
#[inline(always)]
fn slot(src: &[u8; 16], dst: &[u8; 16], ifindex: u32) -> u32 {
    let (s, d) = (src.as_ptr() as usize, dst.as_ptr() as usize);
    // SAFETY: 16 readable bytes each (map values or the scratch slot).
    let x = unsafe {
        mem::load32(d + 12)
            ^ mem::load32(d + 8).rotate_left(7)
            ^ mem::load32(d).rotate_left(13)
            ^ mem::load32(s + 12).rotate_left(19)
            ^ mem::load32(s).rotate_left(25)
    } ^ ifindex;
    x.wrapping_mul(0x9e37_79b1) >> (32 - FIB_HOP_SLOTS.trailing_zeros())
}

/// Whether the slot `h` holds the next hop from `src` to `dst` for a packet of `ip_len`
/// bytes from `ifindex`, looked up in tick `tick` (`ip_len` 0: any length).
#[inline(always)]
fn cached(
    h: &FibHop,
    src: &[u8; 16],
    dst: &[u8; 16],
    ifindex: u32,
    ip_len: u16,
    tick: u32,
) -> bool {
    let word = |a: &[u8; 16], i: usize| {
        // SAFETY: `i` is 0 or 8, within the 16 readable bytes of `a`.
        unsafe { mem::load64(a.as_ptr() as usize + i) }
    };
    h.ifindex_out != 0
        && h.tick == tick
        && h.ifindex_in == ifindex
        && ip_len <= h.checked_len
        && word(&h.dst, 0) == word(dst, 0)
        && word(&h.dst, 8) == word(dst, 8)
        && word(&h.src, 0) == word(src, 0)
        && word(&h.src, 8) == word(src, 8)
}
