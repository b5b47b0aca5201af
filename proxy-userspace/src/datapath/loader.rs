//! Loading the eBPF object, pinning its maps, and attaching the socket programs to a cgroup
//! through pinned links, so the data path keeps working while the agent is stopped and a new
//! agent takes it over without a gap.

use std::{
    fs::{self, File},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf, EbpfError, EbpfLoader,
    maps::Map,
    maps::MapError,
    programs::{
        CgroupAttachMode, CgroupSkb, CgroupSkbAttachType, CgroupSock, CgroupSockAddr, Program,
        ProgramError, links::FdLink, links::PinnedLink,
    },
};
use proxy_common::{
    AFFINITY, ALL_MAPS, BACKEND_SLOTS, BACKEND_STATS, BACKENDS, FRONTENDS, LC_COUNTS, MEMBERS,
    REVNAT_SK, RR_CURSORS, SERVICE_NAMES, SERVICE_STATS, SOCK_NAT, SOCK_NAT_OVERFLOW,
    SOCK_NAT_SLOT_MASK, SOCK_NAT_SPILLED, SOCKETS, SPILLED_LEGACY, SPILLED_OVERFLOW, STALE_SOCKETS,
    STATS_CARRIED, UDP_FLOWS,
    nat::{CONNTRACK, LC_FLOWS},
    sock_nat_slots,
};

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
pub const EGRESS_PROGRAM: &str = "sock_egress";

/// The cgroup `sock` release program (section `cgroup/sock_release`): gives back the
/// least-connections count of closed sockets.
pub const RELEASE_PROGRAM: &str = "sock_release";

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
    pub fn as_str(self) -> &'static str {
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
pub fn kernel_log_level() -> KernelLogLevel {
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
pub fn new_loader() -> EbpfLoader<'static> {
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
    pub fn conntrack_entries(&self) -> u32 {
        self.conntrack_flows.saturating_mul(2).max(2)
    }
}

/// Where the pins live: `<bpffs>/<pin_dir>` (see [`check_pin_dir_name`]).
pub fn pin_dir(bpffs: &Path, pin_dir: &str) -> PathBuf {
    bpffs.join(pin_dir)
}

/// Checks that a `--pin-dir` is a plain name (letters, digits, `-`, `_`; bpffs rejects dots),
/// so no path outside the BPF file system can be addressed through it.
pub fn check_pin_dir_name(pin_dir: &str) -> Result<()> {
    if pin_dir.is_empty()
        || !pin_dir
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        bail!(
            "--pin-dir {pin_dir:?} must be a plain name of letters, digits, '-' and '_' (it is created under --bpffs)"
        );
    }
    Ok(())
}

const BPF_FS_MAGIC: i64 = 0xcafe4a11;
const CGROUP2_SUPER_MAGIC: i64 = 0x63677270;

fn fs_magic(path: &Path) -> std::io::Result<i64> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(std::io::Error::other)?;
    // SAFETY: statfs(2) into a zeroed struct we own.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.f_type as i64)
}

/// True when `path` is on a BPF file system.
pub fn is_on_bpffs(path: &Path) -> bool {
    fs_magic(path).is_ok_and(|m| m == BPF_FS_MAGIC)
}

/// Checks that `cgroup` is a cgroup v2 directory, with a remedy in the error.
pub fn check_cgroup(cgroup: &Path) -> Result<()> {
    let hint = || match cgroup2_root() {
        Ok(root) => format!(
            "cgroup v2 is mounted at {}; pass it or a directory below it",
            root.display()
        ),
        Err(e) => format!("{e:#}"),
    };
    match fs_magic(cgroup) {
        Ok(CGROUP2_SUPER_MAGIC) if cgroup.is_dir() => Ok(()),
        Ok(_) => bail!(
            "--cgroup-path {} is not a cgroup v2 directory ({})",
            cgroup.display(),
            hint()
        ),
        Err(e) => bail!("--cgroup-path {}: {e} ({})", cgroup.display(), hint()),
    }
}

/// An exclusive lock on a pin directory, held while the agent runs, so two agents never
/// write the same maps (each would undo the other's entries). Released on drop or exit.
#[derive(Debug)]
pub struct PinDirLock(#[allow(dead_code)] File);

/// Creates `dir` if needed and locks it (`flock(LOCK_EX | LOCK_NB)`).
///
/// Errors: another process holds the lock (another agent uses this pin directory).
pub fn lock_pin_dir(dir: &Path) -> Result<PinDirLock> {
    fs::create_dir_all(dir).with_context(|| format!("create pin directory {}", dir.display()))?;
    let f = File::open(dir).with_context(|| format!("open pin directory {}", dir.display()))?;
    use std::os::fd::AsRawFd;
    // SAFETY: flock(2) on a descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            bail!(
                "another ebpf-proxy agent is using the pin directory {}; stop it or choose another --pin-dir",
                dir.display()
            );
        }
        return Err(e).with_context(|| format!("lock pin directory {}", dir.display()));
    }
    Ok(PinDirLock(f))
}

/// Waits (at most `wait`) until no agent holds the lock of the pin directory `dir`, then
/// holds it, so that a cleanup never races an agent that is still stopping (or running,
/// which would pin again what the cleanup removes). `None` when `dir` does not exist.
///
/// Errors: an agent still holds the lock after `wait`; the directory cannot be opened.
pub fn wait_pin_dir_free(dir: &Path, wait: std::time::Duration) -> Result<Option<PinDirLock>> {
    let f = match File::open(dir) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("open pin directory {}", dir.display())),
    };
    use std::os::fd::AsRawFd;
    let deadline = std::time::Instant::now() + wait;
    loop {
        // SAFETY: flock(2) on a descriptor we own.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(Some(PinDirLock(f)));
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(e).with_context(|| format!("lock pin directory {}", dir.display()));
        }
        if std::time::Instant::now() >= deadline {
            bail!(
                "an ebpf-proxy agent still runs on the pin directory {} (it holds its lock; waited {} s): stop it first (delete its DaemonSet, or SIGTERM), or it would pin again what the cleanup removes",
                dir.display(),
                wait.as_secs()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
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

/// Path of the pinned link of program `prog`.
pub fn link_pin(dir: &Path, prog: &str) -> PathBuf {
    dir.join(format!("link_{prog}"))
}

pub use crate::mounts::{cgroup2_root, ensure_bpffs};

/// The remedy for a failure that is most likely missing privileges.
const REMEDY_PRIVILEGES: &str = "run as root, or with CAP_BPF, CAP_NET_ADMIN and CAP_SYS_ADMIN (and AppArmor/SELinux allowing bpf)";

/// At most this many lines of the verifier log end up in an error (the reason is at the end).
const VERIFIER_EXCERPT_LINES: usize = 12;

/// The last lines of a verifier log, where the kernel says why it rejected the program.
pub fn verifier_excerpt(log: &str) -> String {
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = lines.len().saturating_sub(VERIFIER_EXCERPT_LINES);
    let mut out = String::new();
    if start > 0 {
        out.push_str(&format!("  ... ({start} earlier lines)\n"));
    }
    for l in &lines[start..] {
        out.push_str("  ");
        out.push_str(l);
        out.push('\n');
    }
    out
}

/// True when an error chain ends in EPERM or EACCES.
fn denied(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && matches!(io.raw_os_error(), Some(libc::EPERM) | Some(libc::EACCES))
        {
            return true;
        }
        cur = err.source();
    }
    false
}

/// Every map the programs share through the pin directory: the socket path's, the tc
/// path's, the monitor's and the kernel log ring (`AYA_LOGS`). Every load of the object
/// pins exactly these, so programs loaded later (the egress program attached on demand,
/// the tc and bypassed pods' programs) see the same maps as the first load. The log ring is
/// pinned rather than created per load for the same reason: with one ring per load the
/// agent would need a reader per load, and the lines of programs loaded by an earlier
/// agent (attached until the new links replace theirs) would go nowhere.
pub fn pinned_maps() -> impl Iterator<Item = &'static str> {
    ALL_MAPS
        .iter()
        .chain(proxy_common::nat::TC_MAPS.iter())
        .chain(proxy_common::monitor::MONITOR_MAPS.iter())
        .chain(std::iter::once(&proxy_common::KERNEL_LOGS))
        .copied()
}

/// Arrays indexed by a fixed list of this build (the counters, the overflow hints), whose
/// size is the list's.
pub const FIXED_INDEX_MAPS: [&str; 3] = [
    proxy_common::COUNTERS,
    proxy_common::nat::TC_COUNTERS,
    proxy_common::SOCK_NAT_SPILLED,
];

/// Removes the pins of maps whose layout differs from this binary's object: map type, key
/// size, value size or creation flags (an agent upgrade across a layout change). The load
/// that follows creates them anew; adopting them instead would make the programs fail
/// verification or misread their values. `max_entries` is not a layout: a map keeps the size
/// it was created with (see [`MapSizes`]), except the counter arrays indexed by a fixed list
/// ([`FIXED_INDEX_MAPS`]), replaced when smaller than this build's (a newer build counts
/// more things; its new counters would otherwise never count). Returns each replaced map's
/// name and why. A pin that cannot be read is left for the load to report.
pub fn replace_incompatible_pins(dir: &Path) -> Result<Vec<(&'static str, String)>> {
    let obj = aya_obj::Object::parse(OBJECT).context("load: parse the embedded object")?;
    let mut replaced = Vec::new();
    for name in pinned_maps() {
        let path = dir.join(name);
        let (Some(want), Ok(have)) = (obj.maps.get(name), aya::maps::MapInfo::from_pin(&path))
        else {
            continue;
        };
        // Map types by name (`PerCpuHash`); a pinned type this build does not know is only
        // known to differ.
        let want_type = want.map_type();
        let type_diff = match have.map_type() {
            Ok(t) if t as u32 == want_type => None,
            Ok(t) => Some(format!("{t:?}")),
            Err(_) => Some("(unknown to this build)".to_string()),
        }
        .map(|pinned| {
            let now = match map_type(want_type) {
                Some(t) => format!("{t:?}"),
                None => want_type.to_string(),
            };
            format!("type {pinned} pinned, {now} now")
        });
        let diffs: Vec<String> = type_diff
            .into_iter()
            .chain(
                [
                    ("key size", have.key_size(), want.key_size()),
                    ("value size", have.value_size(), want.value_size()),
                    ("flags", have.map_flags(), want.map_flags()),
                ]
                .iter()
                .filter(|(_, h, w)| h != w)
                .map(|(what, h, w)| format!("{what} {h} pinned, {w} now")),
            )
            .chain(
                (FIXED_INDEX_MAPS.contains(&name) && have.max_entries() < want.max_entries()).then(
                    || {
                        format!(
                            "{} entries pinned, {} now",
                            have.max_entries(),
                            want.max_entries()
                        )
                    },
                ),
            )
            .collect();
        if !diffs.is_empty() {
            fs::remove_file(&path)
                .with_context(|| format!("pin: remove incompatible {}", path.display()))?;
            replaced.push((name, diffs.join(", ")));
        }
    }
    Ok(replaced)
}

/// The error of the object load (maps created, adopted and pinned), naming the step.
fn load_error(e: EbpfError, pinned: bool) -> anyhow::Error {
    // The whole chain: the map's name and the errno are in the sources.
    let mut text = String::new();
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = cur {
        text.push_str(&format!("{err}: "));
        cur = err.source();
    }
    let remedy = if denied(&e) {
        REMEDY_PRIVILEGES
    } else if text.contains(proxy_common::nat::CONNTRACK)
        || text.contains(proxy_common::nat::LC_FLOWS)
    {
        "the north-south conntrack is too large for this kernel or its memory: lower --conntrack-min / --conntrack-max-per-core"
    } else if text.contains("os error 7)") || text.contains("os error 12)") {
        // E2BIG, ENOMEM: a size the kernel or the memory cannot hold.
        "a map is too large for this kernel or its memory: lower the size flag that sets it (--max-sockets: REVNAT_SK, UDP_FLOWS, SOCKETS, SOCK_NAT, SOCK_NAT_OVERFLOW, STALE_SOCKETS, AFFINITY; --max-frontends, --max-backends, --max-backend-slots)"
    } else if pinned {
        "if the map layout changed since the maps were pinned, run `ebpf-proxy cleanup` first"
    } else {
        "run `ebpf-proxy check`"
    };
    let step = match &e {
        EbpfError::MapError(MapError::PinError { .. }) => "pin",
        _ => "load",
    };
    anyhow::Error::new(e).context(format!(
        "{step}: creating{} the maps failed (remedy: {remedy})",
        if pinned { ", adopting or pinning" } else { "" }
    ))
}

/// The error of loading program `prog` into the kernel: "verify" with the verifier log
/// excerpt when the verifier rejected it, "load" otherwise.
fn program_load_error(prog: &str, e: ProgramError) -> anyhow::Error {
    match e {
        ProgramError::LoadError {
            io_error,
            verifier_log,
        } if !denied(&io_error) => {
            let log = verifier_log.to_string();
            anyhow::anyhow!(
                "verify: the kernel rejected program {prog} ({io_error}); end of the verifier log:\n{}\
                 (remedy: this kernel lacks something the program needs: run `ebpf-proxy check`; Linux >= 5.18 is required)",
                verifier_excerpt(&log)
            )
        }
        e if denied(&e) => anyhow::Error::new(e).context(format!(
            "load: program {prog} (remedy: {REMEDY_PRIVILEGES})"
        )),
        e => anyhow::Error::new(e).context(format!(
            "load: program {prog} (remedy: run `ebpf-proxy check`)"
        )),
    }
}

/// The values [`set_sock_nat_slots`] points the global at: `2^k - 1` at index `k`.
static SOCK_NAT_SLOT_MASKS: [u64; 33] = {
    let mut m = [0u64; 33];
    let mut k = 0;
    while k < 33 {
        m[k] = (1u64 << k) - 1;
        k += 1;
    }
    m
};

/// Sets the size of `SOCK_NAT` (a power of two, see [`proxy_common::sock_nat_slots`])
/// and the programs' slot mask to match; `slots` that is no power of two gets the mask of
/// the largest power of two below it, so every index stays inside the map.
fn set_sock_nat_slots(loader: &mut EbpfLoader<'_>, slots: u32) {
    let slots = slots.max(1);
    let k = 31 - slots.leading_zeros() as usize;
    loader.map_max_entries(SOCK_NAT, slots).override_global(
        SOCK_NAT_SLOT_MASK,
        &SOCK_NAT_SLOT_MASKS[k],
        true,
    );
}

/// A loader for the embedded object with the given map sizes.
fn object_loader(sizes: MapSizes) -> EbpfLoader<'static> {
    let mut loader = new_loader();
    set_sock_nat_slots(&mut loader, sock_nat_slots(sizes.sockets));
    loader
        .map_max_entries(SOCK_NAT_OVERFLOW, (sizes.sockets / 4).max(1))
        .map_max_entries(FRONTENDS, sizes.frontends)
        .map_max_entries(SERVICE_NAMES, sizes.frontends)
        .map_max_entries(BACKEND_SLOTS, sizes.slots)
        .map_max_entries(BACKENDS, sizes.backends)
        .map_max_entries(REVNAT_SK, sizes.sockets)
        .map_max_entries(UDP_FLOWS, sizes.sockets)
        .map_max_entries(SOCKETS, sizes.sockets)
        // Only some sockets need these (stale UDP sockets, clients of affinity Services): a
        // quarter of --max-sockets, LRU beyond that.
        .map_max_entries(STALE_SOCKETS, (sizes.sockets / 4).max(1))
        .map_max_entries(AFFINITY, (sizes.sockets / 4).max(1))
        .map_max_entries(MEMBERS, sizes.slots)
        .map_max_entries(LC_COUNTS, sizes.backends)
        .map_max_entries(RR_CURSORS, sizes.frontends)
        .map_max_entries(SERVICE_STATS, sizes.frontends)
        // The (service, backend) pairs in use are at most the slots; the counts carried
        // from pairs no longer in use, one per bound service or backend. Neither map is
        // preallocated, but their buckets are allocated at creation: 16 bytes each, their
        // number the size rounded up to a power of two (4 MiB each at the default sizes).
        .map_max_entries(BACKEND_STATS, sizes.slots)
        .map_max_entries(
            STATS_CARRIED,
            sizes.frontends.saturating_add(sizes.backends),
        )
        .map_max_entries(CONNTRACK, sizes.conntrack_entries())
        .map_max_entries(LC_FLOWS, sizes.conntrack_flows.max(1));
    loader
}

/// Loads every program of the embedded object into the kernel, with small maps that are not
/// pinned, attaches nothing, and unloads everything again: the preflight of `check` for the
/// attach types (each program of a cgroup `sock_addr` section is loaded with the expected
/// attach type its section names, e.g. `connect4`) and the verifier. Returns the names of
/// the programs, with the program type when it is not cgroup `sock_addr`.
///
/// Errors name the step (load, verify) as [`load_and_attach`] does.
pub fn verify_programs() -> Result<Vec<String>> {
    if OBJECT.is_empty() {
        bail!("this binary was built without the eBPF object; build it with `cargo xtask build`");
    }
    let small = MapSizes {
        frontends: 64,
        slots: 64,
        backends: 64,
        sockets: 64,
        conntrack_flows: 64,
    };
    let mut ebpf = object_loader(small)
        .load(OBJECT)
        .map_err(|e| load_error(e, false))?;
    let mut names: Vec<String> = ebpf.programs().map(|(n, _)| n.to_string()).collect();
    names.sort();
    let mut loaded = Vec::new();
    for name in names {
        let Some(program) = ebpf.program_mut(&name) else {
            continue;
        };
        match program {
            Program::CgroupSockAddr(p) => {
                p.load().map_err(|e| program_load_error(&name, e))?;
                loaded.push(name);
            }
            Program::SchedClassifier(p) => {
                p.load().map_err(|e| program_load_error(&name, e))?;
                loaded.push(format!("{name} (sched_cls)"));
            }
            Program::CgroupSkb(p) => {
                p.load().map_err(|e| program_load_error(&name, e))?;
                loaded.push(format!("{name} (cgroup_skb)"));
            }
            Program::CgroupSock(p) => {
                p.load().map_err(|e| program_load_error(&name, e))?;
                loaded.push(format!("{name} (cgroup_sock)"));
            }
            Program::Xdp(p) => {
                p.load().map_err(|e| program_load_error(&name, e))?;
                loaded.push(format!("{name} (xdp)"));
            }
            other => {
                let t = other.prog_type();
                loaded.push(format!("{name} ({t:?}, not loaded by the check)"));
            }
        }
    }
    Ok(loaded)
}

/// Loads the embedded object with its maps pinned under `dir`: maps pinned by an earlier run
/// are adopted (those whose layout differs from this build's are created anew, with a
/// warning), the others created with `sizes` and pinned. No program is loaded into the
/// kernel or attached; the caller picks them from the returned object.
///
/// Errors name the step (load, pin) and a remedy.
pub fn load_pinned(dir: &Path, sizes: MapSizes) -> Result<Ebpf> {
    if OBJECT.is_empty() {
        bail!("this binary was built without the eBPF object; build it with `cargo xtask build`");
    }
    fs::create_dir_all(dir)
        .with_context(|| format!("pin: create pin directory {}", dir.display()))?;
    let pins: Vec<(&str, PathBuf)> = pinned_maps().map(|m| (m, dir.join(m))).collect();
    // An earlier version's slots hold backend ids only: their pin is set aside (not
    // removed) and carried over into the new layout after the load, before any program is
    // attached, so every Service keeps its backends until the first sync. A start that
    // fails or dies before the carry-over finds the set-aside pin again.
    let ids_pin = dir.join(SLOT_IDS_PIN);
    if id_only_slots(&dir.join(BACKEND_SLOTS)) {
        fs::rename(dir.join(BACKEND_SLOTS), &ids_pin)
            .with_context(|| format!("pin: set aside {}", ids_pin.display()))?;
    }
    for (name, why) in replace_incompatible_pins(dir)? {
        tracing::warn!(map = name, %why, "a pinned map has another layout than this version's (pinned by another version, older or newer): it is created anew and its entries are lost; the old programs keep the old map until their links are replaced");
    }
    // The pins of a version without slots: its connect programs may still write connected
    // entries to `REVNAT_SK` until their links are replaced.
    let without_slots = !dir.join(SOCK_NAT).exists() && dir.join(REVNAT_SK).exists();
    // Hints created anew next to an adopted overflow map start from its entries.
    let seed_overflow =
        !dir.join(SOCK_NAT_SPILLED).exists() && dir.join(SOCK_NAT_OVERFLOW).exists();
    let mut loader = object_loader(sizes);
    // Carried counts created next to adopted maps have room for every id those can bind.
    if !dir.join(STATS_CARRIED).exists()
        && let (Ok(names), Ok(backends)) = (
            aya::maps::MapInfo::from_pin(dir.join(SERVICE_NAMES)),
            aya::maps::MapInfo::from_pin(dir.join(BACKENDS)),
        )
    {
        loader.map_max_entries(
            STATS_CARRIED,
            names.max_entries().saturating_add(backends.max_entries()),
        );
    }
    // Slots carried over keep the earlier map's size, as an adopted map would.
    if !dir.join(BACKEND_SLOTS).exists()
        && let Ok(info) = aya::maps::MapInfo::from_pin(&ids_pin)
    {
        loader.map_max_entries(BACKEND_SLOTS, info.max_entries());
    }
    // An adopted `SOCK_NAT` keeps its size: the programs' mask must follow it.
    if let Ok(info) = aya::maps::MapInfo::from_pin(dir.join(SOCK_NAT)) {
        set_sock_nat_slots(&mut loader, info.max_entries());
    }
    for (name, path) in &pins {
        loader.map_pin_path(name, path.as_path());
    }
    let ebpf = loader.load(OBJECT).map_err(|e| load_error(e, true))?;
    if ids_pin.exists() {
        match carry_slots(dir, &ids_pin) {
            Ok(n) => {
                tracing::info!(
                    slots = n,
                    "carried the earlier version's BACKEND_SLOTS over"
                );
                fs::remove_file(&ids_pin)
                    .with_context(|| format!("pin: remove {}", ids_pin.display()))?;
            }
            // Kept for the next start; the first sync writes the slots meanwhile.
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), pin = %ids_pin.display(), "could not carry the earlier version's BACKEND_SLOTS over: Services without slots refuse new connections until the first sync")
            }
        }
    }
    if without_slots || legacy_entries(dir)? > 0 {
        spilled_map(dir)?
            .set(SPILLED_LEGACY, 1, 0)
            .context("write SOCK_NAT_SPILLED")?;
    }
    if seed_overflow {
        let mut n: u32 = 0;
        super::batch::for_each(
            open_pinned(dir, SOCK_NAT_OVERFLOW)?.fd(),
            |_: &u64, _: &proxy_common::SockNat| n = n.saturating_add(1),
        )
        .context("read SOCK_NAT_OVERFLOW")?;
        spilled_map(dir)?
            .set(SPILLED_OVERFLOW, n, 0)
            .context("write SOCK_NAT_SPILLED")?;
    }
    Ok(ebpf)
}

/// Where an earlier version's `BACKEND_SLOTS` (backend ids only) is kept, next to the other
/// pins, until its slots are carried over into this version's map (bpffs refuses dots in
/// names).
const SLOT_IDS_PIN: &str = "BACKEND_SLOTS_IDS";

/// Whether the map pinned at `pin` has the key and value sizes of an earlier version's
/// `BACKEND_SLOTS` (8 and 4 bytes: a backend id per slot).
fn id_only_slots(pin: &Path) -> bool {
    aya::maps::MapInfo::from_pin(pin).is_ok_and(|i| i.key_size() == 8 && i.value_size() == 4)
}

/// Writes the slots of the earlier version's map pinned at `ids_pin` into `BACKEND_SLOTS`,
/// each with its backend from the pinned `BACKENDS` (slots naming an unknown backend are
/// left out: that version's programs could not use them either). Returns how many.
///
/// Errors: either map has an unexpected layout, or a read or write failed (a full map:
/// the new map has the earlier one's size, so only when `BACKENDS` changed meanwhile).
fn carry_slots(dir: &Path, ids_pin: &Path) -> Result<usize> {
    use proxy_common::{Backend, BackendSlot, BackendSlotKey};
    let backends_pin = dir.join(BACKENDS);
    let b = aya::maps::MapInfo::from_pin(&backends_pin).context("BACKENDS")?;
    anyhow::ensure!(
        id_only_slots(ids_pin) && b.key_size() == 4 && b.value_size() == 20,
        "unexpected map layout"
    );
    let backends: std::collections::HashMap<u32, Backend> =
        super::batch::read_all(open_pinned(dir, BACKENDS)?.fd())
            .context("read BACKENDS")?
            .into_iter()
            .collect();
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    let ids = aya::maps::MapData::from_pin(ids_pin)
        .with_context(|| format!("pin: open {}", ids_pin.display()))?;
    super::batch::for_each(ids.fd(), |k: &BackendSlotKey, id: &u32| {
        if let Some(b) = backends.get(id) {
            keys.push(*k);
            values.push(BackendSlot {
                backend_id: *id,
                backend: *b,
            });
        }
    })
    .context("read the earlier BACKEND_SLOTS")?;
    super::batch::write_all(open_pinned(dir, BACKEND_SLOTS)?.fd(), &keys, &values).map_err(
        |(written, e)| {
            anyhow::anyhow!("write BACKEND_SLOTS: {e} after {written} of {}", keys.len())
        },
    )?;
    Ok(keys.len())
}

/// The connected sockets' entries in `REVNAT_SK`: what a version without slots wrote.
fn legacy_entries(dir: &Path) -> Result<u32> {
    let mut n: u32 = 0;
    super::batch::for_each(
        open_pinned(dir, REVNAT_SK)?.fd(),
        |_: &proxy_common::RevNatKey, v: &proxy_common::RevNatValue| {
            if v.flags & proxy_common::REVNAT_F_CONNECTED != 0 {
                n = n.saturating_add(1);
            }
        },
    )
    .context("read REVNAT_SK")?;
    Ok(n)
}

fn open_pinned(dir: &Path, name: &str) -> Result<aya::maps::MapData> {
    let path = dir.join(name);
    aya::maps::MapData::from_pin(&path).with_context(|| format!("pin: open {}", path.display()))
}

fn spilled_map(dir: &Path) -> Result<aya::maps::Array<aya::maps::MapData, u32>> {
    aya::maps::Array::try_from(aya::maps::Map::Array(open_pinned(dir, SOCK_NAT_SPILLED)?))
        .context("open SOCK_NAT_SPILLED")
}

/// Whether `SPILLED_LEGACY` is set (see [`proxy_common::SOCK_NAT_SPILLED`]).
fn legacy_hint(dir: &Path) -> bool {
    spilled_map(dir)
        .and_then(|m| m.get(&SPILLED_LEGACY, 0).context("read SOCK_NAT_SPILLED"))
        .is_ok_and(|n| n != 0)
}

/// Clears `SPILLED_LEGACY` when `REVNAT_SK` holds no connected socket's entry any more,
/// once the programs of a version without slots no longer run (these programs never add
/// one, so the answer cannot go stale). Otherwise it stays set until a later start.
/// Reads `REVNAT_SK` once (a batched pass; tens of milliseconds at the default size).
fn clear_legacy_hint(dir: &Path) -> Result<()> {
    let n = legacy_entries(dir)?;
    if n > 0 {
        tracing::info!(
            sockets = n,
            "connections translated by an earlier version keep their reverse-NAT entries in REVNAT_SK until they close"
        );
        return Ok(());
    }
    spilled_map(dir)?
        .set(SPILLED_LEGACY, 0, 0)
        .context("write SOCK_NAT_SPILLED")?;
    Ok(())
}

/// Loads the object with its maps pinned under `dir` (adopting maps pinned by an earlier
/// run, see [`load_pinned`]), then attaches every program to `cgroup` and pins the links.
/// Links of an earlier run are replaced only after the new ones are attached, so there is
/// no moment without a data path (the two generations agree, see `proxy-ebpf/src/sock.rs`).
///
/// Errors name the step that failed (load, verify, attach, pin) and a remedy; a verifier
/// rejection carries the end of the verifier log.
///
/// Returns the reader of the kernel log ring when the kernel log level is not off.
pub fn load_and_attach(
    dir: &Path,
    cgroup: &Path,
    sizes: MapSizes,
) -> Result<Option<crate::kernel_log::KernelLogs>> {
    attach_programs(load_pinned(dir, sizes)?, dir, cgroup)
}

/// The second half of [`load_and_attach`]: verifies the socket programs of `ebpf` (loaded by
/// [`load_pinned`], maps in place) and attaches them to `cgroup`, pinning their links under
/// `dir` and replacing an earlier run's only once the new ones are attached. It needs
/// nothing from the maps' contents, so the agent runs it while its source is read.
///
/// Errors and result as [`load_and_attach`].
pub fn attach_programs(
    mut ebpf: Ebpf,
    dir: &Path,
    cgroup: &Path,
) -> Result<Option<crate::kernel_log::KernelLogs>> {
    let cg = File::open(cgroup).with_context(|| {
        format!(
            "attach: open cgroup {} (remedy: pass an existing cgroup v2 directory as --cgroup-path)",
            cgroup.display()
        )
    })?;
    let mut wanted: Vec<&str> = PROGRAMS.to_vec();
    wanted.push(RELEASE_PROGRAM);
    load_parallel(&mut ebpf, &wanted)?;
    // The release program first: the new one frees what either generation's connect
    // programs wrote (see `clear_legacy_hint`), the old one knows nothing of `SOCK_NAT`.
    let p: &mut CgroupSock = ebpf
        .program_mut(RELEASE_PROGRAM)
        .with_context(|| format!("load: program {RELEASE_PROGRAM} missing from the object"))?
        .try_into()
        .with_context(|| format!("load: program {RELEASE_PROGRAM} is not a cgroup sock program"))?;
    let id = p
        .attach(&cg, CgroupAttachMode::Single)
        .with_context(|| format!("attach: {RELEASE_PROGRAM} to cgroup {}", cgroup.display()))?;
    let link: FdLink = p
        .take_link(id)
        .context("attach: take link")?
        .try_into()
        .context("attach: the kernel did not give a bpf_link (needs Linux >= 5.7)")?;
    replace_link(dir, RELEASE_PROGRAM, link)?;
    for prog in PROGRAMS {
        let p: &mut CgroupSockAddr = ebpf
            .program_mut(prog)
            .with_context(|| format!("load: program {prog} missing from the object (remedy: rebuild with `cargo xtask build`)"))?
            .try_into()
            .with_context(|| format!("load: program {prog} is not a cgroup sock_addr program (remedy: rebuild with `cargo xtask build`)"))?;
        // With bpf_link (kernel >= 5.7) `Single` means flags 0, which the kernel requires for
        // cgroup links; links always coexist with other links on the same hook.
        let id = p.attach(&cg, CgroupAttachMode::Single).with_context(|| {
            format!(
                "attach: {prog} to cgroup {} (remedy: {})",
                cgroup.display(),
                "check that it is a cgroup v2 directory and that the agent has CAP_NET_ADMIN and CAP_SYS_ADMIN"
            )
        })?;
        let link: FdLink = p
            .take_link(id)
            .context("attach: take link")?
            .try_into()
            .context("attach: the kernel did not give a bpf_link (remedy: use Linux >= 5.7)")?;
        replace_link(dir, prog, link)?;
    }
    // The egress program is needed only while some socket is stale (an adopted data path
    // may have some); otherwise an earlier generation's link is detached.
    if stale_sockets_listed(dir) {
        attach_egress_of(&mut ebpf, dir, &cg, cgroup)?;
    } else {
        detach_egress(dir)?;
    }

    if legacy_hint(dir) {
        clear_legacy_hint(dir)?;
    }
    if kernel_log_level() == KernelLogLevel::Off {
        return Ok(None);
    }
    crate::kernel_log::KernelLogs::new(&mut ebpf).map(Some)
}

/// Loads the programs `names` of `ebpf` (cgroup `sock_addr` or `sock` programs) into the
/// kernel, several at a time: the verifier runs in the thread that loads, one program per
/// call, and takes most of a start-up on a fresh pin directory (several hundred
/// milliseconds for each translating program), so one thread per CPU (at most one per
/// program) shortens it by up to that factor.
/// Attaching stays with the caller, in its order.
///
/// Errors: a program missing from the object or of another kind, or the first load that
/// failed (in `names` order), worded as [`program_load_error`] does.
fn load_parallel(ebpf: &mut Ebpf, names: &[&str]) -> Result<()> {
    for name in names {
        match ebpf.program(name) {
            Some(Program::CgroupSockAddr(_) | Program::CgroupSock(_)) => {}
            Some(_) => bail!(
                "load: program {name} is not a cgroup sock_addr or sock program (remedy: rebuild with `cargo xtask build`)"
            ),
            None => bail!(
                "load: program {name} missing from the object (remedy: rebuild with `cargo xtask build`)"
            ),
        }
    }
    let mut work: Vec<(usize, &mut Program)> = ebpf
        .programs_mut()
        .filter_map(|(n, p)| Some((names.iter().position(|w| *w == n)?, p)))
        .collect();
    // Taken from the end: in `names` order, which puts the long verifications
    // (connect, sendmsg) first, so no thread starts one last while the others idle.
    work.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, work.len().max(1));
    let queue = std::sync::Mutex::new(work);
    let mut failures: Vec<(usize, anyhow::Error)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut failed = Vec::new();
                    loop {
                        let Some((i, p)) = queue.lock().expect("queue").pop() else {
                            break;
                        };
                        let started = std::time::Instant::now();
                        let loaded = match p {
                            Program::CgroupSockAddr(p) => p.load(),
                            Program::CgroupSock(p) => p.load(),
                            _ => Ok(()),
                        };
                        // Where a start-up's time goes: the verifier, per program.
                        tracing::debug!(
                            program = names[i],
                            ms = started.elapsed().as_millis() as u64,
                            verified_insns =
                                p.info().ok().and_then(|i| i.verified_instruction_count()),
                            "program loaded"
                        );
                        if let Err(e) = loaded {
                            failed.push((i, program_load_error(names[i], e)));
                        }
                    }
                    failed
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("loader thread"))
            .collect()
    });
    failures.sort_by_key(|(i, _)| *i);
    match failures.into_iter().next() {
        Some((_, e)) => Err(e),
        None => Ok(()),
    }
}

/// Loads and attaches the egress program of `ebpf` to `cg` and pins its link (replacing an
/// earlier one without a gap).
fn attach_egress_of(ebpf: &mut Ebpf, dir: &Path, cg: &File, cgroup: &Path) -> Result<()> {
    let p: &mut CgroupSkb = ebpf
        .program_mut(EGRESS_PROGRAM)
        .with_context(|| format!("load: program {EGRESS_PROGRAM} missing from the object"))?
        .try_into()
        .with_context(|| format!("load: program {EGRESS_PROGRAM} is not a cgroup skb program"))?;
    p.load()
        .map_err(|e| program_load_error(EGRESS_PROGRAM, e))?;
    let id = p
        .attach(cg, CgroupSkbAttachType::Egress, CgroupAttachMode::Single)
        .with_context(|| format!("attach: {EGRESS_PROGRAM} to cgroup {}", cgroup.display()))?;
    let link: FdLink = p
        .take_link(id)
        .context("attach: take link")?
        .try_into()
        .context("attach: the kernel did not give a bpf_link (needs Linux >= 5.7)")?;
    replace_link(dir, EGRESS_PROGRAM, link)
}

/// True when `STALE_SOCKETS` pinned under `dir` has an entry (false when it cannot be read:
/// a fresh pin directory).
pub fn stale_sockets_listed(dir: &Path) -> bool {
    let Ok(m) = aya::maps::MapData::from_pin(dir.join(STALE_SOCKETS)) else {
        return false;
    };
    let Ok(h) = aya::maps::HashMap::<_, u64, u32>::try_from(Map::LruHashMap(m)) else {
        return false;
    };
    h.keys().next().is_some()
}

/// True when the egress program's link is pinned under `dir` (attached).
pub fn egress_attached(dir: &Path) -> bool {
    link_pin(dir, EGRESS_PROGRAM).exists()
}

/// Attaches the egress program (stale connected UDP sockets) to `cgroup` when it is not
/// attached: loads it from the embedded object with the maps pinned under `dir` (all exist
/// once the agent has started) and pins its link. Returns whether it attached it.
///
/// Errors name the step (load, verify, attach, pin).
pub fn attach_egress(dir: &Path, cgroup: &Path) -> Result<bool> {
    if egress_attached(dir) {
        return Ok(false);
    }
    let mut loader = new_loader();
    for name in pinned_maps() {
        loader.map_pin_path(name, dir.join(name));
    }
    let mut ebpf = loader.load(OBJECT).map_err(|e| load_error(e, true))?;
    let cg =
        File::open(cgroup).with_context(|| format!("attach: open cgroup {}", cgroup.display()))?;
    attach_egress_of(&mut ebpf, dir, &cg, cgroup)?;
    Ok(true)
}

/// Detaches the egress program by removing its pinned link; returns whether it was attached.
pub fn detach_egress(dir: &Path) -> Result<bool> {
    let pin = link_pin(dir, EGRESS_PROGRAM);
    if !pin.exists() {
        return Ok(false);
    }
    match PinnedLink::from_pin(&pin) {
        Ok(l) => l
            .unpin()
            .map(drop)
            .with_context(|| format!("pin: remove {}", pin.display()))?,
        Err(_) => {
            fs::remove_file(&pin).with_context(|| format!("pin: remove {}", pin.display()))?
        }
    }
    Ok(true)
}

/// Pins `link` as the link of `prog`, detaching the link an earlier run pinned there only
/// after the new one is in place.
fn replace_link(dir: &Path, prog: &str, link: FdLink) -> Result<()> {
    let final_pin = link_pin(dir, prog);
    let new_pin = dir.join(format!("next_{prog}"));
    let _ = fs::remove_file(&new_pin);
    link.pin(&new_pin).with_context(|| {
        format!(
            "pin: link {} (remedy: check that --bpffs is a writable BPF file system)",
            new_pin.display()
        )
    })?;
    if final_pin.exists() {
        // Detach the earlier generation: its pin is the last reference to its link.
        match PinnedLink::from_pin(&final_pin) {
            Ok(old) => drop(old.unpin()),
            Err(_) => drop(fs::remove_file(&final_pin)),
        }
    }
    fs::rename(&new_pin, &final_pin).with_context(|| {
        format!(
            "pin: rename {} to {}",
            new_pin.display(),
            final_pin.display()
        )
    })?;
    Ok(())
}

/// Everything `cleanup` removed.
#[derive(Debug, Default)]
pub struct CleanupReport {
    /// Link pins removed (each detached its program).
    pub links: Vec<PathBuf>,
    /// Map pins removed.
    pub maps: Vec<PathBuf>,
    /// Whether the pin directory itself was removed.
    pub dir_removed: bool,
    /// How long the north-south flows were drained before the programs went (`None`: no
    /// packet programs were attached).
    pub drained: Option<std::time::Duration>,
}

/// Longest wait of [`cleanup`] for the north-south flows open at that moment.
pub const DRAIN_MAX: std::time::Duration = std::time::Duration::from_secs(3);
/// A flow whose last packet is older than this counts as idle for the drain.
const DRAIN_IDLE_NS: u64 = 500_000_000;

/// Drains the north-south flows of the pins under `dir` before their programs go: sets
/// `TC_CFG_DRAIN` (no new flow starts: a first packet goes to the kernel, where the rules
/// of the proxy taking over, kube-proxy's on a rollback, translate it), then waits until no
/// tracked flow that is still open saw a packet in the last 0.5 s, at most [`DRAIN_MAX`].
/// Without the drain, a connection in flight when the programs go would have its next
/// packet translated anew by those rules, to a backend that does not know it, and be reset.
/// Returns how long it waited; `None` when the maps cannot be opened.
fn drain_flows(dir: &Path) -> Option<std::time::Duration> {
    use aya::maps::{Array, HashMap, MapData};
    use proxy_common::nat::{
        CT_F_EGRESS, CtEntry, CtKey, TC_CFG_DRAIN, TC_CONFIG, TcConfig, ct_closed,
    };
    let open = |name: &str| {
        MapData::from_pin(dir.join(name))
            .ok()
            .and_then(|d| Map::from_map_data(d).ok())
    };
    let mut cfg: Array<MapData, TcConfig> = open(TC_CONFIG)?.try_into().ok()?;
    let mut c = cfg.get(&0, 0).ok()?;
    c.flags |= TC_CFG_DRAIN;
    cfg.set(0, c, 0).ok()?;
    let ct: HashMap<MapData, CtKey, CtEntry> = open(CONNTRACK)?.try_into().ok()?;
    let start = std::time::Instant::now();
    while start.elapsed() < DRAIN_MAX {
        let now = super::clock::monotonic_ns();
        let busy = ct.iter().filter_map(|kv| kv.ok()).any(|(_, e)| {
            e.flags & CT_F_EGRESS == 0
                && !ct_closed(e.flags)
                && now.saturating_sub(e.last_seen_ns) < DRAIN_IDLE_NS
        });
        if !busy {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Some(start.elapsed())
}

/// Detaches the programs (by removing their pinned links) and removes the pinned maps and the
/// pin directory. Missing pieces are not errors, so it can run on a half-cleaned node.
pub fn cleanup(dir: &Path) -> Result<CleanupReport> {
    let mut r = CleanupReport::default();
    let Ok(entries) = fs::read_dir(dir) else {
        return Ok(r);
    };
    // Only pins are removed: a directory elsewhere (a mistyped --bpffs) is left alone.
    if !is_on_bpffs(dir) {
        bail!(
            "{} is not on a BPF file system: nothing ebpf-proxy pinned can be there, nothing removed (check --bpffs)",
            dir.display()
        );
    }
    let mut files: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    let packet_programs = files.iter().any(|p| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("link_tc_") || n.starts_with("link_xdp_"))
    });
    if packet_programs {
        r.drained = drain_flows(dir);
    }
    // The programs that start translations (connect, sendmsg, tc ingress) go first, those
    // that reverse them (recvmsg, getpeername, tc egress, ...) last: a connection in its
    // handshake at that moment is then either not translated at all or has its replies
    // reversed, instead of a SYN-ACK leaving with the backend's address.
    files.sort_by_key(|p| {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let starts = ["connect4", "connect6", "sendmsg4", "sendmsg6", "tc_ingress"]
            .iter()
            .any(|prog| name.contains(prog));
        (!starts, p.clone())
    });
    for path in files {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        if name.starts_with("link_") || name.starts_with("next_") {
            match PinnedLink::from_pin(&path) {
                Ok(l) => drop(l.unpin()),
                Err(_) => drop(fs::remove_file(&path)),
            }
            r.links.push(path);
        } else if pinned_maps().any(|m| m == name) {
            fs::remove_file(&path).with_context(|| format!("remove {}", path.display()))?;
            r.maps.push(path);
        }
    }
    r.dir_removed = fs::remove_dir(dir).is_ok();
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cleanup_waits_for_the_agents_lock_and_then_holds_it() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("pins");
        assert!(
            wait_pin_dir_free(&dir, std::time::Duration::ZERO)
                .unwrap()
                .is_none(),
            "nothing to wait for without the directory"
        );
        let agent = lock_pin_dir(&dir).unwrap();
        let e = wait_pin_dir_free(&dir, std::time::Duration::from_millis(200)).unwrap_err();
        assert!(
            e.to_string().contains("still runs on the pin directory"),
            "{e}"
        );
        // The agent stops meanwhile: the cleanup goes on, and holds the lock itself.
        let stopper = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            drop(agent);
        });
        let held = wait_pin_dir_free(&dir, std::time::Duration::from_secs(5)).unwrap();
        assert!(held.is_some());
        stopper.join().unwrap();
        assert!(lock_pin_dir(&dir).is_err(), "the cleanup holds the lock");
    }

    #[test]
    fn verifier_excerpt_keeps_the_end() {
        let log: String = (1..=30).map(|i| format!("line {i}\n")).collect();
        let e = verifier_excerpt(&log);
        assert!(
            e.starts_with("  ... (18 earlier lines)\n  line 19\n"),
            "{e}"
        );
        assert!(e.ends_with("  line 30\n"), "{e}");
        assert_eq!(verifier_excerpt("a\n\nb\n"), "  a\n  b\n");
    }

    #[test]
    fn program_errors_name_the_step_and_a_remedy() {
        let rejected = ProgramError::LoadError {
            io_error: std::io::Error::from_raw_os_error(libc::EINVAL),
            verifier_log: aya_obj::VerifierLog::new(
                "0: (b7) r0 = 0\n1: (85) call bpf_set_retval#187\nunknown func bpf_set_retval#187\n"
                    .into(),
            ),
        };
        let e = format!("{:#}", program_load_error("connect4", rejected));
        assert!(
            e.starts_with("verify: the kernel rejected program connect4 (Invalid argument"),
            "{e}"
        );
        assert!(
            e.contains("  unknown func bpf_set_retval#187\n(remedy: "),
            "{e}"
        );

        let denied = ProgramError::LoadError {
            io_error: std::io::Error::from_raw_os_error(libc::EPERM),
            verifier_log: aya_obj::VerifierLog::new(String::new()),
        };
        let e = format!("{:#}", program_load_error("connect4", denied));
        assert!(
            e.starts_with("load: program connect4 (remedy: run as root"),
            "{e}"
        );
    }
}
