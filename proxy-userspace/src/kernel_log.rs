//! The kernel programs' own log lines (`--kernel-log-level`): aya-log records read from the
//! pinned ring buffer `AYA_LOGS` and written to the agent's log as tracing events with the
//! target [`TARGET`] at the record's level, the program's module in the field
//! `kernel_module`. What the programs log, and why it costs nothing when off:
//! `proxy-ebpf/src/klog.rs`.

use anyhow::{Context, Result};
use aya::Ebpf;
use aya_log::EbpfLogger;

/// The tracing target of the forwarded lines. `--log-level` does not filter them: the
/// agent enables this target whenever `--kernel-log-level` is not off.
pub const TARGET: &str = "ebpf_proxy::kernel";

/// Forwards aya-log records (the `log` crate's) to tracing.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Forward;

impl log::Log for Forward {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, r: &log::Record<'_>) {
        let module = r.module_path().unwrap_or_default();
        let msg = r.args();
        // tracing's level must be a constant at each call site.
        match r.level() {
            log::Level::Error => {
                tracing::error!(target: TARGET, kernel_module = module, "{msg}")
            }
            log::Level::Warn => tracing::warn!(target: TARGET, kernel_module = module, "{msg}"),
            log::Level::Info => tracing::info!(target: TARGET, kernel_module = module, "{msg}"),
            log::Level::Debug => {
                tracing::debug!(target: TARGET, kernel_module = module, "{msg}")
            }
            log::Level::Trace => {
                tracing::trace!(target: TARGET, kernel_module = module, "{msg}")
            }
        }
    }

    fn flush(&self) {}
}

/// The reader of the kernel log ring.
pub(crate) struct KernelLogs(EbpfLogger<Forward>);

impl std::fmt::Debug for KernelLogs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KernelLogs")
    }
}

impl KernelLogs {
    /// Takes the log ring (`AYA_LOGS`, pinned: see `loader::pinned_maps`) of a loaded
    /// object. Errors: the object has no log ring.
    pub(crate) fn new(ebpf: &mut Ebpf) -> Result<Self> {
        EbpfLogger::init_with_logger(ebpf, Forward)
            .map(KernelLogs)
            .context("load: open the kernel log ring AYA_LOGS")
    }

    /// Forwards the records as they arrive, on the current tokio runtime, until the
    /// runtime stops. Errors: the ring cannot be registered with the runtime.
    pub(crate) fn spawn(self) -> Result<()> {
        use tokio::io::{Interest, unix::AsyncFd};
        // SAFETY: the descriptor is the ring buffer map's, owned by the logger that the
        // AsyncFd owns from here on: it stays open and the same until both are dropped.
        let mut fd = unsafe { AsyncFd::register_with_interest(self.0, Interest::READABLE) }
            .map_err(|e| e.into_parts().1)
            .context("watch the kernel log ring")?;
        tokio::spawn(async move {
            loop {
                let Ok(mut ready) = fd.readable_mut().await else {
                    break;
                };
                ready.get_inner_mut().flush();
                ready.clear_ready();
            }
        });
        Ok(())
    }
}
