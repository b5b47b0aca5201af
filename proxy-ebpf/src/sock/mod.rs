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
//!
//! Modules: [`hook`] (what every hook reads and answers) and [`revnat`] (the reverse-NAT
//! entries) are shared; the entry points, one module per syscall, import those two and
//! never each other: [`connect`], [`sendmsg`], [`reverse`] (`recvmsg` and `getpeername`),
//! [`release`].

mod connect;
mod hook;
mod release;
mod reverse;
mod revnat;
mod sendmsg;
