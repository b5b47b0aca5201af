//! Checks of the deployment manifests in `deploy/*.yaml` (not `deploy/examples/`, the demo's
//! objects). No root and no cluster are needed.
//!
//! - Every YAML document parses as the k8s-openapi type its `kind` names (an unknown kind
//!   fails), with the matching `apiVersion`, and without any field the type does not know.
//!   A misspelled field would otherwise be dropped silently.
//! - The ClusterRoles bound to the DaemonSet's ServiceAccount grant every access in
//!   [`API_ACCESS`], plus creating and patching Events.
//! - The DaemonSet runs the agent as a kube-proxy replacement: it uses the API source
//!   (no `--manifests`, no `--kubeconfig`), on every node, with the host network, the
//!   capabilities, bpffs and the host's cgroup v2 root, probes, priority and the node name.
//! - Every `--flag` in its args is a flag of `ebpf-proxy run`.
//! - The image (Containerfile) answers to kube-proxy's path, and kubeadm's kube-proxy
//!   DaemonSet command (the fixture in `tests/fixtures/kubeadm/`) runs the agent through it.
//!
//! Run: `cargo test --release -p proxy-userspace --test deploy_manifests`.

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{ConfigMap, Container, Namespace, PodSpec, ServiceAccount},
        rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule},
    },
    apimachinery::pkg::util::intstr::IntOrString,
};
use proxy_userspace::source::kubeapi::API_ACCESS;
use serde::Deserialize;

/// Access the agent needs besides [`API_ACCESS`]: writing Events, in both API groups.
const EVENT_ACCESS: &[(&str, &str, &[&str])] = &[
    ("", "events", &["create", "patch"]),
    ("events.k8s.io", "events", &["create", "patch"]),
];

/// Linux capabilities the agent container must have.
const CAPABILITIES: &[&str] = &["BPF", "NET_ADMIN", "SYS_ADMIN", "PERFMON", "SYS_PTRACE"];

/// Namespaces every cluster has, which the manifests need not create.
const BUILTIN_NAMESPACES: &[&str] = &["kube-system", "default"];

/// The objects of `deploy/*.yaml`, by kind; each with the file it came from.
#[derive(Default)]
struct Manifests {
    namespaces: Vec<(PathBuf, Namespace)>,
    service_accounts: Vec<(PathBuf, ServiceAccount)>,
    cluster_roles: Vec<(PathBuf, ClusterRole)>,
    bindings: Vec<(PathBuf, ClusterRoleBinding)>,
    config_maps: Vec<(PathBuf, ConfigMap)>,
    daemon_sets: Vec<(PathBuf, DaemonSet)>,
}

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// The first place where `typed` (the object serialized back) differs from `raw` (the
/// document as written), as a path like `spec.template.spec.containers[0].image`.
fn first_difference(
    raw: &serde_json::Value,
    typed: &serde_json::Value,
    at: &str,
) -> Option<String> {
    use serde_json::Value;
    match (raw, typed) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                let here = if at.is_empty() {
                    k.clone()
                } else {
                    format!("{at}.{k}")
                };
                match b.get(k) {
                    Some(w) => {
                        if let Some(d) = first_difference(v, w, &here) {
                            return Some(d);
                        }
                    }
                    // `null` in YAML (e.g. `key:` with nothing after it) is the same as absent.
                    None if v.is_null() => {}
                    None => return Some(format!("{here} (unknown to the API type)")),
                }
            }
            b.keys()
                .find(|k| !a.contains_key(*k))
                .map(|k| format!("{at}.{k} (added by the API type)"))
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => a
            .iter()
            .zip(b)
            .enumerate()
            .find_map(|(i, (v, w))| first_difference(v, w, &format!("{at}[{i}]"))),
        _ if raw == typed => None,
        _ => Some(format!("{at}: written {raw}, read back {typed}")),
    }
}

/// Parses `doc` as `T`, checking `apiVersion` and that no field is lost on the way.
fn parse<T>(file: &Path, doc: serde_json::Value) -> (PathBuf, T)
where
    T: k8s_openapi::Resource + serde::de::DeserializeOwned + serde::Serialize,
{
    let what = format!("{}: {}", file.display(), T::KIND);
    assert_eq!(
        doc["apiVersion"].as_str(),
        Some(T::API_VERSION),
        "{what}: wrong apiVersion"
    );
    let obj: T = serde_json::from_value(doc.clone()).unwrap_or_else(|e| panic!("{what}: {e}"));
    let back = serde_json::to_value(&obj).unwrap();
    if let Some(d) = first_difference(&doc, &back, "") {
        panic!("{what}: {d}");
    }
    (file.to_owned(), obj)
}

fn load() -> Manifests {
    let mut files: Vec<PathBuf> = fs::read_dir(deploy_dir())
        .expect("deploy/ exists")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no deploy/*.yaml");
    let mut m = Manifests::default();
    for f in &files {
        let text = fs::read_to_string(f).unwrap();
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            let doc = serde_json::Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("{}: not YAML: {e}", f.display()));
            if doc.is_null() {
                continue; // an empty document, e.g. after a trailing `---`
            }
            let kind = doc["kind"]
                .as_str()
                .unwrap_or_else(|| panic!("{}: a document without kind", f.display()))
                .to_owned();
            match kind.as_str() {
                "Namespace" => m.namespaces.push(parse(f, doc)),
                "ServiceAccount" => m.service_accounts.push(parse(f, doc)),
                "ClusterRole" => m.cluster_roles.push(parse(f, doc)),
                "ClusterRoleBinding" => m.bindings.push(parse(f, doc)),
                "ConfigMap" => m.config_maps.push(parse(f, doc)),
                "DaemonSet" => m.daemon_sets.push(parse(f, doc)),
                other => panic!("{}: unexpected kind {other}", f.display()),
            }
        }
    }
    m
}

fn name(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> &str {
    meta.name.as_deref().expect("metadata.name")
}

/// The one DaemonSet: (namespace, pod spec).
fn daemon_set(m: &Manifests) -> (String, &PodSpec) {
    assert_eq!(
        m.daemon_sets.len(),
        1,
        "expected exactly one DaemonSet in deploy/"
    );
    let (f, ds) = &m.daemon_sets[0];
    let ns = ds
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| panic!("{}: the DaemonSet has no namespace", f.display()));
    let spec = ds.spec.as_ref().expect("DaemonSet spec");
    let pod = spec.template.spec.as_ref().expect("pod template spec");
    (ns, pod)
}

/// The container that runs `ebpf-proxy run`.
fn agent(pod: &PodSpec) -> &Container {
    let runs = |c: &&Container| {
        c.args
            .as_ref()
            .and_then(|a| a.first())
            .is_some_and(|a| a == "run")
    };
    let mut agents = pod.containers.iter().filter(runs);
    let c = agents
        .next()
        .expect("a container whose args start with `run`");
    assert!(agents.next().is_none(), "more than one agent container");
    c
}

fn args(c: &Container) -> &[String] {
    c.args.as_deref().unwrap_or_default()
}

/// The value of `--flag` in `args`, written `--flag VALUE` or `--flag=VALUE`.
fn flag<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter().enumerate().find_map(|(i, a)| {
        if a == flag {
            args.get(i + 1).map(String::as_str)
        } else {
            a.strip_prefix(flag).and_then(|r| r.strip_prefix('='))
        }
    })
}

fn has_flag(args: &[String], f: &str) -> bool {
    args.iter()
        .any(|a| a == f || a.strip_prefix(f).is_some_and(|r| r.starts_with('=')))
}

/// The hostPath of the volume mounted at `path` in `c`, and the mount's propagation.
fn host_path_at<'a>(
    pod: &'a PodSpec,
    c: &'a Container,
    path: &str,
) -> Option<(&'a str, Option<&'a str>)> {
    let mount = c
        .volume_mounts
        .as_ref()?
        .iter()
        .find(|m| m.mount_path == path)?;
    let volume = pod
        .volumes
        .as_ref()?
        .iter()
        .find(|v| v.name == mount.name)?;
    Some((
        volume.host_path.as_ref()?.path.as_str(),
        mount.mount_propagation.as_deref(),
    ))
}

fn grants(rule: &PolicyRule, group: &str, resource: &str, verb: &str) -> bool {
    let has = |list: Option<&Vec<String>>, x: &str| {
        list.is_some_and(|l| l.iter().any(|v| v == x || v == "*"))
    };
    // A rule limited to resourceNames does not allow list or watch of the whole resource.
    rule.resource_names.as_ref().is_none_or(|n| n.is_empty())
        && has(rule.api_groups.as_ref(), group)
        && has(rule.resources.as_ref(), resource)
        && has(Some(&rule.verbs), verb)
}

#[test]
fn every_document_parses_as_its_kind() {
    let m = load();
    assert_eq!(m.service_accounts.len(), 1, "expected one ServiceAccount");
    assert!(!m.cluster_roles.is_empty(), "no ClusterRole");
    assert!(!m.bindings.is_empty(), "no ClusterRoleBinding");
    assert_eq!(m.daemon_sets.len(), 1, "expected one DaemonSet");
}

/// Every namespaced object is in a namespace that exists in every cluster or is shipped.
#[test]
fn namespaces_exist() {
    let m = load();
    let shipped: BTreeSet<&str> = m
        .namespaces
        .iter()
        .map(|(_, n)| name(&n.metadata))
        .collect();
    let metas = m
        .service_accounts
        .iter()
        .map(|(f, o)| (f, &o.metadata))
        .chain(m.config_maps.iter().map(|(f, o)| (f, &o.metadata)))
        .chain(m.daemon_sets.iter().map(|(f, o)| (f, &o.metadata)));
    for (f, meta) in metas {
        let ns = meta
            .namespace
            .as_deref()
            .unwrap_or_else(|| panic!("{}: {} has no namespace", f.display(), name(meta)));
        assert!(
            BUILTIN_NAMESPACES.contains(&ns) || shipped.contains(ns),
            "{}: namespace {ns} is neither built in nor in deploy/",
            f.display()
        );
    }
    for (f, n) in &m.namespaces {
        let n = name(&n.metadata);
        assert!(
            m.daemon_sets
                .iter()
                .any(|(_, d)| d.metadata.namespace.as_deref() == Some(n)),
            "{}: Namespace {n} is shipped but nothing runs in it",
            f.display()
        );
    }
}

#[test]
fn service_account_is_granted_the_api_access_the_agent_uses() {
    let m = load();
    let (ns, pod) = daemon_set(&m);
    let sa = pod
        .service_account_name
        .as_deref()
        .expect("the DaemonSet names its serviceAccountName");
    assert!(
        m.service_accounts
            .iter()
            .any(|(_, s)| name(&s.metadata) == sa
                && s.metadata.namespace.as_deref() == Some(ns.as_str())),
        "ServiceAccount {ns}/{sa} is not in deploy/"
    );

    // The rules of every ClusterRole bound to that ServiceAccount.
    let mut rules: Vec<&PolicyRule> = Vec::new();
    for (f, b) in &m.bindings {
        let bound = b.subjects.iter().flatten().any(|s| {
            s.kind == "ServiceAccount"
                && s.name == sa
                && s.namespace.as_deref() == Some(ns.as_str())
        });
        if !bound {
            continue;
        }
        assert_eq!(
            b.role_ref.kind,
            "ClusterRole",
            "{}: roleRef kind",
            f.display()
        );
        assert_eq!(
            b.role_ref.api_group,
            "rbac.authorization.k8s.io",
            "{}: roleRef apiGroup",
            f.display()
        );
        let role = m
            .cluster_roles
            .iter()
            .find(|(_, r)| name(&r.metadata) == b.role_ref.name)
            .unwrap_or_else(|| {
                panic!(
                    "{}: ClusterRole {} is not in deploy/",
                    f.display(),
                    b.role_ref.name
                )
            });
        rules.extend(role.1.rules.iter().flatten());
    }
    assert!(
        !rules.is_empty(),
        "no ClusterRole with rules is bound to {ns}/{sa}"
    );

    let mut missing = Vec::new();
    for (group, resource, verbs) in API_ACCESS.iter().chain(EVENT_ACCESS) {
        for verb in *verbs {
            if !rules.iter().any(|r| grants(r, group, resource, verb)) {
                missing.push(format!("{verb} {resource} (group {group:?})"));
            }
        }
    }
    assert!(missing.is_empty(), "not granted to {ns}/{sa}: {missing:?}");
}

#[test]
fn daemon_set_runs_the_agent_on_every_node_from_the_api() {
    let m = load();
    let (_, pod) = daemon_set(&m);
    assert_eq!(pod.host_network, Some(true), "hostNetwork");
    // Pods opting out of socket-level translation are found through their processes.
    assert_eq!(pod.host_pid, Some(true), "hostPID");
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    assert!(
        pod.tolerations
            .iter()
            .flatten()
            .any(|t| t.operator.as_deref() == Some("Exists")
                && t.key.is_none()
                && t.effect.is_none()),
        "no toleration of every taint (`operator: Exists` without key and effect)"
    );
    let grace = pod
        .termination_grace_period_seconds
        .expect("terminationGracePeriodSeconds");
    assert!(
        grace <= 30,
        "terminationGracePeriodSeconds {grace}: the data path stays pinned, keep it small"
    );

    let c = agent(pod);
    let a = args(c);
    assert!(
        !has_flag(a, "--manifests"),
        "the agent must follow the API, not --manifests: {a:?}"
    );
    assert!(
        !has_flag(a, "--kubeconfig"),
        "the agent must use the in-cluster config: {a:?}"
    );
    assert_eq!(
        flag(a, "--hostname-override"),
        Some("$(NODE_NAME)"),
        "--hostname-override"
    );
    let node_name = c
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "NODE_NAME")
        .expect("env NODE_NAME");
    let field = node_name
        .value_from
        .as_ref()
        .and_then(|v| v.field_ref.as_ref())
        .map(|f| f.field_path.as_str());
    assert_eq!(
        field,
        Some("spec.nodeName"),
        "NODE_NAME from the downward API"
    );
    // Every ConfigMap the pod refers to is shipped, in the pod's namespace.
    let (ns, _) = daemon_set(&m);
    let refs = pod
        .init_containers
        .iter()
        .flatten()
        .chain(&pod.containers)
        .flat_map(|k| k.env_from.iter().flatten())
        .filter_map(|e| e.config_map_ref.as_ref().map(|r| r.name.as_str()))
        .chain(
            pod.volumes
                .iter()
                .flatten()
                .filter_map(|v| v.config_map.as_ref().map(|c| c.name.as_str())),
        );
    for r in refs {
        assert!(
            m.config_maps.iter().any(|(_, c)| name(&c.metadata) == r
                && c.metadata.namespace.as_deref() == Some(ns.as_str())),
            "ConfigMap {ns}/{r} is referred to but not in deploy/"
        );
    }
    let requests = c.resources.as_ref().and_then(|r| r.requests.as_ref());
    assert!(
        requests.is_some_and(|r| r.contains_key("cpu") && r.contains_key("memory")),
        "cpu and memory requests"
    );
}

#[test]
fn daemon_set_has_the_kernel_access_the_data_path_needs() {
    let m = load();
    let (_, pod) = daemon_set(&m);
    let c = agent(pod);
    let sc = c.security_context.as_ref().expect("securityContext");
    let added: BTreeSet<&str> = sc
        .capabilities
        .as_ref()
        .and_then(|c| c.add.as_ref())
        .into_iter()
        .flatten()
        .map(|c| c.strip_prefix("CAP_").unwrap_or(c))
        .collect();
    for cap in CAPABILITIES {
        assert!(added.contains(cap), "capability {cap} not added: {added:?}");
    }

    // bpffs: the host's, so the pins outlive the pod.
    let bpffs = flag(args(c), "--bpffs").unwrap_or("/sys/fs/bpf");
    assert_eq!(bpffs, "/sys/fs/bpf");
    let (host, _) = host_path_at(pod, c, bpffs).expect("a hostPath volume mounted at /sys/fs/bpf");
    assert_eq!(host, "/sys/fs/bpf");

    // The host's cgroup v2 root, where --cgroup-path points.
    let cgroup =
        flag(args(c), "--cgroup-path").expect("--cgroup-path (the mounted host cgroup2 root)");
    let (host, _) = host_path_at(pod, c, cgroup)
        .unwrap_or_else(|| panic!("--cgroup-path {cgroup} is not a hostPath mount"));
    assert!(
        host == "/sys/fs/cgroup" || host == "/sys/fs/cgroup/unified",
        "--cgroup-path {cgroup} mounts {host}, not the host's cgroup2 root"
    );

    // The API server accepts Bidirectional propagation only in privileged containers.
    for k in pod.init_containers.iter().flatten().chain(&pod.containers) {
        let privileged = k.security_context.as_ref().and_then(|s| s.privileged) == Some(true);
        for v in k.volume_mounts.iter().flatten() {
            if v.mount_propagation.as_deref() == Some("Bidirectional") {
                assert!(
                    privileged,
                    "container {}: Bidirectional mount {} needs privileged",
                    k.name, v.mount_path
                );
            }
        }
    }
}

#[test]
fn daemon_set_probes_use_the_health_server() {
    let m = load();
    let (_, pod) = daemon_set(&m);
    let c = agent(pod);
    let health_port: i32 = flag(args(c), "--healthz-bind-address")
        .unwrap_or("0.0.0.0:10256")
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .expect("--healthz-bind-address ADDR:PORT");
    let get = |p: Option<&k8s_openapi::api::core::v1::Probe>, what: &str| {
        let h = p
            .and_then(|p| p.http_get.as_ref())
            .unwrap_or_else(|| panic!("{what}: no httpGet"));
        let port = match &h.port {
            IntOrString::Int(n) => *n,
            IntOrString::String(n) => c
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(n.as_str()))
                .map(|p| p.container_port)
                .unwrap_or_else(|| panic!("{what}: no port named {n}")),
        };
        assert_eq!(port, health_port, "{what}: port");
        h.path.clone().unwrap_or_default()
    };
    assert_eq!(
        get(c.liveness_probe.as_ref(), "livenessProbe"),
        "/livez",
        "livenessProbe path"
    );
    assert_eq!(
        get(c.readiness_probe.as_ref(), "readinessProbe"),
        "/healthz",
        "readinessProbe path"
    );
    if c.startup_probe.is_some() {
        get(c.startup_probe.as_ref(), "startupProbe");
    }
}

/// Every `--flag` of the DaemonSet's args is a flag of `ebpf-proxy run` (from its --help,
/// which needs neither root nor the eBPF object).
#[test]
fn daemon_set_args_are_flags_of_ebpf_proxy_run() {
    let m = load();
    let (_, pod) = daemon_set(&m);
    let out = Command::new(env!("CARGO_BIN_EXE_ebpf-proxy"))
        .args(["run", "--help"])
        .output()
        .expect("run ebpf-proxy run --help");
    assert!(out.status.success(), "ebpf-proxy run --help failed");
    let help = String::from_utf8_lossy(&out.stdout);
    let known: BTreeSet<&str> = help
        .split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']')
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| w.split('=').next().unwrap())
        .collect();
    let unknown: BTreeSet<&str> = args(agent(pod))
        .iter()
        .skip(1)
        .filter(|a| a.starts_with("--"))
        .map(|a| a.split('=').next().unwrap())
        .filter(|f| !known.contains(f))
        .collect();
    assert!(
        unknown.is_empty(),
        "not flags of `ebpf-proxy run`: {unknown:?}"
    );
}

/// The path kube-proxy's DaemonSets run, and the link the Containerfile makes to the agent.
const KUBE_PROXY_PATH: &str = "/usr/local/bin/kube-proxy";

#[test]
fn the_image_runs_kubeadms_kube_proxy_command() {
    // The Containerfile's runtime stage installs the agent and links kube-proxy's path to it.
    let containerfile =
        fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../Containerfile")).unwrap();
    let runtime = containerfile
        .rsplit("\nFROM ")
        .next()
        .expect("a runtime stage");
    assert!(
        runtime.contains("/src/target/release/ebpf-proxy /usr/local/bin/ebpf-proxy"),
        "{runtime}"
    );
    assert!(
        runtime
            .lines()
            .any(|l| l.trim() == format!("RUN ln -s ebpf-proxy {KUBE_PROXY_PATH}")),
        "no {KUBE_PROXY_PATH} link in the runtime stage:\n{runtime}"
    );

    // kubeadm's DaemonSet command, run through such a link, with kubeadm's ConfigMap at
    // /var/lib/kube-proxy: the agent reads both (here it writes its effective
    // configuration and exits, so no root is needed).
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kubeadm");
    let ds: DaemonSet = serde_yaml_ng::from_str(
        &fs::read_to_string(fixtures.join("kube-proxy-daemonset.yaml")).unwrap(),
    )
    .unwrap();
    let command = ds.spec.unwrap().template.spec.unwrap().containers[0]
        .command
        .clone()
        .unwrap();
    assert_eq!(command[0], KUBE_PROXY_PATH);
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("kube-proxy");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_ebpf-proxy"), &link).unwrap();
    let conf = dir.path().join("config.conf");
    fs::copy(fixtures.join("config.conf"), &conf).unwrap();
    let written = dir.path().join("written.yaml");
    let args: Vec<String> = command[1..]
        .iter()
        .map(|a| {
            a.replace(
                "/var/lib/kube-proxy/config.conf",
                &conf.display().to_string(),
            )
            .replace("$(NODE_NAME)", "node-1")
        })
        .collect();
    let out = Command::new(&link)
        .args(&args)
        .arg(format!("--write-config-to={}", written.display()))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        !stderr.contains("WARN"),
        "kubeadm's file reads without warnings: {stderr}"
    );
    let loaded = proxy_userspace::config::parse(&fs::read_to_string(&written).unwrap()).unwrap();
    let s = loaded.settings;
    assert_eq!(s.hostname_override.as_deref(), Some("node-1"));
    assert_eq!(s.cluster_cidr.unwrap().to_string(), "10.244.0.0/16");
    assert_eq!(
        s.kubeconfig.as_deref(),
        Some(Path::new("/var/lib/kube-proxy/kubeconfig.conf"))
    );
}
