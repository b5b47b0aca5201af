//! The north-south data path's kernel side: the tcx programs `tc_ingress`/`tc_egress`
//! (`proxy-ebpf/src/tc.rs`) attached to interfaces through pinned links, the tc maps the
//! agent writes (`proxy_common::nat`), this network namespace's interfaces and routes, and
//! the collection of ended least-connections flows. What to attach where and what to write
//! is the reconciler's (`reconcile::node`).
//!
//! The XDP program `xdp_ingress` (`proxy-ebpf/src/xdp.rs`) goes in front of the tcx ingress
//! program of the external interfaces when `--xdp` asks for it (`XdpSetting`); the tcx
//! programs stay attached behind it and remain the complete path, so an interface without
//! XDP, or a moment without it (an agent restart replaces the XDP link), only costs speed.
//!
//! Links are pinned as `link_tc_ingress_<ifname>` and `link_tc_egress_<ifname>` in the pin
//! directory, the XDP link as `link_xdp_<mode>_<ifname>` (mode `native` or `generic`, so
//! `services` and the metrics read the mode from the pin's name), so they survive agent restarts and `ebpf-proxy cleanup` detaches them (it
//! removes every `link_*` pin). A restarted agent attaches its own links before it removes
//! the old pins; tcx runs both meanwhile, and the second program finds nothing to do on a
//! packet the first one translated.

mod attach;
mod interfaces;
mod kernel;
mod maps;
mod settings;

pub use crate::datapath::clock::monotonic_ns;
pub use attach::{XdpMode, install_tail_calls, program_clock, program_clock_or_warn, xdp_modes};
pub(crate) use attach::{attach_pinned, linked_interfaces, tc_interfaces};
pub(crate) use interfaces::{check_interfaces, if_index, interface_addresses, route_device};
pub use kernel::TcKernel;
pub(crate) use maps::{allowed_ranges, pinned_source_ranges};
pub use maps::{conntrack_entries, counters};
pub use settings::TcSettings;
pub(crate) use settings::{
    ConntrackSize, DEFAULT_CONNTRACK_MAX_PER_CORE, DEFAULT_CONNTRACK_MIN,
    DEFAULT_CT_TCP_ESTABLISHED, DEFAULT_CT_UDP_STREAM, MAX_CONNTRACK_FLOWS, MIN_CONNTRACK_FLOWS,
    XdpSetting, own_cgroup_memory_max,
};
// Used by the unit tests only.
#[cfg(test)]
pub(crate) use interfaces::interface_names;
#[cfg(test)]
pub(crate) use settings::tc_config;

/// Name of the ingress program in the object.
pub(crate) const INGRESS_PROGRAM: &str = "tc_ingress";

/// The program `tc_ingress` tail-calls to reject a packet to a frontend without endpoints.
pub(crate) const REJECT_PROGRAM: &str = "tc_reject";

/// Name of the egress program in the object.
pub(crate) const EGRESS_PROGRAM: &str = "tc_egress";

/// Name of the XDP program in the object.
pub(crate) const XDP_PROGRAM: &str = "xdp_ingress";

/// Name of the least-connections collection program in the object (never attached; run by
/// [`TcKernel::collect_lc_flows`] through `BPF_PROG_TEST_RUN`).
pub(crate) const LC_GC_PROGRAM: &str = "tc_lc_gc";

/// Name of the conntrack clock's probe program in the object (never attached; run by
/// [`program_clock`] through `BPF_PROG_TEST_RUN`).
pub(crate) const CLOCK_PROBE_PROGRAM: &str = "tc_clock_probe";

/// How often the agent looks for timed-out or evicted least-connections flows: half the
/// shortest conntrack timeout (unreplied UDP), within 1..=10 s.
pub(crate) fn lc_collect_interval(udp_timeout: std::time::Duration) -> std::time::Duration {
    (udp_timeout / 2).clamp(
        std::time::Duration::from_secs(1),
        std::time::Duration::from_secs(10),
    )
}

#[cfg(test)]
mod tests;
