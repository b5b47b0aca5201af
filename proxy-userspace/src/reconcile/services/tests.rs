//! Tests of the service writer as a whole: every write order, restart, verification and
//! capacity rule of the module documentation, against the in-memory data path.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
};

use proxy_common::{BackendSlotKey, FRONTEND_F_EXTERNAL, Frontend, FrontendKey, MemberKey};

use super::{Report, ServiceReconciler, ids::backend_value};
use crate::datapath::{
    Capacity, DatapathError, ServiceMaps, Snapshot,
    fake::{FakeDatapath, Moment, Op, consistency_violations},
};
use crate::model::{
    Algorithm, DesiredService, DesiredState, Family, Protocol, Scope, ServicePortKey,
};

pub(crate) type Tables = BTreeMap<u32, Vec<u32>>;

/// The old whole-state entry point, for tests: applies every key of `d` and removes the
/// keys it lacks, Service by Service; the first error is returned (after every Service
/// was tried).
fn sync(
    s: &mut ServiceReconciler,
    dp: &mut FakeDatapath,
    d: &DesiredState,
) -> Result<Report, DatapathError> {
    let mut keys: BTreeSet<ServicePortKey> = d.services.keys().cloned().collect();
    keys.extend(s.keys().cloned());
    let mut r = Report::default();
    let mut err = None;
    let mut group: Vec<(ServicePortKey, Option<&DesiredService>)> = Vec::new();
    let mut flush = |group: &mut Vec<(ServicePortKey, Option<&DesiredService>)>,
                     s: &mut ServiceReconciler,
                     dp: &mut FakeDatapath,
                     r: &mut Report| {
        if !group.is_empty() {
            if let Err(e) = s.apply_service(dp, group, r) {
                err.get_or_insert(e);
            }
            group.clear();
        }
    };
    for k in keys {
        if group
            .first()
            .is_some_and(|(g, _)| (&g.namespace, &g.name) != (&k.namespace, &k.name))
        {
            flush(&mut group, s, dp, &mut r);
        }
        let v = d.services.get(&k);
        group.push((k, v));
    }
    flush(&mut group, s, dp, &mut r);
    match err {
        Some(e) => Err(e),
        None => Ok(r),
    }
}

fn cap() -> Capacity {
    Capacity {
        frontends: 100,
        slots: 100,
        backends: 100,
        services: 100,
    }
}

pub(super) fn key(name: &str, proto: Protocol) -> ServicePortKey {
    ServicePortKey {
        namespace: "default".into(),
        name: name.into(),
        port_name: "http".into(),
        protocol: proto,
        family: Family::V4,
        scope: Scope::Internal,
    }
}

fn svc(frontends: &[&str], backends: &[&str]) -> DesiredService {
    DesiredService {
        frontends: frontends.iter().map(|s| s.parse().unwrap()).collect(),
        backends: backends.iter().map(|s| s.parse().unwrap()).collect(),
        flags: 0,
        ..Default::default()
    }
}

fn state(items: Vec<(ServicePortKey, DesiredService)>) -> DesiredState {
    DesiredState {
        services: items.into_iter().collect(),
    }
}

/// Replays the op log and checks the maps after every single write
/// ([`consistency_violations`] at [`Moment::AnyWrite`]), then at rest after the last.
pub(crate) fn assert_every_step_consistent(log: &[Op], start: &Snapshot, start_tables: &Tables) {
    let mut s = start.clone();
    let mut tables = start_tables.clone();
    for (i, op) in log.iter().enumerate() {
        match op {
            Op::PutFrontend(k, v) => drop(s.frontends.insert(*k, *v)),
            Op::DeleteFrontend(k) => drop(s.frontends.remove(k)),
            Op::PutSlot(k, v) => drop(s.slots.insert(*k, *v)),
            Op::DeleteSlot(k) => drop(s.slots.remove(k)),
            Op::PutBackend(k, v) => drop(s.backends.insert(*k, *v)),
            Op::DeleteBackend(k) => drop(s.backends.remove(k)),
            Op::PutName(k, v) => drop(s.names.insert(*k, v.clone())),
            Op::DeleteName(k) => drop(s.names.remove(k)),
            Op::PutMember(k, w) => drop(s.members.insert(*k, *w)),
            Op::DeleteMember(k) => drop(s.members.remove(k)),
            Op::PutMaglev(id, t) => {
                s.maglev.insert(*id);
                tables.insert(*id, t.clone());
            }
            Op::DeleteMaglev(id) => {
                s.maglev.remove(id);
                tables.remove(id);
            }
            _ => {}
        }
        let v = consistency_violations(&s, &tables, Moment::AnyWrite);
        assert!(v.is_empty(), "after write {i} ({op:?}): {v:#?}");
    }
    let v = consistency_violations(&s, &tables, Moment::AtRest);
    assert!(v.is_empty(), "at rest: {v:#?}");
}

#[test]
fn removed_udp_backends_are_reported_for_release_and_tcp_ones_are_not() {
    for incremental in [false, true] {
        let mut dp = FakeDatapath::new(cap());
        let mut s = ServiceReconciler::adopt(&dp).unwrap();
        let both = |udp: &[&str], tcp: &[&str]| {
            state(vec![
                (key("dns", Protocol::Udp), svc(&["10.96.0.10:53"], udp)),
                (key("dns", Protocol::Tcp), svc(&["10.96.0.10:53"], tcp)),
            ])
        };
        let st = sync(
            &mut s,
            &mut dp,
            &both(&["10.0.0.1:53", "10.0.0.2:53"], &["10.0.0.1:53"]),
        )
        .unwrap();
        assert!(st.released.is_empty());
        if !incremental {
            s = ServiceReconciler::adopt(&dp).unwrap(); // the next sync is a full one
        }
        let udp_id = s.id_of(&key("dns", Protocol::Udp)).unwrap();
        let st = sync(&mut s, &mut dp, &both(&["10.0.0.2:53"], &[])).unwrap();
        assert_eq!(st.released.len(), 1, "{:?}", st.released);
        let (sid, bid, b) = st.released[0];
        assert_eq!(sid, udp_id);
        assert_eq!(
            b,
            backend_value(&"10.0.0.1:53".parse().unwrap(), Protocol::Udp)
        );
        assert_ne!(bid, 0);
        // Removing the whole UDP Service releases its last backend too.
        if !incremental {
            s = ServiceReconciler::adopt(&dp).unwrap();
        }
        let st = sync(
            &mut s,
            &mut dp,
            &state(vec![(
                key("dns", Protocol::Tcp),
                svc(&["10.96.0.10:53"], &[]),
            )]),
        )
        .unwrap();
        assert_eq!(st.released.len(), 1, "{:?}", st.released);
        assert_eq!(st.released[0].0, udp_id);
    }
}

#[test]
fn external_frontends_get_no_vip_marker_and_their_own_key_scope() {
    for incremental in [false, true] {
        let mut dp = FakeDatapath::new(cap());
        let mut s = ServiceReconciler::adopt(&dp).unwrap();
        let mut ext = svc(&["192.0.2.7:80", "192.168.1.5:30080"], &["10.0.0.1:8080"]);
        ext.flags = FRONTEND_F_EXTERNAL;
        let mut ingress = ext.clone();
        ingress.flags |= proxy_common::FRONTEND_F_LOCAL_ONLY;
        let k = |scope| ServicePortKey {
            scope,
            ..key("lb", Protocol::Tcp)
        };
        let d = state(vec![
            (
                k(Scope::Internal),
                svc(&["10.96.0.1:80"], &["10.0.0.1:8080"]),
            ),
            (k(Scope::External), ext),
            (k(Scope::Ingress), ingress),
        ]);
        if incremental {
            sync(&mut s, &mut dp, &DesiredState::default()).unwrap();
        }
        sync(&mut s, &mut dp, &d).unwrap();
        // 5 frontends and the cluster IP's VIP marker.
        assert_eq!(s.entry_counts().0, 6);
        assert_eq!(dp.state.frontends.len(), 6);
        let markers: Vec<_> = dp.state.frontends.keys().filter(|k| k.proto == 0).collect();
        assert_eq!(markers.len(), 1, "only the cluster IP: {markers:?}");
        let scopes: BTreeSet<u8> = dp.state.frontends.keys().map(|k| k.scope).collect();
        assert_eq!(
            scopes,
            BTreeSet::from([proxy_common::SCOPE_NODE, proxy_common::SCOPE_INGRESS])
        );
        // Removing everything leaves nothing behind.
        sync(&mut s, &mut dp, &DesiredState::default()).unwrap();
        assert!(dp.state.frontends.is_empty(), "{:?}", dp.state.frontends);
    }
}

#[test]
fn frontend_flags_come_from_the_desired_state() {
    let mut dp = FakeDatapath::new(cap());
    let mut s = ServiceReconciler::adopt(&dp).unwrap();
    let mut d = svc(&["10.96.0.1:80"], &[]);
    d.flags = proxy_common::FRONTEND_F_LOCAL_ONLY;
    sync(
        &mut s,
        &mut dp,
        &state(vec![(key("web", Protocol::Tcp), d.clone())]),
    )
    .unwrap();
    let fe = |dp: &FakeDatapath| {
        *dp.state
            .frontends
            .iter()
            .find(|(k, _)| k.proto != 0)
            .unwrap()
            .1
    };
    assert_eq!(fe(&dp).flags, proxy_common::FRONTEND_F_LOCAL_ONLY);
    d.flags = 0;
    sync(
        &mut s,
        &mut dp,
        &state(vec![(key("web", Protocol::Tcp), d)]),
    )
    .unwrap();
    assert_eq!(fe(&dp).flags, 0);
}

#[test]
fn first_sync_writes_everything_in_order() {
    let mut dp = FakeDatapath::new(cap());
    let mut s = ServiceReconciler::adopt(&dp).unwrap();
    let d = state(vec![(
        key("web", Protocol::Tcp),
        svc(&["10.96.0.10:80"], &["10.0.0.1:8080", "10.0.0.2:8080"]),
    )]);
    let st = sync(&mut s, &mut dp, &d).unwrap();
    assert_eq!(st.writes, 2 + 1 + 2 + 2); // backends, name, slots, marker + frontend
    // Random selection never reads memberships: none are written.
    assert_eq!(dp.state.members.len(), 0);
    assert_eq!(dp.state.frontends.len(), 2);
    assert_eq!(dp.state.slots.len(), 2);
    assert_eq!(dp.state.backends.len(), 2);
    assert_every_step_consistent(&dp.log, &Snapshot::default(), &Tables::new());
    // The frontend comes last.
    assert!(
        matches!(dp.log.last(), Some(Op::PutFrontend(k, f)) if k.proto == 6 && f.backend_count == 2)
    );
    // Keys are in network byte order.
    let fk = dp.state.frontends.keys().find(|k| k.proto == 6).unwrap();
    assert_eq!(fk.port, [0, 80]);
}

#[test]
fn memberships_follow_affinity_and_hashing_and_come_before_the_frontend() {
    let mut dp = FakeDatapath::new(cap());
    let mut s = ServiceReconciler::adopt(&dp).unwrap();
    let k = key("web", Protocol::Tcp);
    let mut d = svc(&["10.96.0.10:80"], &["10.0.0.1:8080", "10.0.0.2:8080"]);
    sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
    assert!(dp.state.members.is_empty());
    // Affinity on: the memberships are written before the frontend that reads them.
    d.affinity_timeout_s = 60;
    dp.log.clear();
    sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
    assert_eq!(dp.state.members.len(), 2);
    let last_member = dp
        .log
        .iter()
        .rposition(|o| matches!(o, Op::PutMember(..)))
        .unwrap();
    let frontend = dp
        .log
        .iter()
        .position(|o| matches!(o, Op::PutFrontend(k, _) if k.proto == 6))
        .unwrap();
    assert!(last_member < frontend, "{:?}", dp.log);
    // Maglev instead of affinity: memberships stay, a table is added.
    d.affinity_timeout_s = 0;
    d.algorithm = Algorithm::Maglev;
    sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
    assert_eq!(dp.state.members.len(), 2);
    assert_eq!(dp.state.maglev.len(), 1);
    // Back to random: memberships and table go.
    d.algorithm = Algorithm::Random;
    sync(&mut s, &mut dp, &state(vec![(k, d)])).unwrap();
    assert!(dp.state.members.is_empty());
    assert!(dp.state.maglev.is_empty());
    assert_eq!(s.verify(&mut dp).unwrap(), Report::default());
}

/// `MEMBERS` of the fake as (backend address, weight), for readable assertions.
fn member_weights(dp: &FakeDatapath) -> BTreeMap<String, u32> {
    dp.state
        .members
        .iter()
        .map(|(m, w)| {
            let b = dp.state.backends[&m.backend_id];
            (
                crate::datapath::addr::to_socket_addr(b.addr, b.port).to_string(),
                *w,
            )
        })
        .collect()
}

fn weighted(d: &mut DesiredService, list: &[(&str, u32)]) {
    d.weights = list.iter().map(|(a, w)| (a.parse().unwrap(), *w)).collect();
}

#[test]
fn weighted_least_load_keys_carry_weights_in_memberships() {
    let mut dp = FakeDatapath::new(cap());
    let mut s = ServiceReconciler::adopt(&dp).unwrap();
    let k = key("web", Protocol::Tcp);
    let three = ["10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080"];
    let mut d = svc(&["10.96.0.10:80"], &three);
    d.algorithm = Algorithm::WeightedLeastConnections;
    weighted(
        &mut d,
        &[
            ("10.0.0.1:8080", 1),
            ("10.0.0.2:8080", 3),
            ("10.0.0.3:8080", 1),
        ],
    );
    sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
    // One slot per backend (the scan compares each once, by its weight), no table.
    assert_eq!(dp.state.slots.len(), 3);
    assert!(dp.state.maglev.is_empty());
    let mut want = BTreeMap::from([
        ("10.0.0.1:8080".to_string(), 1),
        ("10.0.0.2:8080".to_string(), 3),
        ("10.0.0.3:8080".to_string(), 1),
    ]);
    assert_eq!(member_weights(&dp), want);
    let v = consistency_violations(&dp.state, &dp.tables, Moment::AtRest);
    assert!(v.is_empty(), "{v:#?}");

    // A weight change rewrites that membership only.
    weighted(
        &mut d,
        &[
            ("10.0.0.1:8080", 1),
            ("10.0.0.2:8080", 5),
            ("10.0.0.3:8080", 1),
        ],
    );
    dp.log.clear();
    sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
    assert_eq!(dp.log.len(), 1, "{:?}", dp.log);
    assert!(matches!(dp.log[0], Op::PutMember(_, 5)), "{:?}", dp.log);
    want.insert("10.0.0.2:8080".into(), 5);
    assert_eq!(member_weights(&dp), want);

    // Weight 0 (the model leaves the endpoint out): its membership goes first, so the
    // scan skips it before its slot moves; every step is consistent.
    d.backends.remove(&"10.0.0.3:8080".parse().unwrap());
    weighted(&mut d, &[("10.0.0.1:8080", 1), ("10.0.0.2:8080", 5)]);
    let (before, before_tables) = (dp.state.clone(), dp.tables.clone());
    dp.log.clear();
    sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
    assert_every_step_consistent(&dp.log, &before, &before_tables);
    assert!(matches!(dp.log[0], Op::DeleteMember(_)), "{:?}", dp.log);
    want.remove("10.0.0.3:8080");
    assert_eq!(member_weights(&dp), want);

    // A restarted agent adopts the weights: nothing to write.
    let mut s = ServiceReconciler::adopt(&dp).unwrap();
    dp.log.clear();
    let r = sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
    assert_eq!((r.writes, r.deletes), (0, 0), "{:?}", dp.log);
    assert_eq!(s.verify(&mut dp).unwrap(), Report::default());

    // A weight changed behind the agent's back is repaired.
    let m = *dp.state.members.keys().next().unwrap();
    let was = dp.state.members[&m];
    dp.put_member(&m, 9).unwrap();
    let r = s.verify(&mut dp).unwrap();
    assert_eq!((r.writes, r.deletes), (1, 0));
    assert_eq!(dp.state.members[&m], was);

    // A slot whose copy of its backend went stale keeps its id at adoption and is
    // rewritten by the verification.
    let k0 = *dp.state.slots.keys().next().unwrap();
    dp.state.stale_slots.insert(k0);
    let mut s = ServiceReconciler::adopt(&dp).unwrap();
    dp.log.clear();
    let r = sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
    assert_eq!((r.writes, r.deletes), (0, 0), "{:?}", dp.log);
    let r = s.verify(&mut dp).unwrap();
    assert_eq!((r.writes, r.deletes), (1, 0));
    assert!(
        matches!(dp.log[..], [Op::PutSlot(sk, _)] if sk == k0),
        "{:?}",
        dp.log
    );
    assert!(dp.state.stale_slots.is_empty());

    // The other weighted least-load algorithms keep the memberships; least-connections
    // has them all of weight 1; round-robin needs none.
    for a in [Algorithm::ShortestExpectedDelay, Algorithm::NeverQueue] {
        d.algorithm = a;
        sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
        assert_eq!(member_weights(&dp), want, "{a:?}");
    }
    d.algorithm = Algorithm::LeastConnections;
    d.weights.clear();
    sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
    want.values_mut().for_each(|w| *w = 1);
    assert_eq!(member_weights(&dp), want);
    d.algorithm = Algorithm::RoundRobin;
    sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
    assert!(dp.state.members.is_empty());
    assert_eq!(s.verify(&mut dp).unwrap(), Report::default());
}

#[test]
fn destination_hash_has_a_table_and_memberships_of_weight_one() {
    let mut dp = FakeDatapath::new(cap());
    let mut s = ServiceReconciler::adopt(&dp).unwrap();
    let k = key("web", Protocol::Tcp);
    let mut d = svc(&["10.96.0.10:80"], &["10.0.0.1:8080", "10.0.0.2:8080"]);
    d.algorithm = Algorithm::DestinationHash;
    sync(&mut s, &mut dp, &state(vec![(k, d)])).unwrap();
    assert_eq!(dp.state.maglev.len(), 1);
    let table = dp.tables.values().next().unwrap();
    let ids: BTreeSet<u32> = table.iter().copied().collect();
    assert_eq!(ids, dp.state.backends.keys().copied().collect());
    assert_eq!(
        member_weights(&dp),
        BTreeMap::from([
            ("10.0.0.1:8080".to_string(), 1),
            ("10.0.0.2:8080".to_string(), 1)
        ])
    );
    let v = consistency_violations(&dp.state, &dp.tables, Moment::AtRest);
    assert!(v.is_empty(), "{v:#?}");
}

#[test]
fn unchanged_state_writes_nothing() {
    let mut dp = FakeDatapath::new(cap());
    let mut s = ServiceReconciler::adopt(&dp).unwrap();
    let d = state(vec![(
        key("web", Protocol::Tcp),
        svc(&["10.96.0.10:80"], &["10.0.0.1:8080"]),
    )]);
    sync(&mut s, &mut dp, &d).unwrap();
    dp.log.clear();
    let st = sync(&mut s, &mut dp, &d).unwrap();
    assert_eq!((st.writes, st.deletes), (0, 0));
    assert!(dp.log.is_empty());
}

#[test]
fn removing_a_backend_moves_one_slot_and_keeps_every_step_consistent() {
    let mut dp = FakeDatapath::new(cap());
    let mut s = ServiceReconciler::adopt(&dp).unwrap();
    let k = key("web", Protocol::Tcp);
    let three = ["10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080"];
    let with_affinity = |b: &[&str]| {
        let mut d = svc(&["10.96.0.10:80"], b);
        d.affinity_timeout_s = 30;
        d
    };
    sync(
        &mut s,
        &mut dp,
        &state(vec![(k.clone(), with_affinity(&three))]),
    )
    .unwrap();
    let before = dp.state.clone();
    let before_tables = dp.tables.clone();
    dp.log.clear();
    sync(
        &mut s,
        &mut dp,
        &state(vec![(
            k,
            with_affinity(&["10.0.0.1:8080", "10.0.0.3:8080"]),
        )]),
    )
    .unwrap();
    assert_every_step_consistent(&dp.log, &before, &before_tables);
    // The leaving backend stops being a member first (affinity and Maglev let go of it).
    assert!(
        matches!(dp.log[0], Op::DeleteMember(MemberKey { backend_id: 2, .. })),
        "{:?}",
        dp.log
    );
    dp.log.remove(0);
    // slot 1 rewritten (3 moved in), frontend count 2, slot 2 deleted, backend 2 deleted.
    assert_eq!(dp.log.len(), 4, "{:?}", dp.log);
    assert!(matches!(
        dp.log[0],
        Op::PutSlot(BackendSlotKey { slot: 1, .. }, _)
    ));
    assert!(matches!(
        dp.log[1],
        Op::PutFrontend(
            _,
            Frontend {
                backend_count: 2,
                ..
            }
        )
    ));
    assert!(matches!(
        dp.log[2],
        Op::DeleteSlot(BackendSlotKey { slot: 2, .. })
    ));
    assert!(matches!(dp.log[3], Op::DeleteBackend(_)));
}

#[test]
fn removed_service_is_deleted_frontend_first_and_vip_marker_too() {
    let mut dp = FakeDatapath::new(cap());
    let mut s = ServiceReconciler::adopt(&dp).unwrap();
    sync(
        &mut s,
        &mut dp,
        &state(vec![(
            key("web", Protocol::Tcp),
            svc(&["10.96.0.10:80"], &["10.0.0.1:8080"]),
        )]),
    )
    .unwrap();
    let before = dp.state.clone();
    let before_tables = dp.tables.clone();
    dp.log.clear();
    sync(&mut s, &mut dp, &DesiredState::default()).unwrap();
    assert_every_step_consistent(&dp.log, &before, &before_tables);
    assert_eq!(dp.state, Snapshot::default());
    assert!(
        matches!(dp.log[0], Op::DeleteFrontend(FrontendKey { proto: 6, .. })),
        "{:?}",
        dp.log
    );
    assert!(matches!(
        dp.log[1],
        Op::DeleteFrontend(FrontendKey { proto: 0, .. })
    ));
}

#[test]
fn zero_endpoints_gives_a_frontend_with_count_zero() {
    let mut dp = FakeDatapath::new(cap());
    let mut s = ServiceReconciler::adopt(&dp).unwrap();
    sync(
        &mut s,
        &mut dp,
        &state(vec![(
            key("web", Protocol::Tcp),
            svc(&["10.96.0.10:80"], &[]),
        )]),
    )
    .unwrap();
    let f = dp.state.frontends.values().find(|f| f.flags == 0).unwrap();
    assert_eq!(f.backend_count, 0);
    assert!(dp.state.slots.is_empty());
}

#[test]
fn tcp_and_udp_of_one_port_are_distinct_frontends_sharing_backend_addresses() {
    let mut dp = FakeDatapath::new(cap());
    let mut s = ServiceReconciler::adopt(&dp).unwrap();
    let d = state(vec![
        (
            key("dns", Protocol::Tcp),
            svc(&["10.96.0.10:53"], &["10.0.0.1:53"]),
        ),
        (
            key("dns", Protocol::Udp),
            svc(&["10.96.0.10:53"], &["10.0.0.1:53"]),
        ),
    ]);
    sync(&mut s, &mut dp, &d).unwrap();
    // 2 frontends + 1 marker; backends differ by protocol.
    assert_eq!(dp.state.frontends.len(), 3);
    assert_eq!(dp.state.backends.len(), 2);
}

#[test]
fn full_map_is_refused_whole_and_state_is_kept() {
    let mut dp = FakeDatapath::new(Capacity {
        frontends: 100,
        slots: 3,
        backends: 100,
        services: 100,
    });
    let mut s = ServiceReconciler::adopt(&dp).unwrap();
    let ok = state(vec![(
        key("a", Protocol::Tcp),
        svc(&["10.96.0.1:80"], &["10.0.0.1:80", "10.0.0.2:80"]),
    )]);
    sync(&mut s, &mut dp, &ok).unwrap();
    let before = dp.state.clone();
    let too_big = state(vec![
        (
            key("a", Protocol::Tcp),
            svc(&["10.96.0.1:80"], &["10.0.0.1:80", "10.0.0.2:80"]),
        ),
        (
            key("b", Protocol::Tcp),
            svc(&["10.96.0.2:80"], &["10.0.0.3:80", "10.0.0.4:80"]),
        ),
    ]);
    let err = sync(&mut s, &mut dp, &too_big).unwrap_err();
    assert!(
        matches!(
            err,
            DatapathError::Full {
                map: "BACKEND_SLOTS",
                needed: 4,
                limit: 3,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("--max-backend-slots"));
    assert_eq!(dp.state, before);
    // And the old state still syncs cleanly afterwards.
    let st = sync(&mut s, &mut dp, &ok).unwrap();
    assert_eq!((st.writes, st.deletes), (0, 0));
}

/// A service's and a backend's connections as readers sum them (pairs and carried keys).
fn service_sum(dp: &FakeDatapath, sid: u32) -> u64 {
    dp.pair_stats
        .iter()
        .filter(|(k, _)| k.service_id == sid)
        .map(|(_, n)| n)
        .sum()
}
fn backend_sum(dp: &FakeDatapath, bid: u32) -> u64 {
    dp.pair_stats
        .iter()
        .filter(|(k, _)| k.backend_id == bid)
        .map(|(_, n)| n)
        .sum()
}
/// web (one endpoint, 10.0.0.1:8080) and one more TCP Service `name` with one endpoint.
fn web_and(web: &ServicePortKey, name: &str, vip: &str, backend: &str) -> DesiredState {
    state(vec![
        (web.clone(), svc(&["10.96.0.10:80"], &["10.0.0.1:8080"])),
        (key(name, Protocol::Tcp), svc(&[vip], &[backend])),
    ])
}
fn pair(service_id: u32, backend_id: u32) -> MemberKey {
    MemberKey {
        service_id,
        backend_id,
    }
}

// Over 120 lines: one scenario, each step starting from the counters the previous one left.
#[test]
fn verification_deletes_the_counters_of_released_ids_only() {
    let mut dp = FakeDatapath::new(cap());
    let mut s = ServiceReconciler::adopt(&dp).unwrap();
    let web = key("web", Protocol::Tcp);
    let both = state(vec![
        (web.clone(), svc(&["10.96.0.10:80"], &["10.0.0.1:8080"])),
        (
            key("dns", Protocol::Udp),
            svc(&["10.96.0.11:53"], &["10.0.0.2:53"]),
        ),
    ]);
    sync(&mut s, &mut dp, &both).unwrap();
    let services: BTreeSet<u32> = dp.state.names.keys().copied().collect();
    let in_use: BTreeMap<MemberKey, u64> = dp
        .state
        .slots
        .iter()
        .map(|(k, b)| (pair(k.service_id, *b), 5))
        .collect();
    // The programs counted for every pair in use, and for ids released long ago.
    dp.service_stats = services.iter().copied().chain([9_999]).collect();
    dp.pair_stats = in_use.clone();
    dp.pair_stats.insert(pair(9_999, 8_888), 3);
    dp.pair_stats.insert(pair(9_999, 0), 3);
    dp.pair_stats.insert(pair(0, 8_888), 3);
    s.verify(&mut dp).unwrap();
    assert_eq!(dp.service_stats, services);
    assert_eq!(dp.pair_stats, in_use);
    // A Service leaves: its id's counters go at the next verification; its backend,
    // bound to nothing else, goes too.
    let web_only = state(vec![(
        web.clone(),
        svc(&["10.96.0.10:80"], &["10.0.0.1:8080"]),
    )]);
    sync(&mut s, &mut dp, &web_only).unwrap();
    s.verify(&mut dp).unwrap();
    let web_id = s.id_of(&web).unwrap();
    assert_eq!(dp.service_stats, BTreeSet::from([web_id]));
    let left: BTreeSet<u32> = dp.state.backends.keys().copied().collect();
    assert_eq!(left.len(), 1);
    let web_b1 = *left.first().unwrap();
    assert_eq!(dp.pair_stats, BTreeMap::from([(pair(web_id, web_b1), 5)]));
    // A backend leaves a Service that stays, while another Service still uses it: the
    // pair goes, its count is carried to the Service's and the backend's keys, so no
    // sum goes down; the pair of the backend that stays is untouched.
    let shared = state(vec![
        (
            web.clone(),
            svc(&["10.96.0.10:80"], &["10.0.0.1:8080", "10.0.0.3:8080"]),
        ),
        (
            key("api", Protocol::Tcp),
            svc(&["10.96.0.13:80"], &["10.0.0.3:8080"]),
        ),
    ]);
    sync(&mut s, &mut dp, &shared).unwrap();
    let api_id = s.id_of(&key("api", Protocol::Tcp)).unwrap();
    let b3 = *dp.state.backends.keys().find(|id| **id != web_b1).unwrap();
    dp.pair_stats.insert(pair(web_id, b3), 7);
    dp.pair_stats.insert(pair(api_id, b3), 2);
    let web_only_b1 = web_and(&web, "api", "10.96.0.13:80", "10.0.0.3:8080");
    sync(&mut s, &mut dp, &web_only_b1).unwrap();
    s.verify(&mut dp).unwrap();
    assert_eq!(
        dp.pair_stats,
        BTreeMap::from([
            (pair(web_id, web_b1), 5),
            (pair(web_id, 0), 7),
            (pair(api_id, b3), 2),
            (pair(0, b3), 7),
        ])
    );
    assert_eq!(
        (service_sum(&dp, web_id), service_sum(&dp, api_id)),
        (12, 2)
    );
    assert_eq!((backend_sum(&dp, web_b1), backend_sum(&dp, b3)), (5, 9));
    // The second verification changes nothing; then api leaves, taking the backend with
    // it: every key naming either goes, web keeps its sum.
    s.verify(&mut dp).unwrap();
    assert_eq!(service_sum(&dp, web_id), 12);
    sync(&mut s, &mut dp, &web_only).unwrap();
    s.verify(&mut dp).unwrap();
    assert_eq!(
        dp.pair_stats,
        BTreeMap::from([(pair(web_id, web_b1), 5), (pair(web_id, 0), 7)])
    );
    // A Service leaves while its backend stays bound to another: the pair's count moves
    // to the backend's key only.
    let with_x = web_and(&web, "x", "10.96.0.14:80", "10.0.0.1:8080");
    sync(&mut s, &mut dp, &with_x).unwrap();
    let x_id = s.id_of(&key("x", Protocol::Tcp)).unwrap();
    dp.pair_stats.insert(pair(x_id, web_b1), 3);
    sync(&mut s, &mut dp, &web_only).unwrap();
    s.verify(&mut dp).unwrap();
    assert_eq!(
        dp.pair_stats,
        BTreeMap::from([
            (pair(web_id, web_b1), 5),
            (pair(web_id, 0), 7),
            (pair(0, web_b1), 3),
        ])
    );
    assert_eq!(backend_sum(&dp, web_b1), 8);
    // A full map: the key a pair's count moves to cannot be created, so the pair stays
    // and is counted once, in place; the next sweep with room moves it, once.
    sync(&mut s, &mut dp, &shared).unwrap();
    let b3 = *dp.state.backends.keys().find(|id| **id != web_b1).unwrap();
    dp.pair_stats.insert(pair(web_id, b3), 6);
    sync(&mut s, &mut dp, &web_only_b1).unwrap();
    dp.pair_stats_max = Some(
        dp.pair_stats
            .keys()
            .filter(|k| k.service_id == 0 || k.backend_id == 0)
            .count(),
    );
    s.sweep_counters(&mut dp);
    s.sweep_counters(&mut dp);
    assert_eq!(dp.pair_stats.get(&pair(web_id, b3)), Some(&6));
    assert_eq!((service_sum(&dp, web_id), backend_sum(&dp, b3)), (18, 6));
    dp.pair_stats_max = None;
    s.sweep_counters(&mut dp);
    assert_eq!(dp.pair_stats.get(&pair(web_id, b3)), None);
    assert_eq!(dp.pair_stats.get(&pair(0, b3)), Some(&6));
    assert_eq!((service_sum(&dp, web_id), backend_sum(&dp, b3)), (18, 6));
    sync(&mut s, &mut dp, &web_only).unwrap();
    s.verify(&mut dp).unwrap();
    // A restart after a removal no verification saw: the removed Service's id is the
    // next one handed out, and the sweep at start keeps it from inheriting the counts.
    let both = web_and(&web, "late", "10.96.0.12:80", "10.0.0.4:80");
    sync(&mut s, &mut dp, &both).unwrap();
    let late_id = s.id_of(&key("late", Protocol::Tcp)).unwrap();
    let late_b = *dp.state.backends.keys().find(|id| **id != web_b1).unwrap();
    dp.service_stats = [web_id, late_id].into();
    dp.pair_stats.insert(pair(late_id, late_b), 4);
    sync(&mut s, &mut dp, &web_only).unwrap();
    let restarted = ServiceReconciler::adopt(&dp).unwrap();
    restarted.sweep_counters(&mut dp);
    assert_eq!(dp.service_stats, BTreeSet::from([web_id]));
    assert_eq!(
        dp.pair_stats,
        BTreeMap::from([
            (pair(web_id, web_b1), 5),
            (pair(web_id, 0), 13),
            (pair(0, web_b1), 3),
        ])
    );
}

#[test]
fn restart_adopts_ids_and_rewrites_nothing() {
    let mut dp = FakeDatapath::new(cap());
    let d = state(vec![
        (
            key("web", Protocol::Tcp),
            svc(&["10.96.0.10:80"], &["10.0.0.1:8080", "10.0.0.2:8080"]),
        ),
        (
            key("dns", Protocol::Udp),
            svc(&["10.96.0.11:53"], &["10.0.0.1:53"]),
        ),
    ]);
    sync(&mut ServiceReconciler::adopt(&dp).unwrap(), &mut dp, &d).unwrap();
    dp.log.clear();
    let mut again = ServiceReconciler::adopt(&dp).unwrap();
    let st = sync(&mut again, &mut dp, &d).unwrap();
    assert_eq!((st.writes, st.deletes), (0, 0), "{:?}", dp.log);
    // A new service after restart gets a fresh id, not one in use.
    let mut d2 = d.clone();
    d2.services.insert(
        key("new", Protocol::Tcp),
        svc(&["10.96.0.12:80"], &["10.0.0.9:80"]),
    );
    sync(&mut again, &mut dp, &d2).unwrap();
    let ids: BTreeSet<u32> = dp.state.names.keys().copied().collect();
    assert_eq!(ids.len(), 3);
}

#[test]
fn restart_removes_what_nothing_claims() {
    let mut dp = FakeDatapath::new(cap());
    let d = state(vec![(
        key("web", Protocol::Tcp),
        svc(&["10.96.0.10:80"], &["10.0.0.1:8080"]),
    )]);
    sync(&mut ServiceReconciler::adopt(&dp).unwrap(), &mut dp, &d).unwrap();
    // Garbage left by some other writer.
    dp.state.slots.insert(
        BackendSlotKey {
            service_id: 999,
            slot: 0,
        },
        12345,
    );
    dp.state.names.insert(999, "not a name".into());
    let mut again = ServiceReconciler::adopt(&dp).unwrap();
    sync(&mut again, &mut dp, &DesiredState::default()).unwrap();
    // What a key had goes with it; what nothing claims goes at the verification.
    let r = again.verify(&mut dp).unwrap();
    assert_eq!((r.writes, r.deletes), (0, 2));
    assert_eq!(dp.state, Snapshot::default());
}

#[test]
fn ipv6_frontends_and_backends() {
    let mut dp = FakeDatapath::new(cap());
    let mut s = ServiceReconciler::adopt(&dp).unwrap();
    let k = ServicePortKey {
        family: Family::V6,
        ..key("web", Protocol::Tcp)
    };
    sync(
        &mut s,
        &mut dp,
        &state(vec![(k, svc(&["[fd00::10]:80"], &["[fd00:1::1]:8080"]))]),
    )
    .unwrap();
    let b = dp.state.backends.values().next().unwrap();
    assert!(!proxy_common::is_v4_mapped(&b.addr));
    assert_eq!(
        crate::datapath::addr::to_socket_addr(b.addr, b.port),
        "[fd00:1::1]:8080".parse().unwrap()
    );
}

/// What the maps mean: frontend (addr, proto) -> backend addresses; and no orphans.
fn meaning(s: &Snapshot) -> BTreeMap<(SocketAddr, u8), BTreeSet<SocketAddr>> {
    use crate::datapath::addr::to_socket_addr;
    let mut m = BTreeMap::new();
    let mut used_slots = BTreeSet::new();
    let mut vips = BTreeSet::new();
    for (k, f) in &s.frontends {
        if k.proto == 0 {
            continue;
        }
        vips.insert(k.addr);
        let mut set = BTreeSet::new();
        for slot in 0..f.backend_count {
            let sk = BackendSlotKey {
                service_id: f.service_id,
                slot,
            };
            let b = s.backends[&s.slots[&sk]];
            set.insert(to_socket_addr(b.addr, b.port));
            used_slots.insert(sk);
        }
        m.insert((to_socket_addr(k.addr, k.port), k.proto), set);
    }
    let markers: BTreeSet<[u8; 16]> = s
        .frontends
        .keys()
        .filter(|k| k.proto == 0)
        .map(|k| k.addr)
        .collect();
    assert_eq!(markers, vips, "one VIP marker per VIP, no more");
    assert_eq!(used_slots.len(), s.slots.len(), "orphan slots");
    let used_b: BTreeSet<u32> = s.slots.values().copied().collect();
    assert_eq!(used_b.len(), s.backends.len(), "orphan backends");
    let ids: BTreeSet<u32> = s
        .frontends
        .values()
        .filter(|f| f.flags == 0)
        .map(|f| f.service_id)
        .collect();
    assert!(s.names.keys().all(|id| ids.contains(id)));
    m
}

fn expected(d: &DesiredState) -> BTreeMap<(SocketAddr, u8), BTreeSet<SocketAddr>> {
    let mut m = BTreeMap::new();
    for (k, svc) in &d.services {
        for fe in &svc.frontends {
            m.insert((*fe, k.protocol.number()), svc.backends.clone());
        }
    }
    m
}

#[test]
fn incremental_syncs_match_the_desired_state_at_every_step() {
    // Deterministic pseudo-random sequence of desired states over a small universe, so
    // services appear, change, move VIPs, share backends and disappear.
    let mut seed: u64 = 0x9e3779b97f4a7c15;
    let mut rnd = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut dp = FakeDatapath::new(Capacity {
        frontends: 1000,
        slots: 1000,
        backends: 1000,
        services: 1000,
    });
    let mut s = ServiceReconciler::adopt(&dp).unwrap();
    let mut d = DesiredState::default();
    for step in 0..500 {
        let name = format!("s{}", rnd(12));
        let proto = if rnd(2) == 0 {
            Protocol::Tcp
        } else {
            Protocol::Udp
        };
        let k = key(&name, proto);
        match rnd(4) {
            0 => {
                d.services.remove(&k);
            }
            _ => {
                let svc_no = name[1..].parse::<u8>().unwrap();
                // Two VIPs per service number, ports vary: VIPs are shared between
                // the TCP and UDP keys of one name.
                let vip = format!("10.96.0.{}:{}", svc_no + 1, 80 + rnd(2));
                let mut backends = BTreeSet::new();
                for _ in 0..rnd(5) {
                    backends.insert(
                        format!("10.0.0.{}:{}", 1 + rnd(8), 8080 + rnd(2))
                            .parse()
                            .unwrap(),
                    );
                }
                d.services.insert(
                    k,
                    DesiredService {
                        frontends: [vip.parse().unwrap()].into(),
                        backends,
                        flags: 0,
                        ..Default::default()
                    },
                );
            }
        }
        // The model never gives one frontend (VIP, port, protocol) to two keys; mimic it.
        let mut seen = BTreeSet::new();
        d.services
            .retain(|k, v| v.frontends.iter().all(|f| seen.insert((*f, k.protocol))));
        let before = dp.state.clone();
        let before_tables = dp.tables.clone();
        dp.log.clear();
        sync(&mut s, &mut dp, &d).unwrap_or_else(|e| panic!("step {step}: {e}"));
        assert_every_step_consistent(&dp.log, &before, &before_tables);
        assert_eq!(meaning(&dp.state), expected(&d), "step {step}");
        // A fresh full sync from the kernel state agrees and writes nothing.
        assert_eq!(s.verify(&mut dp).unwrap(), Report::default(), "step {step}");
        let mut fresh = ServiceReconciler::adopt(&dp).unwrap();
        let st = sync(&mut fresh, &mut dp, &d).unwrap();
        assert_eq!(
            (st.writes, st.deletes),
            (0, 0),
            "step {step}: incremental state differs from full"
        );
    }
}
