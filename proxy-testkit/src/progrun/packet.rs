//! Packets for the packet programs: built byte by byte ([`Packet`]), decoded, checked
//! (checksums, [`verify`]) and compared ([`diff`], [`step`]).

use std::net::{IpAddr, SocketAddr};

use super::Harness;

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const ICMP: u8 = 1;
pub const ICMPV6: u8 = 58;
pub const SYN: u8 = 0x02;
pub const ACK: u8 = 0x10;
pub const FIN: u8 = 0x01;
pub const RST: u8 = 0x04;
/// MACs of the frames built here (the programs only rewrite them when they redirect).
pub const SRC_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
pub const DST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];

/// A TCP or UDP packet (or an ICMP/ICMPv6 message with `payload` as its body) to build.
#[derive(Clone, Debug)]
pub struct Packet {
    pub src: SocketAddr,
    pub dst: SocketAddr,
    pub proto: u8,
    pub tcp_flags: u8,
    pub payload: Vec<u8>,
    /// IPv4 options (a multiple of 4 bytes).
    pub ip_options: Vec<u8>,
    /// IPv4 flags and fragment offset (host order, as in the header); 0 = none.
    pub frag: u16,
    /// IPv4 TTL / IPv6 hop limit.
    pub ttl: u8,
    /// UDP over IPv4: send a zero checksum ("none").
    pub udp_no_csum: bool,
    /// IPv6 extension headers before the L4 header: (type, body after the first two bytes).
    pub ext: Vec<(u8, Vec<u8>)>,
    /// ICMP type and code (for `proto` ICMP/ICMPv6); the body follows after 4 more bytes
    /// (`icmp_rest`).
    pub icmp: (u8, u8),
    pub icmp_rest: [u8; 4],
    /// TCP options (a multiple of 4 bytes).
    pub tcp_options: Vec<u8>,
}

impl Packet {
    pub fn new(proto: u8, src: &str, dst: &str) -> Packet {
        Packet {
            src: src.parse().expect("src"),
            dst: dst.parse().expect("dst"),
            proto,
            tcp_flags: if proto == TCP { SYN } else { 0 },
            payload: b"hello".to_vec(),
            ip_options: Vec::new(),
            frag: 0,
            ttl: 64,
            udp_no_csum: false,
            ext: Vec::new(),
            icmp: (0, 0),
            icmp_rest: [0; 4],
            tcp_options: Vec::new(),
        }
    }

    pub fn tcp(src: &str, dst: &str, flags: u8) -> Packet {
        Packet {
            tcp_flags: flags,
            ..Packet::new(TCP, src, dst)
        }
    }

    pub fn udp(src: &str, dst: &str) -> Packet {
        Packet::new(UDP, src, dst)
    }

    /// An ICMP (or ICMPv6, by the family of the addresses) error `ty`/`code` from `src` to
    /// `dst` quoting `quoted` (an IP packet, cut to `quote_len` bytes).
    pub fn icmp_error(
        src: &str,
        dst: &str,
        ty: u8,
        code: u8,
        quoted: &[u8],
        quote_len: usize,
    ) -> Packet {
        let v6 = src.parse::<IpAddr>().expect("src").is_ipv6();
        let q = &quoted[..quote_len.min(quoted.len())];
        let mut p = Packet::new(if v6 { ICMPV6 } else { ICMP }, &sock(src, 0), &sock(dst, 0));
        p.icmp = (ty, code);
        p.payload = q.to_vec();
        p
    }

    pub fn v6(&self) -> bool {
        self.src.is_ipv6()
    }

    /// The L4 header and payload, with its checksum.
    fn l4(&self) -> Vec<u8> {
        let mut l4 = Vec::new();
        match self.proto {
            TCP => {
                l4.extend_from_slice(&self.src.port().to_be_bytes());
                l4.extend_from_slice(&self.dst.port().to_be_bytes());
                l4.extend_from_slice(&1000u32.to_be_bytes()); // seq
                l4.extend_from_slice(
                    &(if self.tcp_flags & ACK != 0 {
                        2000u32
                    } else {
                        0
                    })
                    .to_be_bytes(),
                );
                assert_eq!(self.tcp_options.len() % 4, 0, "TCP options length");
                l4.push((5 + self.tcp_options.len() as u8 / 4) << 4);
                l4.push(self.tcp_flags);
                l4.extend_from_slice(&64240u16.to_be_bytes());
                l4.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent
                l4.extend_from_slice(&self.tcp_options);
                l4.extend_from_slice(&self.payload);
            }
            UDP => {
                l4.extend_from_slice(&self.src.port().to_be_bytes());
                l4.extend_from_slice(&self.dst.port().to_be_bytes());
                l4.extend_from_slice(&((8 + self.payload.len()) as u16).to_be_bytes());
                l4.extend_from_slice(&[0, 0]);
                l4.extend_from_slice(&self.payload);
            }
            _ => {
                l4.push(self.icmp.0);
                l4.push(self.icmp.1);
                l4.extend_from_slice(&[0, 0]);
                l4.extend_from_slice(&self.icmp_rest);
                l4.extend_from_slice(&self.payload);
            }
        }
        let off = csum_offset(self.proto);
        if !(self.proto == UDP && self.udp_no_csum && !self.v6()) {
            let mut c = l4_checksum(self.src.ip(), self.dst.ip(), self.proto, &l4);
            if c == 0 && self.proto == UDP {
                c = 0xffff; // zero means "no checksum" in UDP (RFC 768)
            }
            l4[off..off + 2].copy_from_slice(&c.to_be_bytes());
        }
        l4
    }

    /// The IP packet (no Ethernet header).
    pub fn ip(&self) -> Vec<u8> {
        let l4 = self.l4();
        match (self.src.ip(), self.dst.ip()) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let hlen = 20 + self.ip_options.len();
                let mut h = vec![0u8; hlen];
                h[0] = 0x40 | (hlen / 4) as u8;
                h[2..4].copy_from_slice(&((hlen + l4.len()) as u16).to_be_bytes());
                h[4..6].copy_from_slice(&0x1234u16.to_be_bytes());
                h[6..8].copy_from_slice(&self.frag.to_be_bytes());
                h[8] = self.ttl;
                h[9] = self.proto;
                h[12..16].copy_from_slice(&s.octets());
                h[16..20].copy_from_slice(&d.octets());
                h[20..].copy_from_slice(&self.ip_options);
                let c = checksum(&h);
                h[10..12].copy_from_slice(&c.to_be_bytes());
                h.extend_from_slice(&l4);
                h
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let mut ext = Vec::new();
                let mut types: Vec<u8> = self.ext.iter().map(|(t, _)| *t).collect();
                types.push(self.proto);
                for (i, (_, body)) in self.ext.iter().enumerate() {
                    let len = 2 + body.len();
                    assert_eq!(len % 8, 0, "extension header length");
                    ext.push(types[i + 1]);
                    ext.push(if self.ext[i].0 == 44 {
                        0
                    } else {
                        (len / 8 - 1) as u8
                    });
                    ext.extend_from_slice(body);
                }
                let mut h = vec![0u8; 40];
                h[0] = 0x60;
                h[4..6].copy_from_slice(&((ext.len() + l4.len()) as u16).to_be_bytes());
                h[6] = types[0];
                h[7] = self.ttl;
                h[8..24].copy_from_slice(&s.octets());
                h[24..40].copy_from_slice(&d.octets());
                h.extend_from_slice(&ext);
                h.extend_from_slice(&l4);
                h
            }
            _ => panic!("mixed families"),
        }
    }

    /// The Ethernet frame.
    pub fn frame(&self) -> Vec<u8> {
        ether(&self.ip(), self.v6())
    }
}

/// Whether `BPF_PROG_TEST_RUN` runs a tc program on `frame`: the kernel refuses (EINVAL)
/// frames with nothing after the Ethernet header and IPv4 or IPv6 frames shorter than the
/// fixed IP header, so such frames cannot be tested this way.
pub fn runnable(frame: &[u8]) -> bool {
    let min = match frame.get(12..14) {
        Some([0x08, 0x00]) => 14 + 20,
        Some([0x86, 0xdd]) => 14 + 40,
        _ => 15,
    };
    frame.len() >= min
}

/// An Ethernet frame around IP packet `ip`.
pub fn ether(ip: &[u8], v6: bool) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + ip.len());
    f.extend_from_slice(&DST_MAC);
    f.extend_from_slice(&SRC_MAC);
    f.extend_from_slice(if v6 { &[0x86, 0xdd] } else { &[0x08, 0x00] });
    f.extend_from_slice(ip);
    f
}

/// `ip:port` (brackets for IPv6).
pub fn sock(ip: &str, port: u16) -> String {
    let ip: IpAddr = ip.parse().expect("ip");
    SocketAddr::new(ip, port).to_string()
}

fn csum_offset(proto: u8) -> usize {
    match proto {
        TCP => 16,
        UDP => 6,
        _ => 2,
    }
}

/// The Internet checksum (RFC 1071) of `data`.
pub fn checksum(data: &[u8]) -> u16 {
    !fold(sum(data, 0))
}

fn sum(data: &[u8], mut acc: u64) -> u64 {
    for c in data.chunks(2) {
        acc += u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u64;
    }
    acc
}

fn fold(mut s: u64) -> u16 {
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

/// The checksum of L4 segment `l4` (checksum field zeroed or not: it is computed over the
/// bytes as given, so a correct segment sums to 0 when the field is included) with the
/// pseudo-header of `src`, `dst` and `proto` (ICMPv4 has none).
pub fn l4_checksum(src: IpAddr, dst: IpAddr, proto: u8, l4: &[u8]) -> u16 {
    let mut acc = 0u64;
    if proto != ICMP {
        match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                acc = sum(&s.octets(), acc);
                acc = sum(&d.octets(), acc);
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                acc = sum(&s.octets(), acc);
                acc = sum(&d.octets(), acc);
            }
            _ => panic!("mixed families"),
        }
        acc += proto as u64 + l4.len() as u64;
    }
    !fold(sum(l4, acc))
}

/// What a frame holds, as far as checksums go.
#[derive(Debug, PartialEq, Eq)]
pub struct Decoded {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub proto: u8,
    /// Offset of the L4 header in the frame.
    pub l4: usize,
    /// A fragment other than the first (no L4 header to check).
    pub later_fragment: bool,
}

/// Decodes an Ethernet + IPv4/IPv6 frame far enough to check its checksums; `None` for
/// anything else or anything malformed.
pub fn decode(f: &[u8]) -> Option<Decoded> {
    let et = u16::from_be_bytes([*f.get(12)?, *f.get(13)?]);
    let ip = f.get(14..)?;
    match et {
        0x0800 => {
            let ihl = ((*ip.first()? & 0x0f) as usize) * 4;
            if ip[0] >> 4 != 4 || ihl < 20 || ip.len() < ihl {
                return None;
            }
            let total = u16::from_be_bytes([ip[2], ip[3]]) as usize;
            if total < ihl || total > ip.len() {
                return None;
            }
            let frag = u16::from_be_bytes([ip[6], ip[7]]);
            Some(Decoded {
                src: IpAddr::from(<[u8; 4]>::try_from(&ip[12..16]).ok()?),
                dst: IpAddr::from(<[u8; 4]>::try_from(&ip[16..20]).ok()?),
                proto: ip[9],
                l4: 14 + ihl,
                later_fragment: frag & 0x1fff != 0 || frag & 0x2000 != 0,
            })
        }
        0x86dd => {
            if ip.len() < 40 || ip[0] >> 4 != 6 {
                return None;
            }
            let payload = u16::from_be_bytes([ip[4], ip[5]]) as usize;
            if 40 + payload > ip.len() {
                return None;
            }
            let mut next = ip[6];
            let mut off = 40;
            let mut frag = false;
            loop {
                match next {
                    0 | 43 | 60 => {
                        next = *ip.get(off)?;
                        off += (*ip.get(off + 1)? as usize + 1) * 8;
                    }
                    44 => {
                        let fo = u16::from_be_bytes([*ip.get(off + 2)?, *ip.get(off + 3)?]);
                        frag = fo & 0xfff9 != 0;
                        next = *ip.get(off)?;
                        off += 8;
                    }
                    _ => break,
                }
            }
            Some(Decoded {
                src: IpAddr::from(<[u8; 16]>::try_from(&ip[8..24]).ok()?),
                dst: IpAddr::from(<[u8; 16]>::try_from(&ip[24..40]).ok()?),
                proto: next,
                l4: 14 + off,
                later_fragment: frag,
            })
        }
        _ => None,
    }
}

/// Checks the IPv4 header checksum and the TCP, UDP, ICMP or ICMPv6 checksum of a frame
/// (over the whole IP payload; fragments and IPv4 UDP without a checksum are skipped).
/// `Err` says which one is wrong.
pub fn verify(f: &[u8]) -> Result<(), String> {
    let d = decode(f).ok_or("not a decodable IP frame")?;
    let end = if d.src.is_ipv4() {
        let ihl = ((f[14] & 0x0f) as usize) * 4;
        if checksum(&f[14..14 + ihl]) != 0 {
            return Err("IPv4 header checksum".into());
        }
        14 + u16::from_be_bytes([f[16], f[17]]) as usize
    } else {
        14 + 40 + u16::from_be_bytes([f[18], f[19]]) as usize
    };
    if d.later_fragment || !matches!(d.proto, TCP | UDP | ICMP | ICMPV6) {
        return Ok(());
    }
    let l4 = f.get(d.l4..end).ok_or("L4 beyond the IP length")?;
    if d.proto == UDP && d.src.is_ipv4() && l4.get(6..8) == Some(&[0, 0]) {
        return Ok(());
    }
    if l4_checksum(d.src, d.dst, d.proto, l4) != 0 {
        return Err(format!("L4 checksum (protocol {})", d.proto));
    }
    Ok(())
}

/// IP packet `translated` with the L4 checksum of `as_sent` (both TCP or UDP packets of
/// the same shape): what an ICMP error's quote looks like after translation, since the
/// programs leave the quoted L4 checksum as it was.
pub fn requote(translated: &Packet, as_sent: &[u8]) -> Vec<u8> {
    let mut ip = translated.ip();
    let l4 = if translated.v6() {
        40
    } else {
        ((ip[0] & 0x0f) as usize) * 4
    };
    let off = l4 + csum_offset(translated.proto);
    ip[off..off + 2].copy_from_slice(&as_sent[off..off + 2]);
    ip
}

/// A short printable view of a frame for assertion messages.
pub fn show(f: &[u8]) -> String {
    match decode(f) {
        Some(d) => {
            let ports = match d.proto {
                TCP | UDP if f.len() >= d.l4 + 4 && !d.later_fragment => format!(
                    " {}->{}",
                    u16::from_be_bytes([f[d.l4], f[d.l4 + 1]]),
                    u16::from_be_bytes([f[d.l4 + 2], f[d.l4 + 3]])
                ),
                _ => String::new(),
            };
            format!(
                "{} -> {} proto {}{ports} ({} bytes)",
                d.src,
                d.dst,
                d.proto,
                f.len()
            )
        }
        None => format!("undecodable ({} bytes)", f.len()),
    }
}

/// The first differing byte of two frames, for assertion messages.
pub fn diff(a: &[u8], b: &[u8]) -> String {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(i) => format!(
            "first difference at byte {i}: got {:#04x}, want {:#04x}",
            a[i], b[i]
        ),
        None => format!("lengths {} and {}", a.len(), b.len()),
    }
}

// ---------------------------------------------------------------------------------------
// fixtures
// ---------------------------------------------------------------------------------------

/// One fixture: runs `prog` on `input` and checks the verdict, the output frame
/// (`want`, or the input unchanged when `None`), valid checksums of a translated frame,
/// and that counter `counter` grew by one.
pub fn step(
    h: &Harness,
    what: &str,
    prog: &str,
    input: &[u8],
    verdict: i32,
    want: Option<&[u8]>,
    counter: Option<&str>,
) -> Vec<u8> {
    let before = h.counters();
    let (v, out) = h.run(prog, input);
    assert_eq!(v, verdict, "{what}: verdict (output {})", show(&out));
    let want = want.unwrap_or(input);
    assert!(
        out == want,
        "{what}: output {} differs from the expected {}: {}",
        show(&out),
        show(want),
        diff(&out, want)
    );
    if out != input {
        verify(&out).unwrap_or_else(|e| panic!("{what}: {e} wrong in {}", show(&out)));
    }
    if let Some(c) = counter {
        let after = h.counters();
        assert_eq!(
            after[c],
            before[c] + 1,
            "{what}: counter {c} (before {before:?}, after {after:?})"
        );
    }
    out
}

/// What the tc ingress program answers to `p` (a TCP or UDP packet from a client) when it
/// rejects it, built here from scratch: an ICMP (3/3) or ICMPv6 (1/4) port unreachable from
/// the address `p` was sent to, back to its sender, quoting `p`'s IP header (options and
/// all) and the first bytes of its L4 header (UDP 8, TCP its 20-byte header), Ethernet
/// addresses swapped, TTL 64, IPv4 identification 0.
pub fn port_unreachable(p: &Packet) -> Vec<u8> {
    let ip = p.ip();
    let hl = if p.v6() {
        40
    } else {
        ((ip[0] & 0x0f) as usize) * 4
    };
    let (ty, code) = if p.v6() { (1, 4) } else { (3, 3) };
    let e = Packet::icmp_error(
        &p.dst.ip().to_string(),
        &p.src.ip().to_string(),
        ty,
        code,
        &ip,
        hl + if p.proto == TCP { 20 } else { 8 },
    );
    let mut f = e.frame();
    f[..6].copy_from_slice(&SRC_MAC);
    f[6..12].copy_from_slice(&DST_MAC);
    if !p.v6() {
        f[18..20].copy_from_slice(&[0, 0]);
        f[24..26].copy_from_slice(&[0, 0]);
        let c = checksum(&f[14..34]);
        f[24..26].copy_from_slice(&c.to_be_bytes());
    }
    f
}

/// IP packet `inner` inside the outer header ebpf-proxy's DSR writes: IPv4 (TOS copied, DF,
/// TTL 64, protocol 4) or IPv6 (first word copied, hop limit 64, next header 41) from
/// `src` to `dst`.
pub fn encapsulated(inner: &[u8], src: &str, dst: &str) -> Vec<u8> {
    let (s, d): (std::net::IpAddr, std::net::IpAddr) = (src.parse().unwrap(), dst.parse().unwrap());
    let mut h = match (s, d) {
        (std::net::IpAddr::V4(s), std::net::IpAddr::V4(d)) => {
            let mut h = vec![0u8; 20];
            h[0] = 0x45;
            h[1] = inner[1];
            h[2..4].copy_from_slice(&((20 + inner.len()) as u16).to_be_bytes());
            h[6] = 0x40;
            h[8] = 64;
            h[9] = 4;
            h[12..16].copy_from_slice(&s.octets());
            h[16..20].copy_from_slice(&d.octets());
            let c = checksum(&h);
            h[10..12].copy_from_slice(&c.to_be_bytes());
            h
        }
        (std::net::IpAddr::V6(s), std::net::IpAddr::V6(d)) => {
            let mut h = vec![0u8; 40];
            h[..4].copy_from_slice(&inner[..4]);
            h[4..6].copy_from_slice(&(inner.len() as u16).to_be_bytes());
            h[6] = 41;
            h[7] = 64;
            h[8..24].copy_from_slice(&s.octets());
            h[24..40].copy_from_slice(&d.octets());
            h
        }
        _ => panic!("mixed families"),
    };
    h.extend_from_slice(inner);
    h
}
