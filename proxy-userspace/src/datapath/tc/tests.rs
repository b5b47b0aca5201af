use ipnet::IpNet;
use proxy_common::nat::{TC_CFG_CLUSTER_CIDR_V4, TC_CFG_CLUSTER_CIDR_V6};

use super::attach::tcx_attach_hint;
use super::interfaces::{mask_v4, mask_v6, parse_ipv6_routes};
use super::*;

#[test]
fn interface_errors_list_this_namespace_and_attach_hints_follow_the_errno() {
    // Every network namespace has lo; the list comes from this process's namespace.
    let names = interface_names();
    assert!(names.iter().any(|n| n == "lo"), "{names:?}");
    let e = check_interfaces(&["lo".into(), "no-such-if0".into()]).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("\"no-such-if0\""), "{msg}");
    let listed = msg.split("(there are: ").nth(1).expect(&msg);
    assert!(listed.split([',', ' ', ')']).any(|n| n == "lo"), "{msg}");
    let err = |errno: i32| {
        aya::programs::ProgramError::SyscallError(aya::sys::SyscallError {
            call: "bpf_mprog_attach",
            io_error: std::io::Error::from_raw_os_error(errno),
        })
    };
    for errno in [libc::EINVAL, libc::EOPNOTSUPP, 524] {
        assert_eq!(tcx_attach_hint(&err(errno)), Some("tcx needs Linux >= 6.6"));
    }
    let exists = tcx_attach_hint(&err(libc::EEXIST)).unwrap();
    assert!(
        !exists.contains("6.6") && exists.contains("already"),
        "{exists}"
    );
    assert_eq!(tcx_attach_hint(&err(libc::EPERM)), None);
    assert_eq!(
        tcx_attach_hint(&aya::programs::ProgramError::NotLoaded),
        None
    );
}

#[test]
fn ipv6_routes_and_dual_stack_cluster_cidr() {
    let text = "fd000002000000000000000000000000 40 00000000000000000000000000000000 00 fd000100000000000000000000000002 00000400 00000001 00000000 00000003     eth0\n\
                fe800000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001      br0\n";
    let r = parse_ipv6_routes(text);
    assert_eq!(
        r,
        vec![
            ("eth0".to_string(), "fd00:2::".parse().unwrap(), 64),
            ("br0".to_string(), "fe80::".parse().unwrap(), 64),
        ]
    );
    assert_eq!(
        mask_v6("fd00:2::10".parse().unwrap(), 64),
        mask_v6("fd00:2::".parse().unwrap(), 64)
    );
    assert_ne!(
        mask_v6("fd00:3::10".parse().unwrap(), 64),
        mask_v6("fd00:2::".parse().unwrap(), 64)
    );
    let cidrs: Vec<IpNet> = vec!["10.0.0.0/8".parse().unwrap(), "fd00::/48".parse().unwrap()];
    let c = tc_config(&TcSettings::default(), &cidrs);
    assert_eq!(c.flags, TC_CFG_CLUSTER_CIDR_V4 | TC_CFG_CLUSTER_CIDR_V6);
    assert_eq!(
        (c.cluster_cidr_v4, c.cluster_cidr_v4_len),
        ([10, 0, 0, 0], 8)
    );
    assert_eq!(c.cluster_cidr_v6_len, 48);
    assert_eq!(&c.cluster_cidr_v6[..2], &[0xfd, 0]);
    let c = tc_config(&TcSettings::default(), &cidrs[1..]);
    assert_eq!(c.flags, TC_CFG_CLUSTER_CIDR_V6);
}

#[test]
fn ipv4_masks() {
    assert_eq!(mask_v4(0xc612_0105, 24), 0xc612_0100);
    assert_eq!(mask_v4(0xc612_0105, 0), 0);
}
