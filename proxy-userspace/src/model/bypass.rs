//! Which workloads of this node bypass socket-level translation.
//!
//! Translating at `connect()` hides the ClusterIP from everything below the socket: a
//! sidecar proxy that redirects a pod's outbound connections (iptables `REDIRECT`) and reads
//! their original destination (`SO_ORIGINAL_DST`) sees a pod IP; an application in a VM
//! (KubeVirt, Kata) has sockets the node's cgroup hooks never see. Such workloads opt out:
//! their sockets are left alone and their packets are translated on their interface
//! (`pod_ingress`/`pod_egress`, see `proxy_common::bypass`).
//!
//! The choice, per pod of this node (`spec.nodeName`), first that applies:
//! 1. the pod's label, else its annotation, [`SOCKET_LB_KEY`]: `disabled` bypasses,
//!    `enabled` keeps socket-level translation;
//! 2. the same key on its Namespace;
//! 3. `--socket-lb-scope`: `host-only` bypasses every pod (only the node's own network
//!    namespace is translated at the socket), `all` (the default) none.
//!
//! Pods with `hostNetwork` share the node's namespace and are never bypassed; pods that
//! finished (phase `Succeeded` or `Failed`) have no interface left and are skipped. Other
//! values of the key are reported and ignored.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

pub(crate) use crate::datapath::bypass::{BypassedPod, SocketLbScope};

/// Label or annotation (on a Pod or a Namespace) choosing socket-level translation:
/// `disabled` (bypass it: translate per packet) or `enabled`.
pub const SOCKET_LB_KEY: &str = "ebpf-proxy.io/socket-lb";

/// What the model keeps of a Pod.
#[derive(Clone, Debug, PartialEq, Eq)]
struct PodEntry {
    node: String,
    uid: String,
    ips: Vec<IpAddr>,
    version: String,
    host_network: bool,
    finished: bool,
    choice: Option<bool>,
}

/// The bypass part of the model: Pods and Namespaces as read, and the choice.
#[derive(Debug, Default)]
pub struct BypassState {
    scope: SocketLbScope,
    pods: BTreeMap<(String, String), PodEntry>,
    /// Namespace -> its choice (`Some(true)`: disabled, i.e. bypass).
    namespaces: BTreeMap<String, Option<bool>>,
    /// Bad values of [`SOCKET_LB_KEY`], by object, for the log.
    errors: BTreeMap<String, String>,
}

/// The choice an object's metadata makes: `Some(true)` bypass, `Some(false)` keep the
/// socket path, `None` no choice; `Err` names a value that is neither.
fn choice_of(meta: &ObjectMeta) -> Result<Option<bool>, String> {
    let label = meta.labels.as_ref().and_then(|l| l.get(SOCKET_LB_KEY));
    let annotation = meta.annotations.as_ref().and_then(|a| a.get(SOCKET_LB_KEY));
    match label.or(annotation).map(String::as_str) {
        None => Ok(None),
        Some("disabled") => Ok(Some(true)),
        Some("enabled") => Ok(Some(false)),
        Some(other) => Err(format!(
            "{SOCKET_LB_KEY}: {other:?} is neither \"disabled\" nor \"enabled\"; ignored"
        )),
    }
}

impl BypassState {
    /// Sets `--socket-lb-scope`.
    pub fn set_scope(&mut self, scope: SocketLbScope) {
        self.scope = scope;
    }

    /// `--socket-lb-scope`.
    pub fn scope(&self) -> SocketLbScope {
        self.scope
    }

    /// Reads a Pod (added or changed).
    pub fn apply_pod(&mut self, pod: &Pod) {
        let meta = &pod.metadata;
        let key = (
            meta.namespace.clone().unwrap_or_else(|| "default".into()),
            meta.name.clone().unwrap_or_default(),
        );
        let shown = format!("Pod {}/{}", key.0, key.1);
        let choice = match choice_of(meta) {
            Ok(c) => {
                self.errors.remove(&shown);
                c
            }
            Err(e) => {
                self.errors.insert(shown, e);
                None
            }
        };
        let spec = pod.spec.as_ref();
        let status = pod.status.as_ref();
        let mut ips: Vec<IpAddr> = status
            .and_then(|s| s.pod_ips.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|p| p.ip.parse().ok())
            .collect();
        if ips.is_empty()
            && let Some(ip) = status.and_then(|s| s.pod_ip.as_ref())
            && let Ok(ip) = ip.parse()
        {
            ips.push(ip);
        }
        let ip_text: Vec<String> = ips.iter().map(ToString::to_string).collect();
        let entry = PodEntry {
            node: spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
            uid: meta.uid.clone().unwrap_or_default(),
            version: meta
                .resource_version
                .clone()
                .unwrap_or_else(|| ip_text.join(",")),
            ips,
            host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
            finished: matches!(
                status.and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            ),
            choice,
        };
        self.pods.insert(key, entry);
    }

    /// A Pod is gone.
    pub fn delete_pod(&mut self, namespace: &str, name: &str) {
        self.pods.remove(&(namespace.to_string(), name.to_string()));
        self.errors.remove(&format!("Pod {namespace}/{name}"));
    }

    /// Reads a Namespace (added or changed).
    pub fn apply_namespace(&mut self, ns: &Namespace) {
        let name = ns.metadata.name.clone().unwrap_or_default();
        let shown = format!("Namespace {name}");
        let choice = match choice_of(&ns.metadata) {
            Ok(c) => {
                self.errors.remove(&shown);
                c
            }
            Err(e) => {
                self.errors.insert(shown, e);
                None
            }
        };
        self.namespaces.insert(name, choice);
    }

    /// A Namespace is gone.
    pub fn delete_namespace(&mut self, name: &str) {
        self.namespaces.remove(name);
        self.errors.remove(&format!("Namespace {name}"));
    }

    /// Bad values of the key, one line per object (`Pod ns/name: ...`).
    pub fn errors(&self) -> Vec<String> {
        self.errors
            .iter()
            .map(|(o, e)| format!("{o}: {e}"))
            .collect()
    }

    /// The pods of node `node` that bypass socket-level translation, in (namespace, name)
    /// order.
    pub fn bypassed(&self, node: &str) -> Vec<BypassedPod> {
        self.pods
            .iter()
            .filter(|(_, p)| p.node == node && !p.host_network && !p.finished)
            .filter_map(|((ns, name), p)| {
                let reason = match (p.choice, self.namespaces.get(ns).copied().flatten()) {
                    (Some(true), _) => "pod",
                    (Some(false), _) => return None,
                    (None, Some(true)) => "namespace",
                    (None, Some(false)) => return None,
                    (None, None) if self.scope == SocketLbScope::HostOnly => "host-only",
                    (None, None) => return None,
                };
                Some(BypassedPod {
                    namespace: ns.clone(),
                    name: name.clone(),
                    uid: p.uid.clone(),
                    ips: p.ips.clone(),
                    version: p.version.clone(),
                    reason,
                })
            })
            .collect()
    }

    /// Which path serves connections from `client`, a pod address: the bypassed pod it
    /// belongs to on this node, if any.
    #[cfg(test)]
    pub fn pod_of(&self, node: &str, client: &IpAddr) -> Option<BypassedPod> {
        self.bypassed(node)
            .into_iter()
            .find(|p| p.ips.contains(client))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ns: &str, name: &str, node: &str, labels: &[(&str, &str)], host: bool) -> Pod {
        let yaml = format!(
            "metadata: {{name: {name}, namespace: {ns}, uid: u-{name}, labels: {{{}}}}}\n\
             spec: {{nodeName: {node}, hostNetwork: {host}, containers: []}}\n\
             status: {{podIP: 10.0.0.9, podIPs: [{{ip: 10.0.0.9}}]}}\n",
            labels
                .iter()
                .map(|(k, v)| format!("\"{k}\": \"{v}\""))
                .collect::<Vec<_>>()
                .join(", ")
        );
        serde_yaml_ng::from_str(&yaml).unwrap()
    }

    fn namespace(name: &str, annotations: &[(&str, &str)]) -> Namespace {
        let yaml = format!(
            "metadata: {{name: {name}, annotations: {{{}}}}}\n",
            annotations
                .iter()
                .map(|(k, v)| format!("\"{k}\": \"{v}\""))
                .collect::<Vec<_>>()
                .join(", ")
        );
        serde_yaml_ng::from_str(&yaml).unwrap()
    }

    fn names(s: &BypassState) -> Vec<(String, &'static str)> {
        s.bypassed("n1")
            .into_iter()
            .map(|p| (p.name, p.reason))
            .collect()
    }

    #[test]
    fn pod_label_beats_namespace_which_beats_the_scope() {
        let mut s = BypassState::default();
        s.apply_pod(&pod(
            "a",
            "opted",
            "n1",
            &[(SOCKET_LB_KEY, "disabled")],
            false,
        ));
        s.apply_pod(&pod("a", "plain", "n1", &[], false));
        s.apply_pod(&pod(
            "a",
            "other-node",
            "n2",
            &[(SOCKET_LB_KEY, "disabled")],
            false,
        ));
        s.apply_pod(&pod(
            "a",
            "host",
            "n1",
            &[(SOCKET_LB_KEY, "disabled")],
            true,
        ));
        s.apply_pod(&pod("b", "in-b", "n1", &[], false));
        s.apply_pod(&pod(
            "b",
            "kept",
            "n1",
            &[(SOCKET_LB_KEY, "enabled")],
            false,
        ));
        assert_eq!(names(&s), vec![("opted".into(), "pod")]);
        s.apply_namespace(&namespace("b", &[(SOCKET_LB_KEY, "disabled")]));
        assert_eq!(
            names(&s),
            vec![("opted".into(), "pod"), ("in-b".into(), "namespace")]
        );
        s.set_scope(SocketLbScope::HostOnly);
        assert_eq!(
            names(&s),
            vec![
                ("opted".into(), "pod"),
                ("plain".into(), "host-only"),
                ("in-b".into(), "namespace"),
            ]
        );
        s.delete_namespace("b");
        s.delete_pod("a", "opted");
        s.set_scope(SocketLbScope::All);
        assert!(names(&s).is_empty());
        let found = s.pod_of("n1", &"10.0.0.9".parse().unwrap());
        assert!(found.is_none());
    }

    #[test]
    fn a_bad_value_is_reported_and_ignored() {
        let mut s = BypassState::default();
        s.apply_pod(&pod("a", "p", "n1", &[(SOCKET_LB_KEY, "off")], false));
        assert!(names(&s).is_empty());
        assert_eq!(s.errors().len(), 1);
        assert!(s.errors()[0].starts_with("Pod a/p: ebpf-proxy.io/socket-lb: \"off\""));
        s.apply_pod(&pod("a", "p", "n1", &[(SOCKET_LB_KEY, "disabled")], false));
        assert!(s.errors().is_empty());
        assert_eq!(s.bypassed("n1")[0].uid, "u-p");
        assert_eq!(
            s.bypassed("n1")[0].ips,
            vec!["10.0.0.9".parse::<IpAddr>().unwrap()]
        );
    }
}
