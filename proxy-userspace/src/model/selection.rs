//! Backend selection settings and their names: the algorithm (`--lb-algorithm`, IPVS
//! scheduler names, [`ALGORITHM_ANNOTATION`]), endpoint weights ([`WEIGHTS_ANNOTATION`]) and
//! the north-south mode ([`NorthSouthMode`], [`NORTH_SOUTH_MODE_ANNOTATION`]), with how a
//! Service's `ebpf-proxy.io/*` annotations choose them.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Service;

use super::vocab::{Algorithm, MAX_WEIGHT, Protocol};

/// Service annotation choosing its algorithm: a name of [`Algorithm::ALL`] (`random`,
/// `round-robin`, `weighted-round-robin`, `least-connections`, `source-hash`, `maglev`,
/// `weighted-least-connections`, `shortest-expected-delay`, `never-queue`,
/// `destination-hash`) or an IPVS scheduler name of [`Algorithm::IPVS`] (`rr`, `wrr`, `lc`,
/// `wlc`, `sed`, `nq`, `sh`, `dh`, `mh`).
pub const ALGORITHM_ANNOTATION: &str = "ebpf-proxy.io/lb-algorithm";
/// Service annotation with endpoint weights: a JSON object from pod name (the endpoint's
/// `targetRef.name`) or endpoint IP address to an integer weight 0..=100 (default 1). The
/// weighted algorithms ([`Algorithm::uses_weights`]) follow the weights; 0 takes the
/// endpoint out of new connections with every algorithm (established ones are untouched),
/// as IPVS quiesces a server of weight 0.
pub const WEIGHTS_ANNOTATION: &str = "ebpf-proxy.io/weights";
/// Service annotation choosing how flows from outside the cluster reach a backend on
/// another node: `snat`, `dsr` or `hybrid` ([`NorthSouthMode`]); without it,
/// `--north-south-mode` decides.
pub const NORTH_SOUTH_MODE_ANNOTATION: &str = "ebpf-proxy.io/north-south-mode";

/// How a flow entering the node from outside (node port, external or load balancer IP, with
/// `externalTrafficPolicy: Cluster`) reaches a backend on another node (`--north-south-mode`,
/// or a Service's [`NORTH_SOUTH_MODE_ANNOTATION`]). A backend on the entry node, and every
/// flow of a `Local` policy, keep the client address in every mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NorthSouthMode {
    /// Source-NAT to the entry node's address, replies back through it (kube-proxy's
    /// behaviour; the backend sees the entry node as the client).
    #[default]
    Snat,
    /// Direct server return for TCP and UDP: the client's packet is forwarded encapsulated
    /// to the backend, whose node answers the client directly from the frontend address
    /// (`proxy_common::nat::DSR`); the backend sees the client's address.
    Dsr,
    /// Direct server return for TCP, SNAT for UDP (Cilium's hybrid mode: a UDP flow has no
    /// handshake whose MSS could be lowered for the encapsulation, and its datagrams are
    /// often large).
    Hybrid,
}

impl NorthSouthMode {
    /// Every mode with its name.
    pub const ALL: [(NorthSouthMode, &'static str); 3] = [
        (NorthSouthMode::Snat, "snat"),
        (NorthSouthMode::Dsr, "dsr"),
        (NorthSouthMode::Hybrid, "hybrid"),
    ];

    /// The mode named `s` (`snat`, `dsr`, `hybrid`).
    pub fn from_name(s: &str) -> Option<NorthSouthMode> {
        Self::ALL.iter().find(|(_, n)| *n == s).map(|(m, _)| *m)
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(m, _)| *m == self)
            .map_or("snat", |(_, n)| n)
    }

    /// Whether flows of `protocol` go by direct server return in this mode.
    pub fn dsr_for(self, protocol: Protocol) -> bool {
        match self {
            NorthSouthMode::Snat => false,
            NorthSouthMode::Dsr => true,
            NorthSouthMode::Hybrid => protocol == Protocol::Tcp,
        }
    }
}

/// Parses an algorithm name as `ALGORITHM_ANNOTATION` and `--lb-algorithm` take it: an
/// ebpf-proxy name ([`Algorithm::ALL`]) or an IPVS scheduler name ([`Algorithm::IPVS`]).
pub fn parse_algorithm(s: &str) -> Option<Algorithm> {
    Algorithm::from_name(s)
}

/// Every name [`parse_algorithm`] accepts, for messages: `random, round-robin, ... (IPVS:
/// rr, wrr, ...)`.
pub fn algorithm_names() -> String {
    let own: Vec<&str> = Algorithm::ALL.iter().map(|(_, n)| *n).collect();
    let ipvs: Vec<&str> = Algorithm::IPVS.iter().map(|(n, _)| *n).collect();
    format!("{} (IPVS: {})", own.join(", "), ipvs.join(", "))
}

/// The Service's [`NORTH_SOUTH_MODE_ANNOTATION`], else `default`; a value that is not a mode
/// is reported in `warn` and `default` used.
pub(crate) fn north_south_mode(
    svc: &Service,
    default: NorthSouthMode,
    warn: &mut Vec<String>,
) -> NorthSouthMode {
    let Some(v) = svc
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(NORTH_SOUTH_MODE_ANNOTATION))
    else {
        return default;
    };
    NorthSouthMode::from_name(v.trim()).unwrap_or_else(|| {
        warn.push(format!(
            "annotation {NORTH_SOUTH_MODE_ANNOTATION} {v:?} is not one of snat, dsr, hybrid; using {}",
            default.name()
        ));
        default
    })
}

/// A Service's algorithm ([`ALGORITHM_ANNOTATION`], else `default`) and endpoint weights
/// ([`WEIGHTS_ANNOTATION`], by pod name or address). A bad annotation is reported through
/// `warn` and ignored (default algorithm, weight 1), the rest of the Service still works.
pub(crate) fn algorithm_and_weights(
    svc: &Service,
    default: Algorithm,
    warn: &mut Vec<String>,
) -> (Algorithm, BTreeMap<String, u32>) {
    let ann = svc.metadata.annotations.as_ref();
    let mut algorithm = default;
    if let Some(v) = ann.and_then(|a| a.get(ALGORITHM_ANNOTATION)) {
        match parse_algorithm(v.trim()) {
            Some(a) => algorithm = a,
            None => warn.push(format!(
                "annotation {ALGORITHM_ANNOTATION} {v:?} is not one of {}; using {}",
                algorithm_names(),
                default.name()
            )),
        }
    }
    let mut weights = BTreeMap::new();
    if let Some(v) = ann.and_then(|a| a.get(WEIGHTS_ANNOTATION)) {
        match serde_json::from_str::<BTreeMap<String, i64>>(v) {
            Ok(m) => {
                for (k, w) in m {
                    match u32::try_from(w) {
                        Ok(w) if w <= MAX_WEIGHT => {
                            weights.insert(k, w);
                        }
                        _ => warn.push(format!(
                            "annotation {WEIGHTS_ANNOTATION}: weight {w} of {k:?} is not 0-{MAX_WEIGHT}; weight 1 used"
                        )),
                    }
                }
            }
            Err(e) => warn.push(format!(
                "annotation {WEIGHTS_ANNOTATION} is not a JSON object of integer weights ({e}); every weight is 1"
            )),
        }
        if !algorithm.uses_weights() && weights.values().any(|w| *w != 0) {
            warn.push(format!(
                "annotation {WEIGHTS_ANNOTATION}: weights other than 0 have no effect with algorithm {}",
                algorithm.name()
            ));
        }
    }
    (algorithm, weights)
}

#[cfg(test)]
mod tests;
