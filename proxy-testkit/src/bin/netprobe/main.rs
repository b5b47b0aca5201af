//! netprobe: test and demo helper for ebpf-proxy (not shipped in the image).
//!
//! - `netprobe serve`: servers that answer with their name (HTTP, TCP, UDP).
//! - `netprobe tcp` / `netprobe udp`: clients that print, per attempt, one JSON line with
//!   what the kernel reported (peer address from getpeername, source of a reply, errno).
//!   Exit status 0 when every attempt succeeded, 1 otherwise (the JSON lines are printed
//!   either way).
//! - `netprobe demo`: the end-to-end demo run by `cargo xtask demo`.
//!
//! Every client loop is bounded by `--count` and every wait by a timeout.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

mod client;
mod demo;
mod serve;
mod sidecar;

use client::{TcpProbe, tcp_interactive, tcp_probe, udp_probe};
use serve::serve;
use sidecar::sidecar;

#[derive(Parser)]
#[command(name = "netprobe", about = "Test and demo helper for ebpf-proxy")]
struct Cli {
    /// Run on this CPU only (per-CPU state in the data path, such as round-robin cursors,
    /// is then observed without migrations between CPUs).
    #[arg(long, global = true)]
    cpu: Option<usize>,
    #[command(subcommand)]
    cmd: Cmd,
}

/// Pins the calling process to `cpu`.
fn pin_to_cpu(cpu: usize) -> io::Result<()> {
    // SAFETY: `set` is a plain bitmask owned by this frame; the kernel only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve NAME over HTTP, TCP and UDP until killed.
    Serve {
        /// Name sent back to every client.
        #[arg(long)]
        name: String,
        /// HTTP listen address (`ADDR:PORT`, or `:PORT` for all addresses); every GET gets `NAME\n`.
        #[arg(long)]
        http: Vec<String>,
        /// TCP listen address: sends `NAME\n` on accept, answers each line `L` with `NAME L\n`.
        #[arg(long)]
        tcp: Vec<String>,
        /// UDP listen address: answers every datagram with `NAME` to its source.
        #[arg(long)]
        udp: Vec<String>,
    },
    /// Connect over TCP, read the server's name; one JSON line per attempt.
    Tcp {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long, default_value_t = 1)]
        count: u32,
        #[arg(long, default_value_t = 2000)]
        timeout_ms: u64,
        /// Keep each connection open this long before closing it.
        #[arg(long, default_value_t = 0)]
        hold_ms: u64,
        /// Pause between attempts.
        #[arg(long, default_value_t = 0)]
        interval_ms: u64,
        /// Keep every connection open until the last attempt is done (then `--hold-ms`
        /// more), so they are open together: the least-load algorithms count them all.
        #[arg(long)]
        keep_open: bool,
        /// Connect once, then send each stdin line and print the reply as JSON (the line
        /// `!peer` prints the connection's getpeername() instead).
        #[arg(long)]
        interactive: bool,
        /// Source address to bind before connecting; repeated, attempt i uses the
        /// (i mod n)-th (many clients from one pod).
        #[arg(long)]
        bind: Vec<std::net::IpAddr>,
        /// After the name, ask the server who it sees connecting (`whoami`) and report it
        /// as `seen_as` (shows whether a proxy kept or masqueraded the client address).
        #[arg(long)]
        whoami: bool,
        /// connect() in blocking mode (no timeout): a refused connect then fails inside
        /// the syscall, which resets the socket's peer before it is closed.
        #[arg(long)]
        blocking: bool,
    },
    /// Send UDP datagrams from one socket and wait for each reply; one JSON line per attempt.
    Udp {
        /// Destination; repeated, attempt i sends to the (i mod n)-th (one socket talking
        /// to several addresses, one family). With --connected only the first is used.
        #[arg(long, required = true)]
        to: Vec<SocketAddr>,
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// connect() the socket and use send(); otherwise sendto() on the same socket.
        #[arg(long)]
        connected: bool,
        #[arg(long, default_value_t = 0)]
        interval_ms: u64,
        #[arg(long, default_value_t = 1000)]
        timeout_ms: u64,
        /// With --connected: when a send fails, connect() the socket to --to again (what an
        /// application does to recover a socket whose endpoint went away) and retry once.
        #[arg(long)]
        reconnect: bool,
        /// With --connected: after the first datagram, dissolve the connection
        /// (`connect(AF_UNSPEC)`) and send the others with sendto(), attempt i to the
        /// (i mod n)-th --to.
        #[arg(long)]
        then_disconnect: bool,
    },
    /// A sidecar proxy as a service mesh runs one: accepts the TCP connections an iptables
    /// `REDIRECT` sends to `--listen`, reads each one's original destination
    /// (`SO_ORIGINAL_DST`), prints it as JSON (`original_dst`), connects onward to it with
    /// `SO_MARK` `--mark` (which the REDIRECT rule must exclude) and relays both ways.
    Sidecar {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long, default_value_t = 1337)]
        mark: u32,
        /// Exit after this many connections ended.
        #[arg(long, default_value_t = 1)]
        count: u32,
    },
    /// Run the end-to-end demo (needs root): a lab of pod namespaces, the agent, traffic.
    Demo {
        /// The ebpf-proxy agent binary.
        #[arg(long, default_value = "target/release/ebpf-proxy")]
        agent: PathBuf,
        /// Directory with the demo manifests (demo.yaml, dns.yaml).
        #[arg(long, default_value = "deploy/examples")]
        manifests: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(cpu) = cli.cpu
        && let Err(e) = pin_to_cpu(cpu)
    {
        eprintln!("netprobe: pin to CPU {cpu}: {e}");
        return ExitCode::FAILURE;
    }
    let r = match cli.cmd {
        Cmd::Serve {
            name,
            http,
            tcp,
            udp,
        } => serve(name, http, tcp, udp),
        Cmd::Tcp {
            to,
            count,
            timeout_ms,
            hold_ms,
            interval_ms,
            keep_open,
            interactive,
            bind,
            whoami,
            blocking,
        } => {
            let t = Duration::from_millis(timeout_ms);
            if interactive {
                tcp_interactive(to, t)
            } else {
                tcp_probe(&TcpProbe {
                    to,
                    count,
                    timeout: t,
                    hold: Duration::from_millis(hold_ms),
                    interval: Duration::from_millis(interval_ms),
                    keep_open,
                    bind,
                    whoami,
                    blocking,
                })
            }
        }
        Cmd::Udp {
            to,
            count,
            connected,
            interval_ms,
            timeout_ms,
            reconnect,
            then_disconnect,
        } => udp_probe(
            to,
            count,
            (connected, then_disconnect),
            reconnect,
            Duration::from_millis(interval_ms),
            Duration::from_millis(timeout_ms),
        ),
        Cmd::Sidecar {
            listen,
            mark,
            count,
        } => sidecar(listen, mark, count).map(|()| true),
        Cmd::Demo { agent, manifests } => demo::run(&agent, &manifests).map(|()| true),
    };
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("netprobe: error: {e:#}");
            ExitCode::from(2)
        }
    }
}
