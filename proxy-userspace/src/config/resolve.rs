//! [`AgentConfig::resolve`]: the flags given, the file's settings and the defaults applied onto
//! the one settings type (a flag given wins, then the file, then the default of
//! [`super::defaults`]): by the table of `settings` for its settings, by one line each here
//! for the others; then the checks across settings, then the written-back document built
//! from the result ([`super::written`]).

use std::net::SocketAddr;

use anyhow::{Result, bail};
use proxy_common::Algorithm;

use super::defaults::{self, DEFAULT_LOG_LEVEL, MAX_PERIOD};
use super::go::format_go_duration;
use super::settings::{self, Origins};
use super::table::Origin;
use super::values::{
    IpvsScheduler, LogFormat, ProxyMode, SchedulerFlag, ServerAddress, bind_address_warning,
};
use super::{
    Action, AgentConfig, FileSettings, KubeProxyConfiguration, KubeProxyFlags, RunFlags,
    SourceChoice, written,
};

impl AgentConfig {
    /// Merges the flags with the configuration file's settings (`file`, when `--config` was
    /// given) and the defaults.
    ///
    /// Errors: a mode other than empty or `ebpf` (except with `--cleanup`), an IPVS
    /// scheduler the data path does not implement, flags of one setting that disagree,
    /// `--min-sync-period` longer than `--sync-period` (as kube-proxy's validation, whether
    /// they come from flags or the file), an empty `--hostname-override` or one that is no
    /// node name, a `--pin-dir` that is not a plain name.
    pub fn resolve(flags: RunFlags, file: Option<FileSettings>) -> Result<AgentConfig> {
        let f = file.unwrap_or_default();
        let k = &flags.kube_proxy;
        // The fallible steps run in this order: it decides which of several errors is told.
        let action = action(k);
        // Refuses every mode but ebpf; the value itself is kept for the tests only.
        #[cfg_attr(not(test), allow(unused_variables))]
        let proxy_mode = proxy_mode(&flags, &f, &action)?;
        // The table's settings the flags give (several names of one setting must agree).
        let given = flags.settings.given()?;
        let (log_level, verbosity, log_format) = logging(&flags, &f);
        let mut c = AgentConfig {
            action,
            #[cfg(test)]
            proxy_mode,
            source: source(&flags, &f),
            master: k.master.clone().filter(|m| !m.trim().is_empty()),
            pins: flags.pins.clone(),
            lb_algorithm: lb_algorithm(&flags, &f),
            log_level,
            verbosity,
            log_format,
            warnings: warnings(&flags),
            document: KubeProxyConfiguration::default(),
            // The table's settings and the servers, set below.
            ..AgentConfig::default()
        };
        let origins = settings::apply(&mut c, &given, &f.values);
        // The servers' default addresses are IPv6 when the bind address (the table's) is.
        let ipv6 = c.bind_address.is_some_and(|ip| ip.is_ipv6());
        c.metrics_bind_address = server(
            flags.metrics_bind_address,
            f.metrics_bind_address,
            k.metrics_port,
            defaults::metrics_bind_address(ipv6),
        );
        c.healthz_bind_address = server(
            flags.healthz_bind_address,
            f.healthz_bind_address,
            k.healthz_port,
            defaults::healthz_bind_address(ipv6),
        );
        c.check_sync_periods(&origins)?;
        // Refused by every command that opens the pins; `--write-config-to` checks it too.
        crate::datapath::loader::check_pin_dir_name(&c.pins.pin_dir)?;
        c.document = written::effective(&c, k, &f.document, &origins);
        Ok(c)
    }

    /// kube-proxy's validation of the sync periods, whether they come from flags or the
    /// file: the period at most [`MAX_PERIOD`], the minimum not longer than the period.
    fn check_sync_periods(&self, origins: &Origins) -> Result<()> {
        if self.sync_period > MAX_PERIOD {
            let what = match origins.sync_period {
                Origin::File => "the config file's syncPeriod",
                _ => "--sync-period",
            };
            bail!("{what} must be at most 8760h (a year)");
        }
        if self.min_sync_period > self.sync_period {
            // Name where each value came from: a flag, the config file, or the default.
            let origin = |origin: Origin, field: &str| match origin {
                Origin::Flag => String::new(),
                Origin::File => format!(", the config file's {field}"),
                Origin::Default => ", the default".to_string(),
            };
            bail!(
                "--min-sync-period ({}{}) is longer than --sync-period ({}{})",
                format_go_duration(self.min_sync_period),
                origin(origins.min_sync_period, "minSyncPeriod"),
                format_go_duration(self.sync_period),
                origin(origins.sync_period, "syncPeriod"),
            );
        }
        Ok(())
    }
}

/// What the process does (kube-proxy's order: `--write-config-to` first, then `--cleanup`,
/// then `--init-only`).
fn action(k: &KubeProxyFlags) -> Action {
    if let Some(path) = k.write_config_to.clone() {
        Action::WriteConfig(path)
    } else if k.cleanup == Some(true) {
        Action::Cleanup
    } else if k.init_only == Some(true) {
        Action::InitOnly
    } else {
        Action::Run
    }
}

/// `--proxy-mode`, else the file's `mode`: only ebpf runs, except that `--cleanup` removes
/// what ebpf-proxy installed whatever the mode says. The error names where the mode came
/// from.
fn proxy_mode(flags: &RunFlags, f: &FileSettings, action: &Action) -> Result<ProxyMode> {
    let (mode, origin) = match &flags.kube_proxy.proxy_mode {
        Some(m) => (ProxyMode::parse(m), "--proxy-mode".to_string()),
        None => {
            let origin = match &flags.config {
                Some(path) => format!("--config {}: mode", path.display()),
                None => "--config: mode".to_string(),
            };
            (f.mode.clone().unwrap_or_default(), origin)
        }
    };
    if *action != Action::Cleanup {
        mode.require_ebpf(&origin)?;
    }
    Ok(mode)
}

/// `--manifests`, else the API with `--kubeconfig`, else the file's kubeconfig (also a
/// source choice; `--manifests` is the other one).
fn source(flags: &RunFlags, f: &FileSettings) -> SourceChoice {
    match &flags.manifests {
        Some(m) => SourceChoice::Manifests(m.clone()),
        None => SourceChoice::Api(flags.kubeconfig.clone().or(f.kubeconfig.clone())),
    }
}

/// `--lb-algorithm`, else `--ipvs-scheduler` (empty: the default algorithm, over the file),
/// else the file's `ipvs.scheduler`, else random.
fn lb_algorithm(flags: &RunFlags, f: &FileSettings) -> Algorithm {
    match (flags.lb_algorithm, flags.kube_proxy.ipvs_scheduler) {
        (Some(a), _) => a,
        (None, Some(SchedulerFlag(Some(s)))) => s.algorithm(),
        (None, Some(SchedulerFlag(None))) => Algorithm::default(),
        (None, None) => f
            .ipvs_scheduler
            .map(IpvsScheduler::algorithm)
            .unwrap_or_default(),
    }
}

/// The log level (`--log-level`, else the one of `-v` or the file's verbosity), the
/// verbosity as given, and the format (`--log-format`, `--logging-format`, the file's).
fn logging(flags: &RunFlags, f: &FileSettings) -> (String, Option<u32>, LogFormat) {
    let k = &flags.kube_proxy;
    let verbosity = k.verbosity.or(f.verbosity);
    let log_level = flags
        .log_level
        .clone()
        .or_else(|| verbosity.map(|v| log_level_of_verbosity(v).to_string()))
        .unwrap_or_else(|| DEFAULT_LOG_LEVEL.into());
    let log_format = flags
        .log_format
        .or(k.logging_format)
        .or(f.log_format)
        .unwrap_or_default();
    (log_level, verbosity, log_format)
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

/// A server's address: the flag (empty disables the server), else the file's, else
/// `default`; a deprecated port flag then sets the port or, at 0, disables the server.
fn server(
    flag: Option<ServerAddress>,
    file: Option<SocketAddr>,
    port_flag: Option<u16>,
    default: SocketAddr,
) -> Option<SocketAddr> {
    let mut addr = match flag {
        Some(a) => a.resolve(default.port()),
        None => Some(file.unwrap_or(default)),
    };
    if let Some(port) = port_flag {
        addr = (port != 0).then(|| SocketAddr::new(addr.map_or(default.ip(), |a| a.ip()), port));
    }
    addr
}

/// One line per flag given that has no effect here (`--bind-address`, whose address is not
/// used, first; then those of
/// [`KubeProxyFlags::warnings`]), then one when the two log format flags disagree.
fn warnings(flags: &RunFlags) -> Vec<String> {
    let k = &flags.kube_proxy;
    let mut warnings: Vec<String> = flags
        .bind_address
        .filter(|ip| !ip.is_unspecified())
        .map(|_| bind_address_warning("flag --bind-address"))
        .into_iter()
        .collect();
    warnings.extend(k.warnings());
    if k.logging_format.is_some()
        && flags.log_format.is_some()
        && k.logging_format != flags.log_format
    {
        warnings
            .push("flags --log-format and --logging-format disagree: --log-format is used".into());
    }
    warnings
}
