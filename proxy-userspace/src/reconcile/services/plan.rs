//! Planning: what every key of one Service will hold (slots, frontends, memberships, Maglev
//! table), from its desired state and what it holds now, before anything is written.

use foldhash::HashMap;
use std::{
    collections::{BTreeMap, BTreeSet},
    hash::{Hash, Hasher},
    net::SocketAddr,
};

use proxy_common::{Backend, Frontend, FrontendKey, PROTO_UDP};

use super::{
    Applied, Plan, ServiceReconciler, Target,
    ids::{BatchIds, KeyBackends},
};
use crate::{
    datapath::addr::{ip_to_bytes, port_to_map},
    model::{Algorithm, DesiredService, Protocol, Scope, ServicePortKey},
};

/// The `FRONTENDS` key of the frontend `addr` of a key of protocol `proto` and scope `scope`.
fn frontend_key(addr: &SocketAddr, proto: Protocol, scope: Scope) -> FrontendKey {
    FrontendKey {
        addr: ip_to_bytes(addr.ip()),
        port: port_to_map(addr.port()),
        proto: proto.number(),
        scope: scope.key_scope(),
    }
}

/// The frontend value of service id `id` with `count` slots, in affinity group `group`.
fn frontend_value(id: u32, count: usize, svc: &DesiredService, group: u32) -> Frontend {
    Frontend {
        service_id: id,
        backend_count: count as u32,
        flags: svc.flags,
        algorithm: svc.algorithm as u8,
        _pad: [0; 3],
        affinity_timeout_s: svc.affinity_timeout_s,
        affinity_group: if svc.affinity_timeout_s != 0 {
            group
        } else {
            0
        },
    }
}

/// The key whose service id names the affinity group of `key`: its cluster IP set.
fn group_key(key: &ServicePortKey) -> ServicePortKey {
    ServicePortKey {
        scope: Scope::Internal,
        ..key.clone()
    }
}

/// Slots of a service: smooth weighted round-robin order for `weighted-round-robin` (each
/// backend `weight` times, interleaved as nginx does, so successive slots spread the
/// weights), else [`arrange_slots`] (survivors keep their slot).
fn plan_slots(svc: &DesiredService, old: &[u32], bids: &[(SocketAddr, u32)]) -> Vec<u32> {
    if svc.algorithm != Algorithm::WeightedRoundRobin {
        let set: BTreeSet<u32> = bids.iter().map(|(_, b)| *b).collect();
        return arrange_slots(old, &set);
    }
    let items: Vec<(u32, i64)> = bids
        .iter()
        .map(|(a, b)| (*b, *svc.weights.get(a).unwrap_or(&1) as i64))
        .collect();
    let total: i64 = items.iter().map(|(_, w)| w).sum();
    let mut current = vec![0i64; items.len()];
    let mut out = Vec::with_capacity(total as usize);
    for _ in 0..total {
        let mut best = 0;
        for (i, (_, w)) in items.iter().enumerate() {
            current[i] += w;
            if current[i] > current[best] {
                best = i;
            }
        }
        current[best] -= total;
        out.push(items[best].0);
    }
    out
}

/// New slot order for a service: survivors keep their slot, new backends fill holes, then
/// the tail moves into holes that are left.
pub fn arrange_slots(old: &[u32], wanted: &BTreeSet<u32>) -> Vec<u32> {
    let mut placed = BTreeSet::new();
    let mut new: Vec<Option<u32>> = old
        .iter()
        .map(|b| (wanted.contains(b) && placed.insert(*b)).then_some(*b))
        .collect();
    let mut adds = wanted.iter().filter(|b| !placed.contains(b)).copied();
    for slot in new.iter_mut() {
        if slot.is_none() {
            *slot = adds.next();
        }
    }
    new.extend(adds.map(Some));
    // Compact: move the last filled slot into the first hole until none is left.
    loop {
        while matches!(new.last(), Some(None)) {
            new.pop();
        }
        match new.iter().position(Option::is_none) {
            Some(hole) => {
                new[hole] = new.pop().flatten();
            }
            None => break,
        }
    }
    new.into_iter().flatten().collect()
}

/// True for algorithms that read a Maglev table.
fn is_hashing(a: Algorithm) -> bool {
    a.uses_table()
}

/// True for keys whose backends must be in `MEMBERS` (affinity, the tables and the
/// least-load algorithms read it).
fn needs_members(svc: &DesiredService) -> bool {
    svc.affinity_timeout_s != 0 || svc.algorithm.reads_members()
}

/// The `MEMBERS` entries of a key: backend id -> weight (1 where the key has no weights);
/// empty for a key that needs none.
fn plan_members(svc: &DesiredService, bids: &[(SocketAddr, u32)]) -> BTreeMap<u32, u32> {
    if !needs_members(svc) {
        return BTreeMap::new();
    }
    bids.iter()
        .map(|(a, b)| (*b, svc.weights.get(a).copied().unwrap_or(1).max(1)))
        .collect()
}

/// A backend's name for Maglev: `address:port/PROTOCOL`, the same on every node.
fn backend_name(b: &Backend) -> String {
    let addr = crate::datapath::addr::to_socket_addr(b.addr, b.port);
    let proto = if b.proto == PROTO_UDP { "UDP" } else { "TCP" };
    format!("{addr}/{proto}")
}

/// A hash of a Maglev table, kept instead of the table to tell whether it changed.
pub(super) fn table_hash(table: &[u32]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    table.hash(&mut h);
    h.finish()
}

impl ServiceReconciler {
    /// The Maglev table of a key with these slots; the values of backends not recorded yet
    /// (new in this batch) come from `local`.
    pub(super) fn table(&self, slots: &[u32], local: &HashMap<u32, Backend>) -> Vec<u32> {
        let names: Vec<(u32, String)> = slots
            .iter()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .filter_map(|bid| {
                self.backends
                    .get(bid)
                    .map(|(b, _)| b)
                    .or_else(|| local.get(bid))
                    .map(|b| (*bid, backend_name(b)))
            })
            .collect();
        let size = if self.maglev_size == 0 {
            proxy_common::MAGLEV_DEFAULT
        } else {
            self.maglev_size
        };
        crate::maglev::table(&names, size)
    }

    /// Plans the keys of one Service (`None` removes a key), removals first: they free
    /// entries the others may need. New ids are handed out here and recorded only when
    /// their plan is written.
    pub(super) fn plan(
        &mut self,
        items: &[(ServicePortKey, Option<&DesiredService>)],
    ) -> Vec<Plan> {
        let mut order: Vec<&(ServicePortKey, Option<&DesiredService>)> = items.iter().collect();
        order.sort_by_key(|(k, d)| (d.is_some(), k.clone()));
        let mut batch = BatchIds::default();
        let mut plans = Vec::new();
        for (key, desired) in order {
            let old = self.applied.get(key).cloned();
            let Some(svc) = desired else {
                if let Some(old) = old {
                    plans.push(Plan {
                        key: key.clone(),
                        id: old.id,
                        new_id: false,
                        old: Some(old),
                        new: None,
                        new_backends: Vec::new(),
                    });
                }
                continue;
            };
            plans.push(self.plan_key(&mut batch, key, svc, old));
        }
        plans
    }

    /// Plans `key` to hold `svc`; `old` is what it holds now.
    fn plan_key(
        &mut self,
        batch: &mut BatchIds,
        key: &ServicePortKey,
        svc: &DesiredService,
        old: Option<Applied>,
    ) -> Plan {
        let (id, new_id) = self.service_id(batch, key, old.as_ref());
        let KeyBackends {
            ids: bids,
            new: new_backends,
        } = self.backend_ids(batch, key.protocol, svc);
        let old_slots = old.as_ref().map(|a| a.slots.as_slice()).unwrap_or(&[]);
        let slots = plan_slots(svc, old_slots, &bids);
        let gk = group_key(key);
        let group = batch
            .service_ids
            .get(&gk)
            .copied()
            .or_else(|| self.id_of(&gk))
            .unwrap_or(id);
        let mut frontends: Vec<(FrontendKey, Frontend)> = svc
            .frontends
            .iter()
            .map(|fe| {
                (
                    frontend_key(fe, key.protocol, key.scope),
                    frontend_value(id, slots.len(), svc, group),
                )
            })
            .collect();
        frontends.sort_by_key(|(k, _)| *k);
        let table = is_hashing(svc.algorithm).then(|| {
            let t = self.table(&slots, &batch.backends);
            let h = table_hash(&t);
            (t, h)
        });
        Plan {
            key: key.clone(),
            id,
            new_id,
            old,
            new: Some(Target {
                members: plan_members(svc, &bids),
                slots,
                frontends,
                table,
            }),
            new_backends,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrange_keeps_survivors_in_place() {
        let set = |v: &[u32]| v.iter().copied().collect::<BTreeSet<_>>();
        assert_eq!(arrange_slots(&[], &set(&[3, 1, 2])), vec![1, 2, 3]);
        assert_eq!(arrange_slots(&[1, 2, 3], &set(&[1, 2, 3])), vec![1, 2, 3]);
        // Remove the middle one: the last moves into its hole.
        assert_eq!(arrange_slots(&[1, 2, 3], &set(&[1, 3])), vec![1, 3]);
        // Replace: the new one takes the hole.
        assert_eq!(arrange_slots(&[1, 2, 3], &set(&[1, 3, 4])), vec![1, 4, 3]);
        // Grow.
        assert_eq!(arrange_slots(&[1, 2], &set(&[1, 2, 5])), vec![1, 2, 5]);
        assert_eq!(arrange_slots(&[1, 2, 3], &set(&[])), Vec::<u32>::new());
        assert_eq!(arrange_slots(&[1, 2, 3, 4], &set(&[4])), vec![4]);
    }
}
