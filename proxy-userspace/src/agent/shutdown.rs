//! The way out: what stops the agent, and what a failed start or run leaves behind. A stop
//! leaves the data path attached and pinned for the next agent; a failure removes only a
//! pin directory this run created and never attached.

use anyhow::Result;
use tracing::info;

use std::path::Path;

use tokio::task::JoinHandle;

use super::Agent;
use crate::{datapath::kernel::KernelDatapath, datapath::loader, servers::Fatal};

/// Completes on SIGTERM, Ctrl-C, or the first server failure under
/// `--bind-address-hard-fail`.
///
/// Errors: the SIGTERM handler cannot be installed.
pub(super) fn stop_signal(
    fatal: std::sync::Arc<Fatal>,
) -> Result<impl std::future::Future<Output = ()>> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
            _ = fatal.wait() => {}
        }
    })
}

/// A start that failed after the maps were loaded: the attach thread cannot be stopped, so
/// its pins are removed once it is done (when this run created the pin directory, `fresh`).
/// Returns `e`.
pub(super) async fn abandon_start<T>(
    attach: JoinHandle<T>,
    dir: &Path,
    fresh: bool,
    e: anyhow::Error,
) -> anyhow::Error {
    let _ = attach.await;
    if fresh {
        let _ = loader::cleanup(dir);
    }
    e
}

/// The end of the event loop: a pin directory this run created goes again when the programs
/// failed to attach (`fresh`: this run created the pin directory `dir`); a server failure
/// under `--bind-address-hard-fail` is the error.
pub(super) fn finish(
    agent: &Agent<KernelDatapath>,
    ran: Result<()>,
    fatal: &Fatal,
    dir: &Path,
    fresh: bool,
) -> Result<()> {
    if ran.is_err() && fresh && !agent.attached() {
        // The programs failed to attach: a pin directory this run created goes again.
        let _ = loader::cleanup(dir);
    }
    ran?;
    if let Some(e) = fatal.error() {
        anyhow::bail!("{e} (--bind-address-hard-fail); the data path stays attached and pinned");
    }
    info!(
        "stopping; the data path stays attached and pinned for the next agent (use `ebpf-proxy cleanup` to remove it)"
    );
    Ok(())
}
