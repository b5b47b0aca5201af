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

use std::net::IpAddr;
use std::time::Duration;

mod http;
mod listwatch;
mod selector;
mod server;
mod store;
#[cfg(test)]
mod tests;
mod tls;

pub use server::FakeApiServer;

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
