//! `--close-connections-to-removed-endpoints`: closing the TCP connections of endpoints
//! that left their Service, after a sync.

use tracing::{error, info, warn};

use super::Agent;
use crate::{
    datapath::{Datapath, FlowCollection, addr::ip_to_bytes},
    model::ServicePortKey,
};

impl<D: Datapath + FlowCollection> Agent<D> {
    /// `--close-connections-to-removed-endpoints`: closes the TCP connections the socket
    /// programs translated, for one of `ports` (Service port, its service id), to an
    /// endpoint that is no longer live there. Live means in one of the Service's
    /// EndpointSlices for that port and ready or serving, on any node: a terminating
    /// endpoint that still serves keeps its connections (kube-proxy never cuts them, and
    /// the endpoint is draining them), one that is gone or neither ready nor serving loses
    /// them; every endpoint of a removed Service port does. Narrowing by topology, traffic
    /// policy or weight 0 changes where new connections go, never closes one.
    ///
    /// Finds the sockets in the reverse-NAT entries of connected sockets (one pass, only
    /// when some TCP port changed), then
    /// closes them by cookie on a thread of its own (sock_diag in every network namespace,
    /// see [`crate::sockdiag`]), so the sync loop does not wait for it. Only connections of
    /// the socket path: flows the tc programs translate (from outside the node, or from
    /// pods that bypass the socket programs) are not closed.
    pub(super) fn close_removed(&mut self, ports: Vec<(ServicePortKey, u32)>) {
        let Some(dir) = self.close_connections.clone() else {
            return;
        };
        if ports.is_empty() {
            return;
        }
        let mut live = crate::datapath::maps::LiveBackends::new();
        for (k, id) in ports {
            let set = live.entry(id).or_default();
            if !self.model.ports().contains_key(&k) {
                continue; // the port is gone: nothing is live
            }
            let eps =
                self.model
                    .endpoints_of(&k.namespace, &k.name, &k.port_name, k.protocol, k.family);
            set.extend(
                eps.iter()
                    .filter(|(_, e)| e.ready || e.serving)
                    .map(|(a, _)| (ip_to_bytes(a.ip()), a.port().to_be_bytes())),
            );
        }
        let cookies = match crate::datapath::maps::tcp_sockets_to_removed(&dir, &live) {
            Ok(c) => c,
            Err(e) => {
                error!(error = %e, "closing connections to removed endpoints: reading the connected sockets' reverse-NAT entries failed");
                return;
            }
        };
        if cookies.is_empty() {
            return;
        }
        let closed = self.metrics.connections_closed.clone();
        std::thread::spawn(move || {
            let r = crate::sockdiag::destroy(&cookies);
            closed.inc_by(r.closed as u64);
            info!(
                sockets = cookies.len(),
                closed = r.closed,
                not_found = r.not_found,
                namespaces = r.namespaces,
                "closed TCP connections to removed endpoints"
            );
            for e in r.errors.iter().take(5) {
                warn!(error = %e, "closing a connection to a removed endpoint failed");
            }
        });
    }
}
