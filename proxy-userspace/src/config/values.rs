//! The value types of the settings and their syntaxes, shared by the flags (`flags.rs`)
//! and the configuration file (`file.rs`), so that a value is checked by one rule
//! whichever way it is given: CIDR lists, NodePort addresses, proxy modes, IPVS schedulers,
//! server addresses, log formats, durations and ranged numbers.

use std::{
    fmt,
    net::{IpAddr, SocketAddr},
    str::FromStr,
    time::Duration,
};

use anyhow::{Result, bail};
use ipnet::IpNet;
use proxy_common::Algorithm;

use super::defaults::{MAX_CONNTRACK_FLOWS, MAX_PERIOD, MIN_CONNTRACK_FLOWS};
use super::go::parse_go_duration;

/// Log output format (`--log-format`, `--logging-format`, `logging.format` in the file).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per line (tracing-subscriber's JSON format).
    Json,
}

impl LogFormat {
    /// The name in flags and the file: `text` or `json`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }

    /// The format of a name as the file's `logging.format` takes it (the flags' by clap);
    /// `None` for another name.
    pub(crate) fn from_name(name: &str) -> Option<LogFormat> {
        [LogFormat::Text, LogFormat::Json]
            .into_iter()
            .find(|f| f.name() == name)
    }
}

/// A comma-separated list of CIDRs (`--cluster-cidr`, `clusterCIDR`): one CIDR, or an IPv4
/// and an IPv6 one for dual-stack clusters, as kube-proxy accepts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterCidrs(pub Vec<IpNet>);

impl FromStr for ClusterCidrs {
    type Err = String;

    /// Empty (a flag filled from an empty variable, kube-proxy's default) is the empty list:
    /// no cluster CIDR.
    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim().is_empty() {
            return Ok(Self(Vec::new()));
        }
        let cidrs = s
            .split(',')
            .map(|c| {
                c.trim()
                    .parse::<IpNet>()
                    .map_err(|_| format!("{:?} is not a CIDR (e.g. 10.244.0.0/16)", c.trim()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        match cidrs.as_slice() {
            [_] => {}
            [a, b] if a.addr().is_ipv4() != b.addr().is_ipv4() => {}
            _ => {
                return Err(format!(
                    "{s:?}: give one CIDR, or an IPv4 and an IPv6 CIDR separated by a comma"
                ));
            }
        }
        Ok(Self(cidrs))
    }
}

impl fmt::Display for ClusterCidrs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&v.join(","))
    }
}

/// Where NodePorts would be served (`--nodeport-addresses`, `nodePortAddresses`): the
/// keyword `primary` (the node's primary addresses) alone, or a list of CIDRs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// The Node object's primary IPv4 and/or IPv6 addresses.
    Primary,
    /// Node addresses within these CIDRs.
    Cidrs(Vec<IpNet>),
}

impl NodePortAddresses {
    /// Parses the list form of the file (each item a CIDR or `primary`).
    pub fn from_items<S: AsRef<str>>(items: &[S]) -> Result<Self, String> {
        let items: Vec<&str> = items.iter().map(|s| s.as_ref().trim()).collect();
        if items.contains(&"primary") {
            if items.len() != 1 {
                return Err("\"primary\" cannot be combined with CIDRs".into());
            }
            return Ok(Self::Primary);
        }
        if items.is_empty() {
            return Err("the list is empty".into());
        }
        items
            .iter()
            .map(|c| {
                c.parse::<IpNet>().map_err(|_| {
                    format!("{c:?} is not a CIDR (e.g. 192.0.2.0/24) or the keyword \"primary\"")
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Self::Cidrs)
    }

    /// The list form of the file.
    pub fn items(&self) -> Vec<String> {
        match self {
            Self::Primary => vec!["primary".into()],
            Self::Cidrs(c) => c.iter().map(ToString::to_string).collect(),
        }
    }
}

impl FromStr for NodePortAddresses {
    type Err = String;

    /// Empty (a flag filled from an empty variable, kube-proxy's default) is the empty list
    /// of CIDRs, which the flag takes as not given.
    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim().is_empty() {
            return Ok(Self::Cidrs(Vec::new()));
        }
        let items: Vec<&str> = s.split(',').collect();
        Self::from_items(&items)
    }
}

impl fmt::Display for NodePortAddresses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.items().join(","))
    }
}

/// kube-proxy's proxy modes (`--proxy-mode`, `mode`), and ebpf-proxy's own.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ProxyMode {
    /// Empty or `ebpf`: this agent.
    #[default]
    Ebpf,
    /// `iptables`, `ipvs`, `nftables` or `kernelspace` (by name): another implementation.
    KubeProxy(&'static str),
    /// Anything else.
    Unknown(String),
}

impl ProxyMode {
    /// Reads a mode as written; empty and `ebpf` are [`ProxyMode::Ebpf`].
    pub fn parse(s: &str) -> ProxyMode {
        match s.trim() {
            "" | "ebpf" => ProxyMode::Ebpf,
            "iptables" => ProxyMode::KubeProxy("iptables"),
            "ipvs" => ProxyMode::KubeProxy("ipvs"),
            "nftables" => ProxyMode::KubeProxy("nftables"),
            "kernelspace" => ProxyMode::KubeProxy("kernelspace"),
            other => ProxyMode::Unknown(other.to_string()),
        }
    }

    /// Ok for [`ProxyMode::Ebpf`]; otherwise the one-line error that stops start-up, naming
    /// where the mode came from (`origin`, e.g. `--proxy-mode`).
    pub fn require_ebpf(&self, origin: &str) -> Result<()> {
        match self {
            ProxyMode::Ebpf => Ok(()),
            ProxyMode::KubeProxy(mode) => bail!(
                "{origin} {mode:?}: this is ebpf-proxy, a kube-proxy replacement that proxies Services with eBPF programs and has no {mode} mode; to run it, leave the mode empty or set it to \"ebpf\" (every other kube-proxy flag and field is read as it is); to keep the {mode} mode, run kube-proxy"
            ),
            ProxyMode::Unknown(mode) => {
                bail!("{origin} {mode:?} is not a proxy mode; leave it empty or set it to \"ebpf\"")
            }
        }
    }
}

/// IPVS schedulers by their IPVS names (`--ipvs-scheduler`, `ipvs.scheduler`; `ipvsadm -s`).
/// Those with an ebpf-proxy algorithm of the same rule select it as the default algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IpvsScheduler {
    /// `rr`: round-robin.
    Rr,
    /// `wrr`: weighted round-robin.
    Wrr,
    /// `lc`: least-connection.
    Lc,
    /// `wlc`: weighted least-connection.
    Wlc,
    /// `sed`: shortest expected delay.
    Sed,
    /// `nq`: never queue.
    Nq,
    /// `sh`: source hashing.
    Sh,
    /// `dh`: destination hashing.
    Dh,
    /// `mh`: Maglev hashing.
    Mh,
}

impl IpvsScheduler {
    /// Every scheduler with its IPVS name.
    pub const ALL: [(IpvsScheduler, &'static str); 9] = [
        (IpvsScheduler::Rr, "rr"),
        (IpvsScheduler::Wrr, "wrr"),
        (IpvsScheduler::Lc, "lc"),
        (IpvsScheduler::Wlc, "wlc"),
        (IpvsScheduler::Sed, "sed"),
        (IpvsScheduler::Nq, "nq"),
        (IpvsScheduler::Sh, "sh"),
        (IpvsScheduler::Dh, "dh"),
        (IpvsScheduler::Mh, "mh"),
    ];

    /// The IPVS name.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(s, _)| *s == self)
            .map(|(_, n)| *n)
            .expect("every scheduler is listed")
    }

    /// The ebpf-proxy algorithm that does what the scheduler does
    /// ([`Algorithm::IPVS`], which lists where the rules differ): rr -> round-robin, wrr ->
    /// weighted-round-robin, lc -> least-connections, wlc -> weighted-least-connections,
    /// sed -> shortest-expected-delay, nq -> never-queue, sh and mh -> source-hash (the
    /// client address; IPVS's `mh` without `mh-port`), dh -> destination-hash.
    pub fn algorithm(self) -> Algorithm {
        Algorithm::from_ipvs(self.name()).expect("every IPVS scheduler has an algorithm")
    }

    /// The scheduler of the same rule as `algorithm`, if any: random and maglev (the client
    /// address and port, IPVS's `mh` only with the `mh-port` flag) have none; source-hash
    /// is written as `sh`.
    pub fn of_algorithm(algorithm: Algorithm) -> Option<IpvsScheduler> {
        Self::ALL
            .iter()
            .map(|(s, _)| *s)
            .find(|s| s.algorithm() == algorithm && *s != IpvsScheduler::Mh)
    }
}

impl FromStr for IpvsScheduler {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        Self::ALL
            .iter()
            .find(|(_, n)| *n == s)
            .map(|(sch, _)| *sch)
            .ok_or_else(|| {
                format!(
                    "{s:?}: not an IPVS scheduler ebpf-proxy implements (rr, wrr, lc, wlc, sed, \
                     nq, sh, dh, mh; the locality-based lblc and lblcr have no equivalent)"
                )
            })
    }
}

/// A server address as kube-proxy's `--healthz-bind-address` and `--metrics-bind-address`
/// take it: `ip:port`, an IP alone (the server's default port), or empty to disable the
/// server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServerAddress {
    /// No server.
    Disabled,
    /// This IP, the default port.
    Ip(IpAddr),
    /// This address.
    Addr(SocketAddr),
}

impl ServerAddress {
    /// The socket address, with `default_port` for an IP alone; `None` when disabled.
    pub fn resolve(self, default_port: u16) -> Option<SocketAddr> {
        match self {
            ServerAddress::Disabled => None,
            ServerAddress::Ip(ip) => Some(SocketAddr::new(ip, default_port)),
            ServerAddress::Addr(a) => Some(a),
        }
    }
}

impl FromStr for ServerAddress {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() {
            return Ok(ServerAddress::Disabled);
        }
        if let Ok(a) = s.parse::<SocketAddr>() {
            return Ok(ServerAddress::Addr(a));
        }
        let ip = s
            .strip_prefix('[')
            .and_then(|v| v.strip_suffix(']'))
            .unwrap_or(s);
        ip.parse::<IpAddr>().map(ServerAddress::Ip).map_err(|_| {
            format!(
                "{s:?} is not an IP address and port (e.g. 0.0.0.0:10249, [::]:10256 or 127.0.0.1)"
            )
        })
    }
}

/// A Go duration ([`super::go::parse_go_duration`]) of at most [`MAX_PERIOD`].
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = parse_go_duration(s)?;
    if d > MAX_PERIOD {
        return Err("must be at most 8760h (a year)".into());
    }
    Ok(d)
}

/// A duration greater than zero and at most [`MAX_PERIOD`].
pub fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(d)
}

/// A timeout that must be given: at least 1 ms, the least the configuration file takes for
/// the same setting (so that the written-back file reads back).
pub fn parse_required_timeout(s: &str) -> Result<Duration, String> {
    let d = parse_positive_duration(s)?;
    if d < Duration::from_millis(1) {
        return Err(format!("{s:?} is too short (at least 1ms)"));
    }
    Ok(d)
}

/// A timeout: zero (kube-proxy's "leave as is": the default here) or at least 1 ms.
pub fn parse_timeout(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if !d.is_zero() && d < Duration::from_millis(1) {
        return Err(format!("{s:?} is too short (at least 1ms)"));
    }
    Ok(d)
}

/// A value parser for an integer flag from `min` to `max` whose error says so in words
/// ("must be a number from 0 to 65535") rather than in clap's range syntax (`0..=65535`) or
/// Rust's parse errors. Every ranged integer flag uses it.
pub fn number_in<T>(min: T, max: T) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync
where
    T: FromStr + PartialOrd + fmt::Display + Copy + Send + Sync + 'static,
{
    move |s: &str| match s.trim().parse::<T>() {
        Ok(n) if n >= min && n <= max => Ok(n),
        _ => Err(format!("must be a number from {min} to {max}")),
    }
}

/// kube-proxy's values of `--detect-local-mode` / `detectLocalMode` (its validation,
/// `validateDetectLocalMode` in pkg/proxy/apis/config/validation); empty is valid too.
/// Only `ClusterCIDR` has an effect here (what `--cluster-cidr` does).
pub const DETECT_LOCAL_MODES: [&str; 4] = [
    "ClusterCIDR",
    "NodeCIDR",
    "BridgeInterface",
    "InterfaceNamePrefix",
];

/// Checks a local-traffic detection mode as kube-proxy does: one of [`DETECT_LOCAL_MODES`]
/// (case-sensitive) or empty; anything else is refused.
pub fn check_detect_local_mode(s: &str) -> Result<(), String> {
    if s.is_empty() || DETECT_LOCAL_MODES.contains(&s) {
        return Ok(());
    }
    Err(format!(
        "{s:?} is not a local-traffic detection mode: use {} (or leave it empty)",
        DETECT_LOCAL_MODES.join(", ")
    ))
}

/// `--conntrack-min`: 0 (the default) or a number of flows from [`MIN_CONNTRACK_FLOWS`] to
/// [`MAX_CONNTRACK_FLOWS`].
pub fn parse_conntrack_min(s: &str) -> Result<u32, String> {
    match s.trim().parse::<u32>() {
        Ok(n) if n == 0 || (MIN_CONNTRACK_FLOWS..=MAX_CONNTRACK_FLOWS).contains(&n) => Ok(n),
        _ => Err(format!(
            "{s:?} is not 0 or a number from {MIN_CONNTRACK_FLOWS} to {MAX_CONNTRACK_FLOWS}"
        )),
    }
}

/// `--ipvs-scheduler` as given: a scheduler, or empty for kube-proxy's "default", which is
/// the default algorithm here (the file's `ipvs.scheduler` is overridden).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerFlag(pub Option<IpvsScheduler>);

/// `--ipvs-scheduler`'s value parser.
pub(super) fn parse_scheduler_flag(s: &str) -> Result<SchedulerFlag, String> {
    if s.trim().is_empty() {
        return Ok(SchedulerFlag(None));
    }
    s.parse().map(|sch| SchedulerFlag(Some(sch)))
}

/// `--north-south-mode`: `snat`, `dsr` or `hybrid`.
pub(super) fn parse_north_south_mode(s: &str) -> Result<crate::model::NorthSouthMode, String> {
    crate::model::NorthSouthMode::from_name(s.trim())
        .ok_or_else(|| format!("{s:?} is not a north-south mode (snat, dsr, hybrid)"))
}

/// `--maglev-table-size`: a prime from 7 to the largest table the kernel programs take.
pub(super) fn parse_maglev_size(s: &str) -> Result<u32, String> {
    let n: u32 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if !crate::maglev::is_prime(n) || n as usize > proxy_common::MAGLEV_MAX || n < 7 {
        return Err(format!(
            "{n} is not a prime between 7 and {} (e.g. 251, 1021, 4093, 16381, 65521)",
            proxy_common::MAGLEV_MAX
        ));
    }
    Ok(n)
}

/// The warning for a specific `--bind-address` / `bindAddress` given by `source` (the flag,
/// or the file's field with its value): only its family is used, for the default server
/// addresses as kube-proxy's defaulting does; kube-proxy also takes it as the node's primary
/// IP, which the data path here does not need (the node's addresses come from its Node
/// object and interfaces).
pub(super) fn bind_address_warning(source: &str) -> String {
    format!(
        "{source}: only its IP family is used here (that of the default health and metrics addresses); kube-proxy takes it as the node's primary IP, which ebpf-proxy does not need"
    )
}

/// Checks a node name given by `--hostname-override` / `hostnameOverride`, after the trim and
/// lowercasing: a Node's name is a DNS subdomain (RFC 1123: labels of lower-case letters,
/// digits and `-`, starting and ending with a letter or digit, joined by `.`, at most 253
/// characters; Kubernetes' `IsDNS1123Subdomain`), so anything else names no Node, and the
/// name goes into the API's field selectors, where a `,` would add a condition of its own.
///
/// Errors: the reason, for the caller to prefix with the flag or field.
pub(super) fn check_node_name(name: &str) -> Result<(), String> {
    let label_ok = |l: &str| {
        let b = l.as_bytes();
        let inner = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-';
        let end = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
        !b.is_empty() && b.iter().all(inner) && end(&b[0]) && end(&b[b.len() - 1])
    };
    if name.len() > 253 || !name.split('.').all(label_ok) {
        return Err(format!(
            "{name:?} is not a valid node name (a DNS subdomain: lower-case letters, digits, '-' and '.', each part starting and ending with a letter or digit, at most 253 characters)"
        ));
    }
    Ok(())
}
