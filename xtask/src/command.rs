//! Running commands: echoed, checked, their output read; the cargo commands of the host
//! build and of sub-builds with their own toolchain.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{target_dir, workspace};

/// Runs `cmd`, echoing it, and fails on a non-zero exit.
pub(crate) fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("+ {}", show(cmd));
    let status = cmd
        .status()
        .with_context(|| format!("starting {}", show(cmd)))?;
    if !status.success() {
        bail!("{} failed ({status})", show(cmd));
    }
    Ok(())
}

pub(crate) fn show(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// True when `cmd` runs and exits 0 (output discarded).
pub(crate) fn succeeds(cmd: &mut Command) -> bool {
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

pub(crate) fn stdout_of(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("starting {}", show(cmd)))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            show(cmd),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The rustup proxy for cargo (understands `+nightly`), falling back to `cargo` on PATH.
fn cargo_proxy() -> PathBuf {
    let home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")));
    match home.map(|h| h.join("bin/cargo")) {
        Some(p) if p.exists() => p,
        _ => PathBuf::from("cargo"),
    }
}

/// The cargo running this xtask (stable), for host builds.
pub(crate) fn host_cargo() -> Command {
    let mut c = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    c.env("CARGO_TARGET_DIR", target_dir())
        .current_dir(workspace());
    c
}

/// A cargo command with the variables of the outer (stable) cargo removed, so a nightly or
/// `cargo install` sub-build chooses its own toolchain and flags.
pub(crate) fn clean_cargo(toolchain: Option<&str>) -> Command {
    let mut c = Command::new(cargo_proxy());
    if let Some(t) = toolchain {
        c.arg(format!("+{t}"));
    }
    for (k, _) in env::vars_os() {
        let k = k.to_string_lossy();
        let drop = (k.starts_with("CARGO") && k != "CARGO_HOME")
            || k.starts_with("__CARGO")
            || k.starts_with("RUSTC")
            || matches!(
                k.as_ref(),
                "RUSTUP_TOOLCHAIN"
                    | "RUSTDOC"
                    | "RUSTFLAGS"
                    | "RUSTDOCFLAGS"
                    | "RUST_RECURSION_COUNT"
            );
        if drop {
            c.env_remove(k.as_ref());
        }
    }
    c
}
