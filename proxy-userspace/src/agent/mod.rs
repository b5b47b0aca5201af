//! The node agent (`ebpf-proxy run`): loads and attaches the data path, follows a source of
//! changes into the model, and has the reconciler program every change, in one typed event
//! loop.
//!
//! Events (`Event`):
//! - **Batch**: a source's changes. They are read into the model at once; the model is
//!   committed and the changes programmed when the source's view is complete and
//!   `--min-sync-period` allows (API source: an isolated change after a quiet period goes
//!   out at once, the next no sooner than the period after the last sync; manifests: at
//!   once). Batches that queued meanwhile are all read first, so a burst is one sync.
//! - **Verify** (every `--sync-period`): the reconciler compares the maps with what it
//!   applied and repairs them, re-evaluates interfaces and retries health-check ports.
//! - **Retry**: failed Service ports whose backoff expired.
//! - **Collect**: least-connections counts of tc flows that ended without a FIN or RST.
//! - **Stop** (SIGTERM, Ctrl-C): the data path stays attached and pinned for the next agent.
//!
//! Health as kube-proxy's healthz server reports it (`pkg/proxy/healthcheck`, see
//! `crate::servers`): healthy once a sync succeeded, unless an update (or a failed Service
//! port) has been pending for longer than twice `--sync-period`; `/healthz` also follows the
//! node's eligibility, which the model reads from the Node object. The health and metrics
//! servers bind in the background and are retried while the data path runs.

mod close;
mod event_loop;
mod launch;
mod shutdown;
mod startup;
mod sync;

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Result;

use crate::{
    metrics::Metrics,
    model::Model,
    reconcile::Reconciler,
    source::{Batch, SourceError},
};

pub(crate) use crate::status::Health;
pub use launch::run;
pub use startup::init_only;

/// What the loop reacts to.
#[derive(Debug)]
pub(crate) enum Event {
    /// A batch of changes from the source.
    Batch(Batch),
    /// The source stopped for good.
    SourceClosed,
    /// Time to program what the model holds.
    Reconcile,
    /// Time to verify and repair.
    Verify,
    /// Time to retry failed Service ports.
    Retry,
    /// Time to collect ended least-connections flows.
    Collect,
    /// SIGTERM or Ctrl-C.
    Stop,
}

/// The running agent's state, over any data path (the kernel's, or the in-memory fake in
/// tests).
pub(crate) struct Agent<D> {
    /// The model.
    pub(crate) model: Model,
    /// The reconciler.
    pub(crate) reconciler: Reconciler,
    /// The data path.
    pub(crate) dp: D,
    metrics: Arc<Metrics>,
    health: Arc<Mutex<Health>>,
    source_label: &'static str,
    min_period: Duration,
    /// The source's view is complete.
    synced: bool,
    /// The first full pass ran.
    first_done: bool,
    /// The maps were created empty by this run, so the first pass has nothing of an earlier
    /// agent's to remove and skips its verification.
    fresh_maps: bool,
    /// When the model must be programmed (changes are waiting).
    reconcile_at: Option<tokio::time::Instant>,
    /// The programs still being verified and attached (a start reads its source meanwhile):
    /// no sync runs before they are in place, and their failure ends [`Agent::run`].
    attaching: Option<Attaching>,
    last_sync: Option<tokio::time::Instant>,
    /// When the source saw the oldest change not yet programmed.
    first_received: Option<Instant>,
    source_errors: Vec<SourceError>,
    logged_node_errors: BTreeSet<String>,
    collect_failed: bool,
    pending_services: i64,
    pending_endpoints: i64,
    /// The kernel side of the socket-level bypass (`None`: not programmed, as with the
    /// in-memory data path).
    bypass: Option<crate::datapath::bypass::BypassKernel>,
    /// Bad `ebpf-proxy.io/socket-lb` values already logged.
    logged_bypass: BTreeSet<String>,
    /// `--close-connections-to-removed-endpoints`: the pin directory whose `REVNAT_SK`
    /// names the connections (`None`: off, kube-proxy's behaviour).
    close_connections: Option<std::path::PathBuf>,
    /// The north-south path as the status server reports it, updated after every sync.
    north_south: Option<Arc<Mutex<crate::status::NorthSouth>>>,
}

/// Now, on tokio's clock (paused in tests) as a std `Instant`, so the reconciler's retry
/// times and the loop's timers agree.
fn clock() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// The programs' verification and attachment, awaited by the agent's loop.
type Attaching = std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + Send>>;

#[cfg(test)]
mod tests;
