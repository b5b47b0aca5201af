//! The IPVS least-load schedulers' rules (`net/netfilter/ipvs/ip_vs_wlc.c`, `ip_vs_sed.c`,
//! `ip_vs_nq.c`) as a replay check of the choices a data path made, shared by the socket
//! scenarios (`least-cost=`, `scenarios/socket/alg-*.txtar`) and the tc packet fixtures
//! (`tc_fixtures`).
//!
//! ebpf-proxy counts every open connection as active (no inactive ones, see
//! `proxy_common::Algorithm`), so the costs below are IPVS's with `inactconns = 0`.

#![allow(dead_code)]

use std::collections::BTreeMap;

/// `wlc` (and `lc` with every weight 1): a backend's connections.
pub fn wlc_cost(c: u64) -> u64 {
    c
}

/// `sed`: the connections one more connection would make.
pub fn sed_cost(c: u64) -> u64 {
    c + 1
}

/// `nq`: an idle backend costs nothing, any other as `sed`.
pub fn nq_cost(c: u64) -> u64 {
    if c == 0 { 0 } else { c + 1 }
}

/// Checks that every choice of `seq` (backend names, in the order the connections were
/// opened, none closed meanwhile) went to a backend of minimal `cost(connections) / weight`
/// among `weights` (name -> weight > 0) given the choices before it, compared by
/// cross-multiplication as IPVS does; ties may go either way. A backend outside `weights`
/// (weight 0, or not in the set) must never be chosen.
pub fn assert_least_cost(seq: &[String], weights: &[(&str, u64)], cost: fn(u64) -> u64) {
    let mut conns: BTreeMap<&str, u64> = weights.iter().map(|(n, _)| (*n, 0)).collect();
    for (i, chosen) in seq.iter().enumerate() {
        let Some(&(_, wc)) = weights.iter().find(|(n, _)| n == chosen) else {
            panic!("choice {i} went to {chosen}, not a backend of weight > 0: {seq:?}");
        };
        let cc = cost(conns[chosen.as_str()]);
        for (n, w) in weights {
            let c = cost(conns[n]);
            assert!(
                cc * w <= c * wc,
                "choice {i} went to {chosen} (cost {cc}, weight {wc}) though {n} has cost {c}, \
                 weight {w}: {seq:?}"
            );
        }
        *conns.get_mut(chosen.as_str()).unwrap() += 1;
    }
}

/// How often each name occurs in `seq`.
pub fn tally(seq: &[String]) -> BTreeMap<String, usize> {
    seq.iter().fold(BTreeMap::new(), |mut m, n| {
        *m.entry(n.clone()).or_default() += 1;
        m
    })
}

/// `[(name, n)]` as a tally, for comparisons.
pub fn counts(list: &[(&str, usize)]) -> BTreeMap<String, usize> {
    list.iter().map(|(n, c)| (n.to_string(), *c)).collect()
}
