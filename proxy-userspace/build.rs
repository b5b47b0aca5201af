//! Embeds the eBPF object built by `cargo xtask build-ebpf`.
//!
//! The object is looked up at `$EBPF_PROXY_OBJECT`, else at
//! `<workspace>/target/bpfel-unknown-none/release/ebpf-proxy`. When it is missing (a plain
//! `cargo build` or `cargo test` of the host crates), an empty object is embedded and the
//! agent refuses to start with a message naming `cargo xtask build`, so host-only work never
//! needs the nightly toolchain.

use std::{env, fs, path::PathBuf};

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let default = manifest.join("../target/bpfel-unknown-none/release/ebpf-proxy");
    let object = env::var_os("EBPF_PROXY_OBJECT")
        .map(PathBuf::from)
        .unwrap_or(default);
    println!("cargo:rerun-if-env-changed=EBPF_PROXY_OBJECT");
    println!("cargo:rerun-if-changed={}", object.display());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("ebpf-proxy.bpf.o");
    match fs::read(&object) {
        Ok(bytes) => fs::write(&out, bytes).unwrap(),
        Err(_) => {
            println!(
                "cargo:warning=eBPF object {} not found; the agent will not load (run `cargo xtask build`)",
                object.display()
            );
            fs::write(&out, []).unwrap();
        }
    }
}
