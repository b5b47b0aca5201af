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
//!
//! - Each server listens on `[::]:port` with `IPV6_V6ONLY` off, so it answers on the node's
//!   IPv4 and IPv6 addresses (kube-proxy listens on every node address of both families);
//!   where IPv6 is unavailable it falls back to `0.0.0.0:port`.
//! - A port that cannot be bound (busy) is reported with an error naming the Service and is
//!   retried at every [`HealthChecks::sync`] and [`HealthChecks::retry`] (the agent's
//!   periodic resync), not only when the objects change.
//! - A `healthCheckNodePort` outside 1-65535 (e.g. `0` or `99999`) on a Local Service is
//!   reported with an error naming the Service; it gets no server.
//! - Two Local Services with the same `healthCheckNodePort` (which the API server never
//!   allocates): as with kube-proxy, whose second listen then fails, the first in
//!   namespace/name order keeps the port and an error names both Services.

use std::{
    collections::BTreeMap,
    io,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
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
/// Invalid ports and ports asked for twice are left out silently; see [`wanted_checked`].
pub fn wanted(objects: &ObjectSet, state: &DesiredState) -> BTreeMap<u16, Checked> {
    wanted_checked(objects, state, &mut Vec::new())
}

/// As [`wanted`], reporting in `errors` (each naming the Service) a `healthCheckNodePort`
/// outside 1-65535 and a port asked for by two Services (the first in namespace/name order
/// keeps it).
pub fn wanted_checked(
    objects: &ObjectSet,
    state: &DesiredState,
    errors: &mut Vec<String>,
) -> BTreeMap<u16, Checked> {
    let mut out: BTreeMap<u16, Checked> = BTreeMap::new();
    for ((ns, name), svc) in &objects.services {
        let Some(spec) = svc.object.spec.as_ref() else {
            continue;
        };
        if spec.external_traffic_policy.as_deref() != Some("Local") {
            continue;
        }
        let Some(asked) = spec.health_check_node_port else {
            continue;
        };
        let Some(port) = u16::try_from(asked).ok().filter(|p| *p != 0) else {
            errors.push(format!(
                "Service {ns}/{name}: healthCheckNodePort {asked} is not a port (1-65535); no health-check server"
            ));
            continue;
        };
        if let Some(first) = out.get(&port) {
            errors.push(format!(
                "Service {ns}/{name}: healthCheckNodePort {port} is also the port of Service {}/{}, which keeps it; no health-check server for {ns}/{name}",
                first.namespace, first.name
            ));
            continue;
        }
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

/// A listening socket for `port` on every address: `[::]` dual-stack, or `0.0.0.0` when
/// IPv6 cannot be used (a busy port is an error, not a reason to fall back).
fn listen(port: u16) -> io::Result<std::net::TcpListener> {
    match listen_on(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port))) {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => Err(e),
        Err(_) => listen_on(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port))),
    }
}

fn listen_on(addr: SocketAddr) -> io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    if addr.is_ipv6() {
        s.set_only_v6(false)?;
    }
    s.set_reuse_address(true)?;
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    s.listen(1024)?;
    Ok(s.into())
}

type Shared = Arc<Mutex<Checked>>;

/// The running health-check servers, by port.
#[derive(Default)]
pub struct HealthChecks {
    servers: BTreeMap<u16, (tokio::task::JoinHandle<()>, Shared)>,
    /// What the last sync asked for, for [`HealthChecks::retry`].
    want: BTreeMap<u16, Checked>,
}

impl HealthChecks {
    /// Starts, updates and stops servers to match `want`. Must run inside a tokio runtime.
    /// A port that cannot be bound is reported in `errors` (naming the Service) and retried
    /// at the next sync or [`HealthChecks::retry`].
    pub fn sync(&mut self, want: BTreeMap<u16, Checked>, errors: &mut Vec<String>) {
        self.want = want.clone();
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
            let listener = match listen(port).and_then(tokio::net::TcpListener::from_std) {
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

    /// Binds again the ports the last sync asked for that are not served (their bind
    /// failed), e.g. at the periodic resync. Errors as in [`HealthChecks::sync`].
    pub fn retry(&mut self, errors: &mut Vec<String>) {
        if self.want.keys().any(|p| !self.servers.contains_key(p)) {
            self.sync(self.want.clone(), errors);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::manifests::parse_documents;

    fn local(name: &str, policy: &str, port: i64) -> String {
        format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: ns}}\nspec: {{type: LoadBalancer, clusterIP: 10.96.0.1, externalTrafficPolicy: {policy}, healthCheckNodePort: {port}, ports: [{{port: 80, nodePort: 30080}}]}}\n"
        )
    }

    fn objects(yaml: &str) -> ObjectSet {
        let (objs, errors) = parse_documents("t.yaml", yaml);
        assert!(errors.is_empty(), "{errors:?}");
        let mut set = ObjectSet::default();
        for o in objs {
            set.insert(o);
        }
        set
    }

    #[test]
    fn invalid_and_shared_ports_are_reported_naming_the_services() {
        let yaml = [
            local("a-big", "Local", 99999),
            local("b-zero", "Local", 0),
            local("c-first", "Local", 31000),
            local("d-second", "Local", 31000),
            local("e-cluster", "Cluster", 99999),
            local("f-ok", "Local", 31001),
        ]
        .concat();
        let objs = objects(&yaml);
        let mut errors = Vec::new();
        let want = wanted_checked(&objs, &DesiredState::default(), &mut errors);
        assert_eq!(want.keys().copied().collect::<Vec<_>>(), [31000, 31001]);
        assert_eq!(want[&31000].name, "c-first");
        assert_eq!(errors.len(), 3, "{errors:#?}");
        assert!(
            errors[0].starts_with("Service ns/a-big: healthCheckNodePort 99999 is not a port"),
            "{}",
            errors[0]
        );
        assert!(
            errors[1].starts_with("Service ns/b-zero: healthCheckNodePort 0 is not a port"),
            "{}",
            errors[1]
        );
        assert!(
            errors[2].starts_with("Service ns/d-second: healthCheckNodePort 31000")
                && errors[2].contains("Service ns/c-first"),
            "{}",
            errors[2]
        );
        assert_eq!(wanted(&objs, &DesiredState::default()), want);
    }

    /// One HTTP request with bounded waits, off the runtime's workers.
    async fn get(addr: SocketAddr) -> String {
        tokio::task::spawn_blocking(move || {
            use std::io::{Read, Write};
            let t = std::time::Duration::from_secs(5);
            let mut s = std::net::TcpStream::connect_timeout(&addr, t)?;
            s.set_read_timeout(Some(t))?;
            s.set_write_timeout(Some(t))?;
            s.write_all(b"GET /any HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
            let mut out = String::new();
            s.read_to_string(&mut out)?;
            io::Result::Ok(out)
        })
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("GET {addr}: {e}"))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn busy_port_is_retried_and_then_served_on_both_families() {
        // Occupy a free port on IPv4: the dual-stack bind fails with "address in use".
        let blocker = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        let port = blocker.local_addr().unwrap().port();
        let want = BTreeMap::from([(
            port,
            Checked {
                namespace: "ns".into(),
                name: "web".into(),
                local_endpoints: 1,
            },
        )]);
        let mut hc = HealthChecks::default();
        let mut errors = Vec::new();
        hc.sync(want, &mut errors);
        assert!(hc.ports().is_empty());
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].starts_with(&format!(
                "Service ns/web: healthCheckNodePort {port}: cannot listen"
            )),
            "{}",
            errors[0]
        );
        // Still busy: still reported, nothing served.
        errors.clear();
        hc.retry(&mut errors);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(hc.ports().is_empty());
        // Freed: the retry binds it without any change of the objects.
        drop(blocker);
        errors.clear();
        hc.retry(&mut errors);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(hc.ports(), [port]);
        // Nothing left to retry: a no-op.
        hc.retry(&mut errors);
        assert!(errors.is_empty(), "{errors:?}");

        let v4 = get(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).await;
        assert!(v4.starts_with("HTTP/1.1 200"), "{v4}");
        assert!(v4.contains(r#""localEndpoints":1"#), "{v4}");
        if std::net::TcpListener::bind("[::1]:0").is_ok() {
            let v6 = get(SocketAddr::from((Ipv6Addr::LOCALHOST, port))).await;
            assert!(v6.starts_with("HTTP/1.1 200"), "{v6}");
            assert!(v6.contains(r#""name":"web""#), "{v6}");
        } else {
            eprintln!("no IPv6 loopback here: the IPv6 answer is left to the north_south test");
        }
    }
}
