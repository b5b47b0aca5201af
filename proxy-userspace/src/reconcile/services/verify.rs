//! Verification: the maps themselves are compared with what was applied and every
//! difference repaired in the safe order (entries changed behind the agent's back,
//! leftovers of an interrupted write, entries nothing claims after a restart); then the
//! counters of released ids are swept.

use foldhash::{HashMap, HashMapExt, HashSet};

use proxy_common::{BackendSlot, BackendSlotKey, FrontendKey, MemberKey};

use super::{
    Counts, Report, ServiceReconciler, plan::table_hash, service_name, write::unknown_backend,
};
use crate::datapath::{
    DatapathError, ServiceMaps, Snapshot,
    vip::{MARKER, marker_key},
};

impl ServiceReconciler {
    /// The service maps as they should be, from what was applied.
    fn expected(&self) -> Snapshot {
        let mut s = Snapshot::default();
        for (key, a) in &self.applied {
            for (k, v) in &a.frontends {
                s.frontends.insert(*k, *v);
            }
            for (i, b) in a.slots.iter().enumerate() {
                s.slots.insert(
                    BackendSlotKey {
                        service_id: a.id,
                        slot: i as u32,
                    },
                    *b,
                );
            }
            for (b, w) in &a.members {
                s.members.insert(
                    MemberKey {
                        service_id: a.id,
                        backend_id: *b,
                    },
                    *w,
                );
            }
            s.names.insert(a.id, service_name(key));
            if a.maglev.is_some() {
                s.maglev.insert(a.id);
            }
        }
        for a in self.vip_refs.keys() {
            s.frontends.insert(marker_key(*a), MARKER);
        }
        for (id, (b, _)) in &self.backends {
            s.backends.insert(*id, *b);
        }
        s
    }

    /// Compares the maps with what was applied and repairs every difference in the safe
    /// order: entries nothing claims are removed, missing or changed ones written again.
    /// Returns the repairs made (0 and 0 when the maps were as expected).
    pub fn verify(&mut self, dp: &mut impl ServiceMaps) -> Result<Report, DatapathError> {
        let mut r = Report::default();
        self.forget_unused_backends();
        let have = dp.snapshot()?;
        let want = self.expected();
        // (A) removals, in the order the data path tolerates.
        repair_removals(dp, &have, &want, &mut r)?;
        // (B) writes: backends, names, slots and memberships, the tables, then frontends.
        repair_entries(dp, &have, &want, &mut r)?;
        self.repair_tables(dp, &mut r)?;
        repair_frontends(dp, &have, &want, &mut r)?;
        // (C) stale tables and backends.
        repair_stale(dp, &have, &want, &mut r)?;
        self.orphan_service_ids.clear();
        self.orphan_backend_ids.clear();
        self.orphans = Counts::default();
        self.sweep_counters(dp);
        Ok(r)
    }

    /// Backends left unused by an interrupted write are not wanted.
    fn forget_unused_backends(&mut self) {
        let unused: Vec<u32> = self
            .backends
            .iter()
            .filter(|(_, (_, refs))| *refs == 0)
            .map(|(id, _)| *id)
            .collect();
        for id in unused {
            if let Some((b, _)) = self.backends.remove(&id) {
                self.backend_ids.remove(&b);
            }
            self.counts.backends -= 1;
        }
    }

    /// Rewrites every Maglev table whose hash differs from the one applied.
    fn repair_tables(
        &mut self,
        dp: &mut impl ServiceMaps,
        r: &mut Report,
    ) -> Result<(), DatapathError> {
        let hashing: Vec<(u32, Vec<u32>, u64)> = self
            .applied
            .values()
            .filter_map(|a| a.maglev.map(|h| (a.id, a.slots.clone(), h)))
            .collect();
        for (id, slots, h) in hashing {
            let current = dp.get_maglev(id)?.map(|t| table_hash(&t));
            if current != Some(h) {
                let t = self.table(&slots, &HashMap::new());
                dp.put_maglev(id, &t)?;
                r.writes += 1;
                // The size may have changed since: remember what is there now.
                let nh = table_hash(&t);
                if let Some(a) = self.applied.values_mut().find(|a| a.id == id) {
                    a.maglev = Some(nh);
                }
            }
        }
        Ok(())
    }

    /// Deletes the counters of ids not bound now and of (service, backend) pairs no longer
    /// in any slot, keeping their counts in the sums of what stays bound
    /// ([`ServiceMaps::sweep_stats`]): at every verification, and at start before any id
    /// is handed out, since an id an earlier agent released may be handed out again then
    /// (ids continue after the highest bound one) and must not inherit its counts. Not a
    /// repair (the programs wrote them); a failure leaves entries, or a count to move, for
    /// the next verification, so it is logged, not returned.
    pub fn sweep_counters(&self, dp: &mut impl ServiceMaps) {
        let pairs: HashSet<(u32, u32)> = self
            .applied
            .values()
            .flat_map(|a| a.slots.iter().map(move |b| (a.id, *b)))
            .collect();
        let bound = crate::datapath::Bound {
            service: &|id| self.ids_in_use.contains(&id),
            backend: &|id| self.backends.contains_key(&id),
            member: &|s, b| pairs.contains(&(s, b)),
        };
        match dp.sweep_stats(&bound) {
            Ok(0) => {}
            Ok(n) => tracing::debug!(entries = n, "counters of released ids deleted"),
            Err(e) => {
                tracing::warn!(error = %e, "sweeping the counters of released ids and endpoints failed; retried at the next verification")
            }
        }
    }
}

/// (A) Removes memberships, frontends (real ones before VIP markers), slots and names that
/// are not wanted.
fn repair_removals(
    dp: &mut impl ServiceMaps,
    have: &Snapshot,
    want: &Snapshot,
    r: &mut Report,
) -> Result<(), DatapathError> {
    for k in have
        .members
        .keys()
        .filter(|k| !want.members.contains_key(k))
    {
        dp.delete_member(k)?;
        r.deletes += 1;
    }
    let stale_fe: Vec<&FrontendKey> = have
        .frontends
        .keys()
        .filter(|k| !want.frontends.contains_key(k))
        .collect();
    for k in stale_fe
        .iter()
        .filter(|k| k.proto != 0)
        .chain(stale_fe.iter().filter(|k| k.proto == 0))
    {
        dp.delete_frontend(k)?;
        r.deletes += 1;
    }
    for k in have.slots.keys().filter(|k| !want.slots.contains_key(k)) {
        dp.delete_slot(k)?;
        r.deletes += 1;
    }
    for id in have.names.keys().filter(|id| !want.names.contains_key(id)) {
        dp.delete_name(*id)?;
        r.deletes += 1;
    }
    Ok(())
}

/// (B) Writes the backends, names, slots (also those whose copy of their backend is stale)
/// and memberships that are missing or differ.
fn repair_entries(
    dp: &mut impl ServiceMaps,
    have: &Snapshot,
    want: &Snapshot,
    r: &mut Report,
) -> Result<(), DatapathError> {
    for (id, b) in &want.backends {
        if have.backends.get(id) != Some(b) {
            dp.put_backend(*id, b)?;
            r.writes += 1;
        }
    }
    for (id, n) in &want.names {
        if have.names.get(id) != Some(n) {
            dp.put_name(*id, n)?;
            r.writes += 1;
        }
    }
    for (k, b) in &want.slots {
        if have.slots.get(k) != Some(b) || have.stale_slots.contains(k) {
            let backend = *want.backends.get(b).ok_or_else(|| unknown_backend(*b))?;
            dp.put_slot(
                k,
                &BackendSlot {
                    backend_id: *b,
                    backend,
                },
            )?;
            r.writes += 1;
        }
    }
    for (k, w) in &want.members {
        if have.members.get(k) != Some(w) {
            dp.put_member(k, *w)?;
            r.writes += 1;
        }
    }
    Ok(())
}

/// (B) Writes the frontends that are missing or differ, VIP markers first.
fn repair_frontends(
    dp: &mut impl ServiceMaps,
    have: &Snapshot,
    want: &Snapshot,
    r: &mut Report,
) -> Result<(), DatapathError> {
    let (markers, real): (Vec<_>, Vec<_>) = want.frontends.iter().partition(|(k, _)| k.proto == 0);
    for (k, v) in markers.into_iter().chain(real) {
        if have.frontends.get(k) != Some(v) {
            dp.put_frontend(k, v)?;
            r.writes += 1;
        }
    }
    Ok(())
}

/// (C) Removes the Maglev tables and backends that are not wanted.
fn repair_stale(
    dp: &mut impl ServiceMaps,
    have: &Snapshot,
    want: &Snapshot,
    r: &mut Report,
) -> Result<(), DatapathError> {
    for id in have.maglev.difference(&want.maglev) {
        dp.delete_maglev(*id)?;
        r.deletes += 1;
    }
    for id in have
        .backends
        .keys()
        .filter(|id| !want.backends.contains_key(id))
    {
        dp.delete_backend(*id)?;
        r.deletes += 1;
    }
    Ok(())
}
