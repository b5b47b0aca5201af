//! Privileged integration tests of the socket-level data path: the real programs attached to
//! a test cgroup, the real agent fed by manifests, real sockets in pod namespaces.
//!
//! Run as root with `cargo xtask test` (which builds the eBPF object first). Each test has
//! its own namespaces, cgroup and pin directory, cleaned up on drop.

mod common;

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use common::*;
use proxy_common::FRONTEND_F_VIP_MARKER;

const ECONNREFUSED: i64 = 111;
const VIP: &str = "198.19.0.10";

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn b(i: usize) -> IpAddr {
    IpAddr::V4(backend_v4(i))
}

/// A Service `default/web` (TCP 80 -> 8080 "http", UDP 53 -> 5353 "dns") with the given
/// ready IPv4 endpoints.
fn web(env: &Env, endpoints: &[IpAddr]) {
    let svc = service(
        "default",
        "web",
        &[VIP],
        &[("http", 80, 8080, "TCP"), ("dns", 53, 5353, "UDP")],
    );
    let eps: Vec<(IpAddr, bool)> = endpoints.iter().map(|a| (*a, true)).collect();
    let sl = slice(
        "default",
        "web-1",
        "web",
        "IPv4",
        &[("http", 8080, "TCP"), ("dns", 5353, "UDP")],
        &eps,
    );
    env.write_manifest("web.yaml", &format!("{svc}---\n{sl}"));
}

#[test]
fn tcp_and_udp_reach_every_backend_and_peer_is_the_vip() {
    let mut env = Env::new("reach", 3, false);
    web(&env, &[b(0), b(1), b(2)]);
    env.start_agent();

    let tcp = env.tcp(&format!("{VIP}:80"), 60);
    let counts = by_name(&tcp);
    println!("TCP per backend: {counts:?}");
    assert_eq!(counts.len(), 3, "every backend answers TCP: {counts:?}");
    for p in &tcp {
        // getpeername() shows the VIP, not the pod.
        assert_eq!(p["peer"], format!("{VIP}:80"), "{p}");
    }

    // A dual-stack IPv6 socket reaching the IPv4 VIP as ::ffff:a.b.c.d is translated too.
    let mapped = format!("[::ffff:{VIP}]:80");
    let r = env.tcp(&mapped, 5);
    assert_eq!(by_name(&r).values().sum::<usize>(), 5);
    for p in &r {
        assert_eq!(
            p["peer"], mapped,
            "getpeername on the IPv6 socket shows the mapped VIP: {p}"
        );
    }

    // Connected UDP: one backend per socket; several sockets reach every backend.
    let mut udp_counts = std::collections::BTreeMap::new();
    for _ in 0..40 {
        let r = env.udp(&format!("{VIP}:53"), 2, true);
        let c = by_name(&r);
        assert_eq!(
            c.len(),
            1,
            "a connected UDP socket keeps its backend: {c:?}"
        );
        for p in &r {
            assert_eq!(p["peer"], format!("{VIP}:53"), "{p}");
            assert_eq!(
                p["from"],
                format!("{VIP}:53"),
                "recvfrom shows the VIP: {p}"
            );
        }
        for (k, v) in c {
            *udp_counts.entry(k).or_insert(0) += v;
        }
        if udp_counts.len() == 3 {
            break;
        }
    }
    println!("connected UDP per backend: {udp_counts:?}");
    assert_eq!(udp_counts.len(), 3, "every backend answers UDP");

    // Unconnected UDP: one socket's flow to one frontend sticks to one backend.
    let r = env.udp(&format!("{VIP}:53"), 10, false);
    let c = by_name(&r);
    assert_eq!(
        c.len(),
        1,
        "an unconnected UDP flow keeps its backend: {c:?}"
    );
    for p in &r {
        assert_eq!(
            p["from"],
            format!("{VIP}:53"),
            "recvfrom shows the VIP: {p}"
        );
    }
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..40 {
        seen.extend(by_name(&env.udp(&format!("{VIP}:53"), 1, false)).into_keys());
        if seen.len() == 3 {
            break;
        }
    }
    assert_eq!(
        seen.len(),
        3,
        "new flows spread over every backend: {seen:?}"
    );

    // Health: 200 once synced, with kube-proxy's JSON fields.
    let h = env.health_addr();
    let out = std::process::Command::new("curl")
        .args(["-s", "-w", "\n%{http_code}", &format!("http://{h}/healthz")])
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.ends_with("\n200"), "healthz: {text}");
    assert!(
        text.contains("lastUpdated") && text.contains("currentTime"),
        "{text}"
    );
}

#[test]
fn pod_ip_addressed_directly_is_never_translated() {
    let mut env = Env::new("direct", 2, false);
    web(&env, &[b(0), b(1)]);
    env.start_agent();
    let target = format!("{}:8080", backend_v4(1));
    for p in env.tcp(&target, 5) {
        assert_eq!(p["ok"], true, "{p}");
        assert_eq!(p["name"], "b1");
        assert_eq!(p["peer"], target, "getpeername untouched: {p}");
    }
    let target = format!("{}:5353", backend_v4(0));
    for p in env.udp(&target, 3, false) {
        assert_eq!(p["ok"], true, "{p}");
        assert_eq!(p["from"], target, "recvfrom untouched: {p}");
    }
}

/// One unconnected UDP socket alternates between a VIP and the address of the VIP's only
/// endpoint: each reply is shown as coming from where the socket's last datagram to that
/// peer went (the VIP, then the pod, then the VIP again), in both families.
#[test]
fn udp_reply_source_follows_the_last_datagram_to_the_peer() {
    let mut env = Env::new("lastsend", 1, true);
    let vip6 = "fd00:96::10";
    let svc = service("default", "web", &[VIP], &[("dns", 53, 5353, "UDP")]);
    let sl = slice(
        "default",
        "web-1",
        "web",
        "IPv4",
        &[("dns", 5353, "UDP")],
        &[(b(0), true)],
    );
    let svc6 = service("default", "web6", &[vip6], &[("dns", 53, 5353, "UDP")]);
    let sl6 = slice(
        "default",
        "web6-1",
        "web6",
        "IPv6",
        &[("dns", 5353, "UDP")],
        &[(IpAddr::V6(backend_v6(0)), true)],
    );
    env.write_manifest("web.yaml", &format!("{svc}---\n{sl}---\n{svc6}---\n{sl6}"));
    env.start_agent();
    for (vip, pod) in [
        (format!("{VIP}:53"), format!("{}:5353", backend_v4(0))),
        (format!("[{vip6}]:53"), format!("[{}]:5353", backend_v6(0))),
    ] {
        let r = env.probe(&[
            "udp",
            "--to",
            &vip,
            "--to",
            &pod,
            "--count",
            "6",
            "--timeout-ms",
            "2000",
        ]);
        assert_eq!(r.len(), 6, "{r:?}");
        for (i, p) in r.iter().enumerate() {
            assert_eq!(p["ok"], true, "{p}");
            assert_eq!(p["name"], "b0", "{p}");
            let want = if i % 2 == 0 { &vip } else { &pod };
            assert_eq!(p["from"], want.as_str(), "datagram {i}: {r:?}");
        }
    }

    // A socket connected through one VIP, then disconnected (`connect(AF_UNSPEC)`), sends
    // through another VIP of the same endpoint and back: each reply comes from the VIP
    // of the datagram before it, not from the one the socket was once connected to.
    let vip2 = "198.19.0.11";
    let svc2 = service("default", "web2", &[vip2], &[("dns", 53, 5353, "UDP")]);
    let sl2 = slice(
        "default",
        "web2-1",
        "web2",
        "IPv4",
        &[("dns", 5353, "UDP")],
        &[(b(0), true)],
    );
    env.write_manifest("web2.yaml", &format!("{svc2}---\n{sl2}"));
    env.wait_maps(
        |s| s.names.values().any(|n| n.starts_with("default/web2:")),
        "web2",
    );
    // Datagrams alternate between `first` (connected, then disconnected) and `second`
    // (sendto); each reply comes from where the datagram before it went.
    let alternate = |first: &str, second: &str| {
        let r = env.probe(&[
            "udp",
            "--to",
            first,
            "--to",
            second,
            "--count",
            "4",
            "--connected",
            "--then-disconnect",
            "--timeout-ms",
            "2000",
        ]);
        assert_eq!(r.len(), 4, "{r:?}");
        for (i, p) in r.iter().enumerate() {
            assert_eq!(p["ok"], true, "{p}");
            let want = if i % 2 == 0 { first } else { second };
            assert_eq!(p["from"], want, "datagram {i}: {r:?}");
        }
    };
    alternate(&format!("{VIP}:53"), &format!("{vip2}:53"));
    // The same, sending to the pod itself after the disconnect: its replies come from the
    // pod, until a datagram goes through the VIP again.
    alternate(&format!("{VIP}:53"), &format!("{}:5353", backend_v4(0)));
}

#[test]
fn ipv6_cluster_ip() {
    let mut env = Env::new("ipv6", 2, true);
    let vip6 = "fd00:96::10";
    let svc = service(
        "default",
        "web6",
        &[vip6],
        &[("http", 80, 8080, "TCP"), ("dns", 53, 5353, "UDP")],
    );
    let eps: Vec<(IpAddr, bool)> = (0..2).map(|i| (IpAddr::V6(backend_v6(i)), true)).collect();
    let sl = slice(
        "default",
        "web6-1",
        "web6",
        "IPv6",
        &[("http", 8080, "TCP"), ("dns", 5353, "UDP")],
        &eps,
    );
    env.write_manifest("web6.yaml", &format!("{svc}---\n{sl}"));
    env.start_agent();

    let to = format!("[{vip6}]:80");
    let tcp = env.tcp(&to, 30);
    let c = by_name(&tcp);
    assert_eq!(c.len(), 2, "{c:?}");
    assert!(tcp.iter().all(|p| p["peer"] == to.as_str()), "{tcp:?}");
    let to = format!("[{vip6}]:53");
    let udp = env.udp(&to, 3, false);
    assert_eq!(by_name(&udp).len(), 1);
    assert!(udp.iter().all(|p| p["from"] == to.as_str()), "{udp:?}");
    // Undefined port on an IPv6 VIP.
    let r = env.tcp(&format!("[{vip6}]:81"), 1);
    assert_eq!(errno(&r[0]), Some(ECONNREFUSED), "{r:?}");
}

#[test]
fn zero_endpoints_and_undefined_port_are_refused() {
    let mut env = Env::new("refuse", 1, false);
    web(&env, &[]);
    env.start_agent();
    let start = Instant::now();
    let r = env.tcp(&format!("{VIP}:80"), 1);
    assert_eq!(errno(&r[0]), Some(ECONNREFUSED), "no endpoints, TCP: {r:?}");
    let r = env.udp(&format!("{VIP}:53"), 1, false);
    assert_eq!(
        errno(&r[0]),
        Some(ECONNREFUSED),
        "no endpoints, UDP sendto: {r:?}"
    );
    let r = env.udp(&format!("{VIP}:53"), 1, true);
    assert_eq!(
        errno(&r[0]),
        Some(ECONNREFUSED),
        "no endpoints, UDP connect: {r:?}"
    );
    // A port the VIP does not define, and the other protocol of a defined port.
    let r = env.tcp(&format!("{VIP}:8080"), 1);
    assert_eq!(errno(&r[0]), Some(ECONNREFUSED), "undefined port: {r:?}");
    let r = env.tcp(&format!("{VIP}:53"), 1);
    assert_eq!(
        errno(&r[0]),
        Some(ECONNREFUSED),
        "TCP on a UDP-only port: {r:?}"
    );
    let r = env.udp(&format!("{VIP}:80"), 1, false);
    assert_eq!(
        errno(&r[0]),
        Some(ECONNREFUSED),
        "UDP on a TCP-only port: {r:?}"
    );
    // "At once": no connect timeout was involved.
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "refusals took {:?}",
        start.elapsed()
    );

    // From none to some: the next connection succeeds.
    web(&env, &[b(0)]);
    env.wait_maps(
        |s| s.frontends.values().any(|f| f.backend_count == 1),
        "endpoint added",
    );
    assert_eq!(by_name(&env.tcp(&format!("{VIP}:80"), 3)).len(), 1);
    assert_eq!(by_name(&env.udp(&format!("{VIP}:53"), 2, false)).len(), 1);
}

#[test]
fn endpoint_removal_takes_effect_without_restart() {
    let mut env = Env::new("remove", 3, false);
    web(&env, &[b(0), b(1), b(2)]);
    env.start_agent();
    assert_eq!(by_name(&env.tcp(&format!("{VIP}:80"), 60)).len(), 3);

    let written = Instant::now();
    web(&env, &[b(0), b(1)]);
    let waited = env.wait_maps(
        |s| {
            s.frontends
                .values()
                .all(|f| f.flags & FRONTEND_F_VIP_MARKER != 0 || f.backend_count == 2)
        },
        "backend removed",
    );
    let _ = waited;
    println!("file change to data path update: {:?}", written.elapsed());
    let c = by_name(&env.tcp(&format!("{VIP}:80"), 60));
    assert!(
        !c.contains_key("b2"),
        "removed endpoint still chosen: {c:?}"
    );
    assert_eq!(c.len(), 2, "{c:?}");
    // The removed backend's entries are gone; the unused backend ids were deleted.
    let s = env.snapshot();
    assert_eq!(
        s.backends.len(),
        4,
        "2 endpoints x (TCP, UDP): {:?}",
        s.backends
    );

    // Deleting the manifest file removes the service; its VIP is no longer a VIP.
    env.remove_manifest("web.yaml");
    env.wait_maps(
        |s| s.frontends.is_empty() && s.slots.is_empty() && s.backends.is_empty(),
        "service removed",
    );
}

#[test]
fn several_slices_are_merged_and_target_ports_resolve_per_endpoint() {
    let mut env = Env::new("slices", 3, false);
    // One Service port "http" whose endpoints listen on different container ports: b0/b1 on
    // 8080 (slice 1), b2 on 8081 (slice 2, as after a rolling update of a named targetPort).
    let svc = service("default", "web", &[VIP], &[("http", 80, 8080, "TCP")]);
    let s1 = slice(
        "default",
        "web-a",
        "web",
        "IPv4",
        &[("http", 8080, "TCP")],
        &[(b(0), true), (b(1), true)],
    );
    // b1 appears in both slices with the same port: merged, not duplicated.
    let s2 = slice(
        "default",
        "web-b",
        "web",
        "IPv4",
        &[("http", 8081, "TCP")],
        &[(b(2), true), (b(1), false)],
    );
    let s3 = slice(
        "default",
        "web-c",
        "web",
        "IPv4",
        &[("http", 8080, "TCP")],
        &[(b(1), true)],
    );
    env.write_manifest("web.yaml", &format!("{svc}---\n{s1}---\n{s2}"));
    env.write_manifest("web-c.yaml", &s3);
    env.start_agent();
    let s = env.snapshot();
    let fe = s.frontends.values().find(|f| f.flags == 0).unwrap();
    assert_eq!(
        fe.backend_count, 3,
        "b0:8080, b1:8080 (deduplicated), b2:8081"
    );
    let c = by_name(&env.tcp(&format!("{VIP}:80"), 60));
    assert_eq!(c.len(), 3, "{c:?}");
}

#[test]
fn bad_input_is_skipped_with_one_clear_line_and_others_keep_working() {
    let mut env = Env::new("badinput", 1, false);
    web(&env, &[b(0)]);
    env.write_manifest(
        "broken.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: x\n  - [unclosed",
    );
    env.write_manifest(
        "bad-ip.yaml",
        &service(
            "default",
            "bad-ip",
            &["10.96.300.1"],
            &[("http", 80, 8080, "TCP")],
        ),
    );
    env.write_manifest(
        "port0.yaml",
        &service(
            "default",
            "port-zero",
            &["198.19.0.20"],
            &[("http", 0, 8080, "TCP")],
        ),
    );
    env.write_manifest(
        "port-big.yaml",
        &service(
            "default",
            "port-big",
            &["198.19.0.21"],
            &[("http", 70000, 8080, "TCP")],
        ),
    );
    env.write_manifest(
        "family.yaml",
        &format!(
            "{}---\n{}",
            service(
                "default",
                "fam",
                &["198.19.0.22"],
                &[("http", 80, 8080, "TCP")]
            ),
            slice(
                "default",
                "fam-1",
                "fam",
                "IPv4",
                &[("http", 8080, "TCP")],
                &[(ip("fd00::1"), true), (b(0), true)]
            )
        ),
    );
    env.write_manifest(
        "kind.yaml",
        "apiVersion: example.com/v1\nkind: Gadget\nmetadata: {name: g, namespace: default}\n",
    );
    env.start_agent();
    let log = env.log();
    for (needle, what) in [
        ("broken.yaml", "unparseable file"),
        ("Service default/bad-ip", "invalid IP"),
        ("Service default/port-zero", "port 0"),
        ("Service default/port-big", "port above 65535"),
        ("EndpointSlice default/fam-1", "wrong-family address"),
        ("Gadget", "unknown kind"),
    ] {
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("skipped") && l.contains(needle))
            .collect();
        assert_eq!(
            lines.len(),
            1,
            "{what}: expected one error line naming {needle:?}, got {lines:?}\n{log}"
        );
        println!("{what}: {}", lines[0]);
    }
    // Every other service works, including the one whose slice had one bad address.
    assert_eq!(by_name(&env.tcp(&format!("{VIP}:80"), 3)).len(), 1);
    assert_eq!(by_name(&env.tcp("198.19.0.22:80", 3)).len(), 1);
    // The agent is still running, and a later fix is picked up.
    env.write_manifest(
        "port0.yaml",
        &service(
            "default",
            "port-zero",
            &["198.19.0.20"],
            &[("http", 80, 8080, "TCP")],
        ),
    );
    env.wait_maps(
        |s| {
            s.names
                .values()
                .any(|n| n.starts_with("default/port-zero:"))
        },
        "fixed service",
    );
    // Still one line per bad object: errors are not repeated on every sync.
    let log = env.log();
    assert_eq!(
        log.lines()
            .filter(|l| l.contains("skipped") && l.contains("Service default/bad-ip"))
            .count(),
        1
    );
}

#[test]
fn full_map_is_reported_and_existing_state_is_kept() {
    let mut env = Env::new("full", 3, false);
    env.extra_agent_args = vec!["--max-backends".into(), "2".into()];
    let svc = service("default", "web", &[VIP], &[("http", 80, 8080, "TCP")]);
    let two = slice(
        "default",
        "web-1",
        "web",
        "IPv4",
        &[("http", 8080, "TCP")],
        &[(b(0), true), (b(1), true)],
    );
    env.write_manifest("web.yaml", &format!("{svc}---\n{two}"));
    env.start_agent();
    let before = env.snapshot();
    assert_eq!(before.backends.len(), 2);
    let three = slice(
        "default",
        "web-1",
        "web",
        "IPv4",
        &[("http", 8080, "TCP")],
        &[(b(0), true), (b(1), true), (b(2), true)],
    );
    env.write_manifest("web.yaml", &format!("{svc}---\n{three}"));
    env.wait_log(|l| l.contains("map BACKENDS is full"), "full map error");
    let log = env.log();
    let line = log
        .lines()
        .find(|l| l.contains("map BACKENDS is full"))
        .unwrap();
    assert!(
        line.contains("limit 2") && line.contains("--max-backends"),
        "{line}"
    );
    assert_eq!(env.snapshot(), before, "nothing half-applied");
    assert_eq!(by_name(&env.tcp(&format!("{VIP}:80"), 20)).len(), 2);
}

#[test]
fn open_connection_survives_agent_restart_and_data_path_works_while_agent_is_down() {
    let mut env = Env::new("restart", 2, false);
    web(&env, &[b(0), b(1)]);
    env.start_agent();

    // An established TCP connection through a VIP, held open by an interactive netprobe.
    let svc = service(
        "default",
        "hold",
        &["198.19.0.30"],
        &[("hold", 80, 8081, "TCP")],
    );
    let sl = slice(
        "default",
        "hold-1",
        "hold",
        "IPv4",
        &[("hold", 8081, "TCP")],
        &[(b(0), true), (b(1), true)],
    );
    env.write_manifest("hold.yaml", &format!("{svc}---\n{sl}"));
    env.wait_maps(
        |s| s.names.values().any(|n| n.starts_with("default/hold:")),
        "hold service",
    );

    let mut held = HeldTcp::open(&env.client, env.cg.path(), "198.19.0.30:80", &[]);
    assert_eq!(held.first["ok"], true, "{}", held.first);
    let backend = held.backend().to_string();
    let mut ask = |msg: &str| held.ask(msg);
    assert_eq!(ask("before")["reply"], format!("{backend} before"));

    // Agent down: the pinned data path keeps answering new connections and the held one.
    env.stop_agent();
    assert!(env.log().contains("data path stays attached"));
    assert_eq!(ask("while-down")["reply"], format!("{backend} while-down"));
    let c = by_name(&env.tcp(&format!("{VIP}:80"), 20));
    assert_eq!(c.len(), 2, "new connections while the agent is down: {c:?}");

    // Agent back: it adopts the pinned maps and links and rewrites nothing.
    env.start_agent();
    let log = env.log();
    let last_sync = log.lines().rfind(|l| l.contains("sync done")).unwrap();
    assert!(
        last_sync.contains("writes=0") && last_sync.contains("deletes=0"),
        "{last_sync}"
    );
    assert_eq!(ask("after")["reply"], format!("{backend} after"));
    assert_eq!(by_name(&env.tcp(&format!("{VIP}:80"), 20)).len(), 2);
    // Exactly one generation of programs is attached after the restart.
    let out = std::process::Command::new("bpftool")
        .args(["cgroup", "show"])
        .arg(env.cg.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.matches("connect4").count(), 1, "{text}");
    // The egress program is attached only while a connected UDP socket is stale.
    assert_eq!(text.matches("sock_egress").count(), 0, "{text}");
    assert_eq!(
        text.matches("cgroup_inet_sock_release").count(),
        1,
        "{text}"
    );
    assert_eq!(text.lines().count(), 10, "header + 9 programs: {text}");
}

#[test]
fn cleanup_detaches_and_removes_everything() {
    let mut env = Env::new("cleanup", 1, false);
    web(&env, &[b(0)]);
    env.start_agent();
    // A cleanup started while the agent still runs (a DaemonSet pod terminating) waits for
    // it to stop, and removes nothing before.
    let cleanup = std::process::Command::new(AGENT)
        .args(["cleanup", "--pin-dir", &env.pin_dir, "--cgroup-path"])
        .arg(env.cg.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(env.pin_path().exists(), "removed while the agent runs");
    assert_eq!(
        by_name(&env.tcp(&format!("{VIP}:80"), 2)).len(),
        1,
        "still served"
    );
    env.stop_agent();
    let out = cleanup.wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(!env.pin_path().exists());
    let out = std::process::Command::new("bpftool")
        .args(["cgroup", "show"])
        .arg(env.cg.path())
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "",
        "programs still attached"
    );
    // Without the data path the VIP is just an unrouted address: no translation, no refusal
    // from the program (the lab's node namespace has no route for it).
    let r = env.probe(&["tcp", "--to", &format!("{VIP}:80"), "--timeout-ms", "300"]);
    assert_ne!(r[0]["ok"], true, "{r:?}");
    // Running it again is fine.
    let out = std::process::Command::new(AGENT)
        .args(["cleanup", "--pin-dir", &env.pin_dir])
        .output()
        .unwrap();
    assert!(out.status.success());
}

#[test]
fn services_command_prints_frontends_from_pinned_maps() {
    let mut env = Env::new("svccmd", 2, false);
    web(&env, &[b(0), b(1)]);
    env.start_agent();
    env.stop_agent();
    // Works while the agent is down: it reads the pinned maps.
    let out = std::process::Command::new(AGENT)
        .args(["services", "--pin-dir", &env.pin_dir])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    assert!(out.status.success());
    assert!(
        text.contains("default/web:http/TCP/v4") && text.contains("198.19.0.10:80"),
        "{text}"
    );
    assert!(text.contains(&format!("{}:8080", backend_v4(0))), "{text}");
    let out = std::process::Command::new(AGENT)
        .args(["services", "--pin-dir", &env.pin_dir, "-o", "json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 2);
}

/// The connected sockets' reverse-NAT slots (`SOCK_NAT`) of `env`: (slot, cookie) of each
/// slot in use, and `SOCK_NAT_SPILLED`.
fn slots_in_use(env: &Env) -> (Vec<(u32, u64)>, u32) {
    use aya::maps::{Array, Map, MapData};
    use proxy_common::{SOCK_NAT, SOCK_NAT_SPILLED, SockNat};
    let dir = env.pin_path();
    let slots: Array<MapData, SockNat> =
        Array::try_from(Map::Array(MapData::from_pin(dir.join(SOCK_NAT)).unwrap())).unwrap();
    let used = (0..slots.len())
        .map(|i| (i, slots.get(&i, 0).unwrap().key.cookie))
        .filter(|(_, c)| *c != 0)
        .collect();
    let spilled: Array<MapData, u32> = Array::try_from(Map::Array(
        MapData::from_pin(dir.join(SOCK_NAT_SPILLED)).unwrap(),
    ))
    .unwrap();
    (used, spilled.get(&0, 0).unwrap())
}

/// `ebpf-proxy <command> -o json` on `env`'s pins.
fn agent_json(env: &Env, command: &str) -> serde_json::Value {
    let out = std::process::Command::new(AGENT)
        .args([command, "--pin-dir", &env.pin_dir, "-o", "json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{command}: {out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn connected_sockets_take_slots_spill_when_taken_and_free_them_on_close() {
    let mut env = Env::new("slots", 2, false);
    // 64 slots and 16 overflow entries.
    env.extra_agent_args = vec!["--max-sockets".into(), "64".into()];
    web(&env, &[b(0), b(1)]);
    // A Service whose endpoint refuses (nothing listens on 9999), least-connections: each
    // connect is counted, and its release must give the count back.
    let svc = service(
        "default",
        "shut",
        &["198.19.0.40"],
        &[("x", 80, 9999, "TCP")],
    )
    .replace(
        "metadata:\n",
        "metadata:\n  annotations: {ebpf-proxy.io/lb-algorithm: least-connections}\n",
    );
    let sl = slice(
        "default",
        "shut-1",
        "shut",
        "IPv4",
        &[("x", 9999, "TCP")],
        &[(b(0), true)],
    );
    env.write_manifest("shut.yaml", &format!("{svc}---\n{sl}"));
    env.start_agent();
    env.wait_maps(
        |s| s.names.values().any(|n| n.starts_with("default/shut:")),
        "shut service",
    );
    assert_eq!(slots_in_use(&env), (vec![], 0), "nothing connected yet");

    // Connects the backend refuses: a blocking one clears the socket's peer before its
    // release (a non-blocking one keeps it); the entry goes either way.
    let refused = |env: &Env| {
        let mut r = env.probe(&["tcp", "--to", "198.19.0.40:80", "--count", "2"]);
        r.extend(env.probe(&[
            "tcp",
            "--to",
            "198.19.0.40:80",
            "--count",
            "2",
            "--blocking",
        ]));
        assert!(
            r.len() == 4 && r.iter().all(|p| errno(p) == Some(ECONNREFUSED)),
            "{r:?}"
        );
    };
    refused(&env);
    assert_eq!(
        slots_in_use(&env),
        (vec![], 0),
        "failed connects hold no slot"
    );

    // 65 connections open together, 64 slots: at least one entry overflows. From one CPU,
    // whose cookies come in one contiguous batch (sockets opened on two CPUs draw from two
    // batches, whose slots overlap, and the 16 overflow entries would not be enough).
    let holder = env
        .client
        .spawn(
            Some(env.cg.path()),
            std::process::Command::new("taskset")
                .args(["-c", "0", NETPROBE, "tcp", "--to", &format!("{VIP}:80")])
                .args(["--count", "65", "--keep-open", "--hold-ms", "4000"])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null()),
        )
        .unwrap();
    // An entry the full overflow map refused (a batch of cookies ending among the 65)
    // counts as `map_update_failed`; that socket's getpeername() shows its endpoint.
    let failed = |env: &Env| {
        agent_json(env, "stats")["reasons"]["map_update_failed"]
            .as_u64()
            .unwrap() as u32
    };
    let t = Instant::now();
    let (used, spilled) = loop {
        let (used, spilled) = slots_in_use(&env);
        if used.len() as u32 + spilled + failed(&env) >= 65 || t.elapsed() > Duration::from_secs(5)
        {
            break (used, spilled);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let refused_entries = failed(&env);
    assert!(spilled >= 1, "65 sockets, 64 slots: spilled {spilled}");
    assert_eq!(
        used.len() as u32 + spilled + refused_entries,
        65,
        "{used:?} spilled {spilled}"
    );
    for (slot, cookie) in &used {
        assert_eq!(
            cookie & 63,
            u64::from(*slot),
            "slot = cookie & mask: {used:?}"
        );
    }
    // Operators see the spills in `stats` (and /metrics).
    let stats = agent_json(&env, "stats");
    assert_eq!(
        stats["reasons"]["reverse_nat_spilled"],
        u64::from(spilled),
        "{stats}"
    );
    // The reader the listing and the connection closing use sees all of them.
    let mut listed = Vec::new();
    proxy_userspace::datapath::maps::for_each_connected(&env.pin_path(), |k, v| {
        listed.push((k.cookie, ip_port(v.addr, v.port)))
    })
    .unwrap();
    assert_eq!(listed.len() as u32, 65 - refused_entries);
    assert!(
        listed.iter().all(|(_, fe)| *fe == format!("{VIP}:80")),
        "{listed:?}"
    );
    // Refused connects while every slot is taken overflow, and go all the same.
    refused(&env);
    if used.len() == 64 && spilled + 4 <= 16 {
        let after = agent_json(&env, "stats")["reasons"]["reverse_nat_spilled"]
            .as_u64()
            .unwrap();
        assert_eq!(
            after,
            u64::from(spilled) + 4,
            "the refused connects overflowed"
        );
    }
    let done = finish_probe(holder);
    assert_eq!(done.len(), 65, "{done:?}");
    assert!(done.iter().all(|p| p["ok"] == true), "{done:?}");
    // getpeername() shows the VIP for a slot's socket and an overflowed one alike.
    let vip_peers = done
        .iter()
        .filter(|p| p["peer"] == format!("{VIP}:80"))
        .count();
    assert_eq!(vip_peers as u32, 65 - refused_entries, "{done:?}");
    // Closed: slots free, overflow entries deleted (and counted out).
    assert_eq!(
        slots_in_use(&env),
        (vec![], 0),
        "released sockets keep nothing"
    );
    let mut left = 0;
    proxy_userspace::datapath::maps::for_each_connected(&env.pin_path(), |_, _| left += 1).unwrap();
    assert_eq!(left, 0);
    let backends = agent_json(&env, "backends");
    let shut = backends
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["backend"] == format!("{}:9999", b(0)))
        .expect("the refusing backend");
    assert_eq!(shut["connections"], 8, "{shut}");
    assert_eq!(
        shut["active"], 0,
        "least-connections counts given back: {shut}"
    );
}

/// `addr:port` of a map's IPv4-mapped address and network-order port.
fn ip_port(addr: [u8; 16], port: [u8; 2]) -> String {
    let ip = std::net::Ipv6Addr::from(addr);
    let ip: IpAddr = match ip.to_ipv4_mapped() {
        Some(v4) => v4.into(),
        None => ip.into(),
    };
    std::net::SocketAddr::new(ip, u16::from_be_bytes(port)).to_string()
}

#[test]
fn upgrade_from_pins_without_slots_keeps_open_connections_reverse_nat() {
    use aya::maps::{Array, HashMap, Map, MapData};
    use proxy_common::{
        REVNAT_F_CONNECTED, REVNAT_SK, RevNatKey, RevNatValue, SOCK_NAT, SOCK_NAT_SPILLED,
        SPILLED_LEGACY, SockNat,
    };
    let mut env = Env::new("slots-upgrade", 1, false);
    web(&env, &[b(0)]);
    env.start_agent();
    let mut held = HeldTcp::open(&env.client, env.cg.path(), &format!("{VIP}:80"), &[]);
    assert_eq!(held.first["ok"], true, "{}", held.first);

    // What a version without slots leaves: the connection's entry in REVNAT_SK only, and
    // no SOCK_NAT_SPILLED pin.
    env.stop_agent();
    let dir = env.pin_path();
    let mut slots: Array<MapData, SockNat> =
        Array::try_from(Map::Array(MapData::from_pin(dir.join(SOCK_NAT)).unwrap())).unwrap();
    let (i, e) = (0..slots.len())
        .map(|i| (i, slots.get(&i, 0).unwrap()))
        .find(|(_, e)| e.key.cookie != 0)
        .expect("the held connection's slot");
    assert_ne!(e.value.flags & REVNAT_F_CONNECTED, 0);
    let mut revnat: HashMap<MapData, RevNatKey, RevNatValue> = HashMap::try_from(Map::LruHashMap(
        MapData::from_pin(dir.join(REVNAT_SK)).unwrap(),
    ))
    .unwrap();
    revnat.insert(e.key, e.value, 0).unwrap();
    slots.set(i, SockNat::default(), 0).unwrap();
    std::fs::remove_file(dir.join(SOCK_NAT_SPILLED)).unwrap();

    env.start_agent();
    let legacy = || -> u32 {
        let m: Array<MapData, u32> = Array::try_from(Map::Array(
            MapData::from_pin(dir.join(SOCK_NAT_SPILLED)).unwrap(),
        ))
        .unwrap();
        m.get(&SPILLED_LEGACY, 0).unwrap()
    };
    assert_eq!(
        legacy(),
        1,
        "the earlier version's connection is looked for"
    );
    // getpeername() still shows the VIP, from the earlier version's entry.
    assert_eq!(held.ask("!peer")["peer"], format!("{VIP}:80"));
    assert_eq!(held.ask("after")["reply"], "b0 after");
    // Its release finds the entry in REVNAT_SK by its peer: deleted.
    held.close();
    assert!(
        revnat
            .iter()
            .filter_map(Result::ok)
            .all(|(k, _)| k.cookie != e.key.cookie),
        "the entry went with its socket"
    );
    // The next start finds no such entry left and stops looking.
    env.stop_agent();
    env.start_agent();
    assert_eq!(legacy(), 0);
}

/// An upgrade from a version whose slots hold backend ids only (4-byte values): the start
/// carries every slot over into this version's layout (id and backend) before any program
/// is attached, so no Service loses its backends until the first sync; the agent then
/// serves through them. A slot whose copy of its backend differs from `BACKENDS` is
/// rewritten by the next verification.
#[test]
fn upgrade_carries_slots_without_backends_over() {
    use aya::maps::{HashMap, Map, MapData};
    use proxy_common::{
        BACKEND_SLOTS, BackendSlot, BackendSlotKey, DEFAULT_MAX_BACKENDS, DEFAULT_MAX_FRONTENDS,
        DEFAULT_MAX_SLOTS, DEFAULT_MAX_SOCKETS,
    };
    use proxy_userspace::datapath::loader::{MapSizes, load_pinned};
    let mut env = Env::new("slots-carry", 2, false);
    web(&env, &[b(0), b(1)]);
    env.start_agent();
    env.stop_agent();
    let dir = env.pin_path();
    let path = dir.join(BACKEND_SLOTS);
    let read = || -> Vec<(BackendSlotKey, BackendSlot)> {
        let m: HashMap<MapData, BackendSlotKey, BackendSlot> =
            HashMap::try_from(Map::HashMap(MapData::from_pin(&path).unwrap())).unwrap();
        let mut v: Vec<_> = m.iter().map(Result::unwrap).collect();
        v.sort();
        v
    };
    let before = read();
    assert_eq!(before.len(), 4, "2 endpoints x (TCP, UDP): {before:?}");

    // What the earlier version pinned: the same slots, backend ids only.
    std::fs::remove_file(&path).unwrap();
    pin_old_map(&path, "hash", 8, 4, 1024, "BACKEND_SLOTS");
    {
        let mut old: HashMap<MapData, BackendSlotKey, u32> =
            HashMap::try_from(Map::HashMap(MapData::from_pin(&path).unwrap())).unwrap();
        for (k, v) in &before {
            old.insert(k, v.backend_id, 0).unwrap();
        }
    }
    let sizes = MapSizes {
        frontends: DEFAULT_MAX_FRONTENDS,
        slots: DEFAULT_MAX_SLOTS,
        backends: DEFAULT_MAX_BACKENDS,
        sockets: DEFAULT_MAX_SOCKETS,
        conntrack_flows: 65536,
    };
    // The load alone (no program attached, no sync) carries them over, into a map of the
    // earlier one's size, and drops the set-aside pin.
    drop(load_pinned(&dir, sizes).unwrap());
    assert_eq!(read(), before, "every slot carried over with its backend");
    let info = aya::maps::MapInfo::from_pin(&path).unwrap();
    assert_eq!((info.value_size(), info.max_entries()), (24, 1024));
    assert!(!dir.join("BACKEND_SLOTS_IDS").exists());

    // A slot whose copy of its backend went wrong is repaired by the verification.
    {
        let mut m: HashMap<MapData, BackendSlotKey, BackendSlot> =
            HashMap::try_from(Map::HashMap(MapData::from_pin(&path).unwrap())).unwrap();
        let (k, mut v) = before[0];
        v.backend.port = [0, 1];
        m.insert(k, v, 0).unwrap();
    }
    assert_eq!(
        env.snapshot().stale_slots.into_iter().collect::<Vec<_>>(),
        vec![before[0].0]
    );
    env.extra_agent_args = vec!["--sync-period".into(), "1s".into()];
    env.start_agent();
    // Adopted by id (the Service keeps its backend ids), then rewritten by a verification.
    env.wait_maps(|s| s.stale_slots.is_empty(), "the damaged slot rewritten");
    assert_eq!(read(), before);
    let c = by_name(&env.tcp(&format!("{VIP}:80"), 30));
    assert_eq!(c.len(), 2, "both backends serve after the upgrade: {c:?}");
}
