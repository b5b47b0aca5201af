//! `netprobe serve`: servers that answer with their name over HTTP, TCP and UDP.

use std::io::{self, BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream, ToSocketAddrs};

use anyhow::{Context, Result, anyhow, bail};

/// `:PORT` means every address: `[::]:PORT` (dual-stack), or `0.0.0.0:PORT` where IPv6 is off.
fn listen_addrs(spec: &str) -> Result<Vec<SocketAddr>> {
    if let Some(port) = spec.strip_prefix(':') {
        let port: u16 = port
            .parse()
            .with_context(|| format!("bad port in {spec:?}"))?;
        return Ok(vec![
            SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port)),
            SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)),
        ]);
    }
    Ok(spec
        .to_socket_addrs()
        .with_context(|| format!("bad address {spec:?}"))?
        .collect())
}

async fn bind_tcp(spec: &str) -> Result<tokio::net::TcpListener> {
    let mut last = None;
    for a in listen_addrs(spec)? {
        match tokio::net::TcpListener::bind(a).await {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(anyhow!("binding TCP {spec}: {:?}", last))
}

async fn bind_udp(spec: &str) -> Result<tokio::net::UdpSocket> {
    let mut last = None;
    for a in listen_addrs(spec)? {
        match tokio::net::UdpSocket::bind(a).await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(anyhow!("binding UDP {spec}: {:?}", last))
}

pub(super) fn serve(
    name: String,
    http: Vec<String>,
    tcp: Vec<String>,
    udp: Vec<String>,
) -> Result<bool> {
    if http.is_empty() && tcp.is_empty() && udp.is_empty() {
        bail!("give at least one of --http, --tcp, --udp");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let mut tasks = tokio::task::JoinSet::new();
        for spec in &http {
            let listener = bind_tcp(spec).await?;
            let body = format!("{name}\n");
            let app = axum::Router::new().fallback(move || {
                let body = body.clone();
                async move { body }
            });
            tasks.spawn(async move {
                axum::serve(listener, app)
                    .await
                    .map_err(anyhow::Error::from)
            });
        }
        for spec in &tcp {
            // Plain threads: one per listener and one per open connection.
            let listener = bind_tcp_std(spec)?;
            let name = name.clone();
            tasks.spawn_blocking(move || -> Result<()> {
                loop {
                    let (sock, _) = listener.accept()?;
                    let name = name.clone();
                    std::thread::spawn(move || tcp_conn(sock, &name));
                }
            });
        }
        for spec in &udp {
            let sock = bind_udp(spec).await?;
            let name = name.clone();
            tasks.spawn(async move {
                let mut buf = vec![0u8; 65536];
                loop {
                    let (n, from) = sock.recv_from(&mut buf).await?;
                    // `whoami` gets `NAME PEER`: the client address this server sees.
                    let reply = if &buf[..n] == b"whoami" {
                        format!("{name} {from}")
                    } else {
                        name.clone()
                    };
                    // A failed reply (e.g. the client is gone) is not fatal for the server.
                    let _ = sock.send_to(reply.as_bytes(), from).await;
                }
            });
        }
        eprintln!("netprobe serve: {name} ready");
        match tasks.join_next().await {
            Some(Ok(Err(e))) => Err(e),
            Some(Err(e)) => Err(e.into()),
            _ => Ok(true),
        }
    })
}

fn bind_tcp_std(spec: &str) -> Result<std::net::TcpListener> {
    let mut last = None;
    for a in listen_addrs(spec)? {
        match std::net::TcpListener::bind(a) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(anyhow!("binding TCP {spec}: {:?}", last))
}

/// Sends `NAME\n`, then answers each line `L` with `NAME L\n` until the client closes; the
/// line `whoami` is answered with `NAME PEER\n`, the client address this server sees (so a
/// test can check whether a proxy kept the client's source address).
fn tcp_conn(sock: TcpStream, name: &str) -> io::Result<()> {
    let mut w = sock.try_clone()?;
    let peer = sock.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    w.write_all(format!("{name}\n").as_bytes())?;
    for line in BufReader::new(sock).lines() {
        let line = line?;
        if line == "whoami" {
            w.write_all(format!("{name} {peer}\n").as_bytes())?;
            continue;
        }
        w.write_all(format!("{name} {line}\n").as_bytes())?;
    }
    Ok(())
}
