//! Unit tests of the fake API server: the list/watch protocol through kube-rs clients
//! and watchers, and raw requests, over plain HTTP; the HTTPS mode's are in [`tls`].

mod tls;

use super::*;
use std::fs::File;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::core::v1::{ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::{watcher, watcher::Event};

const WAIT: Duration = Duration::from_secs(15);

fn local() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn svc(ns: &str, name: &str, port: i32) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ns.into()),
            labels: Some([("app".to_owned(), name.to_owned())].into()),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            cluster_ip: Some("10.96.0.10".into()),
            ports: Some(vec![ServicePort {
                port,
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn node(name: &str, ip: &str) -> Node {
    let mut n = Node::default();
    n.metadata.name = Some(name.into());
    n.metadata.annotations = Some([("ip".to_owned(), ip.to_owned())].into());
    n
}

fn name_of<K: kube::Resource>(k: &K) -> String {
    k.meta().name.clone().unwrap_or_default()
}

/// A compact rendering of watcher events for assertions.
fn show<K: kube::Resource>(ev: &Result<Event<K>, watcher::Error>) -> String {
    match ev {
        Ok(Event::Init) => "Init".into(),
        Ok(Event::InitApply(k)) => format!("InitApply({})", name_of(k)),
        Ok(Event::InitDone) => "InitDone".into(),
        Ok(Event::Apply(k)) => format!("Apply({})", name_of(k)),
        Ok(Event::Delete(k)) => format!("Delete({})", name_of(k)),
        Err(e) => format!("Err({e})"),
    }
}

async fn next<S, K>(s: &mut S) -> String
where
    S: futures::Stream<Item = Result<Event<K>, watcher::Error>> + Unpin,
    K: kube::Resource,
{
    let ev = tokio::time::timeout(WAIT, s.next())
        .await
        .expect("timed out waiting for a watcher event")
        .expect("watcher stream ended");
    show(&ev)
}

/// Polls the watcher for `dur` (so it keeps issuing requests), failing on any event.
async fn quiet<S, K>(s: &mut S, dur: Duration)
where
    S: futures::Stream<Item = Result<Event<K>, watcher::Error>> + Unpin,
    K: kube::Resource,
{
    if let Ok(ev) = tokio::time::timeout(dur, s.next()).await {
        panic!("unexpected event {:?}", ev.map(|e| show(&e)));
    }
}

/// Collects the watcher's events for `dur`.
async fn drain<S, K>(s: &mut S, dur: Duration) -> Vec<String>
where
    S: futures::Stream<Item = Result<Event<K>, watcher::Error>> + Unpin,
    K: kube::Resource,
{
    let mut seen = Vec::new();
    let _ = tokio::time::timeout(dur, async {
        while let Some(ev) = s.next().await {
            seen.push(show(&ev));
        }
    })
    .await;
    seen
}

/// Polls the watcher (a watcher only sends its watch request when polled)
/// until the server has `n` open watch streams.
async fn watching<S, K>(server: &FakeApiServer, s: &mut S, n: usize)
where
    S: futures::Stream<Item = Result<Event<K>, watcher::Error>> + Unpin,
    K: kube::Resource,
{
    tokio::select! {
        r = server.wait_open_watches(n, WAIT) => r.unwrap(),
        ev = s.next() => panic!("unexpected event {:?}", ev.map(|e| show(&e))),
    }
}

/// Polls until an event rendered as `want` arrives; returns everything seen.
async fn until<S, K>(s: &mut S, want: &str) -> Vec<String>
where
    S: futures::Stream<Item = Result<Event<K>, watcher::Error>> + Unpin,
    K: kube::Resource,
{
    let mut seen = Vec::new();
    tokio::time::timeout(WAIT, async {
        loop {
            let ev = next(s).await;
            let done = ev == want;
            seen.push(ev);
            if done {
                break;
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("never saw {want}; saw {seen:?}"));
    seen
}

#[tokio::test]
async fn kubeconfig_list_and_pagination() {
    let server = FakeApiServer::start(local()).await.unwrap();
    for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
        let stored = server.apply_service(svc("default", name, 80 + i as i32));
        assert!(stored.metadata.resource_version.is_some());
    }
    server.apply_service(svc("other", "d", 90));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    server.write_kubeconfig(&path).unwrap();
    let yaml = std::fs::read_to_string(&path).unwrap();
    eprintln!("kubeconfig:\n{yaml}");
    for want in [
        "current-context: fakeapi",
        "token: fakeapi-dummy-token",
        "server: http://127.0.0.1:",
    ] {
        assert!(yaml.contains(want), "{want:?} not in\n{yaml}");
    }
    let kc = kube::config::Kubeconfig::read_from(&path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    assert_eq!(config.cluster_url.to_string(), format!("{}/", server.url()));
    let client = kube::Client::try_from(config).unwrap();

    let all: Api<Service> = Api::all(client.clone());
    let list = all.list(&ListParams::default()).await.unwrap();
    let names: Vec<_> = list.items.iter().map(name_of).collect();
    assert_eq!(names, ["a", "b", "c", "d"]);
    assert_eq!(list.metadata.resource_version.as_deref(), Some("5"));
    assert!(
        list.items
            .iter()
            .all(|s| s.metadata.resource_version.is_some())
    );

    // Pagination with limit=1, also across a concurrent change.
    let ns: Api<Service> = Api::namespaced(client.clone(), "default");
    let mut lp = ListParams::default().limit(1);
    let mut pages = Vec::new();
    loop {
        let page = ns.list(&lp).await.unwrap();
        assert_eq!(page.metadata.resource_version.as_deref(), Some("5"));
        assert!(page.items.len() <= 1);
        pages.extend(page.items.iter().map(name_of));
        match page.metadata.continue_ {
            Some(c) if !c.is_empty() => lp = lp.continue_token(&c),
            _ => break,
        }
    }
    assert_eq!(pages, ["a", "b", "c"]);

    // Continue tokens expire with compaction.
    let first = ns.list(&ListParams::default().limit(1)).await.unwrap();
    server.apply_service(svc("default", "e", 80));
    server.compact();
    let token = first.metadata.continue_.unwrap();
    let err = ns
        .list(&ListParams::default().limit(1).continue_token(&token))
        .await
        .unwrap_err();
    assert!(
        matches!(err, kube::Error::Api(ref s) if s.code == 410),
        "{err:?}"
    );

    // Selectors and single-object GET.
    let by_label = all
        .list(&ListParams::default().labels("app=b"))
        .await
        .unwrap();
    assert_eq!(
        by_label.items.iter().map(name_of).collect::<Vec<_>>(),
        ["b"]
    );
    let by_field = all
        .list(&ListParams::default().fields("metadata.namespace=other"))
        .await
        .unwrap();
    assert_eq!(
        by_field.items.iter().map(name_of).collect::<Vec<_>>(),
        ["d"]
    );
    let one = ns.get("c").await.unwrap();
    assert_eq!(one.spec.unwrap().ports.unwrap()[0].port, 82);
    let missing = ns.get("zz").await.unwrap_err();
    assert!(
        matches!(missing, kube::Error::Api(ref s) if s.code == 404),
        "{missing:?}"
    );
    assert_eq!(
        server.request_count("/api/v1/namespaces/default/services", Verb::List),
        5
    );
    // The kubeconfig's token is sent (and recorded), though plain HTTP checks none.
    let log = server.request_log();
    assert!(
        log.iter()
            .all(|r| r.bearer_token.as_deref() == Some("fakeapi-dummy-token")),
        "{log:?}"
    );
}

#[tokio::test]
async fn raw_watch_replays_and_expires() {
    let server = FakeApiServer::start(local()).await.unwrap();
    server.set_bookmark_interval(Duration::from_millis(100));
    let client = server.client().unwrap();
    let api: Api<Service> = Api::all(client);
    let a = server.apply_service(svc("default", "a", 80));
    let rv_a = a.metadata.resource_version.clone().unwrap();
    server.apply_service(svc("default", "a", 81));
    server.delete_service("default", "a");

    let mut s = api
        .watch(&WatchParams::default().timeout(5), &rv_a)
        .await
        .unwrap()
        .boxed();
    let mut kinds = Vec::new();
    while kinds.len() < 3 {
        match tokio::time::timeout(WAIT, s.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            WatchEvent::Modified(o) => {
                kinds.push(format!("M{}", o.metadata.resource_version.unwrap()))
            }
            WatchEvent::Deleted(o) => {
                kinds.push(format!("D{}", o.metadata.resource_version.unwrap()))
            }
            WatchEvent::Bookmark(b) => kinds.push(format!("B{}", b.metadata.resource_version)),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(kinds, ["M3", "D4", "B4"]);

    server.compact();
    server.apply_service(svc("default", "b", 80));
    let mut s = api
        .watch(&WatchParams::default(), &rv_a)
        .await
        .unwrap()
        .boxed();
    match tokio::time::timeout(WAIT, s.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
    {
        WatchEvent::Error(e) => {
            assert_eq!((e.code, e.reason.as_str()), (410, "Expired"));
            assert_eq!(e.message, "too old resource version: 2 (4)");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(
        tokio::time::timeout(WAIT, s.next())
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn watcher_sees_changes_and_relists_after_compaction() {
    let server = FakeApiServer::start(local()).await.unwrap();
    server.apply_service(svc("default", "a", 80));
    server.apply_service(svc("default", "b", 80));
    let api: Api<Service> = Api::all(server.client().unwrap());
    let mut w = watcher(api, watcher::Config::default()).boxed();
    assert_eq!(next(&mut w).await, "Init");
    assert_eq!(next(&mut w).await, "InitApply(a)");
    assert_eq!(next(&mut w).await, "InitApply(b)");
    assert_eq!(next(&mut w).await, "InitDone");

    server.apply_service(svc("default", "c", 80));
    assert_eq!(next(&mut w).await, "Apply(c)");
    server.apply_service(svc("default", "c", 8080));
    assert_eq!(next(&mut w).await, "Apply(c)");
    server.delete_service("default", "c");
    assert_eq!(next(&mut w).await, "Delete(c)");

    // The watch is closed, b is deleted while the watcher is away, and the
    // history is compacted: the watcher's resume gets 410 and it re-lists.
    let lists_before = server.request_count("/api/v1/services", Verb::List);
    let watches_before = server.request_count("/api/v1/services", Verb::Watch);
    server.wait_open_watches(1, WAIT).await.unwrap();
    server.close_watches();
    server.wait_open_watches(0, WAIT).await.unwrap();
    server.delete_service("default", "b");
    server.compact();
    let seen = until(&mut w, "InitDone").await;
    assert!(
        seen[0].starts_with("Err(") && seen[0].contains("Expired"),
        "{seen:?}"
    );
    assert_eq!(seen[1..], ["Init", "InitApply(a)", "InitDone"]);
    assert_eq!(
        server.request_count("/api/v1/services", Verb::List),
        lists_before + 1
    );
    assert_eq!(
        server.request_count("/api/v1/services", Verb::Watch),
        watches_before + 1
    );

    server.apply_service(svc("default", "d", 80));
    assert_eq!(next(&mut w).await, "Apply(d)");

    // What kube-rs sent.
    let log = server.request_log();
    let list = log.iter().find(|r| r.verb == Verb::List).unwrap();
    assert_eq!(list.param("limit").as_deref(), Some("500"));
    let watch = log.iter().find(|r| r.verb == Verb::Watch).unwrap();
    assert_eq!(watch.param("allowWatchBookmarks").as_deref(), Some("true"));
    assert_eq!(watch.param("timeoutSeconds").as_deref(), Some("290"));
    assert_eq!(watch.param("resourceVersion").as_deref(), Some("3"));
    for r in &log {
        eprintln!("kube-rs sent: {:?} {}?{}", r.verb, r.path, r.query);
    }
}

#[tokio::test]
async fn watcher_recovers_from_failures() {
    let server = FakeApiServer::start(local()).await.unwrap();
    server.apply_service(svc("default", "a", 80));
    let api: Api<Service> = Api::all(server.client().unwrap());
    let mut w = watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    until(&mut w, "InitDone").await;

    watching(&server, &mut w, 1).await;
    server.set_failing(true);
    server.close_watches();
    let ev = next(&mut w).await;
    assert!(
        ev.starts_with("Err(") && ev.contains("InternalError"),
        "{ev}"
    );
    server.apply_service(svc("default", "b", 80));
    let during = drain(&mut w, Duration::from_millis(1500)).await;
    assert!(during.iter().all(|e| e.starts_with("Err(")), "{during:?}");
    server.set_failing(false);
    let seen = until(&mut w, "Apply(b)").await;
    assert!(
        seen.iter()
            .all(|e| e.starts_with("Err(") || e == "Apply(b)"),
        "{seen:?}"
    );

    // 503 is retried inside the kube client (Retry-After: 1): no error surfaces.
    watching(&server, &mut w, 1).await;
    server.set_failure_code(503);
    server.set_failing(true);
    server.close_watches();
    server.wait_open_watches(0, WAIT).await.unwrap();
    server.apply_service(svc("default", "c", 80));
    let failing = async {
        tokio::time::sleep(Duration::from_millis(2500)).await;
        server.set_failing(false);
    };
    let (seen, ()) = tokio::join!(until(&mut w, "Apply(c)"), failing);
    assert_eq!(seen, ["Apply(c)"]);
    assert!(
        server.request_count("/api/v1/services", Verb::Watch) >= 5,
        "{:?}",
        server.requests()
    );
}

#[tokio::test]
async fn watcher_survives_restart_on_same_port() {
    let mut server = FakeApiServer::start(local()).await.unwrap();
    let addr = server.addr();
    server.apply_service(svc("default", "a", 80));
    let api: Api<Service> = Api::all(server.client().unwrap());
    let mut w = watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    until(&mut w, "InitDone").await;
    watching(&server, &mut w, 1).await;

    server.stop().await;
    assert!(!server.is_running());
    assert_eq!(server.open_watches(), 0);
    server.apply_service(svc("default", "b", 80));
    server.delete_service("default", "a");
    // The watcher fails to reconnect while the server is down.
    let ev = next(&mut w).await;
    assert!(ev.starts_with("Err("), "{ev}");

    server.restart().await.unwrap();
    assert_eq!(server.addr(), addr);
    let seen = until(&mut w, "Delete(a)").await;
    assert!(seen.contains(&"Apply(b)".to_owned()), "{seen:?}");
    assert!(
        !seen.contains(&"Init".to_owned()),
        "resumed without relist: {seen:?}"
    );
}

#[tokio::test]
async fn node_watch_by_field_selector() {
    let server = FakeApiServer::start(local()).await.unwrap();
    server.apply_node(node("node-a", "10.0.0.1"));
    server.apply_node(node("node-b", "10.0.0.2"));
    let api: Api<Node> = Api::all(server.client().unwrap());
    let cfg = watcher::Config::default().fields("metadata.name=node-a");
    let mut w = watcher(api.clone(), cfg).boxed();
    assert_eq!(next(&mut w).await, "Init");
    assert_eq!(next(&mut w).await, "InitApply(node-a)");
    assert_eq!(next(&mut w).await, "InitDone");
    server.apply_node(node("node-b", "10.0.0.3"));
    server.apply_node(node("node-c", "10.0.0.4"));
    server.apply_node(node("node-a", "10.0.0.5"));
    assert_eq!(next(&mut w).await, "Apply(node-a)");
    server.delete_node("node-b");
    server.delete_node("node-a");
    assert_eq!(next(&mut w).await, "Delete(node-a)");

    let got = api.get("node-b").await.unwrap_err();
    assert!(
        matches!(got, kube::Error::Api(ref s) if s.code == 404),
        "{got:?}"
    );
    assert_eq!(
        api.get("node-c").await.unwrap().metadata.name.as_deref(),
        Some("node-c")
    );
    let watch = server
        .request_log()
        .into_iter()
        .find(|r| r.verb == Verb::Watch)
        .unwrap();
    assert_eq!(watch.path, "/api/v1/nodes");
    assert_eq!(
        watch.param("fieldSelector").as_deref(),
        Some("metadata.name=node-a")
    );
}

#[tokio::test]
async fn endpoint_slices_streaming_list_and_timeouts() {
    use k8s_openapi::api::discovery::v1::Endpoint;
    let server = FakeApiServer::start(local()).await.unwrap();
    let slice = |name: &str, ip: &str| EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            labels: Some([("kubernetes.io/service-name".to_owned(), "a".to_owned())].into()),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        endpoints: vec![Endpoint {
            addresses: vec![ip.into()],
            ..Default::default()
        }],
        ports: None,
    };
    server.apply_endpoint_slice(slice("a-1", "10.1.0.1"));
    let api: Api<EndpointSlice> = Api::namespaced(server.client().unwrap(), "default");

    // kube-rs streaming lists (sendInitialEvents) work too.
    let cfg = watcher::Config::default()
        .streaming_lists()
        .labels("kubernetes.io/service-name=a");
    let mut w = watcher(api.clone(), cfg).boxed();
    assert_eq!(next(&mut w).await, "Init");
    assert_eq!(next(&mut w).await, "InitApply(a-1)");
    assert_eq!(next(&mut w).await, "InitDone");
    server.apply_endpoint_slice(slice("a-2", "10.1.0.2"));
    assert_eq!(next(&mut w).await, "Apply(a-2)");

    // timeoutSeconds ends the stream; the watcher silently re-watches.
    let path = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices";
    let mut w2 = watcher(api, watcher::Config::default().timeout(1)).boxed();
    until(&mut w2, "InitDone").await;
    quiet(&mut w2, Duration::from_millis(2500)).await;
    server.delete_endpoint_slice("default", "a-1");
    assert_eq!(next(&mut w2).await, "Delete(a-1)");
    assert!(
        server.request_count(path, Verb::Watch) >= 3,
        "{:?}",
        server.requests()
    );
    assert_eq!(next(&mut w).await, "Delete(a-1)");
}

#[tokio::test]
async fn delay_and_label_transitions() {
    let server = FakeApiServer::start(local()).await.unwrap();
    let api: Api<Service> = Api::all(server.client().unwrap());
    server.set_delay(Duration::from_millis(300));
    let t = std::time::Instant::now();
    api.list(&ListParams::default()).await.unwrap();
    assert!(t.elapsed() >= Duration::from_millis(300));
    server.set_delay(Duration::ZERO);

    let mut w = watcher(api, watcher::Config::default().labels("tier=web")).boxed();
    until(&mut w, "InitDone").await;
    let mut s = svc("default", "a", 80);
    server.apply_service(s.clone());
    s.metadata.labels = Some([("tier".to_owned(), "web".to_owned())].into());
    server.apply_service(s.clone());
    assert_eq!(next(&mut w).await, "Apply(a)");
    s.metadata.labels = None;
    server.apply_service(s);
    assert_eq!(next(&mut w).await, "Delete(a)");
}
