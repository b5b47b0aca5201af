//! The anchors: the floor programs, and Katran's balancer when its object is given.

use super::*;

/// The floor's programs (proxy-ebpf/src/bin/floor.rs): direct access, the helpers'
/// access, and empty (what the measurement adds), per hook.
pub(super) const FLOOR_TC: &str = "floor_tc";
pub(super) const FLOOR_TC_HELPERS: &str = "floor_tc_helpers";
pub(super) const FLOOR_TC_PASS: &str = "floor_tc_pass";
pub(super) const FLOOR_XDP: &str = "floor_xdp";
pub(super) const FLOOR_XDP_HELPERS: &str = "floor_xdp_helpers";
pub(super) const FLOOR_XDP_PASS: &str = "floor_xdp_pass";

/// The floor object loaded, its flow table holding the flow of the tracked TCP case
/// (client:40000 -> node port 30080, to 10.0.1.5:8080 on ifindex 1).
pub(super) fn floor_object(path: &Path) -> Result<Object> {
    let mut ebpf = EbpfLoader::new()
        .load_file(path)
        .with_context(|| format!("load {}", path.display()))?;
    for p in [FLOOR_TC, FLOOR_TC_HELPERS, FLOOR_TC_PASS] {
        let prog: &mut SchedClassifier = ebpf.program_mut(p).context(p)?.try_into()?;
        prog.load().with_context(|| format!("load {p}"))?;
    }
    for p in [FLOOR_XDP, FLOOR_XDP_HELPERS, FLOOR_XDP_PASS] {
        let prog: &mut Xdp = ebpf.program_mut(p).context(p)?.try_into()?;
        prog.load().with_context(|| format!("load {p}"))?;
    }
    // FloorKey and FloorTarget of proxy-ebpf/src/bin/floor.rs.
    let ip = |s: &str| s.parse::<std::net::Ipv4Addr>().expect("address").octets();
    let mut key = [0u8; 16];
    key[0..4].copy_from_slice(&ip(CLIENT));
    key[4..8].copy_from_slice(&ip(NODE));
    key[8..10].copy_from_slice(&40000u16.to_be_bytes());
    key[10..12].copy_from_slice(&30080u16.to_be_bytes());
    key[12..16].copy_from_slice(&6u32.to_le_bytes());
    let mut to = [0u8; 12];
    to[0..4].copy_from_slice(&ip(LOCAL));
    to[4..6].copy_from_slice(&8080u16.to_be_bytes());
    to[8..12].copy_from_slice(&1u32.to_ne_bytes());
    let mut flows: BpfHash<&mut MapData, [u8; 16], [u8; 12]> =
        BpfHash::try_from(ebpf.map_mut("FLOOR_FLOWS").context("FLOOR_FLOWS")?)?;
    flows.insert(key, to, 0)?;
    Ok(Object { ebpf, lru: false })
}

pub(super) fn floor_cases() -> Vec<Case> {
    let frame = data(CLIENT, 40000, NODE, 30080);
    let floor = |name, prog, hook, verdict| {
        Case::new(name, prog, hook, Like::Anchor)
            .object("floor")
            .verdict(verdict)
            .frame(frame.clone())
    };
    vec![
        floor("floor: tc, direct access", FLOOR_TC, Hook::Tc, REDIRECT),
        floor(
            "floor: tc, through the skb helpers",
            FLOOR_TC_HELPERS,
            Hook::Tc,
            REDIRECT,
        ),
        floor("floor: tc, empty program", FLOOR_TC_PASS, Hook::Tc, PASS),
        floor(
            "floor: XDP, direct access",
            FLOOR_XDP,
            Hook::Xdp,
            XDP_REDIRECT,
        ),
        floor(
            "floor: XDP, through bpf_xdp_load/store_bytes",
            FLOOR_XDP_HELPERS,
            Hook::Xdp,
            XDP_REDIRECT,
        ),
        floor(
            "floor: XDP, empty program",
            FLOOR_XDP_PASS,
            Hook::Xdp,
            XDP_PASS,
        ),
    ]
}

// ---------------------------------------------------------------------------------------

/// Katran's `struct flow_key` (balancer_structs.h): `src[16]`, `dst[16]`, ports, proto, pad.
pub(super) type KatranFlowKey = [u8; 40];
/// `RING_SIZE` (balancer_consts.h): ring positions per VIP.
pub(super) const KATRAN_RING: u32 = 65537;
/// `F_LRU_BYPASS` (balancer_consts.h, VIP flags).
pub(super) const KATRAN_F_LRU_BYPASS: u32 = 1 << 1;
pub(super) const KATRAN_PROG: &str = "balancer_ingress";
/// The tester's client and VIPs (KatranTestFixtures.h).
pub(super) const K_CLIENT: &str = "192.168.1.1";
pub(super) const K_VIP: &str = "10.200.1.1";
pub(super) const K_VIP_BYPASS: &str = "10.200.1.2";

pub(super) fn katran_object(path: &Path) -> Result<Object> {
    let mut ebpf = EbpfLoader::new()
        .map_max_entries("ch_rings", 2 * KATRAN_RING)
        .map_max_entries("fallback_cache", 65536)
        .load_file(path)
        .with_context(|| format!("load {}", path.display()))?;
    let prog: &mut Xdp = ebpf
        .program_mut(KATRAN_PROG)
        .context(KATRAN_PROG)?
        .try_into()?;
    prog.load().context("load balancer_ingress")?;
    let ip = |s: &str| s.parse::<std::net::Ipv4Addr>().expect("address").octets();
    // vip_map: struct vip_definition {addr[16], port (network order), proto, pad} ->
    // struct vip_meta {flags, vip_num}.
    {
        let mut vips: BpfHash<&mut MapData, [u8; 20], [u8; 8]> =
            BpfHash::try_from(ebpf.map_mut("vip_map").context("vip_map")?)?;
        for (num, (vip, flags)) in [(K_VIP, 0u32), (K_VIP_BYPASS, KATRAN_F_LRU_BYPASS)]
            .into_iter()
            .enumerate()
        {
            let mut k = [0u8; 20];
            k[0..4].copy_from_slice(&ip(vip));
            k[16..18].copy_from_slice(&80u16.to_be_bytes());
            k[18] = 6;
            let mut v = [0u8; 8];
            v[0..4].copy_from_slice(&flags.to_ne_bytes());
            v[4..8].copy_from_slice(&(num as u32).to_ne_bytes());
            vips.insert(k, v, 0)?;
        }
    }
    // reals: id -> struct real_definition {dst[16], flags, pad}; ids start at 1.
    {
        let mut reals: Array<&mut MapData, [u8; 20]> =
            Array::try_from(ebpf.map_mut("reals").context("reals")?)?;
        for id in 1..=3u32 {
            let mut r = [0u8; 20];
            r[0..4].copy_from_slice(&ip(&format!("10.0.0.{id}")));
            reals.set(id, r, 0)?;
        }
    }
    // ch_rings: vip_num * RING_SIZE + position -> real id.
    {
        let mut ring: Array<&mut MapData, u32> =
            Array::try_from(ebpf.map_mut("ch_rings").context("ch_rings")?)?;
        for vip in 0..2 {
            for pos in 0..KATRAN_RING {
                ring.set(vip * KATRAN_RING + pos, pos % 3 + 1, 0)?;
            }
        }
    }
    // ctl_array[0]: the default router's MAC (kDefaultMac).
    {
        let mut ctl: Array<&mut MapData, [u8; 8]> =
            Array::try_from(ebpf.map_mut("ctl_array").context("ctl_array")?)?;
        ctl.set(0, [0x00, 0x00, 0xde, 0xad, 0xbe, 0xaf, 0, 0], 0)?;
    }
    Ok(Object { ebpf, lru: true })
}

pub(super) fn katran_cases() -> Vec<Case> {
    vec![
        Case::new(
            "Katran: TCP data, known flow (LRU hit)",
            KATRAN_PROG,
            Hook::Xdp,
            Like::Anchor,
        )
        .object("katran")
        .prime(KATRAN_PROG, syn(K_CLIENT, 31337, K_VIP, 80), XDP_TX)
        .verdict(XDP_TX)
        .frame(data(K_CLIENT, 31337, K_VIP, 80)),
        Case::new(
            "Katran: SYN of a new flow",
            KATRAN_PROG,
            Hook::Xdp,
            Like::Anchor,
        )
        .object("katran")
        .verdict(XDP_TX)
        .per_sample(|i| syn(K_CLIENT, (NEW_PORT_BASE + i) as u16, K_VIP, 80)),
        Case::new(
            "Katran: TCP data, LRU bypassed (its perf-testing mode)",
            KATRAN_PROG,
            Hook::Xdp,
            Like::Anchor,
        )
        .object("katran")
        .verdict(XDP_TX)
        .frame(data(K_CLIENT, 31337, K_VIP_BYPASS, 80)),
    ]
}

// ---------------------------------------------------------------------------------------
