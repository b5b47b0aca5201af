//! The node's kernel and file systems: the kernel version, BTF, bpffs, cgroup v2, and the
//! locked-memory limit.

use std::path::Path;

use super::{CheckResult, Options, Status};
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

pub(super) fn kernel() -> CheckResult {
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

pub(super) fn btf() -> CheckResult {
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

pub(super) fn bpffs(opts: &Options) -> CheckResult {
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

pub(super) fn cgroup(opts: &Options) -> CheckResult {
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

pub(super) fn memlock() -> CheckResult {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
