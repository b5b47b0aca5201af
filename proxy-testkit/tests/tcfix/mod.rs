//! The packet tests' support is the testkit's [`proxy_testkit::progrun`] (shared with the
//! packet micro-benchmark): used by `tc_fixtures.rs` and by the packet scenario files
//! (`tests/scenarios/tc/`, through `script::packets`).

#![allow(unused_imports)]

pub use proxy_testkit::progrun::*;
