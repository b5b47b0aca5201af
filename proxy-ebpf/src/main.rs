//! ebpf-proxy kernel programs: Kubernetes Service load balancing at the socket (cgroup hooks)
//! and for packets entering the node (tcx), built for `bpfel-unknown-none`.
//!
//! Entry points, one module per kind of hook, each thin (parse the context, call the shared
//! logic, map its outcome to the hook's return code):
//! - [`sock`]: cgroup `sock_addr` hooks (`connect4/6`, `sendmsg4/6`, `recvmsg4/6`,
//!   `getpeername4/6`) and cgroup `sock_release`;
//! - [`skb`]: the cgroup `skb` egress hook (stale connected UDP sockets);
//! - [`pod`]: the tcx hooks of bypassed workloads' interfaces (`pod_ingress`,
//!   `pod_egress`): per-packet translation for workloads that bypass the socket hooks;
//! - [`tc`]: the tcx hooks of the node's interfaces (`tc_ingress`, `tc_egress`) and the
//!   least-connections collection program `tc_lc_gc` run by the agent;
//! - [`xdp`]: the XDP program of the external interfaces (`xdp_ingress`), which finishes
//!   the flows it can send out of the node itself and hands everything else to `tc`.
//!
//! Shared logic, one module per concern, written against [`packet::Buf`] (the packet
//! operations a hook offers) rather than a tc context, so the XDP hook reuses it unchanged.
//! Layered as Katran's program is (`balancer_structs.h`, then `balancer_maps.h`, then the
//! logic): a module imports only modules of the layers before its own.
//! 1. Shared types: [`addr`] (the L4 address every module passes around), [`verdict`]
//!    (what happens to a packet, hook-neutral), [`types`] (what a hook asks of the load
//!    balancer and gets back, the scratch space of a new flow), [`mem`] (word loads and
//!    stores at any alignment, one instruction each, and word-sized copies).
//! 2. [`maps`]: every map, and the accessors that only read one.
//! 3. Counting and tracing: [`stats`] (per-CPU counters, counted drops), [`monitor`] (the
//!    event stream of `ebpf-proxy monitor`), [`klog`] (debug lines for
//!    `--kernel-log-level`, aya-log, pruned when off).
//! 4. Logic: [`lb`] (the frontend lookup with its scope policy and backend selection:
//!    algorithms, affinity), [`lc`] (least-connections accounting, one protocol for sockets
//!    and packet flows), [`packet`] (the [`packet::Buf`] trait; parsing of Ethernet, IPv4
//!    with options and fragments, IPv6 with extension headers), [`csum`] (rewriting
//!    addresses and ports with their checksums), [`ct`] (the conntrack entries of packet
//!    flows: state, timeouts, both directions), [`fib`] (sending a packet on to its next hop
//!    with a FIB lookup), [`tcbuf`] (the tc context's packet operations), [`icmp`]
//!    (translation of ICMP and ICMPv6 errors quoting a translated packet), [`dsr`] (direct
//!    server return: the encapsulation on the entry node, the decapsulation and the replies'
//!    MSS on the backend's node), [`admit`] (which new flows are admitted and source-NATed:
//!    source ranges, masquerading rules), [`nat`] (DNAT and SNAT of packet flows: new
//!    flows, SNAT ports and bindings, tracked packets).
//! 5. The entry points above.
//!
//! Layouts of map keys and values come from `proxy-common` only.

#![no_std]
#![no_main]
// Atomic adds on shared map values (BPF_ATOMIC | BPF_ADD): the bpfel target has no atomic
// types, so the intrinsic is used directly.
#![allow(internal_features)]
#![feature(core_intrinsics)]
// Single-instruction unaligned packet accesses (`mem`).
#![feature(asm_experimental_arch)]

mod addr;
mod admit;
mod csum;
mod ct;
mod dsr;
mod fib;
mod icmp;
mod klog;
mod lb;
mod lc;
mod maps;
mod mem;
mod monitor;
mod nat;
mod packet;
mod pod;
mod skb;
mod sock;
mod stats;
mod tc;
mod tcbuf;
mod types;
mod verdict;
mod xdp;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any reachable panic path; this is never executed.
    loop {}
}

/// License of the object, as the kernel reads it (`license_is_gpl_compatible`): the crate is
/// `GPL-2.0-only OR Apache-2.0`, which the kernel's vocabulary calls "GPL and additional
/// rights" (GPL v2 rights and more). GPL-compatible, so GPL-only helpers are available.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 26] = *b"GPL and additional rights\0";
