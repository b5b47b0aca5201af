use crate::model::DesiredState;
use crate::model::tests::{NO_ERRORS, build_yaml, slice, svc};

#[test]
fn counts() {
    // Two Services share a backend (same addr, port, proto): one backend, two slots.
    let yaml = svc(
        "default",
        "a",
        "  clusterIPs: [10.96.0.1, 'fd00::1']\n  ports: [{name: x, port: 80}, {name: y, port: 53, protocol: UDP}]\n",
    ) + &svc(
        "default",
        "b",
        "  clusterIP: 10.96.0.2\n  ports: [{port: 80}]\n",
    ) + &slice(
        "default",
        "a-1",
        "a",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}, {addresses: [10.0.0.2]}]\nports: [{name: x, port: 8080}, {name: y, port: 8080, protocol: UDP}]\n",
    ) + &slice(
        "default",
        "b-1",
        "b",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 8080}]\n",
    );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(e, NO_ERRORS);
    assert_eq!(s.services.len(), 5);
    assert_eq!(
        s.vips(),
        ["10.96.0.1", "10.96.0.2", "fd00::1"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect()
    );
    // a: 2 ports x 2 families, b: 1.
    assert_eq!(s.frontend_count(), 5);
    // 10.0.0.1:8080/TCP, 10.0.0.2:8080/TCP, 10.0.0.1:8080/UDP, 10.0.0.2:8080/UDP.
    assert_eq!(s.backend_count(), 4);
    // a/x/V4: 2, a/y/V4: 2, b/V4: 1, the V6 sets: 0.
    assert_eq!(s.slot_count(), 5);
    assert_eq!(DesiredState::default().frontend_count(), 0);
}
