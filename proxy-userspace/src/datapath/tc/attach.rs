//! Attaching programs to interfaces through pinned links: tcx (replacing an earlier
//! agent's link only once the new one is pinned), XDP by mode, and the links' pin names.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::Path,
};

use anyhow::{Context, Result};
use aya::{
    Ebpf,
    programs::{
        LinkOrder, SchedClassifier, TcAttachType,
        links::{FdLink, PinnedLink},
        tc::TcAttachOptions,
    },
};

use super::{INGRESS_PROGRAM, REJECT_PROGRAM};

/// How XDP runs on an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum XdpMode {
    /// In the driver, before an skb exists (`XDP_FLAGS_DRV_MODE`).
    Native,
    /// On the skb, in the generic receive path (`XDP_FLAGS_SKB_MODE`).
    Generic,
}

impl XdpMode {
    /// `native` or `generic`, as in the pins, logs, metrics and `services`.
    pub fn as_str(self) -> &'static str {
        match self {
            XdpMode::Native => "native",
            XdpMode::Generic => "generic",
        }
    }

    pub(super) fn aya(self) -> aya::programs::xdp::XdpMode {
        match self {
            XdpMode::Native => aya::programs::xdp::XdpMode::Driver,
            XdpMode::Generic => aya::programs::xdp::XdpMode::Skb,
        }
    }
}

/// Loads the programs `tc_ingress` and `pod_ingress` tail-call (`tc_reject`) and writes
/// them into the tail-call table `TC_TAILS` of the same load, `ebpf` (the table is not
/// pinned: each load has its own). Without it they drop what they would reject (counted as
/// `tc_dropped_no_endpoints`).
pub fn install_tail_calls(ebpf: &mut Ebpf) -> Result<()> {
    let p: &mut SchedClassifier = ebpf
        .program_mut(REJECT_PROGRAM)
        .with_context(|| format!("program {REJECT_PROGRAM} missing from the object"))?
        .try_into()?;
    p.load()
        .map_err(|e| anyhow::anyhow!("verify: program {REJECT_PROGRAM} was rejected: {e:#}"))?;
    let fd = p.fd()?.try_clone().context("duplicate the tc_reject fd")?;
    let map = ebpf
        .map_mut(proxy_common::nat::TAILS)
        .context("map TC_TAILS missing from the object")?;
    let mut tails = aya::maps::ProgramArray::try_from(map)?;
    tails
        .set(proxy_common::nat::TAIL_REJECT, &fd, 0)
        .context("write TC_TAILS")?;
    Ok(())
}

pub(super) fn link_name(prog: &str, ifname: &str) -> String {
    format!("link_{prog}_{ifname}")
}

pub(super) fn xdp_link_name(mode: XdpMode, ifname: &str) -> String {
    format!("link_xdp_{}_{ifname}", mode.as_str())
}

/// The interfaces with a pinned tcx ingress link under the pin directory `dir` (those with
/// the north-south programs).
pub fn tc_interfaces(dir: &Path) -> BTreeSet<String> {
    linked_interfaces(dir, INGRESS_PROGRAM)
}

/// The interfaces with a pinned link of program `prog` under the pin directory `dir`
/// (pins named `link_<prog>_<interface>`).
pub fn linked_interfaces(dir: &Path, prog: &str) -> BTreeSet<String> {
    let prefix = format!("link_{prog}_");
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| n.strip_prefix(&prefix).map(str::to_string))
        .collect()
}

/// Detaches and removes the pinned link at `pin`, if any (a missing pin is no error).
pub(super) fn remove_link_pin(pin: &Path) -> Result<()> {
    if let Ok(l) = PinnedLink::from_pin(pin) {
        drop(l.unpin());
    }
    match fs::remove_file(pin) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("remove {}", pin.display())),
    }
}

/// The interfaces with a pinned XDP link under the pin directory `dir`, with the mode each
/// runs in (from the pins' names).
pub fn xdp_modes(dir: &Path) -> BTreeMap<String, XdpMode> {
    let mut out = BTreeMap::new();
    for name in fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
    {
        for mode in [XdpMode::Native, XdpMode::Generic] {
            if let Some(ifname) = name.strip_prefix(&xdp_link_name(mode, "")) {
                out.insert(ifname.to_string(), mode);
            }
        }
    }
    out
}

/// The hint added to a failed tcx attach, from the errno of the link creation: the kernel
/// refuses an unknown attach type (no tcx before Linux 6.6) with EINVAL, or EOPNOTSUPP /
/// ENOTSUPP (524, the kernel-internal code some paths leak); EEXIST means the program is
/// already attached to that hook (tcx holds a program once per hook, whatever link put it
/// there), so "tcx missing" would mislead.
pub(super) fn tcx_attach_hint(e: &aya::programs::ProgramError) -> Option<&'static str> {
    const ENOTSUPP: i32 = 524;
    let aya::programs::ProgramError::SyscallError(s) = e else {
        return None;
    };
    match s.io_error.raw_os_error()? {
        libc::EINVAL | libc::EOPNOTSUPP | ENOTSUPP => Some("tcx needs Linux >= 6.6"),
        libc::EEXIST => Some("another link already attaches this program to that hook"),
        _ => None,
    }
}

/// Attaches each `(program, direction)` of `ebpf` to `ifname` with tcx, in order, and pins
/// its link as `link_<program>_<ifname>` under `dir`, replacing the link an earlier agent
/// pinned there only once the new one is in place (so the interface is never left without
/// the program). Errors: attaching (with a hint from the errno: tcx needs Linux >= 6.6,
/// or the hook is taken) or pinning.
pub(crate) fn attach_pinned(
    ebpf: &mut Ebpf,
    dir: &Path,
    ifname: &str,
    progs: [(&str, TcAttachType); 2],
) -> Result<()> {
    for (prog, ty) in progs {
        let p: &mut SchedClassifier = ebpf
            .program_mut(prog)
            .context("program missing")?
            .try_into()?;
        let id = p
            .attach_with_options(ifname, ty, TcAttachOptions::TcxOrder(LinkOrder::default()))
            .map_err(|e| {
                let hint = tcx_attach_hint(&e).map(|h| format!(" ({h})"));
                anyhow::Error::new(e).context(format!(
                    "attach {prog} to {ifname}{}",
                    hint.unwrap_or_default()
                ))
            })?;
        let link: FdLink = p.take_link(id)?.try_into()?;
        let pin = dir.join(link_name(prog, ifname));
        let next = dir.join(format!("next_{prog}_{ifname}"));
        let _ = fs::remove_file(&next);
        link.pin(&next)
            .with_context(|| format!("pin {}", next.display()))?;
        if pin.exists() {
            match PinnedLink::from_pin(&pin) {
                Ok(old) => drop(old.unpin()),
                Err(_) => drop(fs::remove_file(&pin)),
            }
        }
        fs::rename(&next, &pin).with_context(|| format!("pin {}", pin.display()))?;
    }
    Ok(())
}
