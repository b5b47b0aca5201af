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
//! node. Which ports to serve and what they report is the model's (`Model::health_checks`);
//! the reconciler starts, updates, stops and retries the servers through [`HealthServers`],
//! and the kernel data path (`kernel::KernelDatapath`) holds them.
//!
//! Each server listens on `[::]:port` with `IPV6_V6ONLY` off, so it answers on the node's
//! IPv4 and IPv6 addresses (kube-proxy listens on every node address of both families);
//! where IPv6 is unavailable it falls back to `0.0.0.0:port`.

use std::{
    collections::BTreeMap,
    io,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{Arc, Mutex},
};

use axum::{extract::State, http::StatusCode, response::IntoResponse};
use tracing::info;

use super::{HealthCheck, HealthServers};

/// A listening socket for `port` on every address: `[::]` dual-stack, or `0.0.0.0` when
/// IPv6 cannot be used (a busy port is an error, not a reason to fall back).
pub(crate) fn listen(port: u16) -> io::Result<std::net::TcpListener> {
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

type Shared = Arc<Mutex<HealthCheck>>;

/// The running health-check servers, by port (tokio tasks; must be used inside a runtime).
#[derive(Default)]
pub struct HealthCheckServers {
    servers: BTreeMap<u16, (tokio::task::JoinHandle<()>, Shared)>,
}

impl HealthServers for HealthCheckServers {
    fn serve_health(&mut self, port: u16, check: &HealthCheck) -> io::Result<()> {
        if let Some((_, shared)) = self.servers.get(&port) {
            *shared.lock().unwrap() = check.clone();
            return Ok(());
        }
        let listener = listen(port).and_then(tokio::net::TcpListener::from_std)?;
        info!(port, service = %format!("{}/{}", check.namespace, check.name), "health-check server listening");
        let shared: Shared = Arc::new(Mutex::new(check.clone()));
        let app = axum::Router::new()
            .fallback(answer)
            .with_state(shared.clone());
        let h = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        self.servers.insert(port, (h, shared));
        Ok(())
    }

    fn update_health(&mut self, port: u16, check: &HealthCheck) {
        if let Some((_, shared)) = self.servers.get(&port) {
            *shared.lock().unwrap() = check.clone();
        }
    }

    fn stop_health(&mut self, port: u16) {
        if let Some((h, _)) = self.servers.remove(&port) {
            h.abort();
            info!(port, "health-check server stopped");
        }
    }
}

#[cfg(test)]
impl HealthCheckServers {
    /// Ports served now.
    pub(crate) fn ports(&self) -> Vec<u16> {
        self.servers.keys().copied().collect()
    }
}

impl Drop for HealthCheckServers {
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
    async fn busy_port_fails_then_binds_and_serves_both_families() {
        // Occupy a free port on IPv4: the dual-stack bind fails with "address in use".
        let blocker = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        let port = blocker.local_addr().unwrap().port();
        let check = HealthCheck {
            namespace: "ns".into(),
            name: "web".into(),
            local_endpoints: 1,
        };
        let mut hc = HealthCheckServers::default();
        let e = hc.serve_health(port, &check).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse, "{e}");
        assert!(hc.ports().is_empty());
        drop(blocker);
        hc.serve_health(port, &check).unwrap();
        assert_eq!(hc.ports(), [port]);

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
        // No local endpoint: 503.
        hc.update_health(
            port,
            &HealthCheck {
                local_endpoints: 0,
                ..check
            },
        );
        let v4 = get(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).await;
        assert!(v4.starts_with("HTTP/1.1 503"), "{v4}");
        hc.stop_health(port);
        assert!(hc.ports().is_empty());
    }
}
