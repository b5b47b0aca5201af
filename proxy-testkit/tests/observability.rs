//! The kernel programs pass the verifier with their log lines at the most verbose level
//! (`--kernel-log-level trace`) and, the agent's default, with them off. Loads programs
//! into the kernel, so it needs root; no lab, no agent. The kernel log lines themselves and
//! `--close-connections-to-removed-endpoints` are scenarios
//! (`tests/scenarios/socket/obs-*.txtar`).

use proxy_userspace::datapath::loader;

#[test]
fn every_program_passes_the_verifier_with_kernel_logs_at_trace() {
    assert!(proxy_testkit::testbed::is_root(), "needs root");
    // The tc programs are close to the verifier's budget: the log lines must fit in every
    // program at the most verbose level, and (the agent's default) with them off.
    for level in [loader::KernelLogLevel::Trace, loader::KernelLogLevel::Off] {
        loader::set_kernel_log_level(level);
        let loaded = loader::verify_programs()
            .unwrap_or_else(|e| panic!("kernel log level {level:?}: {e:#}"));
        for p in [
            "connect4",
            "sendmsg6",
            "tc_ingress",
            "tc_reject",
            "pod_ingress",
        ] {
            assert!(
                loaded.iter().any(|l| l.starts_with(p)),
                "{p} not verified: {loaded:?}"
            );
        }
    }
}
