//! XDP entry point on the node's external interfaces: the fast half of the north-south data
//! path. The tcx programs (`tc`) stay attached behind it and remain the complete path; XDP
//! finishes only what it can send out of the node itself, with the same maps, the same
//! conntrack and the same shared modules (`packet`, `nat`, `ct`, `csum`, `lb`, `lc`):
//! - a new flow to an ingress frontend is selected and tracked by `nat::new_flow`, exactly
//!   as at tcx ingress (so affinity, policies, source ranges and selection are the same);
//! - a packet of a source-NATed flow (backend on another node) is translated both ways at
//!   once (the DNAT of the original entry, then the SNAT stage that tcx egress applies) and
//!   sent back out with `XDP_TX`, or `XDP_REDIRECT` to another interface, towards the next
//!   hop from a FIB lookup (TTL or hop limit decremented, as routing would);
//! - a reply of a source-NATed flow (backend -> node address) becomes frontend -> client
//!   and leaves the same way, when the FIB lookup done *before* the rewrite gives a next
//!   hop with a known neighbour.
//!
//! What XDP leaves to the stack (`XDP_PASS`), where tcx ingress sees it next:
//! - untranslated: anything not TCP or UDP (ICMP errors included), later fragments,
//!   packets of flows to local backends or of flows not source-NATed (delivery needs the
//!   stack), replies without a neighbour entry for the client yet (tcx resolves it with
//!   `bpf_redirect_neigh`), a TTL or hop limit about to expire (the stack answers with ICMP);
//! - translated to client -> backend (DNAT only): a new flow to a local backend, and a flow
//!   to a remote backend whose next hop the FIB lookup did not give. tcx ingress finds
//!   nothing to do on such a packet (no conntrack entry is keyed by a DNATed tuple on the
//!   ingress side, and a backend is no ingress frontend), the kernel routes or delivers it,
//!   and tcx egress applies the SNAT stage as for its own flows.
//!
//! So no packet is translated twice, and a flow may move between the two paths packet by
//! packet (for instance its first packets through the stack until the neighbour is known):
//! both read and write the one conntrack table.

// Map keys are passed by reference on purpose: by value, each 40-byte key would be copied
// onto the 512-byte BPF stack first.
#![allow(clippy::needless_borrows_for_generic_args)]

use aya_ebpf::{
    bindings::{
        bpf_fib_lookup as FibParams,
        xdp_action::{XDP_DROP, XDP_PASS, XDP_REDIRECT, XDP_TX},
        xdp_md,
    },
    helpers::{
        bpf_fib_lookup, bpf_redirect, bpf_xdp_adjust_head, bpf_xdp_adjust_tail,
        bpf_xdp_get_buff_len, bpf_xdp_load_bytes, bpf_xdp_store_bytes,
    },
    macros::xdp,
    programs::XdpContext,
};
use proxy_common::{
    PROTO_UDP,
    nat::{CT_F_EGRESS, CT_F_REPLY, CT_F_SNAT, CtEntry, TcCounter},
};

use crate::{
    csum::{
        BPF_F_MARK_MANGLED_0, DIRECT_DONE, DIRECT_FAILED, DIRECT_UNFIT, failed, fold16,
        rewrite_any, rewrite4_at,
    },
    ct::{self, alive},
    fib,
    maps::{TC_CONNTRACK, TC_SCRATCH},
    mem,
    nat::{count_new_flow, new_flow, tracked_at},
    packet::{Buf, ETH_HLEN, IP_CSUM_OFF, Kind, Pkt, parse, tcp_flags},
    stats::count_tc,
    verdict::Verdict,
};

/// Offset of the IPv4 TTL in the frame (the 16-bit word TTL, protocol).
const IP_TTL_OFF: usize = ETH_HLEN + 8;
/// Offset of the IPv6 hop limit in the frame.
const IP6_HOPLIMIT_OFF: usize = ETH_HLEN + 7;

#[xdp]
pub fn xdp_ingress(ctx: XdpContext) -> u32 {
    on_frame(&ctx)
}

/// What the conntrack entry of a packet says XDP does with it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// No live entry on the ingress side: a new flow, if anything.
    New,
    /// A live entry of a flow that is not source-NATed: the tcx path's.
    Stack,
    /// The original direction of a source-NATed flow.
    Original,
    /// The reply direction of a source-NATed flow.
    Reply,
}

impl Plan {
    /// The plan for a live ingress-side entry with `flags` ([`plan`] gave it).
    #[inline(always)]
    fn of(flags: u16) -> Plan {
        if flags & CT_F_SNAT == 0 {
            Plan::Stack
        } else if flags & CT_F_REPLY != 0 {
            Plan::Reply
        } else {
            Plan::Original
        }
    }
}

#[inline(always)]
fn on_frame(ctx: &XdpContext) -> u32 {
    let mut slot = core::mem::MaybeUninit::uninit();
    let pkt = Pkt::init(&mut slot);
    if parse(ctx, pkt) != Kind::Flow || expiring(ctx, pkt.v6) {
        return XDP_PASS;
    }
    let flags = tcp_flags(ctx, pkt);
    let now = ct::now();
    let e = plan(pkt, now);
    // SAFETY: a value of the map (`plan` checked it); a word-sized read.
    let kind = if e.is_null() {
        Plan::New
    } else {
        Plan::of(unsafe { (*e).flags })
    };
    match kind {
        Plan::Stack => XDP_PASS,
        Plan::Reply => reply(ctx, pkt, e, flags, now),
        Plan::Original => {
            // `plan` wrote the SNAT stage's key (the original entry's rewritten tuple).
            match tracked_at(ctx, pkt, e, flags, now, true) {
                Some(Verdict::Pass) => {
                    let Some(sc) = TC_SCRATCH.get_ptr(0) else {
                        return XDP_PASS;
                    };
                    // SAFETY: this CPU's slot, `ekey` written by `plan`.
                    pkt.key = unsafe { (*sc).ekey };
                    snat_stage(ctx, pkt, flags, now)
                }
                Some(v) => v.xdp(),
                // Reopened or expired meanwhile: untouched, for tcx.
                None => XDP_PASS,
            }
        }
        Plan::New => {
            let Some(sc) = TC_SCRATCH.get_ptr_mut(0) else {
                return XDP_PASS;
            };
            // `new_flow` sets the original entry it writes in the scratch slot; a stale
            // one of an earlier packet must not pass for this packet's.
            // SAFETY: this CPU's slot.
            unsafe { (*sc).fwd.last_seen_ns = 0 };
            let v = new_flow(ctx, pkt, flags, now);
            if v == Verdict::Reject {
                // tcx ingress sees the same packet, answers it, and counts and reports it
                // then: nothing of this run's decision is kept.
                // SAFETY: as above.
                unsafe {
                    (*sc).mon = 0;
                    (*sc).count_sid = 0;
                }
                return XDP_PASS;
            }
            count_new_flow(pkt);
            if v != Verdict::Pass {
                return v.xdp();
            }
            // SAFETY: as above.
            let (started, snat) = unsafe { ((*sc).fwd.last_seen_ns == now, (*sc).fwd.flags) };
            if !started || snat & CT_F_SNAT == 0 {
                // Untranslated (no frontend), or DNATed to a local backend: the stack.
                return XDP_PASS;
            }
            // SAFETY: as above; `new_flow` wrote the SNAT stage's key there.
            pkt.key = unsafe { (*sc).ekey };
            snat_stage(ctx, pkt, flags, now)
        }
    }
}

/// Whether the packet's TTL (IPv4) or hop limit (IPv6) would expire at this hop: the
/// stack forwards it (and answers with ICMP time exceeded), so XDP leaves it alone.
#[inline(always)]
fn expiring(ctx: &XdpContext, v6: bool) -> bool {
    let off = if v6 { IP6_HOPLIMIT_OFF } else { IP_TTL_OFF };
    let (data, end) = Buf::linear(ctx);
    if data + IP6_HOPLIMIT_OFF.max(IP_TTL_OFF) < end {
        // SAFETY: both offsets are within the first buffer, checked above.
        return unsafe { *((data + off) as *const u8) } <= 1;
    }
    ctx.load::<u8>(off).is_none_or(|t| t <= 1)
}

/// The packet's live ingress-side conntrack entry (nothing written there), null for none
/// (a new flow, if anything; see [`Plan`]); for the original direction of a source-NATed
/// flow, writes the SNAT stage's key into the scratch slot's `ekey`. Its own BPF function
/// (stack).
#[inline(never)]
fn plan(pkt: &Pkt, now: u64) -> *mut CtEntry {
    let Some(e) = TC_CONNTRACK.get_ptr_mut(&pkt.key) else {
        return core::ptr::null_mut();
    };
    // SAFETY: a value of the map, read field by field.
    let (flags, seen) = unsafe { ((*e).flags, (*e).last_seen_ns) };
    if flags & CT_F_EGRESS != 0 || !alive(flags, seen, pkt.key.proto, now) {
        return core::ptr::null_mut();
    }
    if Plan::of(flags) != Plan::Original {
        return e;
    }
    // The SNAT stage's key, the entry's rewritten tuple, for the entry point.
    let Some(sc) = TC_SCRATCH.get_ptr_mut(0) else {
        return core::ptr::null_mut();
    };
    // SAFETY: a map value and this CPU's slot, copied field by field.
    unsafe {
        mem::copy_addr(&mut (*sc).ekey.saddr, &(*e).saddr);
        mem::copy_addr(&mut (*sc).ekey.daddr, &(*e).daddr);
        (*sc).ekey.sport = (*e).sport;
        (*sc).ekey.dport = (*e).dport;
        mem::set_proto(&mut (*sc).ekey, pkt.key.proto);
    }
    e
}

/// A reply of a source-NATed flow (`e` its entry, from [`plan`]): the next hop towards
/// the client first (from the entry's rewritten tuple), then the shared rewrite, which
/// hands the packet to [`Buf::send_out`] (the MAC addresses of that next hop).
#[inline(never)]
fn reply(ctx: &XdpContext, pkt: &Pkt, e: *mut CtEntry, tcp_flags: u8, now: u64) -> u32 {
    // SAFETY: `plan`'s entry, a value of the map; the addresses are read in place by the
    // lookup.
    let found = unsafe { hop(ctx, &(*e).saddr, &(*e).daddr) };
    if !found {
        count_tc(TcCounter::XdpToStack);
        return XDP_PASS;
    }
    match tracked_at(ctx, pkt, e, tcp_flags, now, true) {
        Some(Verdict::Redirect) => out(ctx, pkt.v6),
        Some(v) => v.xdp(),
        None => XDP_PASS,
    }
}

/// A DNATed packet of a source-NATed flow, `pkt.key` now its SNAT stage's key: the next
/// hop towards the backend from the node address, then the SNAT stage (`nat::tracked` on
/// the egress side, as tcx egress would) and out. Without a next hop the DNATed packet
/// goes to the stack, and tcx egress applies the SNAT stage after routing.
#[inline(never)]
fn snat_stage(ctx: &XdpContext, pkt: &mut Pkt, tcp_flags: u8, now: u64) -> u32 {
    let Some(eg) = TC_CONNTRACK.get_ptr_mut(&pkt.key) else {
        return XDP_PASS;
    };
    // SAFETY: a value of the map; the addresses are read in place by the lookup.
    let found = unsafe { hop(ctx, &(*eg).saddr, &(*eg).daddr) };
    if !found {
        count_tc(TcCounter::XdpToStack);
        return XDP_PASS;
    }
    match tracked_at(ctx, pkt, eg, tcp_flags, now, false) {
        Some(Verdict::Pass) => {}
        Some(v) => return v.xdp(),
        None => return XDP_PASS,
    }
    if !set_macs(ctx) {
        return failed().xdp();
    }
    out(ctx, pkt.v6)
}

/// FIB lookup of the route from `src` to `dst` for this frame's length: true when it
/// gave an output interface and the next hop's MAC address (in the scratch slot's `fib`).
#[inline(always)]
fn hop(ctx: &XdpContext, src: &[u8; 16], dst: &[u8; 16]) -> bool {
    let ip_len = (Buf::len(ctx) as usize).saturating_sub(ETH_HLEN) as u16;
    matches!(fib::lookup(ctx, src, dst, ip_len), Some((0, _)))
}

/// Writes the next hop's MAC addresses from the scratch slot's FIB result: in place when
/// the Ethernet header is in the first buffer (always, in practice), else through the
/// helpers. A global BPF function (verified once, see `tcbuf::ebpf_proxy_tc_rewrite`).
#[inline(always)]
fn set_macs(ctx: &XdpContext) -> bool {
    ebpf_proxy_xdp_macs(ctx.ctx) == DIRECT_DONE
}

/// [`set_macs`]: [`DIRECT_DONE`] or [`DIRECT_FAILED`].
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn ebpf_proxy_xdp_macs(ctx: *mut xdp_md) -> i32 {
    let Some(sc) = TC_SCRATCH.get_ptr(0) else {
        return DIRECT_FAILED;
    };
    // SAFETY: this CPU's slot, filled by `hop`.
    let (smac, dmac) = unsafe { ((*sc).fib.smac, (*sc).fib.dmac) };
    // SAFETY: our context; the first buffer as the verifier bounds it.
    let (data, end) = unsafe { ((*ctx).data as usize, (*ctx).data_end as usize) };
    if data + ETH_HLEN <= end {
        // SAFETY: the first 12 bytes are within the first buffer, checked above.
        unsafe {
            mem::store32(
                data,
                u32::from_ne_bytes([dmac[0], dmac[1], dmac[2], dmac[3]]),
            );
            mem::store16(data + 4, u16::from_ne_bytes([dmac[4], dmac[5]]));
            mem::store16(data + 6, u16::from_ne_bytes([smac[0], smac[1]]));
            mem::store32(
                data + 8,
                u32::from_ne_bytes([smac[2], smac[3], smac[4], smac[5]]),
            );
        }
        return DIRECT_DONE;
    }
    let x = XdpContext::new(ctx);
    if x.store(0, &dmac) && x.store(6, &smac) {
        DIRECT_DONE
    } else {
        DIRECT_FAILED
    }
}

/// Sends the translated frame (MAC addresses already set) out of the interface of the
/// FIB result: `XDP_TX` when that is the one it arrived on, else `XDP_REDIRECT`. The TTL
/// or hop limit is decremented first, as forwarding does.
#[inline(always)]
fn out(ctx: &XdpContext, v6: bool) -> u32 {
    let Some(sc) = TC_SCRATCH.get_ptr(0) else {
        return XDP_PASS;
    };
    // SAFETY: this CPU's slot, filled by `hop`.
    let ifindex = unsafe { (*sc).fib.ifindex };
    if !decrement_ttl(ctx, v6) {
        return failed().xdp();
    }
    count_tc(TcCounter::XdpForwarded);
    if ifindex == Buf::ifindex(ctx) {
        return XDP_TX;
    }
    // SAFETY: helper without memory arguments.
    let r = unsafe { bpf_redirect(ifindex, 0) };
    if r == XDP_REDIRECT as i64 {
        XDP_REDIRECT
    } else {
        XDP_DROP
    }
}

/// Decrements the TTL (with the IPv4 header checksum) or the hop limit; `expiring` made
/// sure it is above 1.
#[inline(always)]
fn decrement_ttl(ctx: &XdpContext, v6: bool) -> bool {
    ebpf_proxy_xdp_ttl(ctx.ctx, v6 as u32) == DIRECT_DONE
}

/// [`decrement_ttl`]: in place when the IP header is in the first buffer, else through
/// the helpers. A global BPF function (verified once). [`DIRECT_DONE`] or
/// [`DIRECT_FAILED`].
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn ebpf_proxy_xdp_ttl(ctx: *mut xdp_md, v6: u32) -> i32 {
    // SAFETY: our context; the first buffer as the verifier bounds it.
    let (data, end) = unsafe { ((*ctx).data as usize, (*ctx).data_end as usize) };
    if v6 != 0 {
        if data + IP6_HOPLIMIT_OFF < end {
            // SAFETY: within the first buffer, checked above.
            unsafe {
                let h = (data + IP6_HOPLIMIT_OFF) as *mut u8;
                *h = (*h).wrapping_sub(1);
            }
            return DIRECT_DONE;
        }
        let x = XdpContext::new(ctx);
        return match x.load::<u8>(IP6_HOPLIMIT_OFF) {
            Some(h) if x.store(IP6_HOPLIMIT_OFF, &h.wrapping_sub(1)) => DIRECT_DONE,
            _ => DIRECT_FAILED,
        };
    }
    // The TTL is the high byte of the 16-bit word (TTL, protocol) in network order.
    if data + IP_CSUM_OFF + 2 <= end {
        // SAFETY: within the first buffer, checked above; unaligned accesses.
        unsafe {
            let (w, c) = (data + IP_TTL_OFF, data + IP_CSUM_OFF);
            let old = mem::load16(w);
            let new = u16::from_be(old).wrapping_sub(0x100).to_be();
            mem::store16(w, new);
            mem::store16(c, csum_update(mem::load16(c), old as u64, new as u64, 2));
        }
        return DIRECT_DONE;
    }
    let x = XdpContext::new(ctx);
    let Some(old) = x.load::<u16>(IP_TTL_OFF) else {
        return DIRECT_FAILED;
    };
    let new = u16::from_be(old).wrapping_sub(0x100).to_be();
    if x.store(IP_TTL_OFF, &new) && x.l3_csum_replace(IP_CSUM_OFF, old as u64, new as u64, 2) {
        DIRECT_DONE
    } else {
        DIRECT_FAILED
    }
}

/// The Internet checksum `sum` updated for a change of `from` to `to` (RFC 1624 eq. 3,
/// `HC' = ~(~HC + ~m + m')`), as the kernel's `inet_proto_csum_replace*` computes it:
/// `size` 2 or 4 bytes of memory-order values, or 0 when `to` is a 32-bit difference from
/// `bpf_csum_diff` (`from` unused).
#[inline(always)]
fn csum_update(sum: u16, from: u64, to: u64, size: u64) -> u16 {
    let mut s = (!sum) as u64;
    match size {
        2 => s += (!(from as u16)) as u64 + (to as u16) as u64,
        4 => {
            let (f, t) = (!(from as u32), to as u32);
            s += (f & 0xffff) as u64 + (f >> 16) as u64 + (t & 0xffff) as u64 + (t >> 16) as u64;
        }
        _ => s += to & 0xffff_ffff,
    }
    !fold16(s)
}

/// [`Buf::rewrite`] of XDP, a global BPF function (verified once, see
/// `tcbuf::ebpf_proxy_tc_rewrite`).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn ebpf_proxy_xdp_rewrite(
    ctx: *mut xdp_md,
    pkt: *const Pkt,
    to: *const CtEntry,
) -> i32 {
    if pkt.is_null() || to.is_null() {
        return DIRECT_FAILED;
    }
    // SAFETY: our context; both pointers are the caller's, non-null, of their sizes.
    unsafe { rewrite_any(&XdpContext::new(ctx), &*pkt, &*to) }
}

/// [`Buf::rewrite4_direct`] of XDP: everything in place, the L4 checksum included (an XDP
/// frame has no checksum offload state). A UDP checksum of zero ("none") stays zero, a
/// computed zero is written as 0xffff (RFC 768).
#[inline(always)]
fn rewrite4_in_place(xdp: &XdpContext, saddr: u32, daddr: u32, ports: u32, proto: u32) -> i32 {
    let ctx = xdp.ctx;
    // SAFETY: our context; the first buffer as the verifier bounds it.
    let (data, end) = unsafe { ((*ctx).data as usize, (*ctx).data_end as usize) };
    // SAFETY: `data..end` is the first buffer of the frame.
    let Some((addrs, port_diff, csum)) =
        (unsafe { rewrite4_at(data, end, saddr, daddr, ports, proto) })
    else {
        return DIRECT_UNFIT;
    };
    let p = csum;
    // SAFETY: `rewrite4_at` checked the checksum field is within the frame.
    unsafe {
        let old = mem::load16(p);
        let udp = proto == PROTO_UDP as u32;
        if !(udp && old == 0) {
            let mut new = !fold16((!old) as u64 + addrs as u64 + port_diff as u64);
            if udp && new == 0 {
                new = 0xffff;
            }
            mem::store16(p, new);
        }
    }
    DIRECT_DONE
}

/// The packet operations of an XDP frame: `bpf_xdp_load_bytes` / `bpf_xdp_store_bytes`
/// (bounds checked by the kernel, as the skb helpers of tc; a multi-buffer frame reads
/// across its fragments), checksums updated here (XDP has no checksum helpers and no checksum offload state to
/// keep), the FIB lookup on the XDP context. `send_out` uses the next hop the entry point
/// looked up before translating.
impl Buf for XdpContext {
    #[inline(always)]
    fn linear(&self) -> (usize, usize) {
        (self.data(), self.data_end())
    }

    #[inline(always)]
    fn load<T>(&self, off: usize) -> Option<T> {
        let mut v = core::mem::MaybeUninit::<T>::uninit();
        // SAFETY: the helper writes exactly `size_of::<T>()` bytes into `v`, or fails.
        let r = unsafe {
            bpf_xdp_load_bytes(
                self.ctx,
                off as u32,
                v.as_mut_ptr() as *mut _,
                core::mem::size_of::<T>() as u32,
            )
        };
        // SAFETY: fully written when the helper succeeded.
        (r == 0).then(|| unsafe { v.assume_init() })
    }

    #[inline(always)]
    fn load16(&self, off: usize, dst: &mut [u8; 16]) -> bool {
        // SAFETY: the helper writes exactly 16 bytes into `dst`.
        unsafe { bpf_xdp_load_bytes(self.ctx, off as u32, dst.as_mut_ptr() as *mut _, 16) == 0 }
    }

    #[inline(always)]
    fn store<T>(&self, off: usize, v: &T) -> bool {
        // SAFETY: the helper reads `size_of::<T>()` bytes of `v`.
        unsafe {
            bpf_xdp_store_bytes(
                self.ctx,
                off as u32,
                v as *const T as *mut _,
                core::mem::size_of::<T>() as u32,
            ) == 0
        }
    }

    #[inline(always)]
    fn l3_csum_replace(&self, off: usize, from: u64, to: u64, size: u64) -> bool {
        let Some(sum) = self.load::<u16>(off) else {
            return false;
        };
        self.store(off, &csum_update(sum, from, to, size))
    }

    #[inline(always)]
    fn l4_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> bool {
        let Some(sum) = self.load::<u16>(off) else {
            return false;
        };
        let mangled = flags & BPF_F_MARK_MANGLED_0 != 0;
        // A UDP checksum of zero means "none" (IPv4): it stays zero.
        if mangled && sum == 0 {
            return true;
        }
        let mut new = csum_update(sum, from, to, flags & 0xf);
        if mangled && new == 0 {
            new = 0xffff;
        }
        self.store(off, &new)
    }

    #[inline(always)]
    fn len(&self) -> u32 {
        // SAFETY: helper on our own context (all fragments of a multi-buffer frame).
        unsafe { bpf_xdp_get_buff_len(self.ctx) as u32 }
    }

    #[inline(always)]
    fn ifindex(&self) -> u32 {
        self.ingress_ifindex() as u32
    }

    #[inline(always)]
    fn fib_lookup(&self, params: &mut FibParams) -> i64 {
        // SAFETY: helper with our context and a buffer of the right size.
        unsafe {
            bpf_fib_lookup(
                self.ctx as *mut _,
                params,
                core::mem::size_of::<FibParams>() as i32,
                0,
            )
        }
    }

    #[inline(always)]
    fn redirect(&self, ifindex: u32) -> Verdict {
        // SAFETY: helper without memory arguments.
        if unsafe { bpf_redirect(ifindex, 0) } == XDP_REDIRECT as i64 {
            Verdict::Redirect
        } else {
            Verdict::Drop
        }
    }

    #[inline(always)]
    fn redirect_neigh(&self, _ifindex: u32) -> Verdict {
        // XDP has no neighbour resolution: the stack gets the packet (the XDP entry point
        // never translates a packet it cannot send out, see `send_out`).
        Verdict::Pass
    }

    #[inline(always)]
    fn grow_after_l2(&self, len: u32) -> bool {
        // Room at the head, then the Ethernet header moved back to the front.
        let Some(eth) = self.load::<[u8; ETH_HLEN]>(len as usize) else {
            return false;
        };
        // SAFETY: helper on our own context, no memory arguments.
        if unsafe { bpf_xdp_adjust_head(self.ctx, -(len as i32)) } != 0 {
            return false;
        }
        self.store(0, &eth)
    }

    #[inline(always)]
    fn truncate(&self, len: u32) -> bool {
        let delta = len as i32 - Buf::len(self) as i32;
        // SAFETY: helper on our own context, no memory arguments.
        unsafe { bpf_xdp_adjust_tail(self.ctx, delta) == 0 }
    }

    /// XDP leaves direct server return flows to tcx (`plan` hands their packets to the
    /// stack), which encapsulates them with the skb's GSO metadata kept right.
    #[inline(always)]
    fn hook(_ingress: bool) -> u8 {
        proxy_common::monitor::HOOK_XDP
    }

    const ENCAPSULATES: bool = false;

    #[inline(always)]
    fn rewrite4_direct(&self, saddr: u32, daddr: u32, ports: u32, proto: u32) -> i32 {
        rewrite4_in_place(self, saddr, daddr, ports, proto)
    }

    #[inline(always)]
    fn rewrite(&self, pkt: &Pkt, to: &CtEntry) -> i32 {
        ebpf_proxy_xdp_rewrite(self.ctx, pkt, to)
    }

    #[inline(always)]
    fn encap_room(&self, len: u32, _v6: bool) -> bool {
        self.grow_after_l2(len)
    }

    #[inline(always)]
    fn decap_room(&self, len: u32, _v6: bool) -> bool {
        let Some(eth) = self.load::<[u8; ETH_HLEN]>(0) else {
            return false;
        };
        // SAFETY: helper on our own context, no memory arguments.
        if unsafe { bpf_xdp_adjust_head(self.ctx, len as i32) } != 0 {
            return false;
        }
        self.store(0, &eth)
    }

    #[inline(always)]
    fn send_out(&self, _src: &[u8; 16], _dst: &[u8; 16]) -> Verdict {
        // The entry point looked the next hop up before the rewrite (`reply`).
        if set_macs(self) {
            Verdict::Redirect
        } else {
            failed()
        }
    }
}
