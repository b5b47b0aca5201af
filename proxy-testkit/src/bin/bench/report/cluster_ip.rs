//! The ClusterIP tables: cold start, one endpoint change, connection rate and latency,
//! memory.

use std::fmt::Write as _;

use super::{Case, Results};

impl Results {
    /// The socket-path latency and the peers' rule-set sizes (results.md only).
    pub(super) fn cluster_ip_details(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "\n### Data path latency (µs per connection: connect, request, reply, close)\n"
        );
        let _ = writeln!(
            o,
            "| N | direct p50 / p99 | ebpf-proxy p50 / p99 | ebpf-proxy per packet (bypassed pod) p50 / p99 | iptables p50 / p99 | nftables p50 / p99 |"
        );
        let _ = writeln!(o, "| ---: | ---: | ---: | ---: | ---: | ---: |");
        for &n in &self.services {
            let c = |case| {
                format!(
                    "{} / {}",
                    self.cell(case, n, "p50_us", 0),
                    self.cell(case, n, "p99_us", 0)
                )
            };
            let _ = writeln!(
                o,
                "| {n} | {} | {} | {} | {} | {} |",
                c(Case::Direct),
                c(Case::Ebpf),
                c(Case::Bypass),
                c(Case::Iptables),
                c(Case::Nftables)
            );
        }
        let _ = writeln!(
            o,
            "\n### Rule-set size of the peers (lines of restore / nft input)\n"
        );
        let _ = writeln!(o, "| N | iptables-restore lines | nft -f lines |");
        let _ = writeln!(o, "| ---: | ---: | ---: |");
        for &n in &self.services {
            let _ = writeln!(
                o,
                "| {n} | {} | {} |",
                self.cell(Case::Iptables, n, "rule_lines", 0),
                self.cell(Case::Nftables, n, "rule_lines", 0)
            );
        }
        o
    }

    /// The control plane, socket data path and memory tables.
    pub(super) fn cluster_ip_tables(&self) -> String {
        let mut o = String::new();
        o.push_str(&self.targets());
        o.push_str(&self.data_path_targets());
        o.push_str(&self.cold_table());
        o.push_str(&self.change_table());
        o.push_str(&self.connection_rate_table());
        o.push_str(&self.program_costs());
        o.push_str(&self.memory_table());
        o
    }

    /// Programming N services from cold: ebpf-proxy's start to its first sync (and the
    /// sync's parts) against the peers' whole restores.
    fn cold_table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "### Control plane: programming N services from cold (ms)\n"
        );
        let _ = writeln!(
            o,
            "| N | ebpf-proxy start → synced | of which model commit | of which map writes | iptables-restore | nft -f |"
        );
        let _ = writeln!(o, "| ---: | ---: | ---: | ---: | ---: | ---: |");
        for &n in &self.services {
            let _ = writeln!(
                o,
                "| {n} | {} | {} | {} | {} | {} |",
                self.cell(Case::Ebpf, n, "cold_wall_ms", 0),
                self.cell(Case::Ebpf, n, "cold_model_ms", 1),
                self.cell(Case::Ebpf, n, "cold_ms", 1),
                self.cell(Case::Iptables, n, "cold_ms", 0),
                self.cell(Case::Nftables, n, "cold_ms", 0)
            );
        }
        o
    }

    /// One endpoint change at every N of `change_at`: a row per row of [`CHANGE_ROWS`]
    /// that was measured or whose cold load timed out.
    fn change_table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "\n### Control plane: one endpoint change (ms, over all changes of all runs)\n"
        );
        let _ = writeln!(o, "| N | proxy | median | p99 | changes | what is timed |");
        let _ = writeln!(o, "| ---: | --- | ---: | ---: | ---: | --- |");
        for &n in &self.change_at {
            for (label, case, m, what) in CHANGE_ROWS {
                let cell = match self.get(case, n, m) {
                    Some(s) => format!("{:.2} | {:.2} | {}", s.med, s.p99, s.n),
                    None if self.get(case, n, "timed_out_s").is_some()
                        || self.timed_out.get(case.key()).is_some_and(|&t| n >= t) =>
                    {
                        "not run (cold load timed out) | | ".to_string()
                    }
                    None => continue,
                };
                let _ = writeln!(o, "| {n} | {label} | {cell} | {what} |");
            }
        }
        o
    }

    /// New TCP connections per second to one ClusterIP, each proxy with its ratio to
    /// direct.
    fn connection_rate_table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "\n### Data path: new TCP connections per second to one ClusterIP (ratio to direct)\n"
        );
        let _ = writeln!(
            o,
            "| N | direct | ebpf-proxy | ebpf-proxy per packet (bypassed pod) | iptables | nftables |"
        );
        let _ = writeln!(o, "| ---: | ---: | ---: | ---: | ---: | ---: |");
        for &n in &self.services {
            let c = |case| {
                format!(
                    "{} ({})",
                    self.cell(case, n, "cps", 0),
                    self.ratio(case, n, "cps")
                )
            };
            let _ = writeln!(
                o,
                "| {n} | {} | {} | {} | {} | {} |",
                self.cell(Case::Direct, n, "cps", 0),
                c(Case::Ebpf),
                c(Case::Bypass),
                c(Case::Iptables),
                c(Case::Nftables)
            );
        }
        o
    }

    /// ebpf-proxy's memory: the agent's RSS (after the first sync and after the first
    /// verification, with their peaks) and the BPF maps' memlock.
    fn memory_table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "\n### Memory of ebpf-proxy (MiB)\n");
        let _ = writeln!(
            o,
            "| N | agent RSS after the first sync | peak RSS by then | RSS after the first verification | peak RSS by then | BPF maps (all, memlock) | service maps |"
        );
        let _ = writeln!(o, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
        for &n in &self.services {
            let _ = writeln!(
                o,
                "| {n} | {} | {} | {} | {} | {} | {} |",
                self.cell(Case::Ebpf, n, "rss_mib", 1),
                self.cell(Case::Ebpf, n, "peak_rss_mib", 1),
                self.cell(Case::Ebpf, n, "rss_verified_mib", 1),
                self.cell(Case::Ebpf, n, "peak_rss_verified_mib", 1),
                self.cell(Case::Ebpf, n, "map_mib", 1),
                self.cell(Case::Ebpf, n, "service_map_mib", 1)
            );
        }
        o
    }
}
/// The rows of the one-endpoint-change table, in its order: (proxy label, case, metric,
/// what is timed).
const CHANGE_ROWS: [(&str, Case, &str, &str); 9] = [
    (
        "ebpf-proxy",
        Case::Ebpf,
        "change_ms",
        "manifest file renamed → new endpoint readable in the pinned maps (polled every 100 µs)",
    ),
    (
        "ebpf-proxy (agent)",
        Case::Ebpf,
        "change_latency_ms",
        "the agent's `latency_us`: watch event received → maps written",
    ),
    (
        "ebpf-proxy (model)",
        Case::Ebpf,
        "change_model_ms",
        "of which the model (`model_us`)",
    ),
    (
        "ebpf-proxy (map writes)",
        Case::Ebpf,
        "change_sync_ms",
        "of which the map writes (`duration_us`)",
    ),
    (
        "ebpf-proxy, API source",
        Case::Ebpf,
        "api_change_ms",
        "EndpointSlice applied on the (in-process) API server → new endpoint readable in the pinned maps",
    ),
    (
        "ebpf-proxy, API source (agent)",
        Case::Ebpf,
        "api_change_latency_ms",
        "the agent's `latency_us`: watch event received → maps written",
    ),
    (
        "ebpf-proxy, API source (metric)",
        Case::Ebpf,
        "api_programming_mean_ms",
        "`kubeproxy_network_programming_duration_seconds`, mean per run (its buckets start at 250 ms)",
    ),
    (
        "iptables",
        Case::Iptables,
        "change_ms",
        "`iptables-restore --noflush` of a partial sync",
    ),
    (
        "nftables",
        Case::Nftables,
        "change_ms",
        "`nft -f` of the changed chains",
    ),
];
