use std::net::SocketAddr;

use clap::{Args, FromArgMatches};

use super::file::yaml::field_line;
use super::*;

/// Every field a kube-proxy v1alpha1 file can have, with values.
const FULL: &str = r#"
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 45s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
featureGates: {}
healthzBindAddress: 0.0.0.0:10256
hostnameOverride: Node-1
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 2s
  syncPeriod: 1m0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
logging:
  flushFrequency: 0
  format: json
  options:
    json:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: 127.0.0.1:10249
mode: ""
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: [192.0.2.0/24, "2001:db8::/64"]
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"#;

/// kubeadm's configuration file (see the fixture's header for where it comes from).
pub const KUBEADM: &str = include_str!("../../tests/fixtures/kubeadm/config.conf");

/// Flags as the agent gets them (`argv` without the program name).
pub fn flags(argv: &[&str]) -> RunFlags {
    let cmd = RunFlags::augment_args(clap::Command::new("ebpf-proxy"));
    let m = cmd
        .try_get_matches_from(std::iter::once("ebpf-proxy").chain(argv.iter().copied()))
        .unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    RunFlags::from_arg_matches(&m).unwrap()
}

fn flags_err(argv: &[&str]) -> String {
    let cmd = RunFlags::augment_args(clap::Command::new("ebpf-proxy"));
    cmd.try_get_matches_from(std::iter::once("ebpf-proxy").chain(argv.iter().copied()))
        .map(|_| ())
        .expect_err("refused")
        .to_string()
}

fn resolve(argv: &[&str], file: Option<&str>) -> Result<AgentConfig> {
    AgentConfig::resolve(flags(argv), file.map(|t| parse(t).unwrap().settings))
}

fn body(text: &str) -> String {
    format!("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n{text}")
}

#[test]
fn full_file_is_read_without_warnings() {
    let loaded = parse(FULL).unwrap();
    assert_eq!(
        loaded.warnings,
        Vec::<String>::new(),
        "zero values are not reported"
    );
    let s = &loaded.settings;
    assert_eq!(
        s.kubeconfig.as_deref(),
        Some(Path::new("/var/lib/kube-proxy/kubeconfig.conf"))
    );
    assert_eq!(s.hostname_override.as_deref(), Some("Node-1"));
    assert_eq!(
        s.healthz_bind_address,
        Some("0.0.0.0:10256".parse().unwrap())
    );
    assert_eq!(
        s.metrics_bind_address,
        Some("127.0.0.1:10249".parse().unwrap())
    );
    assert_eq!(
        s.cluster_cidr.as_ref().unwrap().to_string(),
        "10.244.0.0/16,fd00:10:244::/56"
    );
    assert_eq!(
        s.node_port_addresses.as_ref().unwrap().to_string(),
        "192.0.2.0/24,2001:db8::/64"
    );
    assert_eq!(s.sync_period, Some(Duration::from_secs(60)));
    assert_eq!(s.min_sync_period, Some(Duration::from_secs(2)));
    assert_eq!(s.udp_flow_timeout, Some(Duration::from_secs(45)));
    assert_eq!(s.log_format, Some(LogFormat::Json));
    assert_eq!(s.masquerade_all, Some(false));
    assert_eq!(s.mode, None);
    let c = resolve(&[], Some(FULL)).unwrap();
    assert_eq!(c.hostname_override.as_deref(), Some("node-1"), "lowercased");
}

#[test]
fn kubeadm_file_runs_with_kube_proxy_defaults_and_no_warning() {
    let loaded = parse(KUBEADM).unwrap();
    assert_eq!(loaded.warnings, Vec::<String>::new());
    let c = AgentConfig::resolve(flags(&[]), Some(loaded.settings)).unwrap();
    assert_eq!(c.action, Action::Run);
    assert_eq!(c.proxy_mode, ProxyMode::Ebpf);
    assert_eq!(
        c.source,
        SourceChoice::Api(Some(PathBuf::from("/var/lib/kube-proxy/kubeconfig.conf")))
    );
    assert_eq!(c.cluster_cidrs, vec!["10.244.0.0/16".parse().unwrap()]);
    // Every zero value is kube-proxy's default.
    assert_eq!(c.sync_period, DEFAULT_SYNC_PERIOD);
    assert_eq!(c.min_sync_period, DEFAULT_MIN_SYNC_PERIOD);
    assert_eq!(
        c.healthz_bind_address,
        Some("0.0.0.0:10256".parse().unwrap())
    );
    assert_eq!(
        c.metrics_bind_address,
        Some("127.0.0.1:10249".parse().unwrap())
    );
    assert_eq!(c.udp_flow_timeout, DEFAULT_UDP_FLOW_TIMEOUT);
    assert_eq!(c.tc.conntrack_min, DEFAULT_CONNTRACK_MIN);
    assert_eq!(
        c.tc.conntrack_tcp_timeout_established,
        DEFAULT_CT_TCP_ESTABLISHED
    );
    assert!(!c.tc.masquerade_all);
    assert_eq!(c.nodeport_addresses, None);
    assert_eq!(c.lb_algorithm, Algorithm::Random);
    assert_eq!(c.log_level, "info");
    assert_eq!(c.oom_score_adj, DEFAULT_OOM_SCORE_ADJ);
    assert!(!c.bind_address_hard_fail);
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
}

#[test]
fn minimal_file_sets_nothing() {
    for text in [body(""), body("mode: ebpf\n"), body("mode: \"\"\n")] {
        let l = parse(&text).unwrap();
        assert!(l.warnings.is_empty());
        let s = FileSettings {
            document: KubeProxyConfiguration::default(),
            mode: None,
            ..l.settings
        };
        assert_eq!(s, FileSettings::default(), "{text}");
    }
}

#[test]
fn each_invalid_value_names_the_field() {
    for (text, expected) in [
        (
            "bindAddress: node-1\n",
            "bindAddress: \"node-1\" is not an IP address",
        ),
        (
            "healthzBindAddress: 0.0.0.0:x\n",
            "healthzBindAddress: \"0.0.0.0:x\" is not an IP address and port",
        ),
        (
            "metricsBindAddress: localhost:10249\n",
            "metricsBindAddress: \"localhost:10249\" is not an IP address and port (e.g. 0.0.0.0:10249 or [::]:10249)",
        ),
        (
            "clusterCIDR: 10.244.0.0/33\n",
            "clusterCIDR: \"10.244.0.0/33\" is not a CIDR",
        ),
        (
            "clusterCIDR: 10.0.0.0/16,10.1.0.0/16\n",
            "clusterCIDR: \"10.0.0.0/16,10.1.0.0/16\": give one CIDR, or an IPv4 and an IPv6 CIDR",
        ),
        (
            "nodePortAddresses: [primary, 10.0.0.0/8]\n",
            "nodePortAddresses: \"primary\" cannot be combined with CIDRs",
        ),
        (
            "nodePortAddresses: [all]\n",
            "nodePortAddresses: \"all\" is not a CIDR",
        ),
        (
            "conntrack:\n  udpTimeout: soon\n",
            "conntrack.udpTimeout: invalid duration \"soon\"",
        ),
        (
            "iptables:\n  syncPeriod: -1s\n",
            "iptables.syncPeriod: invalid duration \"-1s\" (negative)",
        ),
        (
            "nftables:\n  minSyncPeriod: 1x\n",
            "nftables.minSyncPeriod: invalid duration \"1x\"",
        ),
        (
            "iptables:\n  syncPeriod: 10s\nnftables:\n  syncPeriod: 20s\n",
            "iptables.syncPeriod: 10s differs from nftables.syncPeriod (20s)",
        ),
        (
            "iptables:\n  syncPeriod: 10s\n  minSyncPeriod: 1m\n",
            "minSyncPeriod: 1m0s is longer than syncPeriod (10s)",
        ),
        (
            "logging:\n  format: xml\n",
            "logging.format: \"xml\" is not supported; use \"text\" or \"json\"",
        ),
        (
            "logging:\n  verbosity: -1\n",
            "logging.verbosity: -1 is not an integer",
        ),
        (
            "ipvs:\n  scheduler: lblc\n",
            "ipvs.scheduler: \"lblc\": not an IPVS scheduler ebpf-proxy implements (rr, wrr, lc, wlc, sed, nq, sh, dh, mh; the locality-based lblc and lblcr have no equivalent)",
        ),
        (
            "oomScoreAdj: -1001\n",
            "oomScoreAdj: -1001 is not an integer from -1000 to 1000",
        ),
        (
            "hostnameOverride: [a]\n",
            "hostnameOverride: expected a string, found a list",
        ),
        (
            "hostnameOverride: Node A\n",
            "hostnameOverride: \"node a\" is not a valid node name",
        ),
        (
            "mode: nftables\nclusterCIDR: 10.0.0.0/8\nmode: iptables\n",
            "duplicate field `mode` (line 5)",
        ),
        (
            "conntrack:\n  min: 1024\n  maxPerCore: 0\n  min: 2048\n",
            "duplicate field `min` (line 6)",
        ),
        (
            "enableProfiling: yes please\n",
            "enableProfiling: expected true or false, found the string \"yes please\" (line 3)",
        ),
        (
            "conntrack:\n  tcpBeLiberal: 1\n",
            "conntrack.tcpBeLiberal: expected true or false, found the number 1",
        ),
        (
            "conntrack: 5\n",
            "conntrack: expected a mapping of fields, found the number 5",
        ),
        (
            "nodePortAddresses: 10.0.0.0/8\n",
            "nodePortAddresses: expected a list, found the string \"10.0.0.0/8\"",
        ),
        (
            "detectLocalMode: Bogus\n",
            "detectLocalMode: \"Bogus\" is not a local-traffic detection mode: use ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix (or leave it empty)",
        ),
    ] {
        let e = format!("{:#}", parse(&body(text)).unwrap_err());
        assert!(e.contains(expected), "{text:?}: {e}");
    }
    for (text, expected) in [
        (
            "apiVersion: kubeproxy.config.k8s.io/v1alpha2\nkind: KubeProxyConfiguration\n",
            "apiVersion: expected \"kubeproxy.config.k8s.io/v1alpha1\", found \"kubeproxy.config.k8s.io/v1alpha2\"",
        ),
        (
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n",
            "kind: expected \"KubeProxyConfiguration\", found \"KubeletConfiguration\"",
        ),
        ("kind: KubeProxyConfiguration\n", "apiVersion: expected"),
    ] {
        let e = format!("{:#}", parse(text).unwrap_err());
        assert!(e.contains(expected), "{text:?}: {e}");
    }
}

#[test]
fn a_fields_type_error_is_named_by_the_field_and_only_a_wrong_document_is_called_one() {
    let e = format!("{:#}", parse(&body("hostnameOverride: [a]\n")).unwrap_err());
    assert!(e.starts_with("hostnameOverride: expected a string"), "{e}");
    let e = format!("{:#}", parse("- a\n- b\n").unwrap_err());
    assert!(
        e.starts_with("not a KubeProxyConfiguration document: "),
        "{e}"
    );
}

#[test]
fn unknown_and_meaningless_fields_are_warned_about_once_each_by_name() {
    let l = parse(&body(
        "bindAddress: 192.0.2.1\n\
         fooBar: 1\n\
         serviceProxyName: other\n\
         enableProfiling: true\n\
         featureGates: {SomeGate: true}\n\
         detectLocalMode: BridgeInterface\n\
         conntrack:\n  maxPerCore: 32768\n  tcpBeLiberal: true\n  udpTimeout: 30s\n  colour: red\n\
         iptables:\n  masqueradeAll: true\n  masqueradeBit: 15\n  localhostNodePorts: true\n  udpTimeout: 5s\n\
         ipvs:\n  scheduler: rr\n  strictARP: true\n\
         clientConnection:\n  qps: 50\n\
         logging:\n  verbosity: 4\n  vmodule: [{filePattern: x, verbosity: 2}]\n",
    ))
    .unwrap();
    let expected = [
        "--config: field \"bindAddress\" (192.0.2.1): only its IP family is used here (that of the default health and metrics addresses); kube-proxy takes it as the node's primary IP, which ebpf-proxy does not need",
        "--config: field \"iptables.masqueradeBit\" has no effect in ebpf-proxy: ignored",
        "--config: unknown field \"iptables.udpTimeout\" (not in kubeproxy.config.k8s.io/v1alpha1 KubeProxyConfiguration): ignored",
        "--config: field \"ipvs.strictARP\" has no effect in ebpf-proxy: ignored",
        "--config: unknown field \"conntrack.colour\" (not in kubeproxy.config.k8s.io/v1alpha1 KubeProxyConfiguration): ignored",
        "--config: field \"conntrack.tcpBeLiberal\" has no effect in ebpf-proxy: ignored",
        "--config: field \"clientConnection.qps\" has no effect in ebpf-proxy: ignored",
        "--config: field \"logging.vmodule\" has no effect in ebpf-proxy: ignored",
        "--config: field \"detectLocalMode\" has no effect in ebpf-proxy: ignored",
        "--config: field \"enableProfiling\" has no effect in ebpf-proxy: ignored",
        "--config: field \"featureGates\" has no effect in ebpf-proxy: ignored",
        "--config: unknown field \"fooBar\" (not in kubeproxy.config.k8s.io/v1alpha1 KubeProxyConfiguration): ignored",
        "--config: unknown field \"serviceProxyName\" (not in kubeproxy.config.k8s.io/v1alpha1 KubeProxyConfiguration): ignored",
    ];
    assert_eq!(sorted(&l.warnings), sorted(&expected));
    let s = &l.settings;
    assert_eq!(s.udp_flow_timeout, Some(Duration::from_secs(30)));
    assert_eq!(s.conntrack_max_per_core, Some(32768));
    assert_eq!(s.masquerade_all, Some(true));
    assert_eq!(s.ipvs_scheduler, Some(IpvsScheduler::Rr));
    assert_eq!(s.verbosity, Some(4));
    let c = AgentConfig::resolve(flags(&[]), Some(l.settings)).unwrap();
    assert_eq!(c.lb_algorithm, Algorithm::RoundRobin);
    assert!(c.tc.masquerade_all);
    assert_eq!(c.log_level, "debug");
}

#[test]
fn conntrack_size_and_timeouts_are_read_and_checked() {
    let l = parse(&body(
        "conntrack:\n  maxPerCore: 0\n  min: 4096\n  tcpEstablishedTimeout: 1h\n  udpStreamTimeout: 2.5m\n",
    ))
    .unwrap();
    assert!(l.warnings.is_empty(), "{:?}", l.warnings);
    assert_eq!(l.settings.conntrack_max_per_core, Some(0));
    assert_eq!(l.settings.conntrack_min, Some(4096));
    assert_eq!(
        l.settings.conntrack_tcp_timeout_established,
        Some(Duration::from_secs(3600))
    );
    assert_eq!(
        l.settings.conntrack_udp_timeout_stream,
        Some(Duration::from_secs(150))
    );
    // kube-proxy's 0 = leave as is: the default here.
    let l = parse(&body("conntrack:\n  maxPerCore: 0\n  min: 0\n")).unwrap();
    assert_eq!(l.settings.conntrack_min, None);
    for (bad, field) in [
        (
            "min: 10",
            "conntrack.min: 10 is not an integer from 1024 to 16777216",
        ),
        (
            "maxPerCore: -1",
            "conntrack.maxPerCore: -1 is not an integer",
        ),
        ("min: many", "conntrack.min: many is not an integer"),
        (
            "tcpEstablishedTimeout: soon",
            "conntrack.tcpEstablishedTimeout",
        ),
        (
            "udpStreamTimeout: 10",
            "conntrack.udpStreamTimeout: 10 is not a duration",
        ),
        (
            "tcpEstablishedTimeout: [1, 2]",
            "conntrack.tcpEstablishedTimeout: - 1",
        ),
        (
            "tcpEstablishedTimeout: 500us",
            "conntrack.tcpEstablishedTimeout: 500µs is too short",
        ),
    ] {
        let e = parse(&body(&format!("conntrack:\n  {bad}\n"))).unwrap_err();
        assert!(format!("{e:#}").contains(field), "{bad}: {e:#}");
        // The value's line: after apiVersion, kind and `conntrack:`.
        assert!(format!("{e:#}").ends_with("(line 4)"), "{bad}: {e:#}");
    }
}

#[test]
fn invalid_values_name_their_line() {
    let text = body(
        "# comment\nconntrack:\n  min: 0\n  udpTimeout: 1s\n\n  maxPerCore: lots\noomScoreAdj: 5\n",
    );
    let e = format!("{:#}", parse(&text).unwrap_err());
    assert!(
        e.contains("conntrack.maxPerCore: lots") && e.ends_with("(line 8)"),
        "{e}"
    );
    assert_eq!(field_line(&text, "oomScoreAdj"), Some(9));
    assert_eq!(field_line(&text, "conntrack.min"), Some(5));
    // Not a key of that block, not a field path.
    assert_eq!(field_line(&text, "conntrack.oomScoreAdj"), None);
    assert_eq!(field_line(&text, "minSyncPeriod is longer"), None);
    // A duration section's field, and a flow mapping (no line, the message still names it).
    let e = format!(
        "{:#}",
        parse(&body("iptables:\n  syncPeriod: 10\n")).unwrap_err()
    );
    assert!(e.ends_with("(line 4)"), "{e}");
    let e = format!(
        "{:#}",
        parse(&body("conntrack: {maxPerCore: lots}\n")).unwrap_err()
    );
    assert!(
        e.contains("conntrack.maxPerCore") && !e.contains("(line"),
        "{e}"
    );
}

fn sorted<S: AsRef<str>>(v: &[S]) -> Vec<String> {
    let mut v: Vec<String> = v.iter().map(|s| s.as_ref().to_string()).collect();
    v.sort();
    v
}

#[test]
fn list_flags_parse_like_kube_proxy() {
    assert_eq!(
        "10.0.0.0/8".parse::<ClusterCidrs>().unwrap().to_string(),
        "10.0.0.0/8"
    );
    assert!("10.0.0.0/8,fd00::/64".parse::<ClusterCidrs>().is_ok());
    assert!("fd00::/64,fd01::/64".parse::<ClusterCidrs>().is_err());
    // Empty is kube-proxy's default: none (the flag takes it as not given).
    assert_eq!(
        "".parse::<ClusterCidrs>().unwrap(),
        ClusterCidrs(Vec::new())
    );
    assert_eq!(
        "primary".parse::<NodePortAddresses>().unwrap(),
        NodePortAddresses::Primary
    );
    assert_eq!(
        "10.0.0.0/8, 192.168.0.0/16"
            .parse::<NodePortAddresses>()
            .unwrap()
            .to_string(),
        "10.0.0.0/8,192.168.0.0/16"
    );
    assert!("primary,10.0.0.0/8".parse::<NodePortAddresses>().is_err());
    for argv in [
        ["--cluster-cidr", "10.0.0.0/33"],
        ["--nodeport-addresses", "primary,10.0.0.0/8"],
        ["--log-format", "xml"],
        ["--ipvs-scheduler", "lblc"],
        ["--masquerade-all", "maybe"],
    ] {
        flags_err(&argv);
    }
}

#[test]
fn server_addresses_as_kube_proxy_takes_them() {
    let addr = |s: &str| s.parse::<ServerAddress>().unwrap();
    assert_eq!(addr(""), ServerAddress::Disabled);
    assert_eq!(
        addr("0.0.0.0").resolve(10256),
        Some("0.0.0.0:10256".parse().unwrap())
    );
    assert_eq!(
        addr("::").resolve(10256),
        Some("[::]:10256".parse().unwrap())
    );
    assert_eq!(
        addr("[::1]").resolve(10249),
        Some("[::1]:10249".parse().unwrap())
    );
    assert_eq!(
        addr("[::]:1").resolve(10256),
        Some("[::]:1".parse().unwrap())
    );
    assert!("localhost".parse::<ServerAddress>().is_err());

    // An IP alone in the file takes the server's port.
    let c = resolve(
        &[],
        Some(&body(
            "healthzBindAddress: 192.0.2.1\nmetricsBindAddress: \"::1\"\n",
        )),
    )
    .unwrap();
    assert_eq!(
        c.healthz_bind_address,
        Some("192.0.2.1:10256".parse().unwrap())
    );
    assert_eq!(c.metrics_bind_address, Some("[::1]:10249".parse().unwrap()));
    // An empty flag disables the server; the deprecated port flags set the port or, at 0,
    // disable it.
    let c = resolve(
        &["--metrics-bind-address=", "--healthz-port", "20256"],
        None,
    )
    .unwrap();
    assert_eq!(c.metrics_bind_address, None);
    assert_eq!(
        c.healthz_bind_address,
        Some("0.0.0.0:20256".parse().unwrap())
    );
    let c = resolve(&["--healthz-port=0", "--metrics-port=20249"], None).unwrap();
    assert_eq!(c.healthz_bind_address, None);
    assert_eq!(
        c.metrics_bind_address,
        Some("127.0.0.1:20249".parse().unwrap())
    );
    // An IPv6 --bind-address makes the defaults IPv6, as kube-proxy's defaulting.
    let c = resolve(&["--bind-address", "::"], None).unwrap();
    assert_eq!(c.healthz_bind_address, Some("[::]:10256".parse().unwrap()));
    assert_eq!(c.metrics_bind_address, Some("[::1]:10249".parse().unwrap()));
    assert!(
        c.warnings.is_empty(),
        "an unspecified --bind-address is not reported"
    );
}

#[test]
fn kube_proxy_modes_stop_start_up_with_one_line() {
    for mode in ["iptables", "ipvs", "nftables", "kernelspace"] {
        for (argv, file, origin) in [
            (vec![format!("--proxy-mode={mode}")], None, "--proxy-mode"),
            (
                vec![],
                Some(body(&format!("mode: {mode}\n"))),
                "--config: mode",
            ),
        ] {
            let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
            let e = format!("{:#}", resolve(&argv, file.as_deref()).unwrap_err());
            assert_eq!(e.lines().count(), 1, "{e}");
            assert!(
                e.starts_with(&format!(
                    "{origin} \"{mode}\": this is ebpf-proxy, a kube-proxy replacement"
                )),
                "{e}"
            );
            assert!(
                e.contains("leave the mode empty or set it to \"ebpf\""),
                "{e}"
            );
            assert!(
                e.contains(&format!("to keep the {mode} mode, run kube-proxy")),
                "{e}"
            );
        }
    }
    let e = resolve(&["--proxy-mode", "userspace"], None).unwrap_err();
    assert!(
        e.to_string().contains("\"userspace\" is not a proxy mode"),
        "{e}"
    );
    for ok in ["", "ebpf"] {
        assert_eq!(
            resolve(&["--proxy-mode", ok], None).unwrap().proxy_mode,
            ProxyMode::Ebpf
        );
    }
    // The flag wins over the file, as every flag here.
    resolve(&["--proxy-mode=ebpf"], Some(&body("mode: ipvs\n"))).unwrap();
    // --cleanup removes what ebpf-proxy installed whatever the mode says.
    let c = resolve(&["--cleanup"], Some(&body("mode: ipvs\n"))).unwrap();
    assert_eq!(c.action, Action::Cleanup);
}

#[test]
fn ipvs_schedulers_select_the_algorithm_of_the_same_rule() {
    for (name, algorithm) in [
        ("rr", Algorithm::RoundRobin),
        ("wrr", Algorithm::WeightedRoundRobin),
        ("lc", Algorithm::LeastConnections),
        ("wlc", Algorithm::WeightedLeastConnections),
        ("sed", Algorithm::ShortestExpectedDelay),
        ("nq", Algorithm::NeverQueue),
        ("sh", Algorithm::SourceHash),
        ("dh", Algorithm::DestinationHash),
        ("mh", Algorithm::SourceHash),
    ] {
        assert_eq!(
            resolve(&["--ipvs-scheduler", name], None)
                .unwrap()
                .lb_algorithm,
            algorithm
        );
        let file = body(&format!("ipvs:\n  scheduler: {name}\n"));
        assert_eq!(resolve(&[], Some(&file)).unwrap().lb_algorithm, algorithm);
        // Written back under a name that reads as the same algorithm (mh as sh).
        let s = IpvsScheduler::of_algorithm(algorithm).expect("a scheduler name");
        assert_eq!(s.algorithm(), algorithm);
    }
    assert_eq!(IpvsScheduler::of_algorithm(Algorithm::Maglev), None);
    assert_eq!(IpvsScheduler::of_algorithm(Algorithm::Random), None);
    // The flag beats the file; --lb-algorithm and --ipvs-scheduler are one setting.
    let c = resolve(
        &["--ipvs-scheduler", "lc"],
        Some(&body("ipvs:\n  scheduler: wlc\n")),
    )
    .unwrap();
    assert_eq!(c.lb_algorithm, Algorithm::LeastConnections);
    let c = resolve(
        &["--lb-algorithm", "maglev"],
        Some(&body("ipvs:\n  scheduler: rr\n")),
    )
    .unwrap();
    assert_eq!(c.lb_algorithm, Algorithm::Maglev);
    assert!(
        flags_err(&["--lb-algorithm", "random", "--ipvs-scheduler", "rr"])
            .contains("cannot be used with")
    );
    assert_eq!(
        resolve(&[], Some(&body("ipvs:\n  scheduler: \"\"\n")))
            .unwrap()
            .lb_algorithm,
        Algorithm::Random
    );
    // An empty flag is kube-proxy's "default" and overrides the file.
    let c = resolve(
        &["--ipvs-scheduler="],
        Some(&body("ipvs:\n  scheduler: wlc\n")),
    )
    .unwrap();
    assert_eq!(c.lb_algorithm, Algorithm::Random);
    assert!(flags_err(&["--ipvs-scheduler=lblc"]).contains("locality-based"));
    // Only IPVS names are schedulers (ebpf-proxy's own names are algorithms), and none is
    // empty.
    assert!("least-connections".parse::<IpvsScheduler>().is_err());
    assert!("".parse::<IpvsScheduler>().is_err());
    let e = "lblcr".parse::<IpvsScheduler>().unwrap_err();
    assert!(e.contains("locality-based"), "{e}");
}

#[test]
fn conntrack_min_zero_keeps_the_default_on_the_command_line_as_in_the_file() {
    let c = resolve(&["--conntrack-min=0"], None).unwrap();
    assert_eq!(c.tc.conntrack_min, DEFAULT_CONNTRACK_MIN);
    let c = resolve(
        &["--conntrack-min=0"],
        Some(&body("conntrack:\n  min: 4096\n")),
    )
    .unwrap();
    assert_eq!(c.tc.conntrack_min, 4096);
    assert_eq!(
        resolve(&["--conntrack-min=2048"], None)
            .unwrap()
            .tc
            .conntrack_min,
        2048
    );
    let e = flags_err(&["--conntrack-min=10"]);
    assert!(
        e.contains("is not 0 or a number from 1024 to 16777216"),
        "{e}"
    );
}

#[test]
fn a_kube_proxy_mode_in_the_file_is_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.conf");
    std::fs::write(&path, body("mode: ipvs\n")).unwrap();
    let path_arg = format!("--config={}", path.display());
    let f = flags(&[&path_arg]);
    let settings = load(&path).unwrap().settings;
    let e = format!("{:#}", AgentConfig::resolve(f, Some(settings)).unwrap_err());
    assert!(
        e.starts_with(&format!(
            "--config {}: mode \"ipvs\": this is ebpf-proxy",
            path.display()
        )),
        "{e}"
    );
}

#[test]
fn kube_proxy_flags_have_kube_proxy_meaning() {
    let c = resolve(
        &[
            "--iptables-sync-period=1m0s",
            "--ipvs-sync-period",
            "60s",
            "--iptables-min-sync-period=0",
            "--conntrack-udp-timeout=45s",
            "--conntrack-tcp-timeout-established=0s",
            "--conntrack-udp-timeout-stream=1m30s",
            "--masquerade-all",
            "--bind-address-hard-fail=true",
            "--oom-score-adj=-500",
            "--master=https://192.0.2.1:6443",
            "--logging-format=json",
            "-v=4",
            "--hostname-override=  Worker-1 ",
        ],
        None,
    )
    .unwrap();
    assert_eq!(c.sync_period, Duration::from_secs(60));
    assert_eq!(
        c.min_sync_period,
        Duration::ZERO,
        "0 syncs every change at once"
    );
    assert_eq!(c.udp_flow_timeout, Duration::from_secs(45));
    assert_eq!(
        c.tc.conntrack_tcp_timeout_established, DEFAULT_CT_TCP_ESTABLISHED,
        "0 keeps the default"
    );
    assert_eq!(c.tc.conntrack_udp_timeout_stream, Duration::from_secs(90));
    assert!(c.tc.masquerade_all);
    assert!(c.bind_address_hard_fail);
    assert_eq!(c.oom_score_adj, -500);
    assert_eq!(c.master.as_deref(), Some("https://192.0.2.1:6443"));
    assert_eq!(c.log_format, LogFormat::Json);
    assert_eq!(c.log_level, "debug");
    assert_eq!(c.hostname_override.as_deref(), Some("worker-1"));
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    for (v, level) in [
        ("0", "info"),
        ("2", "info"),
        ("3", "debug"),
        ("5", "trace"),
        ("10", "trace"),
    ] {
        assert_eq!(resolve(&["--v", v], None).unwrap().log_level, level);
        assert_eq!(
            resolve(&[&format!("-v{v}")], None).unwrap().log_level,
            level
        );
    }
    assert_eq!(
        resolve(&["-v", "5", "--log-level", "warn"], None)
            .unwrap()
            .log_level,
        "warn"
    );
    // Go booleans: `--flag` is true, `--flag=false` false.
    assert!(
        !resolve(
            &["--masquerade-all=false"],
            Some(&body("iptables:\n  masqueradeAll: true\n"))
        )
        .unwrap()
        .tc
        .masquerade_all
    );
    // One setting under several names must agree.
    let e = resolve(
        &["--sync-period", "30s", "--iptables-sync-period", "1m"],
        None,
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "--iptables-sync-period 1m0s differs from --sync-period 30s; give one value"
    );
    let e = resolve(&["--hostname-override", " "], None).unwrap_err();
    assert!(e.to_string().contains("empty name"), "{e}");
    assert!(flags_err(&["--oom-score-adj", "-1001"]).contains("-1001"));
}

#[test]
fn kube_proxy_flags_without_effect_are_accepted_with_one_warning_each() {
    let c = resolve(
        &[
            "--feature-gates=SomeGate=true",
            "--kube-api-content-type=application/json",
            "--kube-api-burst=20",
            "--kube-api-qps=10.5",
            "--bind-address=192.0.2.1",
            "--profiling",
            "--show-hidden-metrics-for-version=1.35",
            "--iptables-masquerade-bit=14",
            "--iptables-localhost-nodeports=true",
            "--ipvs-exclude-cidrs=10.0.0.0/8,192.168.0.0/16",
            "--ipvs-strict-arp",
            "--ipvs-tcp-timeout=1m",
            "--ipvs-tcpfin-timeout=1m",
            "--ipvs-udp-timeout=1m",
            "--detect-local-mode=NodeCIDR",
            "--pod-bridge-interface=cbr0",
            "--pod-interface-name-prefix=veth",
            "--conntrack-tcp-timeout-close-wait=1h",
            "--conntrack-tcp-be-liberal",
            "--config-sync-period=15m",
            "--proxy-port-range=30000-31000",
            "--vmodule=proxier=4",
            "--log-flush-frequency=5s",
            "--log-text-split-stream",
            "--log-text-info-buffer-size=1Ki",
            "--log-json-split-stream=true",
            "--log-json-info-buffer-size=1Ki",
            "--boot-id-file=/proc/sys/kernel/random/boot_id",
            "--machine-id-file=/etc/machine-id",
        ],
        None,
    )
    .unwrap();
    let names: Vec<String> = c
        .warnings
        .iter()
        .map(|w| {
            // --bind-address's family is used; its address is not.
            assert!(
                w.ends_with(" has no effect in ebpf-proxy: ignored")
                    || w.starts_with("flag --bind-address: only its IP family is used here"),
                "{w}"
            );
            w.trim_start_matches("flag --")
                .split(' ')
                .next()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(names.len(), 29, "{names:?}");
    let unique: std::collections::BTreeSet<&String> = names.iter().collect();
    assert_eq!(unique.len(), names.len(), "one warning per flag: {names:?}");
    // Zero values are not reported.
    let c = resolve(
        &[
            "--profiling=false",
            "--detect-local-mode=ClusterCIDR",
            "--bind-address=0.0.0.0",
            "--feature-gates=",
        ],
        None,
    )
    .unwrap();
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
}

#[test]
fn action_flags_follow_kube_proxy_order() {
    assert_eq!(resolve(&[], None).unwrap().action, Action::Run);
    assert_eq!(
        resolve(&["--cleanup"], None).unwrap().action,
        Action::Cleanup
    );
    assert_eq!(
        resolve(&["--cleanup=false"], None).unwrap().action,
        Action::Run
    );
    assert_eq!(
        resolve(&["--init-only"], None).unwrap().action,
        Action::InitOnly
    );
    assert_eq!(
        resolve(
            &["--init-only", "--cleanup", "--write-config-to", "/tmp/x"],
            None
        )
        .unwrap()
        .action,
        Action::WriteConfig(PathBuf::from("/tmp/x"))
    );
    assert_eq!(
        resolve(&["--cleanup", "--init-only"], None).unwrap().action,
        Action::Cleanup
    );
}

/// The meaningful settings of a configuration, to compare two.
fn meaning(c: &AgentConfig) -> String {
    format!(
        "{:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?}",
        c.source,
        c.min_sync_period,
        c.sync_period,
        c.metrics_bind_address,
        c.healthz_bind_address,
        c.bind_address_hard_fail,
        c.hostname_override,
        c.lb_algorithm,
        c.log_format,
        c.cluster_cidrs,
        c.nodeport_addresses,
        c.udp_flow_timeout,
        (
            c.tc.masquerade_all,
            c.tc.conntrack_max_per_core,
            c.tc.conntrack_min
        ),
        (
            c.tc.conntrack_tcp_timeout_established,
            c.tc.conntrack_udp_timeout_stream
        ),
        (c.oom_score_adj, c.verbosity, &c.log_level),
    )
}

#[test]
fn written_configuration_runs_the_same_agent() {
    for (argv, file) in [
        (vec![], None),
        (vec![], Some(KUBEADM.to_string())),
        (
            vec![
                "--kubeconfig=/etc/kube/config",
                "--hostname-override=n1",
                "--sync-period=1m",
                "--min-sync-period=5s",
                "--metrics-bind-address=0.0.0.0:20249",
                "--healthz-bind-address=[::]:20256",
                "--bind-address-hard-fail",
                "--cluster-cidr=10.0.0.0/8,fd00::/64",
                "--nodeport-addresses=primary",
                "--ipvs-scheduler=sh",
                "--log-format=json",
                "-v=3",
                "--udp-flow-timeout=45s",
                "--masquerade-all",
                "--conntrack-max-per-core=1024",
                "--conntrack-min=4096",
                "--conntrack-tcp-timeout-established=1h",
                "--conntrack-udp-timeout-stream=3m",
                "--oom-score-adj=-100",
                "--feature-gates=A=true",
                "--vmodule=proxier=4,foo=2",
                "--iptables-masquerade-bit=15",
            ],
            Some(FULL.to_string()),
        ),
    ] {
        let c = resolve(&argv, file.as_deref()).unwrap();
        let yaml = c.kube_proxy_configuration();
        let loaded = parse(&yaml).unwrap_or_else(|e| panic!("{e:#}\n{yaml}"));
        let again = AgentConfig::resolve(flags(&[]), Some(loaded.settings)).unwrap();
        assert_eq!(meaning(&again), meaning(&c), "{yaml}");
        // Written once more, the same text.
        assert_eq!(again.kube_proxy_configuration(), yaml);
        // Every v1alpha1 field is written, in kube-proxy's (alphabetical) order.
        let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&yaml).unwrap();
        let keys: Vec<&str> = doc
            .as_mapping()
            .unwrap()
            .keys()
            .map(|k| k.as_str().unwrap())
            .collect();
        let mut sorted_keys = keys.clone();
        sorted_keys.sort();
        assert_eq!(keys, sorted_keys);
        for field in [
            "apiVersion",
            "bindAddress",
            "bindAddressHardFail",
            "clientConnection",
            "clusterCIDR",
            "configSyncPeriod",
            "conntrack",
            "detectLocal",
            "detectLocalMode",
            "enableProfiling",
            "healthzBindAddress",
            "hostnameOverride",
            "iptables",
            "ipvs",
            "kind",
            "logging",
            "metricsBindAddress",
            "mode",
            "nftables",
            "oomScoreAdj",
            "portRange",
            "showHiddenMetricsForVersion",
            "winkernel",
        ] {
            assert!(keys.contains(&field), "{field} missing:\n{yaml}");
        }
        if argv.contains(&"--feature-gates=A=true") {
            assert!(yaml.contains("featureGates:\n  A: true"), "{yaml}");
            assert!(yaml.contains("masqueradeBit: 15"), "{yaml}");
            assert!(yaml.contains("scheduler: sh"), "{yaml}");
            assert!(yaml.contains("filePattern: proxier"), "{yaml}");
        }
    }
    // Defaults as kube-proxy writes its own.
    let yaml = resolve(&[], None).unwrap().kube_proxy_configuration();
    for line in [
        "healthzBindAddress: 0.0.0.0:10256",
        "metricsBindAddress: 127.0.0.1:10249",
        "  syncPeriod: 30s",
        "  minSyncPeriod: 1s",
        "  tcpEstablishedTimeout: 24h0m0s",
        "oomScoreAdj: -999",
        "mode: ''",
    ] {
        assert!(yaml.lines().any(|l| l == line), "{line:?} not in\n{yaml}");
    }
    // Read back, kube-proxy's defaults warn about nothing.
    let l = parse(&yaml).unwrap();
    assert!(l.warnings.is_empty(), "{:?}", l.warnings);
}

/// `conntrack.maxPerCore` left to its default is written as null: ebpf-proxy reads it
/// back as its 0, kube-proxy (after a rollback) as its 32768 rather than as "leave
/// nf_conntrack_max alone". A value given, 0 included, is written as given.
#[test]
fn written_max_per_core_is_null_unless_given() {
    let yaml = resolve(&[], None).unwrap().kube_proxy_configuration();
    assert!(yaml.lines().any(|l| l == "  maxPerCore: null"), "{yaml}");
    assert!(yaml.lines().any(|l| l == "  min: 131072"), "{yaml}");
    let back = AgentConfig::resolve(flags(&[]), Some(parse(&yaml).unwrap().settings)).unwrap();
    assert_eq!(back.tc.conntrack_max_per_core, 0);
    for (argv, file, line) in [
        (&["--conntrack-max-per-core=0"][..], None, "  maxPerCore: 0"),
        (
            &["--conntrack-max-per-core=32768"][..],
            None,
            "  maxPerCore: 32768",
        ),
        (
            &[][..],
            Some(body("conntrack:\n  maxPerCore: 0\n")),
            "  maxPerCore: 0",
        ),
    ] {
        let yaml = resolve(argv, file.as_deref())
            .unwrap()
            .kube_proxy_configuration();
        assert!(yaml.lines().any(|l| l == line), "{argv:?}: {yaml}");
    }
}

#[test]
fn flags_given_override_the_file_even_at_their_default_value() {
    const FILE: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: /etc/kube-proxy/kubeconfig}
hostnameOverride: file-node
healthzBindAddress: 0.0.0.0:20256
metricsBindAddress: 0.0.0.0:20249
clusterCIDR: 10.244.0.0/16
nodePortAddresses: [primary]
nftables: {syncPeriod: 1m, minSyncPeriod: 5s}
conntrack: {udpTimeout: 1m}
logging: {format: json}
";
    let a = resolve(&["--config", "f.yaml"], Some(FILE)).unwrap();
    assert_eq!(
        a.source,
        SourceChoice::Api(Some(PathBuf::from("/etc/kube-proxy/kubeconfig")))
    );
    assert_eq!(a.hostname_override.as_deref(), Some("file-node"));
    assert_eq!(
        a.healthz_bind_address,
        Some("0.0.0.0:20256".parse().unwrap())
    );
    assert_eq!(a.sync_period, Duration::from_secs(60));
    assert_eq!(a.min_sync_period, Duration::from_secs(5));
    assert_eq!(a.udp_flow_timeout, Duration::from_secs(60));
    assert_eq!(a.log_format, LogFormat::Json);
    assert_eq!(a.nodeport_addresses, Some(NodePortAddresses::Primary));
    let a = resolve(
        &[
            "--manifests",
            "/tmp/m",
            "--hostname-override",
            "flag-node",
            "--metrics-bind-address",
            "127.0.0.1:10249",
            "--sync-period",
            "10s",
            "--udp-flow-timeout",
            "30s",
            "--log-format",
            "text",
            "--cluster-cidr",
            "10.0.0.0/8,fd00::/64",
            "--nodeport-addresses",
            "192.0.2.0/24",
            "--min-sync-period",
            "5s",
        ],
        Some(FILE),
    )
    .unwrap();
    assert_eq!(a.source, SourceChoice::Manifests(PathBuf::from("/tmp/m")));
    assert_eq!(a.hostname_override.as_deref(), Some("flag-node"));
    assert_eq!(
        a.metrics_bind_address,
        Some("127.0.0.1:10249".parse::<SocketAddr>().unwrap())
    );
    assert_eq!(a.sync_period, Duration::from_secs(10));
    assert_eq!(a.udp_flow_timeout, Duration::from_secs(30));
    assert_eq!(a.log_format, LogFormat::Text);
    assert_eq!(a.cluster_cidrs.len(), 2);
    assert_eq!(a.nodeport_addresses.unwrap().to_string(), "192.0.2.0/24");
    assert_eq!(
        a.healthz_bind_address,
        Some("0.0.0.0:20256".parse().unwrap())
    );
    // The file's minSyncPeriod is checked against a flag's sync period too.
    let e = resolve(&["--sync-period", "2s"], Some(FILE)).unwrap_err();
    assert!(
        e.to_string().contains(
            "--min-sync-period (5s, the config file's minSyncPeriod) is longer than --sync-period (2s)"
        ),
        "{e}"
    );
    let e = resolve(&["--sync-period", "30s", "--min-sync-period", "1m"], None).unwrap_err();
    assert!(
        e.to_string()
            .contains("--min-sync-period (1m0s) is longer than --sync-period (30s)"),
        "{e}"
    );
    let e = resolve(&["--min-sync-period", "1m"], None).unwrap_err();
    assert!(
        e.to_string()
            .contains("--min-sync-period (1m0s) is longer than --sync-period (30s, the default)"),
        "{e}"
    );
    assert!(flags_err(&["--sync-period", "9999999999999s"]).contains("8760h"));
}

/// The example of the guide's configuration file chapter.
#[test]
fn guide_example_is_valid_and_quiet() {
    let guide = include_str!("../../../docs/src/reference/configuration.md");
    let section = &guide[guide.find("# Configuration file").expect("section")..];
    let start = section.find("```yaml\n").expect("yaml block") + "```yaml\n".len();
    let example = &section[start..start + section[start..].find("```").unwrap()];
    let l = parse(example).unwrap();
    assert_eq!(l.warnings, Vec::<String>::new());
    assert_eq!(l.settings.log_format, Some(LogFormat::Json));
    assert_eq!(l.settings.sync_period, Some(Duration::from_secs(30)));
}

#[test]
fn type_errors_of_the_file_name_no_rust_types() {
    for text in [
        "enableProfiling: 3\n",
        "clientConnection:\n  kubeconfig: [x]\n",
        "featureGates: {A: maybe}\n",
        "ipvs: [1]\n",
        "bindAddressHardFail: null\nmode: {a: 1}\n",
    ] {
        let e = format!("{:#}", parse(&body(text)).unwrap_err());
        for rust in ["invalid type", "u32", "i64", "struct ", "bool", "column"] {
            assert!(!e.contains(rust), "{text:?}: {e}");
        }
        assert!(e.contains("expected "), "{text:?}: {e}");
    }
    assert_eq!(
        plain_type_error("invalid type: string \"x\", expected u32 at line 4 column 7"),
        "expected a whole number, found the string \"x\""
    );
    assert_eq!(plain_type_error("something else"), "something else");
    for number in ["99999999999999999999", "-99999999999999999999"] {
        let e = format!(
            "{:#}",
            parse(&body(&format!("oomScoreAdj: {number}\n"))).unwrap_err()
        );
        assert!(
            e.contains(&format!(
                "oomScoreAdj: expected a whole number that fits its field, found the number {number} (line 3)"
            )),
            "{e}"
        );
        assert!(!e.contains('`') && !e.contains("128"), "{e}");
    }
}

#[test]
fn ranged_flags_say_their_range_in_words() {
    for (arg, expected) in [
        ("--max-frontends=0", "must be a number from 1 to 4294967295"),
        ("--max-sockets=x", "must be a number from 1 to 4294967295"),
        ("--healthz-port=70000", "must be a number from 0 to 65535"),
        ("--metrics-port=-1", "must be a number from 0 to 65535"),
        (
            "--oom-score-adj=5000",
            "must be a number from -1000 to 1000",
        ),
        (
            "--conntrack-max-per-core=-1",
            "must be a number from 0 to 16777216",
        ),
        ("-v=x", "must be a number from 0 to 4294967295"),
        (
            "--iptables-masquerade-bit=32",
            "must be a number from 0 to 31",
        ),
        (
            "--kube-api-burst=-1",
            "must be a number from 0 to 2147483647",
        ),
        (
            "--kube-api-qps=fast",
            "must be a number of queries per second",
        ),
    ] {
        let e = flags_err(&[arg]);
        assert!(e.contains(expected), "{arg}: {e}");
        assert!(!e.contains("..="), "{arg}: {e}");
        assert!(!e.contains("invalid digit"), "{arg}: {e}");
    }
    // In range, the value is taken.
    let f = flags(&[
        "--healthz-port=0",
        "--oom-score-adj=-1000",
        "--max-frontends=7",
    ]);
    assert_eq!(f.kube_proxy.healthz_port, Some(0));
    assert_eq!(f.oom_score_adj, Some(-1000));
    assert_eq!(f.max_frontends, Some(7));
}

#[test]
fn unknown_detect_local_modes_are_refused_as_kube_proxy_does() {
    let e = flags_err(&["--detect-local-mode=Bogus"]);
    assert!(
        e.contains(
            "\"Bogus\" is not a local-traffic detection mode: use ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix (or leave it empty)"
        ),
        "{e}"
    );
    // Case matters, as in kube-proxy.
    assert!(flags_err(&["--detect-local-mode=clustercidr"]).contains("not a local-traffic"));
    for m in DETECT_LOCAL_MODES.iter().chain(&[""]) {
        let c = resolve(&[&format!("--detect-local-mode={m}")], None).unwrap();
        // Only the modes without an effect here are warned about.
        assert_eq!(
            c.warnings.len(),
            usize::from(!m.is_empty() && *m != "ClusterCIDR"),
            "{m}: {:?}",
            c.warnings
        );
    }
    for m in DETECT_LOCAL_MODES {
        parse(&body(&format!("detectLocalMode: {m}\n"))).unwrap();
    }
}

#[test]
fn file_warnings_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.conf");
    std::fs::write(&path, body("fooBar: 1\nenableProfiling: true\n")).unwrap();
    let l = load(&path).unwrap();
    assert_eq!(
        l.warnings,
        [
            format!(
                "--config {}: field \"enableProfiling\" has no effect in ebpf-proxy: ignored",
                path.display()
            ),
            format!(
                "--config {}: unknown field \"fooBar\" (not in kubeproxy.config.k8s.io/v1alpha1 KubeProxyConfiguration): ignored",
                path.display()
            ),
        ]
    );
    // A type error names the file, the field and the line.
    std::fs::write(&path, body("conntrack:\n  maxPerCore: []\n")).unwrap();
    let e = format!("{:#}", load(&path).unwrap_err());
    assert!(
        e.starts_with(&format!("--config {}: ", path.display())),
        "{e}"
    );
}

/// `--socket-lb-scope` is ebpf-proxy's own, as the map sizes: `KubeProxyConfiguration` has
/// no field for it, so `--write-config-to` leaves it out (the written file runs kube-proxy
/// too) and a file cannot set it: a field of that name is reported as unknown and
/// ignored. The flag keeps its effect next to `--config`.
#[test]
fn socket_lb_scope_is_a_flag_only() {
    use crate::model::bypass::SocketLbScope;
    let c = resolve(&["--socket-lb-scope=host-only"], None).unwrap();
    assert_eq!(c.socket_lb_scope, SocketLbScope::HostOnly);
    let yaml = c.kube_proxy_configuration();
    let lower = yaml.to_lowercase();
    assert!(
        !lower.contains("socketlb") && !lower.contains("host-only"),
        "{yaml}"
    );
    let back = AgentConfig::resolve(flags(&[]), Some(parse(&yaml).unwrap().settings)).unwrap();
    assert_eq!(
        back.socket_lb_scope,
        SocketLbScope::All,
        "not carried by the file"
    );
    let both = AgentConfig::resolve(
        flags(&["--socket-lb-scope=host-only"]),
        Some(parse(&yaml).unwrap().settings),
    )
    .unwrap();
    assert_eq!(
        both.socket_lb_scope,
        SocketLbScope::HostOnly,
        "the flag with --config"
    );

    let loaded = parse(&body("socketLBScope: host-only\n")).unwrap();
    assert_eq!(
        loaded.warnings,
        [format!(
            "--config: unknown field \"socketLBScope\" (not in {API_VERSION} {KIND}): ignored"
        )]
    );
    let c = AgentConfig::resolve(flags(&[]), Some(loaded.settings)).unwrap();
    assert_eq!(c.socket_lb_scope, SocketLbScope::All);
}

/// The defaults the help states in words are the defaults applied ([`super::defaults`]).
#[test]
fn help_states_the_defaults_applied() {
    use super::defaults as d;
    use super::go::parse_go_duration;
    let cmd = RunFlags::augment_args(clap::Command::new("ebpf-proxy"));
    let stated = |long: &str| -> String {
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_long() == Some(long))
            .unwrap_or_else(|| panic!("--{long}"));
        let help = arg.get_long_help().or(arg.get_help()).unwrap().to_string();
        let start = help.rfind("[default: ").expect("a stated default") + "[default: ".len();
        help[start..start + help[start..].find(']').unwrap()].to_string()
    };
    let duration = |long: &str| parse_go_duration(&stated(long)).unwrap();
    assert_eq!(duration("min-sync-period"), d::DEFAULT_MIN_SYNC_PERIOD);
    assert_eq!(duration("sync-period"), d::DEFAULT_SYNC_PERIOD);
    assert_eq!(duration("udp-flow-timeout"), d::DEFAULT_UDP_FLOW_TIMEOUT);
    assert_eq!(
        duration("conntrack-tcp-timeout-established"),
        d::DEFAULT_CT_TCP_ESTABLISHED
    );
    assert_eq!(
        duration("conntrack-udp-timeout-stream"),
        d::DEFAULT_CT_UDP_STREAM
    );
    for (long, value) in [
        (
            "metrics-bind-address",
            d::metrics_bind_address(false).to_string(),
        ),
        (
            "healthz-bind-address",
            d::healthz_bind_address(false).to_string(),
        ),
        ("status-bind-address", d::status_bind_address().to_string()),
        ("maglev-table-size", d::MAGLEV_DEFAULT.to_string()),
        ("max-frontends", d::DEFAULT_MAX_FRONTENDS.to_string()),
        ("max-backend-slots", d::DEFAULT_MAX_SLOTS.to_string()),
        ("max-backends", d::DEFAULT_MAX_BACKENDS.to_string()),
        ("max-sockets", d::DEFAULT_MAX_SOCKETS.to_string()),
        (
            "conntrack-max-per-core",
            d::DEFAULT_CONNTRACK_MAX_PER_CORE.to_string(),
        ),
        ("conntrack-min", d::DEFAULT_CONNTRACK_MIN.to_string()),
        ("oom-score-adj", d::DEFAULT_OOM_SCORE_ADJ.to_string()),
        ("log-format", LogFormat::default().name().to_string()),
    ] {
        assert_eq!(stated(long), value, "--{long}");
    }
    assert!(stated("log-level").starts_with(d::DEFAULT_LOG_LEVEL));
}

/// The `KubeProxyConfiguration` fields the table of `settings` names, as its messages name
/// them, are the document's own: each is in the written-back document under that path
/// (`nodePortAddresses` is written when set).
#[test]
fn the_settings_table_names_the_documents_fields() {
    let yaml = resolve(&["--nodeport-addresses=primary"], None)
        .unwrap()
        .kube_proxy_configuration();
    let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&yaml).unwrap();
    for path in settings::FIELDS {
        let mut v = &doc;
        for key in path.split('.') {
            v = v
                .get(key)
                .unwrap_or_else(|| panic!("{path} is not in\n{yaml}"));
        }
    }
}

#[test]
fn udp_flow_timeout_flag_takes_what_the_file_takes() {
    // The written-back file holds the flag's value as conntrack.udpTimeout, which must be
    // read back: under 1 ms is refused on the command line as in the file.
    for v in ["1ns", "500us"] {
        let e = flags_err(&["--udp-flow-timeout", v]);
        assert!(e.contains("too short (at least 1ms)"), "{v}: {e}");
    }
    assert!(flags_err(&["--udp-flow-timeout", "0s"]).contains("greater than zero"));
    let a = resolve(
        &["--manifests", "/tmp/m", "--udp-flow-timeout", "1ms"],
        None,
    )
    .unwrap();
    assert_eq!(a.udp_flow_timeout, Duration::from_millis(1));
}

#[test]
fn a_sync_period_over_a_year_is_named_where_it_came_from() {
    let e = resolve(
        &["--manifests", "/tmp/m"],
        Some(&body("iptables:\n  syncPeriod: 9000h\n")),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("the config file's syncPeriod must be at most 8760h"),
        "{e}"
    );
}

#[test]
fn a_hostname_override_must_be_a_node_name() {
    // Trimmed and lowercased first, as kube-proxy does; then a DNS subdomain.
    let c = resolve(&["--hostname-override", " MyNode.Example.COM "], None).unwrap();
    assert_eq!(c.hostname_override.as_deref(), Some("mynode.example.com"));
    let long = format!(
        "{}.{}.{}.{}",
        "a".repeat(63),
        "b".repeat(63),
        "c".repeat(63),
        "d".repeat(61)
    );
    assert_eq!(long.len(), 253);
    assert!(resolve(&["--hostname-override", &long], None).is_ok());
    for bad in [
        "a b",
        "node,x=y",
        "-node",
        "node-",
        "a..b",
        "nöde",
        &format!("{long}e"),
    ] {
        let e = resolve(&["--hostname-override", bad], None)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("--hostname-override: ") && e.contains("is not a valid node name"),
            "{bad:?}: {e}"
        );
    }
    let e = format!(
        "{:#}",
        parse(&body("hostnameOverride: \"node,other\"\n")).unwrap_err()
    );
    assert!(
        e.starts_with("hostnameOverride: \"node,other\" is not a valid node name"),
        "{e}"
    );
}

#[test]
fn write_config_to_refuses_a_pin_dir_that_is_no_plain_name() {
    for bad in ["../../etc", "", "a/b", "x.y"] {
        let e = resolve(
            &["--write-config-to", "/tmp/x.yaml", "--pin-dir", bad],
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("must be a plain name"), "{bad:?}: {e}");
    }
    assert!(resolve(&["--pin-dir", "ebpf-proxy_2"], None).is_ok());
}

#[test]
fn empty_cluster_cidr_and_nodeport_addresses_flags_are_as_if_not_given() {
    // kube-proxy's defaults are empty: a DaemonSet may pass them from an empty variable.
    let c = resolve(&["--cluster-cidr", "", "--nodeport-addresses", " "], None).unwrap();
    assert!(c.cluster_cidrs.is_empty());
    assert_eq!(c.nodeport_addresses, None);
    let file = "clusterCIDR: 10.244.0.0/16\nnodePortAddresses: [primary]\n";
    let c = resolve(
        &["--cluster-cidr=", "--nodeport-addresses="],
        Some(&body(file)),
    )
    .unwrap();
    assert_eq!(
        c.cluster_cidrs,
        vec!["10.244.0.0/16".parse::<ipnet::IpNet>().unwrap()]
    );
    assert_eq!(c.nodeport_addresses, Some(NodePortAddresses::Primary));
}
