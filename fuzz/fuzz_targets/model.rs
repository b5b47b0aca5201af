//! The model and the reconciler fed arbitrary objects: a sequence of Service, EndpointSlice
//! and Node changes (written as YAML from fuzzer-chosen fields, many of them invalid or
//! conflicting), deletions and commits. After every commit the fake data path's maps pass
//! the consistency check of the sync tests; at the end the incremental model equals a fresh
//! full build and a verification repairs nothing (`proxy_fuzz::run`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|scenario: proxy_fuzz::Scenario| {
    proxy_fuzz::run(&scenario);
});
