//! The PNG charts: ClusterIP and north-south.

use std::fs;
use std::path::Path;

use anyhow::{Context, Result};
use plotters::prelude::*;

use super::north_south::{NS_CASES, ns_label};
use super::{Case, Results, Stat};

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

type Series = (String, RGBColor, Vec<(f64, Stat)>);

fn series(r: &Results, case: Case, m: &str, label: &str, color: RGBColor) -> Series {
    let pts = r
        .services
        .iter()
        .filter_map(|&n| Some((n as f64, r.get(case, n, m)?)))
        .collect();
    (label.to_string(), color, pts)
}

fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    ylabel: &str,
    log_y: bool,
    data: &[Series],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let xs: Vec<f64> = data.iter().flat_map(|s| s.2.iter().map(|p| p.0)).collect();
    let ys: Vec<f64> = data
        .iter()
        .flat_map(|s| s.2.iter().flat_map(|p| [p.1.min, p.1.max]))
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    if xs.is_empty() || ys.is_empty() {
        return Ok(());
    }
    let ns = &xs;
    let (x0, x1) = (
        xs.iter().cloned().fold(f64::MAX, f64::min) / 1.5,
        xs.iter().cloned().fold(0.0, f64::max) * 1.5,
    );
    let (y0, y1) = (
        ys.iter().cloned().fold(f64::MAX, f64::min),
        ys.iter().cloned().fold(0.0, f64::max),
    );
    let mut b = ChartBuilder::on(area);
    b.caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(80);
    macro_rules! draw {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc("services (N), log scale")
                .y_desc(ylabel)
                .light_line_style(WHITE)
                .x_label_formatter(&|v: &f64| {
                    let r = v.round();
                    let mut p = 1.0;
                    while p < r {
                        p *= 10.0;
                    }
                    if (r - p).abs() < 0.5 || ns.iter().any(|n| (r - n).abs() < 0.5) {
                        format!("{r:.0}")
                    } else {
                        String::new()
                    }
                })
                .y_label_formatter(&|v: &f64| {
                    if v.abs() >= 10.0 {
                        format!("{v:.0}")
                    } else {
                        format!("{v:.1}")
                    }
                })
                .label_style(("sans-serif", 15))
                .axis_desc_style(("sans-serif", 16))
                .draw()?;
            for (label, color, pts) in data {
                let c = *color;
                chart
                    .draw_series(LineSeries::new(
                        pts.iter().map(|(x, s)| (*x, s.med)),
                        c.stroke_width(2),
                    ))?
                    .label(label.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                    });
                chart.draw_series(
                    pts.iter()
                        .map(|(x, s)| Circle::new((*x, s.med), 4, c.filled())),
                )?;
                chart.draw_series(pts.iter().map(|(x, s)| {
                    ErrorBar::new_vertical(
                        *x,
                        s.min.max(y0 * 0.9),
                        s.med,
                        s.max,
                        c.stroke_width(1),
                        8,
                    )
                }))?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .label_font(("sans-serif", 15))
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()?;
        }};
    }
    if log_y {
        draw!(b.build_cartesian_2d((x0..x1).log_scale(), (y0 / 2.0..y1 * 3.0).log_scale())?);
    } else {
        draw!(b.build_cartesian_2d((x0..x1).log_scale(), 0.0..y1 * 1.25)?);
    }
    Ok(())
}

/// Writes `control_plane.png` and `data_path.png`.
pub fn charts(r: &Results, dir: &Path) -> Result<()> {
    let font = match fs::read(FONT) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("no charts: cannot read {FONT} ({e}); install fonts-dejavu-core");
            return Ok(());
        }
    };
    let font: &'static [u8] = Box::leak(font.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| anyhow::anyhow!("invalid font {FONT}"))?;

    if !r.services.is_empty() {
        cluster_ip_charts(r, dir)?;
    }
    if let Some(&n) = r.north_south.last() {
        north_south_chart(r, n, dir)?;
    }
    Ok(())
}

/// Writes `control_plane.png` and `data_path.png`.
fn cluster_ip_charts(r: &Results, dir: &Path) -> Result<()> {
    let cp = dir.join("control_plane.png");
    {
        let root = BitMapBackend::new(&cp, (1000, 620)).into_drawing_area();
        root.fill(&WHITE)?;
        panel(
            &root,
            &format!(
                "Programming N services x 10 endpoints from cold — {}",
                short_machine(r)
            ),
            "milliseconds (log scale)",
            true,
            &[
                series(
                    r,
                    Case::Ebpf,
                    "cold_ms",
                    "ebpf-proxy: sync (map writes)",
                    Case::Ebpf.color(),
                ),
                series(
                    r,
                    Case::Ebpf,
                    "cold_wall_ms",
                    "ebpf-proxy: agent start → synced",
                    RGBColor(0x9e, 0xc7, 0xe8),
                ),
                series(
                    r,
                    Case::Iptables,
                    "cold_ms",
                    "iptables-restore (kube-proxy iptables mode)",
                    Case::Iptables.color(),
                ),
                series(
                    r,
                    Case::Nftables,
                    "cold_ms",
                    "nft -f (kube-proxy nftables mode)",
                    Case::Nftables.color(),
                ),
            ],
        )?;
        root.present().context("write control_plane.png")?;
    }
    let dp = dir.join("data_path.png");
    {
        let root = BitMapBackend::new(&dp, (1000, 1100)).into_drawing_area();
        root.fill(&WHITE)?;
        let (top, bottom) = root.split_vertically(550);
        let cases = [Case::Direct, Case::Ebpf, Case::Iptables, Case::Nftables];
        let s = |m: &str| -> Vec<Series> {
            cases
                .iter()
                .map(|&c| series(r, c, m, c.label(), c.color()))
                .collect()
        };
        panel(
            &top,
            "New TCP connections per second to one ClusterIP",
            "connections / s",
            false,
            &s("cps"),
        )?;
        panel(
            &bottom,
            "p99 latency per connection (connect + request + reply)",
            "µs (log scale)",
            true,
            &s("p99_us"),
        )?;
        root.present().context("write data_path.png")?;
    }
    Ok(())
}

/// Writes `north_south.png`: the north-south rates at N (bars: median, whiskers: min–max
/// over runs), TCP and UDP side by side, each with the local and the remote backend.
fn north_south_chart(r: &Results, n: usize, dir: &Path) -> Result<()> {
    const CASES: [Case; 6] = NS_CASES;
    let file = dir.join("north_south.png");
    let root = BitMapBackend::new(&file, (1200, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let (title, body) = root.split_vertically(40);
    title.draw(&Text::new(
        format!(
            "NodePorts from a client outside the cluster, {n} ClusterIP services loaded too — {}",
            short_machine(r)
        ),
        (20, 10),
        ("sans-serif", 20),
    ))?;
    let panels = body.split_evenly((1, 2));
    for (area, (proto, unit)) in panels.iter().zip([
        (
            "tcp",
            "new TCP connections / s (connect, request, reply, close)",
        ),
        (
            "udp",
            "UDP request/reply exchanges / s (one flow, 32 in flight)",
        ),
    ]) {
        let stats: Vec<Vec<Option<Stat>>> = ["local", "remote"]
            .iter()
            .map(|side| {
                CASES
                    .iter()
                    .map(|&c| r.get(c, n, &format!("ns:{proto}_{side}:rate")))
                    .collect()
            })
            .collect();
        let ymax = stats
            .iter()
            .flatten()
            .flatten()
            .map(|s| s.max)
            .fold(0.0, f64::max);
        if ymax <= 0.0 {
            continue;
        }
        let mut chart = ChartBuilder::on(area)
            .caption(proto.to_uppercase(), ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            // Head room for the legend's six entries above the bars.
            .build_cartesian_2d(0.0..2.0, 0.0..ymax * 1.5)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .light_line_style(WHITE)
            // Key points at 0, 0.5, .., 2: the groups' centres carry their names.
            .x_labels(5)
            .x_label_formatter(&|v: &f64| {
                if (v - 0.5).abs() < 0.01 {
                    "backend on the node".into()
                } else if (v - 1.5).abs() < 0.01 {
                    "backend on another node (SNAT / DSR)".into()
                } else {
                    String::new()
                }
            })
            .y_desc(unit)
            .y_label_formatter(&|v: &f64| format!("{v:.0}"))
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 14))
            .draw()?;
        // Each group (one unit wide) holds one bar per case in its middle 0.8.
        let w = 0.8 / CASES.len() as f64;
        for (k, &case) in CASES.iter().enumerate() {
            let c = case.color();
            let bars: Vec<(f64, Stat)> = stats
                .iter()
                .enumerate()
                .filter_map(|(g, row)| Some((g as f64 + 0.1 + w * k as f64, row[k]?)))
                .collect();
            chart
                .draw_series(bars.iter().map(|(x, s)| {
                    Rectangle::new([(*x + 0.05 * w, 0.0), (*x + 0.95 * w, s.med)], c.filled())
                }))?
                .label(ns_label(case))
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], c.filled()));
            chart.draw_series(bars.iter().map(|(x, s)| {
                ErrorBar::new_vertical(*x + w / 2.0, s.min, s.med, s.max, BLACK.stroke_width(1), 6)
            }))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font(("sans-serif", 14))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    }
    root.present().context("write north_south.png")?;
    Ok(())
}

fn short_machine(r: &Results) -> String {
    format!("{} cores, Linux {}", r.machine.cores, r.machine.kernel)
}
