//! Loading the eBPF object, pinning its maps, and attaching the socket programs to a cgroup
//! through pinned links, so the data path keeps working while the agent is stopped and a new
//! agent takes it over without a gap.

use std::{
    fs::{self, File},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use aya::{
    EbpfLoader,
    programs::{
        CgroupAttachMode, CgroupSkb, CgroupSkbAttachType, CgroupSockAddr, links::FdLink,
        links::PinnedLink,
    },
};
use proxy_common::{
    ALL_MAPS, BACKEND_SLOTS, BACKENDS, FRONTENDS, REVNAT_SK, SERVICE_NAMES, STALE_SOCKETS,
    UDP_FLOWS,
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
/// connected UDP sockets whose endpoint left their service (`STALE_SOCKETS`).
pub const EGRESS_PROGRAM: &str = "sock_egress";

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
    /// `REVNAT_SK`, `UDP_FLOWS` and `STALE_SOCKETS`.
    pub sockets: u32,
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

/// Path of the pinned link of program `prog`.
pub fn link_pin(dir: &Path, prog: &str) -> PathBuf {
    dir.join(format!("link_{prog}"))
}

pub use crate::mounts::{cgroup2_root, ensure_bpffs};

/// Loads the object with its maps pinned under `dir` (adopting maps pinned by an earlier
/// run), then attaches every program to `cgroup` and pins the links. Links of an earlier run
/// are replaced only after the new ones are attached, so there is no moment without a data
/// path (the two generations agree, see `proxy-ebpf/src/sock.rs`).
///
/// Errors name the step that failed (load, verify, attach, pin) and carry the verifier log.
pub fn load_and_attach(dir: &Path, cgroup: &Path, sizes: MapSizes) -> Result<()> {
    if OBJECT.is_empty() {
        bail!("this binary was built without the eBPF object; build it with `cargo xtask build`");
    }
    fs::create_dir_all(dir).with_context(|| format!("create pin directory {}", dir.display()))?;
    let pins: Vec<(&str, PathBuf)> = (ALL_MAPS.iter().chain(proxy_common::nat::TC_MAPS.iter()))
        .map(|m| (*m, dir.join(m)))
        .collect();
    let mut loader = EbpfLoader::new();
    for (name, path) in &pins {
        loader.map_pin_path(name, path.as_path());
    }
    loader
        .map_max_entries(FRONTENDS, sizes.frontends)
        .map_max_entries(SERVICE_NAMES, sizes.frontends)
        .map_max_entries(BACKEND_SLOTS, sizes.slots)
        .map_max_entries(BACKENDS, sizes.backends)
        .map_max_entries(REVNAT_SK, sizes.sockets)
        .map_max_entries(UDP_FLOWS, sizes.sockets)
        .map_max_entries(STALE_SOCKETS, sizes.sockets);
    let mut ebpf = loader.load(OBJECT).context(
        "load: creating or adopting the pinned maps failed (if the layout changed, run `ebpf-proxy cleanup`)",
    )?;
    let cg =
        File::open(cgroup).with_context(|| format!("attach: open cgroup {}", cgroup.display()))?;
    for prog in PROGRAMS {
        let p: &mut CgroupSockAddr = ebpf
            .program_mut(prog)
            .with_context(|| format!("load: program {prog} missing from the object"))?
            .try_into()
            .with_context(|| format!("load: program {prog} is not a cgroup sock_addr program"))?;
        p.load()
            .map_err(|e| anyhow::anyhow!("verify: program {prog} was rejected: {e:#}"))?;
        // With bpf_link (kernel >= 5.7) `Single` means flags 0, which the kernel requires for
        // cgroup links; links always coexist with other links on the same hook.
        let id = p
            .attach(&cg, CgroupAttachMode::Single)
            .with_context(|| format!("attach: {prog} to cgroup {}", cgroup.display()))?;
        let link: FdLink = p
            .take_link(id)
            .context("attach: take link")?
            .try_into()
            .context("attach: the kernel did not give a bpf_link (needs Linux >= 5.7)")?;
        replace_link(dir, prog, link)?;
    }
    let p: &mut CgroupSkb = ebpf
        .program_mut(EGRESS_PROGRAM)
        .with_context(|| format!("load: program {EGRESS_PROGRAM} missing from the object"))?
        .try_into()
        .with_context(|| format!("load: program {EGRESS_PROGRAM} is not a cgroup skb program"))?;
    p.load()
        .map_err(|e| anyhow::anyhow!("verify: program {EGRESS_PROGRAM} was rejected: {e:#}"))?;
    let id = p
        .attach(&cg, CgroupSkbAttachType::Egress, CgroupAttachMode::Single)
        .with_context(|| format!("attach: {EGRESS_PROGRAM} to cgroup {}", cgroup.display()))?;
    let link: FdLink = p
        .take_link(id)
        .context("attach: take link")?
        .try_into()
        .context("attach: the kernel did not give a bpf_link (needs Linux >= 5.7)")?;
    replace_link(dir, EGRESS_PROGRAM, link)?;
    Ok(())
}

/// Pins `link` as the link of `prog`, detaching the link an earlier run pinned there only
/// after the new one is in place.
fn replace_link(dir: &Path, prog: &str, link: FdLink) -> Result<()> {
    let final_pin = link_pin(dir, prog);
    let new_pin = dir.join(format!("next_{prog}"));
    let _ = fs::remove_file(&new_pin);
    link.pin(&new_pin)
        .with_context(|| format!("pin: link {}", new_pin.display()))?;
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
}

/// Detaches the programs (by removing their pinned links) and removes the pinned maps and the
/// pin directory. Missing pieces are not errors, so it can run on a half-cleaned node.
pub fn cleanup(dir: &Path) -> Result<CleanupReport> {
    let mut r = CleanupReport::default();
    let Ok(entries) = fs::read_dir(dir) else {
        return Ok(r);
    };
    let mut files: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    files.sort();
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
        } else if ALL_MAPS
            .iter()
            .chain(proxy_common::nat::TC_MAPS.iter())
            .any(|m| *m == name)
        {
            fs::remove_file(&path).with_context(|| format!("remove {}", path.display()))?;
            r.maps.push(path);
        }
    }
    r.dir_removed = fs::remove_dir(dir).is_ok();
    Ok(r)
}
