//! Services, and the rule sets kube-proxy programs for them, for the bench (`cargo xtask
//! bench`, kube-proxy's rules side by side with ebpf-proxy) and the tests that run
//! kube-proxy's rules before and after ebpf-proxy (the switch from one to the other).
//!
//! - [`iptables_full`] / [`iptables_change`] produce the `iptables-restore` input of
//!   kube-proxy's iptables mode, following kubernetes `pkg/proxy/iptables/proxier.go`
//!   (`syncProxyRules`, `servicePortChainName`, `servicePortEndpointChainName`,
//!   `portProtoHash`): KUBE-SERVICES jumps to one `KUBE-SVC-<hash>` chain per service port,
//!   which picks a `KUBE-SEP-<hash>` chain with `-m statistic --mode random --probability
//!   1/(n-i)`; each KUBE-SEP chain marks hairpin traffic with KUBE-MARK-MASQ and DNATs. The
//!   hashes are the upstream ones: the first 16 characters of base32(sha256(name)).
//!   Partial syncs (kube-proxy >= 1.28) rewrite the top-level chains (KUBE-SERVICES with one
//!   rule per service, so O(N) text) and only the changed service's SVC/SEP chains, and
//!   delete stale SEP chains with `-X`, all in one `iptables-restore --noflush`. A node port
//!   ([`Svc::node_port`]) adds a KUBE-NODEPORTS rule to the service's `KUBE-EXT-<hash>` chain,
//!   which marks the flow for masquerading and goes on to `KUBE-SVC-<hash>`
//!   (`externalTrafficPolicy: Cluster`).
//! - [`nft_full`] / [`nft_change`] produce the `nft -f` input of kube-proxy's nftables mode,
//!   following kubernetes `pkg/proxy/nftables/proxier.go` (`setupNFTables`,
//!   `syncProxyRules`, `writeServiceToEndpointRules`, `servicePortChainNameBase`,
//!   `servicePortEndpointChainNameBase`, `hashAndTruncate`): table `ip kube-proxy`, the
//!   `service-ips` verdict map `ip daddr . meta l4proto . th dport vmap @service-ips`, one
//!   `service-<hash>-ns/name/tcp/port` chain per service port ending in `numgen random mod
//!   N vmap { 0 : goto endpoint-..., ... }`, and one `endpoint-<hash>-...` chain per
//!   endpoint with the masquerade mark and `dnat to`. A change rewrites (flush + add) the
//!   service chain, adds the new endpoint chain and deletes the stale one in one transaction.
//!   A node port adds an element of the `service-nodeports` map (`meta l4proto . th dport`,
//!   for destinations of a local address) leading to the `external-<hash>-...` chain, which
//!   jumps to `mark-for-masquerade` and goes on to the service chain.
//!
//! Services have one port, TCP or UDP ([`Svc::proto`]); [`services`] makes TCP ClusterIP
//! services with 10 endpoints each, as the benchmark uses them. LoadBalancer IPs, external IPs, affinity and the Local
//! traffic policy are left out (for all proxies alike in the bench).

use std::fmt::Write as _;
use std::net::Ipv4Addr;

use sha2::{Digest, Sha256};

/// Namespace of every benchmark service.
pub const NS: &str = "bench";
/// Port name of every benchmark service.
pub const PORT_NAME: &str = "http";
/// Service (ClusterIP) port.
pub const SVC_PORT: u16 = 80;
/// Port the real backend pods listen on.
pub const REAL_PORT: u16 = 8080;
/// Endpoints per service.
pub const ENDPOINTS: usize = 10;
/// The cluster CIDR given to the masquerade rules (the lab's pods are inside it).
pub const CLUSTER_CIDR: &str = "198.18.0.0/15";
/// Addresses of the synthetic endpoints cycle through this many addresses
/// (198.18.1.0 ..= 198.19.127.247), the port moves on by one after each cycle.
const SYNTH_ADDRS: u32 = 98_040;

/// The protocol of a service's port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    /// As kube-proxy writes it into chain-name hashes and rules: `tcp`, `udp`.
    pub fn lower(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }

    /// As the Kubernetes API spells it: `TCP`, `UDP`.
    pub fn upper(self) -> &'static str {
        match self {
            Proto::Tcp => "TCP",
            Proto::Udp => "UDP",
        }
    }
}

/// One service (namespace [`NS`], one port [`SVC_PORT`] named [`PORT_NAME`]) with its
/// endpoints.
#[derive(Clone, Debug)]
pub struct Svc {
    /// `metadata.name`.
    pub name: String,
    /// The ClusterIP.
    pub vip: Ipv4Addr,
    /// Endpoint addresses and ports, in the order the rules list them.
    pub endpoints: Vec<(Ipv4Addr, u16)>,
    /// `spec.ports[0].nodePort` of a NodePort Service with `externalTrafficPolicy:
    /// Cluster`; `None` for a ClusterIP Service.
    pub node_port: Option<u16>,
    /// The port's protocol.
    pub proto: Proto,
}

/// ClusterIP of service `i`: 198.19.128.0/17 (RFC 2544 range; exists only in the lab).
pub fn vip(i: usize) -> Ipv4Addr {
    assert!(i < 32_768, "at most 32768 services");
    Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 128, 0)) + i as u32)
}

/// Address of real backend pod `j` (the lab pods `b0..b9`).
pub fn real_backend(j: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 0, 10 + j as u8)
}

/// The `n` services; service `real` has the lab's real backend pods as endpoints, every
/// other one has synthetic endpoints (distinct address:port pairs that never get traffic).
pub fn services(n: usize, real: usize) -> Vec<Svc> {
    (0..n)
        .map(|i| {
            let endpoints = (0..ENDPOINTS)
                .map(|j| {
                    if i == real {
                        (real_backend(j), REAL_PORT)
                    } else {
                        let e = (i * ENDPOINTS + j) as u32;
                        let off = 256 + e % SYNTH_ADDRS;
                        let port = REAL_PORT + (e / SYNTH_ADDRS) as u16;
                        (
                            Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 0)) + off),
                            port,
                        )
                    }
                })
                .collect();
            Svc {
                name: format!("svc-{i:05}"),
                vip: vip(i),
                endpoints,
                node_port: None,
                proto: Proto::Tcp,
            }
        })
        .collect()
}

/// An address no generated endpoint uses, for endpoint changes (`k` picks one of two).
pub fn change_addr(k: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 19, 127, 250 + (k % 2) as u8)
}

// ---------------------------------------------------------------------------------------
// manifests for ebpf-proxy
// ---------------------------------------------------------------------------------------

/// The Service object (JSON, one line): type ClusterIP, or NodePort with the node port; the
/// target port is the first endpoint's.
pub fn service_json(s: &Svc) -> String {
    let (ty, np) = match s.node_port {
        Some(np) => ("NodePort", format!(r#","nodePort":{np}"#)),
        None => ("ClusterIP", String::new()),
    };
    format!(
        r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"{n}","namespace":"{NS}"}},"spec":{{"type":"{ty}","clusterIP":"{v}","clusterIPs":["{v}"],"ports":[{{"name":"{PORT_NAME}","port":{SVC_PORT},"targetPort":{tp},"protocol":"{p}"{np}}}]}}}}"#,
        n = s.name,
        v = s.vip,
        tp = s.endpoints.first().map_or(REAL_PORT, |e| e.1),
        p = s.proto.upper()
    )
}

/// The EndpointSlice object of a service (JSON, one line). All endpoints of a generated
/// service share one port.
pub fn slice_json(s: &Svc) -> String {
    slice_json_on(s, None)
}

/// [`slice_json`] with every endpoint's `nodeName` set to `node` (which tells a proxy on
/// that node that the endpoints are local).
pub fn slice_json_on(s: &Svc, node: Option<&str>) -> String {
    let port = s.endpoints[0].1;
    let node = node
        .map(|n| format!(r#","nodeName":"{n}""#))
        .unwrap_or_default();
    let mut eps = String::new();
    for (k, (ip, _)) in s.endpoints.iter().enumerate() {
        if k > 0 {
            eps.push(',');
        }
        let _ = write!(
            eps,
            r#"{{"addresses":["{ip}"],"conditions":{{"ready":true}}{node}}}"#
        );
    }
    format!(
        r#"{{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","metadata":{{"name":"{n}-x1","namespace":"{NS}","labels":{{"kubernetes.io/service-name":"{n}"}}}},"addressType":"IPv4","ports":[{{"name":"{PORT_NAME}","port":{port},"protocol":"{p}"}}],"endpoints":[{eps}]}}"#,
        n = s.name,
        p = s.proto.upper()
    )
}

// ---------------------------------------------------------------------------------------
// iptables mode
// ---------------------------------------------------------------------------------------

fn b32_sha256(s: &str) -> String {
    const ALPHA: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let h = Sha256::digest(s.as_bytes());
    let mut out = String::with_capacity(52);
    let (mut buf, mut bits) = (0u32, 0u32);
    for &b in h.iter() {
        buf = (buf << 8) | b as u32;
        bits += 8;
        while bits >= 5 {
            out.push(ALPHA[((buf >> (bits - 5)) & 31) as usize] as char);
            bits -= 5;
        }
    }
    if bits > 0 {
        out.push(ALPHA[((buf << (5 - bits)) & 31) as usize] as char);
    }
    out
}

/// `ns/name:port` as kube-proxy's ServicePortName.String().
fn svc_port_name(s: &Svc) -> String {
    format!("{NS}/{}:{PORT_NAME}", s.name)
}

/// KUBE-SVC-<portProtoHash(servicePortName, protocol)>.
pub fn ipt_svc_chain(s: &Svc) -> String {
    let h = b32_sha256(&format!("{}{}", svc_port_name(s), s.proto.lower()));
    format!("KUBE-SVC-{}", &h[..16])
}

/// KUBE-EXT-<portProtoHash(servicePortName, protocol)>: the node port's chain.
pub fn ipt_ext_chain(s: &Svc) -> String {
    let h = b32_sha256(&format!("{}{}", svc_port_name(s), s.proto.lower()));
    format!("KUBE-EXT-{}", &h[..16])
}

/// KUBE-SEP-<hash(servicePortName + protocol + endpoint)>.
pub fn ipt_sep_chain(s: &Svc, ep: (Ipv4Addr, u16)) -> String {
    let h = b32_sha256(&format!(
        "{}{}{}:{}",
        svc_port_name(s),
        s.proto.lower(),
        ep.0,
        ep.1
    ));
    format!("KUBE-SEP-{}", &h[..16])
}

const FILTER_CHAINS: [&str; 6] = [
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-FIREWALL",
    "KUBE-FORWARD",
    "KUBE-NODEPORTS",
    "KUBE-PROXY-FIREWALL",
    "KUBE-SERVICES",
];
const NAT_CHAINS: [&str; 4] = [
    "KUBE-MARK-MASQ",
    "KUBE-NODEPORTS",
    "KUBE-POSTROUTING",
    "KUBE-SERVICES",
];

/// The jumps from the filter table's built-in chains to kube-proxy's (chain and rule, as
/// after `-A`).
const FILTER_HOOKS: [&str; 8] = [
    "INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL",
    "INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS",
    "INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES",
    "INPUT -j KUBE-FIREWALL",
    "FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD",
    "FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
    "OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
    "OUTPUT -j KUBE-FIREWALL",
];
/// The jumps from the nat table's built-in chains to kube-proxy's.
const NAT_HOOKS: [&str; 3] = [
    "PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
    "OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
    "POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING",
];

/// The filter table and the top-level nat chains, written on every sync.
fn ipt_top(out: &mut String, with_hooks: bool) {
    out.push_str("*filter\n");
    for c in FILTER_CHAINS {
        let _ = writeln!(out, ":{c} - [0:0]");
    }
    if with_hooks {
        // kube-proxy installs these jumps with `iptables -I` (EnsureRule) before the restore.
        for h in FILTER_HOOKS {
            let _ = writeln!(out, "-A {h}");
        }
    }
    out.push_str("-A KUBE-FIREWALL -m comment --comment \"block incoming localnet connections\" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP\n");
    out.push_str("-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n");
    out.push_str("-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark 0x4000/0x4000 -j ACCEPT\n");
    out.push_str("-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n");
    out.push_str("COMMIT\n*nat\n");
    for c in NAT_CHAINS {
        let _ = writeln!(out, ":{c} - [0:0]");
    }
}

fn ipt_nat_top_rules(out: &mut String, svcs: &[Svc], with_hooks: bool) {
    if with_hooks {
        for h in NAT_HOOKS {
            let _ = writeln!(out, "-A {h}");
        }
    }
    out.push_str("-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n");
    out.push_str("-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000\n");
    out.push_str("-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully\n");
    out.push_str("-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000\n");
    for s in svcs {
        let _ = writeln!(
            out,
            "-A KUBE-SERVICES -m comment --comment \"{} cluster IP\" -m {p} -p {p} -d {}/32 --dport {SVC_PORT} -j {}",
            svc_port_name(s),
            s.vip,
            ipt_svc_chain(s),
            p = s.proto.lower()
        );
    }
    out.push_str("-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n");
    for s in svcs {
        if let Some(np) = s.node_port {
            let _ = writeln!(
                out,
                "-A KUBE-NODEPORTS -m comment --comment {} -m {p} -p {p} --dport {np} -j {}",
                svc_port_name(s),
                ipt_ext_chain(s),
                p = s.proto.lower()
            );
        }
    }
}

/// Declarations of a service's own chains (SVC, EXT if it has a node port, and one SEP per
/// endpoint).
fn ipt_declare(out: &mut String, s: &Svc) {
    let _ = writeln!(out, ":{} - [0:0]", ipt_svc_chain(s));
    if s.node_port.is_some() {
        let _ = writeln!(out, ":{} - [0:0]", ipt_ext_chain(s));
    }
    for ep in &s.endpoints {
        let _ = writeln!(out, ":{} - [0:0]", ipt_sep_chain(s, *ep));
    }
}

fn ipt_svc_rules(out: &mut String, s: &Svc) {
    let svc = ipt_svc_chain(s);
    let name = svc_port_name(s);
    if s.node_port.is_some() {
        let ext = ipt_ext_chain(s);
        let _ = writeln!(
            out,
            "-A {ext} -m comment --comment \"masquerade traffic for {name} external destinations\" -j KUBE-MARK-MASQ"
        );
        let _ = writeln!(out, "-A {ext} -j {svc}");
    }
    let _ = writeln!(
        out,
        "-A {svc} -m comment --comment \"{name} cluster IP\" -m {p} -p {p} -d {}/32 --dport {SVC_PORT} ! -s {CLUSTER_CIDR} -j KUBE-MARK-MASQ",
        s.vip,
        p = s.proto.lower()
    );
    let n = s.endpoints.len();
    for (i, ep) in s.endpoints.iter().enumerate() {
        let sep = ipt_sep_chain(s, *ep);
        if i + 1 < n {
            let _ = writeln!(
                out,
                "-A {svc} -m comment --comment \"{name} -> {}:{}\" -m statistic --mode random --probability {:.10} -j {sep}",
                ep.0,
                ep.1,
                1.0 / (n - i) as f64
            );
        } else {
            let _ = writeln!(
                out,
                "-A {svc} -m comment --comment \"{name} -> {}:{}\" -j {sep}",
                ep.0, ep.1
            );
        }
    }
}

fn ipt_sep_rules(out: &mut String, s: &Svc, ep: (Ipv4Addr, u16)) {
    let sep = ipt_sep_chain(s, ep);
    let name = svc_port_name(s);
    let _ = writeln!(
        out,
        "-A {sep} -m comment --comment {name} -s {}/32 -j KUBE-MARK-MASQ",
        ep.0
    );
    let _ = writeln!(
        out,
        "-A {sep} -m comment --comment {name} -m {p} -p {p} -j DNAT --to-destination {}:{}",
        ep.0,
        ep.1,
        p = s.proto.lower()
    );
}

/// Full sync from cold (for `iptables-restore --noflush` into empty tables), including the
/// jumps from the built-in chains.
pub fn iptables_full(svcs: &[Svc]) -> String {
    let mut out = String::with_capacity(svcs.len() * 4200 + 4096);
    // kube-proxy's canary (`ipt.Monitor` creates it in mangle, nat and filter at start and
    // recreates the rules when it vanishes): what the rollback's wait looks for.
    out.push_str("*mangle\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n");
    ipt_top(&mut out, true);
    for s in svcs {
        ipt_declare(&mut out, s);
    }
    ipt_nat_top_rules(&mut out, svcs, true);
    for s in svcs {
        ipt_svc_rules(&mut out, s);
        for ep in &s.endpoints {
            ipt_sep_rules(&mut out, s, *ep);
        }
    }
    out.push_str("COMMIT\n");
    out
}

/// Partial sync after `old` became `new` (same service, one endpoint replaced): the
/// top-level chains in full, the service's SVC chain, its new SEP chains, and `-X` of the
/// stale SEP chains (for `iptables-restore --noflush`).
pub fn iptables_change(svcs: &[Svc], old: &Svc, new: &Svc) -> String {
    let mut out = String::with_capacity(svcs.len() * 200 + 4096);
    ipt_top(&mut out, false);
    ipt_declare(&mut out, new);
    // Stale chains are declared (flushed) too, then deleted below.
    for ep in &old.endpoints {
        if !new.endpoints.contains(ep) {
            let _ = writeln!(out, ":{} - [0:0]", ipt_sep_chain(old, *ep));
        }
    }
    ipt_nat_top_rules(&mut out, svcs, false);
    ipt_svc_rules(&mut out, new);
    for ep in &new.endpoints {
        ipt_sep_rules(&mut out, new, *ep);
    }
    for ep in &old.endpoints {
        if !new.endpoints.contains(ep) {
            let _ = writeln!(out, "-X {}", ipt_sep_chain(old, *ep));
        }
    }
    out.push_str("COMMIT\n");
    out
}

/// Input of `iptables-restore` (without --noflush) that empties both tables.
pub const IPTABLES_EMPTY: &str = "*filter\nCOMMIT\n*nat\nCOMMIT\n";

// ---------------------------------------------------------------------------------------
// nftables mode
// ---------------------------------------------------------------------------------------

/// hashAndTruncate: 8 base32 characters of sha256(name), "-", name (max 112 characters).
fn nft_hash_trunc(name: &str) -> String {
    let mut s = format!("{}-{name}", &b32_sha256(name)[..8]);
    if s.len() > 112 {
        s.truncate(109);
        s.push_str("...");
    }
    s
}

/// `ns/name/protocol/port`: kube-proxy's servicePortChainNameBase without the prefix.
fn nft_base(s: &Svc) -> String {
    format!("{NS}/{}/{}/{PORT_NAME}", s.name, s.proto.lower())
}

/// `service-<hash>-ns/name/protocol/port`.
pub fn nft_svc_chain(s: &Svc) -> String {
    format!("service-{}", nft_hash_trunc(&nft_base(s)))
}

/// `external-<hash>-ns/name/protocol/port`: the node port's chain (same hash as the service
/// chain).
pub fn nft_ext_chain(s: &Svc) -> String {
    format!("external-{}", nft_hash_trunc(&nft_base(s)))
}

/// `endpoint-<hash>-ns/name/protocol/port__ip/port`.
pub fn nft_ep_chain(s: &Svc, ep: (Ipv4Addr, u16)) -> String {
    format!(
        "endpoint-{}",
        nft_hash_trunc(&format!("{}__{}/{}", nft_base(s), ep.0, ep.1))
    )
}

const T: &str = "ip kube-proxy";

/// setupNFTables: the table, base chains, maps and the dispatch rules.
fn nft_setup(out: &mut String) {
    let _ = writeln!(
        out,
        "add table {T} {{ comment \"rules for kube-proxy\" ; }}"
    );
    for (name, hook) in [
        (
            "filter-prerouting",
            "type filter hook prerouting priority -110",
        ),
        ("filter-input", "type filter hook input priority -110"),
        ("filter-forward", "type filter hook forward priority -110"),
        ("filter-output", "type filter hook output priority -110"),
        (
            "filter-output-post-dnat",
            "type filter hook output priority -90",
        ),
        ("nat-prerouting", "type nat hook prerouting priority -100"),
        ("nat-output", "type nat hook output priority -100"),
        ("nat-postrouting", "type nat hook postrouting priority 100"),
    ] {
        let _ = writeln!(out, "add chain {T} {name} {{ {hook} ; }}");
        let _ = writeln!(out, "flush chain {T} {name}");
    }
    for name in [
        "mark-for-masquerade",
        "masquerading",
        "services",
        "service-endpoints-check",
        "nodeport-endpoints-check",
        "firewall-check",
        "reject-chain",
        "cluster-ips-check",
    ] {
        let _ = writeln!(out, "add chain {T} {name}");
        let _ = writeln!(out, "flush chain {T} {name}");
    }
    let _ = writeln!(
        out,
        "add rule {T} mark-for-masquerade mark set mark or 0x4000"
    );
    let _ = writeln!(out, "add rule {T} masquerading mark and 0x4000 == 0 return");
    let _ = writeln!(out, "add rule {T} masquerading mark set mark xor 0x4000");
    let _ = writeln!(out, "add rule {T} masquerading masquerade fully-random");
    let _ = writeln!(out, "add rule {T} reject-chain reject");
    let _ = writeln!(
        out,
        "add map {T} service-ips {{ type ipv4_addr . inet_proto . inet_service : verdict ; comment \"ClusterIP, ExternalIP and LoadBalancer IP traffic\" ; }}"
    );
    let _ = writeln!(
        out,
        "add map {T} service-nodeports {{ type inet_proto . inet_service : verdict ; comment \"NodePort traffic\" ; }}"
    );
    let _ = writeln!(
        out,
        "add map {T} no-endpoint-services {{ type ipv4_addr . inet_proto . inet_service : verdict ; comment \"vmap to drop or reject packets to services with no endpoints\" ; }}"
    );
    let _ = writeln!(
        out,
        "add set {T} cluster-ips {{ type ipv4_addr ; comment \"Active ClusterIPs\" ; }}"
    );
    let _ = writeln!(
        out,
        "add rule {T} filter-prerouting ct state new jump firewall-check"
    );
    let _ = writeln!(
        out,
        "add rule {T} filter-output ct state new jump service-endpoints-check"
    );
    let _ = writeln!(
        out,
        "add rule {T} filter-output-post-dnat ct state new jump cluster-ips-check"
    );
    let _ = writeln!(
        out,
        "add rule {T} service-endpoints-check ip daddr . meta l4proto . th dport vmap @no-endpoint-services"
    );
    let _ = writeln!(
        out,
        "add rule {T} cluster-ips-check ip daddr @cluster-ips reject comment \"Reject traffic to invalid ports of ClusterIPs\""
    );
    let _ = writeln!(out, "add rule {T} nat-prerouting jump services");
    let _ = writeln!(out, "add rule {T} nat-output jump services");
    let _ = writeln!(out, "add rule {T} nat-postrouting jump masquerading");
    let _ = writeln!(
        out,
        "add rule {T} services ip daddr . meta l4proto . th dport vmap @service-ips"
    );
    let _ = writeln!(
        out,
        "add rule {T} services fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports"
    );
}

fn nft_service(out: &mut String, s: &Svc) {
    let svc = nft_svc_chain(s);
    let _ = writeln!(out, "add chain {T} {svc}");
    let _ = writeln!(out, "flush chain {T} {svc}");
    let _ = writeln!(
        out,
        "add rule {T} {svc} ip daddr {} {} dport {SVC_PORT} ip saddr != {CLUSTER_CIDR} jump mark-for-masquerade",
        s.vip,
        s.proto.lower()
    );
    let mut vmap = String::new();
    for (i, ep) in s.endpoints.iter().enumerate() {
        if i > 0 {
            vmap.push_str(" , ");
        }
        let _ = write!(vmap, "{i} : goto {}", nft_ep_chain(s, *ep));
    }
    let _ = writeln!(
        out,
        "add rule {T} {svc} numgen random mod {} vmap {{ {vmap} }}",
        s.endpoints.len()
    );
    if s.node_port.is_some() {
        let ext = nft_ext_chain(s);
        let _ = writeln!(out, "add chain {T} {ext}");
        let _ = writeln!(out, "flush chain {T} {ext}");
        let _ = writeln!(out, "add rule {T} {ext} jump mark-for-masquerade");
        let _ = writeln!(out, "add rule {T} {ext} goto {svc}");
    }
}

fn nft_endpoint(out: &mut String, s: &Svc, ep: (Ipv4Addr, u16)) {
    let c = nft_ep_chain(s, ep);
    let _ = writeln!(out, "add chain {T} {c}");
    let _ = writeln!(out, "flush chain {T} {c}");
    let _ = writeln!(
        out,
        "add rule {T} {c} ip saddr {} jump mark-for-masquerade",
        ep.0
    );
    let _ = writeln!(
        out,
        "add rule {T} {c} meta l4proto {} dnat to {}:{}",
        s.proto.lower(),
        ep.0,
        ep.1
    );
}

/// Full sync from cold (for `nft -f`).
pub fn nft_full(svcs: &[Svc]) -> String {
    let mut out = String::with_capacity(svcs.len() * 3600 + 8192);
    nft_setup(&mut out);
    for s in svcs {
        for ep in &s.endpoints {
            nft_endpoint(&mut out, s, *ep);
        }
        nft_service(&mut out, s);
        let _ = writeln!(out, "add element {T} cluster-ips {{ {} }}", s.vip);
        let _ = writeln!(
            out,
            "add element {T} service-ips {{ {} . {} . {SVC_PORT} : goto {} }}",
            s.vip,
            s.proto.lower(),
            nft_svc_chain(s)
        );
        if let Some(np) = s.node_port {
            let _ = writeln!(
                out,
                "add element {T} service-nodeports {{ {} . {np} : goto {} }}",
                s.proto.lower(),
                nft_ext_chain(s)
            );
        }
    }
    out
}

/// Incremental sync after `old` became `new`: new endpoint chains, the rewritten service
/// chain, the stale endpoint chains deleted.
pub fn nft_change(old: &Svc, new: &Svc) -> String {
    let mut out = String::new();
    for ep in &new.endpoints {
        if !old.endpoints.contains(ep) {
            nft_endpoint(&mut out, new, *ep);
        }
    }
    nft_service(&mut out, new);
    for ep in &old.endpoints {
        if !new.endpoints.contains(ep) {
            let c = nft_ep_chain(old, *ep);
            let _ = writeln!(out, "delete chain {T} {c}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chain names as kube-proxy's own tests spell them (`TestOverallNFTablesRules` and
    /// `TestOverallIPTablesRules`, service `ns3/svc3`, port `p80`).
    #[test]
    fn chain_names_match_kube_proxy() {
        assert_eq!(
            nft_hash_trunc("ns3/svc3/tcp/p80"),
            "4AT6LBPK-ns3/svc3/tcp/p80"
        );
        assert_eq!(&b32_sha256("ns3/svc3:p80tcp")[..16], "X27LE4BHSL4DOUIK");
    }

    /// A node port appears in both rule sets, and only when the Service has one.
    #[test]
    fn node_port_rules() {
        let mut s = services(1, 0).remove(0);
        assert!(
            !nft_full(std::slice::from_ref(&s))
                .contains("add element ip kube-proxy service-nodeports")
        );
        assert!(!iptables_full(std::slice::from_ref(&s)).contains("KUBE-EXT-"));
        s.node_port = Some(30080);
        let nft = nft_full(std::slice::from_ref(&s));
        let ext = nft_ext_chain(&s);
        assert!(nft.contains(&format!(
            "add element ip kube-proxy service-nodeports {{ tcp . 30080 : goto {ext} }}"
        )));
        assert!(nft.contains(&format!(
            "add rule ip kube-proxy {ext} goto {}",
            nft_svc_chain(&s)
        )));
        let ipt = iptables_full(std::slice::from_ref(&s));
        let ext = ipt_ext_chain(&s);
        assert!(ipt.contains(&format!(":{ext} - [0:0]")));
        assert!(ipt.contains(&format!("--dport 30080 -j {ext}")));
        assert!(ipt.contains(&format!("-A {ext} -j {}", ipt_svc_chain(&s))));
        // A partial sync of the Service rewrites its external chain too.
        let ipt = iptables_change(std::slice::from_ref(&s), &s, &s);
        assert!(ipt.contains(&format!(":{ext} - [0:0]")));
    }

    /// A UDP port is UDP everywhere: chain-name hashes, matches, DNAT and map elements.
    #[test]
    fn udp_rules() {
        let mut s = services(1, 0).remove(0);
        let tcp_chains = (ipt_svc_chain(&s), nft_svc_chain(&s));
        s.proto = Proto::Udp;
        s.node_port = Some(30053);
        assert_ne!(ipt_svc_chain(&s), tcp_chains.0);
        assert!(nft_svc_chain(&s).ends_with("-bench/svc-00000/udp/http"));
        let one = std::slice::from_ref(&s);
        let nft = nft_full(one);
        assert!(!nft.contains("tcp"), "{nft}");
        assert!(nft.contains("service-nodeports { udp . 30053 : goto external-"));
        assert!(nft.contains(&format!(". udp . {SVC_PORT} : goto service-")));
        assert!(nft.contains("meta l4proto udp dnat to"));
        let ipt = iptables_full(one);
        assert!(!ipt.contains("-p tcp"), "{ipt}");
        assert!(ipt.contains("-m udp -p udp --dport 30053 -j KUBE-EXT-"));
        assert!(service_json(&s).contains(r#""protocol":"UDP""#));
        assert!(slice_json(&s).contains(r#""protocol":"UDP""#));
    }

    /// ebpf-proxy's `kube-proxy cleanup` removes every chain of kube-proxy's the full sync
    /// created and every jump to them, and recognises the synced state with the canary.
    #[test]
    fn the_agents_cleanup_undoes_the_full_sync() {
        use proxy_userspace::kube_proxy::{
            iptables_cleanup, iptables_state, owned_chain, parse_iptables_save,
        };
        let mut s = services(1, 0).remove(0);
        s.node_port = Some(30080);
        let full = iptables_full(std::slice::from_ref(&s));
        let tables = parse_iptables_save(&full);
        let state = iptables_state(&tables);
        assert!(state.canary && state.synced, "{state:?}");
        let clean = iptables_cleanup(&tables).unwrap();
        for line in full.lines() {
            if let Some(chain) = line.strip_prefix(':') {
                let chain = chain.split_whitespace().next().unwrap();
                assert_eq!(
                    clean.contains(&format!("-X {chain}\n")),
                    owned_chain(chain),
                    "{chain}"
                );
            }
            if let Some(rule) = line.strip_prefix("-A ")
                && !rule.starts_with("KUBE-")
            {
                let to_owned = rule.split_whitespace().last().is_some_and(owned_chain);
                assert_eq!(clean.contains(&format!("-D {rule}\n")), to_owned, "{rule}");
            }
        }
    }

    #[test]
    fn base32_matches_go() {
        // base32.StdEncoding.EncodeToString(sha256("")) in Go.
        assert_eq!(
            b32_sha256(""),
            "4OYMIQUY7QOBJGX36TEJS35ZEQT24QPEMSNZGTFESWMRW6CSXBKQ====".trim_end_matches('=')
        );
    }
}
