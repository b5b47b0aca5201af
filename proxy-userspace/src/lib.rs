//! ebpf-proxy agent library: sources of Service and EndpointSlice objects, the pure
//! desired-state model, the map sync, and the aya data path behind a trait.

pub mod check;
pub mod config;
pub mod datapath;
pub mod fakeapi;
pub mod healthcheck;
pub mod inspect;
pub mod maglev;
pub mod metrics;
pub mod model;
pub mod mounts;
pub mod source;
pub mod sync;
pub mod testbed;
