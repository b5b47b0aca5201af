//! Where the agent reaches the Kubernetes API server, and with which credentials.
//!
//! In order:
//! 1. `--kubeconfig` (or the configuration file's `clientConnection.kubeconfig`, kubeadm's
//!    way for kube-proxy): that file, its server replaced by `--master` when given.
//! 2. `KUBECONFIG` or `~/.kube/config` (a developer's machine, a host with a kubeconfig).
//! 3. In a pod (a service account token mounted at [`SERVICE_ACCOUNT_DIR`]): the service
//!    account's token and CA with the address of `--master`, which is **required** there.
//!    The in-cluster default, `KUBERNETES_SERVICE_HOST`, is the ClusterIP of the
//!    `kubernetes` Service; once kube-proxy is gone only this proxy translates it, so after
//!    a node reboot (bpffs empty, nothing programmed) an agent dialing it could never start.
//!    kubeadm gives kube-proxy a kubeconfig with the control plane's address for the same
//!    reason, and Cilium requires `k8sServiceHost`.
//! 4. Elsewhere, `--master` alone: that URL without credentials (kube-proxy's behaviour).

use std::path::Path;

use anyhow::{Context, Result, bail};

use super::SourceChoice;

/// Where the kubelet mounts a pod's service account credentials (`token`, `ca.crt`,
/// `namespace`).
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// How an agent without `--kubeconfig` reaches the API.
#[derive(Debug, PartialEq, Eq)]
pub enum Plan {
    /// `KUBECONFIG` or `~/.kube/config`, server replaced by `--master` when given.
    LocalKubeconfig,
    /// In a pod: the service account's credentials, the server of `--master`.
    ServiceAccount,
    /// `--master` without credentials.
    MasterOnly,
}

/// The plan for an agent without `--kubeconfig`, from whether a local kubeconfig loads,
/// whether a service account is mounted, and `--master`.
///
/// Errors: in a pod without `--master` ([`address_required`]); nothing usable at all.
pub fn plan(local_kubeconfig: bool, service_account: bool, master: Option<&str>) -> Result<Plan> {
    match (local_kubeconfig, service_account, master) {
        (true, _, _) => Ok(Plan::LocalKubeconfig),
        (false, true, Some(_)) => Ok(Plan::ServiceAccount),
        (false, true, None) => bail!("{}", address_required()),
        (false, false, Some(_)) => Ok(Plan::MasterOnly),
        (false, false, None) => bail!(
            "no usable Kubernetes API configuration: pass --kubeconfig or --manifests, set KUBECONFIG, or run in a pod with --master"
        ),
    }
}

/// The error of an agent in a pod without the API server's address: names the setting in
/// each way of installing.
pub fn address_required() -> String {
    let host = std::env::var("KUBERNETES_SERVICE_HOST").unwrap_or_default();
    let shown = if host.is_empty() {
        String::new()
    } else {
        format!(" (KUBERNETES_SERVICE_HOST={host})")
    };
    format!(
        "the Kubernetes API server's address is not set: --master is empty. In a pod the in-cluster address{shown} is the ClusterIP of the `kubernetes` Service, which only this proxy translates once kube-proxy is gone, so after a node reboot the agent could not reach it. Set the API server's own address or its load balancer's (host:port or https://host:port): the Helm chart's value apiServer.address, the `address` key of the ebpf-proxy-apiserver ConfigMap with kustomize, or --master; or pass --kubeconfig with a file whose server is that address"
    )
}

/// `--master`: the API server's URL (kube-proxy also takes `host:port`, meaning https).
///
/// Errors: not a URL.
pub fn parse_master(url: &str) -> Result<axum::http::Uri> {
    let url = if url.contains("://") {
        url.to_string()
    } else {
        format!("https://{url}")
    };
    let uri: axum::http::Uri = url
        .parse()
        .map_err(|e| anyhow::anyhow!("--master {url:?}: not a URL ({e})"))?;
    const FORM: &str = "host:port or https://host:port, IPv6 in brackets";
    if uri.host().is_none_or(str::is_empty) {
        bail!("--master {url:?}: no host ({FORM})");
    }
    if !matches!(uri.scheme_str(), Some("https" | "http")) {
        bail!("--master {url:?}: the scheme must be https (or http) ({FORM})");
    }
    // `Uri` keeps a port it cannot read and then falls back to the scheme's (443): say so.
    let authority = uri.authority().map(|a| a.as_str()).unwrap_or("");
    let after_host = authority
        .rsplit_once(']')
        .map_or(authority, |(_, rest)| rest);
    if let Some((_, port)) = after_host.rsplit_once(':')
        && !port.parse::<u16>().is_ok_and(|p| p != 0)
    {
        bail!("--master {url:?}: port {port} is not a port from 1 to 65535 ({FORM})");
    }
    Ok(uri)
}

/// How a kubeconfig file is named in errors.
pub fn kubeconfig_named(path: &Path) -> String {
    format!(
        "kubeconfig {} (--kubeconfig, clientConnection.kubeconfig)",
        path.display()
    )
}

/// A client configuration with the service account's credentials under `dir` (`token`,
/// re-read as the kubelet rotates it, and `ca.crt`) for the API server at `master`.
///
/// Errors: `master` is not a URL; the CA cannot be read or parsed.
pub async fn service_account_config(dir: &Path, master: &str) -> Result<kube::Config> {
    let server = parse_master(master)?.to_string();
    let server = server.trim_end_matches('/');
    let ca = dir.join("ca.crt");
    let token = dir.join("token");
    let namespace = std::fs::read_to_string(dir.join("namespace"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "default".into());
    let yaml = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "in-cluster", "cluster": {
            "server": server,
            "certificate-authority": ca.display().to_string(),
        }}],
        "users": [{"name": "service-account", "user": {"tokenFile": token.display().to_string()}}],
        "contexts": [{"name": "in-cluster", "context": {
            "cluster": "in-cluster", "user": "service-account", "namespace": namespace,
        }}],
        "current-context": "in-cluster",
    });
    let kc: kube::config::Kubeconfig =
        serde_json::from_value(yaml).context("the service account's kubeconfig")?;
    kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
        .await
        .with_context(|| {
            format!(
                "the service account's credentials in {} with --master {master}",
                dir.display()
            )
        })
}

/// The Kubernetes API configuration of `source` (see the module documentation); `None` with
/// `--manifests`. Resolved before the data path is touched, so a missing or broken
/// configuration changes nothing.
///
/// Errors: those of `plan` (in a pod without `--master`; nothing usable at all); a
/// kubeconfig that cannot be read or used; a bad `--master`.
pub async fn kube_config(
    source: &SourceChoice,
    master: Option<&str>,
) -> Result<Option<kube::Config>> {
    let SourceChoice::Api(kubeconfig) = source else {
        return Ok(None);
    };
    let mut config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| anyhow::anyhow!("{}: {e}", kubeconfig_named(path)))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| anyhow::anyhow!("{}: {e}", kubeconfig_named(path)))?
        }
        None => {
            let local =
                kube::Config::from_kubeconfig(&kube::config::KubeConfigOptions::default()).await;
            let sa = Path::new(SERVICE_ACCOUNT_DIR);
            match plan(local.is_ok(), sa.join("token").exists(), master)? {
                Plan::LocalKubeconfig => local.expect("loaded"),
                Plan::ServiceAccount => {
                    return service_account_config(sa, master.expect("planned with --master"))
                        .await
                        .map(Some);
                }
                Plan::MasterOnly => kube::Config::new(parse_master(master.expect("planned"))?),
            }
        }
    };
    if let Some(url) = master {
        config.cluster_url = parse_master(url)?;
    }
    Ok(Some(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_a_pod_the_api_address_is_required_and_named() {
        assert_eq!(plan(true, true, None).unwrap(), Plan::LocalKubeconfig);
        assert_eq!(
            plan(false, true, Some("192.0.2.10:6443")).unwrap(),
            Plan::ServiceAccount
        );
        assert_eq!(plan(false, false, Some("h:1")).unwrap(), Plan::MasterOnly);
        let e = plan(false, true, None).unwrap_err().to_string();
        for needle in [
            "--master",
            "apiServer.address",
            "ebpf-proxy-apiserver",
            "ClusterIP",
        ] {
            assert!(e.contains(needle), "{needle} missing in {e}");
        }
        assert!(
            plan(false, false, None)
                .unwrap_err()
                .to_string()
                .contains("--kubeconfig")
        );
    }

    #[test]
    fn master_takes_host_port_or_a_url() {
        assert_eq!(
            parse_master("192.0.2.10:6443").unwrap().to_string(),
            "https://192.0.2.10:6443/"
        );
        assert_eq!(
            parse_master("[2001:db8::1]:6443").unwrap().host(),
            Some("[2001:db8::1]")
        );
        assert_eq!(
            parse_master("http://127.0.0.1:8080").unwrap().scheme_str(),
            Some("http")
        );
        // An unset variable in the DaemonSet's `--master $(API_SERVER)` or an empty value.
        assert!(parse_master("https://:6443").is_err());
        assert!(parse_master(":6443").is_err());
        for bad in [
            "127.0.0.1:99999",
            "https://[2001:db8::1]:70000",
            "h:0",
            "ftp://h:1",
        ] {
            let e = parse_master(bad).unwrap_err().to_string();
            assert!(e.contains("port") || e.contains("scheme"), "{bad}: {e}");
        }
        assert_eq!(parse_master("https://h").unwrap().port_u16(), None);
    }

    #[tokio::test]
    async fn service_account_credentials_go_with_the_given_server() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "secret-token\n").unwrap();
        std::fs::write(dir.path().join("namespace"), "kube-system").unwrap();
        // A CA the config must parse: a self-signed certificate's PEM.
        std::fs::write(dir.path().join("ca.crt"), TEST_CA).unwrap();
        let c = service_account_config(dir.path(), "192.0.2.10:6443")
            .await
            .unwrap();
        assert_eq!(c.cluster_url.to_string(), "https://192.0.2.10:6443/");
        assert_eq!(c.default_namespace, "kube-system");
        assert_eq!(
            c.auth_info.token_file.as_deref(),
            Some(dir.path().join("token").to_str().unwrap())
        );
        assert!(c.root_cert.as_ref().is_some_and(|r| r.len() == 1));
        let missing = tempfile::tempdir().unwrap();
        std::fs::write(missing.path().join("token"), "t").unwrap();
        let e = service_account_config(missing.path(), "192.0.2.10:6443")
            .await
            .unwrap_err();
        assert!(format!("{e:#}").contains("service account"), "{e:#}");
    }

    /// A self-signed CA certificate (any valid PEM does: only parsing is tested).
    const TEST_CA: &str = "-----BEGIN CERTIFICATE-----
MIIBezCCASGgAwIBAgIUXK/dT2f5DW1I7k6MYb1vnp1oWMgwCgYIKoZIzj0EAwIw
EjEQMA4GA1UEAwwHdGVzdC1jYTAgFw0yNjEyMDQxNjQ2MDFaGA8yMTI2MTExMDE2
NDYwMVowEjEQMA4GA1UEAwwHdGVzdC1jYTBZMBMGByqGSM49AgEGCCqGSM49AwEH
A0IABET0gO76R6b0z1T4yNOMYhfCkme2MtM9PBwPenxMkHlalFJL/16KJ8rwanQc
JSziUWR2GqvZm+vRlDutj589LPWjUzBRMB0GA1UdDgQWBBTWTKSyi/rw1/gr4x9c
LCSfAfEiCzAfBgNVHSMEGDAWgBTWTKSyi/rw1/gr4x9cLCSfAfEiCzAPBgNVHRMB
Af8EBTADAQH/MAoGCCqGSM49BAMCA0gAMEUCIQCQsdOE9ZR4A6WN5mYttsE2qorD
/KmNXEbusjP6yFvSMgIgD8II9SrRyFECzQ7fIu68uUOfSptQ/J7dhw7MWw+FGVE=
-----END CERTIFICATE-----
";
}
