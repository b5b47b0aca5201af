//! The privileged tests written as data: every `tests/scenarios/socket/*.txtar` is a lab
//! (pod namespaces, a test cgroup, the real agent on a manifest directory) driven by the
//! steps of its script. See `tests/scenarios/README.md` for the format and how to add a
//! case; `EBPF_PROXY_SCENARIO=PART` runs only the files whose name contains PART.
//!
//! Run as root with `cargo xtask test` (which builds the eBPF object and the agent first).

mod common;
mod sched;
mod script;

use std::path::Path;

fn scenarios(dir: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/scenarios")
        .join(dir)
}

/// Every socket-level scenario, each in its own lab.
#[test]
fn socket_scenarios() {
    script::run_dir(&scenarios("socket"), script::socket::run);
}
