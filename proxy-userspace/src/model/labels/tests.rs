use std::collections::BTreeSet;

use crate::model::tests::{addrs, apply_yaml, build_yaml, model};
use crate::model::{HEADLESS_LABEL, PROXY_LABEL_SELECTOR, SERVICE_PROXY_NAME_LABEL};

/// A Service `ns/{name}` on 10.96.1.{n}:80 with extra metadata lines, and its slice
/// with one endpoint on another node and the same labels.
fn labelled(name: &str, n: u8, labels: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: ns, labels: {{{labels}}}}}\nspec: {{clusterIP: 10.96.1.{n}, ports: [{{port: 80}}]}}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: ns, labels: {{kubernetes.io/service-name: {name}{}{labels}}}}}\naddressType: IPv4\nports: [{{port: 80}}]\nendpoints: [{{addresses: [10.0.1.{n}], nodeName: node-2}}]\n",
        if labels.is_empty() { "" } else { ", " }
    )
}

#[test]
fn objects_labelled_for_another_proxy_or_headless_are_not_proxied() {
    let yaml = labelled("plain", 1, "")
        + &labelled(
            "other-proxy",
            2,
            "service.kubernetes.io/service-proxy-name: other",
        )
        + &labelled(
            "empty-name",
            3,
            "service.kubernetes.io/service-proxy-name: ''",
        )
        + &labelled("headless", 4, "service.kubernetes.io/headless: ''");
    let (s, errors) = build_yaml(&yaml);
    assert!(errors.is_empty(), "{errors:?}");
    let names: BTreeSet<&str> = s.services.keys().map(|k| k.name.as_str()).collect();
    assert_eq!(
        names,
        BTreeSet::from(["plain"]),
        "any value of the label excludes"
    );

    // Gaining the label removes what the Service gave; losing it brings it back (the
    // watch's DELETED and ADDED events under kube-proxy's selector).
    let mut m = model(&labelled("web", 5, ""));
    assert_eq!(m.ports().len(), 1);
    apply_yaml(
        &mut m,
        &labelled("web", 5, "service.kubernetes.io/service-proxy-name: istio"),
    );
    let d = m.commit();
    assert!(m.ports().is_empty(), "{d:?}");
    assert_eq!(d.ports.len(), 1);
    apply_yaml(&mut m, &labelled("web", 5, ""));
    m.commit();
    let (k, v) = m.ports().iter().next().expect("back");
    assert_eq!(k.name, "web");
    assert_eq!(v.backends, addrs(&["10.0.1.5:80"]));
    // A slice alone with the label: the Service stays, without those endpoints.
    apply_yaml(
        &mut m,
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, namespace: ns, labels: {kubernetes.io/service-name: web, service.kubernetes.io/headless: ''}}\naddressType: IPv4\nports: [{port: 80}]\nendpoints: [{addresses: [10.0.1.5]}]\n",
    );
    m.commit();
    assert!(m.ports().values().next().unwrap().backends.is_empty());
    assert_eq!(
        PROXY_LABEL_SELECTOR,
        format!("!{SERVICE_PROXY_NAME_LABEL},!{HEADLESS_LABEL}")
    );
}
