//! Kernel debug logs (aya-log), for `--kernel-log-level`: one line per decision (a
//! connection translated or refused at the socket, a packet flow started, dropped or
//! rejected on tc), written to the `AYA_LOGS` ring buffer that the agent forwards to its
//! own log.
//!
//! Zero cost when off: each entry point here compares the line's level with the global
//! `AYA_LOG_LEVEL` (aya-log-ebpf's, a `.rodata` value the agent sets at load time, 0 for
//! off) before calling the function that writes the line. The loader freezes `.rodata`, so
//! the verifier knows the value and removes the disabled branches as dead code: with logs
//! off the programs the kernel runs hold no instruction of them, not even the call.
//! With logs on, each line is its own BPF function (its formatting and frame stay out of
//! the hooks' frames and the tc programs' verifier budget), called only at decisions, never
//! per packet of a tracked flow. Lines are lost, never blocking, when the ring is full.
//!
//! Addresses are printed as IPv6 (IPv4 addresses IPv4-mapped, `::ffff:a.b.c.d`, the form
//! every map holds them in); ports in host order.

use aya_log_ebpf::{
    debug,
    macro_support::{Level, level_enabled},
    trace,
};
use proxy_common::nat::CtKey;

use crate::addr::L4Addr;

/// Whether debug lines are on: one load of the `.rodata` global, which the verifier knows,
/// so with lines off the branch and the call behind it are removed from the program (the
/// check aya-log's macros make, done at the call site so the call goes too).
#[inline(always)]
fn debug_on() -> bool {
    level_enabled(Level::Debug)
}

/// Whether trace lines are on (see [`debug_on`]).
#[inline(always)]
fn trace_on() -> bool {
    level_enabled(Level::Trace)
}

/// A socket's `connect()`/`sendmsg()` reached frontend `fe` of `service_id` and was sent to
/// backend `be_addr`:`be_port` (id `backend_id`).
#[inline(always)]
pub fn sock_translated(
    fe: &L4Addr,
    be_addr: &[u8; 16],
    be_port: [u8; 2],
    service_id: u32,
    backend_id: u32,
) {
    if debug_on() {
        sock_translated_line(fe, be_addr, be_port, service_id, backend_id);
    }
}

#[inline(never)]
fn sock_translated_line(
    fe: &L4Addr,
    be_addr: &[u8; 16],
    be_port: [u8; 2],
    service_id: u32,
    backend_id: u32,
) {
    debug!(
        &(),
        "sock: frontend [{:i}]:{} proto {} -> backend [{:i}]:{} (service {}, backend {})",
        fe.addr,
        u16::from_be_bytes(fe.port),
        fe.proto,
        *be_addr,
        u16::from_be_bytes(be_port),
        service_id,
        backend_id
    );
}

/// A socket's `connect()`/`sendmsg()` to frontend `fe` was refused; `reason` is the
/// monitor's `EventReason` number (`no-endpoints` 1, `undefined-port` 2,
/// `no-local-endpoints` 3).
#[inline(always)]
pub fn sock_refused(fe: &L4Addr, reason: u8, service_id: u32) {
    if debug_on() {
        sock_refused_line(fe, reason, service_id);
    }
}

#[inline(never)]
fn sock_refused_line(fe: &L4Addr, reason: u8, service_id: u32) {
    debug!(
        &(),
        "sock: frontend [{:i}]:{} proto {} refused (reason {}, service {})",
        fe.addr,
        u16::from_be_bytes(fe.port),
        fe.proto,
        reason,
        service_id
    );
}

/// tc: a packet `key` started a flow to backend `be_addr`:`be_port` (conntrack entries
/// created), source-NATed when `snat`.
#[inline(always)]
pub fn flow_new(key: &CtKey, be_addr: &[u8; 16], be_port: [u8; 2], service_id: u32, snat: bool) {
    if debug_on() {
        flow_new_line(key, be_addr, be_port, service_id, snat);
    }
}

#[inline(never)]
fn flow_new_line(key: &CtKey, be_addr: &[u8; 16], be_port: [u8; 2], service_id: u32, snat: bool) {
    debug!(
        &(),
        "tc: flow [{:i}]:{} -> frontend [{:i}]:{} proto {} -> backend [{:i}]:{} (service {}, snat {})",
        key.saddr,
        u16::from_be_bytes(key.sport),
        key.daddr,
        u16::from_be_bytes(key.dport),
        key.proto,
        *be_addr,
        u16::from_be_bytes(be_port),
        service_id,
        snat as u8
    );
}

/// tc: a packet that would have started a flow was dropped; `counter` is the
/// `TcCounter` that counts it (no endpoints, SNAT ports exhausted, conntrack full, ...).
#[inline(always)]
pub fn flow_drop(counter: u32) {
    if debug_on() {
        flow_drop_line(counter);
    }
}

#[inline(never)]
fn flow_drop_line(counter: u32) {
    debug!(&(), "tc: new flow dropped (counter {})", counter);
}

/// tc: a packet `key` to a frontend without endpoints was answered with an ICMP / ICMPv6
/// port unreachable (`built`), or dropped when the answer could not be built.
#[inline(always)]
pub fn rejected(key: &CtKey, built: bool) {
    if debug_on() {
        rejected_line(key, built);
    }
}

#[inline(never)]
fn rejected_line(key: &CtKey, built: bool) {
    debug!(
        &(),
        "tc: [{:i}]:{} -> frontend [{:i}]:{} proto {} has no endpoints: {}",
        key.saddr,
        u16::from_be_bytes(key.sport),
        key.daddr,
        u16::from_be_bytes(key.dport),
        key.proto,
        if built {
            "rejected (ICMP port unreachable)"
        } else {
            "dropped"
        }
    );
}

/// A frontend lookup at the socket that found no frontend (trace: one line per connect()
/// to any address).
#[inline(always)]
pub fn sock_not_frontend(dst: &L4Addr) {
    if trace_on() {
        sock_not_frontend_line(dst);
    }
}

#[inline(never)]
fn sock_not_frontend_line(dst: &L4Addr) {
    trace!(
        &(),
        "sock: [{:i}]:{} proto {} is no frontend",
        dst.addr,
        u16::from_be_bytes(dst.port),
        dst.proto
    );
}
