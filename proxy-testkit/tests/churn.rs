//! Churn soak (privileged): endpoints of several Services are added, removed, made
//! terminating and not ready in a loop, Services come and go, while clients open
//! connections to two Services whose ready backends never change (their objects do: extra
//! endpoints that are not ready or terminating, a second slice, annotations). Every one of
//! those connections must succeed, the verification (every 2 s here) must find nothing to
//! repair, and when the churn stops and its Services go, the maps hold exactly the steady
//! Services — no leaked frontend, slot, backend, name, membership or table — and a restarted
//! agent rewrites nothing.
//!
//! Bounded: 20 s of churn by default (`EBPF_PROXY_SOAK_SECS` sets it, e.g. 600 for a long
//! soak), clients at one connection per 20 ms each, every wait bounded.

mod common;

use std::{
    net::{IpAddr, Ipv4Addr},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use common::*;

const STEADY: [(&str, &str, u16); 2] = [
    ("steady-a", "198.19.5.1", 8080),
    ("steady-b", "198.19.5.2", 8081),
];
const CHURN: [&str; 4] = ["churn-0", "churn-1", "churn-2", "churn-3"];

/// A small deterministic PRNG (xorshift), seeded per run and printed, so a failure can be
/// replayed with `EBPF_PROXY_SOAK_SEED`.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// The ready backends of a steady Service: b0+b1 for steady-a, b1+b2 for steady-b.
fn steady_ready(i: usize) -> [IpAddr; 2] {
    [IpAddr::V4(backend_v4(i)), IpAddr::V4(backend_v4(i + 1))]
}

/// An endpoint line with explicit conditions.
fn endpoint(ip: IpAddr, ready: bool, serving: bool, terminating: bool) -> String {
    format!(
        "- addresses: [\"{ip}\"]\n  conditions: {{ready: {ready}, serving: {serving}, terminating: {terminating}}}\n"
    )
}

fn slice_with(name: &str, service: &str, port: u16, endpoints: &[String]) -> String {
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: soak\n  labels:\n    kubernetes.io/service-name: {service}\naddressType: IPv4\nports:\n- {{name: http, port: {port}, protocol: TCP}}\nendpoints:\n{}",
        endpoints.concat()
    )
}

/// Addresses that no pod has: churned endpoints that are never connected to.
fn ghost(r: &mut Rng) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(198, 18, 0, 200 + r.below(20) as u8))
}

/// Rewrites the objects of a steady Service without changing its ready backends.
fn churn_steady(env: &Env, r: &mut Rng, i: usize) {
    let (name, _, port) = STEADY[i];
    let ready = steady_ready(i);
    let mut first: Vec<String> = ready
        .iter()
        .map(|ip| endpoint(*ip, true, true, false))
        .collect();
    let mut second = Vec::new();
    for _ in 0..r.below(4) {
        let e = match r.below(3) {
            0 => endpoint(ghost(r), false, false, false),
            1 => endpoint(ghost(r), false, true, true),
            _ => endpoint(ghost(r), false, false, true),
        };
        if r.below(2) == 0 {
            first.push(e);
        } else {
            second.push(e);
        }
    }
    if r.below(3) == 0 {
        // An endpoint moving between slices is in both for a while.
        second.push(endpoint(ready[r.below(2) as usize], true, true, false));
    }
    env.write_manifest(
        &format!("{name}-slice-1.yaml"),
        &slice_with(&format!("{name}-1"), name, port, &first),
    );
    if second.is_empty() {
        let _ = std::fs::remove_file(env.manifests.path().join(format!("{name}-slice-2.yaml")));
    } else {
        env.write_manifest(
            &format!("{name}-slice-2.yaml"),
            &slice_with(&format!("{name}-2"), name, port, &second),
        );
    }
    if r.below(4) == 0 {
        // A Service edit that changes nothing the proxy reads.
        let mut svc = service("soak", name, &[STEADY[i].1], &[("http", 80, port, "TCP")]);
        svc = svc.replacen(
            "  namespace: soak\n",
            &format!(
                "  namespace: soak\n  annotations: {{soak/round: \"{}\"}}\n",
                r.below(1000)
            ),
            1,
        );
        env.write_manifest(&format!("{name}.yaml"), &svc);
    }
}

/// Adds, changes or removes one churned Service or its endpoints.
fn churn_other(env: &Env, r: &mut Rng) {
    let i = r.below(CHURN.len() as u64) as usize;
    let name = CHURN[i];
    match r.below(10) {
        0 => {
            let _ = std::fs::remove_file(env.manifests.path().join(format!("{name}.yaml")));
        }
        1 | 2 => {
            // (Re)created, sometimes on another cluster IP.
            let ip = format!("198.19.6.{}", 1 + i * 2 + r.below(2) as usize);
            env.write_manifest(
                &format!("{name}.yaml"),
                &service("soak", name, &[&ip], &[("http", 80, 8080, "TCP")]),
            );
        }
        _ => {
            let mut eps = Vec::new();
            for _ in 0..r.below(6) {
                let ip = if r.below(2) == 0 {
                    IpAddr::V4(backend_v4(r.below(3) as usize))
                } else {
                    ghost(r)
                };
                let (ready, serving, terminating) = match r.below(4) {
                    0 => (true, true, false),
                    1 => (false, false, false),
                    2 => (false, true, true),
                    _ => (false, false, true),
                };
                eps.push(endpoint(ip, ready, serving, terminating));
            }
            env.write_manifest(
                &format!("{name}-slice.yaml"),
                &slice_with(&format!("{name}-1"), name, 8080, &eps),
            );
        }
    }
}

// Longer than 120 lines: set-up, rounds and checks share one lab and its running clients.
#[test]
fn endpoint_churn_never_disturbs_services_whose_ready_backends_stay() {
    let secs: u64 = std::env::var("EBPF_PROXY_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let seed: u64 = std::env::var("EBPF_PROXY_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
                | 1
        });
    eprintln!("churn soak: {secs} s, seed {seed} (EBPF_PROXY_SOAK_SEED replays it)");
    let mut r = Rng(seed);
    let mut env = Env::new("churn", 3, false);
    env.extra_agent_args = vec!["--sync-period".into(), "2s".into()];
    for (i, (name, ip, port)) in STEADY.iter().enumerate() {
        env.write_manifest(
            &format!("{name}.yaml"),
            &service("soak", name, &[ip], &[("http", 80, *port, "TCP")]),
        );
        let eps: Vec<String> = steady_ready(i)
            .iter()
            .map(|ip| endpoint(*ip, true, true, false))
            .collect();
        env.write_manifest(
            &format!("{name}-slice-1.yaml"),
            &slice_with(&format!("{name}-1"), name, *port, &eps),
        );
    }
    env.start_agent();

    // Clients: one connection per 20 ms to each steady Service for the whole churn.
    let count = (secs * 1000 / 20).to_string();
    let clients: Vec<_> = STEADY
        .iter()
        .map(|(_, ip, _)| {
            env.client
                .spawn(
                    Some(env.cg.path()),
                    Command::new(NETPROBE)
                        .args(["tcp", "--to", &format!("{ip}:80"), "--count", &count])
                        .args(["--interval-ms", "20", "--timeout-ms", "2000"])
                        .stdout(Stdio::piped())
                        .stderr(Stdio::null()),
                )
                .expect("client")
        })
        .collect();

    let start = Instant::now();
    let mut rounds = 0u64;
    while start.elapsed() < Duration::from_secs(secs) {
        if r.below(3) == 0 {
            let i = r.below(2) as usize;
            churn_steady(&env, &mut r, i);
        } else {
            churn_other(&env, &mut r);
        }
        rounds += 1;
        std::thread::sleep(Duration::from_millis(5 + r.below(20)));
    }
    let churned = start.elapsed();

    for (c, (name, _, _)) in clients.into_iter().zip(STEADY) {
        let probes = finish_probe(c);
        let failed: Vec<&Probe> = probes.iter().filter(|p| p["ok"] != true).collect();
        assert!(
            failed.is_empty(),
            "{name}: {} of {} connections failed during the churn (seed {seed}), first: {}",
            failed.len(),
            probes.len(),
            failed[0]
        );
        let names = by_name(&probes);
        let i = STEADY.iter().position(|s| s.0 == name).unwrap();
        let want = [format!("b{i}"), format!("b{}", i + 1)];
        assert!(
            names.keys().all(|n| want.contains(n)),
            "{name} reached another backend: {names:?}"
        );
        assert!(
            probes.len() > 100,
            "{name}: only {} connections",
            probes.len()
        );
        eprintln!(
            "{name}: {} connections, all answered ({names:?})",
            probes.len()
        );
    }
    eprintln!("{rounds} object changes in {churned:?}");

    // The churn stops and its objects go: only the steady Services remain in the maps.
    let before = env.syncs();
    for name in CHURN {
        for f in [format!("{name}.yaml"), format!("{name}-slice.yaml")] {
            let _ = std::fs::remove_file(env.manifests.path().join(f));
        }
    }
    for (name, _, _) in STEADY {
        let _ = std::fs::remove_file(env.manifests.path().join(format!("{name}-slice-2.yaml")));
    }
    env.wait_log(|l| syncs(l) > before, "the sync after the churn");
    env.wait_maps(
        |s| {
            s.frontends.len() == 4
                && s.slots.len() == 4
                && s.backends.len() == 4
                && s.names.len() == 2
                && s.members.is_empty()
                && s.maglev.is_empty()
        },
        "exactly the two steady Services (2 frontends and 2 VIP markers, 4 slots, 4 backends, 2 names)",
    );
    // The maps can reach the end state before the last removals are read (deleting the
    // slice of a Service already gone writes nothing but is a change): let those settle,
    // then two verifications pass with the churn over; none may have repaired anything.
    let mut n = env.syncs();
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(500));
        let now = env.syncs();
        if now == n {
            break;
        }
        n = now;
    }
    std::thread::sleep(Duration::from_secs(5));
    let log = env.log();
    assert!(
        !log.contains("verification repaired"),
        "a verification found the maps different from what was applied:\n{log}"
    );
    assert!(!log.contains("Service not applied"), "{log}");
    assert_eq!(syncs(&log), n, "no change, no sync");

    // A restarted agent adopts the maps and rewrites nothing.
    env.stop_agent();
    env.start_agent();
    let log = env.log();
    let last = log.lines().rfind(|l| l.contains("sync done")).unwrap();
    assert!(
        last.contains("writes=0") && last.contains("deletes=0"),
        "a restart after the churn changed the maps: {last}"
    );
    assert_eq!(by_name(&env.tcp("198.19.5.1:80", 10)).len(), 2);
}
