use crate::model::{Algorithm, algorithm_names, parse_algorithm, parse_ipvs_scheduler};

#[test]
fn algorithm_names_and_ipvs_scheduler_names_are_accepted() {
    for (a, n) in Algorithm::ALL {
        assert_eq!(parse_algorithm(n), Some(a), "{n}");
        assert_eq!(a.name(), n);
        assert_eq!(Algorithm::from_u8(a as u8), Some(a));
    }
    let ipvs = [
        ("rr", Algorithm::RoundRobin),
        ("wrr", Algorithm::WeightedRoundRobin),
        ("lc", Algorithm::LeastConnections),
        ("wlc", Algorithm::WeightedLeastConnections),
        ("sed", Algorithm::ShortestExpectedDelay),
        ("nq", Algorithm::NeverQueue),
        ("sh", Algorithm::SourceHash),
        ("dh", Algorithm::DestinationHash),
        ("mh", Algorithm::SourceHash),
    ];
    for (n, a) in ipvs {
        assert_eq!(parse_algorithm(n), Some(a), "{n}");
        assert_eq!(parse_ipvs_scheduler(n, ""), Ok(a), "{n}");
    }
    // IPVS names are exact (case-sensitive), and the own names are not IPVS names.
    assert_eq!(parse_algorithm("WLC"), None);
    assert_eq!(parse_algorithm(""), None);
    assert!(parse_ipvs_scheduler("least-connections", "").is_err());
    assert!(algorithm_names().ends_with("(IPVS: rr, wrr, lc, wlc, sed, nq, sh, dh, mh)"));
    // Scheduler flags as ipvsadm -b takes them.
    assert_eq!(parse_ipvs_scheduler("sh", "sh-port"), Ok(Algorithm::Maglev));
    assert_eq!(
        parse_ipvs_scheduler("mh", "mh-fallback, mh-port"),
        Ok(Algorithm::Maglev)
    );
    assert_eq!(
        parse_ipvs_scheduler("sh", "sh-fallback"),
        Ok(Algorithm::SourceHash)
    );
    assert_eq!(
        parse_ipvs_scheduler("mh", "sh-port"),
        Err("IPVS scheduler flag \"sh-port\" does not apply to \"mh\" (sh takes sh-port, sh-fallback; mh takes mh-port, mh-fallback)".into())
    );
    assert_eq!(
        parse_ipvs_scheduler("", ""),
        Err("IPVS scheduler \"\" is not one of rr, wrr, lc, wlc, sed, nq, sh, dh, mh".into())
    );
    let e = parse_ipvs_scheduler("lblcr", "").unwrap_err();
    assert!(e.contains("locality-based") && e.contains("dh"), "{e}");
    // The data path counts connections for the least-load family only.
    let counted: Vec<&str> = Algorithm::ALL
        .iter()
        .filter(|(a, _)| proxy_common::counts_connections(*a as u8))
        .map(|(_, n)| *n)
        .collect();
    assert_eq!(
        counted,
        [
            "least-connections",
            "weighted-least-connections",
            "shortest-expected-delay",
            "never-queue"
        ]
    );
    assert!(!proxy_common::counts_connections(200));
}
