//! The errors of a load, worded with the step that failed (load, verify, pin) and a remedy.

use aya::{EbpfError, maps::MapError, programs::ProgramError};

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

/// The error of the object load (maps created, adopted and pinned), naming the step.
pub(super) fn load_error(e: EbpfError, pinned: bool) -> anyhow::Error {
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
pub(super) fn program_load_error(prog: &str, e: ProgramError) -> anyhow::Error {
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

#[cfg(test)]
mod tests {
    use super::*;

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
