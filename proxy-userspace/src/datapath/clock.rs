//! The kernel's monotonic clock, shared by the loader's drain and the tc path (and read by
//! `inspect` and `monitor` through its re-export `tc::monotonic_ns`): a leaf module, so
//! neither of them imports the other for it.

/// `CLOCK_MONOTONIC` in nanoseconds: the clock of `bpf_ktime_get_ns`, so of the conntrack
/// entries' `last_seen_ns`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime(2) into a timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The `CONFIG_HZ` values Linux offers (every architecture's Kconfig choices); a measured
/// tick is snapped to one of them.
const KERNEL_HZ: [u64; 13] = [
    24, 48, 64, 100, 128, 200, 250, 256, 300, 500, 512, 1000, 1024,
];

/// Longest the calibration samples (it needs two jiffy edges at least 20 ms apart).
const CALIBRATION_LIMIT_NS: u64 = 200_000_000;

/// Shortest span between the two jiffy edges the tick is measured over.
const CALIBRATION_SPAN_NS: u64 = 20_000_000;

/// The kernel's `TICK_NSEC` for `hz`: nanoseconds per jiffy, rounded as the kernel does.
pub(crate) fn tick_nsec(hz: u64) -> u64 {
    (1_000_000_000 + hz / 2) / hz
}

/// Calibrates the packet programs' conntrack clock (`proxy_common::nat::CtClock`) from
/// `sample`, which returns (jiffies, `CLOCK_MONOTONIC` ns) read together by the kernel,
/// jiffies first (the probe program `tc_clock_probe`). Samples until jiffies have moved
/// on twice, at least 20 ms apart (at most 200 ms of samples): the time between the two
/// first samples after an edge over the jiffies between them is the tick, snapped to the
/// `TICK_NSEC` of one of Linux's `CONFIG_HZ` values (within 1 %). The offset is the least
/// `time - jiffies * tick` seen (a sample right after an edge), less one tick, so the
/// clock never runs ahead of `CLOCK_MONOTONIC` and lags it by less than two ticks.
///
/// Returns `Ok(None)` when the samples fit no `CONFIG_HZ` (jiffies not moving, a tick
/// of no known length); the programs then keep the coarse clock. Errors: a failed sample.
pub(crate) fn calibrate(
    mut sample: impl FnMut() -> anyhow::Result<(u64, u64)>,
) -> anyhow::Result<Option<proxy_common::nat::CtClock>> {
    let (j0, t0) = sample()?;
    let mut samples = Vec::new();
    // The first sample after each jiffy edge.
    let mut edges: Vec<(u64, u64)> = Vec::new();
    let mut last = j0;
    loop {
        let (j, t) = sample()?;
        if j != last {
            edges.push((j, t));
            last = j;
        }
        if !edges.is_empty() {
            samples.push((j, t));
        }
        if let (Some(first), Some(edge)) = (edges.first(), edges.last())
            && edge.1.saturating_sub(first.1) >= CALIBRATION_SPAN_NS
        {
            break;
        }
        if t.saturating_sub(t0) > CALIBRATION_LIMIT_NS {
            return Ok(None);
        }
    }
    let (first, edge) = (edges[0], edges[edges.len() - 1]);
    let jiffies = edge.0.wrapping_sub(first.0);
    if jiffies == 0 {
        return Ok(None);
    }
    let measured = (edge.1 - first.1) as f64 / jiffies as f64;
    let Some(tick) = KERNEL_HZ
        .iter()
        .map(|hz| tick_nsec(*hz))
        .find(|tick| (measured - *tick as f64).abs() <= *tick as f64 / 100.0)
    else {
        return Ok(None);
    };
    // Offsets lie near each other modulo 2^64 (jiffies * tick wraps): the least is the
    // one at the least wrapping distance from any of them.
    let offsets: Vec<u64> = samples
        .iter()
        .map(|(j, t)| t.wrapping_sub(j.wrapping_mul(tick)))
        .collect();
    let base = offsets[0];
    let offset = offsets
        .iter()
        .copied()
        .min_by_key(|o| o.wrapping_sub(base) as i64)
        .expect("at least the edges' samples");
    Ok(Some(proxy_common::nat::CtClock {
        tick_ns: tick,
        offset_ns: offset.wrapping_sub(tick),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel whose jiffies tick every `tick` ns from `phase`, starting at `j0`, read
    /// every `step` ns from time `t0`: the probe's samples, and the time of each.
    fn kernel(
        tick: u64,
        phase: u64,
        j0: u64,
        t0: u64,
        step: u64,
    ) -> impl FnMut() -> anyhow::Result<(u64, u64)> {
        let mut t = t0;
        move || {
            t += step;
            let j = j0.wrapping_add((t - phase) / tick);
            Ok((j, t))
        }
    }

    /// The programs' clock at time `t` of that kernel.
    fn now(c: &proxy_common::nat::CtClock, tick: u64, phase: u64, j0: u64, t: u64) -> u64 {
        let j = j0.wrapping_add((t - phase) / tick);
        j.wrapping_mul(c.tick_ns).wrapping_add(c.offset_ns)
    }

    #[test]
    fn calibration_finds_the_tick_and_never_runs_ahead() {
        for hz in [100, 250, 300, 1000] {
            let tick = tick_nsec(hz);
            // Jiffies start 300 s before wrapping 32 bits, as the kernel's do.
            let j0 = (1u64 << 32) - 300 * hz;
            for (phase, step) in [(0, 3_000), (1_234_567, 1_700), (999, 40_000)] {
                let t0 = 5_000_000_000;
                let c = calibrate(kernel(tick, phase, j0, t0, step))
                    .unwrap()
                    .unwrap_or_else(|| panic!("HZ {hz}: no calibration"));
                assert_eq!(c.tick_ns, tick, "HZ {hz}");
                for t in (t0..t0 + 3 * 1_000_000_000).step_by(333_333) {
                    let n = now(&c, tick, phase, j0, t);
                    assert!(n <= t, "HZ {hz}: {n} ahead of {t}");
                    assert!(t - n < 2 * tick, "HZ {hz}: {n} lags {t} by 2 ticks or more");
                }
            }
        }
    }

    #[test]
    fn calibration_gives_up_without_a_known_tick() {
        // Jiffies that never move.
        let mut t = 0;
        let still = || {
            t += 1_000;
            Ok((7, t))
        };
        assert_eq!(calibrate(still).unwrap(), None);
        // A tick of 7 ms is no CONFIG_HZ.
        assert_eq!(calibrate(kernel(7_000_000, 0, 0, 0, 2_000)).unwrap(), None);
        // A failed sample is an error.
        assert!(calibrate(|| anyhow::bail!("no probe")).is_err());
    }

    #[test]
    fn tick_nsec_rounds_as_the_kernel() {
        assert_eq!(tick_nsec(250), 4_000_000);
        assert_eq!(tick_nsec(300), 3_333_333);
        assert_eq!(tick_nsec(1024), 976_563);
    }
}
