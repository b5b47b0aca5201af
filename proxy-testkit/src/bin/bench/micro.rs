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
    ether, in_private_netns, sock, test_run, verify,
};
use proxy_userspace::datapath::loader::MapSizes;

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
    /// Katran's balancer object (`balancer.bpf.o`, built from Katran's source as README.md
    /// describes); without it Katran's rows are left out.
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
    let bpf = |cmd: libc::c_long, attr: &mut [u64; 16]| -> std::io::Result<libc::c_long> {
        // SAFETY: `attr` is a writable, zero-padded `union bpf_attr`; the pointers in it
        // point at live buffers of the caller of the size it says.
        let r = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                cmd,
                attr.as_mut_ptr(),
                std::mem::size_of_val(attr) as libc::c_uint,
            )
        };
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(r)
        }
    };
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

// ---------------------------------------------------------------------------------------
// ebpf-proxy
// ---------------------------------------------------------------------------------------

/// Node `node-1` (this node, 192.0.2.50) and `node-2`:
/// - `local`: endpoint 10.0.1.5 on this node: node ports 30080/TCP, 30053/UDP; cluster IP
///   10.96.0.10;
/// - `remote`: endpoint 10.0.2.7 on node-2 (source-NATed): node ports 30081/TCP,
///   30054/UDP.
///
/// (A part of the packet tests' objects.)
const OBJECTS: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: node-1}
status: {addresses: [{type: InternalIP, address: 192.0.2.50}]}
---
apiVersion: v1
kind: Service
metadata: {name: local, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, protocol: TCP, nodePort: 30080}, {name: dns, port: 53, protocol: UDP, nodePort: 30053}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: local-v4, namespace: default, labels: {kubernetes.io/service-name: local}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 5353, protocol: UDP}]
endpoints: [{addresses: [10.0.1.5], nodeName: node-1}]
---
apiVersion: v1
kind: Service
metadata: {name: remote, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.11
  ports: [{name: http, port: 80, protocol: TCP, nodePort: 30081}, {name: dns, port: 53, protocol: UDP, nodePort: 30054}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: remote-v4, namespace: default, labels: {kubernetes.io/service-name: remote}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 5353, protocol: UDP}]
endpoints: [{addresses: [10.0.2.7], nodeName: node-2}]
"#;

/// Node `node-1` and two Services in `dsr` mode: `dsr-out` with its endpoint on node-2
/// (this node is the entry node): node port 30091; `dsr-in` with its endpoint 10.0.1.5 on
/// this node (the backend's node of flows entering at another node): node port 30093.
const DSR_OBJECTS: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: node-1}
status: {addresses: [{type: InternalIP, address: 192.0.2.50}]}
---
apiVersion: v1
kind: Service
metadata: {name: dsr-out, namespace: default, annotations: {ebpf-proxy.io/north-south-mode: dsr}}
spec:
  type: NodePort
  clusterIP: 10.96.0.40
  ports: [{name: http, port: 80, protocol: TCP, nodePort: 30091}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dsr-out-v4, namespace: default, labels: {kubernetes.io/service-name: dsr-out}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints: [{addresses: [10.0.2.7], nodeName: node-2}]
---
apiVersion: v1
kind: Service
metadata: {name: dsr-in, namespace: default, annotations: {ebpf-proxy.io/north-south-mode: dsr}}
spec:
  type: NodePort
  clusterIP: 10.96.0.41
  ports: [{name: http, port: 80, protocol: TCP, nodePort: 30093}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dsr-in-v4, namespace: default, labels: {kubernetes.io/service-name: dsr-in}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints: [{addresses: [10.0.1.5], nodeName: node-1}]
"#;

const NODE: &str = "192.0.2.50";
/// Another node: the entry node of the DSR flows this node's endpoint serves.
const OTHER_NODE: &str = "192.0.2.60";
const CLIENT: &str = "198.51.100.7";
const LOCAL: &str = "10.0.1.5";
const REMOTE: &str = "10.0.2.7";
/// A bypassed pod on this node, and the cluster IP of `local`.
const POD: &str = "10.0.1.20";
const CLUSTER_IP: &str = "10.96.0.10";

const INGRESS: &str = "tc_ingress";
const EGRESS: &str = "tc_egress";
const POD_INGRESS: &str = "pod_ingress";
const POD_EGRESS: &str = "pod_egress";

/// ebpf-proxy's object loaded in this namespace, seeded with `objects` on node-1; room for
/// a run's new flows in the conntrack.
fn harness(name: &str, objects: &str) -> Harness {
    let h = Harness::with_sizes(
        name,
        MapSizes {
            frontends: 1024,
            slots: 1024,
            backends: 1024,
            sockets: 1024,
            conntrack_flows: 65536,
        },
    );
    h.seed(objects, "node-1", &TcOptions::default());
    h
}

fn tcp(src: &str, sport: u16, dst: &str, dport: u16, flags: u8) -> Packet {
    Packet::tcp(&sock(src, sport), &sock(dst, dport), flags)
}

/// A data segment ("hello").
fn data(src: &str, sport: u16, dst: &str, dport: u16) -> Vec<u8> {
    tcp(src, sport, dst, dport, PSH | ACK).frame()
}

fn syn(src: &str, sport: u16, dst: &str, dport: u16) -> Vec<u8> {
    tcp(src, sport, dst, dport, SYN).frame()
}

/// The handshake of client:`cport` -> node port `nport`, backend `backend`:8080 on this
/// node, through tc: SYN at ingress, SYN-ACK at egress, ACK at ingress.
fn local_handshake(c: Case, cport: u16, nport: u16) -> Case {
    c.prime(INGRESS, syn(CLIENT, cport, NODE, nport), PASS)
        .prime(
            EGRESS,
            tcp(LOCAL, 8080, CLIENT, cport, SYN | ACK).frame(),
            PASS,
        )
        .prime(INGRESS, tcp(CLIENT, cport, NODE, nport, ACK).frame(), PASS)
}

/// Cases without routes: flows to a backend on this node, new flows, UDP, ICMP, the pod
/// path.
fn node_cases() -> Vec<Case> {
    use Hook::Tc;
    use Like::{New, Tracked};
    let udp = Packet::udp(&sock(CLIENT, 40001), &sock(NODE, 30053)).frame();
    let dnat_udp = Packet::udp(&sock(CLIENT, 40002), &sock(LOCAL, 5353));
    let icmp = Packet::icmp_error(LOCAL, CLIENT, 3, 3, &dnat_udp.ip(), 64).frame();
    let pod_syn = Packet::tcp(&sock(POD, 45100), &sock(CLUSTER_IP, 80), SYN).frame();
    vec![
        local_handshake(
            Case::new(
                "TCP data, tracked, backend on this node",
                INGRESS,
                Tc,
                Tracked,
            ),
            40000,
            30080,
        )
        .counter("tc_translated")
        .frame(data(CLIENT, 40000, NODE, 30080)),
        local_handshake(
            Case::new(
                "TCP reply, tracked, backend on this node",
                EGRESS,
                Tc,
                Tracked,
            ),
            40000,
            30080,
        )
        .counter("tc_translated")
        .frame(data(LOCAL, 8080, CLIENT, 40000)),
        Case::new("SYN of a new flow, backend on this node", INGRESS, Tc, New)
            .counter("tc_new_flow")
            .per_sample(|i| syn(CLIENT, (NEW_PORT_BASE + i) as u16, NODE, 30080)),
        Case::new("UDP datagram, tracked", INGRESS, Tc, Tracked)
            .prime(INGRESS, udp.clone(), PASS)
            .counter("tc_translated")
            .frame(udp),
        Case::new(
            "ICMP port unreachable quoting a DNATed datagram",
            EGRESS,
            Tc,
            Tracked,
        )
        .prime(
            INGRESS,
            Packet::udp(&sock(CLIENT, 40002), &sock(NODE, 30053)).frame(),
            PASS,
        )
        .counter("tc_icmp_translated")
        .frame(icmp),
        Case::new(
            "pod: TCP data to a cluster IP, tracked",
            POD_INGRESS,
            Tc,
            Tracked,
        )
        .prime(POD_INGRESS, pod_syn.clone(), PASS)
        .counter("tc_translated")
        .frame(data(POD, 45100, CLUSTER_IP, 80)),
        Case::new(
            "pod: TCP reply into the pod, tracked",
            POD_EGRESS,
            Tc,
            Tracked,
        )
        .prime(POD_INGRESS, pod_syn, PASS)
        .counter("tc_translated")
        .frame(data(LOCAL, 8080, POD, 45100)),
        Case::new(
            "pod: SYN of a new flow to a cluster IP",
            POD_INGRESS,
            Tc,
            New,
        )
        .counter("tc_new_flow")
        .per_sample(|i| {
            Packet::tcp(
                &sock(POD, (NEW_PORT_BASE + i) as u16),
                &sock(CLUSTER_IP, 80),
                SYN,
            )
            .frame()
        }),
    ]
}

/// Cases that leave through a FIB lookup: source-NATed flows through tc and XDP.
fn routed_cases() -> Vec<Case> {
    use Hook::{Tc, Xdp};
    use Like::{New, Tracked};
    // tc: client:42000 -> node port 30081 -> 10.0.2.7:8080, source-NATed to the node
    // address keeping the client's port (free).
    let tc_flow = |c: Case| {
        c.prime(INGRESS, syn(CLIENT, 42000, NODE, 30081), PASS)
            .prime(EGRESS, syn(CLIENT, 42000, REMOTE, 8080), PASS)
            .prime(
                INGRESS,
                tcp(REMOTE, 8080, NODE, 42000, SYN | ACK).frame(),
                REDIRECT,
            )
    };
    // XDP: client:45000 -> node port 30081, both translations at once.
    let xdp_flow = |c: Case| {
        c.prime(XDP, syn(CLIENT, 45000, NODE, 30081), XDP_REDIRECT)
            .prime(
                XDP,
                tcp(REMOTE, 8080, NODE, 45000, SYN | ACK).frame(),
                XDP_REDIRECT,
            )
    };
    vec![
        tc_flow(Case::new(
            "TCP data to a remote backend (DNAT)",
            INGRESS,
            Tc,
            Tracked,
        ))
        .counter("tc_translated")
        .frame(data(CLIENT, 42000, NODE, 30081)),
        tc_flow(Case::new(
            "TCP data to a remote backend, SNAT stage",
            EGRESS,
            Tc,
            Tracked,
        ))
        .counter("tc_translated")
        .frame(data(CLIENT, 42000, REMOTE, 8080)),
        tc_flow(Case::new(
            "TCP reply of a remote backend (reverse SNAT and DNAT, sent on)",
            INGRESS,
            Tc,
            Tracked,
        ))
        .verdict(REDIRECT)
        .counter("tc_translated")
        .frame(data(REMOTE, 8080, NODE, 42000)),
        xdp_flow(Case::new(
            "XDP: TCP data to a remote backend (DNAT and SNAT, sent on)",
            XDP,
            Xdp,
            Tracked,
        ))
        .verdict(XDP_REDIRECT)
        .counter("xdp_forwarded")
        .frame(data(CLIENT, 45000, NODE, 30081)),
        xdp_flow(Case::new(
            "XDP: TCP reply of a remote backend (sent on)",
            XDP,
            Xdp,
            Tracked,
        ))
        .verdict(XDP_REDIRECT)
        .counter("xdp_forwarded")
        .frame(data(REMOTE, 8080, NODE, 45000)),
        Case::new(
            "XDP: SYN of a new flow to a remote backend (sent on)",
            XDP,
            Xdp,
            New,
        )
        .verdict(XDP_REDIRECT)
        .counter("tc_new_flow")
        .per_sample(|i| syn(CLIENT, (NEW_PORT_BASE + i) as u16, NODE, 30081)),
        Case::new(
            "XDP: TCP data, backend on this node (left to tc)",
            XDP,
            Xdp,
            Tracked,
        )
        .prime(XDP, syn(CLIENT, 45001, NODE, 30080), XDP_PASS)
        .verdict(XDP_PASS)
        .frame(data(CLIENT, 45001, NODE, 30080)),
    ]
}

/// IP packet `inner` inside the outer IPv4 header ebpf-proxy's DSR writes (TOS copied, DF,
/// TTL 64, protocol 4) from `src` to `dst` (as the packet tests build it).
fn encapsulated(inner: &[u8], src: &str, dst: &str) -> Vec<u8> {
    let (s, d): (std::net::Ipv4Addr, std::net::Ipv4Addr) =
        (src.parse().expect("src"), dst.parse().expect("dst"));
    let mut h = vec![0u8; 20];
    h[0] = 0x45;
    h[1] = inner[1];
    h[2..4].copy_from_slice(&((20 + inner.len()) as u16).to_be_bytes());
    h[6] = 0x40;
    h[8] = 64;
    h[9] = 4;
    h[12..16].copy_from_slice(&s.octets());
    h[16..20].copy_from_slice(&d.octets());
    let c = proxy_testkit::progrun::checksum(&h);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    h.extend_from_slice(inner);
    ether(&h, false)
}

/// Direct server return: the entry node and the backend's node.
fn dsr_cases() -> Vec<Case> {
    use Hook::Tc;
    use Like::Tracked;
    let entry = |c: Case| {
        c.prime(INGRESS, syn(CLIENT, 46000, NODE, 30091), REDIRECT)
            .prime(
                INGRESS,
                tcp(CLIENT, 46000, NODE, 30091, ACK).frame(),
                REDIRECT,
            )
    };
    let inner_syn = tcp(CLIENT, 46010, OTHER_NODE, 30093, SYN).ip();
    let accepted =
        move |c: Case| c.prime(INGRESS, encapsulated(&inner_syn, OTHER_NODE, LOCAL), PASS);
    let inner_data = tcp(CLIENT, 46010, OTHER_NODE, 30093, PSH | ACK).ip();
    vec![
        entry(Case::new(
            "DSR entry node: TCP data, tracked (encapsulated, sent on)",
            INGRESS,
            Tc,
            Tracked,
        ))
        .verdict(REDIRECT)
        .counter("tc_dsr_encapsulated")
        .frame(data(CLIENT, 46000, NODE, 30091)),
        accepted.clone()(Case::new(
            "DSR backend node: encapsulated TCP data, tracked (decapsulated, DNAT)",
            INGRESS,
            Tc,
            Tracked,
        ))
        .counter("tc_translated")
        .frame(encapsulated(&inner_data, OTHER_NODE, LOCAL)),
        accepted(Case::new(
            "DSR backend node: TCP reply (from the frontend)",
            EGRESS,
            Tc,
            Tracked,
        ))
        .counter("tc_translated")
        .frame(data(LOCAL, 8080, CLIENT, 46010)),
    ]
}

/// Routes of the XDP and DSR cases, in this thread's namespace: an interface `xf0` (a
/// veth; its peer `xf1` only gives it a carrier) with the node's address, the other node's
/// pod network (10.0.2.0/24) behind a router with a neighbour entry, the client's network
/// (198.51.100.0/24) behind another; forwarding on (the FIB lookup refuses otherwise).
/// The packet tests' setup.
fn routes() -> Result<()> {
    let ip = |args: &str| -> Result<()> {
        let st = Command::new("ip")
            .args(args.split_whitespace())
            .status()
            .context("run ip")?;
        ensure!(st.success(), "ip {args}");
        Ok(())
    };
    fs::write("/proc/sys/net/ipv4/ip_forward", "1").context("ip_forward")?;
    ip("link add xf0 address 02:00:00:00:00:50 type veth peer name xf1")?;
    ip("link set lo up")?;
    ip("link set xf1 up")?;
    ip("link set xf0 up")?;
    ip("addr add 192.0.2.50/24 dev xf0")?;
    ip("route add 10.0.2.0/24 via 192.0.2.2 dev xf0")?;
    ip("route add 198.51.100.0/24 via 192.0.2.1 dev xf0")?;
    ip("neigh add 192.0.2.2 lladdr 02:00:00:00:00:22 dev xf0 nud permanent")?;
    ip("neigh add 192.0.2.1 lladdr 02:00:00:00:00:11 dev xf0 nud permanent")?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// the floor
// ---------------------------------------------------------------------------------------

/// The floor's programs (proxy-ebpf/src/bin/floor.rs): direct access, the helpers'
/// access, and empty (what the measurement adds), per hook.
const FLOOR_TC: &str = "floor_tc";
const FLOOR_TC_HELPERS: &str = "floor_tc_helpers";
const FLOOR_TC_PASS: &str = "floor_tc_pass";
const FLOOR_XDP: &str = "floor_xdp";
const FLOOR_XDP_HELPERS: &str = "floor_xdp_helpers";
const FLOOR_XDP_PASS: &str = "floor_xdp_pass";

/// The floor object loaded, its flow table holding the flow of the tracked TCP case
/// (client:40000 -> node port 30080, to 10.0.1.5:8080 on ifindex 1).
fn floor_object(path: &Path) -> Result<Object> {
    let mut ebpf = EbpfLoader::new()
        .load_file(path)
        .with_context(|| format!("load {}", path.display()))?;
    for p in [FLOOR_TC, FLOOR_TC_HELPERS, FLOOR_TC_PASS] {
        let prog: &mut SchedClassifier = ebpf.program_mut(p).context(p)?.try_into()?;
        prog.load().with_context(|| format!("load {p}"))?;
    }
    for p in [FLOOR_XDP, FLOOR_XDP_HELPERS, FLOOR_XDP_PASS] {
        let prog: &mut Xdp = ebpf.program_mut(p).context(p)?.try_into()?;
        prog.load().with_context(|| format!("load {p}"))?;
    }
    // FloorKey and FloorTarget of proxy-ebpf/src/bin/floor.rs.
    let ip = |s: &str| s.parse::<std::net::Ipv4Addr>().expect("address").octets();
    let mut key = [0u8; 16];
    key[0..4].copy_from_slice(&ip(CLIENT));
    key[4..8].copy_from_slice(&ip(NODE));
    key[8..10].copy_from_slice(&40000u16.to_be_bytes());
    key[10..12].copy_from_slice(&30080u16.to_be_bytes());
    key[12..16].copy_from_slice(&6u32.to_le_bytes());
    let mut to = [0u8; 12];
    to[0..4].copy_from_slice(&ip(LOCAL));
    to[4..6].copy_from_slice(&8080u16.to_be_bytes());
    to[8..12].copy_from_slice(&1u32.to_ne_bytes());
    let mut flows: BpfHash<&mut MapData, [u8; 16], [u8; 12]> =
        BpfHash::try_from(ebpf.map_mut("FLOOR_FLOWS").context("FLOOR_FLOWS")?)?;
    flows.insert(key, to, 0)?;
    Ok(Object { ebpf, lru: false })
}

fn floor_cases() -> Vec<Case> {
    let frame = data(CLIENT, 40000, NODE, 30080);
    let floor = |name, prog, hook, verdict| {
        Case::new(name, prog, hook, Like::Anchor)
            .object("floor")
            .verdict(verdict)
            .frame(frame.clone())
    };
    vec![
        floor("floor: tc, direct access", FLOOR_TC, Hook::Tc, REDIRECT),
        floor(
            "floor: tc, through the skb helpers",
            FLOOR_TC_HELPERS,
            Hook::Tc,
            REDIRECT,
        ),
        floor("floor: tc, empty program", FLOOR_TC_PASS, Hook::Tc, PASS),
        floor(
            "floor: XDP, direct access",
            FLOOR_XDP,
            Hook::Xdp,
            XDP_REDIRECT,
        ),
        floor(
            "floor: XDP, through bpf_xdp_load/store_bytes",
            FLOOR_XDP_HELPERS,
            Hook::Xdp,
            XDP_REDIRECT,
        ),
        floor(
            "floor: XDP, empty program",
            FLOOR_XDP_PASS,
            Hook::Xdp,
            XDP_PASS,
        ),
    ]
}

// ---------------------------------------------------------------------------------------
// Katran
// ---------------------------------------------------------------------------------------

/// Katran's `struct flow_key` (balancer_structs.h): src[16], dst[16], ports, proto, pad.
type KatranFlowKey = [u8; 40];
/// `RING_SIZE` (balancer_consts.h): ring positions per VIP.
const KATRAN_RING: u32 = 65537;
/// `F_LRU_BYPASS` (balancer_consts.h, VIP flags).
const KATRAN_F_LRU_BYPASS: u32 = 1 << 1;
const KATRAN_PROG: &str = "balancer_ingress";
/// The tester's client and VIPs (KatranTestFixtures.h).
const K_CLIENT: &str = "192.168.1.1";
const K_VIP: &str = "10.200.1.1";
const K_VIP_BYPASS: &str = "10.200.1.2";

fn katran_object(path: &Path) -> Result<Object> {
    let mut ebpf = EbpfLoader::new()
        .map_max_entries("ch_rings", 2 * KATRAN_RING)
        .map_max_entries("fallback_cache", 65536)
        .load_file(path)
        .with_context(|| format!("load {}", path.display()))?;
    let prog: &mut Xdp = ebpf
        .program_mut(KATRAN_PROG)
        .context(KATRAN_PROG)?
        .try_into()?;
    prog.load().context("load balancer_ingress")?;
    let ip = |s: &str| s.parse::<std::net::Ipv4Addr>().expect("address").octets();
    // vip_map: struct vip_definition {addr[16], port (network order), proto, pad} ->
    // struct vip_meta {flags, vip_num}.
    {
        let mut vips: BpfHash<&mut MapData, [u8; 20], [u8; 8]> =
            BpfHash::try_from(ebpf.map_mut("vip_map").context("vip_map")?)?;
        for (num, (vip, flags)) in [(K_VIP, 0u32), (K_VIP_BYPASS, KATRAN_F_LRU_BYPASS)]
            .into_iter()
            .enumerate()
        {
            let mut k = [0u8; 20];
            k[0..4].copy_from_slice(&ip(vip));
            k[16..18].copy_from_slice(&80u16.to_be_bytes());
            k[18] = 6;
            let mut v = [0u8; 8];
            v[0..4].copy_from_slice(&flags.to_ne_bytes());
            v[4..8].copy_from_slice(&(num as u32).to_ne_bytes());
            vips.insert(k, v, 0)?;
        }
    }
    // reals: id -> struct real_definition {dst[16], flags, pad}; ids start at 1.
    {
        let mut reals: Array<&mut MapData, [u8; 20]> =
            Array::try_from(ebpf.map_mut("reals").context("reals")?)?;
        for id in 1..=3u32 {
            let mut r = [0u8; 20];
            r[0..4].copy_from_slice(&ip(&format!("10.0.0.{id}")));
            reals.set(id, r, 0)?;
        }
    }
    // ch_rings: vip_num * RING_SIZE + position -> real id.
    {
        let mut ring: Array<&mut MapData, u32> =
            Array::try_from(ebpf.map_mut("ch_rings").context("ch_rings")?)?;
        for vip in 0..2 {
            for pos in 0..KATRAN_RING {
                ring.set(vip * KATRAN_RING + pos, pos % 3 + 1, 0)?;
            }
        }
    }
    // ctl_array[0]: the default router's MAC (kDefaultMac).
    {
        let mut ctl: Array<&mut MapData, [u8; 8]> =
            Array::try_from(ebpf.map_mut("ctl_array").context("ctl_array")?)?;
        ctl.set(0, [0x00, 0x00, 0xde, 0xad, 0xbe, 0xaf, 0, 0], 0)?;
    }
    Ok(Object { ebpf, lru: true })
}

fn katran_cases() -> Vec<Case> {
    vec![
        Case::new(
            "Katran: TCP data, known flow (LRU hit)",
            KATRAN_PROG,
            Hook::Xdp,
            Like::Anchor,
        )
        .object("katran")
        .prime(KATRAN_PROG, syn(K_CLIENT, 31337, K_VIP, 80), XDP_TX)
        .verdict(XDP_TX)
        .frame(data(K_CLIENT, 31337, K_VIP, 80)),
        Case::new(
            "Katran: SYN of a new flow",
            KATRAN_PROG,
            Hook::Xdp,
            Like::Anchor,
        )
        .object("katran")
        .verdict(XDP_TX)
        .per_sample(|i| syn(K_CLIENT, (NEW_PORT_BASE + i) as u16, K_VIP, 80)),
        Case::new(
            "Katran: TCP data, LRU bypassed (its perf-testing mode)",
            KATRAN_PROG,
            Hook::Xdp,
            Like::Anchor,
        )
        .object("katran")
        .verdict(XDP_TX)
        .frame(data(K_CLIENT, 31337, K_VIP_BYPASS, 80)),
    ]
}

// ---------------------------------------------------------------------------------------
// report
// ---------------------------------------------------------------------------------------

/// One case's figures, nanoseconds.
#[derive(Clone, Debug, serde::Serialize)]
struct Row {
    #[serde(flatten)]
    case: CaseMeta,
    samples: usize,
    median: f64,
    p10: f64,
    p90: f64,
    /// The lowest and highest of the runs' medians.
    run_median_min: f64,
    run_median_max: f64,
    /// Median less the empty program's of the case's hook: what the program itself takes.
    net: Option<f64>,
    /// Median over the floor of the case's hook, and over Katran's comparable packet.
    x_floor: Option<f64>,
    x_katran: Option<f64>,
}

impl Row {
    fn new(case: CaseMeta, runs: &[Vec<u32>]) -> Row {
        let sorted = |v: &mut Vec<f64>| v.sort_by(f64::total_cmp);
        let mut all: Vec<f64> = runs.iter().flatten().map(|&x| x as f64).collect();
        sorted(&mut all);
        let mut meds: Vec<f64> = runs
            .iter()
            .map(|r| {
                let mut r: Vec<f64> = r.iter().map(|&x| x as f64).collect();
                sorted(&mut r);
                crate::report::percentile(&r, 50.0)
            })
            .collect();
        sorted(&mut meds);
        Row {
            case,
            samples: all.len(),
            median: crate::report::percentile(&all, 50.0),
            p10: crate::report::percentile(&all, 10.0),
            p90: crate::report::percentile(&all, 90.0),
            run_median_min: meds.first().copied().unwrap_or(f64::NAN),
            run_median_max: meds.last().copied().unwrap_or(f64::NAN),
            net: None,
            x_floor: None,
            x_katran: None,
        }
    }
}

#[derive(Debug, serde::Serialize)]
struct Report {
    runs: usize,
    samples_per_run: usize,
    warmup: usize,
    cpu: Option<usize>,
    kernel: String,
    katran_object: Option<PathBuf>,
    rows: Vec<Row>,
    programs: Vec<ProgMeta>,
}

impl Report {
    fn new(opts: &MicroOpts, mut rows: Vec<Row>, programs: Vec<ProgMeta>) -> Report {
        let median_of = |rows: &[Row], prog: &str| {
            rows.iter()
                .find(|r| r.case.prog == prog && r.case.object != "ebpf-proxy")
                .map(|r| r.median)
        };
        let floor_tc = median_of(&rows, FLOOR_TC);
        let floor_xdp = median_of(&rows, FLOOR_XDP);
        let empty_tc = median_of(&rows, FLOOR_TC_PASS);
        let empty_xdp = median_of(&rows, FLOOR_XDP_PASS);
        let katran = |name: &str| rows.iter().find(|r| r.case.name == name).map(|r| r.median);
        let k_tracked = katran("Katran: TCP data, known flow (LRU hit)");
        let k_new = katran("Katran: SYN of a new flow");
        for r in &mut rows {
            let (floor, empty) = match r.case.hook {
                Hook::Tc => (floor_tc, empty_tc),
                Hook::Xdp => (floor_xdp, empty_xdp),
            };
            r.x_floor = floor.map(|f| r.median / f);
            r.net = empty.map(|e| r.median - e);
            let k = match r.case.like {
                Like::Tracked => k_tracked,
                Like::New => k_new,
                Like::Anchor => None,
            };
            r.x_katran = k.map(|k| r.median / k);
        }
        Report {
            runs: opts.runs,
            samples_per_run: opts.samples,
            warmup: opts.warmup,
            cpu: opts.cpu,
            kernel: fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .to_string(),
            katran_object: opts.katran_object.clone(),
            rows,
            programs,
        }
    }

    fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# ebpf-proxy packet programs, ns per packet (BPF_PROG_TEST_RUN)\n\n\
             Kernel {}; {} runs x {} samples per case (after {} warm-up runs each){}. \
             Median, p10 and p90 over every sample; the range of the runs' medians; net: \
             the median less the empty program's of the same hook (what the measurement \
             adds); the median over the floor of the case's hook (tc: `floor_tc`, XDP: \
             `floor_xdp`) and over Katran's comparable packet (a known flow, or a new \
             flow's SYN).\n",
            self.kernel,
            self.runs,
            self.samples_per_run,
            self.warmup,
            self.cpu
                .map(|c| format!(", pinned to CPU {c}"))
                .unwrap_or_default()
        );
        let _ = writeln!(
            s,
            "| case | program | median | p10 | p90 | run medians | net | x floor | x Katran |\n\
             |---|---|---:|---:|---:|---:|---:|---:|---:|"
        );
        let x = |v: Option<f64>| v.map(|v| format!("{v:.2}")).unwrap_or_else(|| "-".into());
        for r in &self.rows {
            let _ = writeln!(
                s,
                "| {} | {} | {:.0} | {:.0} | {:.0} | {:.0}-{:.0} | {} | {} | {} |",
                r.case.name,
                r.case.prog,
                r.median,
                r.p10,
                r.p90,
                r.run_median_min,
                r.run_median_max,
                r.net
                    .map(|v| format!("{v:.0}"))
                    .unwrap_or_else(|| "-".into()),
                x(r.x_floor),
                x(r.x_katran)
            );
        }
        let _ = writeln!(
            s,
            "\n## Programs\n\n\
             Instructions after the verifier's rewrites (xlated), machine code bytes, and \
             instructions the verifier processed over every path it explored.\n\n\
             | object | program | xlated insns | jited bytes | verified insns |\n\
             |---|---|---:|---:|---:|"
        );
        for p in &self.programs {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} |",
                p.object, p.prog, p.xlated_insns, p.jited_bytes, p.verified_insns
            );
        }
        s
    }
}
