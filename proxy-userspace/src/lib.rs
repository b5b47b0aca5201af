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
pub mod inspect;
pub mod kernel_log;
pub mod kube_proxy;
mod maglev;
mod metrics;
pub mod model;
pub mod monitor;
pub mod mounts;
pub mod reconcile;
mod servers;
mod sockdiag;
pub mod source;
pub mod status;

/// Returns the calling thread's free heap pages to the system at once: mimalloc's (the
/// agent binary's allocator, which otherwise does so about 1 s after the free; its heaps are
/// per thread, so each thread that freed much calls this itself) and glibc's (C libraries;
/// and every allocation when this library runs in a binary that keeps glibc's malloc). Called
/// after the work that builds and frees large transient structures: the first listing of a
/// manifest directory (on the thread that parsed it), the programs' verification (on the
/// thread that loaded them), the first sync and every verification (the parsed objects, a
/// snapshot of every map entry and the one expected: at 30,000 Services x 10 endpoints about
/// 55 MiB). Takes a few ms.
pub(crate) fn give_back_heap() {
    // SAFETY: both only release memory their allocator holds free.
    unsafe {
        libmimalloc_sys::mi_collect(true);
        #[cfg(target_env = "gnu")]
        libc::malloc_trim(0);
    }
}

/// An error and its causes on one line, joined by `": "` as `{:#}` prints them, each text
/// once: a cause whose text the cause before it already contains is left out. Libraries
/// often print their source inside their own message too (kube-rs' kubeconfig errors, aya's
/// map errors), which would otherwise show the same text two or three times.
pub fn error_chain(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = cause.to_string();
        let text = text.trim();
        if text.is_empty() || parts.last().is_some_and(|prev| prev.contains(text)) {
            continue;
        }
        parts.push(text.to_string());
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    #[derive(Debug, thiserror::Error)]
    #[error("failed to read kubeconfig {path:?}: {source}")]
    struct Echoing {
        path: String,
        #[source]
        source: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("failed to create map `X`")]
    struct Repeating(#[source] Inner);

    #[derive(Debug, thiserror::Error)]
    #[error("failed to create map `X`")]
    struct Inner(#[source] std::io::Error);

    #[test]
    fn error_chain_prints_each_cause_text_once() {
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory");
        let e = anyhow::Error::new(Echoing {
            path: "/k".into(),
            source: io(),
        })
        .context("explain --api");
        assert_eq!(
            error_chain(&e),
            "explain --api: failed to read kubeconfig \"/k\": No such file or directory"
        );
        let e = anyhow::Error::new(Repeating(Inner(io()))).context("load");
        assert_eq!(
            error_chain(&e),
            "load: failed to create map `X`: No such file or directory"
        );
        // Different texts are all kept, in order.
        let e = anyhow::anyhow!("c").context("b").context("a");
        assert_eq!(error_chain(&e), "a: b: c");
        assert_eq!(format!("{e:#}"), error_chain(&e));
    }
}
