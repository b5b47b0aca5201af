//! Operating the agent, the cases that steer it in code: the preflight `check` on this
//! machine (its rows against the loader's program list), configuration files and kube-proxy
//! command lines the agent refuses or rewrites before it touches anything (no root, no lab:
//! the agent binary only; the written configuration is read back with the crate's own
//! parser), the agent's transparent huge pages (its `/proc/PID/status`), server ports held
//! by the test process (a busy metrics port, kube-proxy still on the health port, the
//! status server and `status --require`), pins of another version's layout made before a
//! start, the Grafana dashboard's metric names against `/metrics`, and counter arrays of
//! another size loaded in the test process.
//!
//! The cases that are only commands in and output, logs and pins out are socket scenario
//! files (`tests/scenarios/socket/ops-*.txtar`, run by `tests/scenarios.rs`): the failing
//! `check` and `run`'s preflight, the configuration file applied with JSON logs, `--init-only`
//! and `--cleanup`, SIGTERM keeping the pinned data path for the next agent.
//!
//! The privileged tests (root, `cargo xtask test`) use the fixture of `common` (their own
//! namespaces, child cgroup and pin directory, removed on drop). `check` only reads, except
//! that it loads the programs into the kernel without attaching them; no test gives `run` or
//! `check` a directory that it could mount bpffs on.

mod common;

use std::{
    collections::BTreeSet,
    net::IpAddr,
    path::Path,
    process::{Command, Output},
    time::Duration,
};

use common::*;
use proxy_testkit::testbed;
use proxy_userspace::datapath::loader;

const VIP: &str = "198.19.0.10";

/// A Service `default/web` (TCP 80 -> 8080) with the given backends as ready endpoints.
fn web(env: &Env, endpoints: &[usize]) {
    let eps: Vec<IpAddr> = endpoints
        .iter()
        .map(|i| IpAddr::V4(backend_v4(*i)))
        .collect();
    env.write_web(&Web::new(VIP).ports(&[HTTP]).ready(&eps));
}

fn agent(args: &[&str]) -> Output {
    Command::new(AGENT).args(args).output().expect("run agent")
}

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

fn require_root() {
    assert!(
        testbed::is_root(),
        "the privileged integration tests need root (run `cargo xtask test` as root)"
    );
    testbed::ensure_bpffs().expect("bpffs");
}

#[test]
fn check_passes_on_this_machine() {
    require_root();
    let out = agent(&["check"]);
    let table = text(&out.stdout);
    println!("{table}");
    assert!(out.status.success(), "{table}\n{}", text(&out.stderr));
    assert!(table.starts_with("CHECK "), "{table}");
    let out = agent(&["check", "-o", "json"]);
    assert!(out.status.success());
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let checks: Vec<&str> = rows.iter().map(|r| r["check"].as_str().unwrap()).collect();
    assert_eq!(
        checks,
        [
            "kernel",
            "btf",
            "bpffs",
            "cgroup v2",
            "privileges",
            "program types",
            "map types",
            "helpers",
            "programs",
            "memlock",
            "conntrack",
            "kube-proxy rules",
            "socket destroy",
            "xdp"
        ]
    );
    for r in &rows {
        assert_ne!(r["status"], "fail", "{r}");
    }
    let programs = rows.iter().find(|r| r["check"] == "programs").unwrap();
    for p in loader::PROGRAMS {
        assert!(
            programs["detail"].as_str().unwrap().contains(p),
            "{programs}"
        );
    }
}

#[test]
fn invalid_configuration_file_stops_start_up_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.yaml");
    std::fs::write(
        &file,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: ipvs\n",
    )
    .unwrap();
    // Read before anything else: nothing is checked, mounted or attached.
    let out = agent(&[
        "run",
        "--config",
        &file.display().to_string(),
        "--manifests",
        "/nonexistent",
    ]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with(&format!("error: --config {}: mode \"ipvs\": this is ebpf-proxy, a kube-proxy replacement that proxies Services with eBPF programs and has no ipvs mode; to run it, leave the mode empty or set it to \"ebpf\"", file.display())),
        "{err}"
    );
    // A field with an invalid value names the file and the field.
    std::fs::write(
        &file,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nclusterCIDR: 10.0.0.0/33\n",
    )
    .unwrap();
    let out = agent(&["run", "--config", &file.display().to_string()]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with(&format!(
            "error: --config {}: clusterCIDR: \"10.0.0.0/33\" is not a CIDR",
            file.display()
        )),
        "{err}"
    );
}

#[test]
fn kube_proxy_command_lines_run_without_a_subcommand() {
    // kubeadm's configuration file, with kube-proxy's flags and no subcommand: the effective
    // configuration is written and the process exits 0, nothing touched.
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("config.conf");
    std::fs::write(
        &conf,
        include_str!("../../proxy-userspace/tests/fixtures/kubeadm/config.conf"),
    )
    .unwrap();
    let written = dir.path().join("written.yaml");
    let out = agent(&[
        &format!("--config={}", conf.display()),
        "--hostname-override=Node-A",
        &format!("--write-config-to={}", written.display()),
        "--ipvs-scheduler=wlc",
        "-v=4",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let yaml = std::fs::read_to_string(&written).unwrap();
    let loaded = proxy_userspace::config::parse(&yaml).unwrap();
    assert_eq!(loaded.settings.hostname_override.as_deref(), Some("node-a"));
    assert!(yaml.contains("scheduler: wlc"), "{yaml}");
    assert!(yaml.contains("clusterCIDR: 10.244.0.0/16"), "{yaml}");
    assert!(
        yaml.contains("kubeconfig: /var/lib/kube-proxy/kubeconfig.conf"),
        "{yaml}"
    );
    // A kube-proxy mode on the command line: one line saying what this is.
    for mode in ["iptables", "ipvs", "nftables", "kernelspace"] {
        let out = agent(&[
            &format!("--proxy-mode={mode}"),
            "--manifests",
            "/nonexistent",
        ]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains("this is ebpf-proxy, a kube-proxy replacement"),
            "{err}"
        );
    }
    // A scheduler IPVS has but ebpf-proxy does not (locality-based) stops start-up, named.
    let out = agent(&["--ipvs-scheduler=lblc", "--manifests", "/nonexistent"]);
    assert!(
        text(&out.stderr).contains("\"lblc\": not an IPVS scheduler ebpf-proxy implements"),
        "{}",
        text(&out.stderr)
    );
    // kube-proxy flags without an effect here are accepted with a warning each.
    let out = agent(&[
        "--profiling",
        "--feature-gates=A=true",
        &format!("--write-config-to={}", written.display()),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    for flag in ["--profiling", "--feature-gates"] {
        assert_eq!(
            err.matches(&format!("flag {flag} has no effect in ebpf-proxy"))
                .count(),
            1,
            "{err}"
        );
    }
}

#[test]
fn the_agent_runs_without_transparent_huge_pages() {
    let mut env = Env::new("ops-thp", 1, false);
    web(&env, &[0]);
    env.start_agent();
    // Its allocator asks for huge pages, which would keep every touched 2 MiB of the heap
    // resident; the agent turns them off for itself (PR_SET_THP_DISABLE) before the heap
    // grows.
    let pid = env.agent.as_mut().unwrap().child_mut().id();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("THP_enabled:"))
        .expect("THP_enabled in /proc/PID/status (Linux >= 5.0)");
    assert_eq!(line.split_whitespace().nth(1), Some("0"), "{status}");
    assert_eq!(by_name(&env.tcp(&format!("{VIP}:80"), 3)).len(), 1);
}

#[test]
fn a_busy_metrics_port_does_not_stop_the_agent_and_is_retried() {
    let mut env = Env::new("ops-busy", 1, false);
    web(&env, &[0]);
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap();
    env.extra_agent_args = vec!["--metrics-bind-address".into(), addr.to_string()];
    env.start_agent();
    // The data path runs and serves while the port is taken.
    assert_eq!(by_name(&env.tcp(&format!("{VIP}:80"), 3)).len(), 1);
    env.logged_addr("health");
    // Retried every 5 s, reported once.
    std::thread::sleep(Duration::from_secs(6));
    let failed = |log: &str| {
        log.lines()
            .filter(|l| l.contains("metrics server failed"))
            .count()
    };
    assert_eq!(failed(&env.log()), 1, "{}", env.log());
    assert!(!env.log().contains("metrics server listening"));
    drop(busy);
    env.wait_log(|l| l.contains("metrics server listening"), "metrics bound");
    assert_eq!(http_code(&format!("http://{addr}/metrics")), "200");
    assert_eq!(failed(&env.log()), 1);

    // With --bind-address-hard-fail, kube-proxy's meaning: the agent stops on the failure
    // (the data path stays pinned).
    env.stop_agent();
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    env.extra_agent_args = vec![
        "--healthz-bind-address".into(),
        busy.local_addr().unwrap().to_string(),
        "--bind-address-hard-fail".into(),
    ];
    env.start_agent_with(&[
        "--manifests".into(),
        env.manifests.path().display().to_string(),
    ]);
    env.wait_log(
        |l| l.contains("(--bind-address-hard-fail); the data path stays attached and pinned"),
        "hard failure",
    );
    let status = env
        .agent
        .as_mut()
        .unwrap()
        .wait_timeout(Duration::from_secs(5))
        .unwrap();
    assert_eq!(status.and_then(|s| s.code()), Some(1));
    env.agent = None;
}

/// The HTTP status code of GET `url` (curl).
fn http_code(url: &str) -> String {
    let out = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "5",
            url,
        ])
        .output()
        .unwrap();
    text(&out.stdout)
}

#[test]
fn a_health_port_held_by_another_process_keeps_the_agent_unready_until_it_is_free() {
    let mut env = Env::new("ops-ready", 1, false);
    web(&env, &[0]);
    // kube-proxy, still running during the switch, holds the health port and answers on it.
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let health = held.local_addr().unwrap();
    let holder = testbed::KubeProxyHealth::serve(held).unwrap();
    env.extra_agent_args = vec!["--healthz-bind-address".into(), health.to_string()];
    env.start_agent();
    let status = env.logged_addr("status");
    // The data path serves, and kube-proxy answers the health port: a probe there would lie.
    assert_eq!(by_name(&env.tcp(&format!("{VIP}:80"), 3)).len(), 1);
    assert_eq!(http_code(&format!("http://{health}/healthz")), "200");
    // The kubelet's probes go to the agent's own status server: live, not ready.
    assert_eq!(http_code(&format!("http://{status}/livez")), "200");
    assert_eq!(http_code(&format!("http://{status}/readyz")), "503");
    let ask = |require: &str, wait: &str| {
        agent(&[
            "status",
            "--address",
            &status.to_string(),
            "--require",
            require,
            "--wait",
            wait,
        ])
    };
    // Synced: the condition for going on with the switch while kube-proxy runs.
    let out = ask("synced", "0s");
    assert!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert!(
        text(&out.stdout).contains("synced        yes"),
        "{}",
        text(&out.stdout)
    );
    let out = ask("ready", "0s");
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!("not met: ready: health server on {health}: "))
            && err.contains("kube-proxy's health server"),
        "{err}"
    );
    // No external interface in this lab: removing kube-proxy's rules would lose NodePorts.
    let out = ask("synced,north-south", "0s");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("not met: north-south: no external interface"),
        "{}",
        text(&out.stderr)
    );
    // kube-proxy goes away: the agent binds the port (retried every 5 s) and turns Ready.
    drop(holder);
    let out = ask("ready", "20s");
    assert!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert_eq!(http_code(&format!("http://{status}/readyz")), "200");
    let out = agent(&["status", "--address", &status.to_string(), "-o", "json"]);
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["ready"], true);
    assert_eq!(doc["servers"][0]["name"], "health");
    assert_eq!(doc["servers"][0]["state"], "listening");
    // Nothing listening: the command says where it looked.
    env.stop_agent();
    let out = ask("synced", "0s");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("--status-bind-address"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn an_upgrade_recreates_pinned_maps_whose_layout_changed() {
    let mut env = Env::new("ops-upgrade", 1, false);
    web(&env, &[0]);
    // What another version pinned: TC_CONFIG with a 16-byte value (this version's is
    // larger), BYPASS_CONFIG with this version's sizes but another map type, and every
    // other map as it is now.
    let dir = env.pin_path();
    std::fs::create_dir_all(&dir).unwrap();
    let old = dir.join(proxy_common::nat::TC_CONFIG);
    pin_old_map(&old, "array", 4, 16, 1, "TC_CONFIG");
    pin_old_map(
        &dir.join(proxy_common::bypass::BYPASS_CONFIG),
        "percpu_array",
        4,
        std::mem::size_of::<proxy_common::bypass::BypassConfig>(),
        1,
        "BYPASS_CONFIG",
    );
    env.start_agent();
    let log = env.log();
    let warned: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("another layout"))
        .collect();
    assert_eq!(warned.len(), 2, "{log}");
    let of = |map: &str| {
        warned
            .iter()
            .find(|l| l.contains(&format!("map=\"{map}\"")))
            .unwrap_or_else(|| panic!("no warning for {map}: {warned:?}"))
    };
    let tc = of("TC_CONFIG");
    assert!(tc.contains("value size 16 pinned"), "{tc}");
    // Map types by name, not by kernel number.
    let bypass = of("BYPASS_CONFIG");
    assert!(
        bypass.contains("type PerCpuArray pinned, Array now"),
        "{bypass}"
    );
    let info = aya::maps::MapInfo::from_pin(&old).unwrap();
    assert_eq!(
        info.value_size() as usize,
        std::mem::size_of::<proxy_common::nat::TcConfig>(),
        "recreated with this version's layout"
    );
    assert_eq!(by_name(&env.tcp(&format!("{VIP}:80"), 10)).len(), 1);
}

/// Metric names (`kubeproxy_*`, `ebpf_proxy_*`) in a PromQL expression.
fn metric_names(expr: &str) -> BTreeSet<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|t| t.starts_with("kubeproxy_") || t.starts_with("ebpf_proxy_"))
        .map(str::to_string)
        .collect()
}

/// Every query of the dashboard: panel targets and template variables.
fn dashboard_queries() -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/dashboard.json");
    let text = std::fs::read_to_string(&path).expect("deploy/grafana/dashboard.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut queries = Vec::new();
    let panels = v["panels"].as_array().expect("panels");
    for p in panels {
        if p["type"] == "row" {
            continue;
        }
        let targets = p["targets"]
            .as_array()
            .unwrap_or_else(|| panic!("panel {} has no targets", p["title"]));
        assert!(!targets.is_empty(), "panel {} has no targets", p["title"]);
        for t in targets {
            let expr = t["expr"].as_str().expect("expr");
            assert!(
                !metric_names(expr).is_empty(),
                "{expr:?} uses no metric of the agent"
            );
            queries.push(expr.to_string());
        }
    }
    for var in v["templating"]["list"].as_array().expect("templating") {
        if let Some(q) = var["definition"].as_str() {
            queries.push(q.to_string());
        }
    }
    queries
}

#[test]
fn grafana_dashboard_is_valid_json_with_queries() {
    let queries = dashboard_queries();
    assert!(queries.len() >= 10, "{queries:?}");
}

#[test]
fn grafana_dashboard_uses_only_metrics_the_agent_exports() {
    let mut env = Env::new("ops-metrics", 1, false);
    web(&env, &[0]);
    env.start_agent();
    // Some traffic, so every data path counter has been touched at least once.
    assert_eq!(by_name(&env.tcp(&format!("{VIP}:80"), 3)).len(), 1);
    let addr = env.logged_addr("metrics");
    let out = Command::new("curl")
        .args(["-s", &format!("http://{addr}/metrics")])
        .output()
        .expect("curl");
    let exposition = text(&out.stdout);
    // Sample names: the first token of every line that is not a comment; and the families
    // declared by `# TYPE` lines (a gauge without series yet, such as the least-connections
    // counts when no Service uses that algorithm, is exported all the same).
    let mut exported: BTreeSet<String> = exposition
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap().to_string())
        .collect();
    for l in exposition.lines() {
        let mut it = l.split_whitespace();
        if let (Some("#"), Some("TYPE"), Some(name), Some(kind)) =
            (it.next(), it.next(), it.next(), it.next())
        {
            exported.insert(if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_string()
            });
        }
    }
    let mut used = BTreeSet::new();
    for q in dashboard_queries() {
        used.extend(metric_names(&q));
    }
    let missing: Vec<&String> = used.iter().filter(|n| !exported.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "the dashboard uses metrics the agent does not export: {missing:?}\nexported: {exported:?}"
    );
    // And it covers the agent's own families and every kube-proxy family.
    for family in [
        "ebpf_proxy_datapath_events_total",
        "ebpf_proxy_map_entries",
        "ebpf_proxy_map_capacity",
        "ebpf_proxy_sync_errors_total",
        "ebpf_proxy_tc_events_total",
        "ebpf_proxy_interface_xdp",
        "ebpf_proxy_connections_closed_total",
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
        "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
        "kubeproxy_sync_proxy_rules_endpoint_changes_total",
        "kubeproxy_sync_proxy_rules_service_changes_pending",
        "kubeproxy_sync_proxy_rules_service_changes_total",
        "kubeproxy_proxy_healthz_total",
        "kubeproxy_proxy_livez_total",
        "kubeproxy_network_programming_duration_seconds_bucket",
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
        "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
        "kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total",
        "kubeproxy_conntrack_reconciler_sync_duration_seconds_bucket",
        "kubeproxy_conntrack_reconciler_deleted_entries_total",
    ] {
        assert!(used.contains(family), "{family} not on the dashboard");
    }
}

/// An upgrade whose build counts more things: a pinned counter array smaller than this
/// build's is replaced (its new counters would never count), one of the right size is kept,
/// and a pinned map sized by the agent's flags keeps any size.
#[test]
fn smaller_pinned_counter_arrays_are_replaced_on_upgrade() {
    require_root();
    testbed::ensure_bpffs().unwrap();
    let dir = loader::pin_dir(
        Path::new(testbed::BPFFS_PATH),
        "ebpf-proxy-test-upgrade-pins",
    );
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    struct Rm(std::path::PathBuf);
    impl Drop for Rm {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _rm = Rm(dir.clone());
    let tc_counters = proxy_common::nat::TC_COUNTERS;
    let mut ebpf = aya::EbpfLoader::new()
        .map_max_entries(tc_counters, 16)
        .map_max_entries(proxy_common::FRONTENDS, 7)
        .load(loader::OBJECT)
        .unwrap();
    for name in [tc_counters, proxy_common::COUNTERS, proxy_common::FRONTENDS] {
        ebpf.map_mut(name).unwrap().pin(dir.join(name)).unwrap();
    }
    drop(ebpf);
    let replaced = loader::replace_incompatible_pins(&dir).unwrap();
    assert_eq!(
        replaced,
        vec![(
            tc_counters,
            format!(
                "16 entries pinned, {} now",
                proxy_common::nat::TC_COUNTER_MAX
            )
        )]
    );
    assert!(!dir.join(tc_counters).exists());
    assert!(dir.join(proxy_common::COUNTERS).exists());
    assert!(dir.join(proxy_common::FRONTENDS).exists());
}
