//! Test and demo support for ebpf-proxy; a workspace crate that is never shipped, so the
//! agent (`proxy-userspace`) neither compiles this code nor depends on what it uses.
//!
//! - [`testbed`]: RAII network namespaces, a bridge lab of pod namespaces, a test cgroup.
//! - [`fakeapi`]: a list/watch server that behaves like kube-apiserver.
//! - [`kube_proxy_rules`]: the iptables and nftables rules kube-proxy programs for a set of
//!   Services (the bench's peers, and kube-proxy's side of the switch tests).
//! - [`podrun`]: a pod template run with podman as a kubelet would, on a lab node.
//! - [`progrun`]: the real object's packet programs run through `BPF_PROG_TEST_RUN` on maps
//!   seeded by the agent's reconciler, and the packets they are run on.
//!
//! Its binaries are `netprobe` (test servers and clients, and the demo) and, with the
//! `bench` feature, `ebpf-proxy-bench`. Its `tests/` are the privileged integration tests:
//! they run the agent binary `ebpf-proxy` of `proxy-userspace` (see `tests/common`).

pub mod fakeapi;
pub mod kube_proxy_rules;
pub mod podrun;
pub mod progrun;
pub mod testbed;
