//! What every `sock_addr` hook reads and answers: the syscall's address, the verdicts and
//! errnos of a refusal, the client as the Service sees it, whether the socket's workload
//! bypasses socket-level translation, and the socket cookie.

use aya_ebpf::{
    EbpfContext,
    bindings::bpf_sock_addr,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_set_retval},
    programs::SockAddrContext,
};
use proxy_common::{
    Counter, Frontend,
    bypass::{BYPASS_CFG_HOST_ONLY, BYPASS_CFG_PODS},
    bytes_of, client_of_netns, is_v4_mapped, v4_mapped, v4_of_mapped, words_of,
};

use crate::{
    addr::L4Addr,
    maps::{BYPASS_CONFIG, BYPASS_NETNS},
    stats::{count, count_service},
    types::Refusal,
};

const ECONNREFUSED: i32 = 111;
const EHOSTUNREACH: i32 = 113;
/// Verdict "let the syscall go on" of a sock_addr program.
pub(super) const ALLOW: i32 = 1;
/// Verdict "fail the syscall" (with the errno set by `bpf_set_retval`).
const DENY: i32 = 0;

/// The user address of the syscall as 16 bytes (IPv4 mapped), and its port (network order).
#[inline(always)]
pub(super) fn read_addr<const V6: bool>(sa: *const bpf_sock_addr) -> ([u8; 16], [u8; 2]) {
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
pub(super) fn write_addr<const V6: bool>(
    sa: *mut bpf_sock_addr,
    addr: &[u8; 16],
    port: [u8; 2],
) -> bool {
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
pub(super) fn deny(r: Refusal) -> i32 {
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
pub(super) fn no_endpoints(fe: &Frontend) -> i32 {
    count_service(fe.service_id, 0, 1);
    deny(Refusal::no_backend(fe))
}

/// The client as the Service sees it: the socket's bound source address when it has one,
/// else its network namespace (one per pod; see `proxy_common::client_of_netns`). Not
/// inlined, for the stack (see `remember`).
#[inline(never)]
pub(super) fn client_of<const V6: bool>(ctx: &SockAddrContext, out: &mut L4Addr) {
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
pub(super) fn bypassed(ctx: &SockAddrContext) -> bool {
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
pub(super) fn cookie(ctx: &SockAddrContext) -> u64 {
    // SAFETY: helper on our own context.
    unsafe { bpf_get_socket_cookie(ctx.as_ptr()) }
}
