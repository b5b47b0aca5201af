//! The server and the client the bench runs as its own children inside the lab: a
//! server that answers with its name, and a client that measures connections to it.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};

use super::report;

pub(super) fn serve(listen: SocketAddr, name: &str) -> Result<()> {
    let l = TcpListener::bind(listen).with_context(|| format!("bind {listen}"))?;
    let reply = format!("{name}\n").into_bytes();
    let l2 = l.try_clone()?;
    let r2 = reply.clone();
    std::thread::spawn(move || serve_loop(l2, &r2));
    serve_loop(l, &reply)
}

/// Accepts forever; per connection: one request line (small: one read), the reply, then
/// wait (at most 2 s) for the client's close.
fn serve_loop(l: TcpListener, reply: &[u8]) -> ! {
    loop {
        let Ok((mut s, _)) = l.accept() else { continue };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let _ = s.set_nodelay(true);
        let mut buf = [0u8; 256];
        if matches!(s.read(&mut buf), Ok(n) if n > 0) && s.write_all(reply).is_ok() {
            let _ = s.read(&mut buf);
        }
    }
}

#[derive(serde::Serialize, serde::Deserialize, Debug, Default, Clone)]
pub(super) struct ClientResult {
    pub(super) ok: usize,
    pub(super) errors: usize,
    pub(super) first_error: Option<String>,
    elapsed_s: f64,
    pub(super) cps: f64,
    pub(super) p50_us: f64,
    pub(super) p99_us: f64,
    pub(super) names: BTreeMap<String, usize>,
}

fn one_conn(to: SocketAddr) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(1))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(1)))?;
    s.write_all(b"hello\n")?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line)?;
    if line.is_empty() {
        return Err(std::io::Error::other("closed without a reply"));
    }
    Ok(line.trim().to_string())
}

pub(super) fn client(to: &[SocketAddr], count: usize, secs: f64, warmup: usize) -> Result<()> {
    ensure!(!to.is_empty(), "--to");
    for i in 0..warmup {
        let _ = one_conn(to[i % to.len()]);
    }
    let mut lat = Vec::with_capacity(count);
    let mut res = ClientResult::default();
    let limit = Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut i = 0;
    while i < count && start.elapsed() < limit {
        let t = Instant::now();
        match one_conn(to[i % to.len()]) {
            Ok(name) => {
                lat.push(t.elapsed().as_secs_f64() * 1e6);
                res.ok += 1;
                *res.names.entry(name).or_default() += 1;
            }
            Err(e) => {
                res.errors += 1;
                res.first_error.get_or_insert_with(|| e.to_string());
            }
        }
        i += 1;
    }
    res.elapsed_s = start.elapsed().as_secs_f64();
    res.cps = res.ok as f64 / res.elapsed_s;
    lat.sort_by(f64::total_cmp);
    res.p50_us = report::percentile(&lat, 50.0);
    res.p99_us = report::percentile(&lat, 99.0);
    println!("{}", serde_json::to_string(&res)?);
    Ok(())
}
