use proxy_common::{PROTO_TCP, PROTO_UDP, client_of_netns};

use super::*;
use crate::datapath::addr::{ip_to_bytes, port_to_map};

fn event(kind: EventKind, reason: EventReason) -> MonitorEvent {
    MonitorEvent {
        ts_ns: 2_000_000_000,
        cookie: 7,
        netns: 4026531840,
        client: client_of_netns(4026531840),
        frontend: ip_to_bytes("198.19.0.10".parse().unwrap()),
        frontend_port: port_to_map(80),
        backend: ip_to_bytes("198.18.0.2".parse().unwrap()),
        backend_port: port_to_map(8080),
        service_id: 3,
        backend_id: 5,
        kind: kind as u8,
        reason: reason as u8,
        proto: PROTO_TCP,
        algorithm: Algorithm::Random as u8,
        hook: HOOK_SOCK,
        ..Default::default()
    }
}

#[test]
fn decodes_a_record_of_the_right_size_only() {
    let e = event(EventKind::SockTranslate, EventReason::None);
    // SAFETY: reading the bytes of a plain struct.
    let bytes = unsafe {
        std::slice::from_raw_parts(
            (&e as *const MonitorEvent).cast::<u8>(),
            std::mem::size_of::<MonitorEvent>(),
        )
    };
    assert_eq!(decode(bytes), Some(e));
    assert_eq!(decode(&bytes[1..]), None);
}

#[test]
fn shows_socket_and_flow_events() {
    let e = event(EventKind::SockTranslate, EventReason::None);
    let s = show(&e, Some("default/web:http/TCP/v4".into()), 1_000_000_000);
    assert_eq!(s.kind, "translate");
    assert_eq!(s.reason, None);
    assert_eq!(s.client.as_deref(), Some("netns:4026531840"));
    assert_eq!(s.frontend, "198.19.0.10:80");
    assert_eq!(s.backend.as_deref(), Some("198.18.0.2:8080"));
    assert_eq!(s.algorithm, Some("random"));
    assert_eq!(s.time, 3.0);
    let j: serde_json::Value = serde_json::to_value(&s).unwrap();
    assert_eq!(j["type"], "translate");
    assert_eq!(j["service"], "default/web:http/TCP/v4");
    assert!(j.get("reason").is_none());
    assert!(j.get("nat").is_none());
    let line = text_line(&s);
    assert!(
        line.contains("translate  TCP netns:4026531840 -> 198.19.0.10:80 => 198.18.0.2:8080"),
        "{line}"
    );
    assert!(line.contains("service=default/web:http/TCP/v4"), "{line}");

    let mut r = event(EventKind::SockRefuse, EventReason::NoLocalEndpoints);
    r.backend = [0; 16];
    r.backend_port = [0; 2];
    r.backend_id = 0;
    let s = show(&r, None, 0);
    assert_eq!(s.reason, Some("no-local-endpoints"));
    assert_eq!(s.backend, None);
    assert!(text_line(&s).contains("reason=no-local-endpoints service_id=3"));

    let mut f = event(EventKind::FlowNew, EventReason::None);
    f.flags = EVENT_F_SNAT | EVENT_F_AFFINITY_HIT;
    f.hook = HOOK_TC_INGRESS;
    f.client = ip_to_bytes("2001:db8::1".parse().unwrap());
    f.client_port = port_to_map(40000);
    f.nat = ip_to_bytes("198.18.0.1".parse().unwrap());
    f.nat_port = port_to_map(61000);
    let s = show(&f, None, 0);
    assert_eq!(s.client.as_deref(), Some("[2001:db8::1]:40000"));
    assert_eq!(s.nat.as_deref(), Some("198.18.0.1:61000"));
    assert_eq!(s.affinity, Some("hit"));
    assert_eq!(s.hook, "tc-ingress");
    assert!(text_line(&s).contains("snat=198.18.0.1:61000"));
    f.hook = HOOK_XDP;
    assert!(text_line(&show(&f, None, 0)).contains(" hook=xdp"));
}

#[test]
fn filters_by_every_criterion() {
    let e = event(EventKind::SockRefuse, EventReason::NoEndpoints);
    let name = Some("default/web:http/TCP/v4");
    assert!(Filter::default().matches(&e, None));
    let f = |f: Filter| f.matches(&e, name);
    assert!(f(Filter {
        service: Some("default/web".into()),
        ..Default::default()
    }));
    assert!(!f(Filter {
        service: Some("default/we".into()),
        ..Default::default()
    }));
    assert!(
        !Filter {
            service: Some("default/web".into()),
            ..Default::default()
        }
        .matches(&e, None)
    );
    assert!(f(Filter {
        address: Some("198.18.0.2".parse().unwrap()),
        ..Default::default()
    }));
    assert!(!f(Filter {
        address: Some("198.18.0.3".parse().unwrap()),
        ..Default::default()
    }));
    assert!(f(Filter {
        port: Some(8080),
        ..Default::default()
    }));
    assert!(f(Filter {
        port: Some(80),
        ..Default::default()
    }));
    assert!(!f(Filter {
        port: Some(81),
        ..Default::default()
    }));
    assert!(!f(Filter {
        protocol: Some(PROTO_UDP),
        ..Default::default()
    }));
    assert!(f(Filter {
        kinds: vec![EventKind::SockTranslate, EventKind::SockRefuse],
        ..Default::default()
    }));
    assert!(!f(Filter {
        kinds: vec![EventKind::FlowNew],
        ..Default::default()
    }));
    assert!(f(Filter {
        reasons: vec![EventReason::NoEndpoints],
        ..Default::default()
    }));
    assert!(!f(Filter {
        reasons: vec![EventReason::UndefinedPort],
        ..Default::default()
    }));
}

#[test]
fn parses_names_and_reports_losses() {
    assert_eq!(parse_kind("flow-new").unwrap(), EventKind::FlowNew);
    assert!(parse_kind("nope").is_err());
    assert_eq!(
        parse_reason("undefined-port").unwrap(),
        EventReason::UndefinedPort
    );
    assert!(parse_reason("").is_err());
    for (k, n) in EventKind::ALL {
        assert_eq!(EventKind::from_u8(k as u8), Some(k));
        assert_eq!(k.name(), n);
    }
    let base = Lost {
        rate_limited: 5,
        ring_full: 1,
    };
    let now = Lost {
        rate_limited: 12,
        ring_full: 3,
    };
    let d = now.since(&base);
    assert_eq!(d.total(), 9);
    assert_eq!(
        lost_line(&d, false),
        "-- 9 events lost (rate limit: 7, ring buffer full: 2)"
    );
    let j: serde_json::Value = serde_json::from_str(&lost_line(&d, true)).unwrap();
    assert_eq!(j["lost"], 9);
    assert_eq!(j["rate_limited"], 7);
    assert_eq!(j["ring_full"], 2);
}
