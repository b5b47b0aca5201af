//! The Kubernetes API source: `v1/Service`, `discovery.k8s.io/v1/EndpointSlice` and this
//! node's `v1/Node`, followed with `kube::runtime::watcher`, each event turned into a
//! [`Change`] at once (no store of objects is kept: the model reads each object once).
//!
//! Rules (kube-proxy's, see `pkg/proxy/config`):
//! - The view is complete ([`Batch::synced`]) once the initial lists of Services and
//!   EndpointSlices have both completed, so a restarted agent never removes backends whose
//!   slices have not arrived. The Node is not waited for (a node object may be missing).
//! - Changes are passed on as they arrive; pacing (`--min-sync-period`) is the agent's.
//! - API errors are retried with kube-rs' default exponential backoff (0.8 s doubling to
//!   30 s, jittered), reset only by an answer of the API server (a listed object, the end
//!   of a list, a watch event): the watcher's own "about to list" step is no answer, so an
//!   unreachable server is not retried every second; a `410 Gone` makes it relist. While the API is unreachable nothing changes, so nothing is flushed. A relist
//!   passes on the objects it lists and, when it completes, a deletion for every object it
//!   no longer lists, so a deletion is applied only after a successful list or watch event
//!   says so. A failing watch is logged when it starts failing and when it recovers, not on
//!   every retry.
//! - Services and EndpointSlices are watched with kube-proxy's label selector
//!   `!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless`
//!   ([`PROXY_LABEL_SELECTOR`]), so objects meant for another proxy and the
//!   slices of headless Services are filtered by the API server (an object that gains a
//!   label arrives as a deletion); the model applies the same rule to every source. The
//!   Node is watched by name (`metadata.name=NODE`).
//! - `metadata.managedFields` and the `kubectl.kubernetes.io/last-applied-configuration`
//!   annotation are dropped from every object on arrival.
//!
//! Access used (checked against the Helm chart's ClusterRole by a test): [`API_ACCESS`].

use std::collections::HashSet;

use futures::StreamExt;
use k8s_openapi::{
    api::{
        core::v1::{Namespace, Node, Pod, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    Api, Client, Resource,
    runtime::{WatchStreamExt, watcher},
};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::{Batch, Change, Kind, Object, Source, Sourced};

/// Every (API group, resource, verbs) the agent uses; the chart's ClusterRole
/// (`deploy/helm/ebpf-proxy/templates/rbac.yaml`) must grant them.
pub const API_ACCESS: &[(&str, &str, &[&str])] = &[
    ("", "services", &["list", "watch"]),
    ("discovery.k8s.io", "endpointslices", &["list", "watch"]),
    ("", "nodes", &["list", "watch"]),
    ("", "pods", &["list", "watch"]),
    ("", "namespaces", &["list", "watch"]),
];

/// The label selector of kube-proxy's Service and EndpointSlice watches
/// (`cmd/kube-proxy/app/server.go`): objects with either label
/// (`service.kubernetes.io/service-proxy-name`, `service.kubernetes.io/headless`) are not
/// proxied; the model applies the same rule to objects of every source.
pub const PROXY_LABEL_SELECTOR: &str =
    "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// Origin recorded on objects from the API (appears in skipped-object messages).
pub const API_ORIGIN: &str = "api";

/// Objects of a relist passed on per batch (so a large list never sits in memory whole).
const RELIST_CHUNK: usize = 500;

/// A [`Source`] following the Kubernetes API.
pub struct KubeSource {
    client: Client,
    node_name: String,
}

impl KubeSource {
    /// A source using `client`, watching the Node named `node_name`.
    pub fn new(client: Client, node_name: impl Into<String>) -> Self {
        Self {
            client,
            node_name: node_name.into(),
        }
    }
}

fn strip(meta: &mut ObjectMeta) {
    meta.managed_fields = None;
    if let Some(a) = meta.annotations.as_mut() {
        a.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
}

/// What one watcher sends to the merging loop.
struct Part {
    kind: Kind,
    changes: Vec<Change>,
    /// The kind's list completed with this part.
    listed: bool,
    received: std::time::Instant,
}

/// Turns watch events of one kind into changes. Tracks the keys it passed on, so a relist
/// can delete what it no longer lists.
#[derive(Default)]
pub struct Tracker {
    known: HashSet<(String, String)>,
    relist: Option<HashSet<(String, String)>>,
}

impl Tracker {
    /// The changes of one watch event (`wrap` makes the object; `key` reads its key), and
    /// whether a list completed with it.
    pub fn event<K>(
        &mut self,
        kind: Kind,
        ev: watcher::Event<K>,
        wrap: impl Fn(K) -> Object,
        out: &mut Vec<Change>,
    ) -> bool
    where
        K: Resource,
    {
        let key = |o: &K| {
            let m = o.meta();
            (
                if matches!(kind, Kind::Node | Kind::Namespace) {
                    String::new()
                } else {
                    m.namespace.clone().unwrap_or_default()
                },
                m.name.clone().unwrap_or_default(),
            )
        };
        match ev {
            watcher::Event::Apply(o) => {
                self.known.insert(key(&o));
                out.push(Change::Apply(wrap(o)));
                false
            }
            watcher::Event::Delete(o) => {
                let k = key(&o);
                self.known.remove(&k);
                out.push(Change::Delete(kind, k));
                false
            }
            watcher::Event::Init => {
                self.relist = Some(HashSet::new());
                false
            }
            watcher::Event::InitApply(o) => {
                let k = key(&o);
                self.known.insert(k.clone());
                self.relist.get_or_insert_with(HashSet::new).insert(k);
                out.push(Change::Apply(wrap(o)));
                false
            }
            watcher::Event::InitDone => {
                let listed = self.relist.take().unwrap_or_default();
                for k in self.known.iter().filter(|k| !listed.contains(*k)) {
                    out.push(Change::Delete(kind, k.clone()));
                }
                self.known = listed;
                true
            }
        }
    }
}

/// Drives one watcher, sending its changes to the merging loop. Logs a failing watch once
/// when it starts failing and once when it recovers.
async fn drive<K>(
    kind: Kind,
    api: Api<K>,
    cfg: watcher::Config,
    wrap: fn(K) -> Object,
    tx: mpsc::Sender<Part>,
) where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
{
    use kube::runtime::utils::Backoff as _;
    let stream = watcher(api, cfg).modify(|o: &mut K| strip(o.meta_mut()));
    futures::pin_mut!(stream);
    // Not `default_backoff()`: its stream resets the backoff on every `Ok`, and the watcher
    // yields `Ok(Init)` before each list attempt, so an unreachable server was retried
    // about every second forever and each attempt logged as a recovery.
    let mut backoff = watcher::DefaultBackoff::default();
    let mut failing = false;
    let mut tracker = Tracker::default();
    let mut changes = Vec::new();
    let mut received = None;
    while let Some(ev) = stream.next().await {
        match ev {
            Ok(ev) => {
                if matches!(ev, watcher::Event::Init) {
                    debug!(kind = kind.as_str(), "listing");
                } else {
                    // The API server answered.
                    backoff.reset();
                    if failing {
                        info!(kind = kind.as_str(), "watch recovered");
                        failing = false;
                    }
                }
                let init_apply = matches!(ev, watcher::Event::InitApply(_));
                received.get_or_insert_with(std::time::Instant::now);
                let listed = tracker.event(kind, ev, wrap, &mut changes);
                if init_apply && changes.len() < RELIST_CHUNK {
                    continue;
                }
                if changes.is_empty() && !listed {
                    continue;
                }
                let part = Part {
                    kind,
                    changes: std::mem::take(&mut changes),
                    listed,
                    received: received.take().expect("set above"),
                };
                if tx.send(part).await.is_err() {
                    return;
                }
            }
            Err(e) => {
                // The causes too: kube's own text stops at "client error (Connect)".
                let error = crate::error_chain(&anyhow::Error::new(e));
                if !failing {
                    warn!(kind = kind.as_str(), error = %error, "watch failed; retrying with backoff, the data path keeps its last state");
                    failing = true;
                } else {
                    debug!(kind = kind.as_str(), error = %error, "watch still failing");
                }
                let delay = backoff.next().unwrap_or(std::time::Duration::from_secs(30));
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// Merges the watchers' parts into batches, marking them synced once Services and
/// EndpointSlices have both been listed.
async fn merge(mut parts: mpsc::Receiver<Part>, tx: mpsc::Sender<Batch>) {
    let (mut services, mut slices) = (false, false);
    let mut synced = false;
    while let Some(p) = parts.recv().await {
        if p.listed {
            match p.kind {
                Kind::Service => services = true,
                Kind::EndpointSlice => slices = true,
                Kind::Node | Kind::Pod | Kind::Namespace => {}
            }
        }
        if !synced && services && slices {
            info!("initial lists of Services and EndpointSlices complete");
            synced = true;
        }
        let batch = Batch {
            changes: p.changes,
            errors: None,
            synced,
            received: p.received,
        };
        if tx.send(batch).await.is_err() {
            return;
        }
    }
}

/// The watch of each kind: Services and EndpointSlices with kube-proxy's label selector,
/// this node's Node by name.
pub fn watch_config(kind: Kind, node_name: &str) -> watcher::Config {
    let cfg = watcher::Config::default();
    match kind {
        Kind::Service | Kind::EndpointSlice => cfg.labels(PROXY_LABEL_SELECTOR),
        Kind::Node => cfg.fields(&format!("metadata.name={node_name}")),
        // This node's pods only (as kubelet watches its own), for the socket-level bypass.
        Kind::Pod => cfg.fields(&format!("spec.nodeName={node_name}")),
        Kind::Namespace => cfg,
    }
}

impl Source for KubeSource {
    fn start(self) -> anyhow::Result<mpsc::Receiver<Batch>> {
        let (part_tx, part_rx) = mpsc::channel(64);
        tokio::spawn(drive(
            Kind::Service,
            Api::<Service>::all(self.client.clone()),
            watch_config(Kind::Service, &self.node_name),
            |o| Object::Service(Sourced::new(API_ORIGIN, o)),
            part_tx.clone(),
        ));
        tokio::spawn(drive(
            Kind::EndpointSlice,
            Api::<EndpointSlice>::all(self.client.clone()),
            watch_config(Kind::EndpointSlice, &self.node_name),
            |o| Object::EndpointSlice(Sourced::new(API_ORIGIN, o)),
            part_tx.clone(),
        ));
        tokio::spawn(drive(
            Kind::Node,
            Api::<Node>::all(self.client.clone()),
            watch_config(Kind::Node, &self.node_name),
            |o| Object::Node(Sourced::new(API_ORIGIN, o)),
            part_tx.clone(),
        ));
        tokio::spawn(drive(
            Kind::Pod,
            Api::<Pod>::all(self.client.clone()),
            watch_config(Kind::Pod, &self.node_name),
            |o| Object::Pod(Sourced::new(API_ORIGIN, o)),
            part_tx.clone(),
        ));
        tokio::spawn(drive(
            Kind::Namespace,
            Api::<Namespace>::all(self.client.clone()),
            watch_config(Kind::Namespace, &self.node_name),
            |o| Object::Namespace(Sourced::new(API_ORIGIN, o)),
            part_tx,
        ));
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(merge(part_rx, tx));
        Ok(rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An API server that accepts connections and closes them at once: every list fails.
    /// Without a backoff that grows, the watcher reconnected about once a second.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreachable_api_server_is_retried_with_a_growing_backoff() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let accepts = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = accepts.clone();
        std::thread::spawn(move || {
            for c in listener.incoming() {
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                drop(c);
            }
        });
        let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
        let client = Client::try_from(config).unwrap();
        let (tx, mut rx) = mpsc::channel(8);
        let task = tokio::spawn(drive(
            Kind::Service,
            Api::<Service>::all(client),
            watch_config(Kind::Service, "node-a"),
            |o| Object::Service(Sourced::new(API_ORIGIN, o)),
            tx,
        ));
        tokio::time::sleep(std::time::Duration::from_secs(10)).await;
        task.abort();
        assert!(rx.try_recv().is_err(), "nothing was listed");
        // 0.8 s doubling (jittered): about 4 attempts in 10 s, where a retry every second
        // made 9 or 10.
        let n = accepts.load(std::sync::atomic::Ordering::Relaxed);
        eprintln!("{n} connection attempts in 10 s");
        assert!((1..=6).contains(&n), "{n} connection attempts in 10 s");
    }

    fn svc(ns: &str, name: &str) -> Service {
        let mut s = Service::default();
        s.metadata.namespace = Some(ns.into());
        s.metadata.name = Some(name.into());
        s
    }

    fn wrap(s: Service) -> Object {
        Object::Service(Sourced::new(API_ORIGIN, s))
    }

    fn deleted(changes: &[Change]) -> Vec<String> {
        changes
            .iter()
            .filter_map(|c| match c {
                Change::Delete(_, (ns, n)) => Some(format!("{ns}/{n}")),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_relist_deletes_what_it_no_longer_lists_only_when_it_completes() {
        let mut t = Tracker::default();
        let mut out = Vec::new();
        // Initial list: a, b.
        t.event(Kind::Service, watcher::Event::Init, wrap, &mut out);
        t.event(
            Kind::Service,
            watcher::Event::InitApply(svc("ns", "a")),
            wrap,
            &mut out,
        );
        t.event(
            Kind::Service,
            watcher::Event::InitApply(svc("ns", "b")),
            wrap,
            &mut out,
        );
        assert!(t.event(Kind::Service, watcher::Event::InitDone, wrap, &mut out));
        assert_eq!(out.len(), 2);
        assert!(deleted(&out).is_empty());
        // A watch event adds c.
        out.clear();
        assert!(!t.event(
            Kind::Service,
            watcher::Event::Apply(svc("ns", "c")),
            wrap,
            &mut out
        ));
        // The watch breaks and relists: only b is listed. Nothing is deleted before the
        // list completes.
        out.clear();
        t.event(Kind::Service, watcher::Event::Init, wrap, &mut out);
        t.event(
            Kind::Service,
            watcher::Event::InitApply(svc("ns", "b")),
            wrap,
            &mut out,
        );
        assert!(deleted(&out).is_empty());
        assert!(t.event(Kind::Service, watcher::Event::InitDone, wrap, &mut out));
        let mut d = deleted(&out);
        d.sort();
        assert_eq!(d, vec!["ns/a", "ns/c"]);
        // A deletion event deletes.
        out.clear();
        t.event(
            Kind::Service,
            watcher::Event::Delete(svc("ns", "b")),
            wrap,
            &mut out,
        );
        assert_eq!(deleted(&out), vec!["ns/b"]);
    }

    #[test]
    fn services_and_slices_are_watched_with_kube_proxys_label_selector() {
        for kind in [Kind::Service, Kind::EndpointSlice] {
            let c = watch_config(kind, "node-a");
            assert_eq!(
                c.label_selector.as_deref(),
                Some("!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless")
            );
            assert_eq!(c.field_selector, None);
        }
        let c = watch_config(Kind::Node, "node-a");
        assert_eq!(c.field_selector.as_deref(), Some("metadata.name=node-a"));
        assert_eq!(c.label_selector, None);
    }

    #[tokio::test]
    async fn batches_are_synced_once_services_and_slices_are_listed() {
        let (ptx, prx) = mpsc::channel(8);
        let (tx, mut rx) = mpsc::channel(8);
        tokio::spawn(merge(prx, tx));
        let part = |kind, listed| Part {
            kind,
            changes: vec![Change::Delete(kind, ("a".into(), "b".into()))],
            listed,
            received: std::time::Instant::now(),
        };
        ptx.send(part(Kind::Node, true)).await.unwrap();
        assert!(!rx.recv().await.unwrap().synced);
        ptx.send(part(Kind::Service, true)).await.unwrap();
        assert!(!rx.recv().await.unwrap().synced, "slices not listed yet");
        ptx.send(part(Kind::EndpointSlice, false)).await.unwrap();
        assert!(!rx.recv().await.unwrap().synced);
        ptx.send(part(Kind::EndpointSlice, true)).await.unwrap();
        let b = rx.recv().await.unwrap();
        assert!(b.synced);
        assert_eq!(b.changes.len(), 1, "changes are passed on");
        ptx.send(part(Kind::Service, false)).await.unwrap();
        assert!(rx.recv().await.unwrap().synced, "stays synced");
    }
}
