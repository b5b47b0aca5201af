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
