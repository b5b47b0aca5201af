//! The capacity check: the keys of one Service are written only when every map can hold the
//! peak number of entries their steps need; a Service that does not fit is refused whole
//! with [`DatapathError::Full`], before anything is written.

use foldhash::{HashMap, HashMapExt, HashSet};

use proxy_common::FrontendKey;

use super::{Counts, Plan, ServiceReconciler};
use crate::datapath::{Capacity, DatapathError, vip::has_marker};

impl ServiceReconciler {
    /// Refuses plans whose peak entry counts exceed the maps' limits, or whose largest key
    /// exceeds `MAX_BACKENDS_PER_SERVICE`, naming the map, the limit and the flag that raises
    /// it. Steps run in plan order, each key's removals before its additions.
    pub(super) fn check_capacity(
        &self,
        cap: Capacity,
        plans: &[Plan],
    ) -> Result<(), DatapathError> {
        let mut run = Counts {
            frontends: self.counts.frontends + self.orphans.frontends,
            slots: self.counts.slots + self.orphans.slots,
            backends: self.counts.backends + self.orphans.backends,
            names: self.counts.names + self.orphans.names,
        };
        let mut peak = run;
        let mut vips: HashMap<[u8; 16], i64> = HashMap::new();
        let mut largest = 0;
        for p in plans {
            let empty = Vec::new();
            let old_fe = p.old.as_ref().map(|a| &a.frontends).unwrap_or(&empty);
            let new_fe = p.new.as_ref().map(|t| &t.frontends).unwrap_or(&empty);
            let old_keys: HashSet<&FrontendKey> = old_fe.iter().map(|(k, _)| k).collect();
            let new_keys: HashSet<&FrontendKey> = new_fe.iter().map(|(k, _)| k).collect();
            let vip = |vips: &mut HashMap<[u8; 16], i64>, a: [u8; 16]| -> i64 {
                *vips
                    .entry(a)
                    .or_insert_with(|| *self.vip_refs.get(&a).unwrap_or(&0) as i64)
            };
            // (A) removals.
            for (k, f) in old_fe.iter().filter(|(k, _)| !new_keys.contains(k)) {
                run.frontends -= 1;
                if has_marker(f) {
                    let n = vip(&mut vips, k.addr);
                    vips.insert(k.addr, n - 1);
                    if n == 1 {
                        run.frontends -= 1;
                    }
                }
            }
            let old_slots = p.old.as_ref().map(|a| a.slots.len()).unwrap_or(0) as i64;
            let new_slots = p.new.as_ref().map(|t| t.slots.len()).unwrap_or(0) as i64;
            if p.new.is_none() {
                run.slots -= old_slots;
                run.names -= 1;
            }
            // (B) additions.
            if p.new_id {
                run.names += 1;
            }
            run.backends += p.new_backends.len() as i64;
            run.slots += (new_slots - old_slots).max(0);
            for (k, f) in new_fe.iter().filter(|(k, _)| !old_keys.contains(k)) {
                run.frontends += 1;
                if has_marker(f) {
                    let n = vip(&mut vips, k.addr);
                    vips.insert(k.addr, n + 1);
                    if n == 0 {
                        run.frontends += 1;
                    }
                }
            }
            peak.frontends = peak.frontends.max(run.frontends);
            peak.slots = peak.slots.max(run.slots);
            peak.backends = peak.backends.max(run.backends);
            peak.names = peak.names.max(run.names);
            // (C) stale slots (backends nothing uses are removed after every key).
            if p.new.is_some() {
                run.slots -= (old_slots - new_slots).max(0);
            }
            largest = largest.max(new_slots as usize);
        }
        let checks = [
            ("FRONTENDS", peak.frontends, cap.frontends, "max-frontends"),
            ("BACKEND_SLOTS", peak.slots, cap.slots, "max-backend-slots"),
            ("BACKENDS", peak.backends, cap.backends, "max-backends"),
            ("SERVICE_NAMES", peak.names, cap.services, "max-frontends"),
            (
                "BACKEND_SLOTS (per service)",
                largest as i64,
                proxy_common::MAX_BACKENDS_PER_SERVICE,
                "max-backend-slots",
            ),
        ];
        for (map, needed, limit, flag) in checks {
            if needed > limit as i64 {
                return Err(DatapathError::Full {
                    map,
                    needed: needed as usize,
                    limit,
                    flag,
                });
            }
        }
        Ok(())
    }
}
