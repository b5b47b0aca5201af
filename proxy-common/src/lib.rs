//! Map names, default sizes, keys and values shared by the eBPF data path (`proxy-ebpf`)
//! and the agent (`proxy-userspace`). This crate is the single definition of every layout.
//!
//! Conventions (all maps):
//! - Every key and value is `#[repr(C)]` with explicit padding fields, so the layout is the
//!   same for the BPF target and the host, and `bpftool map dump pinned` shows named fields
//!   (the object is built with BTF).
//! - Addresses are `[u8; 16]` in **network byte order** (the bytes of `struct in6_addr`).
//!   IPv4 addresses are stored IPv4-mapped (`::ffff:a.b.c.d`), so one map serves both
//!   families and an IPv4 VIP reached through a dual-stack IPv6 socket
//!   (`::ffff:10.96.0.10`) matches the IPv4 frontend. Byte arrays (rather than `u32` words)
//!   make `bpftool map dump` print `[..,255,255,10,96,0,10]`, readable at a glance.
//! - Ports are `[u8; 2]` in **network byte order** (`[0, 80]` is port 80), for the same
//!   reason.
//! - Protocols are IANA numbers: [`PROTO_TCP`], [`PROTO_UDP`].
//!
//! Service layout (after Cilium's `lb4_services_v2`/`lb4_backends`, see
//! `shared/notes/architecture.md`): [`FRONTENDS`] maps (VIP, port, protocol) to a
//! [`Frontend`] carrying a service id and a backend count; [`BACKEND_SLOTS`] maps
//! (service id, slot) for slot in `0..count` to a backend id and a copy of that backend (a
//! pick by slot reads one map); [`BACKENDS`] maps a backend id to its (address, port,
//! protocol). The agent writes a service in this order: backends, new slots,
//! then the frontend (count), and removes stale slots and backends last, so a reader never
//! sees a slot index without a backend behind it.

#![no_std]

mod addr;
pub mod bypass;
mod counters;
pub mod monitor;
pub mod nat;
mod select;
mod service;
mod sock;

pub use addr::*;
pub use counters::*;
pub use select::*;
pub use service::*;
pub use sock::*;

/// IANA protocol number of TCP.
pub const PROTO_TCP: u8 = 6;
/// IANA protocol number of UDP.
pub const PROTO_UDP: u8 = 17;

/// Name of the kernel log ring buffer (BPF_MAP_TYPE_RINGBUF, 128 KiB) of aya-log records
/// (`--kernel-log-level`; the name and layout are aya-log-ebpf's). Pinned with the other
/// maps, so the programs of every load (socket, egress, tc, bypassed pods', and those of
/// an earlier agent until their links are replaced) write into one ring the agent reads.
pub const KERNEL_LOGS: &str = "AYA_LOGS";
/// Name of aya-log-ebpf's global log level (`u8` in `.rodata`: 0 off, 1 error, 2 warn,
/// 3 info, 4 debug, 5 trace), set by the agent at every load of the object.
pub const KERNEL_LOG_LEVEL: &str = "AYA_LOG_LEVEL";

/// Every map the agent pins, in the order the data path depends on them.
pub const ALL_MAPS: [&str; 25] = [
    FRONTENDS,
    BACKEND_SLOTS,
    BACKENDS,
    MEMBERS,
    MAGLEV,
    REVNAT_SK,
    UDP_FLOWS,
    STALE_SOCKETS,
    RR_CURSORS,
    LC_COUNTS,
    SOCKETS,
    AFFINITY,
    CONFIG,
    COUNTERS,
    SERVICE_STATS,
    PACKET_OWNERS,
    SERVICE_PACKETS,
    BACKEND_STATS,
    STATS_CARRIED,
    SERVICE_NAMES,
    bypass::BYPASS_CONFIG,
    bypass::BYPASS_NETNS,
    SOCK_NAT,
    SOCK_NAT_OVERFLOW,
    SOCK_NAT_SPILLED,
];
