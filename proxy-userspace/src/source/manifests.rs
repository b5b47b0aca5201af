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

use foldhash::{HashMap, HashMapExt, HashSet};
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde::Deserialize;
use serde_json::Value;
use tokio::{sync::mpsc, time::Instant};
use tracing::{debug, warn};

use super::{Batch, Change, Kind, Object, ObjectSet, Source, SourceError, Sourced};

const SERVICE_API: &str = "v1";
const ENDPOINT_SLICE_API: &str = "discovery.k8s.io/v1";

/// Parses the text of one manifest file. `origin` names the file in errors; when it ends in
/// `.json` (any case) the text is parsed as a JSON stream, otherwise as multi-document YAML.
/// Returns the objects in document order and the errors of everything skipped.
pub fn parse_documents(origin: &str, text: &str) -> (Vec<Object>, Vec<SourceError>) {
    let mut objects = Vec::new();
    let mut errors = Vec::new();
    if origin.to_ascii_lowercase().ends_with(".json") {
        for (i, doc) in serde_json::Deserializer::from_str(text)
            .into_iter::<&serde_json::value::RawValue>()
            .enumerate()
        {
            match doc {
                Ok(raw) => match plain_object(origin, raw.get()) {
                    Some(object) => objects.push(object),
                    // Everything else (lists, errors) through the general path, which
                    // words the errors.
                    None => match serde_json::from_str::<Value>(raw.get()) {
                        Ok(value) => {
                            dispatch(origin, i + 1, value, None, &mut objects, &mut errors)
                        }
                        Err(e) => errors.push(SourceError::file(
                            origin,
                            format!("invalid JSON in document {}: {e}; document skipped", i + 1),
                        )),
                    },
                },
                Err(e) => {
                    errors.push(SourceError::file(
                        origin,
                        format!(
                            "invalid JSON in document {}: {e}; rest of the file skipped",
                            i + 1
                        ),
                    ));
                    break;
                }
            }
        }
    } else {
        parse_yaml(origin, text, &mut objects, &mut errors);
    }
    (objects, errors)
}

/// Parses multi-document YAML. The whole text is read as one stream first; serde_yaml's
/// stream ends at a syntax error, so when it hits one, the text is parsed again piece by
/// piece, cut before every line that starts a document (`---` at column 0, see
/// [`document_pieces`]): a broken document then loses only itself.
fn parse_yaml(origin: &str, text: &str, objects: &mut Vec<Object>, errors: &mut Vec<SourceError>) {
    let mut whole = (Vec::new(), Vec::new());
    if parse_yaml_stream(origin, text, 0, 1, &mut whole.0, &mut whole.1).is_ok() {
        objects.append(&mut whole.0);
        errors.append(&mut whole.1);
        return;
    }
    let mut documents = 0;
    for (line, piece) in document_pieces(text) {
        // Comments before the first `---` are no document (the parser would see an empty one).
        let prelude = !piece.starts_with("---")
            && piece.lines().all(|l| {
                let l = l.trim();
                l.is_empty() || l.starts_with('#') || l.starts_with('%')
            });
        if prelude {
            continue;
        }
        match parse_yaml_stream(origin, piece, documents, line, objects, errors) {
            Ok(n) => documents += n,
            Err(n) => documents += n + 1,
        }
    }
}

/// Cuts YAML text before every line that starts with the document marker `---` followed by
/// the end of the line, a space or a tab. YAML forbids such a line inside any content (block
/// scalars are indented, quoted scalars may not hold it at column 0), so each piece holds at
/// most one document; the first may hold none (only comments or directives). Returns the
/// 1-based line number where each piece starts, and the piece.
fn document_pieces(text: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let (mut start, mut start_line, mut pos) = (0, 1, 0);
    for (i, line) in text.split_inclusive('\n').enumerate() {
        let rest = line.strip_prefix("---");
        let marker = rest.is_some_and(|r| {
            r.is_empty() || r.starts_with([' ', '\t', '\n']) || r == "\r\n" || r == "\r"
        });
        if marker && pos > start {
            out.push((start_line, &text[start..pos]));
            start = pos;
            start_line = i + 1;
        }
        pos += line.len();
    }
    if pos > start || out.is_empty() {
        out.push((start_line, &text[start..]));
    }
    out
}

/// Reads the documents of `text`, numbering them from `before + 1` in errors (`first_line`
/// is where `text` starts in the file, named in syntax errors of a piece). Returns the number
/// of documents read, or at a syntax error the number read before it (the error is pushed).
fn parse_yaml_stream(
    origin: &str,
    text: &str,
    before: usize,
    first_line: usize,
    objects: &mut Vec<Object>,
    errors: &mut Vec<SourceError>,
) -> Result<usize, usize> {
    let mut read = 0;
    for doc in serde_yaml_ng::Deserializer::from_str(text) {
        let number = before + read + 1;
        // Through a YAML value first: a document that is valid YAML but not valid JSON
        // (a number out of range, a non-string key) is skipped alone.
        match serde_yaml_ng::Value::deserialize(doc) {
            Ok(yaml) => match serde_json::to_value(&yaml) {
                Ok(value) => dispatch(origin, number, value, None, objects, errors),
                Err(e) => {
                    let get = |f: &str| {
                        yaml.get(f)
                            .and_then(|v| v.as_str())
                            .unwrap_or("")
                            .to_string()
                    };
                    let meta = |f: &str| {
                        yaml.get("metadata")
                            .and_then(|m| m.get(f))
                            .and_then(|v| v.as_str())
                            .unwrap_or("")
                            .to_string()
                    };
                    let ns = if meta("namespace").is_empty() {
                        "default".to_string()
                    } else {
                        meta("namespace")
                    };
                    errors.push(SourceError::object(
                        origin,
                        get("kind"),
                        ns,
                        meta("name"),
                        format!("document {number} cannot be read: {e}; object skipped"),
                    ));
                }
            },
            Err(e) => {
                let msg = e.to_string();
                // A value YAML cannot represent (an integer beyond 64 bits) spoils only
                // its document; a syntax error ends the stream.
                if msg.contains("invalid type") || msg.contains("invalid value") {
                    errors.push(SourceError::file(
                        origin,
                        format!("document {number} cannot be read: {msg}; document skipped"),
                    ));
                    read += 1;
                    continue;
                }
                let msg = shift_lines(&msg, first_line - 1);
                errors.push(SourceError::file(
                    origin,
                    format!("invalid YAML in document {number}: {msg}; document skipped"),
                ));
                return Err(read);
            }
        }
        read += 1;
    }
    Ok(read)
}

/// Adds `offset` to every "line N" of a YAML error message, so that positions in a piece
/// of a file name lines of the file.
fn shift_lines(msg: &str, offset: usize) -> String {
    if offset == 0 {
        return msg.to_string();
    }
    let mut out = String::with_capacity(msg.len() + 8);
    let mut rest = msg;
    while let Some(i) = rest.find("line ") {
        out.push_str(&rest[..i + 5]);
        rest = &rest[i + 5..];
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        match rest[..digits].parse::<usize>() {
            Ok(n) => out.push_str(&(n + offset).to_string()),
            Err(_) => out.push_str(&rest[..digits]),
        }
        rest = &rest[digits..];
    }
    out.push_str(rest);
    out
}

/// The fields of a JSON document that say what it is, borrowed from the text.
#[derive(Deserialize)]
struct Head<'a> {
    #[serde(rename = "apiVersion", borrow, default)]
    api_version: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    kind: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    metadata: Option<HeadMeta<'a>>,
}

#[derive(Deserialize)]
struct HeadMeta<'a> {
    #[serde(borrow, default)]
    name: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    namespace: Option<std::borrow::Cow<'a, str>>,
}

/// The common case of a JSON document, read straight into its k8s-openapi type: one
/// Service, EndpointSlice or Node with its apiVersion, kind and name, that deserializes.
/// `None` for anything else, which [`dispatch`] reads (and words the errors of) through a
/// `serde_json::Value`; the result is the same object either way, about twice as fast (no
/// intermediate tree).
fn plain_object(origin: &str, raw: &str) -> Option<Object> {
    let head: Head = serde_json::from_str(raw).ok()?;
    let meta = head.metadata?;
    meta.name.as_deref().filter(|n| !n.is_empty())?;
    let ns = meta
        .namespace
        .as_deref()
        .filter(|n| !n.is_empty())
        .unwrap_or("default");
    match (head.api_version.as_deref()?, head.kind.as_deref()?) {
        (SERVICE_API, "Service") => {
            let mut s: Service = serde_json::from_str(raw).ok()?;
            s.metadata.namespace = Some(ns.to_string());
            Some(Object::Service(Sourced::new(origin, s)))
        }
        (ENDPOINT_SLICE_API, "EndpointSlice") => {
            let mut s: EndpointSlice = serde_json::from_str(raw).ok()?;
            s.metadata.namespace = Some(ns.to_string());
            Some(Object::EndpointSlice(Sourced::new(origin, s)))
        }
        (SERVICE_API, "Node") => {
            let mut n: Node = serde_json::from_str(raw).ok()?;
            n.metadata.namespace = None;
            Some(Object::Node(Sourced::new(origin, n)))
        }
        _ => None,
    }
}

/// A string field of a JSON object, when present and a string.
fn str_field<'a>(value: &'a Value, field: &str) -> Option<&'a str> {
    value.get(field).and_then(Value::as_str)
}

/// (namespace, name) as far as they can be read from a raw object; namespace defaults to
/// "default", name to "".
fn raw_key(value: &Value) -> (String, String) {
    let meta = value.get("metadata");
    let ns = meta
        .and_then(|m| str_field(m, "namespace"))
        .filter(|n| !n.is_empty())
        .unwrap_or("default");
    let name = meta.and_then(|m| str_field(m, "name")).unwrap_or("");
    (ns.to_string(), name.to_string())
}

/// Dispatches one document (or list item). `document` is its number in the file (from 1,
/// for messages); `list_item_type` is `(apiVersion, kind)` of the typed list the value is an
/// item of, used when the item leaves them out.
fn dispatch(
    origin: &str,
    document: usize,
    mut value: Value,
    list_item_type: Option<(&str, &str)>,
    objects: &mut Vec<Object>,
    errors: &mut Vec<SourceError>,
) {
    if value.is_null() {
        return; // empty document
    }
    let Some(map) = value.as_object_mut() else {
        let what = if list_item_type.is_some() {
            "an item of the list in document"
        } else {
            "document"
        };
        errors.push(SourceError::file(
            origin,
            format!("{what} {document} is not an object (expected a Kubernetes manifest)"),
        ));
        return;
    };
    if let Some((api, kind)) = list_item_type {
        map.entry("apiVersion")
            .or_insert_with(|| Value::String(api.into()));
        map.entry("kind")
            .or_insert_with(|| Value::String(kind.into()));
    }
    let (ns, name) = raw_key(&value);
    let api = str_field(&value, "apiVersion").map(str::to_owned);
    let kind = str_field(&value, "kind").map(str::to_owned);
    let (api, kind) = match (api, kind) {
        (Some(a), Some(k)) if !a.is_empty() && !k.is_empty() => (a, k),
        (a, k) => {
            let missing = match (a.as_deref().unwrap_or(""), k.as_deref().unwrap_or("")) {
                ("", "") => "apiVersion and kind",
                ("", _) => "apiVersion",
                _ => "kind",
            };
            let shown_ns = if name.is_empty() { String::new() } else { ns };
            errors.push(SourceError::object(
                origin,
                k.unwrap_or_default(),
                shown_ns,
                name,
                format!("missing {missing}; object skipped"),
            ));
            return;
        }
    };

    let item_type = match (api.as_str(), kind.as_str()) {
        ("v1", "List") => Some(None),
        ("v1", "ServiceList") => Some(Some((SERVICE_API, "Service"))),
        ("v1", "NodeList") => Some(Some((SERVICE_API, "Node"))),
        ("discovery.k8s.io/v1", "EndpointSliceList") => {
            Some(Some((ENDPOINT_SLICE_API, "EndpointSlice")))
        }
        _ => None,
    };
    if let Some(item_type) = item_type {
        match value.get_mut("items").map(Value::take) {
            None | Some(Value::Null) => {} // an empty list
            Some(Value::Array(items)) => {
                for item in items {
                    dispatch(origin, document, item, item_type, objects, errors);
                }
            }
            Some(_) => errors.push(SourceError::object(
                origin,
                kind,
                "",
                "",
                "items is not a list; list skipped",
            )),
        }
        return;
    }

    let shown_ns = if name.is_empty() {
        String::new()
    } else {
        ns.clone()
    };
    match (api.as_str(), kind.as_str()) {
        (SERVICE_API, "Service")
        | (ENDPOINT_SLICE_API, "EndpointSlice")
        | (SERVICE_API, "Node")
        | (SERVICE_API, "Pod")
        | (SERVICE_API, "Namespace") => {}
        _ => {
            errors.push(SourceError::object(
                origin,
                kind.clone(),
                shown_ns,
                name,
                format!(
                    "unsupported kind {api} {kind} (only v1 Service, discovery.k8s.io/v1 \
                     EndpointSlice, v1 Node, v1 Pod and v1 Namespace are read); object skipped"
                ),
            ));
            return;
        }
    }
    if name.is_empty() {
        errors.push(SourceError::object(
            origin,
            kind,
            "",
            "",
            "metadata.name is missing; object skipped",
        ));
        return;
    }
    let result = if kind == "Pod" {
        serde_json::from_value::<Pod>(value).map(|mut p| {
            p.metadata.namespace = Some(ns.clone());
            Object::Pod(Sourced::new(origin, p))
        })
    } else if kind == "Namespace" {
        serde_json::from_value::<Namespace>(value).map(|mut n| {
            n.metadata.namespace = None;
            Object::Namespace(Sourced::new(origin, n))
        })
    } else if kind == "Node" {
        serde_json::from_value::<Node>(value).map(|mut n| {
            n.metadata.namespace = None;
            Object::Node(Sourced::new(origin, n))
        })
    } else if kind == "Service" {
        serde_json::from_value::<Service>(value).map(|mut s| {
            s.metadata.namespace = Some(ns.clone());
            Object::Service(Sourced::new(origin, s))
        })
    } else {
        serde_json::from_value::<EndpointSlice>(value).map(|mut s| {
            s.metadata.namespace = Some(ns.clone());
            Object::EndpointSlice(Sourced::new(origin, s))
        })
    };
    match result {
        Ok(object) => objects.push(object),
        Err(e) => errors.push(SourceError::object(
            origin,
            kind,
            ns,
            name,
            format!("{e}; object skipped"),
        )),
    }
}

/// True for a file name the directory source reads.
fn is_manifest_name(name: &str) -> bool {
    if name.starts_with('.') || name.ends_with('~') {
        return false;
    }
    let lower = name.to_ascii_lowercase();
    lower.ends_with(".yaml") || lower.ends_with(".yml") || lower.ends_with(".json")
}

/// Reads every manifest file of `dir` at once (see the module documentation for the rules).
/// A directory that cannot be read yields an empty set and one error.
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
struct Dir {
    dir: PathBuf,
    files: BTreeMap<String, FileState>,
    /// The files defining each object, in name order (a short sorted vector sharing the
    /// names: there is one per object, and almost every object has one file).
    definers: HashMap<ObjectId, Vec<Arc<str>>>,
    /// Objects defined by more than one file (each later definition is reported).
    multi: BTreeSet<ObjectId>,
}

impl Dir {
    fn new(dir: &Path) -> Dir {
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
    fn rescan(&mut self, out: &mut Vec<Change>) -> io::Result<()> {
        for chunk in self.plan(u64::MAX)? {
            self.read_chunk(chunk, out);
        }
        Ok(())
    }

    /// Lists the directory and stats every manifest file in it and every known file that
    /// is gone (in parallel): what must be read, in name order, cut into chunks of about
    /// `chunk_bytes` of text each (at least one file), so a caller can hand on each chunk's
    /// objects before the next is parsed. Unchanged files are left out.
    fn plan(&self, chunk_bytes: u64) -> io::Result<Vec<Vec<(String, Stat)>>> {
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
    fn read_chunk(&mut self, chunk: Vec<(String, Stat)>, out: &mut Vec<Change>) {
        let probes = parallel(&chunk, |(name, st)| read_stat(&self.dir, name, st));
        for ((name, _), p) in chunk.iter().zip(probes) {
            if let Some(p) = p {
                self.install(name, p, out);
            }
        }
    }

    /// Reads file `name` again when its stamp changed (always with `force`), or notices it
    /// is gone, and appends the changes of the objects it defines.
    fn refresh(&mut self, name: &str, force: bool, out: &mut Vec<Change>) {
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
    fn errors(&self) -> Vec<SourceError> {
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
enum Stat {
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
/// Longest a stream of events on one file can delay its read.
const MAX_DEBOUNCE_DELAY: Duration = Duration::from_secs(1);

/// A [`Source`] reading a directory of manifests (see the module documentation) and
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
/// is timed ([`Batch::received`]) from the earliest watch event behind what it holds, as the
/// watcher received it, so a debounced read counts its wait.
///
/// The first listing parses files in parallel and is sent in chunks of about 1 MiB of
/// manifest text, each as soon as it is parsed, in batches that are not complete yet
/// ([`Batch::synced`] false but for the last): the agent reads one chunk into its model
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

    /// Sets the quiet time after the last event on a file that may still be written.
    pub fn with_debounce(mut self, debounce: Duration) -> Self {
        self.debounce = debounce;
        self
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

/// What an event asks for, per path.
#[derive(Debug, PartialEq, Eq)]
enum Action {
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
fn action(dir: &Path, kind: &notify::EventKind, path: &Path) -> Action {
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
fn dir_identity(dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(dir).ok().map(|m| (m.dev(), m.ino()))
}

struct Watch {
    watcher: notify::RecommendedWatcher,
    dir: PathBuf,
    /// Identity of the directory the watch is on; `None` when not watching.
    watching: Option<(u64, u64)>,
}

impl Watch {
    /// (Re-)establishes the watch when the directory is not watched or was replaced.
    /// Returns true when a new watch was set up (the directory must then be listed).
    fn ensure(&mut self) -> bool {
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
        let mut watch = Watch {
            watcher,
            dir: self.dir.clone(),
            watching: None,
        };
        // Watch before the first read, so no change between the two is lost.
        watch.ensure();
        if watch.watching.is_none() {
            anyhow::bail!("cannot watch manifest directory {}", self.dir.display());
        }
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(run(self, watch, event_rx, tx));
        Ok(rx)
    }
}

/// A watch event and when the watcher received it.
type Received = (std::time::Instant, notify::Result<notify::Event>);

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
/// a batch is timed from the earliest event behind what it holds ([`Batch::received`]),
/// not from whatever event came last, so a debounced read counts its wait.
#[derive(Debug, Default)]
struct Pending {
    /// Complete files (closed after writing, renamed into place): read at once.
    now: BTreeMap<String, std::time::Instant>,
    /// Files that may still be written: read once quiet.
    later: HashMap<String, Waiting>,
    /// A listing of the whole directory once quiet (the directory itself changed, events
    /// were lost).
    rescan: Option<Waiting>,
    /// A listing due at once (the start, the periodic resync).
    rescan_now: Option<std::time::Instant>,
}

/// What is due in one round.
#[derive(Debug, Default, PartialEq, Eq)]
struct Due {
    /// List the whole directory (it covers every file).
    rescan: bool,
    /// Complete files to read.
    now: Vec<String>,
    /// Files that became quiet.
    later: Vec<String>,
    /// The earliest event behind all of it.
    received: Option<std::time::Instant>,
}

impl Pending {
    /// Takes in what an event on one path asks for.
    fn note(&mut self, action: Action, now: Instant, received: std::time::Instant) {
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
    fn take_due(&mut self, now: Instant, debounce: Duration) -> Due {
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
    fn next_due(&self, debounce: Duration) -> Option<Instant> {
        self.later
            .values()
            .chain(self.rescan.iter())
            .map(|w| w.due_at(debounce))
            .min()
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
    let mut pending = Pending {
        rescan_now: Some(std::time::Instant::now()),
        ..Pending::default()
    };
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
mod tests {
    use super::*;

    const SVC: &str = "apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: shop
spec:
  clusterIP: 10.96.0.10
  ports:
  - port: 80
";

    const SLICE: &str = "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc
  namespace: shop
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
endpoints:
- addresses: [10.0.0.1]
ports:
- port: 8080
";

    fn keys(objects: &[Object]) -> Vec<(&'static str, String, String)> {
        objects
            .iter()
            .map(|o| {
                let (ns, name) = o.key();
                (o.kind(), ns, name)
            })
            .collect()
    }

    fn lines(errors: &[SourceError]) -> Vec<String> {
        errors.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn out_of_range_number_skips_only_its_document() {
        let text = "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {clusterIP: 10.0.0.1, ports: [{port: 80}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: big, namespace: x}\nspec: {ports: [{port: 99999999999999999999}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: c}\nspec: {clusterIP: 10.0.0.3, ports: [{port: 80}]}\n";
        let (objects, errors) = parse_documents("f.yaml", text);
        assert_eq!(objects.len(), 2, "{errors:?}");
        assert_eq!(errors.len(), 1, "{errors:?}");
        let msg = errors[0].to_string();
        assert!(
            msg.contains("document 2") && msg.contains("document skipped"),
            "{msg}"
        );
    }

    #[test]
    fn multi_document_yaml() {
        let text = format!("---\n{SVC}---\n# only a comment\n---\n{SLICE}---\n");
        let (objects, errors) = parse_documents("a.yaml", &text);
        assert_eq!(lines(&errors), Vec::<String>::new());
        assert_eq!(
            keys(&objects),
            vec![
                ("Service", "shop".into(), "web".into()),
                ("EndpointSlice", "shop".into(), "web-abc".into())
            ]
        );
        assert_eq!(objects[0].origin(), "a.yaml");
        let Object::Service(s) = &objects[0] else {
            panic!()
        };
        assert_eq!(
            s.object.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port,
            80
        );
    }

    #[test]
    fn empty_and_comment_only_files() {
        for text in ["", "\n", "# nothing\n", "---\n", "---\n---\n"] {
            let (objects, errors) = parse_documents("e.yaml", text);
            assert!(objects.is_empty(), "{text:?}");
            assert!(errors.is_empty(), "{text:?}: {errors:?}");
        }
        let (objects, errors) = parse_documents("e.json", "");
        assert!(objects.is_empty() && errors.is_empty());
    }

    #[test]
    fn lists_generic_and_typed() {
        let text = "apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: a}
  spec: {clusterIP: 10.96.0.1, ports: [{port: 53, protocol: UDP}]}
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {name: a-1}
  addressType: IPv4
  endpoints: []
- metadata: {name: no-kind}
---
apiVersion: v1
kind: ServiceList
items:
- metadata: {name: b, namespace: x}
  spec: {clusterIP: 10.96.0.2}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSliceList
items:
- metadata: {name: b-1, namespace: x}
  addressType: IPv6
  endpoints: []
---
apiVersion: v1
kind: List
items: []
";
        let (objects, errors) = parse_documents("l.yaml", text);
        assert_eq!(
            keys(&objects),
            vec![
                ("Service", "default".into(), "a".into()),
                ("EndpointSlice", "default".into(), "a-1".into()),
                ("Service", "x".into(), "b".into()),
                ("EndpointSlice", "x".into(), "b-1".into()),
            ]
        );
        assert_eq!(
            lines(&errors),
            vec!["l.yaml: default/no-kind: missing apiVersion and kind; object skipped"]
        );
    }

    #[test]
    fn json_file_single_and_stream() {
        let json = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"j"},
            "spec":{"clusterIP":"10.96.0.3","ports":[{"port":443}]}}
            {"apiVersion":"v1","kind":"List","items":[{"apiVersion":"v1","kind":"Service",
            "metadata":{"name":"k","namespace":"n"},"spec":{"clusterIP":"10.96.0.4"}}]}"#;
        let (objects, errors) = parse_documents("/m/svc.json", json);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(
            keys(&objects),
            vec![
                ("Service", "default".into(), "j".into()),
                ("Service", "n".into(), "k".into())
            ]
        );
        // Namespace defaulted on the object itself.
        let Object::Service(s) = &objects[0] else {
            panic!()
        };
        assert_eq!(s.object.metadata.namespace.as_deref(), Some("default"));
    }

    #[test]
    fn invalid_json_keeps_earlier_values() {
        let json =
            r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"j"}} {"apiVersion": "#;
        let (objects, errors) = parse_documents("x.JSON", json);
        assert_eq!(
            keys(&objects),
            vec![("Service", "default".into(), "j".into())]
        );
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0]
                .to_string()
                .starts_with("x.JSON: invalid JSON in document 2: "),
            "{}",
            errors[0]
        );
    }

    fn svc(name: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: shop}}\nspec: {{clusterIP: 10.96.0.1, ports: [{{port: 80}}]}}\n"
        )
    }

    fn slice(name: &str, service: &str) -> String {
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}, namespace: shop, labels: {{kubernetes.io/service-name: {service}}}}}\naddressType: IPv4\nendpoints: [{{addresses: [10.0.0.1]}}]\nports: [{{port: 8080}}]\n"
        )
    }

    fn names(objects: &[Object]) -> Vec<String> {
        objects.iter().map(|o| o.key().1).collect()
    }

    #[test]
    fn yaml_syntax_error_mid_stream_keeps_earlier_documents() {
        let text = format!("{SVC}---\nkind: [unclosed\n---\n{SLICE}");
        let (objects, errors) = parse_documents("m.yaml", &text);
        assert_eq!(
            keys(&objects),
            vec![
                ("Service", "shop".into(), "web".into()),
                ("EndpointSlice", "shop".into(), "web-abc".into())
            ]
        );
        assert_eq!(errors.len(), 1, "{errors:?}");
        let line = errors[0].to_string();
        assert!(
            line.starts_with("m.yaml: invalid YAML in document 2: "),
            "{line}"
        );
        assert!(line.ends_with("document skipped"), "{line}");
        assert_eq!(errors[0].kind, "");
    }

    /// The review's case: Service `two` broken by a deleted `}` must not take Service
    /// `one`'s slice (a later document) with it.
    #[test]
    fn yaml_broken_middle_document_keeps_the_others() {
        let two = svc("two").replacen("80}]}", "80}]", 1);
        let text = format!(
            "{}---\n{two}---\n{}---\n{}",
            svc("one"),
            slice("one-1", "one"),
            slice("two-1", "two")
        );
        let (objects, errors) = parse_documents("m.yaml", &text);
        assert_eq!(names(&objects), ["one", "one-1", "two-1"], "{errors:?}");
        assert_eq!(errors.len(), 1, "{errors:?}");
        let line = errors[0].to_string();
        assert!(
            line.starts_with("m.yaml: invalid YAML in document 2: "),
            "{line}"
        );
        // Positions are lines of the file, not of the piece: the broken `spec` is line 9.
        assert!(line.contains("at line 9 column"), "{line}");
    }

    #[test]
    fn yaml_broken_first_or_last_document_keeps_the_others() {
        let bad = "apiVersion: v1\nkind: Service\nmetadata: {name: bad\n";
        let first = format!("{bad}---\n{}---\n{}", svc("one"), slice("one-1", "one"));
        let (objects, errors) = parse_documents("f.yaml", &first);
        assert_eq!(names(&objects), ["one", "one-1"], "{errors:?}");
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0]
                .to_string()
                .starts_with("f.yaml: invalid YAML in document 1: "),
            "{}",
            errors[0]
        );

        // A leading `---` and a comment-only prelude do not count as documents.
        let last = format!(
            "# shop\n---\n{}---\n{}--- # the broken one\n{bad}",
            svc("one"),
            slice("one-1", "one")
        );
        let (objects, errors) = parse_documents("l.yaml", &last);
        assert_eq!(names(&objects), ["one", "one-1"], "{errors:?}");
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0]
                .to_string()
                .starts_with("l.yaml: invalid YAML in document 3: "),
            "{}",
            errors[0]
        );
    }

    #[test]
    fn yaml_several_broken_documents_each_reported() {
        let text = format!(
            "a: [\n---\n{}---\nb: {{\n---\n{}",
            svc("one"),
            slice("one-1", "one")
        );
        let (objects, errors) = parse_documents("s.yaml", &text);
        assert_eq!(names(&objects), ["one", "one-1"], "{errors:?}");
        let lines = lines(&errors);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[0].starts_with("s.yaml: invalid YAML in document 1: "));
        assert!(lines[1].starts_with("s.yaml: invalid YAML in document 3: "));
    }

    #[test]
    fn yaml_entirely_garbage_file() {
        for text in ["{{{ ]]] :::\n\t- ][\n", "a: [\nb: }\n---\n: : {\n"] {
            let (objects, errors) = parse_documents("g.yaml", text);
            assert!(objects.is_empty(), "{text:?}");
            assert!(!errors.is_empty(), "{text:?}");
            for e in &errors {
                let line = e.to_string();
                assert!(
                    line.starts_with("g.yaml: invalid YAML in document "),
                    "{line}"
                );
            }
        }
    }

    #[test]
    fn document_pieces_cut_at_markers_only() {
        let text = "a: 1\n---\nb: |\n  ---\n---x: 2\n--- # c\nd: 3\n---";
        let pieces = document_pieces(text);
        assert_eq!(
            pieces,
            vec![
                (1, "a: 1\n"),
                (2, "---\nb: |\n  ---\n---x: 2\n"),
                (6, "--- # c\nd: 3\n"),
                (8, "---"),
            ]
        );
        assert_eq!(document_pieces(""), vec![(1, "")]);
        assert_eq!(
            shift_lines("x at line 3 column 1, while parsing at line 1", 4),
            "x at line 7 column 1, while parsing at line 5"
        );
    }

    #[test]
    fn unknown_and_wrong_api_version_kinds() {
        let text = "apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: shop}
---
apiVersion: discovery.k8s.io/v1beta1
kind: EndpointSlice
metadata: {name: old}
addressType: IPv4
endpoints: []
---
apiVersion: v1
kind: Sevrice
metadata: {name: typo}
---
apiVersion: v1
metadata: {name: nokind}
---
- just a list
";
        let (objects, errors) = parse_documents("k.yaml", text);
        assert!(objects.is_empty());
        assert_eq!(
            lines(&errors),
            vec![
                "k.yaml: Deployment shop/web: unsupported kind apps/v1 Deployment (only v1 Service, discovery.k8s.io/v1 EndpointSlice, v1 Node, v1 Pod and v1 Namespace are read); object skipped",
                "k.yaml: EndpointSlice default/old: unsupported kind discovery.k8s.io/v1beta1 EndpointSlice (only v1 Service, discovery.k8s.io/v1 EndpointSlice, v1 Node, v1 Pod and v1 Namespace are read); object skipped",
                "k.yaml: Sevrice default/typo: unsupported kind v1 Sevrice (only v1 Service, discovery.k8s.io/v1 EndpointSlice, v1 Node, v1 Pod and v1 Namespace are read); object skipped",
                "k.yaml: default/nokind: missing kind; object skipped",
                "k.yaml: document 5 is not an object (expected a Kubernetes manifest)",
            ]
        );
    }

    #[test]
    fn missing_name() {
        let text = "apiVersion: v1\nkind: Service\nmetadata: {namespace: a}\nspec: {clusterIP: 10.96.0.1}\n";
        let (objects, errors) = parse_documents("n.yaml", text);
        assert!(objects.is_empty());
        assert_eq!(
            lines(&errors),
            vec!["n.yaml: Service: metadata.name is missing; object skipped"]
        );
    }

    #[test]
    fn type_error_skips_only_that_object() {
        let text = format!(
            "apiVersion: v1
kind: Service
metadata: {{name: bad, namespace: shop}}
spec:
  clusterIP: 10.96.0.9
  ports:
  - port: abc
---
{SVC}"
        );
        let (objects, errors) = parse_documents("t.yaml", &text);
        assert_eq!(
            keys(&objects),
            vec![("Service", "shop".into(), "web".into())]
        );
        assert_eq!(errors.len(), 1);
        assert_eq!(
            (
                errors[0].origin.as_str(),
                errors[0].kind.as_str(),
                errors[0].namespace.as_str(),
                errors[0].name.as_str()
            ),
            ("t.yaml", "Service", "shop", "bad")
        );
        let line = errors[0].to_string();
        assert!(
            line.starts_with(
                "t.yaml: Service shop/bad: invalid type: string \"abc\", expected i32"
            ),
            "{line}"
        );
    }

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).unwrap();
    }

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

    /// What a consumer of the source knows: every batch folded into an object set.
    struct Follower {
        rx: mpsc::Receiver<Batch>,
        objects: ObjectSet,
        errors: Vec<SourceError>,
        /// A complete batch came.
        synced: bool,
    }

    impl Follower {
        fn new(rx: mpsc::Receiver<Batch>) -> Self {
            Follower {
                rx,
                objects: ObjectSet::default(),
                errors: Vec::new(),
                synced: false,
            }
        }

        /// Folds the next batch; returns its number of changes.
        async fn next(&mut self) -> usize {
            let b = tokio::time::timeout(Duration::from_secs(5), self.rx.recv())
                .await
                .expect("no batch within 5 s")
                .expect("source stopped");
            assert!(
                b.synced || !self.synced,
                "every batch after the first complete one is complete"
            );
            self.synced |= b.synced;
            let n = b.changes.len();
            for c in b.changes {
                self.objects.apply(c);
            }
            if let Some(e) = b.errors {
                self.errors = e;
            }
            n
        }

        /// Folds batches until the Services are `want` (or 5 s pass).
        async fn until_services(&mut self, want: &[&str]) {
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while self.service_names() != want {
                assert!(
                    std::time::Instant::now() < deadline,
                    "services {:?}, want {want:?}",
                    self.service_names()
                );
                self.next().await;
            }
        }

        fn service_names(&self) -> Vec<String> {
            self.objects
                .services
                .keys()
                .map(|(_, n)| n.clone())
                .collect()
        }
    }

    #[tokio::test]
    async fn manifest_source_follows_the_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().to_path_buf();
        write(&d, "a.yaml", SVC);
        let mut f = Follower::new(ManifestSource::new(&d).start().unwrap());

        // Initial batch.
        f.next().await;
        assert_eq!(f.service_names(), vec!["web"]);
        assert!(f.errors.is_empty());

        // A new file.
        write(
            &d,
            "b.yaml",
            &SVC.replace("name: web", "name: api")
                .replace("10.96.0.10", "10.96.0.20"),
        );
        f.until_services(&["api", "web"]).await;

        // Replaced by rename (as sed -i and editors do): read at once, without a debounce.
        write(
            &d,
            ".b.yaml.tmp",
            &SVC.replace("name: web", "name: api2")
                .replace("10.96.0.10", "10.96.0.21"),
        );
        std::fs::rename(d.join(".b.yaml.tmp"), d.join("b.yaml")).unwrap();
        f.until_services(&["api2", "web"]).await;

        // A removed file.
        std::fs::remove_file(d.join("a.yaml")).unwrap();
        f.until_services(&["api2"]).await;

        // Temporarily empty, then filled again.
        std::fs::remove_file(d.join("b.yaml")).unwrap();
        f.until_services(&[]).await;
        assert!(f.objects.is_empty());
        write(&d, "c.yaml", SVC);
        f.until_services(&["web"]).await;

        // A broken file is reported, the rest stays.
        write(&d, "d.yaml", "kind: [");
        while f.errors.is_empty() {
            f.next().await;
        }
        assert_eq!(f.service_names(), vec!["web"]);
        assert_eq!(f.errors.len(), 1);
    }

    #[tokio::test]
    async fn a_change_to_one_file_reads_only_that_file_and_gives_only_its_changes() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().to_path_buf();
        for i in 0..20 {
            write(
                &d,
                &format!("s{i:02}.yaml"),
                &SVC.replace("name: web", &format!("name: web{i}")),
            );
        }
        let mut f = Follower::new(ManifestSource::new(&d).start().unwrap());
        assert_eq!(f.next().await, 20);
        // Rename one file into place: one batch with that file's object only.
        write(
            &d,
            ".tmp",
            &SVC.replace("name: web", "name: web7")
                .replace("10.96.0.10", "10.96.0.99"),
        );
        std::fs::rename(d.join(".tmp"), d.join("s07.yaml")).unwrap();
        assert_eq!(f.next().await, 1);
        let s = &f.objects.services[&("shop".to_string(), "web7".to_string())];
        assert_eq!(
            s.object.spec.as_ref().unwrap().cluster_ip.as_deref(),
            Some("10.96.0.99")
        );
    }

    #[tokio::test]
    async fn duplicates_across_files_follow_the_last_file_and_fall_back_when_it_drops_one() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().to_path_buf();
        write(&d, "1.yaml", SVC);
        write(&d, "2.yaml", &SVC.replace("10.96.0.10", "10.96.0.11"));
        let mut f = Follower::new(ManifestSource::new(&d).start().unwrap());
        f.next().await;
        let ip = |f: &Follower| {
            f.objects.services[&("shop".to_string(), "web".to_string())]
                .object
                .spec
                .as_ref()
                .unwrap()
                .cluster_ip
                .clone()
        };
        assert_eq!(ip(&f).as_deref(), Some("10.96.0.11"));
        assert_eq!(f.errors.len(), 1, "{:?}", f.errors);
        // The winner drops it: the other file's definition is in force again.
        std::fs::remove_file(d.join("2.yaml")).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while ip(&f).as_deref() != Some("10.96.0.10") {
            assert!(std::time::Instant::now() < deadline);
            f.next().await;
        }
        assert!(f.errors.is_empty(), "{:?}", f.errors);
        // The last one goes too: the Service is deleted.
        std::fs::remove_file(d.join("1.yaml")).unwrap();
        f.until_services(&[]).await;
    }

    #[tokio::test]
    async fn manifest_source_survives_directory_recreation() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("m");
        std::fs::create_dir(&d).unwrap();
        write(&d, "a.yaml", SVC);
        let mut f = Follower::new(
            ManifestSource::new(&d)
                .with_resync(Duration::from_millis(200))
                .start()
                .unwrap(),
        );
        f.next().await;
        assert_eq!(f.service_names(), vec!["web"]);

        // The directory goes away: what was read stays (no deletion is sent).
        std::fs::remove_dir_all(&d).unwrap();
        let quiet = tokio::time::timeout(Duration::from_millis(500), async {
            loop {
                f.next().await;
                if f.service_names() != vec!["web"] {
                    return;
                }
            }
        })
        .await;
        assert!(
            quiet.is_err(),
            "the Services changed: {:?}",
            f.service_names()
        );

        // It comes back with other content: picked up (by the resync) and watched again.
        std::fs::create_dir(&d).unwrap();
        write(&d, "b.yaml", &SVC.replace("name: web", "name: api"));
        f.until_services(&["api"]).await;
        write(
            &d,
            "c.yaml",
            &SVC.replace("name: web", "name: third")
                .replace("10.96.0.10", "10.96.0.30"),
        );
        f.until_services(&["api", "third"]).await;
    }

    #[tokio::test]
    async fn the_first_listing_comes_in_chunks_and_only_the_last_batch_is_complete() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().to_path_buf();
        for i in 0..5 {
            write(
                &d,
                &format!("s{i}.yaml"),
                &SVC.replace("name: web", &format!("name: web{i}")),
            );
        }
        // One file per chunk.
        let mut rx = ManifestSource::new(&d).with_chunk_bytes(1).start().unwrap();
        let mut seen = Vec::new();
        loop {
            let b = tokio::time::timeout(Duration::from_secs(5), rx.recv())
                .await
                .unwrap()
                .unwrap();
            seen.push((b.changes.len(), b.synced, b.errors.is_some()));
            if b.synced {
                break;
            }
        }
        // Five batches of one object; only the last is complete and carries the errors.
        assert_eq!(
            seen,
            vec![
                (1, false, false),
                (1, false, false),
                (1, false, false),
                (1, false, false),
                (1, true, true)
            ]
        );
        // Later changes come whole, as before.
        let mut f = Follower::new(rx);
        f.synced = true;
        write(&d, ".tmp", &SVC.replace("name: web", "name: web9"));
        std::fs::rename(d.join(".tmp"), d.join("s2.yaml")).unwrap();
        assert_eq!(f.next().await, 2, "web2 deleted, web9 applied");
    }

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
