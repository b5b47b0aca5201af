//! Per-CPU counters: the socket path's reasons (`COUNTERS`), the packet path's reasons
//! (`TC_COUNTERS`), and the per-service and per-(service, backend) figures (`SERVICE_STATS`,
//! `BACKEND_STATS`). Per-CPU values, so plain adds.

use proxy_common::{Counter, MemberKey, PACKET_SLOTS, ServiceStats, nat::TcCounter};

use crate::{
    maps::{BACKEND_STATS, COUNTERS, PACKET_OWNERS, SERVICE_PACKETS, SERVICE_STATS, TC_COUNTERS},
    verdict::Verdict,
};

/// Adds one to a socket-path counter.
#[inline(always)]
pub fn count(c: Counter) {
    if let Some(p) = COUNTERS.get_ptr_mut(c as u32) {
        // SAFETY: per-CPU slot, only this CPU writes it while we run.
        unsafe { *p += 1 };
    }
}

/// Adds one to a packet-path counter.
#[inline(always)]
pub fn count_tc(c: TcCounter) {
    if let Some(p) = TC_COUNTERS.get_ptr_mut(c as u32) {
        // SAFETY: per-CPU slot, only this CPU writes it while we run.
        unsafe { *p += 1 };
    }
}

/// Counts a translated connection or new flow (`refused` 0) of service id `service_id` to
/// backend `backend_id`: one lookup, the pair's counter in `BACKEND_STATS` (readers sum a
/// service's and a backend's pairs). Counts a refusal (`refused` 1) of the service in
/// `SERVICE_STATS` (off the hot path). Not inlined (stack).
// The key by reference: a by-value key is copied onto the 512-byte BPF stack first.
#[allow(clippy::needless_borrows_for_generic_args)]
#[inline(never)]
pub fn count_service(service_id: u32, backend_id: u32, refused: u32) {
    if refused != 0 {
        match SERVICE_STATS.get_ptr_mut(service_id) {
            // SAFETY: this CPU's value; only this CPU writes it while we run.
            Some(p) => unsafe { (*p).refused += 1 },
            None => {
                let v = ServiceStats {
                    connections: 0,
                    refused: 1,
                    packets: 0,
                    bytes: 0,
                };
                let _ = SERVICE_STATS.insert(service_id, v, 0);
            }
        }
        return;
    }
    let key = MemberKey {
        service_id,
        backend_id,
    };
    match BACKEND_STATS.get_ptr_mut(&key) {
        // SAFETY: as above.
        Some(p) => unsafe { *p += 1 },
        None => {
            if BACKEND_STATS.insert(&key, 1, 0).is_err() {
                count(Counter::MapUpdateFailed);
            }
        }
    }
}

/// A zeroed value to create a [`SERVICE_STATS`] entry from (read-only global data, so no
/// stack space is used for it).
static ZERO_STATS: ServiceStats = ServiceStats {
    connections: 0,
    refused: 0,
    packets: 0,
    bytes: 0,
};

/// Counts one packet of `bytes` translated through a conntrack entry for service id
/// `service_id`: in its slot of `SERVICE_PACKETS` when it owns the slot or claims it free
/// (two array lookups, see `proxy_common::PACKET_OWNERS`), else in `SERVICE_STATS` (a
/// hashed lookup). Inlined and without a value on the stack: it runs deep in the packet
/// programs' call chain, which shares the 512-byte stack.
#[inline(always)]
pub fn count_packet(service_id: u32, bytes: u32) {
    if count_in_slot(service_id, bytes) {
        return;
    }
    let p = match SERVICE_STATS.get_ptr_mut(service_id) {
        Some(p) => p,
        None => {
            // By reference to the static: a by-value copy would land on the stack.
            #[allow(clippy::needless_borrows_for_generic_args)]
            let _ = SERVICE_STATS.insert(service_id, &ZERO_STATS, 0);
            match SERVICE_STATS.get_ptr_mut(service_id) {
                Some(p) => p,
                None => return,
            }
        }
    };
    // SAFETY: this CPU's value; only this CPU writes it while we run.
    unsafe {
        (*p).packets += 1;
        (*p).bytes += bytes as u64;
    }
}

/// [`count_packet`] in the slot of `service_id` when it owns it or claims it now (false:
/// another service owns it).
#[inline(always)]
fn count_in_slot(service_id: u32, bytes: u32) -> bool {
    let slot = service_id & (PACKET_SLOTS - 1);
    let Some(o) = PACKET_OWNERS.get_ptr_mut(slot) else {
        return false;
    };
    // SAFETY: a value of the map, one aligned 8-byte load.
    let mut tag = unsafe { core::ptr::read_volatile(o) };
    if tag as u32 != service_id {
        if tag as u32 != 0 || service_id == 0 {
            return false;
        }
        // A free slot: claimed with this generation, once, whichever CPU wins.
        let want = tag | service_id as u64;
        // SAFETY: a value of the map, one atomic compare-and-exchange of 8 aligned bytes.
        let (_, won) = unsafe {
            core::intrinsics::atomic_cxchg::<
                u64,
                { core::intrinsics::AtomicOrdering::Relaxed },
                { core::intrinsics::AtomicOrdering::Relaxed },
            >(o, tag, want)
        };
        if !won {
            return false;
        }
        tag = want;
    }
    let Some(p) = SERVICE_PACKETS.get_ptr_mut(slot) else {
        return false;
    };
    // SAFETY: this CPU's value; only this CPU writes it while we run.
    unsafe {
        if (*p).tag != tag {
            // An earlier owner's counts (or none yet): this owner starts from zero.
            (*p).tag = tag;
            (*p).packets = 0;
            (*p).bytes = 0;
        }
        (*p).packets += 1;
        (*p).bytes += bytes as u64;
    }
    true
}

/// A counted drop.
#[inline(always)]
pub fn drop_with(c: TcCounter) -> Verdict {
    count_tc(c);
    Verdict::Drop
}
