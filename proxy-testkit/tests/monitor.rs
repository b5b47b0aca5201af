//! Privileged integration tests of `ebpf-proxy monitor` on the socket path: one event per
//! connection with the right frontend, backend and reason (translated, refused for lack of
//! endpoints, for an undefined port, for a Local policy without local endpoints, a stale
//! connected UDP socket dropped and repaired), reverse translations, the lease given back,
//! and losses under a burst over the rate reported rather than silent. The tc path's
//! events are tested by the north-south scenario `monitor-flows-and-drops.txtar`, with its
//! two-node lab.

mod common;

use std::{
    net::IpAddr,
    process::{Command, Stdio},
    time::Duration,
};

use common::*;
use proxy_userspace::datapath::view::PinnedView;
use serde_json::Value;

const VIP: &str = "198.19.0.50";
const EMPTY_VIP: &str = "198.19.0.51";
const LOCAL_VIP: &str = "198.19.0.52";
const KEEP_VIP: &str = "198.19.0.53";

fn b(i: usize) -> IpAddr {
    IpAddr::V4(backend_v4(i))
}

/// `web` (TCP 80 and UDP 53, endpoint `b<web_ep>`), `empty` (no endpoints), `local`
/// (internalTrafficPolicy Local, its endpoint on another node) and `keep` (b0 on UDP, so
/// b0's backend entry outlives its removal from `web`).
fn manifests(env: &Env, web_ep: usize) {
    let svc = service(
        "default",
        "web",
        &[VIP],
        &[("http", 80, 8080, "TCP"), ("dns", 53, 5353, "UDP")],
    );
    let sl = slice(
        "default",
        "web-1",
        "web",
        "IPv4",
        &[("http", 8080, "TCP"), ("dns", 5353, "UDP")],
        &[(b(web_ep), true)],
    );
    let empty = service(
        "default",
        "empty",
        &[EMPTY_VIP],
        &[("http", 80, 8080, "TCP")],
    );
    let keep = service("default", "keep", &[KEEP_VIP], &[("dns", 53, 5353, "UDP")]);
    let keep_slice = slice(
        "default",
        "keep-1",
        "keep",
        "IPv4",
        &[("dns", 5353, "UDP")],
        &[(b(0), true)],
    );
    let local = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: local, namespace: default}}\nspec:\n  clusterIP: {LOCAL_VIP}\n  internalTrafficPolicy: Local\n  ports:\n  - {{name: http, port: 80, targetPort: 8080, protocol: TCP}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: local-1\n  namespace: default\n  labels: {{kubernetes.io/service-name: local}}\naddressType: IPv4\nports:\n- {{name: http, port: 8080, protocol: TCP}}\nendpoints:\n- addresses: [\"{}\"]\n  nodeName: node-b\n",
        b(1)
    );
    env.write_manifest(
        "objects.yaml",
        &format!("{svc}---\n{sl}---\n{empty}---\n{keep}---\n{keep_slice}---\n{local}"),
    );
}

#[test]
fn one_event_per_connection_with_frontend_backend_and_reason() {
    let mut env = Env::new("mon-sock", 3, false);
    env.extra_agent_args = vec!["--hostname-override".into(), "node-a".into()];
    manifests(&env, 0);
    env.start_agent();
    let mon = MonitorRun::start(&env.pin_path(), &[]);
    // One reader at a time.
    let name = env
        .pin_path()
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    let second = Command::new(AGENT)
        .args(["monitor", "--pin-dir", &name, "--duration", "1"])
        .output()
        .unwrap();
    assert!(!second.status.success());
    assert!(
        String::from_utf8_lossy(&second.stderr).contains("one reader at a time"),
        "{second:?}"
    );

    // Translated: one TCP connection, then one unconnected UDP flow of three datagrams.
    let r = env.tcp(&format!("{VIP}:80"), 1);
    assert_eq!(r[0]["name"], "b0", "{r:?}");
    let r = env.udp(&format!("{VIP}:53"), 3, false);
    assert!(r.iter().all(|p| p["name"] == "b0"), "{r:?}");
    // Refused: no endpoints, undefined port (ECONNREFUSED), Local policy without a local
    // endpoint (EHOSTUNREACH).
    let r = env.tcp(&format!("{EMPTY_VIP}:80"), 1);
    assert_eq!(errno(&r[0]), Some(111), "{r:?}");
    let r = env.tcp(&format!("{VIP}:81"), 1);
    assert_eq!(errno(&r[0]), Some(111), "{r:?}");
    let r = env.tcp(&format!("{LOCAL_VIP}:80"), 1);
    assert_eq!(errno(&r[0]), Some(113), "{r:?}");

    // Stale: a connected UDP socket sending every 100 ms while its endpoint b0 is replaced
    // by b2; its next send fails (EPERM) and it connects again.
    let mut cmd = Command::new(NETPROBE);
    cmd.args(["udp", "--to", &format!("{VIP}:53"), "--count", "20"])
        .args(["--interval-ms", "100", "--timeout-ms", "300"])
        .args(["--connected", "--reconnect"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let stream = env.client.spawn(Some(env.cg.path()), &mut cmd).unwrap();
    std::thread::sleep(Duration::from_millis(700));
    env.apply(|| manifests(&env, 2));
    let lines = finish_probe(stream);
    let reconnects: Vec<&Probe> = lines
        .iter()
        .filter(|p| !p["reconnected_after"].is_null())
        .collect();
    assert_eq!(reconnects.len(), 1, "{lines:?}");

    let events = mon.stop();
    let ev = |kind: &str, frontend: &str| -> Vec<&Value> {
        events
            .iter()
            .filter(|e| e["type"] == kind && e["frontend"] == frontend)
            .collect()
    };
    let web_tcp = format!("{VIP}:80");
    let web_udp = format!("{VIP}:53");

    // One translate event for the TCP connection, with the frontend, backend, Service port
    // and client identity.
    let t = ev("translate", &web_tcp);
    assert_eq!(t.len(), 1, "{events:#?}");
    assert_eq!(t[0]["backend"], format!("{}:8080", b(0)));
    assert_eq!(t[0]["service"], "default/web:http/TCP/v4");
    assert_eq!(t[0]["protocol"], "TCP");
    assert_eq!(t[0]["hook"], "sock");
    assert_eq!(t[0]["algorithm"], "random");
    assert!(t[0]["cookie"].as_u64().unwrap() > 0, "{t:?}");
    assert!(t[0]["netns"].as_u64().unwrap() > 0, "{t:?}");
    assert!(t[0]["cgroup"].as_u64().unwrap() > 0, "{t:?}");
    assert!(
        t[0]["client"].as_str().unwrap().starts_with("netns:"),
        "{t:?}"
    );

    // UDP: one event for the unconnected flow (its first datagram), one for the connected
    // socket's connect(), one for its repair (to b2), with the stale drop between them.
    let u = ev("translate", &web_udp);
    let flows: Vec<&&Value> = u.iter().filter(|e| e["datagram"] == true).collect();
    assert_eq!(flows.len(), 1, "{u:#?}");
    assert_eq!(flows[0]["backend"], format!("{}:5353", b(0)));
    let connects: Vec<&&Value> = u.iter().filter(|e| e["datagram"].is_null()).collect();
    assert_eq!(connects.len(), 2, "{u:#?}");
    assert_eq!(connects[0]["backend"], format!("{}:5353", b(0)));
    assert!(connects[0]["stale_repaired"].is_null(), "{connects:?}");
    assert_eq!(connects[1]["backend"], format!("{}:5353", b(2)));
    assert_eq!(connects[1]["stale_repaired"], true, "{connects:?}");
    let stale = of_type(&events, "stale-drop");
    assert_eq!(stale.len(), 1, "{events:#?}");
    assert_eq!(stale[0]["reason"], "stale-socket");
    assert_eq!(stale[0]["hook"], "skb");
    assert_eq!(stale[0]["backend"], format!("{}:0", b(0)));
    assert_eq!(stale[0]["service"], "default/web:dns/UDP/v4");
    assert_eq!(stale[0]["cookie"], connects[0]["cookie"]);
    assert_eq!(connects[1]["cookie"], connects[0]["cookie"]);

    // Refusals, one per connection, each with its reason.
    let refused = of_type(&events, "refuse");
    assert_eq!(refused.len(), 3, "{events:#?}");
    let one = |frontend: &str| {
        let v = ev("refuse", frontend);
        assert_eq!(v.len(), 1, "{frontend}: {events:#?}");
        v[0].clone()
    };
    let e = one(&format!("{EMPTY_VIP}:80"));
    assert_eq!(e["reason"], "no-endpoints");
    assert_eq!(e["service"], "default/empty:http/TCP/v4");
    assert!(e["backend"].is_null(), "{e}");
    let e = one(&format!("{VIP}:81"));
    assert_eq!(e["reason"], "undefined-port");
    assert_eq!(e["service_id"], 0);
    let e = one(&format!("{LOCAL_VIP}:80"));
    assert_eq!(e["reason"], "no-local-endpoints");
    assert_eq!(e["service"], "default/local:http/TCP/v4");

    // Replies show the frontend again: each recvmsg() of the unconnected flow's three
    // replies (from b0), and the connected socket's recvmsg()/getpeername() after its
    // repair (b2).
    let rev = ev("reverse", &web_udp);
    let of_flow: Vec<&&Value> = rev
        .iter()
        .filter(|e| e["cookie"] == flows[0]["cookie"])
        .collect();
    assert_eq!(of_flow.len(), 3, "{rev:#?}");
    assert!(
        of_flow
            .iter()
            .all(|e| e["datagram"] == true && e["backend"] == format!("{}:5353", b(0))),
        "{of_flow:?}"
    );
    assert!(
        rev.iter()
            .any(|e| e["cookie"] == connects[0]["cookie"]
                && e["backend"] == format!("{}:5353", b(2))),
        "{rev:#?}"
    );

    // The connected UDP socket's flow ended with the socket: one flow-end event with its
    // cookie, the frontend and the backend it last had. The TCP connection's and the
    // unconnected flow's end are not socket-path UDP flow ends (the unconnected flow's
    // state ages out).
    let ends = of_type(&events, "flow-end");
    assert_eq!(ends.len(), 1, "{events:#?}");
    assert_eq!(ends[0]["reason"], "socket-closed");
    assert_eq!(ends[0]["hook"], "sock");
    assert_eq!(ends[0]["protocol"], "UDP");
    assert_eq!(ends[0]["frontend"], web_udp);
    assert_eq!(ends[0]["backend"], format!("{}:5353", b(2)));
    assert_eq!(ends[0]["cookie"], connects[0]["cookie"]);
    assert_eq!(ends[0]["service"], "default/web:dns/UDP/v4");

    // Nothing else, and nothing lost.
    let kinds = ["translate", "refuse", "stale-drop", "reverse", "flow-end"];
    assert!(
        events
            .iter()
            .all(|e| kinds.contains(&e["type"].as_str().unwrap_or(""))),
        "{events:#?}"
    );
    assert!(
        events.iter().all(|e| e.get("lost").is_none()),
        "{events:#?}"
    );
}

#[test]
fn filters_select_events_and_losses_over_the_rate_are_reported() {
    let mut env = Env::new("mon-loss", 1, false);
    manifests(&env, 0);
    env.start_agent();

    // Filters: only refusals for lack of endpoints, of one Service.
    let mut mon = MonitorRun::start(
        &env.pin_path(),
        &[
            "--service",
            "default/empty",
            "--reason",
            "no-endpoints",
            "--count",
            "2",
        ],
    );
    env.tcp(&format!("{VIP}:80"), 2);
    env.tcp(&format!("{VIP}:81"), 1);
    env.tcp(&format!("{EMPTY_VIP}:80"), 2);
    let events = mon.finish();
    assert_eq!(events.len(), 2, "{events:#?}");
    assert!(
        events
            .iter()
            .all(|e| e["reason"] == "no-endpoints" && e["frontend"] == format!("{EMPTY_VIP}:80")),
        "{events:#?}"
    );

    // A burst of 60 connections against a rate of 5 events per second and CPU with
    // bursts of 5: most events are lost, and the monitor says how many.
    let mon = MonitorRun::start(
        &env.pin_path(),
        &["--type", "translate", "--rate", "5", "--burst", "5"],
    );
    let r = env.tcp(&format!("{VIP}:80"), 60);
    assert!(r.iter().all(|p| p["name"] == "b0"), "{r:?}");
    let out = mon.stop();
    let shown = out.iter().filter(|e| e["type"] == "translate").count();
    let lost: Vec<&Value> = out.iter().filter(|e| e.get("lost").is_some()).collect();
    assert!(!lost.is_empty(), "no loss reported: {out:#?}");
    let last = lost.last().unwrap();
    let total = last["lost"].as_u64().unwrap();
    assert!(
        total > 0 && last["rate_limited"].as_u64().unwrap() > 0,
        "{last}"
    );
    // Every connection is either shown or counted as lost (the counts cover the whole
    // run; other events, such as none here, would only add to them).
    assert!(shown > 0 && shown < 60, "{shown} shown");
    assert!(shown as u64 + total >= 60, "{shown} shown + {total} lost");
    // The data path's counters agree, and the agent exports them.
    let t = PinnedView::new(&env.pin_path()).monitor_totals().unwrap();
    assert!(
        t.rate_limited >= total && t.emitted >= shown as u64,
        "{t:?}"
    );
    let addr = env.logged_addr("metrics");
    let out = Command::new("curl")
        .args(["-sf", &format!("http://{addr}/metrics")])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("ebpf_proxy_monitor_events_total{outcome=\"rate_limited\"}"))
        .unwrap_or_else(|| panic!("{text}"));
    let v: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(v >= total as f64, "{line}");
    assert!(text.contains("ebpf_proxy_monitor_active 0"), "{text}");
}
