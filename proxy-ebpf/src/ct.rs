//! Conntrack of packet flows: the entries of `TC_CONNTRACK` (layouts and the meaning of each
//! direction in `proxy_common::nat`), their TCP state, liveness and timeouts.
//!
//! Each entry says "a packet with this tuple is rewritten to that tuple"; reversing an
//! entry's rewritten tuple gives the key of the other direction's entry ([`peer_key`]), so
//! either direction updates the other (state bits, last seen).

use aya_ebpf::{
    bindings::BPF_ANY,
    helpers::{bpf_jiffies64, bpf_ktime_get_coarse_ns},
};
use proxy_common::nat::{
    CT_F_FIN_ORIG, CT_F_FIN_REPLY, CT_F_REPLY, CT_F_RST, CT_F_SEEN_REPLY, CT_PEER_TICK_SHIFT,
    CtEntry, CtKey, TcCounter, ct_alive, ct_closed, ct_timeout_ns,
};

use crate::{
    maps::{TC_CONFIG, TC_CONNTRACK, TC_CT_CLOCK},
    packet::{TCP_FIN, TCP_RST},
    types::Scratch,
};

/// The conntrack clock, nanoseconds of `CLOCK_MONOTONIC` at the resolution of the kernel's
/// tick: the entries' `last_seen_ns` and every liveness check of the packet paths.
/// `jiffies * tick_ns + offset_ns` as the agent calibrated this load
/// (`proxy_common::nat::CtClock`): reading jiffies is a plain load, where the coarse clock
/// (`bpf_ktime_get_coarse_ns`, Linux >= 5.11, the fallback before calibration) converts a
/// timespec per call and the precise one reads the clock source (a virtual machine's TSC
/// or kvm-clock). Timeouts are seconds long, so the lag of up to two ticks (at most 20 ms)
/// changes nothing. The agent reads `CLOCK_MONOTONIC`, never behind this clock.
#[inline(always)]
pub fn now() -> u64 {
    if let Some(c) = TC_CT_CLOCK.get(0)
        && c.tick_ns != 0
    {
        // SAFETY: helper without arguments or side effects.
        let j = unsafe { bpf_jiffies64() };
        return j.wrapping_mul(c.tick_ns).wrapping_add(c.offset_ns);
    }
    // SAFETY: helper without arguments or side effects.
    unsafe { bpf_ktime_get_coarse_ns() }
}

/// The state bits both directions of a flow share.
pub const SHARED_FLAGS: u16 = CT_F_SEEN_REPLY | CT_F_FIN_ORIG | CT_F_FIN_REPLY | CT_F_RST;

/// Whether a TCP flow with `flags` is closed (RST, or FIN both ways).
#[inline(always)]
pub fn is_closed(flags: u16) -> bool {
    ct_closed(flags)
}

/// Idle time in nanoseconds after which an entry with `flags` of protocol `proto` is dead,
/// with the configured timeouts (`TcConfig`; see `proxy_common::nat::ct_timeout_ns`).
#[inline(always)]
pub fn timeout_of(flags: u16, proto: u8) -> u64 {
    match TC_CONFIG.get(0) {
        Some(c) => ct_timeout_ns(
            flags,
            proto,
            c.tcp_established_ns,
            c.udp_ns,
            c.udp_stream_ns,
        ),
        None => ct_timeout_ns(flags, proto, 0, 0, 0),
    }
}

/// Whether an entry with `flags`, last seen at `seen`, is still alive at `now`.
#[inline(always)]
pub fn alive(flags: u16, seen: u64, proto: u8, now: u64) -> bool {
    ct_alive(now, seen, timeout_of(flags, proto))
}

/// Flags of `entry` after a packet with `tcp_flags` in its direction.
#[inline(always)]
pub fn track(entry: &CtEntry, tcp_flags: u8) -> u16 {
    let mut f = entry.flags;
    let reply = f & CT_F_REPLY != 0;
    if reply {
        f |= CT_F_SEEN_REPLY;
    }
    if tcp_flags & TCP_RST != 0 {
        f |= CT_F_RST;
    }
    if tcp_flags & TCP_FIN != 0 {
        f |= if reply { CT_F_FIN_REPLY } else { CT_F_FIN_ORIG };
    }
    f
}

/// The key of the other direction of the flow `entry` belongs to: its rewritten tuple,
/// reversed.
#[inline(always)]
pub fn peer_key(entry: &CtEntry, proto: u8) -> CtKey {
    let mut k = core::mem::MaybeUninit::<CtKey>::uninit();
    let w = k.as_mut_ptr() as *mut u64;
    let word = |a: &[u8; 16], i: usize| {
        u64::from_ne_bytes([
            a[i],
            a[i + 1],
            a[i + 2],
            a[i + 3],
            a[i + 4],
            a[i + 5],
            a[i + 6],
            a[i + 7],
        ])
    };
    let tail = u16::from_ne_bytes(entry.dport) as u64
        | (u16::from_ne_bytes(entry.sport) as u64) << 16
        | (proto as u64) << 32;
    // SAFETY: `CtKey` is 40 bytes, 8-byte aligned, any bytes valid; written as its five
    // words (little-endian target), so the padding's zeroes are no `memset` call.
    unsafe {
        w.write(word(&entry.daddr, 0));
        w.add(1).write(word(&entry.daddr, 8));
        w.add(2).write(word(&entry.saddr, 0));
        w.add(3).write(word(&entry.saddr, 8));
        w.add(4).write(tail);
        k.assume_init()
    }
}

/// The conntrack clock's tick at `now` ([`CT_PEER_TICK_SHIFT`]).
#[inline(always)]
pub fn tick(now: u64) -> u32 {
    (now >> CT_PEER_TICK_SHIFT) as u32
}

/// Shares the state bits and liveness with the other direction.
#[inline(always)]
pub fn touch_peer(entry: &CtEntry, proto: u8, flags: u16, now: u64) {
    if let Some(p) = TC_CONNTRACK.get_ptr_mut(peer_key(entry, proto)) {
        // SAFETY: value of the map, word-sized stores.
        unsafe {
            (*p).flags |= flags & SHARED_FLAGS;
            (*p).last_seen_ns = now;
        }
    }
}

/// Writes the two entries of a flow that is not source-NATed from the scratch slot: the
/// reply entry `rev` (keyed by the reverse of `fwd`'s rewrite, left in `rkey`) first, then
/// the original entry `fwd` keyed `key`; when the second write fails the first is removed,
/// so nothing is half-applied. `Err` is the counter of the drop.
#[inline(always)]
pub fn track_pair(key: &CtKey, sc: &mut Scratch) -> Result<(), TcCounter> {
    sc.rkey = peer_key(&sc.fwd, key.proto);
    if TC_CONNTRACK
        .insert(&sc.rkey, &sc.rev, BPF_ANY as u64)
        .is_err()
    {
        return Err(TcCounter::ConntrackFull);
    }
    if TC_CONNTRACK.insert(key, &sc.fwd, BPF_ANY as u64).is_err() {
        let _ = TC_CONNTRACK.remove(&sc.rkey);
        return Err(TcCounter::ConntrackFull);
    }
    Ok(())
}
