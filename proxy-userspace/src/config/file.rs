//! kube-proxy's configuration file (`--config`): a `KubeProxyConfiguration` of
//! `kubeproxy.config.k8s.io/v1alpha1`, read with serde into [`KubeProxyConfiguration`]
//! ([`super::document`]), then checked section by section, as kube-proxy's
//! `pkg/proxy/apis/config/validation` does.
//!
//! [`validate`] turns a document into [`FileSettings`]: the settings that have a meaning in
//! ebpf-proxy, checked, and one warning per field that is unknown or has no effect here.
//! kubeadm writes every field, mostly as `""`, `0s`, `false`, `0` or `null`: such zero values
//! mean "unset" (kube-proxy's defaulting) and are not reported. An invalid value stops
//! start-up with an error naming the field (and its line).

pub(crate) mod yaml;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result, bail};
use serde_yaml_ng::Value;

use self::yaml::{duplicate_key_line, field_line, plain_type_error};
use super::defaults::{DEFAULT_HEALTHZ_PORT, DEFAULT_METRICS_PORT, kube_proxy as kp};
pub use super::document::{
    ClientConnection, Conntrack, DetectLocal, IpTables, Ipvs, KubeProxyConfiguration, Logging,
    NfTables, Other, Winkernel,
};
use super::fields::{count, is_unset, server_address, text};
use super::go::{format_go_duration, parse_go_duration};
use super::settings::SettingValues;
use super::table::Section;
use super::values::{
    IpvsScheduler, LogFormat, ProxyMode, bind_address_warning, check_detect_local_mode,
};
use super::{API_VERSION, KIND};

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
/// (`plain_type_error`).
pub fn parse(text: &str) -> Result<Loaded> {
    let de = serde_yaml_ng::Deserializer::from_str(text);
    let file: KubeProxyConfiguration = serde_path_to_error::deserialize(de).map_err(|e| {
        let line = e.inner().location().map(|l| l.line());
        let field = e.path().to_string();
        // serde_yaml_ng names the field itself when it knows it: once is enough.
        let inner = e.inner().to_string();
        let inner = inner.strip_prefix(&format!("{field}: ")).unwrap_or(&inner);
        let mut msg = plain_type_error(inner);
        // A named field is reported as a field's error, as validation reports one; only an
        // error about the whole document says the document is not a configuration.
        let named = field != "." && field != "?";
        if named {
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
        if named {
            anyhow::anyhow!(msg)
        } else {
            anyhow::anyhow!("not a KubeProxyConfiguration document: {msg}")
        }
    })?;
    // A field's invalid value is named by its dotted path: add the line it is on.
    validate(&file).map_err(|e| {
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

/// The settings a configuration file gives, after validation; `None` where the file leaves
/// the setting unset (absent, empty, null, or a zero duration).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FileSettings {
    /// `clientConnection.kubeconfig`.
    pub kubeconfig: Option<PathBuf>,
    /// `healthzBindAddress` (an IP alone gets port 10256).
    pub healthz_bind_address: Option<SocketAddr>,
    /// `metricsBindAddress` (an IP alone gets port 10249).
    pub metrics_bind_address: Option<SocketAddr>,
    /// `mode`; `None` when empty.
    pub mode: Option<ProxyMode>,
    /// `ipvs.scheduler`.
    pub ipvs_scheduler: Option<IpvsScheduler>,
    /// `logging.format`.
    pub log_format: Option<LogFormat>,
    /// `logging.verbosity` (`-v`).
    pub verbosity: Option<u32>,
    /// The settings of the table of `settings` (read as fields of [`FileSettings`]).
    pub values: SettingValues,
    /// The document as read, for `--write-config-to` (it keeps the values of the fields
    /// without an effect here).
    pub document: KubeProxyConfiguration,
}

impl std::ops::Deref for FileSettings {
    type Target = SettingValues;

    fn deref(&self) -> &SettingValues {
        &self.values
    }
}

/// A configuration file, read and validated.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Loaded {
    /// The settings it gives.
    pub settings: FileSettings,
    /// One line per field that is unknown or has no effect here, by name.
    pub warnings: Vec<String>,
}

/// Collects the warnings of one level: unknown fields always, fields without an effect here
/// when they hold something other than their zero value.
struct Warnings(Vec<String>);

impl Warnings {
    fn unknown(&mut self, prefix: &str, other: &Other) {
        for name in other.keys() {
            self.0.push(format!(
                "--config: unknown field \"{prefix}{name}\" (not in {API_VERSION} {KIND}): ignored"
            ));
        }
    }

    fn inert(&mut self, path: &str, set: bool) {
        if set {
            self.0.push(format!(
                "--config: field \"{path}\" has no effect in ebpf-proxy: ignored"
            ));
        }
    }
}

fn set_value(v: &Option<Value>) -> bool {
    v.as_ref().is_some_and(|v| !is_unset(v))
}

/// Whether `v` is set (see [`set_value`]) to something other than kube-proxy's default
/// `default` (a number, or a duration in Go notation), so that a file holding kube-proxy's
/// defaults, such as one `--write-config-to` wrote, warns about nothing.
fn set_other_than(v: &Option<Value>, default: &str) -> bool {
    let Some(v) = v.as_ref().filter(|v| !is_unset(v)) else {
        return false;
    };
    match v {
        Value::Number(n) => n.as_f64() != default.parse::<f64>().ok(),
        Value::String(s) => match (parse_go_duration(s), parse_go_duration(default)) {
            (Ok(a), Ok(b)) => a != b,
            _ => s.trim() != default,
        },
        _ => true,
    }
}

fn set_text(v: &Option<String>) -> bool {
    text(v).is_some()
}

fn set_bool(v: &Option<bool>) -> bool {
    v.unwrap_or(false)
}

/// [`set_other_than`] kube-proxy's default number `default`.
fn set_other_than_number(v: &Option<Value>, default: i64) -> bool {
    set_other_than(v, &default.to_string())
}

/// [`set_other_than`] kube-proxy's default duration `default`.
fn set_other_than_duration(v: &Option<Value>, default: Duration) -> bool {
    set_other_than(v, &format_go_duration(default))
}

/// Checks a parsed document and extracts its settings, section by section (the order of the
/// checks decides which of several errors is reported).
///
/// Errors: `apiVersion`/`kind` are not kube-proxy's v1alpha1 configuration, or a field has an
/// invalid value (the message names the field). `mode` is returned, not judged here: the
/// caller decides ([`super::AgentConfig::resolve`]).
pub fn validate(file: &KubeProxyConfiguration) -> Result<Loaded> {
    check_type(file)?;
    let mut s = FileSettings {
        document: file.clone(),
        mode: text(&file.mode).map(ProxyMode::parse),
        ..Default::default()
    };
    let mut w = Warnings(Vec::new());
    top_level(file, &mut s, &mut w)?;
    sync_periods(file, &mut s)?;
    mode_sections(file, &mut s, &mut w)?;
    s.values.read(file, Section::Conntrack)?;
    if let Some(c) = &file.conntrack {
        conntrack(c, &mut w);
    }
    if let Some(c) = &file.client_connection {
        client_connection(c, &mut s, &mut w);
    }
    if let Some(l) = &file.logging {
        logging(l, &mut s, &mut w)?;
    }
    detect_local(file, &mut w)?;
    if let Some(k) = &file.winkernel {
        winkernel(k, &mut w);
    }
    top_level_inert(file, &mut w);
    w.unknown("", &file.other);
    Ok(Loaded {
        settings: s,
        warnings: w.0,
    })
}

/// `apiVersion` and `kind`.
fn check_type(file: &KubeProxyConfiguration) -> Result<()> {
    match file.api_version.as_deref() {
        Some(API_VERSION) => {}
        Some(other) => bail!("apiVersion: expected {API_VERSION:?}, found {other:?}"),
        None => bail!("apiVersion: expected {API_VERSION:?}, found none"),
    }
    match file.kind.as_deref() {
        Some(KIND) => {}
        Some(other) => bail!("kind: expected {KIND:?}, found {other:?}"),
        None => bail!("kind: expected {KIND:?}, found none"),
    }
    Ok(())
}

/// The top level's settings: `bindAddress` (by `settings`, with its warning), the server
/// addresses, then the table's others (`clusterCIDR`, `hostnameOverride`,
/// `bindAddressHardFail`, `nodePortAddresses`, `oomScoreAdj`), in this order.
fn top_level(file: &KubeProxyConfiguration, s: &mut FileSettings, w: &mut Warnings) -> Result<()> {
    s.values.read(file, Section::BindAddress)?;
    if let Some(b) = text(&file.bind_address)
        && s.bind_address.is_some_and(|ip| !ip.is_unspecified())
    {
        w.0.push(bind_address_warning(&format!(
            "--config: field \"bindAddress\" ({b})"
        )));
    }
    s.healthz_bind_address = server_address(
        "healthzBindAddress",
        &file.healthz_bind_address,
        DEFAULT_HEALTHZ_PORT,
    )?;
    s.metrics_bind_address = server_address(
        "metricsBindAddress",
        &file.metrics_bind_address,
        DEFAULT_METRICS_PORT,
    )?;
    s.values.read(file, Section::TopLevel)?;
    Ok(())
}

/// The sync periods: kube-proxy reads them from its mode's section. ebpf-proxy has no
/// section of its own, so it takes them from any of the three (`settings`: values given in
/// several must agree); the minimum must not be longer than the period.
fn sync_periods(file: &KubeProxyConfiguration, s: &mut FileSettings) -> Result<()> {
    s.values.read(file, Section::SyncPeriods)?;
    if let (Some(min), Some(max)) = (s.min_sync_period, s.sync_period)
        && min > max
    {
        bail!(
            "minSyncPeriod: {} is longer than syncPeriod ({})",
            format_go_duration(min),
            format_go_duration(max)
        );
    }
    Ok(())
}

/// `iptables`, `nftables` and `ipvs` (their sync periods are read by [`sync_periods`]):
/// `masqueradeAll` from either of the first two (by `settings`), `ipvs.scheduler`.
fn mode_sections(
    file: &KubeProxyConfiguration,
    s: &mut FileSettings,
    w: &mut Warnings,
) -> Result<()> {
    s.values.read(file, Section::ModeSections)?;
    if let Some(t) = &file.iptables {
        w.inert(
            "iptables.masqueradeBit",
            set_other_than_number(&t.masquerade_bit, kp::MASQUERADE_BIT),
        );
        // ebpf-proxy never serves node ports on loopback, as kube-proxy's nftables mode, which
        // ignores this field too; no warning, since kube-proxy's default (true) is in every
        // file it writes.
        w.unknown("iptables.", &t.other);
    }
    if let Some(t) = &file.nftables {
        w.inert(
            "nftables.masqueradeBit",
            set_other_than_number(&t.masquerade_bit, kp::MASQUERADE_BIT),
        );
        w.unknown("nftables.", &t.other);
    }
    if let Some(t) = &file.ipvs {
        if let Some(name) = text(&t.scheduler) {
            s.ipvs_scheduler = Some(
                name.parse::<IpvsScheduler>()
                    .map_err(|e| anyhow::anyhow!("ipvs.scheduler: {e}"))?,
            );
        }
        w.inert(
            "ipvs.excludeCIDRs",
            t.exclude_cidrs.as_ref().is_some_and(|v| !v.is_empty()),
        );
        w.inert("ipvs.strictARP", set_bool(&t.strict_arp));
        w.inert("ipvs.tcpTimeout", set_value(&t.tcp_timeout));
        w.inert("ipvs.tcpFinTimeout", set_value(&t.tcp_fin_timeout));
        w.inert("ipvs.udpTimeout", set_value(&t.udp_timeout));
        w.unknown("ipvs.", &t.other);
    }
    Ok(())
}

/// `conntrack`'s fields without an effect here (the UDP flow timeout and the north-south
/// conntrack table are read by `settings`).
fn conntrack(c: &Conntrack, w: &mut Warnings) {
    w.inert(
        "conntrack.tcpCloseWaitTimeout",
        set_other_than_duration(
            &c.tcp_close_wait_timeout,
            kp::CONNTRACK_TCP_CLOSE_WAIT_TIMEOUT,
        ),
    );
    w.inert("conntrack.tcpBeLiberal", set_bool(&c.tcp_be_liberal));
    w.unknown("conntrack.", &c.other);
}

/// `clientConnection`: the kubeconfig.
fn client_connection(c: &ClientConnection, s: &mut FileSettings, w: &mut Warnings) {
    s.kubeconfig = text(&c.kubeconfig).map(PathBuf::from);
    w.inert(
        "clientConnection.acceptContentTypes",
        set_text(&c.accept_content_types),
    );
    w.inert(
        "clientConnection.contentType",
        text(&c.content_type).is_some_and(|t| t != kp::CONTENT_TYPE),
    );
    w.inert(
        "clientConnection.qps",
        set_other_than_number(&c.qps, kp::QPS),
    );
    w.inert(
        "clientConnection.burst",
        set_other_than_number(&c.burst, kp::BURST),
    );
    w.unknown("clientConnection.", &c.other);
}

/// `logging`: the format and the verbosity.
fn logging(l: &Logging, s: &mut FileSettings, w: &mut Warnings) -> Result<()> {
    s.log_format = match text(&l.format) {
        None => None,
        Some(f) => Some(LogFormat::from_name(f).ok_or_else(|| {
            anyhow::anyhow!("logging.format: {f:?} is not supported; use \"text\" or \"json\"")
        })?),
    };
    s.verbosity = count("logging.verbosity", &l.verbosity, 0, u32::MAX as i64)?
        .map(|n| n as u32)
        .filter(|n| *n > 0);
    w.inert(
        "logging.flushFrequency",
        set_other_than_duration(&l.flush_frequency, kp::LOG_FLUSH_FREQUENCY),
    );
    w.inert("logging.vmodule", set_value(&l.vmodule));
    w.inert("logging.options", set_value(&l.options));
    w.unknown("logging.", &l.other);
    Ok(())
}

/// `detectLocal` and `detectLocalMode`: kube-proxy refuses a mode it does not know;
/// ClusterCIDR is what ebpf-proxy does with clusterCIDR, the other modes are not.
fn detect_local(file: &KubeProxyConfiguration, w: &mut Warnings) -> Result<()> {
    if let Some(d) = &file.detect_local {
        w.inert("detectLocal.bridgeInterface", set_text(&d.bridge_interface));
        w.inert(
            "detectLocal.interfaceNamePrefix",
            set_text(&d.interface_name_prefix),
        );
        w.unknown("detectLocal.", &d.other);
    }
    if let Some(m) = text(&file.detect_local_mode) {
        check_detect_local_mode(m).map_err(|e| anyhow::anyhow!("detectLocalMode: {e}"))?;
    }
    w.inert(
        "detectLocalMode",
        text(&file.detect_local_mode).is_some_and(|m| m != kp::DETECT_LOCAL_MODE),
    );
    Ok(())
}

/// `winkernel`: Windows only, nothing has an effect.
fn winkernel(k: &Winkernel, w: &mut Warnings) {
    w.inert("winkernel.enableDSR", set_bool(&k.enable_dsr));
    w.inert(
        "winkernel.forwardHealthCheckVip",
        set_bool(&k.forward_health_check_vip),
    );
    w.inert("winkernel.networkName", set_text(&k.network_name));
    w.inert(
        "winkernel.rootHnsEndpointName",
        set_text(&k.root_hns_endpoint_name),
    );
    w.inert("winkernel.sourceVip", set_text(&k.source_vip));
    w.unknown("winkernel.", &k.other);
}

/// The top level's fields without an effect here.
fn top_level_inert(file: &KubeProxyConfiguration, w: &mut Warnings) {
    w.inert(
        "configSyncPeriod",
        set_other_than_duration(&file.config_sync_period, kp::CONFIG_SYNC_PERIOD),
    );
    w.inert("enableProfiling", set_bool(&file.enable_profiling));
    w.inert(
        "featureGates",
        file.feature_gates.as_ref().is_some_and(|g| !g.is_empty()),
    );
    w.inert("portRange", set_text(&file.port_range));
    w.inert(
        "showHiddenMetricsForVersion",
        set_text(&file.show_hidden_metrics_for_version),
    );
    w.inert(
        "windowsRunAsService",
        set_bool(&file.windows_run_as_service),
    );
}
