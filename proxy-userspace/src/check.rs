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

use std::{
    collections::BTreeSet,
    fmt::Write as _,
    path::{Path, PathBuf},
    time::Duration,
};

use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported, is_map_supported, is_program_supported},
};
use aya_obj::{
    Object, ProgramSection,
    generated::{BPF_CALL, BPF_JMP, bpf_func_id},
};
use serde::Serialize;

use crate::{
    datapath::loader,
    mounts::{cgroup2_root, find_mount, mount_bpffs},
};

/// The oldest kernel the programs load on: `bpf_set_retval` (5.18) refuses a connect() or
/// sendmsg() with ECONNREFUSED. The other needs are older: cgroup sock_addr `connect4/6`
/// (4.17), `sendmsg4/6` (4.18), `recvmsg4/6` (5.2), `getpeername4/6` (5.8), cgroup
/// `bpf_link` (5.7).
pub const MIN_KERNEL: (u32, u32) = (5, 18);

/// The oldest kernel the north-south (tc) programs attach on: tcx links (6.6). Below it,
/// ClusterIPs work from the node's own sockets, but NodePorts, external IPs and LB IPs are
/// not served to traffic entering the node.
pub const MIN_TCX_KERNEL: (u32, u32) = (6, 6);

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

/// Capabilities the agent needs (the DaemonSet grants exactly these): CAP_BPF loads
/// programs and creates maps, CAP_NET_ADMIN attaches them, CAP_SYS_ADMIN covers the bpf(2)
/// commands that still require it (getting objects by id), CAP_PERFMON makes the verifier
/// trust the loader. CAP_SYS_ADMIN also grants what CAP_BPF and CAP_PERFMON do.
pub const CAPABILITIES: [(&str, u32); 4] = [
    ("CAP_BPF", 39),
    ("CAP_NET_ADMIN", 12),
    ("CAP_SYS_ADMIN", 21),
    ("CAP_PERFMON", 38),
];

/// The needed capabilities ([`CAPABILITIES`]) missing from an effective set (`CapEff` of
/// /proc/self/status); CAP_SYS_ADMIN stands in for CAP_BPF and CAP_PERFMON, as in the
/// kernel's `bpf_capable()` and `perfmon_capable()`.
pub fn missing_capabilities(effective: u64) -> Vec<&'static str> {
    let has = |bit: u32| effective & (1u64 << bit) != 0;
    CAPABILITIES
        .iter()
        .filter(|(name, bit)| {
            let by_sys_admin = matches!(*name, "CAP_BPF" | "CAP_PERFMON") && has(21);
            !(has(*bit) || by_sys_admin)
        })
        .map(|(name, _)| *name)
        .collect()
}

/// `CapEff` of a /proc/PID/status text.
pub fn effective_capabilities(status: &str) -> Option<u64> {
    let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    u64::from_str_radix(hex.trim(), 16).ok()
}

/// Whether this process has the capabilities: a failure naming those missing when it
/// cannot load or attach programs, a warning when it lacks only CAP_SYS_ADMIN or
/// CAP_PERFMON.
fn privileges() -> CheckResult {
    const CHECK: &str = "privileges";
    let Some(eff) = std::fs::read_to_string("/proc/self/status")
        .ok()
        .as_deref()
        .and_then(effective_capabilities)
    else {
        return CheckResult::bad(
            CHECK,
            Status::Warn,
            "cannot read CapEff from /proc/self/status",
            "mount /proc",
        );
    };
    // SAFETY: geteuid(2) cannot fail.
    let uid = unsafe { libc::geteuid() };
    let missing = missing_capabilities(eff);
    if missing.is_empty() {
        let all: Vec<&str> = CAPABILITIES.iter().map(|(n, _)| *n).collect();
        return CheckResult::ok(CHECK, format!("uid {uid} with {}", all.join(", ")));
    }
    let remedy = "run as root (e.g. `sudo ebpf-proxy check`), or with CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN and CAP_PERFMON (the DaemonSet's capabilities)";
    // Without CAP_BPF (or CAP_SYS_ADMIN) nothing loads and without CAP_NET_ADMIN nothing
    // attaches; the other two are needed by some bpf(2) commands and the verifier.
    if missing.contains(&"CAP_BPF") || missing.contains(&"CAP_NET_ADMIN") {
        return CheckResult::bad(
            CHECK,
            Status::Fail,
            format!(
                "uid {uid} without {}: the agent cannot load or attach its programs; the program probes and the kube-proxy rules are not checked",
                missing.join(", ")
            ),
            remedy,
        );
    }
    CheckResult::bad(
        CHECK,
        Status::Warn,
        format!("uid {uid} without {}", missing.join(", ")),
        remedy,
    )
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

/// Whether `--close-connections-to-removed-endpoints` can close connections here
/// (sock_diag `SOCK_DESTROY`, `CONFIG_INET_DIAG_DESTROY`). A warning, not a failure: the
/// option is off by default.
pub fn socket_destroy() -> CheckResult {
    const NAME: &str = "socket destroy";
    match crate::sockdiag::destroy_supported() {
        Ok(true) => CheckResult::ok(
            NAME,
            "sock_diag SOCK_DESTROY works (--close-connections-to-removed-endpoints)".to_string(),
        ),
        Ok(false) => CheckResult::bad(
            NAME,
            Status::Warn,
            "sock_diag SOCK_DESTROY is not supported: --close-connections-to-removed-endpoints cannot close connections".to_string(),
            "a kernel built with CONFIG_INET_DIAG_DESTROY=y (and inet_diag/tcp_diag loaded), or leave the option off",
        ),
        Err(e) => CheckResult::bad(
            NAME,
            Status::Warn,
            format!("sock_diag cannot be used: {e}"),
            "load the inet_diag and tcp_diag modules, and run with CAP_NET_ADMIN; or leave --close-connections-to-removed-endpoints off",
        ),
    }
}

/// The conntrack table's size and preallocation, a warning when it is large
/// ([`crate::datapath::tc::ConntrackSize::excess`]).
pub fn conntrack(
    size: &crate::datapath::tc::ConntrackSize,
    memory_max: Option<u64>,
) -> CheckResult {
    let detail = size.describe();
    let detail = detail
        .strip_prefix("north-south conntrack table: ")
        .unwrap_or(&detail)
        .to_string();
    match size.excess(memory_max) {
        None => CheckResult::ok("conntrack", detail),
        Some(e) => CheckResult::bad(
            "conntrack",
            Status::Warn,
            format!("{detail}: {e}"),
            crate::datapath::tc::ConntrackSize::remedy(),
        ),
    }
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

/// Major and minor of a kernel release such as `6.18.44` or `5.15.0-91-generic`.
pub fn parse_kernel_release(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(['.', '-']);
    let major = parts.next()?.parse().ok()?;
    let minor_part = parts.next()?;
    let digits: String = minor_part
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    Some((major, digits.parse().ok()?))
}

fn kernel_release() -> Option<String> {
    // SAFETY: uname(2) into a zeroed struct we own.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    if unsafe { libc::uname(&mut u) } != 0 {
        return None;
    }
    // SAFETY: the kernel NUL-terminates the field.
    let c = unsafe { std::ffi::CStr::from_ptr(u.release.as_ptr()) };
    Some(c.to_string_lossy().into_owned())
}

fn kernel() -> CheckResult {
    let (maj, min) = MIN_KERNEL;
    let need = format!("needs >= {maj}.{min} for bpf_set_retval in cgroup sock_addr programs");
    let Some(release) = kernel_release() else {
        return CheckResult::bad(
            "kernel",
            Status::Warn,
            "uname(2) failed",
            format!("make sure the kernel is Linux >= {maj}.{min}"),
        );
    };
    let (tmaj, tmin) = MIN_TCX_KERNEL;
    match parse_kernel_release(&release) {
        Some(v) if v >= MIN_TCX_KERNEL => CheckResult::ok(
            "kernel",
            format!("{release} ({need}, >= {tmaj}.{tmin} for tcx)"),
        ),
        Some(v) if v >= MIN_KERNEL => CheckResult::bad(
            "kernel",
            Status::Warn,
            format!(
                "{release}: the socket programs load ({need}), but the north-south programs need tcx (>= {tmaj}.{tmin}): NodePorts, external IPs and LB IPs are not served to traffic entering the node"
            ),
            format!("upgrade the node to Linux >= {tmaj}.{tmin}"),
        ),
        Some(_) => CheckResult::bad(
            "kernel",
            Status::Fail,
            format!("{release} is too old ({need})"),
            format!("upgrade the node to Linux >= {maj}.{min}"),
        ),
        None => CheckResult::bad(
            "kernel",
            Status::Warn,
            format!("cannot read the version of {release:?} ({need})"),
            format!("make sure the kernel is Linux >= {maj}.{min}"),
        ),
    }
}

fn btf() -> CheckResult {
    const VMLINUX: &str = "/sys/kernel/btf/vmlinux";
    match std::fs::metadata(VMLINUX) {
        Ok(_) => CheckResult::ok("btf", VMLINUX),
        // The programs use no CO-RE relocation, so they load without kernel BTF; bpftool
        // still prints the maps' fields from the object's own BTF.
        Err(e) => CheckResult::bad(
            "btf",
            Status::Warn,
            format!("{VMLINUX}: {e} (the programs do not need it today)"),
            "use a kernel built with CONFIG_DEBUG_INFO_BTF=y",
        ),
    }
}

fn bpffs(opts: &Options) -> CheckResult {
    let path = &opts.bpffs;
    let mount_cmd = format!("mount -t bpf bpf {}", path.display());
    match find_mount("bpf", Some(path)) {
        Ok(Some(_)) => return CheckResult::ok("bpffs", format!("mounted at {}", path.display())),
        Ok(None) => {}
        Err(e) => {
            return CheckResult::bad(
                "bpffs",
                Status::Fail,
                format!("{e:#}"),
                "mount /proc (the mount table is read from /proc/self/mounts)",
            );
        }
    }
    if !opts.mount_bpffs {
        return CheckResult::bad(
            "bpffs",
            Status::Fail,
            format!("{} is not a BPF file system", path.display()),
            bpffs_remedy(path, &mount_cmd),
        );
    }
    match mount_bpffs(path) {
        Ok(_) => CheckResult::ok("bpffs", format!("mounted at {} (now)", path.display())),
        Err(e) => CheckResult::bad(
            "bpffs",
            Status::Fail,
            format!("{e:#}"),
            format!("run `{mount_cmd}` as root"),
        ),
    }
}

/// What to do about `--bpffs` naming a path that is no bpffs: point it at a bpffs mounted
/// elsewhere (most likely what was meant); never mount one over a directory that holds files
/// (`/tmp` after a typo), which would hide them; otherwise mount one there.
fn bpffs_remedy(path: &Path, mount_cmd: &str) -> String {
    if let Ok(Some(m)) = find_mount("bpf", None) {
        return format!(
            "point --bpffs at the BPF file system mounted at {}",
            m.display()
        );
    }
    let holds_files = std::fs::read_dir(path).is_ok_and(|mut d| d.next().is_some());
    if holds_files {
        return format!(
            "point --bpffs at an empty directory and pass --mount-bpffs (mounting a bpffs on {} would hide its files)",
            path.display()
        );
    }
    format!("run `{mount_cmd}`, pass --mount-bpffs, or point --bpffs at a bpffs mount")
}

fn cgroup(opts: &Options) -> CheckResult {
    let root = match cgroup2_root() {
        Ok(r) => r,
        Err(e) => {
            return CheckResult::bad(
                "cgroup v2",
                Status::Fail,
                format!("{e:#}"),
                "mount cgroup2, e.g. `mount -t cgroup2 none /sys/fs/cgroup/unified`",
            );
        }
    };
    let target = opts.cgroup.clone().unwrap_or_else(|| root.clone());
    match loader::check_cgroup(&target) {
        Ok(()) => CheckResult::ok(
            "cgroup v2",
            format!(
                "mounted at {}; programs attach to {}",
                root.display(),
                target.display()
            ),
        ),
        Err(e) => CheckResult::bad(
            "cgroup v2",
            Status::Fail,
            format!("{e:#}"),
            format!(
                "pass --cgroup-path {} (every process of the node) or a directory below it",
                root.display()
            ),
        ),
    }
}

/// Short name of a program type, as bpftool prints it.
fn program_type_name(t: ProgramType) -> &'static str {
    match t {
        ProgramType::CgroupSockAddr => "cgroup_sock_addr",
        ProgramType::SchedClassifier => "sched_cls",
        ProgramType::CgroupSkb => "cgroup_skb",
        ProgramType::CgroupSock => "cgroup_sock",
        ProgramType::Xdp => "xdp",
        _ => "other",
    }
}

/// The program type of an object section, for the types this project uses.
fn program_type(section: &ProgramSection) -> Option<ProgramType> {
    match section {
        ProgramSection::CgroupSockAddr { .. } => Some(ProgramType::CgroupSockAddr),
        ProgramSection::SchedClassifier => Some(ProgramType::SchedClassifier),
        ProgramSection::CgroupSkb { .. } => Some(ProgramType::CgroupSkb),
        ProgramSection::CgroupSock { .. } => Some(ProgramType::CgroupSock),
        ProgramSection::Xdp { .. } => Some(ProgramType::Xdp),
        _ => None,
    }
}

/// A helper id of a call instruction as aya's [`BpfHelper`].
fn helper(id: i32) -> Option<BpfHelper> {
    let id = u32::try_from(id).ok()?;
    if id == 0 || id >= bpf_func_id::__BPF_FUNC_MAX_ID as u32 {
        return None;
    }
    // SAFETY: `bpf_func_id` is `repr(u32)` with every value from 0 to `__BPF_FUNC_MAX_ID`
    // defined (the kernel's helper list is dense), checked above.
    Some(unsafe { std::mem::transmute::<u32, bpf_func_id>(id) })
}

/// `BPF_FUNC_map_lookup_elem` as `map_lookup_elem`.
fn helper_name(h: BpfHelper) -> String {
    format!("{h:?}").trim_start_matches("BPF_FUNC_").to_string()
}

/// What the embedded object uses: program types (with their programs), map types, and the
/// helpers called by the programs of each type.
#[derive(Debug, Default)]
struct Uses {
    programs: Vec<(ProgramType, String)>,
    map_types: BTreeSet<String>,
    maps: Vec<(String, MapType)>,
    helpers: Vec<(ProgramType, BpfHelper)>,
}

fn uses(obj: &Object) -> Uses {
    let mut u = Uses::default();
    // Each program linked with the subprograms it reaches (`.text` functions called, and
    // `bpf_loop` callbacks), as the loader links them: a helper counts for the program
    // types whose programs call it, wherever the call is.
    let mut linked = obj.clone();
    let text_sections = linked
        .functions
        .keys()
        .map(|(section, _)| *section)
        .collect();
    let linked_ok = linked.relocate_calls(&text_sections).is_ok();
    let mut names: Vec<&String> = obj.programs.keys().collect();
    names.sort();
    for name in names {
        let p = &obj.programs[name];
        let Some(t) = program_type(&p.section) else {
            continue;
        };
        u.programs.push((t, name.clone()));
        // Unlinked (an object the linker refuses; loading it fails and says so): the
        // functions of the program's own section.
        let functions: Vec<&aya_obj::Function> = if linked_ok {
            linked
                .functions
                .get(&p.function_key())
                .into_iter()
                .collect()
        } else {
            obj.functions
                .values()
                .filter(|f| f.section_index.0 == p.section_index)
                .collect()
        };
        for f in functions {
            for insn in &f.instructions {
                if insn.code == (BPF_JMP | BPF_CALL) as u8
                    && insn.src_reg() == 0
                    && let Some(h) = helper(insn.imm)
                    && !u.helpers.contains(&(t, h))
                {
                    u.helpers.push((t, h));
                }
            }
        }
    }
    let mut maps: Vec<(&String, u32)> = obj.maps.iter().map(|(n, m)| (n, m.map_type())).collect();
    maps.sort();
    for (name, t) in maps {
        if let Some(mt) = loader::map_type(t) {
            u.map_types.insert(format!("{mt:?}"));
            u.maps.push((name.clone(), mt));
        }
    }
    u
}

/// Program type, map type, helper and attach type probes, then a load of every program.
fn programs() -> Vec<CheckResult> {
    const ROOT: &str = "run as root (or with CAP_BPF, CAP_NET_ADMIN and CAP_SYS_ADMIN)";
    if loader::OBJECT.is_empty() {
        return vec![CheckResult::bad(
            "programs",
            Status::Fail,
            "this binary was built without the eBPF object",
            "build it with `cargo xtask build`",
        )];
    }
    let obj = match Object::parse(loader::OBJECT) {
        Ok(o) => o,
        Err(e) => {
            return vec![CheckResult::bad(
                "programs",
                Status::Fail,
                format!("the embedded eBPF object does not parse: {e}"),
                "rebuild with `cargo xtask build`",
            )];
        }
    };
    let u = uses(&obj);
    let mut out = Vec::new();

    // Program types.
    let mut types: Vec<ProgramType> = Vec::new();
    for (t, _) in &u.programs {
        if !types.contains(t) {
            types.push(*t);
        }
    }
    let mut missing = Vec::new();
    let mut errors = Vec::new();
    for t in &types {
        match is_program_supported(*t) {
            Ok(true) => {}
            Ok(false) => missing.push(program_type_name(*t)),
            Err(e) => errors.push(format!("{}: {e}", program_type_name(*t))),
        }
    }
    let names: Vec<&str> = types.iter().map(|t| program_type_name(*t)).collect();
    out.push(probe_result(
        "program types",
        &names.join(", "),
        &missing,
        &errors,
        "a kernel with CONFIG_BPF_SYSCALL and CONFIG_CGROUP_BPF (Linux >= 5.18)",
        ROOT,
    ));

    // Map types.
    let mut missing = Vec::new();
    let mut errors = Vec::new();
    let mut seen: Vec<MapType> = Vec::new();
    for (_, t) in &u.maps {
        if seen.contains(t) {
            continue;
        }
        seen.push(*t);
        match is_map_supported(*t) {
            Ok(true) => {}
            Ok(false) => missing.push(format!("{t:?}")),
            Err(e) => errors.push(format!("{t:?}: {e}")),
        }
    }
    let all: Vec<&str> = u.map_types.iter().map(String::as_str).collect();
    out.push(probe_result(
        "map types",
        &all.join(", "),
        &missing,
        &errors,
        "a newer kernel (Linux >= 5.18)",
        ROOT,
    ));

    // Helpers, per program type.
    let mut missing = Vec::new();
    let mut errors = Vec::new();
    for (t, h) in &u.helpers {
        match is_helper_supported(*t, *h) {
            Ok(true) => {}
            Ok(false) => missing.push(format!("{} in {}", helper_name(*h), program_type_name(*t))),
            Err(e) => errors.push(format!("{}: {e}", helper_name(*h))),
        }
    }
    let all: BTreeSet<String> = u.helpers.iter().map(|(_, h)| helper_name(*h)).collect();
    let all: Vec<String> = all.into_iter().collect();
    out.push(probe_result(
        "helpers",
        &all.join(", "),
        &missing,
        &errors,
        "Linux >= 5.18 (bpf_set_retval)",
        ROOT,
    ));

    // Attach types and the verifier: load every program, attach nothing.
    out.push(match loader::verify_programs() {
        Ok(loaded) => CheckResult::ok(
            "programs",
            format!(
                "{} programs pass the verifier with their attach types: {}",
                loaded.len(),
                loaded.join(", ")
            ),
        ),
        Err(e) => {
            let msg = crate::error_chain(&e);
            let remedy = if msg.contains("Operation not permitted") {
                ROOT.to_string()
            } else {
                format!(
                    "use Linux >= {}.{}; with a newer kernel, report the verifier log above",
                    MIN_KERNEL.0, MIN_KERNEL.1
                )
            };
            CheckResult::bad("programs", Status::Fail, msg, remedy)
        }
    });
    out
}

/// Probe errors (`name: message`) grouped by message, each name once:
/// `bpf_prog_load failed: a, b, c`.
pub fn group_errors(errors: &[String]) -> String {
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for e in errors {
        let (name, msg) = e.split_once(": ").unwrap_or(("", e));
        let msg = msg.replace('`', "");
        let names = match groups.iter_mut().find(|(m, _)| *m == msg) {
            Some((_, names)) => names,
            None => {
                groups.push((msg, Vec::new()));
                &mut groups.last_mut().expect("just pushed").1
            }
        };
        if !name.is_empty() && !names.iter().any(|n| n == name) {
            names.push(name.to_string());
        }
    }
    groups
        .iter()
        .map(|(msg, names)| {
            if names.is_empty() {
                msg.clone()
            } else {
                format!("{msg} for {}", names.join(", "))
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn probe_result(
    check: &'static str,
    all: &str,
    missing: &[impl AsRef<str>],
    errors: &[String],
    newer: &str,
    root: &str,
) -> CheckResult {
    if !missing.is_empty() {
        let m: Vec<&str> = missing.iter().map(AsRef::as_ref).collect();
        return CheckResult::bad(
            check,
            Status::Fail,
            format!("not supported by this kernel: {}", m.join(", ")),
            format!("use {newer}"),
        );
    }
    if !errors.is_empty() {
        return CheckResult::bad(
            check,
            Status::Fail,
            format!("probing failed: {}", group_errors(errors)),
            root,
        );
    }
    CheckResult::ok(check, format!("{all} (probed)"))
}

fn memlock() -> CheckResult {
    // SAFETY: getrlimit(2) into a struct we own.
    let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 {
        return CheckResult::bad(
            "memlock",
            Status::Warn,
            format!("getrlimit: {}", std::io::Error::last_os_error()),
            "nothing to do on Linux >= 5.11",
        );
    }
    let v = if r.rlim_cur == libc::RLIM_INFINITY {
        "unlimited".to_string()
    } else {
        format!("{} KiB", r.rlim_cur / 1024)
    };
    CheckResult::ok(
        "memlock",
        format!(
            "RLIMIT_MEMLOCK {v} (informational: Linux >= 5.11 charges BPF memory to the memory cgroup)"
        ),
    )
}

fn kube_proxy_rules() -> CheckResult {
    const CHECK: &str = "kube-proxy rules";
    let timeout = Duration::from_secs(10);
    let mut found = Vec::new();
    let mut checked = Vec::new();
    let mut not_checked = Vec::new();
    for (tool, args) in [
        ("iptables-save", &[][..]),
        ("ip6tables-save", &[][..]),
        ("nft", &["list", "tables"][..]),
    ] {
        let label = if tool == "nft" {
            "nft list tables".to_string()
        } else {
            tool.to_string()
        };
        match crate::kube_proxy::read_command(tool, args, timeout) {
            None => not_checked.push(format!("{label}: not installed")),
            Some(Err(e)) => not_checked.push(e),
            Some(Ok(out)) => {
                if crate::kube_proxy::found_in(tool, &out) {
                    found.push(if tool == "nft" {
                        "nftables table kube-proxy".to_string()
                    } else {
                        format!("KUBE-SERVICES chain ({tool})")
                    });
                }
                checked.push(label);
            }
        }
    }
    let remedy = "kube-proxy runs or ran on this node: both can run side by side while switching; \
                  once ebpf-proxy serves every node, remove kube-proxy and run `ebpf-proxy kube-proxy cleanup` on each node";
    if !found.is_empty() {
        return CheckResult::bad(
            CHECK,
            Status::Warn,
            format!("found: {}", found.join(", ")),
            remedy,
        );
    }
    if checked.is_empty() {
        // A tool that is installed but failed usually lacks privileges.
        let remedy = if not_checked.iter().all(|e| e.ends_with("not installed")) {
            "install iptables or nftables to check for kube-proxy's rules"
        } else {
            "run `ebpf-proxy check` as root: reading the rules needs CAP_NET_ADMIN"
        };
        return CheckResult::bad(
            CHECK,
            Status::Skip,
            format!("not checked ({})", not_checked.join("; ")),
            remedy,
        );
    }
    let mut detail = format!("none ({})", checked.join(", "));
    if !not_checked.is_empty() {
        let _ = write!(detail, "; not checked: {}", not_checked.join("; "));
    }
    CheckResult::ok(CHECK, detail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn privileges_name_the_missing_capabilities() {
        let status = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n";
        let root = effective_capabilities(status).unwrap();
        assert!(missing_capabilities(root).is_empty());
        assert_eq!(
            missing_capabilities(0),
            ["CAP_BPF", "CAP_NET_ADMIN", "CAP_SYS_ADMIN", "CAP_PERFMON"]
        );
        // CAP_SYS_ADMIN stands in for CAP_BPF and CAP_PERFMON, as in the kernel.
        assert_eq!(missing_capabilities(1 << 21), ["CAP_NET_ADMIN"]);
        // The DaemonSet's set.
        let ds = (1u64 << 39) | (1 << 12) | (1 << 21) | (1 << 38);
        assert!(missing_capabilities(ds).is_empty());
        assert_eq!(
            missing_capabilities((1 << 39) | (1 << 12)),
            ["CAP_SYS_ADMIN", "CAP_PERFMON"]
        );
        assert_eq!(effective_capabilities("Name:\tx\n"), None);
    }

    #[test]
    fn probe_errors_are_grouped_with_each_name_once() {
        let errors: Vec<String> = [
            "map_lookup_elem: `bpf_prog_load` failed",
            "get_socket_cookie: `bpf_prog_load` failed",
            "map_lookup_elem: `bpf_prog_load` failed",
            "set_retval: something else",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            group_errors(&errors),
            "bpf_prog_load failed for map_lookup_elem, get_socket_cookie; something else for set_retval"
        );
    }

    /// The rows of a run without privileges: one failure naming the capabilities and the
    /// remedy, no probe rows repeating it. Run as root, the privileges row is ok.
    #[test]
    fn without_privileges_one_row_says_what_is_missing() {
        let rows = run_checks(&Options {
            bpffs: "/nonexistent-bpffs".into(),
            mount_bpffs: false,
            cgroup: None,
            probe_programs: false,
            tc: crate::datapath::tc::TcSettings::default(),
        });
        let p = rows.iter().find(|r| r.check == "privileges").unwrap();
        let eff =
            effective_capabilities(&std::fs::read_to_string("/proc/self/status").unwrap()).unwrap();
        if missing_capabilities(eff).is_empty() {
            assert_eq!(p.status, Status::Ok, "{p:?}");
            assert!(rows.iter().any(|r| r.check == "kube-proxy rules"));
        } else {
            assert_ne!(p.status, Status::Ok, "{p:?}");
            assert!(p.remedy.as_deref().unwrap().starts_with("run as root"));
            if p.status == Status::Fail {
                assert!(!rows.iter().any(|r| r.check == "kube-proxy rules"));
            }
        }
        let c = rows.iter().find(|r| r.check == "conntrack").unwrap();
        assert!(
            c.detail.starts_with("131072 flows, 40 MiB preallocated"),
            "{c:?}"
        );
    }

    #[test]
    fn kernel_releases() {
        assert_eq!(parse_kernel_release("6.18.44"), Some((6, 18)));
        assert_eq!(parse_kernel_release("5.15.0-91-generic"), Some((5, 15)));
        assert_eq!(parse_kernel_release("5.18-rc1"), Some((5, 18)));
        assert_eq!(parse_kernel_release("6.1+"), Some((6, 1)));
        assert_eq!(parse_kernel_release("garbage"), None);
        assert!(parse_kernel_release("5.17.3").unwrap() < MIN_KERNEL);
        assert!(parse_kernel_release("5.18.0").unwrap() >= MIN_KERNEL);
    }

    #[test]
    fn kube_proxy_rules_are_recognised() {
        let ipt = "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n-A PREROUTING -j KUBE-SERVICES\nCOMMIT\n";
        assert!(crate::kube_proxy::found_in("iptables-save", ipt));
        assert!(!crate::kube_proxy::found_in(
            "iptables-save",
            "*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -m comment --comment KUBE-SERVICES -j ACCEPT\nCOMMIT\n"
        ));
        assert!(crate::kube_proxy::found_in(
            "nft",
            "table ip filter\ntable ip kube-proxy\ntable ip6 kube-proxy\n"
        ));
        assert!(!crate::kube_proxy::found_in(
            "nft",
            "table ip filter\ntable inet kube-proxy-old\n"
        ));
    }

    #[test]
    fn table_is_aligned_with_remedies_under_failures() {
        let rows = vec![
            CheckResult::ok("kernel", "6.18.44"),
            CheckResult::bad(
                "bpffs",
                Status::Fail,
                "/tmp/x is not a BPF file system",
                "mount it",
            ),
        ];
        let t = table(&rows);
        assert_eq!(
            t,
            "CHECK   STATUS  DETAIL\n\
             kernel  ok      6.18.44\n\
             bpffs   fail    /tmp/x is not a BPF file system\n\
             \x20               remedy: mount it\n"
        );
        assert!(failed(&rows));
        assert!(!failed(&rows[..1]));
        let json = serde_json::to_value(&rows).unwrap();
        assert_eq!(json[1]["status"], "fail");
        assert_eq!(json[0]["remedy"], serde_json::Value::Null);
        assert_eq!(
            rows[1].message(),
            "bpffs: /tmp/x is not a BPF file system (remedy: mount it)"
        );
    }

    #[test]
    fn the_object_uses_what_the_docs_say() {
        if loader::OBJECT.is_empty() {
            return;
        }
        let u = uses(&Object::parse(loader::OBJECT).unwrap());
        let progs: Vec<&str> = u.programs.iter().map(|(_, n)| n.as_str()).collect();
        for p in loader::PROGRAMS {
            assert!(progs.contains(&p), "{p} in {progs:?}");
        }
        let helpers: Vec<String> = u.helpers.iter().map(|(_, h)| helper_name(*h)).collect();
        for h in ["set_retval", "get_socket_cookie", "map_lookup_elem"] {
            assert!(helpers.iter().any(|x| x == h), "{h} in {helpers:?}");
        }
        // Helpers called only from subprograms count for the types whose programs reach
        // them, and only for those.
        let of = |t: ProgramType| -> Vec<String> {
            u.helpers
                .iter()
                .filter(|(pt, _)| *pt == t)
                .map(|(_, h)| helper_name(*h))
                .collect()
        };
        let (sock, tc) = (
            of(ProgramType::CgroupSockAddr),
            of(ProgramType::SchedClassifier),
        );
        for h in ["loop", "get_prandom_u32"] {
            assert!(sock.iter().any(|x| x == h), "{h} in {sock:?}");
            assert!(tc.iter().any(|x| x == h), "{h} in {tc:?}");
        }
        assert!(tc.iter().any(|x| x == "fib_lookup"), "{tc:?}");
        assert!(!sock.iter().any(|x| x == "fib_lookup"), "{sock:?}");
        assert!(u.map_types.contains("Hash"), "{:?}", u.map_types);
    }
}

/// Per interface of this network namespace (not `lo`), whether its driver runs XDP
/// natively (`--xdp native`; without it `--xdp best-effort` falls back to generic XDP). The
/// answer is the kernel's own: the `xdp-features` of the generic netlink family `netdev`
/// (Linux >= 6.3, `Documentation/netlink/specs/netdev.yaml`); `basic` (XDP_PASS, DROP,
/// ABORTED in the driver) means native XDP. Informational: never a failure.
fn xdp() -> CheckResult {
    let names: Vec<(String, u32)> = crate::datapath::tc::interface_addresses()
        .map(|m| m.into_keys().collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .filter(|n| n != "lo")
        .filter_map(|n| Some((n.clone(), crate::datapath::tc::if_index(&n)?)))
        .collect();
    let mut parts = Vec::new();
    for (name, index) in &names {
        match netdev::xdp_features(*index) {
            Ok(f) => parts.push(format!(
                "{name}: {}",
                xdp_description(&netdev::describe(f), crate::datapath::veth::is_veth(name))
            )),
            Err(e) => {
                return CheckResult::bad(
                    "xdp",
                    Status::Warn,
                    format!("cannot read the interfaces' XDP features: {e}"),
                    "Linux >= 6.3 reports them (netlink family netdev); --xdp best-effort still works",
                );
            }
        }
    }
    if parts.is_empty() {
        parts.push("no interface besides lo".into());
    }
    CheckResult::ok("xdp", parts.join("; "))
}

/// An interface's XDP row: a native veth gets the condition that makes it usable (see
/// [`crate::datapath::veth`]).
fn xdp_description(features: &str, veth: bool) -> String {
    if veth && features.starts_with("native") {
        format!(
            "{features}, but frames sent back need an XDP program on the peer (veth: --xdp best-effort keeps it on tcx; --xdp native needs --xdp-veth-peers-ready)"
        )
    } else {
        features.to_string()
    }
}

/// The generic netlink family `netdev`: `dev-get` of one interface's `xdp-features`.
mod netdev {
    use std::io;

    const NETLINK_GENERIC: i32 = 16;
    const GENL_ID_CTRL: u16 = 0x10;
    const CTRL_CMD_GETFAMILY: u8 = 3;
    const CTRL_ATTR_FAMILY_ID: u16 = 1;
    const CTRL_ATTR_FAMILY_NAME: u16 = 2;
    const NETDEV_CMD_DEV_GET: u8 = 1;
    const NETDEV_A_DEV_IFINDEX: u16 = 1;
    const NETDEV_A_DEV_XDP_FEATURES: u16 = 3;
    const NLM_F_REQUEST: u16 = 1;
    const NLMSG_ERROR: u16 = 2;
    /// `enum netdev_xdp_act` bits and their names.
    const ACTS: [(u64, &str); 3] = [(1, "basic"), (2, "redirect"), (4, "ndo-xmit")];

    /// "native (basic, redirect, ndo-xmit)" or "generic only".
    pub fn describe(f: u64) -> String {
        if f & 1 == 0 {
            return "generic only (no native XDP in its driver)".into();
        }
        let acts: Vec<&str> = ACTS
            .iter()
            .filter(|(b, _)| f & b != 0)
            .map(|(_, n)| *n)
            .collect();
        format!("native ({})", acts.join(", "))
    }

    /// One netlink request with a genetlink header and attributes; the attributes of the
    /// answer.
    fn request(
        fd: i32,
        ty: u16,
        cmd: u8,
        attrs: &[(u16, &[u8])],
    ) -> io::Result<Vec<(u16, Vec<u8>)>> {
        let mut msg = vec![0u8; 20];
        for (t, v) in attrs {
            let len = 4 + v.len();
            msg.extend_from_slice(&(len as u16).to_ne_bytes());
            msg.extend_from_slice(&t.to_ne_bytes());
            msg.extend_from_slice(v);
            msg.resize(msg.len().next_multiple_of(4), 0);
        }
        let total = msg.len() as u32;
        msg[0..4].copy_from_slice(&total.to_ne_bytes());
        msg[4..6].copy_from_slice(&ty.to_ne_bytes());
        msg[6..8].copy_from_slice(&NLM_F_REQUEST.to_ne_bytes());
        msg[16] = cmd;
        msg[17] = 1; // version
        // SAFETY: send(2)/recv(2) of buffers we own on a socket we own.
        let sent = unsafe { libc::send(fd, msg.as_ptr().cast(), msg.len(), 0) };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut buf = vec![0u8; 8192];
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        parse_reply(&buf[..n as usize])
    }

    /// The attributes of a genetlink answer, or the error it carries.
    pub(super) fn parse_reply(b: &[u8]) -> io::Result<Vec<(u16, Vec<u8>)>> {
        let bad = || io::Error::new(io::ErrorKind::InvalidData, "short netlink answer");
        if b.len() < 16 {
            return Err(bad());
        }
        let len = (u32::from_ne_bytes(b[0..4].try_into().unwrap()) as usize).min(b.len());
        let ty = u16::from_ne_bytes(b[4..6].try_into().unwrap());
        if ty == NLMSG_ERROR {
            let code = i32::from_ne_bytes(b.get(16..20).ok_or_else(bad)?.try_into().unwrap());
            return Err(io::Error::from_raw_os_error(-code));
        }
        let mut out = Vec::new();
        let mut off = 20;
        while off + 4 <= len {
            let alen = u16::from_ne_bytes(b[off..off + 2].try_into().unwrap()) as usize;
            let aty = u16::from_ne_bytes(b[off + 2..off + 4].try_into().unwrap()) & 0x3fff;
            if alen < 4 || off + alen > len {
                break;
            }
            out.push((aty, b[off + 4..off + alen].to_vec()));
            off += alen.next_multiple_of(4);
        }
        Ok(out)
    }

    /// The `xdp-features` bit set of interface `ifindex`.
    pub fn xdp_features(ifindex: u32) -> io::Result<u64> {
        // SAFETY: a netlink socket we close below.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                NETLINK_GENERIC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let r = (|| {
            let fam = request(
                fd,
                GENL_ID_CTRL,
                CTRL_CMD_GETFAMILY,
                &[(CTRL_ATTR_FAMILY_NAME, b"netdev\0")],
            )?;
            let id = fam
                .iter()
                .find(|(t, v)| *t == CTRL_ATTR_FAMILY_ID && v.len() >= 2)
                .map(|(_, v)| u16::from_ne_bytes([v[0], v[1]]))
                .ok_or_else(|| io::Error::other("no netlink family netdev"))?;
            let dev = request(
                fd,
                id,
                NETDEV_CMD_DEV_GET,
                &[(NETDEV_A_DEV_IFINDEX, &ifindex.to_ne_bytes())],
            )?;
            dev.iter()
                .find(|(t, v)| *t == NETDEV_A_DEV_XDP_FEATURES && v.len() >= 8)
                .map(|(_, v)| u64::from_ne_bytes(v[..8].try_into().unwrap()))
                .ok_or_else(|| io::Error::other("no xdp-features in the answer"))
        })();
        // SAFETY: our own socket.
        unsafe { libc::close(fd) };
        r
    }
}

#[cfg(test)]
mod xdp_tests {
    use super::netdev::{describe, parse_reply};

    #[test]
    fn a_native_veth_is_flagged() {
        assert_eq!(
            super::xdp_description("native (basic)", false),
            "native (basic)"
        );
        let v = super::xdp_description("native (basic, redirect, ndo-xmit)", true);
        assert!(
            v.starts_with("native (basic, redirect, ndo-xmit), but frames sent back need an XDP program on the peer"),
            "{v}"
        );
        assert_eq!(
            super::xdp_description("generic only (no native XDP in its driver)", true),
            "generic only (no native XDP in its driver)"
        );
    }

    #[test]
    fn xdp_features_are_read_from_a_netdev_answer() {
        // nlmsghdr (len 36, type 0x20), genl header, then ifindex 4 and xdp-features 7.
        let mut b = vec![0u8; 20];
        b.extend_from_slice(&8u16.to_ne_bytes());
        b.extend_from_slice(&1u16.to_ne_bytes());
        b.extend_from_slice(&4u32.to_ne_bytes());
        b.extend_from_slice(&12u16.to_ne_bytes());
        b.extend_from_slice(&3u16.to_ne_bytes());
        b.extend_from_slice(&7u64.to_ne_bytes());
        let len = b.len() as u32;
        b[0..4].copy_from_slice(&len.to_ne_bytes());
        b[4..6].copy_from_slice(&0x20u16.to_ne_bytes());
        let attrs = parse_reply(&b).unwrap();
        assert_eq!(attrs[1], (3, 7u64.to_ne_bytes().to_vec()));
        assert_eq!(describe(7), "native (basic, redirect, ndo-xmit)");
        assert!(describe(0).starts_with("generic only"));
        // An error answer: -ENODEV.
        let mut e = vec![0u8; 20];
        e[0..4].copy_from_slice(&20u32.to_ne_bytes());
        e[4..6].copy_from_slice(&2u16.to_ne_bytes());
        e[16..20].copy_from_slice(&(-19i32).to_ne_bytes());
        assert_eq!(parse_reply(&e).unwrap_err().raw_os_error(), Some(19));
    }
}
