//! The report's summary: the programs' costs, the control-plane and data-path targets
//! (each met or missed) and the headline tables.

use std::fmt::Write as _;

use super::{Case, Results};

impl Results {
    /// The kernel's statistics of ebpf-proxy's programs during the data-path runs: time per
    /// invocation, invocations per connection, time per connection (median over runs).
    pub fn program_costs(&self) -> String {
        let mut o = String::new();
        let any = self
            .services
            .iter()
            .any(|&n| self.get(Case::Ebpf, n, "bpf_ns_per_conn").is_some());
        if !any {
            return o;
        }
        let _ = writeln!(
            o,
            "\n### Data path: BPF time per TCP connection (kernel program statistics)\n"
        );
        let _ = writeln!(
            o,
            "Per program: ns per invocation x invocations per connection = ns per connection (`BPF_ENABLE_STATS`, over the whole client run; programs that did not run are left out).\n"
        );
        let mut head = String::from("| program |");
        let mut rule = String::from("| --- |");
        for &n in &self.services {
            let _ = write!(head, " N = {n} |");
            rule.push_str(" ---: |");
        }
        let _ = writeln!(o, "{head}\n{rule}");
        for (prog, _) in crate::progstats::PROGRAMS {
            let cells: Vec<String> = self
                .services
                .iter()
                .map(|&n| {
                    let g = |m: &str| self.get(Case::Ebpf, n, &format!("{m}:{prog}"));
                    match (g("ns_per_run"), g("runs_per_conn"), g("ns_per_conn")) {
                        (Some(a), Some(b), Some(c)) if b.med > 0.0 => {
                            format!("{:.0} x {:.2} = {:.0}", a.med, b.med, c.med)
                        }
                        _ => String::new(),
                    }
                })
                .collect();
            if cells.iter().all(|c| c.is_empty()) {
                continue;
            }
            let _ = writeln!(o, "| {prog} | {} |", cells.join(" | "));
        }
        let total: Vec<String> = self
            .services
            .iter()
            .map(|&n| self.cell(Case::Ebpf, n, "bpf_ns_per_conn", 0))
            .collect();
        let _ = writeln!(o, "| **all programs** | {} |", total.join(" | "));
        let floor = |m: &str| -> Vec<String> {
            self.services
                .iter()
                .map(|&n| match self.get(Case::Ebpf, n, m) {
                    Some(s) => format!("{:.0}", s.med),
                    None => "–".into(),
                })
                .collect()
        };
        if self
            .services
            .iter()
            .any(|&n| self.get(Case::Ebpf, n, "above_floor:all").is_some())
        {
            for (hook, what) in [
                ("connect4", "`sock_addr` hooks"),
                ("sock_release", "`sock_release`"),
            ] {
                let _ = writeln!(
                    o,
                    "| floor: a program that only returns, {what} (ns per invocation) | {} |",
                    floor(&format!("ns_per_run:floor:{hook}")).join(" | ")
                );
            }
            let _ = writeln!(
                o,
                "| **all programs above the floor** | {} |",
                floor("above_floor:all").join(" | ")
            );
            let _ = writeln!(
                o,
                "\nThe floor is what the statistics count for any program on the hook (their clock read and the call into the program; the hook's dispatch is outside every program's figures), measured by programs that only return, attached next to ebpf-proxy's for the same connections and run after them; \"above the floor\" is ebpf-proxy's own work (each program's time per invocation less its hook's floor, times its invocations per connection; the packet programs have no floor subtracted). Each row is its own median over the runs, so the rows need not subtract exactly."
            );
        }
        o
    }

    /// The control-plane targets of ebpf-proxy (agent with the manifest source, N services x
    /// 10 endpoints), each with what this run measured and whether it is met.
    pub fn targets(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "### Control-plane targets\n");
        let _ = writeln!(o, "| target | N | measured | limit | met |");
        let _ = writeln!(o, "| --- | ---: | ---: | ---: | --- |");
        for (what, m, n, statistic, limit, unit) in CONTROL_PLANE_TARGETS {
            let Some(s) = self.get(Case::Ebpf, n, m) else {
                continue;
            };
            let (v, shown) = match statistic {
                "p99" => (
                    s.p99,
                    format!("{:.2} (median {:.2}, {} changes)", s.p99, s.med, s.n),
                ),
                "med" => (
                    s.med,
                    format!("{:.2} (p99 {:.2}, {} changes)", s.med, s.p99, s.n),
                ),
                _ => (s.med, self.cell(Case::Ebpf, n, m, 0)),
            };
            let met = if v <= limit { "met" } else { "missed" };
            let _ = writeln!(
                o,
                "| {what} | {n} | {shown} {unit} | ≤ {limit} {unit} | {met} |"
            );
        }
        o.push('\n');
        o
    }

    /// The socket-path targets at every N measured: BPF time per TCP connection (all
    /// programs, statistics' floor included, median over runs) at most 500 ns, and new
    /// connections per second at least 0.98 of direct (ratio of the medians). A ratio below
    /// 0.98 whose min–max range overlaps direct's is "within the spread": the runs cannot
    /// tell it from direct.
    pub fn data_path_targets(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "### Socket-path targets\n");
        let _ = writeln!(o, "| target | N | measured | limit | met |");
        let _ = writeln!(o, "| --- | ---: | ---: | ---: | --- |");
        let mut any = false;
        for &n in &self.services {
            if let Some(s) = self.get(Case::Ebpf, n, "bpf_ns_per_conn") {
                any = true;
                let met = if s.med <= 500.0 { "met" } else { "missed" };
                let _ = writeln!(
                    o,
                    "| BPF time per TCP connection, all programs | {n} | {:.0} ({:.0}–{:.0}) ns | ≤ 500 ns | {met} |",
                    s.med, s.min, s.max
                );
            }
        }
        for &n in &self.services {
            if let (Some(e), Some(d)) = (
                self.get(Case::Ebpf, n, "cps"),
                self.get(Case::Direct, n, "cps"),
            ) && d.med > 0.0
            {
                any = true;
                let r = e.med / d.med;
                let met = if r >= 0.98 {
                    "met"
                } else if e.max >= d.min {
                    "within the spread"
                } else {
                    "missed"
                };
                let _ = writeln!(
                    o,
                    "| new connections per second, ratio to direct | {n} | {r:.2} ({:.0}–{:.0} vs {:.0}–{:.0}) | ≥ 0.98 | {met} |",
                    e.min, e.max, d.min, d.max
                );
            }
        }
        if !any {
            return String::new();
        }
        o.push('\n');
        o
    }

    /// The tables that go into the guide's benchmarks chapters (docs/src/benchmarks*.md).
    pub fn headline(&self) -> String {
        let mut o = String::new();
        if !self.services.is_empty() {
            o.push_str(&self.cluster_ip_tables());
        }
        o.push_str(&self.north_south_tables());
        o
    }
}
/// The control-plane targets of [`Results::targets`]: (what, metric, N, statistic, limit,
/// unit); statistic `p99` is over every change, `med` the median over every change, else
/// (`runs`) the median over runs (min–max shown).
const CONTROL_PLANE_TARGETS: [(&str, &str, usize, &str, f64, &str); 11] = [
    (
        "one endpoint change, watch event → maps written (agent), p99",
        "change_latency_ms",
        10000,
        "p99",
        5.0,
        "ms",
    ),
    (
        "one endpoint change, watch event → maps written (agent), p99",
        "change_latency_ms",
        30000,
        "p99",
        5.0,
        "ms",
    ),
    (
        "one endpoint change, file renamed → visible in the pinned maps, median",
        "change_ms",
        10000,
        "med",
        20.0,
        "ms",
    ),
    (
        "one endpoint change, API source: watch event → maps written (agent), p99",
        "api_change_latency_ms",
        10000,
        "p99",
        5.0,
        "ms",
    ),
    (
        "one endpoint change, API source: watch event → maps written (agent), p99",
        "api_change_latency_ms",
        30000,
        "p99",
        5.0,
        "ms",
    ),
    (
        "agent RSS after the first sync",
        "rss_mib",
        10000,
        "runs",
        100.0,
        "MiB",
    ),
    (
        "agent RSS after the first sync",
        "rss_mib",
        30000,
        "runs",
        250.0,
        "MiB",
    ),
    (
        "agent RSS after its first periodic verification",
        "rss_verified_mib",
        10000,
        "runs",
        100.0,
        "MiB",
    ),
    (
        "agent RSS after its first periodic verification",
        "rss_verified_mib",
        30000,
        "runs",
        250.0,
        "MiB",
    ),
    (
        "cold start, agent process start → first `sync done`",
        "cold_wall_ms",
        30000,
        "runs",
        2000.0,
        "ms",
    ),
    (
        "one endpoint change, file renamed → visible in the pinned maps, median",
        "change_ms",
        30000,
        "med",
        20.0,
        "ms",
    ),
];
