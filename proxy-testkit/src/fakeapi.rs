//! Test support: an in-process fake Kubernetes API server speaking the list/watch
//! protocol the way kube-apiserver does, for the resources the agent watches
//! (`Service`, `discovery.k8s.io/v1` `EndpointSlice`, `Node`, `Pod`, `Namespace`).
//!
//! No kube-apiserver can be installed on the build machines, so the agent's
//! Kubernetes source (kube-rs `watcher`s) is exercised against this server instead,
//! both in-process (unit tests below) and through the real `ebpf-proxy run
//! --kubeconfig FILE` binary (integration tests, via [`FakeApiServer::write_kubeconfig`]).
//!
//! # What it implements
//!
//! * Paths (HTTP GET only):
//!   `/api/v1/services`, `/api/v1/namespaces/{ns}/services[/{name}]`,
//!   `/apis/discovery.k8s.io/v1/endpointslices`,
//!   `/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices[/{name}]`,
//!   `/api/v1/nodes`, `/api/v1/nodes/{name}`, `/api/v1/pods`, `/api/v1/namespaces/{ns}/pods[/{name}]`,
//!   `/api/v1/namespaces`, `/api/v1/namespaces/{name}`. Anything else is a `404` `Status`.
//! * List: `labelSelector` (equality/existence terms: `k=v`, `k==v`, `k!=v`, `k`, `!k`;
//!   set-based terms are rejected with 400), `fieldSelector` (`metadata.name`,
//!   `metadata.namespace` and `spec.nodeName` with `=`, `==`, `!=`; other fields are rejected with 400 like
//!   the real server), `limit` + `continue` (pagination; continued pages report the
//!   first page's resourceVersion and answer `410 Expired` once that version is
//!   compacted), `resourceVersion` + `resourceVersionMatch` (served from the current
//!   state; a version newer than the current one answers `504 Timeout` "Too large
//!   resource version", `Exact` on an old version answers `410 Expired`).
//!   Items are sorted by namespace/name. As on the real server, list items carry no
//!   `kind`/`apiVersion`: the server sets them on the list only, and a client derives each
//!   item's type from the list's (`ServiceList` holds `Service`s); see
//!   [`FakeApiServer::set_list_item_type_meta`] to change that.
//! * Watch (`watch=true|1`): a chunked stream of newline-delimited JSON events
//!   `{"type":"ADDED"|"MODIFIED"|"DELETED"|"BOOKMARK"|"ERROR","object":{..}}`.
//!   With `resourceVersion=N` (N > 0) events after N are replayed from the bounded
//!   history and then streamed live; without a resourceVersion, or with `0`, the
//!   stream starts with synthetic `ADDED` events for the current objects.
//!   `sendInitialEvents=true` (kube-rs "streaming lists") also sends the synthetic
//!   `ADDED` events, followed by a `BOOKMARK` annotated `k8s.io/initial-events-end`.
//!   A version older than the history floor gets HTTP 200 and a single `ERROR`
//!   event with a `410 Expired` `Status` ("too old resource version: X (Y)"),
//!   then the stream closes. `allowWatchBookmarks=true` adds periodic `BOOKMARK`
//!   events ([`FakeApiServer::set_bookmark_interval`], 1 s by default).
//!   `timeoutSeconds` closes the stream after that time (default 1800 s).
//!   Selectors apply to watches too: an object that stops matching is sent as
//!   `DELETED`, one that starts matching as `ADDED`, as the real server does.
//!   A watcher that falls more than [`EVENT_BUFFER`] events behind is disconnected.
//! * One global resourceVersion counter (like the etcd revision), stamped on
//!   every object by every create/update/delete.
//!
//! # Test controls
//!
//! All `&self` and thread-safe: [`FakeApiServer::apply`]/[`FakeApiServer::delete`]
//! (and the typed shortcuts), [`FakeApiServer::compact`],
//! [`FakeApiServer::close_watches`], [`FakeApiServer::set_failing`],
//! [`FakeApiServer::set_delay`], request counters ([`FakeApiServer::requests`],
//! [`FakeApiServer::request_count`], [`FakeApiServer::request_log`], whose entries carry
//! the bearer token each request sent); and
//! [`FakeApiServer::stop`]/[`FakeApiServer::restart`] (`&mut self`) to simulate an
//! apiserver outage on the same port with the state kept.
//!
//! Everything runs inside the caller's tokio runtime; the server task ends on
//! [`FakeApiServer::stop`] or when the `FakeApiServer` is dropped.

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::fs::File;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::Response;
use axum::routing::get;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc, watch};
use tokio::task::JoinHandle;

/// How many live events a watch stream may fall behind before it is disconnected
/// (the client then resumes from its last resourceVersion).
pub const EVENT_BUFFER: usize = 4096;

/// Default number of events kept for watch resumption.
pub const DEFAULT_HISTORY_LIMIT: usize = 1000;

/// Default interval between `BOOKMARK` events on watches that allow them.
pub const DEFAULT_BOOKMARK_INTERVAL: Duration = Duration::from_secs(1);

/// Default watch duration when the client sends no `timeoutSeconds`.
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);

/// How long [`FakeApiServer::stop`] waits for connections to drain before
/// aborting the server task.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// The resource kinds the fake server knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ResourceKind {
    /// core/v1 `Service` (namespaced).
    Service,
    /// discovery.k8s.io/v1 `EndpointSlice` (namespaced).
    EndpointSlice,
    /// core/v1 `Node` (cluster-scoped).
    Node,
    /// core/v1 `Pod` (namespaced).
    Pod,
    /// core/v1 `Namespace` (cluster-scoped).
    Namespace,
}

impl ResourceKind {
    /// Every kind, in routing order.
    pub const ALL: [ResourceKind; 5] = [
        Self::Service,
        Self::EndpointSlice,
        Self::Node,
        Self::Pod,
        Self::Namespace,
    ];

    /// The `kind` field of one object.
    pub fn kind(self) -> &'static str {
        match self {
            Self::Service => "Service",
            Self::EndpointSlice => "EndpointSlice",
            Self::Node => "Node",
            Self::Pod => "Pod",
            Self::Namespace => "Namespace",
        }
    }

    /// The `kind` field of a list.
    pub fn list_kind(self) -> &'static str {
        match self {
            Self::Service => "ServiceList",
            Self::EndpointSlice => "EndpointSliceList",
            Self::Node => "NodeList",
            Self::Pod => "PodList",
            Self::Namespace => "NamespaceList",
        }
    }

    /// The `apiVersion` field.
    pub fn api_version(self) -> &'static str {
        match self {
            Self::Service | Self::Node | Self::Pod | Self::Namespace => "v1",
            Self::EndpointSlice => "discovery.k8s.io/v1",
        }
    }

    /// The resource name in URLs.
    pub fn plural(self) -> &'static str {
        match self {
            Self::Service => "services",
            Self::EndpointSlice => "endpointslices",
            Self::Node => "nodes",
            Self::Pod => "pods",
            Self::Namespace => "namespaces",
        }
    }

    /// Whether objects of this kind live in a namespace.
    pub fn namespaced(self) -> bool {
        !matches!(self, Self::Node | Self::Namespace)
    }

    fn url_prefix(self) -> &'static str {
        match self {
            Self::Service | Self::Node | Self::Pod | Self::Namespace => "/api/v1",
            Self::EndpointSlice => "/apis/discovery.k8s.io/v1",
        }
    }

    /// The kind matching a k8s-openapi resource type, if the server serves it.
    pub fn of<K: k8s_openapi::Resource>() -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|k| k.kind() == K::KIND && k.api_version() == K::API_VERSION)
    }
}

/// What a request asked for, for the request counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Verb {
    /// A collection GET without `watch`.
    List,
    /// A collection GET with `watch=true` (or `1`).
    Watch,
    /// A GET of one named object.
    Get,
}

/// One request as the server received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedRequest {
    /// The URL path, e.g. `/api/v1/services`.
    pub path: String,
    /// The raw query string (without `?`), empty when absent.
    pub query: String,
    /// List, watch or get.
    pub verb: Verb,
    /// The token of an `Authorization: Bearer <token>` header, if the request had one.
    pub bearer_token: Option<String>,
}

impl RecordedRequest {
    /// The decoded value of one query parameter.
    pub fn param(&self, name: &str) -> Option<String> {
        form_urlencoded::parse(self.query.as_bytes())
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.into_owned())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EventType {
    Added,
    Modified,
    Deleted,
}

/// One change, as kept in the history and sent to live watchers.
#[derive(Debug)]
struct HistEvent {
    rv: u64,
    kind: ResourceKind,
    etype: EventType,
    /// The object after the change (for deletions: the last state, stamped with
    /// the deletion's resourceVersion).
    object: Arc<Value>,
    /// The object before a modification (for selector transitions).
    prev: Option<Arc<Value>>,
}

type ObjKey = (String, String);

struct Store {
    rv: u64,
    /// Watches must start at or above this resourceVersion; older ones get 410.
    floor: u64,
    history_limit: usize,
    objects: BTreeMap<ResourceKind, BTreeMap<ObjKey, Arc<Value>>>,
    history: VecDeque<Arc<HistEvent>>,
}

impl Store {
    fn objects(&self, kind: ResourceKind) -> impl Iterator<Item = (&ObjKey, &Arc<Value>)> {
        self.objects.get(&kind).into_iter().flat_map(|m| m.iter())
    }

    fn trim_history(&mut self) {
        while self.history.len() > self.history_limit {
            if let Some(ev) = self.history.pop_front() {
                self.floor = self.floor.max(ev.rv);
            }
        }
    }
}

struct Settings {
    delay: Duration,
    bookmark_interval: Duration,
    list_item_type_meta: bool,
}

#[derive(Default)]
struct RequestStats {
    counts: BTreeMap<(String, Verb), u64>,
    log: VecDeque<RecordedRequest>,
}

const REQUEST_LOG_LIMIT: usize = 10_000;

struct Shared {
    store: Mutex<Store>,
    events: broadcast::Sender<Arc<HistEvent>>,
    close_watches: watch::Sender<u64>,
    failing: AtomicBool,
    failure_code: AtomicU16,
    settings: Mutex<Settings>,
    requests: Mutex<RequestStats>,
    open_watches: AtomicUsize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking test thread must not wedge the server for the others.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn new() -> Self {
        Self {
            store: Mutex::new(Store {
                // Start above 0: "0" means "any version" to the protocol.
                rv: 1,
                floor: 1,
                history_limit: DEFAULT_HISTORY_LIMIT,
                objects: BTreeMap::new(),
                history: VecDeque::new(),
            }),
            events: broadcast::channel(EVENT_BUFFER).0,
            close_watches: watch::channel(0).0,
            failing: AtomicBool::new(false),
            failure_code: AtomicU16::new(500),
            settings: Mutex::new(Settings {
                delay: Duration::ZERO,
                bookmark_interval: DEFAULT_BOOKMARK_INTERVAL,
                list_item_type_meta: false,
            }),
            requests: Mutex::new(RequestStats::default()),
            open_watches: AtomicUsize::new(0),
        }
    }

    /// Records a change under the store lock and publishes it, so a watcher that
    /// subscribes under the same lock sees every event exactly once.
    fn record(&self, st: &mut Store, ev: HistEvent) {
        let ev = Arc::new(ev);
        st.history.push_back(ev.clone());
        st.trim_history();
        let _ = self.events.send(ev);
    }

    fn apply_value(&self, kind: ResourceKind, mut obj: Value) -> Arc<Value> {
        let name = obj["metadata"]["name"]
            .as_str()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| panic!("fakeapi: {} without metadata.name", kind.kind()))
            .to_owned();
        let ns = if kind.namespaced() {
            let ns = obj["metadata"]["namespace"]
                .as_str()
                .unwrap_or("")
                .to_owned();
            if ns.is_empty() {
                "default".to_owned()
            } else {
                ns
            }
        } else {
            String::new()
        };
        let mut st = lock(&self.store);
        st.rv += 1;
        let rv = st.rv;
        let key = (ns.clone(), name);
        let prev = st.objects.get(&kind).and_then(|m| m.get(&key)).cloned();
        {
            let o = obj
                .as_object_mut()
                .expect("fakeapi: object is not a JSON object");
            o.insert("kind".into(), kind.kind().into());
            o.insert("apiVersion".into(), kind.api_version().into());
            let meta = o
                .entry("metadata")
                .or_insert_with(|| json!({}))
                .as_object_mut()
                .expect("fakeapi: metadata is not an object");
            meta.insert("resourceVersion".into(), rv.to_string().into());
            if kind.namespaced() {
                meta.insert("namespace".into(), ns.into());
            }
            let uid = prev
                .as_ref()
                .and_then(|p| p["metadata"]["uid"].as_str().map(str::to_owned))
                .unwrap_or_else(|| format!("00000000-0000-4000-8000-{rv:012}"));
            meta.entry("uid").or_insert_with(|| uid.into());
            if let Some(ts) = prev
                .as_ref()
                .and_then(|p| p["metadata"].get("creationTimestamp"))
            {
                meta.entry("creationTimestamp")
                    .or_insert_with(|| ts.clone());
            }
        }
        let obj = Arc::new(obj);
        st.objects.entry(kind).or_default().insert(key, obj.clone());
        let etype = if prev.is_some() {
            EventType::Modified
        } else {
            EventType::Added
        };
        self.record(
            &mut st,
            HistEvent {
                rv,
                kind,
                etype,
                object: obj.clone(),
                prev,
            },
        );
        obj
    }

    fn delete_value(&self, kind: ResourceKind, ns: &str, name: &str) -> Option<Arc<Value>> {
        let ns = if kind.namespaced() { ns } else { "" };
        let mut st = lock(&self.store);
        let old = st
            .objects
            .get_mut(&kind)?
            .remove(&(ns.to_owned(), name.to_owned()))?;
        st.rv += 1;
        let rv = st.rv;
        let mut last = (*old).clone();
        last["metadata"]["resourceVersion"] = rv.to_string().into();
        let last = Arc::new(last);
        self.record(
            &mut st,
            HistEvent {
                rv,
                kind,
                etype: EventType::Deleted,
                object: last.clone(),
                prev: None,
            },
        );
        Some(last)
    }
}

/// A running (or stopped) fake API server. See the [module docs](self).
pub struct FakeApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    running: Option<Running>,
    /// The network namespace the first listener lived in, where [`Self::restart`]
    /// binds again; `None` if it could not be opened (then: the caller's).
    netns: Option<File>,
}

struct Running {
    shutdown: watch::Sender<bool>,
    task: JoinHandle<()>,
}

#[derive(Clone)]
struct App {
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
}

impl FakeApiServer {
    /// Binds `addr` (use `127.0.0.1:0` for a free port) and starts serving on the
    /// current tokio runtime.
    pub async fn start(addr: SocketAddr) -> anyhow::Result<Self> {
        let listener = bind(addr)?;
        let mut server = Self {
            addr: listener.local_addr()?,
            shared: Arc::new(Shared::new()),
            running: None,
            netns: netns_of(&listener),
        };
        server.serve(listener)?;
        Ok(server)
    }

    /// Serves on `listener` from a new task; needs a tokio runtime context.
    fn serve(&mut self, listener: std::net::TcpListener) -> anyhow::Result<()> {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        self.addr = listener.local_addr()?;
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let app = App {
            shared: self.shared.clone(),
            shutdown: shutdown_rx.clone(),
        };
        let router = router(app);
        let task = spawn_server(listener, router, shutdown_rx);
        self.running = Some(Running {
            shutdown: shutdown_tx,
            task,
        });
        Ok(())
    }

    /// The bound address (with the real port when started on port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig with one cluster (`server:` [`Self::url`], plain http), a user
    /// with a dummy bearer token, and a `fakeapi` context set as current context.
    pub fn kubeconfig(&self) -> kube::config::Kubeconfig {
        use kube::config::{
            Cluster, Context, Kubeconfig, NamedAuthInfo, NamedCluster, NamedContext,
        };
        // `AuthInfo::token` is a `secrecy::SecretString`; build it through serde so
        // this crate does not need `secrecy` as a dependency.
        let auth_info = serde_json::from_value(json!({ "token": "fakeapi-dummy-token" }))
            .expect("AuthInfo from JSON");
        Kubeconfig {
            clusters: vec![NamedCluster {
                name: "fakeapi".into(),
                cluster: Some(Cluster {
                    server: Some(self.url()),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            auth_infos: vec![NamedAuthInfo {
                name: "fakeapi".into(),
                auth_info: Some(auth_info),
                ..Default::default()
            }],
            contexts: vec![NamedContext {
                name: "fakeapi".into(),
                context: Some(Context {
                    cluster: "fakeapi".into(),
                    user: Some("fakeapi".into()),
                    namespace: Some("default".into()),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            current_context: Some("fakeapi".into()),
            api_version: Some("v1".into()),
            kind: Some("Config".into()),
            ..Default::default()
        }
    }

    /// Writes [`Self::kubeconfig`] as YAML to `path` (for `--kubeconfig` /
    /// `KUBECONFIG`).
    pub fn write_kubeconfig(&self, path: impl AsRef<Path>) -> anyhow::Result<()> {
        let path = path.as_ref();
        let yaml = serde_yaml_ng::to_string(&self.kubeconfig())?;
        std::fs::write(path, yaml).with_context(|| format!("writing {}", path.display()))
    }

    /// A kube client configuration pointing at this server.
    pub fn client_config(&self) -> kube::Config {
        kube::Config::new(self.url().parse().expect("valid URL"))
    }

    /// A kube client for this server.
    pub fn client(&self) -> anyhow::Result<kube::Client> {
        Ok(kube::Client::try_from(self.client_config())?)
    }

    /// Whether the server is currently accepting connections.
    pub fn is_running(&self) -> bool {
        self.running.is_some()
    }

    /// Stops serving, as an apiserver outage: every watch stream ends, the
    /// listener closes (new connections are refused) and open connections are
    /// closed once their in-flight responses finish (aborted after 5 s). The
    /// state (objects, resourceVersion, history, counters) is kept for
    /// [`Self::restart`].
    pub async fn stop(&mut self) {
        if let Some(Running { shutdown, mut task }) = self.running.take() {
            let _ = shutdown.send(true);
            if tokio::time::timeout(STOP_GRACE, &mut task).await.is_err() {
                tracing::warn!("fakeapi: connections did not drain; aborting");
                task.abort();
                let _ = task.await;
            }
        }
    }

    /// Serves again on the same address with the same state (stopping first if
    /// still running).
    ///
    /// The address is bound in the network namespace the first listener lived in,
    /// whichever namespace the calling thread is in (entering it from a short-lived
    /// thread needs `CAP_SYS_ADMIN`). Errors: the bind fails (port taken meanwhile,
    /// namespace gone or not enterable).
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.stop().await;
        let listener = match &self.netns {
            Some(ns) => bind_in(ns, self.addr)?,
            None => bind(self.addr)?,
        };
        self.serve(listener)
    }

    // ---- state changes -------------------------------------------------------

    /// Creates or replaces an object (matched by namespace/name; a missing
    /// namespace means `default`), stamping a new resourceVersion, and returns it
    /// as stored.
    ///
    /// # Panics
    /// If `K` is not served ([`ResourceKind::of`]) or the object has no name.
    pub fn apply<K>(&self, obj: &K) -> K
    where
        K: k8s_openapi::Resource + Serialize + DeserializeOwned,
    {
        let kind = ResourceKind::of::<K>()
            .unwrap_or_else(|| panic!("fakeapi does not serve {}/{}", K::API_VERSION, K::KIND));
        let value = serde_json::to_value(obj).expect("serialize object");
        let stored = self.shared.apply_value(kind, value);
        serde_json::from_value((*stored).clone()).expect("deserialize stored object")
    }

    /// Deletes an object (`ns` is ignored for cluster-scoped kinds), stamping a
    /// new resourceVersion; returns its last state, or `None` if it did not exist.
    ///
    /// # Panics
    /// If `K` is not served.
    pub fn delete<K>(&self, ns: &str, name: &str) -> Option<K>
    where
        K: k8s_openapi::Resource + DeserializeOwned,
    {
        let kind = ResourceKind::of::<K>()
            .unwrap_or_else(|| panic!("fakeapi does not serve {}/{}", K::API_VERSION, K::KIND));
        let last = self.shared.delete_value(kind, ns, name)?;
        Some(serde_json::from_value((*last).clone()).expect("deserialize stored object"))
    }

    /// The stored object, if any (`ns` is ignored for cluster-scoped kinds).
    pub fn get<K>(&self, ns: &str, name: &str) -> Option<K>
    where
        K: k8s_openapi::Resource + DeserializeOwned,
    {
        let kind = ResourceKind::of::<K>()?;
        let ns = if kind.namespaced() { ns } else { "" };
        let st = lock(&self.shared.store);
        let v = st
            .objects
            .get(&kind)?
            .get(&(ns.to_owned(), name.to_owned()))?
            .clone();
        drop(st);
        serde_json::from_value((*v).clone()).ok()
    }

    /// Creates or replaces a Service; see [`Self::apply`].
    pub fn apply_service(&self, svc: Service) -> Service {
        self.apply(&svc)
    }

    /// Deletes a Service; see [`Self::delete`].
    pub fn delete_service(&self, ns: &str, name: &str) -> Option<Service> {
        self.delete(ns, name)
    }

    /// Creates or replaces an EndpointSlice; see [`Self::apply`].
    pub fn apply_endpoint_slice(&self, slice: EndpointSlice) -> EndpointSlice {
        self.apply(&slice)
    }

    /// Deletes an EndpointSlice; see [`Self::delete`].
    pub fn delete_endpoint_slice(&self, ns: &str, name: &str) -> Option<EndpointSlice> {
        self.delete(ns, name)
    }

    /// Creates or replaces a Node; see [`Self::apply`].
    pub fn apply_node(&self, node: Node) -> Node {
        self.apply(&node)
    }

    /// Deletes a Node; see [`Self::delete`].
    pub fn delete_node(&self, name: &str) -> Option<Node> {
        self.delete("", name)
    }

    /// The current (global) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        lock(&self.shared.store).rv
    }

    // ---- protocol knobs ------------------------------------------------------

    /// Raises the history floor to the current resourceVersion: every watch (and
    /// continued list) from an older version now gets `410 Expired`. Open watch
    /// streams are not affected; combine with [`Self::close_watches`].
    pub fn compact(&self) {
        let mut st = lock(&self.shared.store);
        st.floor = st.rv;
        st.history.clear();
    }

    /// Number of events kept for watch resumption (default 1000); older events
    /// are dropped and raise the floor.
    pub fn set_history_limit(&self, limit: usize) {
        let mut st = lock(&self.shared.store);
        st.history_limit = limit;
        st.trim_history();
    }

    /// Ends every open watch stream cleanly (as the apiserver does on its watch
    /// timeouts); clients resume from their last resourceVersion.
    pub fn close_watches(&self) {
        self.shared.close_watches.send_modify(|g| *g += 1);
    }

    /// Number of watch streams currently open.
    pub fn open_watches(&self) -> usize {
        self.shared.open_watches.load(Ordering::SeqCst)
    }

    /// Waits (bounded by `timeout`) until exactly `n` watch streams are open.
    pub async fn wait_open_watches(&self, n: usize, timeout: Duration) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.open_watches() != n {
            if tokio::time::Instant::now() >= deadline {
                anyhow::bail!("fakeapi: {} watches open, wanted {n}", self.open_watches());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    /// While `true`, every request (new lists, gets and watches) answers with an
    /// error `Status` body: `500 InternalError` unless changed with
    /// [`Self::set_failure_code`]. Open watch streams are not affected; combine
    /// with [`Self::close_watches`].
    ///
    /// Note: kube 5 clients retry `429`, `503` and `504` internally (up to 15
    /// times, exponential backoff from 5 ms, honouring `Retry-After`, which this
    /// server sets to 1 s for those codes), so with those codes a watcher sees no
    /// error for a long while; `500` reaches the watcher at once.
    pub fn set_failing(&self, failing: bool) {
        self.shared.failing.store(failing, Ordering::SeqCst);
    }

    /// The HTTP status [`Self::set_failing`] answers with (default 500).
    pub fn set_failure_code(&self, code: u16) {
        self.shared.failure_code.store(code, Ordering::SeqCst);
    }

    /// Delays every response (including the start of watch streams) by `delay`.
    pub fn set_delay(&self, delay: Duration) {
        lock(&self.shared.settings).delay = delay;
    }

    /// Interval between `BOOKMARK` events for watches opened from now on.
    pub fn set_bookmark_interval(&self, interval: Duration) {
        lock(&self.shared.settings).bookmark_interval = interval.max(Duration::from_millis(1));
    }

    /// Whether list items carry `kind`/`apiVersion`. `false` by default, like
    /// kube-apiserver (which only sets them on the list itself, on single-object
    /// GETs and on watch event objects).
    pub fn set_list_item_type_meta(&self, on: bool) {
        lock(&self.shared.settings).list_item_type_meta = on;
    }

    // ---- request counters ----------------------------------------------------

    /// Requests received so far, per (path, verb).
    pub fn requests(&self) -> BTreeMap<(String, Verb), u64> {
        lock(&self.shared.requests).counts.clone()
    }

    /// Requests received so far for one path and verb.
    pub fn request_count(&self, path: &str, verb: Verb) -> u64 {
        lock(&self.shared.requests)
            .counts
            .get(&(path.to_owned(), verb))
            .copied()
            .unwrap_or(0)
    }

    /// The last (up to 10000) requests, oldest first, each with the bearer token it
    /// sent.
    pub fn request_log(&self) -> Vec<RecordedRequest> {
        lock(&self.shared.requests).log.iter().cloned().collect()
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            let _ = r.shutdown.send(true);
        }
    }
}

// ---- sockets --------------------------------------------------------------

/// Binds a listening TCP socket on `addr` in the calling thread's network namespace.
fn bind(addr: SocketAddr) -> anyhow::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    // Restarting on the same port must not trip over TIME_WAIT connections.
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket
        .bind(&addr.into())
        .with_context(|| format!("fakeapi: binding {addr}"))?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// The network namespace `listener` lives in: asked of the socket (`SIOCGSKNS`,
/// which needs `CAP_NET_ADMIN` there), else the calling thread's; `None` if neither
/// can be opened.
fn netns_of(listener: &std::net::TcpListener) -> Option<File> {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: the ioctl only reads the socket's namespace; on success it returns a
    // new descriptor that nothing else owns.
    let fd = unsafe { libc::ioctl(listener.as_raw_fd(), libc::SIOCGSKNS as _) };
    if fd >= 0 {
        // SAFETY: `fd` is a fresh descriptor owned by nothing else.
        return Some(unsafe { File::from_raw_fd(fd) });
    }
    File::open("/proc/thread-self/ns/net").ok()
}

/// Binds `addr` in the network namespace `ns`: directly when the calling thread is in
/// it, else from a short-lived thread that enters it first (`setns` changes only the
/// calling thread, so nothing else moves).
fn bind_in(ns: &File, addr: SocketAddr) -> anyhow::Result<std::net::TcpListener> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let id = |m: std::fs::Metadata| (m.dev(), m.ino());
    let here = std::fs::metadata("/proc/thread-self/ns/net").map(id).ok();
    if here == Some(id(ns.metadata()?)) {
        return bind(addr);
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: `ns` is an open namespace file; only this thread changes namespace.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(anyhow::Error::from(io::Error::last_os_error())
                    .context("fakeapi: entering the listener's network namespace"));
            }
            bind(addr)
        })
        .join()
        .unwrap_or_else(|_| Err(anyhow::anyhow!("fakeapi: the binding thread panicked")))
    })
}

/// Runs axum on `listener` until `shutdown` turns `true`.
fn spawn_server<L>(
    listener: L,
    router: Router,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<()>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    tokio::spawn(async move {
        let res = axum::serve(listener, router)
            .with_graceful_shutdown(async move {
                let _ = shutdown.wait_for(|stop| *stop).await;
            })
            .await;
        if let Err(e) = res {
            tracing::warn!(error = %e, "fakeapi: server error");
        }
    })
}

// ---- HTTP side ---------------------------------------------------------------

fn router(app: App) -> Router {
    let mut r = Router::new();
    for kind in ResourceKind::ALL {
        let prefix = kind.url_prefix();
        let plural = kind.plural();
        r = r.route(
            &format!("{prefix}/{plural}"),
            get(
                move |State(app): State<App>,
                      headers: HeaderMap,
                      uri: Uri,
                      RawQuery(q): RawQuery| {
                    handle(app, kind, None, None, headers, uri, q)
                },
            ),
        );
        if kind.namespaced() {
            r = r
                .route(
                    &format!("{prefix}/namespaces/{{ns}}/{plural}"),
                    get(
                        move |State(app): State<App>,
                              axum::extract::Path(ns): axum::extract::Path<String>,
                              headers: HeaderMap,
                              uri: Uri,
                              RawQuery(q): RawQuery| {
                            handle(app, kind, Some(ns), None, headers, uri, q)
                        },
                    ),
                )
                .route(
                    &format!("{prefix}/namespaces/{{ns}}/{plural}/{{name}}"),
                    get(
                        move |State(app): State<App>,
                              axum::extract::Path((ns, name)): axum::extract::Path<(
                            String,
                            String,
                        )>,
                              headers: HeaderMap,
                              uri: Uri,
                              RawQuery(q): RawQuery| {
                            handle(app, kind, Some(ns), Some(name), headers, uri, q)
                        },
                    ),
                );
        } else {
            r = r.route(
                &format!("{prefix}/{plural}/{{name}}"),
                get(
                    move |State(app): State<App>,
                          axum::extract::Path(name): axum::extract::Path<String>,
                          headers: HeaderMap,
                          uri: Uri,
                          RawQuery(q): RawQuery| {
                        handle(app, kind, None, Some(name), headers, uri, q)
                    },
                ),
            );
        }
    }
    r.fallback(|uri: Uri| async move {
        status_response(
            404,
            "NotFound",
            format!(
                "the server could not find the requested resource ({})",
                uri.path()
            ),
        )
    })
    .with_state(app)
}

fn status_value(code: u16, reason: &str, message: impl Into<String>) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message.into(),
        "reason": reason,
        "code": code,
    })
}

fn json_response(code: u16, body: &Value) -> Response {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(
            serde_json::to_vec(body).expect("serialize JSON"),
        ))
        .expect("valid response")
}

fn status_response(code: u16, reason: &str, message: impl Into<String>) -> Response {
    json_response(code, &status_value(code, reason, message))
}

/// The token of an `Authorization: Bearer <token>` header, parsed as kube-apiserver
/// does: the scheme is case-insensitive and anything after the token is ignored.
fn bearer_token(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let mut parts = value.splitn(3, ' ');
    let scheme = parts.next()?;
    let token = parts.next().filter(|t| !t.is_empty())?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.to_owned())
}

#[derive(Debug, Default)]
struct Params {
    watch: bool,
    resource_version: Option<String>,
    resource_version_match: Option<String>,
    allow_bookmarks: bool,
    timeout_seconds: Option<u64>,
    label_selector: Option<String>,
    field_selector: Option<String>,
    limit: Option<usize>,
    continue_token: Option<String>,
    send_initial_events: bool,
}

fn parse_params(q: &str) -> Result<Params, String> {
    let truthy = |v: &str| matches!(v, "true" | "1");
    let mut p = Params::default();
    for (k, v) in form_urlencoded::parse(q.as_bytes()) {
        let v = v.into_owned();
        match &*k {
            "watch" => p.watch = truthy(&v),
            "resourceVersion" => p.resource_version = Some(v).filter(|s| !s.is_empty()),
            "resourceVersionMatch" => p.resource_version_match = Some(v).filter(|s| !s.is_empty()),
            "allowWatchBookmarks" => p.allow_bookmarks = truthy(&v),
            "timeoutSeconds" => {
                p.timeout_seconds = Some(
                    v.parse()
                        .map_err(|_| format!("invalid timeoutSeconds: {v:?}"))?,
                )
            }
            "labelSelector" => p.label_selector = Some(v).filter(|s| !s.is_empty()),
            "fieldSelector" => p.field_selector = Some(v).filter(|s| !s.is_empty()),
            "limit" => {
                let n: i64 = v.parse().map_err(|_| format!("invalid limit: {v:?}"))?;
                p.limit = usize::try_from(n).ok().filter(|n| *n > 0);
            }
            "continue" => p.continue_token = Some(v).filter(|s| !s.is_empty()),
            "sendInitialEvents" => p.send_initial_events = truthy(&v),
            _ => {}
        }
    }
    Ok(p)
}

#[derive(Debug, Clone)]
enum Op {
    Eq,
    NotEq,
    Exists,
    NotExists,
}

/// Namespace, label and field requirements of one request.
#[derive(Debug, Clone, Default)]
struct Filter {
    namespace: Option<String>,
    labels: Vec<(String, Op, String)>,
    fields: Vec<(String, Op, String)>,
}

impl Filter {
    fn parse(
        ns: Option<String>,
        labels: Option<&str>,
        fields: Option<&str>,
    ) -> Result<Self, String> {
        let mut f = Filter {
            namespace: ns,
            ..Default::default()
        };
        if let Some(sel) = labels {
            if sel.contains('(') {
                return Err(format!(
                    "set-based label selectors are not supported by fakeapi: {sel:?}"
                ));
            }
            for term in sel.split(',').map(str::trim).filter(|t| !t.is_empty()) {
                f.labels.push(parse_term(term, true)?);
            }
        }
        if let Some(sel) = fields {
            for term in sel.split(',').map(str::trim).filter(|t| !t.is_empty()) {
                let req = parse_term(term, false)?;
                // `spec.nodeName` as the real server offers it for Pods (a node's agents
                // watch their own pods).
                if !matches!(
                    req.0.as_str(),
                    "metadata.name" | "metadata.namespace" | "spec.nodeName"
                ) {
                    return Err(format!("field label not supported: {}", req.0));
                }
                f.fields.push(req);
            }
        }
        Ok(f)
    }

    fn matches(&self, obj: &Value) -> bool {
        let meta = &obj["metadata"];
        if self
            .namespace
            .as_ref()
            .is_some_and(|ns| meta["namespace"].as_str() != Some(ns.as_str()))
        {
            return false;
        }
        let labels = &meta["labels"];
        let label_ok = self.labels.iter().all(|(k, op, v)| {
            let have = labels.get(k).and_then(Value::as_str);
            match op {
                Op::Eq => have == Some(v.as_str()),
                Op::NotEq => have != Some(v.as_str()),
                Op::Exists => have.is_some(),
                Op::NotExists => have.is_none(),
            }
        });
        let field_ok = self.fields.iter().all(|(k, op, v)| {
            let have = match k.as_str() {
                "metadata.name" => meta["name"].as_str().unwrap_or(""),
                "spec.nodeName" => obj["spec"]["nodeName"].as_str().unwrap_or(""),
                _ => meta["namespace"].as_str().unwrap_or(""),
            };
            match op {
                Op::NotEq => have != v,
                _ => have == v,
            }
        });
        label_ok && field_ok
    }
}

fn parse_term(term: &str, allow_existence: bool) -> Result<(String, Op, String), String> {
    let split = |sep: &str, op: Op| {
        term.split_once(sep)
            .map(|(k, v)| (k.trim().to_owned(), op, v.trim().to_owned()))
    };
    let req = split("!=", Op::NotEq)
        .or_else(|| split("==", Op::Eq))
        .or_else(|| split("=", Op::Eq));
    match req {
        Some(r) if !r.0.is_empty() => Ok(r),
        Some(_) => Err(format!("invalid selector term: {term:?}")),
        None if allow_existence && term.contains(' ') => {
            Err(format!("unsupported selector term: {term:?}"))
        }
        None if allow_existence => match term.strip_prefix('!') {
            Some(k) => Ok((k.trim().to_owned(), Op::NotExists, String::new())),
            None => Ok((term.to_owned(), Op::Exists, String::new())),
        },
        None => Err(format!("invalid field selector term: {term:?}")),
    }
}

async fn handle(
    app: App,
    kind: ResourceKind,
    ns: Option<String>,
    name: Option<String>,
    headers: HeaderMap,
    uri: Uri,
    query: Option<String>,
) -> Response {
    let query = query.unwrap_or_default();
    let bearer_token = bearer_token(&headers);
    let params = parse_params(&query);
    let verb = match (&name, &params) {
        (Some(_), _) => Verb::Get,
        (None, Ok(p)) if p.watch => Verb::Watch,
        _ => Verb::List,
    };
    {
        let mut rq = lock(&app.shared.requests);
        *rq.counts.entry((uri.path().to_owned(), verb)).or_default() += 1;
        rq.log.push_back(RecordedRequest {
            path: uri.path().to_owned(),
            query: query.clone(),
            verb,
            bearer_token,
        });
        while rq.log.len() > REQUEST_LOG_LIMIT {
            rq.log.pop_front();
        }
    }
    tracing::debug!(path = uri.path(), query, ?verb, "fakeapi request");

    let delay = lock(&app.shared.settings).delay;
    if !delay.is_zero() {
        let mut shutdown = app.shutdown.clone();
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.wait_for(|s| *s) => {
                return status_response(503, "ServiceUnavailable", "fakeapi: shutting down");
            }
        }
    }
    if app.shared.failing.load(Ordering::SeqCst) {
        let code = app.shared.failure_code.load(Ordering::SeqCst);
        let reason = match code {
            429 => "TooManyRequests",
            503 => "ServiceUnavailable",
            504 => "Timeout",
            _ => "InternalError",
        };
        let mut resp = status_response(code, reason, "fakeapi: failing on purpose (set_failing)");
        if matches!(code, 429 | 503 | 504) {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        return resp;
    }
    let params = match params {
        Ok(p) => p,
        Err(msg) => return status_response(400, "BadRequest", msg),
    };
    if let Some(name) = name {
        return get_one(&app, kind, ns.as_deref().unwrap_or(""), &name);
    }
    let filter = match Filter::parse(
        ns,
        params.label_selector.as_deref(),
        params.field_selector.as_deref(),
    ) {
        Ok(f) => f,
        Err(msg) => return status_response(400, "BadRequest", msg),
    };
    if params.watch {
        watch(app, kind, filter, params)
    } else {
        list(&app, kind, &filter, &params)
    }
}

fn get_one(app: &App, kind: ResourceKind, ns: &str, name: &str) -> Response {
    let st = lock(&app.shared.store);
    match st
        .objects
        .get(&kind)
        .and_then(|m| m.get(&(ns.to_owned(), name.to_owned())))
    {
        Some(obj) => json_response(200, obj),
        None => status_response(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", kind.plural()),
        ),
    }
}

fn parse_rv(rv: &str) -> Result<u64, Box<Response>> {
    rv.parse().map_err(|_| {
        Box::new(status_response(
            400,
            "BadRequest",
            format!("invalid resource version: {rv:?}"),
        ))
    })
}

fn expired(rv: u64, floor: u64) -> Value {
    status_value(
        410,
        "Expired",
        format!("too old resource version: {rv} ({floor})"),
    )
}

fn list(app: &App, kind: ResourceKind, filter: &Filter, p: &Params) -> Response {
    let type_meta = lock(&app.shared.settings).list_item_type_meta;
    let st = lock(&app.shared.store);
    // Where the page starts and which resourceVersion the list reports.
    let (list_rv, after): (u64, Option<ObjKey>) = match &p.continue_token {
        Some(token) => {
            let mut parts = token.splitn(3, ':');
            let parsed = (|| {
                let rv: u64 = parts.next()?.parse().ok()?;
                Some((rv, (parts.next()?.to_owned(), parts.next()?.to_owned())))
            })();
            let Some((rv, key)) = parsed else {
                return status_response(
                    400,
                    "BadRequest",
                    format!("invalid continue token: {token:?}"),
                );
            };
            if rv < st.floor {
                return status_response(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list result. \
                     You can start a new list without the continue parameter.",
                );
            }
            (rv, Some(key))
        }
        None => {
            if let Some(rv) = &p.resource_version {
                let rv = match parse_rv(rv) {
                    Ok(rv) => rv,
                    Err(resp) => return *resp,
                };
                if rv > st.rv {
                    let mut s = status_value(
                        504,
                        "Timeout",
                        format!("Too large resource version: {rv}, current: {}", st.rv),
                    );
                    s["details"] = json!({"causes": [{"reason": "ResourceVersionTooLarge",
                        "message": "Too large resource version"}], "retryAfterSeconds": 1});
                    return json_response(504, &s);
                }
                if p.resource_version_match.as_deref() == Some("Exact") && rv != st.rv {
                    return json_response(410, &expired(rv, st.floor));
                }
            }
            (st.rv, None)
        }
    };
    let mut items = Vec::new();
    let mut more = false;
    let mut last_key = None;
    let range = st
        .objects(kind)
        .filter(|(k, _)| after.as_ref().is_none_or(|a| *k > a));
    for (key, obj) in range {
        if !filter.matches(obj) {
            continue;
        }
        if p.limit.is_some_and(|l| items.len() >= l) {
            more = true;
            break;
        }
        let mut item = (**obj).clone();
        if let Some(o) = item.as_object_mut().filter(|_| !type_meta) {
            o.remove("kind");
            o.remove("apiVersion");
        }
        items.push(item);
        last_key = Some(key.clone());
    }
    drop(st);
    let mut meta = json!({ "resourceVersion": list_rv.to_string() });
    if more {
        let (ns, name) = last_key.expect("a full page has a last item");
        meta["continue"] = format!("{list_rv}:{ns}:{name}").into();
    }
    json_response(
        200,
        &json!({
            "kind": kind.list_kind(),
            "apiVersion": kind.api_version(),
            "metadata": meta,
            "items": items,
        }),
    )
}

/// Where a watch starts.
#[derive(Debug, Clone, Copy)]
enum Start {
    /// Synthetic ADDED events for the current state (no resourceVersion, or "0").
    Current { initial_events_end: bool },
    /// Replay the history after this resourceVersion.
    After(u64),
}

fn watch(app: App, kind: ResourceKind, filter: Filter, p: Params) -> Response {
    if p.send_initial_events {
        if !p.allow_bookmarks {
            return status_response(
                422,
                "Invalid",
                "sendInitialEvents requires allowWatchBookmarks=true",
            );
        }
        if p.resource_version_match.as_deref() != Some("NotOlderThan") {
            return status_response(
                422,
                "Invalid",
                "sendInitialEvents requires resourceVersionMatch=NotOlderThan",
            );
        }
    } else if p.resource_version_match.is_some() {
        return status_response(
            422,
            "Invalid",
            "resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
        );
    }
    let start = match p.resource_version.as_deref() {
        _ if p.send_initial_events => Start::Current {
            initial_events_end: true,
        },
        None | Some("0") => Start::Current {
            initial_events_end: false,
        },
        Some(rv) => match parse_rv(rv) {
            Ok(rv) => Start::After(rv),
            Err(resp) => return *resp,
        },
    };
    let timeout = p
        .timeout_seconds
        .map_or(DEFAULT_WATCH_TIMEOUT, Duration::from_secs);
    let bookmark_interval = lock(&app.shared.settings).bookmark_interval;
    let bookmarks = p.allow_bookmarks.then_some(bookmark_interval);

    let (tx, rx) = mpsc::channel::<Bytes>(256);
    tokio::spawn(run_watch(app, kind, filter, start, bookmarks, timeout, tx));
    let body = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(body))
        .expect("valid response")
}

fn event_line(etype: &str, obj: &Value) -> Bytes {
    let mut line =
        serde_json::to_vec(&json!({ "type": etype, "object": obj })).expect("serialize event");
    line.push(b'\n');
    Bytes::from(line)
}

fn bookmark(kind: ResourceKind, rv: u64, initial_events_end: bool) -> Bytes {
    let mut meta = json!({ "resourceVersion": rv.to_string() });
    if initial_events_end {
        meta["annotations"] = json!({ "k8s.io/initial-events-end": "true" });
    }
    event_line(
        "BOOKMARK",
        &json!({ "kind": kind.kind(), "apiVersion": kind.api_version(), "metadata": meta }),
    )
}

/// How one change looks to a watch with `filter`, if it sees it at all.
fn visible(ev: &HistEvent, kind: ResourceKind, filter: &Filter) -> Option<Bytes> {
    if ev.kind != kind {
        return None;
    }
    let now = filter.matches(&ev.object);
    let etype = match ev.etype {
        EventType::Added => now.then_some("ADDED")?,
        EventType::Deleted => now.then_some("DELETED")?,
        EventType::Modified => {
            let before = ev.prev.as_deref().is_some_and(|p| filter.matches(p));
            match (before, now) {
                (true, true) => "MODIFIED",
                (false, true) => "ADDED",
                (true, false) => "DELETED",
                (false, false) => return None,
            }
        }
    };
    Some(event_line(etype, &ev.object))
}

struct OpenWatch(Arc<Shared>);

impl Drop for OpenWatch {
    fn drop(&mut self) {
        self.0.open_watches.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn run_watch(
    app: App,
    kind: ResourceKind,
    filter: Filter,
    start: Start,
    bookmarks: Option<Duration>,
    timeout: Duration,
    tx: mpsc::Sender<Bytes>,
) {
    let shared = app.shared.clone();
    // Subscribe before counting the watch as open, so that a `close_watches()`
    // issued after `wait_open_watches()` always reaches it.
    let mut close_rx = shared.close_watches.subscribe();
    close_rx.mark_unchanged();
    shared.open_watches.fetch_add(1, Ordering::SeqCst);
    let _open = OpenWatch(shared.clone());
    let mut shutdown = app.shutdown.clone();

    // Snapshot and subscribe under the store lock: nothing is missed or doubled.
    let snapshot = {
        let st = lock(&shared.store);
        let events = shared.events.subscribe();
        let mut initial = Vec::new();
        match start {
            Start::Current { initial_events_end } => {
                for (_, obj) in st.objects(kind) {
                    if filter.matches(obj) {
                        initial.push(event_line("ADDED", obj));
                    }
                }
                if initial_events_end {
                    initial.push(bookmark(kind, st.rv, true));
                }
            }
            Start::After(rv) if rv < st.floor => {
                initial.push(event_line("ERROR", &expired(rv, st.floor)));
            }
            Start::After(rv) => {
                for ev in st.history.iter().filter(|e| e.rv > rv) {
                    initial.extend(visible(ev, kind, &filter));
                }
            }
        }
        let expired = matches!(start, Start::After(rv) if rv < st.floor);
        (initial, (!expired).then_some(events), st.rv)
    };
    let (initial, events, mut last_rv) = snapshot;
    for line in initial {
        if tx.send(line).await.is_err() {
            return;
        }
    }
    // A 410 ERROR event ends the stream.
    let Some(mut events) = events else { return };

    let deadline = tokio::time::sleep(timeout);
    tokio::pin!(deadline);
    let mut ticker =
        bookmarks.map(|every| tokio::time::interval_at(tokio::time::Instant::now() + every, every));
    loop {
        let out: Vec<Bytes> = tokio::select! {
            // Closing wins over pending events, so nothing is sent after
            // `close_watches()`/`stop()` once the stream notices.
            biased;
            _ = shutdown.wait_for(|s| *s) => return,
            _ = close_rx.changed() => return,
            _ = &mut deadline => return,
            _ = tx.closed() => return,
            ev = events.recv() => match ev {
                Ok(ev) => {
                    if ev.rv <= last_rv {
                        continue;
                    }
                    last_rv = ev.rv;
                    visible(&ev, kind, &filter).into_iter().collect()
                }
                // Too slow (or the server is gone): end the stream; the client resumes.
                Err(_) => return,
            },
            _ = async { ticker.as_mut().expect("guarded").tick().await }, if ticker.is_some() => {
                // Everything up to the current version must be sent before a
                // bookmark claims it.
                let mut out = Vec::new();
                let now_rv = {
                    let st = lock(&shared.store);
                    loop {
                        match events.try_recv() {
                            Ok(ev) => {
                                if ev.rv > last_rv {
                                    last_rv = ev.rv;
                                    out.extend(visible(&ev, kind, &filter));
                                }
                            }
                            Err(broadcast::error::TryRecvError::Empty) => break,
                            Err(_) => return,
                        }
                    }
                    st.rv
                };
                last_rv = last_rv.max(now_rv);
                out.push(bookmark(kind, last_rv, false));
                out
            }
        };
        for line in out {
            if tx.send(line).await.is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::{ServicePort, ServiceSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use kube::api::{Api, ListParams, WatchEvent, WatchParams};
    use kube::runtime::WatchStreamExt;
    use kube::runtime::{watcher, watcher::Event};

    const WAIT: Duration = Duration::from_secs(15);

    fn local() -> SocketAddr {
        "127.0.0.1:0".parse().unwrap()
    }

    fn svc(ns: &str, name: &str, port: i32) -> Service {
        Service {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(ns.into()),
                labels: Some([("app".to_owned(), name.to_owned())].into()),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                cluster_ip: Some("10.96.0.10".into()),
                ports: Some(vec![ServicePort {
                    port,
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn node(name: &str, ip: &str) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some(name.into());
        n.metadata.annotations = Some([("ip".to_owned(), ip.to_owned())].into());
        n
    }

    fn name_of<K: kube::Resource>(k: &K) -> String {
        k.meta().name.clone().unwrap_or_default()
    }

    /// A compact rendering of watcher events for assertions.
    fn show<K: kube::Resource>(ev: &Result<Event<K>, watcher::Error>) -> String {
        match ev {
            Ok(Event::Init) => "Init".into(),
            Ok(Event::InitApply(k)) => format!("InitApply({})", name_of(k)),
            Ok(Event::InitDone) => "InitDone".into(),
            Ok(Event::Apply(k)) => format!("Apply({})", name_of(k)),
            Ok(Event::Delete(k)) => format!("Delete({})", name_of(k)),
            Err(e) => format!("Err({e})"),
        }
    }

    async fn next<S, K>(s: &mut S) -> String
    where
        S: futures::Stream<Item = Result<Event<K>, watcher::Error>> + Unpin,
        K: kube::Resource,
    {
        let ev = tokio::time::timeout(WAIT, s.next())
            .await
            .expect("timed out waiting for a watcher event")
            .expect("watcher stream ended");
        show(&ev)
    }

    /// Polls the watcher for `dur` (so it keeps issuing requests), failing on any event.
    async fn quiet<S, K>(s: &mut S, dur: Duration)
    where
        S: futures::Stream<Item = Result<Event<K>, watcher::Error>> + Unpin,
        K: kube::Resource,
    {
        if let Ok(ev) = tokio::time::timeout(dur, s.next()).await {
            panic!("unexpected event {:?}", ev.map(|e| show(&e)));
        }
    }

    /// Collects the watcher's events for `dur`.
    async fn drain<S, K>(s: &mut S, dur: Duration) -> Vec<String>
    where
        S: futures::Stream<Item = Result<Event<K>, watcher::Error>> + Unpin,
        K: kube::Resource,
    {
        let mut seen = Vec::new();
        let _ = tokio::time::timeout(dur, async {
            while let Some(ev) = s.next().await {
                seen.push(show(&ev));
            }
        })
        .await;
        seen
    }

    /// Polls the watcher (a watcher only sends its watch request when polled)
    /// until the server has `n` open watch streams.
    async fn watching<S, K>(server: &FakeApiServer, s: &mut S, n: usize)
    where
        S: futures::Stream<Item = Result<Event<K>, watcher::Error>> + Unpin,
        K: kube::Resource,
    {
        tokio::select! {
            r = server.wait_open_watches(n, WAIT) => r.unwrap(),
            ev = s.next() => panic!("unexpected event {:?}", ev.map(|e| show(&e))),
        }
    }

    /// Polls until an event rendered as `want` arrives; returns everything seen.
    async fn until<S, K>(s: &mut S, want: &str) -> Vec<String>
    where
        S: futures::Stream<Item = Result<Event<K>, watcher::Error>> + Unpin,
        K: kube::Resource,
    {
        let mut seen = Vec::new();
        tokio::time::timeout(WAIT, async {
            loop {
                let ev = next(s).await;
                let done = ev == want;
                seen.push(ev);
                if done {
                    break;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("never saw {want}; saw {seen:?}"));
        seen
    }

    #[tokio::test]
    async fn kubeconfig_list_and_pagination() {
        let server = FakeApiServer::start(local()).await.unwrap();
        for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
            let stored = server.apply_service(svc("default", name, 80 + i as i32));
            assert!(stored.metadata.resource_version.is_some());
        }
        server.apply_service(svc("other", "d", 90));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        server.write_kubeconfig(&path).unwrap();
        let yaml = std::fs::read_to_string(&path).unwrap();
        eprintln!("kubeconfig:\n{yaml}");
        for want in [
            "current-context: fakeapi",
            "token: fakeapi-dummy-token",
            "server: http://127.0.0.1:",
        ] {
            assert!(yaml.contains(want), "{want:?} not in\n{yaml}");
        }
        let kc = kube::config::Kubeconfig::read_from(&path).unwrap();
        let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .unwrap();
        assert_eq!(config.cluster_url.to_string(), format!("{}/", server.url()));
        let client = kube::Client::try_from(config).unwrap();

        let all: Api<Service> = Api::all(client.clone());
        let list = all.list(&ListParams::default()).await.unwrap();
        let names: Vec<_> = list.items.iter().map(name_of).collect();
        assert_eq!(names, ["a", "b", "c", "d"]);
        assert_eq!(list.metadata.resource_version.as_deref(), Some("5"));
        assert!(
            list.items
                .iter()
                .all(|s| s.metadata.resource_version.is_some())
        );

        // Pagination with limit=1, also across a concurrent change.
        let ns: Api<Service> = Api::namespaced(client.clone(), "default");
        let mut lp = ListParams::default().limit(1);
        let mut pages = Vec::new();
        loop {
            let page = ns.list(&lp).await.unwrap();
            assert_eq!(page.metadata.resource_version.as_deref(), Some("5"));
            assert!(page.items.len() <= 1);
            pages.extend(page.items.iter().map(name_of));
            match page.metadata.continue_ {
                Some(c) if !c.is_empty() => lp = lp.continue_token(&c),
                _ => break,
            }
        }
        assert_eq!(pages, ["a", "b", "c"]);

        // Continue tokens expire with compaction.
        let first = ns.list(&ListParams::default().limit(1)).await.unwrap();
        server.apply_service(svc("default", "e", 80));
        server.compact();
        let token = first.metadata.continue_.unwrap();
        let err = ns
            .list(&ListParams::default().limit(1).continue_token(&token))
            .await
            .unwrap_err();
        assert!(
            matches!(err, kube::Error::Api(ref s) if s.code == 410),
            "{err:?}"
        );

        // Selectors and single-object GET.
        let by_label = all
            .list(&ListParams::default().labels("app=b"))
            .await
            .unwrap();
        assert_eq!(
            by_label.items.iter().map(name_of).collect::<Vec<_>>(),
            ["b"]
        );
        let by_field = all
            .list(&ListParams::default().fields("metadata.namespace=other"))
            .await
            .unwrap();
        assert_eq!(
            by_field.items.iter().map(name_of).collect::<Vec<_>>(),
            ["d"]
        );
        let one = ns.get("c").await.unwrap();
        assert_eq!(one.spec.unwrap().ports.unwrap()[0].port, 82);
        let missing = ns.get("zz").await.unwrap_err();
        assert!(
            matches!(missing, kube::Error::Api(ref s) if s.code == 404),
            "{missing:?}"
        );
        assert_eq!(
            server.request_count("/api/v1/namespaces/default/services", Verb::List),
            5
        );
        // The kubeconfig's token is sent (and recorded), though plain HTTP checks none.
        let log = server.request_log();
        assert!(
            log.iter()
                .all(|r| r.bearer_token.as_deref() == Some("fakeapi-dummy-token")),
            "{log:?}"
        );
    }

    #[tokio::test]
    async fn raw_watch_replays_and_expires() {
        let server = FakeApiServer::start(local()).await.unwrap();
        server.set_bookmark_interval(Duration::from_millis(100));
        let client = server.client().unwrap();
        let api: Api<Service> = Api::all(client);
        let a = server.apply_service(svc("default", "a", 80));
        let rv_a = a.metadata.resource_version.clone().unwrap();
        server.apply_service(svc("default", "a", 81));
        server.delete_service("default", "a");

        let mut s = api
            .watch(&WatchParams::default().timeout(5), &rv_a)
            .await
            .unwrap()
            .boxed();
        let mut kinds = Vec::new();
        while kinds.len() < 3 {
            match tokio::time::timeout(WAIT, s.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap()
            {
                WatchEvent::Modified(o) => {
                    kinds.push(format!("M{}", o.metadata.resource_version.unwrap()))
                }
                WatchEvent::Deleted(o) => {
                    kinds.push(format!("D{}", o.metadata.resource_version.unwrap()))
                }
                WatchEvent::Bookmark(b) => kinds.push(format!("B{}", b.metadata.resource_version)),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(kinds, ["M3", "D4", "B4"]);

        server.compact();
        server.apply_service(svc("default", "b", 80));
        let mut s = api
            .watch(&WatchParams::default(), &rv_a)
            .await
            .unwrap()
            .boxed();
        match tokio::time::timeout(WAIT, s.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            WatchEvent::Error(e) => {
                assert_eq!((e.code, e.reason.as_str()), (410, "Expired"));
                assert_eq!(e.message, "too old resource version: 2 (4)");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(
            tokio::time::timeout(WAIT, s.next())
                .await
                .unwrap()
                .is_none()
        );
    }

    #[tokio::test]
    async fn watcher_sees_changes_and_relists_after_compaction() {
        let server = FakeApiServer::start(local()).await.unwrap();
        server.apply_service(svc("default", "a", 80));
        server.apply_service(svc("default", "b", 80));
        let api: Api<Service> = Api::all(server.client().unwrap());
        let mut w = watcher(api, watcher::Config::default()).boxed();
        assert_eq!(next(&mut w).await, "Init");
        assert_eq!(next(&mut w).await, "InitApply(a)");
        assert_eq!(next(&mut w).await, "InitApply(b)");
        assert_eq!(next(&mut w).await, "InitDone");

        server.apply_service(svc("default", "c", 80));
        assert_eq!(next(&mut w).await, "Apply(c)");
        server.apply_service(svc("default", "c", 8080));
        assert_eq!(next(&mut w).await, "Apply(c)");
        server.delete_service("default", "c");
        assert_eq!(next(&mut w).await, "Delete(c)");

        // The watch is closed, b is deleted while the watcher is away, and the
        // history is compacted: the watcher's resume gets 410 and it re-lists.
        let lists_before = server.request_count("/api/v1/services", Verb::List);
        let watches_before = server.request_count("/api/v1/services", Verb::Watch);
        server.wait_open_watches(1, WAIT).await.unwrap();
        server.close_watches();
        server.wait_open_watches(0, WAIT).await.unwrap();
        server.delete_service("default", "b");
        server.compact();
        let seen = until(&mut w, "InitDone").await;
        assert!(
            seen[0].starts_with("Err(") && seen[0].contains("Expired"),
            "{seen:?}"
        );
        assert_eq!(seen[1..], ["Init", "InitApply(a)", "InitDone"]);
        assert_eq!(
            server.request_count("/api/v1/services", Verb::List),
            lists_before + 1
        );
        assert_eq!(
            server.request_count("/api/v1/services", Verb::Watch),
            watches_before + 1
        );

        server.apply_service(svc("default", "d", 80));
        assert_eq!(next(&mut w).await, "Apply(d)");

        // What kube-rs sent.
        let log = server.request_log();
        let list = log.iter().find(|r| r.verb == Verb::List).unwrap();
        assert_eq!(list.param("limit").as_deref(), Some("500"));
        let watch = log.iter().find(|r| r.verb == Verb::Watch).unwrap();
        assert_eq!(watch.param("allowWatchBookmarks").as_deref(), Some("true"));
        assert_eq!(watch.param("timeoutSeconds").as_deref(), Some("290"));
        assert_eq!(watch.param("resourceVersion").as_deref(), Some("3"));
        for r in &log {
            eprintln!("kube-rs sent: {:?} {}?{}", r.verb, r.path, r.query);
        }
    }

    #[tokio::test]
    async fn watcher_recovers_from_failures() {
        let server = FakeApiServer::start(local()).await.unwrap();
        server.apply_service(svc("default", "a", 80));
        let api: Api<Service> = Api::all(server.client().unwrap());
        let mut w = watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        until(&mut w, "InitDone").await;

        watching(&server, &mut w, 1).await;
        server.set_failing(true);
        server.close_watches();
        let ev = next(&mut w).await;
        assert!(
            ev.starts_with("Err(") && ev.contains("InternalError"),
            "{ev}"
        );
        server.apply_service(svc("default", "b", 80));
        let during = drain(&mut w, Duration::from_millis(1500)).await;
        assert!(during.iter().all(|e| e.starts_with("Err(")), "{during:?}");
        server.set_failing(false);
        let seen = until(&mut w, "Apply(b)").await;
        assert!(
            seen.iter()
                .all(|e| e.starts_with("Err(") || e == "Apply(b)"),
            "{seen:?}"
        );

        // 503 is retried inside the kube client (Retry-After: 1): no error surfaces.
        watching(&server, &mut w, 1).await;
        server.set_failure_code(503);
        server.set_failing(true);
        server.close_watches();
        server.wait_open_watches(0, WAIT).await.unwrap();
        server.apply_service(svc("default", "c", 80));
        let failing = async {
            tokio::time::sleep(Duration::from_millis(2500)).await;
            server.set_failing(false);
        };
        let (seen, ()) = tokio::join!(until(&mut w, "Apply(c)"), failing);
        assert_eq!(seen, ["Apply(c)"]);
        assert!(
            server.request_count("/api/v1/services", Verb::Watch) >= 5,
            "{:?}",
            server.requests()
        );
    }

    #[tokio::test]
    async fn watcher_survives_restart_on_same_port() {
        let mut server = FakeApiServer::start(local()).await.unwrap();
        let addr = server.addr();
        server.apply_service(svc("default", "a", 80));
        let api: Api<Service> = Api::all(server.client().unwrap());
        let mut w = watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        until(&mut w, "InitDone").await;
        watching(&server, &mut w, 1).await;

        server.stop().await;
        assert!(!server.is_running());
        assert_eq!(server.open_watches(), 0);
        server.apply_service(svc("default", "b", 80));
        server.delete_service("default", "a");
        // The watcher fails to reconnect while the server is down.
        let ev = next(&mut w).await;
        assert!(ev.starts_with("Err("), "{ev}");

        server.restart().await.unwrap();
        assert_eq!(server.addr(), addr);
        let seen = until(&mut w, "Delete(a)").await;
        assert!(seen.contains(&"Apply(b)".to_owned()), "{seen:?}");
        assert!(
            !seen.contains(&"Init".to_owned()),
            "resumed without relist: {seen:?}"
        );
    }

    #[tokio::test]
    async fn node_watch_by_field_selector() {
        let server = FakeApiServer::start(local()).await.unwrap();
        server.apply_node(node("node-a", "10.0.0.1"));
        server.apply_node(node("node-b", "10.0.0.2"));
        let api: Api<Node> = Api::all(server.client().unwrap());
        let cfg = watcher::Config::default().fields("metadata.name=node-a");
        let mut w = watcher(api.clone(), cfg).boxed();
        assert_eq!(next(&mut w).await, "Init");
        assert_eq!(next(&mut w).await, "InitApply(node-a)");
        assert_eq!(next(&mut w).await, "InitDone");
        server.apply_node(node("node-b", "10.0.0.3"));
        server.apply_node(node("node-c", "10.0.0.4"));
        server.apply_node(node("node-a", "10.0.0.5"));
        assert_eq!(next(&mut w).await, "Apply(node-a)");
        server.delete_node("node-b");
        server.delete_node("node-a");
        assert_eq!(next(&mut w).await, "Delete(node-a)");

        let got = api.get("node-b").await.unwrap_err();
        assert!(
            matches!(got, kube::Error::Api(ref s) if s.code == 404),
            "{got:?}"
        );
        assert_eq!(
            api.get("node-c").await.unwrap().metadata.name.as_deref(),
            Some("node-c")
        );
        let watch = server
            .request_log()
            .into_iter()
            .find(|r| r.verb == Verb::Watch)
            .unwrap();
        assert_eq!(watch.path, "/api/v1/nodes");
        assert_eq!(
            watch.param("fieldSelector").as_deref(),
            Some("metadata.name=node-a")
        );
    }

    #[tokio::test]
    async fn endpoint_slices_streaming_list_and_timeouts() {
        use k8s_openapi::api::discovery::v1::Endpoint;
        let server = FakeApiServer::start(local()).await.unwrap();
        let slice = |name: &str, ip: &str| EndpointSlice {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                labels: Some([("kubernetes.io/service-name".to_owned(), "a".to_owned())].into()),
                ..Default::default()
            },
            address_type: "IPv4".into(),
            endpoints: vec![Endpoint {
                addresses: vec![ip.into()],
                ..Default::default()
            }],
            ports: None,
        };
        server.apply_endpoint_slice(slice("a-1", "10.1.0.1"));
        let api: Api<EndpointSlice> = Api::namespaced(server.client().unwrap(), "default");

        // kube-rs streaming lists (sendInitialEvents) work too.
        let cfg = watcher::Config::default()
            .streaming_lists()
            .labels("kubernetes.io/service-name=a");
        let mut w = watcher(api.clone(), cfg).boxed();
        assert_eq!(next(&mut w).await, "Init");
        assert_eq!(next(&mut w).await, "InitApply(a-1)");
        assert_eq!(next(&mut w).await, "InitDone");
        server.apply_endpoint_slice(slice("a-2", "10.1.0.2"));
        assert_eq!(next(&mut w).await, "Apply(a-2)");

        // timeoutSeconds ends the stream; the watcher silently re-watches.
        let path = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices";
        let mut w2 = watcher(api, watcher::Config::default().timeout(1)).boxed();
        until(&mut w2, "InitDone").await;
        quiet(&mut w2, Duration::from_millis(2500)).await;
        server.delete_endpoint_slice("default", "a-1");
        assert_eq!(next(&mut w2).await, "Delete(a-1)");
        assert!(
            server.request_count(path, Verb::Watch) >= 3,
            "{:?}",
            server.requests()
        );
        assert_eq!(next(&mut w).await, "Delete(a-1)");
    }

    #[tokio::test]
    async fn delay_and_label_transitions() {
        let server = FakeApiServer::start(local()).await.unwrap();
        let api: Api<Service> = Api::all(server.client().unwrap());
        server.set_delay(Duration::from_millis(300));
        let t = std::time::Instant::now();
        api.list(&ListParams::default()).await.unwrap();
        assert!(t.elapsed() >= Duration::from_millis(300));
        server.set_delay(Duration::ZERO);

        let mut w = watcher(api, watcher::Config::default().labels("tier=web")).boxed();
        until(&mut w, "InitDone").await;
        let mut s = svc("default", "a", 80);
        server.apply_service(s.clone());
        s.metadata.labels = Some([("tier".to_owned(), "web".to_owned())].into());
        server.apply_service(s.clone());
        assert_eq!(next(&mut w).await, "Apply(a)");
        s.metadata.labels = None;
        server.apply_service(s);
        assert_eq!(next(&mut w).await, "Delete(a)");
    }
}
