//! Ids: each key is bound to one service id for its lifetime, and each backend value
//! (address, port, protocol) to one backend id shared by every key that uses it. New ids are
//! handed out while a Service is planned ([`BatchIds`]) and recorded when its plan is
//! written.

use foldhash::{HashMap, HashSet};
use std::net::SocketAddr;

use proxy_common::Backend;

use super::{Applied, ServiceReconciler};
use crate::{
    datapath::addr::{ip_to_bytes, port_to_map},
    model::{DesiredService, Protocol, ServicePortKey},
};

/// The `BACKENDS` value of the backend at `addr`; also what binds it to its backend id.
pub(crate) fn backend_value(addr: &SocketAddr, proto: Protocol) -> Backend {
    Backend {
        addr: ip_to_bytes(addr.ip()),
        port: port_to_map(addr.port()),
        proto: proto.number(),
        flags: 0,
    }
}

/// The next id from `next`: ids are handed out in increasing order (wrapping, never 0), so a
/// freed id is not reused soon (a UDP flow remembers its backend id; the data path also
/// checks the address); `taken` rejects ids still in use.
fn alloc_id(next: &mut u32, taken: impl Fn(u32) -> bool) -> u32 {
    loop {
        let id = (*next).max(1);
        *next = id.wrapping_add(1);
        if !taken(id) {
            return id;
        }
    }
}

/// Ids handed out while the keys of one Service are planned, not yet recorded in the
/// reconciler: a later key of the Service reuses a backend an earlier key introduced, and
/// no id is handed out twice.
#[derive(Default)]
pub(super) struct BatchIds {
    /// New backend value -> its id.
    backend_ids: HashMap<Backend, u32>,
    /// New backend id -> its value (a later key's Maglev table names it).
    pub(super) backends: HashMap<u32, Backend>,
    /// The service id of each key planned so far, bound or new.
    pub(super) service_ids: HashMap<ServicePortKey, u32>,
}

/// The backend ids of one key.
pub(super) struct KeyBackends {
    /// (address, backend id) of each of its backends.
    pub(super) ids: Vec<(SocketAddr, u32)>,
    /// The backends first used by this key, with their new ids (written before any slot
    /// names them).
    pub(super) new: Vec<(u32, Backend)>,
}

impl ServiceReconciler {
    /// The service id of `key`: the one it is bound to (`old`), else a new one no key, orphan
    /// or earlier key of the batch holds. Returns the id and whether it is new.
    pub(super) fn service_id(
        &mut self,
        batch: &mut BatchIds,
        key: &ServicePortKey,
        old: Option<&Applied>,
    ) -> (u32, bool) {
        let (id, new_id) = match old {
            Some(a) => (a.id, false),
            None => {
                let (used, orphans) = (&self.ids_in_use, &self.orphan_service_ids);
                let in_batch: HashSet<u32> = batch.service_ids.values().copied().collect();
                let id = alloc_id(&mut self.next_service_id, |id| {
                    used.contains(&id) || orphans.contains(&id) || in_batch.contains(&id)
                });
                (id, true)
            }
        };
        batch.service_ids.insert(key.clone(), id);
        (id, new_id)
    }

    /// The backend id of each backend of `svc`: a known backend keeps its id, a new one gets
    /// a fresh id.
    pub(super) fn backend_ids(
        &mut self,
        batch: &mut BatchIds,
        proto: Protocol,
        svc: &DesiredService,
    ) -> KeyBackends {
        let mut bids = Vec::new();
        let mut new_backends = Vec::new();
        for addr in &svc.backends {
            let b = backend_value(addr, proto);
            let bid = match self.backend_ids.get(&b).or(batch.backend_ids.get(&b)) {
                Some(id) => *id,
                None => {
                    let (used, orphans) = (&self.backends, &self.orphan_backend_ids);
                    let local = &batch.backends;
                    let id = alloc_id(&mut self.next_backend_id, |id| {
                        used.contains_key(&id) || orphans.contains(&id) || local.contains_key(&id)
                    });
                    batch.backend_ids.insert(b, id);
                    batch.backends.insert(id, b);
                    new_backends.push((id, b));
                    id
                }
            };
            bids.push((*addr, bid));
        }
        KeyBackends {
            ids: bids,
            new: new_backends,
        }
    }
}
