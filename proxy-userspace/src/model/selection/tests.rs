use crate::model::{Algorithm, algorithm_names, parse_algorithm};

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
    }
    // IPVS names are exact (case-sensitive), and the own names are not IPVS names.
    assert_eq!(parse_algorithm("WLC"), None);
    assert_eq!(parse_algorithm(""), None);
    assert!(algorithm_names().ends_with("(IPVS: rr, wrr, lc, wlc, sed, nq, sh, dh, mh)"));
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
