//! Unit tests of the test bed: the deploy manifests parse, and (as root) labs, wires and
//! cgroups work and clean up.

use super::*;
use std::fs;
use std::path::PathBuf;
use std::process::Command;

/// The deploy manifests and the demo's examples must parse as the Kubernetes objects
/// they claim to be.
#[test]
fn deploy_manifests_parse() {
    use k8s_openapi::api::{apps, core, discovery, rbac};
    use serde::Deserialize;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let mut files: Vec<PathBuf> = Vec::new();
    for dir in [root.join("kustomize/base"), root.join("examples")] {
        for e in fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "yaml") {
                files.push(p);
            }
        }
    }
    assert!(
        files.len() >= 3,
        "expected deploy/kustomize/base/*.yaml and deploy/examples/*.yaml"
    );
    let mut kinds = Vec::new();
    for f in files {
        let text = fs::read_to_string(&f).unwrap();
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            let v = serde_yaml_ng::Value::deserialize(doc).unwrap();
            if v.is_null() {
                continue;
            }
            let kind = v["kind"]
                .as_str()
                .unwrap_or_else(|| panic!("{}: no kind", f.display()))
                .to_owned();
            let ok = match kind.as_str() {
                "Service" => serde_yaml_ng::from_value::<core::v1::Service>(v).map(drop),
                "EndpointSlice" => {
                    serde_yaml_ng::from_value::<discovery::v1::EndpointSlice>(v).map(drop)
                }
                "DaemonSet" => serde_yaml_ng::from_value::<apps::v1::DaemonSet>(v).map(drop),
                "ConfigMap" => serde_yaml_ng::from_value::<core::v1::ConfigMap>(v).map(drop),
                "ServiceAccount" => {
                    serde_yaml_ng::from_value::<core::v1::ServiceAccount>(v).map(drop)
                }
                "Namespace" => serde_yaml_ng::from_value::<core::v1::Namespace>(v).map(drop),
                "ClusterRole" => serde_yaml_ng::from_value::<rbac::v1::ClusterRole>(v).map(drop),
                "ClusterRoleBinding" => {
                    serde_yaml_ng::from_value::<rbac::v1::ClusterRoleBinding>(v).map(drop)
                }
                other => panic!("{}: unexpected kind {other}", f.display()),
            };
            ok.unwrap_or_else(|e| panic!("{}: {kind}: {e}", f.display()));
            kinds.push(kind);
        }
    }
    for k in [
        "Service",
        "EndpointSlice",
        "DaemonSet",
        "ClusterRole",
        "ClusterRoleBinding",
    ] {
        assert!(kinds.iter().any(|x| x == k), "no {k} in deploy/");
    }
}

#[test]
fn finds_cgroup2_or_explains() {
    match cgroup2_mount() {
        Ok(p) => assert!(p.is_absolute()),
        Err(e) => assert!(e.to_string().contains("cgroup2")),
    }
}

/// Needs root (skipped otherwise); creates namespaces `epunit-*`.
#[test]
fn lab_pods_reach_each_other() {
    assert!(is_root(), "needs root: run `cargo xtask test` as root");
    let mut lab = Lab::new("epunit", true).unwrap();
    let a = lab
        .add_pod(
            "a",
            Ipv4Addr::new(198, 18, 0, 10),
            Some("fd00:198:18::10".parse().unwrap()),
        )
        .unwrap();
    let b = lab
        .add_pod(
            "b",
            Ipv4Addr::new(198, 18, 0, 11),
            Some("fd00:198:18::11".parse().unwrap()),
        )
        .unwrap();
    // A RST (connection refused) from b's closed port proves that b is reachable.
    for dst in [std::net::IpAddr::from(b.ipv4), b.ipv6.unwrap().into()] {
        let r = in_netns(&a.path(), move || {
            std::net::TcpStream::connect_timeout(&(dst, 9).into(), Duration::from_secs(2))
        })
        .unwrap();
        assert_eq!(
            r.unwrap_err().kind(),
            io::ErrorKind::ConnectionRefused,
            "{dst}"
        );
    }
    let path = a.path();
    drop(lab);
    assert!(!path.exists());
}

/// Needs root; creates namespaces `epwire-*`. A host on the wire reaches a pod routed
/// behind a node.
#[test]
fn wire_hosts_reach_pods_behind_a_node() {
    assert!(is_root(), "needs root: run `cargo xtask test` as root");
    let mut wire = Wire::new("epwire").unwrap();
    let (node, _) = wire
        .node("n", &["198.18.100.1/24"], "198.18.1.1/24")
        .unwrap();
    let (client, port) = wire.host("c", &["198.18.100.100/24"]).unwrap();
    assert_eq!(port, "p1");
    client
        .ip(&["route", "add", "198.18.1.0/24", "via", "198.18.100.1"])
        .unwrap();
    let pod = wire
        .pod(&node, "p0", "198.18.1.10/24", "198.18.1.1")
        .unwrap();
    // A RST (connection refused) from the pod's closed port proves the route both ways.
    let dst: std::net::SocketAddr = "198.18.1.10:9".parse().unwrap();
    let r = in_netns(&client.path(), move || {
        std::net::TcpStream::connect_timeout(&dst, Duration::from_secs(2))
    })
    .unwrap();
    assert_eq!(r.unwrap_err().kind(), io::ErrorKind::ConnectionRefused);
    let paths = [pod.path(), client.path(), node.path(), wire.ns().path()];
    drop((pod, client, node, wire));
    assert!(paths.iter().all(|p| !p.exists()));
}

/// Needs root (skipped otherwise); creates the cgroup `ebpf-proxy-unit`.
#[test]
fn cgroup_spawn_and_cleanup() {
    assert!(is_root(), "needs root: run `cargo xtask test` as root");
    let cg = TestCgroup::create("ebpf-proxy-unit").unwrap();
    let mut child =
        ChildGuard::spawn_in(None, Some(cg.path()), Command::new("sleep").arg("5")).unwrap();
    assert_eq!(cg.pids(), vec![child.id()]);
    let p = cg.path().to_owned();
    // Dropped while the process still runs: it is moved out, the cgroup removed.
    drop(cg);
    assert!(!p.exists());
    child.kill();
}
