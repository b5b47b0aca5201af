//! Writing one key's plan in the safe order of the module documentation: (A) removals,
//! (B) writes, (C) stale entries; and, once every key of the Service is written, the
//! backends no slot refers to any more.

use std::collections::{BTreeMap, BTreeSet};

use proxy_common::{BackendSlot, BackendSlotKey, Frontend, FrontendKey, MemberKey};

use super::{Applied, Plan, Report, ServiceReconciler, service_name};
use crate::datapath::{
    DatapathError, ServiceMaps,
    vip::{MARKER, has_marker, marker_key},
};

/// A slot names a backend id whose value the reconciler does not know (a broken invariant:
/// ids come with their values). Reported as a failed `BACKEND_SLOTS` update, so the
/// service's write fails cleanly instead of writing a slot without its backend.
pub(super) fn unknown_backend(id: u32) -> DatapathError {
    DatapathError::Map {
        op: "update",
        map: "BACKEND_SLOTS",
        error: std::io::Error::other(format!("backend id {id} has no known value")),
    }
}

/// One key's write: what it holds now, what it will hold, and the VIP markers that go or
/// come with it.
struct Change<'a> {
    id: u32,
    /// What the key holds now: a frontend of it may have been taken over by a key written
    /// earlier in this batch.
    old: Applied,
    /// What it will hold (nothing for a removed key).
    slots: Vec<u32>,
    frontends: Vec<(FrontendKey, Frontend)>,
    members: BTreeMap<u32, u32>,
    table: Option<&'a (Vec<u32>, u64)>,
    /// Its frontends after and before, by key.
    new_keys: BTreeMap<FrontendKey, Frontend>,
    old_keys: BTreeMap<FrontendKey, Frontend>,
    /// VIP markers no frontend refers to after this plan.
    marker_del: Vec<[u8; 16]>,
    /// VIP markers first referred to by this plan.
    marker_add: Vec<[u8; 16]>,
}

impl ServiceReconciler {
    /// Writes one plan in the safe order and records it; backends left without a slot are
    /// added to `unused` (removed by [`ServiceReconciler::remove_unused_backends`]).
    pub(super) fn write(
        &mut self,
        dp: &mut impl ServiceMaps,
        p: Plan,
        unused: &mut BTreeSet<u32>,
        report: &mut Report,
    ) -> Result<(), DatapathError> {
        let c = self.change(&p);
        self.remove_unwanted(dp, &p, &c, report)?;
        // Addresses whose cluster-IP frontend this key took over from another Service.
        let mut taken_vips = Vec::new();
        if p.new.is_some() {
            taken_vips = self.put_wanted(dp, &p, &c, report)?;
            remove_stale(dp, &c, report)?;
        }
        let old = c.old;
        self.record(p, &old, unused, report);
        // A VIP whose last cluster-IP frontend became another key's external address or
        // node port loses its marker (other ports of the address are no longer refused).
        for a in taken_vips {
            if self.vip_refs.get(&a).is_none_or(|n| *n == 0) {
                dp.delete_frontend(&marker_key(a))?;
                report.deletes += 1;
            }
        }
        Ok(())
    }

    /// What plan `p` changes for its key, the VIP markers included.
    fn change<'a>(&self, p: &'a Plan) -> Change<'a> {
        let id = p.id;
        let empty = Applied {
            id,
            slots: Vec::new(),
            frontends: Vec::new(),
            members: BTreeMap::new(),
            maglev: None,
        };
        let old = self
            .applied
            .get(&p.key)
            .cloned()
            .or_else(|| p.old.clone())
            .unwrap_or(empty);
        let (slots, frontends, members, table) = match &p.new {
            Some(t) => (
                t.slots.clone(),
                t.frontends.clone(),
                t.members.clone(),
                t.table.as_ref(),
            ),
            None => (Vec::new(), Vec::new(), BTreeMap::new(), None),
        };
        let new_keys: BTreeMap<FrontendKey, Frontend> = frontends.iter().copied().collect();
        let old_keys: BTreeMap<FrontendKey, Frontend> = old.frontends.iter().copied().collect();
        // VIP markers after this plan.
        let mut vip_after: BTreeMap<[u8; 16], i64> = BTreeMap::new();
        for (k, f) in old
            .frontends
            .iter()
            .filter(|(k, _)| !new_keys.contains_key(k))
        {
            if has_marker(f) {
                *vip_after
                    .entry(k.addr)
                    .or_insert_with(|| *self.vip_refs.get(&k.addr).unwrap_or(&0) as i64) -= 1;
            }
        }
        for (k, f) in frontends.iter().filter(|(k, _)| !old_keys.contains_key(k)) {
            if has_marker(f) {
                *vip_after
                    .entry(k.addr)
                    .or_insert_with(|| *self.vip_refs.get(&k.addr).unwrap_or(&0) as i64) += 1;
            }
        }
        let had_marker = |a: &[u8; 16]| self.vip_refs.get(a).is_some_and(|n| *n > 0);
        let marker_del: Vec<[u8; 16]> = vip_after
            .iter()
            .filter(|(a, n)| **n <= 0 && had_marker(a))
            .map(|(a, _)| *a)
            .collect();
        let marker_add: Vec<[u8; 16]> = vip_after
            .iter()
            .filter(|(a, n)| **n > 0 && !had_marker(a))
            .map(|(a, _)| *a)
            .collect();
        Change {
            id,
            old,
            slots,
            frontends,
            members,
            table,
            new_keys,
            old_keys,
            marker_del,
            marker_add,
        }
    }

    /// (A) Removals: memberships, frontends this key still owns and VIP markers no longer
    /// wanted; a removed key also loses its slots, name and table.
    fn remove_unwanted(
        &self,
        dp: &mut impl ServiceMaps,
        p: &Plan,
        c: &Change,
        report: &mut Report,
    ) -> Result<(), DatapathError> {
        let id = c.id;
        // Memberships first: affinity and Maglev stop choosing a leaving backend before its
        // slot goes.
        for bid in c.old.members.keys() {
            if !c.members.contains_key(bid) {
                dp.delete_member(&MemberKey {
                    service_id: id,
                    backend_id: *bid,
                })?;
                report.deletes += 1;
            }
        }
        for (k, _) in c
            .old
            .frontends
            .iter()
            .filter(|(k, _)| !c.new_keys.contains_key(k))
        {
            if self.fe_owner.get(k) == Some(&id) {
                dp.delete_frontend(k)?;
                report.deletes += 1;
            }
        }
        for a in &c.marker_del {
            dp.delete_frontend(&marker_key(*a))?;
            report.deletes += 1;
        }
        if p.new.is_none() {
            for slot in 0..c.old.slots.len() as u32 {
                dp.delete_slot(&BackendSlotKey {
                    service_id: id,
                    slot,
                })?;
                report.deletes += 1;
            }
            dp.delete_name(id)?;
            report.deletes += 1;
            if c.old.maglev.is_some() {
                dp.delete_maglev(id)?;
                report.deletes += 1;
            }
        }
        Ok(())
    }

    /// (B) Writes: new backends, the name, changed slots, memberships, the Maglev table, new
    /// VIP markers, then the frontends (a frontend carries the backend count, so it comes
    /// after its slots). Returns the addresses whose cluster-IP frontend this key took over
    /// from another key.
    fn put_wanted(
        &mut self,
        dp: &mut impl ServiceMaps,
        p: &Plan,
        c: &Change,
        report: &mut Report,
    ) -> Result<Vec<[u8; 16]>, DatapathError> {
        let id = c.id;
        for (bid, b) in &p.new_backends {
            dp.put_backend(*bid, b)?;
            report.writes += 1;
        }
        if p.new_id {
            dp.put_name(id, &service_name(&p.key))?;
            report.writes += 1;
        }
        for (i, bid) in c.slots.iter().enumerate() {
            if c.old.slots.get(i) != Some(bid) {
                // Backends first known in this plan are recorded after the writes.
                let backend = p
                    .new_backends
                    .iter()
                    .find(|(n, _)| n == bid)
                    .map(|(_, b)| *b)
                    .or_else(|| self.backends.get(bid).map(|(b, _)| *b))
                    .ok_or_else(|| unknown_backend(*bid))?;
                dp.put_slot(
                    &BackendSlotKey {
                        service_id: id,
                        slot: i as u32,
                    },
                    &BackendSlot {
                        backend_id: *bid,
                        backend,
                    },
                )?;
                report.writes += 1;
            }
        }
        for (bid, w) in &c.members {
            if c.old.members.get(bid) != Some(w) {
                dp.put_member(
                    &MemberKey {
                        service_id: id,
                        backend_id: *bid,
                    },
                    *w,
                )?;
                report.writes += 1;
            }
        }
        if let Some((table, h)) = c.table
            && c.old.maglev != Some(*h)
        {
            dp.put_maglev(id, table)?;
            report.writes += 1;
        }
        // Markers first: a new VIP refuses undefined ports from its first moment.
        for a in &c.marker_add {
            dp.put_frontend(&marker_key(*a), &MARKER)?;
            report.writes += 1;
        }
        let mut taken_vips = Vec::new();
        for (k, v) in &c.frontends {
            if c.old_keys.get(k) != Some(v) {
                dp.put_frontend(k, v)?;
                report.writes += 1;
                taken_vips.extend(self.take_over(k, id));
            }
        }
        Ok(taken_vips)
    }

    /// Removes, after every key of a Service is written, the backends no slot refers to any
    /// more (one may have moved from a removed key to another).
    pub(super) fn remove_unused_backends(
        &mut self,
        dp: &mut impl ServiceMaps,
        unused: BTreeSet<u32>,
        report: &mut Report,
    ) -> Result<(), DatapathError> {
        for bid in unused {
            if self.backends.get(&bid).is_some_and(|(_, r)| *r == 0) {
                dp.delete_backend(bid)?;
                report.deletes += 1;
                if let Some((b, _)) = self.backends.remove(&bid) {
                    self.backend_ids.remove(&b);
                }
                self.counts.backends -= 1;
            }
        }
        Ok(())
    }
}

/// (C) Stale entries of a key that stays: its Maglev table when it no longer hashes, then
/// the slots past its new count.
fn remove_stale(
    dp: &mut impl ServiceMaps,
    c: &Change,
    report: &mut Report,
) -> Result<(), DatapathError> {
    if c.old.maglev.is_some() && c.table.is_none() {
        dp.delete_maglev(c.id)?;
        report.deletes += 1;
    }
    for slot in c.slots.len()..c.old.slots.len() {
        dp.delete_slot(&BackendSlotKey {
            service_id: c.id,
            slot: slot as u32,
        })?;
        report.deletes += 1;
    }
    Ok(())
}
