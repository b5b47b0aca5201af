//! ebpf-proxy under the bench: its manifests, starting and stopping it, its `sync done`
//! lines, its pinned maps, and its process's CPU and memory.

use std::fs;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use aya::maps::{HashMap as BpfHash, Map, MapData};
use proxy_common::{
    ALL_MAPS, BACKEND_SLOTS, BACKENDS, BackendSlot, BackendSlotKey, FRONTENDS, Frontend,
    FrontendKey, PROTO_TCP,
};
use proxy_testkit::kube_proxy_rules as rules;
use proxy_testkit::testbed::{self, ChildGuard};
use proxy_userspace::datapath::loader;
use rules::Svc;

use super::driver::Env;
use super::{Opts, PIN_DIR, VERIFY_PERIOD, check_stop};

pub(super) fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_file_name(format!(
        ".{}.tmp",
        path.file_name().unwrap().to_string_lossy()
    ));
    fs::write(&tmp, text)?;
    fs::rename(&tmp, path)?;
    Ok(())
}

/// Writes the manifests: services and slices in files of 1000 services each, the slice of
/// the service that the change test edits in a file of its own.
pub(super) fn write_manifests(dir: &Path, svcs: &[Svc], change_svc: usize) -> Result<()> {
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir)?;
    for (k, chunk) in svcs.chunks(1000).enumerate() {
        let mut text = String::with_capacity(chunk.len() * 1200);
        for (i, s) in chunk.iter().enumerate() {
            text.push_str(&rules::service_json(s));
            text.push('\n');
            if k * 1000 + i != change_svc {
                text.push_str(&rules::slice_json(s));
                text.push('\n');
            }
        }
        fs::write(dir.join(format!("services-{k:03}.json")), text)?;
    }
    fs::write(
        dir.join("change.json"),
        rules::slice_json(&svcs[change_svc]) + "\n",
    )?;
    Ok(())
}

pub(super) fn agent_log(env: &Env) -> String {
    fs::read_to_string(&env.agent_log).unwrap_or_default()
}

/// The number after ` key=` in a log line.
fn field(line: &str, key: &str) -> Option<u64> {
    let pat = format!(" {key}=");
    let rest = &line[line.find(&pat)? + pat.len()..];
    rest.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

pub(super) fn v4_mapped(a: Ipv4Addr) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[10] = 0xff;
    b[11] = 0xff;
    b[12..].copy_from_slice(&a.octets());
    b
}

/// The pinned service maps, read one key at a time.
pub(super) struct Maps {
    frontends: BpfHash<MapData, FrontendKey, Frontend>,
    slots: BpfHash<MapData, BackendSlotKey, BackendSlot>,
}

impl Maps {
    pub(super) fn open(dir: &Path) -> Result<Self> {
        let open = |name: &str| -> Result<Map> {
            Ok(Map::from_map_data(MapData::from_pin(dir.join(name))?)?)
        };
        Ok(Self {
            frontends: BpfHash::try_from(open(FRONTENDS)?)?,
            slots: BpfHash::try_from(open(BACKEND_SLOTS)?)?,
        })
    }

    /// Backend addresses of the TCP frontend `vip:80` (empty when absent).
    pub(super) fn backends_of(&self, vip: Ipv4Addr) -> Vec<[u8; 16]> {
        let key = FrontendKey {
            addr: v4_mapped(vip),
            port: rules::SVC_PORT.to_be_bytes(),
            proto: PROTO_TCP,
            scope: 0,
        };
        let Ok(f) = self.frontends.get(&key, 0) else {
            return Vec::new();
        };
        (0..f.backend_count)
            .filter_map(|slot| {
                self.slots
                    .get(
                        &BackendSlotKey {
                            service_id: f.service_id,
                            slot,
                        },
                        0,
                    )
                    .ok()
                    .map(|s| s.backend.addr)
            })
            .collect()
    }
}

/// memlock bytes of every pinned map of the agent (from /proc/self/fdinfo), and of the
/// three service maps alone.
pub(super) fn map_memlock(dir: &Path) -> (u64, u64) {
    let (mut all, mut svc) = (0, 0);
    for name in ALL_MAPS {
        let Ok(m) = MapData::from_pin(dir.join(name)) else {
            continue;
        };
        let fd = m.fd().as_fd().as_raw_fd();
        let info = fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).unwrap_or_default();
        let bytes = info
            .lines()
            .find_map(|l| l.strip_prefix("memlock:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        all += bytes;
        if [FRONTENDS, BACKEND_SLOTS, BACKENDS].contains(&name) {
            svc += bytes;
        }
    }
    (all, svc)
}

/// CPU time (user + system) of process `pid` in clock ticks, from `/proc/PID/stat`.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name (which may hold spaces), utime and stime are fields 12 and 13.
    let mut f = s.rsplit_once(')')?.1.split_whitespace().skip(11);
    Some(f.next()?.parse::<u64>().ok()? + f.next()?.parse::<u64>().ok()?)
}

/// Waits until process `pid` has used at most one clock tick (10 ms) of CPU in 500 ms, for
/// at most 10 s (or until it is gone); returns how long it waited.
pub(super) fn wait_idle(pid: u32) -> Duration {
    let t = Instant::now();
    let mut last = cpu_ticks(pid);
    while t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(500));
        let now = cpu_ticks(pid);
        match (last, now) {
            (Some(a), Some(b)) if b.saturating_sub(a) > 1 => last = now,
            _ => break,
        }
    }
    t.elapsed()
}

pub(super) fn proc_status_kib(pid: u32, key: &str) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let l = s.lines().find(|l| l.starts_with(key))?;
    l.split_whitespace().nth(1)?.parse().ok()
}

pub(super) fn stop_agent(env: &mut Env) {
    if let Some(mut a) = env.agent.take() {
        let _ = a.terminate(Duration::from_secs(10));
    }
    let _ = loader::cleanup(&env.pins.0);
}

/// Starts the agent on a fresh pin directory with `source` (its source flags) and extra
/// flags, sized for `n` services, and waits for its first `sync done`. Returns the wall
/// time from the start to that line and the agent's pid.
/// `netns`: the network namespace to run it in (the bench's own when `None`).
pub(super) fn start_agent(
    env: &mut Env,
    o: &Opts,
    n: usize,
    source: &[String],
    netns: Option<&Path>,
) -> Result<(Duration, u32)> {
    let room = |need: usize, default: u32| -> String {
        (((need as f64 * 1.25) as u32).max(default)).to_string()
    };
    let log = fs::File::create(&env.agent_log)?;
    let t0 = Instant::now();
    let mut cmd = Command::new(&env.agent_bin);
    cmd.arg("run")
        .args(source)
        .arg("--cgroup-path")
        .arg(env.cg.path())
        .args([
            "--pin-dir",
            PIN_DIR,
            "--healthz-bind-address",
            "127.0.0.1:0",
            "--sync-period",
            &format!("{}s", VERIFY_PERIOD.as_secs()),
        ])
        .args([
            "--max-frontends",
            &room(2 * n, proxy_common::DEFAULT_MAX_FRONTENDS),
        ])
        .args([
            "--max-backend-slots",
            &room(n * rules::ENDPOINTS, proxy_common::DEFAULT_MAX_SLOTS),
        ])
        .args([
            "--max-backends",
            &room(n * rules::ENDPOINTS, proxy_common::DEFAULT_MAX_BACKENDS),
        ])
        .args(&o.agent_arg)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    let child = testbed::spawn_in(netns, None, &mut cmd).context("start the agent")?;
    let pid = child.id();
    env.agent = Some(ChildGuard::new(child));
    let deadline = t0 + Duration::from_secs(o.load_timeout);
    let wall = loop {
        check_stop()?;
        if agent_log(env).contains("sync done") {
            break t0.elapsed();
        }
        if let Some(s) = env.agent.as_mut().unwrap().try_wait()? {
            bail!("agent exited ({s}): {}", agent_log(env));
        }
        ensure!(
            Instant::now() < deadline,
            "no sync within {}s: {}",
            o.load_timeout,
            agent_log(env)
        );
        std::thread::sleep(Duration::from_millis(2));
    };
    Ok((wall, pid))
}

/// The fields of one `sync done` line of the agent's log.
#[derive(Debug, Clone, Copy)]
pub(super) struct SyncLine {
    pub(super) services: u64,
    pub(super) duration_us: u64,
    pub(super) model_us: u64,
    pub(super) latency_us: u64,
}

impl SyncLine {
    fn lines(log: &str) -> impl Iterator<Item = &str> {
        log.lines().filter(|l| l.contains("sync done"))
    }

    /// Number of `sync done` lines.
    pub(super) fn count(log: &str) -> usize {
        Self::lines(log).count()
    }

    /// The `i`-th (from 0) `sync done` line.
    pub(super) fn nth(log: &str, i: usize) -> Option<SyncLine> {
        let line = Self::lines(log).nth(i)?;
        Some(SyncLine {
            services: field(line, "services").unwrap_or(0),
            duration_us: field(line, "duration_us")?,
            model_us: field(line, "model_us").unwrap_or(0),
            latency_us: field(line, "latency_us").unwrap_or(0),
        })
    }
}
