//! Sources of Kubernetes objects. Every source delivers [`Batch`]es of [`Change`]s: objects
//! added or replaced and objects gone, in order, plus the source's own errors. The one
//! model ([`crate::model::Model`]) reads each changed object once; nothing re-reads a whole
//! snapshot.
//!
//! A source marks its view complete ([`Batch::synced`]) once it has read everything it
//! knows (the initial lists, the directory): the agent programs nothing before, so a
//! restarted agent never removes backends whose objects have not arrived yet. After that,
//! a re-list (a watch that had to start over, a directory listed again) delivers the objects
//! that changed and a deletion for every object that is gone.

pub mod apiconfig;
pub mod kubeapi;
pub mod manifests;

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;

pub use kubeapi::KubeSource;
pub use manifests::ManifestSource;

/// Where an object came from, for error messages: a file path (or "api").
///
/// The object is shared (`Arc`): snapshots are cheap to clone, an unchanged object is the
/// same allocation from one snapshot to the next (a reflector store's entry, a cached
/// file's parse), and equality checks pointers first, so finding what changed between two
/// snapshots costs little for the objects that did not.
#[derive(Clone, Debug)]
pub struct Sourced<T> {
    /// The file the object was read from (or "api").
    pub origin: String,
    /// The object. Its `metadata.namespace` is always set (defaulted to `"default"`).
    pub object: std::sync::Arc<T>,
}

impl<T> Sourced<T> {
    /// Wraps an object read from `origin`.
    pub fn new(origin: impl Into<String>, object: T) -> Self {
        Sourced {
            origin: origin.into(),
            object: std::sync::Arc::new(object),
        }
    }
}

impl<T: PartialEq> PartialEq for Sourced<T> {
    fn eq(&self, other: &Self) -> bool {
        self.origin == other.origin
            && (std::sync::Arc::ptr_eq(&self.object, &other.object) || self.object == other.object)
    }
}

/// One object read by a source, before it is put into an [`ObjectSet`].
// Not boxed: objects are short-lived (parsed, then moved into an ObjectSet).
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum Object {
    /// A `v1` `Service`.
    Service(Sourced<Service>),
    /// A `discovery.k8s.io/v1` `EndpointSlice`.
    EndpointSlice(Sourced<EndpointSlice>),
    /// A `v1` `Node` (cluster-scoped: its namespace is `""`). The agent reads its own
    /// node's zone label from it.
    Node(Sourced<Node>),
    /// A `v1` `Pod`: which workloads of this node bypass socket-level translation
    /// (`model::bypass`).
    Pod(Sourced<Pod>),
    /// A `v1` `Namespace` (cluster-scoped: its namespace is `""`), for the same choice made
    /// per namespace.
    Namespace(Sourced<Namespace>),
}

/// Kind of an object a source delivers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// `v1` `Service`.
    Service,
    /// `discovery.k8s.io/v1` `EndpointSlice`.
    EndpointSlice,
    /// `v1` `Node`.
    Node,
    /// `v1` `Pod`.
    Pod,
    /// `v1` `Namespace`.
    Namespace,
}

impl Kind {
    /// The kind as in a manifest.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
            Kind::Pod => "Pod",
            Kind::Namespace => "Namespace",
        }
    }
}

/// One change of what a source knows.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    /// An object was added or replaced (its whole new version).
    Apply(Object),
    /// The object of this kind and (namespace, name) is gone (`("", name)` for a Node).
    Delete(Kind, (String, String)),
}

/// What a source sends: the changes since its previous batch, in order.
#[derive(Clone, Debug)]
pub struct Batch {
    /// The changes.
    pub changes: Vec<Change>,
    /// The source's own errors (files it could not read, objects defined twice), replacing
    /// the previous list; `None` when they did not change.
    pub errors: Option<Vec<SourceError>>,
    /// The source's view is complete (see the module documentation); once true, it stays.
    pub synced: bool,
    /// When the source saw the first event of this batch (changes are timed from here).
    pub received: std::time::Instant,
}

impl Object {
    /// The object's kind.
    pub fn kind_of(&self) -> Kind {
        match self {
            Object::Service(_) => Kind::Service,
            Object::EndpointSlice(_) => Kind::EndpointSlice,
            Object::Node(_) => Kind::Node,
            Object::Pod(_) => Kind::Pod,
            Object::Namespace(_) => Kind::Namespace,
        }
    }

    /// The object's kind, as in its manifest.
    pub fn kind(&self) -> &'static str {
        match self {
            Object::Service(_) => "Service",
            Object::EndpointSlice(_) => "EndpointSlice",
            Object::Node(_) => "Node",
            Object::Pod(_) => "Pod",
            Object::Namespace(_) => "Namespace",
        }
    }

    /// Where the object came from.
    pub fn origin(&self) -> &str {
        match self {
            Object::Service(s) => &s.origin,
            Object::EndpointSlice(s) => &s.origin,
            Object::Node(s) => &s.origin,
            Object::Pod(s) => &s.origin,
            Object::Namespace(s) => &s.origin,
        }
    }

    /// (namespace, name); the namespace is `"default"` when the manifest had none, `""` for
    /// a Node.
    pub fn key(&self) -> (String, String) {
        let meta = match self {
            Object::Service(s) => &s.object.metadata,
            Object::EndpointSlice(s) => &s.object.metadata,
            Object::Pod(p) => &p.object.metadata,
            Object::Namespace(n) => {
                return (
                    String::new(),
                    n.object.metadata.name.clone().unwrap_or_default(),
                );
            }
            Object::Node(n) => {
                return (
                    String::new(),
                    n.object.metadata.name.clone().unwrap_or_default(),
                );
            }
        };
        (
            meta.namespace
                .clone()
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| "default".into()),
            meta.name.clone().unwrap_or_default(),
        )
    }
}

/// A snapshot of every object a source knows. Keyed by (namespace, name).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ObjectSet {
    /// Services by (namespace, name).
    pub services: BTreeMap<(String, String), Sourced<Service>>,
    /// EndpointSlices by (namespace, name).
    pub endpoint_slices: BTreeMap<(String, String), Sourced<EndpointSlice>>,
    /// Nodes by name: the API source watches this node's only; manifests may hold several
    /// (agents of different nodes can share one directory).
    pub nodes: BTreeMap<String, Sourced<Node>>,
    /// Pods by (namespace, name): the API source watches this node's only.
    pub pods: BTreeMap<(String, String), Sourced<Pod>>,
    /// Namespaces by name.
    pub namespaces: BTreeMap<String, Sourced<Namespace>>,
}

impl ObjectSet {
    /// Inserts an object. When an object of the same kind, namespace and name is already
    /// present, the new one replaces it and the old one's origin is returned.
    pub fn insert(&mut self, object: Object) -> Option<String> {
        let key = object.key();
        match object {
            Object::Service(s) => self.services.insert(key, s).map(|old| old.origin),
            Object::EndpointSlice(s) => self.endpoint_slices.insert(key, s).map(|old| old.origin),
            Object::Node(n) => self.nodes.insert(key.1, n).map(|old| old.origin),
            Object::Pod(p) => self.pods.insert(key, p).map(|old| old.origin),
            Object::Namespace(n) => self.namespaces.insert(key.1, n).map(|old| old.origin),
        }
    }

    /// Applies a change (a deletion of an unknown object is no error).
    pub fn apply(&mut self, change: Change) {
        match change {
            Change::Apply(o) => {
                self.insert(o);
            }
            Change::Delete(Kind::Service, k) => {
                self.services.remove(&k);
            }
            Change::Delete(Kind::EndpointSlice, k) => {
                self.endpoint_slices.remove(&k);
            }
            Change::Delete(Kind::Node, (_, name)) => {
                self.nodes.remove(&name);
            }
            Change::Delete(Kind::Pod, k) => {
                self.pods.remove(&k);
            }
            Change::Delete(Kind::Namespace, (_, name)) => {
                self.namespaces.remove(&name);
            }
        }
    }

    /// Number of objects of every kind.
    pub fn len(&self) -> usize {
        self.services.len()
            + self.endpoint_slices.len()
            + self.nodes.len()
            + self.pods.len()
            + self.namespaces.len()
    }

    /// True when the set holds no object.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One object or file skipped (or a warning about one), with a message that names file,
/// kind, namespace/name and reason. Fields that are unknown are empty strings.
///
/// Every `SourceError` describes something the agent worked around (the object, the port
/// or the endpoint is skipped; the rest keeps working), so callers log them at warning
/// level; none is fatal.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SourceError {
    /// File (or "api") the object came from.
    pub origin: String,
    /// Kind of the object (`Service`, `EndpointSlice`, ...), empty when unknown.
    pub kind: String,
    /// Namespace of the object, empty when unknown.
    pub namespace: String,
    /// Name of the object, empty when unknown.
    pub name: String,
    /// What is wrong and what was skipped.
    pub reason: String,
}

impl SourceError {
    /// An error about a whole file (or directory).
    pub fn file(origin: impl Into<String>, reason: impl Into<String>) -> Self {
        SourceError {
            origin: origin.into(),
            reason: reason.into(),
            ..Default::default()
        }
    }

    /// An error about one object.
    pub fn object(
        origin: impl Into<String>,
        kind: impl Into<String>,
        namespace: impl Into<String>,
        name: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        SourceError {
            origin: origin.into(),
            kind: kind.into(),
            namespace: namespace.into(),
            name: name.into(),
            reason: reason.into(),
        }
    }
}

/// One line: `<file>: <Kind> <ns>/<name>: <reason>`, leaving out the parts that are unknown
/// (`<file>: <reason>` for an unparseable file, `<file>: <Kind>: <reason>` for an object
/// without a name).
impl fmt::Display for SourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut wrote = false;
        if !self.origin.is_empty() {
            f.write_str(&self.origin)?;
            wrote = true;
        }
        let mut object = String::new();
        if !self.kind.is_empty() {
            object.push_str(&self.kind);
        }
        if !self.name.is_empty() {
            if !object.is_empty() {
                object.push(' ');
            }
            if !self.namespace.is_empty() {
                object.push_str(&self.namespace);
                object.push('/');
            }
            object.push_str(&self.name);
        }
        if !object.is_empty() {
            if wrote {
                f.write_str(": ")?;
            }
            f.write_str(&object)?;
            wrote = true;
        }
        if wrote {
            f.write_str(": ")?;
        }
        f.write_str(&self.reason)
    }
}

impl std::error::Error for SourceError {}

/// A producer of [`Batch`]es; implemented by [`ManifestSource`] (a directory of YAML/JSON
/// files) and [`KubeSource`] (the Kubernetes API), so both feed one model.
///
/// Contract:
/// - [`Source::start`] must be called inside a tokio runtime; it spawns the source's task
///   and returns the receiving end of its batch channel, or an error when the source cannot
///   start at all (e.g. the manifest directory does not exist).
/// - Batches come in order and must all be applied; a consumer that falls behind drains the
///   channel and applies every batch before acting on them.
/// - The source's task stops when the receiver is dropped; the channel closes when the
///   source stops for good.
pub trait Source {
    /// Starts the source; see the trait documentation.
    fn start(self) -> anyhow::Result<tokio::sync::mpsc::Receiver<Batch>>;
}
