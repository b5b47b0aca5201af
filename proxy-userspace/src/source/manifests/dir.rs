//! The directory as the source knows it: which files it holds, their stamps, and which
//! file defines which object, so that a change to one file becomes changes of the objects
//! it defines without reading the others. Files are stat'ed and parsed in parallel.

use foldhash::{HashMap, HashMapExt, HashSet};
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tracing::debug;

use super::parse::parse_documents;
use crate::source::{Change, Kind, Object, ObjectSet, SourceError};

/// True for a file name the directory source reads.
pub(super) fn is_manifest_name(name: &str) -> bool {
    if name.starts_with('.') || name.ends_with('~') {
        return false;
    }
    let lower = name.to_ascii_lowercase();
    lower.ends_with(".yaml") || lower.ends_with(".yml") || lower.ends_with(".json")
}

/// Reads every manifest file of `dir` at once (see the [`manifests`](super) module
/// documentation for the rules). A directory that cannot be read yields an empty set and
/// one error.
pub fn load_dir(dir: &Path) -> (ObjectSet, Vec<SourceError>) {
    let mut d = Dir::new(dir);
    let mut changes = Vec::new();
    match d.rescan(&mut changes) {
        Ok(()) => {
            let mut set = ObjectSet::default();
            for c in changes {
                set.apply(c);
            }
            (set, d.errors())
        }
        Err(e) => (
            ObjectSet::default(),
            vec![SourceError::file(
                dir.display().to_string(),
                format!("cannot read directory: {e}"),
            )],
        ),
    }
}

/// Identity and version of a file: a file is read again only when one of these changed.
type FileStamp = (u64, u64, u64, i64, i64, i64, i64);

fn stamp(m: &std::fs::Metadata) -> FileStamp {
    use std::os::unix::fs::MetadataExt;
    (
        m.dev(),
        m.ino(),
        m.size(),
        m.mtime(),
        m.mtime_nsec(),
        m.ctime(),
        m.ctime_nsec(),
    )
}

/// An object's identity: kind and (namespace, name) (`("", name)` for a Node).
type ObjectId = (Kind, (String, String));

/// What is known of one file: its stamp, the objects it defines (in document order, each
/// once) and the errors reading it gave (including objects defined twice in it).
#[derive(Debug, Default)]
struct FileState {
    stamp: Option<FileStamp>,
    objects: Vec<ObjectId>,
    errors: Vec<SourceError>,
}

/// The directory as the source knows it: which file defines which object, so that a change
/// to one file is turned into changes of the objects it defines without reading the others.
/// When several files define one object, the last file in name order wins (with an error
/// naming both); when the winner drops it, the next one's definition is read again.
#[derive(Debug, Default)]
pub(super) struct Dir {
    dir: PathBuf,
    files: BTreeMap<String, FileState>,
    /// The files defining each object, in name order (a short sorted vector sharing the
    /// names: there is one per object, and almost every object has one file).
    definers: HashMap<ObjectId, Vec<Arc<str>>>,
    /// Objects defined by more than one file (each later definition is reported).
    multi: BTreeSet<ObjectId>,
}

impl Dir {
    pub(super) fn new(dir: &Path) -> Dir {
        Dir {
            dir: dir.to_path_buf(),
            files: BTreeMap::new(),
            definers: HashMap::new(),
            multi: BTreeSet::new(),
        }
    }

    fn origin(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    /// Lists the directory and refreshes every manifest file in it and every known file
    /// that is gone. An error (the directory cannot be listed) changes nothing.
    pub(super) fn rescan(&mut self, out: &mut Vec<Change>) -> io::Result<()> {
        for chunk in self.plan(u64::MAX)? {
            self.read_chunk(chunk, out);
        }
        Ok(())
    }

    /// Lists the directory and stats every manifest file in it and every known file that
    /// is gone (in parallel): what must be read, in name order, cut into chunks of about
    /// `chunk_bytes` of text each (at least one file), so a caller can hand on each chunk's
    /// objects before the next is parsed. Unchanged files are left out.
    pub(super) fn plan(&self, chunk_bytes: u64) -> io::Result<Vec<Vec<(String, Stat)>>> {
        let mut names = BTreeSet::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                debug!(path = %entry.path().display(), "ignoring file with a non-UTF-8 name");
                continue;
            };
            if is_manifest_name(&name) {
                names.insert(name);
            }
        }
        let gone: Vec<String> = self
            .files
            .keys()
            .filter(|n| !names.contains(*n))
            .cloned()
            .collect();
        let work: Vec<String> = names.into_iter().chain(gone).collect();
        let stats = parallel(&work, |name| {
            stat_file(
                &self.dir,
                name,
                self.files.get(name).and_then(|f| f.stamp),
                false,
            )
        });
        let mut chunks = Vec::new();
        let (mut chunk, mut bytes) = (Vec::new(), 0);
        for (name, st) in work.into_iter().zip(stats) {
            if matches!(st, Stat::Unchanged) {
                continue;
            }
            if let Stat::File(_, size) = st {
                bytes += size;
            }
            chunk.push((name, st));
            if bytes >= chunk_bytes {
                chunks.push(std::mem::take(&mut chunk));
                bytes = 0;
            }
        }
        if !chunk.is_empty() {
            chunks.push(chunk);
        }
        Ok(chunks)
    }

    /// Reads and parses the files of one chunk of [`Dir::plan`] (in parallel), then takes
    /// them in in name order, appending their changes.
    pub(super) fn read_chunk(&mut self, chunk: Vec<(String, Stat)>, out: &mut Vec<Change>) {
        let probes = parallel(&chunk, |(name, st)| read_stat(&self.dir, name, st));
        for ((name, _), p) in chunk.iter().zip(probes) {
            if let Some(p) = p {
                self.install(name, p, out);
            }
        }
    }

    /// Reads file `name` again when its stamp changed (always with `force`), or notices it
    /// is gone, and appends the changes of the objects it defines.
    pub(super) fn refresh(&mut self, name: &str, force: bool, out: &mut Vec<Change>) {
        let known = self.files.get(name).and_then(|f| f.stamp);
        if let Some(p) = probe(&self.dir, name, known, force) {
            self.install(name, p, out);
        }
    }

    /// Takes in what reading file `name` found: appends the changes of the objects it
    /// defines (and of objects another file's definition of is in force again).
    fn install(&mut self, name: &str, (st, read): Probe, out: &mut Vec<Change>) {
        let origin = self.origin(name);
        let (objects, mut errors) = read.unwrap_or_else(|e| (Vec::new(), vec![e]));
        // The last definition in the file wins; the others are reported.
        let mut order: Vec<ObjectId> = Vec::new();
        let mut latest: HashMap<ObjectId, Object> = HashMap::new();
        for object in objects {
            let id = (object.kind_of(), object.key());
            if latest.insert(id.clone(), object).is_some() {
                errors.push(SourceError::object(
                    origin.clone(),
                    id.0.as_str(),
                    id.1.0.clone(),
                    id.1.1.clone(),
                    format!("defined more than once in {origin}; the last definition is used"),
                ));
            } else {
                order.push(id);
            }
        }
        let old = self.files.remove(name).unwrap_or_default();
        let kept: HashSet<&ObjectId> = order.iter().collect();
        let mut reread = BTreeSet::new();
        for id in old.objects.iter().filter(|id| !kept.contains(id)) {
            let Some(set) = self.definers.get_mut(id) else {
                continue;
            };
            let was_winner = set.last().map(|f| &**f) == Some(name);
            set.retain(|f| &**f != name);
            if set.len() < 2 {
                self.multi.remove(id);
            }
            match set.last() {
                None => {
                    self.definers.remove(id);
                    out.push(Change::Delete(id.0, id.1.clone()));
                }
                Some(next) if was_winner => {
                    reread.insert(next.to_string());
                }
                Some(_) => {}
            }
        }
        let shared: Arc<str> = Arc::from(name);
        for id in &order {
            let set = self.definers.entry(id.clone()).or_default();
            if let Err(at) = set.binary_search_by(|f| (**f).cmp(name)) {
                set.insert(at, shared.clone());
            }
            if set.len() > 1 {
                self.multi.insert(id.clone());
            }
            if set.last().map(|f| &**f) == Some(name)
                && let Some(object) = latest.remove(id)
            {
                out.push(Change::Apply(object));
            }
        }
        if st.is_some() || !errors.is_empty() {
            self.files.insert(
                name.to_string(),
                FileState {
                    stamp: st,
                    objects: order,
                    errors,
                },
            );
        }
        for next in reread {
            if next != name {
                self.refresh(&next, true, out);
            }
        }
    }

    /// Every error now: per file in name order, what reading it gave, then the objects it
    /// defines that an earlier file defines too.
    pub(super) fn errors(&self) -> Vec<SourceError> {
        let mut later: BTreeMap<&str, Vec<SourceError>> = BTreeMap::new();
        for id in &self.multi {
            let Some(set) = self.definers.get(id) else {
                continue;
            };
            for (previous, file) in set.iter().zip(set.iter().skip(1)) {
                let origin = self.origin(file);
                later.entry(&**file).or_default().push(SourceError::object(
                    origin.clone(),
                    id.0.as_str(),
                    id.1.0.clone(),
                    id.1.1.clone(),
                    format!(
                        "also defined in {}; the definition in {origin} is used",
                        self.origin(previous)
                    ),
                ));
            }
        }
        let mut out = Vec::new();
        for (name, f) in &self.files {
            out.extend(f.errors.iter().cloned());
            out.extend(later.remove(name.as_str()).into_iter().flatten());
        }
        out
    }
}

/// What reading one file found: its stamp (`None`: gone, or not a regular file) and its
/// objects and errors (or the one error that it could not be read).
type Probe = (
    Option<FileStamp>,
    Result<(Vec<Object>, Vec<SourceError>), SourceError>,
);

/// What a stat of one file found.
#[derive(Debug)]
pub(super) enum Stat {
    /// Its stamp is the known one: nothing to read.
    Unchanged,
    /// A regular file (or a symlink to one) to read: its stamp and size in bytes.
    File(FileStamp, u64),
    /// Gone, or not a regular file: it defines nothing.
    Gone,
    /// It cannot be stat'ed.
    Error(SourceError),
}

/// Stats file `name` of `dir`; [`Stat::Unchanged`] when its stamp is `known` (never with
/// `force`).
fn stat_file(dir: &Path, name: &str, known: Option<FileStamp>, force: bool) -> Stat {
    let path = dir.join(name);
    // Follows symlinks (ConfigMap volumes); a directory named *.yaml is no file.
    match std::fs::metadata(&path) {
        Ok(m) if m.is_file() => {
            let st = stamp(&m);
            if !force && known == Some(st) {
                Stat::Unchanged
            } else {
                Stat::File(st, m.len())
            }
        }
        Ok(_) => Stat::Gone,
        Err(e) if e.kind() == io::ErrorKind::NotFound => Stat::Gone,
        Err(e) => Stat::Error(SourceError::file(
            path.display().to_string(),
            format!("cannot read file: {e}"),
        )),
    }
}

/// Reads file `name` of `dir` as `st` found it; `None` when it is unchanged.
fn read_stat(dir: &Path, name: &str, st: &Stat) -> Option<Probe> {
    Some(match st {
        Stat::Unchanged => return None,
        Stat::File(stamp, _) => {
            let path = dir.join(name);
            let origin = path.display().to_string();
            (Some(*stamp), read_file(&path, &origin))
        }
        Stat::Gone => (None, Ok((Vec::new(), Vec::new()))),
        Stat::Error(e) => (None, Err(e.clone())),
    })
}

/// Stats file `name` of `dir` and reads it when its stamp differs from `known` (always with
/// `force`); `None` when it is unchanged.
fn probe(dir: &Path, name: &str, known: Option<FileStamp>, force: bool) -> Option<Probe> {
    read_stat(dir, name, &stat_file(dir, name, known, force))
}

/// `f` of every item, in item order, computed by up to 4 threads (as many as there are
/// cores) that take the next item as they finish one, so one large file does not hold
/// up the others' share.
fn parallel<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 4)
        .min(items.len());
    if workers <= 1 {
        return items.iter().map(f).collect();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut done: Vec<(usize, R)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(item) = items.get(i) else {
                            return mine;
                        };
                        mine.push((i, f(item)));
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    done.sort_unstable_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}

/// Reads and parses one file; an unreadable or non-UTF-8 file is one error.
fn read_file(path: &Path, origin: &str) -> Result<(Vec<Object>, Vec<SourceError>), SourceError> {
    let bytes = std::fs::read(path)
        .map_err(|e| SourceError::file(origin, format!("cannot read file: {e}")))?;
    let text = String::from_utf8(bytes)
        .map_err(|e| SourceError::file(origin, format!("file is not UTF-8: {e}")))?;
    Ok(parse_documents(origin, &text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::manifests::fixtures::{SLICE, SVC, lines, write};
    use crate::source::{ManifestSource, Source};

    #[test]
    fn load_dir_reads_sorted_files_and_ignores_others() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        write(d, "b.yml", SLICE);
        write(d, "a.yaml", SVC);
        write(
            d,
            "c.json",
            r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"c"},"spec":{}}"#,
        );
        write(
            d,
            "D.YAML",
            "apiVersion: v1\nkind: Service\nmetadata: {name: d}\n",
        );
        // Ignored: hidden, editor temp/backup, other extensions, subdirectories.
        write(d, ".hidden.yaml", "not: [valid");
        write(d, ".a.yaml.swp", "garbage");
        write(d, "a.yaml~", "not: [valid");
        write(d, "4913", "x");
        write(d, "notes.txt", "x");
        std::fs::create_dir(d.join("sub.yaml")).unwrap();
        write(
            &d.join("sub.yaml"),
            "x.yaml",
            "apiVersion: v1\nkind: Service\nmetadata: {name: sub}\n",
        );

        let (set, errors) = load_dir(d);
        assert!(errors.is_empty(), "{errors:?}");
        let svcs: Vec<_> = set.services.keys().cloned().collect();
        assert_eq!(
            svcs,
            vec![
                ("default".into(), "c".into()),
                ("default".into(), "d".into()),
                ("shop".into(), "web".into())
            ]
        );
        let slices: Vec<_> = set.endpoint_slices.keys().cloned().collect();
        assert_eq!(slices, vec![("shop".to_string(), "web-abc".to_string())]);
        assert_eq!(
            set.services[&("shop".into(), "web".into())].origin,
            d.join("a.yaml").display().to_string()
        );
    }

    #[test]
    fn load_dir_unparseable_file_next_to_good_one() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        write(d, "bad.yaml", "apiVersion: v1\nkind: [unclosed\n");
        write(d, "good.yaml", SVC);
        write(d, "bin.yaml", "");
        std::fs::write(d.join("bin.yaml"), [0xff, 0xfe, 0x00]).unwrap();
        let (set, errors) = load_dir(d);
        assert_eq!(set.services.len(), 1);
        assert_eq!(errors.len(), 2, "{errors:?}");
        let bad = d.join("bad.yaml").display().to_string();
        let bin = d.join("bin.yaml").display().to_string();
        assert_eq!(errors[0].origin, bad);
        assert!(
            errors[0]
                .to_string()
                .starts_with(&format!("{bad}: invalid YAML in document 1: "))
        );
        assert!(
            errors[1]
                .to_string()
                .starts_with(&format!("{bin}: file is not UTF-8")),
            "{}",
            errors[1]
        );
    }

    #[test]
    fn load_dir_duplicate_later_file_wins() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        write(d, "1.yaml", SVC);
        write(d, "2.yaml", &SVC.replace("10.96.0.10", "10.96.0.11"));
        write(d, "3.yaml", &format!("{SLICE}---\n{SLICE}"));
        let (set, errors) = load_dir(d);
        let svc = &set.services[&("shop".into(), "web".into())];
        assert_eq!(
            svc.object.spec.as_ref().unwrap().cluster_ip.as_deref(),
            Some("10.96.0.11")
        );
        let (one, two, three) = (
            d.join("1.yaml").display().to_string(),
            d.join("2.yaml").display().to_string(),
            d.join("3.yaml").display().to_string(),
        );
        assert_eq!(svc.origin, two);
        assert_eq!(
            lines(&errors),
            vec![
                format!(
                    "{two}: Service shop/web: also defined in {one}; the definition in {two} is used"
                ),
                format!(
                    "{three}: EndpointSlice shop/web-abc: defined more than once in {three}; the last definition is used"
                ),
            ]
        );
    }

    #[test]
    fn load_dir_missing_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let missing = tmp.path().join("nope");
        let (set, errors) = load_dir(&missing);
        assert!(set.is_empty());
        assert_eq!(errors.len(), 1);
        assert!(errors[0].reason.starts_with("cannot read directory"));
        assert!(ManifestSource::new(&missing).start().is_err());
    }
}
