//! The watch of the directory and what its events ask for: a file to read at once, a file
//! to read once no event on it came for the debounce time, or a listing of the whole
//! directory.

use foldhash::HashMap;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, warn};

use super::dir::is_manifest_name;

/// Longest a stream of events on one file can delay its read.
const MAX_DEBOUNCE_DELAY: Duration = Duration::from_secs(1);

/// What an event asks for, per path.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Action {
    /// Read this file now (complete: closed after writing, renamed into place).
    Now(String),
    /// Read this file after the debounce (it may still change).
    Later(String),
    /// List the whole directory again (after the debounce).
    Rescan,
    /// Nothing to do.
    Ignore,
}

/// Classifies one path of an event on `dir`.
pub(super) fn action(dir: &Path, kind: &notify::EventKind, path: &Path) -> Action {
    use notify::event::{AccessKind, AccessMode, EventKind, ModifyKind, RenameMode};
    if let EventKind::Access(a) = kind
        && !matches!(a, AccessKind::Close(AccessMode::Write))
    {
        // Our own reads open files.
        return Action::Ignore;
    }
    if matches!(kind, EventKind::Modify(ModifyKind::Name(RenameMode::Both))) {
        // A rename within the directory: its `From` and `To` events (sent as well) already
        // ask for both names; this one would only read the new name a second time.
        return Action::Ignore;
    }
    if path.parent() != Some(dir) {
        return Action::Rescan; // the directory itself
    }
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return Action::Ignore;
    };
    if !is_manifest_name(name) {
        // Hidden temporary files and backups are ignored; `..data` swaps and the like of
        // ConfigMap volumes change what symlinked files point to.
        return if name.starts_with("..") {
            Action::Rescan
        } else {
            Action::Ignore
        };
    }
    match kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write))
        | EventKind::Modify(ModifyKind::Name(RenameMode::To)) => Action::Now(name.to_string()),
        EventKind::Other | EventKind::Any => Action::Rescan,
        _ => Action::Later(name.to_string()),
    }
}

/// Identity of the directory inode, to notice it was replaced and must be re-watched.
pub(super) fn dir_identity(dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(dir).ok().map(|m| (m.dev(), m.ino()))
}

/// The (non-recursive) `notify` watch of the manifest directory.
pub(super) struct Watch {
    watcher: notify::RecommendedWatcher,
    dir: PathBuf,
    /// Identity of the directory the watch is on; `None` when not watching.
    watching: Option<(u64, u64)>,
}

impl Watch {
    /// A watch of `dir` with `watcher`, not watching yet ([`Watch::ensure`] starts it).
    pub(super) fn new(watcher: notify::RecommendedWatcher, dir: PathBuf) -> Watch {
        Watch {
            watcher,
            dir,
            watching: None,
        }
    }

    /// True while the directory is watched.
    pub(super) fn is_watching(&self) -> bool {
        self.watching.is_some()
    }

    /// (Re-)establishes the watch when the directory is not watched or was replaced.
    /// Returns true when a new watch was set up (the directory must then be listed).
    pub(super) fn ensure(&mut self) -> bool {
        use notify::{RecursiveMode, Watcher};
        let current = dir_identity(&self.dir);
        if current.is_some() && current == self.watching {
            return false;
        }
        if self.watching.take().is_some() {
            let _ = self.watcher.unwatch(&self.dir);
        }
        if current.is_none() {
            return false;
        }
        match self.watcher.watch(&self.dir, RecursiveMode::NonRecursive) {
            Ok(()) => {
                debug!(dir = %self.dir.display(), "watching manifest directory");
                self.watching = current;
                true
            }
            Err(e) => {
                warn!(dir = %self.dir.display(), error = %e, "cannot watch manifest directory");
                false
            }
        }
    }
}

/// A watch event and when the watcher received it.
pub(super) type Received = (std::time::Instant, notify::Result<notify::Event>);

/// A read or listing waiting for quiet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Waiting {
    /// First and last event asking for it: it is due once no event came for the debounce
    /// time, and at the latest [`MAX_DEBOUNCE_DELAY`] after the first.
    first: Instant,
    last: Instant,
    /// When the first event behind it was received.
    received: std::time::Instant,
}

impl Waiting {
    fn new(now: Instant, received: std::time::Instant) -> Self {
        Waiting {
            first: now,
            last: now,
            received,
        }
    }

    fn again(&mut self, now: Instant, received: std::time::Instant) {
        self.last = now;
        self.received = self.received.min(received);
    }

    fn due_at(&self, debounce: Duration) -> Instant {
        (self.last + debounce).min(self.first + MAX_DEBOUNCE_DELAY)
    }
}

/// What the source has to read, each with when the first event asking for it was received:
/// a batch is timed from the earliest event behind what it holds
/// ([`Batch::received`](crate::source::Batch::received)), not from whatever event came last,
/// so a debounced read counts its wait.
#[derive(Debug, Default)]
pub(super) struct Pending {
    /// Complete files (closed after writing, renamed into place): read at once.
    now: BTreeMap<String, std::time::Instant>,
    /// Files that may still be written: read once quiet.
    later: HashMap<String, Waiting>,
    /// A listing of the whole directory once quiet (the directory itself changed, events
    /// were lost).
    rescan: Option<Waiting>,
    /// A listing due at once (the start, the periodic resync).
    pub(super) rescan_now: Option<std::time::Instant>,
}

/// What is due in one round.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Due {
    /// List the whole directory (it covers every file).
    pub(super) rescan: bool,
    /// Complete files to read.
    pub(super) now: Vec<String>,
    /// Files that became quiet.
    pub(super) later: Vec<String>,
    /// The earliest event behind all of it.
    pub(super) received: Option<std::time::Instant>,
}

impl Pending {
    /// Takes in what an event on one path asks for.
    pub(super) fn note(&mut self, action: Action, now: Instant, received: std::time::Instant) {
        match action {
            Action::Now(n) => {
                let first = self
                    .later
                    .remove(&n)
                    .map_or(received, |w| w.received.min(received));
                let t = self.now.entry(n).or_insert(first);
                *t = (*t).min(first);
            }
            Action::Later(n) => match self.later.entry(n) {
                std::collections::hash_map::Entry::Occupied(mut e) => {
                    e.get_mut().again(now, received)
                }
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(Waiting::new(now, received));
                }
            },
            Action::Rescan => match &mut self.rescan {
                Some(w) => w.again(now, received),
                None => self.rescan = Some(Waiting::new(now, received)),
            },
            Action::Ignore => {}
        }
    }

    /// Takes what is due at `now`. A listing takes every waiting read with it.
    pub(super) fn take_due(&mut self, now: Instant, debounce: Duration) -> Due {
        let min =
            |a: Option<std::time::Instant>, b: std::time::Instant| Some(a.map_or(b, |a| a.min(b)));
        if self.rescan.is_some_and(|w| now >= w.due_at(debounce)) {
            let w = self.rescan.take().expect("checked");
            self.rescan_now = min(self.rescan_now, w.received);
        }
        if let Some(first) = self.rescan_now.take() {
            let received = self
                .now
                .values()
                .copied()
                .chain(self.later.values().map(|w| w.received))
                .fold(first, std::time::Instant::min);
            self.now.clear();
            self.later.clear();
            return Due {
                rescan: true,
                received: Some(received),
                ..Due::default()
            };
        }
        let mut due = Due::default();
        for (n, t) in std::mem::take(&mut self.now) {
            due.now.push(n);
            due.received = min(due.received, t);
        }
        let quiet: Vec<String> = self
            .later
            .iter()
            .filter(|(_, w)| now >= w.due_at(debounce))
            .map(|(n, _)| n.clone())
            .collect();
        for n in quiet {
            let w = self.later.remove(&n).expect("listed");
            due.received = min(due.received, w.received);
            due.later.push(n);
        }
        due.later.sort();
        due
    }

    /// When the next waiting read or listing is due.
    pub(super) fn next_due(&self, debounce: Duration) -> Option<Instant> {
        self.later
            .values()
            .chain(self.rescan.iter())
            .map(|w| w.due_at(debounce))
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rename_reads_the_new_name_once() {
        use notify::event::{EventKind, ModifyKind, RenameMode};
        let d = Path::new("/m");
        let name = |m| EventKind::Modify(ModifyKind::Name(m));
        assert_eq!(
            action(d, &name(RenameMode::To), &d.join("a.yaml")),
            Action::Now("a.yaml".into())
        );
        // The old name is gone (once quiet).
        assert_eq!(
            action(d, &name(RenameMode::From), &d.join("b.yaml")),
            Action::Later("b.yaml".into())
        );
        // The pair event of the same rename adds nothing (it would read a.yaml again after
        // the debounce).
        for p in ["a.yaml", "b.yaml"] {
            assert_eq!(
                action(d, &name(RenameMode::Both), &d.join(p)),
                Action::Ignore
            );
        }
    }

    #[test]
    fn batches_are_timed_from_the_first_event_behind_them() {
        let debounce = Duration::from_millis(50);
        let t0 = Instant::now();
        let r0 = std::time::Instant::now();
        let ms = |n: u64| Duration::from_millis(n);
        let mut p = Pending::default();
        // A removal waits for quiet; more events on it, and events on other names, come
        // meanwhile.
        p.note(Action::Later("a.yaml".into()), t0, r0);
        p.note(Action::Ignore, t0 + ms(10), r0 + ms(10));
        p.note(Action::Later("a.yaml".into()), t0 + ms(20), r0 + ms(20));
        assert_eq!(p.next_due(debounce), Some(t0 + ms(70)));
        assert_eq!(p.take_due(t0 + ms(60), debounce), Due::default());
        let due = p.take_due(t0 + ms(70), debounce);
        assert_eq!(due.later, vec!["a.yaml".to_string()]);
        assert_eq!(due.received, Some(r0), "timed from its first event");

        // A file renamed into place is read at once, timed from its own event; one that
        // was waiting keeps its first event.
        p.note(Action::Later("b.yaml".into()), t0 + ms(100), r0 + ms(100));
        p.note(Action::Now("b.yaml".into()), t0 + ms(110), r0 + ms(110));
        p.note(Action::Now("c.yaml".into()), t0 + ms(120), r0 + ms(120));
        let due = p.take_due(t0 + ms(120), debounce);
        assert_eq!(due.now, vec!["b.yaml".to_string(), "c.yaml".to_string()]);
        assert_eq!(due.received, Some(r0 + ms(100)));
        assert!(p.later.is_empty() && p.now.is_empty());

        // A listing takes the waiting reads with it, and their time.
        p.note(Action::Later("d.yaml".into()), t0 + ms(200), r0 + ms(200));
        p.note(Action::Rescan, t0 + ms(210), r0 + ms(210));
        let due = p.take_due(t0 + ms(260), debounce);
        assert!(due.rescan && due.now.is_empty() && due.later.is_empty());
        assert_eq!(due.received, Some(r0 + ms(200)));
        assert_eq!(p.next_due(debounce), None);

        // The periodic resync is timed from itself.
        p.rescan_now = Some(r0 + ms(300));
        let due = p.take_due(t0 + ms(300), debounce);
        assert!(due.rescan);
        assert_eq!(due.received, Some(r0 + ms(300)));
    }
}
