//! Sending a translated packet on to its next hop without the kernel's routing.

use aya_ebpf::bindings::bpf_fib_lookup as FibParams;

use crate::{maps::TC_SCRATCH, mem, packet::Buf, verdict::Verdict};

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
    f.ifindex = b.ifindex();
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
    Some((r, f))
}
