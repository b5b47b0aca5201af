//! Test support: an in-process fake Kubernetes API server speaking the list/watch
//! protocol the way kube-apiserver does, for the resources the agent watches
//! (`Service`, `discovery.k8s.io/v1` `EndpointSlice`, `Node`, `Pod`, `Namespace`).
//!
//! No kube-apiserver can be installed on the build machines, so the agent's
//! Kubernetes source (kube-rs `watcher`s) is exercised against this server instead,
//! both in-process (unit tests below) and through the real `ebpf-proxy run
//! --kubeconfig FILE` binary (integration tests, via [`FakeApiServer::write_kubeconfig`]).
//!
//! # Two modes
//!
//! * Plain HTTP ([`FakeApiServer::start`]): no TLS, no authentication; the kubeconfig
//!   carries a dummy token that is recorded but not checked.
//! * HTTPS ([`FakeApiServer::start_tls`], [`FakeApiServer::start_tls_on`]), the way a
//!   pod reaches kube-apiserver: a test CA and a serving certificate are made at start
//!   (SANs: the bound IP, `localhost`, the `kubernetes.default.svc` names and
//!   [`TlsOptions`]' extras), and every request must carry `Authorization: Bearer
//!   <token>` (otherwise `401` with a `Status` `Unauthorized`, as kube-apiserver answers).
//!   [`FakeApiServer::write_service_account_dir`] writes what the kubelet mounts at
//!   `/var/run/secrets/kubernetes.io/serviceaccount/` (`token`, `ca.crt`, `namespace`),
//!   and [`FakeApiServer::write_kubeconfig`] embeds the CA, the token and the `https` URL
//!   ([`FakeApiServer::ca_pem`] and [`FakeApiServer::token`] give them to a test).
//!   `start_tls` binds before it returns its future and `start_tls_on` takes an already
//!   bound listener, so a test can bind inside a network namespace; a restart rebinds in
//!   the namespace the first listener lived in.
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
//! * Authentication (HTTPS mode, unless [`TlsOptions::require_token`] is off): checked
//!   before anything else, including unknown paths.
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
//! apiserver outage on the same port with the state (and in HTTPS mode the CA, the
//! certificate and the token) kept.
//!
//! Everything runs inside the caller's tokio runtime; the server task ends on
//! [`FakeApiServer::stop`] or when the `FakeApiServer` is dropped.

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::fs::File;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
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
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::rustls;

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

/// How long a client may take over its TLS handshake before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The token a plain-HTTP server's kubeconfig carries (recorded, never checked).
const PLAIN_TOKEN: &str = "fakeapi-dummy-token";

/// The service account token of an HTTPS server unless [`TlsOptions::token`] says otherwise.
pub const DEFAULT_TOKEN: &str = "fakeapi-service-account-token";

/// The `namespace` file of [`FakeApiServer::write_service_account_dir`]: the agent's
/// DaemonSet runs in `kube-system`.
pub const SERVICE_ACCOUNT_NAMESPACE: &str = "kube-system";

/// The HTTPS mode's settings; see [`FakeApiServer::start_tls`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsOptions {
    /// IP addresses the serving certificate must also be valid for, besides the bound
    /// one (for example the address a pod in another network namespace dials).
    pub san_ips: Vec<IpAddr>,
    /// DNS names it must also be valid for, besides `localhost` and the
    /// `kubernetes.default.svc` names (ASCII; an IP address given here counts as one).
    pub san_names: Vec<String>,
    /// The service account's bearer token ([`FakeApiServer::token`]); written as is
    /// (no newline) to the `token` file, so it must be a valid header value.
    pub token: String,
    /// Whether requests without `Authorization: Bearer <token>` get `401` (default
    /// `true`). Off, the token is only recorded.
    pub require_token: bool,
}

impl Default for TlsOptions {
    fn default() -> Self {
        Self {
            san_ips: Vec::new(),
            san_names: Vec::new(),
            token: DEFAULT_TOKEN.to_owned(),
            require_token: true,
        }
    }
}

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
    /// The token of an `Authorization: Bearer <token>` header, if the request had one
    /// (recorded whether or not it was accepted).
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
    /// The bearer token every request must carry (HTTPS mode), if any.
    required_token: Option<String>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking test thread must not wedge the server for the others.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn new(required_token: Option<String>) -> Self {
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
            required_token,
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
    /// The HTTPS mode's CA, certificate and token; `None` for plain HTTP.
    tls: Option<Tls>,
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

/// What the HTTPS mode keeps across restarts.
struct Tls {
    ca_pem: String,
    ca_der: Vec<u8>,
    acceptor: tokio_rustls::TlsAcceptor,
    token: String,
}

impl Tls {
    /// Makes a CA and a serving certificate it signs for the IP of `bound` (plus, when
    /// that is unspecified, the loopback address of its family), the names every
    /// kube-apiserver certificate has, and `opts`' extras.
    fn new(bound: SocketAddr, opts: &TlsOptions) -> anyhow::Result<Self> {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
            KeyPair, KeyUsagePurpose, SanType,
        };
        let mut ca = CertificateParams::default();
        // Named after the server, so a client given another server's CA fails with
        // "unknown issuer" rather than a confusing bad signature.
        ca.distinguished_name
            .push(DnType::CommonName, format!("fakeapi-ca@{bound}"));
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_key = KeyPair::generate()?;
        let ca_cert = ca.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca, ca_key);

        let names = [
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ]
        .into_iter()
        .map(str::to_owned)
        .chain(opts.san_names.iter().cloned())
        .collect::<Vec<_>>();
        let mut leaf = CertificateParams::new(names).context("fakeapi: certificate SAN names")?;
        let mut ips = vec![bound.ip()];
        if bound.ip().is_unspecified() {
            ips.push(match bound.ip() {
                IpAddr::V4(_) => Ipv4Addr::LOCALHOST.into(),
                IpAddr::V6(_) => Ipv6Addr::LOCALHOST.into(),
            });
        }
        ips.extend(&opts.san_ips);
        ips.sort();
        ips.dedup();
        leaf.subject_alt_names
            .extend(ips.into_iter().map(SanType::IpAddress));
        leaf.distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        leaf.use_authority_key_identifier_extension = true;
        let leaf_key = KeyPair::generate()?;
        let leaf_cert = leaf.signed_by(&leaf_key, &issuer)?;

        let key = rustls::pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into());
        // The provider is named rather than taken from the process default, which
        // nothing installs in tests.
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(vec![leaf_cert.der().clone()], key)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            ca_pem: ca_cert.pem(),
            ca_der: ca_cert.der().to_vec(),
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
            token: opts.token.clone(),
        })
    }
}

impl FakeApiServer {
    /// Binds `addr` (use `127.0.0.1:0` for a free port) and starts serving plain
    /// HTTP on the current tokio runtime.
    pub async fn start(addr: SocketAddr) -> anyhow::Result<Self> {
        let listener = bind(addr)?;
        let netns = netns_of(&listener);
        Self::launch(listener, netns, None, false)
    }

    /// Starts serving HTTPS with a fresh test CA (see [`TlsOptions`] and the
    /// [module docs](self)) on `addr` (`127.0.0.1:0` for a free port), on the tokio
    /// runtime that polls the returned future.
    ///
    /// The socket is bound, and the CA and certificate are made, by this call itself,
    /// before the future is first polled: a caller can enter a network namespace, call
    /// this, go back, and then await. Errors (from the future): the bind fails, or a
    /// [`TlsOptions::san_names`] entry is not ASCII.
    pub fn start_tls(
        addr: SocketAddr,
        opts: TlsOptions,
    ) -> impl Future<Output = anyhow::Result<Self>> + Send + 'static {
        let prepared = bind(addr).and_then(|listener| {
            let netns = netns_of(&listener);
            let tls = Tls::new(listener.local_addr()?, &opts)?;
            Ok((listener, netns, tls))
        });
        async move {
            let (listener, netns, tls) = prepared?;
            Self::launch(listener, netns, Some(tls), opts.require_token)
        }
    }

    /// [`Self::start_tls`] on a socket the caller bound and put in the listening state
    /// (for example with [`std::net::TcpListener::bind`] inside a network namespace);
    /// the certificate is made for its local address.
    ///
    /// [`Self::restart`] binds that address again in the socket's network namespace,
    /// found by asking the socket (`SIOCGSKNS`, which needs `CAP_NET_ADMIN` there) or
    /// else taken to be the calling thread's; so call this before leaving the namespace
    /// when unprivileged. Errors (from the future): the socket has no local address or
    /// cannot be registered with tokio, or a SAN name is not ASCII.
    pub fn start_tls_on(
        listener: std::net::TcpListener,
        opts: TlsOptions,
    ) -> impl Future<Output = anyhow::Result<Self>> + Send + 'static {
        let prepared = (|| -> anyhow::Result<_> {
            let addr = listener.local_addr()?;
            listener.set_nonblocking(true)?;
            let netns = netns_of(&listener);
            let tls = Tls::new(addr, &opts)?;
            Ok((netns, tls))
        })();
        async move {
            let (netns, tls) = prepared?;
            Self::launch(listener, netns, Some(tls), opts.require_token)
        }
    }

    /// Builds the server around a bound listener and starts serving.
    fn launch(
        listener: std::net::TcpListener,
        netns: Option<File>,
        tls: Option<Tls>,
        require_token: bool,
    ) -> anyhow::Result<Self> {
        let required_token = tls
            .as_ref()
            .filter(|_| require_token)
            .map(|t| t.token.clone());
        let mut server = Self {
            addr: listener.local_addr()?,
            shared: Arc::new(Shared::new(required_token)),
            running: None,
            tls,
            netns,
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
        let task = match &self.tls {
            None => spawn_server(listener, router, shutdown_rx),
            Some(tls) => spawn_server(
                TlsListener {
                    tcp: listener,
                    acceptor: tls.acceptor.clone(),
                    handshakes: JoinSet::new(),
                },
                router,
                shutdown_rx,
            ),
        };
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

    /// Whether this server speaks HTTPS ([`Self::start_tls`]).
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// `http://ADDR:PORT`, or `https://ADDR:PORT` in HTTPS mode.
    pub fn url(&self) -> String {
        let scheme = if self.is_tls() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// The test CA's certificate (PEM), what a pod's `ca.crt` holds; `None` for plain
    /// HTTP.
    pub fn ca_pem(&self) -> Option<&str> {
        self.tls.as_ref().map(|t| t.ca_pem.as_str())
    }

    /// The bearer token clients are given: in HTTPS mode the service account token
    /// ([`TlsOptions::token`]), for plain HTTP the kubeconfig's dummy token (never
    /// checked).
    pub fn token(&self) -> &str {
        self.tls.as_ref().map_or(PLAIN_TOKEN, |t| t.token.as_str())
    }

    /// Writes what the kubelet mounts at `/var/run/secrets/kubernetes.io/serviceaccount/`
    /// into `dir` (created if missing): `token` ([`Self::token`]), `ca.crt`
    /// ([`Self::ca_pem`]) and `namespace` ([`SERVICE_ACCOUNT_NAMESPACE`]), without
    /// trailing newlines as the kubelet writes them (kube-rs sends the `token` file's
    /// content as is). Errors: a plain-HTTP server (it has no CA), or a write fails.
    pub fn write_service_account_dir(&self, dir: impl AsRef<Path>) -> anyhow::Result<()> {
        let dir = dir.as_ref();
        let Some(tls) = &self.tls else {
            anyhow::bail!("fakeapi: a plain-HTTP server has no CA for ca.crt; use start_tls");
        };
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (name, content) in [
            ("token", tls.token.as_str()),
            ("ca.crt", tls.ca_pem.as_str()),
            ("namespace", SERVICE_ACCOUNT_NAMESPACE),
        ] {
            let path = dir.join(name);
            std::fs::write(&path, content)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }

    /// A kubeconfig with one cluster (`server:` [`Self::url`]; in HTTPS mode with the
    /// CA embedded as `certificate-authority-data`), a user with [`Self::token`], and a
    /// `fakeapi` context set as current context.
    pub fn kubeconfig(&self) -> kube::config::Kubeconfig {
        use base64::Engine as _;
        use kube::config::{
            Cluster, Context, Kubeconfig, NamedAuthInfo, NamedCluster, NamedContext,
        };
        // `AuthInfo::token` is a `secrecy::SecretString`; build it through serde so
        // this crate does not need `secrecy` as a dependency.
        let auth_info =
            serde_json::from_value(json!({ "token": self.token() })).expect("AuthInfo from JSON");
        Kubeconfig {
            clusters: vec![NamedCluster {
                name: "fakeapi".into(),
                cluster: Some(Cluster {
                    server: Some(self.url()),
                    certificate_authority_data: self
                        .ca_pem()
                        .map(|pem| base64::engine::general_purpose::STANDARD.encode(pem)),
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

    /// A kube client configuration pointing at this server: for plain HTTP without
    /// credentials, in HTTPS mode trusting the test CA and sending [`Self::token`].
    pub fn client_config(&self) -> kube::Config {
        let mut config = kube::Config::new(self.url().parse().expect("valid URL"));
        if let Some(tls) = &self.tls {
            config.root_cert = Some(vec![tls.ca_der.clone()]);
            config.auth_info =
                serde_json::from_value(json!({ "token": tls.token })).expect("AuthInfo from JSON");
        }
        config
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
    /// still running); in HTTPS mode with the same CA, certificate and token.
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

    /// Requests received so far, per (path, verb), including those answered with an
    /// error ([`Self::set_failing`], `400`, `401`).
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

    /// The last (up to 10000) requests to served paths, oldest first, rejected ones
    /// included; [`RecordedRequest::bearer_token`] shows what each one authenticated with.
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

// ---- sockets and TLS ---------------------------------------------------------

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

/// A TCP listener whose connections are handed to axum once their TLS handshake
/// is done. Handshakes run in their own tasks, so a slow or failing client does not
/// hold up the others; dropping the listener (at stop) aborts those in progress.
struct TlsListener {
    tcp: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    /// Each ends with the connection, or `None` if the handshake failed.
    handshakes: JoinSet<Option<(TlsStream, SocketAddr)>>,
}

type TlsStream = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            tokio::select! {
                conn = self.tcp.accept() => match conn {
                    Ok((tcp, peer)) => {
                        let acceptor = self.acceptor.clone();
                        self.handshakes.spawn(async move {
                            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                                Ok(Ok(tls)) => Some((tls, peer)),
                                Ok(Err(e)) => {
                                    tracing::debug!(%peer, error = %e, "fakeapi: TLS handshake failed");
                                    None
                                }
                                Err(_) => {
                                    tracing::debug!(%peer, "fakeapi: TLS handshake timed out");
                                    None
                                }
                            }
                        });
                    }
                    Err(e) => {
                        // As axum does for plain TCP: a per-connection error needs
                        // nothing; others (EMFILE) get a pause before accepting again.
                        if !matches!(
                            e.kind(),
                            io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
                        ) {
                            tracing::warn!(error = %e, "fakeapi: accept failed");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                },
                Some(done) = self.handshakes.join_next(), if !self.handshakes.is_empty() => {
                    if let Ok(Some(conn)) = done {
                        return conn;
                    }
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
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
    r.fallback(
        |State(app): State<App>, headers: HeaderMap, uri: Uri| async move {
            if let Some(denied) = unauthorized(&app.shared, bearer_token(&headers).as_deref()) {
                return denied;
            }
            status_response(
                404,
                "NotFound",
                format!(
                    "the server could not find the requested resource ({})",
                    uri.path()
                ),
            )
        },
    )
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

/// kube-apiserver's answer to a request that fails authentication, if `token` does
/// not match the required one.
fn unauthorized(shared: &Shared, token: Option<&str>) -> Option<Response> {
    let required = shared.required_token.as_deref()?;
    (token != Some(required)).then(|| status_response(401, "Unauthorized", "Unauthorized"))
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
            bearer_token: bearer_token.clone(),
        });
        while rq.log.len() > REQUEST_LOG_LIMIT {
            rq.log.pop_front();
        }
    }
    tracing::debug!(path = uri.path(), query, ?verb, "fakeapi request");
    // Authentication comes first, as on kube-apiserver.
    if let Some(denied) = unauthorized(&app.shared, bearer_token.as_deref()) {
        return denied;
    }

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

    // ---- HTTPS mode ------------------------------------------------------------

    /// A kube client built as the agent builds it in a pod: server = the `--master`
    /// URL, certificate authority = the mounted `ca.crt`, token file = the mounted
    /// `token` (none when `token_file` is false); `tls_server_name` overrides the
    /// name the certificate is checked against.
    async fn pod_client(
        url: &str,
        sa_dir: &Path,
        token_file: bool,
        tls_server_name: Option<&str>,
    ) -> kube::Client {
        use kube::config::{
            AuthInfo, Cluster, Context, Kubeconfig, NamedAuthInfo, NamedCluster, NamedContext,
        };
        let path = |f: &str| sa_dir.join(f).display().to_string();
        let kubeconfig = Kubeconfig {
            clusters: vec![NamedCluster {
                name: "in-cluster".into(),
                cluster: Some(Cluster {
                    server: Some(url.into()),
                    certificate_authority: Some(path("ca.crt")),
                    tls_server_name: tls_server_name.map(Into::into),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            auth_infos: vec![NamedAuthInfo {
                name: "sa".into(),
                auth_info: Some(AuthInfo {
                    token_file: token_file.then(|| path("token")),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            contexts: vec![NamedContext {
                name: "in-cluster".into(),
                context: Some(Context {
                    cluster: "in-cluster".into(),
                    user: Some("sa".into()),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            current_context: Some("in-cluster".into()),
            ..Default::default()
        };
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .unwrap();
        kube::Client::try_from(config).unwrap()
    }

    async fn tls_server(opts: TlsOptions) -> (FakeApiServer, tempfile::TempDir) {
        let server = FakeApiServer::start_tls(local(), opts).await.unwrap();
        let sa = tempfile::tempdir().unwrap();
        server.write_service_account_dir(sa.path()).unwrap();
        (server, sa)
    }

    async fn list_services(client: kube::Client) -> kube::Result<Vec<String>> {
        let list = Api::<Service>::all(client)
            .list(&ListParams::default())
            .await?;
        Ok(list.items.iter().map(name_of).collect())
    }

    /// Asserts that a request failed before any HTTP exchange (the TLS handshake).
    fn assert_tls_failure(res: kube::Result<Vec<String>>, want: &str) {
        let err = res.expect_err("the TLS handshake should fail");
        assert!(!matches!(err, kube::Error::Api(_)), "{err:?}");
        let text = format!("{err:?}");
        assert!(text.contains(want), "{want:?} not in {text}");
    }

    #[tokio::test]
    async fn tls_pod_client_lists_and_watches() {
        let (server, sa) = tls_server(TlsOptions::default()).await;
        assert!(server.is_tls());
        assert!(
            server.url().starts_with("https://127.0.0.1:"),
            "{}",
            server.url()
        );
        let read = |f: &str| std::fs::read_to_string(sa.path().join(f)).unwrap();
        assert_eq!(read("token"), DEFAULT_TOKEN);
        assert_eq!(server.token(), DEFAULT_TOKEN);
        assert_eq!(read("namespace"), SERVICE_ACCOUNT_NAMESPACE);
        assert_eq!(Some(read("ca.crt").as_str()), server.ca_pem());
        assert!(read("ca.crt").starts_with("-----BEGIN CERTIFICATE-----\n"));

        server.apply_service(svc("default", "a", 80));
        let client = pod_client(&server.url(), sa.path(), true, None).await;
        assert_eq!(list_services(client.clone()).await.unwrap(), ["a"]);
        let api: Api<Service> = Api::all(client);
        let mut w = watcher(api, watcher::Config::default()).boxed();
        assert_eq!(
            until(&mut w, "InitDone").await,
            ["Init", "InitApply(a)", "InitDone"]
        );
        watching(&server, &mut w, 1).await;
        server.apply_service(svc("default", "b", 80));
        assert_eq!(next(&mut w).await, "Apply(b)");

        let log = server.request_log();
        assert!(log.iter().any(|r| r.verb == Verb::Watch), "{log:?}");
        assert!(
            log.iter()
                .all(|r| r.bearer_token.as_deref() == Some(DEFAULT_TOKEN)),
            "{log:?}"
        );
    }

    #[tokio::test]
    async fn tls_kubeconfig_embeds_ca_and_token() {
        let opts = TlsOptions {
            token: "t0ken-from-options".into(),
            ..Default::default()
        };
        let (server, _sa) = tls_server(opts).await;
        server.apply_service(svc("default", "a", 80));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        server.write_kubeconfig(&path).unwrap();
        let yaml = std::fs::read_to_string(&path).unwrap();
        for want in [
            "server: https://127.0.0.1:",
            "certificate-authority-data: ",
            "token: t0ken-from-options",
        ] {
            assert!(yaml.contains(want), "{want:?} not in\n{yaml}");
        }
        let kc = kube::config::Kubeconfig::read_from(&path).unwrap();
        let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .unwrap();
        let from_file = kube::Client::try_from(config).unwrap();
        assert_eq!(list_services(from_file).await.unwrap(), ["a"]);
        assert_eq!(
            list_services(server.client().unwrap()).await.unwrap(),
            ["a"]
        );
        let tokens: Vec<_> = server
            .request_log()
            .into_iter()
            .map(|r| r.bearer_token)
            .collect();
        let tokens: Vec<_> = tokens.iter().map(Option::as_deref).collect();
        assert_eq!(tokens, [Some("t0ken-from-options"); 2]);
    }

    #[tokio::test]
    async fn tls_requires_the_token() {
        let (server, sa) = tls_server(TlsOptions::default()).await;
        let unauthorized = |res: kube::Result<Vec<String>>| match res {
            Err(kube::Error::Api(s)) => {
                assert_eq!(
                    (s.code, s.reason.as_str(), s.message.as_str()),
                    (401, "Unauthorized", "Unauthorized")
                );
            }
            other => panic!("expected 401, got {other:?}"),
        };
        let no_token = pod_client(&server.url(), sa.path(), false, None).await;
        unauthorized(list_services(no_token.clone()).await);

        let wrong = tempfile::tempdir().unwrap();
        std::fs::copy(sa.path().join("ca.crt"), wrong.path().join("ca.crt")).unwrap();
        std::fs::write(wrong.path().join("token"), "not-the-token").unwrap();
        let wrong_token = pod_client(&server.url(), wrong.path(), true, None).await;
        unauthorized(list_services(wrong_token).await);

        // Authentication comes before routing: an unknown path is 401, not 404.
        let unknown = || {
            axum::http::Request::get("/apis/example.com/v1/widgets")
                .body(Vec::new())
                .unwrap()
        };
        let err = no_token.request_text(unknown()).await.unwrap_err();
        assert!(
            matches!(err, kube::Error::Api(ref s) if s.code == 401),
            "{err:?}"
        );
        let err = server
            .client()
            .unwrap()
            .request_text(unknown())
            .await
            .unwrap_err();
        assert!(
            matches!(err, kube::Error::Api(ref s) if s.code == 404),
            "{err:?}"
        );

        let tokens: Vec<_> = server
            .request_log()
            .into_iter()
            .map(|r| r.bearer_token)
            .collect();
        assert_eq!(tokens, [None, Some("not-the-token".to_owned())]);
        assert_eq!(server.request_count("/api/v1/services", Verb::List), 2);

        // With `require_token` off the token is only recorded.
        let (open, open_sa) = tls_server(TlsOptions {
            require_token: false,
            ..Default::default()
        })
        .await;
        let anonymous = pod_client(&open.url(), open_sa.path(), false, None).await;
        assert!(list_services(anonymous).await.unwrap().is_empty());
        assert_eq!(open.request_log()[0].bearer_token, None);
    }

    #[tokio::test]
    async fn tls_client_without_the_ca_fails_the_handshake() {
        let (server, _sa) = tls_server(TlsOptions::default()).await;
        let (_other, other_sa) = tls_server(TlsOptions::default()).await;
        // The right token, but another server's CA.
        let client = pod_client(&server.url(), other_sa.path(), true, None).await;
        assert_tls_failure(list_services(client).await, "UnknownIssuer");
        assert!(server.request_log().is_empty());
    }

    #[tokio::test]
    async fn tls_certificate_names() {
        let opts = TlsOptions {
            san_ips: vec!["10.96.0.1".parse().unwrap()],
            san_names: vec!["apiserver.lab.test".into()],
            ..Default::default()
        };
        let (server, sa) = tls_server(opts).await;
        let url = server.url();
        for name in [
            "10.96.0.1",
            "apiserver.lab.test",
            "localhost",
            "kubernetes.default.svc",
        ] {
            let client = pod_client(&url, sa.path(), true, Some(name)).await;
            assert!(list_services(client).await.is_ok(), "{name}");
        }
        let by_name = format!("https://localhost:{}", server.addr().port());
        let client = pod_client(&by_name, sa.path(), true, None).await;
        assert!(list_services(client).await.is_ok());
        for name in ["10.96.0.2", "other.lab.test"] {
            let client = pod_client(&url, sa.path(), true, Some(name)).await;
            assert_tls_failure(list_services(client).await, "NotValidForName");
        }

        let bad = TlsOptions {
            san_names: vec!["bäd.example".into()],
            ..Default::default()
        };
        assert!(FakeApiServer::start_tls(local(), bad).await.is_err());
        let plain = FakeApiServer::start(local()).await.unwrap();
        assert!(plain.ca_pem().is_none());
        assert_eq!(plain.token(), PLAIN_TOKEN);
        assert!(plain.write_service_account_dir(sa.path()).is_err());
    }

    #[tokio::test]
    async fn tls_restart_keeps_the_ca() {
        let mut server = FakeApiServer::start_tls(local(), TlsOptions::default())
            .await
            .unwrap();
        let (addr, ca) = (server.addr(), server.ca_pem().unwrap().to_owned());
        let sa = tempfile::tempdir().unwrap();
        server.write_service_account_dir(sa.path()).unwrap();
        server.apply_service(svc("default", "a", 80));
        let client = pod_client(&server.url(), sa.path(), true, None).await;
        let mut w = watcher(
            Api::<Service>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .boxed();
        until(&mut w, "InitDone").await;
        watching(&server, &mut w, 1).await;

        server.stop().await;
        assert!(list_services(client.clone()).await.is_err());
        server.apply_service(svc("default", "b", 80));
        server.restart().await.unwrap();
        assert_eq!((server.addr(), server.ca_pem()), (addr, Some(ca.as_str())));
        // The client read ca.crt before the restart.
        let seen = until(&mut w, "Apply(b)").await;
        assert!(!seen.contains(&"Init".to_owned()), "relisted: {seen:?}");
        assert_eq!(list_services(client).await.unwrap(), ["a", "b"]);
    }

    #[tokio::test]
    async fn start_tls_binds_before_it_is_awaited() {
        let addr = std::net::TcpListener::bind(local())
            .unwrap()
            .local_addr()
            .unwrap();
        let starting = FakeApiServer::start_tls(addr, TlsOptions::default());
        // Not yet polled: the kernel already completes TCP connections.
        std::net::TcpStream::connect(addr).unwrap();
        let server = starting.await.unwrap();
        assert_eq!(server.addr(), addr);
        assert!(list_services(server.client().unwrap()).await.is_ok());
    }

    #[tokio::test]
    async fn start_tls_on_a_bound_listener() {
        let listener = std::net::TcpListener::bind(local()).unwrap();
        let addr = listener.local_addr().unwrap();
        let mut server = FakeApiServer::start_tls_on(listener, TlsOptions::default())
            .await
            .unwrap();
        assert_eq!(server.url(), format!("https://{addr}"));
        let client = server.client().unwrap();
        assert!(list_services(client.clone()).await.is_ok());
        server.restart().await.unwrap();
        assert_eq!(server.addr(), addr);
        assert!(list_services(client).await.is_ok());
    }

    /// Brings `lo` up in the calling thread's network namespace.
    fn loopback_up() -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None)?;
        // SAFETY: a zeroed ifreq is valid; the ioctls read and write only that struct.
        unsafe {
            let mut ifr: libc::ifreq = std::mem::zeroed();
            for (d, s) in ifr.ifr_name.iter_mut().zip(b"lo\0") {
                *d = *s as libc::c_char;
            }
            if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS as _, &mut ifr) < 0 {
                return Err(io::Error::last_os_error());
            }
            ifr.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS as _, &ifr) < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }

    /// Whether a TCP connection to `addr` succeeds from inside `ns`.
    fn connects_in(ns: &File, addr: SocketAddr) -> bool {
        use std::os::fd::AsRawFd;
        std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: an open namespace file; only this scoped thread moves.
                assert_eq!(
                    unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) },
                    0
                );
                std::net::TcpStream::connect(addr).is_ok()
            })
            .join()
            .unwrap()
        })
    }

    /// The netns use: a listener bound inside a network namespace, the server started
    /// from outside it, and a restart from outside binding inside again. Needs root
    /// (skipped otherwise).
    #[tokio::test]
    async fn restart_binds_in_the_listeners_network_namespace() {
        let lab = std::thread::spawn(|| {
            // SAFETY: moves only this thread, which ends right after.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                return None;
            }
            loopback_up().unwrap();
            let ns = File::open("/proc/thread-self/ns/net").unwrap();
            Some((ns, std::net::TcpListener::bind(local()).unwrap()))
        })
        .join()
        .unwrap();
        let Some((ns, listener)) = lab else {
            eprintln!("skipped: no permission to create a network namespace");
            return;
        };
        let mut server = FakeApiServer::start_tls_on(listener, TlsOptions::default())
            .await
            .unwrap();
        let addr = server.addr();
        assert!(connects_in(&ns, addr));
        assert!(std::net::TcpStream::connect(addr).is_err());
        server.restart().await.unwrap();
        assert!(connects_in(&ns, addr));
        assert!(std::net::TcpStream::connect(addr).is_err());
    }
}
