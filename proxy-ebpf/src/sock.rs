//! cgroup `sock_addr` entry points: socket-level load balancing.
//!
//! - `connect4/6`: TCP connections and connected UDP sockets get one backend for their
//!   lifetime (kube-proxy picks per connection too).
//! - `sendmsg4/6`: unconnected UDP; one backend per (socket, frontend) flow, kept while the
//!   flow is active (idle timeout from `CONFIG`, default 30 s as `nf_conntrack_udp_timeout`).
//! - `recvmsg4/6`, `getpeername4/6`: the peer a socket reached through a VIP is shown as the
//!   VIP again; peers the socket addressed directly are never touched. What counts is the
//!   socket's most recent datagram to that peer: a datagram sent straight to a backend's
//!   address ends the VIP's reverse translation for that peer, and the next datagram
//!   through the VIP brings it back.
//!
//! - `sock_release`: a released socket's reverse-NAT entry and least-connections count go
//!   (a connected UDP socket's is a `flow-end` event of the monitor).
//!
//! The client identity (netns cookie, socket cookie) is read only for the algorithms and
//! the affinity that use it (`lb::needs_client`), and while a monitor runs (its events name
//! the client).
//!
//! A socket of a workload that bypasses socket-level translation (`proxy_common::bypass`)
//! is left untouched, refusals included: its packets are translated by `pod_ingress`.
//!
//! Refusals (`types::Refusal`: no endpoints, undefined port on a VIP) fail the syscall with
//! ECONNREFUSED via `bpf_set_retval` (kernel >= 5.18), as kube-proxy's nftables mode rejects
//! them. A frontend whose `Local` traffic policy leaves it without endpoints on this node
//! (kube-proxy drops those packets) fails with EHOSTUNREACH: a connect() cannot be dropped
//! silently here.

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_EXIST, BPF_NOEXIST, bpf_sock_addr},
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_ktime_get_ns, bpf_set_retval},
    macros::{cgroup_sock, cgroup_sock_addr},
    programs::{SockAddrContext, SockContext},
};
use proxy_common::{
    Backend, Counter, DEFAULT_UDP_FLOW_TIMEOUT_NS, Frontend, PROTO_TCP, PROTO_UDP,
    REVNAT_F_CONNECTED, REVNAT_F_COUNTED, RevNatKey, RevNatValue, SOCK_NAT_BUSY, SPILLED_LEGACY,
    SPILLED_OVERFLOW, SockNat, UdpFlow, UdpFlowKey,
    bypass::{BYPASS_CFG_HOST_ONLY, BYPASS_CFG_PODS},
    bytes_of, client_of_netns, counts_connections, is_v4_mapped,
    monitor::{ALGORITHM_UNKNOWN as ALG_UNKNOWN, EVENT_F_DATAGRAM, EVENT_F_STALE_REPAIRED},
    v4_mapped, v4_of_mapped, words_of,
};

use crate::{
    addr::L4Addr,
    klog,
    lb::{lookup, needs_client, select},
    lc,
    maps::{
        BYPASS_CONFIG, BYPASS_NETNS, CONFIG, REVNAT_SK, SOCK_NAT, SOCK_NAT_OVERFLOW,
        SOCK_NAT_SPILLED, STALE_SOCKETS, UDP_FLOWS, backend, sock_nat_slot_mask,
    },
    monitor,
    stats::{count, count_service},
    types::{Lookup, NO_BACKEND, Refusal, Request, Scope},
};

const AF_INET6: u32 = 10;
const ECONNREFUSED: i32 = 111;
const EHOSTUNREACH: i32 = 113;
/// Verdict "let the syscall go on" of a sock_addr program.
const ALLOW: i32 = 1;
/// Verdict "fail the syscall" (with the errno set by `bpf_set_retval`).
const DENY: i32 = 0;

/// Forgets a released socket: its reverse-NAT entry and least-connections count. Runs for
/// every socket of the cgroup. A socket `connect()` translated has its entry in its
/// `SOCK_NAT` slot or, only while some entry went there, in `SOCK_NAT_OVERFLOW`: both
/// found by cookie, whatever the socket's state (a failed blocking connect or a
/// `connect(AF_UNSPEC)` clears the peer before the release). Entries an earlier version
/// wrote to `REVNAT_SK` are looked up by the socket's peer while the agent says some may
/// be left (`SPILLED_LEGACY`).
#[cgroup_sock(sock_release)]
pub fn sock_release(ctx: SockContext) -> i32 {
    let sk = ctx.sock;
    // SAFETY: readable fields of our context (`struct bpf_sock`).
    let (family, dst_port, protocol) = unsafe { ((*sk).family, (*sk).dst_port, (*sk).protocol) };
    if protocol != PROTO_TCP as u32 && protocol != PROTO_UDP as u32 {
        return 1;
    }
    // SAFETY: as above. Both forms are read unconditionally, each field at its constant
    // offset: loads in two branches get merged into one through a computed pointer, a
    // context access the verifier refuses.
    let (ip6, ip4) = unsafe {
        use core::ptr::read_volatile as rd;
        (
            [
                rd(&(*sk).dst_ip6[0]),
                rd(&(*sk).dst_ip6[1]),
                rd(&(*sk).dst_ip6[2]),
                rd(&(*sk).dst_ip6[3]),
            ],
            rd(&(*sk).dst_ip4),
        )
    };
    // SAFETY: helper on our own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let found = match take_slot(cookie).or_else(|| take_overflow(cookie)) {
        Some(e) => Some((e.key, e.value)),
        None if dst_port == 0 || !hint(SPILLED_LEGACY) => None,
        None => {
            let key = RevNatKey {
                cookie,
                addr: if family == AF_INET6 {
                    bytes_of(&ip6)
                } else {
                    v4_mapped(ip4)
                },
                port: dst_port.to_ne_bytes(),
                _pad: [0; 6],
            };
            // SAFETY: copied out at once.
            match unsafe { REVNAT_SK.get(key).copied() } {
                Some(v) if v.flags & REVNAT_F_CONNECTED != 0 => {
                    let _ = REVNAT_SK.remove(key);
                    Some((key, v))
                }
                _ => None,
            }
        }
    };
    if let Some((key, v)) = found {
        if v.flags & REVNAT_F_COUNTED != 0 {
            lc::socket_released(cookie);
        }
        if v.flags & REVNAT_F_CONNECTED != 0 && protocol == PROTO_UDP as u32 {
            // A closed socket is no longer stale: once none is, the agent detaches the
            // egress program.
            let _ = STALE_SOCKETS.remove(cookie);
            if monitor::on() {
                monitor::sock_flow_end(&key, &v);
            }
        }
    }
    // sock_release programs must return 1.
    1
}

#[cgroup_sock_addr(connect4)]
pub fn connect4(ctx: SockAddrContext) -> i32 {
    on_connect::<false>(&ctx)
}

#[cgroup_sock_addr(connect6)]
pub fn connect6(ctx: SockAddrContext) -> i32 {
    on_connect::<true>(&ctx)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn sendmsg4(ctx: SockAddrContext) -> i32 {
    on_sendmsg::<false>(&ctx)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn sendmsg6(ctx: SockAddrContext) -> i32 {
    on_sendmsg::<true>(&ctx)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn recvmsg4(ctx: SockAddrContext) -> i32 {
    on_reverse::<false, true>(&ctx)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn recvmsg6(ctx: SockAddrContext) -> i32 {
    on_reverse::<true, true>(&ctx)
}

#[cgroup_sock_addr(getpeername4)]
pub fn getpeername4(ctx: SockAddrContext) -> i32 {
    on_reverse::<false, false>(&ctx)
}

#[cgroup_sock_addr(getpeername6)]
pub fn getpeername6(ctx: SockAddrContext) -> i32 {
    on_reverse::<true, false>(&ctx)
}

/// The user address of the syscall as 16 bytes (IPv4 mapped), and its port (network order).
#[inline(always)]
fn read_addr<const V6: bool>(sa: *const bpf_sock_addr) -> ([u8; 16], [u8; 2]) {
    // SAFETY: `sa` is the program context; these fields are readable in every sock_addr hook
    // (with 4-byte loads, hence word by word).
    unsafe {
        let addr = if V6 {
            bytes_of(&[
                (*sa).user_ip6[0],
                (*sa).user_ip6[1],
                (*sa).user_ip6[2],
                (*sa).user_ip6[3],
            ])
        } else {
            v4_mapped((*sa).user_ip4)
        };
        // user_port holds the be16 port in its low 16 bits.
        (addr, ((*sa).user_port as u16).to_ne_bytes())
    }
}

/// Writes the user address; `false` when an IPv6 address cannot go into an IPv4 socket.
#[inline(always)]
fn write_addr<const V6: bool>(sa: *mut bpf_sock_addr, addr: &[u8; 16], port: [u8; 2]) -> bool {
    // SAFETY: `sa` is the program context; user_ip*/user_port are writable in these hooks.
    unsafe {
        if V6 {
            let w = words_of(addr);
            (*sa).user_ip6[0] = w[0];
            (*sa).user_ip6[1] = w[1];
            (*sa).user_ip6[2] = w[2];
            (*sa).user_ip6[3] = w[3];
        } else {
            if !is_v4_mapped(addr) {
                return false;
            }
            (*sa).user_ip4 = v4_of_mapped(addr);
        }
        (*sa).user_port = u16::from_ne_bytes(port) as u32;
    }
    true
}

/// The socket hooks' answer to a [`Refusal`]: the syscall fails with ECONNREFUSED, or
/// EHOSTUNREACH for a Local policy without local endpoints; counted by reason.
#[inline(always)]
fn deny(r: Refusal) -> i32 {
    let (counter, errno) = match r {
        Refusal::UndefinedPort => (Counter::RefusedUndefinedPort, ECONNREFUSED),
        Refusal::NoEndpoints => (Counter::RefusedNoEndpoints, ECONNREFUSED),
        Refusal::NoLocalEndpoints => (Counter::DroppedNoLocalEndpoints, EHOSTUNREACH),
    };
    count(counter);
    // SAFETY: helper; sets the errno the syscall returns when we deny it.
    unsafe { bpf_set_retval(-errno) };
    DENY
}

/// No endpoint to choose for frontend `fe`: counted for its service and refused.
#[inline(always)]
fn no_endpoints(fe: &Frontend) -> i32 {
    count_service(fe.service_id, 0, 1);
    deny(Refusal::no_backend(fe))
}

/// The client as the Service sees it: the socket's bound source address when it has one,
/// else its network namespace (one per pod; see `proxy_common::client_of_netns`). Not
/// inlined, for the stack (see `remember`).
#[inline(never)]
fn client_of<const V6: bool>(ctx: &SockAddrContext, out: &mut L4Addr) {
    let sa = ctx.sock_addr;
    // SAFETY: `sk` of a sock_addr context is a valid socket pointer; src_ip4/src_ip6 are
    // readable fields of `struct bpf_sock`.
    let bound = unsafe {
        let sk = (*sa).__bindgen_anon_1.sk;
        if V6 {
            let w = [
                (*sk).src_ip6[0],
                (*sk).src_ip6[1],
                (*sk).src_ip6[2],
                (*sk).src_ip6[3],
            ];
            let a = bytes_of(&w);
            if w[0] | w[1] | w[2] | w[3] != 0 && !(is_v4_mapped(&a) && w[3] == 0) {
                Some(a)
            } else {
                None
            }
        } else {
            let ip = (*sk).src_ip4;
            if ip != 0 { Some(v4_mapped(ip)) } else { None }
        }
    };
    out.addr = match bound {
        Some(a) => a,
        // SAFETY: helper on our own context.
        None => client_of_netns(unsafe { bpf_get_netns_cookie(ctx.as_ptr()) }),
    };
    // The client port for `maglev` hashing: the bound source port, else (the usual
    // unbound socket, whose port is chosen later) a per-socket value, so one client's
    // connections spread over backends the way distinct source ports would.
    // SAFETY: as above.
    let bound_port = unsafe { (*(*sa).__bindgen_anon_1.sk).src_port } as u16;
    out.port = if bound_port != 0 {
        bound_port.to_be_bytes()
    } else {
        // SAFETY: helper on our own context.
        (unsafe { bpf_get_socket_cookie(ctx.as_ptr()) } as u16).to_ne_bytes()
    };
}

/// Whether the socket's workload bypasses socket-level translation (see
/// `proxy_common::bypass`): with `--socket-lb-scope host-only` every namespace but the
/// node's own, and the namespaces of pods opted out (`BYPASS_NETNS`). Asked only for a
/// frontend, so other connections pay nothing; with nothing bypassed it costs one array
/// lookup. The reverse hooks (`recvmsg`, `getpeername`) and `sock_release` need no check:
/// they touch only sockets this program translated, which a bypassed socket never is (one
/// translated before its pod opted out keeps its reverse translation until it closes).
#[inline(always)]
fn bypassed(ctx: &SockAddrContext) -> bool {
    let Some(cfg) = BYPASS_CONFIG.get(0) else {
        return false;
    };
    let (flags, host) = (cfg.flags, cfg.host_netns);
    if flags == 0 {
        return false;
    }
    // SAFETY: helper on our own context.
    let ns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    (flags & BYPASS_CFG_HOST_ONLY != 0 && ns != host)
        || (flags & BYPASS_CFG_PODS != 0 && BYPASS_NETNS.get_ptr(ns).is_some())
}

#[inline(always)]
fn cookie(ctx: &SockAddrContext) -> u64 {
    // SAFETY: helper on our own context.
    unsafe { bpf_get_socket_cookie(ctx.as_ptr()) }
}

/// Remembers that this socket reached `b` through the frontend of `req` of service
/// `service_id`. Not inlined: its 56 bytes of key and value stay out of the hook's frame,
/// which shares the 512-byte BPF stack with `select`.
#[inline(never)]
fn remember(cookie: u64, b: &Backend, req: &Request, flags: u8, service_id: u32) {
    let key = RevNatKey {
        cookie,
        addr: b.addr,
        port: b.port,
        _pad: [0; 6],
    };
    let val = RevNatValue {
        addr: req.frontend.addr,
        port: req.frontend.port,
        proto: req.frontend.proto,
        flags,
        service_id,
    };
    if REVNAT_SK.insert(key, val, 0).is_err() {
        count(Counter::MapUpdateFailed);
    }
}

/// A datagram this socket sends to `addr`:`port` itself, not through a frontend: replies
/// from that peer are shown as coming from that peer again (the socket addressed it last,
/// so a reply is an answer to that datagram). Drops the socket's unconnected reverse-NAT
/// entry for that peer, and stops its connected entry for that peer translating (a UDP
/// socket connected through a VIP that sends to the pod itself, or was disconnected).
///
/// Cost for every datagram to an address that is no frontend: the socket's slot and one
/// `REVNAT_SK` lookup, a miss unless the socket reached the same peer through a VIP before
/// (the socket cookie it needs is read once per socket, then cached by the kernel). Not
/// inlined (stack).
#[inline(never)]
fn forget_direct(cookie: u64, addr: &[u8; 16], port: [u8; 2]) {
    forget_connected_peer(cookie, addr, port);
    let key = RevNatKey {
        cookie,
        addr: *addr,
        port,
        _pad: [0; 6],
    };
    // SAFETY: copied out at once.
    if let Some(flags) = unsafe { REVNAT_SK.get(key).map(|v| v.flags) }
        && flags & REVNAT_F_CONNECTED == 0
    {
        let _ = REVNAT_SK.remove(key);
    }
}

/// The socket's slot in `SOCK_NAT` (none when the agent made the map smaller than the mask).
#[inline(always)]
fn slot_of(cookie: u64) -> Option<*mut SockNat> {
    SOCK_NAT.get_ptr_mut((cookie & sock_nat_slot_mask()) as u32)
}

/// Remembers that this connected socket reached `b` through the frontend of `req`: in its
/// `SOCK_NAT` slot (see `proxy_common::SOCK_NAT` for the claiming protocol), or in
/// `SOCK_NAT_OVERFLOW` when another live socket holds the slot. Not inlined (stack, see
/// `remember`).
#[inline(never)]
fn remember_connected(cookie: u64, b: &Backend, req: &Request, flags: u8, service_id: u32) -> bool {
    use core::intrinsics::{AtomicOrdering::SeqCst, atomic_cxchg, atomic_xchg};
    let value = RevNatValue {
        addr: req.frontend.addr,
        port: req.frontend.port,
        proto: req.frontend.proto,
        flags,
        service_id,
    };
    if let Some(p) = slot_of(cookie) {
        // SAFETY: `p` points into a map value that lives while the program runs; the
        // cookie is 8-byte aligned (offset 0 of an array value).
        let c = unsafe { &raw mut (*p).key.cookie };
        // SAFETY: as above.
        let (old, _) =
            unsafe { atomic_cxchg::<u64, { SeqCst }, { SeqCst }>(c, 0, cookie | SOCK_NAT_BUSY) };
        if old == cookie {
            // A socket connected again owns its slot already: busy while rewritten, and
            // the count of its earlier backend given back.
            // SAFETY: as above.
            let before = unsafe {
                core::ptr::write_volatile(c, cookie | SOCK_NAT_BUSY);
                (*p).value.flags
            };
            if before & REVNAT_F_COUNTED != 0 {
                lc::socket_released(cookie);
            }
        }
        if old == 0 || old == cookie {
            // SAFETY: as above; the slot is this socket's until its release.
            unsafe {
                (*p).key.addr = b.addr;
                (*p).key.port = b.port;
                (*p).value = value;
                atomic_xchg::<u64, { SeqCst }>(c, cookie);
            }
            // A socket connected again may have an entry from when its slot was taken.
            if let Some(e) = take_overflow(cookie)
                && e.value.flags & REVNAT_F_COUNTED != 0
            {
                lc::socket_released(cookie);
            }
            return true;
        }
    }
    let e = SockNat {
        key: RevNatKey {
            cookie,
            addr: b.addr,
            port: b.port,
            _pad: [0; 6],
        },
        value,
    };
    // A socket connected again replaces its entry, and gives back its earlier count.
    if hint(SPILLED_OVERFLOW)
        && let Some(old) = SOCK_NAT_OVERFLOW.get_ptr_mut(cookie)
    {
        // SAFETY: a value of our map, copied out at once.
        if unsafe { (*old).value.flags } & REVNAT_F_COUNTED != 0 {
            lc::socket_released(cookie);
        }
        if SOCK_NAT_OVERFLOW
            .insert(cookie, e, BPF_EXIST as u64)
            .is_ok()
        {
            return true;
        }
    }
    if SOCK_NAT_OVERFLOW
        .insert(cookie, e, BPF_NOEXIST as u64)
        .is_err()
    {
        count(Counter::MapUpdateFailed);
        return false;
    }
    hint_add(SPILLED_OVERFLOW, 1);
    count(Counter::ReverseNatSpilled);
    true
}

/// The socket now addresses `addr`:`port` itself, not through a frontend (a UDP datagram
/// or connect() to it): its connected entry for that peer stops translating, while
/// keeping the cookie and flags its release needs.
#[inline(always)]
fn forget_connected_peer(cookie: u64, addr: &[u8; 16], port: [u8; 2]) {
    if let Some(p) = owned_slot_to(cookie, addr, port) {
        // SAFETY: see `owned_slot`.
        unsafe {
            (*p).key.addr = [0; 16];
            (*p).key.port = [0; 2];
        }
        return;
    }
    if hint(SPILLED_OVERFLOW)
        && let Some(p) = SOCK_NAT_OVERFLOW.get_ptr_mut(cookie)
    {
        // SAFETY: a value of our map; only this socket's programs write it.
        unsafe {
            if (*p).key.addr == *addr && (*p).key.port == port {
                (*p).key.addr = [0; 16];
                (*p).key.port = [0; 2];
            }
        }
    }
}

/// Whether the `SOCK_NAT_SPILLED` hint `i` is set.
#[inline(always)]
fn hint(i: u32) -> bool {
    SOCK_NAT_SPILLED.get(i).is_some_and(|n| *n != 0)
}

/// Adds `v` (wrapping: `u32::MAX` subtracts one) to the `SOCK_NAT_SPILLED` hint `i`.
#[inline(always)]
fn hint_add(i: u32, v: u32) {
    if let Some(p) = SOCK_NAT_SPILLED.get_ptr_mut(i) {
        lc::atomic_add(p, v);
    }
}

/// A released socket's `SOCK_NAT_OVERFLOW` entry, deleted; looked up only while some
/// entry went there.
#[inline(always)]
fn take_overflow(cookie: u64) -> Option<SockNat> {
    if !hint(SPILLED_OVERFLOW) {
        return None;
    }
    // SAFETY: copied out at once.
    let e = unsafe { SOCK_NAT_OVERFLOW.get(cookie).copied() }?;
    if SOCK_NAT_OVERFLOW.remove(cookie).is_ok() {
        hint_add(SPILLED_OVERFLOW, u32::MAX);
    }
    Some(e)
}

/// The connected socket's entry for peer `addr`:`port`: its slot, else its overflow entry
/// (a UDP socket connected again elsewhere keeps an entry for its former peer until then).
#[inline(always)]
fn connected_entry(cookie: u64, addr: &[u8; 16], port: [u8; 2]) -> Option<RevNatValue> {
    if let Some(v) = slot_entry(cookie, addr, port) {
        return Some(v);
    }
    if !hint(SPILLED_OVERFLOW) {
        return None;
    }
    // SAFETY: copied out at once.
    let e = unsafe { SOCK_NAT_OVERFLOW.get(cookie).copied() }?;
    (e.key.addr == *addr && e.key.port == port).then_some(e.value)
}

/// The socket's `SOCK_NAT` slot when this socket holds it (the slot's cookie is this
/// socket's, not busy). Only the socket itself writes a slot holding its cookie, so its
/// programs may read and write the slot through the pointer until the socket's release.
#[inline(always)]
fn owned_slot(cookie: u64) -> Option<*mut SockNat> {
    let p = slot_of(cookie)?;
    // SAFETY: as in `remember_connected`.
    (unsafe { core::ptr::read_volatile(&raw const (*p).key.cookie) } == cookie).then_some(p)
}

/// [`owned_slot`] when the entry's peer is `addr`:`port` (a UDP socket connected again
/// elsewhere keeps an entry for its former peer until then).
#[inline(always)]
fn owned_slot_to(cookie: u64, addr: &[u8; 16], port: [u8; 2]) -> Option<*mut SockNat> {
    let p = owned_slot(cookie)?;
    // SAFETY: see `owned_slot`.
    unsafe { ((*p).key.addr == *addr && (*p).key.port == port).then_some(p) }
}

/// A released socket's `SOCK_NAT` entry, freeing the slot; `None` when the slot is not
/// this socket's.
#[inline(always)]
fn take_slot(cookie: u64) -> Option<SockNat> {
    let p = owned_slot(cookie)?;
    // SAFETY: see `owned_slot`.
    unsafe {
        let e = *p;
        core::ptr::write_volatile(&raw mut (*p).key.cookie, 0);
        Some(e)
    }
}

/// The connected socket's `SOCK_NAT` entry when its peer is `addr`:`port`.
#[inline(always)]
fn slot_entry(cookie: u64, addr: &[u8; 16], port: [u8; 2]) -> Option<RevNatValue> {
    // SAFETY: see `owned_slot`.
    owned_slot_to(cookie, addr, port).map(|p| unsafe { (*p).value })
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

/// recvmsg (`RECV` = true) and getpeername: show the VIP instead of the backend.
#[inline(always)]
fn on_reverse<const V6: bool, const RECV: bool>(ctx: &SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    let (addr, port) = read_addr::<V6>(sa);
    let cookie = cookie(ctx);
    let key = RevNatKey {
        cookie,
        addr,
        port,
        _pad: [0; 6],
    };
    // `REVNAT_SK`'s entries by connect()ed kind: sendmsg's, or an earlier version's
    // connected ones.
    let revnat = |connected: bool| {
        // SAFETY: copied out at once.
        unsafe { REVNAT_SK.get(key).copied() }
            .filter(|v| (v.flags & REVNAT_F_CONNECTED != 0) == connected)
    };
    let legacy = || hint(SPILLED_LEGACY).then(|| revnat(true)).flatten();
    // A datagram received: the socket's latest datagram with an address to that peer
    // decides, and `sendmsg` writes only `REVNAT_SK` (a UDP socket may send to another VIP
    // than the one it connected to, or send after `connect(AF_UNSPEC)`). `getpeername`:
    // the connected peer.
    let found = if RECV {
        revnat(false)
            .or_else(|| connected_entry(cookie, &addr, port))
            .or_else(legacy)
    } else {
        connected_entry(cookie, &addr, port).or_else(legacy)
    };
    let Some(v) = found else {
        return ALLOW;
    };
    if write_addr::<V6>(sa, &v.addr, v.port) {
        count(Counter::ReverseTranslated);
        if monitor::on() {
            monitor::reverse_event(ctx.as_ptr(), RECV, &key, &v);
        }
    }
    if RECV {
        // A reply keeps the UDP flow active, as it refreshes a conntrack entry.
        let fkey = UdpFlowKey {
            cookie,
            addr: v.addr,
            port: v.port,
            _pad: [0; 6],
        };
        if let Some(f) = UDP_FLOWS.get_ptr_mut(fkey) {
            // SAFETY: in-place timestamp refresh; a torn read elsewhere only shifts expiry.
            unsafe { (*f).last_seen_ns = bpf_ktime_get_ns() };
        }
    }
    // recvmsg and getpeername programs must return 1.
    ALLOW
}
