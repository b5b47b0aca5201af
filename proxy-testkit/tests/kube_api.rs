//! Privileged integration tests of the Kubernetes API source: the real agent, started with
//! `--kubeconfig`, against `proxy_testkit::fakeapi` (a list/watch server that behaves like
//! kube-apiserver: resourceVersions, chunked watch streams, bookmarks, 410 Gone, outages),
//! with real traffic through a VIP from a pod namespace in the test cgroup.

mod common;

use std::{net::IpAddr, time::Duration};

use common::*;
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use proxy_testkit::fakeapi::{FakeApiServer, Verb};

const VIP: &str = "198.19.0.40";

fn svc_obj(name: &str, vip: &str) -> Service {
    serde_yaml_ng::from_str(&service(
        "default",
        name,
        &[vip],
        &[("http", 80, 8080, "TCP")],
    ))
    .unwrap()
}

fn slice_obj(name: &str, svc: &str, eps: &[usize], trigger: Option<&str>) -> EndpointSlice {
    let eps: Vec<(IpAddr, bool)> = eps
        .iter()
        .map(|i| (IpAddr::V4(backend_v4(*i)), true))
        .collect();
    let mut s: EndpointSlice = serde_yaml_ng::from_str(&slice(
        "default",
        name,
        svc,
        "IPv4",
        &[("http", 8080, "TCP")],
        &eps,
    ))
    .unwrap();
    if let Some(t) = trigger {
        s.metadata.annotations = Some(
            [(
                "endpoints.kubernetes.io/last-change-trigger-time".to_string(),
                t.to_string(),
            )]
            .into(),
        );
    }
    s
}

/// A fake API server on a runtime of its own, and the kubeconfig that points at it.
struct Api {
    rt: tokio::runtime::Runtime,
    server: FakeApiServer,
    kubeconfig: std::path::PathBuf,
}

impl Api {
    fn start(env: &Env) -> Api {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let server = rt
            .block_on(FakeApiServer::start("127.0.0.1:0".parse().unwrap()))
            .expect("fake API server");
        let kubeconfig = env.manifests.path().join("kubeconfig");
        server.write_kubeconfig(&kubeconfig).unwrap();
        Api {
            rt,
            server,
            kubeconfig,
        }
    }

    fn agent_args(&self) -> Vec<String> {
        vec![
            "--kubeconfig".into(),
            self.kubeconfig.display().to_string(),
            "--hostname-override".into(),
            "node-a".into(),
            "--min-sync-period".into(),
            "100ms".into(),
        ]
    }
}

fn backend_count(env: &Env) -> u32 {
    env.snapshot()
        .frontends
        .values()
        .filter(|f| f.flags == 0)
        .map(|f| f.backend_count)
        .sum()
}

#[test]
fn data_path_converges_after_every_api_event() {
    let mut env = Env::new("api-conv", 3, false);
    let api = Api::start(&env);
    api.server.apply_service(svc_obj("web", VIP));
    api.server
        .apply_endpoint_slice(slice_obj("web-1", "web", &[0], None));
    env.start_agent_with(&api.agent_args());
    env.wait_maps(
        |s| s.frontends.values().any(|f| f.backend_count == 1),
        "initial list",
    );
    assert!(
        env.log()
            .contains("initial lists of Services and EndpointSlices complete")
    );
    assert_eq!(by_name(&env.tcp(&format!("{VIP}:80"), 5)).len(), 1);

    // Endpoint added: MODIFIED event.
    let now = humantime::format_rfc3339(std::time::SystemTime::now()).to_string();
    api.server
        .apply_endpoint_slice(slice_obj("web-1", "web", &[0, 1, 2], Some(&now)));
    let took = env.wait_maps(|_| backend_count(&env) == 3, "endpoints added");
    println!("API change to data path: {took:?}");
    assert_eq!(by_name(&env.tcp(&format!("{VIP}:80"), 60)).len(), 3);

    // A second slice, then its removal: DELETED event.
    api.server
        .apply_endpoint_slice(slice_obj("web-2", "web", &[1], None));
    api.server
        .apply_endpoint_slice(slice_obj("web-1", "web", &[0], None));
    env.wait_maps(|_| backend_count(&env) == 2, "two slices merged");
    api.server.delete_endpoint_slice("default", "web-2");
    env.wait_maps(|_| backend_count(&env) == 1, "slice deleted");
    let c = by_name(&env.tcp(&format!("{VIP}:80"), 20));
    assert_eq!(c.keys().collect::<Vec<_>>(), vec!["b0"], "{c:?}");

    // Metrics: kube-proxy's names, and the network programming latency from the annotation.
    let addr = env.logged_addr("metrics");
    let out = std::process::Command::new("curl")
        .args(["-s", &format!("http://{addr}/metrics")])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for m in [
        "kubeproxy_sync_proxy_rules_duration_seconds_count",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_sync_proxy_rules_endpoint_changes_total",
        "kubeproxy_sync_proxy_rules_service_changes_total",
        "ebpf_proxy_map_entries{map=\"FRONTENDS\"}",
        "ebpf_proxy_datapath_events_total{reason=\"translated\"}",
    ] {
        assert!(text.contains(m), "{m} missing:\n{text}");
    }
    // The slice is IPv4: its family's series has the observation.
    let programmed = text
        .lines()
        .find(|l| {
            l.starts_with(
                "kubeproxy_network_programming_duration_seconds_count{ip_family=\"IPv4\"}",
            )
        })
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    assert!(
        programmed >= 1,
        "network programming latency not observed:\n{text}"
    );
    let out = std::process::Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            &format!("http://{}/livez", env.health_addr()),
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200");

    // Service deleted: its frontends go.
    api.server.delete_service("default", "web");
    env.wait_maps(|s| s.frontends.is_empty(), "service deleted");
    drop(api);
}

#[test]
fn services_for_another_proxy_are_filtered_by_the_api_server_and_follow_their_label() {
    let mut env = Env::new("api-labels", 2, false);
    let api = Api::start(&env);
    let labelled = |name: &str, vip: &str, label: Option<&str>| {
        let mut s = svc_obj(name, vip);
        if let Some(l) = label {
            s.metadata.labels = Some([(l.to_string(), "other".to_string())].into());
        }
        s
    };
    api.server.apply_service(labelled("web", VIP, None));
    api.server
        .apply_endpoint_slice(slice_obj("web-1", "web", &[0], None));
    api.server.apply_service(labelled(
        "other",
        "198.19.0.42",
        Some("service.kubernetes.io/service-proxy-name"),
    ));
    api.server
        .apply_endpoint_slice(slice_obj("other-1", "other", &[1], None));
    env.start_agent_with(&api.agent_args());
    env.wait_maps(|_| backend_count(&env) == 1, "initial list");
    let vips = |env: &Env| -> Vec<String> {
        env.snapshot()
            .frontends
            .keys()
            .filter(|k| k.proto != 0)
            .map(|k| proxy_userspace::datapath::addr::bytes_to_ip(k.addr).to_string())
            .collect()
    };
    assert_eq!(
        vips(&env),
        [VIP],
        "the other proxy's Service is not programmed"
    );
    // kube-proxy's selector is on the Service and EndpointSlice lists and watches.
    let log = api.server.request_log();
    for path in [
        "/api/v1/services",
        "/apis/discovery.k8s.io/v1/endpointslices",
    ] {
        let reqs: Vec<_> = log.iter().filter(|r| r.path == path).collect();
        assert!(!reqs.is_empty(), "{path} not requested");
        for r in reqs {
            assert_eq!(
                r.param("labelSelector").as_deref(),
                Some("!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"),
                "{r:?}"
            );
        }
    }
    // The label given to web: the server sends it as deleted, its frontends go; taken
    // away from other: it arrives and is programmed.
    api.server.apply_service(labelled(
        "web",
        VIP,
        Some("service.kubernetes.io/service-proxy-name"),
    ));
    api.server
        .apply_service(labelled("other", "198.19.0.42", None));
    env.wait_maps(|_| vips(&env) == ["198.19.0.42"], "the labels swapped");
    assert_eq!(by_name(&env.tcp("198.19.0.42:80", 5)).len(), 1);
    drop(api);
}

#[test]
fn outage_keeps_the_data_path_and_a_deletion_made_meanwhile_is_applied_after_relist() {
    let mut env = Env::new("api-outage", 2, false);
    let mut api = Api::start(&env);
    api.server.apply_service(svc_obj("web", VIP));
    api.server.apply_service(svc_obj("gone", "198.19.0.41"));
    api.server
        .apply_endpoint_slice(slice_obj("web-1", "web", &[0, 1], None));
    api.server
        .apply_endpoint_slice(slice_obj("gone-1", "gone", &[0], None));
    env.start_agent_with(&api.agent_args());
    env.wait_maps(
        |s| s.frontends.values().filter(|f| f.flags == 0).count() == 2,
        "initial list",
    );

    // API server down (as a restart of kube-apiserver): the data path keeps serving.
    api.rt.block_on(api.server.stop());
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        by_name(&env.tcp(&format!("{VIP}:80"), 20)).len(),
        2,
        "data path kept during the outage"
    );
    assert_eq!(by_name(&env.tcp("198.19.0.41:80", 3)).len(), 1);
    // Changes while the agent cannot see them, and history compacted: its next watch gets
    // 410 Gone and must relist.
    let lists_before = api.server.request_count("/api/v1/services", Verb::List);
    api.server.delete_service("default", "gone");
    api.server.delete_endpoint_slice("default", "gone-1");
    api.server
        .apply_endpoint_slice(slice_obj("web-1", "web", &[1], None));
    api.server.compact();
    api.rt.block_on(api.server.restart()).unwrap();

    env.wait_maps(
        |s| s.frontends.values().filter(|f| f.flags == 0).count() == 1 && backend_count(&env) == 1,
        "deletion applied after relist",
    );
    let lists_after = api.server.request_count("/api/v1/services", Verb::List);
    assert!(
        lists_after > lists_before,
        "no relist after 410 Gone ({lists_before} -> {lists_after})"
    );
    let c = by_name(&env.tcp(&format!("{VIP}:80"), 10));
    assert_eq!(c.keys().collect::<Vec<_>>(), vec!["b1"]);
    // The outage was logged once, not per retry.
    let log = env.log();
    let fails = log.lines().filter(|l| l.contains("watch failed")).count();
    // Five watched kinds: Services, EndpointSlices, Nodes, Pods and Namespaces.
    assert!(
        (1..=5).contains(&fails),
        "expected one 'watch failed' line per watched kind at most, got {fails}:\n{log}"
    );
}

#[test]
fn failing_api_responses_keep_state_and_recover() {
    let mut env = Env::new("api-fail", 2, false);
    let api = Api::start(&env);
    api.server.apply_service(svc_obj("web", VIP));
    api.server
        .apply_endpoint_slice(slice_obj("web-1", "web", &[0, 1], None));
    env.start_agent_with(&api.agent_args());
    env.wait_maps(|_| backend_count(&env) == 2, "initial list");
    api.server.set_failing(true);
    api.server.close_watches();
    std::thread::sleep(Duration::from_millis(1500));
    // Nothing flushed while every request fails.
    assert_eq!(backend_count(&env), 2);
    assert_eq!(by_name(&env.tcp(&format!("{VIP}:80"), 20)).len(), 2);
    api.server.set_failing(false);
    api.server
        .apply_endpoint_slice(slice_obj("web-1", "web", &[0], None));
    env.wait_maps(|_| backend_count(&env) == 1, "recovered after failures");
    assert!(env.log().contains("watch recovered"));
}

#[test]
fn restart_waits_for_the_initial_lists_before_removing_anything() {
    let mut env = Env::new("api-wait", 2, false);
    let api = Api::start(&env);
    api.server.apply_service(svc_obj("web", VIP));
    api.server
        .apply_endpoint_slice(slice_obj("web-1", "web", &[0, 1], None));
    env.start_agent_with(&api.agent_args());
    env.wait_maps(|_| backend_count(&env) == 2, "initial list");
    env.stop_agent();

    // The API answers slowly now: a new agent must not sync (and flush) before both lists
    // have completed.
    api.server.set_delay(Duration::from_secs(2));
    let before = env.syncs();
    env.start_agent_with(&api.agent_args());
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(env.syncs(), before, "synced before the lists completed");
    assert_eq!(backend_count(&env), 2);
    assert_eq!(
        by_name(&env.tcp(&format!("{VIP}:80"), 20)).len(),
        2,
        "data path kept while listing"
    );
    env.wait_log(|l| syncs(l) > before, "sync after the lists");
    let last = env
        .log()
        .lines()
        .rfind(|l| l.contains("sync done"))
        .unwrap()
        .to_string();
    assert!(
        last.contains("writes=0") && last.contains("deletes=0"),
        "{last}"
    );
}
