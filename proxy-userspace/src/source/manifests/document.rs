//! One manifest document to one object: dispatched on `apiVersion`/`kind` (see the rules
//! in the [`manifests`](super) module documentation), lists read item by item, everything
//! else skipped with one error.

use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde::Deserialize;
use serde_json::Value;

use crate::source::{Object, SourceError, Sourced};

const SERVICE_API: &str = "v1";
const ENDPOINT_SLICE_API: &str = "discovery.k8s.io/v1";

/// The fields of a JSON document that say what it is, borrowed from the text.
#[derive(Deserialize)]
struct Head<'a> {
    #[serde(rename = "apiVersion", borrow, default)]
    api_version: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    kind: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    metadata: Option<HeadMeta<'a>>,
}

#[derive(Deserialize)]
struct HeadMeta<'a> {
    #[serde(borrow, default)]
    name: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    namespace: Option<std::borrow::Cow<'a, str>>,
}

/// The common case of a JSON document, read straight into its k8s-openapi type: one
/// Service, EndpointSlice or Node with its apiVersion, kind and name, that deserializes.
/// `None` for anything else, which [`dispatch`] reads (and words the errors of) through a
/// `serde_json::Value`; the result is the same object either way, about twice as fast (no
/// intermediate tree).
pub(super) fn plain_object(origin: &str, raw: &str) -> Option<Object> {
    let head: Head = serde_json::from_str(raw).ok()?;
    let meta = head.metadata?;
    meta.name.as_deref().filter(|n| !n.is_empty())?;
    let ns = meta
        .namespace
        .as_deref()
        .filter(|n| !n.is_empty())
        .unwrap_or("default");
    match (head.api_version.as_deref()?, head.kind.as_deref()?) {
        (SERVICE_API, "Service") => {
            let mut s: Service = serde_json::from_str(raw).ok()?;
            s.metadata.namespace = Some(ns.to_string());
            Some(Object::Service(Sourced::new(origin, s)))
        }
        (ENDPOINT_SLICE_API, "EndpointSlice") => {
            let mut s: EndpointSlice = serde_json::from_str(raw).ok()?;
            s.metadata.namespace = Some(ns.to_string());
            Some(Object::EndpointSlice(Sourced::new(origin, s)))
        }
        (SERVICE_API, "Node") => {
            let mut n: Node = serde_json::from_str(raw).ok()?;
            n.metadata.namespace = None;
            Some(Object::Node(Sourced::new(origin, n)))
        }
        _ => None,
    }
}

/// A string field of a JSON object, when present and a string.
fn str_field<'a>(value: &'a Value, field: &str) -> Option<&'a str> {
    value.get(field).and_then(Value::as_str)
}

/// (namespace, name) as far as they can be read from a raw object; namespace defaults to
/// "default", name to "".
fn raw_key(value: &Value) -> (String, String) {
    let meta = value.get("metadata");
    let ns = meta
        .and_then(|m| str_field(m, "namespace"))
        .filter(|n| !n.is_empty())
        .unwrap_or("default");
    let name = meta.and_then(|m| str_field(m, "name")).unwrap_or("");
    (ns.to_string(), name.to_string())
}

/// Dispatches one document (or list item). `document` is its number in the file (from 1,
/// for messages); `list_item_type` is `(apiVersion, kind)` of the typed list the value is an
/// item of, used when the item leaves them out.
pub(super) fn dispatch(
    origin: &str,
    document: usize,
    mut value: Value,
    list_item_type: Option<(&str, &str)>,
    objects: &mut Vec<Object>,
    errors: &mut Vec<SourceError>,
) {
    if value.is_null() {
        return; // empty document
    }
    let Some(map) = value.as_object_mut() else {
        let what = if list_item_type.is_some() {
            "an item of the list in document"
        } else {
            "document"
        };
        errors.push(SourceError::file(
            origin,
            format!("{what} {document} is not an object (expected a Kubernetes manifest)"),
        ));
        return;
    };
    if let Some((api, kind)) = list_item_type {
        map.entry("apiVersion")
            .or_insert_with(|| Value::String(api.into()));
        map.entry("kind")
            .or_insert_with(|| Value::String(kind.into()));
    }
    let (ns, name) = raw_key(&value);
    let (api, kind) = match type_of(&value) {
        Ok(t) => t,
        Err((kind, missing)) => {
            let shown_ns = if name.is_empty() { String::new() } else { ns };
            errors.push(SourceError::object(
                origin,
                kind,
                shown_ns,
                name,
                format!("missing {missing}; object skipped"),
            ));
            return;
        }
    };

    if let Some(item_type) = list_item_type_of(&api, &kind) {
        match value.get_mut("items").map(Value::take) {
            None | Some(Value::Null) => {} // an empty list
            Some(Value::Array(items)) => {
                for item in items {
                    dispatch(origin, document, item, item_type, objects, errors);
                }
            }
            Some(_) => errors.push(SourceError::object(
                origin,
                kind,
                "",
                "",
                "items is not a list; list skipped",
            )),
        }
        return;
    }

    match read_object(origin, document, &api, kind, ns, name, value) {
        Ok(object) => objects.push(object),
        Err(e) => errors.push(e),
    }
}

/// `(apiVersion, kind)` of a raw object. When either is missing or empty: the kind as far as
/// it can be read (or "") and what is missing, for the error.
fn type_of(value: &Value) -> Result<(String, String), (String, &'static str)> {
    let api = str_field(value, "apiVersion").map(str::to_owned);
    let kind = str_field(value, "kind").map(str::to_owned);
    match (api, kind) {
        (Some(a), Some(k)) if !a.is_empty() && !k.is_empty() => Ok((a, k)),
        (a, k) => {
            let missing = match (a.as_deref().unwrap_or(""), k.as_deref().unwrap_or("")) {
                ("", "") => "apiVersion and kind",
                ("", _) => "apiVersion",
                _ => "kind",
            };
            Err((k.unwrap_or_default(), missing))
        }
    }
}

/// For a list kind, the `(apiVersion, kind)` its items default to (`None` for a `v1` `List`,
/// whose items name their own); `None` for every other kind.
fn list_item_type_of(api: &str, kind: &str) -> Option<Option<(&'static str, &'static str)>> {
    match (api, kind) {
        ("v1", "List") => Some(None),
        ("v1", "ServiceList") => Some(Some((SERVICE_API, "Service"))),
        ("v1", "NodeList") => Some(Some((SERVICE_API, "Node"))),
        ("discovery.k8s.io/v1", "EndpointSliceList") => {
            Some(Some((ENDPOINT_SLICE_API, "EndpointSlice")))
        }
        _ => None,
    }
}

/// Reads one object (not a list) of `api`/`kind` into its k8s-openapi type, its namespace
/// filled in (`ns`, or none for the cluster-scoped Node and Namespace). The error skips it:
/// a kind that is not read, a missing name, or a value that does not deserialize.
fn read_object(
    origin: &str,
    document: usize,
    api: &str,
    kind: String,
    ns: String,
    name: String,
    value: Value,
) -> Result<Object, SourceError> {
    let shown_ns = if name.is_empty() {
        String::new()
    } else {
        ns.clone()
    };
    match (api, kind.as_str()) {
        (SERVICE_API, "Service")
        | (ENDPOINT_SLICE_API, "EndpointSlice")
        | (SERVICE_API, "Node")
        | (SERVICE_API, "Pod")
        | (SERVICE_API, "Namespace") => {}
        _ => {
            return Err(SourceError::object(
                origin,
                kind.clone(),
                shown_ns,
                name,
                format!(
                    "unsupported kind {api} {kind} (only v1 Service, discovery.k8s.io/v1 \
                     EndpointSlice, v1 Node, v1 Pod and v1 Namespace are read); object skipped"
                ),
            ));
        }
    }
    if name.is_empty() {
        // Without a name, the document's number (and the namespace) say which object it is.
        let at = if ns.is_empty() {
            format!("document {document}")
        } else {
            format!("document {document}, namespace {ns}")
        };
        return Err(SourceError::object(
            origin,
            kind,
            "",
            "",
            format!("metadata.name is missing ({at}); object skipped"),
        ));
    }
    let result = if kind == "Pod" {
        typed::<Pod>(value).map(|mut p| {
            p.metadata.namespace = Some(ns.clone());
            Object::Pod(Sourced::new(origin, p))
        })
    } else if kind == "Namespace" {
        typed::<Namespace>(value).map(|mut n| {
            n.metadata.namespace = None;
            Object::Namespace(Sourced::new(origin, n))
        })
    } else if kind == "Node" {
        typed::<Node>(value).map(|mut n| {
            n.metadata.namespace = None;
            Object::Node(Sourced::new(origin, n))
        })
    } else if kind == "Service" {
        typed::<Service>(value).map(|mut s| {
            s.metadata.namespace = Some(ns.clone());
            Object::Service(Sourced::new(origin, s))
        })
    } else {
        typed::<EndpointSlice>(value).map(|mut s| {
            s.metadata.namespace = Some(ns.clone());
            Object::EndpointSlice(Sourced::new(origin, s))
        })
    };
    result.map_err(|e| SourceError::object(origin, kind, ns, name, format!("{e}; object skipped")))
}

/// `value` as a `T`; an error names the field it is about (`spec.ports: invalid type:
/// ...`), as the configuration file's errors do.
fn typed<T: serde::de::DeserializeOwned>(value: Value) -> Result<T, String> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            e.inner().to_string()
        } else {
            format!("{path}: {}", e.inner())
        }
    })
}

#[cfg(test)]
mod tests {
    use crate::source::manifests::fixtures::{SVC, keys, lines};
    use crate::source::manifests::parse_documents;

    #[test]
    fn lists_generic_and_typed() {
        let text = "apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: a}
  spec: {clusterIP: 10.96.0.1, ports: [{port: 53, protocol: UDP}]}
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {name: a-1}
  addressType: IPv4
  endpoints: []
- metadata: {name: no-kind}
---
apiVersion: v1
kind: ServiceList
items:
- metadata: {name: b, namespace: x}
  spec: {clusterIP: 10.96.0.2}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSliceList
items:
- metadata: {name: b-1, namespace: x}
  addressType: IPv6
  endpoints: []
---
apiVersion: v1
kind: List
items: []
";
        let (objects, errors) = parse_documents("l.yaml", text);
        assert_eq!(
            keys(&objects),
            vec![
                ("Service", "default".into(), "a".into()),
                ("EndpointSlice", "default".into(), "a-1".into()),
                ("Service", "x".into(), "b".into()),
                ("EndpointSlice", "x".into(), "b-1".into()),
            ]
        );
        assert_eq!(
            lines(&errors),
            vec!["l.yaml: default/no-kind: missing apiVersion and kind; object skipped"]
        );
    }

    #[test]
    fn unknown_and_wrong_api_version_kinds() {
        let text = "apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: shop}
---
apiVersion: discovery.k8s.io/v1beta1
kind: EndpointSlice
metadata: {name: old}
addressType: IPv4
endpoints: []
---
apiVersion: v1
kind: Sevrice
metadata: {name: typo}
---
apiVersion: v1
metadata: {name: nokind}
---
- just a list
";
        let (objects, errors) = parse_documents("k.yaml", text);
        assert!(objects.is_empty());
        assert_eq!(
            lines(&errors),
            vec![
                "k.yaml: Deployment shop/web: unsupported kind apps/v1 Deployment (only v1 Service, discovery.k8s.io/v1 EndpointSlice, v1 Node, v1 Pod and v1 Namespace are read); object skipped",
                "k.yaml: EndpointSlice default/old: unsupported kind discovery.k8s.io/v1beta1 EndpointSlice (only v1 Service, discovery.k8s.io/v1 EndpointSlice, v1 Node, v1 Pod and v1 Namespace are read); object skipped",
                "k.yaml: Sevrice default/typo: unsupported kind v1 Sevrice (only v1 Service, discovery.k8s.io/v1 EndpointSlice, v1 Node, v1 Pod and v1 Namespace are read); object skipped",
                "k.yaml: default/nokind: missing kind; object skipped",
                "k.yaml: document 5 is not an object (expected a Kubernetes manifest)",
            ]
        );
    }

    #[test]
    fn missing_name() {
        let text = "apiVersion: v1\nkind: Service\nmetadata: {namespace: a}\nspec: {clusterIP: 10.96.0.1}\n";
        let (objects, errors) = parse_documents("n.yaml", text);
        assert!(objects.is_empty());
        assert_eq!(
            lines(&errors),
            vec![
                "n.yaml: Service: metadata.name is missing (document 1, namespace a); object skipped"
            ]
        );
    }

    #[test]
    fn type_error_skips_only_that_object() {
        let text = format!(
            "apiVersion: v1
kind: Service
metadata: {{name: bad, namespace: shop}}
spec:
  clusterIP: 10.96.0.9
  ports:
  - port: abc
---
{SVC}"
        );
        let (objects, errors) = parse_documents("t.yaml", &text);
        assert_eq!(
            keys(&objects),
            vec![("Service", "shop".into(), "web".into())]
        );
        assert_eq!(errors.len(), 1);
        assert_eq!(
            (
                errors[0].origin.as_str(),
                errors[0].kind.as_str(),
                errors[0].namespace.as_str(),
                errors[0].name.as_str()
            ),
            ("t.yaml", "Service", "shop", "bad")
        );
        let line = errors[0].to_string();
        assert!(
            line.starts_with(
                "t.yaml: Service shop/bad: spec.ports[0].port: invalid type: string \"abc\", expected i32"
            ),
            "{line}"
        );
    }
}
