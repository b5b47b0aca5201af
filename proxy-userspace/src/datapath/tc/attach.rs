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
        LinkOrder, SchedClassifier, TcAttachType, TestRun, TestRunOptions,
        links::{FdLink, PinnedLink},
        tc::TcAttachOptions,
    },
};

use super::{CLOCK_PROBE_PROGRAM, INGRESS_PROGRAM, REJECT_PROGRAM};
use crate::datapath::clock::calibrate;

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

/// The conntrack clock of this boot, calibrated by the first load of this process
/// ([`program_clock`]); `None` inside: no calibration fitted, the coarse clock is used.
static CLOCK: std::sync::OnceLock<Option<proxy_common::nat::CtClock>> = std::sync::OnceLock::new();

/// Writes the conntrack clock (`proxy_common::nat::CtClock`) into `TC_CT_CLOCK` of the load
/// `ebpf`, before any of its packet programs is attached: calibrated on the first call of
/// the process through the probe program `tc_clock_probe` (run with `BPF_PROG_TEST_RUN`,
/// see `datapath::clock::calibrate`), the same values for every later load, so that every program of the
/// process reads one clock. Returns the clock written, `None` when the calibration fitted
/// no `CONFIG_HZ` (the map stays zero: the programs read the coarse clock).
///
/// Errors: the probe was rejected or failed to run, or the map write failed; the programs
/// then read the coarse clock, slower but right ([`program_clock_or_warn`]).
pub fn program_clock(ebpf: &mut Ebpf) -> Result<Option<proxy_common::nat::CtClock>> {
    let clock = match CLOCK.get() {
        Some(c) => *c,
        None => {
            let p: &mut SchedClassifier = ebpf
                .program_mut(CLOCK_PROBE_PROGRAM)
                .with_context(|| format!("program {CLOCK_PROBE_PROGRAM} missing from the object"))?
                .try_into()?;
            p.load().map_err(|e| {
                anyhow::anyhow!("verify: program {CLOCK_PROBE_PROGRAM} was rejected: {e:#}")
            })?;
            let c = calibrate(|| probe_clock(p))?;
            match c {
                Some(c) => tracing::info!(
                    tick_ns = c.tick_ns,
                    "conntrack clock: jiffies (a plain read per packet)"
                ),
                None => tracing::warn!(
                    "conntrack clock: the jiffies fit no CONFIG_HZ; the packet programs read the coarse clock"
                ),
            }
            *CLOCK.get_or_init(|| c)
        }
    };
    if let Some(c) = clock {
        let map = ebpf
            .map_mut(proxy_common::nat::CT_CLOCK)
            .context("map TC_CT_CLOCK missing from the object")?;
        aya::maps::Array::<_, proxy_common::nat::CtClock>::try_from(map)?
            .set(0, c, 0)
            .context("write TC_CT_CLOCK")?;
    }
    Ok(clock)
}

/// [`program_clock`], its error logged as a warning: a load without the calibrated clock
/// still serves, on the coarse clock.
pub fn program_clock_or_warn(ebpf: &mut Ebpf) {
    if let Err(e) = program_clock(ebpf) {
        tracing::warn!(error = %format!("{e:#}"), "conntrack clock not calibrated: the packet programs read the coarse clock");
    }
}

/// One run of `tc_clock_probe`: (jiffies, `CLOCK_MONOTONIC` ns).
fn probe_clock(p: &SchedClassifier) -> Result<(u64, u64)> {
    // 14 bytes standing for an Ethernet header (the kernel wants one), then the two words.
    let data = [0u8; 30];
    let mut out = [0u8; 30];
    let r = p
        .test_run(TestRunOptions {
            data_in: Some(&data),
            data_out: Some(&mut out),
            ..TestRunOptions::new()
        })
        .with_context(|| format!("run {CLOCK_PROBE_PROGRAM}"))?;
    if r.return_value != 0 {
        anyhow::bail!("{CLOCK_PROBE_PROGRAM} returned {}", r.return_value);
    }
    let word = |at: usize| u64::from_ne_bytes(out[at..at + 8].try_into().expect("8 bytes"));
    Ok((word(14), word(22)))
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
