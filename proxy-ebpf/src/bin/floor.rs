//! The floor of the packet micro-benchmark (`ebpf-proxy-bench micro`): the least a program
//! does for a packet of a tracked flow, to compare ebpf-proxy's entry programs with. Built
//! into an object of its own (`ebpf-proxy-floor`), never loaded by the agent.
//!
//! Each program parses Ethernet, IPv4 without options and TCP, looks the 5-tuple up in one
//! hash map ([`FLOOR_FLOWS`]), rewrites the destination address and port with incremental
//! checksum updates (RFC 1624) and redirects to the ifindex of the map's value; anything
//! else passes untouched:
//! - `floor_tc` and `floor_xdp`: direct packet access, checksums computed in the program
//!   (the floor proper);
//! - `floor_tc_helpers`: the same through the skb helpers the product's tc programs use,
//!   as few calls as that takes: one `bpf_skb_load_bytes` of the headers, then
//!   `bpf_skb_store_bytes`, `bpf_l3_csum_replace` and `bpf_l4_csum_replace` (the latter
//!   with the pseudo-header flag, which also keeps `skb->csum` right for
//!   `CHECKSUM_COMPLETE`);
//! - `floor_xdp_helpers`: the same through `bpf_xdp_load_bytes` and `bpf_xdp_store_bytes`
//!   as the product's XDP program accesses packets (which works on multi-buffer frames
//!   too), checksums computed in the program;
//! - `floor_tc_pass` and `floor_xdp_pass`: return at once, so their time is what the
//!   measurement itself adds to every program (the clock reads and the call).

#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::xdp_action::XDP_PASS,
    helpers::{
        bpf_l3_csum_replace, bpf_l4_csum_replace, bpf_redirect, bpf_skb_load_bytes,
        bpf_skb_store_bytes, bpf_xdp_load_bytes, bpf_xdp_store_bytes,
    },
    macros::{classifier, map, xdp},
    maps::HashMap,
    programs::{TcContext, XdpContext},
};

/// Key of [`FLOOR_FLOWS`]: a TCP flow's tuple as it arrives, 16 bytes: source and
/// destination address, source and destination port (network byte order, as in the
/// packet), then the protocol number (6) as a host-order `u32` (so, on this little-endian
/// target, the protocol byte followed by three zero bytes). Whole words, so the program
/// builds it without byte stores.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FloorKey {
    pub saddr: u32,
    pub daddr: u32,
    /// The first four bytes of the TCP header: source port, destination port.
    pub ports: u32,
    pub proto: u32,
}

/// Value of [`FLOOR_FLOWS`]: the new destination (network byte order) and the interface to
/// redirect to, 12 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FloorTarget {
    pub daddr: u32,
    pub dport: u16,
    pub _pad: u16,
    pub ifindex: u32,
}

/// The tracked flows; the bench fills it.
#[map]
static FLOOR_FLOWS: HashMap<FloorKey, FloorTarget> = HashMap::with_max_entries(1024, 0);

const ETH_HLEN: usize = 14;
/// Ethernet header, IPv4 header without options, TCP header without options.
const MIN_LEN: usize = ETH_HLEN + 20 + 20;
/// Offsets in the frame.
const IP_CSUM_OFF: usize = ETH_HLEN + 10;
const IP_DST_OFF: usize = ETH_HLEN + 16;
const TCP_DPORT_OFF: usize = ETH_HLEN + 20 + 2;
const TCP_CSUM_OFF: usize = ETH_HLEN + 20 + 16;
/// `tcx` "next program" (leave the packet to the stack).
const TCX_NEXT: i32 = -1;
/// `bpf_l4_csum_replace` flag: the change is part of the pseudo-header.
const BPF_F_PSEUDO_HDR: u64 = 1 << 4;

/// What a lookup found: the frame (its start), the new destination and the interface.
struct Hit {
    data: usize,
    to: FloorTarget,
}

/// The `T` at `off` bytes into the frame at `p`.
///
/// # Safety
/// `off + size_of::<T>()` must be within the bounds the caller checked against the packet's
/// end. The access may be unaligned: packet loads and stores need no alignment in BPF on
/// the architectures this runs on (the verifier enforces it only with strict alignment),
/// and a typed access is one load or store where an unaligned-read helper would be
/// byte-by-byte (as C programs read `iph->daddr`).
#[inline(always)]
unsafe fn at<T>(p: usize, off: usize) -> *mut T {
    (p + off) as *mut T
}

/// Parses the frame between `data` and `end` and looks its tuple up.
#[inline(always)]
fn lookup(data: usize, end: usize) -> Option<Hit> {
    if data + MIN_LEN > end {
        return None;
    }
    // SAFETY: the whole of [data, data + MIN_LEN) is checked to be in the packet above.
    let to = unsafe { lookup_at(data)? };
    Some(Hit { data, to })
}

/// Parses the `MIN_LEN` bytes of headers at `data` (in the packet or a copy) and looks
/// their tuple up.
///
/// # Safety
/// `[data, data + MIN_LEN)` must be readable.
#[inline(always)]
unsafe fn lookup_at(data: usize) -> Option<FloorTarget> {
    // SAFETY: the caller's.
    unsafe {
        // EtherType 0x0800, IPv4 with a 20-byte header, TCP, not a fragment.
        if *at::<u16>(data, 12) != 0x0800u16.to_be()
            || *at::<u8>(data, ETH_HLEN) != 0x45
            || *at::<u8>(data, ETH_HLEN + 9) != 6
            || *at::<u16>(data, ETH_HLEN + 6) & 0x3fffu16.to_be() != 0
        {
            return None;
        }
        let key = FloorKey {
            saddr: *at::<u32>(data, ETH_HLEN + 12),
            daddr: *at::<u32>(data, IP_DST_OFF),
            ports: *at::<u32>(data, ETH_HLEN + 20),
            proto: 6,
        };
        Some(*FLOOR_FLOWS.get(key)?)
    }
}

/// Room for the headers a helper variant reads (up to and including the TCP checksum),
/// from [`HEADERS_AT`] on: the stack, unlike the packet, takes only aligned loads, and there
/// the IPv4 header starts 8-byte aligned.
#[repr(C, align(8))]
struct Headers([u8; HEADERS_AT + MIN_LEN]);

/// Where the frame's first byte goes in [`Headers`].
const HEADERS_AT: usize = 2;

/// Adds 16-bit word `x` to a ones' complement sum (unfolded).
#[inline(always)]
fn add(sum: u32, x: u16) -> u32 {
    sum + x as u32
}

/// Folds a ones' complement sum to 16 bits.
#[inline(always)]
fn fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}

/// Checksum `check` after 32-bit word `old` became `new` (RFC 1624, eqn. 3). Byte order
/// does not matter as long as all three are read from the packet the same way.
#[inline(always)]
fn update32(check: u16, old: u32, new: u32) -> u16 {
    let mut s = add(0, !check);
    s = add(s, !(old as u16));
    s = add(s, !((old >> 16) as u16));
    s = add(s, new as u16);
    s = add(s, (new >> 16) as u16);
    !fold(s)
}

/// Checksum `check` after 16-bit word `old` became `new`.
#[inline(always)]
fn update16(check: u16, old: u16, new: u16) -> u16 {
    !fold(add(add(add(0, !check), !old), new))
}

/// Rewrites the destination of the frame at `h.data` (checked by [`lookup`]) in place.
#[inline(always)]
fn rewrite_direct(h: &Hit) {
    // SAFETY: offsets below MIN_LEN, checked by `lookup`.
    unsafe {
        let ip_csum = at::<u16>(h.data, IP_CSUM_OFF);
        let daddr = at::<u32>(h.data, IP_DST_OFF);
        let dport = at::<u16>(h.data, TCP_DPORT_OFF);
        let tcp_csum = at::<u16>(h.data, TCP_CSUM_OFF);
        let (old_addr, old_port) = (*daddr, *dport);
        *ip_csum = update32(*ip_csum, old_addr, h.to.daddr);
        *tcp_csum = update16(
            update32(*tcp_csum, old_addr, h.to.daddr),
            old_port,
            h.to.dport,
        );
        *daddr = h.to.daddr;
        *dport = h.to.dport;
    }
}

#[classifier]
pub fn floor_tc(ctx: TcContext) -> i32 {
    let Some(h) = lookup(ctx.data(), ctx.data_end()) else {
        return TCX_NEXT;
    };
    rewrite_direct(&h);
    // SAFETY: helper without memory arguments.
    unsafe { bpf_redirect(h.to.ifindex, 0) as i32 }
}

#[classifier]
pub fn floor_tc_helpers(ctx: TcContext) -> i32 {
    // Uninitialised: the helper writes it (zeroing it first would cost a byte loop).
    let mut h = core::mem::MaybeUninit::<Headers>::uninit();
    let skb = ctx.skb.skb;
    let base = h.as_mut_ptr() as usize + HEADERS_AT;
    // SAFETY: the helpers read and write the packet within its bounds (or fail) and
    // `h` (MIN_LEN bytes) only; `lookup_at` reads `h` once the first helper filled it.
    unsafe {
        if bpf_skb_load_bytes(skb as *const _, 0, base as *mut _, MIN_LEN as u32) != 0 {
            return TCX_NEXT;
        }
        let Some(to) = lookup_at(base) else {
            return TCX_NEXT;
        };
        let old_addr = *at::<u32>(base, IP_DST_OFF);
        let old_port = *at::<u16>(base, TCP_DPORT_OFF);
        if bpf_l4_csum_replace(
            skb,
            TCP_CSUM_OFF as u32,
            old_addr as u64,
            to.daddr as u64,
            BPF_F_PSEUDO_HDR | 4,
        ) != 0
            || bpf_l4_csum_replace(
                skb,
                TCP_CSUM_OFF as u32,
                old_port as u64,
                to.dport as u64,
                2,
            ) != 0
            || bpf_l3_csum_replace(skb, IP_CSUM_OFF as u32, old_addr as u64, to.daddr as u64, 4)
                != 0
            || bpf_skb_store_bytes(
                skb,
                IP_DST_OFF as u32,
                &to.daddr as *const u32 as *const _,
                4,
                0,
            ) != 0
            || bpf_skb_store_bytes(
                skb,
                TCP_DPORT_OFF as u32,
                &to.dport as *const u16 as *const _,
                2,
                0,
            ) != 0
        {
            return 2; // TC_ACT_SHOT
        }
        bpf_redirect(to.ifindex, 0) as i32
    }
}

#[classifier]
pub fn floor_tc_pass(_ctx: TcContext) -> i32 {
    TCX_NEXT
}

#[xdp]
pub fn floor_xdp(ctx: XdpContext) -> u32 {
    let Some(h) = lookup(ctx.data(), ctx.data_end()) else {
        return XDP_PASS;
    };
    rewrite_direct(&h);
    // SAFETY: helper without memory arguments.
    unsafe { bpf_redirect(h.to.ifindex, 0) as u32 }
}

#[xdp]
pub fn floor_xdp_helpers(ctx: XdpContext) -> u32 {
    let mut h = core::mem::MaybeUninit::<Headers>::uninit();
    let x = ctx.ctx;
    let base = h.as_mut_ptr() as usize + HEADERS_AT;
    // SAFETY: the helpers read and write the frame within its bounds (or fail) and `h`
    // (MIN_LEN bytes) or the stack values passed only; `lookup_at` reads `h` once the
    // first helper filled it.
    unsafe {
        if bpf_xdp_load_bytes(x, 0, base as *mut _, MIN_LEN as u32) != 0 {
            return XDP_PASS;
        }
        let Some(to) = lookup_at(base) else {
            return XDP_PASS;
        };
        let old_addr = *at::<u32>(base, IP_DST_OFF);
        let old_port = *at::<u16>(base, TCP_DPORT_OFF);
        let ip_csum = update32(*at::<u16>(base, IP_CSUM_OFF), old_addr, to.daddr);
        let tcp_csum = update16(
            update32(*at::<u16>(base, TCP_CSUM_OFF), old_addr, to.daddr),
            old_port,
            to.dport,
        );
        let store = |off: usize, p: *const u8, len: u32| {
            bpf_xdp_store_bytes(x, off as u32, p as *mut _, len) == 0
        };
        if !(store(IP_CSUM_OFF, &ip_csum as *const u16 as *const u8, 2)
            && store(IP_DST_OFF, &to.daddr as *const u32 as *const u8, 4)
            && store(TCP_DPORT_OFF, &to.dport as *const u16 as *const u8, 2)
            && store(TCP_CSUM_OFF, &tcp_csum as *const u16 as *const u8, 2))
        {
            return 1; // XDP_DROP
        }
        bpf_redirect(to.ifindex, 0) as u32
    }
}

#[xdp]
pub fn floor_xdp_pass(_ctx: XdpContext) -> u32 {
    XDP_PASS
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any reachable panic path; this is never executed.
    loop {}
}

/// License of the object, as in the product's object (`src/main.rs`).
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 26] = *b"GPL and additional rights\0";
