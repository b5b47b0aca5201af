use super::*;

/// remedy, no probe rows repeating it. Run as root, the privileges row is ok.
#[test]
fn without_privileges_one_row_says_what_is_missing() {
    let rows = run_checks(&Options {
        bpffs: "/nonexistent-bpffs".into(),
        mount_bpffs: false,
        cgroup: None,
        probe_programs: false,
        tc: crate::datapath::tc::TcSettings::default(),
    });
    let p = rows.iter().find(|r| r.check == "privileges").unwrap();
    let eff =
        effective_capabilities(&std::fs::read_to_string("/proc/self/status").unwrap()).unwrap();
    if missing_capabilities(eff).is_empty() {
        assert_eq!(p.status, Status::Ok, "{p:?}");
        assert!(rows.iter().any(|r| r.check == "kube-proxy rules"));
    } else {
        assert_ne!(p.status, Status::Ok, "{p:?}");
        assert!(p.remedy.as_deref().unwrap().starts_with("run as root"));
        if p.status == Status::Fail {
            assert!(!rows.iter().any(|r| r.check == "kube-proxy rules"));
        }
    }
    let c = rows.iter().find(|r| r.check == "conntrack").unwrap();
    assert!(
        c.detail.starts_with("131072 flows, 40 MiB preallocated"),
        "{c:?}"
    );
}

#[test]
fn table_is_aligned_with_remedies_under_failures() {
    let rows = vec![
        CheckResult::ok("kernel", "6.18.44"),
        CheckResult::bad(
            "bpffs",
            Status::Fail,
            "/tmp/x is not a BPF file system",
            "mount it",
        ),
    ];
    let t = table(&rows);
    assert_eq!(
        t,
        "CHECK   STATUS  DETAIL\n\
         kernel  ok      6.18.44\n\
         bpffs   fail    /tmp/x is not a BPF file system\n\
         \x20               remedy: mount it\n"
    );
    assert!(failed(&rows));
    assert!(!failed(&rows[..1]));
    let json = serde_json::to_value(&rows).unwrap();
    assert_eq!(json[1]["status"], "fail");
    assert_eq!(json[0]["remedy"], serde_json::Value::Null);
    assert_eq!(
        rows[1].message(),
        "bpffs: /tmp/x is not a BPF file system (remedy: mount it)"
    );
}
