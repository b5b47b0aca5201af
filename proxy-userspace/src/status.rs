//! The agent's own status server (`--status-bind-address`, 127.0.0.1:10266 by default) and
//! the `ebpf-proxy status` command that reads it.
//!
//! kube-proxy's health port (10256) and metrics port (10249) are also kube-proxy's while the
//! two run side by side during a switch: a probe or a check sent there may be answered by
//! kube-proxy. The status server listens on a port kube-proxy never binds, so what it says
//! comes from this agent:
//!
//! - `/readyz`: 200 once the first sync is done, no update has been pending for longer than
//!   twice `--sync-period`, and every other server of the agent (health, metrics) is
//!   listening; 503 otherwise, with the reasons. The DaemonSet's readiness probe, so a pod
//!   whose health port is held by another process (kube-proxy) is not Ready, and a Ready pod
//!   has programmed its data path.
//! - `/livez`: 200 once the first sync is done and no update has been pending for too long
//!   (kube-proxy's `/livez` condition; the liveness and startup probes). A busy port does not
//!   fail it: restarting the agent would not free the port.
//! - `/status`: the whole [`Status`] as JSON, always 200.
//!
//! Every answer's body is the [`Status`] document.
//!
//! The state the agent's servers share is defined here too, so the servers read it and
//! publish into it without this module depending on them: the sync health (`Health`, which
//! the health server (`servers`) renders for `/healthz` and `/livez`) and each server's
//! state (`ServerState`).

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, Result, bail};
use axum::{Json, extract::State, http::StatusCode, response::IntoResponse};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::model::Family;

/// The status server's default port: not one of the ports Kubernetes components use
/// (10248-10259), so kube-proxy, the kubelet and the control plane never hold it.
pub(crate) const DEFAULT_STATUS_PORT: u16 = 10266;

/// The agent's sync health: what `/healthz` and `/livez` report (the health server renders
/// it, `servers`) and what `/readyz` and `/livez` here read. The agent updates it after
/// every sync.
#[derive(Debug, Clone)]
pub(crate) struct Health {
    /// Time of the last successful sync; `None` until the first one.
    pub(crate) last_updated: Option<SystemTime>,
    /// When the oldest update not yet applied arrived; `None` when none is pending.
    pub(crate) queued: Option<SystemTime>,
    /// How long an update may stay pending before the agent is unhealthy.
    pub(crate) timeout: Duration,
    /// This node is neither being deleted nor tainted for deletion.
    pub(crate) node_eligible: bool,
    /// The IP families the node runs (one `status` entry each).
    pub(crate) families: Vec<Family>,
}

impl Health {
    /// Nothing synced yet, node eligible.
    pub(crate) fn new(timeout: Duration, families: Vec<Family>) -> Health {
        Health {
            last_updated: None,
            queued: None,
            timeout,
            node_eligible: true,
            families,
        }
    }

    /// Healthy at `now` (the `/livez` condition; `/healthz` adds eligibility)?
    pub(crate) fn healthy(&self, now: SystemTime) -> bool {
        self.last_updated.is_some()
            && self
                .queued
                .is_none_or(|q| now.duration_since(q).unwrap_or_default() < self.timeout)
    }
}

/// Where one of the agent's servers stands, as the server task (`servers::spawn`) publishes
/// it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ServerState {
    /// Not tried yet.
    Starting,
    /// Serving on this address.
    Listening(SocketAddr),
    /// The last attempt failed with this error; retried every `servers::BIND_RETRY`.
    Failing(String),
}

/// The north-south path (NodePorts, external IPs and LB IPs for traffic entering the node)
/// as the last sync left it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NorthSouth {
    /// External interfaces with the tcx programs attached, sorted.
    pub(crate) interfaces: Vec<String>,
    /// Pod-facing interfaces with the programs attached (SNAT of local flows), sorted.
    pub(crate) pod_interfaces: Vec<String>,
    /// Failures of the interfaces step (each names the interface and the cause, e.g. "tcx
    /// needs Linux >= 6.6"), until a pass works.
    pub(crate) errors: Vec<String>,
}

impl NorthSouth {
    /// Why the north-south path does not serve this node (`None` when it does).
    pub(crate) fn problem(&self) -> Option<String> {
        if !self.errors.is_empty() {
            return Some(self.errors.join("; "));
        }
        if self.interfaces.is_empty() {
            return Some(
                "no external interface: none of the interfaces of the agent's network namespace carries one of this node's addresses (its Node's InternalIP/ExternalIP), and --interfaces names none"
                    .into(),
            );
        }
        None
    }
}

/// One of the agent's servers, as `/status` reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ServerStatus {
    /// `health`, `metrics` or `status`.
    pub(crate) name: String,
    /// The configured address (`--healthz-bind-address` and so on).
    pub(crate) address: String,
    /// `starting`, `listening` or `failing`.
    pub(crate) state: String,
    /// The last bind or serve error while `failing`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) error: Option<String>,
}

/// What `/status` answers (and the body of `/readyz` and `/livez`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    /// The node's name as the agent uses it.
    pub(crate) node: String,
    /// The agent's version.
    pub(crate) version: String,
    /// The first sync is done: the data path holds every Service the source listed.
    pub(crate) synced: bool,
    /// Time of the last successful sync (RFC 3339), if any.
    #[serde(default)]
    pub(crate) last_synced: Option<String>,
    /// `/livez`'s condition: synced, and no update pending for longer than twice
    /// `--sync-period`.
    pub(crate) healthy: bool,
    /// `/readyz`'s condition: healthy and every other server listening.
    pub(crate) ready: bool,
    /// Why the agent is not ready (empty when it is), one line each.
    pub(crate) not_ready: Vec<String>,
    /// The agent's servers.
    pub(crate) servers: Vec<ServerStatus>,
    /// The north-south path.
    pub(crate) north_south: NorthSouth,
}

/// A server of the agent whose state the status reports.
#[derive(Clone, Debug)]
pub(crate) struct Listener {
    /// `health` or `metrics`.
    pub(crate) name: &'static str,
    /// The configured address.
    pub(crate) address: SocketAddr,
    /// Its state, as the server task (`servers::spawn`) publishes it.
    pub(crate) state: watch::Receiver<ServerState>,
}

/// What the status server reads: shared with the agent, which updates `health` and
/// `north_south` after every sync.
#[derive(Clone)]
pub(crate) struct StatusSources {
    /// The node's name.
    pub(crate) node: String,
    /// Sync state, as `/healthz` and `/livez` report it.
    pub(crate) health: Arc<Mutex<Health>>,
    /// The north-south path after the last sync.
    pub(crate) north_south: Arc<Mutex<NorthSouth>>,
    /// The other servers (health, metrics) that must listen for the agent to be ready.
    pub(crate) listeners: Vec<Listener>,
}

/// A hint added to a bind error: what usually holds the port.
fn bind_hint(name: &str, error: &str) -> &'static str {
    if !error.contains("in use") {
        return "";
    }
    match name {
        "health" => {
            " (another process holds the port: kube-proxy's health server, while both run on the node)"
        }
        "metrics" => {
            " (another process holds the port: kube-proxy's metrics server, while both run on the node)"
        }
        _ => " (another process holds the port)",
    }
}

impl StatusSources {
    /// The status at `now`.
    pub(crate) fn status(&self, now: SystemTime) -> Status {
        let (synced, last_synced, healthy, pending_too_long) = {
            let h = self.health.lock().unwrap();
            let healthy = h.healthy(now);
            (
                h.last_updated.is_some(),
                h.last_updated
                    .map(|t| humantime::format_rfc3339_millis(t).to_string()),
                healthy,
                h.last_updated.is_some() && !healthy,
            )
        };
        let mut not_ready = Vec::new();
        if !synced {
            not_ready.push(
                "the first sync is not done yet (it waits for the initial lists of Services and EndpointSlices: the agent's log says what fails)"
                    .to_string(),
            );
        } else if pending_too_long {
            not_ready.push(
                "an update has been pending for longer than twice --sync-period (see the agent's log and `kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds`)"
                    .to_string(),
            );
        }
        let servers: Vec<ServerStatus> = self
            .listeners
            .iter()
            .map(|l| {
                let (state, error) = match &*l.state.borrow() {
                    ServerState::Starting => ("starting", None),
                    ServerState::Listening(_) => ("listening", None),
                    ServerState::Failing(e) => ("failing", Some(e.clone())),
                };
                match (state, &error) {
                    ("listening", _) => {}
                    (_, Some(e)) => not_ready.push(format!(
                        "{} server on {}: {e}{}",
                        l.name,
                        l.address,
                        bind_hint(l.name, e)
                    )),
                    _ => not_ready.push(format!(
                        "{} server on {}: not listening yet",
                        l.name, l.address
                    )),
                }
                ServerStatus {
                    name: l.name.to_string(),
                    address: l.address.to_string(),
                    state: state.to_string(),
                    error,
                }
            })
            .collect();
        Status {
            node: self.node.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            synced,
            last_synced,
            healthy,
            ready: not_ready.is_empty(),
            not_ready,
            servers,
            north_south: self.north_south.lock().unwrap().clone(),
        }
    }
}

async fn readyz(State(s): State<StatusSources>) -> impl IntoResponse {
    let status = s.status(SystemTime::now());
    let code = if status.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(status))
}

async fn livez(State(s): State<StatusSources>) -> impl IntoResponse {
    let status = s.status(SystemTime::now());
    let code = if status.healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(status))
}

async fn full(State(s): State<StatusSources>) -> impl IntoResponse {
    Json(s.status(SystemTime::now()))
}

/// The status server's routes.
pub(crate) fn app(sources: StatusSources) -> axum::Router {
    axum::Router::new()
        .route("/readyz", axum::routing::get(readyz))
        .route("/livez", axum::routing::get(livez))
        .route("/status", axum::routing::get(full))
        .with_state(sources)
}

/// A condition `ebpf-proxy status --require` waits for.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Requirement {
    /// The first sync is done (the data path serves every Service), and no update is
    /// pending for too long.
    Synced,
    /// `/readyz`: synced, and the health and metrics servers listen (no other process holds
    /// their ports).
    Ready,
    /// The north-south programs serve this node's external interfaces: NodePorts, external
    /// IPs and LB IPs keep working for traffic entering the node once kube-proxy's rules are
    /// gone (tcx, Linux >= 6.6).
    NorthSouth,
}

impl Requirement {
    /// Why `status` does not meet this requirement (`None` when it does).
    pub(crate) fn unmet(self, status: &Status) -> Option<String> {
        match self {
            Requirement::Synced if !status.healthy => Some(if status.synced {
                "synced: an update has been pending for longer than twice --sync-period".into()
            } else {
                "synced: the first sync is not done yet".into()
            }),
            Requirement::Ready if !status.ready => {
                Some(format!("ready: {}", status.not_ready.join("; ")))
            }
            Requirement::NorthSouth if !status.synced => Some(
                "north-south: not known before the first sync (the agent learns this node's addresses from its Node object)".into(),
            ),
            Requirement::NorthSouth => status.north_south.problem().map(|p| {
                format!(
                    "north-south: {p}; without it NodePorts, external IPs and LB IPs stop working for traffic entering this node once kube-proxy's rules are removed: keep kube-proxy on this node"
                )
            }),
            _ => None,
        }
    }
}

/// Fetches `/status` from the agent's status server at `addr`, within `timeout`.
///
/// Errors: nothing listens there (the agent is not running, or runs with another
/// `--status-bind-address`), or the answer is not a status document.
pub(crate) fn fetch(addr: SocketAddr, timeout: Duration) -> Result<Status> {
    let mut s = TcpStream::connect_timeout(&addr, timeout).with_context(|| {
        format!(
            "no ebpf-proxy agent answers on {addr} (is it running on this node, with --status-bind-address {addr}?)"
        )
    })?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(format!("GET /status HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)
        .with_context(|| format!("read the answer of {addr}"))?;
    let text = String::from_utf8_lossy(&out);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("{addr}: not an HTTP answer"))?;
    if !head.starts_with("HTTP/1.") || head.get(9..12) != Some("200") {
        bail!(
            "{addr}/status answered {:?}: not an ebpf-proxy status server",
            head.lines().next().unwrap_or("")
        );
    }
    serde_json::from_str(body)
        .with_context(|| format!("{addr}/status: not an ebpf-proxy status document"))
}

/// The requirements `status` does not meet, one line each.
pub(crate) fn unmet(status: &Status, require: &[Requirement]) -> Vec<String> {
    require.iter().filter_map(|r| r.unmet(status)).collect()
}

/// Polls the agent at `addr` every `interval` until `require` is met or `wait` has passed
/// (`wait` zero: one look). Returns the last status read and what it does not meet (empty:
/// met).
///
/// Errors: the agent could not be read at the end of the wait.
pub fn wait_for(
    addr: SocketAddr,
    require: &[Requirement],
    wait: Duration,
    interval: Duration,
) -> Result<(Status, Vec<String>)> {
    let deadline = Instant::now() + wait;
    loop {
        let attempt = fetch(addr, Duration::from_secs(5));
        let done = Instant::now() >= deadline;
        match attempt {
            Ok(status) => {
                let missing = unmet(&status, require);
                if missing.is_empty() || done {
                    return Ok((status, missing));
                }
            }
            Err(e) if done => return Err(e),
            Err(_) => {}
        }
        std::thread::sleep(interval.min(deadline.saturating_duration_since(Instant::now())));
    }
}

/// The status as aligned text lines.
pub fn table(status: &Status) -> String {
    let mut out = String::new();
    let yes = |b: bool| if b { "yes" } else { "no" };
    out.push_str(&format!("node          {}\n", status.node));
    out.push_str(&format!("version       {}\n", status.version));
    out.push_str(&format!(
        "synced        {}{}\n",
        yes(status.synced),
        status
            .last_synced
            .as_deref()
            .map(|t| format!(" (last sync {t})"))
            .unwrap_or_default()
    ));
    out.push_str(&format!("healthy       {}\n", yes(status.healthy)));
    out.push_str(&format!("ready         {}\n", yes(status.ready)));
    for r in &status.not_ready {
        out.push_str(&format!("  not ready:  {r}\n"));
    }
    for s in &status.servers {
        out.push_str(&format!(
            "server        {} {} {}{}\n",
            s.name,
            s.address,
            s.state,
            s.error
                .as_deref()
                .map(|e| format!(": {e}"))
                .unwrap_or_default()
        ));
    }
    let ns = &status.north_south;
    match ns.problem() {
        _ if !status.synced => out.push_str("north-south   not known before the first sync\n"),
        None => out.push_str(&format!(
            "north-south   serving on {}\n",
            ns.interfaces.join(", ")
        )),
        Some(p) => out.push_str(&format!("north-south   not serving: {p}\n")),
    }
    if !ns.pod_interfaces.is_empty() {
        out.push_str(&format!("pod-facing    {}\n", ns.pod_interfaces.join(", ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Family;

    fn sources() -> (StatusSources, watch::Sender<ServerState>) {
        let (tx, rx) = watch::channel(ServerState::Starting);
        let s = StatusSources {
            node: "node-a".into(),
            health: Arc::new(Mutex::new(Health::new(
                Duration::from_secs(60),
                vec![Family::V4],
            ))),
            north_south: Arc::new(Mutex::new(NorthSouth::default())),
            listeners: vec![Listener {
                name: "health",
                address: "0.0.0.0:10256".parse().unwrap(),
                state: rx,
            }],
        };
        (s, tx)
    }

    #[test]
    fn ready_needs_the_first_sync_and_every_server_listening() {
        let (s, tx) = sources();
        let now = SystemTime::now();
        let st = s.status(now);
        assert!(!st.synced && !st.healthy && !st.ready);
        assert!(st.not_ready[0].starts_with("the first sync is not done yet"));
        assert_eq!(
            st.not_ready[1],
            "health server on 0.0.0.0:10256: not listening yet"
        );
        assert!(
            Requirement::NorthSouth
                .unmet(&st)
                .unwrap()
                .contains("not known before the first sync")
        );
        s.health.lock().unwrap().last_updated = Some(now);
        tx.send_replace(ServerState::Failing("Address in use (os error 98)".into()));
        let st = s.status(now);
        assert!(st.synced && st.healthy && !st.ready);
        assert_eq!(
            st.not_ready,
            [
                "health server on 0.0.0.0:10256: Address in use (os error 98) (another process holds the port: kube-proxy's health server, while both run on the node)"
            ]
        );
        assert_eq!(st.servers[0].state, "failing");
        assert_eq!(
            Requirement::Synced.unmet(&st),
            None,
            "synced does not need the port"
        );
        assert!(
            Requirement::Ready
                .unmet(&st)
                .unwrap()
                .contains("kube-proxy")
        );
        tx.send_replace(ServerState::Listening("0.0.0.0:10256".parse().unwrap()));
        let st = s.status(now);
        assert!(st.ready, "{:?}", st.not_ready);
        assert!(st.not_ready.is_empty());
        // An update pending too long: neither healthy nor ready.
        s.health.lock().unwrap().queued = Some(now - Duration::from_secs(61));
        let st = s.status(now);
        assert!(st.synced && !st.healthy && !st.ready);
        assert!(Requirement::Synced.unmet(&st).unwrap().contains("pending"));
    }

    #[test]
    fn north_south_requirement_names_what_is_missing() {
        let (s, _tx) = sources();
        s.health.lock().unwrap().last_updated = Some(SystemTime::now());
        let st = s.status(SystemTime::now());
        let why = Requirement::NorthSouth.unmet(&st).unwrap();
        assert!(why.contains("no external interface"), "{why}");
        assert!(why.contains("keep kube-proxy"), "{why}");
        *s.north_south.lock().unwrap() = NorthSouth {
            interfaces: vec![],
            pod_interfaces: vec![],
            errors: vec!["tc: interfaces: eth0: attach tc_ingress: Invalid argument (tcx needs Linux >= 6.6)".into()],
        };
        let why = Requirement::NorthSouth
            .unmet(&s.status(SystemTime::now()))
            .unwrap();
        assert!(why.contains("tcx needs Linux >= 6.6"), "{why}");
        *s.north_south.lock().unwrap() = NorthSouth {
            interfaces: vec!["eth0".into()],
            ..Default::default()
        };
        let st = s.status(SystemTime::now());
        assert_eq!(
            unmet(&st, &[Requirement::Synced, Requirement::NorthSouth]),
            Vec::<String>::new()
        );
        assert!(table(&st).contains("north-south   serving on eth0"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_server_answers_and_the_client_reads_it() {
        let (s, tx) = sources();
        let mut rx = crate::servers::spawn(
            "status",
            "127.0.0.1:0".parse().unwrap(),
            app(s.clone()),
            Duration::from_millis(50),
            None,
        );
        let addr = loop {
            if let ServerState::Listening(a) = rx.borrow_and_update().clone() {
                break a;
            }
            rx.changed().await.unwrap();
        };
        let get = move |path: &'static str| {
            tokio::task::spawn_blocking(move || {
                let mut c = TcpStream::connect(addr).unwrap();
                c.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
                    .unwrap();
                let mut out = String::new();
                c.read_to_string(&mut out).unwrap();
                out[9..12].parse::<u16>().unwrap()
            })
        };
        assert_eq!(get("/readyz").await.unwrap(), 503);
        assert_eq!(get("/livez").await.unwrap(), 503);
        assert_eq!(get("/status").await.unwrap(), 200);
        s.health.lock().unwrap().last_updated = Some(SystemTime::now());
        tx.send_replace(ServerState::Listening("0.0.0.0:10256".parse().unwrap()));
        assert_eq!(get("/readyz").await.unwrap(), 200);
        assert_eq!(get("/livez").await.unwrap(), 200);
        let read = tokio::task::spawn_blocking(move || {
            wait_for(
                addr,
                &[Requirement::Ready],
                Duration::from_secs(2),
                Duration::from_millis(50),
            )
        })
        .await
        .unwrap()
        .unwrap();
        assert!(read.1.is_empty());
        assert_eq!(read.0.node, "node-a");
        // Nothing listening: an error naming the address and the flag.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let gone = closed.local_addr().unwrap();
        drop(closed);
        let err = fetch(gone, Duration::from_secs(1)).unwrap_err();
        assert!(
            format!("{err:#}").contains("--status-bind-address"),
            "{err:#}"
        );
    }
}
