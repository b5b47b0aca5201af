//! The tc context's packet operations ([`Buf`] for `TcContext`), with the skb helpers: used
//! by the node's tcx hooks (`tc`) and the bypassed workloads' (`pod`). Above `fib`, which
//! it uses to send a translated reply on.

use aya_ebpf::{
    bindings::{bpf_adj_room_mode, bpf_fib_lookup as FibParams},
    helpers::{
        bpf_fib_lookup, bpf_redirect, bpf_redirect_neigh, bpf_skb_change_tail, bpf_skb_load_bytes,
    },
    programs::TcContext,
};

use crate::{fib, packet::Buf, verdict::Verdict};

/// `bpf_skb_adjust_room` flags: the room is an outer IPv4 / IPv6 header (GSO and the
/// inner header offsets follow), or an outer one removed.
const BPF_F_ADJ_ROOM_ENCAP_L3_IPV4: u64 = 1 << 1;
const BPF_F_ADJ_ROOM_ENCAP_L3_IPV6: u64 = 1 << 2;
const BPF_F_ADJ_ROOM_DECAP_L3_IPV4: u64 = 1 << 7;
const BPF_F_ADJ_ROOM_DECAP_L3_IPV6: u64 = 1 << 8;

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
