//! Per-CPU counters: the socket path's reasons (`COUNTERS`), the packet path's reasons
//! (`TC_COUNTERS`), and the per-service and per-(service, backend) figures (`SERVICE_STATS`,
//! `BACKEND_STATS`). Per-CPU values, so plain adds.

use proxy_common::{Counter, MemberKey, ServiceStats, nat::TcCounter};

use crate::{
    maps::{BACKEND_STATS, COUNTERS, SERVICE_STATS, TC_COUNTERS},
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
/// `service_id`. Inlined and without a value on the stack: it runs deep in the packet
/// programs' call chain, which shares the 512-byte stack.
#[inline(always)]
pub fn count_packet(service_id: u32, bytes: u32) {
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

/// A counted drop.
#[inline(always)]
pub fn drop_with(c: TcCounter) -> Verdict {
    count_tc(c);
    Verdict::Drop
}
