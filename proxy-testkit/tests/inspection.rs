//! Privileged integration tests of the operator's view: exact data path counters
//! after known traffic (`stats`, `backends`, `/metrics` parsed as Prometheus text), the
//! socket-level `conntrack` listing, and `explain` with every eligibility reason.

mod common;

use std::{
    collections::BTreeMap,
    net::IpAddr,
    process::Command,
    time::{Duration, Instant},
};

use common::*;

const VIP: &str = "198.19.0.40";
const EMPTY_VIP: &str = "198.19.0.41";

fn b(i: usize) -> IpAddr {
    IpAddr::V4(backend_v4(i))
}

fn manifests(env: &Env) {
    let svc = service(
        "default",
        "web",
        &[VIP],
        &[("http", 80, 8080, "TCP"), ("dns", 53, 5353, "UDP")],
    );
    let sl = slice(
        "default",
        "web-1",
        "web",
        "IPv4",
        &[("http", 8080, "TCP"), ("dns", 5353, "UDP")],
        &[(b(0), true), (b(1), true)],
    );
    let empty = service(
        "default",
        "empty",
        &[EMPTY_VIP],
        &[("http", 80, 8080, "TCP")],
    );
    env.write_manifest("web.yaml", &format!("{svc}---\n{sl}---\n{empty}"));
}

#[test]
fn counters_are_exact_after_known_traffic_and_metrics_parse() {
    let mut env = Env::new("insp-counters", 2, false);
    manifests(&env);
    env.start_agent();

    // 10 TCP connections, one UDP socket sending 5 datagrams (one flow), 3 refusals for
    // lack of endpoints, 2 for an undefined port.
    assert_eq!(
        by_name(&env.tcp(&format!("{VIP}:80"), 10))
            .values()
            .sum::<usize>(),
        10
    );
    assert_eq!(
        by_name(&env.udp(&format!("{VIP}:53"), 5, false))
            .values()
            .sum::<usize>(),
        5
    );
    let r = env.tcp(&format!("{EMPTY_VIP}:80"), 3);
    assert!(r.iter().all(|p| errno(p) == Some(111)), "{r:?}");
    let r = env.tcp(&format!("{VIP}:81"), 2);
    assert!(r.iter().all(|p| errno(p) == Some(111)), "{r:?}");

    let stats = env.agent_json(&["stats"]);
    let by_service = |name: &str| {
        stats["services"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["service"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("{name} missing: {stats}"))
    };
    let http = by_service("default/web:http/TCP/v4");
    assert_eq!(
        (http["connections"].as_u64(), http["refused"].as_u64()),
        (Some(10), Some(0))
    );
    let dns = by_service("default/web:dns/UDP/v4");
    assert_eq!(dns["connections"], 1, "one new flow: {dns}");
    let empty = by_service("default/empty:http/TCP/v4");
    assert_eq!(
        (empty["connections"].as_u64(), empty["refused"].as_u64()),
        (Some(0), Some(3))
    );
    let reasons = &stats["reasons"];
    assert_eq!(
        reasons["translated"], 15,
        "10 connects + 5 datagrams: {reasons}"
    );
    assert_eq!(reasons["refused_no_endpoints"], 3, "{reasons}");
    assert_eq!(reasons["refused_undefined_port"], 2, "{reasons}");
    // The table says what each reason means.
    let out = Command::new(AGENT)
        .args(["stats", "--pin-dir", &env.pin_dir])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("REASON") && text.contains("MEANING"),
        "{text}"
    );
    let line = text
        .lines()
        .find(|l| l.starts_with("refused_no_endpoints"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        line.contains(" 3 ") && line.contains("the frontend has no endpoints"),
        "{line}"
    );
    assert!(text.contains("tc_snat_ports_exhausted"), "{text}");

    let backends = env.agent_json(&["backends"]);
    let tcp_total: u64 = backends
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["protocol"] == "TCP")
        .map(|b| b["connections"].as_u64().unwrap())
        .sum();
    assert_eq!(tcp_total, 10, "{backends}");

    // The same numbers on /metrics, read with a Prometheus text-format parser.
    let addr = env.logged_addr("metrics");
    let out = Command::new("curl")
        .args(["-sf", &format!("http://{addr}/metrics")])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("valid Prometheus text");
    let value = |name: &str, labels: &[(&str, &str)]| -> f64 {
        let s = scrape
            .samples
            .iter()
            .find(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
            .unwrap_or_else(|| panic!("no {name} {labels:?} in\n{text}"));
        match s.value {
            prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => v,
            ref other => panic!("{other:?}"),
        }
    };
    let web_http = [
        ("namespace", "default"),
        ("service", "web"),
        ("port", "http"),
        ("protocol", "TCP"),
        ("family", "IPv4"),
        ("scope", "cluster-ip"),
    ];
    assert_eq!(
        value("ebpf_proxy_service_connections_total", &web_http),
        10.0
    );
    assert_eq!(
        value(
            "ebpf_proxy_service_refused_total",
            &[("service", "empty"), ("port", "http")]
        ),
        3.0
    );
    let per_backend: f64 = [b(0), b(1)]
        .iter()
        .map(|ip| {
            value(
                "ebpf_proxy_backend_connections_total",
                &[("backend", &format!("{ip}:8080")), ("protocol", "TCP")],
            )
        })
        .sum();
    assert_eq!(per_backend, 10.0);
    assert_eq!(
        value(
            "ebpf_proxy_datapath_events_total",
            &[("reason", "refused_undefined_port")]
        ),
        2.0
    );
    // The tc path's reasons are exported too (no tc program runs here: all zero).
    assert_eq!(
        value("ebpf_proxy_tc_events_total", &[("reason", "tc_new_flow")]),
        0.0
    );
    env.stop_agent();
}

#[test]
fn conntrack_lists_connected_sockets_and_udp_flows() {
    let mut env = Env::new("insp-ct", 2, false);
    manifests(&env);
    env.start_agent();
    // A UDP flow (unconnected socket, already closed: flows stay listed until reused) and a
    // TCP connection held open.
    env.udp(&format!("{VIP}:53"), 2, false);
    let holder = env
        .client
        .spawn(
            Some(env.cg.path()),
            Command::new(NETPROBE)
                .args(["tcp", "--to", &format!("{VIP}:80"), "--hold-ms", "2000"])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null()),
        )
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let rows = env.agent_json(&["conntrack"]);
    let rows = rows.as_array().unwrap();
    let flow = rows
        .iter()
        .find(|r| r["kind"] == "udp-flow")
        .expect("a flow");
    assert_eq!(flow["frontend"], format!("{VIP}:53"));
    let backends = [format!("{}:5353", b(0)), format!("{}:5353", b(1))];
    assert!(
        backends.iter().any(|x| flow["backend"] == *x.as_str()),
        "{flow}"
    );
    assert_eq!(flow["service"], "default/web:dns/UDP/v4");
    assert!(flow["idle_s"].as_f64().unwrap() < 30.0);
    let conn: Vec<_> = rows
        .iter()
        .filter(|r| r["kind"] == "connected" && r["protocol"] == "TCP")
        .collect();
    assert_eq!(conn.len(), 1, "the held connection: {rows:?}");
    assert_eq!(conn[0]["frontend"], format!("{VIP}:80"));
    assert_eq!(conn[0]["stale"], false);
    // Once closed, the connection is gone from the listing (released sockets are forgotten).
    let done = finish_probe(holder);
    assert_eq!(done[0]["ok"], true, "{done:?}");
    let rows = env.agent_json(&["conntrack"]);
    let open_tcp: Vec<_> = rows
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["protocol"] == "TCP")
        .collect();
    assert!(open_tcp.is_empty(), "closed sockets listed: {open_tcp:?}");
    let out = Command::new(AGENT)
        .args(["conntrack", "--pin-dir", &env.pin_dir])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with("KIND") && text.contains("udp-flow"),
        "{text}"
    );
    env.stop_agent();
}

#[test]
fn explain_gives_each_endpoints_eligibility_with_the_reason() {
    let mut env = Env::new("insp-explain", 1, false);
    env.extra_agent_args = vec!["--hostname-override".into(), "node-a".into()];
    // internalTrafficPolicy Local on node-a: one usable endpoint, one per reason otherwise.
    let svc = service("default", "web", &[VIP], &[("http", 80, 8080, "TCP")])
        + "  internalTrafficPolicy: Local\n";
    let ep = |ip: &str, node: &str, cond: &str| {
        format!("- addresses: [\"{ip}\"]\n  nodeName: {node}\n  conditions: {{{cond}}}\n")
    };
    let sl = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-1\n  namespace: default\n  labels: {{kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{{name: http, port: 8080, protocol: TCP}}]\nendpoints:\n{}{}{}{}{}",
        ep("198.18.0.10", "node-a", "ready: true"),
        ep("198.18.0.11", "node-b", "ready: true"),
        ep("198.18.0.12", "node-a", "ready: false"),
        ep(
            "198.18.0.13",
            "node-a",
            "ready: false, serving: true, terminating: true"
        ),
        ep(
            "198.18.0.14",
            "node-a",
            "ready: false, serving: false, terminating: true"
        ),
    );
    env.write_manifest("web.yaml", &format!("{svc}---\n{sl}"));
    env.start_agent();

    let out = Command::new(AGENT)
        .args([
            "explain",
            &format!("{VIP}:80/TCP"),
            "--pin-dir",
            &env.pin_dir,
        ])
        .args(["--manifests"])
        .arg(env.manifests.path())
        .args(["--hostname-override", "node-a", "-o", "json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let e: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        e["verdict"]
            .as_str()
            .unwrap()
            .starts_with("translated to one of 1 backend"),
        "{e}"
    );
    let eps = e["frontends"][0]["endpoints"].as_array().unwrap();
    let reason = |ip: &str| {
        let x = eps
            .iter()
            .find(|x| x["endpoint"] == format!("{ip}:8080"))
            .unwrap_or_else(|| panic!("{ip} missing: {e}"));
        x["reason"].as_str().unwrap_or("eligible").to_string()
    };
    assert_eq!(reason("198.18.0.10"), "eligible");
    assert_eq!(
        reason("198.18.0.11"),
        "on another node (Local traffic policy)"
    );
    assert_eq!(reason("198.18.0.12"), "not ready");
    assert_eq!(
        reason("198.18.0.13"),
        "terminating (ready endpoints are preferred)"
    );
    assert_eq!(reason("198.18.0.14"), "terminating and not serving");

    // Text form, and the verdicts of an undefined port and a non-frontend.
    let text = |target: &str| {
        let out = Command::new(AGENT)
            .args(["explain", target, "--pin-dir", &env.pin_dir])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let t = text(&format!("{VIP}:80"));
    assert!(
        t.contains("algorithm random") && t.contains("local-only"),
        "{t}"
    );
    assert!(text(&format!("{VIP}:81")).contains("does not define this port"));
    assert!(text("192.0.2.1:80").contains("not a frontend"));

    // Zone hints: node-a in zone-a, the hinted endpoint for zone-b is not eligible.
    let node = "apiVersion: v1\nkind: Node\nmetadata: {name: node-a, labels: {topology.kubernetes.io/zone: zone-a}}\n";
    let syncs = env.syncs();
    env.write_manifest("node.yaml", node);
    let sl = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-1\n  namespace: default\n  labels: {{kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{{name: http, port: 8080, protocol: TCP}}]\nendpoints:\n{}  hints: {{forZones: [{{name: zone-a}}]}}\n{}  hints: {{forZones: [{{name: zone-b}}]}}\n",
        ep("198.18.0.10", "node-a", "ready: true"),
        ep("198.18.0.11", "node-b", "ready: true"),
    );
    let svc = service("default", "web", &[VIP], &[("http", 80, 8080, "TCP")]);
    env.write_manifest("web.yaml", &format!("{svc}---\n{sl}"));
    env.wait_maps(
        |s| {
            s.frontends
                .values()
                .all(|f| f.flags & proxy_common::FRONTEND_F_LOCAL_ONLY == 0)
        },
        "Cluster policy synced",
    );
    assert!(env.syncs() > syncs);
    let out = Command::new(AGENT)
        .args(["explain", &format!("{VIP}:80"), "--pin-dir", &env.pin_dir])
        .args(["--manifests"])
        .arg(env.manifests.path())
        .args(["--hostname-override", "node-a", "-o", "json"])
        .output()
        .unwrap();
    let e: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let eps = e["frontends"][0]["endpoints"].as_array().unwrap();
    let b = eps
        .iter()
        .find(|x| x["endpoint"] == "198.18.0.11:8080")
        .unwrap();
    assert_eq!(
        b["reason"], "not hinted for zone \"zone-a\" (topology hints)",
        "{e}"
    );
    env.stop_agent();
}

/// A backend leaves a Service that stays: the verification deletes that pair's connection
/// counter and carries its count to the Service's own key, so the Service's connections
/// never go down; the backend's series ends with its id, the other backend's stays.
#[test]
fn a_services_connections_survive_a_backend_leaving() {
    const RR_VIP: &str = "198.19.0.42";
    let mut env = Env::new("insp-carry", 2, false);
    // A verification (and its sweep of the counters) every second.
    env.extra_agent_args = vec!["--sync-period".into(), "1s".into()];
    let manifest = |eps: &[(IpAddr, bool)]| {
        // Round robin: both backends get some of the connections.
        let svc = service("default", "rr", &[RR_VIP], &[("http", 80, 8080, "TCP")]).replace(
            "metadata:\n",
            "metadata:\n  annotations: {ebpf-proxy.io/lb-algorithm: round-robin}\n",
        );
        let sl = slice(
            "default",
            "rr-1",
            "rr",
            "IPv4",
            &[("http", 8080, "TCP")],
            eps,
        );
        format!("{svc}---\n{sl}")
    };
    env.write_manifest("rr.yaml", &manifest(&[(b(0), true), (b(1), true)]));
    env.start_agent();
    // One CPU's round-robin cursor: exactly 5 each.
    let got = by_name(&env.probe(&[
        "--cpu",
        "0",
        "tcp",
        "--to",
        &format!("{RR_VIP}:80"),
        "--count",
        "10",
    ]));
    let (n0, n1) = (got["b0"] as u64, got["b1"] as u64);
    assert!(n0 > 0 && n1 > 0 && n0 + n1 == 10, "{got:?}");
    let connections = |env: &Env| -> u64 {
        let stats = env.agent_json(&["stats"]);
        stats["services"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["service"] == "default/rr:http/TCP/v4")
            .unwrap_or_else(|| panic!("rr missing: {stats}"))["connections"]
            .as_u64()
            .unwrap()
    };
    let backend_connections = |env: &Env| -> BTreeMap<String, u64> {
        env.agent_json(&["backends"])
            .as_array()
            .unwrap()
            .iter()
            .map(|b| {
                (
                    b["backend"].as_str().unwrap().to_string(),
                    b["connections"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    assert_eq!(connections(&env), 10);
    let (k0, k1) = (format!("{}:8080", b(0)), format!("{}:8080", b(1)));
    assert_eq!(
        backend_connections(&env),
        BTreeMap::from([(k0.clone(), n0), (k1.clone(), n1)])
    );

    // b1 leaves: once a verification swept, the pair's count sits on the Service's key.
    env.write_manifest("rr.yaml", &manifest(&[(b(0), true)]));
    let pin = env.pin_path();
    let deadline = Instant::now() + Duration::from_secs(20);
    // Done when the map holds the pair in use and the Service's carried key only.
    let carried = loop {
        let pairs = proxy_userspace::datapath::maps::read_connection_counts(&pin).unwrap();
        let carried = pairs.iter().find(|(k, _)| k.backend_id == 0);
        // (A move creates the carried key at 0 before taking the pair.)
        if let (2, Some((_, n))) = (pairs.len(), carried)
            && *n != 0
        {
            break *n;
        }
        assert!(
            Instant::now() < deadline,
            "no carried count after 20 s: {pairs:?}\n{}",
            env.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(carried, n1);
    assert_eq!(connections(&env), 10);
    assert_eq!(
        backend_connections(&env),
        BTreeMap::from([(k0.clone(), n0)])
    );

    // New connections add to both sums as before.
    assert_eq!(
        by_name(&env.tcp(&format!("{RR_VIP}:80"), 4)),
        BTreeMap::from([("b0".to_string(), 4)])
    );
    assert_eq!(connections(&env), 14);
    assert_eq!(backend_connections(&env), BTreeMap::from([(k0, n0 + 4)]));
    env.stop_agent();
}
