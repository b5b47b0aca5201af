//! The Kubernetes API source: `v1/Service`, `discovery.k8s.io/v1/EndpointSlice` and this
//! node's `v1/Node`, followed with `kube::runtime::watcher` into reflector stores.
//!
//! Rules (kube-proxy's, see `pkg/proxy/config` and the BoundedFrequencyRunner):
//! - No snapshot is sent before the initial lists of Services and EndpointSlices have both
//!   completed, so a restarted agent never removes backends whose slices have not arrived.
//!   The Node is not waited for (a node object may be missing; nothing depends on it yet).
//! - Changes are coalesced: a change that arrives after a quiet period is sent after
//!   [`KubeSource::debounce`] (10 ms: the rest of a burst joins it), but two snapshots are
//!   never closer than `--min-sync-period` (default 1 s, as kube-proxy's `minSyncPeriod`).
//! - API errors are retried by the watcher with exponential backoff; a `410 Gone` makes it
//!   relist. While the API is unreachable the stores keep their last state, so nothing is
//!   flushed; a relist replaces a store only once it completed, so a deletion is applied only
//!   after a successful list or watch event says so. A failing watch is logged when it
//!   starts failing and when it recovers, not on every retry.
//! - `metadata.managedFields` is dropped from every object to save memory.
//!
//! Access used (checked against `deploy/rbac.yaml` by a test): [`API_ACCESS`].

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::{
    api::{core::v1::Node, core::v1::Service, discovery::v1::EndpointSlice},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    Api, Client, Resource,
    runtime::{WatchStreamExt, reflector, reflector::Store, watcher},
};
use tokio::{
    sync::mpsc,
    time::{Instant, sleep_until},
};
use tracing::{debug, info, warn};

use super::{ObjectSet, Snapshot, Source, Sourced};

/// Every (API group, resource, verbs) the agent uses; `deploy/rbac.yaml` must grant them.
pub const API_ACCESS: &[(&str, &str, &[&str])] = &[
    ("", "services", &["list", "watch"]),
    ("discovery.k8s.io", "endpointslices", &["list", "watch"]),
    ("", "nodes", &["list", "watch"]),
];

/// Origin recorded on objects from the API (appears in skipped-object messages).
pub const API_ORIGIN: &str = "api";

/// A [`Source`] following the Kubernetes API.
pub struct KubeSource {
    client: Client,
    node_name: String,
    min_sync_period: Duration,
    debounce: Duration,
}

impl KubeSource {
    /// A source using `client`, watching the Node named `node_name`, sending snapshots at
    /// most once per `min_sync_period`.
    pub fn new(client: Client, node_name: impl Into<String>, min_sync_period: Duration) -> Self {
        Self {
            client,
            node_name: node_name.into(),
            min_sync_period,
            debounce: Duration::from_millis(10),
        }
    }

    /// Quiet time that lets the rest of a burst join a change (default 10 ms).
    pub fn debounce(mut self, d: Duration) -> Self {
        self.debounce = d;
        self
    }
}

fn strip(meta: &mut ObjectMeta) {
    meta.managed_fields = None;
}

/// Drives one watcher into its store, waking the coalescer on every change. Logs a failing
/// watch once when it starts failing and once when it recovers.
async fn drive<K>(
    kind: &'static str,
    api: Api<K>,
    cfg: watcher::Config,
    writer: reflector::store::Writer<K>,
    wake: mpsc::UnboundedSender<()>,
) where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
{
    let stream = watcher(api, cfg)
        .default_backoff()
        .modify(|o: &mut K| strip(o.meta_mut()))
        .reflect(writer);
    futures::pin_mut!(stream);
    let mut failing = false;
    while let Some(ev) = stream.next().await {
        match ev {
            Ok(ev) => {
                if failing {
                    info!(kind, "watch recovered");
                    failing = false;
                }
                match ev {
                    // The store changes on these (a relist is swapped in at InitDone).
                    watcher::Event::Apply(_)
                    | watcher::Event::Delete(_)
                    | watcher::Event::InitDone => {
                        if wake.send(()).is_err() {
                            return;
                        }
                    }
                    watcher::Event::Init => debug!(kind, "listing"),
                    watcher::Event::InitApply(_) => {}
                }
            }
            Err(e) => {
                if !failing {
                    warn!(kind, error = %e, "watch failed; retrying with backoff, the data path keeps its last state");
                    failing = true;
                } else {
                    debug!(kind, error = %e, "watch still failing");
                }
            }
        }
    }
}

/// (namespace, name) and the shared object of every entry of a store.
fn keyed<K: Resource + Clone>(
    store: &Store<K>,
) -> impl Iterator<Item = ((String, String), Sourced<K>)>
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    store.state().into_iter().map(|o| {
        let m = o.meta();
        let key = (
            m.namespace.clone().unwrap_or_default(),
            m.name.clone().unwrap_or_default(),
        );
        (
            key,
            Sourced {
                origin: API_ORIGIN.into(),
                object: o,
            },
        )
    })
}

fn objects(
    services: &Store<Service>,
    slices: &Store<EndpointSlice>,
    node: &Store<Node>,
) -> ObjectSet {
    ObjectSet {
        services: keyed(services).collect(),
        endpoint_slices: keyed(slices).collect(),
        nodes: keyed(node).map(|((_, name), n)| (name, n)).collect(),
    }
}

/// The coalescing loop, separate from the watchers so it can be tested with paused time.
///
/// Waits for `ready`, sends the first snapshot, then for every wake-up sends one snapshot at
/// `max(first wake-up + debounce, last send + min_period)`, built at that moment (so every
/// change that arrived meanwhile is in it). Stops when `wake` closes or `tx` is dropped.
pub async fn coalesce(
    ready: impl std::future::Future<Output = ()>,
    mut wake: mpsc::UnboundedReceiver<()>,
    tx: mpsc::Sender<Snapshot>,
    mut build: impl FnMut() -> Snapshot,
    debounce: Duration,
    min_period: Duration,
) {
    ready.await;
    // Wake-ups from the initial lists are covered by the first snapshot.
    while wake.try_recv().is_ok() {}
    if tx.send(build()).await.is_err() {
        return;
    }
    let mut last_send = Instant::now();
    while wake.recv().await.is_some() {
        let first = Instant::now();
        let at = (first + debounce).max(last_send + min_period);
        sleep_until(at).await;
        while wake.try_recv().is_ok() {}
        if tx.send(build()).await.is_err() {
            return;
        }
        last_send = Instant::now();
    }
}

impl Source for KubeSource {
    fn start(self) -> anyhow::Result<mpsc::Receiver<Snapshot>> {
        let (svc_store, svc_writer) = reflector::store::<Service>();
        let (slice_store, slice_writer) = reflector::store::<EndpointSlice>();
        let (node_store, node_writer) = reflector::store::<Node>();
        let (wake_tx, wake_rx) = mpsc::unbounded_channel();
        let cfg = watcher::Config::default();
        tokio::spawn(drive(
            "Service",
            Api::all(self.client.clone()),
            cfg.clone(),
            svc_writer,
            wake_tx.clone(),
        ));
        tokio::spawn(drive(
            "EndpointSlice",
            Api::all(self.client.clone()),
            cfg.clone(),
            slice_writer,
            wake_tx.clone(),
        ));
        let node_cfg = cfg.fields(&format!("metadata.name={}", self.node_name));
        tokio::spawn(drive(
            "Node",
            Api::all(self.client.clone()),
            node_cfg,
            node_writer,
            wake_tx,
        ));
        let (tx, rx) = mpsc::channel(4);
        let (s1, s2) = (svc_store.clone(), slice_store.clone());
        let ready = async move {
            // Err only if a writer is dropped, i.e. the runtime is shutting down.
            let _ = s1.wait_until_ready().await;
            let _ = s2.wait_until_ready().await;
            info!("initial lists of Services and EndpointSlices complete");
        };
        let build = move || Snapshot {
            objects: objects(&svc_store, &slice_store, &node_store),
            errors: Vec::new(),
        };
        tokio::spawn(coalesce(
            ready,
            wake_rx,
            tx,
            build,
            self.debounce,
            self.min_sync_period,
        ));
        Ok(rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    };

    fn counting_build(n: Arc<AtomicUsize>) -> impl FnMut() -> Snapshot {
        move || {
            n.fetch_add(1, Ordering::SeqCst);
            Snapshot::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_is_sent_before_both_initial_lists_complete() {
        let (svc_store, mut svc_writer) = reflector::store::<Service>();
        let (slice_store, mut slice_writer) = reflector::store::<EndpointSlice>();
        let (_wake_tx, wake_rx) = mpsc::unbounded_channel();
        let (tx, mut rx) = mpsc::channel(4);
        let ready = async move {
            svc_store.wait_until_ready().await.unwrap();
            slice_store.wait_until_ready().await.unwrap();
        };
        let n = Arc::new(AtomicUsize::new(0));
        tokio::spawn(coalesce(
            ready,
            wake_rx,
            tx,
            counting_build(n.clone()),
            Duration::from_millis(10),
            Duration::from_secs(1),
        ));
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(rx.try_recv().is_err(), "sent before any list completed");
        svc_writer.apply_watcher_event(&watcher::Event::Init);
        svc_writer.apply_watcher_event(&watcher::Event::InitDone);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(
            rx.try_recv().is_err(),
            "sent before the EndpointSlice list completed"
        );
        slice_writer.apply_watcher_event(&watcher::Event::Init);
        slice_writer.apply_watcher_event(&watcher::Event::InitDone);
        let first = tokio::time::timeout(Duration::from_secs(1), rx.recv()).await;
        assert!(matches!(first, Ok(Some(_))));
        assert_eq!(n.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn isolated_change_is_fast_and_bursts_are_coalesced_within_min_sync_period() {
        let (wake_tx, wake_rx) = mpsc::unbounded_channel();
        let (tx, mut rx) = mpsc::channel(16);
        let n = Arc::new(AtomicUsize::new(0));
        let debounce = Duration::from_millis(10);
        let min = Duration::from_secs(1);
        tokio::spawn(coalesce(
            async {},
            wake_rx,
            tx,
            counting_build(n.clone()),
            debounce,
            min,
        ));
        rx.recv().await.unwrap(); // initial snapshot
        let t0 = Instant::now();

        // After a quiet period longer than min_sync_period, one change goes out after the
        // debounce only.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let changed = Instant::now();
        wake_tx.send(()).unwrap();
        rx.recv().await.unwrap();
        assert_eq!(Instant::now() - changed, debounce);

        // A burst of 100 changes right after: one snapshot, no earlier than min_sync_period
        // after the previous one.
        let sent = Instant::now();
        for _ in 0..100 {
            wake_tx.send(()).unwrap();
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        rx.recv().await.unwrap();
        assert_eq!(Instant::now() - sent, min);
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(
            rx.try_recv().is_err(),
            "the burst gave more than one snapshot"
        );
        assert_eq!(n.load(Ordering::SeqCst), 3);
        let _ = t0;
    }
}
