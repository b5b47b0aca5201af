//! `ebpf-proxy check`: the preflight checks, also run at the start of `ebpf-proxy run`.
//!
//! Each check reports `ok`, `warn`, `fail` or `skip` (could not be checked) with a detail
//! and, when it is not `ok`, a one-line remedy. Only `fail` stops `run` and makes `check`
//! exit with 1. The checks only read, except the bpffs check, which mounts bpffs when
//! [`Options::mount_bpffs`] is set, and the program check, which loads the programs into the
//! kernel (with small maps that are not pinned) and unloads them again without attaching
//! anything.
//!
//! What is probed, as `bpftool feature probe` does (aya's `is_program_supported`,
//! `is_map_supported` and `is_helper_supported`, each loading a tiny program or creating a
//! tiny map): the program types, map types and helpers that the embedded eBPF object
//! actually uses, read from its sections and call instructions. Attach types are probed by
//! loading each program with its expected attach type (that load runs the verifier too).

mod host;
mod kube_proxy;
mod privileges;
mod programs;
mod settings;
mod xdp;

use std::{fmt::Write as _, path::PathBuf};

use serde::Serialize;

pub(crate) use host::MIN_KERNEL;
pub(crate) use settings::{conntrack, socket_destroy};
// Used by the unit tests only.
#[cfg(test)]
pub(crate) use privileges::{effective_capabilities, missing_capabilities};

use host::{bpffs, btf, cgroup, kernel, memlock};
use kube_proxy::kube_proxy_rules;
use privileges::privileges;
use programs::programs;
use xdp::xdp;

/// Outcome of one check.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Fine.
    Ok,
    /// Works, but something deserves attention.
    Warn,
    /// The agent cannot run (or would misbehave) until this is fixed.
    Fail,
    /// Not checked (a tool it needs is missing).
    Skip,
}

impl Status {
    /// The lowercase name used in the table and in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Fail => "fail",
            Status::Skip => "skip",
        }
    }
}

/// One row of the report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CheckResult {
    /// What was checked (`kernel`, `bpffs`, ...).
    pub check: &'static str,
    /// Its outcome.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// What to do about it (set when the status is `warn` or `fail`, and for a `skip` that
    /// can be remedied; `null` in JSON otherwise).
    pub remedy: Option<String>,
}

impl CheckResult {
    fn ok(check: &'static str, detail: impl Into<String>) -> Self {
        Self {
            check,
            status: Status::Ok,
            detail: detail.into(),
            remedy: None,
        }
    }

    fn bad(
        check: &'static str,
        status: Status,
        detail: impl Into<String>,
        remedy: impl Into<String>,
    ) -> Self {
        Self {
            check,
            status,
            detail: detail.into(),
            remedy: Some(remedy.into()),
        }
    }

    /// One line: `check: detail (remedy: ...)`; the message `run` stops with on a failure.
    pub fn message(&self) -> String {
        match &self.remedy {
            Some(r) => format!("{}: {} (remedy: {r})", self.check, self.detail),
            None => format!("{}: {}", self.check, self.detail),
        }
    }
}

/// What to check.
#[derive(Clone, Debug)]
pub struct Options {
    /// Mount point of the BPF file system (`--bpffs`).
    pub bpffs: PathBuf,
    /// Mount bpffs at [`Options::bpffs`] when it is not mounted.
    pub mount_bpffs: bool,
    /// The cgroup the programs attach to; `None` for the cgroup v2 root.
    pub cgroup: Option<PathBuf>,
    /// Probe types and helpers, and load (verify) the programs. `run` skips this: it loads
    /// them right after, and reports a failure with the step that failed.
    pub probe_programs: bool,
    /// The north-south settings, for the size of the conntrack table.
    pub tc: crate::datapath::tc::TcSettings,
}

/// Runs every check, in order. Without the privileges the agent needs, the checks that
/// need them (program probes, kube-proxy's rules) are not run: the privileges row says so.
pub fn run_checks(opts: &Options) -> Vec<CheckResult> {
    let privileged = privileges();
    let allowed = privileged.status != Status::Fail;
    let mut out = vec![kernel(), btf(), bpffs(opts), cgroup(opts), privileged];
    if opts.probe_programs && allowed {
        out.extend(programs());
    }
    out.push(memlock());
    out.push(conntrack(
        &opts.tc.conntrack_size(),
        crate::datapath::tc::own_cgroup_memory_max(),
    ));
    if allowed {
        out.push(kube_proxy_rules());
        out.push(socket_destroy());
    }
    out.push(xdp());
    out
}

/// True when a check failed.
pub fn failed(results: &[CheckResult]) -> bool {
    results.iter().any(|r| r.status == Status::Fail)
}

/// The aligned table `ebpf-proxy check` prints: `CHECK STATUS DETAIL`, and a `remedy:` line
/// under every row that is not `ok`.
pub fn table(results: &[CheckResult]) -> String {
    let w = results
        .iter()
        .map(|r| r.check.len())
        .chain(["CHECK".len()])
        .max()
        .unwrap_or(0);
    let mut s = String::new();
    let _ = writeln!(s, "{:<w$}  {:<6}  DETAIL", "CHECK", "STATUS");
    for r in results {
        let _ = writeln!(s, "{:<w$}  {:<6}  {}", r.check, r.status.as_str(), r.detail);
        if let Some(remedy) = &r.remedy {
            let _ = writeln!(s, "{:<w$}  {:<6}  remedy: {remedy}", "", "");
        }
    }
    s
}

#[cfg(test)]
mod tests;
