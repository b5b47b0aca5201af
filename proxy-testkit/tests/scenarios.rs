//! The privileged tests written as data: every `tests/scenarios/socket/*.txtar` is a lab
//! (pod namespaces, a test cgroup, the real agent on a manifest directory) driven by the
//! steps of its script, every `tests/scenarios/tc/*.txtar` a tc packet fixture (the object
//! loaded, its maps seeded from the file's objects, packets run through the programs with
//! `BPF_PROG_TEST_RUN`), and every `tests/scenarios/north-south/*.txtar` a two-node
//! north-south lab (an external client, two nodes with a pod and an agent each). See
//! `tests/scenarios/README.md` for the format and how to add a case;
//! `EBPF_PROXY_SCENARIO=PART` runs only the files whose name contains PART.
//!
//! Run as root with `cargo xtask test` (which builds the eBPF object and the agent first).

mod common;
mod nslab;
mod sched;
mod script;
mod tcfix;

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

/// Every tc packet fixture, each on a harness of its own.
#[test]
fn tc_packet_scenarios() {
    script::run_dir(&scenarios("tc"), script::packets::run);
}

/// Every north-south scenario (the two-node lab), each variant on a lab of its own.
#[test]
fn north_south_scenarios() {
    script::run_dir(&scenarios("north-south"), script::northsouth::run);
}
