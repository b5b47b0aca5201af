//! Privileged integration tests of the scheduling algorithms and ClientIP session affinity
//! with real connections from a pod namespace through the socket-level data path.
//!
//! Distribution tests use a chi-square test at p = 0.001 (critical values below), so a
//! correct implementation fails one run in a thousand at most; the deterministic tests
//! (the least-load algorithms, affinity expiry) hold connections open to steer the choice.
//! The least-load tests replay every choice against the IPVS scheduler's rule: each
//! connection, opened while the earlier ones are still open, must go to a backend of
//! minimal cost at that moment (ties may go either way).

mod common;
mod sched;

use std::{
    collections::BTreeMap,
    net::IpAddr,
    process::{Command, Stdio},
    time::Duration,
};

use common::*;
use sched::{assert_least_cost, counts as split, nq_cost, sed_cost, tally, wlc_cost};

const VIP: &str = "198.19.0.30";

fn b(i: usize) -> IpAddr {
    IpAddr::V4(backend_v4(i))
}

/// Chi-square critical values at p = 0.001 for 1..=5 degrees of freedom.
const CHI2_P001: [f64; 5] = [10.828, 13.816, 16.266, 18.467, 20.515];

/// Chi-square statistic of `counts` against `expected` shares (summing to 1).
fn chi2(counts: &[usize], expected: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    counts
        .iter()
        .zip(expected)
        .map(|(c, p)| {
            let e = n as f64 * p;
            (*c as f64 - e).powi(2) / e
        })
        .sum()
}

/// Service `default/web` (TCP 80 -> 8080) with metadata annotations and spec lines, and its
/// slice with `endpoints` (index, pod name).
fn web(env: &Env, annotations: &[(&str, &str)], spec_extra: &str, endpoints: &[(usize, &str)]) {
    let mut ann = String::new();
    for (k, v) in annotations {
        ann += &format!("    {k}: '{v}'\n");
    }
    let meta_ann = if ann.is_empty() {
        String::new()
    } else {
        format!("  annotations:\n{ann}")
    };
    let svc = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: default\n{meta_ann}spec:\n  clusterIP: {VIP}\n  ports:\n  - {{name: http, port: 80, targetPort: 8080, protocol: TCP}}\n{spec_extra}"
    );
    let mut eps = String::new();
    for (i, pod) in endpoints {
        eps += &format!(
            "- addresses: [\"{}\"]\n  targetRef: {{kind: Pod, name: {pod}, namespace: default}}\n",
            b(*i)
        );
    }
    let sl = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-1\n  namespace: default\n  labels:\n    kubernetes.io/service-name: web\naddressType: IPv4\nports:\n- {{name: http, port: 8080, protocol: TCP}}\nendpoints:\n{eps}"
    );
    env.write_manifest("web.yaml", &format!("{svc}---\n{sl}"));
}

/// Writes the Service and waits until the agent synced it.
fn apply(env: &Env, write: impl FnOnce()) {
    let n = env.log().matches("sync done").count();
    write();
    env.wait_log(
        |l| l.matches("sync done").count() > n,
        "sync after the change",
    );
}

fn counts(env: &Env, n: usize) -> BTreeMap<String, usize> {
    by_name(&env.tcp(&format!("{VIP}:80"), n))
}

fn started(name: &str, n: usize, annotations: &[(&str, &str)], spec: &str) -> Env {
    let mut env = Env::new(name, n, false);
    let eps: Vec<(usize, String)> = (0..n).map(|i| (i, format!("pod-{i}"))).collect();
    let eps: Vec<(usize, &str)> = eps.iter().map(|(i, p)| (*i, p.as_str())).collect();
    web(&env, annotations, spec, &eps);
    env.start_agent();
    env
}

fn share_test(name: &str, algorithm: &str) {
    let env = started(name, 3, &[("ebpf-proxy.io/lb-algorithm", algorithm)], "");
    let c = counts(&env, 300);
    let v: Vec<usize> = (0..3)
        .map(|i| *c.get(&format!("b{i}")).unwrap_or(&0))
        .collect();
    let x2 = chi2(&v, &[1.0 / 3.0; 3]);
    println!(
        "{algorithm}: {v:?}, chi2 = {x2:.2} (critical {})",
        CHI2_P001[1]
    );
    assert!(x2 < CHI2_P001[1], "{algorithm}: {v:?} chi2 {x2}");
}

#[test]
fn random_spreads_uniformly() {
    share_test("alg-random", "random");
}

#[test]
fn round_robin_spreads_uniformly_and_cycles() {
    share_test("alg-rr", "round-robin");
    // Successive connections from one process on one CPU take successive slots: over 30
    // connections, every backend appears in every window of 3 far more often than random's
    // 2/9 would give. The cursors are per CPU, so the client is pinned to one CPU (a client
    // moving between CPUs each connection interleaves two cursors).
    let env = started(
        "alg-rr2",
        3,
        &[("ebpf-proxy.io/lb-algorithm", "round-robin")],
        "",
    );
    let seq: Vec<String> = env
        .probe(&[
            "--cpu",
            "0",
            "tcp",
            "--to",
            &format!("{VIP}:80"),
            "--count",
            "30",
        ])
        .iter()
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect();
    let full = seq
        .windows(3)
        .filter(|w| w[0] != w[1] && w[1] != w[2] && w[0] != w[2])
        .count();
    println!("round-robin sequence {seq:?}: {full} of 28 windows hold all three");
    assert!(full >= 20, "{seq:?}");
}

#[test]
fn weighted_round_robin_follows_weights_and_zero_drains() {
    let env = started(
        "alg-wrr",
        4,
        &[
            ("ebpf-proxy.io/lb-algorithm", "weighted-round-robin"),
            // By pod name, by address, default 1, and 0 drains pod-3.
            (
                "ebpf-proxy.io/weights",
                r#"{"pod-1": 2, "198.18.0.12": 3, "pod-3": 0}"#,
            ),
        ],
        "",
    );
    let c = counts(&env, 300);
    assert!(
        !c.contains_key("b3"),
        "weight 0 takes no new connection: {c:?}"
    );
    let v: Vec<usize> = (0..3)
        .map(|i| *c.get(&format!("b{i}")).unwrap_or(&0))
        .collect();
    let x2 = chi2(&v, &[1.0 / 6.0, 2.0 / 6.0, 3.0 / 6.0]);
    println!("weighted 1:2:3 -> {v:?}, chi2 = {x2:.2}");
    assert!(x2 < CHI2_P001[1], "{v:?} chi2 {x2}");
}

/// Starts a netprobe holding one connection to the VIP for `hold`; returns it.
fn holder(env: &Env, hold: Duration) -> Held {
    let mut cmd = Command::new(NETPROBE);
    cmd.args(["tcp", "--to", &format!("{VIP}:80"), "--count", "1"])
        .args(["--hold-ms", &hold.as_millis().to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    Held(
        env.client
            .spawn(Some(env.cg.path()), &mut cmd)
            .expect("holder"),
    )
}

/// A running netprobe holding a connection; `name()` waits for it and returns the backend.
struct Held(proxy_testkit::testbed::ChildGuard);

impl Held {
    fn name(self) -> String {
        let lines = finish_probe(self.0);
        let v = &lines[0];
        assert_eq!(v["ok"], true, "{v}");
        v["name"].as_str().unwrap().to_string()
    }
}

#[test]
fn least_connections_avoids_backends_with_open_connections() {
    let env = started(
        "alg-lc",
        3,
        &[("ebpf-proxy.io/lb-algorithm", "least-connections")],
        "",
    );
    // Two long-lived connections take two different backends (each picks one with 0).
    let h1 = holder(&env, Duration::from_secs(4));
    std::thread::sleep(Duration::from_millis(300));
    let h2 = holder(&env, Duration::from_secs(4));
    std::thread::sleep(Duration::from_millis(300));
    // The data path's counts are on /metrics: two open connections.
    let addr = env.logged_addr("metrics");
    let out = Command::new("curl")
        .args(["-sf", &format!("http://{addr}/metrics")])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
        .expect("valid Prometheus text");
    let active: f64 = scrape
        .samples
        .iter()
        .filter(|s| s.metric == "ebpf_proxy_backend_active_connections")
        .map(|s| match s.value {
            prometheus_parse::Value::Gauge(v) => v,
            ref other => panic!("{other:?}"),
        })
        .sum();
    assert_eq!(active, 2.0, "{text}");
    // Short connections now all go to the third backend: it has 0 open, the others 1 (a
    // short connection's count is given back when its socket is released).
    let short = counts(&env, 20);
    let (n1, n2) = (h1.name(), h2.name());
    println!("held on {n1} and {n2}; short connections {short:?}");
    assert_ne!(n1, n2);
    assert_eq!(short.len(), 1, "{short:?}");
    let third = short.keys().next().unwrap();
    assert!(third != &n1 && third != &n2, "{short:?}");
    // Everything closed: every count is back to zero, so all backends are used again.
    let c = counts(&env, 60);
    assert_eq!(c.len(), 3, "{c:?}");
}

#[test]
fn client_ip_affinity_sticks_expires_on_time_and_beats_the_algorithm() {
    // Least-connections under affinity makes the effect of expiry deterministic: a held
    // connection loads the affine backend, so without affinity the next connection goes
    // elsewhere.
    let env = started(
        "aff-expiry",
        2,
        &[("ebpf-proxy.io/lb-algorithm", "least-connections")],
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 2}}\n",
    );
    // Held past the last check below (about 9 s from here).
    let h = holder(&env, Duration::from_secs(12));
    std::thread::sleep(Duration::from_millis(300));
    // Within the timeout every new connection goes to the loaded backend.
    let c = counts(&env, 20);
    assert_eq!(c.len(), 1, "{c:?}");
    let affine = c.keys().next().unwrap().clone();
    // Kept alive by use: connections 1.5 s apart span more than the timeout.
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(counts(&env, 1).keys().next().unwrap(), &affine);
    }
    // 1.6 s after the last use: still there.
    std::thread::sleep(Duration::from_millis(1600));
    assert_eq!(counts(&env, 1).keys().next().unwrap(), &affine);
    // 2.4 s after the last use: expired; least-connections picks the idle backend.
    std::thread::sleep(Duration::from_millis(2400));
    let after = counts(&env, 1);
    println!("affine {affine}, after expiry {after:?}");
    assert!(!after.contains_key(&affine), "{after:?}");
    assert_eq!(h.name(), affine);
}

#[test]
fn affinity_default_timeout_listing_and_terminating_backend() {
    let mut env = started("aff-default", 2, &[], "  sessionAffinity: ClientIP\n");
    let c = counts(&env, 20);
    assert_eq!(c.len(), 1, "{c:?}");
    let affine = c.keys().next().unwrap().clone();
    let i: usize = affine[1..].parse().unwrap();
    let other = 1 - i;

    // The frontend carries the default timeout; the affinity command lists the entry.
    let out = Command::new(AGENT)
        .args(["services", "-o", "json", "--pin-dir", &env.pin_dir])
        .output()
        .unwrap();
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows[0]["affinity_timeout_s"], 10800, "{rows}");
    let out = Command::new(AGENT)
        .args(["affinity", "-o", "json", "--pin-dir", &env.pin_dir])
        .output()
        .unwrap();
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let row = &rows[0];
    assert_eq!(row["backend"], format!("{}:8080", b(i)), "{rows}");
    assert!(
        row["client"].as_str().unwrap().starts_with("netns:"),
        "{rows}"
    );
    let exp = row["expires_in_s"].as_f64().unwrap();
    assert!(exp > 10790.0 && exp <= 10800.0, "{rows}");
    let out = Command::new(AGENT)
        .args(["affinity", "--pin-dir", &env.pin_dir])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    assert!(
        text.starts_with("SERVICE") && text.contains("netns:"),
        "{text}"
    );

    // An established connection to the affine backend, then that backend starts
    // terminating: new connections leave it at once, the established one keeps working.
    let mut held = HeldTcp::open(&env.client, env.cg.path(), &format!("{VIP}:80"), &[]);
    assert_eq!(held.backend(), affine, "{}", held.first);
    apply(&env, || {
        let text = std::fs::read_to_string(env.manifests.path().join("web.yaml")).unwrap();
        let needle = format!("- addresses: [\"{}\"]\n", b(i));
        env.write_manifest(
            "web.yaml",
            &text.replace(
                &needle,
                &format!(
                    "{needle}  conditions: {{ready: false, serving: true, terminating: true}}\n"
                ),
            ),
        );
    });
    let c = counts(&env, 10);
    assert_eq!(
        c.keys().collect::<Vec<_>>(),
        vec![&format!("b{other}")],
        "{c:?}"
    );
    let r = held.ask("still-there");
    assert_eq!(r["reply"], format!("{affine} still-there"), "{r}");
    held.close();
    env.stop_agent();
}

#[test]
fn maglev_spreads_one_clients_connections_and_source_hash_does_not() {
    let env = started(
        "alg-maglev",
        3,
        &[("ebpf-proxy.io/lb-algorithm", "maglev")],
        "",
    );
    let c = counts(&env, 30);
    println!("maglev, one client: {c:?}");
    assert!(c.len() >= 2, "{c:?}");
    apply(&env, || {
        web(
            &env,
            &[("ebpf-proxy.io/lb-algorithm", "source-hash")],
            "",
            &[(0, "pod-0"), (1, "pod-1"), (2, "pod-2")],
        )
    });
    let c = counts(&env, 30);
    assert_eq!(c.len(), 1, "source-hash, one client: {c:?}");
}

#[test]
fn source_hash_is_consistent_and_removal_moves_only_the_removed_backends_clients() {
    let env = started(
        "alg-sh",
        4,
        &[("ebpf-proxy.io/lb-algorithm", "source-hash")],
        "",
    );
    // 60 client addresses on the client pod, each one connection.
    let clients: Vec<String> = (0..60).map(|i| format!("198.18.0.{}", 100 + i)).collect();
    for c in &clients {
        let out = env
            .client
            .output(
                None,
                Command::new("ip").args(["addr", "add", &format!("{c}/32"), "dev", "eth0"]),
                Duration::from_secs(10),
            )
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    }
    let probe = || -> BTreeMap<String, String> {
        let mut args = vec![
            "tcp".to_string(),
            "--to".into(),
            format!("{VIP}:80"),
            "--count".into(),
            clients.len().to_string(),
        ];
        for c in &clients {
            args.push("--bind".into());
            args.push(c.clone());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        env.probe(&args)
            .iter()
            .map(|p| {
                assert_eq!(p["ok"], true, "{p}");
                let local: std::net::SocketAddr = p["local"].as_str().unwrap().parse().unwrap();
                (
                    local.ip().to_string(),
                    p["name"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    let first = probe();
    assert_eq!(first.len(), clients.len());
    assert_eq!(
        probe(),
        first,
        "the same client always reaches the same backend"
    );
    let per: BTreeMap<&String, usize> = first.values().fold(BTreeMap::new(), |mut m, n| {
        *m.entry(n).or_default() += 1;
        m
    });
    println!("clients per backend: {per:?}");
    assert_eq!(per.len(), 4, "{per:?}");

    // Remove b1: its clients move, the others stay.
    apply(&env, || {
        web(
            &env,
            &[("ebpf-proxy.io/lb-algorithm", "source-hash")],
            "",
            &[(0, "pod-0"), (2, "pod-2"), (3, "pod-3")],
        )
    });
    let second = probe();
    let moved = first.iter().filter(|(c, n)| second[*c] != **n).count();
    let moved_others = first
        .iter()
        .filter(|(c, n)| *n != "b1" && second[*c] != **n)
        .count();
    let on_b1 = first.values().filter(|n| *n == "b1").count();
    println!(
        "removing 1 of 4 backends moved {moved} of {} clients ({:.0}%; 1/N = 25%), {on_b1} were on it, {moved_others} others moved",
        clients.len(),
        100.0 * moved as f64 / clients.len() as f64
    );
    assert!(second.values().all(|n| n != "b1"));
    assert!(
        moved_others <= 2,
        "{moved_others} clients of remaining backends moved"
    );
}

/// Opens `n` connections to the VIP one after the other from one process, each kept open
/// until the last is done, so every choice sees the earlier connections counted. Returns
/// the backends in connection order.
fn kept_open(env: &Env, n: usize) -> Vec<String> {
    env.probe(&[
        "tcp",
        "--to",
        &format!("{VIP}:80"),
        "--count",
        &n.to_string(),
        "--keep-open",
    ])
    .iter()
    .map(|p| {
        assert_eq!(p["ok"], true, "{p}");
        p["name"].as_str().unwrap().to_string()
    })
    .collect()
}

/// Three backends weighted 1, 3 and 0 (pod-2 quiesced) by pod name, algorithm `alg`.
fn weighted_1_3_0(name: &str, alg: &str) -> Env {
    started(
        name,
        3,
        &[
            ("ebpf-proxy.io/lb-algorithm", alg),
            (
                "ebpf-proxy.io/weights",
                r#"{"pod-0": 1, "pod-1": 3, "pod-2": 0}"#,
            ),
        ],
        "",
    )
}

const W_1_3: [(&str, u64); 2] = [("b0", 1), ("b1", 3)];

#[test]
fn weighted_least_connections_follows_weights_with_connections_held() {
    let env = weighted_1_3_0("alg-wlc", "wlc");
    // The weights reached the kernel: b0 and b1 are members with weights 1 and 3, b2 (weight
    // 0) is not in the set at all.
    let mut weights: Vec<u32> = env.snapshot().members.values().copied().collect();
    weights.sort();
    assert_eq!(weights, [1, 3]);
    // 8 connections open together: 2 and 6, the only split where connections / weight
    // is equal (2/1 = 6/3), and every single choice was a least-loaded backend.
    let seq = kept_open(&env, 8);
    println!("wlc 1:3:0, 8 held: {seq:?}");
    assert_least_cost(&seq, &W_1_3, wlc_cost);
    let c = tally(&seq);
    assert_eq!(c, split(&[("b0", 2), ("b1", 6)]));
    // All closed, the counts are back at zero: 12 held split 3 and 9.
    let seq = kept_open(&env, 12);
    assert_least_cost(&seq, &W_1_3, wlc_cost);
    assert_eq!(tally(&seq), split(&[("b0", 3), ("b1", 9)]));
}

#[test]
fn shortest_expected_delay_sends_the_first_connections_to_the_heavier_backend() {
    let env = weighted_1_3_0("alg-sed", "sed");
    // (0+1)/1 > (0+1)/3 and 1/1 > (1+1)/3: the first two go to b1 although b0 is idle
    // (wlc would give them one each: 0/1 = 0/3, then the idle one); then the split follows
    // the weights.
    let seq = kept_open(&env, 8);
    println!("sed 1:3:0, 8 held: {seq:?}");
    assert_eq!(seq[..2], ["b1", "b1"], "{seq:?}");
    assert_least_cost(&seq, &W_1_3, sed_cost);
    assert_eq!(tally(&seq), split(&[("b0", 2), ("b1", 6)]));
}

#[test]
fn never_queue_picks_an_idle_backend_first_then_shortest_expected_delay() {
    // The IPVS name through --lb-algorithm this time (no annotation for the algorithm).
    let mut env = Env::new("alg-nq", 3, false);
    web(
        &env,
        &[(
            "ebpf-proxy.io/weights",
            r#"{"pod-0": 1, "pod-1": 3, "pod-2": 0}"#,
        )],
        "",
        &[(0, "pod-0"), (1, "pod-1"), (2, "pod-2")],
    );
    env.extra_agent_args = vec!["--lb-algorithm".into(), "nq".into()];
    env.start_agent();
    // Both weighted backends are idle: the first two connections take one each (sed would
    // give both to b1), never b2, idle but of weight 0. Then (1+1)/1 > (1+1)/3 and on:
    // b1 until 2/1 = 6/3.
    let seq = kept_open(&env, 6);
    println!("nq 1:3:0, 6 held: {seq:?}");
    let mut first = seq[..2].to_vec();
    first.sort();
    assert_eq!(first, ["b0", "b1"], "{seq:?}");
    assert_least_cost(&seq, &W_1_3, nq_cost);
    assert_eq!(tally(&seq), split(&[("b0", 1), ("b1", 5)]));
    // Every weight 1 (annotation removed): nq takes each idle backend once before any
    // gets a second connection, b2 included now.
    apply(&env, || {
        web(&env, &[], "", &[(0, "pod-0"), (1, "pod-1"), (2, "pod-2")])
    });
    let seq = kept_open(&env, 3);
    assert_eq!(tally(&seq).len(), 3, "{seq:?}");
}

#[test]
fn destination_hash_maps_each_frontend_to_one_backend_whoever_the_client() {
    // A cluster IP and eight external IPs, all frontends of one Service port.
    let ext: Vec<String> = (40..48).map(|i| format!("198.19.0.{i}")).collect();
    let spec = format!("  externalIPs: [{}]\n", ext.join(", "));
    let env = started("alg-dh", 3, &[("ebpf-proxy.io/lb-algorithm", "dh")], &spec);
    // 12 client addresses on the client pod.
    let clients: Vec<String> = (0..12).map(|i| format!("198.18.0.{}", 100 + i)).collect();
    for c in &clients {
        let out = env
            .client
            .output(
                None,
                Command::new("ip").args(["addr", "add", &format!("{c}/32"), "dev", "eth0"]),
                Duration::from_secs(10),
            )
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    }
    // One connection from every client address to `frontend`: the backends reached.
    let from_all = |frontend: &str| -> BTreeMap<String, usize> {
        let mut args = vec![
            "tcp".to_string(),
            "--to".into(),
            format!("{frontend}:80"),
            "--count".into(),
            clients.len().to_string(),
        ];
        for c in &clients {
            args.push("--bind".into());
            args.push(c.clone());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let probes = env.probe(&args);
        assert!(probes.iter().all(|p| p["ok"] == true), "{probes:?}");
        by_name(&probes)
    };
    let mut per_frontend = BTreeMap::new();
    for fe in std::iter::once(VIP.to_string()).chain(ext.iter().cloned()) {
        let c = from_all(&fe);
        assert_eq!(
            c.len(),
            1,
            "dh: every client to {fe} reaches one backend: {c:?}"
        );
        // And again: the same one.
        assert_eq!(from_all(&fe), c, "{fe}");
        per_frontend.insert(fe, c.into_keys().next().unwrap());
    }
    println!("dh: backend per frontend {per_frontend:?}");
    let used: std::collections::BTreeSet<&String> = per_frontend.values().collect();
    assert!(
        used.len() >= 2,
        "different frontends map elsewhere: {per_frontend:?}"
    );
    // The same clients to one frontend with source-hash spread over backends: dh ignores
    // the client, sh does not.
    apply(&env, || {
        web(
            &env,
            &[("ebpf-proxy.io/lb-algorithm", "sh")],
            &spec,
            &[(0, "pod-0"), (1, "pod-1"), (2, "pod-2")],
        )
    });
    let c = from_all(VIP);
    println!("sh, 12 clients to {VIP}: {c:?}");
    assert!(c.len() >= 2, "{c:?}");
}
