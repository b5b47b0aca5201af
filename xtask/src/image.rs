//! The agent's container image: what it contains (the one list, below), how
//! `cargo xtask image` assembles it from scratch with buildah and loads it into podman's
//! storage, and how `cargo xtask test` builds it for the pod test.
//!
//! The image has no base image: it holds the agent (also under kube-proxy's path), the
//! libraries it links, the tools its own commands run (iptables in both backends and nft,
//! for `ebpf-proxy check` and for removing kube-proxy's rules) with their libraries and
//! extension modules, and a few files under /etc. Nothing else: no shell and no coreutils,
//! since every command the Helm chart runs in it (the agent, its `check` preflight in the
//! init container, the kube-proxy cleanup Job) is the agent itself. Every file is copied
//! from this machine (Debian): the tools at their own paths, the libraries at the paths
//! `ldd` finds them under, with the symbolic links met on the way (/lib -> usr/lib and the
//! like) recreated, so the image resolves every path the way the host does.
//!
//! The Containerfile describes the same image for places where registries are reachable:
//! its build stage runs `cargo xtask image-rootfs` (this module's [`write_rootfs`], which
//! also makes the agent's links) and its final stage copies that root filesystem, adds the
//! agent binary and the settings below, and runs the smoke test in exec form (the image has
//! no shell to run anything else); a unit test checks it against the constants here.

use std::collections::BTreeSet;
use std::env;
use std::fs;
use std::io::Write as _;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Component, Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::command::{run, show, stdout_of};
use crate::setup::find_tool;
use crate::{target_dir, workspace};

// ---------------------------------------------------------------------------------------
// contents
// ---------------------------------------------------------------------------------------

/// A symbolic link in the image: `path` (absolute) points at `target`, as written in the
/// link (relative to the link's directory unless it starts with `/`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Link {
    pub path: &'static str,
    pub target: &'static str,
}

const fn link(path: &'static str, target: &'static str) -> Link {
    Link { path, target }
}

/// Where the agent binary (`target/release/ebpf-proxy`) goes.
pub const AGENT: &str = "/usr/local/bin/ebpf-proxy";

/// Links to the agent. kube-proxy's DaemonSets (kubeadm's among others) run
/// `/usr/local/bin/kube-proxy` with kube-proxy's flags, and the agent accepts that command
/// line, so swapping the image is enough. [`write_rootfs`] makes them in both of its modes:
/// the Containerfile's final stage gets them with the root filesystem, as an image from
/// scratch has no `ln` to make them with.
pub const AGENT_LINKS: [Link; 1] = [link("/usr/local/bin/kube-proxy", "ebpf-proxy")];

/// Host files copied to the same path in the image, with the libraries `ldd` lists for them:
/// iptables in both backends (Debian's multi-call binaries, named by [`TOOL_LINKS`]) and nft.
/// The "kube-proxy rules" row of `ebpf-proxy check` runs `iptables-save`, `ip6tables-save`
/// and `nft list tables`; removing kube-proxy's rules runs `iptables-restore` and
/// `nft delete table`. The agent runs nothing else: it mounts bpffs itself
/// (`ebpf-proxy check --mount-bpffs`, with mount(2)), so the image needs no shell and no
/// `mount`.
pub const HOST_FILES: [&str; 3] = [
    "/usr/sbin/xtables-nft-multi",
    "/usr/sbin/xtables-legacy-multi",
    "/usr/sbin/nft",
];

/// The Debian packages [`HOST_FILES`] come from: the Containerfile's build stage installs
/// them, `cargo xtask setup` too.
pub const DEBIAN_PACKAGES: [&str; 2] = ["iptables", "nftables"];

/// The names iptables is run by, pointing where Debian's alternatives point by default: the
/// unsuffixed names are the nft backend (as on Debian since 10 and in kube-proxy's image),
/// `-legacy` names the legacy backend. The multi-call binaries choose by the name they were
/// run as, so a direct link behaves like Debian's chain through /etc/alternatives.
pub const TOOL_LINKS: [Link; 18] = [
    link("/usr/sbin/iptables", "xtables-nft-multi"),
    link("/usr/sbin/iptables-save", "xtables-nft-multi"),
    link("/usr/sbin/iptables-restore", "xtables-nft-multi"),
    link("/usr/sbin/ip6tables", "xtables-nft-multi"),
    link("/usr/sbin/ip6tables-save", "xtables-nft-multi"),
    link("/usr/sbin/ip6tables-restore", "xtables-nft-multi"),
    link("/usr/sbin/iptables-nft", "xtables-nft-multi"),
    link("/usr/sbin/iptables-nft-save", "xtables-nft-multi"),
    link("/usr/sbin/iptables-nft-restore", "xtables-nft-multi"),
    link("/usr/sbin/ip6tables-nft", "xtables-nft-multi"),
    link("/usr/sbin/ip6tables-nft-save", "xtables-nft-multi"),
    link("/usr/sbin/ip6tables-nft-restore", "xtables-nft-multi"),
    link("/usr/sbin/iptables-legacy", "xtables-legacy-multi"),
    link("/usr/sbin/iptables-legacy-save", "xtables-legacy-multi"),
    link("/usr/sbin/iptables-legacy-restore", "xtables-legacy-multi"),
    link("/usr/sbin/ip6tables-legacy", "xtables-legacy-multi"),
    link("/usr/sbin/ip6tables-legacy-save", "xtables-legacy-multi"),
    link("/usr/sbin/ip6tables-legacy-restore", "xtables-legacy-multi"),
];

/// The library whose directory holds the xtables extension modules (`<dir>/xtables/*.so`),
/// which iptables `dlopen`s by match and target name, so `ldd` cannot list them. Taking the
/// directory from where `ldd` finds this library resolves the multiarch directory
/// (`x86_64-linux-gnu`) without naming it.
const XTABLES_LIB: &str = "libxtables.so.";

/// Empty directories and their modes: /tmp for any tool's temporary files, /run for the
/// legacy backend's lock (/run/xtables.lock).
pub const DIRS: [(&str, u32); 2] = [("/tmp", 0o1777), ("/run", 0o755)];

/// Files written into the image: root's user and group, so tools that look up uid 0 find a
/// name. No nsswitch.conf: glibc reads /etc/passwd and /etc/group without one. Root's shell
/// is /sbin/nologin, as in distroless images: the image has no shell (neither file exists).
pub const ETC_FILES: [(&str, &str); 2] = [
    ("/etc/passwd", "root:x:0:0:root:/root:/sbin/nologin\n"),
    ("/etc/group", "root:x:0:\n"),
];

/// The image's user: root, because the agent needs CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN
/// and CAP_PERFMON, and Kubernetes grants capabilities to a non-root user only through
/// file capabilities or ambient sets, which it does not manage.
pub const USER: &str = "0:0";
/// The image's entrypoint (exec form).
pub const ENTRYPOINT: [&str; 1] = [AGENT];
/// The image's default arguments: the agent.
pub const CMD: [&str; 1] = ["run"];
/// PATH in the image's environment. An image from scratch has none, and without one the
/// agent's lookups of `iptables-save` and `nft` would search only glibc's default
/// `/bin:/usr/bin`.
pub const PATH_ENV: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// `org.opencontainers.image.title`.
pub const TITLE: &str = "ebpf-proxy";
/// `org.opencontainers.image.description`.
pub const DESCRIPTION: &str = "ebpf-proxy, a kube-proxy replacement: eBPF programs \
    translate Service addresses at the socket and on the packet path, an agent programs \
    them from the Kubernetes API";

/// The image's programs that the smoke test runs with `--version`, each as the entrypoint
/// of its own container (the Containerfile: each in an exec-form RUN): the agent under both
/// names and the tools of `check`.
pub const SMOKE: [&str; 6] = [
    AGENT,
    "/usr/local/bin/kube-proxy",
    "/usr/sbin/iptables-save",
    "/usr/sbin/ip6tables-save",
    "/usr/sbin/iptables-legacy-save",
    "/usr/sbin/nft",
];

// ---------------------------------------------------------------------------------------
// the root filesystem
// ---------------------------------------------------------------------------------------

/// What [`write_rootfs`] wrote: counts and the bytes of regular files.
#[derive(Debug, Default)]
pub struct RootfsSummary {
    pub files: usize,
    pub links: usize,
    pub dirs: usize,
    /// Sum of the regular files' sizes, in bytes.
    pub bytes: u64,
}

/// Whether the agent binary goes into the root filesystem. Its libraries and
/// [`AGENT_LINKS`] always do.
pub enum Agent<'a> {
    /// The agent binary at `path`, copied to [`AGENT`] (`cargo xtask image`).
    Include(&'a Path),
    /// All but the agent binary at `path` (its libraries, its links, left dangling until
    /// it arrives): the Containerfile's final stage copies the binary
    /// (`cargo xtask image-rootfs`).
    AllButBinary(&'a Path),
}

/// Writes the image's files into `root`, which must not exist or be empty (it is created):
/// [`HOST_FILES`] and the libraries `ldd` lists for them, for the xtables modules and for the
/// agent; the xtables modules; [`TOOL_LINKS`]; [`AGENT_LINKS`]; [`DIRS`]; [`ETC_FILES`]; and
/// the agent binary as `agent` says.
///
/// Errors name the file that is missing (install [`DEBIAN_PACKAGES`], or run
/// `cargo xtask build` for the agent), a library `ldd` cannot find, or the path that could
/// not be written.
pub fn write_rootfs(root: &Path, agent: Agent<'_>) -> Result<RootfsSummary> {
    if root.exists() && fs::read_dir(root)?.next().is_some() {
        bail!("{} is not empty; remove it first", root.display());
    }
    fs::create_dir_all(root).with_context(|| format!("creating {}", root.display()))?;
    let agent_bin = match agent {
        Agent::Include(p) | Agent::AllButBinary(p) => p,
    };
    if !agent_bin.is_file() {
        bail!(
            "the agent binary {} is missing (run `cargo xtask build`)",
            agent_bin.display()
        );
    }
    for f in HOST_FILES {
        if fs::metadata(f).is_err() {
            bail!(
                "{f} is missing on this machine: install the Debian packages {} \
                 (`cargo xtask setup` does)",
                DEBIAN_PACKAGES.join(" ")
            );
        }
    }

    // Libraries of the programs first: the xtables modules' directory is found from them.
    let mut elf: Vec<PathBuf> = HOST_FILES.iter().map(PathBuf::from).collect();
    elf.push(agent_bin.to_owned());
    let mut libs = ldd(&elf)?;
    let xtables_dir = libs
        .iter()
        .find(|l| {
            l.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(XTABLES_LIB))
        })
        .and_then(|l| l.parent())
        .map(|d| d.join("xtables"))
        .context("ldd lists no libxtables.so.* for the iptables binaries")?;
    let modules: Vec<PathBuf> = fs::read_dir(&xtables_dir)
        .with_context(|| {
            format!(
                "reading the xtables modules' directory {}",
                xtables_dir.display()
            )
        })?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    let modules: Vec<PathBuf> = modules
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "so"))
        .collect();
    if modules.is_empty() {
        bail!("no xtables modules (*.so) in {}", xtables_dir.display());
    }
    // A module is a regular file or a link to one in the same directory; ldd reads both.
    libs.extend(ldd(&modules)?);

    let mut copied = BTreeSet::new();
    let mut sum = RootfsSummary::default();
    let paths = HOST_FILES
        .iter()
        .map(PathBuf::from)
        .chain(modules)
        .chain(libs);
    for p in paths {
        mirror(root, &p, &mut copied, &mut sum)?;
    }
    for l in TOOL_LINKS {
        make_link(root, l, &mut sum)?;
    }
    if let Agent::Include(bin) = agent {
        let dest = inside(root, Path::new(AGENT));
        create_dirs(root, dest.parent().expect("AGENT is a file path"), &mut sum)?;
        copy_file(bin, &dest, &mut sum)?;
    }
    // Both modes: a stage from scratch has no `ln`, so the Containerfile gets the links here.
    for l in AGENT_LINKS {
        make_link(root, l, &mut sum)?;
    }
    for (d, mode) in DIRS {
        let dest = inside(root, Path::new(d));
        create_dirs(root, &dest, &mut sum)?;
        fs::set_permissions(&dest, fs::Permissions::from_mode(mode))
            .with_context(|| format!("chmod {mode:o} {}", dest.display()))?;
    }
    for (f, text) in ETC_FILES {
        let dest = inside(root, Path::new(f));
        create_dirs(root, dest.parent().expect("a file path"), &mut sum)?;
        fs::write(&dest, text).with_context(|| format!("writing {}", dest.display()))?;
        fs::set_permissions(&dest, fs::Permissions::from_mode(0o644))?;
        sum.files += 1;
        sum.bytes += text.len() as u64;
    }
    Ok(sum)
}

/// The path of the absolute image path `p` inside `root`.
fn inside(root: &Path, p: &Path) -> PathBuf {
    root.join(p.strip_prefix("/").unwrap_or(p))
}

/// Creates `dir` (inside `root`) and its missing parents with mode 0755.
fn create_dirs(root: &Path, dir: &Path, sum: &mut RootfsSummary) -> Result<()> {
    let mut missing = Vec::new();
    let mut d = dir;
    while d != root && !d.exists() {
        missing.push(d);
        d = d.parent().context("a directory outside the root")?;
    }
    for d in missing.into_iter().rev() {
        fs::create_dir(d).with_context(|| format!("creating {}", d.display()))?;
        fs::set_permissions(d, fs::Permissions::from_mode(0o755))?;
        sum.dirs += 1;
    }
    Ok(())
}

/// Copies a regular file without its set-user-ID and set-group-ID bits: in the image
/// everything runs as root, so they would only draw scanners' notice.
fn copy_file(src: &Path, dest: &Path, sum: &mut RootfsSummary) -> Result<()> {
    fs::copy(src, dest)
        .with_context(|| format!("copying {} to {}", src.display(), dest.display()))?;
    let mode = fs::metadata(src)?.permissions().mode() & 0o777;
    fs::set_permissions(dest, fs::Permissions::from_mode(mode))?;
    sum.files += 1;
    sum.bytes += fs::metadata(dest)?.len();
    Ok(())
}

fn make_link(root: &Path, l: Link, sum: &mut RootfsSummary) -> Result<()> {
    let dest = inside(root, Path::new(l.path));
    create_dirs(root, dest.parent().expect("a link path"), sum)?;
    symlink(l.target, &dest)
        .with_context(|| format!("linking {} -> {}", dest.display(), l.target))?;
    sum.links += 1;
    Ok(())
}

/// Copies the host path `path` into `root` at the same path. A symbolic link met on the way,
/// a directory such as `/lib -> usr/lib` or the file itself, is recreated as it is and
/// followed, so the image resolves `path` exactly as the host does. `done` holds the host
/// paths already handled.
fn mirror(
    root: &Path,
    path: &Path,
    done: &mut BTreeSet<PathBuf>,
    sum: &mut RootfsSummary,
) -> Result<()> {
    let mut todo = path.to_owned();
    // Linux gives up after 40 links in one lookup; so does this.
    for _ in 0..40 {
        match mirror_step(root, &todo, done, sum)? {
            None => return Ok(()),
            Some(next) => todo = next,
        }
    }
    bail!("too many levels of symbolic links in {}", path.display())
}

/// Walks `path` component by component from `/`, creating directories in `root` and
/// copying the final file. Returns the path to continue with when a component is a
/// symbolic link (after recreating it), None when the file has been copied.
fn mirror_step(
    root: &Path,
    path: &Path,
    done: &mut BTreeSet<PathBuf>,
    sum: &mut RootfsSummary,
) -> Result<Option<PathBuf>> {
    let comps: Vec<Component> = path.components().collect();
    let mut host = PathBuf::from("/");
    for (i, c) in comps.iter().enumerate() {
        match c {
            Component::RootDir | Component::CurDir => continue,
            Component::ParentDir => {
                host.pop();
                continue;
            }
            Component::Prefix(_) => bail!("not a Unix path: {}", path.display()),
            Component::Normal(n) => host.push(n),
        }
        let rest: PathBuf = comps[i + 1..].iter().collect();
        let meta = fs::symlink_metadata(&host)
            .with_context(|| format!("{} (for {})", host.display(), path.display()))?;
        let dest = inside(root, &host);
        if meta.file_type().is_symlink() {
            let target = fs::read_link(&host)?;
            if done.insert(host.clone()) {
                symlink(&target, &dest).with_context(|| {
                    format!("linking {} -> {}", dest.display(), target.display())
                })?;
                sum.links += 1;
            }
            let base = host.parent().expect("a link has a parent").to_owned();
            return Ok(Some(base.join(target).join(rest)));
        }
        if meta.is_dir() {
            if done.insert(host.clone()) {
                fs::create_dir(&dest).with_context(|| format!("creating {}", dest.display()))?;
                fs::set_permissions(&dest, fs::Permissions::from_mode(0o755))?;
                sum.dirs += 1;
            }
        } else if meta.is_file() && rest.as_os_str().is_empty() {
            if done.insert(host.clone()) {
                copy_file(&host, &dest, sum)?;
            }
            return Ok(None);
        } else {
            bail!(
                "{} (for {}) is neither a directory, a regular file nor a link",
                host.display(),
                path.display()
            );
        }
    }
    // The path named a directory: nothing more to copy.
    Ok(None)
}

/// The libraries (and the dynamic loader) `ldd` lists for `files`, as the absolute paths it
/// prints. Fails when a library is not found.
fn ldd(files: &[PathBuf]) -> Result<BTreeSet<PathBuf>> {
    let mut c = Command::new("ldd");
    c.args(files);
    let out = c
        .output()
        .context("running ldd (Debian package libc-bin)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "{} failed: {}{}",
            show(&c),
            text.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    parse_ldd(&text)
}

/// Paths in `ldd`'s output: `name => /path (0x...)` and `/path (0x...)` (the loader), for one
/// file or several (then each file's list follows a `file:` line). `linux-vdso.so.1` has no
/// path and is skipped; `name => not found` is an error.
fn parse_ldd(text: &str) -> Result<BTreeSet<PathBuf>> {
    let mut out = BTreeSet::new();
    let mut file = "";
    for line in text.lines() {
        if !line.starts_with(char::is_whitespace) {
            file = line.trim_end_matches(':');
            continue;
        }
        let line = line.trim();
        let lib = match line.split_once(" => ") {
            Some((name, rest)) => {
                if rest.starts_with("not found") {
                    bail!("ldd: {name} (needed by {file}) not found");
                }
                rest
            }
            None => line,
        };
        let path = lib.split(" (").next().unwrap_or("");
        if path.starts_with('/') {
            out.insert(PathBuf::from(path));
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// building, measuring and checking the image
// ---------------------------------------------------------------------------------------

/// `cargo xtask image`'s options.
pub struct Options {
    /// The reference to tag; `localhost/ebpf-proxy:<agent version>` when None.
    pub tag: Option<String>,
    /// Where to also write the image as an OCI archive.
    pub save: Option<PathBuf>,
    /// `org.opencontainers.image.source`; `git remote get-url origin` when None.
    pub source: Option<String>,
    /// When the command started (before setup and the build), for the total time.
    pub started: Instant,
}

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

fn agent_bin() -> PathBuf {
    target_dir().join("release/ebpf-proxy")
}

fn image_dir() -> PathBuf {
    target_dir().join("image")
}

/// The agent's version from `ebpf-proxy --version` (`ebpf-proxy 0.1.0`): the image carries
/// that binary, so its version is the image's.
fn agent_version(bin: &Path) -> Result<String> {
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
struct Prepared {
    root: PathBuf,
    rootfs: RootfsSummary,
    /// `git rev-parse HEAD`.
    revision: String,
    /// Seconds since the epoch, see [`timestamp`].
    stamp: u64,
}

/// Writes the root filesystem into target/image/rootfs (replacing an earlier one).
/// Errors name the missing file or library, or the git command that failed.
fn prepare() -> Result<Prepared> {
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

/// Commits the prepared root filesystem, with the settings above and OCI labels, as
/// `reference` into containers-storage (podman's local storage). A previous image of the
/// same tag is removed when nothing else uses or names it.
///
/// Errors name the buildah or podman command that failed, with its message.
/// The `org.opencontainers.image.source` label when `--source` is not given: the git
/// remote `origin` when it is a URL (a clone of a local path has a path there, which names
/// nothing a reader of the image can reach). The image `cargo xtask test` builds takes the
/// same, so both are the same image.
fn default_source() -> Option<String> {
    stdout_of(
        Command::new("git")
            .args(["remote", "get-url", "origin"])
            .current_dir(workspace()),
    )
    .ok()
    .filter(|s| s.contains("://") || s.starts_with("git@"))
}

fn commit(prep: Prepared, reference: &str, version: &str, source: Option<&str>) -> Result<Built> {
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
fn hard_limit(limits: &str, name: &str) -> Option<u64> {
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
fn podman_version_run(reference: &str, program: &str) -> Command {
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
struct Pushed {
    /// Sum of the layers' blob sizes (gzip), in bytes.
    compressed: u64,
    /// The manifest's digest in that layout, `sha256:...` (the gzip layers').
    manifest_digest: String,
}

/// Reads index.json and the manifest of the one image in the OCI layout `dir`.
fn read_layout(dir: &Path) -> Result<Pushed> {
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
fn write_archive(dir: &Path, file: &Path) -> Result<()> {
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

fn mb(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

/// Fails unless `tool` is installed, with the remedy.
fn require(tool: &str) -> Result<()> {
    if find_tool(tool).is_none() {
        bail!(
            "{tool} is not installed: `cargo xtask setup` installs podman, buildah, skopeo and runc"
        );
    }
    Ok(())
}

/// `cargo xtask image`: builds the image from target/release/ebpf-proxy (already built),
/// loads it into podman's storage, pushes it to target/image/oci (gzip) to measure it,
/// writes the OCI archive when asked, runs [`SMOKE`] in it, and prints the reference,
/// digest, sizes and times. Errors name the failed step.
pub fn image(opts: &Options) -> Result<()> {
    let t0 = Instant::now();
    for tool in ["buildah", "podman", "runc"] {
        require(tool)?;
    }
    let version = agent_version(&agent_bin())?;
    let reference = opts
        .tag
        .clone()
        .unwrap_or_else(|| format!("localhost/ebpf-proxy:{version}"));
    let source = opts.source.clone().or_else(default_source);
    if source.is_none() {
        eprintln!(
            "xtask: note: no git remote `origin` and no --source URL: the image has no \
             org.opencontainers.image.source label"
        );
    }
    let built = commit(prepare()?, &reference, &version, source.as_deref())?;
    let t_build = t0.elapsed();

    // The compressed size: what a registry or an archive carries. containers-storage keeps
    // layers uncompressed, so push a copy to an OCI layout with gzip layers and add up the
    // layer sizes its manifest records.
    let t1 = Instant::now();
    let layout = image_dir().join("oci");
    if layout.exists() {
        fs::remove_dir_all(&layout)?;
    }
    let dest = format!("oci:{}:{reference}", layout.display());
    run(Command::new("buildah").args([
        "push",
        "--quiet",
        "--compression-format",
        "gzip",
        &reference,
        &dest,
    ]))?;
    let pushed = read_layout(&layout)?;
    if let Some(file) = &opts.save {
        write_archive(&layout, file)?;
    }
    let t_measure = t1.elapsed();

    let t2 = Instant::now();
    let mut versions = Vec::new();
    for program in SMOKE {
        let out = stdout_of(&mut podman_version_run(&reference, program))
            .with_context(|| format!("smoke test: {program} --version in {reference}"))?;
        versions.push((program, out.lines().next().unwrap_or("").to_owned()));
    }
    let t_smoke = t2.elapsed();

    let mut o = std::io::stdout().lock();
    let r = &built.rootfs;
    writeln!(o, "image        {}", built.reference)?;
    writeln!(
        o,
        "digest       {} (manifest in containers-storage)",
        built.digest
    )?;
    writeln!(o, "id           {}", built.id)?;
    writeln!(
        o,
        "compressed   {} ({} bytes: gzip layers of `buildah push` to {}, manifest {})",
        mb(pushed.compressed),
        pushed.compressed,
        layout.display(),
        pushed.manifest_digest
    )?;
    writeln!(
        o,
        "uncompressed {} ({} bytes: podman image inspect .Size; {} files, {} links, {} directories)",
        mb(built.size),
        built.size,
        r.files,
        r.links,
        r.dirs
    )?;
    if let Some(file) = &opts.save {
        writeln!(
            o,
            "archive      {} (oci-archive, {} bytes)",
            file.display(),
            fs::metadata(file)?.len()
        )?;
    }
    for (program, v) in versions {
        writeln!(o, "smoke        {program} --version: {v}")?;
    }
    writeln!(
        o,
        "time         {:.1?} in all: setup check and build {:.1?}, image {:.1?} (assemble and \
         commit {:.1?}, push and measure {:.1?}, smoke {:.1?})",
        opts.started.elapsed(),
        t0.duration_since(opts.started),
        t0.elapsed(),
        t_build,
        t_measure,
        t_smoke
    )?;
    Ok(())
}

/// For `cargo xtask test`: builds the image and checks podman can run it (one
/// `ebpf-proxy --version`). Returns its reference, or None after printing one line with the
/// reason when podman, buildah or runc are missing or cannot run here. `$EBPF_PROXY_IMAGE`,
/// when already set, is returned as is and nothing is built.
///
/// Errors only for failures that are not about the container tools (writing the root
/// filesystem: a missing tool file or library).
pub fn for_tests() -> Result<Option<String>> {
    if let Ok(r) = env::var("EBPF_PROXY_IMAGE") {
        eprintln!("xtask: EBPF_PROXY_IMAGE={r} (from the environment; no image built)");
        return Ok(Some(r));
    }
    let t = Instant::now();
    for tool in ["buildah", "podman", "runc"] {
        if find_tool(tool).is_none() {
            eprintln!(
                "xtask: EBPF_PROXY_IMAGE not set: {tool} is not installed (`cargo xtask setup` installs it)"
            );
            return Ok(None);
        }
    }
    let version = agent_version(&agent_bin())?;
    let reference = format!("localhost/ebpf-proxy:{version}");
    let prep = prepare()?;
    let built = match commit(prep, &reference, &version, default_source().as_deref()) {
        Ok(b) => b,
        Err(e) => {
            eprintln!(
                "xtask: EBPF_PROXY_IMAGE not set: buildah or podman failed: {}",
                one_line(&e)
            );
            return Ok(None);
        }
    };
    let mut probe = podman_version_run(&built.reference, AGENT);
    match stdout_of(&mut probe) {
        Ok(_) => {
            eprintln!(
                "xtask: EBPF_PROXY_IMAGE={} ({}; built and probed in {:.1?})",
                built.reference,
                built.digest,
                t.elapsed()
            );
            Ok(Some(built.reference))
        }
        Err(e) => {
            eprintln!(
                "xtask: EBPF_PROXY_IMAGE not set: podman cannot run the image here: {}",
                one_line(&e)
            );
            Ok(None)
        }
    }
}

fn one_line(e: &anyhow::Error) -> String {
    format!("{e:#}").replace('\n', " ")
}

/// `cargo xtask image-rootfs DIR --libraries-of BIN`: the Containerfile's build stage writes
/// the image's files, all but the agent binary (its libraries and links included), with
/// this.
pub fn image_rootfs(dir: &Path, agent: &Path) -> Result<()> {
    let sum = write_rootfs(dir, Agent::AllButBinary(agent))?;
    eprintln!(
        "xtask: wrote {} ({} files, {} links, {} directories, {})",
        dir.display(),
        sum.files,
        sum.links,
        sum.dirs,
        mb(sum.bytes)
    );
    Ok(())
}

#[cfg(test)]
mod tests;
