//! The HTTP side: the routes, authentication, query parameters, `Status` answers, and
//! the handler that dispatches a request to a get, a list or a watch.

use std::sync::atomic::Ordering;

use axum::Router;
use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::Response;
use axum::routing::get;
use serde_json::{Value, json};

use super::listwatch::{list, watch};
use super::selector::Filter;
use super::server::App;
use super::store::{REQUEST_LOG_LIMIT, Shared, lock};
use super::{RecordedRequest, ResourceKind, Verb};

// ---- HTTP side ---------------------------------------------------------------

pub(super) fn router(app: App) -> Router {
    let mut r = Router::new();
    for kind in ResourceKind::ALL {
        let prefix = kind.url_prefix();
        let plural = kind.plural();
        r = r.route(
            &format!("{prefix}/{plural}"),
            get(
                move |State(app): State<App>,
                      headers: HeaderMap,
                      uri: Uri,
                      RawQuery(q): RawQuery| {
                    handle(app, kind, None, None, headers, uri, q)
                },
            ),
        );
        if kind.namespaced() {
            r = r
                .route(
                    &format!("{prefix}/namespaces/{{ns}}/{plural}"),
                    get(
                        move |State(app): State<App>,
                              axum::extract::Path(ns): axum::extract::Path<String>,
                              headers: HeaderMap,
                              uri: Uri,
                              RawQuery(q): RawQuery| {
                            handle(app, kind, Some(ns), None, headers, uri, q)
                        },
                    ),
                )
                .route(
                    &format!("{prefix}/namespaces/{{ns}}/{plural}/{{name}}"),
                    get(
                        move |State(app): State<App>,
                              axum::extract::Path((ns, name)): axum::extract::Path<(
                            String,
                            String,
                        )>,
                              headers: HeaderMap,
                              uri: Uri,
                              RawQuery(q): RawQuery| {
                            handle(app, kind, Some(ns), Some(name), headers, uri, q)
                        },
                    ),
                );
        } else {
            r = r.route(
                &format!("{prefix}/{plural}/{{name}}"),
                get(
                    move |State(app): State<App>,
                          axum::extract::Path(name): axum::extract::Path<String>,
                          headers: HeaderMap,
                          uri: Uri,
                          RawQuery(q): RawQuery| {
                        handle(app, kind, None, Some(name), headers, uri, q)
                    },
                ),
            );
        }
    }
    r.fallback(
        |State(app): State<App>, headers: HeaderMap, uri: Uri| async move {
            if let Some(denied) = unauthorized(&app.shared, bearer_token(&headers).as_deref()) {
                return denied;
            }
            status_response(
                404,
                "NotFound",
                format!(
                    "the server could not find the requested resource ({})",
                    uri.path()
                ),
            )
        },
    )
    .with_state(app)
}

pub(super) fn status_value(code: u16, reason: &str, message: impl Into<String>) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message.into(),
        "reason": reason,
        "code": code,
    })
}

pub(super) fn json_response(code: u16, body: &Value) -> Response {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(
            serde_json::to_vec(body).expect("serialize JSON"),
        ))
        .expect("valid response")
}

pub(super) fn status_response(code: u16, reason: &str, message: impl Into<String>) -> Response {
    json_response(code, &status_value(code, reason, message))
}

/// The token of an `Authorization: Bearer <token>` header, parsed as kube-apiserver
/// does: the scheme is case-insensitive and anything after the token is ignored.
fn bearer_token(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let mut parts = value.splitn(3, ' ');
    let scheme = parts.next()?;
    let token = parts.next().filter(|t| !t.is_empty())?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.to_owned())
}

/// kube-apiserver's answer to a request that fails authentication, if `token` does
/// not match the required one.
fn unauthorized(shared: &Shared, token: Option<&str>) -> Option<Response> {
    let required = shared.required_token.as_deref()?;
    (token != Some(required)).then(|| status_response(401, "Unauthorized", "Unauthorized"))
}

#[derive(Debug, Default)]
pub(super) struct Params {
    watch: bool,
    pub(super) resource_version: Option<String>,
    pub(super) resource_version_match: Option<String>,
    pub(super) allow_bookmarks: bool,
    pub(super) timeout_seconds: Option<u64>,
    label_selector: Option<String>,
    field_selector: Option<String>,
    pub(super) limit: Option<usize>,
    pub(super) continue_token: Option<String>,
    pub(super) send_initial_events: bool,
}

fn parse_params(q: &str) -> Result<Params, String> {
    let truthy = |v: &str| matches!(v, "true" | "1");
    let mut p = Params::default();
    for (k, v) in form_urlencoded::parse(q.as_bytes()) {
        let v = v.into_owned();
        match &*k {
            "watch" => p.watch = truthy(&v),
            "resourceVersion" => p.resource_version = Some(v).filter(|s| !s.is_empty()),
            "resourceVersionMatch" => p.resource_version_match = Some(v).filter(|s| !s.is_empty()),
            "allowWatchBookmarks" => p.allow_bookmarks = truthy(&v),
            "timeoutSeconds" => {
                p.timeout_seconds = Some(
                    v.parse()
                        .map_err(|_| format!("invalid timeoutSeconds: {v:?}"))?,
                )
            }
            "labelSelector" => p.label_selector = Some(v).filter(|s| !s.is_empty()),
            "fieldSelector" => p.field_selector = Some(v).filter(|s| !s.is_empty()),
            "limit" => {
                let n: i64 = v.parse().map_err(|_| format!("invalid limit: {v:?}"))?;
                p.limit = usize::try_from(n).ok().filter(|n| *n > 0);
            }
            "continue" => p.continue_token = Some(v).filter(|s| !s.is_empty()),
            "sendInitialEvents" => p.send_initial_events = truthy(&v),
            _ => {}
        }
    }
    Ok(p)
}

async fn handle(
    app: App,
    kind: ResourceKind,
    ns: Option<String>,
    name: Option<String>,
    headers: HeaderMap,
    uri: Uri,
    query: Option<String>,
) -> Response {
    let query = query.unwrap_or_default();
    let bearer_token = bearer_token(&headers);
    let params = parse_params(&query);
    let verb = match (&name, &params) {
        (Some(_), _) => Verb::Get,
        (None, Ok(p)) if p.watch => Verb::Watch,
        _ => Verb::List,
    };
    {
        let mut rq = lock(&app.shared.requests);
        *rq.counts.entry((uri.path().to_owned(), verb)).or_default() += 1;
        rq.log.push_back(RecordedRequest {
            path: uri.path().to_owned(),
            query: query.clone(),
            verb,
            bearer_token: bearer_token.clone(),
        });
        while rq.log.len() > REQUEST_LOG_LIMIT {
            rq.log.pop_front();
        }
    }
    tracing::debug!(path = uri.path(), query, ?verb, "fakeapi request");
    // Authentication comes first, as on kube-apiserver.
    if let Some(denied) = unauthorized(&app.shared, bearer_token.as_deref()) {
        return denied;
    }

    let delay = lock(&app.shared.settings).delay;
    if !delay.is_zero() {
        let mut shutdown = app.shutdown.clone();
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.wait_for(|s| *s) => {
                return status_response(503, "ServiceUnavailable", "fakeapi: shutting down");
            }
        }
    }
    if app.shared.failing.load(Ordering::SeqCst) {
        let code = app.shared.failure_code.load(Ordering::SeqCst);
        let reason = match code {
            429 => "TooManyRequests",
            503 => "ServiceUnavailable",
            504 => "Timeout",
            _ => "InternalError",
        };
        let mut resp = status_response(code, reason, "fakeapi: failing on purpose (set_failing)");
        if matches!(code, 429 | 503 | 504) {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        return resp;
    }
    let params = match params {
        Ok(p) => p,
        Err(msg) => return status_response(400, "BadRequest", msg),
    };
    if let Some(name) = name {
        return get_one(&app, kind, ns.as_deref().unwrap_or(""), &name);
    }
    let filter = match Filter::parse(
        ns,
        params.label_selector.as_deref(),
        params.field_selector.as_deref(),
    ) {
        Ok(f) => f,
        Err(msg) => return status_response(400, "BadRequest", msg),
    };
    if params.watch {
        watch(app, kind, filter, params)
    } else {
        list(&app, kind, &filter, &params)
    }
}

fn get_one(app: &App, kind: ResourceKind, ns: &str, name: &str) -> Response {
    let st = lock(&app.shared.store);
    match st
        .objects
        .get(&kind)
        .and_then(|m| m.get(&(ns.to_owned(), name.to_owned())))
    {
        Some(obj) => json_response(200, obj),
        None => status_response(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", kind.plural()),
        ),
    }
}

pub(super) fn parse_rv(rv: &str) -> Result<u64, Box<Response>> {
    rv.parse().map_err(|_| {
        Box::new(status_response(
            400,
            "BadRequest",
            format!("invalid resource version: {rv:?}"),
        ))
    })
}
