//! The `SERVICE_NAMES` encoding: the name that binds a service id to its key, read back by
//! a restarted agent ([`super::ServiceReconciler::adopt`]), `inspect` and the metrics.

use crate::model::{Family, Protocol, Scope, ServicePortKey};

/// Canonical name of a service id, stored in `SERVICE_NAMES`:
/// `namespace/name:port-name/PROTOCOL/family`, e.g. `default/kube-dns:dns/UDP/v4`, with
/// `/external` or `/ingress` appended for the external addresses' sets ([`Scope`]).
pub fn service_name(k: &ServicePortKey) -> String {
    let proto = match k.protocol {
        Protocol::Tcp => "TCP",
        Protocol::Udp => "UDP",
    };
    let fam = match k.family {
        Family::V4 => "v4",
        Family::V6 => "v6",
    };
    let scope = match k.scope {
        Scope::Internal => "",
        Scope::External => "/external",
        Scope::Ingress => "/ingress",
    };
    format!(
        "{}/{}:{}/{}/{}{scope}",
        k.namespace, k.name, k.port_name, proto, fam
    )
}

/// Inverse of [`service_name`]; `None` for anything else.
pub fn parse_service_name(s: &str) -> Option<ServicePortKey> {
    let mut parts = s.split('/');
    let namespace = parts.next()?.to_string();
    let name_port = parts.next()?;
    let protocol = match parts.next()? {
        "TCP" => Protocol::Tcp,
        "UDP" => Protocol::Udp,
        _ => return None,
    };
    let family = match parts.next()? {
        "v4" => Family::V4,
        "v6" => Family::V6,
        _ => return None,
    };
    let scope = match parts.next() {
        None => Scope::Internal,
        Some("external") => Scope::External,
        Some("ingress") => Scope::Ingress,
        Some(_) => return None,
    };
    if parts.next().is_some() {
        return None;
    }
    let (name, port_name) = name_port.split_once(':')?;
    Some(ServicePortKey {
        namespace,
        name: name.to_string(),
        port_name: port_name.to_string(),
        protocol,
        family,
        scope,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::services::tests::key;

    #[test]
    fn service_names_round_trip() {
        let k = key("web", Protocol::Udp);
        assert_eq!(service_name(&k), "default/web:http/UDP/v4");
        assert_eq!(parse_service_name(&service_name(&k)), Some(k));
        let unnamed = ServicePortKey {
            port_name: String::new(),
            family: Family::V6,
            ..key("x", Protocol::Tcp)
        };
        assert_eq!(parse_service_name(&service_name(&unnamed)), Some(unnamed));
        let external = ServicePortKey {
            scope: Scope::External,
            ..key("lb", Protocol::Tcp)
        };
        assert_eq!(service_name(&external), "default/lb:http/TCP/v4/external");
        assert_eq!(parse_service_name(&service_name(&external)), Some(external));
        assert_eq!(parse_service_name("default/lb:http/TCP/v4/other"), None);
        assert_eq!(parse_service_name("garbage"), None);
    }
}
