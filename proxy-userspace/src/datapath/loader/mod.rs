//! Loading the eBPF object, pinning its maps, and attaching the socket programs to a cgroup
//! through pinned links, so the data path keeps working while the agent is stopped and a new
//! agent takes it over without a gap.

mod attach;
mod cleanup;
mod errors;
mod load;
mod lock;
mod migrate;
mod pins;

use aya::EbpfLoader;
use proxy_common::ALL_MAPS;

pub(crate) use crate::mounts::cgroup2_root;
pub use crate::mounts::ensure_bpffs;
pub(crate) use attach::{
    attach_egress, attach_programs, detach_egress, egress_attached, load_and_attach,
    stale_sockets_listed,
};
pub use cleanup::{DRAIN_MAX, cleanup};
pub use load::{load_pinned, verify_programs};
pub(crate) use lock::lock_pin_dir;
pub use lock::wait_pin_dir_free;
pub use migrate::replace_incompatible_pins;
pub(crate) use pins::{check_cgroup, check_pin_dir_name};
pub use pins::{link_pin, pin_dir};

/// The eBPF object embedded at build time (see `build.rs`); empty when the binary was built
/// without `cargo xtask build`.
pub static OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ebpf-proxy.bpf.o"));

/// The cgroup `sock_addr` programs, by function name (section `cgroup/<name>`).
pub const PROGRAMS: [&str; 8] = [
    "connect4",
    "connect6",
    "sendmsg4",
    "sendmsg6",
    "recvmsg4",
    "recvmsg6",
    "getpeername4",
    "getpeername6",
];

/// The cgroup `skb` egress program (section `cgroup_skb/egress`): fails the sends of
/// connected UDP sockets whose endpoint left their service (`STALE_SOCKETS`). Attached only
/// while `STALE_SOCKETS` has entries ([`attach_egress`], [`detach_egress`]): a cgroup skb
/// program runs for every packet of every socket of the cgroup, which is the largest part
/// of what a short TCP connection would pay in BPF time, for sockets that never need it.
pub(crate) const EGRESS_PROGRAM: &str = "sock_egress";

/// The cgroup `sock` release program (section `cgroup/sock_release`): gives back the
/// least-connections count of closed sockets.
pub(crate) const RELEASE_PROGRAM: &str = "sock_release";

/// `--kernel-log-level`: which of the kernel programs' aya-log lines are written
/// (`proxy_common::KERNEL_LOG_LEVEL`, set at every load). The numbers are aya-log's levels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
#[repr(u8)]
pub enum KernelLogLevel {
    /// No line: the verifier removes every log call.
    #[default]
    Off = 0,
    /// Errors only (none today).
    Error = 1,
    /// Warnings and errors (none today).
    Warn = 2,
    /// Information (none today).
    Info = 3,
    /// One line per decision: translated or refused at the socket, tc flow started,
    /// dropped or rejected.
    Debug = 4,
    /// Debug, and every connect() to an address that is no frontend.
    Trace = 5,
}

impl KernelLogLevel {
    /// The flag's spelling.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            KernelLogLevel::Off => "off",
            KernelLogLevel::Error => "error",
            KernelLogLevel::Warn => "warn",
            KernelLogLevel::Info => "info",
            KernelLogLevel::Debug => "debug",
            KernelLogLevel::Trace => "trace",
        }
    }
}

/// The level every load of the object in this process gets (see [`set_kernel_log_level`]).
static KERNEL_LOG_LEVEL: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// The values [`new_loader`] points the global at (a loader borrows the value for its life).
static KERNEL_LOG_LEVELS: [u8; 6] = [0, 1, 2, 3, 4, 5];

/// Sets the kernel log level of every later load of the object by this process (the
/// agent sets it once, before the first load).
pub fn set_kernel_log_level(level: KernelLogLevel) {
    KERNEL_LOG_LEVEL.store(level as u8, std::sync::atomic::Ordering::Relaxed);
}

/// The kernel log level loads get now.
pub(crate) fn kernel_log_level() -> KernelLogLevel {
    match KERNEL_LOG_LEVEL.load(std::sync::atomic::Ordering::Relaxed) {
        1 => KernelLogLevel::Error,
        2 => KernelLogLevel::Warn,
        3 => KernelLogLevel::Info,
        4 => KernelLogLevel::Debug,
        5 => KernelLogLevel::Trace,
        _ => KernelLogLevel::Off,
    }
}

/// A loader for the embedded object with the kernel log level set
/// ([`set_kernel_log_level`]). Every load of the object goes through here: the global's
/// default in the object is aya-log-ebpf's "everything", so a load that forgot it would
/// run the programs with every log line.
pub(crate) fn new_loader() -> EbpfLoader<'static> {
    let mut loader = EbpfLoader::new();
    // The object has no CO-RE relocations, so the kernel's BTF (about 20 ms and 18 MiB to
    // parse, in the middle of a start-up) is not needed.
    loader.btf(None);
    let level = kernel_log_level() as usize;
    loader.override_global(
        proxy_common::KERNEL_LOG_LEVEL,
        &KERNEL_LOG_LEVELS[level],
        true,
    );
    loader
}

/// Map sizes (`max_entries`) used when the maps are created. Maps adopted from an earlier
/// run keep the size they were created with.
#[derive(Clone, Copy, Debug)]
pub struct MapSizes {
    /// `FRONTENDS` (and `SERVICE_NAMES`).
    pub frontends: u32,
    /// `BACKEND_SLOTS`.
    pub slots: u32,
    /// `BACKENDS`.
    pub backends: u32,
    /// `REVNAT_SK`, `UDP_FLOWS` and `SOCKETS`; a quarter of it for `STALE_SOCKETS` and
    /// `AFFINITY`.
    pub sockets: u32,
    /// Flows of the tc path's conntrack (`--conntrack-min`, `--conntrack-max-per-core`):
    /// `TC_CONNTRACK` gets twice as many entries (one per direction; a source-NATed flow
    /// takes a third), `TC_LC_FLOWS` as many.
    pub conntrack_flows: u32,
}

impl MapSizes {
    /// `max_entries` of `TC_CONNTRACK` for [`MapSizes::conntrack_flows`].
    pub(crate) fn conntrack_entries(&self) -> u32 {
        self.conntrack_flows.saturating_mul(2).max(2)
    }
}

/// A map type number of the object as aya's [`aya::maps::MapType`]; `None` for a number
/// this build does not know (`check` names the object's map types with it too).
pub(crate) fn map_type(t: u32) -> Option<aya::maps::MapType> {
    use aya_obj::generated::bpf_map_type;
    if t >= bpf_map_type::__MAX_BPF_MAP_TYPE as u32 {
        return None;
    }
    // SAFETY: `bpf_map_type` is `repr(u32)` with every value from 0 to
    // `__MAX_BPF_MAP_TYPE` defined (the kernel numbers them densely), checked above.
    let t: bpf_map_type = unsafe { std::mem::transmute::<u32, bpf_map_type>(t) };
    aya::maps::MapType::try_from(t).ok()
}

/// Every map the programs share through the pin directory: the socket path's, the tc
/// path's, the monitor's and the kernel log ring (`AYA_LOGS`). Every load of the object
/// pins exactly these, so programs loaded later (the egress program attached on demand,
/// the tc and bypassed pods' programs) see the same maps as the first load. The log ring is
/// pinned rather than created per load for the same reason: with one ring per load the
/// agent would need a reader per load, and the lines of programs loaded by an earlier
/// agent (attached until the new links replace theirs) would go nowhere.
pub(crate) fn pinned_maps() -> impl Iterator<Item = &'static str> {
    ALL_MAPS
        .iter()
        .chain(proxy_common::nat::TC_MAPS.iter())
        .chain(proxy_common::monitor::MONITOR_MAPS.iter())
        .chain(std::iter::once(&proxy_common::KERNEL_LOGS))
        .copied()
}

/// Arrays indexed by a fixed list of this build (the counters, the overflow hints), whose
/// size is the list's.
pub(crate) const FIXED_INDEX_MAPS: [&str; 3] = [
    proxy_common::COUNTERS,
    proxy_common::nat::TC_COUNTERS,
    proxy_common::SOCK_NAT_SPILLED,
];
