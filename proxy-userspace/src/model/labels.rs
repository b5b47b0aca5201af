//! The Kubernetes labels the model reads: the link from an EndpointSlice to its Service, a
//! Node's zone, and kube-proxy's label selector, which leaves out the objects meant for
//! another proxy and the slices of headless Services.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// The label linking an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// The label holding a Node's zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// Label naming the proxy meant to implement a Service (`service.kubernetes.io/
/// service-proxy-name`, KEP-2447); the EndpointSlice controller copies it to the slices.
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// Label the EndpointSlice controller puts on the slices of headless Services.
pub const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";
/// The label selector of kube-proxy's Service and EndpointSlice watches (the API source's,
/// which filters with it; the model applies the same rule to every source).
#[cfg(any(test, doc))]
pub use crate::source::kubeapi::PROXY_LABEL_SELECTOR;

/// True when an object's labels exclude it from proxying ([`PROXY_LABEL_SELECTOR`]).
pub fn excluded_by_labels(meta: &ObjectMeta) -> bool {
    meta.labels
        .as_ref()
        .is_some_and(|l| l.contains_key(SERVICE_PROXY_NAME_LABEL) || l.contains_key(HEADLESS_LABEL))
}

#[cfg(test)]
mod tests;
