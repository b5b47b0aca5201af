//! `ebpf-proxy-bench` (run by `cargo xtask bench`): ebpf-proxy side by side with the rule sets
//! of kube-proxy's iptables and nftables modes, and with the direct path, on this machine.
//!
//! For each N (services with 10 endpoints each):
//! - control plane: ebpf-proxy from cold (manifests written, agent started on a fresh pin dir,
//!   until its first `sync done`), `iptables-restore` of kube-proxy's iptables rule set and
//!   `nft -f` of its nftables rule set; at some Ns, one endpoint change repeated (ebpf-proxy:
//!   file rename until the pinned maps show the new endpoint, and the agent's own account of
//!   it from its `sync done` line: `latency_us`, `model_us`, `duration_us`; peers: their
//!   incremental update);
//! - data path: new TCP connections per second and per-connection latency (connect, one
//!   request line, one reply line, close) from a client pod to one ClusterIP; for
//!   ebpf-proxy both at the socket and per packet (case `bypass`: a client pod labelled
//!   `ebpf-proxy.io/socket-lb: disabled`, with the agent in the lab's node namespace where
//!   the pod's veth has its node side);
//! - memory: agent RSS after the first sync (and, at some Ns, after its first periodic
//!   verification) and the memlock of its BPF maps;
//! - the control-plane targets, each met or missed (report/targets.rs).
//!
//! `ebpf-proxy-bench micro` (micro.rs) is apart: the cost of one packet in each packet
//! program through `BPF_PROG_TEST_RUN`, next to a minimal floor program and Katran's.
//!
//! Safety: everything runs in a lab of network namespaces (`epb-*`) and a child cgroup
//! (`ebpf-proxy-bench`) created here and removed on exit, panic or Ctrl-C; iptables and nft
//! run only inside the lab's client namespaces (setns before exec; a failed setns fails the
//! spawn); traffic goes only to lab addresses (198.18.0.0/15); every loop is bounded in count
//! and time. The agent's pins live in `/sys/fs/bpf/ebpf-proxy-bench` and are removed.

#[path = "bench/agent.rs"]
mod agent;
#[path = "bench/change_latency.rs"]
mod change_latency;
#[path = "bench/child.rs"]
mod child;
#[path = "bench/conn_rate.rs"]
mod conn_rate;
#[path = "bench/driver.rs"]
mod driver;
#[path = "bench/ebpf_run.rs"]
mod ebpf_run;
#[path = "bench/kube_proxy.rs"]
mod kube_proxy;
#[path = "bench/micro/mod.rs"]
mod micro;
#[path = "bench/northsouth.rs"]
mod northsouth;
#[path = "bench/progstats.rs"]
mod progstats;
#[path = "bench/report/mod.rs"]
mod report;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Result, bail};
use clap::{Parser, Subcommand};

use child::{ClientResult, client, serve};
use conn_rate::{load_client, run_client_in};
use driver::{PinGuard, at_least_one, bench, positive_secs, which};
use kube_proxy::apply_in_netns;

const PIN_DIR: &str = "ebpf-proxy-bench";
const CGROUP: &str = "ebpf-proxy-bench";
const LAB: &str = "epb";
/// The agent's `--sync-period`: how often it verifies the maps (its default).
const VERIFY_PERIOD: Duration = Duration::from_secs(30);

#[derive(Parser)]
#[command(
    name = "ebpf-proxy-bench",
    about = "ebpf-proxy vs kube-proxy's iptables and nftables rule sets"
)]
struct Cli {
    #[command(subcommand)]
    sub: Option<Sub>,
    #[command(flatten)]
    opts: Opts,
}

#[derive(clap::Args, Clone, Debug)]
struct Opts {
    /// Small run for development: N = 100,1000 (north-south: 100), one run, 10 changes at
    /// N=1000, 1 s / 2000 connections per data path case.
    #[arg(long)]
    quick: bool,
    /// Run one part only: `cluster-ip` (control plane, memory and the socket path to a
    /// ClusterIP), `north-south` (NodePorts from a client outside the cluster) or `micro`
    /// (each packet program alone, as `ebpf-proxy-bench micro` with its defaults).
    #[arg(long, value_parser = ["cluster-ip", "north-south", "micro"])]
    only: Option<String>,
    /// Katran's balancer object for the per-packet part's anchor (see `micro --help`).
    #[arg(long, value_name = "PATH")]
    katran_object: Option<PathBuf>,
    /// North-south: numbers of ClusterIP services (10 endpoints each) loaded next to the
    /// four NodePort services (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1000", value_parser = at_least_one)]
    ns_services: Vec<usize>,
    /// North-south: UDP requests per case and path (upper bound; `--conn-secs` bounds the
    /// time).
    #[arg(long, default_value_t = 2_000_000)]
    udp_count: usize,
    /// Numbers of services (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "100,1000,10000,30000", value_parser = at_least_one)]
    services: Vec<usize>,
    /// Repetitions of everything (medians and min-max are over these).
    #[arg(long, default_value_t = 3, value_parser = at_least_one)]
    runs: usize,
    /// Ns at which one endpoint change is measured (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1000,10000,30000")]
    change_at: Vec<usize>,
    /// Ns at which the agent is kept until its first periodic verification (every
    /// `--sync-period`, 30 s) has run, and its RSS is read again (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "10000,30000")]
    steady_at: Vec<usize>,
    /// Endpoint changes per run and case (p99 is over every change of every run).
    #[arg(long, default_value_t = 40)]
    changes: usize,
    /// Connections per data path case (upper bound).
    #[arg(long, default_value_t = 20000)]
    conn_count: usize,
    /// Seconds per data path case (upper bound).
    #[arg(long, default_value_t = 3.0, value_parser = positive_secs)]
    conn_secs: f64,
    /// Cases to run (ebpf, xdp, dsr, bypass, iptables, nftables, direct; xdp = ebpf-proxy
    /// with `--xdp native` and dsr = ebpf-proxy with `--north-south-mode dsr` on both nodes,
    /// in the north-south part only; bypass in the cluster-IP part only).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "ebpf,xdp,dsr,bypass,iptables,nftables,direct"
    )]
    cases: Vec<String>,
    /// Output directory.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
    /// The agent binary [default: `ebpf-proxy` next to this binary].
    #[arg(long)]
    agent: Option<PathBuf>,
    /// Extra arguments for the agent (repeatable), e.g. `--agent-arg=--log-level=debug` to see
    /// where its start-up time goes in `agent-cold-N.log`.
    #[arg(long, allow_hyphen_values = true)]
    agent_arg: Vec<String>,
    /// Timeout of the agent's first sync, seconds.
    #[arg(long, default_value_t = 600)]
    load_timeout: u64,
    /// Timeout of one cold `iptables-restore` / `nft -f`, seconds. A peer that times out at
    /// some N is recorded as such and not run again at that N or above.
    #[arg(long, default_value_t = 90)]
    peer_timeout: u64,
    /// The `iptables-restore` to run for kube-proxy's iptables rules (e.g.
    /// `iptables-legacy-restore` for the legacy backend).
    #[arg(long, default_value = "iptables-restore")]
    iptables_restore: String,
}

#[derive(Subcommand)]
enum Sub {
    /// Per-packet cost of each packet program (BPF_PROG_TEST_RUN, nothing attached), next to
    /// a minimal floor program and, with --katran-object, Katran's balancer (needs root;
    /// results in target/bench/micro.md and micro.json).
    Micro(micro::MicroOpts),
    /// (internal) Load client: sequential connections, one JSON line of results.
    #[command(hide = true)]
    Client {
        #[arg(long, value_delimiter = ',')]
        to: Vec<SocketAddr>,
        #[arg(long)]
        count: usize,
        #[arg(long)]
        secs: f64,
        #[arg(long, default_value_t = 200)]
        warmup: usize,
    },
    /// (internal) Server: answers one request line with NAME and waits for the close.
    #[command(hide = true)]
    Serve {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long)]
        name: String,
    },
    /// (internal) UDP load client: request/reply on one flow, one JSON line of results.
    #[command(hide = true)]
    UdpClient {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long)]
        count: usize,
        #[arg(long)]
        secs: f64,
        #[arg(long, default_value_t = 200)]
        warmup: usize,
    },
    /// (internal) UDP server: answers every datagram with NAME.
    #[command(hide = true)]
    ServeUdp {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long)]
        name: String,
    },
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn check_stop() -> Result<()> {
    if STOP.load(Ordering::SeqCst) {
        bail!("interrupted");
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.sub {
        Some(Sub::Client {
            to,
            count,
            secs,
            warmup,
        }) => client(&to, count, secs, warmup),
        Some(Sub::Serve { listen, name }) => serve(listen, &name),
        Some(Sub::UdpClient {
            to,
            count,
            secs,
            warmup,
        }) => northsouth::udp_client_main(to, count, secs, warmup),
        Some(Sub::ServeUdp { listen, name }) => northsouth::serve_udp(listen, &name),
        Some(Sub::Micro(opts)) => micro::micro(opts),
        None => {
            for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
                // SAFETY: the handler only stores to an atomic (async-signal-safe).
                unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
            }
            bench(cli.opts)
        }
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ebpf-proxy-bench: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
