use super::*;

#[test]
fn ldd_output_is_parsed() {
    let one = "\tlinux-vdso.so.1 (0x00007ffd)\n\
               \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f47)\n\
               \t/lib64/ld-linux-x86-64.so.2 (0x00007f47)\n";
    let got: Vec<PathBuf> = parse_ldd(one).unwrap().into_iter().collect();
    assert_eq!(
        got,
        [
            PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
            PathBuf::from("/lib64/ld-linux-x86-64.so.2")
        ]
    );
    let several = "/usr/sbin/nft:\n\tlibmnl.so.0 => /lib/x/libmnl.so.0 (0x1)\n\
                   /usr/bin/ln:\n\tlibc.so.6 => /lib/x/libc.so.6 (0x2)\n";
    assert_eq!(parse_ldd(several).unwrap().len(), 2);
    let missing = "/usr/sbin/nft:\n\tlibgmp.so.10 => not found\n";
    let e = parse_ldd(missing).unwrap_err().to_string();
    assert!(
        e.contains("libgmp.so.10") && e.contains("/usr/sbin/nft"),
        "{e}"
    );
}

#[test]
fn hard_limits_from_proc_self_limits() {
    let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                  Max processes             96369                96369                processes \n\
                  Max open files            1024                 20000                files     \n\
                  Max locked memory         unlimited            unlimited            bytes     \n";
    assert_eq!(hard_limit(limits, "Max open files"), Some(20000));
    assert_eq!(hard_limit(limits, "Max processes"), Some(96369));
    assert_eq!(hard_limit(limits, "Max locked memory"), None);
}

#[test]
fn every_path_is_listed_once() {
    let mut seen = BTreeSet::new();
    let paths = HOST_FILES
        .iter()
        .copied()
        .chain([AGENT])
        .chain(AGENT_LINKS.iter().map(|l| l.path))
        .chain(TOOL_LINKS.iter().map(|l| l.path))
        .chain(DIRS.iter().map(|(d, _)| *d))
        .chain(ETC_FILES.iter().map(|(f, _)| *f));
    for p in paths {
        assert!(p.starts_with('/'), "{p} is not absolute");
        assert!(seen.insert(p), "{p} is listed twice");
    }
    for p in SMOKE {
        assert!(
            p == AGENT
                || HOST_FILES.contains(&p)
                || AGENT_LINKS.iter().chain(&TOOL_LINKS).any(|l| l.path == p),
            "{p} is smoke-tested but not in the image"
        );
    }
}
