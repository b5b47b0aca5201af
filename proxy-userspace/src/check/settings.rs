//! What a setting asks of the node: the memory of the conntrack table (`--conntrack-*`),
//! sock_diag's `SOCK_DESTROY` (`--close-connections-to-removed-endpoints`).

use super::{CheckResult, Status};

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
