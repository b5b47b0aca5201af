//! List and watch: paginated lists served from the current state, and watch streams
//! that replay the history, then send live events, bookmarks and selector transitions.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::Response;
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};

use super::http::{Params, json_response, parse_rv, status_response, status_value};
use super::selector::Filter;
use super::server::App;
use super::store::{EventType, HistEvent, ObjKey, Shared, lock};
use super::{DEFAULT_WATCH_TIMEOUT, ResourceKind};

fn expired(rv: u64, floor: u64) -> Value {
    status_value(
        410,
        "Expired",
        format!("too old resource version: {rv} ({floor})"),
    )
}

pub(super) fn list(app: &App, kind: ResourceKind, filter: &Filter, p: &Params) -> Response {
    let type_meta = lock(&app.shared.settings).list_item_type_meta;
    let st = lock(&app.shared.store);
    // Where the page starts and which resourceVersion the list reports.
    let (list_rv, after): (u64, Option<ObjKey>) = match &p.continue_token {
        Some(token) => {
            let mut parts = token.splitn(3, ':');
            let parsed = (|| {
                let rv: u64 = parts.next()?.parse().ok()?;
                Some((rv, (parts.next()?.to_owned(), parts.next()?.to_owned())))
            })();
            let Some((rv, key)) = parsed else {
                return status_response(
                    400,
                    "BadRequest",
                    format!("invalid continue token: {token:?}"),
                );
            };
            if rv < st.floor {
                return status_response(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list result. \
                     You can start a new list without the continue parameter.",
                );
            }
            (rv, Some(key))
        }
        None => {
            if let Some(rv) = &p.resource_version {
                let rv = match parse_rv(rv) {
                    Ok(rv) => rv,
                    Err(resp) => return *resp,
                };
                if rv > st.rv {
                    let mut s = status_value(
                        504,
                        "Timeout",
                        format!("Too large resource version: {rv}, current: {}", st.rv),
                    );
                    s["details"] = json!({"causes": [{"reason": "ResourceVersionTooLarge",
                        "message": "Too large resource version"}], "retryAfterSeconds": 1});
                    return json_response(504, &s);
                }
                if p.resource_version_match.as_deref() == Some("Exact") && rv != st.rv {
                    return json_response(410, &expired(rv, st.floor));
                }
            }
            (st.rv, None)
        }
    };
    let mut items = Vec::new();
    let mut more = false;
    let mut last_key = None;
    let range = st
        .objects(kind)
        .filter(|(k, _)| after.as_ref().is_none_or(|a| *k > a));
    for (key, obj) in range {
        if !filter.matches(obj) {
            continue;
        }
        if p.limit.is_some_and(|l| items.len() >= l) {
            more = true;
            break;
        }
        let mut item = (**obj).clone();
        if let Some(o) = item.as_object_mut().filter(|_| !type_meta) {
            o.remove("kind");
            o.remove("apiVersion");
        }
        items.push(item);
        last_key = Some(key.clone());
    }
    drop(st);
    let mut meta = json!({ "resourceVersion": list_rv.to_string() });
    if more {
        let (ns, name) = last_key.expect("a full page has a last item");
        meta["continue"] = format!("{list_rv}:{ns}:{name}").into();
    }
    json_response(
        200,
        &json!({
            "kind": kind.list_kind(),
            "apiVersion": kind.api_version(),
            "metadata": meta,
            "items": items,
        }),
    )
}

/// Where a watch starts.
#[derive(Debug, Clone, Copy)]
enum Start {
    /// Synthetic ADDED events for the current state (no resourceVersion, or "0").
    Current { initial_events_end: bool },
    /// Replay the history after this resourceVersion.
    After(u64),
}

pub(super) fn watch(app: App, kind: ResourceKind, filter: Filter, p: Params) -> Response {
    if p.send_initial_events {
        if !p.allow_bookmarks {
            return status_response(
                422,
                "Invalid",
                "sendInitialEvents requires allowWatchBookmarks=true",
            );
        }
        if p.resource_version_match.as_deref() != Some("NotOlderThan") {
            return status_response(
                422,
                "Invalid",
                "sendInitialEvents requires resourceVersionMatch=NotOlderThan",
            );
        }
    } else if p.resource_version_match.is_some() {
        return status_response(
            422,
            "Invalid",
            "resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
        );
    }
    let start = match p.resource_version.as_deref() {
        _ if p.send_initial_events => Start::Current {
            initial_events_end: true,
        },
        None | Some("0") => Start::Current {
            initial_events_end: false,
        },
        Some(rv) => match parse_rv(rv) {
            Ok(rv) => Start::After(rv),
            Err(resp) => return *resp,
        },
    };
    let timeout = p
        .timeout_seconds
        .map_or(DEFAULT_WATCH_TIMEOUT, Duration::from_secs);
    let bookmark_interval = lock(&app.shared.settings).bookmark_interval;
    let bookmarks = p.allow_bookmarks.then_some(bookmark_interval);

    let (tx, rx) = mpsc::channel::<Bytes>(256);
    tokio::spawn(run_watch(app, kind, filter, start, bookmarks, timeout, tx));
    let body = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(body))
        .expect("valid response")
}

fn event_line(etype: &str, obj: &Value) -> Bytes {
    let mut line =
        serde_json::to_vec(&json!({ "type": etype, "object": obj })).expect("serialize event");
    line.push(b'\n');
    Bytes::from(line)
}

fn bookmark(kind: ResourceKind, rv: u64, initial_events_end: bool) -> Bytes {
    let mut meta = json!({ "resourceVersion": rv.to_string() });
    if initial_events_end {
        meta["annotations"] = json!({ "k8s.io/initial-events-end": "true" });
    }
    event_line(
        "BOOKMARK",
        &json!({ "kind": kind.kind(), "apiVersion": kind.api_version(), "metadata": meta }),
    )
}

/// How one change looks to a watch with `filter`, if it sees it at all.
fn visible(ev: &HistEvent, kind: ResourceKind, filter: &Filter) -> Option<Bytes> {
    if ev.kind != kind {
        return None;
    }
    let now = filter.matches(&ev.object);
    let etype = match ev.etype {
        EventType::Added => now.then_some("ADDED")?,
        EventType::Deleted => now.then_some("DELETED")?,
        EventType::Modified => {
            let before = ev.prev.as_deref().is_some_and(|p| filter.matches(p));
            match (before, now) {
                (true, true) => "MODIFIED",
                (false, true) => "ADDED",
                (true, false) => "DELETED",
                (false, false) => return None,
            }
        }
    };
    Some(event_line(etype, &ev.object))
}

struct OpenWatch(Arc<Shared>);

impl Drop for OpenWatch {
    fn drop(&mut self) {
        self.0.open_watches.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn run_watch(
    app: App,
    kind: ResourceKind,
    filter: Filter,
    start: Start,
    bookmarks: Option<Duration>,
    timeout: Duration,
    tx: mpsc::Sender<Bytes>,
) {
    let shared = app.shared.clone();
    // Subscribe before counting the watch as open, so that a `close_watches()`
    // issued after `wait_open_watches()` always reaches it.
    let mut close_rx = shared.close_watches.subscribe();
    close_rx.mark_unchanged();
    shared.open_watches.fetch_add(1, Ordering::SeqCst);
    let _open = OpenWatch(shared.clone());
    let mut shutdown = app.shutdown.clone();

    // Snapshot and subscribe under the store lock: nothing is missed or doubled.
    let snapshot = {
        let st = lock(&shared.store);
        let events = shared.events.subscribe();
        let mut initial = Vec::new();
        match start {
            Start::Current { initial_events_end } => {
                for (_, obj) in st.objects(kind) {
                    if filter.matches(obj) {
                        initial.push(event_line("ADDED", obj));
                    }
                }
                if initial_events_end {
                    initial.push(bookmark(kind, st.rv, true));
                }
            }
            Start::After(rv) if rv < st.floor => {
                initial.push(event_line("ERROR", &expired(rv, st.floor)));
            }
            Start::After(rv) => {
                for ev in st.history.iter().filter(|e| e.rv > rv) {
                    initial.extend(visible(ev, kind, &filter));
                }
            }
        }
        let expired = matches!(start, Start::After(rv) if rv < st.floor);
        (initial, (!expired).then_some(events), st.rv)
    };
    let (initial, events, mut last_rv) = snapshot;
    for line in initial {
        if tx.send(line).await.is_err() {
            return;
        }
    }
    // A 410 ERROR event ends the stream.
    let Some(mut events) = events else { return };

    let deadline = tokio::time::sleep(timeout);
    tokio::pin!(deadline);
    let mut ticker =
        bookmarks.map(|every| tokio::time::interval_at(tokio::time::Instant::now() + every, every));
    loop {
        let out: Vec<Bytes> = tokio::select! {
            // Closing wins over pending events, so nothing is sent after
            // `close_watches()`/`stop()` once the stream notices.
            biased;
            _ = shutdown.wait_for(|s| *s) => return,
            _ = close_rx.changed() => return,
            _ = &mut deadline => return,
            _ = tx.closed() => return,
            ev = events.recv() => match ev {
                Ok(ev) => {
                    if ev.rv <= last_rv {
                        continue;
                    }
                    last_rv = ev.rv;
                    visible(&ev, kind, &filter).into_iter().collect()
                }
                // Too slow (or the server is gone): end the stream; the client resumes.
                Err(_) => return,
            },
            _ = async { ticker.as_mut().expect("guarded").tick().await }, if ticker.is_some() => {
                // Everything up to the current version must be sent before a
                // bookmark claims it.
                let mut out = Vec::new();
                let now_rv = {
                    let st = lock(&shared.store);
                    loop {
                        match events.try_recv() {
                            Ok(ev) => {
                                if ev.rv > last_rv {
                                    last_rv = ev.rv;
                                    out.extend(visible(&ev, kind, &filter));
                                }
                            }
                            Err(broadcast::error::TryRecvError::Empty) => break,
                            Err(_) => return,
                        }
                    }
                    st.rv
                };
                last_rv = last_rv.max(now_rv);
                out.push(bookmark(kind, last_rv, false));
                out
            }
        };
        for line in out {
            if tx.send(line).await.is_err() {
                return;
            }
        }
    }
}
