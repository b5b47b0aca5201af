//! Frontend lookup and backend selection, shared by every hook.

use aya_ebpf::helpers::bpf_get_prandom_u32;
use proxy_common::{
    Backend, BackendSlotKey, Counter, FRONTEND_F_VIP_MARKER, Frontend, FrontendKey,
};

use crate::maps::{BACKEND_SLOTS, BACKENDS, COUNTERS, FRONTENDS};

/// Result of looking up a destination.
pub enum Lookup {
    /// Not a VIP: leave the socket alone.
    NotService,
    /// A VIP, but this port/protocol is not one of its frontends.
    UndefinedPort,
    /// A frontend.
    Frontend(Frontend),
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

/// Selection outcome for a frontend.
pub enum Choice {
    /// Translate to this backend.
    Backend(u32, Backend),
    /// Refuse: no endpoints.
    NoEndpoints,
}

/// Who opens a flow, for the selection policies that depend on the client (source hashing,
/// ClientIP session affinity). The tc path fills it from the packet; the socket path from
/// the socket.
pub struct Client {
    /// Client address, network byte order, IPv4-mapped for IPv4.
    pub addr: [u8; 16],
    /// Client port, network byte order (zero when unknown).
    pub port: [u8; 2],
}

/// Chooses the backend of a new connection or flow to frontend (`addr`, `port`, `proto`) for
/// `client`: the one entry point every hook (socket and tc) uses, so every data path applies
/// the same selection rules.
#[inline(always)]
pub fn select(fe: &Frontend, addr: &[u8; 16], port: [u8; 2], proto: u8, client: &Client) -> Choice {
    let _ = client;
    choose(fe, addr, port, proto)
}

/// Picks a backend for `fe`, retrying once with a fresh frontend value when a slot
/// vanished under us (the agent shrank the service concurrently).
#[inline(always)]
pub fn choose(fe: &Frontend, addr: &[u8; 16], port: [u8; 2], proto: u8) -> Choice {
    if fe.backend_count == 0 {
        return Choice::NoEndpoints;
    }
    if let Some((id, b)) = pick(fe) {
        return Choice::Backend(id, b);
    }
    count(Counter::SlotMiss);
    if let Lookup::Frontend(fe2) = lookup(addr, port, proto)
        && let Some((id, b)) = pick(&fe2)
    {
        return Choice::Backend(id, b);
    }
    Choice::NoEndpoints
}
