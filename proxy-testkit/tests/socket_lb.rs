//! Privileged integration tests of the socket-level data path that read or edit its maps
//! directly: the reverse-NAT slots of connected sockets (read from `SOCK_NAT` while 65
//! sockets are held open) and upgrades from older pins (entries and maps of an earlier
//! layout written before a start). The real programs are attached to a test cgroup, the
//! real agent is fed by manifests, real sockets run in pod namespaces.
//!
//! The cases that are only objects in and connections, logs and pins out (reaching
//! backends, refusals, endpoint changes, bad input, a full map, the `services` command, an
//! agent restart under an open connection, `cleanup`) are scenario files in
//! `tests/scenarios/socket/`, run by `tests/scenarios.rs`.
//!
//! Run as root with `cargo xtask test` (which builds the eBPF object first). Each test has
//! its own namespaces, cgroup and pin directory, cleaned up on drop.

mod common;

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use common::*;

const ECONNREFUSED: i64 = 111;
const VIP: &str = "198.19.0.10";

fn b(i: usize) -> IpAddr {
    IpAddr::V4(backend_v4(i))
}

/// The connected sockets' reverse-NAT slots (`SOCK_NAT`) of `env`: (slot, cookie) of each
/// slot in use, and `SOCK_NAT_SPILLED`.
fn slots_in_use(env: &Env) -> (Vec<(u32, u64)>, u32) {
    use aya::maps::{Array, Map, MapData};
    use proxy_common::{SOCK_NAT, SOCK_NAT_SPILLED, SockNat};
    let dir = env.pin_path();
    let slots: Array<MapData, SockNat> =
        Array::try_from(Map::Array(MapData::from_pin(dir.join(SOCK_NAT)).unwrap())).unwrap();
    let used = (0..slots.len())
        .map(|i| (i, slots.get(&i, 0).unwrap().key.cookie))
        .filter(|(_, c)| *c != 0)
        .collect();
    let spilled: Array<MapData, u32> = Array::try_from(Map::Array(
        MapData::from_pin(dir.join(SOCK_NAT_SPILLED)).unwrap(),
    ))
    .unwrap();
    (used, spilled.get(&0, 0).unwrap())
}

// Longer than 120 lines: the slots of sockets held open across the steps, read after each.
#[test]
fn connected_sockets_take_slots_spill_when_taken_and_free_them_on_close() {
    let mut env = Env::new("slots", 2, false);
    // 64 slots and 16 overflow entries.
    env.extra_agent_args = vec!["--max-sockets".into(), "64".into()];
    env.write_web(&Web::new(VIP).ready(&[b(0), b(1)]));
    // A Service whose endpoint refuses (nothing listens on 9999), least-connections: each
    // connect is counted, and its release must give the count back.
    let svc = service(
        "default",
        "shut",
        &["198.19.0.40"],
        &[("x", 80, 9999, "TCP")],
    )
    .replace(
        "metadata:\n",
        "metadata:\n  annotations: {ebpf-proxy.io/lb-algorithm: least-connections}\n",
    );
    let sl = slice(
        "default",
        "shut-1",
        "shut",
        "IPv4",
        &[("x", 9999, "TCP")],
        &[(b(0), true)],
    );
    env.write_manifest("shut.yaml", &format!("{svc}---\n{sl}"));
    env.start_agent();
    env.wait_maps(
        |s| s.names.values().any(|n| n.starts_with("default/shut:")),
        "shut service",
    );
    assert_eq!(slots_in_use(&env), (vec![], 0), "nothing connected yet");

    // Connects the backend refuses: a blocking one clears the socket's peer before its
    // release (a non-blocking one keeps it); the entry goes either way.
    let refused = |env: &Env| {
        let mut r = env.probe(&["tcp", "--to", "198.19.0.40:80", "--count", "2"]);
        r.extend(env.probe(&[
            "tcp",
            "--to",
            "198.19.0.40:80",
            "--count",
            "2",
            "--blocking",
        ]));
        assert!(
            r.len() == 4 && r.iter().all(|p| errno(p) == Some(ECONNREFUSED)),
            "{r:?}"
        );
    };
    refused(&env);
    assert_eq!(
        slots_in_use(&env),
        (vec![], 0),
        "failed connects hold no slot"
    );

    // 65 connections open together, 64 slots: at least one entry overflows. From one CPU,
    // whose cookies come in one contiguous batch (sockets opened on two CPUs draw from two
    // batches, whose slots overlap, and the 16 overflow entries would not be enough).
    let holder = env
        .client
        .spawn(
            Some(env.cg.path()),
            std::process::Command::new("taskset")
                .args(["-c", "0", NETPROBE, "tcp", "--to", &format!("{VIP}:80")])
                .args(["--count", "65", "--keep-open", "--hold-ms", "4000"])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null()),
        )
        .unwrap();
    // An entry the full overflow map refused (a batch of cookies ending among the 65)
    // counts as `map_update_failed`; that socket's getpeername() shows its endpoint.
    let failed = |env: &Env| {
        env.agent_json(&["stats"])["reasons"]["map_update_failed"]
            .as_u64()
            .unwrap() as u32
    };
    let t = Instant::now();
    let (used, spilled) = loop {
        let (used, spilled) = slots_in_use(&env);
        if used.len() as u32 + spilled + failed(&env) >= 65 || t.elapsed() > Duration::from_secs(5)
        {
            break (used, spilled);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let refused_entries = failed(&env);
    assert!(spilled >= 1, "65 sockets, 64 slots: spilled {spilled}");
    assert_eq!(
        used.len() as u32 + spilled + refused_entries,
        65,
        "{used:?} spilled {spilled}"
    );
    for (slot, cookie) in &used {
        assert_eq!(
            cookie & 63,
            u64::from(*slot),
            "slot = cookie & mask: {used:?}"
        );
    }
    // Operators see the spills in `stats` (and /metrics).
    let stats = env.agent_json(&["stats"]);
    assert_eq!(
        stats["reasons"]["reverse_nat_spilled"],
        u64::from(spilled),
        "{stats}"
    );
    // The reader the listing and the connection closing use sees all of them.
    let mut listed = Vec::new();
    proxy_userspace::datapath::maps::for_each_connected(&env.pin_path(), |k, v| {
        listed.push((k.cookie, ip_port(v.addr, v.port)))
    })
    .unwrap();
    assert_eq!(listed.len() as u32, 65 - refused_entries);
    assert!(
        listed.iter().all(|(_, fe)| *fe == format!("{VIP}:80")),
        "{listed:?}"
    );
    // Refused connects while every slot is taken overflow, and go all the same.
    refused(&env);
    if used.len() == 64 && spilled + 4 <= 16 {
        let after = env.agent_json(&["stats"])["reasons"]["reverse_nat_spilled"]
            .as_u64()
            .unwrap();
        assert_eq!(
            after,
            u64::from(spilled) + 4,
            "the refused connects overflowed"
        );
    }
    let done = finish_probe(holder);
    assert_eq!(done.len(), 65, "{done:?}");
    assert!(done.iter().all(|p| p["ok"] == true), "{done:?}");
    // getpeername() shows the VIP for a slot's socket and an overflowed one alike.
    let vip_peers = done
        .iter()
        .filter(|p| p["peer"] == format!("{VIP}:80"))
        .count();
    assert_eq!(vip_peers as u32, 65 - refused_entries, "{done:?}");
    // Closed: slots free, overflow entries deleted (and counted out).
    assert_eq!(
        slots_in_use(&env),
        (vec![], 0),
        "released sockets keep nothing"
    );
    let mut left = 0;
    proxy_userspace::datapath::maps::for_each_connected(&env.pin_path(), |_, _| left += 1).unwrap();
    assert_eq!(left, 0);
    let backends = env.agent_json(&["backends"]);
    let shut = backends
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["backend"] == format!("{}:9999", b(0)))
        .expect("the refusing backend");
    assert_eq!(shut["connections"], 8, "{shut}");
    assert_eq!(
        shut["active"], 0,
        "least-connections counts given back: {shut}"
    );
}

/// `addr:port` of a map's IPv4-mapped address and network-order port.
fn ip_port(addr: [u8; 16], port: [u8; 2]) -> String {
    let ip = std::net::Ipv6Addr::from(addr);
    let ip: IpAddr = match ip.to_ipv4_mapped() {
        Some(v4) => v4.into(),
        None => ip.into(),
    };
    std::net::SocketAddr::new(ip, u16::from_be_bytes(port)).to_string()
}

#[test]
fn upgrade_from_pins_without_slots_keeps_open_connections_reverse_nat() {
    use aya::maps::{Array, HashMap, Map, MapData};
    use proxy_common::{
        REVNAT_F_CONNECTED, REVNAT_SK, RevNatKey, RevNatValue, SOCK_NAT, SOCK_NAT_SPILLED,
        SPILLED_LEGACY, SockNat,
    };
    let mut env = Env::new("slots-upgrade", 1, false);
    env.write_web(&Web::new(VIP).ready(&[b(0)]));
    env.start_agent();
    let mut held = HeldTcp::open(&env.client, env.cg.path(), &format!("{VIP}:80"), &[]);
    assert_eq!(held.first["ok"], true, "{}", held.first);

    // What a version without slots leaves: the connection's entry in REVNAT_SK only, and
    // no SOCK_NAT_SPILLED pin.
    env.stop_agent();
    let dir = env.pin_path();
    let mut slots: Array<MapData, SockNat> =
        Array::try_from(Map::Array(MapData::from_pin(dir.join(SOCK_NAT)).unwrap())).unwrap();
    let (i, e) = (0..slots.len())
        .map(|i| (i, slots.get(&i, 0).unwrap()))
        .find(|(_, e)| e.key.cookie != 0)
        .expect("the held connection's slot");
    assert_ne!(e.value.flags & REVNAT_F_CONNECTED, 0);
    let mut revnat: HashMap<MapData, RevNatKey, RevNatValue> = HashMap::try_from(Map::LruHashMap(
        MapData::from_pin(dir.join(REVNAT_SK)).unwrap(),
    ))
    .unwrap();
    revnat.insert(e.key, e.value, 0).unwrap();
    slots.set(i, SockNat::default(), 0).unwrap();
    std::fs::remove_file(dir.join(SOCK_NAT_SPILLED)).unwrap();

    env.start_agent();
    let legacy = || -> u32 {
        let m: Array<MapData, u32> = Array::try_from(Map::Array(
            MapData::from_pin(dir.join(SOCK_NAT_SPILLED)).unwrap(),
        ))
        .unwrap();
        m.get(&SPILLED_LEGACY, 0).unwrap()
    };
    assert_eq!(
        legacy(),
        1,
        "the earlier version's connection is looked for"
    );
    // getpeername() still shows the VIP, from the earlier version's entry.
    assert_eq!(held.ask("!peer")["peer"], format!("{VIP}:80"));
    assert_eq!(held.ask("after")["reply"], "b0 after");
    // Its release finds the entry in REVNAT_SK by its peer: deleted.
    held.close();
    assert!(
        revnat
            .iter()
            .filter_map(Result::ok)
            .all(|(k, _)| k.cookie != e.key.cookie),
        "the entry went with its socket"
    );
    // The next start finds no such entry left and stops looking.
    env.stop_agent();
    env.start_agent();
    assert_eq!(legacy(), 0);
}

/// An upgrade from a version whose slots hold backend ids only (4-byte values): the start
/// carries every slot over into this version's layout (id and backend) before any program
/// is attached, so no Service loses its backends until the first sync; the agent then
/// serves through them. A slot whose copy of its backend differs from `BACKENDS` is
/// rewritten by the next verification.
#[test]
fn upgrade_carries_slots_without_backends_over() {
    use aya::maps::{HashMap, Map, MapData};
    use proxy_common::{
        BACKEND_SLOTS, BackendSlot, BackendSlotKey, DEFAULT_MAX_BACKENDS, DEFAULT_MAX_FRONTENDS,
        DEFAULT_MAX_SLOTS, DEFAULT_MAX_SOCKETS,
    };
    use proxy_userspace::datapath::loader::{MapSizes, load_pinned};
    let mut env = Env::new("slots-carry", 2, false);
    env.write_web(&Web::new(VIP).ready(&[b(0), b(1)]));
    env.start_agent();
    env.stop_agent();
    let dir = env.pin_path();
    let path = dir.join(BACKEND_SLOTS);
    let read = || -> Vec<(BackendSlotKey, BackendSlot)> {
        let m: HashMap<MapData, BackendSlotKey, BackendSlot> =
            HashMap::try_from(Map::HashMap(MapData::from_pin(&path).unwrap())).unwrap();
        let mut v: Vec<_> = m.iter().map(Result::unwrap).collect();
        v.sort();
        v
    };
    let before = read();
    assert_eq!(before.len(), 4, "2 endpoints x (TCP, UDP): {before:?}");

    // What the earlier version pinned: the same slots, backend ids only.
    std::fs::remove_file(&path).unwrap();
    pin_old_map(&path, "hash", 8, 4, 1024, "BACKEND_SLOTS");
    {
        let mut old: HashMap<MapData, BackendSlotKey, u32> =
            HashMap::try_from(Map::HashMap(MapData::from_pin(&path).unwrap())).unwrap();
        for (k, v) in &before {
            old.insert(k, v.backend_id, 0).unwrap();
        }
    }
    let sizes = MapSizes {
        frontends: DEFAULT_MAX_FRONTENDS,
        slots: DEFAULT_MAX_SLOTS,
        backends: DEFAULT_MAX_BACKENDS,
        sockets: DEFAULT_MAX_SOCKETS,
        conntrack_flows: 65536,
    };
    // The load alone (no program attached, no sync) carries them over, into a map of the
    // earlier one's size, and drops the set-aside pin.
    drop(load_pinned(&dir, sizes).unwrap());
    assert_eq!(read(), before, "every slot carried over with its backend");
    let info = aya::maps::MapInfo::from_pin(&path).unwrap();
    assert_eq!((info.value_size(), info.max_entries()), (24, 1024));
    assert!(!dir.join("BACKEND_SLOTS_IDS").exists());

    // A slot whose copy of its backend went wrong is repaired by the verification.
    {
        let mut m: HashMap<MapData, BackendSlotKey, BackendSlot> =
            HashMap::try_from(Map::HashMap(MapData::from_pin(&path).unwrap())).unwrap();
        let (k, mut v) = before[0];
        v.backend.port = [0, 1];
        m.insert(k, v, 0).unwrap();
    }
    assert_eq!(
        env.snapshot().stale_slots.into_iter().collect::<Vec<_>>(),
        vec![before[0].0]
    );
    env.extra_agent_args = vec!["--sync-period".into(), "1s".into()];
    env.start_agent();
    // Adopted by id (the Service keeps its backend ids), then rewritten by a verification.
    env.wait_maps(|s| s.stale_slots.is_empty(), "the damaged slot rewritten");
    assert_eq!(read(), before);
    let c = by_name(&env.tcp(&format!("{VIP}:80"), 30));
    assert_eq!(c.len(), 2, "both backends serve after the upgrade: {c:?}");
}
