//! The tc packet fixtures as files (after Katran's: objects, input packet, expected verdict,
//! expected output packet): a harness of `tcfix` seeded from the scenario's objects by the
//! agent's own model and reconciler, each step a packet run through a program with
//! `BPF_PROG_TEST_RUN`. The syntax is described in `tests/scenarios/README.md`.

use std::net::SocketAddr;

use super::{Script, Step};
use crate::tcfix::{
    ACK, DROP, DST_MAC, FIN, Harness, ICMP, ICMPV6, PASS, Packet, REDIRECT, RST, SRC_MAC, SYN, TCP,
    TcOptions, UDP, XDP, XDP_DROP, XDP_PASS, XDP_REDIRECT, XDP_TX, decode, ether, in_private_netns,
    port_unreachable, step,
};

/// The programs a step may run, by the name the files use.
const PROGRAMS: &[&str] = &[
    "tc_ingress",
    "tc_egress",
    "pod_ingress",
    "pod_egress",
    "xdp",
];

/// Runs a packet scenario in a private network namespace of its own (see
/// `tcfix::in_private_netns`).
pub fn run(script: &Script) {
    // The harness and the steps run on the namespace's thread; the script is shared by a
    // copy of what they need.
    let (path, name, steps, files) = (
        script.path.clone(),
        script.name.clone(),
        script.steps.clone(),
        script.files.clone(),
    );
    in_private_netns(move || {
        let script = Script {
            path,
            name,
            steps,
            files,
        };
        let mut h: Option<Harness> = None;
        for st in &script.steps {
            script.at(st, || {
                if st.words[0] == "harness" {
                    assert!(h.is_none(), "a second `harness`");
                    h = Some(harness(&script, st));
                } else {
                    let h = h.as_ref().expect("the first step must be `harness`");
                    exec(h, st);
                }
            });
        }
    });
}

/// `harness FILE node=NAME [masquerade-all] [cluster-cidr=CIDR]`: the object loaded with
/// its maps pinned, seeded from FILE as node NAME's agent would.
fn harness(script: &Script, st: &Step) -> Harness {
    st.only(&[]);
    let file = st.word(1, "the objects' file");
    let mut node = None;
    let mut tc = TcOptions::default();
    for w in &st.words[2..] {
        match w.split_once('=') {
            Some(("node", n)) => node = Some(n.to_string()),
            Some(("cluster-cidr", c)) => tc.cluster_cidrs.push(c.parse().expect("a CIDR")),
            None if w == "masquerade-all" => tc.masquerade_all = true,
            _ => panic!("unknown harness option {w:?} (node=, masquerade-all, cluster-cidr=)"),
        }
    }
    let h = Harness::new(&format!("sc-{}", script.name));
    h.seed(&script.file(file), &node.expect("node=NAME"), &tc);
    h
}

fn exec(h: &Harness, st: &Step) {
    let w = &st.words;
    match w[0].as_str() {
        p if PROGRAMS.contains(&p) => run_packet(h, st),
        "conntrack" => {
            st.only(&[]);
            assert_eq!(
                w.get(1).map(String::as_str),
                Some("empty"),
                "usage: conntrack empty"
            );
            assert!(h.conntrack().is_empty(), "flows: {:?}", h.conntrack());
        }
        "counters" => {
            let c = h.counters();
            for (k, v) in &st.expect {
                let got = *c
                    .get(k.as_str())
                    .unwrap_or_else(|| panic!("no counter {k}: {c:?}"));
                assert_eq!(got, v.parse::<u64>().expect("counter=N"), "{k}: {c:?}");
            }
        }
        "snat-port" => {
            // snat-port CLIENT BACKEND tcp|udp => port=N | none | range=LO-HI not=N
            st.only(&["port", "none", "range", "not"]);
            let client: SocketAddr = st.word(1, "the client").parse().expect("ip:port");
            let backend: SocketAddr = st.word(2, "the backend").parse().expect("ip:port");
            let proto = match st.word(3, "tcp or udp") {
                "tcp" => TCP,
                "udp" => UDP,
                p => panic!("protocol {p:?}: tcp or udp"),
            };
            let got = h.snat_port(client, backend, proto);
            if st.get("none").is_some() {
                assert_eq!(got, None, "the flow must not be source-NATed");
            }
            if let Some(p) = st.get("port") {
                assert_eq!(got, Some(p.parse().unwrap()), "SNAT port");
            }
            if let Some(r) = st.get("range") {
                let got = got.expect("the SNAT stage of the flow");
                let (lo, hi) = r.split_once('-').expect("range=LO-HI");
                let (lo, hi): (u16, u16) = (lo.parse().unwrap(), hi.parse().unwrap());
                assert!((lo..=hi).contains(&got), "SNAT port {got}");
                for n in st.all("not") {
                    assert_ne!(got, n.parse::<u16>().unwrap(), "SNAT port");
                }
            }
        }
        other => panic!("unknown command {other:?}"),
    }
}

/// `PROGRAM PACKET => VERDICT OUTPUT [count=COUNTER] [at=OFFSET:HEX]`.
fn run_packet(h: &Harness, st: &Step) {
    let prog = match st.words[0].as_str() {
        "xdp" => XDP,
        p => p,
    };
    let (input, packet) = frame(&st.words[1..]);
    let after = &st.after;
    let verdict = match after.first().map(String::as_str) {
        Some("pass") => PASS,
        Some("drop") => DROP,
        Some("redirect") => REDIRECT,
        Some("xdp-pass") => XDP_PASS,
        Some("xdp-drop") => XDP_DROP,
        Some("xdp-tx") => XDP_TX,
        Some("xdp-redirect") => XDP_REDIRECT,
        v => {
            panic!("verdict {v:?}: pass, drop, redirect, xdp-pass, xdp-drop, xdp-tx, xdp-redirect")
        }
    };
    let rest = &after[1..];
    let end = rest
        .iter()
        .position(|w| w.starts_with("count=") || w.starts_with("at="))
        .unwrap_or(rest.len());
    let (out_words, checks) = rest.split_at(end);
    let mut unreachable = false;
    let want: Option<Vec<u8>> = match out_words.first().map(String::as_str) {
        Some("same") => {
            assert_eq!(out_words.len(), 1, "`same` stands alone");
            None
        }
        Some("unreachable") => {
            assert_eq!(out_words.len(), 1, "`unreachable` stands alone");
            unreachable = true;
            let p = packet.expect("`unreachable` answers a tcp or udp packet");
            Some(port_unreachable(&p))
        }
        Some(_) => Some(frame(out_words).0),
        None => panic!("the output: same, unreachable or a packet"),
    };
    let mut counter = None;
    let mut at = Vec::new();
    for c in checks {
        match c.split_once('=') {
            Some(("count", n)) => counter = Some(n.to_string()),
            Some(("at", spec)) => at.push(bytes_at(spec)),
            _ => panic!("{c:?}: count=COUNTER or at=OFFSET:HEX"),
        }
    }
    let out = step(
        h,
        &st.text,
        prog,
        &input,
        verdict,
        want.as_deref(),
        counter.as_deref(),
    );
    if unreachable {
        let d = decode(&out).expect("decodable");
        let v6 = input.get(12..14) == Some(&[0x86, 0xdd][..]);
        assert_eq!(d.proto, if v6 { ICMPV6 } else { ICMP }, "an ICMP error");
    }
    for (off, bytes) in at {
        assert_eq!(
            out.get(off..off + bytes.len()),
            Some(&bytes[..]),
            "output bytes at {off}"
        );
    }
}

/// `OFFSET:HEX`.
fn bytes_at(spec: &str) -> (usize, Vec<u8>) {
    let (off, hex_bytes) = spec.split_once(':').expect("OFFSET:HEX");
    (off.parse().expect("an offset"), hex(hex_bytes))
}

/// Bytes from hex digits (`_` may separate them).
fn hex(s: &str) -> Vec<u8> {
    let s: String = s.chars().filter(|c| *c != '_').collect();
    assert!(
        s.len().is_multiple_of(2),
        "{s:?}: an even number of hex digits"
    );
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap_or_else(|_| panic!("hex {s:?}")))
        .collect()
}

/// A number, decimal or `0x` hex.
fn number<T: TryFrom<u64>>(s: &str) -> T {
    let n = match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    }
    .unwrap_or_else(|_| panic!("{s:?}: a number"));
    T::try_from(n).unwrap_or_else(|_| panic!("{s:?}: out of range"))
}

/// The frame of a packet description (and the packet, for `tcp` and `udp` ones):
/// - `tcp SRC > DST FLAGS [MODS]`, FLAGS from `S A F R P` (`-` for none);
/// - `udp SRC > DST [MODS]`;
/// - `frame HEX`: the Ethernet frame as given;
/// - `arp`: an ARP frame (28 zero bytes after the Ethernet header).
///
/// MODS: `ipopts=HEX` (IPv4 options), `frag=N` (IPv4 flags and fragment offset), `ttl=N`,
/// `nocsum` (UDP over IPv4 with a zero checksum), `ext=TYPE:HEX,...` (IPv6 extension
/// headers, each the body after its first two bytes), `tcpopts=HEX`, `payload=TEXT`; then on
/// the built frame `set=OFFSET:HEX` (bytes overwritten) and `cut=LEN` (frame truncated).
fn frame(words: &[String]) -> (Vec<u8>, Option<Packet>) {
    let kind = words.first().map(String::as_str);
    if kind == Some("frame") {
        assert_eq!(words.len(), 2, "frame HEX");
        return (hex(&words[1]), None);
    }
    if kind == Some("arp") {
        assert_eq!(words.len(), 1, "arp stands alone");
        let mut f = ether(&[0u8; 28], false);
        f[12..14].copy_from_slice(&[0x08, 0x06]);
        return (f, None);
    }
    let proto = match kind {
        Some("tcp") => TCP,
        Some("udp") => UDP,
        k => panic!("packet {k:?}: tcp, udp, frame or arp"),
    };
    assert!(
        words.len() >= 4 && words[2] == ">",
        "{proto_name} SRC > DST ...",
        proto_name = words[0]
    );
    let mut p = Packet::new(proto, &words[1], &words[3]);
    let mut mods = &words[4..];
    if proto == TCP {
        let flags = mods
            .first()
            .expect("the TCP flags (S, SA, A, FA, R, RA, PA, -)");
        p.tcp_flags = tcp_flags(flags);
        mods = &mods[1..];
    }
    let mut edits: Vec<(usize, Vec<u8>)> = Vec::new();
    let mut cut = None;
    for m in mods {
        let (k, v) = m.split_once('=').unwrap_or((m.as_str(), ""));
        match k {
            "ipopts" => p.ip_options = hex(v),
            "frag" => p.frag = number(v),
            "ttl" => p.ttl = number(v),
            "nocsum" => p.udp_no_csum = true,
            "ext" => {
                p.ext = v
                    .split(',')
                    .map(|e| {
                        let (t, body) = e.split_once(':').expect("ext=TYPE:HEX");
                        (number(t), hex(body))
                    })
                    .collect()
            }
            "tcpopts" => p.tcp_options = hex(v),
            "payload" => p.payload = v.as_bytes().to_vec(),
            "set" => edits.push(bytes_at(v)),
            "cut" => cut = Some(number::<usize>(v)),
            _ => panic!("unknown packet modifier {m:?}"),
        }
    }
    let mut f = p.frame();
    for (off, b) in edits {
        f[off..off + b.len()].copy_from_slice(&b);
    }
    if let Some(n) = cut {
        f.truncate(n);
    }
    (f, Some(p))
}

/// TCP flags from letters: `S` SYN, `A` ACK, `F` FIN, `R` RST, `P` PSH; `-` none.
fn tcp_flags(s: &str) -> u8 {
    const PSH: u8 = 0x08;
    if s == "-" {
        return 0;
    }
    s.chars()
        .map(|c| match c {
            'S' => SYN,
            'A' => ACK,
            'F' => FIN,
            'R' => RST,
            'P' => PSH,
            _ => panic!("TCP flags {s:?}: letters of S A F R P, or -"),
        })
        .fold(0, |a, b| a | b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packet_descriptions() {
        let w = |s: &str| super::super::split_words(s).unwrap();
        let (f, p) = frame(&w("tcp 198.51.100.7:40000 > 192.0.2.50:30080 S"));
        let want = Packet::tcp("198.51.100.7:40000", "192.0.2.50:30080", SYN);
        assert_eq!(f, want.frame());
        assert_eq!(p.unwrap().tcp_flags, SYN);
        let (f, _) = frame(&w(
            "udp 198.51.100.7:1 > 192.0.2.50:2 nocsum set=14:46 cut=30",
        ));
        let mut d = Packet::udp("198.51.100.7:1", "192.0.2.50:2");
        d.udp_no_csum = true;
        let mut want = d.frame();
        want[14] = 0x46;
        want.truncate(30);
        assert_eq!(f, want);
        assert_eq!(tcp_flags("FA"), FIN | ACK);
        assert_eq!(tcp_flags("-"), 0);
        let (arp, _) = frame(&w("arp"));
        assert_eq!(&arp[..12], &[DST_MAC, SRC_MAC].concat()[..]);
    }
}
