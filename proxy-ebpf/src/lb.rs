//! Frontend lookup and backend selection, shared by every hook.

use aya_ebpf::helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns};
use proxy_common::{
    AffinityKey, AffinityValue, Algorithm, Backend, BackendSlotKey, Counter, FRONTEND_F_VIP_MARKER,
    Frontend, FrontendKey, LC_SCAN_MAX, MAGLEV_MAX, MemberKey, RevNatKey, SOCKET_F_COUNTED,
    ServiceStats,
};

use crate::maps::{
    AFFINITY, BACKEND_SLOTS, BACKEND_STATS, BACKENDS, COUNTERS, FRONTENDS, LC_COUNTS, MAGLEV,
    MEMBERS, REVNAT_SK, RR_CURSORS, SERVICE_STATS, SOCKETS,
};

/// Result of looking up a destination.
pub enum Lookup {
    /// Not a VIP: leave the socket alone.
    NotService,
    /// A VIP, but this port/protocol is not one of its frontends.
    UndefinedPort,
    /// A frontend.
    Frontend(Frontend),
}

/// Counts a translated connection or new flow (`refused` 0) or a refusal (`refused` 1) of
/// service id `service_id`, and, for a translation, one connection to `backend_id`.
/// Per-CPU values, so plain adds. Not inlined (stack).
#[inline(never)]
pub fn count_service(service_id: u32, backend_id: u32, refused: u32) {
    match SERVICE_STATS.get_ptr_mut(service_id) {
        // SAFETY: this CPU's value; only this CPU writes it while we run.
        Some(p) => unsafe {
            if refused != 0 {
                (*p).refused += 1;
            } else {
                (*p).connections += 1;
            }
        },
        None => {
            let v = ServiceStats {
                connections: (refused == 0) as u64,
                refused: (refused != 0) as u64,
                packets: 0,
                bytes: 0,
            };
            let _ = SERVICE_STATS.insert(service_id, v, 0);
        }
    }
    if refused != 0 {
        return;
    }
    match BACKEND_STATS.get_ptr_mut(backend_id) {
        // SAFETY: as above.
        Some(p) => unsafe { *p += 1 },
        None => {
            let _ = BACKEND_STATS.insert(backend_id, 1, 0);
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

/// Counts one packet of `bytes` translated by the tc path for service id `service_id`.
/// Inlined and without a value on the stack: it runs deep in the tc programs' call chain,
/// which shares the 512-byte stack.
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

/// Adds one to a per-CPU counter.
#[inline(always)]
pub fn count(c: Counter) {
    if let Some(p) = COUNTERS.get_ptr_mut(c as u32) {
        // SAFETY: per-CPU slot, only this CPU writes it while we run.
        unsafe { *p += 1 };
    }
}

/// Looks up (addr, port, proto); address and port bytes in network order.
#[inline(always)]
pub fn lookup(addr: &[u8; 16], port: [u8; 2], proto: u8) -> Lookup {
    let key = FrontendKey {
        addr: *addr,
        port,
        proto,
        scope: 0,
    };
    // SAFETY: the value is copied out at once; a concurrent update replaces the element
    // (RCU) rather than writing into it.
    if let Some(fe) = unsafe { FRONTENDS.get(key) } {
        let fe = *fe;
        if fe.flags & FRONTEND_F_VIP_MARKER == 0 {
            return Lookup::Frontend(fe);
        }
    }
    let marker = FrontendKey {
        addr: *addr,
        port: [0; 2],
        proto: 0,
        scope: 0,
    };
    if FRONTENDS.get_ptr(marker).is_some() {
        return Lookup::UndefinedPort;
    }
    Lookup::NotService
}

/// Backend id `id`, if it still exists.
#[inline(always)]
pub fn backend(id: u32) -> Option<Backend> {
    // SAFETY: copied out at once, see `lookup`.
    unsafe { BACKENDS.get(id).copied() }
}

/// Picks one backend of `fe` uniformly at random. `None` when the frontend has no
/// endpoints, or when the agent removed the chosen slot between our two lookups (the
/// caller then looks the frontend up again once).
#[inline(always)]
pub fn pick(fe: &Frontend) -> Option<(u32, Backend)> {
    let count = fe.backend_count;
    if count == 0 {
        return None;
    }
    // SAFETY: helper without side effects.
    let slot = unsafe { bpf_get_prandom_u32() } % count;
    let key = BackendSlotKey {
        service_id: fe.service_id,
        slot,
    };
    // SAFETY: copied out at once.
    let id = unsafe { BACKEND_SLOTS.get(key).copied() }?;
    let b = backend(id)?;
    Some((id, b))
}

/// Who opens a flow, for the selection policies that depend on the client (source hashing,
/// ClientIP session affinity). The tc path fills it from the packet; the socket path from
/// the socket (its bound source address, else its network namespace).
pub struct Client {
    /// Client address, network byte order, IPv4-mapped for IPv4 (or
    /// `proxy_common::client_of_netns`).
    pub addr: [u8; 16],
    /// Client port, network byte order (zero when unknown).
    pub port: [u8; 2],
}

/// A new connection or flow: the frontend it addressed and its client.
pub struct Request {
    /// Frontend address, network byte order, IPv4-mapped.
    pub addr: [u8; 16],
    /// Frontend port, network byte order.
    pub port: [u8; 2],
    /// IANA protocol.
    pub proto: u8,
    /// Who connects.
    pub client: Client,
}

/// Chooses the backend of a new connection or flow (`req`) to frontend `fe`: the one entry point every hook (socket and tc) uses, so every data path applies
/// the same rules. ClientIP affinity first (a fresh entry whose backend is still a member of
/// this frontend's set), then the frontend's algorithm; an affinity entry is (re)written for
/// the result. Returns the backend id, 0 when the frontend has no endpoints (the caller
/// refuses or drops).
///
/// Not inlined: a BPF subprogram with its own stack frame keeps the hooks within the
/// 512-byte stack. Subprograms here return scalars only (the verifier rejects a returned
/// pointer to the caller's stack, which is how larger return values travel).
#[inline(never)]
pub fn select(fe: &Frontend, req: &Request) -> u32 {
    if fe.backend_count == 0 {
        return 0;
    }
    let client = &req.client;
    // SAFETY: helper without side effects.
    let now = unsafe { bpf_ktime_get_ns() };
    if fe.affinity_timeout_s != 0 {
        let id = affine(fe, &client.addr, now);
        if id != 0 {
            // Refreshed here rather than inside `affine`: one call level less on the stack.
            remember_affinity(fe.affinity_group, &client.addr, id, now);
            return id;
        }
    }
    let mut id = match Algorithm::from_u8(fe.algorithm) {
        Some(Algorithm::RoundRobin) | Some(Algorithm::WeightedRoundRobin) => {
            // checked_rem: no division-by-zero panic path (the verifier rejects one).
            by_slot(
                fe,
                next_cursor(fe.service_id)
                    .checked_rem(fe.backend_count)
                    .unwrap_or(0),
            )
        }
        Some(Algorithm::LeastConnections) => least_connections(fe),
        Some(Algorithm::SourceHash) => by_maglev(fe, hash_client(&client.addr, None)),
        Some(Algorithm::Maglev) => by_maglev(fe, hash_client(&client.addr, Some(client.port))),
        _ => 0,
    };
    if id == 0 {
        id = choose(fe);
    }
    if fe.affinity_timeout_s != 0 && id != 0 {
        remember_affinity(fe.affinity_group, &client.addr, id, now);
    }
    id
}

/// The backend of `client`'s affinity entry in `fe`'s group when the entry is fresh and the
/// backend still a member of `fe`'s set (the caller refreshes it). Not inlined (stack).
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
        || backend(a.backend_id).is_none()
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

/// The backend id in slot `slot` of `fe`; 0 on a concurrent update (the caller falls back
/// to a random pick, which retries).
#[inline(always)]
fn by_slot(fe: &Frontend, slot: u32) -> u32 {
    let key = BackendSlotKey {
        service_id: fe.service_id,
        slot,
    };
    // SAFETY: copied out at once.
    match unsafe { BACKEND_SLOTS.get(key).copied() } {
        Some(id) if backend(id).is_some() => id,
        _ => 0,
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

/// The slot whose backend has the fewest active connections, over at most `LC_SCAN_MAX`
/// consecutive slots from a random start. Each candidate is ranked by (connections, random
/// 32-bit draw), so ties go to a uniformly random one of the tied backends. The ranking is
/// one 64-bit compare per slot: few verifier states per iteration. Not inlined, so its
/// frame is not added to `select`'s (the BPF stack is 512 bytes for the whole call chain).
#[inline(never)]
fn least_connections(fe: &Frontend) -> u32 {
    let count = fe.backend_count;
    // SAFETY: helper without side effects.
    let start = unsafe { bpf_get_prandom_u32() }
        .checked_rem(count)
        .unwrap_or(0);
    let mut best_rank = u64::MAX;
    let mut best_id = 0u32;
    for i in 0..LC_SCAN_MAX {
        if i >= count {
            break;
        }
        let mut slot = start + i;
        if slot >= count {
            slot -= count;
        }
        let key = BackendSlotKey {
            service_id: fe.service_id,
            slot,
        };
        // SAFETY: copied out at once.
        let id = unsafe { BACKEND_SLOTS.get(key).copied() }.unwrap_or(0);
        // SAFETY: copied out at once.
        let conns = unsafe { LC_COUNTS.get(id).copied() }.unwrap_or(0);
        // SAFETY: helper without side effects.
        let draw = unsafe { bpf_get_prandom_u32() };
        let rank = ((conns as u64) << 32) | draw as u64;
        if id != 0 && rank < best_rank {
            best_rank = rank;
            best_id = id;
        }
    }
    if best_id == 0 || backend(best_id).is_none() {
        return 0;
    }
    best_id
}

/// Records the connect()-translated socket `cookie` -> backend `id`, counting the
/// connection for least-connections when `counted`; the socket's release undoes both
/// ([`release_socket`]).
#[inline(always)]
pub fn track_socket(cookie: u64, id: u32, counted: bool) {
    let v = if counted { id | SOCKET_F_COUNTED } else { id };
    if SOCKETS.insert(cookie, v, 0).is_err() {
        count(Counter::MapUpdateFailed);
        return;
    }
    if counted {
        lc_acquire(id);
    }
}

/// One more active connection (or tc flow) to backend `id` in [`LC_COUNTS`], atomically.
#[inline(always)]
pub fn lc_acquire(id: u32) {
    match LC_COUNTS.get_ptr_mut(id) {
        Some(p) => atomic_add(p, 1),
        None => {
            // BPF_NOEXIST: a concurrent first insert wins and we add to it.
            if LC_COUNTS.insert(id, 1, 1).is_err()
                && let Some(p) = LC_COUNTS.get_ptr_mut(id)
            {
                atomic_add(p, 1);
            }
        }
    }
}

/// One active connection (or tc flow) to backend `id` less, the inverse of
/// [`lc_acquire`]; callers make sure each acquired count is released once.
#[inline(always)]
pub fn lc_release(id: u32) {
    if let Some(p) = LC_COUNTS.get_ptr_mut(id) {
        // Adding u32::MAX is subtracting one (wrapping).
        atomic_add(p, u32::MAX);
    }
}

/// `*p += v` atomically (one BPF_ATOMIC | BPF_ADD instruction; the result is unused so no
/// fetch variant is needed).
#[inline(always)]
fn atomic_add(p: *mut u32, v: u32) {
    // SAFETY: `p` points into a map value that lives while the program runs.
    unsafe {
        core::intrinsics::atomic_xadd::<u32, u32, { core::intrinsics::AtomicOrdering::Relaxed }>(
            p, v,
        );
    }
}

/// Forgets a released socket: removes its reverse-NAT entry (so inspection lists only live
/// sockets) and gives back its least-connections count, if any.
#[inline(always)]
pub fn release_socket(cookie: u64) {
    // SAFETY: copied out at once.
    let Some(v) = (unsafe { SOCKETS.get(cookie).copied() }) else {
        return;
    };
    let _ = SOCKETS.remove(cookie);
    let id = v & !SOCKET_F_COUNTED;
    if v & SOCKET_F_COUNTED != 0 {
        lc_release(id);
    }
    if let Some(b) = backend(id) {
        let key = RevNatKey {
            cookie,
            addr: b.addr,
            port: b.port,
            _pad: [0; 6],
        };
        let _ = REVNAT_SK.remove(key);
    }
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

/// The Maglev table's backend for `hash`; `None` without a table (the agent writes it
/// after the slots) or when its backend is no longer a member. Not inlined (stack).
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
    if !is_member(fe.service_id, id) || backend(id).is_none() {
        return 0;
    }
    id
}

/// Picks a backend id of `fe` uniformly at random; when the chosen slot vanished under us
/// (the agent shrank the service concurrently: it removes slots past the new count last),
/// falls back to slot 0, which exists while the service has any backend. 0 when there is
/// none. Not inlined, and without keys of its own on the stack: it is the deepest call of
/// the tc programs' chain, which shares the 512-byte stack.
#[inline(never)]
pub fn choose(fe: &Frontend) -> u32 {
    if fe.backend_count == 0 {
        return 0;
    }
    if let Some((id, _)) = pick(fe) {
        return id;
    }
    count(Counter::SlotMiss);
    by_slot(fe, 0)
}
