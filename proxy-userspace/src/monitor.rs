//! `ebpf-proxy monitor`: the data path's decisions as a stream of events, read from the
//! pinned ring buffer `MONITOR_EVENTS` (layouts and the kernel side's rules:
//! `proxy_common::monitor`).
//!
//! While it runs, the monitor holds the lease in `MONITOR_CTL` (an expiry on the clock of
//! `bpf_ktime_get_ns`, refreshed every second, cleared on exit and on SIGINT/SIGTERM; a
//! monitor that dies leaves an expiry that passes within `LEASE`), decodes each record,
//! applies the filters, and prints one line per event (text or JSON). Events the data path
//! could not emit (over the per-CPU rate, or no room in the ring) are counted per CPU in
//! `MONITOR_CPU`; the monitor prints a summary line whenever that count grew, and at the end.
//! One monitor per pin directory at a time: the ring buffer has one reader.

use std::{
    collections::BTreeMap,
    fs::File,
    net::IpAddr,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result};
use aya::maps::{Array, Map, MapData, RingBuf};
use proxy_common::{
    Algorithm,
    monitor::{
        EVENT_F_AFFINITY_HIT, EVENT_F_AFFINITY_MISS, EVENT_F_DATAGRAM, EVENT_F_DSR, EVENT_F_SNAT,
        EVENT_F_STALE_REPAIRED, EVENT_F_TUPLE, EventKind, EventReason, HOOK_SKB, HOOK_SOCK,
        HOOK_TC_EGRESS, HOOK_TC_INGRESS, HOOK_XDP, MonitorCtl, MonitorEvent,
    },
};
use serde::Serialize;

use crate::datapath::{
    addr::{bytes_to_ip, port_from_map, proto_name},
    tc::monotonic_ns,
    view::{PinnedView, ServiceNames},
};

/// How long a lease lasts without a refresh.
pub(crate) const LEASE: Duration = Duration::from_secs(3);

/// Which events to print. Empty lists and `None` match everything.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// `namespace/name` of a Service: events of its Service ports (any port, family, scope).
    pub service: Option<String>,
    /// An address the event's client, frontend or backend has.
    pub address: Option<IpAddr>,
    /// A port the event's frontend or backend has.
    pub port: Option<u16>,
    /// IANA protocol number.
    pub protocol: Option<u8>,
    /// Event kinds.
    pub kinds: Vec<EventKind>,
    /// Reasons.
    pub reasons: Vec<EventReason>,
}

impl Filter {
    /// Whether `e` (whose Service port is named `name`, `ns/name:port/PROTO/family[...]`)
    /// passes.
    pub(crate) fn matches(&self, e: &MonitorEvent, name: Option<&str>) -> bool {
        if let Some(s) = &self.service {
            let Some(n) = name else { return false };
            // The Service part of the Service port's name.
            let svc = n.split_once(':').map_or(n, |(svc, _)| svc);
            if svc != s {
                return false;
            }
        }
        if let Some(a) = self.address {
            let ends = [e.client, e.frontend, e.backend];
            if !ends.iter().any(|x| bytes_to_ip(*x) == a) {
                return false;
            }
        }
        if let Some(p) = self.port
            && port_from_map(e.frontend_port) != p
            && port_from_map(e.backend_port) != p
        {
            return false;
        }
        if let Some(p) = self.protocol
            && e.proto != p
        {
            return false;
        }
        if !self.kinds.is_empty() && !self.kinds.iter().any(|k| *k as u8 == e.kind) {
            return false;
        }
        if !self.reasons.is_empty() && !self.reasons.iter().any(|r| *r as u8 == e.reason) {
            return false;
        }
        true
    }
}

/// Parses an event kind name (as [`EventKind::ALL`] names them).
pub fn parse_kind(s: &str) -> Result<EventKind> {
    EventKind::ALL
        .iter()
        .find(|(_, n)| *n == s)
        .map(|(k, _)| *k)
        .with_context(|| {
            let names: Vec<&str> = EventKind::ALL.iter().map(|(_, n)| *n).collect();
            format!("unknown event type {s:?} (one of {})", names.join(", "))
        })
}

/// Parses a reason name (as [`EventReason::ALL`] names them).
pub fn parse_reason(s: &str) -> Result<EventReason> {
    EventReason::ALL
        .iter()
        .find(|(r, n)| *n == s && *r != EventReason::None)
        .map(|(r, _)| *r)
        .with_context(|| {
            let names: Vec<&str> = EventReason::ALL[1..].iter().map(|(_, n)| *n).collect();
            format!("unknown reason {s:?} (one of {})", names.join(", "))
        })
}

/// One ring buffer record as a [`MonitorEvent`]; `None` when it has another size (a record
/// of another build of the data path).
pub(crate) fn decode(bytes: &[u8]) -> Option<MonitorEvent> {
    if bytes.len() != std::mem::size_of::<MonitorEvent>() {
        return None;
    }
    // SAFETY: the size matches and MonitorEvent is valid for every bit pattern.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<MonitorEvent>()) })
}

/// An event as the monitor prints it (`-o json`: one object per line).
#[derive(Debug, Serialize, PartialEq)]
pub(crate) struct Shown {
    /// Wall-clock time, seconds since the Unix epoch.
    pub(crate) time: f64,
    /// Event type (`translate`, `refuse`, `reverse`, `stale-drop`, `flow-new`,
    /// `flow-drop`, `flow-end`, `icmp`).
    #[serde(rename = "type")]
    pub(crate) kind: &'static str,
    /// Why it was refused or dropped (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) reason: Option<&'static str>,
    /// Which program: `sock`, `skb`, `tc-ingress`, `tc-egress`, `xdp` or `tc`.
    pub(crate) hook: &'static str,
    /// `TCP` or `UDP`.
    pub(crate) protocol: &'static str,
    /// Service port name (`ns/name:port/PROTO/family`), when the event has a known one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) service: Option<String>,
    /// Service id (0: none).
    pub(crate) service_id: u32,
    /// Client `addr:port`, `netns:<cookie>` for a socket the Service sees by its network
    /// namespace; absent when not known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) client: Option<String>,
    /// Frontend `addr:port` (for tuple events: the matched tuple's destination).
    pub(crate) frontend: String,
    /// Backend `addr:port`; absent when refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) backend: Option<String>,
    /// Backend id (0: none).
    pub(crate) backend_id: u32,
    /// SNAT `addr:port` of a new flow, or the rewritten source of a tuple event.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) nat: Option<String>,
    /// The selection algorithm (absent when not known).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) algorithm: Option<&'static str>,
    /// `hit` or `miss` for a frontend with ClientIP affinity.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) affinity: Option<&'static str>,
    /// The connect() repaired a stale connected UDP socket.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub(crate) stale_repaired: bool,
    /// An unconnected UDP datagram's flow (translate) or recvmsg() (reverse).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub(crate) datagram: bool,
    /// A flow sent by direct server return (flow-new).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub(crate) dsr: bool,
    /// Socket cookie (socket events).
    #[serde(skip_serializing_if = "is_zero")]
    pub(crate) cookie: u64,
    /// Network namespace cookie (socket events).
    #[serde(skip_serializing_if = "is_zero")]
    pub(crate) netns: u64,
    /// cgroup v2 id of the connecting process (connect/sendmsg events).
    #[serde(skip_serializing_if = "is_zero")]
    pub(crate) cgroup: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// `addr:port` of a map address, `netns:<cookie>` for a namespace client id, `None` for
/// all zero.
fn endpoint(a: [u8; 16], port: [u8; 2]) -> Option<String> {
    if a == [0; 16] {
        return None;
    }
    if a[..8] == [0xfe, 0x80, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff] {
        let mut c = [0u8; 8];
        c.copy_from_slice(&a[8..]);
        return Some(format!("netns:{}", u64::from_le_bytes(c)));
    }
    let p = port_from_map(port);
    Some(match bytes_to_ip(a) {
        IpAddr::V4(v4) => format!("{v4}:{p}"),
        IpAddr::V6(v6) => format!("[{v6}]:{p}"),
    })
}

/// The event `e` as printed, with its Service port name and the offset from the
/// monotonic clock to wall-clock time (`wall_offset_ns`, may be negative).
pub(crate) fn show(e: &MonitorEvent, service: Option<String>, wall_offset_ns: i128) -> Shown {
    let kind = EventKind::from_u8(e.kind).map_or("?", EventKind::name);
    let reason = EventReason::from_u8(e.reason)
        .filter(|r| *r != EventReason::None)
        .map(EventReason::name);
    let hook = match e.hook {
        HOOK_SOCK => "sock",
        HOOK_SKB => "skb",
        HOOK_TC_INGRESS => "tc-ingress",
        HOOK_TC_EGRESS => "tc-egress",
        HOOK_XDP => "xdp",
        _ => "tc",
    };
    let affinity = if e.flags & EVENT_F_AFFINITY_HIT != 0 {
        Some("hit")
    } else if e.flags & EVENT_F_AFFINITY_MISS != 0 {
        Some("miss")
    } else {
        None
    };
    let nat = if e.flags & (EVENT_F_SNAT | EVENT_F_TUPLE) != 0 {
        endpoint(e.nat, e.nat_port)
    } else {
        None
    };
    Shown {
        time: (e.ts_ns as i128 + wall_offset_ns) as f64 / 1e9,
        kind,
        reason,
        hook,
        protocol: proto_name(e.proto),
        service,
        service_id: e.service_id,
        client: endpoint(e.client, e.client_port),
        frontend: endpoint(e.frontend, e.frontend_port).unwrap_or_else(|| "-".into()),
        backend: endpoint(e.backend, e.backend_port),
        backend_id: e.backend_id,
        nat,
        algorithm: Algorithm::from_u8(e.algorithm).map(Algorithm::name),
        affinity,
        stale_repaired: e.flags & EVENT_F_STALE_REPAIRED != 0,
        datagram: e.flags & EVENT_F_DATAGRAM != 0,
        dsr: e.flags & EVENT_F_DSR != 0,
        cookie: e.cookie,
        netns: e.netns,
        cgroup: e.cgroup,
    }
}

/// `HH:MM:SS.mmm` (UTC) of Unix time `t`.
fn clock(t: f64) -> String {
    let ms = (t * 1000.0) as u64;
    let s = ms / 1000;
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        (s / 3600) % 24,
        (s / 60) % 60,
        s % 60,
        ms % 1000
    )
}

/// One text line: time, type, protocol, client -> frontend => backend, then the details.
pub(crate) fn text_line(s: &Shown) -> String {
    let mut line = format!(
        "{} {:<10} {:<3} {} -> {}",
        clock(s.time),
        s.kind,
        s.protocol,
        s.client.as_deref().unwrap_or("-"),
        s.frontend
    );
    match (&s.backend, s.kind) {
        (Some(b), "flow-end" | "icmp") if s.hook != "sock" => {
            line.push_str(&format!(
                " rewritten {} -> {b}",
                s.nat.as_deref().unwrap_or("-")
            ));
        }
        (Some(b), _) => line.push_str(&format!(" => {b}")),
        (None, _) => {}
    }
    if let Some(r) = s.reason {
        line.push_str(&format!(" reason={r}"));
    }
    match &s.service {
        Some(n) => line.push_str(&format!(" service={n}")),
        None if s.service_id != 0 => line.push_str(&format!(" service_id={}", s.service_id)),
        None => {}
    }
    if let Some(a) = s.algorithm {
        line.push_str(&format!(" algorithm={a}"));
    }
    if let Some(a) = s.affinity {
        line.push_str(&format!(" affinity={a}"));
    }
    if s.kind != "flow-end"
        && s.kind != "icmp"
        && let Some(n) = &s.nat
    {
        line.push_str(&format!(" snat={n}"));
    }
    if s.stale_repaired {
        line.push_str(" stale-repaired");
    }
    if s.datagram {
        line.push_str(" datagram");
    }
    if s.dsr {
        line.push_str(" dsr");
    }
    line.push_str(&format!(" hook={}", s.hook));
    if s.cookie != 0 {
        line.push_str(&format!(" cookie={}", s.cookie));
    }
    if s.netns != 0 {
        line.push_str(&format!(" netns={}", s.netns));
    }
    if s.cgroup != 0 {
        line.push_str(&format!(" cgroup={}", s.cgroup));
    }
    line
}

/// Events the data path could not emit, summed over CPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Lost {
    /// Over the per-CPU rate.
    pub(crate) rate_limited: u64,
    /// No room in the ring buffer.
    pub(crate) ring_full: u64,
}

impl Lost {
    /// Both causes.
    pub(crate) fn total(&self) -> u64 {
        self.rate_limited + self.ring_full
    }

    /// What was lost since `base`.
    pub(crate) fn since(&self, base: &Lost) -> Lost {
        Lost {
            rate_limited: self.rate_limited.saturating_sub(base.rate_limited),
            ring_full: self.ring_full.saturating_sub(base.ring_full),
        }
    }
}

/// The summary line of lost events (`-o json`: `{"lost":N,"rate_limited":..,"ring_full":..}`).
pub(crate) fn lost_line(l: &Lost, json: bool) -> String {
    if json {
        serde_json::json!({"lost": l.total(), "rate_limited": l.rate_limited, "ring_full": l.ring_full})
            .to_string()
    } else {
        format!(
            "-- {} events lost (rate limit: {}, ring buffer full: {})",
            l.total(),
            l.rate_limited,
            l.ring_full
        )
    }
}

/// The monitor's lease on the event stream: held from [`Lease::take`] to its drop, which
/// clears it.
pub(crate) struct Lease {
    ctl: Array<MapData, MonitorCtl>,
    rate: MonitorCtl,
}

impl Lease {
    /// Takes the lease of the data path of `view` with `rate` events per second and CPU
    /// (0: unlimited) and bursts of `burst`.
    pub(crate) fn take(view: &PinnedView, rate: u32, burst: u32) -> Result<Lease> {
        let ctl = view.monitor_control()?;
        let cost_ns = if rate == 0 {
            0
        } else {
            1_000_000_000 / rate as u64
        };
        let mut l = Lease {
            ctl,
            rate: MonitorCtl {
                expiry_ns: 0,
                cost_ns,
                max_credit_ns: cost_ns * burst.max(1) as u64,
            },
        };
        l.refresh()?;
        Ok(l)
    }

    /// Extends the lease by [`LEASE`] from now.
    pub(crate) fn refresh(&mut self) -> Result<()> {
        let v = MonitorCtl {
            expiry_ns: monotonic_ns() + LEASE.as_nanos() as u64,
            ..self.rate
        };
        self.ctl.set(0, v, 0).context("write MONITOR_CTL")
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let _ = self.ctl.set(0, MonitorCtl::default(), 0);
    }
}

/// Options of one monitor run.
#[derive(Debug, Clone)]
pub struct Options {
    /// The pin directory.
    pub dir: PathBuf,
    /// Which events to print.
    pub filter: Filter,
    /// One JSON object per line instead of text.
    pub json: bool,
    /// Stop after this many printed events.
    pub count: Option<u64>,
    /// Stop after this long.
    pub duration: Option<Duration>,
    /// Events per second and CPU the data path may emit (0: unlimited).
    pub rate: u32,
    /// Burst per CPU.
    pub burst: u32,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// Service port names by id, read from `SERVICE_NAMES` again (at most once a second) when
/// an event names an id it does not know.
struct Names {
    map: ServiceNames,
    known: BTreeMap<u32, String>,
    last_read: Option<Instant>,
}

impl Names {
    fn open(view: &PinnedView) -> Result<Names> {
        let map = view.service_names()?;
        let mut n = Names {
            map,
            known: BTreeMap::new(),
            last_read: None,
        };
        n.reload();
        Ok(n)
    }

    fn reload(&mut self) {
        self.known = self.map.read();
        self.last_read = Some(Instant::now());
    }

    fn get(&mut self, id: u32) -> Option<String> {
        if id == 0 {
            return None;
        }
        if !self.known.contains_key(&id)
            && self
                .last_read
                .is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
        {
            self.reload();
        }
        self.known.get(&id).cloned()
    }
}

/// Offset from CLOCK_MONOTONIC to the Unix epoch, in nanoseconds.
fn wall_offset_ns() -> i128 {
    let wall = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i128);
    wall - monotonic_ns() as i128
}

/// An exclusive lock on the event stream of a pin directory (one reader per ring buffer),
/// held while the monitor runs: a file under /run named after the pin directory, removed
/// again when the monitor ends (see [`lock`]).
struct MonitorLock {
    _file: File,
    path: PathBuf,
}

impl Drop for MonitorLock {
    fn drop(&mut self) {
        // Still ours: `lock` checked that the path names the locked file, and only the
        // holder removes it.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The file under /run that the monitor of the pin directory `dir` locks while it runs (and
/// removes when it ends): `/run/ebpf-proxy-monitor` + `dir` with every character but ASCII
/// letters and digits as `_` + `.lock`.
pub fn lock_path(dir: &Path) -> PathBuf {
    let name: String = dir
        .to_string_lossy()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    PathBuf::from(format!("/run/ebpf-proxy-monitor{name}.lock"))
}

/// Takes the [`MonitorLock`] of `dir`. A monitor that ends removes the file while holding
/// the lock, so one that opened the old file just before must not take the lock on it: the
/// lock counts only when the path still names the locked file afterwards.
fn lock(dir: &Path) -> Result<MonitorLock> {
    use std::os::unix::fs::MetadataExt;
    let path = lock_path(dir);
    let busy = || {
        anyhow::anyhow!(
            "another `ebpf-proxy monitor` is reading the events of {} (one reader at a time)",
            dir.display()
        )
    };
    let f = File::create(&path).with_context(|| format!("create {}", path.display()))?;
    // SAFETY: flock(2) on a descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(busy());
    }
    let same = match (std::fs::metadata(&path), f.metadata()) {
        (Ok(p), Ok(m)) => p.dev() == m.dev() && p.ino() == m.ino(),
        _ => false,
    };
    if !same {
        return Err(busy());
    }
    Ok(MonitorLock { _file: f, path })
}

/// Runs the monitor until `count` events were printed, `duration` passed, or SIGINT or
/// SIGTERM arrived; writes the lines to `out`.
pub fn run(opts: &Options, out: &mut dyn std::io::Write) -> Result<()> {
    let dir = &opts.dir;
    let view = PinnedView::new(dir);
    // The event stream first: a mistyped pin directory leaves nothing behind.
    let data = view.event_stream()?;
    let _lock = lock(dir)?;
    let mut ring = RingBuf::try_from(Map::RingBuf(data))?;
    let mut names = Names::open(&view)?;
    // SAFETY: installing a handler that only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    // Records left from an earlier monitor are not this run's events.
    while ring.next().is_some() {}
    let base = view.monitor_totals()?;
    let base_lost = Lost {
        rate_limited: base.rate_limited,
        ring_full: base.ring_full,
    };
    let mut lease = Lease::take(&view, opts.rate, opts.burst)?;
    let offset = wall_offset_ns();
    let start = Instant::now();
    let mut last_refresh = Instant::now();
    let mut reported = Lost::default();
    let mut printed = 0u64;
    let fd = ring.as_raw_fd();
    let report = |out: &mut dyn std::io::Write, reported: &mut Lost| -> Result<()> {
        let t = view.monitor_totals()?;
        let now = Lost {
            rate_limited: t.rate_limited,
            ring_full: t.ring_full,
        }
        .since(&base_lost);
        if now.total() > reported.total() {
            writeln!(out, "{}", lost_line(&now, opts.json))?;
            out.flush()?;
            *reported = now;
        }
        Ok(())
    };
    'run: loop {
        if STOP.load(Ordering::SeqCst) {
            break;
        }
        if opts.duration.is_some_and(|d| start.elapsed() >= d) {
            break;
        }
        if last_refresh.elapsed() >= Duration::from_secs(1) {
            lease.refresh()?;
            last_refresh = Instant::now();
            report(out, &mut reported)?;
        }
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll(2) on one descriptor we own; EINTR (a signal) just loops.
        unsafe { libc::poll(&mut pfd, 1, 200) };
        while let Some(item) = ring.next() {
            let Some(e) = decode(&item) else { continue };
            drop(item);
            let name = names.get(e.service_id);
            if !opts.filter.matches(&e, name.as_deref()) {
                continue;
            }
            let s = show(&e, name, offset);
            if opts.json {
                writeln!(out, "{}", serde_json::to_string(&s)?)?;
            } else {
                writeln!(out, "{}", text_line(&s))?;
            }
            printed += 1;
            if opts.count.is_some_and(|c| printed >= c) {
                out.flush()?;
                break 'run;
            }
        }
        out.flush()?;
    }
    drop(lease);
    report(out, &mut reported)?;
    out.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests;
