//! ebpf-proxy kernel programs. Entry points live per hook (`sock.rs` for the cgroup
//! socket hooks, `skb.rs` for the cgroup egress hook); shared logic in `lb.rs` (frontend lookup, backend selection) and the map
//! definitions in `maps.rs`. Layouts come from `proxy-common` only.

#![no_std]
#![no_main]
// Atomic adds on shared map values (BPF_ATOMIC | BPF_ADD): the bpfel target has no atomic
// types, so the intrinsic is used directly.
#![allow(internal_features)]
#![feature(core_intrinsics)]

mod lb;
mod maps;
mod skb;
mod sock;
mod tc;
mod tc_maps;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any reachable panic path; this is never executed.
    loop {}
}

/// License of the object: GPL-compatible so GPL-only helpers are available.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
