//! Health-check servers of `spec.healthCheckNodePort` (Services of type LoadBalancer with
//! `externalTrafficPolicy: Local`), as kube-proxy's `pkg/proxy/healthcheck` service health
//! server: one HTTP server per such Service on that port (all addresses), answering every
//! path with
//!
//! ```json
//! {"service":{"namespace":"NS","name":"NAME"},"localEndpoints":N,"serviceProxyHealthy":true}
//! ```
//!
//! and status 200 when this node has N > 0 endpoints of the Service, 503 otherwise, so a
//! cloud load balancer only sends traffic to nodes that can serve it without leaving the
//! node. `localEndpoints` counts the distinct endpoint addresses of the Service's
//! `externalTrafficPolicy: Local` backend sets on this node.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddr},
    sync::{Arc, Mutex},
};

use axum::{extract::State, http::StatusCode, response::IntoResponse};
use tracing::info;

use crate::{
    model::{DesiredState, Scope},
    source::ObjectSet,
};

/// What one health-check port reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checked {
    /// Namespace of the Service.
    pub namespace: String,
    /// Name of the Service.
    pub name: String,
    /// Endpoints of the Service on this node.
    pub local_endpoints: usize,
}

/// The health-check ports the objects ask for: `healthCheckNodePort` of every Service with
/// `externalTrafficPolicy: Local`, with its local endpoint count from the desired state.
pub fn wanted(objects: &ObjectSet, state: &DesiredState) -> BTreeMap<u16, Checked> {
    let mut out = BTreeMap::new();
    for ((ns, name), svc) in &objects.services {
        let Some(spec) = svc.object.spec.as_ref() else {
            continue;
        };
        if spec.external_traffic_policy.as_deref() != Some("Local") {
            continue;
        }
        let Some(port) = spec
            .health_check_node_port
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0)
        else {
            continue;
        };
        let local: std::collections::BTreeSet<std::net::IpAddr> = state
            .services
            .iter()
            .filter(|(k, _)| k.scope == Scope::Ingress && &k.namespace == ns && &k.name == name)
            .flat_map(|(_, s)| s.backends.iter().map(|b| b.ip()))
            .collect();
        out.insert(
            port,
            Checked {
                namespace: ns.clone(),
                name: name.clone(),
                local_endpoints: local.len(),
            },
        );
    }
    out
}

type Shared = Arc<Mutex<Checked>>;

/// The running health-check servers, by port.
#[derive(Default)]
pub struct HealthChecks {
    servers: BTreeMap<u16, (tokio::task::JoinHandle<()>, Shared)>,
}

impl HealthChecks {
    /// Starts, updates and stops servers to match `want`. Must run inside a tokio runtime.
    /// A port that cannot be bound is reported in `errors` (naming the Service) and retried
    /// at the next sync.
    pub fn sync(&mut self, want: BTreeMap<u16, Checked>, errors: &mut Vec<String>) {
        let gone: Vec<u16> = self
            .servers
            .keys()
            .filter(|p| !want.contains_key(p))
            .copied()
            .collect();
        for p in gone {
            if let Some((h, _)) = self.servers.remove(&p) {
                h.abort();
                info!(port = p, "health-check server stopped");
            }
        }
        for (port, c) in want {
            if let Some((_, shared)) = self.servers.get(&port) {
                *shared.lock().unwrap() = c;
                continue;
            }
            let addr = SocketAddr::from((Ipv4Addr::UNSPECIFIED, port));
            let listener = match std::net::TcpListener::bind(addr)
                .and_then(|l| l.set_nonblocking(true).map(|_| l))
                .and_then(tokio::net::TcpListener::from_std)
            {
                Ok(l) => l,
                Err(e) => {
                    errors.push(format!(
                        "Service {}/{}: healthCheckNodePort {port}: cannot listen: {e}",
                        c.namespace, c.name
                    ));
                    continue;
                }
            };
            info!(port, service = %format!("{}/{}", c.namespace, c.name), "health-check server listening");
            let shared: Shared = Arc::new(Mutex::new(c));
            let app = axum::Router::new()
                .fallback(answer)
                .with_state(shared.clone());
            let h = tokio::spawn(async move {
                let _ = axum::serve(listener, app).await;
            });
            self.servers.insert(port, (h, shared));
        }
    }

    /// Ports served now.
    pub fn ports(&self) -> Vec<u16> {
        self.servers.keys().copied().collect()
    }
}

impl Drop for HealthChecks {
    fn drop(&mut self) {
        for (h, _) in self.servers.values() {
            h.abort();
        }
    }
}

async fn answer(State(s): State<Shared>) -> impl IntoResponse {
    let c = s.lock().unwrap().clone();
    let body = serde_json::json!({
        "service": {"namespace": c.namespace, "name": c.name},
        "localEndpoints": c.local_endpoints,
        "serviceProxyHealthy": true,
    });
    let status = if c.local_endpoints > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        [
            ("content-type", "application/json"),
            ("x-content-type-options", "nosniff"),
        ],
        body.to_string(),
    )
}
