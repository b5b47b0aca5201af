//! The reconciler's record of what the maps hold: after a key's write, its backends, slot
//! references, frontend owners, VIP references and entry counts; the counts feed the
//! capacity check and the VIP references decide when a marker comes and goes.

use std::collections::{BTreeMap, BTreeSet};

use proxy_common::{FrontendKey, PROTO_UDP};

use super::{Applied, Plan, Report, ServiceReconciler};
use crate::datapath::vip::has_marker;

impl ServiceReconciler {
    /// Records plan `p` after its writes; `old` is what its key held before. Backends first
    /// known now are recorded, slot references moved (a backend left without one goes to
    /// `unused`), UDP backends that left the key reported for release.
    pub(super) fn record(
        &mut self,
        p: Plan,
        old: &Applied,
        unused: &mut BTreeSet<u32>,
        report: &mut Report,
    ) {
        let id = p.id;
        let new_slots: &[u32] = p.new.as_ref().map(|t| t.slots.as_slice()).unwrap_or(&[]);
        let old_set: BTreeSet<u32> = old.slots.iter().copied().collect();
        let new_set: BTreeSet<u32> = new_slots.iter().copied().collect();
        // Backends first known now, references, then unused backends.
        for (bid, b) in &p.new_backends {
            self.backends.insert(*bid, (*b, 0));
            self.backend_ids.insert(*b, *bid);
            self.counts.backends += 1;
        }
        for b in new_slots {
            if let Some(e) = self.backends.get_mut(b) {
                e.1 += 1;
            }
        }
        for b in &old.slots {
            if let Some(e) = self.backends.get_mut(b) {
                e.1 = e.1.saturating_sub(1);
                if e.1 == 0 {
                    unused.insert(*b);
                }
            }
        }
        for bid in old_set.difference(&new_set) {
            if let Some((b, _)) = self.backends.get(bid)
                && b.proto == PROTO_UDP
            {
                report.released.push((id, *bid, *b));
            }
        }
        if let Some(a) = self.applied.get(&p.key).cloned() {
            self.account(&a, -1);
            for (k, _) in &a.frontends {
                if self.fe_owner.get(k) == Some(&id) {
                    self.fe_owner.remove(k);
                }
            }
        }
        match p.new {
            Some(t) => {
                for (k, _) in &t.frontends {
                    self.fe_owner.insert(*k, id);
                }
                self.keys_by_id.insert(id, p.key.clone());
                let a = Applied {
                    id,
                    slots: t.slots,
                    frontends: t.frontends,
                    members: t.members,
                    maglev: t.table.map(|(_, h)| h),
                };
                self.account(&a, 1);
                self.ids_in_use.insert(id);
                self.applied.insert(p.key, a);
            }
            None => {
                self.ids_in_use.remove(&id);
                self.keys_by_id.remove(&id);
                self.applied.remove(&p.key);
            }
        }
    }

    /// Frontend `k` was just written for service id `id`: when another key held it (it moves
    /// between Services in one batch), that key no longer does, so its later removal of the
    /// frontend does not undo this write. Returns the frontend's address when the other key
    /// held it as a cluster IP (its VIP reference is gone; the caller removes the marker once
    /// nothing refers to the VIP).
    pub(super) fn take_over(&mut self, k: &FrontendKey, id: u32) -> Option<[u8; 16]> {
        let &other = self.fe_owner.get(k)?;
        if other == id {
            return None;
        }
        self.fe_owner.insert(*k, id);
        let okey = self.keys_by_id.get(&other).cloned()?;
        let a = self.applied.get_mut(&okey)?;
        let pos = a.frontends.iter().position(|(fk, _)| fk == k)?;
        let (_, v) = a.frontends.remove(pos);
        let removed = Applied {
            id: other,
            slots: Vec::new(),
            frontends: vec![(*k, v)],
            members: BTreeMap::new(),
            maglev: None,
        };
        // Its frontend (and a VIP reference) leave the other key's count; its name stays.
        self.account(&removed, -1);
        self.counts.names += 1;
        has_marker(&v).then_some(k.addr)
    }

    /// Adds (`sign` 1) or removes (-1) a key's entries from the counts and VIP references.
    pub(super) fn account(&mut self, a: &Applied, sign: i64) {
        self.counts.slots += sign * a.slots.len() as i64;
        self.counts.names += sign;
        self.counts.frontends += sign * a.frontends.len() as i64;
        for (k, f) in &a.frontends {
            if has_marker(f) {
                let r = self.vip_refs.entry(k.addr).or_default();
                if sign > 0 {
                    if *r == 0 {
                        self.counts.frontends += 1;
                    }
                    *r += 1;
                } else {
                    *r -= 1;
                    if *r == 0 {
                        self.vip_refs.remove(&k.addr);
                        self.counts.frontends -= 1;
                    }
                }
            }
        }
    }
}
