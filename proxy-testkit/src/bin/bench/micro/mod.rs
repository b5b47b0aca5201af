//! `ebpf-proxy-bench micro`: the cost of one packet in each of ebpf-proxy's packet programs,
//! measured with `BPF_PROG_TEST_RUN`, next to two anchors measured in the same run: the
//! floor programs (object `ebpf-proxy-floor`: the least a program does for a packet of a
//! tracked flow) and, when its object is given, Katran's balancer XDP program.
//!
//! Method (that of Katran's perf-testing mode, `BpfTester::runXdpProgPerf`): every sample
//! is one `BPF_PROG_TEST_RUN` with repeat 1 (a repeat would run the program again on the
//! frame its first run rewrote), timed by the kernel: from a clock read before the program
//! to one after it, so the clock's own cost (a few tens of nanoseconds) is in every figure,
//! the floor's included. The first packet of a new flow has a source port of its own in
//! every sample of a run, so each sample really starts a flow. Before a case's samples in
//! each run its worker empties the flow table and sets the case's flow up again by running
//! its opening packets (untimed), so every case starts from the same state; untimed
//! warm-up runs follow. Runs go round the workers, so slow drifts of the machine spread over
//! every case alike.
//!
//! Where the programs run: each object in a thread of its own moved into a private network
//! namespace (`progrun::in_private_netns`); nothing is attached anywhere. ebpf-proxy's
//! object has its maps seeded by the agent's own model and reconciler
//! (`progrun::Harness::seed`) from [`OBJECTS`] or [`DSR_OBJECTS`]. Cases whose packet
//! leaves through a FIB lookup (XDP, the replies of source-NATed flows, DSR) run in a
//! namespace with a veth, static routes and neighbours ([`routes`], as the packet tests
//! do); the others in an empty one, where no lookup finds a route.
//!
//! Katran (opt-in: this project neither builds nor ships it): `--katran-object PATH` loads
//! its `balancer.bpf.o` with aya and fills its maps as its tester does (`katran_tester`:
//! `prepareLbData` through `KatranLb`): a TCP VIP 10.200.1.1:80 (flags 0, `vip_num` 0) and
//! 10.200.1.2:80 with `F_LRU_BYPASS` (`vip_num` 1; the flag its perf-testing mode sets on
//! every VIP), reals 10.0.0.1-3 (ids 1-3) spread over each VIP's ring, the default router's
//! MAC in `ctl_array[0]`; no per-CPU LRU is set, so its connection table is
//! `fallback_cache`. Its `ch_rings` is cut to the two VIPs' rings and `fallback_cache`
//! raised to 65536 entries so a run's new flows evict nothing (sizes change no
//! instruction).

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs,
    io::Write as _,
    path::{Path, PathBuf},
    process::Command,
    sync::mpsc,
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHash, MapData},
    programs::{Program, SchedClassifier, Xdp},
};
use proxy_testkit::progrun::{
    ACK, Harness, PASS, Packet, REDIRECT, SYN, TcOptions, XDP, XDP_PASS, XDP_REDIRECT, XDP_TX,
    encapsulated, ether, in_private_netns, sock, test_run, verify,
};
use proxy_userspace::datapath::loader::MapSizes;

mod anchors;
mod cases;
mod report;

use anchors::*;
use cases::*;
use report::*;

/// TCP PSH: a data segment.
const PSH: u8 = 0x08;
/// The floor's object, from the workspace (`cargo xtask build-ebpf`).
const FLOOR_OBJECT: &str = "target/bpfel-unknown-none/release/ebpf-proxy-floor";
/// Source ports of new flows: sample `i` of a run uses `NEW_PORT_BASE + i`.
const NEW_PORT_BASE: u32 = 1024;

/// Options of `ebpf-proxy-bench micro`.
#[derive(clap::Args, Clone, Debug)]
pub struct MicroOpts {
    /// Runs (the percentiles are over every sample of every run; the spread of the run
    /// medians is shown too).
    #[arg(long, default_value_t = 5, value_parser = crate::at_least_one)]
    runs: usize,
    /// Timed samples per case and run.
    #[arg(long, default_value_t = 2000, value_parser = crate::at_least_one)]
    samples: usize,
    /// Untimed runs per case and run before its samples.
    #[arg(long, default_value_t = 200)]
    warmup: usize,
    /// Katran's balancer object (`balancer.bpf.o`, built from Katran's source as
    /// docs/src/benchmarks-micro.md describes); without it Katran's rows are left out.
    #[arg(long, value_name = "PATH")]
    katran_object: Option<PathBuf>,
    /// The floor object [default: target/bpfel-unknown-none/release/ebpf-proxy-floor].
    #[arg(long, value_name = "PATH")]
    floor_object: Option<PathBuf>,
    /// Run only the cases whose name or program contains one of these (comma-separated);
    /// the floor and Katran always run.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Pin the measuring threads to this CPU.
    #[arg(long)]
    cpu: Option<usize>,
    /// Write `bpftool prog dump xlated` (with source lines) and the machine code (raw) of
    /// every measured program into DIR, while they are loaded.
    #[arg(long, value_name = "DIR")]
    dump: Option<PathBuf>,
    /// Output directory (`micro.json`, `micro.md`).
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
}

/// The hook of a case, and so its floor program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
enum Hook {
    Tc,
    Xdp,
}

/// Which of Katran's packets a case compares with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
enum Like {
    /// A packet of a known flow.
    Tracked,
    /// The first packet of a new flow.
    New,
    /// None: an anchor.
    Anchor,
}

/// The frames of a case's samples.
enum Frames {
    /// The same frame every time.
    Fixed(Vec<u8>),
    /// A frame of its own for sample `i` of a run (warm-up included): new flows.
    PerSample(Box<dyn Fn(u32) -> Vec<u8>>),
}

/// One measured case.
struct Case {
    name: &'static str,
    /// The object (`ebpf-proxy`, `floor`, `katran`) and its program.
    object: &'static str,
    prog: &'static str,
    hook: Hook,
    like: Like,
    /// Return code of every sample.
    verdict: i32,
    /// An ebpf-proxy counter the first run must grow by one: the packet took the case's
    /// path.
    counter: Option<&'static str>,
    /// Untimed (program, frame, return code) runs that set the case's flow up.
    prime: Vec<(&'static str, Vec<u8>, i32)>,
    frames: Frames,
}

impl Case {
    fn new(name: &'static str, prog: &'static str, hook: Hook, like: Like) -> Case {
        Case {
            name,
            object: "ebpf-proxy",
            prog,
            hook,
            like,
            verdict: PASS,
            counter: None,
            prime: Vec::new(),
            frames: Frames::Fixed(Vec::new()),
        }
    }
    fn object(mut self, o: &'static str) -> Case {
        self.object = o;
        self
    }
    fn verdict(mut self, v: i32) -> Case {
        self.verdict = v;
        self
    }
    fn counter(mut self, c: &'static str) -> Case {
        self.counter = Some(c);
        self
    }
    fn prime(mut self, prog: &'static str, frame: Vec<u8>, v: i32) -> Case {
        self.prime.push((prog, frame, v));
        self
    }
    fn frame(mut self, f: Vec<u8>) -> Case {
        self.frames = Frames::Fixed(f);
        self
    }
    fn per_sample(mut self, f: impl Fn(u32) -> Vec<u8> + 'static) -> Case {
        self.frames = Frames::PerSample(Box::new(f));
        self
    }
}

/// What a worker measures on: ebpf-proxy's harness or an anchor's object.
trait Target {
    /// Empties the flow table.
    fn reset(&mut self) -> Result<()>;
    fn program(&self, name: &str) -> &Program;
    /// ebpf-proxy's counters by name (none for the anchors).
    fn counters(&self) -> BTreeMap<&'static str, u64> {
        BTreeMap::new()
    }
}

impl Target for Harness {
    fn reset(&mut self) -> Result<()> {
        self.forget_flows();
        Ok(())
    }
    fn program(&self, name: &str) -> &Program {
        Harness::program(self, name)
    }
    fn counters(&self) -> BTreeMap<&'static str, u64> {
        Harness::counters(self)
    }
}

/// An anchor's object with its programs loaded.
struct Object {
    ebpf: Ebpf,
    /// Katran's connection table (`fallback_cache`), emptied by `reset`.
    lru: bool,
}

impl Target for Object {
    fn reset(&mut self) -> Result<()> {
        if !self.lru {
            return Ok(());
        }
        let mut m: BpfHash<&mut MapData, KatranFlowKey, [u8; 16]> = BpfHash::try_from(
            self.ebpf
                .map_mut("fallback_cache")
                .context("fallback_cache")?,
        )?;
        let keys: Vec<KatranFlowKey> = m.keys().filter_map(|k| k.ok()).collect();
        for k in keys {
            let _ = m.remove(&k);
        }
        Ok(())
    }
    fn program(&self, name: &str) -> &Program {
        self.ebpf.program(name).expect("program in the object")
    }
}

/// The workers, one private network namespace each.
#[derive(Clone, Debug)]
enum Kind {
    /// ebpf-proxy on [`OBJECTS`], no routes.
    Node,
    /// ebpf-proxy on [`OBJECTS`], with [`routes`].
    Routed,
    /// ebpf-proxy on [`DSR_OBJECTS`], with [`routes`].
    Dsr,
    /// The floor object.
    Floor(PathBuf),
    /// Katran's object.
    Katran(PathBuf),
}

/// A case as the worker reports it.
#[derive(Clone, Debug, serde::Serialize)]
struct CaseMeta {
    name: &'static str,
    object: &'static str,
    prog: &'static str,
    hook: Hook,
    like: Like,
    verdict: i32,
}

/// A loaded program as the kernel describes it.
#[derive(Clone, Debug, serde::Serialize)]
struct ProgMeta {
    object: &'static str,
    prog: String,
    id: u32,
    /// Instructions after the verifier's rewrites (`xlated_prog_len / 8`).
    xlated_insns: u32,
    /// Bytes of machine code.
    jited_bytes: u32,
    /// Instructions the verifier processed (every path it explored).
    verified_insns: u32,
}

enum Reply {
    Ready(Vec<CaseMeta>, Vec<ProgMeta>),
    /// One run: the samples of every case, nanoseconds.
    Run(Vec<Vec<u32>>),
}

struct Worker {
    name: String,
    cmds: mpsc::Sender<bool>,
    replies: mpsc::Receiver<Result<Reply>>,
    cases: Vec<CaseMeta>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Worker {
    /// Stops the worker and waits for it, so its harness removes its pin directory before
    /// the process exits (on an error too).
    fn drop(&mut self) {
        let _ = self.cmds.send(false);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `ebpf-proxy-bench micro`.
impl MicroOpts {
    /// The options of `ebpf-proxy-bench micro` with their defaults (fewer samples with
    /// `quick`), for the full run: results into `out`, Katran's object if given.
    pub fn defaults(out: &Path, katran_object: Option<PathBuf>, quick: bool) -> MicroOpts {
        #[derive(clap::Parser)]
        struct Defaults {
            #[command(flatten)]
            opts: MicroOpts,
        }
        let mut opts = <Defaults as clap::Parser>::parse_from(["micro"]).opts;
        opts.out = out.to_path_buf();
        opts.katran_object = katran_object;
        if quick {
            opts.runs = 1;
            opts.samples = 500;
        }
        opts
    }
}

pub fn micro(opts: MicroOpts) -> Result<()> {
    // SAFETY: no arguments.
    ensure!(
        unsafe { libc::geteuid() } == 0,
        "the micro-benchmark needs root (BPF_PROG_TEST_RUN, network namespaces)"
    );
    ensure!(
        opts.warmup + opts.samples <= 60000,
        "--warmup plus --samples at most 60000 (a new flow's source port per sample)"
    );
    let floor = opts
        .floor_object
        .clone()
        .unwrap_or_else(|| PathBuf::from(FLOOR_OBJECT));
    ensure!(
        floor.exists(),
        "no floor object at {} (run `cargo xtask build-ebpf`)",
        floor.display()
    );
    let mut kinds = vec![Kind::Node, Kind::Routed, Kind::Dsr, Kind::Floor(floor)];
    if let Some(k) = &opts.katran_object {
        ensure!(k.exists(), "no Katran object at {}", k.display());
        kinds.push(Kind::Katran(k.clone()));
    }
    let mut workers = Vec::new();
    for kind in kinds {
        let name = format!("{kind:?}");
        let (cmd_tx, cmd_rx) = mpsc::channel::<bool>();
        let (rep_tx, rep_rx) = mpsc::channel::<Result<Reply>>();
        let o = opts.clone();
        let thread = std::thread::spawn(move || {
            in_private_netns(move || {
                let tx = rep_tx.clone();
                if let Err(e) = worker(&kind, &o, &cmd_rx, &rep_tx) {
                    let _ = tx.send(Err(e.context(format!("{kind:?}"))));
                }
            })
        });
        let mut w = Worker {
            name,
            cmds: cmd_tx,
            replies: rep_rx,
            cases: Vec::new(),
            thread: Some(thread),
        };
        let progs = match w.replies.recv() {
            Ok(Ok(Reply::Ready(c, p))) => {
                w.cases = c;
                p
            }
            Ok(Ok(Reply::Run(_))) => bail!("{}: unexpected reply", w.name),
            Ok(Err(e)) => return Err(e),
            Err(_) => bail!("{}: the worker died while setting up (see above)", w.name),
        };
        eprintln!("micro: {}: {} cases", w.name, w.cases.len());
        workers.push((w, progs));
    }
    let progs: Vec<ProgMeta> = {
        let mut seen = BTreeMap::new();
        for p in workers.iter().flat_map(|(_, p)| p) {
            seen.entry((p.object, p.prog.clone()))
                .or_insert_with(|| p.clone());
        }
        seen.into_values().collect()
    };
    let workers: Vec<Worker> = workers.into_iter().map(|(w, _)| w).collect();
    if let Some(dir) = &opts.dump {
        dump(dir, &progs)?;
    }

    // Runs round the workers.
    let mut samples: Vec<Vec<Vec<Vec<u32>>>> = workers
        .iter()
        .map(|w| vec![Vec::new(); w.cases.len()])
        .collect();
    for run in 0..opts.runs {
        for (wi, w) in workers.iter().enumerate() {
            w.cmds
                .send(true)
                .map_err(|_| anyhow!("{}: worker gone", w.name))?;
            match w.replies.recv() {
                Ok(Ok(Reply::Run(s))) => {
                    for (ci, s) in s.into_iter().enumerate() {
                        samples[wi][ci].push(s);
                    }
                }
                Ok(Ok(Reply::Ready(..))) => bail!("{}: unexpected reply", w.name),
                Ok(Err(e)) => return Err(e),
                Err(_) => bail!("{}: the worker died (see above)", w.name),
            }
        }
        eprintln!("micro: run {} of {} done", run + 1, opts.runs);
    }
    // Dropping the workers stops them and removes their pins.
    let cases: Vec<Vec<CaseMeta>> = workers.iter().map(|w| w.cases.clone()).collect();
    drop(workers);

    let mut rows = Vec::new();
    for (wi, cases) in cases.iter().enumerate() {
        for (ci, c) in cases.iter().enumerate() {
            rows.push(Row::new(c.clone(), &samples[wi][ci]));
        }
    }
    let report = Report::new(&opts, rows, progs);
    let md = report.markdown();
    print!("{md}");
    fs::create_dir_all(&opts.out).with_context(|| format!("create {}", opts.out.display()))?;
    fs::write(opts.out.join("micro.md"), &md)?;
    fs::write(
        opts.out.join("micro.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    eprintln!(
        "micro: results in {} and {}",
        opts.out.join("micro.md").display(),
        opts.out.join("micro.json").display()
    );
    Ok(())
}

/// `bpftool prog dump xlated id N linum` of every program into `<object>.<prog>.xlated.txt`,
/// and its machine code, raw, into `<object>.<prog>.jited.bin` (read with
/// `BPF_OBJ_GET_INFO_BY_FD`: Debian's bpftool has no disassembler; on x86-64
/// `objdump -D -b binary -m i386:x86-64 FILE` reads it).
fn dump(dir: &Path, progs: &[ProgMeta]) -> Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    for p in progs {
        let id = p.id.to_string();
        let xlated = dir.join(format!("{}.{}.xlated.txt", p.object, p.prog));
        let out = Command::new("bpftool")
            .args(["prog", "dump", "xlated", "id", &id, "linum"])
            .output()
            .context("run bpftool")?;
        fs::File::create(&xlated)?.write_all(&out.stdout)?;
        if !out.status.success() {
            eprintln!(
                "micro: bpftool prog dump xlated id {id} ({}): {}",
                p.prog,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let jited = jited_image(p.id).with_context(|| format!("machine code of {}", p.prog))?;
        fs::write(
            dir.join(format!("{}.{}.jited.bin", p.object, p.prog)),
            jited,
        )?;
    }
    eprintln!("micro: program dumps in {}", dir.display());
    Ok(())
}

/// The machine code of program `id`: `BPF_PROG_GET_FD_BY_ID`, then `BPF_OBJ_GET_INFO_BY_FD`
/// with a buffer for `jited_prog_insns`.
fn jited_image(id: u32) -> Result<Vec<u8>> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    /// `bpf()` commands (uapi `enum bpf_cmd`).
    const PROG_GET_FD_BY_ID: libc::c_long = 13;
    const OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    let bpf = crate::progstats::bpf;
    let mut attr = [0u64; 16];
    attr[0] = id as u64; // prog_id
    let fd = bpf(PROG_GET_FD_BY_ID, &mut attr)?;
    // SAFETY: a descriptor the kernel just returned to us.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // `struct bpf_prog_info` up to `xlated_prog_insns`: jited_prog_len at byte 16,
    // jited_prog_insns (a pointer) at byte 24.
    let info_of = |info: &mut [u64; 5]| -> std::io::Result<()> {
        let mut attr = [0u64; 16];
        // bpf_fd, info_len, then info (a pointer).
        attr[0] = fd.as_raw_fd() as u64 | (std::mem::size_of_val(info) as u64) << 32;
        attr[1] = info.as_mut_ptr() as u64;
        bpf(OBJ_GET_INFO_BY_FD, &mut attr).map(|_| ())
    };
    let mut info = [0u64; 5];
    info_of(&mut info)?;
    let len = (info[2] & 0xffff_ffff) as usize;
    let mut image = vec![0u8; len];
    let mut info = [0u64; 5];
    info[2] = len as u64;
    info[3] = image.as_mut_ptr() as u64;
    info_of(&mut info)?;
    Ok(image)
}

/// A worker's thread (already in its own network namespace): sets its target up, reports
/// its cases, then measures one run per `true` received until `false` or a closed channel.
fn worker(
    kind: &Kind,
    opts: &MicroOpts,
    cmds: &mpsc::Receiver<bool>,
    replies: &mpsc::Sender<Result<Reply>>,
) -> Result<()> {
    if let Some(cpu) = opts.cpu {
        pin_to(cpu)?;
    }
    let (mut target, cases): (Box<dyn Target>, Vec<Case>) = match kind {
        Kind::Node => {
            let h = harness("micro-node", OBJECTS);
            (Box::new(h), node_cases())
        }
        Kind::Routed => {
            routes()?;
            let h = harness("micro-routed", OBJECTS);
            (Box::new(h), routed_cases())
        }
        Kind::Dsr => {
            routes()?;
            let h = harness("micro-dsr", DSR_OBJECTS);
            (Box::new(h), dsr_cases())
        }
        Kind::Floor(path) => (Box::new(floor_object(path)?), floor_cases()),
        Kind::Katran(path) => (Box::new(katran_object(path)?), katran_cases()),
    };
    let cases: Vec<Case> = cases
        .into_iter()
        .filter(|c| {
            c.like == Like::Anchor
                || opts.only.is_empty()
                || opts
                    .only
                    .iter()
                    .any(|o| c.name.contains(o.as_str()) || c.prog.contains(o.as_str()))
        })
        .collect();
    let mut progs: Vec<ProgMeta> = Vec::new();
    for c in &cases {
        if progs.iter().any(|p| p.prog == c.prog) {
            continue;
        }
        let info = target.program(c.prog).info()?;
        progs.push(ProgMeta {
            object: c.object,
            prog: c.prog.to_string(),
            id: info.id(),
            xlated_insns: info.size_translated().unwrap_or(0) / 8,
            jited_bytes: info.size_jitted(),
            verified_insns: info.verified_instruction_count().unwrap_or(0),
        });
    }
    let metas = cases
        .iter()
        .map(|c| CaseMeta {
            name: c.name,
            object: c.object,
            prog: c.prog,
            hook: c.hook,
            like: c.like,
            verdict: c.verdict,
        })
        .collect();
    replies
        .send(Ok(Reply::Ready(metas, progs)))
        .map_err(|_| anyhow!("main thread gone"))?;
    let mut out = Vec::new();
    while let Ok(true) = cmds.recv() {
        let mut run = Vec::with_capacity(cases.len());
        for c in &cases {
            run.push(measure(target.as_mut(), c, opts, &mut out).with_context(|| c.name)?);
        }
        replies
            .send(Ok(Reply::Run(run)))
            .map_err(|_| anyhow!("main thread gone"))?;
    }
    Ok(())
}

/// One run of one case: its flow set up again, the warm-up, then the timed samples (ns).
fn measure(t: &mut dyn Target, c: &Case, opts: &MicroOpts, out: &mut Vec<u8>) -> Result<Vec<u32>> {
    t.reset()?;
    for (prog, frame, want) in &c.prime {
        let (v, _) = test_run(t.program(prog), frame, out)?;
        ensure!(
            v == *want,
            "setting the flow up: {prog} returned {v}, not {want}"
        );
    }
    let prog = t.program(c.prog);
    let mut samples = Vec::with_capacity(opts.samples);
    let total = (opts.warmup + opts.samples) as u32;
    for i in 0..total {
        let per;
        let frame: &[u8] = match &c.frames {
            Frames::Fixed(f) => f,
            Frames::PerSample(g) => {
                per = g(i);
                &per
            }
        };
        let before = (i == 0 && c.counter.is_some()).then(|| t.counters());
        let (v, d) = test_run(prog, frame, out)?;
        ensure!(
            v == c.verdict,
            "sample {i}: {} returned {v}, not {}",
            c.prog,
            c.verdict
        );
        if i == 0 {
            if out.as_slice() != frame {
                verify(out).map_err(|e| anyhow!("{e} wrong in the output frame"))?;
            }
            if let (Some(name), Some(before)) = (c.counter, before) {
                let after = t.counters();
                ensure!(
                    after[name] == before[name] + 1,
                    "counter {name} went from {} to {}: not the case's path",
                    before[name],
                    after[name]
                );
            }
        }
        if i >= opts.warmup as u32 {
            samples.push(d.as_nanos().min(u32::MAX as u128) as u32);
        }
    }
    Ok(samples)
}

/// Pins the calling thread to `cpu`.
fn pin_to(cpu: usize) -> Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_setaffinity(0) is this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) != 0 {
            bail!("pin to CPU {cpu}: {}", std::io::Error::last_os_error());
        }
    }
    Ok(())
}
