//! `cargo xtask build-ebpf`, `build`, `test`, `demo`, `bench` and `fuzz`.

use std::env;
use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::command::{clean_cargo, host_cargo, run, succeeds};
use crate::setup::{apt_install, doing, done, find_tool, has_nightly, is_root, tools_path};
use crate::{target_dir, workspace};

/// Target of the eBPF crate.
const BPF_TARGET: &str = "bpfel-unknown-none";

pub(crate) fn build_ebpf() -> Result<()> {
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
        // bpf-linker's default in-order memcpy expansion makes LLVM emit every memset as a
        // call to aya-ebpf's byte loop; `--disable-expand-memcpy-in-order` would write them
        // out inline, but it grows the new-flow call chain past the 512-byte stack with
        // kernel logs at trace (docs/src/benchmarks-micro.md), so the default stays.
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

pub(crate) fn build() -> Result<()> {
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

/// `cargo doc --no-deps --workspace` with rustdoc's warnings as errors
/// (`RUSTDOCFLAGS="-D warnings"`), so a broken intra-doc link, a public item's doc that
/// links a crate-private item, or stray HTML in a doc comment fails the run; then the same
/// for the eBPF crate (its own workspace: nightly, `-Z build-std=core` for the BPF target,
/// as `build_ebpf` builds it). The API docs go to target/doc/ and
/// target/bpfel-unknown-none/doc/.
pub(crate) fn api_docs() -> Result<()> {
    let t = Instant::now();
    run(host_cargo()
        .args(["doc", "--no-deps", "--workspace"])
        .env("RUSTDOCFLAGS", "-D warnings"))?;
    let mut c = clean_cargo(Some("nightly"));
    c.current_dir(workspace().join("proxy-ebpf"))
        .args([
            "doc",
            "--no-deps",
            "-Z",
            "build-std=core",
            "--target",
            BPF_TARGET,
        ])
        .env("CARGO_TARGET_DIR", target_dir())
        .env("RUSTDOCFLAGS", "-D warnings");
    run(&mut c)?;
    eprintln!(
        "xtask: API docs built without warnings ({:.1?})",
        t.elapsed()
    );
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
pub(crate) fn test(extra: &[String], image: Option<&str>) -> Result<()> {
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

pub(crate) fn demo() -> Result<()> {
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

pub(crate) fn bench_setup() -> Result<()> {
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

/// `cargo xtask bench micro`: the bench binary alone (the agent's object is embedded in
/// it through proxy-userspace; the floor's is read from target/), run as `micro`.
pub(crate) fn bench_micro(args: &[String]) -> Result<()> {
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

pub(crate) fn bench(args: &[String]) -> Result<()> {
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

/// The cargo-fuzz targets in fuzz/.
const FUZZ_TARGETS: [&str; 2] = ["manifests", "model"];

pub(crate) fn fuzz(target: Option<&str>, seconds: u64) -> Result<()> {
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
}
