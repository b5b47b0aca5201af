//! Manifests and helpers shared by the tests of the manifest source.

use std::path::Path;

use crate::source::{Object, SourceError};

pub(super) const SVC: &str = "apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: shop
spec:
  clusterIP: 10.96.0.10
  ports:
  - port: 80
";

pub(super) const SLICE: &str = "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc
  namespace: shop
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
endpoints:
- addresses: [10.0.0.1]
ports:
- port: 8080
";

pub(super) fn keys(objects: &[Object]) -> Vec<(&'static str, String, String)> {
    objects
        .iter()
        .map(|o| {
            let (ns, name) = o.key();
            (o.kind(), ns, name)
        })
        .collect()
}

pub(super) fn lines(errors: &[SourceError]) -> Vec<String> {
    errors.iter().map(ToString::to_string).collect()
}

pub(super) fn svc(name: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: shop}}\nspec: {{clusterIP: 10.96.0.1, ports: [{{port: 80}}]}}\n"
    )
}

pub(super) fn slice(name: &str, service: &str) -> String {
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}, namespace: shop, labels: {{kubernetes.io/service-name: {service}}}}}\naddressType: IPv4\nendpoints: [{{addresses: [10.0.0.1]}}]\nports: [{{port: 8080}}]\n"
    )
}

pub(super) fn names(objects: &[Object]) -> Vec<String> {
    objects.iter().map(|o| o.key().1).collect()
}

pub(super) fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}
