//! The capabilities the agent needs, from this process's effective set.

use super::{CheckResult, Status};

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
pub(super) fn privileges() -> CheckResult {
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
}
