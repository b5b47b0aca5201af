//! Least-connections accounting: `LC_COUNTS` holds the active connections of each backend,
//! counted by the data path itself, for sockets and packet flows alike, for the frontends
//! of the least-load algorithms (`proxy_common::Algorithm::counts_connections`: least
//! connections, weighted least connections, shortest expected delay, never queue).
//!
//! One protocol for both: a connection or flow is counted by writing its *ownership record*
//! (a socket's `SOCKETS` entry with `SOCKET_F_COUNTED`, a packet flow's `TC_LC_FLOWS`
//! entry: original tuple -> backend) and then adding one to its backend's count; it is given
//! back by whoever deletes the record, and only when that delete succeeded. A map delete
//! succeeds once, so a count is never given back twice, whether the socket's release, the
//! packet program seeing the flow close, or the agent's collection (`tc_lc_gc`) gets there
//! first; the agent never writes a count the data path updates atomically.

// Map keys and values are passed by reference on purpose (a by-value key is copied onto the
// 512-byte BPF stack first).
#![allow(clippy::needless_borrows_for_generic_args)]

use aya_ebpf::bindings::BPF_NOEXIST;
use proxy_common::{Counter, SOCKET_F_COUNTED, nat::CtKey};

use crate::{
    maps::{LC_COUNTS, SOCKETS, TC_LC_FLOWS},
    stats::count,
};

/// One more active connection (or flow) to backend `id`, atomically.
#[inline(always)]
pub fn acquire(id: u32) {
    match LC_COUNTS.get_ptr_mut(id) {
        Some(p) => atomic_add(p, 1),
        None => {
            // BPF_NOEXIST: a concurrent first insert wins and we add to it.
            if LC_COUNTS.insert(id, 1, BPF_NOEXIST as u64).is_err()
                && let Some(p) = LC_COUNTS.get_ptr_mut(id)
            {
                atomic_add(p, 1);
            }
        }
    }
}

/// One active connection (or flow) to backend `id` less, the inverse of [`acquire`];
/// callers give back only what the delete of an ownership record entitles them to.
#[inline(always)]
pub fn release(id: u32) {
    if let Some(p) = LC_COUNTS.get_ptr_mut(id) {
        // Adding u32::MAX is subtracting one (wrapping).
        atomic_add(p, u32::MAX);
    }
}

/// `*p += v` atomically (one BPF_ATOMIC | BPF_ADD instruction; the result is unused so no
/// fetch variant is needed).
#[inline(always)]
pub fn atomic_add(p: *mut u32, v: u32) {
    // SAFETY: `p` points into a map value that lives while the program runs.
    unsafe {
        core::intrinsics::atomic_xadd::<u32, u32, { core::intrinsics::AtomicOrdering::Relaxed }>(
            p, v,
        );
    }
}

/// A socket translated by `connect()` to backend `id` of a least-load frontend: its
/// ownership record in `SOCKETS`, then the count. Given back by [`socket_released`].
#[inline(always)]
pub fn socket_counted(cookie: u64, id: u32) {
    if SOCKETS.insert(cookie, id | SOCKET_F_COUNTED, 0).is_err() {
        count(Counter::MapUpdateFailed);
        return;
    }
    acquire(id);
}

/// The counted socket `cookie` is released: gives back its count when this call removed
/// its record.
#[inline(always)]
pub fn socket_released(cookie: u64) {
    // SAFETY: copied out at once.
    let Some(v) = (unsafe { SOCKETS.get(cookie).copied() }) else {
        return;
    };
    if SOCKETS.remove(cookie).is_ok() && v & SOCKET_F_COUNTED != 0 {
        release(v & !SOCKET_F_COUNTED);
    }
}

/// A new packet flow keyed `key` (original direction): gives back the count of an earlier
/// (dead) flow of the same tuple, then counts this one for backend `id` (0: not counted).
#[inline(never)]
pub fn flow_started(key: &CtKey, id: u32) {
    flow_released(key);
    if id != 0 && TC_LC_FLOWS.insert(key, &id, BPF_NOEXIST as u64).is_ok() {
        acquire(id);
    }
}

/// Removes `key`'s ownership record from `TC_LC_FLOWS` and, when this call removed it,
/// gives its count back. Returns whether it did.
#[inline(always)]
pub fn flow_released(key: &CtKey) -> bool {
    // SAFETY: copied out at once.
    if let Some(old) = unsafe { TC_LC_FLOWS.get(key).copied() }
        && TC_LC_FLOWS.remove(key).is_ok()
    {
        release(old);
        return true;
    }
    false
}
