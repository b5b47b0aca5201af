//! `netprobe sidecar`: a transparent proxy that an iptables `REDIRECT` sends connections
//! to, as a service mesh sidecar would.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::json;

use super::client::print_json;

/// The original destination of a connection an iptables `REDIRECT` (IPv4) sent here.
fn original_dst(s: &TcpStream) -> io::Result<SocketAddr> {
    use std::os::fd::AsRawFd;
    /// `SO_ORIGINAL_DST` (`linux/netfilter_ipv4.h`).
    const SO_ORIGINAL_DST: libc::c_int = 80;
    // SAFETY: a zeroed sockaddr_in is valid.
    let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: getsockopt(2) into a sockaddr_in we own, with its size.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_IP,
            SO_ORIGINAL_DST,
            (&mut sa as *mut libc::sockaddr_in).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    let ip = Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr));
    Ok(SocketAddr::from((ip, u16::from_be(sa.sin_port))))
}

/// See `Cmd::Sidecar`.
pub(super) fn sidecar(listen: SocketAddr, mark: u32, count: u32) -> Result<()> {
    let l = std::net::TcpListener::bind(listen).with_context(|| format!("bind {listen}"))?;
    let mut relays = Vec::new();
    for _ in 0..count {
        let (inbound, _) = l.accept()?;
        let dst = original_dst(&inbound).context("SO_ORIGINAL_DST")?;
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
        sock.set_mark(mark)?;
        let onward = sock
            .connect_timeout(&dst.into(), Duration::from_secs(2))
            .map(|()| TcpStream::from(sock));
        let peer = onward
            .as_ref()
            .ok()
            .and_then(|o| o.peer_addr().ok())
            .map(|a| a.to_string());
        print_json(
            &json!({ "ok": onward.is_ok(), "original_dst": dst.to_string(), "onward_peer": peer }),
        );
        let Ok(onward) = onward else { continue };
        let (mut a_r, mut a_w) = (inbound.try_clone()?, inbound);
        let (mut b_r, mut b_w) = (onward.try_clone()?, onward);
        relays.push(std::thread::spawn(move || {
            let _ = io::copy(&mut a_r, &mut b_w);
            let _ = b_w.shutdown(std::net::Shutdown::Write);
        }));
        relays.push(std::thread::spawn(move || {
            let _ = io::copy(&mut b_r, &mut a_w);
            let _ = a_w.shutdown(std::net::Shutdown::Write);
        }));
    }
    for r in relays {
        let _ = r.join();
    }
    Ok(())
}
