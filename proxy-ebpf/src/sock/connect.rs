//! `connect4/6`: a TCP connection or a connected UDP socket gets one backend for its
//! lifetime, remembered in the socket's reverse-NAT slot.

use aya_ebpf::{EbpfContext, macros::cgroup_sock_addr, programs::SockAddrContext};
use proxy_common::{
    Counter, PROTO_TCP, PROTO_UDP, REVNAT_F_CONNECTED, REVNAT_F_COUNTED, counts_connections,
    monitor::{ALGORITHM_UNKNOWN as ALG_UNKNOWN, EVENT_F_STALE_REPAIRED},
};

use super::{
    hook::{ALLOW, bypassed, client_of, cookie, deny, no_endpoints, read_addr, write_addr},
    revnat::{forget_connected_peer, forget_direct, remember_connected},
};
use crate::{
    addr::L4Addr,
    klog,
    lb::{lookup, needs_client, select},
    lc,
    maps::STALE_SOCKETS,
    monitor,
    stats::{count, count_service},
    types::{Lookup, NO_BACKEND, Refusal, Request, Scope},
};

#[cgroup_sock_addr(connect4)]
pub fn connect4(ctx: SockAddrContext) -> i32 {
    on_connect::<false>(&ctx)
}

#[cgroup_sock_addr(connect6)]
pub fn connect6(ctx: SockAddrContext) -> i32 {
    on_connect::<true>(&ctx)
}

#[inline(always)]
fn on_connect<const V6: bool>(ctx: &SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: context field read.
    let proto = unsafe { (*sa).protocol } as u8;
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return ALLOW;
    }
    let (addr, port) = read_addr::<V6>(sa);
    let mut req = Request {
        frontend: L4Addr::new(addr, port, proto),
        client: L4Addr::zero(),
    };
    let found = lookup(&req.frontend, Scope::Node);
    if !matches!(found, Lookup::NotService) && bypassed(ctx) {
        count(Counter::Bypassed);
        return ALLOW;
    }
    let fe = match found {
        Lookup::NotService => {
            klog::sock_not_frontend(&req.frontend);
            // A UDP socket connected to a pod directly after reaching it through a VIP
            // (`connect(AF_UNSPEC)` in between) sees that pod as its peer again. (Not
            // looked for on TCP connects, which would all pay the socket cookie.)
            if proto == PROTO_UDP {
                forget_connected_peer(cookie(ctx), &addr, port);
            }
            return ALLOW;
        }
        Lookup::Refused(r) => {
            monitor::sock_refused(ctx.as_ptr(), r, &req, 0, ALG_UNKNOWN);
            klog::sock_refused(&req.frontend, monitor::reason_of(r) as u8, 0);
            return deny(r);
        }
        Lookup::Frontend { fe, .. } => fe,
    };
    if needs_client(&fe) || monitor::on() {
        client_of::<V6>(ctx, &mut req.client);
    }
    let mut b = NO_BACKEND;
    let id = select(&fe, &req, &mut b);
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
    let cookie = cookie(ctx);
    let mut mon_flags = 0;
    if proto == PROTO_UDP {
        // Connecting again is how an application recovers a socket whose endpoint left.
        if STALE_SOCKETS.remove(cookie).is_ok() {
            mon_flags = EVENT_F_STALE_REPAIRED;
        }
        // This connect is now the socket's latest word on that peer (`recvmsg` reads
        // `REVNAT_SK` first).
        forget_direct(cookie, &b.addr, b.port);
    }
    let counted = counts_connections(fe.algorithm);
    let flags = if counted {
        REVNAT_F_CONNECTED | REVNAT_F_COUNTED
    } else {
        REVNAT_F_CONNECTED
    };
    let remembered = remember_connected(cookie, &b, &req, flags, fe.service_id);
    count_service(fe.service_id, id, 0);
    // Counted only with an entry whose release gives the count back.
    if counted && remembered {
        lc::socket_counted(cookie, id);
    }
    count(Counter::Translated);
    monitor::sock_translated(
        ctx.as_ptr(),
        mon_flags,
        &req,
        fe.service_id,
        id,
        fe.algorithm,
    );
    klog::sock_translated(&req.frontend, &b.addr, b.port, fe.service_id, id);
    ALLOW
}
