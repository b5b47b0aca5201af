//! The server's state: the objects by kind, the bounded event history, the global
//! resourceVersion counter, the settings and request counters that tests control, and
//! the [`Shared`] handle the HTTP side and [`FakeApiServer`](super::FakeApiServer) both hold.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicUsize};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::{broadcast, watch};

use super::{
    DEFAULT_BOOKMARK_INTERVAL, DEFAULT_HISTORY_LIMIT, EVENT_BUFFER, RecordedRequest, ResourceKind,
    Verb,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum EventType {
    Added,
    Modified,
    Deleted,
}

/// One change, as kept in the history and sent to live watchers.
#[derive(Debug)]
pub(super) struct HistEvent {
    pub(super) rv: u64,
    pub(super) kind: ResourceKind,
    pub(super) etype: EventType,
    /// The object after the change (for deletions: the last state, stamped with
    /// the deletion's resourceVersion).
    pub(super) object: Arc<Value>,
    /// The object before a modification (for selector transitions).
    pub(super) prev: Option<Arc<Value>>,
}

pub(super) type ObjKey = (String, String);

pub(super) struct Store {
    pub(super) rv: u64,
    /// Watches must start at or above this resourceVersion; older ones get 410.
    pub(super) floor: u64,
    pub(super) history_limit: usize,
    pub(super) objects: BTreeMap<ResourceKind, BTreeMap<ObjKey, Arc<Value>>>,
    pub(super) history: VecDeque<Arc<HistEvent>>,
}

impl Store {
    pub(super) fn objects(
        &self,
        kind: ResourceKind,
    ) -> impl Iterator<Item = (&ObjKey, &Arc<Value>)> {
        self.objects.get(&kind).into_iter().flat_map(|m| m.iter())
    }

    pub(super) fn trim_history(&mut self) {
        while self.history.len() > self.history_limit {
            if let Some(ev) = self.history.pop_front() {
                self.floor = self.floor.max(ev.rv);
            }
        }
    }
}

pub(super) struct Settings {
    pub(super) delay: Duration,
    pub(super) bookmark_interval: Duration,
    pub(super) list_item_type_meta: bool,
}

#[derive(Default)]
pub(super) struct RequestStats {
    pub(super) counts: BTreeMap<(String, Verb), u64>,
    pub(super) log: VecDeque<RecordedRequest>,
}

pub(super) const REQUEST_LOG_LIMIT: usize = 10_000;

pub(super) struct Shared {
    pub(super) store: Mutex<Store>,
    pub(super) events: broadcast::Sender<Arc<HistEvent>>,
    pub(super) close_watches: watch::Sender<u64>,
    pub(super) failing: AtomicBool,
    pub(super) failure_code: AtomicU16,
    pub(super) settings: Mutex<Settings>,
    pub(super) requests: Mutex<RequestStats>,
    pub(super) open_watches: AtomicUsize,
    /// The bearer token every request must carry (HTTPS mode), if any.
    pub(super) required_token: Option<String>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking test thread must not wedge the server for the others.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    pub(super) fn new(required_token: Option<String>) -> Self {
        Self {
            store: Mutex::new(Store {
                // Start above 0: "0" means "any version" to the protocol.
                rv: 1,
                floor: 1,
                history_limit: DEFAULT_HISTORY_LIMIT,
                objects: BTreeMap::new(),
                history: VecDeque::new(),
            }),
            events: broadcast::channel(EVENT_BUFFER).0,
            close_watches: watch::channel(0).0,
            failing: AtomicBool::new(false),
            failure_code: AtomicU16::new(500),
            settings: Mutex::new(Settings {
                delay: Duration::ZERO,
                bookmark_interval: DEFAULT_BOOKMARK_INTERVAL,
                list_item_type_meta: false,
            }),
            requests: Mutex::new(RequestStats::default()),
            open_watches: AtomicUsize::new(0),
            required_token,
        }
    }

    /// Records a change under the store lock and publishes it, so a watcher that
    /// subscribes under the same lock sees every event exactly once.
    fn record(&self, st: &mut Store, ev: HistEvent) {
        let ev = Arc::new(ev);
        st.history.push_back(ev.clone());
        st.trim_history();
        let _ = self.events.send(ev);
    }

    pub(super) fn apply_value(&self, kind: ResourceKind, mut obj: Value) -> Arc<Value> {
        let name = obj["metadata"]["name"]
            .as_str()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| panic!("fakeapi: {} without metadata.name", kind.kind()))
            .to_owned();
        let ns = if kind.namespaced() {
            let ns = obj["metadata"]["namespace"]
                .as_str()
                .unwrap_or("")
                .to_owned();
            if ns.is_empty() {
                "default".to_owned()
            } else {
                ns
            }
        } else {
            String::new()
        };
        let mut st = lock(&self.store);
        st.rv += 1;
        let rv = st.rv;
        let key = (ns.clone(), name);
        let prev = st.objects.get(&kind).and_then(|m| m.get(&key)).cloned();
        {
            let o = obj
                .as_object_mut()
                .expect("fakeapi: object is not a JSON object");
            o.insert("kind".into(), kind.kind().into());
            o.insert("apiVersion".into(), kind.api_version().into());
            let meta = o
                .entry("metadata")
                .or_insert_with(|| json!({}))
                .as_object_mut()
                .expect("fakeapi: metadata is not an object");
            meta.insert("resourceVersion".into(), rv.to_string().into());
            if kind.namespaced() {
                meta.insert("namespace".into(), ns.into());
            }
            let uid = prev
                .as_ref()
                .and_then(|p| p["metadata"]["uid"].as_str().map(str::to_owned))
                .unwrap_or_else(|| format!("00000000-0000-4000-8000-{rv:012}"));
            meta.entry("uid").or_insert_with(|| uid.into());
            if let Some(ts) = prev
                .as_ref()
                .and_then(|p| p["metadata"].get("creationTimestamp"))
            {
                meta.entry("creationTimestamp")
                    .or_insert_with(|| ts.clone());
            }
        }
        let obj = Arc::new(obj);
        st.objects.entry(kind).or_default().insert(key, obj.clone());
        let etype = if prev.is_some() {
            EventType::Modified
        } else {
            EventType::Added
        };
        self.record(
            &mut st,
            HistEvent {
                rv,
                kind,
                etype,
                object: obj.clone(),
                prev,
            },
        );
        obj
    }

    pub(super) fn delete_value(
        &self,
        kind: ResourceKind,
        ns: &str,
        name: &str,
    ) -> Option<Arc<Value>> {
        let ns = if kind.namespaced() { ns } else { "" };
        let mut st = lock(&self.store);
        let old = st
            .objects
            .get_mut(&kind)?
            .remove(&(ns.to_owned(), name.to_owned()))?;
        st.rv += 1;
        let rv = st.rv;
        let mut last = (*old).clone();
        last["metadata"]["resourceVersion"] = rv.to_string().into();
        let last = Arc::new(last);
        self.record(
            &mut st,
            HistEvent {
                rv,
                kind,
                etype: EventType::Deleted,
                object: last.clone(),
                prev: None,
            },
        );
        Some(last)
    }
}
