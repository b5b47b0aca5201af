//! Attaching the socket programs to the cgroup through pinned links, replacing an earlier
//! agent's links only once the new ones are in place; the egress program on demand.

use std::{fs, fs::File, path::Path};

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf,
    maps::Map,
    programs::{
        CgroupAttachMode, CgroupSkb, CgroupSkbAttachType, CgroupSock, CgroupSockAddr, Program,
        links::FdLink, links::PinnedLink,
    },
};
use proxy_common::STALE_SOCKETS;

use super::{
    EGRESS_PROGRAM, KernelLogLevel, MapSizes, OBJECT, PROGRAMS, RELEASE_PROGRAM,
    errors::{load_error, program_load_error},
    kernel_log_level,
    load::load_pinned,
    migrate::{clear_legacy_hint, legacy_hint},
    new_loader, pinned_maps,
    pins::link_pin,
};

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
