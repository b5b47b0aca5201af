use std::collections::BTreeSet;

use super::build::hard_limit;
use super::rootfs::{inside, parse_ldd};
use super::*;
use crate::workspace;

/// One instruction of a Containerfile: its keyword (upper case) and its arguments, with
/// continuation lines joined.
#[derive(Debug)]
struct Instr {
    keyword: String,
    args: String,
}

/// The instructions of a Containerfile, comments and blank lines dropped.
fn instructions(text: &str) -> Vec<Instr> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('#') || (t.is_empty() && cur.is_empty()) {
            continue;
        }
        match t.strip_suffix('\\') {
            Some(part) => {
                cur.push_str(part.trim());
                cur.push(' ');
            }
            None => {
                cur.push_str(t);
                let (k, a) = cur
                    .trim()
                    .split_once(char::is_whitespace)
                    .unwrap_or((&cur, ""));
                out.push(Instr {
                    keyword: k.to_uppercase(),
                    args: a.trim().to_owned(),
                });
                cur.clear();
            }
        }
    }
    out
}

/// The stages of a Containerfile: each starts with its FROM.
fn stages(text: &str) -> Vec<Vec<Instr>> {
    let mut out: Vec<Vec<Instr>> = Vec::new();
    for i in instructions(text) {
        if i.keyword == "FROM" {
            out.push(Vec::new());
        }
        if let Some(s) = out.last_mut() {
            s.push(i);
        }
    }
    out
}

/// Splits LABEL's arguments `k="v" k2=v2` into pairs (double quotes removed).
fn label_pairs(args: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut chars = args.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        if key.is_empty() {
            return out;
        }
        let mut value = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            value.extend(chars.by_ref().take_while(|c| *c != '"'));
        } else {
            value.extend(chars.by_ref().take_while(|c| !c.is_whitespace()));
        }
        out.push((key, value));
    }
}

fn containerfile() -> String {
    fs::read_to_string(workspace().join("Containerfile")).expect("reading Containerfile")
}

fn find<'a>(stage: &'a [Instr], keyword: &str) -> Vec<&'a str> {
    stage
        .iter()
        .filter(|i| i.keyword == keyword)
        .map(|i| i.args.as_str())
        .collect()
}

/// The Containerfile's final stage holds what `cargo xtask image` builds: the files of
/// `cargo xtask image-rootfs` (this module's list, the agent's links included: see
/// [`the_rootfs_holds_the_list_and_the_agent_links_in_both_modes`]), the agent at [`AGENT`],
/// and the same user, PATH, entrypoint, command and labels; it runs the same smoke test,
/// and nothing through a shell, which the image does not have.
#[test]
fn the_containerfile_describes_the_same_image() {
    let text = containerfile();
    let stages = stages(&text);
    assert!(stages.len() >= 2, "a build stage and a final stage");
    let build = &stages[stages.len() - 2];
    let last = &stages[stages.len() - 1];

    assert_eq!(
        last[0].args, "scratch",
        "the final stage starts from scratch"
    );
    assert!(
        build[0].args.ends_with(" AS build") || build[0].args.ends_with(" as build"),
        "the stage before the final one is `build`: {}",
        build[0].args
    );

    // Files: only the rootfs (with the agent's links) and the agent are copied in, nothing
    // else is added.
    let agent_copy = format!("--from=build /src/target/release/ebpf-proxy {AGENT}");
    assert_eq!(
        find(last, "COPY"),
        ["--from=build /rootfs/ /", agent_copy.as_str()]
    );
    assert!(find(last, "ADD").is_empty());

    // The rootfs is written by xtask from the lists here, with the agent's libraries.
    let rootfs = find(build, "RUN")
        .into_iter()
        .find(|r| r.contains("image-rootfs"))
        .expect("a RUN of `cargo xtask image-rootfs` in the build stage");
    assert!(
        rootfs.contains("image-rootfs /rootfs --libraries-of /src/target/release/ebpf-proxy"),
        "{rootfs}"
    );
    // ... and it needs the tools' packages in the build stage.
    let apt = find(build, "RUN")
        .into_iter()
        .find(|r| r.contains("apt-get install"))
        .expect("an apt-get install in the build stage");
    for p in DEBIAN_PACKAGES {
        assert!(
            apt.split_whitespace().any(|w| w == p),
            "the build stage does not install {p}: {apt}"
        );
    }

    let exec_form = |keyword: &str| -> Vec<Vec<String>> {
        find(last, keyword)
            .iter()
            .map(|a| {
                serde_json::from_str(a)
                    .unwrap_or_else(|e| panic!("{keyword} {a} is not in exec form: {e}"))
            })
            .collect()
    };

    // The tools answer under their names: the final stage runs the same smoke test, in
    // exec form (the image has no shell), and runs nothing else.
    let smoke: Vec<Vec<String>> = SMOKE
        .iter()
        .map(|p| vec![p.to_string(), "--version".to_owned()])
        .collect();
    assert_eq!(exec_form("RUN"), smoke);
    for l in TOOL_LINKS {
        assert!(
            l.target == "xtables-nft-multi" || l.target == "xtables-legacy-multi",
            "{l:?}"
        );
    }

    // Settings.
    assert_eq!(find(last, "USER"), [USER]);
    assert_eq!(find(last, "ENV"), [format!("PATH={PATH_ENV}").as_str()]);
    assert_eq!(
        exec_form("ENTRYPOINT"),
        [ENTRYPOINT.map(String::from).to_vec()]
    );
    assert_eq!(exec_form("CMD"), [CMD.map(String::from).to_vec()]);

    // Labels, with the version from the crate.
    let labels: Vec<(String, String)> = find(last, "LABEL")
        .iter()
        .flat_map(|a| label_pairs(a))
        .collect();
    let label = |k: &str| {
        labels
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("no label {k} in {labels:?}"))
    };
    assert_eq!(label("org.opencontainers.image.title"), TITLE);
    assert_eq!(label("org.opencontainers.image.description"), DESCRIPTION);
    assert_eq!(label("org.opencontainers.image.version"), "${VERSION}");
    assert_eq!(label("org.opencontainers.image.revision"), "${REVISION}");
    assert_eq!(label("org.opencontainers.image.source"), "${SOURCE}");
    let version_arg = format!("VERSION={}", env!("CARGO_PKG_VERSION"));
    assert!(
        find(last, "ARG").contains(&version_arg.as_str()),
        "the final stage's `ARG {version_arg}` (the crate version) is missing"
    );
}

#[test]
fn containerfile_instructions_join_continuations() {
    let text = "# c\nFROM a AS build\nRUN x \\\n    && y\n\nfrom scratch\nLABEL a=\"b c\" d=e\n";
    let s = stages(text);
    assert_eq!(s.len(), 2);
    assert_eq!(s[0][1].args, "x && y");
    assert_eq!(s[1][0].keyword, "FROM");
    assert_eq!(
        label_pairs(&s[1][1].args),
        [("a".into(), "b c".into()), ("d".into(), "e".into())]
    );
}

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
                   /usr/sbin/xtables-nft-multi:\n\tlibc.so.6 => /lib/x/libc.so.6 (0x2)\n";
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

/// [`write_rootfs`] in both modes, from this machine, with this test binary standing in for
/// the agent (any dynamically linked program does): the agent's links are there either way
/// (the Containerfile's final stage has no `ln`, so it gets them from `image-rootfs`), the
/// binary only with [`Agent::Include`], and the only programs are the agent and
/// [`HOST_FILES`]: every other regular file is a library, an xtables module or one of
/// [`ETC_FILES`]. No shell, no coreutils. Checks nothing, saying so, when the tools of
/// [`DEBIAN_PACKAGES`] are not installed.
#[test]
fn the_rootfs_holds_the_list_and_the_agent_links_in_both_modes() {
    if let Some(f) = HOST_FILES.iter().find(|f| fs::metadata(f).is_err()) {
        eprintln!("skipped: {f} is not installed (`cargo xtask setup` installs it)");
        return;
    }
    let agent = env::current_exe().unwrap();
    for include in [true, false] {
        let root = env::temp_dir().join(format!(
            "xtask-rootfs-test-{}-{}",
            std::process::id(),
            if include { "include" } else { "all-but-binary" }
        ));
        let _ = fs::remove_dir_all(&root);
        let mode = if include {
            Agent::Include(&agent)
        } else {
            Agent::AllButBinary(&agent)
        };
        let sum = write_rootfs(&root, mode).unwrap();

        let agent_in = inside(&root, Path::new(AGENT));
        assert_eq!(agent_in.is_file(), include, "{}", agent_in.display());
        for l in AGENT_LINKS {
            let p = inside(&root, Path::new(l.path));
            assert_eq!(
                fs::read_link(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
                Path::new(l.target)
            );
            // Relative to the link's directory, the target is the agent's path.
            let parent = Path::new(l.path).parent().unwrap();
            assert_eq!(parent.join(l.target), Path::new(AGENT), "{l:?}");
        }
        for (f, text) in ETC_FILES {
            assert_eq!(
                fs::read_to_string(inside(&root, Path::new(f))).unwrap(),
                text
            );
        }

        let mut files = Vec::new();
        let mut todo = vec![root.clone()];
        while let Some(d) = todo.pop() {
            for e in fs::read_dir(&d).unwrap() {
                let e = e.unwrap();
                let t = e.file_type().unwrap();
                if t.is_dir() {
                    todo.push(e.path());
                } else if t.is_file() {
                    files.push(Path::new("/").join(e.path().strip_prefix(&root).unwrap()));
                }
            }
        }
        assert_eq!(files.len(), sum.files, "{files:?}");
        // A host file may be reached through links (/bin -> usr/bin); its file is where
        // they lead.
        let host_files: Vec<PathBuf> = HOST_FILES
            .iter()
            .map(|f| fs::canonicalize(f).unwrap())
            .collect();
        for f in &files {
            let s = f.to_str().unwrap();
            let name = f.file_name().unwrap().to_string_lossy();
            assert!(
                s == AGENT
                    || host_files.contains(f)
                    || ETC_FILES.iter().any(|(e, _)| *e == s)
                    || name.contains(".so"),
                "{s} is in the image but in no list"
            );
        }
        for gone in ["sh", "grep", "mount", "ln", "dash", "bash", "busybox"] {
            assert!(
                !files.iter().any(|f| f.file_name().unwrap() == gone),
                "{gone} is in the image"
            );
        }
        fs::remove_dir_all(&root).unwrap();
    }
}
