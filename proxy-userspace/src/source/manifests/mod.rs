//! The manifest source: Services and EndpointSlices read from a directory of YAML/JSON
//! files, re-read whenever the directory changes.
//!
//! Rules (what is read, what is skipped):
//! - Every regular file (or symlink to one) directly in the directory whose name ends in
//!   `.yaml`, `.yml` or `.json` (any case) is read, in byte order of file names. Hidden files
//!   (`.foo.yaml`, `.foo.swp`, Kubernetes ConfigMap `..data` entries) and editor backups
//!   (`foo.yaml~`) are ignored; subdirectories are not entered.
//! - `.json` files are parsed as JSON (a stream of one or more values); every other file
//!   as YAML (any number of `---` documents). Each document is dispatched on
//!   `apiVersion`/`kind` (a plain JSON object of a read kind straight into its type, anything
//!   else through a `serde_json::Value`):
//!   `v1`/`Service`, `discovery.k8s.io/v1`/`EndpointSlice` and `v1`/`Node` (for the zone
//!   label of the agent's own node; cluster-scoped, so its namespace is ignored) are read;
//!   `v1`/`List`, `v1`/`ServiceList`, `v1`/`NodeList` and
//!   `discovery.k8s.io/v1`/`EndpointSliceList` have their
//!   `items` read (items of a typed list may leave out `apiVersion`/`kind`).
//! - **Anything else is skipped with one [`SourceError`]**: a document without `apiVersion`
//!   or `kind`, a Service or EndpointSlice with another `apiVersion` (e.g.
//!   `discovery.k8s.io/v1beta1`), and every other kind, including valid but irrelevant ones
//!   (`Deployment`, `ConfigMap`, ...). One clear line per skipped object beats silently
//!   ignoring a typo'd kind. Empty documents (`---` with nothing, only comments) are skipped
//!   silently.
//! - A missing `metadata.namespace` means `"default"` (and is filled in on the object). A
//!   missing `metadata.name` skips the object with an error.
//! - An object that does not deserialize into its k8s-openapi type (e.g. `port: abc`) is
//!   skipped with an error naming its kind, namespace and name (when they can be read) and
//!   the serde error; the rest of the file is still read.
//! - A YAML syntax error skips only its document, with one error naming the file and the
//!   document number: the file is then cut before every line starting with the document
//!   marker `---` (at column 0, which YAML forbids inside content) and each piece is parsed
//!   alone, so the documents before and after the broken one are kept. The broken
//!   document's objects are gone until it is fixed, as if it were deleted: what it held
//!   cannot be told for sure (its name may be the typo), so no earlier version is kept in
//!   its place. A syntax error in a JSON stream (which has no separators) skips the rest of
//!   the file. An unreadable or non-UTF-8 file is skipped with one error.
//! - The same kind/namespace/name twice (in two files, or twice in one file): the later one
//!   (in file order, then document order) wins, with an error naming both origins.

mod dir;
mod document;
#[cfg(test)]
mod fixtures;
mod parse;
mod watch;

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::{sync::mpsc, time::Instant};
use tracing::{debug, warn};

use dir::Dir;
pub use dir::load_dir;
pub use parse::parse_documents;
use watch::{Action, Pending, Received, Watch, action, dir_identity};

use super::{Batch, Change, Source, SourceError};

/// Manifest text per chunk of the first listing (see [`Dir::plan`]). Each chunk's objects go
/// to the agent before the next chunk is parsed, so the parsed objects of a large directory
/// (several KiB each, of which the model keeps a fraction) are never all held at once: at
/// 30,000 Services x 10 endpoints in one batch they took about 180 MiB, and the heap kept
/// that size after they were freed.
const CHUNK_BYTES: u64 = 1 << 20;

/// Default quiet time after the last event on a file that may still be written (created,
/// modified, removed) before it is read.
pub const DEFAULT_DEBOUNCE: Duration = Duration::from_millis(50);
/// Default interval of the periodic re-read, a safety net for lost events (e.g. the
/// directory itself removed and re-created).
pub const DEFAULT_RESYNC: Duration = Duration::from_secs(10);

/// A `Source` reading a directory of manifests (see the module documentation) and
/// following its changes file by file.
///
/// The directory is watched with `notify` (non-recursive). A file that was closed after
/// writing or renamed into place is complete: it is read at once, alone. A file created,
/// modified or removed is read (or dropped) once no event on it arrived for the debounce
/// time (50 ms by default, at most 1 s after its first event), so a writer that is not done
/// yet is not read half-way and a directory being removed is not mistaken for removed files.
/// Events on other names (Kubernetes ConfigMap volumes swap their `..data` link) and lost
/// events make the whole directory be listed again, as does the periodic resync; a listing
/// reads only the files whose size, times or inode changed. The objects a changed file
/// defines become [`Change`]s; the model drops those that read the same as before. A batch
/// is timed (`Batch::received`) from the earliest watch event behind what it holds, as the
/// watcher received it, so a debounced read counts its wait.
///
/// The first listing parses files in parallel and is sent in chunks of about 1 MiB of
/// manifest text, each as soon as it is parsed, in batches that are not complete yet
/// (`Batch::synced` false but for the last): the agent reads one chunk into its model
/// while the next is parsed, and the parsed objects of a large directory are never all
/// held at once.
///
/// An empty directory yields no objects. A directory that cannot be listed (removed,
/// permissions) changes nothing: what was read stays in force, a warning is logged, and the
/// watch is re-established once the directory is back.
#[derive(Clone, Debug)]
pub struct ManifestSource {
    dir: PathBuf,
    debounce: Duration,
    resync: Duration,
    chunk_bytes: u64,
}

impl ManifestSource {
    /// A source for `dir`, with [`DEFAULT_DEBOUNCE`] and [`DEFAULT_RESYNC`].
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        ManifestSource {
            dir: dir.into(),
            debounce: DEFAULT_DEBOUNCE,
            resync: DEFAULT_RESYNC,
            chunk_bytes: CHUNK_BYTES,
        }
    }

    /// Sets the periodic re-read interval.
    pub fn with_resync(mut self, resync: Duration) -> Self {
        self.resync = resync;
        self
    }

    /// Sets the manifest text per batch of the first listing ([`CHUNK_BYTES`]).
    #[cfg(test)]
    fn with_chunk_bytes(mut self, bytes: u64) -> Self {
        self.chunk_bytes = bytes;
        self
    }

    /// The watched directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Source for ManifestSource {
    fn start(self) -> anyhow::Result<mpsc::Receiver<Batch>> {
        use anyhow::Context as _;
        std::fs::read_dir(&self.dir)
            .with_context(|| format!("cannot read manifest directory {}", self.dir.display()))?;
        let (event_tx, event_rx) = mpsc::unbounded_channel::<Received>();
        let watcher = notify::recommended_watcher(move |res| {
            // Stamped as it arrives: changes are timed from here.
            let _ = event_tx.send((std::time::Instant::now(), res));
        })
        .context("cannot create a file watcher")?;
        let mut watch = Watch::new(watcher, self.dir.clone());
        // Watch before the first read, so no change between the two is lost.
        watch.ensure();
        if !watch.is_watching() {
            anyhow::bail!("cannot watch manifest directory {}", self.dir.display());
        }
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(run(self, watch, event_rx, tx));
        Ok(rx)
    }
}

/// Runs `f` on `dir` on a blocking thread, so the runtime's workers (the agent reading the
/// batches already sent) keep running meanwhile. `None` when the runtime is shutting down.
async fn off_runtime<R: Send + 'static>(
    dir: &mut Dir,
    f: impl FnOnce(&mut Dir) -> R + Send + 'static,
) -> Option<R> {
    let mut d = std::mem::take(dir);
    match tokio::task::spawn_blocking(move || {
        let r = f(&mut d);
        (d, r)
    })
    .await
    {
        Ok((d, r)) => {
            *dir = d;
            Some(r)
        }
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => None,
    }
}

/// The first listing of the directory, chunk by chunk ([`Dir::plan`]): every chunk but the
/// last is sent as soon as it is parsed, in a batch that is not complete yet, so the parsed
/// objects of a large directory are read into the model and dropped while the next chunk
/// is parsed, instead of being held all at once. The last chunk's changes are left in
/// `changes`. `None` when the consumer or the runtime is gone.
async fn first_listing(
    dir: &mut Dir,
    chunk_bytes: u64,
    tx: &mpsc::Sender<Batch>,
    received: std::time::Instant,
    changes: &mut Vec<Change>,
) -> Option<io::Result<()>> {
    let chunks = match off_runtime(dir, move |d| d.plan(chunk_bytes)).await? {
        Ok(c) => c,
        Err(e) => return Some(Err(e)),
    };
    let last = chunks.len().saturating_sub(1);
    for (i, chunk) in chunks.into_iter().enumerate() {
        let mut part = off_runtime(dir, move |d| {
            let mut out = Vec::new();
            d.read_chunk(chunk, &mut out);
            if i == last {
                // This thread parsed every chunk; its free pages go now, not when the
                // blocking pool retires it.
                crate::give_back_heap();
            }
            out
        })
        .await?;
        changes.append(&mut part);
        if i < last && !changes.is_empty() {
            let batch = Batch {
                changes: std::mem::take(changes),
                errors: None,
                synced: false,
                received,
            };
            tx.send(batch).await.ok()?;
        }
    }
    Some(Ok(()))
}

/// The source's loop: reads what events ask for and sends one batch per round of events.
async fn run(
    source: ManifestSource,
    mut watch: Watch,
    mut events: mpsc::UnboundedReceiver<Received>,
    tx: mpsc::Sender<Batch>,
) {
    let mut dir = Dir::new(&source.dir);
    let mut sent_errors: Option<Vec<SourceError>> = None;
    let mut synced = false;
    let mut pending = Pending::default();
    pending.rescan_now = Some(std::time::Instant::now());
    let mut resync = tokio::time::interval_at(Instant::now() + source.resync, source.resync);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // Do what is due.
        let due = pending.take_due(Instant::now(), source.debounce);
        let mut changes = Vec::new();
        let mut read = Vec::new();
        if due.rescan {
            if watch.ensure() {
                debug!(dir = %source.dir.display(), "manifest directory (re-)watched");
            }
            let listed = if synced {
                dir.rescan(&mut changes)
            } else {
                let received = due.received.unwrap_or_else(std::time::Instant::now);
                match first_listing(&mut dir, source.chunk_bytes, &tx, received, &mut changes).await
                {
                    Some(r) => r,
                    None => return, // consumer or runtime gone
                }
            };
            if let Err(e) = listed {
                warn!(dir = %source.dir.display(), error = %e, "cannot read manifest directory; keeping what was read");
            } else {
                synced = true;
            }
        } else {
            read = due.now;
            if !due.later.is_empty() && dir_identity(&source.dir).is_none() {
                // Files "removed" because the directory is going away: keep what was read.
                warn!(dir = %source.dir.display(), "manifest directory is gone; keeping what was read");
                watch.ensure();
            } else {
                read.extend(due.later);
            }
        }
        for name in &read {
            dir.refresh(name, false, &mut changes);
        }
        let errors = dir.errors();
        let errors_changed = sent_errors.as_ref() != Some(&errors);
        if synced && (!changes.is_empty() || errors_changed || sent_errors.is_none()) {
            debug!(dir = %source.dir.display(), changes = changes.len(), errors = errors.len(), "manifest changes");
            let batch = Batch {
                changes,
                errors: errors_changed.then(|| errors.clone()),
                synced: true,
                received: due.received.unwrap_or_else(std::time::Instant::now),
            };
            if tx.send(batch).await.is_err() {
                return; // consumer gone
            }
            sent_errors = Some(errors);
        }

        // Wait for events, the next deadline or the resync.
        let event = tokio::select! {
            _ = tx.closed() => return,
            _ = resync.tick() => {
                pending.rescan_now.get_or_insert_with(std::time::Instant::now);
                continue;
            }
            _ = sleep_until_opt(pending.next_due(source.debounce)) => continue,
            e = events.recv() => e,
        };
        let Some(first) = event else {
            return; // watcher gone
        };
        // Take every event already queued, so a burst becomes one batch.
        let mut queued = vec![first];
        while let Ok(e) = events.try_recv() {
            queued.push(e);
        }
        let now = Instant::now();
        for (received, e) in queued {
            match e {
                Ok(event) => {
                    if event.need_rescan() {
                        pending.note(Action::Rescan, now, received);
                        continue;
                    }
                    for path in &event.paths {
                        pending.note(action(&source.dir, &event.kind, path), now, received);
                    }
                }
                Err(e) => {
                    warn!(error = %e, "manifest watch error; listing the directory again");
                    pending.note(Action::Rescan, now, received);
                }
            }
        }
    }
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests;
