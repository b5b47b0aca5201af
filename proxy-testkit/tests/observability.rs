//! Privileged integration tests of the agent's opt-in observability and connection
//! handling: the kernel programs' own log lines (`--kernel-log-level`), forwarded to the
//! agent's log when asked for and absent from the kernel's ring when not; and
//! `--close-connections-to-removed-endpoints`, which resets a client's TCP connection to an
//! endpoint removed from the EndpointSlice (and only that one), where the default leaves
//! it open and working, as kube-proxy does.

mod common;

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use aya::maps::{Map, MapData, RingBuf};
use common::*;
use proxy_userspace::datapath::loader;

const VIP: &str = "198.19.0.60";
const HOLD_VIP: &str = "198.19.0.61";

fn b(i: usize) -> IpAddr {
    IpAddr::V4(backend_v4(i))
}

/// `logs`: TCP 80 -> 8080 on b0.
fn logs_service(env: &Env) {
    let svc = service("default", "logs", &[VIP], &[("http", 80, 8080, "TCP")]);
    let sl = slice(
        "default",
        "logs-1",
        "logs",
        "IPv4",
        &[("http", 8080, "TCP")],
        &[(b(0), true)],
    );
    env.write_manifest("logs.yaml", &format!("{svc}---\n{sl}"));
}

/// Records waiting in the pinned kernel log ring (read and consumed).
fn ring_records(env: &Env) -> usize {
    let m =
        MapData::from_pin(env.pin_path().join(proxy_common::KERNEL_LOGS)).expect("AYA_LOGS pinned");
    let mut ring = RingBuf::try_from(Map::RingBuf(m)).expect("ring buffer");
    let mut n = 0;
    while ring.next().is_some() {
        n += 1;
    }
    n
}

#[test]
fn kernel_log_lines_at_debug_and_none_when_off() {
    let mut env = Env::new("klog", 1, false);
    logs_service(&env);

    // Debug: the connect() through the ClusterIP is one line naming frontend and backend.
    env.extra_agent_args = vec!["--kernel-log-level".into(), "debug".into()];
    env.start_agent();
    let p = env.tcp(&format!("{VIP}:80"), 1);
    assert_eq!(p[0]["ok"], true, "{p:?}");
    assert_eq!(p[0]["name"], "b0", "{p:?}");
    let want = format!(
        "sock: frontend [::ffff:{VIP}]:80 proto 6 -> backend [::ffff:{}]:8080",
        b(0)
    );
    env.wait_log(
        |l| {
            l.lines()
                .any(|l| l.contains("ebpf_proxy::kernel") && l.contains(&want))
        },
        "the kernel's debug line of the connection",
    );
    assert!(env.log().contains("kernel log lines forwarded"));
    env.stop_agent();

    // Off (the default): the restarted agent's programs write nothing into the pinned
    // ring (read here directly, not through the agent, which does not read it when off).
    let before = env.log().matches("ebpf_proxy::kernel").count();
    env.extra_agent_args.clear();
    env.start_agent();
    ring_records(&env); // lines of the old programs before their links were replaced
    let p = env.tcp(&format!("{VIP}:80"), 3);
    assert!(p.iter().all(|p| p["ok"] == true), "{p:?}");
    // Also a connect() to an address that is no frontend (a trace line when on).
    let _ = env.tcp(&format!("{}:8080", b(0)), 1);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        ring_records(&env),
        0,
        "kernel log records with the flag off"
    );
    assert_eq!(
        env.log().matches("ebpf_proxy::kernel").count(),
        before,
        "kernel lines in the agent's log with the flag off:\n{}",
        env.log()
    );
}

/// `hold`: TCP 80 -> 8081 on the backends `eps`.
fn hold_service(env: &Env, eps: &[usize]) {
    let svc = service("default", "hold", &[HOLD_VIP], &[("hold", 80, 8081, "TCP")]);
    let list: Vec<(IpAddr, bool)> = eps.iter().map(|i| (b(*i), true)).collect();
    let sl = slice(
        "default",
        "hold-1",
        "hold",
        "IPv4",
        &[("hold", 8081, "TCP")],
        &list,
    );
    env.write_manifest("hold.yaml", &format!("{svc}---\n{sl}"));
}

/// An established TCP connection through `HOLD_VIP` from the client pod.
fn hold(env: &Env) -> HeldTcp {
    let h = HeldTcp::open(
        &env.client,
        env.cg.path(),
        &format!("{HOLD_VIP}:80"),
        &["--timeout-ms", "3000"],
    );
    assert_eq!(h.first["ok"], true, "{}", h.first);
    h
}

/// One held connection to b0 and one to b1 (connections are balanced at random: at most
/// 40 attempts).
fn held_pair(env: &Env) -> (HeldTcp, HeldTcp) {
    let (mut a, mut c) = (None, None);
    for _ in 0..40 {
        let h = hold(env);
        match h.backend() {
            "b0" if a.is_none() => a = Some(h),
            "b1" if c.is_none() => c = Some(h),
            _ => {}
        }
        if a.is_some() && c.is_some() {
            break;
        }
    }
    (
        a.expect("a connection to b0 in 40 attempts"),
        c.expect("a connection to b1 in 40 attempts"),
    )
}

#[test]
fn connections_to_a_removed_endpoint_close_only_with_the_flag() {
    let mut env = Env::new("close", 2, false);
    hold_service(&env, &[0, 1]);

    // Default (kube-proxy's behaviour): removing b0 leaves its connection open and usable.
    env.start_agent();
    let (mut to_a, mut to_b) = held_pair(&env);
    assert_eq!(to_a.ask("one")["reply"], "b0 one");
    // The sync removing b0.
    env.apply(|| hold_service(&env, &[1]));
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        to_a.ask("two")["reply"],
        "b0 two",
        "without the flag the connection stays"
    );
    assert_eq!(to_b.ask("two")["reply"], "b1 two");
    assert!(!env.log().contains("closed TCP connections"));
    drop((to_a, to_b));
    env.stop_agent();

    // With the flag (in the `=true` form kube-proxy's booleans take): the connection to b0
    // is reset promptly, the one to b1 is untouched.
    hold_service(&env, &[0, 1]);
    env.extra_agent_args = vec!["--close-connections-to-removed-endpoints=true".into()];
    env.start_agent();
    let (mut to_a, mut to_b) = held_pair(&env);
    assert_eq!(to_a.ask("one")["reply"], "b0 one");
    assert_eq!(to_b.ask("one")["reply"], "b1 one");
    let start = Instant::now();
    hold_service(&env, &[1]);
    env.wait_log(
        |l| l.contains("closed TCP connections to removed endpoints"),
        "the agent closing the connection to b0",
    );
    let line = env
        .log()
        .lines()
        .find(|l| l.contains("closed TCP connections to removed endpoints"))
        .unwrap()
        .to_string();
    assert!(
        line.contains("sockets=1") && line.contains("closed=1"),
        "{line}"
    );
    let r = to_a.ask("two");
    assert_eq!(
        r["ok"], false,
        "the connection to the removed b0 must be closed: {r}"
    );
    // ECONNABORTED (the socket was destroyed) or ECONNRESET/EPIPE (the backend's RST).
    assert!(
        [103, 104, 32].contains(&r["errno"].as_i64().unwrap_or(-1)),
        "{r}"
    );
    assert!(start.elapsed() < Duration::from_secs(10), "closed too late");
    assert_eq!(
        to_b.ask("two")["reply"],
        "b1 two",
        "b1's connection is untouched"
    );
}

#[test]
fn every_program_passes_the_verifier_with_kernel_logs_at_trace() {
    assert!(is_root_for_tests(), "needs root");
    // The tc programs are close to the verifier's budget: the log lines must fit in every
    // program at the most verbose level, and (the agent's default) with them off.
    for level in [loader::KernelLogLevel::Trace, loader::KernelLogLevel::Off] {
        loader::set_kernel_log_level(level);
        let loaded = loader::verify_programs()
            .unwrap_or_else(|e| panic!("kernel log level {level:?}: {e:#}"));
        for p in [
            "connect4",
            "sendmsg6",
            "tc_ingress",
            "tc_reject",
            "pod_ingress",
        ] {
            assert!(
                loaded.iter().any(|l| l.starts_with(p)),
                "{p} not verified: {loaded:?}"
            );
        }
    }
}

fn is_root_for_tests() -> bool {
    proxy_testkit::testbed::is_root()
}
