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

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream, ToSocketAddrs, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use clap::{Parser, Subcommand};
use proxy_testkit::testbed::{self, ChildGuard, Lab, Pod, TestCgroup};
use serde_json::{Value, json};

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

// ---------------------------------------------------------------------------------------
// serve
// ---------------------------------------------------------------------------------------

/// `:PORT` means every address: `[::]:PORT` (dual-stack), or `0.0.0.0:PORT` where IPv6 is off.
fn listen_addrs(spec: &str) -> Result<Vec<SocketAddr>> {
    if let Some(port) = spec.strip_prefix(':') {
        let port: u16 = port
            .parse()
            .with_context(|| format!("bad port in {spec:?}"))?;
        return Ok(vec![
            SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port)),
            SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)),
        ]);
    }
    Ok(spec
        .to_socket_addrs()
        .with_context(|| format!("bad address {spec:?}"))?
        .collect())
}

async fn bind_tcp(spec: &str) -> Result<tokio::net::TcpListener> {
    let mut last = None;
    for a in listen_addrs(spec)? {
        match tokio::net::TcpListener::bind(a).await {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(anyhow!("binding TCP {spec}: {:?}", last))
}

async fn bind_udp(spec: &str) -> Result<tokio::net::UdpSocket> {
    let mut last = None;
    for a in listen_addrs(spec)? {
        match tokio::net::UdpSocket::bind(a).await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(anyhow!("binding UDP {spec}: {:?}", last))
}

fn serve(name: String, http: Vec<String>, tcp: Vec<String>, udp: Vec<String>) -> Result<bool> {
    if http.is_empty() && tcp.is_empty() && udp.is_empty() {
        bail!("give at least one of --http, --tcp, --udp");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let mut tasks = tokio::task::JoinSet::new();
        for spec in &http {
            let listener = bind_tcp(spec).await?;
            let body = format!("{name}\n");
            let app = axum::Router::new().fallback(move || {
                let body = body.clone();
                async move { body }
            });
            tasks.spawn(async move {
                axum::serve(listener, app)
                    .await
                    .map_err(anyhow::Error::from)
            });
        }
        for spec in &tcp {
            // Plain threads: one per listener and one per open connection.
            let listener = bind_tcp_std(spec)?;
            let name = name.clone();
            tasks.spawn_blocking(move || -> Result<()> {
                loop {
                    let (sock, _) = listener.accept()?;
                    let name = name.clone();
                    std::thread::spawn(move || tcp_conn(sock, &name));
                }
            });
        }
        for spec in &udp {
            let sock = bind_udp(spec).await?;
            let name = name.clone();
            tasks.spawn(async move {
                let mut buf = vec![0u8; 65536];
                loop {
                    let (n, from) = sock.recv_from(&mut buf).await?;
                    // `whoami` gets `NAME PEER`: the client address this server sees.
                    let reply = if &buf[..n] == b"whoami" {
                        format!("{name} {from}")
                    } else {
                        name.clone()
                    };
                    // A failed reply (e.g. the client is gone) is not fatal for the server.
                    let _ = sock.send_to(reply.as_bytes(), from).await;
                }
            });
        }
        eprintln!("netprobe serve: {name} ready");
        match tasks.join_next().await {
            Some(Ok(Err(e))) => Err(e),
            Some(Err(e)) => Err(e.into()),
            _ => Ok(true),
        }
    })
}

fn bind_tcp_std(spec: &str) -> Result<std::net::TcpListener> {
    let mut last = None;
    for a in listen_addrs(spec)? {
        match std::net::TcpListener::bind(a) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(anyhow!("binding TCP {spec}: {:?}", last))
}

/// Sends `NAME\n`, then answers each line `L` with `NAME L\n` until the client closes; the
/// line `whoami` is answered with `NAME PEER\n`, the client address this server sees (so a
/// test can check whether a proxy kept the client's source address).
fn tcp_conn(sock: TcpStream, name: &str) -> io::Result<()> {
    let mut w = sock.try_clone()?;
    let peer = sock.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    w.write_all(format!("{name}\n").as_bytes())?;
    for line in BufReader::new(sock).lines() {
        let line = line?;
        if line == "whoami" {
            w.write_all(format!("{name} {peer}\n").as_bytes())?;
            continue;
        }
        w.write_all(format!("{name} {line}\n").as_bytes())?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// clients
// ---------------------------------------------------------------------------------------

fn print_json(v: &Value) {
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

/// `{"ok":false,"errno":N,"error":"..."}`, or `{"ok":false,"timeout":true,...}`.
fn error_json(e: &io::Error) -> Value {
    if matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    ) {
        return json!({ "ok": false, "timeout": true, "error": "timed out" });
    }
    let mut v = json!({ "ok": false, "error": strerror(e) });
    if let Some(n) = e.raw_os_error() {
        v["errno"] = json!(n);
    }
    v
}

/// The error text without std's " (os error N)" suffix.
fn strerror(e: &io::Error) -> String {
    let s = e.to_string();
    match s.find(" (os error ") {
        Some(i) => s[..i].to_owned(),
        None => s,
    }
}

/// Connects to `to`, from source address `from` when given (bound with port 0 first),
/// within `timeout`; `None`: a blocking connect (reads and writes then time out after 5 s).
fn connect_from(
    to: SocketAddr,
    from: Option<std::net::IpAddr>,
    timeout: Option<Duration>,
) -> io::Result<TcpStream> {
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(to),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    if let Some(ip) = from {
        sock.bind(&SocketAddr::new(ip, 0).into())?;
    }
    match timeout {
        Some(t) => sock.connect_timeout(&to.into(), t)?,
        None => sock.connect(&to.into())?,
    }
    let s: TcpStream = sock.into();
    let timeout = timeout.unwrap_or(Duration::from_secs(5));
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    Ok(s)
}

fn read_line(r: &mut impl BufRead) -> io::Result<String> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed by peer",
        ));
    }
    Ok(line.trim_end_matches(['\n', '\r']).to_owned())
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock `bpf_ktime_get_ns` and every process of the
/// machine share, so a test can order an attempt against its own observations.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime fills the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Connects, reads the server's first line (and with `whoami` the address the server sees),
/// returns the attempt's JSON (with `start_ns`, [`monotonic_ns`] before connecting).
fn tcp_attempt(
    to: SocketAddr,
    from: Option<std::net::IpAddr>,
    timeout: Duration,
    whoami: bool,
    blocking: bool,
) -> (Value, Option<BufReader<TcpStream>>) {
    let start_ns = monotonic_ns();
    let s = match connect_from(to, from, (!blocking).then_some(timeout)) {
        Ok(s) => s,
        Err(e) => {
            let mut v = error_json(&e);
            v["start_ns"] = json!(start_ns);
            return (v, None);
        }
    };
    let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let local = s.local_addr().map(|a| a.to_string()).unwrap_or_default();
    let mut r = BufReader::new(s);
    let seen_as = |r: &mut BufReader<TcpStream>| -> io::Result<Option<String>> {
        if !whoami {
            return Ok(None);
        }
        r.get_ref().write_all(b"whoami\n")?;
        let line = read_line(r)?;
        Ok(Some(
            line.split_whitespace().nth(1).unwrap_or("").to_owned(),
        ))
    };
    match read_line(&mut r).and_then(|name| Ok((name, seen_as(&mut r)?))) {
        Ok((name, seen)) => {
            let mut v = json!({ "ok": true, "name": name, "peer": peer, "local": local, "start_ns": start_ns });
            if let Some(seen) = seen {
                v["seen_as"] = json!(seen);
            }
            (v, Some(r))
        }
        Err(e) => {
            let mut v = error_json(&e);
            v["connected"] = json!(true);
            v["peer"] = json!(peer);
            v["local"] = json!(local);
            v["start_ns"] = json!(start_ns);
            (v, None)
        }
    }
}

/// The attempts of `netprobe tcp` (its flags, durations parsed).
struct TcpProbe {
    to: SocketAddr,
    count: u32,
    timeout: Duration,
    hold: Duration,
    interval: Duration,
    keep_open: bool,
    bind: Vec<std::net::IpAddr>,
    whoami: bool,
    blocking: bool,
}

fn tcp_probe(p: &TcpProbe) -> Result<bool> {
    let TcpProbe {
        to,
        count,
        timeout,
        hold,
        interval,
        keep_open,
        ref bind,
        whoami,
        blocking,
    } = *p;
    let mut all_ok = true;
    let mut open = Vec::new();
    for i in 0..count {
        if i > 0 {
            std::thread::sleep(interval);
        }
        let from = (!bind.is_empty()).then(|| bind[i as usize % bind.len()]);
        let (v, conn) = tcp_attempt(to, from, timeout, whoami, blocking);
        all_ok &= v["ok"] == json!(true);
        print_json(&v);
        if keep_open {
            open.extend(conn);
            continue;
        }
        if conn.is_some() && !hold.is_zero() {
            std::thread::sleep(hold);
        }
        drop(conn);
    }
    if !open.is_empty() && !hold.is_zero() {
        std::thread::sleep(hold);
    }
    drop(open);
    Ok(all_ok)
}

fn tcp_interactive(to: SocketAddr, timeout: Duration) -> Result<bool> {
    let (v, conn) = tcp_attempt(to, None, timeout, false, false);
    print_json(&v);
    let Some(mut r) = conn else { return Ok(false) };
    let mut w = r.get_ref().try_clone()?;
    for line in io::stdin().lock().lines() {
        let line = line?;
        if line == "!peer" {
            // The connection's peer as getpeername() shows it now.
            let peer = w.peer_addr().map(|a| a.to_string()).unwrap_or_default();
            print_json(&json!({ "ok": true, "peer": peer }));
            continue;
        }
        let reply = w
            .write_all(format!("{line}\n").as_bytes())
            .and_then(|()| read_line(&mut r));
        match reply {
            Ok(reply) => print_json(&json!({ "ok": true, "reply": reply })),
            Err(e) => {
                print_json(&error_json(&e));
                return Ok(false);
            }
        }
    }
    Ok(true)
}

fn udp_probe(
    dests: Vec<SocketAddr>,
    count: u32,
    (connected, then_disconnect): (bool, bool),
    reconnect: bool,
    interval: Duration,
    timeout: Duration,
) -> Result<bool> {
    let to = dests[0];
    let bind: SocketAddr = if to.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let sock = UdpSocket::bind(bind).context("binding UDP socket")?;
    sock.set_read_timeout(Some(timeout))?;
    let mut is_connected = false;
    let mut all_ok = true;
    let mut buf = [0u8; 2048];
    for i in 0..count {
        if i > 0 {
            std::thread::sleep(interval);
        }
        let mut send_error: Option<Value> = None;
        if then_disconnect && is_connected {
            disconnect(&sock)?;
            is_connected = false;
        }
        let connected = connected && !(then_disconnect && i > 0);
        let mut v = (|| -> io::Result<Value> {
            if connected && !is_connected {
                sock.connect(to)?;
                is_connected = true;
            }
            if connected {
                if let Err(e) = sock.send(b"ping") {
                    if !reconnect {
                        return Err(e);
                    }
                    send_error = Some(error_json(&e));
                    sock.connect(to)?;
                    sock.send(b"ping")?;
                }
            } else {
                sock.send_to(b"ping", dests[i as usize % dests.len()])?;
            }
            let (n, from) = sock.recv_from(&mut buf)?;
            let mut v = json!({
                "ok": true,
                "name": String::from_utf8_lossy(&buf[..n]).trim().to_owned(),
                "from": from.to_string(),
            });
            if let Ok(local) = sock.local_addr() {
                v["local"] = json!(local.to_string());
            }
            if connected && let Ok(peer) = sock.peer_addr() {
                v["peer"] = json!(peer.to_string());
            }
            Ok(v)
        })()
        .unwrap_or_else(|e| error_json(&e));
        if let Some(e) = send_error {
            v["reconnected_after"] = e;
        }
        // Wall-clock time of the attempt, so a test can line attempts up with its changes.
        v["at_ms"] = json!(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0)
        );
        all_ok &= v["ok"] == json!(true);
        print_json(&v);
    }
    Ok(all_ok)
}

/// Dissolves the UDP socket's connection: `connect()` with an `AF_UNSPEC` address.
fn disconnect(sock: &UdpSocket) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: a zeroed sockaddr with family AF_UNSPEC, its size passed; the fd is ours.
    let r = unsafe {
        let mut sa: libc::sockaddr = std::mem::zeroed();
        sa.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
        libc::connect(
            sock.as_raw_fd(),
            &sa,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// demo
// ---------------------------------------------------------------------------------------

mod demo {
    use super::*;

    const PREFIX: &str = "epdemo";
    const CGROUP: &str = "ebpf-proxy-demo";
    const PIN_DIR: &str = "ebpf-proxy-demo";
    /// ClusterIP of `demo/web` in deploy/examples/demo.yaml (assigned to no interface).
    const WEB_VIP: &str = "198.19.0.10";
    /// ClusterIP of `demo/dns` in deploy/examples/dns.yaml.
    const DNS_VIP: &str = "198.19.0.53";
    const CLIENT: (&str, Ipv4Addr) = ("client", Ipv4Addr::new(198, 18, 0, 10));
    /// The backends; their addresses are the endpoints of both example EndpointSlices.
    const BACKENDS: [(&str, Ipv4Addr); 3] = [
        ("backend-a", Ipv4Addr::new(198, 18, 0, 11)),
        ("backend-b", Ipv4Addr::new(198, 18, 0, 12)),
        ("backend-c", Ipv4Addr::new(198, 18, 0, 13)),
    ];
    const REQUESTS: usize = 30;

    static STOP: AtomicBool = AtomicBool::new(false);

    extern "C" fn on_signal(_: libc::c_int) {
        STOP.store(true, Ordering::SeqCst);
    }

    /// Ctrl-C / SIGTERM set a flag that every step checks, so the guards run on the way out.
    fn install_signal_handlers() {
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            // SAFETY: the handler only stores to an atomic (async-signal-safe).
            unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
        }
    }

    fn check_stop() -> Result<()> {
        if STOP.load(Ordering::SeqCst) {
            bail!("interrupted");
        }
        Ok(())
    }

    fn step(msg: &str) -> Result<()> {
        check_stop()?;
        println!("\n==> {msg}");
        Ok(())
    }

    /// The running agent: stopped, then `ebpf-proxy cleanup` on drop (also on failure).
    struct Agent {
        child: Option<ChildGuard>,
        bin: PathBuf,
        cgroup: PathBuf,
        log: PathBuf,
        cleaned: bool,
    }

    impl Agent {
        fn cleanup_cmd(&self) -> Command {
            let mut c = Command::new(&self.bin);
            c.args(["cleanup", "--pin-dir", PIN_DIR, "--cgroup-path"])
                .arg(&self.cgroup);
            c
        }

        fn stop(&mut self) {
            if let Some(mut c) = self.child.take() {
                let _ = c.terminate(Duration::from_secs(5));
            }
        }

        fn log_tail(&self, lines: usize) -> String {
            let s = fs::read_to_string(&self.log).unwrap_or_default();
            let v: Vec<&str> = s.lines().collect();
            v[v.len().saturating_sub(lines)..].join("\n")
        }

        fn stop_and_cleanup(&mut self) -> Result<String> {
            self.stop();
            self.cleaned = true;
            let out =
                testbed::output_in(None, None, &mut self.cleanup_cmd(), Duration::from_secs(30))?;
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            ensure!(
                out.status.success(),
                "ebpf-proxy cleanup failed ({}): {text}",
                out.status
            );
            Ok(text)
        }
    }

    impl Drop for Agent {
        fn drop(&mut self) {
            self.stop();
            if !self.cleaned {
                let _ = testbed::output_in(
                    None,
                    None,
                    &mut self.cleanup_cmd(),
                    Duration::from_secs(30),
                );
            }
        }
    }

    fn abs(p: &Path) -> Result<PathBuf> {
        fs::canonicalize(p).with_context(|| format!("{} not found", p.display()))
    }

    /// A free port on 127.0.0.1 for the agent's health server.
    fn free_port() -> Result<u16> {
        Ok(std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port())
    }

    fn run_cmd(cmd: &mut Command, timeout: Duration) -> Result<std::process::Output> {
        testbed::output_in(None, None, cmd, timeout).with_context(|| format!("running {cmd:?}"))
    }

    /// The demo (`netprobe demo`): a lab of a client pod and three backends, the agent on
    /// `manifests` (copied), HTTP and DNS-like rounds, an endpoint removal, then the agent
    /// stopped and `ebpf-proxy cleanup`. Errors: not root, a step failed (the agent log's
    /// last lines are printed), or interrupted; everything made is removed either way.
    pub fn run(agent_bin: &Path, manifests: &Path) -> Result<()> {
        install_signal_handlers();
        ensure!(
            testbed::is_root(),
            "the demo needs root (namespaces, cgroups, BPF)"
        );
        let agent_bin = abs(agent_bin)?;
        let manifests = abs(manifests)?;
        let me = std::env::current_exe().context("locating netprobe")?;

        step("preparing: bpffs, temp manifests, test cgroup, lab namespaces")?;
        if testbed::ensure_bpffs()? {
            println!("mounted bpffs on {}", testbed::BPFFS_PATH);
        }
        // Removed on drop (also on failure and Ctrl-C, as the guards below unwind).
        let tmp = tempfile::Builder::new()
            .prefix("ebpf-proxy-demo-")
            .tempdir()?;
        let mdir = copy_manifests(&manifests, tmp.path())?;
        let demo_yaml = mdir.join("demo.yaml");

        let cg = TestCgroup::create(CGROUP)?;
        println!("cgroup {}", cg.path().display());
        // Leftover pins of a crashed run (tolerated if there are none).
        let _ = run_cmd(
            Command::new(&agent_bin)
                .args(["cleanup", "--pin-dir", PIN_DIR, "--cgroup-path"])
                .arg(cg.path()),
            Duration::from_secs(30),
        );

        let mut lab = Lab::new(PREFIX, false)?;
        let client = lab.add_pod(CLIENT.0, CLIENT.1, None)?;
        let (backends, servers) = start_backends(&mut lab, &me)?;
        println!(
            "pod {:<10} {}  netns {}  (in cgroup {CGROUP})",
            client.name, client.ipv4, client.netns
        );
        wait_servers_listening(&backends)?;

        step("starting the agent")?;
        let port = free_port()?;
        let mut agent = start_agent(&agent_bin, &mdir, cg.path(), tmp.path(), port)?;
        let result = (|| -> Result<()> {
            wait_healthy(&mut agent, port)?;
            println!("agent healthy (/healthz 200 on 127.0.0.1:{port})");
            rounds(&agent, &me, &client, cg.path(), &demo_yaml, tmp.path())
        })();
        if let Err(e) = result {
            eprintln!(
                "\ndemo failed: {e:#}\n--- last lines of the agent log ---\n{}",
                agent.log_tail(30)
            );
            return Err(e);
        }

        step("stopping the agent and running ebpf-proxy cleanup")?;
        cleanup_summary(&mut agent)?;
        drop(agent);
        drop(servers);
        drop(lab);
        drop(cg);
        println!(
            "\nremoved namespaces {PREFIX}-*, cgroup {CGROUP}, pins {}/{PIN_DIR}",
            testbed::BPFFS_PATH
        );
        println!("demo OK");
        Ok(())
    }

    /// Copies the YAML files of `manifests` to `<tmp>/manifests` and returns that directory.
    /// Errors when a file cannot be copied, or demo.yaml is missing or lacks the Service
    /// address or an endpoint the demo expects.
    fn copy_manifests(manifests: &Path, tmp: &Path) -> Result<PathBuf> {
        let mdir = tmp.join("manifests");
        fs::create_dir_all(&mdir)?;
        for e in fs::read_dir(manifests)?.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
                fs::copy(&p, mdir.join(e.file_name()))?;
            }
        }
        let demo_text = fs::read_to_string(mdir.join("demo.yaml"))
            .context("demo.yaml missing in the manifests")?;
        ensure!(
            demo_text.contains(WEB_VIP),
            "demo.yaml does not mention {WEB_VIP}; the demo expects that ClusterIP"
        );
        for (_, ip) in BACKENDS {
            ensure!(
                demo_text.contains(&ip.to_string()),
                "demo.yaml has no endpoint {ip}"
            );
        }
        Ok(mdir)
    }

    /// Adds the backend pods to `lab`, each with `netprobe serve` (`me`) on HTTP :8080 and
    /// TCP and UDP :5353. Returns the pods and their servers' guards (the servers stop when
    /// the guards drop); errors when a pod or server cannot be made, or on a stop signal.
    fn start_backends(lab: &mut Lab, me: &Path) -> Result<(Vec<Pod>, Vec<ChildGuard>)> {
        let mut backends: Vec<Pod> = Vec::new();
        let mut servers: Vec<ChildGuard> = Vec::new();
        for (name, ip) in BACKENDS {
            check_stop()?;
            let pod = lab.add_pod(name, ip, None)?;
            let mut cmd = Command::new(me);
            cmd.args([
                "serve", "--name", name, "--http", ":8080", "--tcp", ":5353", "--udp", ":5353",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
            // Servers run in their pod namespace only, outside the test cgroup.
            servers.push(pod.spawn(None, &mut cmd)?);
            println!(
                "pod {name:<10} {ip}  netns {}  (netprobe serve: http :8080, tcp+udp :5353)",
                pod.netns
            );
            backends.push(pod);
        }
        Ok((backends, servers))
    }

    /// Starts the agent on the manifests in `mdir`, in cgroup `cg`, with its health server
    /// on 127.0.0.1:`port` and its log in `tmp`. Errors when it cannot be started.
    fn start_agent(
        agent_bin: &Path,
        mdir: &Path,
        cg: &Path,
        tmp: &Path,
        port: u16,
    ) -> Result<Agent> {
        let log = tmp.join("agent.log");
        let mut cmd = Command::new(agent_bin);
        cmd.arg("run")
            .arg("--manifests")
            .arg(mdir)
            .arg("--cgroup-path")
            .arg(cg)
            .args([
                "--pin-dir",
                PIN_DIR,
                "--healthz-bind-address",
                &format!("127.0.0.1:{port}"),
                "--metrics-bind-address",
                "127.0.0.1:0",
                "--status-bind-address",
                "127.0.0.1:0",
            ])
            .stdin(Stdio::null());
        let f = fs::File::create(&log)?;
        cmd.stdout(f.try_clone()?).stderr(f);
        println!(
            "{} run --manifests {} --cgroup-path {} --pin-dir {PIN_DIR} --healthz-bind-address 127.0.0.1:{port} --metrics-bind-address 127.0.0.1:0",
            agent_bin.display(),
            mdir.display(),
            cg.display()
        );
        // The log lives in the demo's temporary directory, removed when the demo ends.
        println!(
            "agent log (while the demo runs; its last lines are shown if the demo fails): {}",
            log.display()
        );
        Ok(Agent {
            child: Some(ChildGuard::new(
                testbed::spawn_in(None, None, &mut cmd).context("starting the agent")?,
            )),
            bin: agent_bin.to_owned(),
            cgroup: cg.to_owned(),
            log,
            cleaned: false,
        })
    }

    /// The demo's steps with the agent healthy: HTTP requests from `client` (in cgroup
    /// `cg`) spread over every backend, the DNS-like Service over TCP and UDP, `ebpf-proxy
    /// services`, backend-c removed from `demo_yaml` (rewritten through `tmp`), then HTTP
    /// again without it. Errors name the step's failed expectation.
    fn rounds(
        agent: &Agent,
        me: &Path,
        client: &Pod,
        cg: &Path,
        demo_yaml: &Path,
        tmp: &Path,
    ) -> Result<()> {
        step(&format!(
            "{REQUESTS} HTTP requests from the client pod to http://{WEB_VIP}:80/ (Service demo/web)"
        ))?;
        let counts = http_round(client, cg)?;
        print_counts(&counts);
        for (name, _) in BACKENDS {
            ensure!(
                counts.get(name).copied().unwrap_or(0) > 0,
                "{name} got no request"
            );
        }
        ensure!(!counts.contains_key("(failed)"), "some requests failed");

        step(&format!(
            "DNS-like Service demo/dns: TCP and UDP port 53 on {DNS_VIP} (two frontends)"
        ))?;
        dns_round(me, client, cg)?;

        step("ebpf-proxy services")?;
        let out = run_cmd(
            Command::new(&agent.bin).args(["services", "--pin-dir", PIN_DIR]),
            Duration::from_secs(10),
        )?;
        print!("{}", String::from_utf8_lossy(&out.stdout));
        ensure!(
            out.status.success(),
            "ebpf-proxy services failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );

        step("removing backend-c (198.18.0.13) from the EndpointSlice of demo/web")?;
        let c_ip = BACKENDS[2].1.to_string();
        let listed_before = services_mentions(&agent.bin, &c_ip)?;
        remove_endpoint(demo_yaml, tmp, &c_ip)?;
        wait_removed(&agent.bin, &c_ip, listed_before)?;

        step(&format!("{REQUESTS} HTTP requests again"))?;
        let counts = http_round(client, cg)?;
        print_counts(&counts);
        ensure!(
            !counts.contains_key("backend-c"),
            "backend-c still got traffic after its removal"
        );
        ensure!(!counts.contains_key("(failed)"), "some requests failed");
        for name in ["backend-a", "backend-b"] {
            ensure!(
                counts.get(name).copied().unwrap_or(0) > 0,
                "{name} got no request"
            );
        }
        Ok(())
    }

    /// Stops the agent, runs `ebpf-proxy cleanup` and prints its summary. Errors when the
    /// cleanup fails.
    fn cleanup_summary(agent: &mut Agent) -> Result<()> {
        let out = agent.stop_and_cleanup()?;
        // One line per link and map is what `cleanup` prints for an operator; the demo
        // sums them up and shows anything else as is.
        let (mut links, mut pins) = (0, 0);
        for line in out.lines() {
            if line.starts_with("detached ") {
                links += 1;
            } else if line.starts_with("removed ") {
                pins += 1;
            } else {
                println!("{line}");
            }
        }
        println!("cleanup: detached {links} program links, removed {pins} pins");
        Ok(())
    }

    /// Waits (bounded) until every backend's HTTP port accepts connections.
    fn wait_servers_listening(backends: &[Pod]) -> Result<()> {
        for pod in backends {
            let addr = SocketAddr::from((pod.ipv4, 8080));
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                check_stop()?;
                let ok = testbed::in_netns(&pod.path(), move || {
                    TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
                })?;
                if ok {
                    break;
                }
                ensure!(
                    Instant::now() < deadline,
                    "netprobe serve in {} is not listening",
                    pod.name
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(())
    }

    fn wait_healthy(agent: &mut Agent, port: u16) -> Result<()> {
        let url = format!("http://127.0.0.1:{port}/healthz");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            check_stop()?;
            if let Some(child) = agent.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!("the agent exited ({status}) before it became healthy");
            }
            let out = run_cmd(
                Command::new("curl").args([
                    "-s",
                    "-o",
                    "/dev/null",
                    "-w",
                    "%{http_code}",
                    "-m",
                    "1",
                    &url,
                ]),
                Duration::from_secs(5),
            )?;
            if String::from_utf8_lossy(&out.stdout).trim() == "200" {
                return Ok(());
            }
            ensure!(
                Instant::now() < deadline,
                "the agent was not healthy within 30 s ({url})"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// `REQUESTS` curl runs from the client pod, inside the test cgroup; body -> count.
    fn http_round(client: &Pod, cg: &Path) -> Result<BTreeMap<String, usize>> {
        let url = format!("http://{WEB_VIP}:80/");
        let mut counts = BTreeMap::new();
        for _ in 0..REQUESTS {
            check_stop()?;
            let out = client.output(
                Some(cg),
                Command::new("curl").args(["-s", "-m", "2", &url]),
                Duration::from_secs(5),
            )?;
            let body = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            let key = if out.status.success() && !body.is_empty() {
                body
            } else {
                "(failed)".to_owned()
            };
            *counts.entry(key).or_insert(0) += 1;
        }
        Ok(counts)
    }

    fn print_counts(counts: &BTreeMap<String, usize>) {
        for (name, _) in BACKENDS {
            let n = counts.get(name).copied().unwrap_or(0);
            println!("  {name:<10} {n:>3}  {}", "#".repeat(n));
        }
        for (k, n) in counts {
            if !BACKENDS.iter().any(|(b, _)| b == k) {
                println!("  {k:<10} {n:>3}");
            }
        }
    }

    /// Runs a netprobe client in the client pod and counts the names in its JSON lines.
    fn probe(
        me: &Path,
        client: &Pod,
        cg: &Path,
        args: &[&str],
        counts: &mut BTreeMap<String, usize>,
    ) -> Result<()> {
        check_stop()?;
        let out = client.output(
            Some(cg),
            Command::new(me).args(args),
            Duration::from_secs(30),
        )?;
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let v: Value =
                serde_json::from_str(line).with_context(|| format!("netprobe printed {line:?}"))?;
            let key = match v["name"].as_str() {
                Some(n) if v["ok"] == json!(true) => n.to_owned(),
                _ => format!("(failed: {})", v["error"].as_str().unwrap_or("timeout")),
            };
            *counts.entry(key).or_insert(0) += 1;
        }
        Ok(())
    }

    fn dns_round(me: &Path, client: &Pod, cg: &Path) -> Result<()> {
        let to = format!("{DNS_VIP}:53");
        let mut tcp = BTreeMap::new();
        probe(
            me,
            client,
            cg,
            &["tcp", "--to", &to, "--count", "12", "--timeout-ms", "2000"],
            &mut tcp,
        )?;
        println!("TCP {to}, 12 connections:");
        print_counts(&tcp);
        let mut udp = BTreeMap::new();
        for _ in 0..6 {
            probe(
                me,
                client,
                cg,
                &["udp", "--to", &to, "--count", "3", "--timeout-ms", "1000"],
                &mut udp,
            )?;
        }
        println!(
            "UDP {to}, 6 sockets x 3 datagrams (unconnected sendto; a socket's flow sticks to one backend):"
        );
        print_counts(&udp);
        for (proto, counts) in [("TCP", &tcp), ("UDP", &udp)] {
            ensure!(
                counts.keys().all(|k| BACKENDS.iter().any(|(b, _)| b == k)),
                "some {proto} probes to {to} failed"
            );
        }
        Ok(())
    }

    /// Rewrites demo.yaml without the endpoint `ip` (parsed and written with serde_yaml_ng;
    /// replaced atomically by a rename so the agent never reads a half-written file).
    fn remove_endpoint(file: &Path, scratch: &Path, ip: &str) -> Result<()> {
        use serde::Deserialize;
        let text = fs::read_to_string(file)?;
        let mut docs = Vec::new();
        let mut removed = 0;
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            let mut v = serde_yaml_ng::Value::deserialize(doc)?;
            if v.is_null() {
                continue;
            }
            if v["kind"].as_str() == Some("EndpointSlice")
                && let Some(eps) = v.get_mut("endpoints").and_then(|e| e.as_sequence_mut())
            {
                let before = eps.len();
                eps.retain(|ep| {
                    !ep["addresses"]
                        .as_sequence()
                        .is_some_and(|a| a.iter().any(|x| x.as_str() == Some(ip)))
                });
                removed += before - eps.len();
            }
            docs.push(serde_yaml_ng::to_string(&v)?);
        }
        ensure!(removed > 0, "no endpoint {ip} in {}", file.display());
        let tmp = scratch.join("demo.yaml.new");
        fs::write(&tmp, docs.join("---\n"))?;
        fs::rename(&tmp, file)?;
        println!("rewrote {} without {ip}", file.display());
        Ok(())
    }

    /// How often `ebpf-proxy services` mentions `ip`.
    fn services_mentions(agent: &Path, ip: &str) -> Result<usize> {
        let out = run_cmd(
            Command::new(agent).args(["services", "--pin-dir", PIN_DIR]),
            Duration::from_secs(10),
        )?;
        Ok(String::from_utf8_lossy(&out.stdout).matches(ip).count())
    }

    /// Waits (at most 10 s) until `ebpf-proxy services` mentions `ip` less often than
    /// `before` times (backend-c stays listed for demo/dns), then 1 s more.
    fn wait_removed(agent: &Path, ip: &str, before: usize) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        // `before == 0`: `services` does not list backend addresses; only wait the 1 s.
        while before > 0 && services_mentions(agent, ip)? >= before {
            check_stop()?;
            if Instant::now() >= deadline {
                println!("warning: `ebpf-proxy services` still lists {ip} as often after 10 s");
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        std::thread::sleep(Duration::from_secs(1));
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// sidecar
// ---------------------------------------------------------------------------------------

/// The original destination of a connection an iptables `REDIRECT` (IPv4) sent here.
fn original_dst(s: &TcpStream) -> io::Result<SocketAddr> {
    use std::os::fd::AsRawFd;
    /// `SO_ORIGINAL_DST` (`linux/netfilter_ipv4.h`).
    const SO_ORIGINAL_DST: libc::c_int = 80;
    // SAFETY: a zeroed sockaddr_in is valid.
    let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: getsockopt(2) into a sockaddr_in we own, with its size.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_IP,
            SO_ORIGINAL_DST,
            (&mut sa as *mut libc::sockaddr_in).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    let ip = Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr));
    Ok(SocketAddr::from((ip, u16::from_be(sa.sin_port))))
}

/// See `Cmd::Sidecar`.
fn sidecar(listen: SocketAddr, mark: u32, count: u32) -> Result<()> {
    let l = std::net::TcpListener::bind(listen).with_context(|| format!("bind {listen}"))?;
    let mut relays = Vec::new();
    for _ in 0..count {
        let (inbound, _) = l.accept()?;
        let dst = original_dst(&inbound).context("SO_ORIGINAL_DST")?;
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
        sock.set_mark(mark)?;
        let onward = sock
            .connect_timeout(&dst.into(), Duration::from_secs(2))
            .map(|()| TcpStream::from(sock));
        let peer = onward
            .as_ref()
            .ok()
            .and_then(|o| o.peer_addr().ok())
            .map(|a| a.to_string());
        print_json(
            &json!({ "ok": onward.is_ok(), "original_dst": dst.to_string(), "onward_peer": peer }),
        );
        let Ok(onward) = onward else { continue };
        let (mut a_r, mut a_w) = (inbound.try_clone()?, inbound);
        let (mut b_r, mut b_w) = (onward.try_clone()?, onward);
        relays.push(std::thread::spawn(move || {
            let _ = io::copy(&mut a_r, &mut b_w);
            let _ = b_w.shutdown(std::net::Shutdown::Write);
        }));
        relays.push(std::thread::spawn(move || {
            let _ = io::copy(&mut b_r, &mut a_w);
            let _ = a_w.shutdown(std::net::Shutdown::Write);
        }));
    }
    for r in relays {
        let _ = r.join();
    }
    Ok(())
}
