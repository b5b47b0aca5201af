//! Unit tests of the HTTPS mode: pod clients with the mounted CA and token, the
//! kubeconfig, authentication, certificate names, restarts, and binding inside a
//! network namespace.

use super::*;

// ---- HTTPS mode ------------------------------------------------------------

/// A kube client built as the agent builds it in a pod: server = the `--master`
/// URL, certificate authority = the mounted `ca.crt`, token file = the mounted
/// `token` (none when `token_file` is false); `tls_server_name` overrides the
/// name the certificate is checked against.
async fn pod_client(
    url: &str,
    sa_dir: &Path,
    token_file: bool,
    tls_server_name: Option<&str>,
) -> kube::Client {
    use kube::config::{
        AuthInfo, Cluster, Context, Kubeconfig, NamedAuthInfo, NamedCluster, NamedContext,
    };
    let path = |f: &str| sa_dir.join(f).display().to_string();
    let kubeconfig = Kubeconfig {
        clusters: vec![NamedCluster {
            name: "in-cluster".into(),
            cluster: Some(Cluster {
                server: Some(url.into()),
                certificate_authority: Some(path("ca.crt")),
                tls_server_name: tls_server_name.map(Into::into),
                ..Default::default()
            }),
            ..Default::default()
        }],
        auth_infos: vec![NamedAuthInfo {
            name: "sa".into(),
            auth_info: Some(AuthInfo {
                token_file: token_file.then(|| path("token")),
                ..Default::default()
            }),
            ..Default::default()
        }],
        contexts: vec![NamedContext {
            name: "in-cluster".into(),
            context: Some(Context {
                cluster: "in-cluster".into(),
                user: Some("sa".into()),
                ..Default::default()
            }),
            ..Default::default()
        }],
        current_context: Some("in-cluster".into()),
        ..Default::default()
    };
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    kube::Client::try_from(config).unwrap()
}

async fn tls_server(opts: TlsOptions) -> (FakeApiServer, tempfile::TempDir) {
    let server = FakeApiServer::start_tls(local(), opts).await.unwrap();
    let sa = tempfile::tempdir().unwrap();
    server.write_service_account_dir(sa.path()).unwrap();
    (server, sa)
}

async fn list_services(client: kube::Client) -> kube::Result<Vec<String>> {
    let list = Api::<Service>::all(client)
        .list(&ListParams::default())
        .await?;
    Ok(list.items.iter().map(name_of).collect())
}

/// Asserts that a request failed before any HTTP exchange (the TLS handshake).
fn assert_tls_failure(res: kube::Result<Vec<String>>, want: &str) {
    let err = res.expect_err("the TLS handshake should fail");
    assert!(!matches!(err, kube::Error::Api(_)), "{err:?}");
    let text = format!("{err:?}");
    assert!(text.contains(want), "{want:?} not in {text}");
}

#[tokio::test]
async fn tls_pod_client_lists_and_watches() {
    let (server, sa) = tls_server(TlsOptions::default()).await;
    assert!(server.is_tls());
    assert!(
        server.url().starts_with("https://127.0.0.1:"),
        "{}",
        server.url()
    );
    let read = |f: &str| std::fs::read_to_string(sa.path().join(f)).unwrap();
    assert_eq!(read("token"), DEFAULT_TOKEN);
    assert_eq!(server.token(), DEFAULT_TOKEN);
    assert_eq!(read("namespace"), SERVICE_ACCOUNT_NAMESPACE);
    assert_eq!(Some(read("ca.crt").as_str()), server.ca_pem());
    assert!(read("ca.crt").starts_with("-----BEGIN CERTIFICATE-----\n"));

    server.apply_service(svc("default", "a", 80));
    let client = pod_client(&server.url(), sa.path(), true, None).await;
    assert_eq!(list_services(client.clone()).await.unwrap(), ["a"]);
    let api: Api<Service> = Api::all(client);
    let mut w = watcher(api, watcher::Config::default()).boxed();
    assert_eq!(
        until(&mut w, "InitDone").await,
        ["Init", "InitApply(a)", "InitDone"]
    );
    watching(&server, &mut w, 1).await;
    server.apply_service(svc("default", "b", 80));
    assert_eq!(next(&mut w).await, "Apply(b)");

    let log = server.request_log();
    assert!(log.iter().any(|r| r.verb == Verb::Watch), "{log:?}");
    assert!(
        log.iter()
            .all(|r| r.bearer_token.as_deref() == Some(DEFAULT_TOKEN)),
        "{log:?}"
    );
}

#[tokio::test]
async fn tls_kubeconfig_embeds_ca_and_token() {
    let opts = TlsOptions {
        token: "t0ken-from-options".into(),
        ..Default::default()
    };
    let (server, _sa) = tls_server(opts).await;
    server.apply_service(svc("default", "a", 80));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    server.write_kubeconfig(&path).unwrap();
    let yaml = std::fs::read_to_string(&path).unwrap();
    for want in [
        "server: https://127.0.0.1:",
        "certificate-authority-data: ",
        "token: t0ken-from-options",
    ] {
        assert!(yaml.contains(want), "{want:?} not in\n{yaml}");
    }
    let kc = kube::config::Kubeconfig::read_from(&path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    let from_file = kube::Client::try_from(config).unwrap();
    assert_eq!(list_services(from_file).await.unwrap(), ["a"]);
    assert_eq!(
        list_services(server.client().unwrap()).await.unwrap(),
        ["a"]
    );
    let tokens: Vec<_> = server
        .request_log()
        .into_iter()
        .map(|r| r.bearer_token)
        .collect();
    let tokens: Vec<_> = tokens.iter().map(Option::as_deref).collect();
    assert_eq!(tokens, [Some("t0ken-from-options"); 2]);
}

#[tokio::test]
async fn tls_requires_the_token() {
    let (server, sa) = tls_server(TlsOptions::default()).await;
    let unauthorized = |res: kube::Result<Vec<String>>| match res {
        Err(kube::Error::Api(s)) => {
            assert_eq!(
                (s.code, s.reason.as_str(), s.message.as_str()),
                (401, "Unauthorized", "Unauthorized")
            );
        }
        other => panic!("expected 401, got {other:?}"),
    };
    let no_token = pod_client(&server.url(), sa.path(), false, None).await;
    unauthorized(list_services(no_token.clone()).await);

    let wrong = tempfile::tempdir().unwrap();
    std::fs::copy(sa.path().join("ca.crt"), wrong.path().join("ca.crt")).unwrap();
    std::fs::write(wrong.path().join("token"), "not-the-token").unwrap();
    let wrong_token = pod_client(&server.url(), wrong.path(), true, None).await;
    unauthorized(list_services(wrong_token).await);

    // Authentication comes before routing: an unknown path is 401, not 404.
    let unknown = || {
        axum::http::Request::get("/apis/example.com/v1/widgets")
            .body(Vec::new())
            .unwrap()
    };
    let err = no_token.request_text(unknown()).await.unwrap_err();
    assert!(
        matches!(err, kube::Error::Api(ref s) if s.code == 401),
        "{err:?}"
    );
    let err = server
        .client()
        .unwrap()
        .request_text(unknown())
        .await
        .unwrap_err();
    assert!(
        matches!(err, kube::Error::Api(ref s) if s.code == 404),
        "{err:?}"
    );

    let tokens: Vec<_> = server
        .request_log()
        .into_iter()
        .map(|r| r.bearer_token)
        .collect();
    assert_eq!(tokens, [None, Some("not-the-token".to_owned())]);
    assert_eq!(server.request_count("/api/v1/services", Verb::List), 2);

    // With `require_token` off the token is only recorded.
    let (open, open_sa) = tls_server(TlsOptions {
        require_token: false,
        ..Default::default()
    })
    .await;
    let anonymous = pod_client(&open.url(), open_sa.path(), false, None).await;
    assert!(list_services(anonymous).await.unwrap().is_empty());
    assert_eq!(open.request_log()[0].bearer_token, None);
}

#[tokio::test]
async fn tls_client_without_the_ca_fails_the_handshake() {
    let (server, _sa) = tls_server(TlsOptions::default()).await;
    let (_other, other_sa) = tls_server(TlsOptions::default()).await;
    // The right token, but another server's CA.
    let client = pod_client(&server.url(), other_sa.path(), true, None).await;
    assert_tls_failure(list_services(client).await, "UnknownIssuer");
    assert!(server.request_log().is_empty());
}

#[tokio::test]
async fn tls_certificate_names() {
    let opts = TlsOptions {
        san_ips: vec!["10.96.0.1".parse().unwrap()],
        san_names: vec!["apiserver.lab.test".into()],
        ..Default::default()
    };
    let (server, sa) = tls_server(opts).await;
    let url = server.url();
    for name in [
        "10.96.0.1",
        "apiserver.lab.test",
        "localhost",
        "kubernetes.default.svc",
    ] {
        let client = pod_client(&url, sa.path(), true, Some(name)).await;
        assert!(list_services(client).await.is_ok(), "{name}");
    }
    let by_name = format!("https://localhost:{}", server.addr().port());
    let client = pod_client(&by_name, sa.path(), true, None).await;
    assert!(list_services(client).await.is_ok());
    for name in ["10.96.0.2", "other.lab.test"] {
        let client = pod_client(&url, sa.path(), true, Some(name)).await;
        assert_tls_failure(list_services(client).await, "NotValidForName");
    }

    let bad = TlsOptions {
        san_names: vec!["bäd.example".into()],
        ..Default::default()
    };
    assert!(FakeApiServer::start_tls(local(), bad).await.is_err());
    let plain = FakeApiServer::start(local()).await.unwrap();
    assert!(plain.ca_pem().is_none());
    assert_eq!(plain.token(), PLAIN_TOKEN);
    assert!(plain.write_service_account_dir(sa.path()).is_err());
}

#[tokio::test]
async fn tls_restart_keeps_the_ca() {
    let mut server = FakeApiServer::start_tls(local(), TlsOptions::default())
        .await
        .unwrap();
    let (addr, ca) = (server.addr(), server.ca_pem().unwrap().to_owned());
    let sa = tempfile::tempdir().unwrap();
    server.write_service_account_dir(sa.path()).unwrap();
    server.apply_service(svc("default", "a", 80));
    let client = pod_client(&server.url(), sa.path(), true, None).await;
    let mut w = watcher(
        Api::<Service>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .boxed();
    until(&mut w, "InitDone").await;
    watching(&server, &mut w, 1).await;

    server.stop().await;
    assert!(list_services(client.clone()).await.is_err());
    server.apply_service(svc("default", "b", 80));
    server.restart().await.unwrap();
    assert_eq!((server.addr(), server.ca_pem()), (addr, Some(ca.as_str())));
    // The client read ca.crt before the restart.
    let seen = until(&mut w, "Apply(b)").await;
    assert!(!seen.contains(&"Init".to_owned()), "relisted: {seen:?}");
    assert_eq!(list_services(client).await.unwrap(), ["a", "b"]);
}

#[tokio::test]
async fn start_tls_binds_before_it_is_awaited() {
    let addr = std::net::TcpListener::bind(local())
        .unwrap()
        .local_addr()
        .unwrap();
    let starting = FakeApiServer::start_tls(addr, TlsOptions::default());
    // Not yet polled: the kernel already completes TCP connections.
    std::net::TcpStream::connect(addr).unwrap();
    let server = starting.await.unwrap();
    assert_eq!(server.addr(), addr);
    assert!(list_services(server.client().unwrap()).await.is_ok());
}

#[tokio::test]
async fn start_tls_on_a_bound_listener() {
    let listener = std::net::TcpListener::bind(local()).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut server = FakeApiServer::start_tls_on(listener, TlsOptions::default())
        .await
        .unwrap();
    assert_eq!(server.url(), format!("https://{addr}"));
    let client = server.client().unwrap();
    assert!(list_services(client.clone()).await.is_ok());
    server.restart().await.unwrap();
    assert_eq!(server.addr(), addr);
    assert!(list_services(client).await.is_ok());
}

/// Brings `lo` up in the calling thread's network namespace.
fn loopback_up() -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None)?;
    // SAFETY: a zeroed ifreq is valid; the ioctls read and write only that struct.
    unsafe {
        let mut ifr: libc::ifreq = std::mem::zeroed();
        for (d, s) in ifr.ifr_name.iter_mut().zip(b"lo\0") {
            *d = *s as libc::c_char;
        }
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS as _, &mut ifr) < 0 {
            return Err(io::Error::last_os_error());
        }
        ifr.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS as _, &ifr) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Whether a TCP connection to `addr` succeeds from inside `ns`.
fn connects_in(ns: &File, addr: SocketAddr) -> bool {
    use std::os::fd::AsRawFd;
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: an open namespace file; only this scoped thread moves.
            assert_eq!(
                unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) },
                0
            );
            std::net::TcpStream::connect(addr).is_ok()
        })
        .join()
        .unwrap()
    })
}

/// The netns use: a listener bound inside a network namespace, the server started
/// from outside it, and a restart from outside binding inside again. Needs root
/// (skipped otherwise).
#[tokio::test]
async fn restart_binds_in_the_listeners_network_namespace() {
    let lab = std::thread::spawn(|| {
        // SAFETY: moves only this thread, which ends right after.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return None;
        }
        loopback_up().unwrap();
        let ns = File::open("/proc/thread-self/ns/net").unwrap();
        Some((ns, std::net::TcpListener::bind(local()).unwrap()))
    })
    .join()
    .unwrap();
    let Some((ns, listener)) = lab else {
        eprintln!("skipped: no permission to create a network namespace");
        return;
    };
    let mut server = FakeApiServer::start_tls_on(listener, TlsOptions::default())
        .await
        .unwrap();
    let addr = server.addr();
    assert!(connects_in(&ns, addr));
    assert!(std::net::TcpStream::connect(addr).is_err());
    server.restart().await.unwrap();
    assert!(connects_in(&ns, addr));
    assert!(std::net::TcpStream::connect(addr).is_err());
}
