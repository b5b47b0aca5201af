//! Which new north-south flows are admitted and how (for `nat`'s `try_new_flow` and
//! `dsr_flow`): an LB IP's source ranges, a backend of the packet's family, whether the flow
//! is source-NATed (kube-proxy's masquerading rules, `--masquerade-all`, `--cluster-cidr`)
//! and whether an interface's node address can be the SNAT source.

use aya_ebpf::btf_maps::lpm_trie::Key;
use proxy_common::{
    FRONTEND_F_LOCAL_ONLY, Frontend, is_v4_mapped,
    nat::{
        SOURCE_RANGE_RESTRICTED, SourceRange, TC_CFG_CLUSTER_CIDR_V4, TC_CFG_CLUSTER_CIDR_V6,
        TC_CFG_MASQUERADE_ALL,
    },
};

use crate::maps::{TC_CONFIG, TC_LOCAL_ENDPOINTS, TC_SOURCE_RANGES};

/// Whether backend address `a` is not of the packet's family. Its own BPF function: inline,
/// the comparison costs `new_flow` about 100 bytes of stack.
#[inline(never)]
pub fn other_family(a: &[u8; 16], v6: bool) -> bool {
    is_v4_mapped(a) == v6
}

/// Whether `a`, read from `IfaceAddr`, is a node address of the family (all zero: none).
/// For IPv6, the agent writes global or unique-local addresses only, none of them in
/// `::/8` (reserved: the unspecified, loopback and IPv4-mapped addresses live there), so
/// the first byte tells.
#[inline(always)]
pub fn snat_addr_usable(a: &[u8; 16], v6: bool) -> bool {
    if v6 { a[0] != 0 } else { is_v4_mapped(a) }
}

/// Whether a new flow of `fe` from `client` to backend `addr` is source-NATed:
/// - never with a Local policy (the client address is kept, KEP-1672 / KEP-2086);
/// - with `--masquerade-all` always (kube-proxy's meaning);
/// - for a cluster IP, when the client is outside `--cluster-cidr`'s prefix of its family
///   (kube-proxy masquerades off-cluster traffic to cluster IPs);
/// - when the backend is on another node: its replies must come back through this node
///   to be translated. (kube-proxy masquerades every Cluster-policy external flow; here a
///   flow to a backend on this node keeps the client address, as Cilium does.)
#[inline(always)]
pub fn needs_snat(fe: &Frontend, addr: &[u8; 16], client: &[u8; 16], cluster_ip: bool) -> bool {
    if fe.flags & FRONTEND_F_LOCAL_ONLY != 0 {
        return false;
    }
    if let Some(cfg) = TC_CONFIG.get(0) {
        if cfg.flags & TC_CFG_MASQUERADE_ALL != 0 {
            return true;
        }
        let v4 = is_v4_mapped(client);
        if cluster_ip && !v4 && cfg.flags & TC_CFG_CLUSTER_CIDR_V6 != 0 && outside_cidr6(client) {
            return true;
        }
        if cluster_ip && v4 && cfg.flags & TC_CFG_CLUSTER_CIDR_V4 != 0 {
            let len = cfg.cluster_cidr_v4_len as u32;
            let mask = if len == 0 {
                0
            } else {
                u32::MAX << (32 - len.min(32))
            };
            let c = u32::from_be_bytes([client[12], client[13], client[14], client[15]]);
            let n = u32::from_be_bytes(cfg.cluster_cidr_v4);
            if c & mask != n & mask {
                return true;
            }
        }
    }
    TC_LOCAL_ENDPOINTS.get_ptr(*addr).is_none()
}

/// Whether IPv6 client `a` is outside the IPv6 `--cluster-cidr` (`TC_CONFIG`). Its own BPF
/// function: the 64-bit halves would otherwise take `new_flow`'s stack.
#[inline(never)]
fn outside_cidr6(a: &[u8; 16]) -> bool {
    match TC_CONFIG.get(0) {
        Some(cfg) => !in_prefix6(a, &cfg.cluster_cidr_v6, cfg.cluster_cidr_v6_len),
        None => false,
    }
}

/// Whether IPv6 address `a` is in `net`/`len` (both network byte order).
#[inline(always)]
fn in_prefix6(a: &[u8; 16], net: &[u8; 16], len: u8) -> bool {
    let len = len.min(128) as u32;
    let (mh, ml) = (mask64(len), mask64(len.saturating_sub(64)));
    let (ah, al) = halves(a);
    let (nh, nl) = halves(net);
    ah & mh == nh & mh && al & ml == nl & ml
}

/// The first `len` (0..=64; more counts as 64) bits set.
#[inline(always)]
fn mask64(len: u32) -> u64 {
    if len == 0 {
        0
    } else if len >= 64 {
        u64::MAX
    } else {
        u64::MAX << (64 - len)
    }
}

/// An address as two big-endian 64-bit halves.
#[inline(always)]
fn halves(a: &[u8; 16]) -> (u64, u64) {
    (
        u64::from_be_bytes([a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]]),
        u64::from_be_bytes([a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]]),
    )
}

/// `spec.loadBalancerSourceRanges`: true when `dst` is a restricted LB IP and `src` is in
/// none of its ranges.
#[inline(always)]
pub fn denied_by_source_ranges(dst: &[u8; 16], src: &[u8; 16]) -> bool {
    let key = Key::new(
        256,
        SourceRange {
            lb_addr: *dst,
            client: *src,
        },
    );
    matches!(TC_SOURCE_RANGES.get(&key), Some(v) if *v == SOURCE_RANGE_RESTRICTED)
}
