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

mod build;
mod rootfs;

use std::env;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result};

use crate::command::{run, stdout_of};
use crate::setup::find_tool;

use build::{
    agent_bin, agent_version, commit, default_source, image_dir, mb, podman_version_run, prepare,
    read_layout, require, write_archive,
};
use rootfs::{Agent, write_rootfs};

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
