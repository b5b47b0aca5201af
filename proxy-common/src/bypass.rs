//! Layouts of the socket-level translation bypass: workloads whose sockets the socket
//! programs leave alone, and whose Service traffic is translated per packet instead, by the
//! tcx programs `pod_ingress`/`pod_egress` on the node side of their interfaces.
//!
//! Why: a workload that must see the ClusterIP on the wire (a sidecar proxy that redirects
//! outbound connections and reads their original destination), or whose sockets the node's
//! cgroup hooks never see (an application in a VM), cannot be served at `connect()`.
//!
//! The kernel identity of a workload is its network namespace cookie
//! (`bpf_get_netns_cookie`, the same value as `getsockopt(SO_NETNS_COOKIE)` in that
//! namespace): every socket of a pod shares it, whichever container or cgroup opened it,
//! and the node's own namespace has one too (`--socket-lb-scope host-only` compares with
//! it, as Cilium's `socketLB.hostNamespaceOnly`).

/// Name of the bypass configuration map: index 0 -> [`BypassConfig`]
/// (BPF_MAP_TYPE_ARRAY, one entry).
pub const BYPASS_CONFIG: &str = "BYPASS_CONFIG";
/// Name of the bypassed-namespace map: network namespace cookie `u64` -> `u32`
/// ([`BYPASS_POD`]) (BPF_MAP_TYPE_HASH, [`MAX_BYPASS_NETNS`] entries).
pub const BYPASS_NETNS: &str = "BYPASS_NETNS";

/// `max_entries` of [`BYPASS_NETNS`]: pods of one node opting out (kubelet's default is at
/// most 110 pods per node).
pub const MAX_BYPASS_NETNS: u32 = 4096;

/// Value of [`BYPASS_NETNS`]: the namespace is a pod opted out of socket-level
/// translation.
pub const BYPASS_POD: u32 = 1;

/// Bypass configuration, index 0 of [`BYPASS_CONFIG`]. 16 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct BypassConfig {
    /// `BYPASS_CFG_*` bits; 0: nothing is bypassed and the socket programs skip the check
    /// after one array lookup.
    pub flags: u32,
    /// Reserved; always 0.
    pub _pad: u32,
    /// Network namespace cookie of the node's own namespace (the agent's), used with
    /// [`BYPASS_CFG_HOST_ONLY`].
    pub host_netns: u64,
}

/// [`BypassConfig::flags`]: some namespace is listed in [`BYPASS_NETNS`]; the socket
/// programs look the socket's namespace up there.
pub const BYPASS_CFG_PODS: u32 = 1 << 0;
/// [`BypassConfig::flags`]: `--socket-lb-scope host-only`: only sockets of the node's own
/// namespace ([`BypassConfig::host_netns`]) are translated at the socket.
pub const BYPASS_CFG_HOST_ONLY: u32 = 1 << 1;

#[cfg(feature = "user")]
mod user {
    // SAFETY: #[repr(C)] plain old data without padding holes.
    unsafe impl aya::Pod for super::BypassConfig {}
}
