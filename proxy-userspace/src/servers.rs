//! The agent's HTTP servers: health (`/healthz`, `/livez`, as kube-proxy's
//! `pkg/proxy/healthcheck/proxy_health.go`) and metrics (`/metrics`).
//!
//! Each server binds its address in the background and keeps trying, every
//! [`BIND_RETRY`], while the data path runs, as kube-proxy's `serveHealthz` and
//! `serveMetrics` (`wait.Until(…, 5*time.Second)`): a busy port never stops the agent. The
//! log has one error line when a server starts failing and one info line when it listens
//! (again), not one per attempt. With `--bind-address-hard-fail` the first failure stops
//! the agent instead ([`Fatal`]).
//!
//! Health, as kube-proxy reports it:
//! - healthy once the first sync is done, unless an update (or a failed Service port) has
//!   been pending for longer than twice `--sync-period`; `/livez` answers by this alone
//!   (kube-proxy answers healthy before its first sync; ebpf-proxy waits for the data path
//!   to be programmed, so a load balancer never sends traffic to a node that cannot serve
//!   it yet);
//! - `/healthz` also requires the node to be eligible (not being deleted, not tainted
//!   `ToBeDeletedByClusterAutoscaler`, KEP-3836), so cloud load balancers drain a node
//!   before it goes away, and reports `nodeEligible`;
//! - body `{"lastUpdated", "currentTime", "nodeEligible" (healthz only), "healthy",
//!   "status": {"IPv4": {"lastUpdated", "healthy"}, …}}`, 200 or 503;
//!   `kubeproxy_proxy_healthz_total{code}` and `kubeproxy_proxy_livez_total{code}` count
//!   the answers.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use axum::{Json, extract::State, http::StatusCode, response::IntoResponse};
use tokio::sync::watch;
use tracing::{error, info};

use crate::{
    metrics::Metrics,
    status::{Health, ServerState},
};

/// How long a server waits before trying its address again (kube-proxy's 5 s).
pub const BIND_RETRY: Duration = Duration::from_secs(5);

/// The health server's answer for [`Health`] (kube-proxy's rules, in the module
/// documentation).
impl Health {
    /// The answer to `/healthz` (`with_node`) or `/livez` at `now`: status and body.
    pub fn answer(&self, now: SystemTime, with_node: bool) -> (StatusCode, serde_json::Value) {
        let healthy = self.healthy(now);
        let ok = healthy && (!with_node || self.node_eligible);
        let fmt = |t: SystemTime| humantime::format_rfc3339_millis(t).to_string();
        // Go's zero time, as kube-proxy writes a time never set.
        let never = "0001-01-01T00:00:00Z".to_string();
        let last = self.last_updated.map(fmt).unwrap_or(never.clone());
        let status: serde_json::Map<String, serde_json::Value> = self
            .families
            .iter()
            .map(|f| {
                (
                    f.as_str().to_string(),
                    serde_json::json!({"lastUpdated": last, "healthy": healthy}),
                )
            })
            .collect();
        let mut body = serde_json::json!({
            // kube-proxy: "recent" when healthy, the last sync otherwise.
            "lastUpdated": if ok { fmt(now) } else { last.clone() },
            "currentTime": fmt(now),
            "healthy": healthy,
            "status": status,
        });
        if with_node {
            body["nodeEligible"] = serde_json::Value::Bool(self.node_eligible);
        }
        let code = if ok {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        (code, body)
    }
}

type HealthState = (Arc<Mutex<Health>>, Arc<Metrics>);

/// The `code` label of an answer (only 200 and 503 are given).
fn code_label(code: StatusCode) -> &'static str {
    if code == StatusCode::OK { "200" } else { "503" }
}

async fn healthz(State((h, m)): State<HealthState>) -> impl IntoResponse {
    let (code, body) = h.lock().unwrap().answer(SystemTime::now(), true);
    m.kube_proxy
        .healthz
        .get_or_create(&[("code", code_label(code))])
        .inc();
    (code, Json(body))
}

async fn livez(State((h, m)): State<HealthState>) -> impl IntoResponse {
    let (code, body) = h.lock().unwrap().answer(SystemTime::now(), false);
    m.kube_proxy
        .livez
        .get_or_create(&[("code", code_label(code))])
        .inc();
    (code, Json(body))
}

async fn metrics_handler(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        m.encode(),
    )
}

/// The health server's routes.
pub fn health_app(health: Arc<Mutex<Health>>, metrics: Arc<Metrics>) -> axum::Router {
    axum::Router::new()
        .route("/healthz", axum::routing::get(healthz))
        .route("/livez", axum::routing::get(livez))
        .with_state((health, metrics))
}

/// The metrics server's routes.
pub fn metrics_app(metrics: Arc<Metrics>) -> axum::Router {
    axum::Router::new()
        .route("/metrics", axum::routing::get(metrics_handler))
        .with_state(metrics)
}

/// `--bind-address-hard-fail`: the first server failure, for the agent to stop on.
#[derive(Debug, Default)]
pub struct Fatal {
    error: Mutex<Option<String>>,
    notify: tokio::sync::Notify,
}

impl Fatal {
    /// Records the failure (the first one wins) and wakes [`Fatal::wait`].
    pub fn fail(&self, error: String) {
        self.error.lock().unwrap().get_or_insert(error);
        self.notify.notify_one();
    }

    /// Completes once a server failed.
    pub async fn wait(&self) {
        loop {
            if self.error.lock().unwrap().is_some() {
                return;
            }
            self.notify.notified().await;
        }
    }

    /// The failure, if any.
    pub fn error(&self) -> Option<String> {
        self.error.lock().unwrap().clone()
    }
}

/// Binds `addr`. An unspecified address of either family (`0.0.0.0`, `::`) means every
/// address of both: a dual-stack `[::]` socket, or `0.0.0.0` on a node without IPv6. So the
/// kubelet's probes and load balancers' checks reach the server on an IPv6-primary node too,
/// where kube-proxy's literal `0.0.0.0:10256` would not answer. A port another process holds
/// on either family is an error.
fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let l = if addr.ip().is_unspecified() {
        crate::datapath::healthcheck::listen(addr.port())?
    } else {
        let l = std::net::TcpListener::bind(addr)?;
        l.set_nonblocking(true)?;
        l
    };
    tokio::net::TcpListener::from_std(l)
}

/// Serves `app` on `addr` in the background (inside a tokio runtime), binding again every
/// `retry` while the address cannot be bound or the server stops. Logs one error line when
/// it starts failing and `"{what} server listening"` (with the address) whenever it
/// listens. With `fatal`, the first failure is recorded there and the server gives up.
/// Returns the server's state, updated on every change.
pub fn spawn(
    what: &'static str,
    addr: SocketAddr,
    app: axum::Router,
    retry: Duration,
    fatal: Option<Arc<Fatal>>,
) -> watch::Receiver<ServerState> {
    let (tx, rx) = watch::channel(ServerState::Starting);
    tokio::spawn(async move {
        loop {
            let error = match bind(addr) {
                Ok(listener) => {
                    let local = listener.local_addr().unwrap_or(addr);
                    info!(address = %local, "{what} server listening");
                    tx.send_replace(ServerState::Listening(local));
                    match axum::serve(listener, app.clone()).await {
                        Ok(()) => "the server stopped".to_string(),
                        Err(e) => e.to_string(),
                    }
                }
                Err(e) => e.to_string(),
            };
            let was_failing = matches!(*tx.borrow(), ServerState::Failing(_));
            if !was_failing {
                match &fatal {
                    Some(_) => error!(
                        address = %addr,
                        error = %error,
                        "{what} server failed; stopping (--bind-address-hard-fail)"
                    ),
                    None => error!(
                        address = %addr,
                        error = %error,
                        "{what} server failed; retrying every {}s while the data path runs",
                        retry.as_secs_f64()
                    ),
                }
            }
            tx.send_replace(ServerState::Failing(error.clone()));
            if let Some(f) = &fatal {
                f.fail(format!("{what} server on {addr}: {error}"));
                return;
            }
            tokio::time::sleep(retry).await;
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Family;

    fn families() -> Vec<Family> {
        vec![Family::V4, Family::V6]
    }

    #[test]
    fn healthz_fails_on_a_node_being_removed_and_livez_does_not() {
        let now = SystemTime::now();
        let mut h = Health::new(Duration::from_secs(60), families());
        // Before the first sync: unhealthy, lastUpdated is Go's zero time.
        let (code, body) = h.answer(now, true);
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["lastUpdated"], "0001-01-01T00:00:00Z");
        assert_eq!(body["healthy"], false);
        h.last_updated = Some(now - Duration::from_secs(100));
        let (code, body) = h.answer(now, true);
        assert_eq!(code, StatusCode::OK);
        assert_eq!(body["nodeEligible"], true);
        assert_eq!(body["healthy"], true);
        assert_eq!(body["status"]["IPv6"]["healthy"], true);
        assert_eq!(
            body["lastUpdated"], body["currentTime"],
            "healthy answers say \"recent\", as kube-proxy's"
        );
        // A node being deleted: /healthz 503 with nodeEligible false; /livez 200 without
        // the field.
        h.node_eligible = false;
        let (code, body) = h.answer(now, true);
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["nodeEligible"], false);
        assert_eq!(body["healthy"], true);
        let (code, body) = h.answer(now, false);
        assert_eq!(code, StatusCode::OK);
        assert!(body.get("nodeEligible").is_none());
        // An update pending for too long fails both.
        h.node_eligible = true;
        h.queued = Some(now - Duration::from_secs(61));
        assert_eq!(h.answer(now, true).0, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(h.answer(now, false).0, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(h.answer(now, false).1["status"]["IPv4"]["healthy"], false);
        h.queued = Some(now - Duration::from_secs(59));
        assert_eq!(h.answer(now, false).0, StatusCode::OK);
    }

    async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        let path = path.to_string();
        tokio::task::spawn_blocking(move || {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
                .unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).unwrap();
            let code = out[9..12].parse().unwrap();
            let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
            (code, body)
        })
        .await
        .unwrap()
    }

    async fn until(rx: &mut watch::Receiver<ServerState>, ok: impl Fn(&ServerState) -> bool) {
        tokio::time::timeout(Duration::from_secs(10), rx.wait_for(ok))
            .await
            .expect("state in time")
            .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_busy_port_is_retried_with_one_state_change_until_it_is_free() {
        let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = busy.local_addr().unwrap();
        let metrics = Arc::new(Metrics::new("/nonexistent".into(), families()));
        let mut rx = spawn(
            "metrics",
            addr,
            metrics_app(metrics.clone()),
            Duration::from_millis(50),
            None,
        );
        until(&mut rx, |s| matches!(s, ServerState::Failing(_))).await;
        // Several retries fail; the state (and so the log) does not change.
        let mut changes = 0;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(300);
        while let Ok(Ok(())) = tokio::time::timeout_at(deadline, rx.changed()).await {
            assert!(matches!(*rx.borrow(), ServerState::Failing(_)));
            changes += 1;
        }
        assert!(changes >= 2, "retried: {changes}");
        drop(busy);
        until(&mut rx, |s| matches!(s, ServerState::Listening(_))).await;
        let (code, body) = get(addr, "/metrics").await;
        assert_eq!(code, 200);
        assert!(
            body.contains("kubeproxy_sync_proxy_rules_duration_seconds"),
            "{body}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unspecified_address_serves_both_families() {
        let metrics = Arc::new(Metrics::new("/nonexistent".into(), families()));
        let health = Arc::new(Mutex::new(Health::new(Duration::from_secs(60), families())));
        health.lock().unwrap().last_updated = Some(SystemTime::now());
        // 0.0.0.0, as kube-proxy's default and the DaemonSet give it: IPv6 clients (an
        // IPv6-primary node's kubelet) reach it too.
        let mut rx = spawn(
            "health",
            "0.0.0.0:0".parse().unwrap(),
            health_app(health, metrics.clone()),
            BIND_RETRY,
            None,
        );
        until(&mut rx, |s| matches!(s, ServerState::Listening(_))).await;
        let ServerState::Listening(addr) = rx.borrow().clone() else {
            unreachable!()
        };
        let v6 = SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, addr.port()));
        let v4 = SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, addr.port()));
        assert_eq!(get(v6, "/healthz").await.0, 200);
        assert_eq!(get(v4, "/healthz").await.0, 200);
        // A port held on IPv4 alone (kube-proxy's literal 0.0.0.0:10256) is busy for it.
        let held = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        let port = held.local_addr().unwrap().port();
        let mut rx = spawn(
            "health",
            SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, port)),
            metrics_app(metrics),
            Duration::from_millis(20),
            None,
        );
        until(
            &mut rx,
            |s| matches!(s, ServerState::Failing(e) if e.contains("in use")),
        )
        .await;
    }

    #[tokio::test]
    async fn hard_fail_records_the_first_failure_and_gives_up() {
        let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = busy.local_addr().unwrap();
        let fatal = Arc::new(Fatal::default());
        let metrics = Arc::new(Metrics::new("/nonexistent".into(), families()));
        let mut rx = spawn(
            "health",
            addr,
            metrics_app(metrics),
            Duration::from_millis(10),
            Some(fatal.clone()),
        );
        tokio::time::timeout(Duration::from_secs(5), fatal.wait())
            .await
            .expect("failed in time");
        assert!(
            fatal
                .error()
                .unwrap()
                .starts_with(&format!("health server on {addr}: "))
        );
        until(&mut rx, |s| matches!(s, ServerState::Failing(_))).await;
        drop(busy);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            matches!(*rx.borrow(), ServerState::Failing(_)),
            "no retry after a hard failure"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn health_server_counts_answers_by_code() {
        let metrics = Arc::new(Metrics::new("/nonexistent".into(), families()));
        let health = Arc::new(Mutex::new(Health::new(Duration::from_secs(60), families())));
        let mut rx = spawn(
            "health",
            "127.0.0.1:0".parse().unwrap(),
            health_app(health.clone(), metrics.clone()),
            BIND_RETRY,
            None,
        );
        until(&mut rx, |s| matches!(s, ServerState::Listening(_))).await;
        let ServerState::Listening(addr) = rx.borrow().clone() else {
            unreachable!()
        };
        assert_eq!(get(addr, "/healthz").await.0, 503);
        health.lock().unwrap().last_updated = Some(SystemTime::now());
        let (code, body) = get(addr, "/healthz").await;
        assert_eq!(code, 200);
        assert!(body.contains("\"nodeEligible\":true"), "{body}");
        health.lock().unwrap().node_eligible = false;
        assert_eq!(get(addr, "/healthz").await.0, 503);
        assert_eq!(get(addr, "/livez").await.0, 200);
        let text = metrics.encode();
        for line in [
            "kubeproxy_proxy_healthz_total{code=\"503\"} 2",
            "kubeproxy_proxy_healthz_total{code=\"200\"} 1",
            "kubeproxy_proxy_livez_total{code=\"200\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing in\n{text}");
        }
    }
}
