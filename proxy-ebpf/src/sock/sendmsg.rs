//! `sendmsg4/6`: unconnected UDP. One backend per (socket, frontend) flow, kept in
//! `UDP_FLOWS` while the flow is active (idle timeout from `CONFIG`).

use aya_ebpf::{
    EbpfContext, helpers::bpf_ktime_get_ns, macros::cgroup_sock_addr, programs::SockAddrContext,
};
use proxy_common::{
    Backend, Counter, DEFAULT_UDP_FLOW_TIMEOUT_NS, Frontend, PROTO_UDP, UdpFlow, UdpFlowKey,
    monitor::{ALGORITHM_UNKNOWN as ALG_UNKNOWN, EVENT_F_DATAGRAM},
};

use super::{
    hook::{ALLOW, bypassed, client_of, cookie, deny, no_endpoints, read_addr, write_addr},
    revnat::{forget_direct, remember},
};
use crate::{
    addr::L4Addr,
    klog,
    lb::{lookup, needs_client, select},
    maps::{CONFIG, UDP_FLOWS, backend},
    monitor,
    stats::{count, count_service},
    types::{Lookup, NO_BACKEND, Refusal, Request, Scope},
};

#[cgroup_sock_addr(sendmsg4)]
pub fn sendmsg4(ctx: SockAddrContext) -> i32 {
    on_sendmsg::<false>(&ctx)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn sendmsg6(ctx: SockAddrContext) -> i32 {
    on_sendmsg::<true>(&ctx)
}

#[inline(always)]
fn flow_timeout_ns() -> u64 {
    match CONFIG.get(0) {
        Some(c) if c.udp_flow_timeout_ns != 0 => c.udp_flow_timeout_ns,
        _ => DEFAULT_UDP_FLOW_TIMEOUT_NS,
    }
}

#[inline(always)]
fn on_sendmsg<const V6: bool>(ctx: &SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    let (addr, port) = read_addr::<V6>(sa);
    let mut req = Request {
        frontend: L4Addr::new(addr, port, PROTO_UDP),
        client: L4Addr::zero(),
    };
    let found = lookup(&req.frontend, Scope::Node);
    if !matches!(found, Lookup::NotService) && bypassed(ctx) {
        count(Counter::Bypassed);
        return ALLOW;
    }
    let fe = match found {
        Lookup::NotService => {
            forget_direct(cookie(ctx), &addr, port);
            return ALLOW;
        }
        Lookup::Refused(r) => {
            monitor::sock_refused(ctx.as_ptr(), r, &req, 0, ALG_UNKNOWN);
            klog::sock_refused(&req.frontend, monitor::reason_of(r) as u8, 0);
            return deny(r);
        }
        Lookup::Frontend { fe, .. } => fe,
    };
    let cookie = cookie(ctx);
    // SAFETY: helper without side effects.
    let now = unsafe { bpf_ktime_get_ns() };
    let fkey = UdpFlowKey {
        cookie,
        addr,
        port,
        _pad: [0; 6],
    };

    let mut b = NO_BACKEND;
    let chosen = flow_backend(&fkey, &fe, now, &mut b);
    let id = if chosen != 0 {
        chosen
    } else {
        if needs_client(&fe) || monitor::on() {
            client_of::<V6>(ctx, &mut req.client);
        }
        let id = select(&fe, &req, &mut b);
        if id != 0 {
            // A new flow.
            count_service(fe.service_id, id, 0);
        }
        id
    };
    if id == 0 {
        let r = Refusal::no_backend(&fe);
        monitor::sock_refused(ctx.as_ptr(), r, &req, fe.service_id, fe.algorithm);
        klog::sock_refused(&req.frontend, monitor::reason_of(r) as u8, fe.service_id);
        return no_endpoints(&fe);
    };
    if !write_addr::<V6>(sa, &b.addr, b.port) {
        monitor::sock_refused(
            ctx.as_ptr(),
            Refusal::NoEndpoints,
            &req,
            fe.service_id,
            fe.algorithm,
        );
        return deny(Refusal::NoEndpoints);
    }
    save_flow(&fkey, id, fe.service_id, now, &b);
    remember(cookie, &b, &req, 0, fe.service_id);
    count(Counter::Translated);
    if chosen == 0 {
        // A new flow (a datagram of a known flow is not an event).
        monitor::sock_translated(
            ctx.as_ptr(),
            EVENT_F_DATAGRAM,
            &req,
            fe.service_id,
            id,
            fe.algorithm,
        );
        klog::sock_translated(&req.frontend, &b.addr, b.port, fe.service_id, id);
    }
    ALLOW
}

/// The id of the flow's backend, written into `out`, while the flow is active and the
/// backend still exists; 0 otherwise. Not inlined
/// (stack).
#[inline(never)]
fn flow_backend(fkey: &UdpFlowKey, fe: &Frontend, now: u64, out: &mut Backend) -> u32 {
    // SAFETY: copied out at once.
    let Some(f) = (unsafe { UDP_FLOWS.get(*fkey).copied() }) else {
        return 0;
    };
    if f.service_id != fe.service_id
        || fe.backend_count == 0
        || now.wrapping_sub(f.last_seen_ns) >= flow_timeout_ns()
    {
        return 0;
    }
    match backend(f.backend_id) {
        Some(b) if b.addr == f.addr => {
            *out = b;
            f.backend_id
        }
        _ => 0,
    }
}

/// Records (or refreshes) the flow `key` -> backend `id` of service `service_id`. Not
/// inlined, for the stack (see `remember`).
#[inline(never)]
fn save_flow(key: &UdpFlowKey, id: u32, service_id: u32, now: u64, b: &Backend) {
    let flow = UdpFlow {
        backend_id: id,
        service_id,
        last_seen_ns: now,
        addr: b.addr,
    };
    if UDP_FLOWS.insert(*key, flow, 0).is_err() {
        count(Counter::MapUpdateFailed);
    }
}
