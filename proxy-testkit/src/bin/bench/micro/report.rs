//! The report: one row per case, as Markdown and JSON.

use super::*;

/// One case's figures, nanoseconds.
#[derive(Clone, Debug, serde::Serialize)]
pub(super) struct Row {
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
    pub(super) fn new(case: CaseMeta, runs: &[Vec<u32>]) -> Row {
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
pub(super) struct Report {
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
    pub(super) fn new(opts: &MicroOpts, mut rows: Vec<Row>, programs: Vec<ProgMeta>) -> Report {
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

    pub(super) fn markdown(&self) -> String {
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
