//! The readers of `KubeProxyConfiguration` fields: each takes the field's dotted path and
//! its value as serde read it, and returns the value of the setting (`None`: unset, as
//! kube-proxy's defaulting treats zero values) or an error that names the field. Shared by
//! the settings table (`settings`) and the file's own checks (`file`).

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use anyhow::{Result, bail};
use serde_yaml_ng::Value;

use super::defaults::{MAX_CONNTRACK_FLOWS, MIN_CONNTRACK_FLOWS};
use super::go::{format_go_duration, parse_go_duration};
use super::values::{ClusterCidrs, NodePortAddresses, ServerAddress, check_node_name};

/// True for a value that kube-proxy treats as unset: null, false, 0, "", a zero duration,
/// and empty lists or maps (or maps holding only such values).
pub(crate) fn is_unset(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty() || parse_go_duration(s).is_ok_and(|d| d.is_zero()),
        Value::Sequence(s) => s.is_empty(),
        Value::Mapping(m) => m.values().all(is_unset),
        Value::Tagged(_) => false,
    }
}

/// A YAML value as written (for messages), not its Rust debug form.
pub(crate) fn show(v: &Value) -> String {
    serde_yaml_ng::to_string(v)
        .map(|s| s.trim_end().to_string())
        .unwrap_or_else(|_| format!("{v:?}"))
}

/// A string field; empty means unset.
pub(super) fn text(v: &Option<String>) -> Option<&str> {
    v.as_deref().map(str::trim).filter(|s| !s.is_empty())
}

/// A duration field (Go notation in a string); null, absent or empty is `None`, zero is
/// `Some(0)`. Anything else that is not a duration is an error naming the field.
pub(super) fn duration(field: &str, v: &Option<Value>) -> Result<Option<Duration>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.trim().is_empty() => Ok(None),
        Some(Value::String(s)) => parse_go_duration(s)
            .map(Some)
            .map_err(|e| anyhow::anyhow!("{field}: {e}")),
        Some(other) => bail!(
            "{field}: {} is not a duration; write a string such as \"30s\" or \"1m30s\"",
            show(other)
        ),
    }
}

/// A duration field where zero means unset (kube-proxy's defaulting replaces it).
pub(super) fn nonzero_duration(field: &str, v: &Option<Value>) -> Result<Option<Duration>> {
    Ok(duration(field, v)?.filter(|d| !d.is_zero()))
}

/// A boolean field, as read (serde checked its type).
pub(super) fn boolean(_field: &str, v: &Option<bool>) -> Result<Option<bool>> {
    Ok(*v)
}

/// A duration field where zero means unset (kube-proxy's "0 to leave as-is"); a value
/// below 1 ms is an error.
pub(super) fn timeout(field: &str, v: &Option<Value>) -> Result<Option<Duration>> {
    let Some(d) = duration(field, v)?.filter(|d| !d.is_zero()) else {
        return Ok(None);
    };
    if d < Duration::from_millis(1) {
        bail!(
            "{field}: {} is too short (at least 1ms)",
            format_go_duration(d)
        );
    }
    Ok(Some(d))
}

/// An integer field in `least..=most` (kube-proxy's `*int32`); null or absent is `None`.
pub(super) fn count(field: &str, v: &Option<Value>, least: i64, most: i64) -> Result<Option<i64>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_i64() {
            Some(n) if n >= least && n <= most => Ok(Some(n)),
            _ => bail!(
                "{field}: {} is not an integer from {least} to {most}",
                show(v)
            ),
        },
    }
}

/// The reader of an integer field in `least..=most` (see [`count`]).
pub(super) fn count_in<T>(least: T, most: T) -> impl Fn(&str, &Option<Value>) -> Result<Option<T>>
where
    T: Into<i64> + TryFrom<i64> + Copy,
{
    move |field, v| Ok(count(field, v, least.into(), most.into())?.and_then(|n| T::try_from(n).ok()))
}

/// `conntrack.min`: 0 is kube-proxy's "leave it as is", the default here; otherwise a number
/// of flows from [`MIN_CONNTRACK_FLOWS`] to [`MAX_CONNTRACK_FLOWS`].
pub(super) fn conntrack_min(field: &str, v: &Option<Value>) -> Result<Option<u32>> {
    match v {
        Some(v) if v.as_i64() == Some(0) => Ok(None),
        v => count_in(MIN_CONNTRACK_FLOWS, MAX_CONNTRACK_FLOWS)(field, v),
    }
}

/// An IP address (`bindAddress`); empty is `None`.
pub(super) fn ip_address(field: &str, v: &Option<String>) -> Result<Option<IpAddr>> {
    text(v)
        .map(|b| {
            b.parse()
                .map_err(|_| anyhow::anyhow!("{field}: {b:?} is not an IP address"))
        })
        .transpose()
}

/// A node name (`hostnameOverride`), trimmed; empty is `None`; once lowercased, a DNS
/// subdomain ([`check_node_name`]).
pub(super) fn name(field: &str, v: &Option<String>) -> Result<Option<String>> {
    let Some(name) = text(v) else {
        return Ok(None);
    };
    if let Err(e) = check_node_name(&name.to_lowercase()) {
        bail!("{field}: {e}");
    }
    Ok(Some(name.to_string()))
}

/// `clusterCIDR`: one CIDR, or an IPv4 and an IPv6 one; empty is `None`.
pub(super) fn cluster_cidrs(field: &str, v: &Option<String>) -> Result<Option<ClusterCidrs>> {
    text(v)
        .map(|c| c.parse().map_err(|e| anyhow::anyhow!("{field}: {e}")))
        .transpose()
}

/// `nodePortAddresses`: CIDRs, or `primary` alone; an empty list is `None`.
pub(super) fn node_port_addresses(
    field: &str,
    v: &Option<Vec<String>>,
) -> Result<Option<NodePortAddresses>> {
    v.as_ref()
        .filter(|v| !v.is_empty())
        .map(|items| {
            NodePortAddresses::from_items(items).map_err(|e| anyhow::anyhow!("{field}: {e}"))
        })
        .transpose()
}

/// An `ip:port` field (an IP alone gets `default_port`, as kube-proxy's defaulting appends
/// it); empty is `None`.
pub(super) fn server_address(
    field: &str,
    v: &Option<String>,
    default_port: u16,
) -> Result<Option<SocketAddr>> {
    let Some(s) = text(v) else { return Ok(None) };
    match s.parse::<ServerAddress>() {
        Ok(a) => Ok(a.resolve(default_port)),
        Err(_) => {
            bail!(
                "{field}: {s:?} is not an IP address and port (e.g. 0.0.0.0:{default_port} or [::]:{default_port})"
            )
        }
    }
}
