//! kube-proxy's rules on this node (iptables, ip6tables, nftables): found means kube-proxy
//! runs or ran here.

use std::{fmt::Write as _, time::Duration};

use super::{CheckResult, Status};

pub(super) fn kube_proxy_rules() -> CheckResult {
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
}
