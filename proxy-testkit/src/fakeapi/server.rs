//! [`FakeApiServer`]: starting (plain HTTP or HTTPS), stopping and restarting the
//! server, and the test controls that change its state.

use std::collections::BTreeMap;
use std::fs::File;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use super::http::router;
use super::store::{Shared, lock};
use super::tls::{Tls, TlsListener, bind, bind_in, netns_of, spawn_server};
use super::{
    PLAIN_TOKEN, RecordedRequest, ResourceKind, SERVICE_ACCOUNT_NAMESPACE, STOP_GRACE, TlsOptions,
    Verb,
};

/// A running (or stopped) fake API server. See the [module docs](super).
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
pub(super) struct App {
    pub(super) shared: Arc<Shared>,
    pub(super) shutdown: watch::Receiver<bool>,
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
    /// [module docs](super)) on `addr` (`127.0.0.1:0` for a free port), on the tokio
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
