//! Sources of Kubernetes objects. Every source delivers batches (`Batch`) of [`Change`]s: objects
//! added or replaced and objects gone, in order, plus the source's own errors. The one
//! model (`model::Model`) reads each changed object once; nothing re-reads a whole
//! snapshot.
//!
//! A source marks its view complete (`Batch::synced`) once it has read everything it
//! knows (the initial lists, the directory): the agent programs nothing before, so a
//! restarted agent never removes backends whose objects have not arrived yet. After that,
//! a re-list (a watch that had to start over, a directory listed again) delivers the objects
//! that changed and a deletion for every object that is gone.

pub(crate) mod apiconfig;
pub(crate) mod error;
pub(crate) mod event;
pub(crate) mod kubeapi;
pub mod manifests;

use std::path::PathBuf;

pub use apiconfig::kube_config;
pub use error::SourceError;
pub(crate) use event::Batch;
pub use event::{Change, Kind, Object, ObjectSet, Sourced};
pub use kubeapi::API_ACCESS;
pub(crate) use kubeapi::KubeSource;
pub(crate) use manifests::ManifestSource;

/// Where the agent reads objects from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceChoice {
    /// A directory of manifests (`--manifests`).
    Manifests(PathBuf),
    /// The Kubernetes API, with this kubeconfig (else `Config::infer`).
    Api(Option<PathBuf>),
}

impl Default for SourceChoice {
    /// The Kubernetes API, with the kubeconfig `Config::infer` finds.
    fn default() -> Self {
        SourceChoice::Api(None)
    }
}

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
pub(crate) trait Source {
    /// Starts the source; see the trait documentation.
    fn start(self) -> anyhow::Result<tokio::sync::mpsc::Receiver<Batch>>;
}
