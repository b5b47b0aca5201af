//! Frontends and backend selection, shared by every hook (Cilium's `lb.h` is the model):
//! - [`lookup`]: the one frontend lookup, with a `Scope` policy saying which frontends a
//!   hook serves;
//! - `Refusal` (in `types`): the one classification of a frontend or connection that gets no backend,
//!   which each hook maps to its own outcome (an errno at the socket, a counted drop for a
//!   packet);
//! - [`select`]: the one selection entry point (ClientIP affinity, then the frontend's
//!   algorithm).

use aya_ebpf::{
    cty::c_void,
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns, bpf_loop},
};
use proxy_common::{
    AffinityKey, AffinityValue, Algorithm, Backend, BackendSlotKey, Counter, FRONTEND_F_EXTERNAL,
    FRONTEND_F_VIP_MARKER, Frontend, FrontendKey, LC_SCAN_MAX, MAGLEV_MAX, MemberKey,
    SCOPE_INGRESS, SCOPE_NODE,
};

use crate::{
    addr::L4Addr,
    maps::{AFFINITY, BACKEND_SLOTS, FRONTENDS, LC_COUNTS, MAGLEV, MEMBERS, RR_CURSORS, backend},
    stats::count,
    types::{Lookup, Refusal, Request, Scope},
};

/// Looks `dst` up in `FRONTENDS` for a hook of `scope`.
#[inline(always)]
pub fn lookup(dst: &L4Addr, scope: Scope) -> Lookup {
    let mut key = FrontendKey {
        addr: dst.addr,
        port: dst.port,
        proto: dst.proto,
        scope: if scope == Scope::Ingress {
            SCOPE_INGRESS
        } else {
            SCOPE_NODE
        },
    };
    // SAFETY: the value is copied out at once; a concurrent update replaces the element
    // (RCU) rather than writing into it.
    if let Some(fe) = unsafe { FRONTENDS.get(key).copied() } {
        if fe.flags & FRONTEND_F_VIP_MARKER != 0 {
            return Lookup::NotService;
        }
        return Lookup::Frontend {
            fe,
            cluster_ip: false,
        };
    }
    if scope == Scope::Ingress {
        key.scope = SCOPE_NODE;
        // SAFETY: as above.
        return match unsafe { FRONTENDS.get(key).copied() } {
            Some(fe) if fe.flags & (FRONTEND_F_EXTERNAL | FRONTEND_F_VIP_MARKER) == 0 => {
                Lookup::Frontend {
                    fe,
                    cluster_ip: true,
                }
            }
            _ => Lookup::NotService,
        };
    }
    // The VIP marker (port 0, protocol 0) of a cluster IP: a port it does not define.
    key.port = [0; 2];
    key.proto = 0;
    if FRONTENDS.get_ptr(key).is_some() {
        return Lookup::Refused(Refusal::UndefinedPort);
    }
    Lookup::NotService
}

/// True when [`select`] reads the request's client for frontend `fe`: ClientIP affinity, and
/// the algorithms that hash the client (`source-hash`, `maglev`). The socket hooks pay for
/// finding the client (netns and socket cookies) only then.
#[inline(always)]
pub fn needs_client(fe: &Frontend) -> bool {
    fe.affinity_timeout_s != 0
        || matches!(
            Algorithm::from_u8(fe.algorithm),
            Some(Algorithm::SourceHash | Algorithm::Maglev)
        )
}

/// Picks one backend of `fe` uniformly at random: writes it into `out` and returns its id.
/// 0 when the frontend has no endpoints, or when the agent removed the chosen slot
/// concurrently (the caller then falls back to slot 0). One map read: the slot carries the
/// backend.
#[inline(always)]
pub fn pick(fe: &Frontend, out: &mut Backend) -> u32 {
    let count = fe.backend_count;
    if count == 0 {
        return 0;
    }
    // SAFETY: helper without side effects.
    let slot = unsafe { bpf_get_prandom_u32() } % count;
    by_slot(fe, slot, out)
}

/// Chooses the backend of a new connection or flow (`req`) to frontend `fe`: the one entry
/// point every hook (socket and tc) uses, so every data path applies
/// the same rules. ClientIP affinity first (a fresh entry whose backend is still a member of
/// this frontend's set), then the frontend's algorithm; an affinity entry is (re)written for
/// the result. Returns the backend id and writes its value into `out` (one lookup of the
/// backend per selection), or returns 0, leaving `out` alone, when the frontend has no
/// endpoints (the caller refuses or drops).
///
/// Not inlined: a BPF subprogram with its own stack frame keeps the hooks within the
/// 512-byte stack. Subprograms here return scalars only (the verifier rejects a returned
/// pointer to the caller's stack, which is how larger return values travel).
#[inline(never)]
pub fn select(fe: &Frontend, req: &Request, out: &mut Backend) -> u32 {
    if fe.backend_count == 0 {
        return 0;
    }
    let client = &req.client;
    // The clock only matters to affinity entries.
    let now = if fe.affinity_timeout_s != 0 {
        // SAFETY: helper without side effects.
        unsafe { bpf_ktime_get_ns() }
    } else {
        0
    };
    if fe.affinity_timeout_s != 0 {
        let id = affine(fe, &client.addr, now);
        let found = backend(id);
        if crate::monitor::on() {
            crate::monitor::note_affinity(fe.service_id, found.is_some());
        }
        if let Some(b) = found {
            *out = b;
            // Refreshed here rather than inside `affine`: one call level less on the stack.
            remember_affinity(fe.affinity_group, &client.addr, id, now);
            return id;
        }
    }
    let alg = Algorithm::from_u8(fe.algorithm);
    let id = if matches!(
        alg,
        Some(Algorithm::RoundRobin | Algorithm::WeightedRoundRobin)
    ) {
        // The slot carries its backend. checked_rem: no division-by-zero panic path (the
        // verifier rejects one).
        let slot = next_cursor(fe.service_id)
            .checked_rem(fe.backend_count)
            .unwrap_or(0);
        by_slot(fe, slot, out)
    } else {
        // The other algorithms return a candidate id; its backend is read once, here.
        let id = match alg {
            Some(
                Algorithm::LeastConnections
                | Algorithm::WeightedLeastConnections
                | Algorithm::ShortestExpectedDelay
                | Algorithm::NeverQueue,
            ) => least_load(fe),
            Some(Algorithm::SourceHash) => by_maglev(fe, hash_client(&client.addr, None)),
            Some(Algorithm::Maglev) => by_maglev(fe, hash_client(&client.addr, Some(client.port))),
            Some(Algorithm::DestinationHash) => {
                by_maglev(fe, hash_client(&req.frontend.addr, None))
            }
            _ => 0,
        };
        match backend(id) {
            Some(b) => {
                *out = b;
                id
            }
            None => 0,
        }
    };
    // Random, and the fallback of every algorithm that found nothing.
    let id = if id != 0 { id } else { choose(fe, out) };
    if fe.affinity_timeout_s != 0 && id != 0 {
        remember_affinity(fe.affinity_group, &client.addr, id, now);
    }
    id
}

/// The backend id of `client`'s affinity entry in `fe`'s group when the entry is fresh and
/// the backend still a member of `fe`'s set (the caller reads the backend and refreshes
/// the entry). Not inlined (stack).
#[inline(never)]
fn affine(fe: &Frontend, client: &[u8; 16], now: u64) -> u32 {
    let key = AffinityKey {
        group: fe.affinity_group,
        _pad: 0,
        client: *client,
    };
    // SAFETY: copied out at once.
    let Some(a) = (unsafe { AFFINITY.get(key).copied() }) else {
        return 0;
    };
    if now.wrapping_sub(a.last_used_ns) >= fe.affinity_timeout_s as u64 * 1_000_000_000
        || !is_member(fe.service_id, a.backend_id)
    {
        return 0;
    }
    a.backend_id
}

/// Writes `client`'s affinity entry in `group`. Not inlined (stack).
#[inline(never)]
fn remember_affinity(group: u32, client: &[u8; 16], backend_id: u32, now: u64) {
    let key = AffinityKey {
        group,
        _pad: 0,
        client: *client,
    };
    let v = AffinityValue {
        backend_id,
        _pad: 0,
        last_used_ns: now,
    };
    if AFFINITY.insert(key, v, 0).is_err() {
        count(Counter::MapUpdateFailed);
    }
}

/// True when `backend_id` is in the backend set of `service_id` now.
#[inline(always)]
fn is_member(service_id: u32, backend_id: u32) -> bool {
    MEMBERS
        .get_ptr(MemberKey {
            service_id,
            backend_id,
        })
        .is_some()
}

/// The backend in slot `slot` of `fe`: written into `out`, its id returned; 0, leaving
/// `out` alone, when the slot is gone (a concurrent update; the caller falls back to a
/// random pick, which retries).
///
/// The value is copied from the map element: `BACKEND_SLOTS` is preallocated, so an agent
/// update of this slot at the same moment can recycle the element under the copy (a torn
/// read, one connection in a window of nanoseconds, as for a frontend in [`lookup`]).
#[inline(always)]
fn by_slot(fe: &Frontend, slot: u32, out: &mut Backend) -> u32 {
    let key = BackendSlotKey {
        service_id: fe.service_id,
        slot,
    };
    let Some(p) = BACKEND_SLOTS.get_ptr(key) else {
        return 0;
    };
    // SAFETY: a live map value, copied out at once.
    unsafe {
        let id = (*p).backend_id;
        if id != 0 {
            *out = (*p).backend;
        }
        id
    }
}

/// This CPU's round-robin cursor of `service_id`, advanced by one.
#[inline(always)]
fn next_cursor(service_id: u32) -> u32 {
    if let Some(p) = RR_CURSORS.get_ptr_mut(service_id) {
        // SAFETY: per-CPU value, only this CPU writes it while we run.
        unsafe {
            let c = *p;
            *p = c.wrapping_add(1);
            return c;
        }
    }
    // First use on this CPU: start at a random slot so CPUs do not move in lockstep.
    // SAFETY: helper without side effects.
    let start = unsafe { bpf_get_prandom_u32() };
    let _ = RR_CURSORS.insert(service_id, start.wrapping_add(1), 0);
    start
}

/// Bit `a` set for the algorithms whose cost counts one more connection (`sed`, `nq`).
const PLUS_ONE: u64 =
    1 << Algorithm::ShortestExpectedDelay as u64 | 1 << Algorithm::NeverQueue as u64;
/// Bit `a` set for the algorithm that puts an idle backend first (`nq`).
const IDLE_FIRST: u64 = 1 << Algorithm::NeverQueue as u64;
/// The first candidate's reference: a cost per weight above any real one (costs are at most
/// 2^32, weights at least 1), small enough that `cost * weight` (weights at most 100) still
/// fits in 40 bits.
const NO_COST: u64 = 1 << 33;

/// The backend id of the lowest load over at most `LC_SCAN_MAX` consecutive slots from a
/// random start, for the least-load algorithms (the Linux IPVS schedulers' rules with no
/// inactive connections; see `proxy_common::Algorithm` for why there are none here): with
/// `c` the backend's connections ([`LC_COUNTS`]) and `w` its weight in the set ([`MEMBERS`];
/// every weight is 1 for least-connections), the lowest `cost / w` where `cost` is `c`
/// (`lc`, `wlc`), `c + 1` (`sed`), or 0 for an idle backend and `c + 1` otherwise (`nq`).
///
/// `cost1 / w1 < cost2 / w2` is compared as `cost1 * w2 < cost2 * w1`, as IPVS does (no
/// division on the data path; both products fit in 40 bits). Ties go to a random one of the
/// tied backends: each candidate draws 24 random bits, appended below the product, so one
/// 64-bit compare ranks by load, then by draw (equal draws, 1 in 2^24, favour the earlier
/// slot). A slot whose backend has no weight is leaving the set (the agent removes its
/// membership first) and is skipped.
///
/// The scan is a `bpf_loop` (Linux >= 5.17) over [`scan_slot`]: the verifier checks the
/// body once rather than each of the 32 iterations at every place the hooks select a
/// backend, which made this loop most of the verification of every translating program
/// (and of an agent's start-up). Not inlined, so its frame is not added to `select`'s (the
/// BPF stack is 512 bytes for the whole call chain).
#[inline(never)]
fn least_load(fe: &Frontend) -> u32 {
    let count = fe.backend_count;
    let alg = (fe.algorithm & 63) as u64;
    let mut scan = Scan {
        service_id: fe.service_id,
        count,
        // SAFETY: helper without side effects.
        start: unsafe { bpf_get_prandom_u32() }
            .checked_rem(count)
            .unwrap_or(0),
        best_id: 0,
        plus_one: (PLUS_ONE >> alg) & 1,
        idle_first: (IDLE_FIRST >> alg) & 1,
        best_cost: NO_COST,
        best_weight: 1,
        best_draw: 0,
    };
    let n = if count < LC_SCAN_MAX {
        count
    } else {
        LC_SCAN_MAX
    };
    // SAFETY: the callback is a BPF subprogram taking (index, context); the context is our
    // own stack value, which outlives the call.
    unsafe {
        bpf_loop(
            n,
            scan_slot as *const () as *mut c_void,
            &mut scan as *mut Scan as *mut c_void,
            0,
        )
    };
    scan.best_id
}

/// The state of a [`least_load`] scan, shared with its loop body.
#[repr(C)]
struct Scan {
    service_id: u32,
    /// The frontend's backend count (slots `0..count`).
    count: u32,
    /// The first slot scanned.
    start: u32,
    /// The best backend so far (0: none).
    best_id: u32,
    /// 1 when the cost counts one more connection (`sed`, `nq`).
    plus_one: u64,
    /// 1 when an idle backend goes first (`nq`).
    idle_first: u64,
    best_cost: u64,
    best_weight: u64,
    best_draw: u64,
}

/// One slot of a [`least_load`] scan (`i` from 0): a `bpf_loop` callback, which returns 0
/// to go on. The algorithm's cost terms are bit masks rather than branches and the body has
/// one compare, so the verifier converges on it in few passes.
#[inline(never)]
extern "C" fn scan_slot(i: u32, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the `Scan` that `least_load` passed to `bpf_loop`.
    let s = unsafe { &mut *(ctx as *mut Scan) };
    let mut slot = s.start.wrapping_add(i);
    if slot >= s.count {
        slot = slot.wrapping_sub(s.count);
    }
    let key = BackendSlotKey {
        service_id: s.service_id,
        slot,
    };
    // SAFETY: a live map value; only its id is read.
    let id = BACKEND_SLOTS
        .get_ptr(key)
        .map_or(0, |p| unsafe { (*p).backend_id });
    let member = MemberKey {
        service_id: s.service_id,
        backend_id: id,
    };
    // SAFETY: copied out at once.
    let weight = unsafe { MEMBERS.get(member).copied() }.unwrap_or(0) as u64;
    if weight == 0 {
        return 0;
    }
    // SAFETY: copied out at once.
    let conns = unsafe { LC_COUNTS.get(id).copied() }.unwrap_or(0) as u64;
    // 1 for an idle backend under nq: `conns - 1` wraps to the top bit only from 0.
    let idle = (conns.wrapping_sub(1) >> 63) & s.idle_first;
    let cost = (conns + s.plus_one) * (1 - idle);
    // SAFETY: helper without side effects.
    let draw = (unsafe { bpf_get_prandom_u32() } >> 8) as u64;
    let this = (cost.wrapping_mul(s.best_weight) << 24) | draw;
    let best = (s.best_cost.wrapping_mul(weight) << 24) | s.best_draw;
    if this < best {
        s.best_cost = cost;
        s.best_weight = weight;
        s.best_draw = draw;
        s.best_id = id;
    }
    0
}

/// A 32-bit hash of a client address (and port): murmur3's finalizer over its words, so
/// nearby addresses spread over the whole Maglev table.
#[inline(always)]
fn hash_client(addr: &[u8; 16], port: Option<[u8; 2]>) -> u32 {
    let mut h: u32 = 0x9e37_79b9;
    let mut i = 0;
    while i < 16 {
        let w = u32::from_ne_bytes([addr[i], addr[i + 1], addr[i + 2], addr[i + 3]]);
        h = fmix(h ^ w).wrapping_mul(0x85eb_ca6b);
        i += 4;
    }
    if let Some(p) = port {
        h = fmix(h ^ u16::from_ne_bytes(p) as u32);
    }
    fmix(h)
}

#[inline(always)]
fn fmix(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// The Maglev table's backend id for `hash`; 0 without a table (the agent writes it after
/// the slots) or when its backend is no longer a member. Not inlined (stack).
#[inline(never)]
fn by_maglev(fe: &Frontend, hash: u32) -> u32 {
    // Through a raw pointer: the table is far larger than the BPF stack and must never be
    // copied. A concurrent update replaces the element (RCU), so the reads are consistent.
    let Some(t) = MAGLEV.get_ptr(fe.service_id) else {
        return 0;
    };
    // SAFETY: `t` points to a live map value.
    let size = unsafe { (*t).size };
    if size == 0 {
        return 0;
    }
    let idx = hash.checked_rem(size).unwrap_or(0) as usize;
    if idx >= MAGLEV_MAX {
        return 0;
    }
    // SAFETY: idx < MAGLEV_MAX, inside the value.
    let id = unsafe { *(core::ptr::addr_of!((*t).entries) as *const u32).add(idx) };
    if !is_member(fe.service_id, id) {
        return 0;
    }
    id
}

/// Picks a backend id of `fe` uniformly at random; when the chosen slot vanished under us
/// (the agent shrank the service concurrently: it removes slots past the new count last),
/// falls back to slot 0, which exists while the service has any backend. Writes the
/// backend into `out` and returns its id; 0 when there is none. Not inlined, and without
/// keys of its own on the stack: it is the deepest call of
/// the tc programs' chain, which shares the 512-byte stack.
#[inline(never)]
pub fn choose(fe: &Frontend, out: &mut Backend) -> u32 {
    if fe.backend_count == 0 {
        return 0;
    }
    let id = pick(fe, out);
    if id != 0 {
        return id;
    }
    count(Counter::SlotMiss);
    by_slot(fe, 0, out)
}
