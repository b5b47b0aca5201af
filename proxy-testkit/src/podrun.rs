//! Test support: runs a Kubernetes pod template with podman the way a kubelet would, on a
//! lab node (a network namespace, a child cgroup, directories standing for the host's
//! paths), for the test that starts the DaemonSet's pod as a container runtime does.
//!
//! `podman kube play` (4.3 here) ignores mount propagation and probes and would put a
//! `hostNetwork` pod on this machine's own network, so the template is translated field by
//! field instead: every field of the pod and its containers is either mapped to a podman
//! option or named here as having no effect on a single node; any other field is an error,
//! so a template that grows a field the translation does not know fails the test instead
//! of being run without it.
//!
//! | pod field | podman |
//! | --- | --- |
//! | `hostNetwork: true` | `--network ns:<lab node's netns>` (never this machine's) |
//! | `hostPID: true` | `--pid host` |
//! | `hostPath` volumes | `-v <the lab's directory for that host path>:<mountPath>`, `:rshared` for `Bidirectional`, `:rslave` for `HostToContainer`, `:ro` for `readOnly` |
//! | `configMap` volumes | a directory written from the ConfigMap's data |
//! | service account | the credentials directory mounted at `/var/run/secrets/kubernetes.io/serviceaccount` (read-only), `KUBERNETES_SERVICE_HOST`/`_PORT` set as the kubelet sets them |
//! | `command`, `args` | `--entrypoint` and arguments, `$(VAR)` expanded from the container's environment as the kubelet does |
//! | `env` (`value`, `fieldRef` `spec.nodeName`, `configMapKeyRef`) | `--env` |
//! | `securityContext` | `--privileged`, `--cap-drop`/`--cap-add`, `--read-only`, `--security-opt apparmor=unconfined`, `--security-opt label=type:…` |
//! | init containers | run in order to completion before the containers start |
//!
//! Without effect on one node, accepted: scheduling fields (`nodeSelector`, `tolerations`,
//! `priorityClassName`, `affinity`), `dnsPolicy: Default` (podman gives the node's
//! resolver), `serviceAccountName`, `terminationGracePeriodSeconds` (used by
//! [`Pod::stop`]), resource requests (no limits: nothing to enforce), `ports` (host
//! network), `terminationMessagePolicy`, `imagePullPolicy` (the image is local), probes
//! (the test calls them as the kubelet does, see [`Probe`]).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Command, Output},
    time::Duration,
};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, PodSpec, Probe as K8sProbe, SecurityContext, Volume,
};

/// How the pod meets the lab node.
#[derive(Clone, Debug)]
pub struct Node {
    /// The node's name (`spec.nodeName`).
    pub name: String,
    /// Path of the node's network namespace file (`/run/netns/<name>`).
    pub netns: PathBuf,
    /// Host path -> the lab's directory standing for it (e.g. `/sys/fs/bpf` -> a directory
    /// of the test); a hostPath volume without an entry is an error.
    pub host_paths: BTreeMap<String, PathBuf>,
    /// ConfigMaps the pod may reference, by name.
    pub config_maps: BTreeMap<String, ConfigMap>,
    /// The service account credentials directory (`token`, `ca.crt`, `namespace`).
    pub service_account: PathBuf,
    /// `KUBERNETES_SERVICE_HOST` and `_PORT`, as the kubelet sets them from the `kubernetes`
    /// Service.
    pub kubernetes_service: (String, u16),
    /// Where ConfigMap volumes are written.
    pub scratch: PathBuf,
}

/// An HTTP probe of a container, as the kubelet runs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Probe {
    /// `httpGet.host`, or the pod IP (the node's address with `hostNetwork`) when unset.
    pub host: Option<String>,
    /// `httpGet.port`.
    pub port: u16,
    /// `httpGet.path`.
    pub path: String,
}

/// The probes of a container.
#[derive(Clone, Debug, Default)]
pub struct Probes {
    /// `startupProbe`.
    pub startup: Option<Probe>,
    /// `livenessProbe`.
    pub liveness: Option<Probe>,
    /// `readinessProbe`.
    pub readiness: Option<Probe>,
}

/// A translated container: the podman arguments (after `podman run`) and its probes.
#[derive(Clone, Debug)]
pub struct RunSpec {
    /// The container's name.
    pub name: String,
    /// `podman run` arguments without the leading `run`, image and command included.
    pub args: Vec<String>,
    /// Its HTTP probes.
    pub probes: Probes,
}

/// The podman command used by the lab: the runc runtime (crun refuses this machine's hybrid
/// cgroup layout) and explicit limits (raising the defaults needs CAP_SYS_RESOURCE).
pub fn podman() -> Command {
    let mut c = Command::new("podman");
    c.args(["--runtime", "runc"]);
    c
}

/// The resource limits every lab container runs with.
fn ulimits() -> Vec<String> {
    let mut nofile = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills the struct.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut nofile) };
    let n = nofile.rlim_max.min(1 << 20);
    vec![
        "--ulimit".into(),
        format!("nofile={n}:{n}"),
        "--ulimit".into(),
        "nproc=32768:32768".into(),
    ]
}

/// Expands `$(VAR)` references in `s` from `env`, as the kubelet does for command and args
/// (`$$` escapes; an unknown reference stays as written).
pub fn expand(s: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(body) = after.strip_prefix('(') {
            match body.find(')') {
                Some(end) => {
                    let name = &body[..end];
                    match env.get(name) {
                        Some(v) => out.push_str(v),
                        None => out.push_str(&format!("$({name})")),
                    }
                    rest = &body[end + 1..];
                }
                None => {
                    out.push_str(&rest[i..]);
                    rest = "";
                }
            }
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

fn probe(p: &Option<K8sProbe>, what: &str) -> Result<Option<Probe>> {
    let Some(p) = p else { return Ok(None) };
    let Some(h) = &p.http_get else {
        bail!("{what}: only httpGet probes are run by the lab");
    };
    let port = match &h.port {
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n) => *n as u16,
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(s) => {
            bail!("{what}: named port {s:?} not supported by the lab")
        }
    };
    Ok(Some(Probe {
        host: h.host.clone(),
        port,
        path: h.path.clone().unwrap_or_else(|| "/".into()),
    }))
}

/// The container's environment (`env` only; `envFrom` is rejected): name -> value.
fn environment(c: &Container, node: &Node) -> Result<BTreeMap<String, String>> {
    if c.env_from.is_some() {
        bail!("container {}: envFrom is not translated", c.name);
    }
    let mut env = BTreeMap::new();
    env.insert(
        "KUBERNETES_SERVICE_HOST".to_string(),
        node.kubernetes_service.0.clone(),
    );
    env.insert(
        "KUBERNETES_SERVICE_PORT".to_string(),
        node.kubernetes_service.1.to_string(),
    );
    for e in c.env.iter().flatten() {
        let value = match (&e.value, &e.value_from) {
            (Some(v), None) => expand(v, &env),
            (None, Some(from)) => {
                if let Some(f) = &from.field_ref {
                    match f.field_path.as_str() {
                        "spec.nodeName" => node.name.clone(),
                        other => bail!("env {}: fieldRef {other} not translated", e.name),
                    }
                } else if let Some(k) = &from.config_map_key_ref {
                    let cm = node.config_maps.get(&k.name).with_context(|| {
                        format!("env {}: ConfigMap {} not rendered", e.name, k.name)
                    })?;
                    match cm.data.as_ref().and_then(|d| d.get(&k.key)) {
                        Some(v) => v.clone(),
                        None if k.optional == Some(true) => continue,
                        // The kubelet refuses to start the container (CreateContainerConfigError).
                        None => bail!(
                            "env {}: couldn't find key {} in ConfigMap {}",
                            e.name,
                            k.key,
                            k.name
                        ),
                    }
                } else {
                    bail!("env {}: valueFrom kind not translated", e.name)
                }
            }
            (None, None) => String::new(),
            (Some(_), Some(_)) => bail!("env {}: both value and valueFrom", e.name),
        };
        env.insert(e.name.clone(), value);
    }
    Ok(env)
}

/// Translates container `c` of a pod with `spec` into `podman run` arguments for `node`.
///
/// Errors: a field the translation does not know or cannot honour (see the module doc).
pub fn translate(spec: &PodSpec, c: &Container, node: &Node, image: &str) -> Result<RunSpec> {
    check_translatable(spec, c)?;
    let env = environment(c, node)?;
    let mut args: Vec<String> = vec![
        "--name".into(),
        c.name.clone(),
        "--network".into(),
        format!("ns:{}", node.netns.display()),
    ];
    args.extend(ulimits());
    if spec.host_pid == Some(true) {
        args.extend(["--pid".into(), "host".into()]);
    }
    let sc = c.security_context.clone().unwrap_or_default();
    args.extend(security_args(&sc, &c.name)?);
    for (k, v) in &env {
        args.extend(["--env".into(), format!("{k}={v}")]);
    }
    args.extend(volume_args(spec, c, node, sc.privileged == Some(true))?);
    if spec.automount_service_account_token != Some(false) {
        args.extend([
            "-v".into(),
            format!(
                "{}:/var/run/secrets/kubernetes.io/serviceaccount:ro",
                node.service_account.display()
            ),
        ]);
    }
    args.extend(command_args(c, &env, image));
    Ok(RunSpec {
        name: c.name.clone(),
        args,
        probes: Probes {
            startup: probe(&c.startup_probe, "startupProbe")?,
            liveness: probe(&c.liveness_probe, "livenessProbe")?,
            readiness: probe(&c.readiness_probe, "readinessProbe")?,
        },
    })
}

/// Refuses a pod or container field that [`translate`] does not map and that would matter:
/// a pod other than hostNetwork with hostPath and configMap volumes, and the fields listed
/// here. Errors name the first such field.
fn check_translatable(spec: &PodSpec, c: &Container) -> Result<()> {
    let known_pod = spec.host_network == Some(true)
        && spec
            .volumes
            .iter()
            .flatten()
            .all(|v| v.host_path.is_some() || v.config_map.is_some());
    if !known_pod {
        bail!("pod: only hostNetwork pods with hostPath and configMap volumes are translated");
    }
    for (set, what) in [
        (spec.host_ipc == Some(true), "hostIPC"),
        (
            spec.share_process_namespace == Some(true),
            "shareProcessNamespace",
        ),
        (spec.runtime_class_name.is_some(), "runtimeClassName"),
        (
            spec.security_context
                .as_ref()
                .is_some_and(|s| s != &Default::default()),
            "pod securityContext",
        ),
        (
            spec.dns_policy.as_deref().is_some_and(|d| d != "Default"),
            "dnsPolicy other than Default",
        ),
        (spec.host_aliases.is_some(), "hostAliases"),
        (c.working_dir.is_some(), "workingDir"),
        (c.lifecycle.is_some(), "lifecycle"),
        (c.stdin == Some(true) || c.tty == Some(true), "stdin/tty"),
        (c.volume_devices.is_some(), "volumeDevices"),
        (
            c.resources
                .as_ref()
                .and_then(|r| r.limits.as_ref())
                .is_some_and(|l| !l.is_empty()),
            "resource limits",
        ),
        (
            c.liveness_probe
                .as_ref()
                .or(c.readiness_probe.as_ref())
                .or(c.startup_probe.as_ref())
                .is_some_and(|p| p.exec.is_some() || p.tcp_socket.is_some() || p.grpc.is_some()),
            "non-HTTP probes",
        ),
    ] {
        if set {
            bail!("container {}: {what} is not translated by the lab", c.name);
        }
    }
    Ok(())
}

/// The podman options of the security context `sc` of container `name`: `--privileged`,
/// `--cap-drop`/`--cap-add`, `--read-only`, `--security-opt`. Errors on an AppArmor
/// profile other than Unconfined or RuntimeDefault, and on the fields not translated.
fn security_args(sc: &SecurityContext, name: &str) -> Result<Vec<String>> {
    let mut args: Vec<String> = Vec::new();
    if sc.privileged == Some(true) {
        args.push("--privileged".into());
    }
    if let Some(caps) = &sc.capabilities {
        for d in caps.drop.iter().flatten() {
            args.extend(["--cap-drop".into(), d.to_lowercase()]);
        }
        for a in caps.add.iter().flatten() {
            args.extend(["--cap-add".into(), a.to_lowercase()]);
        }
    }
    if sc.read_only_root_filesystem == Some(true) {
        args.push("--read-only".into());
    }
    if let Some(p) = &sc.app_armor_profile {
        match p.type_.as_str() {
            "Unconfined" => args.extend(["--security-opt".into(), "apparmor=unconfined".into()]),
            "RuntimeDefault" => {}
            other => bail!("appArmorProfile {other} not translated"),
        }
    }
    if let Some(se) = &sc.se_linux_options {
        if let Some(t) = &se.type_ {
            args.extend(["--security-opt".into(), format!("label=type:{t}")]);
        }
        if let Some(l) = &se.level {
            args.extend(["--security-opt".into(), format!("label=level:{l}")]);
        }
    }
    if sc.run_as_user.is_some()
        || sc.run_as_group.is_some()
        || sc.allow_privilege_escalation.is_some()
        || sc.seccomp_profile.is_some()
        || sc.proc_mount.is_some()
    {
        bail!(
            "container {}: securityContext fields beyond privileged, capabilities, readOnlyRootFilesystem, appArmorProfile and seLinuxOptions are not translated",
            name
        );
    }
    Ok(args)
}

/// The `-v` options of container `c`'s volume mounts, in their order (ConfigMap volumes
/// written to `node.scratch` first). `privileged`: whether the container is, which
/// Bidirectional propagation needs. Errors on a mount without its volume, a subPath, a
/// host path the lab has no directory for, a ConfigMap not rendered, and a propagation
/// not translated.
fn volume_args(
    spec: &PodSpec,
    c: &Container,
    node: &Node,
    privileged: bool,
) -> Result<Vec<String>> {
    let mut args: Vec<String> = Vec::new();
    let volumes: BTreeMap<&str, &Volume> = spec
        .volumes
        .iter()
        .flatten()
        .map(|v| (v.name.as_str(), v))
        .collect();
    for m in c.volume_mounts.iter().flatten() {
        let v = volumes
            .get(m.name.as_str())
            .with_context(|| format!("volumeMount {}: no such volume", m.name))?;
        if m.sub_path.is_some() || m.sub_path_expr.is_some() {
            bail!("volumeMount {}: subPath not translated", m.name);
        }
        let source = volume_source(v, node)?;
        let mut opts = Vec::new();
        if m.read_only == Some(true) {
            opts.push("ro");
        }
        match m.mount_propagation.as_deref() {
            None | Some("None") => {}
            Some("HostToContainer") => opts.push("rslave"),
            Some("Bidirectional") => {
                if !privileged {
                    // The API server rejects it too.
                    bail!(
                        "volumeMount {}: Bidirectional needs a privileged container",
                        m.name
                    );
                }
                opts.push("rshared")
            }
            Some(other) => bail!("volumeMount {}: mountPropagation {other}", m.name),
        }
        let mut volume = format!("{}:{}", source.display(), m.mount_path);
        if !opts.is_empty() {
            volume.push(':');
            volume.push_str(&opts.join(","));
        }
        args.extend(["-v".into(), volume]);
    }
    Ok(args)
}

/// The directory mounted for volume `v`: the lab's directory standing for a hostPath, or
/// a ConfigMap's data written to a directory of `node.scratch`. Errors when the lab has no
/// directory for the host path, the ConfigMap is not rendered, or writing it fails.
fn volume_source(v: &Volume, node: &Node) -> Result<PathBuf> {
    if let Some(hp) = &v.host_path {
        let dir = node.host_paths.get(&hp.path).with_context(|| {
            format!(
                "hostPath {} of volume {}: the lab has no directory standing for it",
                hp.path, v.name
            )
        })?;
        Ok(dir.clone())
    } else if let Some(cmv) = &v.config_map {
        let cm = node
            .config_maps
            .get(&cmv.name)
            .with_context(|| format!("volume {}: ConfigMap {} not rendered", v.name, cmv.name))?;
        let dir = node.scratch.join(format!("configmap-{}", v.name));
        std::fs::create_dir_all(&dir)?;
        for (k, val) in cm.data.iter().flatten() {
            std::fs::write(dir.join(k), val)?;
        }
        Ok(dir)
    } else {
        unreachable!("check_translatable refuses other volumes")
    }
}

/// The image and the container's command and arguments, `$(VAR)` expanded from `env` as
/// the kubelet does: the command's first word as `--entrypoint`, then the image, the rest
/// of the command and the arguments.
fn command_args(c: &Container, env: &BTreeMap<String, String>, image: &str) -> Vec<String> {
    let mut args: Vec<String> = Vec::new();
    let command: Vec<String> = c.command.iter().flatten().map(|s| expand(s, env)).collect();
    let cargs: Vec<String> = c.args.iter().flatten().map(|s| expand(s, env)).collect();
    if let Some(entry) = command.first() {
        args.extend(["--entrypoint".into(), entry.clone()]);
    }
    args.push(image.to_string());
    args.extend(command.iter().skip(1).cloned());
    args.extend(cargs);
    args
}

/// Runs `podman ARGS` with a timeout; the output (a non-zero exit is not an error).
///
/// Errors: podman cannot be started or does not finish in time.
pub fn podman_output(args: &[String], timeout: Duration) -> Result<Output> {
    let mut c = podman();
    c.args(args);
    crate::testbed::output_in(None, None, &mut c, timeout)
        .with_context(|| format!("podman {}", args.join(" ")))
}

/// A running pod: its containers' names (removed on drop).
pub struct Pod {
    /// The prefix of every container name.
    pub prefix: String,
    /// The main containers' names (the first is the agent).
    pub containers: Vec<String>,
    /// `terminationGracePeriodSeconds`.
    pub grace: u64,
    /// Each init container's name and output, in order.
    pub inits: Vec<(String, Output)>,
    /// The main containers as translated (their probes among them), in order.
    pub specs: Vec<RunSpec>,
    /// Names of the containers created (init and main), for removal.
    created: Vec<String>,
}

impl Pod {
    /// Runs the init containers of `spec` in order (each must exit 0; their output is kept
    /// in [`Pod::inits`]) and starts its containers detached. Container names get `prefix`.
    ///
    /// Errors: a translation error, an init container failing (with its output), a
    /// container that does not start.
    pub fn start(spec: &PodSpec, node: &Node, image: &str, prefix: &str) -> Result<Pod> {
        let mut pod = Pod {
            prefix: prefix.to_string(),
            containers: Vec::new(),
            grace: spec.termination_grace_period_seconds.unwrap_or(30).max(1) as u64,
            inits: Vec::new(),
            specs: Vec::new(),
            created: Vec::new(),
        };
        // A leftover of a crashed run.
        for c in spec
            .init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
        {
            let _ = podman_output(
                &["rm".into(), "-f".into(), format!("{prefix}{}", c.name)],
                Duration::from_secs(30),
            );
        }
        for c in spec.init_containers.iter().flatten() {
            let mut rs = translate(spec, c, node, image)?;
            let name = format!("{prefix}{}", c.name);
            rs.args[1] = name.clone();
            pod.created.push(name.clone());
            let mut args = vec!["run".to_string()];
            args.extend(rs.args);
            let out = podman_output(&args, Duration::from_secs(120))?;
            let ok = out.status.success();
            pod.inits.push((c.name.clone(), out));
            if !ok {
                let (_, out) = pod.inits.last().unwrap();
                bail!(
                    "init container {} failed ({}): {}{}",
                    c.name,
                    out.status,
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        for c in &spec.containers {
            let mut rs = translate(spec, c, node, image)?;
            let name = format!("{prefix}{}", c.name);
            rs.args[1] = name.clone();
            pod.created.push(name.clone());
            let mut args = vec!["run".to_string(), "-d".to_string()];
            args.extend(rs.args.clone());
            let out = podman_output(&args, Duration::from_secs(120))?;
            if !out.status.success() {
                bail!(
                    "container {} did not start: {}",
                    c.name,
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            pod.containers.push(name);
            pod.specs.push(rs);
        }
        Ok(pod)
    }

    /// `podman exec` of `args` in container `i`.
    ///
    /// Errors: podman cannot run or does not finish within `timeout`.
    pub fn exec(&self, i: usize, args: &[&str], timeout: Duration) -> Result<Output> {
        let mut a = vec!["exec".to_string(), self.containers[i].clone()];
        a.extend(args.iter().map(|s| s.to_string()));
        podman_output(&a, timeout)
    }

    /// Restarts container `i` as the kubelet restarts a container (stop within the grace
    /// period, start again with the same spec).
    ///
    /// Errors: podman failed.
    pub fn restart(&self, i: usize) -> Result<()> {
        let out = podman_output(
            &[
                "restart".into(),
                "-t".into(),
                self.grace.to_string(),
                self.containers[i].clone(),
            ],
            Duration::from_secs(60 + self.grace),
        )?;
        if !out.status.success() {
            bail!("podman restart: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    /// The logs of container `i`.
    pub fn logs(&self, i: usize) -> String {
        podman_output(
            &["logs".into(), self.containers[i].clone()],
            Duration::from_secs(30),
        )
        .map(|o| {
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )
        })
        .unwrap_or_default()
    }

    /// Stops the containers (SIGTERM, then SIGKILL after the grace period).
    pub fn stop(&self) {
        for c in &self.containers {
            let _ = podman_output(
                &[
                    "stop".into(),
                    "-t".into(),
                    self.grace.to_string(),
                    c.clone(),
                ],
                Duration::from_secs(60 + self.grace),
            );
        }
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        for c in self.created.iter().rev() {
            let _ = podman_output(
                &["rm".into(), "-f".into(), "-t".into(), "2".into(), c.clone()],
                Duration::from_secs(60),
            );
        }
    }
}

/// Whether podman can run a container from `image` here (`--network none`, `true`-like
/// command: `--version` of the image's entrypoint); the reason when it cannot.
pub fn usable(image: &str) -> std::result::Result<(), String> {
    let mut args: Vec<String> = vec![
        "run".into(),
        "--rm".into(),
        "--network".into(),
        "none".into(),
    ];
    args.extend(ulimits());
    args.extend([image.to_string(), "--version".into()]);
    match podman_output(&args, Duration::from_secs(120)) {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "podman cannot run {image}: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("podman cannot run here: {e:#}")),
    }
}

/// `dir` as a shared mount point of its own (a bind mount onto itself, `--make-shared`),
/// so a mount a container makes below it with `rshared` propagation reaches this mount
/// namespace, as the host's `/sys/fs/bpf` does on a node. Undone by [`unshare_dir`].
///
/// Errors: the mount calls fail.
pub fn share_dir(dir: &Path) -> Result<()> {
    let path = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())?;
    // SAFETY: mount(2) with valid C strings and no data.
    unsafe {
        if libc::mount(
            path.as_ptr(),
            path.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        ) != 0
        {
            return Err(std::io::Error::last_os_error()).context("bind mount");
        }
        if libc::mount(
            std::ptr::null(),
            path.as_ptr(),
            std::ptr::null(),
            libc::MS_SHARED,
            std::ptr::null(),
        ) != 0
        {
            return Err(std::io::Error::last_os_error()).context("make shared");
        }
    }
    Ok(())
}

/// Unmounts everything at and below `dir` (lazily, deepest first).
pub fn unshare_dir(dir: &Path) {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mut below: Vec<String> = mounts
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter(|m| Path::new(m).starts_with(dir))
        .map(str::to_string)
        .collect();
    below.sort_by_key(|m| std::cmp::Reverse(m.len()));
    for m in below {
        if let Ok(p) = std::ffi::CString::new(m) {
            // SAFETY: umount2 with a valid path.
            unsafe { libc::umount2(p.as_ptr(), libc::MNT_DETACH) };
        }
    }
}

/// The file system type magic of `path` (`statfs`).
pub fn fs_magic(path: &Path) -> Option<i64> {
    let p = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statfs into a zeroed struct.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statfs(p.as_ptr(), &mut s) } == 0).then_some(s.f_type as i64)
}

/// `BPF_FS_MAGIC`.
pub const BPF_FS_MAGIC: i64 = 0xcafe4a11;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_expand_as_the_kubelet_does() {
        let env: BTreeMap<String, String> = [("NODE_NAME", "node-a"), ("API", "192.0.2.1:6443")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(expand("$(NODE_NAME)", &env), "node-a");
        assert_eq!(expand("--master=$(API)", &env), "--master=192.0.2.1:6443");
        assert_eq!(expand("$$(NODE_NAME)", &env), "$(NODE_NAME)");
        assert_eq!(expand("$(MISSING)", &env), "$(MISSING)");
        assert_eq!(expand("a$b", &env), "a$b");
    }
}
