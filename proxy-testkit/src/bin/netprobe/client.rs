//! `netprobe tcp` / `netprobe udp`: clients that print one JSON line per attempt with
//! what the kernel reported (peer address, source of a reply, errno).

use std::io::{self, BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{Value, json};

pub(super) fn print_json(v: &Value) {
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
pub(super) struct TcpProbe {
    pub(super) to: SocketAddr,
    pub(super) count: u32,
    pub(super) timeout: Duration,
    pub(super) hold: Duration,
    pub(super) interval: Duration,
    pub(super) keep_open: bool,
    pub(super) bind: Vec<std::net::IpAddr>,
    pub(super) whoami: bool,
    pub(super) blocking: bool,
}

pub(super) fn tcp_probe(p: &TcpProbe) -> Result<bool> {
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

pub(super) fn tcp_interactive(to: SocketAddr, timeout: Duration) -> Result<bool> {
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

pub(super) fn udp_probe(
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
