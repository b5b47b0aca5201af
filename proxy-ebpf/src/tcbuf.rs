//! The tc context's packet operations ([`Buf`] for `TcContext`), with the skb helpers: used
//! by the node's tcx hooks (`tc`) and the bypassed workloads' (`pod`). Above `fib`, which
//! it uses to send a translated reply on.

use aya_ebpf::{
    bindings::{__sk_buff, bpf_adj_room_mode, bpf_fib_lookup as FibParams},
    helpers::{
        bpf_fib_lookup, bpf_l4_csum_replace, bpf_redirect, bpf_redirect_neigh, bpf_skb_change_tail,
        bpf_skb_load_bytes,
    },
    programs::TcContext,
};

use proxy_common::{PROTO_UDP, nat::CtEntry};

use crate::{
    csum::{
        BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, DIRECT_DONE, DIRECT_FAILED, DIRECT_UNFIT,
        rewrite_any, rewrite4_at,
    },
    fib,
    packet::{Buf, Pkt},
    verdict::Verdict,
};

/// `bpf_skb_adjust_room` flags: the room is an outer IPv4 / IPv6 header (GSO and the
/// inner header offsets follow), or an outer one removed.
const BPF_F_ADJ_ROOM_ENCAP_L3_IPV4: u64 = 1 << 1;
const BPF_F_ADJ_ROOM_ENCAP_L3_IPV6: u64 = 1 << 2;
const BPF_F_ADJ_ROOM_DECAP_L3_IPV4: u64 = 1 << 7;
const BPF_F_ADJ_ROOM_DECAP_L3_IPV6: u64 = 1 << 8;

/// [`Buf::rewrite`] of the tc hooks, a global BPF function: the verifier checks it once,
/// with the context and two pointers to memory of their types' sizes as arguments, not
/// once per state of each caller. Returns [`DIRECT_DONE`] or [`DIRECT_FAILED`].
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn ebpf_proxy_tc_rewrite(
    skb: *mut __sk_buff,
    pkt: *const Pkt,
    to: *const CtEntry,
) -> i32 {
    if pkt.is_null() || to.is_null() {
        return DIRECT_FAILED;
    }
    // SAFETY: our context; both pointers are the caller's, non-null, of their sizes.
    unsafe { rewrite_any(&TcContext::new(skb), &*pkt, &*to) }
}

/// [`Buf::rewrite4_direct`] of the tc hooks: the addresses, ports and IP header checksum
/// written in place; the L4 checksum through `bpf_l4_csum_replace` in its difference
/// form, once for the pseudo-header and once for the ports, because only the helper knows
/// the skb's checksum state (a `CHECKSUM_PARTIAL` field takes the pseudo-header's change
/// inverted and not the ports', a `CHECKSUM_COMPLETE` skb needs `skb->csum` moved by the
/// pseudo-header's). Ports whose sum did not change (a Service whose port is its target
/// port, the common case of DNS) leave the checksum as it is: that call is skipped.
#[inline(always)]
fn rewrite4_in_place(ctx: &TcContext, saddr: u32, daddr: u32, ports: u32, proto: u32) -> i32 {
    let skb = ctx.skb.skb;
    // SAFETY: our context; the frame's linear part as the verifier bounds it.
    let (data, end) = unsafe { ((*skb).data as usize, (*skb).data_end as usize) };
    // SAFETY: `data..end` is the linear part.
    let Some((addrs, port_diff, csum)) =
        (unsafe { rewrite4_at(data, end, saddr, daddr, ports, proto) })
    else {
        return DIRECT_UNFIT;
    };
    let off = (csum - data) as u32;
    let m = if proto == PROTO_UDP as u32 {
        BPF_F_MARK_MANGLED_0
    } else {
        0
    };
    // SAFETY: helpers on our own context (size 0: `to` is a difference).
    let done = unsafe {
        bpf_l4_csum_replace(skb, off, 0, addrs as u64, BPF_F_PSEUDO_HDR | m) == 0
            && (port_diff == 0
                || port_diff == 0xffff
                || bpf_l4_csum_replace(skb, off, 0, port_diff as u64, m) == 0)
    };
    if done { DIRECT_DONE } else { DIRECT_FAILED }
}

impl Buf for TcContext {
    #[inline(always)]
    fn linear(&self) -> (usize, usize) {
        (self.data(), self.data_end())
    }

    #[inline(always)]
    fn load<T>(&self, off: usize) -> Option<T> {
        TcContext::load(self, off).ok()
    }

    #[inline(always)]
    fn load16(&self, off: usize, dst: &mut [u8; 16]) -> bool {
        // SAFETY: the helper writes exactly 16 bytes into `dst`.
        unsafe {
            bpf_skb_load_bytes(
                self.skb.skb as *const _,
                off as u32,
                dst.as_mut_ptr() as *mut _,
                16,
            ) == 0
        }
    }

    #[inline(always)]
    fn store<T>(&self, off: usize, v: &T) -> bool {
        TcContext::store(self, off, v, 0).is_ok()
    }

    #[inline(always)]
    fn l3_csum_replace(&self, off: usize, from: u64, to: u64, size: u64) -> bool {
        TcContext::l3_csum_replace(self, off, from, to, size).is_ok()
    }

    #[inline(always)]
    fn l4_csum_replace(&self, off: usize, from: u64, to: u64, flags: u64) -> bool {
        TcContext::l4_csum_replace(self, off, from, to, flags).is_ok()
    }

    #[inline(always)]
    fn len(&self) -> u32 {
        TcContext::len(self)
    }

    #[inline(always)]
    fn ifindex(&self) -> u32 {
        // SAFETY: a field of our own context.
        unsafe { (*self.skb.skb).ifindex }
    }

    #[inline(always)]
    fn fib_lookup(&self, params: &mut FibParams) -> i64 {
        // SAFETY: helper with our context and a buffer of the right size.
        unsafe {
            bpf_fib_lookup(
                self.skb.skb as *mut _,
                params,
                core::mem::size_of::<FibParams>() as i32,
                0,
            )
        }
    }

    #[inline(always)]
    fn redirect(&self, ifindex: u32) -> Verdict {
        // SAFETY: helper without memory arguments.
        Verdict::of_redirect(unsafe { bpf_redirect(ifindex, 0) })
    }

    #[inline(always)]
    fn redirect_neigh(&self, ifindex: u32) -> Verdict {
        // SAFETY: helper without memory arguments (no explicit next hop).
        Verdict::of_redirect(unsafe { bpf_redirect_neigh(ifindex, core::ptr::null_mut(), 0, 0) })
    }

    #[inline(always)]
    fn send_out(&self, src: &[u8; 16], dst: &[u8; 16]) -> Verdict {
        fib::redirect_out(self, src, dst)
    }

    #[inline(always)]
    fn grow_after_l2(&self, len: u32) -> bool {
        // `bpf_skb_adjust_room` in MAC mode: room between the L2 and the L3 header.
        TcContext::adjust_room(self, len as i32, bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, 0).is_ok()
    }

    #[inline(always)]
    fn truncate(&self, len: u32) -> bool {
        // SAFETY: helper on our own context, no memory arguments.
        unsafe { bpf_skb_change_tail(self.skb.skb as *mut _, len, 0) == 0 }
    }

    #[inline(always)]
    fn hook(ingress: bool) -> u8 {
        if ingress {
            proxy_common::monitor::HOOK_TC_INGRESS
        } else {
            proxy_common::monitor::HOOK_TC_EGRESS
        }
    }

    const ENCAPSULATES: bool = true;

    #[inline(always)]
    fn rewrite4_direct(&self, saddr: u32, daddr: u32, ports: u32, proto: u32) -> i32 {
        rewrite4_in_place(self, saddr, daddr, ports, proto)
    }

    #[inline(always)]
    fn rewrite(&self, pkt: &Pkt, to: &CtEntry) -> i32 {
        ebpf_proxy_tc_rewrite(self.skb.skb, pkt, to)
    }

    #[inline(always)]
    fn is_gso(&self) -> bool {
        // SAFETY: a field of our own context.
        unsafe { (*self.skb.skb).gso_size != 0 }
    }

    #[inline(always)]
    fn encap_room(&self, len: u32, v6: bool) -> bool {
        let flags = if v6 {
            BPF_F_ADJ_ROOM_ENCAP_L3_IPV6
        } else {
            BPF_F_ADJ_ROOM_ENCAP_L3_IPV4
        };
        TcContext::adjust_room(self, len as i32, bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, flags).is_ok()
    }

    #[inline(always)]
    fn decap_room(&self, len: u32, v6: bool) -> bool {
        let flags = if v6 {
            BPF_F_ADJ_ROOM_DECAP_L3_IPV6
        } else {
            BPF_F_ADJ_ROOM_DECAP_L3_IPV4
        };
        TcContext::adjust_room(
            self,
            -(len as i32),
            bpf_adj_room_mode::BPF_ADJ_ROOM_MAC,
            flags,
        )
        .is_ok()
    }
}
