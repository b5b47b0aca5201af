//! The service maps (`FRONTENDS`, `BACKEND_SLOTS`, `BACKENDS`, `SERVICE_NAMES`, `MEMBERS`,
//! `MAGLEV`) reconciled per Service port: what each [`ServicePortKey`] has in the maps is
//! kept ([`Applied`]), and a key is written only when the model says it changed.
//!
//! Rules:
//! - A service id is bound to one Service port x protocol x family x scope for its
//!   lifetime; the binding is stored in `SERVICE_NAMES`, so a restarted agent adopts the same
//!   ids ([`ServiceReconciler::adopt`]) and rewrites nothing that did not change (established
//!   sockets keep their reverse NAT and UDP flows keep their backend).
//! - Order within a key, so the data path never sees a half-written service: (A) remove
//!   memberships, frontends and VIP markers that are no longer wanted; (B) write new
//!   backends, the name, changed slots, memberships, the Maglev table, new VIP markers, then
//!   the frontends (a frontend carries the backend count, so it is written after its slots);
//!   (C) remove the Maglev table when no longer hashing, slots past the new count, then
//!   backends no slot refers to. A removed key loses memberships, frontends, markers, slots,
//!   name and table, then its unused backends.
//! - The keys of one Service are applied together: before anything is written, the peak
//!   number of entries of every map during their steps is checked against its limit; a
//!   Service that does not fit is refused whole with [`DatapathError::Full`] (its keys keep
//!   what they had), other Services are applied.
//! - Slots of a key keep their backends in place where possible: removing one backend moves
//!   at most one other slot (the last one into the hole), adding fills holes first.
//! - `MEMBERS` holds the backends of the keys that read it, each with its weight: ClientIP
//!   affinity and the table algorithms (source-hash, maglev, destination-hash), which must
//!   not return a client to a backend that left, and the least-load algorithms
//!   (least-connections with every weight 1, weighted-least-connections,
//!   shortest-expected-delay, never-queue), which divide a backend's connections by its
//!   weight. A weight change rewrites the membership. Other keys pay no membership writes.
//! - [`ServiceReconciler::verify`] compares the maps themselves with what was applied and
//!   repairs every difference in the same order (entries changed behind the agent's back,
//!   leftovers of an interrupted write, entries nothing claims after a restart).
//!
//! The write of one Service runs as steps, each in its own file: `plan.rs` plans every key
//! (its ids from `ids.rs`: bound ones kept, new ones handed out), `capacity.rs` refuses the
//! Service when it does not fit, `write.rs` writes each key in the order above, and
//! `record.rs` keeps what the reconciler knows of the maps. `restore.rs` adopts the pinned
//! maps at start ([`ServiceReconciler::adopt`]), `verify.rs` repairs them
//! ([`ServiceReconciler::verify`]); `names.rs` is the `SERVICE_NAMES` encoding.

mod capacity;
mod ids;
mod names;
mod plan;
mod record;
mod restore;
#[cfg(test)]
pub(crate) mod tests;
mod verify;
mod write;

use foldhash::{HashMap, HashSet};
use std::collections::{BTreeMap, BTreeSet};

use proxy_common::{Backend, Frontend, FrontendKey};

use crate::{
    datapath::{DatapathError, ServiceMaps},
    model::{DesiredService, ServicePortKey},
};

pub use names::{parse_service_name, service_name};

/// What one key has in the maps.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Applied {
    id: u32,
    /// Backend ids by slot.
    slots: Vec<u32>,
    /// Its frontends (VIP markers not included), by key.
    frontends: Vec<(FrontendKey, Frontend)>,
    /// Its `MEMBERS` entries: backend id -> weight.
    members: BTreeMap<u32, u32>,
    /// Hash of its Maglev table, when it has one.
    maglev: Option<u64>,
}

/// What one key will have, planned before anything is written.
struct Target {
    slots: Vec<u32>,
    frontends: Vec<(FrontendKey, Frontend)>,
    members: BTreeMap<u32, u32>,
    table: Option<(Vec<u32>, u64)>,
}

/// One key's plan.
struct Plan {
    key: ServicePortKey,
    id: u32,
    new_id: bool,
    old: Option<Applied>,
    /// `None`: the key is removed.
    new: Option<Target>,
    /// Backends first used by this plan.
    new_backends: Vec<(u32, Backend)>,
}

/// Map entry counts, for the capacity check.
#[derive(Clone, Copy, Debug, Default)]
struct Counts {
    frontends: i64,
    slots: i64,
    backends: i64,
    names: i64,
}

/// What reconciling did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Map entries created or replaced.
    pub writes: usize,
    /// Map entries removed.
    pub deletes: usize,
    /// Keys applied (written or found up to date).
    pub applied: usize,
    /// UDP backends that left a service id: (service id, backend id, backend). Flows and
    /// connected sockets translated to them must be released
    /// ([`crate::datapath::ServiceMaps::release_stale`]), as kube-proxy clears their
    /// conntrack entries.
    pub released: Vec<(u32, u32, Backend)>,
}

impl Report {
    /// Adds another report's figures to this one.
    pub fn add(&mut self, other: Report) {
        self.writes += other.writes;
        self.deletes += other.deletes;
        self.applied += other.applied;
        self.released.extend(other.released);
    }
}

/// The service maps' reconciler: the bindings of service ids and backend ids, and what
/// every key has in the maps. See the module documentation.
#[derive(Debug, Default)]
pub struct ServiceReconciler {
    applied: HashMap<ServicePortKey, Applied>,
    /// The key bound to each service id.
    keys_by_id: HashMap<u32, ServicePortKey>,
    /// The service id whose key holds each frontend: a frontend moving between Services in
    /// one batch is removed from the key that lost it only if no other key took it over.
    fe_owner: HashMap<FrontendKey, u32>,
    ids_in_use: HashSet<u32>,
    /// Backend id -> (value, number of slots referring to it).
    backends: HashMap<u32, (Backend, u32)>,
    backend_ids: HashMap<Backend, u32>,
    /// Real frontends with a VIP marker on each VIP (the marker exists while > 0).
    vip_refs: HashMap<[u8; 16], u32>,
    /// Entries in the maps that nothing claims (after a restart or an interrupted write),
    /// until [`ServiceReconciler::verify`] removes them; their ids are not handed out.
    orphan_service_ids: HashSet<u32>,
    orphan_backend_ids: HashSet<u32>,
    orphans: Counts,
    counts: Counts,
    next_service_id: u32,
    next_backend_id: u32,
    /// Maglev table size (0: `MAGLEV_DEFAULT`).
    maglev_size: u32,
}

impl ServiceReconciler {
    /// Sets the Maglev table size of hashing services (a prime `<= MAGLEV_MAX`); tables are
    /// rewritten when their key is applied next.
    pub fn set_maglev_size(&mut self, size: u32) {
        self.maglev_size = size;
    }

    /// Number of keys bound to a service id.
    pub fn bound(&self) -> usize {
        self.applied.len()
    }

    /// The service id of `key`, when it has one.
    pub fn id_of(&self, key: &ServicePortKey) -> Option<u32> {
        self.applied.get(key).map(|a| a.id)
    }

    /// Every key bound to a service id.
    pub fn keys(&self) -> impl Iterator<Item = &ServicePortKey> {
        self.applied.keys()
    }

    /// Makes room for `keys` Service ports, `frontends` frontends and `backends` backends in
    /// total, so that a first sync of N Services grows no table N times over. A hint: a
    /// backend shared by several Service ports is counted once per port by callers that sum
    /// per port, which reserves more than the tables end up holding.
    pub fn reserve(&mut self, keys: usize, frontends: usize, backends: usize) {
        let more = |want: usize, have: usize| want.saturating_sub(have);
        self.applied.reserve(more(keys, self.applied.len()));
        self.keys_by_id.reserve(more(keys, self.keys_by_id.len()));
        self.ids_in_use.reserve(more(keys, self.ids_in_use.len()));
        self.fe_owner.reserve(more(frontends, self.fe_owner.len()));
        self.backends.reserve(more(backends, self.backends.len()));
        self.backend_ids
            .reserve(more(backends, self.backend_ids.len()));
    }

    /// Entries in use per map: (frontends with VIP markers, slots, backends, names).
    pub fn entry_counts(&self) -> (usize, usize, usize, usize) {
        let c = self.counts;
        (
            c.frontends as usize,
            c.slots as usize,
            c.backends as usize,
            c.names as usize,
        )
    }

    /// Applies the desired state of the keys of one Service: `None` removes a key. The keys
    /// must all belong to one Service. On [`DatapathError::Full`] nothing was written; on
    /// another error the keys before the failing one are applied, the failing one may be
    /// half-written (in the safe order) and [`ServiceReconciler::verify`] must run before it
    /// is retried.
    pub fn apply_service(
        &mut self,
        dp: &mut impl ServiceMaps,
        items: &[(ServicePortKey, Option<&DesiredService>)],
        report: &mut Report,
    ) -> Result<(), DatapathError> {
        let plans = self.plan(items);
        self.check_capacity(dp.capacity(), &plans)?;
        let mut unused = BTreeSet::new();
        for p in plans {
            let applied = p.new.is_some();
            self.write(dp, p, &mut unused, report)?;
            if applied {
                report.applied += 1;
            }
        }
        // Backends no slot refers to any more, after every key (one may have moved from a
        // removed key to another).
        self.remove_unused_backends(dp, unused, report)
    }
}
