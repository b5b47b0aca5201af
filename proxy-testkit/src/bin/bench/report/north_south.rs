//! The north-south tables: connection and exchange rates, latency, the programs' costs
//! and the problems seen, per case and path.

use std::fmt::Write as _;

use super::{Case, Results};

impl Results {
    /// A north-south cell: median (min–max) of `ns:<path>:<what>`.
    fn ns_cell(&self, case: Case, n: usize, path: &str, what: &str, digits: usize) -> String {
        self.cell(case, n, &format!("ns:{path}:{what}"), digits)
    }

    /// The north-south tables: rates side by side with their ratio to plain routing, TCP
    /// latency, ebpf-proxy's tc program costs, and losses.
    pub fn north_south_tables(&self) -> String {
        let mut o = String::new();
        for &n in &self.north_south {
            o.push_str(&self.ns_rate_table(n));
            o.push_str(&self.ns_latency_table(n));
            o.push_str(&self.ns_program_table(n));
            o.push_str(&self.ns_problems(n));
        }
        o
    }

    /// North-south at `n` ClusterIP services: the section's heading and the rate of every
    /// path, each case with its ratio to plain routing.
    fn ns_rate_table(&self, n: usize) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "\n### North-south: NodePorts from a client outside the cluster (ratio to plain routing), {n} ClusterIP services loaded too\n"
        );
        let _ = writeln!(
            o,
            "TCP: new connections per second, each with a one-line request and reply; UDP: request/reply exchanges per second on one flow (32-byte datagrams, {} in flight).\n",
            32
        );
        let _ = writeln!(o, "| path | {} |", NS_CASES.map(ns_label).join(" | "));
        let _ = writeln!(o, "{}", ns_align());
        for (path, label) in NS_PATHS {
            let m = format!("ns:{path}:rate");
            let cells: Vec<String> = NS_CASES
                .iter()
                .map(|&c| {
                    let v = self.cell(c, n, &m, 0);
                    if c == Case::Direct || v == "–" {
                        v
                    } else {
                        format!("{v} ({})", self.ratio(c, n, &m))
                    }
                })
                .collect();
            let _ = writeln!(o, "| {label} | {} |", cells.join(" | "));
        }
        o
    }

    /// North-south at `n`: p50 / p99 latency of the TCP paths.
    fn ns_latency_table(&self, n: usize) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "\nTCP latency per connection, p50 / p99 (µs):\n\n| path | {} |\n{}",
            NS_CASES.map(ns_label).join(" | "),
            ns_align()
        );
        for (path, label) in NS_PATHS.iter().filter(|(p, _)| p.starts_with("tcp")) {
            let cells: Vec<String> = NS_CASES
                .iter()
                .map(|&c| {
                    format!(
                        "{} / {}",
                        self.ns_cell(c, n, path, "p50_us", 0),
                        self.ns_cell(c, n, path, "p99_us", 0)
                    )
                })
                .collect();
            let _ = writeln!(o, "| {label} | {} |", cells.join(" | "));
        }
        o
    }

    /// North-south at `n`: the cost of ebpf-proxy's programs per path, a row per case and
    /// node whose programs were measured; empty when none were.
    fn ns_program_table(&self, n: usize) -> String {
        let mut o = String::new();
        // (case, node prefix of its metrics, row label): node-a's programs in every
        // ebpf-proxy case, node-b's too with DSR (they decapsulate and answer there).
        let bpf_rows: Vec<(Case, &str, String)> = [
            (Case::Xdp, "", ns_label(Case::Xdp).to_string()),
            (Case::Ebpf, "", ns_label(Case::Ebpf).to_string()),
            (Case::Dsr, "", format!("{}, node-a", ns_label(Case::Dsr))),
            (
                Case::Dsr,
                NODE_B_PREFIX,
                format!("{}, node-b", ns_label(Case::Dsr)),
            ),
        ]
        .into_iter()
        .filter(|(c, node, _)| {
            NS_PATHS.iter().any(|(p, _)| {
                self.get(*c, n, &format!("ns:{p}:{node}bpf_ns_per_flow"))
                    .is_some()
            })
        })
        .collect();
        if bpf_rows.is_empty() {
            return o;
        }
        let _ = writeln!(
            o,
            "\nebpf-proxy's programs (kernel program statistics): ns per packet x packets per TCP connection or UDP exchange, and BPF ns per connection or exchange (warm-up included). node-a's programs in every case; with DSR, node-b's too (plain routing in the other cases):\n"
        );
        let _ = writeln!(
            o,
            "| path | xdp_ingress | tc_ingress | tc_egress | BPF ns per connection / exchange |"
        );
        let _ = writeln!(o, "| --- | ---: | ---: | ---: | ---: |");
        for (c, node, row) in &bpf_rows {
            let c = *c;
            for (path, label) in NS_PATHS {
                // node-b has no part in flows to a0: no row where none of its
                // programs ran.
                if !node.is_empty()
                    && self
                        .get(c, n, &format!("ns:{path}:{node}bpf_ns_per_flow"))
                        .is_none_or(|s| s.max == 0.0)
                {
                    continue;
                }
                let prog = |name: &str| {
                    let g = |m: &str| self.get(c, n, &format!("ns:{path}:{m}:{node}{name}"));
                    match (g("ns_per_run"), g("runs_per_flow")) {
                        (Some(a), Some(b)) => format!("{:.0} x {:.2}", a.med, b.med),
                        _ => "–".into(),
                    }
                };
                let _ = writeln!(
                    o,
                    "| {row}: {label} | {} | {} | {} | {} |",
                    prog("xdp_ingress"),
                    prog("tc_ingress"),
                    prog("tc_egress"),
                    self.ns_cell(c, n, path, &format!("{node}bpf_ns_per_flow"), 0)
                );
            }
        }
        o
    }

    /// North-south at `n`: the failed connections and lost UDP requests of every case and
    /// path; empty when there were none.
    fn ns_problems(&self, n: usize) -> String {
        let mut o = String::new();
        let mut problems = Vec::new();
        for c in NS_CASES {
            for (path, label) in NS_PATHS {
                for (what, unit) in [("errors", "failed"), ("lost", "lost")] {
                    if let Some(s) = self.get(c, n, &format!("ns:{path}:{what}"))
                        && s.max > 0.0
                    {
                        problems.push(format!(
                            "{} — {label}: up to {} {unit} per run",
                            ns_label(c),
                            s.max
                        ));
                    }
                }
            }
        }
        if !problems.is_empty() {
            let _ = writeln!(o, "\nFailed connections and lost UDP requests:\n");
            for p in problems {
                let _ = writeln!(o, "- {p}");
            }
        }
        o
    }
}

/// The column alignment row of the north-south tables: the path, then one right-aligned
/// column per case of [`NS_CASES`].
fn ns_align() -> String {
    format!("| --- |{}", " ---: |".repeat(NS_CASES.len()))
}

/// The north-south cases, in the order of the tables' columns and the chart's bars.
pub(super) const NS_CASES: [Case; 6] = [
    Case::Direct,
    Case::Xdp,
    Case::Ebpf,
    Case::Dsr,
    Case::Nftables,
    Case::Iptables,
];

/// The north-south paths: metric key and label.
const NS_PATHS: [(&str, &str); 4] = [
    ("tcp_local", "TCP conn/s, backend on the node"),
    (
        "tcp_remote",
        "TCP conn/s, backend on another node (SNAT; DSR case: DSR)",
    ),
    ("udp_local", "UDP exchanges/s, backend on the node"),
    (
        "udp_remote",
        "UDP exchanges/s, backend on another node (SNAT; DSR case: DSR)",
    ),
];

/// Prefix of the north-south program metrics of node-b's agent (the DSR case), before the
/// program name (`ns:<path>:ns_per_run:node-b/tc_ingress`) or the metric
/// (`ns:<path>:node-b/bpf_ns_per_flow`).
pub const NODE_B_PREFIX: &str = "node-b/";

/// A case's name in the north-south tables.
pub(super) fn ns_label(c: Case) -> &'static str {
    match c {
        Case::Direct => "plain routing (floor)",
        Case::Ebpf => "ebpf-proxy (tc)",
        // Not a north-south case (see `northsouth::run`).
        Case::Bypass => "ebpf-proxy per packet (bypassed pod)",
        Case::Xdp => "ebpf-proxy (XDP)",
        Case::Dsr => "ebpf-proxy (DSR)",
        Case::Nftables => "kube-proxy nftables rules",
        Case::Iptables => "kube-proxy iptables rules",
    }
}
