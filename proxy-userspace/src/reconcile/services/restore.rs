//! Restore at start: what the pinned maps hold is adopted, so a restarted agent keeps its
//! service ids and backend ids and rewrites nothing that did not change (established
//! sockets keep their reverse NAT, UDP flows their backend).

use foldhash::{HashMap, HashMapExt};

use proxy_common::{BackendSlotKey, FRONTEND_F_VIP_MARKER, Frontend, FrontendKey, MemberKey};

use super::{Applied, Counts, ServiceReconciler, parse_service_name, plan::table_hash};
use crate::datapath::{DatapathError, ServiceMaps, Snapshot};

impl ServiceReconciler {
    /// Starts from what the maps hold now (pinned by an earlier run, or empty): each service
    /// id named in `SERVICE_NAMES` is re-bound to its key with the slots, frontends,
    /// memberships and table it has; entries nothing claims are left for
    /// [`ServiceReconciler::verify`] to remove.
    pub fn adopt(dp: &impl ServiceMaps) -> Result<Self, DatapathError> {
        let snap = dp.snapshot()?;
        let mut s = ServiceReconciler::default();
        let mut fe_by_id: HashMap<u32, Vec<(FrontendKey, Frontend)>> = HashMap::new();
        for (k, v) in &snap.frontends {
            if v.flags & FRONTEND_F_VIP_MARKER == 0 {
                fe_by_id.entry(v.service_id).or_default().push((*k, *v));
            }
        }
        for (id, name) in &snap.names {
            let Some(key) = parse_service_name(name) else {
                continue;
            };
            if s.applied.contains_key(&key) {
                continue; // a second id for one key: the first is kept, the other is an orphan
            }
            let applied = adopted_key(dp, &snap, *id, &mut fe_by_id)?;
            s.account(&applied, 1);
            s.ids_in_use.insert(*id);
            for (k, _) in &applied.frontends {
                s.fe_owner.insert(*k, *id);
            }
            s.keys_by_id.insert(*id, key.clone());
            s.applied.insert(key, applied);
        }
        for a in s.applied.values() {
            for b in &a.slots {
                let v = snap.backends[b];
                s.backends.entry(*b).or_insert((v, 0)).1 += 1;
                s.backend_ids.insert(v, *b);
            }
        }
        s.counts.backends = s.backends.len() as i64;
        s.adopt_orphans(&snap);
        Ok(s)
    }

    /// Everything the adopted keys do not claim is an orphan until verified: its ids are
    /// not handed out and its entries count against the maps' limits. New ids continue
    /// after the highest one in the maps.
    fn adopt_orphans(&mut self, snap: &Snapshot) {
        let ids = snap
            .names
            .keys()
            .chain(snap.slots.keys().map(|k| &k.service_id))
            .chain(snap.frontends.values().map(|f| &f.service_id))
            .chain(snap.maglev.iter());
        self.orphan_service_ids = ids
            .filter(|id| **id != 0 && !self.ids_in_use.contains(id))
            .copied()
            .collect();
        self.orphan_backend_ids = snap
            .backends
            .keys()
            .filter(|b| !self.backends.contains_key(b))
            .copied()
            .collect();
        self.orphans = Counts {
            frontends: snap.frontends.len() as i64 - self.counts.frontends,
            slots: snap.slots.len() as i64 - self.counts.slots,
            backends: self.orphan_backend_ids.len() as i64,
            names: snap.names.len() as i64 - self.counts.names,
        };
        let max_sid = self
            .ids_in_use
            .iter()
            .chain(self.orphan_service_ids.iter())
            .max()
            .copied()
            .unwrap_or(0);
        self.next_service_id = max_sid.wrapping_add(1).max(1);
        self.next_backend_id = snap
            .backends
            .keys()
            .max()
            .copied()
            .unwrap_or(0)
            .wrapping_add(1)
            .max(1);
    }
}

/// What service id `id` holds in the maps: its slots from 0 up to the first missing one (or
/// one naming a missing backend), its frontends (taken from `fe_by_id`), the memberships of
/// backends in its slots and the hash of its Maglev table.
fn adopted_key(
    dp: &impl ServiceMaps,
    snap: &Snapshot,
    id: u32,
    fe_by_id: &mut HashMap<u32, Vec<(FrontendKey, Frontend)>>,
) -> Result<Applied, DatapathError> {
    let mut slots = Vec::new();
    while let Some(b) = snap.slots.get(&BackendSlotKey {
        service_id: id,
        slot: slots.len() as u32,
    }) {
        if !snap.backends.contains_key(b) {
            break;
        }
        slots.push(*b);
    }
    let maglev = if snap.maglev.contains(&id) {
        dp.get_maglev(id)?.map(|t| table_hash(&t))
    } else {
        None
    };
    // Memberships of backends in its slots; any other is left for `verify`.
    let members = slots
        .iter()
        .filter_map(|b| {
            snap.members
                .get(&MemberKey {
                    service_id: id,
                    backend_id: *b,
                })
                .map(|w| (*b, *w))
        })
        .collect();
    Ok(Applied {
        id,
        slots,
        frontends: fe_by_id.remove(&id).unwrap_or_default(),
        members,
        maglev,
    })
}
