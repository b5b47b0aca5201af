//! The agent's settings: command-line flags ([`RunFlags`]: ebpf-proxy's own and every flag of
//! kube-proxy), kube-proxy's configuration file (`--config`, a `KubeProxyConfiguration` of
//! `kubeproxy.config.k8s.io/v1alpha1`, see [`file`]) and the defaults, merged once into the
//! typed [`AgentConfig`] by [`AgentConfig::resolve`]: a flag given on the command line wins,
//! then the file, then the default.
//!
//! kube-proxy's flags are those of `cmd/kube-proxy/app/options.go` (and the logging flags of
//! component-base `logs/api/v1`) in kubernetes/kubernetes. Each has kube-proxy's meaning where
//! ebpf-proxy has one; the others are accepted and named in one warning each when given a
//! value other than their zero value. The same holds for the file's fields. Values use Go's
//! syntaxes ([`go`]): durations such as `1m0s` or `1.5s`, booleans as `--flag=false`.
//!
//! `--proxy-mode` / `mode`: empty or `ebpf` run the agent; kube-proxy's own modes stop
//! start-up with one line that says what ebpf-proxy is ([`ProxyMode::require_ebpf`]).

pub mod file;
pub mod go;

use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    str::FromStr,
    time::Duration,
};

use anyhow::{Context, Result, bail};
use ipnet::IpNet;

pub use self::file::{FileSettings, KubeProxyConfiguration, Loaded};
use self::go::{FeatureGates, format_go_duration, parse_go_bool, parse_go_duration};
use crate::datapath::tc::{
    DEFAULT_CONNTRACK_MAX_PER_CORE, DEFAULT_CONNTRACK_MIN, MAX_CONNTRACK_FLOWS,
    MIN_CONNTRACK_FLOWS, TcSettings, XdpSetting,
};
use proxy_common::{
    Algorithm, DEFAULT_MAX_BACKENDS, DEFAULT_MAX_FRONTENDS, DEFAULT_MAX_SLOTS, DEFAULT_MAX_SOCKETS,
};

/// The `apiVersion` a configuration file must have.
pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
/// The `kind` a configuration file must have.
pub const KIND: &str = "KubeProxyConfiguration";

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
    fn name(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

/// A comma-separated list of CIDRs (`--cluster-cidr`, `clusterCIDR`): one CIDR, or an IPv4
/// and an IPv6 one for dual-stack clusters, as kube-proxy accepts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterCidrs(pub Vec<IpNet>);

impl FromStr for ClusterCidrs {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
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

    fn from_str(s: &str) -> Result<Self, String> {
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

/// Reads and validates the configuration file at `path`.
///
/// Errors: the file cannot be read or parsed, `apiVersion`/`kind` are not kube-proxy's
/// v1alpha1 configuration, or a field has an invalid value (the message names the field).
/// Warnings name the file (`--config PATH: field ...`).
pub fn load(path: &Path) -> Result<Loaded> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--config {}: cannot read the file", path.display()))?;
    let mut loaded = parse(&text).with_context(|| format!("--config {}", path.display()))?;
    for w in &mut loaded.warnings {
        if let Some(rest) = w.strip_prefix("--config: ") {
            *w = format!("--config {}: {rest}", path.display());
        }
    }
    Ok(loaded)
}

/// Parses and validates a configuration file's text (see [`load`]). A value of the wrong
/// type is reported with its field's path and the kind expected, in words
/// ([`plain_type_error`]).
pub fn parse(text: &str) -> Result<Loaded> {
    let de = serde_yaml_ng::Deserializer::from_str(text);
    let file: KubeProxyConfiguration = serde_path_to_error::deserialize(de).map_err(|e| {
        let line = e.inner().location().map(|l| l.line());
        let field = e.path().to_string();
        // serde_yaml_ng names the field itself when it knows it: once is enough.
        let inner = e.inner().to_string();
        let inner = inner.strip_prefix(&format!("{field}: ")).unwrap_or(&inner);
        let mut msg = plain_type_error(inner);
        if field != "." && field != "?" {
            msg = format!("{field}: {msg}");
        }
        // A duplicate key is reported where its mapping starts: name the repeated line.
        let line = inner
            .strip_prefix("duplicate field `")
            .and_then(|r| r.split('`').next())
            .and_then(|name| duplicate_key_line(text, name, line.unwrap_or(1)))
            .or(line);
        if let Some(line) = line {
            msg = format!("{msg} (line {line})");
        }
        anyhow::anyhow!("not a KubeProxyConfiguration document: {msg}")
    })?;
    // A field's invalid value is named by its dotted path: add the line it is on.
    file::validate(&file).map_err(|e| {
        let msg = format!("{e:#}");
        let line = msg
            .split_once(": ")
            .and_then(|(field, _)| field_line(text, field));
        match line {
            Some(line) => anyhow::anyhow!("{msg} (line {line})"),
            None => e,
        }
    })
}

/// The 1-based line of the key at the dotted `path` (`conntrack.maxPerCore`) in a block-style
/// YAML document: the first segment at the top level, each next one inside the previous
/// key's block. `None` when the text has no such key in that style (a flow mapping, a quoted
/// key) or `path` is not a field path.
fn field_line(text: &str, path: &str) -> Option<usize> {
    let segments: Vec<&str> = path.split('.').collect();
    if segments
        .iter()
        .any(|s| s.is_empty() || !s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
    {
        return None;
    }
    let mut depth = 0;
    // The indentation of the last matched key: the next segment must be deeper.
    let mut parent: Option<usize> = None;
    for (i, l) in text.lines().enumerate() {
        let key = l.trim_start();
        if key.is_empty() || key.starts_with('#') || key.starts_with("---") {
            continue;
        }
        let indent = l.len() - key.len();
        match parent {
            // Left the matched key's block without finding the next segment.
            Some(p) if indent <= p => return None,
            None if indent > 0 => continue,
            _ => {}
        }
        if key
            .strip_prefix(segments[depth])
            .is_some_and(|rest| rest.trim_start().starts_with(':'))
        {
            depth += 1;
            if depth == segments.len() {
                return Some(i + 1);
            }
            parent = Some(indent);
        }
    }
    None
}

/// The 1-based line of the second `name:` key at one indentation, from line `from` on
/// (the start of the mapping serde named): where a duplicate key is. `None` when the text
/// has no such pair (a flow mapping, a quoted key).
fn duplicate_key_line(text: &str, name: &str, from: usize) -> Option<usize> {
    let mut seen = std::collections::HashSet::new();
    for (i, l) in text.lines().enumerate().skip(from.saturating_sub(1)) {
        let key = l.trim_start();
        let indent = l.len() - key.len();
        if key
            .strip_prefix(name)
            .is_some_and(|rest| rest.trim_start().starts_with(':'))
            && !seen.insert(indent)
        {
            return Some(i + 1);
        }
    }
    None
}

/// A serde or YAML error message without Rust's type names: "invalid type: string "yes",
/// expected a boolean at line 3 column 5" becomes "expected true or false, found the
/// string "yes"". Messages of other shapes are kept, without their position.
pub fn plain_type_error(msg: &str) -> String {
    let msg = match msg.rfind(" at line ") {
        Some(i) if msg[i..].contains(" column ") => &msg[..i],
        _ => msg,
    };
    let Some(rest) = msg.strip_prefix("invalid type: ") else {
        return msg.to_string();
    };
    let Some((found, expected)) = rest.rsplit_once(", expected ") else {
        return msg.to_string();
    };
    let expected = match expected.trim() {
        "a boolean" => "true or false".to_string(),
        "a string" | "a borrowed string" | "a character" => "a string".to_string(),
        "a sequence" => "a list".to_string(),
        "a map" => "a mapping of names to values".to_string(),
        e if e.starts_with("struct ") => "a mapping of fields".to_string(),
        "u8" | "u16" | "u32" | "u64" | "i8" | "i16" | "i32" | "i64" | "an integer" => {
            "a whole number".to_string()
        }
        "f32" | "f64" => "a number".to_string(),
        e => e.to_string(),
    };
    // serde_yaml_ng reports an integer beyond 64 bits as "integer `N` as u128" (or i128),
    // expecting "any YAML value": it is a whole number too large for any field.
    let (found, expected) = match found
        .strip_suffix(" as u128")
        .or_else(|| found.strip_suffix(" as i128"))
    {
        Some(f) => (f, "a whole number that fits its field".to_string()),
        None => (found, expected),
    };
    let found = if let Some(v) = found.strip_prefix("string ") {
        format!("the string {v}")
    } else if let Some(v) = found
        .strip_prefix("integer ")
        .or_else(|| found.strip_prefix("floating point "))
    {
        format!("the number {}", v.trim_matches('`'))
    } else if let Some(v) = found.strip_prefix("boolean ") {
        format!("the boolean {}", v.trim_matches('`'))
    } else {
        match found {
            "sequence" => "a list".to_string(),
            "map" => "a mapping".to_string(),
            "unit value" => "null".to_string(),
            other => other.to_string(),
        }
    };
    format!("expected {expected}, found {found}")
}

/// Mount point of the BPF file system by default.
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf";
/// Pin directory under the BPF file system by default.
pub const DEFAULT_PIN_DIR: &str = "ebpf-proxy";
/// `--min-sync-period` by default (kube-proxy's).
pub const DEFAULT_MIN_SYNC_PERIOD: Duration = Duration::from_secs(1);
/// `--sync-period` by default (kube-proxy's).
pub const DEFAULT_SYNC_PERIOD: Duration = Duration::from_secs(30);
/// Port of the metrics server by default (kube-proxy's `ports.ProxyStatusPort`).
pub const DEFAULT_METRICS_PORT: u16 = 10249;
/// Port of the health server by default (kube-proxy's `ports.ProxyHealthzPort`).
pub const DEFAULT_HEALTHZ_PORT: u16 = 10256;
/// `--metrics-bind-address` by default (kube-proxy's; `[::1]:10249` when `--bind-address`
/// is IPv6).
pub const DEFAULT_METRICS_BIND_ADDRESS: &str = "127.0.0.1:10249";
/// `--healthz-bind-address` by default (kube-proxy's; `[::]:10256` when `--bind-address` is
/// IPv6).
pub const DEFAULT_HEALTHZ_BIND_ADDRESS: &str = "0.0.0.0:10256";
/// `--udp-flow-timeout` by default (the kernel's `nf_conntrack_udp_timeout`).
pub const DEFAULT_UDP_FLOW_TIMEOUT: Duration = Duration::from_secs(30);
/// `--conntrack-tcp-timeout-established` by default (kube-proxy's).
pub const DEFAULT_CT_TCP_ESTABLISHED: Duration = Duration::from_secs(24 * 3600);
/// `--conntrack-udp-timeout-stream` by default (the kernel's).
pub const DEFAULT_CT_UDP_STREAM: Duration = Duration::from_secs(120);
/// `--oom-score-adj` by default (kube-proxy's `qos.KubeProxyOOMScoreAdj`).
pub const DEFAULT_OOM_SCORE_ADJ: i32 = -999;
/// Longest period or timeout accepted (timer arithmetic stays far from overflow).
pub const MAX_PERIOD: Duration = Duration::from_secs(365 * 24 * 3600);

/// The bpffs mount and the pin directory (every subcommand that touches pins takes them).
#[derive(clap::Args, Debug, Clone)]
pub struct PinArgs {
    /// Mount point of the BPF file system.
    #[arg(allow_hyphen_values = true, long, default_value = DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
    /// Directory under --bpffs holding the pinned maps and links.
    #[arg(allow_hyphen_values = true, long, default_value = DEFAULT_PIN_DIR)]
    pub pin_dir: String,
}

impl Default for PinArgs {
    fn default() -> Self {
        PinArgs {
            bpffs: PathBuf::from(DEFAULT_BPFFS),
            pin_dir: DEFAULT_PIN_DIR.into(),
        }
    }
}

impl PinArgs {
    /// The pin directory, after checking the name.
    pub fn dir(&self) -> Result<PathBuf> {
        crate::datapath::loader::check_pin_dir_name(&self.pin_dir)?;
        Ok(crate::datapath::loader::pin_dir(&self.bpffs, &self.pin_dir))
    }
}

/// A Go duration ([`go::parse_go_duration`]) of at most [`MAX_PERIOD`].
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

fn parse_qps(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(n) if n.is_finite() && n >= 0.0 => Ok(n),
        _ => Err("must be a number of queries per second (0 or more, e.g. 5 or 0.5)".into()),
    }
}

fn parse_detect_local_mode(s: &str) -> Result<String, String> {
    check_detect_local_mode(s).map(|()| s.to_string())
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

fn parse_scheduler_flag(s: &str) -> Result<SchedulerFlag, String> {
    if s.trim().is_empty() {
        return Ok(SchedulerFlag(None));
    }
    s.parse().map(|sch| SchedulerFlag(Some(sch)))
}

/// `--north-south-mode`: `snat`, `dsr` or `hybrid`.
fn parse_north_south_mode(s: &str) -> Result<crate::model::NorthSouthMode, String> {
    crate::model::NorthSouthMode::from_name(s.trim())
        .ok_or_else(|| format!("{s:?} is not a north-south mode (snat, dsr, hybrid)"))
}

fn parse_lb_algorithm(s: &str) -> Result<proxy_common::Algorithm, String> {
    crate::model::parse_algorithm(s)
        .ok_or_else(|| format!("{s:?} is not one of {}", crate::model::algorithm_names()))
}

fn parse_maglev_size(s: &str) -> Result<u32, String> {
    let n: u32 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if !crate::maglev::is_prime(n) || n as usize > proxy_common::MAGLEV_MAX || n < 7 {
        return Err(format!(
            "{n} is not a prime between 7 and {} (e.g. 251, 1021, 4093, 16381, 65521)",
            proxy_common::MAGLEV_MAX
        ));
    }
    Ok(n)
}

/// The flags of the agent (`ebpf-proxy run`, or `ebpf-proxy` with no subcommand as
/// kube-proxy is run). A setting left out is taken from the configuration file (`--config`),
/// else its default: [`AgentConfig::resolve`] merges them once.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct RunFlags {
    /// kube-proxy configuration file (KubeProxyConfiguration, kubeproxy.config.k8s.io/v1alpha1).
    /// Flags given on the command line override its values.
    #[arg(allow_hyphen_values = true, long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Read Services and EndpointSlices from this directory of manifests (*.yaml, *.yml,
    /// *.json), watched for changes, instead of the Kubernetes API.
    #[arg(allow_hyphen_values = true, long, conflicts_with = "kubeconfig")]
    pub manifests: Option<PathBuf>,
    /// Kubeconfig for the Kubernetes API [default: $KUBECONFIG or ~/.kube/config, else the
    /// in-cluster service account, as kube-rs `Config::infer`]. Read before anything is
    /// attached: a missing or broken configuration stops start-up.
    #[arg(allow_hyphen_values = true, long)]
    pub kubeconfig: Option<PathBuf>,
    /// Minimum time between two syncs from the API source; an isolated change after a
    /// quiet period is applied at once; 0 syncs every change at once (kube-proxy's
    /// --iptables-min-sync-period) [default: 1s].
    #[arg(long, allow_hyphen_values = true, value_parser = parse_duration)]
    pub min_sync_period: Option<Duration>,
    /// Period of the verification that compares the maps with what was applied and
    /// repairs entries changed behind the agent's back (kube-proxy's --iptables-sync-period).
    /// /healthz fails when an update stays pending for twice this long [default: 30s].
    #[arg(long, allow_hyphen_values = true, value_parser = parse_positive_duration)]
    pub sync_period: Option<Duration>,
    /// Address of the Prometheus metrics server (`/metrics`): ip:port, an IP alone (port
    /// 10249), or empty to disable it; port 0 picks a free port [default: 127.0.0.1:10249].
    #[arg(allow_hyphen_values = true, long)]
    pub metrics_bind_address: Option<ServerAddress>,
    /// cgroup v2 directory to attach the socket programs to [default: the cgroup2 mount root
    /// from /proc/self/mounts, i.e. every process of the node].
    #[arg(allow_hyphen_values = true, long)]
    pub cgroup_path: Option<PathBuf>,
    #[command(flatten)]
    pub pins: PinArgs,
    /// Name of this node [default: $NODE_NAME, else the hostname]; trimmed and lowercased,
    /// as kube-proxy does.
    #[arg(allow_hyphen_values = true, long)]
    pub hostname_override: Option<String>,
    /// Backend selection of Services without the `ebpf-proxy.io/lb-algorithm` annotation:
    /// random (kube-proxy's), round-robin, weighted-round-robin, least-connections,
    /// source-hash, maglev, weighted-least-connections, shortest-expected-delay, never-queue,
    /// destination-hash, or an IPVS scheduler name (rr, wrr, lc, wlc, sed, nq, sh, dh, mh)
    /// [default: random].
    #[arg(allow_hyphen_values = true, long, value_parser = parse_lb_algorithm)]
    pub lb_algorithm: Option<Algorithm>,
    /// Which sockets the socket programs translate: `all`, or `host-only` (only the node's
    /// own network namespace; pods are translated per packet on their interfaces, as
    /// Cilium's `socketLB.hostNamespaceOnly`). Pods and namespaces also opt out one by one
    /// with the label or annotation `ebpf-proxy.io/socket-lb: disabled` [default: all].
    #[arg(allow_hyphen_values = true, long, value_enum)]
    pub socket_lb_scope: Option<crate::model::bypass::SocketLbScope>,
    /// How a flow from outside (node port, external or LB IP, `externalTrafficPolicy:
    /// Cluster`) reaches a backend on another node: `snat` (source-NAT to this node's
    /// address, kube-proxy's), `dsr` (direct server return: the packet is forwarded
    /// encapsulated, IPIP or IPv6-in-IPv6, and the backend's node answers the client
    /// directly; the backend sees the client's address), or `hybrid` (DSR for TCP, SNAT for
    /// UDP). Every node must run the same mode (a DSR packet is accepted by the backend's
    /// node only when it runs DSR for that Service too). Services override it with the
    /// annotation `ebpf-proxy.io/north-south-mode` [default: snat].
    #[arg(allow_hyphen_values = true, long, value_name = "MODE", value_parser = parse_north_south_mode)]
    pub north_south_mode: Option<crate::model::NorthSouthMode>,
    /// Level of the kernel programs' own log lines (aya-log), forwarded to the agent's log
    /// under the target `ebpf_proxy::kernel` whatever `--log-level` says: off, error, warn,
    /// info, debug (one line per decision: a connection translated or refused, a packet
    /// flow started, dropped or rejected) or trace (also every connect() to an address
    /// that is no frontend). Off costs nothing: the verifier removes the disabled lines
    /// [default: off].
    #[arg(allow_hyphen_values = true, long, value_enum)]
    pub kernel_log_level: Option<crate::datapath::loader::KernelLogLevel>,
    /// Close the TCP connections of client sockets translated to an endpoint that left its
    /// Service (gone from the EndpointSlices, or neither ready nor serving), with sock_diag's
    /// SOCK_DESTROY in the socket's network namespace, as `ss -K` does. Off by default, as
    /// kube-proxy leaves established connections alone [default: false].
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value = "false", value_parser = parse_go_bool, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub close_connections_to_removed_endpoints: bool,
    /// Size of the Maglev lookup tables of source-hash and maglev Services: a prime from 7 to
    /// 65521 (larger tables spread backends more evenly; each costs 4 bytes per entry)
    /// [default: 16381].
    #[arg(long, allow_hyphen_values = true, value_parser = parse_maglev_size)]
    pub maglev_table_size: Option<u32>,
    /// Address of the health server (`/healthz`, `/livez`): ip:port, an IP alone (port
    /// 10256), or empty to disable it; port 0 picks a free port [default: 0.0.0.0:10256].
    #[arg(allow_hyphen_values = true, long)]
    pub healthz_bind_address: Option<ServerAddress>,
    /// Address of the agent's own status server (`/readyz`, `/livez`, `/status`; read by
    /// `ebpf-proxy status` and the DaemonSet's probes), on a port kube-proxy never binds so
    /// that its answers cannot come from kube-proxy while both run: ip:port, an IP alone
    /// (port 10266), or empty to disable it; port 0 picks a free port
    /// [default: 127.0.0.1:10266].
    #[arg(allow_hyphen_values = true, long)]
    pub status_bind_address: Option<ServerAddress>,
    /// Log level of the agent (error, warn, info, debug, trace; other crates log warnings
    /// only), or a tracing filter directive with `=` or `,` (e.g. `info,kube=debug`)
    /// [default: info, or the one of -v].
    #[arg(allow_hyphen_values = true, long)]
    pub log_level: Option<String>,
    /// Log format: one text line or one JSON object per event [default: text].
    #[arg(allow_hyphen_values = true, long, value_enum)]
    pub log_format: Option<LogFormat>,
    /// CIDR of the cluster's pods, or an IPv4 and an IPv6 CIDR separated by a comma
    /// (kube-proxy's --cluster-cidr): traffic entering the node to a cluster IP from a
    /// client outside the prefix of its family is masqueraded (tc path).
    #[arg(allow_hyphen_values = true, long)]
    pub cluster_cidr: Option<ClusterCidrs>,
    /// Node addresses that serve NodePorts: comma-separated CIDRs, or `primary` (the
    /// node's first InternalIP per family, kube-proxy's nftables default) [default: every
    /// InternalIP and ExternalIP of this node's Node object] (kube-proxy's
    /// --nodeport-addresses).
    #[arg(allow_hyphen_values = true, long)]
    pub nodeport_addresses: Option<NodePortAddresses>,
    /// Size of the frontend map (VIP x port x protocol, plus one entry per VIP) when created
    /// [default: 65536].
    #[arg(long, allow_hyphen_values = true, value_parser = number_in(1u32, u32::MAX))]
    pub max_frontends: Option<u32>,
    /// Size of the backend slot map (sum of all services' endpoint counts) when created
    /// [default: 524288].
    #[arg(long, allow_hyphen_values = true, value_parser = number_in(1u32, u32::MAX))]
    pub max_backend_slots: Option<u32>,
    /// Size of the backend map (distinct endpoint address x port x protocol) when created
    /// [default: 262144].
    #[arg(long, allow_hyphen_values = true, value_parser = number_in(1u32, u32::MAX))]
    pub max_backends: Option<u32>,
    /// Size of the per-socket reverse-NAT and UDP flow maps (LRU) when created; connected
    /// sockets' reverse-NAT slots get the largest power of two not above it
    /// [default: 262144].
    #[arg(long, allow_hyphen_values = true, value_parser = number_in(1u32, u32::MAX))]
    pub max_sockets: Option<u32>,
    /// Idle time after which an unconnected UDP flow picks a backend anew, like conntrack's
    /// nf_conntrack_udp_timeout (e.g. 30s, 2m; kube-proxy's --conntrack-udp-timeout)
    /// [default: 30s].
    #[arg(long, allow_hyphen_values = true, value_parser = parse_positive_duration)]
    pub udp_flow_timeout: Option<Duration>,
    /// Interfaces that serve NodePorts, external IPs and LB IPs to traffic from outside the
    /// node, comma-separated [default: the interfaces of the agent's network namespace that
    /// carry one of this node's InternalIP/ExternalIP addresses from its Node object].
    #[arg(allow_hyphen_values = true, long, value_delimiter = ',')]
    pub interfaces: Vec<String>,
    /// XDP in front of the tcx programs on the external interfaces, for the same
    /// NodePorts, external IPs and LB IPs with the same conntrack: `native` (driver XDP on
    /// every external interface; an interface without it is an error), `best-effort`
    /// (native where the driver supports it, else generic XDP, else the tcx programs
    /// alone) or `disabled`. `ebpf-proxy check` tells which interfaces have native XDP
    /// [default: disabled].
    #[arg(allow_hyphen_values = true, long, value_enum, value_name = "MODE")]
    pub xdp: Option<XdpSetting>,
    /// The peers of veth external interfaces run an XDP program in native mode, so frames
    /// the XDP program sends back or redirects into a veth are delivered: lets --xdp use
    /// native XDP on veths, which it otherwise refuses (native) or skips (best-effort)
    /// [default: false].
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value = "false", value_parser = parse_go_bool, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub xdp_veth_peers_ready: bool,
    /// Source-NAT every external flow of a Cluster-policy Service to the node address, also
    /// when the backend runs on this node (kube-proxy's --masquerade-all).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
    pub masquerade_all: Option<bool>,
    /// Flows tracked per CPU by the north-south conntrack table (kube-proxy's
    /// --conntrack-max-per-core); the table holds max(this x CPUs, --conntrack-min) flows.
    /// The table is preallocated (about 320 bytes per flow), unlike the kernel's conntrack
    /// limit kube-proxy sets, so the default is 0: --conntrack-min alone, whatever the core
    /// count. Fixed when the pinned table is created [default: 0].
    #[arg(long, allow_hyphen_values = true, value_parser = number_in(0u32, MAX_CONNTRACK_FLOWS), value_name = "N")]
    pub conntrack_max_per_core: Option<u32>,
    /// Least number of flows of the north-south conntrack table (kube-proxy's
    /// --conntrack-min), from 1024 (smaller LRU tables lose live flows to the kernel's batch
    /// eviction) to 16777216; 0 keeps the default [default: 131072].
    #[arg(long, allow_hyphen_values = true, value_parser = parse_conntrack_min, value_name = "N")]
    pub conntrack_min: Option<u32>,
    /// Idle timeout of an established TCP flow in the north-south conntrack (kube-proxy's
    /// --conntrack-tcp-timeout-established), e.g. 24h; 0 keeps the default [default: 24h].
    #[arg(long, allow_hyphen_values = true, value_parser = parse_timeout)]
    pub conntrack_tcp_timeout_established: Option<Duration>,
    /// Idle timeout of a UDP flow that saw replies in the north-south conntrack (kube-proxy's
    /// --conntrack-udp-timeout-stream, the kernel's nf_conntrack_udp_timeout_stream), e.g.
    /// 2m; 0 keeps the default. Unreplied UDP flows use --udp-flow-timeout [default: 2m].
    #[arg(long, allow_hyphen_values = true, value_parser = parse_timeout)]
    pub conntrack_udp_timeout_stream: Option<Duration>,
    /// kube-proxy's other flags.
    #[command(flatten)]
    pub kube_proxy: KubeProxyFlags,
}

/// kube-proxy's flags that ebpf-proxy has no name of its own for (the others are in
/// [`RunFlags`] under their kube-proxy names). Each is `None` unless given.
#[derive(clap::Args, Debug, Clone, Default)]
#[command(next_help_heading = "kube-proxy flags")]
pub struct KubeProxyFlags {
    /// Write the effective configuration (flags, --config and defaults merged) to FILE as a
    /// KubeProxyConfiguration and exit.
    #[arg(allow_hyphen_values = true, long, value_name = "FILE")]
    pub write_config_to: Option<PathBuf>,
    /// Remove everything ebpf-proxy installed (programs, links, pinned maps under
    /// --bpffs/--pin-dir) and exit, as `ebpf-proxy cleanup`.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
    pub cleanup: Option<bool>,
    /// Do the privileged start-up (preflight, mount bpffs, load, attach and pin the data
    /// path), then exit; a later run adopts what was pinned.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
    pub init_only: Option<bool>,
    /// Proxy mode: empty or `ebpf`; kube-proxy's iptables, ipvs, nftables and kernelspace
    /// modes stop start-up with an error.
    #[arg(allow_hyphen_values = true, long, value_name = "MODE")]
    pub proxy_mode: Option<String>,
    /// URL of the Kubernetes API server, overriding the kubeconfig's.
    #[arg(allow_hyphen_values = true, long, value_name = "URL")]
    pub master: Option<String>,
    /// Exit when the health or metrics server cannot bind its address (otherwise the bind is
    /// retried every 5 s while the data path runs).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
    pub bind_address_hard_fail: Option<bool>,
    /// Same as --sync-period.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_positive_duration, value_name = "DURATION")]
    pub iptables_sync_period: Option<Duration>,
    /// Same as --min-sync-period.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_duration, value_name = "DURATION")]
    pub iptables_min_sync_period: Option<Duration>,
    /// Same as --sync-period.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_positive_duration, value_name = "DURATION")]
    pub ipvs_sync_period: Option<Duration>,
    /// Same as --min-sync-period.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_duration, value_name = "DURATION")]
    pub ipvs_min_sync_period: Option<Duration>,
    /// Default algorithm by its IPVS scheduler name: rr, wrr, lc, wlc, sed, nq, sh, dh, mh
    /// (see --lb-algorithm; mh is source-hash); empty keeps the default algorithm.
    #[arg(allow_hyphen_values = true, long, value_name = "SCHEDULER", value_parser = parse_scheduler_flag, conflicts_with = "lb_algorithm")]
    pub ipvs_scheduler: Option<SchedulerFlag>,
    /// Same as --udp-flow-timeout (0 keeps the default).
    #[arg(long, allow_hyphen_values = true, value_parser = parse_timeout, value_name = "DURATION")]
    pub conntrack_udp_timeout: Option<Duration>,
    /// oom_score_adj of the agent process, -1000..=1000 [default: -999].
    #[arg(long, allow_hyphen_values = true, value_parser = number_in(-1000i32, 1000), value_name = "N")]
    pub oom_score_adj: Option<i32>,
    /// Deprecated in kube-proxy: port of the health server (0 disables it).
    #[arg(allow_hyphen_values = true, long, value_name = "PORT", value_parser = number_in(0u16, u16::MAX))]
    pub healthz_port: Option<u16>,
    /// Deprecated in kube-proxy: port of the metrics server (0 disables it).
    #[arg(allow_hyphen_values = true, long, value_name = "PORT", value_parser = number_in(0u16, u16::MAX))]
    pub metrics_port: Option<u16>,
    /// Same as --log-format.
    #[arg(allow_hyphen_values = true, long, value_enum, value_name = "FORMAT")]
    pub logging_format: Option<LogFormat>,
    /// klog verbosity: 0-2 is --log-level info, 3-4 debug, 5 and more trace.
    #[arg(allow_hyphen_values = true, short = 'v', long = "v", value_name = "N", value_parser = number_in(0u32, u32::MAX))]
    pub verbosity: Option<u32>,
    /// kube-proxy's idea of the node's primary IP; only its family is used here (the
    /// default server addresses are IPv6 when it is IPv6).
    #[arg(allow_hyphen_values = true, long, value_name = "IP")]
    pub bind_address: Option<IpAddr>,
    /// No effect here.
    #[arg(allow_hyphen_values = true, long, value_name = "Name=bool,...")]
    pub feature_gates: Option<FeatureGates>,
    /// No effect here (the client sends JSON).
    #[arg(allow_hyphen_values = true, long, value_name = "TYPE")]
    pub kube_api_content_type: Option<String>,
    /// No effect here (the client does not throttle).
    #[arg(allow_hyphen_values = true, long, value_name = "N", value_parser = number_in(0i32, i32::MAX))]
    pub kube_api_burst: Option<i32>,
    /// No effect here (the client does not throttle).
    #[arg(allow_hyphen_values = true, long, value_name = "QPS", value_parser = parse_qps)]
    pub kube_api_qps: Option<f32>,
    /// No effect here (no /debug/pprof).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
    pub profiling: Option<bool>,
    /// No effect here.
    #[arg(allow_hyphen_values = true, long, value_name = "VERSION")]
    pub show_hidden_metrics_for_version: Option<String>,
    /// No effect here (no fwmark).
    #[arg(allow_hyphen_values = true, long, value_name = "BIT", value_parser = number_in(0i32, 31))]
    pub iptables_masquerade_bit: Option<i32>,
    /// No effect here: node ports are never served on loopback (as kube-proxy's nftables
    /// mode).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
    pub iptables_localhost_nodeports: Option<bool>,
    /// No effect here.
    #[arg(
        allow_hyphen_values = true,
        long,
        value_delimiter = ',',
        value_name = "CIDR,..."
    )]
    pub ipvs_exclude_cidrs: Vec<String>,
    /// No effect here.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
    pub ipvs_strict_arp: Option<bool>,
    /// No effect here.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_duration, value_name = "DURATION")]
    pub ipvs_tcp_timeout: Option<Duration>,
    /// No effect here.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_duration, value_name = "DURATION")]
    pub ipvs_tcpfin_timeout: Option<Duration>,
    /// No effect here.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_duration, value_name = "DURATION")]
    pub ipvs_udp_timeout: Option<Duration>,
    /// How kube-proxy tells local traffic: ClusterCIDR (what --cluster-cidr does here),
    /// NodeCIDR, BridgeInterface or InterfaceNamePrefix (accepted, no effect here); any
    /// other value stops start-up, as in kube-proxy.
    #[arg(allow_hyphen_values = true, long, value_name = "MODE", value_parser = parse_detect_local_mode)]
    pub detect_local_mode: Option<String>,
    /// No effect here.
    #[arg(allow_hyphen_values = true, long, value_name = "NAME")]
    pub pod_bridge_interface: Option<String>,
    /// No effect here.
    #[arg(allow_hyphen_values = true, long, value_name = "PREFIX")]
    pub pod_interface_name_prefix: Option<String>,
    /// No effect here.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_duration, value_name = "DURATION")]
    pub conntrack_tcp_timeout_close_wait: Option<Duration>,
    /// No effect here.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
    pub conntrack_tcp_be_liberal: Option<bool>,
    /// No effect here (watches are not resynced).
    #[arg(long, allow_hyphen_values = true, value_parser = parse_duration, value_name = "DURATION")]
    pub config_sync_period: Option<Duration>,
    /// Removed from kube-proxy (userspace mode); no effect here.
    #[arg(allow_hyphen_values = true, long, value_name = "RANGE")]
    pub proxy_port_range: Option<String>,
    /// No effect here.
    #[arg(allow_hyphen_values = true, long, value_name = "PATTERN=N,...")]
    pub vmodule: Option<String>,
    /// No effect here (logs are not buffered).
    #[arg(long, allow_hyphen_values = true, value_parser = parse_duration, value_name = "DURATION")]
    pub log_flush_frequency: Option<Duration>,
    /// No effect here (logs go to stderr).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
    pub log_text_split_stream: Option<bool>,
    /// No effect here.
    #[arg(allow_hyphen_values = true, long, value_name = "SIZE")]
    pub log_text_info_buffer_size: Option<String>,
    /// No effect here (logs go to stderr).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
    pub log_json_split_stream: Option<bool>,
    /// No effect here.
    #[arg(allow_hyphen_values = true, long, value_name = "SIZE")]
    pub log_json_info_buffer_size: Option<String>,
    /// No effect here (cAdvisor's flag, linked into kube-proxy).
    #[arg(allow_hyphen_values = true, long, value_name = "FILES")]
    pub boot_id_file: Option<String>,
    /// No effect here (cAdvisor's flag, linked into kube-proxy).
    #[arg(allow_hyphen_values = true, long, value_name = "FILES")]
    pub machine_id_file: Option<String>,
}

impl KubeProxyFlags {
    /// One warning per flag given that has no effect here (a zero value, such as
    /// `--profiling=false`, is not reported).
    pub fn warnings(&self) -> Vec<String> {
        let given = |set: bool, name: &str| {
            set.then(|| format!("flag --{name} has no effect in ebpf-proxy: ignored"))
        };
        let text = |v: &Option<String>| v.as_deref().is_some_and(|s| !s.trim().is_empty());
        let yes = |v: &Option<bool>| v.unwrap_or(false);
        let nonzero = |v: &Option<Duration>| v.is_some_and(|d| !d.is_zero());
        [
            given(
                self.bind_address.is_some_and(|ip| !ip.is_unspecified()),
                "bind-address",
            ),
            given(
                self.feature_gates.as_ref().is_some_and(|g| !g.0.is_empty()),
                "feature-gates",
            ),
            given(text(&self.kube_api_content_type), "kube-api-content-type"),
            given(
                self.kube_api_burst.is_some_and(|n| n != 0),
                "kube-api-burst",
            ),
            given(self.kube_api_qps.is_some_and(|n| n != 0.0), "kube-api-qps"),
            given(yes(&self.profiling), "profiling"),
            given(
                text(&self.show_hidden_metrics_for_version),
                "show-hidden-metrics-for-version",
            ),
            given(
                self.iptables_masquerade_bit.is_some(),
                "iptables-masquerade-bit",
            ),
            given(
                yes(&self.iptables_localhost_nodeports),
                "iptables-localhost-nodeports",
            ),
            given(!self.ipvs_exclude_cidrs.is_empty(), "ipvs-exclude-cidrs"),
            given(yes(&self.ipvs_strict_arp), "ipvs-strict-arp"),
            given(nonzero(&self.ipvs_tcp_timeout), "ipvs-tcp-timeout"),
            given(nonzero(&self.ipvs_tcpfin_timeout), "ipvs-tcpfin-timeout"),
            given(nonzero(&self.ipvs_udp_timeout), "ipvs-udp-timeout"),
            given(
                self.detect_local_mode
                    .as_deref()
                    .is_some_and(|m| !m.is_empty() && m != "ClusterCIDR"),
                "detect-local-mode",
            ),
            given(text(&self.pod_bridge_interface), "pod-bridge-interface"),
            given(
                text(&self.pod_interface_name_prefix),
                "pod-interface-name-prefix",
            ),
            given(
                nonzero(&self.conntrack_tcp_timeout_close_wait),
                "conntrack-tcp-timeout-close-wait",
            ),
            given(
                yes(&self.conntrack_tcp_be_liberal),
                "conntrack-tcp-be-liberal",
            ),
            given(nonzero(&self.config_sync_period), "config-sync-period"),
            given(text(&self.proxy_port_range), "proxy-port-range"),
            given(text(&self.vmodule), "vmodule"),
            given(nonzero(&self.log_flush_frequency), "log-flush-frequency"),
            given(yes(&self.log_text_split_stream), "log-text-split-stream"),
            given(
                text(&self.log_text_info_buffer_size),
                "log-text-info-buffer-size",
            ),
            given(yes(&self.log_json_split_stream), "log-json-split-stream"),
            given(
                text(&self.log_json_info_buffer_size),
                "log-json-info-buffer-size",
            ),
            given(text(&self.boot_id_file), "boot-id-file"),
            given(text(&self.machine_id_file), "machine-id-file"),
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}

/// Where the agent reads objects from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceChoice {
    /// A directory of manifests (`--manifests`).
    Manifests(PathBuf),
    /// The Kubernetes API, with this kubeconfig (else `Config::infer`).
    Api(Option<PathBuf>),
}

/// What the process does with the settings (kube-proxy's order: `--write-config-to` first,
/// then `--cleanup`, then `--init-only`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Run the agent.
    Run,
    /// `--write-config-to FILE`: write the effective configuration and exit.
    WriteConfig(PathBuf),
    /// `--cleanup`: remove the data path and exit.
    Cleanup,
    /// `--init-only`: set up the data path and exit.
    InitOnly,
}

/// Sizes of the maps created at start (adopted pins keep theirs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSizeSettings {
    /// `--max-frontends`.
    pub frontends: u32,
    /// `--max-backend-slots`.
    pub slots: u32,
    /// `--max-backends`.
    pub backends: u32,
    /// `--max-sockets`.
    pub sockets: u32,
}

/// Every setting of the agent, merged once from the flags, the configuration file and the
/// defaults (a flag given wins, then the file, then the default), typed.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// What to do.
    pub action: Action,
    /// `--proxy-mode` / `mode` (only [`ProxyMode::Ebpf`] runs).
    pub proxy_mode: ProxyMode,
    /// Where objects come from.
    pub source: SourceChoice,
    /// `--master`: the API server's URL, overriding the kubeconfig's.
    pub master: Option<String>,
    /// `--min-sync-period` (the pacing of the API source).
    pub min_sync_period: Duration,
    /// `--sync-period`.
    pub sync_period: Duration,
    /// `--metrics-bind-address` (`None`: no metrics server).
    pub metrics_bind_address: Option<SocketAddr>,
    /// `--healthz-bind-address` (`None`: no health server).
    pub healthz_bind_address: Option<SocketAddr>,
    /// `--status-bind-address` (`None`: no status server).
    pub status_bind_address: Option<SocketAddr>,
    /// `--bind-address-hard-fail`: a server that cannot bind stops the agent.
    pub bind_address_hard_fail: bool,
    /// `--bind-address` (kept for the written configuration).
    pub bind_address: Option<IpAddr>,
    /// `--cgroup-path` (`None`: the cgroup2 mount root).
    pub cgroup_path: Option<PathBuf>,
    /// The pin directory.
    pub pins: PinArgs,
    /// `--hostname-override`, trimmed and lowercased (the node name is resolved at start).
    pub hostname_override: Option<String>,
    /// `--lb-algorithm` (or `--ipvs-scheduler`).
    pub lb_algorithm: Algorithm,
    /// `--maglev-table-size`.
    pub maglev_table_size: u32,
    /// `--socket-lb-scope`.
    pub socket_lb_scope: crate::model::bypass::SocketLbScope,
    /// `--north-south-mode`.
    pub north_south_mode: crate::model::NorthSouthMode,
    /// `--kernel-log-level`.
    pub kernel_log_level: crate::datapath::loader::KernelLogLevel,
    /// `--close-connections-to-removed-endpoints`.
    pub close_connections_to_removed_endpoints: bool,
    /// `--log-level` (or `-v`).
    pub log_level: String,
    /// `-v` / `logging.verbosity` as given (for the written configuration).
    pub verbosity: Option<u32>,
    /// `--log-format`.
    pub log_format: LogFormat,
    /// `--cluster-cidr`.
    pub cluster_cidrs: Vec<IpNet>,
    /// `--nodeport-addresses` (`None`: every node address).
    pub nodeport_addresses: Option<NodePortAddresses>,
    /// Map sizes.
    pub map_sizes: MapSizeSettings,
    /// `--udp-flow-timeout`.
    pub udp_flow_timeout: Duration,
    /// The north-south path.
    pub tc: TcSettings,
    /// `--oom-score-adj`.
    pub oom_score_adj: i32,
    /// One line per flag given that has no effect here.
    pub warnings: Vec<String>,
    /// The effective configuration as a `KubeProxyConfiguration` (`--write-config-to`).
    pub document: KubeProxyConfiguration,
}

/// The one value of a setting given by several flags (kube-proxy's per-mode names of one
/// setting): they must agree.
fn agree<T: PartialEq + Copy>(
    given: &[(&str, Option<T>)],
    show: impl Fn(T) -> String,
) -> Result<Option<T>> {
    let mut found: Option<(&str, T)> = None;
    for (name, v) in given {
        let Some(v) = v else { continue };
        match found {
            Some((first, f)) if f != *v => bail!(
                "{name} {} differs from {first} {}; give one value",
                show(*v),
                show(f)
            ),
            Some(_) => {}
            None => found = Some((name, *v)),
        }
    }
    Ok(found.map(|(_, v)| v))
}

/// The log level of a klog verbosity: 0-2 info (kube-proxy logs its normal operation up to
/// V(2)), 3-4 debug, 5 and more trace.
pub fn log_level_of_verbosity(v: u32) -> &'static str {
    match v {
        0..=2 => "info",
        3..=4 => "debug",
        _ => "trace",
    }
}

impl AgentConfig {
    /// Merges the flags with the configuration file's settings (`file`, when `--config` was
    /// given) and the defaults.
    ///
    /// Errors: a mode other than empty or `ebpf` (except with `--cleanup`), an IPVS
    /// scheduler the data path does not implement, flags of one setting that disagree,
    /// `--min-sync-period` longer than `--sync-period` (as kube-proxy's validation, whether
    /// they come from flags or the file), an empty `--hostname-override`.
    pub fn resolve(flags: RunFlags, file: Option<FileSettings>) -> Result<AgentConfig> {
        let f = file.unwrap_or_default();
        let k = flags.kube_proxy.clone();
        let action = if let Some(path) = k.write_config_to.clone() {
            Action::WriteConfig(path)
        } else if k.cleanup == Some(true) {
            Action::Cleanup
        } else if k.init_only == Some(true) {
            Action::InitOnly
        } else {
            Action::Run
        };
        let proxy_mode = match &k.proxy_mode {
            Some(m) => {
                let mode = ProxyMode::parse(m);
                if action != Action::Cleanup {
                    mode.require_ebpf("--proxy-mode")?;
                }
                mode
            }
            None => {
                let mode = f.mode.clone().unwrap_or_default();
                if action != Action::Cleanup {
                    let origin = match &flags.config {
                        Some(path) => format!("--config {}: mode", path.display()),
                        None => "--config: mode".to_string(),
                    };
                    mode.require_ebpf(&origin)?;
                }
                mode
            }
        };
        let source = match flags.manifests {
            Some(m) => SourceChoice::Manifests(m),
            // The file's kubeconfig is a source choice too; --manifests is the other one.
            None => SourceChoice::Api(flags.kubeconfig.or(f.kubeconfig.clone())),
        };
        let show = |d: Duration| format_go_duration(d);
        let sync_period = agree(
            &[
                ("--sync-period", flags.sync_period),
                ("--iptables-sync-period", k.iptables_sync_period),
                ("--ipvs-sync-period", k.ipvs_sync_period),
            ],
            show,
        )?;
        let min_sync_period = agree(
            &[
                ("--min-sync-period", flags.min_sync_period),
                ("--iptables-min-sync-period", k.iptables_min_sync_period),
                ("--ipvs-min-sync-period", k.ipvs_min_sync_period),
            ],
            show,
        )?;
        let hostname_override = match flags.hostname_override {
            Some(h) => {
                let h = h.trim().to_lowercase();
                if h.is_empty() {
                    bail!("--hostname-override: an empty name is invalid");
                }
                Some(h)
            }
            None => f.hostname_override.clone().map(|h| h.trim().to_lowercase()),
        };
        let lb_algorithm = match (flags.lb_algorithm, k.ipvs_scheduler) {
            (Some(a), _) => a,
            (None, Some(SchedulerFlag(Some(s)))) => s.algorithm(),
            (None, Some(SchedulerFlag(None))) => Algorithm::default(),
            (None, None) => f
                .ipvs_scheduler
                .map(IpvsScheduler::algorithm)
                .unwrap_or_default(),
        };
        let verbosity = k.verbosity.or(f.verbosity);
        let log_level = flags
            .log_level
            .clone()
            .or_else(|| verbosity.map(|v| log_level_of_verbosity(v).to_string()))
            .unwrap_or_else(|| "info".into());
        let bind_address = k.bind_address.or(f.bind_address);
        let ipv6 = bind_address.is_some_and(|ip| ip.is_ipv6());
        let server = |flag: Option<ServerAddress>,
                      file: Option<SocketAddr>,
                      port_flag: Option<u16>,
                      default: SocketAddr| {
            let mut addr = match flag {
                Some(a) => a.resolve(default.port()),
                None => Some(file.unwrap_or(default)),
            };
            if let Some(port) = port_flag {
                addr = (port != 0)
                    .then(|| SocketAddr::new(addr.map_or(default.ip(), |a| a.ip()), port));
            }
            addr
        };
        let healthz_default = if ipv6 {
            SocketAddr::from((Ipv6Addr::UNSPECIFIED, DEFAULT_HEALTHZ_PORT))
        } else {
            SocketAddr::from((Ipv4Addr::UNSPECIFIED, DEFAULT_HEALTHZ_PORT))
        };
        let metrics_default = if ipv6 {
            SocketAddr::from((Ipv6Addr::LOCALHOST, DEFAULT_METRICS_PORT))
        } else {
            SocketAddr::from((Ipv4Addr::LOCALHOST, DEFAULT_METRICS_PORT))
        };
        let udp_flow_timeout = agree(
            &[
                ("--udp-flow-timeout", flags.udp_flow_timeout),
                (
                    "--conntrack-udp-timeout",
                    k.conntrack_udp_timeout.filter(|d| !d.is_zero()),
                ),
            ],
            show,
        )?;
        // Whether the operator chose a per-core figure: the written file leaves it unset
        // otherwise (see below).
        let max_per_core_given =
            flags.conntrack_max_per_core.is_some() || f.conntrack_max_per_core.is_some();
        let mut warnings = k.warnings();
        if k.logging_format.is_some()
            && flags.log_format.is_some()
            && k.logging_format != flags.log_format
        {
            warnings.push(
                "flags --log-format and --logging-format disagree: --log-format is used".into(),
            );
        }
        let mut c = AgentConfig {
            action,
            proxy_mode,
            source,
            master: k.master.clone().filter(|m| !m.trim().is_empty()),
            min_sync_period: min_sync_period
                .or(f.min_sync_period)
                .unwrap_or(DEFAULT_MIN_SYNC_PERIOD),
            sync_period: sync_period.or(f.sync_period).unwrap_or(DEFAULT_SYNC_PERIOD),
            metrics_bind_address: server(
                flags.metrics_bind_address,
                f.metrics_bind_address,
                k.metrics_port,
                metrics_default,
            ),
            healthz_bind_address: server(
                flags.healthz_bind_address,
                f.healthz_bind_address,
                k.healthz_port,
                healthz_default,
            ),
            status_bind_address: match flags.status_bind_address {
                Some(a) => a.resolve(crate::status::DEFAULT_STATUS_PORT),
                None => Some(SocketAddr::from((
                    Ipv4Addr::LOCALHOST,
                    crate::status::DEFAULT_STATUS_PORT,
                ))),
            },
            bind_address_hard_fail: k
                .bind_address_hard_fail
                .or(f.bind_address_hard_fail)
                .unwrap_or(false),
            bind_address,
            cgroup_path: flags.cgroup_path,
            pins: flags.pins,
            hostname_override,
            lb_algorithm,
            maglev_table_size: flags
                .maglev_table_size
                .unwrap_or(proxy_common::MAGLEV_DEFAULT),
            socket_lb_scope: flags.socket_lb_scope.unwrap_or_default(),
            north_south_mode: flags.north_south_mode.unwrap_or_default(),
            kernel_log_level: flags.kernel_log_level.unwrap_or_default(),
            close_connections_to_removed_endpoints: flags.close_connections_to_removed_endpoints,
            log_level,
            verbosity,
            log_format: flags
                .log_format
                .or(k.logging_format)
                .or(f.log_format)
                .unwrap_or_default(),
            cluster_cidrs: flags
                .cluster_cidr
                .or(f.cluster_cidr.clone())
                .map(|c| c.0)
                .unwrap_or_default(),
            nodeport_addresses: flags.nodeport_addresses.or(f.node_port_addresses.clone()),
            map_sizes: MapSizeSettings {
                frontends: flags.max_frontends.unwrap_or(DEFAULT_MAX_FRONTENDS),
                slots: flags.max_backend_slots.unwrap_or(DEFAULT_MAX_SLOTS),
                backends: flags.max_backends.unwrap_or(DEFAULT_MAX_BACKENDS),
                sockets: flags.max_sockets.unwrap_or(DEFAULT_MAX_SOCKETS),
            },
            udp_flow_timeout: udp_flow_timeout
                .or(f.udp_flow_timeout)
                .unwrap_or(DEFAULT_UDP_FLOW_TIMEOUT),
            tc: TcSettings {
                interfaces: flags.interfaces,
                xdp: flags.xdp.unwrap_or_default(),
                xdp_veth_peers_ready: flags.xdp_veth_peers_ready,
                masquerade_all: flags.masquerade_all.or(f.masquerade_all).unwrap_or(false),
                conntrack_max_per_core: flags
                    .conntrack_max_per_core
                    .or(f.conntrack_max_per_core)
                    .unwrap_or(DEFAULT_CONNTRACK_MAX_PER_CORE),
                conntrack_min: flags
                    .conntrack_min
                    .filter(|&n| n != 0)
                    .or(f.conntrack_min)
                    .unwrap_or(DEFAULT_CONNTRACK_MIN),
                conntrack_tcp_timeout_established: flags
                    .conntrack_tcp_timeout_established
                    .filter(|d| !d.is_zero())
                    .or(f.conntrack_tcp_timeout_established)
                    .unwrap_or(DEFAULT_CT_TCP_ESTABLISHED),
                conntrack_udp_timeout_stream: flags
                    .conntrack_udp_timeout_stream
                    .filter(|d| !d.is_zero())
                    .or(f.conntrack_udp_timeout_stream)
                    .unwrap_or(DEFAULT_CT_UDP_STREAM),
            },
            oom_score_adj: k
                .oom_score_adj
                .or(f.oom_score_adj)
                .unwrap_or(DEFAULT_OOM_SCORE_ADJ),
            warnings,
            document: KubeProxyConfiguration::default(),
        };
        if c.sync_period > MAX_PERIOD {
            bail!("--sync-period must be at most 8760h (a year)");
        }
        if c.min_sync_period > c.sync_period {
            // Name where each value came from: a flag, the config file, or the default.
            let origin =
                |flag: Option<Duration>, file: Option<Duration>, field: &str| match (flag, file) {
                    (Some(_), _) => String::new(),
                    (None, Some(_)) => format!(", the config file's {field}"),
                    (None, None) => ", the default".to_string(),
                };
            bail!(
                "--min-sync-period ({}{}) is longer than --sync-period ({}{})",
                format_go_duration(c.min_sync_period),
                origin(min_sync_period, f.min_sync_period, "minSyncPeriod"),
                format_go_duration(c.sync_period),
                origin(sync_period, f.sync_period, "syncPeriod"),
            );
        }
        c.document = written::effective(&c, &k, &f.document);
        // Unless given, `conntrack.maxPerCore` is written as null, so that each program
        // applies its own default to the file: 0 here (a preallocated table), 32768 in
        // kube-proxy, for which 0 would mean "leave nf_conntrack_max alone" after a rollback.
        if !max_per_core_given && let Some(ct) = c.document.conntrack.as_mut() {
            ct.max_per_core = Some(serde_yaml_ng::Value::Null);
        }
        Ok(c)
    }

    /// The node name: `--hostname-override`, else `$NODE_NAME`, else the hostname
    /// (lowercased, as kube-proxy's `nodeutil.GetHostname`).
    pub fn node_name(&self) -> String {
        self.hostname_override
            .clone()
            .filter(|s| !s.is_empty())
            .or_else(|| {
                std::env::var("NODE_NAME")
                    .ok()
                    .filter(|s| !s.trim().is_empty())
            })
            .or_else(|| {
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .ok()
                    .map(|s| s.trim().to_string())
            })
            .map(|s| s.trim().to_lowercase())
            .unwrap_or_default()
    }

    /// The effective configuration as kube-proxy's configuration file (YAML), as
    /// `--write-config-to` writes it.
    pub fn kube_proxy_configuration(&self) -> String {
        serde_yaml_ng::to_string(&self.document).expect("the document serializes")
    }

    /// `--write-config-to`: writes [`AgentConfig::kube_proxy_configuration`] to `path`.
    pub fn write_config(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.kube_proxy_configuration())
            .with_context(|| format!("--write-config-to {}", path.display()))
    }
}

mod written;

#[cfg(test)]
pub(crate) mod tests;
