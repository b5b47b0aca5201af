//! What a source delivers: the objects it read ([`Object`], [`Sourced`]), their changes
//! ([`Change`]) in [`Batch`]es, and a snapshot of them ([`ObjectSet`]). A leaf: it imports
//! nothing of the crate but the sources' error type, so the model can read this vocabulary
//! without depending on the sources themselves.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::error::SourceError;

/// Where an object came from, for error messages: a file path (or "api").
///
/// The object is shared (`Arc`): snapshots are cheap to clone, an unchanged object is the
/// same allocation from one snapshot to the next (a reflector store's entry, a cached
/// file's parse), and equality checks pointers first, so finding what changed between two
/// snapshots costs little for the objects that did not.
#[derive(Clone, Debug)]
pub struct Sourced<T> {
    /// The file the object was read from (or "api").
    pub(crate) origin: String,
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
    pub(crate) fn as_str(self) -> &'static str {
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
    /// The source's view is complete (see the [`source`](super) module documentation);
    /// once true, it stays.
    pub synced: bool,
    /// When the source saw the first event of this batch (changes are timed from here).
    pub received: std::time::Instant,
}

impl Object {
    /// The object's kind.
    pub(crate) fn kind_of(&self) -> Kind {
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
    pub(crate) endpoint_slices: BTreeMap<(String, String), Sourced<EndpointSlice>>,
    /// Nodes by name: the API source watches this node's only; manifests may hold several
    /// (agents of different nodes can share one directory).
    pub(crate) nodes: BTreeMap<String, Sourced<Node>>,
    /// Pods by (namespace, name): the API source watches this node's only.
    pub(crate) pods: BTreeMap<(String, String), Sourced<Pod>>,
    /// Namespaces by name.
    pub(crate) namespaces: BTreeMap<String, Sourced<Namespace>>,
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
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.services.len()
            + self.endpoint_slices.len()
            + self.nodes.len()
            + self.pods.len()
            + self.namespaces.len()
    }

    /// True when the set holds no object.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
