//! The one reconciler: it programs every part of the data path from the model — the service
//! maps (`services`), the north-south maps, interfaces and health-check servers (`node`)
//! — through the [`Datapath`] seam, so the whole control plane runs against the in-memory
//! fake in tests.
//!
//! - **Per change.** [`Reconciler::apply`] programs what one `Delta` of the model names:
//!   the changed Service ports and the changed node facts; its cost does not grow with the
//!   number of Services.
//! - **Status per Service port.** A Service port is applied, or failed: its Service did not
//!   fit a map (refused whole, nothing written) or a map write failed. A failed port keeps
//!   what it had in the maps, is reported, and is retried with exponential backoff (1 s,
//!   doubling, at most the resync period), with the model's state at the time of the retry.
//!   A map write that failed half-way is followed by a verification before the retry.
//! - **Verify and repair.** [`Reconciler::verify`] (every `--sync-period`) compares the
//!   maps themselves with what was applied and repairs every difference: entries changed
//!   behind the agent's back, leftovers of an interrupted write, entries nothing claims after
//!   a restart; it also re-evaluates the interfaces and retries health-check ports.
//! - **Restart.** [`Reconciler::adopt`] restores the service ids, backend ids and what each
//!   key holds from the pinned maps, so the first full pass ([`Reconciler::apply_all`])
//!   rewrites nothing that did not change.

#[cfg(test)]
mod equivalence;
pub(crate) mod node;
pub(crate) mod services;

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use crate::{
    datapath::{Datapath, DatapathError, Released},
    model::{Delta, Family, Model, ServicePortKey},
};
pub(crate) use node::NodeReconciler;
pub use node::{NodeConfig, source_range_entries};
pub(crate) use services::{Report, ServiceReconciler, parse_service_name};

/// First retry delay of a failed Service port.
pub const RETRY_MIN: Duration = Duration::from_secs(1);

/// Why a Service port is not applied, and when it is tried again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// What went wrong (names the map and the flag for a full map).
    pub error: String,
    /// Failed attempts in a row.
    pub attempts: u32,
    /// When it is retried.
    pub retry_at: Instant,
}

/// What one reconciler call did.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// Service map writes and deletes, keys applied, UDP backends released.
    pub report: Report,
    /// Entries repaired by a verification (writes and deletes).
    pub repaired: Report,
    /// North-south map entries, interfaces and servers changed.
    pub node_changes: usize,
    /// Services that failed in this call: ("namespace/name", error).
    pub failed: Vec<(String, String)>,
    /// Services that had failed and are applied now.
    pub recovered: Vec<String>,
    /// What releasing the UDP state of removed backends did, or why it failed.
    pub released: Option<Result<Released, String>>,
    /// The same per IP family of the backends, with the time it took (kube-proxy's
    /// conntrack reconciler metrics); a family without removed UDP backends is absent.
    pub released_by_family: Vec<(Family, Result<Released, String>, Duration)>,
    /// Wall time of the call.
    pub duration: Duration,
}

/// The reconciler; see the module documentation.
#[derive(Debug)]
pub struct Reconciler {
    /// The service maps.
    pub services: ServiceReconciler,
    /// The node's part.
    pub node: NodeReconciler,
    failed: BTreeMap<ServicePortKey, Failure>,
    /// A map write failed half-way: verify before retrying.
    needs_verify: bool,
    max_backoff: Duration,
}

impl Reconciler {
    /// Restores what the pinned maps hold. `max_backoff` bounds the retry delay of failed
    /// Service ports (the resync period).
    pub fn adopt(
        dp: &impl Datapath,
        node: NodeConfig,
        max_backoff: Duration,
    ) -> Result<Self, DatapathError> {
        Ok(Reconciler {
            services: ServiceReconciler::adopt(dp)?,
            node: NodeReconciler::adopt(dp, node)?,
            failed: BTreeMap::new(),
            needs_verify: false,
            max_backoff: max_backoff.max(RETRY_MIN),
        })
    }

    /// Failed Service ports.
    pub fn failed(&self) -> &BTreeMap<ServicePortKey, Failure> {
        &self.failed
    }

    /// When the next retry is due.
    pub fn next_retry(&self) -> Option<Instant> {
        self.failed.values().map(|f| f.retry_at).min()
    }

    /// Programs what the model's last commit changed.
    pub fn apply(
        &mut self,
        dp: &mut impl Datapath,
        model: &Model,
        delta: &Delta,
        now: Instant,
    ) -> Outcome {
        let start = Instant::now();
        let mut out = Outcome::default();
        self.apply_keys(dp, model, delta.ports.iter(), now, &mut out);
        if !delta.ports.is_empty() {
            let r = self.node.apply_dsr(dp, model, delta.ports.iter());
            Self::node_result(&mut out, "direct server return", r);
        }
        if delta.local_endpoints_changed {
            let r = self.node.apply_local(
                dp,
                &delta.local_endpoints_added,
                &delta.local_endpoints_removed,
            );
            Self::node_result(&mut out, "local endpoints", r);
        }
        if delta.source_ranges_changed {
            Self::node_result(&mut out, "source ranges", self.node.sync_ranges(dp, model));
        }
        if delta.health_changed {
            self.node.sync_health(dp, model);
        }
        if delta.node_changed
            || self
                .node
                .needs_pod_interface(dp, &delta.local_endpoints_added)
        {
            out.node_changes += self.node.sync_interfaces(dp, model);
        }
        self.release(dp, &mut out);
        out.duration = start.elapsed();
        out
    }

    /// Programs every Service port of the model and removes the ports it no longer has (the
    /// first pass after a start), and every node fact.
    pub fn apply_all(&mut self, dp: &mut impl Datapath, model: &Model, now: Instant) -> Outcome {
        let start = Instant::now();
        let mut out = Outcome::default();
        let mut keys: BTreeSet<ServicePortKey> = model.ports().keys().cloned().collect();
        keys.extend(self.services.keys().cloned());
        // Every Service at once (the first sync): batched writes, into tables sized once.
        let (mut frontends, mut backends) = (0, 0);
        for d in model.ports().values() {
            frontends += d.frontends.len();
            backends += d.backends.len();
        }
        self.services
            .reserve(model.ports().len(), frontends, backends);
        dp.begin_bulk();
        self.apply_keys(dp, model, keys.iter(), now, &mut out);
        if let Err(e) = dp.end_bulk() {
            // Which Service ports lost writes is not known: the verification finds and
            // repairs them entry by entry, reporting what still fails.
            out.failed.push(("(batched write)".into(), e.to_string()));
            self.verify_into(dp, model, &mut out);
        }
        Self::node_result(&mut out, "local endpoints", self.node.sync_local(dp, model));
        Self::node_result(&mut out, "source ranges", self.node.sync_ranges(dp, model));
        Self::node_result(
            &mut out,
            "direct server return",
            self.node.sync_dsr(dp, model),
        );
        self.node.sync_health(dp, model);
        out.node_changes += self.node.sync_interfaces(dp, model);
        self.release(dp, &mut out);
        out.duration = start.elapsed();
        out
    }

    /// Compares the maps with what was applied and repairs them; re-evaluates interfaces,
    /// retries health-check ports, then retries every failed Service port.
    pub fn verify(&mut self, dp: &mut impl Datapath, model: &Model, now: Instant) -> Outcome {
        let start = Instant::now();
        let mut out = Outcome::default();
        self.verify_into(dp, model, &mut out);
        let due: Vec<ServicePortKey> = self.failed.keys().cloned().collect();
        self.apply_keys(dp, model, due.iter(), now, &mut out);
        self.release(dp, &mut out);
        out.duration = start.elapsed();
        out
    }

    fn verify_into(&mut self, dp: &mut impl Datapath, model: &Model, out: &mut Outcome) {
        match self.services.verify(dp) {
            Ok(r) => {
                out.repaired.add(r);
                self.needs_verify = false;
            }
            Err(e) => out.failed.push(("(verification)".into(), e.to_string())),
        }
        Self::node_result(out, "north-south maps", self.node.verify(dp, model));
        // What a failed write left out is applied now.
        Self::node_result(out, "local endpoints", self.node.sync_local(dp, model));
        Self::node_result(out, "source ranges", self.node.sync_ranges(dp, model));
        self.node.sync_health(dp, model);
    }

    /// Retries the failed Service ports whose time has come.
    pub fn retry(&mut self, dp: &mut impl Datapath, model: &Model, now: Instant) -> Outcome {
        let start = Instant::now();
        let mut out = Outcome::default();
        let due: Vec<ServicePortKey> = self
            .failed
            .iter()
            .filter(|(_, f)| f.retry_at <= now)
            .map(|(k, _)| k.clone())
            .collect();
        if !due.is_empty() {
            if self.needs_verify {
                self.verify_into(dp, model, &mut out);
            }
            self.apply_keys(dp, model, due.iter(), now, &mut out);
            self.release(dp, &mut out);
        }
        out.duration = start.elapsed();
        out
    }

    fn node_result(out: &mut Outcome, what: &str, r: Result<usize, DatapathError>) {
        match r {
            Ok(n) => out.node_changes += n,
            Err(e) => out.failed.push((format!("({what})"), e.to_string())),
        }
    }

    /// Applies `keys` (sorted, so the keys of one Service are adjacent) Service by Service.
    fn apply_keys<'a>(
        &mut self,
        dp: &mut impl Datapath,
        model: &Model,
        keys: impl Iterator<Item = &'a ServicePortKey>,
        now: Instant,
        out: &mut Outcome,
    ) {
        let mut group: Vec<&ServicePortKey> = Vec::new();
        let mut flush = |this: &mut Self, group: &mut Vec<&ServicePortKey>, out: &mut Outcome| {
            if group.is_empty() {
                return;
            }
            let items: Vec<_> = group
                .iter()
                .map(|k| ((*k).clone(), model.port(k)))
                .collect();
            let service = || format!("{}/{}", group[0].namespace, group[0].name);
            match this.services.apply_service(dp, &items, &mut out.report) {
                Ok(()) => {
                    let mut recovered = false;
                    for k in group.iter() {
                        recovered |= this.failed.remove(*k).is_some();
                    }
                    if recovered {
                        out.recovered.push(service());
                    }
                }
                Err(e) => {
                    if !matches!(e, DatapathError::Full { .. }) {
                        this.needs_verify = true;
                    }
                    let error = e.to_string();
                    for k in group.iter() {
                        let attempts = this.failed.get(*k).map(|f| f.attempts).unwrap_or(0) + 1;
                        let delay = RETRY_MIN
                            .saturating_mul(1 << (attempts - 1).min(16))
                            .min(this.max_backoff);
                        this.failed.insert(
                            (*k).clone(),
                            Failure {
                                error: error.clone(),
                                attempts,
                                retry_at: now + delay,
                            },
                        );
                    }
                    out.failed.push((service(), error));
                }
            }
            group.clear();
        };
        for k in keys {
            if group
                .first()
                .is_some_and(|g| g.namespace != k.namespace || g.name != k.name)
            {
                flush(self, &mut group, out);
            }
            group.push(k);
        }
        flush(self, &mut group, out);
    }

    fn release(&mut self, dp: &mut impl Datapath, out: &mut Outcome) {
        if out.report.released.is_empty() {
            return;
        }
        // One call per family, so each family's work is measured on its own.
        let mut total: Result<Released, String> = Ok(Released::default());
        for family in [Family::V4, Family::V6] {
            let of_family: Vec<_> = out
                .report
                .released
                .iter()
                .filter(|(_, _, b)| {
                    Family::of(&crate::datapath::addr::bytes_to_ip(b.addr)) == family
                })
                .copied()
                .collect();
            if of_family.is_empty() {
                continue;
            }
            let start = Instant::now();
            let r = dp.release_stale(&of_family).map_err(|e| e.to_string());
            out.released_by_family
                .push((family, r.clone(), start.elapsed()));
            total = match (total, r) {
                (Ok(a), Ok(b)) => Ok(Released {
                    flows: a.flows + b.flows,
                    sockets: a.sockets + b.sockets,
                }),
                (Err(e), _) | (_, Err(e)) => Err(e),
            };
        }
        out.released = Some(total);
    }
}

#[cfg(test)]
mod tests;
