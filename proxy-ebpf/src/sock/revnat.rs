//! The socket's reverse-NAT entries, shared by the hooks: written when `connect()` or
//! `sendmsg()` translates (`remember_connected`, `remember`), stopped when the socket
//! addresses the peer itself (`forget_direct`, `forget_connected_peer`), read by `recvmsg`
//! and `getpeername` (`connected_entry`), taken by `sock_release` (`take_slot`,
//! `take_overflow`). Connected sockets' entries live in their `SOCK_NAT` slot or in
//! `SOCK_NAT_OVERFLOW` (see `proxy_common::SOCK_NAT` for the claiming protocol),
//! unconnected UDP sends' in `REVNAT_SK`.

use aya_ebpf::bindings::{BPF_EXIST, BPF_NOEXIST};
use proxy_common::{
    Backend, Counter, REVNAT_F_CONNECTED, REVNAT_F_COUNTED, RevNatKey, RevNatValue, SOCK_NAT_BUSY,
    SPILLED_OVERFLOW, SockNat,
};

use crate::{
    lc,
    maps::{REVNAT_SK, SOCK_NAT, SOCK_NAT_OVERFLOW, SOCK_NAT_SPILLED, sock_nat_slot_mask},
    stats::count,
    types::Request,
};

/// Remembers that this socket reached `b` through the frontend of `req` of service
/// `service_id`. Not inlined: its 56 bytes of key and value stay out of the hook's frame,
/// which shares the 512-byte BPF stack with `select`.
#[inline(never)]
pub(super) fn remember(cookie: u64, b: &Backend, req: &Request, flags: u8, service_id: u32) {
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
pub(super) fn forget_direct(cookie: u64, addr: &[u8; 16], port: [u8; 2]) {
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
pub(super) fn remember_connected(
    cookie: u64,
    b: &Backend,
    req: &Request,
    flags: u8,
    service_id: u32,
) -> bool {
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
pub(super) fn forget_connected_peer(cookie: u64, addr: &[u8; 16], port: [u8; 2]) {
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
pub(super) fn hint(i: u32) -> bool {
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
pub(super) fn take_overflow(cookie: u64) -> Option<SockNat> {
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
pub(super) fn connected_entry(cookie: u64, addr: &[u8; 16], port: [u8; 2]) -> Option<RevNatValue> {
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
pub(super) fn take_slot(cookie: u64) -> Option<SockNat> {
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
