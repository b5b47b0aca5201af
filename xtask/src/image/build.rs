//! Building the image with buildah from the prepared root filesystem, measuring it in an
//! OCI layout, and running its programs with podman.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use super::{
    CMD, DESCRIPTION, ENTRYPOINT, PATH_ENV, TITLE, USER,
    rootfs::{Agent, RootfsSummary, write_rootfs},
};
use crate::command::{run, stdout_of};
use crate::setup::find_tool;
use crate::{target_dir, workspace};

/// An image committed to containers-storage.
pub struct Built {
    /// The reference as tagged, e.g. `localhost/ebpf-proxy:0.1.0`.
    pub reference: String,
    /// The image id (the config's digest, `sha256:...`).
    pub id: String,
    /// The manifest digest in containers-storage (uncompressed layers), `sha256:...`.
    pub digest: String,
    /// The uncompressed size of its layers as containers-storage counts it, in bytes.
    pub size: u64,
    pub rootfs: RootfsSummary,
}

pub(super) fn agent_bin() -> PathBuf {
    target_dir().join("release/ebpf-proxy")
}

pub(super) fn image_dir() -> PathBuf {
    target_dir().join("image")
}

/// The agent's version from `ebpf-proxy --version` (`ebpf-proxy 0.1.0`): the image carries
/// that binary, so its version is the image's.
pub(super) fn agent_version(bin: &Path) -> Result<String> {
    let out = stdout_of(Command::new(bin).arg("--version"))?;
    out.split_whitespace()
        .nth(1)
        .map(str::to_owned)
        .with_context(|| format!("no version in `{} --version`: {out:?}", bin.display()))
}

/// Seconds since the epoch for the image's created time and every file's mtime:
/// `$SOURCE_DATE_EPOCH`, else HEAD's commit time, so the same tree gives the same image.
fn timestamp() -> Result<u64> {
    if let Some(s) = env::var_os("SOURCE_DATE_EPOCH") {
        let s = s.to_string_lossy();
        return s
            .parse()
            .with_context(|| format!("SOURCE_DATE_EPOCH={s:?} is not a number of seconds"));
    }
    let t = stdout_of(
        Command::new("git")
            .args(["log", "-1", "--format=%ct"])
            .current_dir(workspace()),
    )
    .context("reading HEAD's commit time (set SOURCE_DATE_EPOCH outside a git checkout)")?;
    t.parse()
        .with_context(|| format!("git's commit time {t:?} is not a number"))
}

fn git_head() -> Result<String> {
    stdout_of(
        Command::new("git")
            .args(["rev-parse", "HEAD"])
            .current_dir(workspace()),
    )
}

/// True when the work tree differs from HEAD (the revision label then names HEAD only).
fn git_dirty() -> bool {
    stdout_of(
        Command::new("git")
            .args(["status", "--porcelain", "--untracked-files=no"])
            .current_dir(workspace()),
    )
    .is_ok_and(|s| !s.is_empty())
}

/// Removes a buildah working container on drop, so a failed step leaves none behind.
struct WorkingContainer(String);

impl Drop for WorkingContainer {
    fn drop(&mut self) {
        let _ = Command::new("buildah")
            .args(["rm", &self.0])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// The image's files in target/image/rootfs, and what its labels and times need.
pub(super) struct Prepared {
    pub(super) root: PathBuf,
    pub(super) rootfs: RootfsSummary,
    /// `git rev-parse HEAD`.
    pub(super) revision: String,
    /// Seconds since the epoch, see [`timestamp`].
    pub(super) stamp: u64,
}

/// Writes the root filesystem into target/image/rootfs (replacing an earlier one).
/// Errors name the missing file or library, or the git command that failed.
pub(super) fn prepare() -> Result<Prepared> {
    let root = image_dir().join("rootfs");
    if root.exists() {
        fs::remove_dir_all(&root).with_context(|| format!("removing {}", root.display()))?;
    }
    let rootfs = write_rootfs(&root, Agent::Include(&agent_bin()))?;
    let revision = git_head()?;
    if git_dirty() {
        eprintln!(
            "xtask: note: the work tree has uncommitted changes; the revision label names HEAD ({revision})"
        );
    }
    Ok(Prepared {
        root,
        rootfs,
        revision,
        stamp: timestamp()?,
    })
}

/// The `org.opencontainers.image.source` label when `--source` is not given: the git
/// remote `origin` when it is a URL (a clone of a local path has a path there, which names
/// nothing a reader of the image can reach). The image `cargo xtask test` builds takes the
/// same, so both are the same image.
pub(super) fn default_source() -> Option<String> {
    stdout_of(
        Command::new("git")
            .args(["remote", "get-url", "origin"])
            .current_dir(workspace()),
    )
    .ok()
    .filter(|s| s.contains("://") || s.starts_with("git@"))
}

/// Commits the prepared root filesystem, with the settings above and OCI labels, as
/// `reference` into containers-storage (podman's local storage). A previous image of the
/// same tag is removed when nothing else uses or names it.
///
/// Errors name the buildah or podman command that failed, with its message.
pub(super) fn commit(
    prep: Prepared,
    reference: &str,
    version: &str,
    source: Option<&str>,
) -> Result<Built> {
    let Prepared {
        root,
        rootfs,
        revision,
        stamp,
    } = prep;
    let name = format!("ebpf-proxy-image-{}", std::process::id());
    // buildah prints the container's name and the image's id on stdout even with --quiet;
    // stdout is this command's report, so they go nowhere.
    run(Command::new("buildah")
        .args(["from", "--quiet", "--name", &name, "scratch"])
        .stdout(Stdio::null()))
    .context(
        "buildah cannot create a working container (is this root, with containers-storage usable?)",
    )?;
    let ctr = WorkingContainer(name);
    run(Command::new("buildah")
        .args(["copy", "--quiet", "--chown", "0:0", &ctr.0])
        .arg(&root)
        .arg("/"))?;
    let json = |v: &[&str]| serde_json::to_string(v).expect("a list of strings serializes");
    let mut config = Command::new("buildah");
    config
        .arg("config")
        .args(["--user", USER])
        .args(["--entrypoint", &json(&ENTRYPOINT)])
        .args(["--cmd", &json(&CMD)])
        .args(["--env", &format!("PATH={PATH_ENV}")])
        .args(["--created-by", "cargo xtask image"])
        .args([
            "--label",
            &format!("org.opencontainers.image.title={TITLE}"),
        ])
        .args([
            "--label",
            &format!("org.opencontainers.image.version={version}"),
        ])
        .args([
            "--label",
            &format!("org.opencontainers.image.revision={revision}"),
        ])
        .args([
            "--label",
            &format!("org.opencontainers.image.description={DESCRIPTION}"),
        ]);
    if let Some(s) = source {
        config.args(["--label", &format!("org.opencontainers.image.source={s}")]);
    }
    run(config.arg(&ctr.0))?;

    let old = inspect(reference, "{{.Id}}").ok();
    // --identity-label=false: no io.buildah.version label, so the image does not change
    // with the buildah version. --timestamp: fixed created time and file mtimes.
    run(Command::new("buildah")
        .args([
            "commit",
            "--quiet",
            "--identity-label=false",
            "--timestamp",
            &stamp.to_string(),
            &ctr.0,
            reference,
        ])
        .stdout(Stdio::null()))?;
    drop(ctr);

    let id = inspect(reference, "{{.Id}}")?;
    if let Some(old) = old.filter(|o| *o != id) {
        // Fails, and leaves it, when another tag names it or a container uses it.
        let _ = Command::new("podman")
            .args(["rmi", &old])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
    Ok(Built {
        reference: reference.to_owned(),
        id: format!("sha256:{id}"),
        digest: inspect(reference, "{{.Digest}}")?,
        size: inspect(reference, "{{.Size}}")?
            .parse()
            .context("podman's image size is not a number")?,
        rootfs,
    })
}

fn inspect(reference: &str, format: &str) -> Result<String> {
    stdout_of(Command::new("podman").args(["image", "inspect", "--format", format, reference]))
}

/// The hard limit of `name` (e.g. "Max open files") in /proc/self/limits; None when
/// unlimited or not found.
pub(super) fn hard_limit(limits: &str, name: &str) -> Option<u64> {
    limits.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        rest.split_whitespace().nth(1)?.parse().ok()
    })
}

/// `podman run` of `program --version` in `reference`, the image's entrypoint replaced.
///
/// `--runtime runc`: crun refuses the hybrid cgroup v1/v2 layout ("cgroups in hybrid mode
/// not supported"). Explicit ulimits: podman otherwise raises RLIMIT_NOFILE and
/// RLIMIT_NPROC, which needs CAP_SYS_RESOURCE this process may not have; the values are
/// this process's hard limits (nproc at most 32768). `--network none`: nothing here needs
/// a network, and the root network namespace stays untouched.
pub(super) fn podman_version_run(reference: &str, program: &str) -> Command {
    let limits = fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let nofile = hard_limit(&limits, "Max open files").unwrap_or(1024);
    let nproc = hard_limit(&limits, "Max processes").map_or(32768, |n| n.min(32768));
    let mut c = Command::new("podman");
    c.args(["--runtime", "runc", "run", "--rm", "--pull", "never"])
        .args(["--network", "none"])
        .args(["--ulimit", &format!("nofile={nofile}:{nofile}")])
        .args(["--ulimit", &format!("nproc={nproc}:{nproc}")])
        .args(["--entrypoint", program, reference, "--version"]);
    c
}

/// Sizes of an OCI image layout written by `buildah push ... oci:DIR`.
pub(super) struct Pushed {
    /// Sum of the layers' blob sizes (gzip), in bytes.
    pub(super) compressed: u64,
    /// The manifest's digest in that layout, `sha256:...` (the gzip layers').
    pub(super) manifest_digest: String,
}

/// Reads index.json and the manifest of the one image in the OCI layout `dir`.
pub(super) fn read_layout(dir: &Path) -> Result<Pushed> {
    let read = |p: PathBuf| -> Result<serde_json::Value> {
        let text = fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))
    };
    let index = read(dir.join("index.json"))?;
    let digest = index["manifests"][0]["digest"]
        .as_str()
        .context("index.json names no manifest")?
        .to_owned();
    let hex = digest
        .strip_prefix("sha256:")
        .with_context(|| format!("unexpected digest {digest}"))?;
    let manifest = read(dir.join("blobs/sha256").join(hex))?;
    let layers = manifest["layers"]
        .as_array()
        .context("the manifest has no layers")?;
    let mut compressed = 0;
    for l in layers {
        compressed += l["size"].as_u64().context("a layer without a size")?;
    }
    Ok(Pushed {
        compressed,
        manifest_digest: digest,
    })
}

/// Writes the OCI layout `dir` as an OCI archive (a tar of the layout, the format of
/// `oci-archive:`), so the archive holds exactly the gzip layers that were measured.
pub(super) fn write_archive(dir: &Path, file: &Path) -> Result<()> {
    if let Some(parent) = file.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    let mut c = Command::new("tar");
    c.arg("--create")
        .arg("--file")
        .arg(file)
        .args(["--sort=name", "--owner=0", "--group=0", "--numeric-owner"])
        .args([
            "--mtime=@0",
            "--format=posix",
            "--pax-option=delete=atime,delete=ctime",
        ])
        .arg("-C")
        .arg(dir)
        .args(["oci-layout", "index.json", "blobs"]);
    run(&mut c)
}

pub(super) fn mb(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

/// Fails unless `tool` is installed, with the remedy.
pub(super) fn require(tool: &str) -> Result<()> {
    if find_tool(tool).is_none() {
        bail!(
            "{tool} is not installed: `cargo xtask setup` installs podman, buildah, skopeo and runc"
        );
    }
    Ok(())
}
