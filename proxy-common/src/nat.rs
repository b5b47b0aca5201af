//! Layouts of the north-south data path: the tc (tcx) programs on the node's external
//! interfaces that serve NodePorts, external IPs and load balancer IPs to traffic from
//! outside the node. Same conventions as the crate root: `#[repr(C)]`, explicit
//! padding, addresses `[u8; 16]` in network byte order (IPv4 stored IPv4-mapped), ports
//! `[u8; 2]` in network byte order.
//!
//! IPv4 and IPv6 flows share every map: an IPv6 flow's keys and entries hold plain IPv6
//! addresses, an IPv4 flow's IPv4-mapped ones, and the two never meet (the programs pass
//! IPv6 packets that carry an IPv4-mapped address untouched: such addresses must not
//! appear on the wire, RFC 4291 section 2.5.5.2, and the kernel drops them).
//!
//! Connection tracking: one LRU map, [`CONNTRACK`], holds two entries per translated flow
//! (three with SNAT), each of the form "a packet with this tuple is rewritten to that
//! tuple":
//! - the *original* entry, keyed by the packet the client sends (client -> frontend), says
//!   client -> backend (DNAT, at ingress);
//! - with SNAT, the *SNAT stage* ([`CT_F_EGRESS`]), keyed client -> backend, says
//!   node address:port -> backend (at egress, after routing);
//! - the *reply* entry, keyed by the packet the backend sends back (backend -> node
//!   address:port, or backend -> client), says frontend -> client.
//!
//! Reversing an entry's rewritten tuple gives the key of the other entry, so either
//! direction can update the other (TCP state, liveness). A reply entry with SNAT is also the
//! SNAT binding (node address, node port) -> flow: the port is free when no live reply entry
//! uses it.

/// Name of the conntrack map: [`CtKey`] -> [`CtEntry`] (BPF_MAP_TYPE_LRU_HASH).
pub const CONNTRACK: &str = "TC_CONNTRACK";
/// Name of the node-local endpoint map: endpoint address `[u8; 16]` -> `u32` (1)
/// (BPF_MAP_TYPE_HASH). Written by the agent from the EndpointSlices' `nodeName`: a backend
/// listed here runs on this node and is reached without SNAT.
pub const LOCAL_ENDPOINTS: &str = "TC_LOCAL_ENDPOINTS";
/// Name of the SNAT address map: ifindex `u32` -> [`IfaceAddr`] (BPF_MAP_TYPE_HASH): the
/// node addresses (one per family) that a flow arriving on that interface is masqueraded to.
pub const IFACE_ADDRS: &str = "TC_IFACE_ADDRS";
/// Name of the tc configuration map: index 0 -> [`TcConfig`] (BPF_MAP_TYPE_ARRAY).
pub const TC_CONFIG: &str = "TC_CONFIG";
/// Name of the conntrack clock map: index 0 -> [`CtClock`] (BPF_MAP_TYPE_ARRAY). Never
/// pinned: each load of the object has its own, written by the agent before it attaches
/// any of that load's programs.
pub const CT_CLOCK: &str = "TC_CT_CLOCK";
/// Name of the per-CPU tc counter map: [`TcCounter`] as `u32` index -> `u64`
/// (BPF_MAP_TYPE_PERCPU_ARRAY, [`TC_COUNTER_MAX`] entries).
pub const TC_COUNTERS: &str = "TC_COUNTERS";
/// Name of the source range map: `Key<`[`SourceRange`]`>` -> `u32` (BPF_MAP_TYPE_LPM_TRIE).
pub const SOURCE_RANGES: &str = "TC_SOURCE_RANGES";

/// Name of the least-connections flow map: original-direction [`CtKey`] -> backend id `u32`
/// (BPF_MAP_TYPE_HASH, [`CONNTRACK`]'s size / 2 entries). One entry per tc flow of a
/// least-connections Service that is counted in [`crate::LC_COUNTS`]; removing the entry is
/// what gives the count back, so each flow is released exactly once (a map delete succeeds
/// once): by the tc program when the flow closes (FIN both ways or RST) or its tuple starts a
/// new flow, or by the agent's periodic collection (the `tc_lc_gc` program run through
/// `BPF_PROG_TEST_RUN`) when its conntrack entry timed out or was evicted.
pub const LC_FLOWS: &str = "TC_LC_FLOWS";

/// Name of the tail-call table of the tc programs (BPF_MAP_TYPE_PROG_ARRAY, `u32` slot ->
/// program, [`TAIL_SLOTS`] entries). Not pinned: whoever loads `tc_ingress` or
/// `pod_ingress` fills the table of its own load ([`TAIL_REJECT`]).
pub const TAILS: &str = "TC_TAILS";
/// Number of slots of [`TAILS`].
pub const TAIL_SLOTS: u32 = 1;
/// Slot of [`TAILS`] holding `tc_reject`, the program that answers a packet to a frontend
/// without endpoints with an ICMP / ICMPv6 port unreachable. A program of its own, reached
/// by a tail call, so its instructions are verified once and not on each of its callers'
/// paths (whose verification is close to the kernel's limit of one million instructions).
pub const TAIL_REJECT: u32 = 0;
/// Name of the direct server return map: [`DsrKey`] -> [`DsrTarget`] (BPF_MAP_TYPE_HASH,
/// [`MAX_DSR`] entries), written by the agent of the backend's node.
///
/// Direct server return (DSR): the node a client's packet enters (the entry node) picks a
/// backend on another node as usual, then, instead of source-NATing the flow, sends the
/// client's packet on *unchanged*, encapsulated in an outer IP header of the same family
/// (IPIP, protocol 4, for IPv4; IPv6-in-IPv6, next header 41, for IPv6; RFC 2003 / RFC
/// 2473): outer source the entry node's address, outer destination the backend's address,
/// routed as any packet to that pod. The original frontend address and port travel as the
/// inner packet's destination, the client's address and port as its source, so nothing
/// else needs carrying. The backend's node finds the encapsulated packet at tcx ingress of
/// its external interface (outer destination one of its endpoints), looks the frontend and
/// the backend up here, strips the outer header, translates the inner packet to the backend
/// and tracks the flow, whose replies leave that node with the frontend as their source,
/// straight to the client. The backend sees the client's address; the entry node never
/// sees a reply.
///
/// One entry per (frontend of a DSR Service port, endpoint of it on this node): a node
/// port's frontend address is all zero (a node port is served on every node's addresses,
/// and the packet names the entry node's), an external or load balancer IP's is that
/// address. Only packets whose (frontend, outer destination) pair is listed are accepted.
pub const DSR: &str = "TC_DSR";
/// `max_entries` of [`DSR`].
pub const MAX_DSR: u32 = 65536;
/// Bytes the DSR encapsulation adds to an IPv4 packet (the outer IPv4 header).
pub const DSR_OVERHEAD_V4: u32 = 20;
/// Bytes the DSR encapsulation adds to an IPv6 packet (the outer IPv6 header).
pub const DSR_OVERHEAD_V6: u32 = 40;

/// Every map of the tc data path, pinned next to the maps of [`crate::ALL_MAPS`].
pub const TC_MAPS: [&str; 8] = [
    CONNTRACK,
    LOCAL_ENDPOINTS,
    IFACE_ADDRS,
    TC_CONFIG,
    TC_COUNTERS,
    SOURCE_RANGES,
    LC_FLOWS,
    DSR,
];

/// Default `max_entries` of [`CONNTRACK`] (two entries per flow, three with SNAT). The agent
/// sizes it from `--conntrack-min` / `--conntrack-max-per-core` at creation.
pub const DEFAULT_MAX_CONNTRACK: u32 = 131072;
/// `max_entries` of [`LOCAL_ENDPOINTS`].
pub const MAX_LOCAL_ENDPOINTS: u32 = 65536;
/// `max_entries` of [`IFACE_ADDRS`].
pub const MAX_IFACES: u32 = 64;
/// `max_entries` of [`SOURCE_RANGES`].
pub const MAX_SOURCE_RANGES: u32 = 16384;
/// Number of entries in [`TC_COUNTERS`].
pub const TC_COUNTER_MAX: u32 = 32;

/// Lowest SNAT source port (the kernel's default `ip_local_port_range` starts at 32768).
pub const SNAT_PORT_MIN: u16 = 32768;
/// Number of SNAT source ports, `SNAT_PORT_MIN..SNAT_PORT_MIN + SNAT_PORT_COUNT` (up to
/// 60999, the end of the kernel's default range).
pub const SNAT_PORT_COUNT: u16 = 28232;
/// Lowest client source port a source-NATed flow keeps (when no live flow holds it): a
/// client port below it (a privileged one) is never reused, as netfilter's masquerade
/// maps those only to privileged ports.
pub const SNAT_KEEP_PORT_MIN: u16 = 1024;
/// SNAT ports tried for a new flow (the client's own first, see [`SNAT_KEEP_PORT_MIN`],
/// then random ones) before it is dropped and counted as
/// [`TcCounter::SnatPortsExhausted`].
pub const SNAT_PORT_TRIES: u32 = 16;

/// Conntrack timeouts (nanoseconds). TCP: an opening flow (no reply yet) as the kernel's
/// `nf_conntrack_tcp_timeout_syn_sent` (120 s); an established one as kube-proxy's
/// `--conntrack-tcp-timeout-established` default (24 h); a closing one (RST, or FIN seen in
/// both directions) as kube-proxy's `--conntrack-tcp-timeout-close-wait` (1 h is the
/// kernel's close-wait, kube-proxy sets 1 h; closed flows here use 10 s, the kernel's
/// `nf_conntrack_tcp_timeout_close`, so a closed port is reusable quickly). UDP: 30 s
/// unreplied and 120 s once replied, the kernel's `nf_conntrack_udp_timeout(_stream)`.
pub const CT_TIMEOUT_TCP_OPENING_NS: u64 = 120_000_000_000;
/// See [`CT_TIMEOUT_TCP_OPENING_NS`].
pub const CT_TIMEOUT_TCP_ESTABLISHED_NS: u64 = 86_400_000_000_000;
/// See [`CT_TIMEOUT_TCP_OPENING_NS`].
pub const CT_TIMEOUT_TCP_CLOSED_NS: u64 = 10_000_000_000;
/// Idle timeout of a direct server return flow on its entry node once the client sent its
/// FIN (the backend's is never seen there): the kernel's
/// `nf_conntrack_tcp_timeout_fin_wait`, 120 s.
pub const CT_TIMEOUT_TCP_HALF_CLOSED_NS: u64 = 120_000_000_000;
/// See [`CT_TIMEOUT_TCP_OPENING_NS`].
pub const CT_TIMEOUT_UDP_NS: u64 = 30_000_000_000;
/// See [`CT_TIMEOUT_TCP_OPENING_NS`].
pub const CT_TIMEOUT_UDP_STREAM_NS: u64 = 120_000_000_000;

/// Whether a TCP flow with conntrack `flags` is closed: a RST seen, or a FIN in each
/// direction.
#[inline(always)]
pub const fn ct_closed(flags: u16) -> bool {
    flags & CT_F_RST != 0
        || flags & (CT_F_FIN_ORIG | CT_F_FIN_REPLY) == (CT_F_FIN_ORIG | CT_F_FIN_REPLY)
}

/// Idle time in nanoseconds after which a conntrack entry of protocol `proto` with `flags`
/// is dead, given the configured timeouts of [`TcConfig`] (`tcp_established_ns`, `udp_ns`,
/// `udp_stream_ns`; 0 = the `CT_TIMEOUT_*` default). One definition for the tc programs and
/// the agent's collection of least-connections flows.
#[inline(always)]
pub const fn ct_timeout_ns(
    flags: u16,
    proto: u8,
    tcp_established_ns: u64,
    udp_ns: u64,
    udp_stream_ns: u64,
) -> u64 {
    let (configured, default) = if proto == crate::PROTO_TCP {
        if ct_closed(flags) {
            (0, CT_TIMEOUT_TCP_CLOSED_NS)
        } else if flags & (CT_F_DSR_ENCAP | CT_F_FIN_ORIG) == (CT_F_DSR_ENCAP | CT_F_FIN_ORIG) {
            // The entry node of a DSR flow after the client's FIN: the backend's FIN never
            // passes there, so the flow ends by this timeout.
            (0, CT_TIMEOUT_TCP_HALF_CLOSED_NS)
        } else if flags & CT_F_SEEN_REPLY != 0 {
            (tcp_established_ns, CT_TIMEOUT_TCP_ESTABLISHED_NS)
        } else {
            (0, CT_TIMEOUT_TCP_OPENING_NS)
        }
    } else if flags & CT_F_SEEN_REPLY != 0 {
        (udp_stream_ns, CT_TIMEOUT_UDP_STREAM_NS)
    } else {
        (udp_ns, CT_TIMEOUT_UDP_NS)
    };
    if configured != 0 { configured } else { default }
}

/// Conntrack key: a packet's tuple. 40 bytes, 8-byte aligned (so the eBPF programs build
/// and compare it in whole words, not byte by byte).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct CtKey {
    /// Source address, network byte order, IPv4-mapped for IPv4.
    pub saddr: [u8; 16],
    /// Destination address, network byte order, IPv4-mapped for IPv4.
    pub daddr: [u8; 16],
    /// Source port, network byte order.
    pub sport: [u8; 2],
    /// Destination port, network byte order.
    pub dport: [u8; 2],
    /// IANA protocol number.
    pub proto: u8,
    /// Reserved; always 0.
    pub _pad: [u8; 3],
}

/// Conntrack value: what a packet of the key's tuple is rewritten to. 56 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct CtEntry {
    /// New source address (network byte order, IPv4-mapped).
    pub saddr: [u8; 16],
    /// New destination address.
    pub daddr: [u8; 16],
    /// New source port, network byte order.
    pub sport: [u8; 2],
    /// New destination port, network byte order.
    pub dport: [u8; 2],
    /// `CT_F_*` bits.
    pub flags: u16,
    /// Reserved; always 0.
    pub _pad: u16,
    /// [`crate::Frontend::service_id`] of the flow.
    pub service_id: u32,
    /// The conntrack clock's tick ([`CT_PEER_TICK_SHIFT`]) when a packet of this entry last
    /// refreshed the other direction's entry (its `last_seen_ns` and state bits).
    pub peer_tick: u32,
    /// The conntrack clock (`CLOCK_MONOTONIC`, nanoseconds) at the last packet of the flow
    /// in this direction, or in the other direction when that one refreshed it: behind the
    /// flow's last packet by less than [`CT_PEER_LAG_NS`].
    pub last_seen_ns: u64,
}

/// The conntrack clock in ticks of 2^30 ns (about 1.07 s): a packet refreshes the other
/// direction's entry of its flow only when its state bits change or the tick moved on
/// ([`CtEntry::peer_tick`]), so a tracked packet costs one conntrack lookup rather than two.
pub const CT_PEER_TICK_SHIFT: u32 = 30;

/// How far an entry's `last_seen_ns` may lag its flow's last packet (one tick of
/// [`CT_PEER_TICK_SHIFT`]); liveness allows for it ([`ct_alive`]).
pub const CT_PEER_LAG_NS: u64 = 1 << CT_PEER_TICK_SHIFT;

/// Whether a conntrack entry last seen at `seen` is alive at `now` (nanoseconds of the
/// conntrack clock) with idle timeout `timeout_ns` ([`ct_timeout_ns`]): idle for at most the
/// timeout plus [`CT_PEER_LAG_NS`], so both directions of a flow end together, between
/// its timeout and about a second after it. One rule for the tc programs and the agent.
#[inline(always)]
pub const fn ct_alive(now: u64, seen: u64, timeout_ns: u64) -> bool {
    now.saturating_sub(seen) <= timeout_ns.saturating_add(CT_PEER_LAG_NS)
}

/// [`CtEntry::flags`]: this entry is the reply direction (backend -> client).
pub const CT_F_REPLY: u16 = 1 << 0;
/// [`CtEntry::flags`]: the flow is source-NATed to a node address.
pub const CT_F_SNAT: u16 = 1 << 1;
/// [`CtEntry::flags`]: a packet was seen in the reply direction (TCP established, UDP
/// stream).
pub const CT_F_SEEN_REPLY: u16 = 1 << 2;
/// [`CtEntry::flags`]: a FIN was seen from the client.
pub const CT_F_FIN_ORIG: u16 = 1 << 3;
/// [`CtEntry::flags`]: a FIN was seen from the backend.
pub const CT_F_FIN_REPLY: u16 = 1 << 4;
/// [`CtEntry::flags`]: a RST was seen.
pub const CT_F_RST: u16 = 1 << 5;
/// [`CtEntry::flags`]: the SNAT stage of a flow, keyed (client -> backend) and applied on
/// egress only, after the kernel routed the DNATed packet (a node address as source at
/// ingress would be dropped by routing as a martian).
pub const CT_F_EGRESS: u16 = 1 << 6;
/// [`CtEntry::flags`]: a flow started by a workload that bypasses socket-level translation
/// (see [`crate::bypass`]), tracked and rewritten only by the programs on that workload's
/// interface (`pod_ingress` its original direction, `pod_egress` its replies), never by
/// the programs of the node's external interfaces.
pub const CT_F_POD: u16 = 1 << 7;
/// [`CtEntry::flags`]: the original entry of a direct server return flow on the entry node
/// (see [`DSR`]): its packets are sent encapsulated, outer source `saddr` (the node
/// address), outer destination `daddr` (the backend), untranslated inside. The flow has no
/// reply entry there (its replies go straight to the client).
pub const CT_F_DSR_ENCAP: u16 = 1 << 8;
/// [`CtEntry::flags`]: both entries of a direct server return flow on the backend's node,
/// which arrived encapsulated (see [`DSR`]). The reply entry's SYN-ACK has its MSS option
/// lowered by the encapsulation's overhead ([`DSR_OVERHEAD_V4`], [`DSR_OVERHEAD_V6`]), so
/// that the client's segments still fit the path once encapsulated.
pub const CT_F_DSR_DECAP: u16 = 1 << 9;

/// An interface the tc programs are attached to (value of [`IFACE_ADDRS`]). 40 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct IfaceAddr {
    /// Node IPv4 address, network byte order, IPv4-mapped; all zero when the interface has
    /// none (SNAT of IPv4 flows arriving there is then impossible: counted and dropped).
    pub v4: [u8; 16],
    /// Node IPv6 address (global or unique-local scope, never link-local), network byte
    /// order; all zero when the interface has none (SNAT of IPv6 flows arriving there is
    /// then impossible: counted as [`TcCounter::NoSnatAddress`] and dropped).
    pub v6: [u8; 16],
    /// `IFACE_F_*` bits.
    pub flags: u32,
    /// Reserved; always 0.
    pub _pad: u32,
}

/// [`IfaceAddr::flags`]: a pod-facing interface (the route to this node's endpoints),
/// attached with `--masquerade-all` or `--cluster-cidr` only (both masquerade some flows to
/// local backends) so that masqueraded flows to local backends get their SNAT stage
/// (egress) and their replies (ingress) translated. No new flow starts
/// there: pods reach Services through the socket programs.
pub const IFACE_F_POD: u32 = 1 << 0;

/// tc data path configuration, index 0 of [`TC_CONFIG`]. 56 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct TcConfig {
    /// `TC_CFG_*` bits.
    pub flags: u32,
    /// `--cluster-cidr` (IPv4), network byte order; used when
    /// [`TC_CFG_CLUSTER_CIDR_V4`] is set.
    pub cluster_cidr_v4: [u8; 4],
    /// Prefix length of `cluster_cidr_v4`, 0..=32.
    pub cluster_cidr_v4_len: u8,
    /// Prefix length of `cluster_cidr_v6`, 0..=128.
    pub cluster_cidr_v6_len: u8,
    /// Reserved; always 0.
    pub _pad: [u8; 6],
    /// Idle timeout of an established TCP flow, nanoseconds
    /// (`--conntrack-tcp-timeout-established`); 0 = [`CT_TIMEOUT_TCP_ESTABLISHED_NS`].
    pub tcp_established_ns: u64,
    /// Idle timeout of a UDP flow without a reply yet, nanoseconds (`--udp-flow-timeout`,
    /// the kernel's `nf_conntrack_udp_timeout`); 0 = [`CT_TIMEOUT_UDP_NS`].
    pub udp_ns: u64,
    /// Idle timeout of a UDP flow that saw a reply, nanoseconds
    /// (`--conntrack-udp-timeout-stream`); 0 = [`CT_TIMEOUT_UDP_STREAM_NS`].
    pub udp_stream_ns: u64,
    /// `--cluster-cidr` (IPv6), network byte order; used when
    /// [`TC_CFG_CLUSTER_CIDR_V6`] is set.
    pub cluster_cidr_v6: [u8; 16],
}

/// The conntrack clock of the packet programs, index 0 of [`CT_CLOCK`]: `now` in
/// nanoseconds of `CLOCK_MONOTONIC` is `jiffies * tick_ns + offset_ns` (wrapping u64
/// arithmetic; `bpf_jiffies64`, Linux >= 5.5). Reading jiffies is a plain load where the
/// kernel's coarse clock (`bpf_ktime_get_coarse_ns`) converts a timespec on every call,
/// which cost about 30 ns of each tracked packet. The kernel advances jiffies from the
/// monotonic clock, one `tick_ns` (`TICK_NSEC`, from `CONFIG_HZ`) at a time, so the two
/// never drift apart. The agent measures both through a probe program and sets
/// `offset_ns` so that the result lags `CLOCK_MONOTONIC` by at most two ticks and is
/// never ahead of it (the agent compares the entries' `last_seen_ns` with its own
/// clock). `tick_ns` 0 (not calibrated): the programs read the coarse clock. 16 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct CtClock {
    /// Nanoseconds per jiffy (`TICK_NSEC`); 0: use the coarse clock.
    pub tick_ns: u64,
    /// Added to `jiffies * tick_ns` (wrapping: jiffies start near 2^32 at boot).
    pub offset_ns: u64,
}

/// [`TcConfig::flags`]: `--cluster-cidr` has an IPv4 prefix: a flow to a cluster IP from a
/// client outside it is source-NATed (kube-proxy's "masquerade off-cluster traffic to
/// cluster IPs").
pub const TC_CFG_CLUSTER_CIDR_V4: u32 = 1 << 1;

/// [`TcConfig::flags`]: `--cluster-cidr` has an IPv6 prefix; as
/// [`TC_CFG_CLUSTER_CIDR_V4`] for IPv6 clients.
pub const TC_CFG_CLUSTER_CIDR_V6: u32 = 1 << 2;

/// [`TcConfig::flags`]: `--masquerade-all`: every Cluster-policy flow is source-NATed,
/// local backends included.
pub const TC_CFG_MASQUERADE_ALL: u32 = 1 << 0;
/// [`TcConfig::flags`]: draining, set by `ebpf-proxy cleanup` before it detaches the
/// programs: no new flow starts (a first packet goes to the kernel untouched, where the
/// rules of whatever proxy takes over translate it), tracked flows go on, so the
/// connections open at that moment finish before the programs go.
pub const TC_CFG_DRAIN: u32 = 1 << 3;

/// Data of a source range key (LPM trie key `Key<SourceRange>`, whose `u32` prefix length
/// comes first, as the kernel's `bpf_lpm_trie_key`): (load balancer IP, client address).
/// The prefix length counts bits from the start of `lb_addr`: 128 for the LB IP alone (the "restricted" marker), and
/// 128 + the range's length in the mapped 128-bit form for an allowed range (IPv4 /n is
/// 96 + n there). Lookups use 256. Keyed by the LB IP rather than the Service because
/// `spec.loadBalancerSourceRanges` applies to the load balancer IPs only, not to node
/// ports or external IPs (kube-proxy's firewall chain); two Services sharing an LB IP share
/// the union of their ranges. 32 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct SourceRange {
    /// Load balancer IP, network byte order, IPv4-mapped.
    pub lb_addr: [u8; 16],
    /// Client address (range network), network byte order, IPv4-mapped.
    pub client: [u8; 16],
}

/// Value in [`SOURCE_RANGES`] of the marker (prefix 128, the LB IP alone): this LB IP only
/// admits the listed ranges. A lookup that ends at the marker is denied.
pub const SOURCE_RANGE_RESTRICTED: u32 = 2;
/// Value of an allowed range in [`SOURCE_RANGES`].
pub const SOURCE_RANGE_ALLOW: u32 = 1;

/// Key of [`DSR`]. 36 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct DsrKey {
    /// Frontend address (network byte order, IPv4-mapped); all zero for a node port.
    pub frontend: [u8; 16],
    /// The backend's address (the outer destination), network byte order, IPv4-mapped.
    pub backend: [u8; 16],
    /// Frontend port, network byte order.
    pub port: [u8; 2],
    /// IANA protocol number.
    pub proto: u8,
    /// Reserved; always 0.
    pub _pad: u8,
}

/// Value of [`DSR`]: where the backend listens. 4 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct DsrTarget {
    /// The backend's port (the Service port's target port on that endpoint), network byte
    /// order.
    pub port: [u8; 2],
    /// Reserved; always 0.
    pub _pad: [u8; 2],
}

/// Indices of [`TC_COUNTERS`] (per-CPU `u64`): what the tc programs did.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcCounter {
    /// A new flow to a frontend was DNATed to a backend.
    NewFlow = 0,
    /// A new flow was also source-NATed to a node address.
    Snat = 1,
    /// A packet of a tracked flow was translated (either direction).
    Translated = 2,
    /// Dropped: `externalTrafficPolicy: Local` and no endpoint on this node.
    DroppedNoLocalEndpoints = 3,
    /// Dropped: the frontend has no endpoints at all and the reject (see
    /// [`TcCounter::RejectedNoEndpoints`]) could not be built: an IPv6 packet with
    /// extension headers, or a helper failure.
    DroppedNoEndpoints = 4,
    /// Dropped: no free SNAT port after [`SNAT_PORT_TRIES`] tries.
    SnatPortsExhausted = 5,
    /// Dropped: a conntrack entry could not be written (nothing was half-applied).
    ConntrackFull = 6,
    /// Dropped: the client is outside `spec.loadBalancerSourceRanges`.
    SourceRangeDenied = 7,
    /// Dropped: a rewrite or checksum helper failed.
    RewriteFailed = 8,
    /// Dropped: SNAT needed but the interface has no node address of the family.
    NoSnatAddress = 9,
    /// An ICMP error about a translated flow was translated back.
    IcmpTranslated = 10,
    /// Dropped: a packet of a source-NATed flow whose SNAT binding is gone (its SNAT stage
    /// evicted from the LRU table, or its node port taken by another flow after its reply
    /// entry was evicted). The flow's entries are removed, so the client's next packet is
    /// that of an unknown flow (a UDP datagram starts a new flow on a free port, a TCP
    /// packet other than a SYN goes to the kernel: [`TcCounter::PassedUntracked`]) instead of
    /// mixing with another flow's.
    SnatBindingLost = 11,
    /// Left to the kernel: a TCP packet to a frontend that matches no tracked flow and does
    /// not open a connection (anything but a SYN without ACK), for a Service whose backend
    /// selection is not consistent. Picking a backend anew would break the flow the packet
    /// belongs to; the kernel's own conntrack may know it (a flow kube-proxy's rules
    /// translated before ebpf-proxy started), and otherwise answers it as the node would.
    PassedUntracked = 12,
    /// A TCP packet as in [`TcCounter::PassedUntracked`], for a Service whose selection is
    /// consistent (source-hash, maglev, destination-hash): its backend was picked again,
    /// which gives the one a lost or never-seen flow already has, so the flow carries on.
    ReselectedUntracked = 13,
    /// Rejected: the first packet of a flow to a frontend without any endpoint was answered
    /// with an ICMP / ICMPv6 port unreachable sent back out of the interface it came in on,
    /// as kube-proxy's nftables mode rejects it (a failure to build the answer is counted as
    /// [`TcCounter::DroppedNoEndpoints`]).
    RejectedNoEndpoints = 14,
    /// A packet translated in XDP and sent out of the node with `XDP_TX` or `XDP_REDIRECT`
    /// (the next hop from a FIB lookup), without the kernel's stack.
    XdpForwarded = 15,
    /// A packet XDP would have sent out itself, handed to the stack instead because the FIB
    /// lookup gave no next hop (no neighbour entry yet, no route, MTU exceeded): the tcx
    /// programs and the kernel finish it (they resolve the neighbour or answer with ICMP).
    XdpToStack = 16,
    /// A packet of a direct server return flow was sent to its backend's node encapsulated
    /// (entry node).
    DsrEncapsulated = 17,
    /// An encapsulated packet of a direct server return flow was accepted and translated to
    /// its backend (backend's node).
    DsrDecapsulated = 18,
    /// An encapsulated packet to an endpoint of this node whose frontend and backend are
    /// not a direct server return pair of [`DSR`]: left alone, for whoever tunnels to that
    /// address; or one whose inner packet, once decapsulated, is no flow of its family:
    /// dropped.
    DsrUnknown = 19,
    /// A packet of a direct server return flow too big for the path once encapsulated:
    /// answered with ICMP "fragmentation needed" / ICMPv6 "packet too big" naming the MTU
    /// left after the encapsulation (or dropped when an IPv4 packet allows fragmentation).
    DsrTooBig = 20,
}

impl TcCounter {
    /// Every counter, in index order, with its Prometheus-style name.
    pub const ALL: [(TcCounter, &'static str); 21] = [
        (TcCounter::NewFlow, "tc_new_flow"),
        (TcCounter::Snat, "tc_snat"),
        (TcCounter::Translated, "tc_translated"),
        (
            TcCounter::DroppedNoLocalEndpoints,
            "tc_dropped_no_local_endpoints",
        ),
        (TcCounter::DroppedNoEndpoints, "tc_dropped_no_endpoints"),
        (TcCounter::SnatPortsExhausted, "tc_snat_ports_exhausted"),
        (TcCounter::ConntrackFull, "tc_conntrack_full"),
        (TcCounter::SourceRangeDenied, "tc_source_range_denied"),
        (TcCounter::RewriteFailed, "tc_rewrite_failed"),
        (TcCounter::NoSnatAddress, "tc_no_snat_address"),
        (TcCounter::IcmpTranslated, "tc_icmp_translated"),
        (TcCounter::SnatBindingLost, "tc_snat_binding_lost"),
        (TcCounter::PassedUntracked, "tc_untracked_passed"),
        (TcCounter::ReselectedUntracked, "tc_untracked_reselected"),
        (TcCounter::RejectedNoEndpoints, "tc_rejected_no_endpoints"),
        (TcCounter::XdpForwarded, "xdp_forwarded"),
        (TcCounter::XdpToStack, "xdp_to_stack"),
        (TcCounter::DsrEncapsulated, "tc_dsr_encapsulated"),
        (TcCounter::DsrDecapsulated, "tc_dsr_decapsulated"),
        (TcCounter::DsrUnknown, "tc_dsr_unknown"),
        (TcCounter::DsrTooBig, "tc_dsr_too_big"),
    ];

    /// What the counter counts, in one line for operators (`ebpf-proxy stats`).
    pub const fn meaning(self) -> &'static str {
        match self {
            TcCounter::NewFlow => "new flow to a frontend DNATed to a backend",
            TcCounter::Snat => "new flow also source-NATed to the node address",
            TcCounter::Translated => "packet of a tracked flow translated",
            TcCounter::DroppedNoLocalEndpoints => "dropped: Local policy, no endpoint here",
            TcCounter::DroppedNoEndpoints => "dropped: no endpoints, reject not buildable",
            TcCounter::SnatPortsExhausted => "dropped: no free SNAT port",
            TcCounter::ConntrackFull => "dropped: conntrack entry not written",
            TcCounter::SourceRangeDenied => "dropped: client outside loadBalancerSourceRanges",
            TcCounter::RewriteFailed => "dropped: a rewrite or checksum helper failed",
            TcCounter::NoSnatAddress => "dropped: no node address of the family to SNAT to",
            TcCounter::IcmpTranslated => "ICMP error about a translated flow translated",
            TcCounter::SnatBindingLost => "dropped: the flow lost its SNAT port",
            TcCounter::PassedUntracked => {
                "mid-flow TCP packet of no tracked flow left to the kernel"
            }
            TcCounter::ReselectedUntracked => {
                "mid-flow TCP packet re-picked its (consistent) backend"
            }
            TcCounter::RejectedNoEndpoints => "answered port unreachable: no endpoints",
            TcCounter::XdpForwarded => "translated and sent out by XDP",
            TcCounter::XdpToStack => "XDP found no next hop: left to tcx and the kernel",
            TcCounter::DsrEncapsulated => "sent encapsulated to a DSR backend's node",
            TcCounter::DsrDecapsulated => "encapsulated DSR packet accepted here",
            TcCounter::DsrUnknown => "encapsulated packet of no DSR pair here",
            TcCounter::DsrTooBig => "DSR packet too big once encapsulated: ICMP sent",
        }
    }
}

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: #[repr(C)], integers and explicit padding only, valid for every bit pattern.
    unsafe impl aya::Pod for CtKey {}
    unsafe impl aya::Pod for CtEntry {}
    unsafe impl aya::Pod for IfaceAddr {}
    unsafe impl aya::Pod for TcConfig {}
    unsafe impl aya::Pod for CtClock {}
    unsafe impl aya::Pod for SourceRange {}
    unsafe impl aya::Pod for DsrKey {}
    unsafe impl aya::Pod for DsrTarget {}
}

const _: () = {
    assert!(core::mem::size_of::<CtKey>() == 40);
    assert!(core::mem::size_of::<CtEntry>() == 56);
    assert!(core::mem::size_of::<IfaceAddr>() == 40);
    assert!(core::mem::size_of::<TcConfig>() == 56);
    assert!(core::mem::size_of::<CtClock>() == 16);
    assert!(core::mem::size_of::<SourceRange>() == 32);
    assert!(core::mem::size_of::<DsrKey>() == 36);
    assert!(core::mem::size_of::<DsrTarget>() == 4);
};
