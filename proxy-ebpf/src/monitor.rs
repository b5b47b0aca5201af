//! The event stream of `ebpf-proxy monitor` (layouts and rules: `proxy_common::monitor`).
//!
//! A decision point calls [`on`] first: one array lookup and one compare, all it costs
//! while no monitor runs. Only then does it call one of the emitters, each its own BPF
//! function (its frame and instructions stay out of the caller's, which matters for the
//! tc programs' stack and verifier budget): the emitter checks the lease against the
//! clock, takes a token from this CPU's bucket (or counts the event as rate-limited),
//! reserves a record in the ring buffer (or counts it as lost to a full ring), fills it in
//! place and submits it.

use aya_ebpf::{
    helpers::{bpf_get_current_cgroup_id, bpf_get_netns_cookie, bpf_ktime_get_ns},
    programs::SkBuffContext,
};
use core::ffi::c_void;
use proxy_common::{
    RevNatKey, RevNatValue,
    monitor::{
        EVENT_F_AFFINITY_HIT, EVENT_F_AFFINITY_MISS, EVENT_F_DATAGRAM, EventKind, EventReason,
        HOOK_SKB, HOOK_SOCK, MonitorCpu, MonitorEvent,
    },
    nat::{CtEntry, CtKey},
};

use crate::{
    maps::{MONITOR_AFFINITY, MONITOR_CPU, MONITOR_CTL, MONITOR_EVENTS, backend},
    types::{Refusal, Request, Scratch},
};

/// Whether a monitor holds (or held) the lease: the cheap test every decision point makes
/// before calling an emitter, which checks the lease's expiry.
#[inline(always)]
pub fn on() -> bool {
    matches!(MONITOR_CTL.get(0), Some(c) if c.expiry_ns != 0)
}

/// The packed first argument of the emitters: kind, reason, `EVENT_F_*` flags, algorithm
/// and hook, one byte each from the lowest.
#[inline(always)]
pub const fn word(kind: EventKind, reason: EventReason, flags: u8, algorithm: u8, hook: u8) -> u64 {
    kind as u64
        | (reason as u64) << 8
        | (flags as u64) << 16
        | (algorithm as u64) << 24
        | (hook as u64) << 32
}

/// The event reason of a refusal.
#[inline(always)]
pub const fn reason_of(r: Refusal) -> EventReason {
    match r {
        Refusal::UndefinedPort => EventReason::UndefinedPort,
        Refusal::NoEndpoints => EventReason::NoEndpoints,
        Refusal::NoLocalEndpoints => EventReason::NoLocalEndpoints,
    }
}

/// Records, for the event of the connection being selected, whether ClientIP affinity
/// chose its backend (`hit`) for `service_id`. Called by `lb::select` for frontends with
/// affinity while a monitor runs; the emitter reads it back for the same service only.
#[inline(always)]
pub fn note_affinity(service_id: u32, hit: bool) {
    if let Some(p) = MONITOR_AFFINITY.get_ptr_mut(0) {
        let flag = if hit {
            EVENT_F_AFFINITY_HIT
        } else {
            EVENT_F_AFFINITY_MISS
        };
        // SAFETY: this CPU's slot.
        unsafe { *p = (service_id as u64) << 8 | flag as u64 };
    }
}

/// The affinity flag [`note_affinity`] left for `service_id` (0 for none), cleared.
#[inline(always)]
fn take_affinity(service_id: u32) -> u8 {
    let Some(p) = MONITOR_AFFINITY.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: this CPU's slot.
    unsafe {
        let v = *p;
        *p = 0;
        if v >> 8 == service_id as u64 {
            (v & 0xff) as u8
        } else {
            0
        }
    }
}

/// Checks the lease and takes a token from this CPU's bucket. Returns the time and this
/// CPU's state when the event may be emitted; counts a rate-limited event.
#[inline(always)]
fn admit() -> Option<(u64, *mut MonitorCpu)> {
    let ctl = MONITOR_CTL.get(0)?;
    // SAFETY: helper without side effects.
    let now = unsafe { bpf_ktime_get_ns() };
    if now >= ctl.expiry_ns {
        return None;
    }
    let cpu = MONITOR_CPU.get_ptr_mut(0)?;
    // SAFETY: this CPU's value; only this CPU writes it while we run.
    let c = unsafe { &mut *cpu };
    if ctl.cost_ns != 0 {
        let credit = c
            .credit_ns
            .saturating_add(now.wrapping_sub(c.last_ns))
            .min(ctl.max_credit_ns);
        c.last_ns = now;
        if credit < ctl.cost_ns {
            c.credit_ns = credit;
            c.rate_limited += 1;
            return None;
        }
        c.credit_ns = credit - ctl.cost_ns;
    }
    Some((now, cpu))
}

/// Reserves a record, zeroed but for the fields of `w` (see [`word`]) and the time; `None`
/// (counted) when the ring is full.
#[inline(always)]
fn reserve(
    w: u64,
    now: u64,
    cpu: *mut MonitorCpu,
) -> Option<aya_ebpf::maps::ring_buf::RingBufEntry<MonitorEvent>> {
    let Some(mut e) = MONITOR_EVENTS.reserve(0) else {
        // SAFETY: this CPU's value.
        unsafe { (*cpu).ring_full += 1 };
        return None;
    };
    let p = e.as_mut_ptr();
    // SAFETY: `p` is the reserved record, ours until submitted; written field by field so
    // nothing lands on the stack.
    unsafe {
        core::ptr::write_bytes(p, 0, 1);
        (*p).ts_ns = now;
        (*p).kind = w as u8;
        (*p).reason = (w >> 8) as u8;
        (*p).flags = (w >> 16) as u8;
        (*p).algorithm = (w >> 24) as u8;
        (*p).hook = (w >> 32) as u8;
    }
    Some(e)
}

/// Submits a record and counts its cost since `start`.
#[inline(always)]
fn submit(
    e: aya_ebpf::maps::ring_buf::RingBufEntry<MonitorEvent>,
    start: u64,
    cpu: *mut MonitorCpu,
) {
    e.submit(0);
    // SAFETY: helper without side effects; this CPU's value.
    unsafe {
        let end = bpf_ktime_get_ns();
        (*cpu).emitted += 1;
        (*cpu).emit_ns += end.wrapping_sub(start);
    }
}

/// A socket's connect()/sendmsg() event: `req` (frontend, and the client when known),
/// service `service_id` and backend `backend_id` (0: refused; its address is looked up).
/// `ctx` is the sock_addr program's context (for the socket and namespace cookies).
#[inline(never)]
pub fn sock_event(ctx: *mut c_void, w: u64, req: &Request, service_id: u32, backend_id: u32) {
    let Some((now, cpu)) = admit() else {
        return;
    };
    let affinity = take_affinity(service_id);
    let Some(mut e) = reserve(w, now, cpu) else {
        return;
    };
    let p = e.as_mut_ptr();
    // SAFETY: the reserved record (see `reserve`); helpers on our own context.
    unsafe {
        (*p).flags |= affinity;
        (*p).cookie = aya_ebpf::helpers::bpf_get_socket_cookie(ctx);
        (*p).netns = bpf_get_netns_cookie(ctx);
        (*p).cgroup = bpf_get_current_cgroup_id();
        (*p).client = req.client.addr;
        (*p).client_port = req.client.port;
        (*p).frontend = req.frontend.addr;
        (*p).frontend_port = req.frontend.port;
        (*p).proto = req.frontend.proto;
        (*p).service_id = service_id;
        (*p).backend_id = backend_id;
        if backend_id != 0
            && let Some(b) = backend(backend_id)
        {
            (*p).backend = b.addr;
            (*p).backend_port = b.port;
        }
    }
    submit(e, now, cpu);
}

/// A recvmsg() (`recv`) or getpeername() shown the frontend `v` instead of the backend of
/// `key`.
#[inline(never)]
pub fn reverse_event(ctx: *mut c_void, recv: bool, key: &RevNatKey, v: &RevNatValue) {
    let Some((now, cpu)) = admit() else {
        return;
    };
    let flags = if recv { EVENT_F_DATAGRAM } else { 0 };
    let w = word(
        EventKind::SockReverse,
        EventReason::None,
        flags,
        proxy_common::monitor::ALGORITHM_UNKNOWN,
        HOOK_SOCK,
    );
    let Some(mut e) = reserve(w, now, cpu) else {
        return;
    };
    let p = e.as_mut_ptr();
    // SAFETY: the reserved record; helper on our own context.
    unsafe {
        (*p).cookie = key.cookie;
        (*p).netns = bpf_get_netns_cookie(ctx);
        (*p).backend = key.addr;
        (*p).backend_port = key.port;
        (*p).frontend = v.addr;
        (*p).frontend_port = v.port;
        (*p).proto = v.proto;
        (*p).service_id = v.service_id;
    }
    submit(e, now, cpu);
}

/// The end of a connected UDP socket's translation: socket `cookie` was released, and its
/// reverse-NAT entry `key` -> `v` (backend -> frontend) went with it.
#[inline(never)]
pub fn sock_flow_end(key: &RevNatKey, v: &RevNatValue) {
    let Some((now, cpu)) = admit() else {
        return;
    };
    let w = word(
        EventKind::FlowEnd,
        EventReason::SocketClosed,
        0,
        proxy_common::monitor::ALGORITHM_UNKNOWN,
        HOOK_SOCK,
    );
    let Some(mut e) = reserve(w, now, cpu) else {
        return;
    };
    let p = e.as_mut_ptr();
    // SAFETY: the reserved record.
    unsafe {
        (*p).cookie = key.cookie;
        (*p).backend = key.addr;
        (*p).backend_port = key.port;
        (*p).frontend = v.addr;
        (*p).frontend_port = v.port;
        (*p).proto = v.proto;
        (*p).service_id = v.service_id;
    }
    submit(e, now, cpu);
}

/// A send of the stale connected UDP socket `cookie` (of service `service_id`) dropped by
/// the cgroup skb program `skb` (its packet's destination is the backend that left).
#[inline(never)]
pub fn stale_event(skb: *mut aya_ebpf::bindings::__sk_buff, cookie: u64, service_id: u32) {
    let Some((now, cpu)) = admit() else {
        return;
    };
    let w = word(
        EventKind::StaleDrop,
        EventReason::StaleSocket,
        0,
        proxy_common::monitor::ALGORITHM_UNKNOWN,
        HOOK_SKB,
    );
    let Some(mut e) = reserve(w, now, cpu) else {
        return;
    };
    let ctx = SkBuffContext::new(skb);
    let p = e.as_mut_ptr();
    // SAFETY: the reserved record.
    unsafe {
        (*p).cookie = cookie;
        (*p).service_id = service_id;
        (*p).proto = proxy_common::PROTO_UDP;
        // The packet starts at its IP header: the destination of IPv4 at 16, of IPv6 at 24.
        if ctx.skb.protocol() == 0x0800u16.to_be() as u32 {
            if let Ok(d) = ctx.load::<u32>(16) {
                (*p).backend = proxy_common::v4_mapped(d);
            }
        } else if let Ok(d) = ctx.load::<[u8; 16]>(24) {
            (*p).backend = d;
        }
    }
    submit(e, now, cpu);
}

/// A new packet flow decided on by `nat::new_flow`, from its scratch slot: the request
/// (frontend, client), the service and backend, and the SNAT address and port.
#[inline(never)]
pub fn flow_event(w: u64, sc: *const Scratch) {
    let Some((now, cpu)) = admit() else {
        return;
    };
    // SAFETY: this CPU's scratch slot, as the caller passes it.
    let sid = unsafe { (*sc).mon_sid };
    let affinity = take_affinity(sid);
    let Some(mut e) = reserve(w, now, cpu) else {
        return;
    };
    let p = e.as_mut_ptr();
    // SAFETY: the reserved record and this CPU's scratch slot.
    unsafe {
        (*p).flags |= affinity;
        (*p).client = (*sc).req.client.addr;
        (*p).client_port = (*sc).req.client.port;
        (*p).frontend = (*sc).req.frontend.addr;
        (*p).frontend_port = (*sc).req.frontend.port;
        (*p).proto = (*sc).req.frontend.proto;
        (*p).service_id = sid;
        let bid = (*sc).mon_bid;
        (*p).backend_id = bid;
        if bid != 0 {
            (*p).backend = (*sc).fwd.daddr;
            (*p).backend_port = (*sc).fwd.dport;
        }
        if w >> 16 & proxy_common::monitor::EVENT_F_SNAT as u64 != 0 {
            (*p).nat = (*sc).eg.saddr;
            (*p).nat_port = (*sc).eg.sport;
        }
    }
    submit(e, now, cpu);
}

/// A packet tuple event: the conntrack entry `entry` keyed `key` (flow end, ICMP error
/// translation). `client`:`client_port` -> `frontend`:`frontend_port` is the key's tuple,
/// `nat` -> `backend` the rewritten one.
#[inline(never)]
pub fn tuple_event(w: u64, key: &CtKey, entry: *const CtEntry) {
    let Some((now, cpu)) = admit() else {
        return;
    };
    let Some(mut e) = reserve(w, now, cpu) else {
        return;
    };
    let p = e.as_mut_ptr();
    // SAFETY: the reserved record; `entry` is a map value the caller holds.
    unsafe {
        (*p).client = key.saddr;
        (*p).client_port = key.sport;
        (*p).frontend = key.daddr;
        (*p).frontend_port = key.dport;
        (*p).proto = key.proto;
        (*p).nat = (*entry).saddr;
        (*p).nat_port = (*entry).sport;
        (*p).backend = (*entry).daddr;
        (*p).backend_port = (*entry).dport;
        (*p).service_id = (*entry).service_id;
    }
    submit(e, now, cpu);
}

/// A refused connect()/sendmsg() of request `req` to service `service_id` (0 when the port
/// is undefined) with `algorithm`: emitted when a monitor runs.
#[inline(always)]
pub fn sock_refused(ctx: *mut c_void, r: Refusal, req: &Request, service_id: u32, algorithm: u8) {
    if on() {
        let w = word(EventKind::SockRefuse, reason_of(r), 0, algorithm, HOOK_SOCK);
        sock_event(ctx, w, req, service_id, 0);
    }
}

/// A translated connect() (or the first sendmsg() of an unconnected UDP flow, with
/// `EVENT_F_DATAGRAM` in `flags`) of request `req` to backend `backend_id` of service
/// `service_id`: emitted when a monitor runs.
#[inline(always)]
pub fn sock_translated(
    ctx: *mut c_void,
    flags: u8,
    req: &Request,
    service_id: u32,
    backend_id: u32,
    algorithm: u8,
) {
    if on() {
        let w = word(
            EventKind::SockTranslate,
            EventReason::None,
            flags,
            algorithm,
            HOOK_SOCK,
        );
        sock_event(ctx, w, req, service_id, backend_id);
    }
}

/// Notes the drop of a packet that would have started a flow, counted as `counter` (a
/// `TcCounter`), at hook `hook` (`HOOK_*`), for the entry point to emit (see
/// `nat::count_new_flow`). Its own BPF function: the mapping stays out of `new_flow`'s
/// instructions.
#[inline(never)]
pub fn note_flow_drop(counter: u32, hook: u8) {
    use proxy_common::nat::TcCounter as C;
    let reason = if counter == C::DroppedNoEndpoints as u32 {
        EventReason::NoEndpoints
    } else if counter == C::DroppedNoLocalEndpoints as u32 {
        EventReason::NoLocalEndpoints
    } else if counter == C::SourceRangeDenied as u32 {
        EventReason::SourceRange
    } else if counter == C::NoSnatAddress as u32 {
        EventReason::NoSnatAddress
    } else if counter == C::SnatPortsExhausted as u32 {
        EventReason::SnatPortsExhausted
    } else if counter == C::ConntrackFull as u32 {
        EventReason::ConntrackFull
    } else {
        EventReason::RewriteFailed
    };
    let Some(sc) = crate::maps::TC_SCRATCH.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's slot, used only while this program runs.
    unsafe {
        (*sc).mon = word(
            EventKind::FlowDrop,
            reason,
            0,
            proxy_common::monitor::ALGORITHM_UNKNOWN,
            hook,
        );
        (*sc).mon_bid = 0;
    }
}
