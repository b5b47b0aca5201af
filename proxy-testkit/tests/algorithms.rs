//! Privileged integration tests of the scheduling algorithms and ClientIP session affinity
//! with real connections from a pod namespace through the socket-level data path, where the
//! test steers the choice in code: connections held open while others are made, affinity
//! timing, many client addresses, `/metrics` and the `affinity` listing.
//!
//! The cases that are objects in and connections out (the distributions of random,
//! round-robin and weighted-round-robin, maglev against source-hash, the least-load
//! schedulers replayed against IPVS's rule) are `tests/scenarios/socket/alg-*.txtar`.

mod common;

use std::{
    collections::BTreeMap,
    net::IpAddr,
    process::{Command, Stdio},
    time::Duration,
};

use common::*;

const VIP: &str = "198.19.0.30";

fn b(i: usize) -> IpAddr {
    IpAddr::V4(backend_v4(i))
}

/// `default/web` (TCP 80 -> 8080) with metadata `annotations` and `spec` lines, its endpoints
/// the backends `endpoints`, backend `b<i>` backed by pod `pod-<i>`.
fn web(annotations: &[(&str, &str)], spec: &str, endpoints: &[usize]) -> Web {
    let mut w = Web::new(VIP).ports(&[HTTP]).spec(spec);
    for (k, v) in annotations {
        w = w.annotation(k, v);
    }
    w.endpoints(
        endpoints
            .iter()
            .map(|i| Endpoint::new(b(*i)).pod(&format!("pod-{i}"))),
    )
}

fn counts(env: &Env, n: usize) -> BTreeMap<String, usize> {
    by_name(&env.tcp(&format!("{VIP}:80"), n))
}

fn started(name: &str, n: usize, annotations: &[(&str, &str)], spec: &str) -> Env {
    let mut env = Env::new(name, n, false);
    env.write_web(&web(annotations, spec, &(0..n).collect::<Vec<_>>()));
    env.start_agent();
    env
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
    let mut w = web(&[], "  sessionAffinity: ClientIP\n", &[0, 1]);
    w.endpoints[i] = w.endpoints[i]
        .clone()
        .conditions("ready: false, serving: true, terminating: true");
    env.apply(|| env.write_web(&w));
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
    env.apply(|| {
        env.write_web(&web(
            &[("ebpf-proxy.io/lb-algorithm", "source-hash")],
            "",
            &[0, 2, 3],
        ))
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
    env.apply(|| {
        env.write_web(&web(
            &[("ebpf-proxy.io/lb-algorithm", "sh")],
            &spec,
            &[0, 1, 2],
        ))
    });
    let c = from_all(VIP);
    println!("sh, 12 clients to {VIP}: {c:?}");
    assert!(c.len() >= 2, "{c:?}");
}
