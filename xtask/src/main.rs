//! Developer tasks for ebpf-proxy:
//! `cargo xtask <setup|build-ebpf|build|image|test|demo|bench|fuzz>`.
//!
//! Every command first runs `setup` when one of its cheap checks fails, so a fresh Debian
//! machine (as root) needs nothing but `cargo xtask test` or `cargo xtask demo`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};

mod command;
mod guide;
mod image;
mod setup;
mod tasks;

use setup::{setup, setup_if_needed};
use tasks::{api_docs, bench, bench_micro, bench_setup, build, build_ebpf, demo, fuzz, test};

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
        /// Image reference; default `localhost/ebpf-proxy:<crate version>`.
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
    /// Set up if needed, build the guide (docs/) and check its links, build the API docs
    /// with rustdoc's warnings as errors, build, build the image when podman can run it (its
    /// reference in $EBPF_PROXY_IMAGE), run every test single-threaded (needs root).
    Test {
        /// Extra arguments for the test binaries (after `--`), e.g. a test name filter.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Set up if needed, build, run the end-to-end demo (needs root).
    Demo,
    /// Set up if needed (plus iptables, nftables, fonts), build the agent and the bench
    /// (proxy-testkit's `bench` feature), run the benchmarks against kube-proxy's rule sets
    /// (needs root; results in target/bench/); the per-packet micro-benchmark last. `bench
    /// micro`: the per-packet micro-benchmark only.
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
            .and_then(|()| api_docs())
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
