use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use anyhow::Result;
use tokio::sync::mpsc;

use super::*;
use crate::datapath::{Capacity, fake::FakeDatapath};
use crate::metrics::Metrics;
use crate::model::{Model, NodeInfo};
use crate::reconcile::{NodeConfig, Reconciler};
use crate::source::{Batch, Change, manifests::parse_documents};

fn agent(min_period: Duration) -> Agent<FakeDatapath> {
    let dp = FakeDatapath::new(Capacity {
        frontends: 100,
        slots: 100,
        backends: 100,
        services: 100,
    });
    let r = Reconciler::adopt(&dp, NodeConfig::default(), Duration::from_secs(30)).unwrap();
    let health = Arc::new(Mutex::new(Health::new(
        Duration::from_secs(60),
        vec![crate::model::Family::V4],
    )));
    Agent::new(
        Model::new(NodeInfo {
            name: "node-1".into(),
            ..Default::default()
        }),
        r,
        dp,
        Arc::new(Metrics::new(
            std::path::PathBuf::from("/nonexistent"),
            vec![crate::model::Family::V4],
        )),
        health,
        "manifests",
        min_period,
    )
}

fn batch(yaml: &str, synced: bool) -> Batch {
    let (objs, errors) = parse_documents("t.yaml", yaml);
    assert!(errors.is_empty(), "{errors:?}");
    Batch {
        changes: objs.into_iter().map(Change::Apply).collect(),
        errors: None,
        synced,
        received: Instant::now(),
    }
}

fn svc(name: &str, ip: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: ns}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}\n"
    )
}

fn real_frontends(a: &Agent<FakeDatapath>) -> usize {
    a.dp.state.frontends.keys().filter(|k| k.proto != 0).count()
}

#[tokio::test(start_paused = true)]
async fn nothing_is_programmed_before_the_source_is_complete() {
    let mut a = agent(Duration::ZERO);
    a.handle(Event::Batch(batch(&svc("a", "10.96.0.1"), false)));
    assert_eq!(a.reconcile_at(), None, "the view is not complete yet");
    a.handle(Event::Retry);
    a.handle(Event::Verify);
    assert!(a.dp.log.is_empty());
    assert!(a.health.lock().unwrap().last_updated.is_none());
    a.handle(Event::Batch(batch(&svc("b", "10.96.0.2"), true)));
    assert!(a.reconcile_at().is_some());
    a.handle(Event::Reconcile);
    assert_eq!(real_frontends(&a), 2);
    let h = a.health.lock().unwrap();
    assert!(h.healthy(SystemTime::now()));
}

#[tokio::test(start_paused = true)]
async fn min_sync_period_paces_syncs_and_an_isolated_change_goes_at_once() {
    let period = Duration::from_secs(1);
    let mut a = agent(period);
    a.handle(Event::Batch(batch(&svc("a", "10.96.0.1"), true)));
    a.handle(Event::Reconcile);
    let t0 = tokio::time::Instant::now();
    // A change right after a sync waits for the period.
    tokio::time::advance(Duration::from_millis(100)).await;
    a.handle(Event::Batch(batch(&svc("b", "10.96.0.2"), true)));
    assert_eq!(a.reconcile_at(), Some(t0 + period));
    tokio::time::advance(Duration::from_millis(900)).await;
    a.handle(Event::Reconcile);
    assert_eq!(real_frontends(&a), 2);
    // After a quiet period, a change goes out at once.
    tokio::time::advance(Duration::from_secs(5)).await;
    a.handle(Event::Batch(batch(&svc("c", "10.96.0.3"), true)));
    assert_eq!(a.reconcile_at(), Some(tokio::time::Instant::now()));
}

#[tokio::test(start_paused = true)]
async fn the_loop_reads_bursts_as_one_sync_and_stops() {
    let mut a = agent(Duration::ZERO);
    let (tx, rx) = mpsc::channel(16);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    tx.send(batch(&svc("a", "10.96.0.1"), true)).await.unwrap();
    for i in 2..6 {
        tx.send(batch(&svc(&format!("s{i}"), &format!("10.96.0.{i}")), true))
            .await
            .unwrap();
    }
    let driver = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        stop_tx.send(()).unwrap();
    };
    let run = a.run(
        rx,
        Duration::from_secs(30),
        Duration::from_secs(10),
        async {
            let _ = stop_rx.await;
        },
    );
    let (r, ()) = tokio::join!(run, driver);
    r.unwrap();
    assert_eq!(real_frontends(&a), 5);
    // One pass wrote everything: every frontend once.
    let puts =
        a.dp.log
            .iter()
            .filter(|o| matches!(o, crate::datapath::fake::Op::PutFrontend(k, _) if k.proto != 0))
            .count();
    assert_eq!(puts, 5);
    assert!(a.dp.collections >= 1, "the collection ran");
}

#[tokio::test(start_paused = true)]
async fn no_sync_runs_before_the_programs_are_attached_and_their_failure_ends_the_loop() {
    // Attached after 2 s: the source is read meanwhile, the sync waits for it.
    let (attach_tx, attach_rx) = tokio::sync::oneshot::channel::<Result<()>>();
    let mut a = agent(Duration::ZERO)
        .with_attaching(async move { attach_rx.await.unwrap_or_else(|_| Ok(())) });
    assert!(!a.attached());
    let (tx, rx) = mpsc::channel(16);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    tx.send(batch(&svc("a", "10.96.0.1"), true)).await.unwrap();
    let driver = async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        attach_tx.send(Ok(())).unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        stop_tx.send(()).unwrap();
    };
    let t0 = tokio::time::Instant::now();
    let run = a.run(
        rx,
        Duration::from_secs(30),
        Duration::from_secs(10),
        async {
            let _ = stop_rx.await;
        },
    );
    let (r, ()) = tokio::join!(run, driver);
    r.unwrap();
    assert!(a.attached());
    assert_eq!(real_frontends(&a), 1);
    // The first sync ran once the programs were attached, not before.
    let synced_at = a.last_sync.expect("synced");
    assert!(
        synced_at >= t0 + Duration::from_secs(2),
        "{:?}",
        synced_at - t0
    );

    // A failed attach ends the loop with its error, before any sync.
    let mut a =
        agent(Duration::ZERO).with_attaching(async { Err(anyhow::anyhow!("verify: rejected")) });
    let (tx, rx) = mpsc::channel(16);
    tx.send(batch(&svc("a", "10.96.0.1"), true)).await.unwrap();
    let e = a
        .run(
            rx,
            Duration::from_secs(30),
            Duration::from_secs(10),
            std::future::pending(),
        )
        .await
        .unwrap_err();
    assert_eq!(e.to_string(), "verify: rejected");
    assert!(!a.attached());
    assert_eq!(real_frontends(&a), 0);
}

#[tokio::test(start_paused = true)]
async fn the_node_object_drives_healthz_eligibility_at_once() {
    let mut a = agent(Duration::ZERO);
    let node = |extra: &str| {
        format!("---\napiVersion: v1\nkind: Node\nmetadata: {{name: node-1{extra}}}\n")
    };
    a.handle(Event::Batch(batch(&node(""), true)));
    assert!(a.health.lock().unwrap().node_eligible);
    // No sync needed: the next /healthz already answers 503.
    a.handle(Event::Batch(batch(
        &node(", deletionTimestamp: '2026-01-01T00:00:00Z'"),
        true,
    )));
    assert!(!a.health.lock().unwrap().node_eligible);
}

#[tokio::test(start_paused = true)]
async fn kube_proxy_sync_families_follow_each_sync() {
    let mut a = agent(Duration::ZERO);
    a.dp.cap.frontends = 2; // one cluster IP (frontend + VIP marker)
    let local = "---\napiVersion: v1\nkind: Service\nmetadata: {name: loc, namespace: ns}\nspec: {clusterIP: 10.96.0.9, internalTrafficPolicy: Local, ports: [{port: 80}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: loc-1, namespace: ns, labels: {kubernetes.io/service-name: loc}}\naddressType: IPv4\nports: [{port: 80}]\nendpoints: [{addresses: [10.0.0.7], nodeName: node-2}]\n";
    a.handle(Event::Batch(batch(&(svc("a", "10.96.0.1") + local), true)));
    a.handle(Event::Reconcile);
    let text = a.metrics.encode();
    for line in [
        "kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family=\"IPv4\"} 1",
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"internal\"} 1",
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"external\"} 0",
        "kubeproxy_sync_proxy_rules_service_changes_total 2",
        "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1",
        "kubeproxy_conntrack_reconciler_sync_duration_seconds_count{ip_family=\"IPv4\"} 1",
        // A Service port is still failed: the last full sync has not happened.
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"} 0",
    ] {
        assert!(text.contains(line), "{line} missing in\n{text}");
    }
    assert!(
        !text.contains(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family=\"IPv4\"} 0"
        ),
        "a change was queued"
    );
}

#[tokio::test(start_paused = true)]
async fn a_change_due_now_is_programmed_without_waiting_for_a_timer_tick() {
    let mut a = agent(Duration::ZERO);
    let (tx, rx) = mpsc::channel(4);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let sent = std::cell::Cell::new(None);
    let driver = async {
        // The loop is waiting; the change comes off a millisecond boundary, where a
        // timer for "now" would fire only at the next tick.
        tokio::time::sleep(Duration::from_millis(10)).await;
        tokio::time::advance(Duration::from_micros(500)).await;
        sent.set(Some(tokio::time::Instant::now()));
        tx.send(batch(&svc("a", "10.96.0.1"), true)).await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        stop_tx.send(()).unwrap();
    };
    let run = a.run(
        rx,
        Duration::from_secs(30),
        Duration::from_secs(10),
        async {
            let _ = stop_rx.await;
        },
    );
    let (r, ()) = tokio::join!(run, driver);
    r.unwrap();
    assert_eq!(real_frontends(&a), 1);
    assert_eq!(a.last_sync, sent.get(), "programmed when it arrived");
}

#[tokio::test(start_paused = true)]
async fn a_failed_service_keeps_healthz_pending_until_it_is_applied() {
    let mut a = agent(Duration::ZERO);
    a.dp.cap.frontends = 2; // one cluster IP (frontend + VIP marker)
    a.handle(Event::Batch(batch(
        &(svc("a", "10.96.0.1") + &svc("b", "10.96.0.2")),
        true,
    )));
    a.handle(Event::Reconcile);
    assert_eq!(a.reconciler.failed().len(), 1);
    {
        let h = a.health.lock().unwrap();
        assert!(
            h.queued.is_some(),
            "a failed Service port is a pending update"
        );
        let later = SystemTime::now() + Duration::from_secs(61);
        assert!(!h.healthy(later));
    }
    a.dp.cap.frontends = 4;
    tokio::time::advance(Duration::from_secs(2)).await;
    a.handle(Event::Retry);
    assert!(a.reconciler.failed().is_empty());
    assert!(a.health.lock().unwrap().queued.is_none());
    assert_eq!(real_frontends(&a), 2);
}
