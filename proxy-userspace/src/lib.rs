//! ebpf-proxy agent library: sources of Service, EndpointSlice and Node changes, the
//! desired-state model (the one reader of Kubernetes objects), the reconciler that programs
//! the data path from it, the aya data path behind a trait, and the agent that runs them.
//!
//! Test and demo support (the namespace lab, the fake API server, netprobe) is in the
//! `proxy-testkit` workspace crate, which depends on this one.

pub mod agent;
pub mod check;
pub mod cli;
pub mod config;
pub mod datapath;
pub mod healthcheck;
pub mod inspect;
pub mod maglev;
pub mod metrics;
pub mod model;
pub mod monitor;
pub mod mounts;
pub mod reconcile;
pub mod servers;
pub mod source;
