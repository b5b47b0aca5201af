//! Listening: binding (also inside the first listener's network namespace, for
//! restarts), the HTTPS mode's CA and serving certificate, and the listener that hands
//! connections to axum once their TLS handshake is done.

use std::fs::File;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::rustls;

use super::{HANDSHAKE_TIMEOUT, TlsOptions};

/// What the HTTPS mode keeps across restarts.
pub(super) struct Tls {
    pub(super) ca_pem: String,
    pub(super) ca_der: Vec<u8>,
    pub(super) acceptor: tokio_rustls::TlsAcceptor,
    pub(super) token: String,
}

impl Tls {
    /// Makes a CA and a serving certificate it signs for the IP of `bound` (plus, when
    /// that is unspecified, the loopback address of its family), the names every
    /// kube-apiserver certificate has, and `opts`' extras.
    pub(super) fn new(bound: SocketAddr, opts: &TlsOptions) -> anyhow::Result<Self> {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
            KeyPair, KeyUsagePurpose, SanType,
        };
        let mut ca = CertificateParams::default();
        // Named after the server, so a client given another server's CA fails with
        // "unknown issuer" rather than a confusing bad signature.
        ca.distinguished_name
            .push(DnType::CommonName, format!("fakeapi-ca@{bound}"));
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_key = KeyPair::generate()?;
        let ca_cert = ca.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca, ca_key);

        let names = [
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ]
        .into_iter()
        .map(str::to_owned)
        .chain(opts.san_names.iter().cloned())
        .collect::<Vec<_>>();
        let mut leaf = CertificateParams::new(names).context("fakeapi: certificate SAN names")?;
        let mut ips = vec![bound.ip()];
        if bound.ip().is_unspecified() {
            ips.push(match bound.ip() {
                IpAddr::V4(_) => Ipv4Addr::LOCALHOST.into(),
                IpAddr::V6(_) => Ipv6Addr::LOCALHOST.into(),
            });
        }
        ips.extend(&opts.san_ips);
        ips.sort();
        ips.dedup();
        leaf.subject_alt_names
            .extend(ips.into_iter().map(SanType::IpAddress));
        leaf.distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        leaf.use_authority_key_identifier_extension = true;
        let leaf_key = KeyPair::generate()?;
        let leaf_cert = leaf.signed_by(&leaf_key, &issuer)?;

        let key = rustls::pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into());
        // The provider is named rather than taken from the process default, which
        // nothing installs in tests.
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(vec![leaf_cert.der().clone()], key)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            ca_pem: ca_cert.pem(),
            ca_der: ca_cert.der().to_vec(),
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
            token: opts.token.clone(),
        })
    }
}

/// Binds a listening TCP socket on `addr` in the calling thread's network namespace.
pub(super) fn bind(addr: SocketAddr) -> anyhow::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    // Restarting on the same port must not trip over TIME_WAIT connections.
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket
        .bind(&addr.into())
        .with_context(|| format!("fakeapi: binding {addr}"))?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// The network namespace `listener` lives in: asked of the socket (`SIOCGSKNS`,
/// which needs `CAP_NET_ADMIN` there), else the calling thread's; `None` if neither
/// can be opened.
pub(super) fn netns_of(listener: &std::net::TcpListener) -> Option<File> {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: the ioctl only reads the socket's namespace; on success it returns a
    // new descriptor that nothing else owns.
    let fd = unsafe { libc::ioctl(listener.as_raw_fd(), libc::SIOCGSKNS as _) };
    if fd >= 0 {
        // SAFETY: `fd` is a fresh descriptor owned by nothing else.
        return Some(unsafe { File::from_raw_fd(fd) });
    }
    File::open("/proc/thread-self/ns/net").ok()
}

/// Binds `addr` in the network namespace `ns`: directly when the calling thread is in
/// it, else from a short-lived thread that enters it first (`setns` changes only the
/// calling thread, so nothing else moves).
pub(super) fn bind_in(ns: &File, addr: SocketAddr) -> anyhow::Result<std::net::TcpListener> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let id = |m: std::fs::Metadata| (m.dev(), m.ino());
    let here = std::fs::metadata("/proc/thread-self/ns/net").map(id).ok();
    if here == Some(id(ns.metadata()?)) {
        return bind(addr);
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: `ns` is an open namespace file; only this thread changes namespace.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(anyhow::Error::from(io::Error::last_os_error())
                    .context("fakeapi: entering the listener's network namespace"));
            }
            bind(addr)
        })
        .join()
        .unwrap_or_else(|_| Err(anyhow::anyhow!("fakeapi: the binding thread panicked")))
    })
}

/// Runs axum on `listener` until `shutdown` turns `true`.
pub(super) fn spawn_server<L>(
    listener: L,
    router: Router,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<()>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    tokio::spawn(async move {
        let res = axum::serve(listener, router)
            .with_graceful_shutdown(async move {
                let _ = shutdown.wait_for(|stop| *stop).await;
            })
            .await;
        if let Err(e) = res {
            tracing::warn!(error = %e, "fakeapi: server error");
        }
    })
}

/// A TCP listener whose connections are handed to axum once their TLS handshake
/// is done. Handshakes run in their own tasks, so a slow or failing client does not
/// hold up the others; dropping the listener (at stop) aborts those in progress.
pub(super) struct TlsListener {
    pub(super) tcp: tokio::net::TcpListener,
    pub(super) acceptor: tokio_rustls::TlsAcceptor,
    /// Each ends with the connection, or `None` if the handshake failed.
    pub(super) handshakes: JoinSet<Option<(TlsStream, SocketAddr)>>,
}

type TlsStream = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            tokio::select! {
                conn = self.tcp.accept() => match conn {
                    Ok((tcp, peer)) => {
                        let acceptor = self.acceptor.clone();
                        self.handshakes.spawn(async move {
                            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                                Ok(Ok(tls)) => Some((tls, peer)),
                                Ok(Err(e)) => {
                                    tracing::debug!(%peer, error = %e, "fakeapi: TLS handshake failed");
                                    None
                                }
                                Err(_) => {
                                    tracing::debug!(%peer, "fakeapi: TLS handshake timed out");
                                    None
                                }
                            }
                        });
                    }
                    Err(e) => {
                        // As axum does for plain TCP: a per-connection error needs
                        // nothing; others (EMFILE) get a pause before accepting again.
                        if !matches!(
                            e.kind(),
                            io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
                        ) {
                            tracing::warn!(error = %e, "fakeapi: accept failed");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                },
                Some(done) = self.handshakes.join_next(), if !self.handshakes.is_empty() => {
                    if let Ok(Some(conn)) = done {
                        return conn;
                    }
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}
