//! kube-proxy's rules on this node: whether they are there (the preflight's warning), whether
//! kube-proxy has programmed them (the rollback's wait), and their removal once ebpf-proxy
//! serves the node (`ebpf-proxy kube-proxy cleanup`, as `kube-proxy --cleanup` does).
//!
//! What kube-proxy writes (kubernetes `pkg/proxy/iptables/proxier.go` and
//! `pkg/proxy/nftables/proxier.go`):
//! - iptables mode, per family and per backend (iptables-nft or iptables-legacy): the canary
//!   chain `KUBE-PROXY-CANARY` in the mangle, nat and filter tables (created at start and
//!   watched to detect a flush), and in nat and filter the `KUBE-SERVICES`, `KUBE-NODEPORTS`,
//!   `KUBE-POSTROUTING`, `KUBE-EXTERNAL-SERVICES`, `KUBE-FORWARD`, `KUBE-PROXY-FIREWALL`
//!   chains and one `KUBE-SVC-`, `KUBE-SEP-`, `KUBE-EXT-`, `KUBE-SVL-`, `KUBE-FW-` (and the
//!   older `KUBE-XLB-`) chain per Service port and endpoint, reached by jumps from the
//!   built-in chains. Every full sync ends `KUBE-SERVICES` (nat) with the jump to
//!   `KUBE-NODEPORTS`, so that rule marks the first sync done.
//! - nftables mode: the tables `ip kube-proxy` and `ip6 kube-proxy`, written whole by the
//!   first sync (chain `services`, map `service-ips`).
//!
//! The kubelet's own chains (`KUBE-KUBELET-CANARY`, `KUBE-FIREWALL`, `KUBE-IPTABLES-HINT`,
//! and the older `KUBE-MARK-DROP`/`KUBE-MARK-MASQ`) are left alone, as kube-proxy's cleanup
//! leaves them.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{Read, Write},
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

/// Chains kube-proxy owns by name (iptables mode).
const OWNED_CHAINS: [&str; 7] = [
    "KUBE-SERVICES",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-POSTROUTING",
    "KUBE-FORWARD",
    "KUBE-PROXY-FIREWALL",
    "KUBE-PROXY-CANARY",
];
/// Prefixes of kube-proxy's per-Service and per-endpoint chains.
const OWNED_PREFIXES: [&str; 6] = [
    "KUBE-SVC-",
    "KUBE-SEP-",
    "KUBE-EXT-",
    "KUBE-SVL-",
    "KUBE-FW-",
    "KUBE-XLB-",
];
/// kube-proxy's canary chain.
pub(crate) const CANARY: &str = "KUBE-PROXY-CANARY";
/// The comment of the rule that ends every full sync of `KUBE-SERVICES` (nat).
const NODEPORTS_LAST_RULE: &str = "-j KUBE-NODEPORTS";

/// Whether kube-proxy owns the iptables chain `name`.
pub fn owned_chain(name: &str) -> bool {
    OWNED_CHAINS.contains(&name) || OWNED_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// One table of `iptables-save` output: chain name -> its rules (the text after
/// `-A CHAIN `), in order. Built-in chains are included.
pub(crate) type Table = BTreeMap<String, Vec<String>>;

/// Parses `iptables-save` output into tables (`nat`, `filter`, ...).
pub fn parse_iptables_save(text: &str) -> BTreeMap<String, Table> {
    let mut out: BTreeMap<String, Table> = BTreeMap::new();
    let mut table: Option<String> = None;
    for line in text.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = Some(t.trim().to_string());
            out.entry(t.trim().to_string()).or_default();
            continue;
        }
        let Some(t) = &table else { continue };
        let chains = out.get_mut(t).expect("created above");
        if let Some(decl) = line.strip_prefix(':') {
            if let Some(name) = decl.split_whitespace().next() {
                chains.entry(name.to_string()).or_default();
            }
        } else if let Some(rule) = line.strip_prefix("-A ") {
            if let Some((chain, spec)) = rule.split_once(' ') {
                chains
                    .entry(chain.to_string())
                    .or_default()
                    .push(spec.to_string());
            }
        } else if line == "COMMIT" {
            table = None;
        }
    }
    out
}

/// The chain a rule jumps or goes to (`-j X` / `-g X`).
fn target(rule: &str) -> Option<&str> {
    let mut it = rule.split_whitespace();
    while let Some(w) = it.next() {
        if w == "-j" || w == "-g" || w == "--jump" || w == "--goto" {
            return it.next();
        }
    }
    None
}

/// What one `iptables-save` view holds of kube-proxy's.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct IptablesState {
    /// kube-proxy's chains, by table.
    pub(crate) chains: BTreeMap<String, BTreeSet<String>>,
    /// The canary chain exists (kube-proxy runs, or ran).
    pub canary: bool,
    /// `KUBE-SERVICES` (nat) ends with the jump to `KUBE-NODEPORTS`: a full sync happened.
    pub synced: bool,
    /// Service port rules in `KUBE-SERVICES` (nat).
    pub(crate) service_rules: usize,
}

/// kube-proxy's state in one parsed `iptables-save` output.
pub fn iptables_state(tables: &BTreeMap<String, Table>) -> IptablesState {
    let mut s = IptablesState::default();
    for (name, chains) in tables {
        let owned: BTreeSet<String> = chains.keys().filter(|c| owned_chain(c)).cloned().collect();
        if owned.contains(CANARY) {
            s.canary = true;
        }
        if !owned.is_empty() {
            s.chains.insert(name.clone(), owned);
        }
    }
    if let Some(services) = tables.get("nat").and_then(|t| t.get("KUBE-SERVICES")) {
        s.synced = services
            .last()
            .is_some_and(|r| r.trim_end().ends_with(NODEPORTS_LAST_RULE));
        s.service_rules = services
            .iter()
            .filter(|r| {
                target(r).is_some_and(|t| {
                    t.starts_with("KUBE-SVC-")
                        || t.starts_with("KUBE-EXT-")
                        || t.starts_with("KUBE-FW-")
                        || t.starts_with("KUBE-SVL-")
                })
            })
            .count();
    }
    s
}

/// The `iptables-restore --noflush` input that removes kube-proxy's chains from `tables`
/// (`None` when there are none): per table, the jumps to them from other chains are deleted,
/// then each is flushed (declared) and deleted, in one transaction per table.
pub fn iptables_cleanup(tables: &BTreeMap<String, Table>) -> Option<String> {
    let mut out = String::new();
    for (name, chains) in tables {
        let owned: Vec<&String> = chains.keys().filter(|c| owned_chain(c)).collect();
        if owned.is_empty() {
            continue;
        }
        out.push_str(&format!("*{name}\n"));
        for c in &owned {
            out.push_str(&format!(":{c} - [0:0]\n"));
        }
        for (chain, rules) in chains {
            if owned_chain(chain) {
                continue;
            }
            for r in rules {
                if target(r).is_some_and(owned_chain) {
                    out.push_str(&format!("-D {chain} {r}\n"));
                }
            }
        }
        for c in &owned {
            out.push_str(&format!("-X {c}\n"));
        }
        out.push_str("COMMIT\n");
    }
    (!out.is_empty()).then_some(out)
}

/// The tables named `kube-proxy` in `nft list tables` output, as `FAMILY kube-proxy`.
pub(crate) fn nft_tables(list: &str) -> Vec<String> {
    list.lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            match (it.next(), it.next(), it.next()) {
                (Some("table"), Some(family), Some("kube-proxy")) => {
                    Some(format!("{family} kube-proxy"))
                }
                _ => None,
            }
        })
        .collect()
}

/// Whether an `nft list table FAMILY kube-proxy` listing is of a synced kube-proxy: its
/// `services` chain and `service-ips` map exist (the first sync writes the table whole).
pub(crate) fn nft_synced(listing: &str) -> bool {
    let has = |what: &str| {
        listing
            .lines()
            .any(|l| l.trim_start().starts_with(what) && l.contains('{'))
    };
    has("chain services ") && has("map service-ips ")
}

/// Whether kube-proxy's rules are present, from the output of `iptables-save` /
/// `ip6tables-save` (a `KUBE-SERVICES` chain) or `nft list tables` (a table named
/// `kube-proxy`). `tool` names which.
pub(crate) fn found_in(tool: &str, output: &str) -> bool {
    if tool == "nft" {
        !nft_tables(output).is_empty()
    } else {
        output
            .lines()
            .any(|l| l.starts_with(":KUBE-SERVICES ") || l.starts_with("-N KUBE-SERVICES"))
    }
}

/// Runs a read-only command for at most `timeout`; `None` when it is not installed.
pub(crate) fn read_command(
    program: &str,
    args: &[&str],
    timeout: Duration,
) -> Option<Result<String, String>> {
    run_command(program, args, None, timeout)
}

/// Runs `program` with `input` on its standard input (if any), for at most `timeout`.
/// `None` when it is not installed; `Err` with its standard error when it fails.
fn run_command(
    program: &str,
    args: &[&str],
    input: Option<&str>,
    timeout: Duration,
) -> Option<Result<String, String>> {
    let mut child = match Command::new(program)
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => return Some(Err(format!("{program}: {e}"))),
    };
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        let text = text.to_string();
        std::thread::spawn(move || {
            let _ = stdin.write_all(text.as_bytes());
        });
    }
    let read = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let _ = r.read_to_string(&mut s);
            }
            s
        })
    };
    let out = read(
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    );
    let err = read(
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    );
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Ok(s),
            Ok(None) if start.elapsed() < timeout => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                break Err(format!("{program} did not finish within {timeout:?}"));
            }
            Err(e) => break Err(format!("{program}: {e}")),
        }
    };
    let (out, err) = (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    );
    Some(match status {
        Ok(s) if s.success() => Ok(out),
        Ok(s) => Err(format!("{program} failed ({s}): {}", err.trim())),
        Err(e) => Err(e),
    })
}

const TOOL_TIMEOUT: Duration = Duration::from_secs(30);

/// One iptables view of the node: a backend and a family, with its save and restore tools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct IptablesView {
    /// e.g. `iptables-nft (IPv4)`.
    pub(crate) label: String,
    save: &'static str,
    restore: &'static str,
}

/// The iptables views to read: the nft backend (`iptables-nft-save`, else `iptables-save`)
/// for both families, and the legacy backend when the kernel has legacy tables loaded
/// (`/proc/net/ip_tables_names` non-empty: reading it otherwise would load the modules).
fn iptables_views() -> Vec<IptablesView> {
    let has = |p: &str| which(p);
    let mut out = Vec::new();
    for (family, nft, plain, restore_nft, restore_plain, legacy, legacy_restore, names) in [
        (
            "IPv4",
            "iptables-nft-save",
            "iptables-save",
            "iptables-nft-restore",
            "iptables-restore",
            "iptables-legacy-save",
            "iptables-legacy-restore",
            "/proc/net/ip_tables_names",
        ),
        (
            "IPv6",
            "ip6tables-nft-save",
            "ip6tables-save",
            "ip6tables-nft-restore",
            "ip6tables-restore",
            "ip6tables-legacy-save",
            "ip6tables-legacy-restore",
            "/proc/net/ip6_tables_names",
        ),
    ] {
        if has(nft) && has(restore_nft) {
            out.push(IptablesView {
                label: format!("iptables-nft ({family})"),
                save: nft,
                restore: restore_nft,
            });
        } else if has(plain) && has(restore_plain) {
            out.push(IptablesView {
                label: format!("{plain} ({family})"),
                save: plain,
                restore: restore_plain,
            });
        }
        let legacy_loaded = std::fs::read_to_string(names).is_ok_and(|s| !s.trim().is_empty());
        if legacy_loaded && has(legacy) && has(legacy_restore) {
            out.push(IptablesView {
                label: format!("iptables-legacy ({family})"),
                save: legacy,
                restore: legacy_restore,
            });
        }
    }
    out
}

/// `program` is on `PATH`.
fn which(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|d| d.join(program).is_file()))
}

/// What kube-proxy has on this node.
#[derive(Debug, Default)]
pub struct Found {
    /// Per iptables view read: its label and state.
    pub(crate) iptables: Vec<(String, IptablesState)>,
    /// nftables tables named kube-proxy, with whether each is synced.
    pub(crate) nft: Vec<(String, bool)>,
    /// `nft list tables` was read (nft is installed and answered).
    pub(crate) nft_read: bool,
    /// Views or tools that could not be read, with why.
    pub(crate) unreadable: Vec<String>,
}

impl Found {
    /// kube-proxy has programmed this node: an iptables view with the canary and a full
    /// sync, or a synced nftables table.
    pub fn programmed(&self) -> bool {
        self.iptables.iter().any(|(_, s)| s.canary && s.synced) || self.nft.iter().any(|(_, s)| *s)
    }

    /// Any of kube-proxy's rules are present.
    pub fn any(&self) -> bool {
        self.iptables.iter().any(|(_, s)| !s.chains.is_empty()) || !self.nft.is_empty()
    }

    /// One line per view.
    pub fn describe(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (label, s) in &self.iptables {
            if s.chains.is_empty() {
                out.push(format!("{label}: no kube-proxy chain"));
                continue;
            }
            let n: usize = s.chains.values().map(BTreeSet::len).sum();
            out.push(format!(
                "{label}: {n} kube-proxy chains, canary {}, {} (KUBE-SERVICES: {} service rules)",
                if s.canary { "present" } else { "absent" },
                if s.synced { "synced" } else { "no full sync" },
                s.service_rules
            ));
        }
        if self.nft_read && self.nft.is_empty() {
            out.push("nftables: no kube-proxy table".to_string());
        }
        for (t, synced) in &self.nft {
            out.push(format!(
                "nftables table {t}: {}",
                if *synced {
                    "synced (chain services, map service-ips)"
                } else {
                    "present, not synced"
                }
            ));
        }
        for u in &self.unreadable {
            out.push(format!("not read: {u}"));
        }
        out
    }
}

/// Reads kube-proxy's rules on this node (the network namespace this process runs in).
pub(crate) fn read() -> Found {
    let mut f = Found::default();
    for v in iptables_views() {
        match read_command(v.save, &[], TOOL_TIMEOUT) {
            Some(Ok(text)) => f
                .iptables
                .push((v.label.clone(), iptables_state(&parse_iptables_save(&text)))),
            Some(Err(e)) => f.unreadable.push(format!("{}: {e}", v.label)),
            None => {}
        }
    }
    match read_command("nft", &["list", "tables"], TOOL_TIMEOUT) {
        Some(Ok(list)) => {
            f.nft_read = true;
            for t in nft_tables(&list) {
                let (family, name) = t.split_once(' ').expect("FAMILY NAME");
                let synced =
                    match read_command("nft", &["list", "table", family, name], TOOL_TIMEOUT) {
                        Some(Ok(listing)) => nft_synced(&listing),
                        _ => false,
                    };
                f.nft.push((t, synced));
            }
        }
        Some(Err(e)) => f.unreadable.push(format!("nft: {e}")),
        None => {}
    }
    if f.iptables.is_empty() && !f.unreadable.iter().any(|u| u.starts_with("nft")) && !which("nft")
    {
        f.unreadable
            .push("neither iptables nor nft is installed".to_string());
    }
    f
}

/// Waits until kube-proxy has programmed this node (see [`Found::programmed`]), reading
/// every `interval` for at most `wait`. Returns the last reading.
pub fn wait_programmed(wait: Duration, interval: Duration) -> Found {
    let deadline = Instant::now() + wait;
    loop {
        let f = read();
        if f.programmed() || Instant::now() >= deadline {
            return f;
        }
        std::thread::sleep(interval.min(deadline.saturating_duration_since(Instant::now())));
    }
}

/// Processes of this PID namespace that are kube-proxy itself (named `kube-proxy` and not
/// an ebpf-proxy binary, which answers to that name too): `pid exe` each.
pub(crate) fn running_kube_proxies(proc: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(proc) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|p| p.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        if comm.trim() != "kube-proxy" {
            continue;
        }
        let exe = std::fs::read_link(e.path().join("exe"))
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| "(unreadable)".into());
        if exe.trim_end_matches(" (deleted)").ends_with("/ebpf-proxy") {
            continue;
        }
        out.push(format!("{pid} {exe}"));
    }
    out.sort();
    out
}

/// What [`cleanup`] did, one line each.
pub(crate) type Report = Vec<String>;

/// Removes kube-proxy's rules from this node: its chains in every iptables view and its
/// nftables tables (`dry_run`: only says what it would remove). The IPVS mode's virtual
/// servers and `kube-ipvs0` interface are reported, not removed (no IPVS tool in the
/// image).
///
/// Errors: a rule set could not be read or rewritten (the others are still done; the error
/// lists every failure).
pub fn cleanup(dry_run: bool) -> Result<Report> {
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for v in iptables_views() {
        let text = match read_command(v.save, &[], TOOL_TIMEOUT) {
            Some(Ok(t)) => t,
            Some(Err(e)) => {
                failures.push(format!("{}: {e}", v.label));
                continue;
            }
            None => continue,
        };
        let tables = parse_iptables_save(&text);
        let Some(input) = iptables_cleanup(&tables) else {
            report.push(format!("{}: no kube-proxy chain", v.label));
            continue;
        };
        let n: usize = iptables_state(&tables)
            .chains
            .values()
            .map(BTreeSet::len)
            .sum();
        if dry_run {
            report.push(format!("{}: would remove {n} chains", v.label));
            continue;
        }
        match run_command(v.restore, &["--noflush"], Some(&input), TOOL_TIMEOUT) {
            Some(Ok(_)) => report.push(format!("{}: removed {n} chains", v.label)),
            Some(Err(e)) => failures.push(format!("{}: {e}", v.label)),
            None => failures.push(format!("{}: {} is not installed", v.label, v.restore)),
        }
    }
    match read_command("nft", &["list", "tables"], TOOL_TIMEOUT) {
        Some(Ok(list)) => {
            for t in nft_tables(&list) {
                if dry_run {
                    report.push(format!("nftables: would delete table {t}"));
                    continue;
                }
                let (family, name) = t.split_once(' ').expect("FAMILY NAME");
                match run_command(
                    "nft",
                    &["delete", "table", family, name],
                    None,
                    TOOL_TIMEOUT,
                ) {
                    Some(Ok(_)) => report.push(format!("nftables: deleted table {t}")),
                    Some(Err(e)) => failures.push(format!("nftables table {t}: {e}")),
                    None => {}
                }
            }
        }
        Some(Err(e)) => failures.push(format!("nft: {e}")),
        None => {}
    }
    if std::fs::read_to_string("/proc/net/ip_vs").is_ok_and(|s| s.lines().count() > 3) {
        report.push("IPVS virtual servers are present: remove them with `ipvsadm --clear` (ebpf-proxy's image has no IPVS tool)".into());
    }
    if Path::new("/sys/class/net/kube-ipvs0").exists() {
        report.push("interface kube-ipvs0 (IPVS mode) is present: remove it with `ip link delete kube-ipvs0`".into());
    }
    if !failures.is_empty() {
        bail!("{}", failures.join("; "));
    }
    Ok(report)
}

/// The gates of `ebpf-proxy kube-proxy cleanup` (unless `--force`): kube-proxy no longer runs
/// here, and the agent at `status` serves the node, north-south included.
///
/// Errors: a gate is not passed, naming why and what to do.
pub fn check_gates(proc: &Path, status: std::net::SocketAddr) -> Result<()> {
    let running = running_kube_proxies(proc);
    if !running.is_empty() {
        bail!(
            "kube-proxy still runs on this node ({}): delete its DaemonSet first (it would write its rules again); --force skips this check",
            running.join(", ")
        );
    }
    let st = crate::status::fetch(status, Duration::from_secs(5)).context(
        "the ebpf-proxy agent of this node must serve it before kube-proxy's rules go (--force skips this check)",
    )?;
    let unmet = crate::status::unmet(
        &st,
        &[
            crate::status::Requirement::Synced,
            crate::status::Requirement::NorthSouth,
        ],
    );
    if !unmet.is_empty() {
        bail!(
            "the ebpf-proxy agent of this node does not serve everything kube-proxy's rules do: {}; --force removes them anyway",
            unmet.join("; ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAVE: &str = "# Generated by iptables-nft-save
*mangle
:PREROUTING ACCEPT [0:0]
:KUBE-IPTABLES-HINT - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-PROXY-CANARY - [0:0]
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-PROXY-CANARY - [0:0]
-A INPUT -j KUBE-FIREWALL
-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -j DROP
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-NPX46M4PTMTKRN6Y - [0:0]
:KUBE-SEP-ABC - [0:0]
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING
-A POSTROUTING -o eth9 -j MASQUERADE
-A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m comment --comment \"default/kubernetes:https cluster IP\" -m tcp --dport 443 -j KUBE-SVC-NPX46M4PTMTKRN6Y
-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-SVC-NPX46M4PTMTKRN6Y -j KUBE-SEP-ABC
-A KUBE-SEP-ABC -p tcp -j DNAT --to-destination 192.0.2.10:6443
COMMIT
";

    #[test]
    fn a_synced_kube_proxy_is_recognised() {
        let t = parse_iptables_save(SAVE);
        let s = iptables_state(&t);
        assert!(s.canary && s.synced);
        assert_eq!(s.service_rules, 1);
        assert_eq!(
            s.chains["nat"]
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
            [
                "KUBE-NODEPORTS",
                "KUBE-POSTROUTING",
                "KUBE-SEP-ABC",
                "KUBE-SERVICES",
                "KUBE-SVC-NPX46M4PTMTKRN6Y"
            ]
        );
        assert!(!s.chains["mangle"].contains("KUBE-KUBELET-CANARY"));
        // Before the first sync: the canary alone.
        let early =
            "*mangle\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n*nat\n:KUBE-SERVICES - [0:0]\nCOMMIT\n";
        let s = iptables_state(&parse_iptables_save(early));
        assert!(s.canary && !s.synced);
        assert!(found_in("iptables-save", SAVE));
        assert!(!found_in(
            "iptables-save",
            "*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n"
        ));
    }

    #[test]
    fn cleanup_removes_kube_proxys_chains_and_jumps_only() {
        let t = parse_iptables_save(SAVE);
        let input = iptables_cleanup(&t).unwrap();
        // Jumps from built-in chains go; other rules and the kubelet's chains stay.
        assert!(input.contains(
            "-D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n"
        ));
        assert!(input.contains(
            "-D FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n"
        ));
        assert!(!input.contains("MASQUERADE"), "{input}");
        assert!(!input.contains("KUBE-FIREWALL"), "{input}");
        assert!(!input.contains("KUBE-KUBELET-CANARY"), "{input}");
        assert!(!input.contains("KUBE-MARK-MASQ"), "{input}");
        for c in [
            "KUBE-SVC-NPX46M4PTMTKRN6Y",
            "KUBE-SEP-ABC",
            "KUBE-NODEPORTS",
            "KUBE-PROXY-CANARY",
        ] {
            assert!(input.contains(&format!(":{c} - [0:0]\n")), "{c}");
            assert!(input.contains(&format!("-X {c}\n")), "{c}");
        }
        // Per table: declarations (flush) first, then jumps removed, then deletions.
        let nat = &input[input.find("*nat").unwrap()..];
        assert!(nat.find(":KUBE-SERVICES").unwrap() < nat.find("-D PREROUTING").unwrap());
        assert!(nat.find("-D PREROUTING").unwrap() < nat.find("-X KUBE-SERVICES").unwrap());
        assert_eq!(input.matches("COMMIT").count(), 3);
        assert_eq!(
            iptables_cleanup(&parse_iptables_save(
                "*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n"
            )),
            None
        );
    }

    #[test]
    fn nftables_tables_and_their_sync() {
        let list = "table ip filter\ntable ip kube-proxy\ntable ip6 kube-proxy\ntable inet kube-proxy-old\n";
        assert_eq!(nft_tables(list), ["ip kube-proxy", "ip6 kube-proxy"]);
        assert!(found_in("nft", list));
        assert!(!found_in("nft", "table ip filter\n"));
        let listing = "table ip kube-proxy {\n\tcomment \"rules for kube-proxy\"\n\tmap service-ips {\n\t\ttype ipv4_addr . inet_proto . inet_service : verdict\n\t}\n\tchain services {\n\t\tip daddr . meta l4proto . th dport vmap @service-ips\n\t}\n}\n";
        assert!(nft_synced(listing));
        assert!(!nft_synced("table ip kube-proxy {\n}\n"));
    }

    #[test]
    fn running_kube_proxy_is_told_from_ebpf_proxy_under_its_name() {
        let proc = tempfile::tempdir().unwrap();
        let mk = |pid: &str, comm: &str, exe: &str| {
            let d = proc.path().join(pid);
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join("comm"), format!("{comm}\n")).unwrap();
            std::os::unix::fs::symlink(exe, d.join("exe")).unwrap();
        };
        mk("10", "kube-proxy", "/usr/local/bin/kube-proxy");
        mk("11", "kube-proxy", "/usr/local/bin/ebpf-proxy");
        mk("12", "bash", "/bin/bash");
        std::fs::create_dir(proc.path().join("self")).unwrap();
        assert_eq!(
            running_kube_proxies(proc.path()),
            ["10 /usr/local/bin/kube-proxy"]
        );
    }
}
