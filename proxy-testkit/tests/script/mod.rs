//! The scenario files' reader and runner (after Cilium's script tests): a file is a
//! txtar archive whose comment is the script, one step a line, and whose files are the
//! manifests (or packet fixtures' objects) the steps name. See `tests/scenarios/README.md`
//! for the format and the commands.
//!
//! [`run_dir`] runs every scenario of a directory, each on its own, and reports all
//! failures at the end; a failing step is named by file and line. `EBPF_PROXY_SCENARIO`
//! (a part of a file name) runs only the matching ones.

#![allow(dead_code)]

pub mod api;
pub mod northsouth;
pub mod packets;
pub mod query;
pub mod socket;

use std::{
    any::Any,
    collections::BTreeMap,
    panic::{AssertUnwindSafe, catch_unwind},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

/// The environment variable that selects scenarios by a part of their file name.
pub const FILTER: &str = "EBPF_PROXY_SCENARIO";

/// A scenario file: its steps and its files.
pub struct Script {
    pub path: PathBuf,
    /// The file name without `.txtar`; names the lab's namespaces, cgroup and pins.
    pub name: String,
    pub steps: Vec<Step>,
    /// The archive's files by name (`-- NAME --` sections), their text as written.
    pub files: BTreeMap<String, String>,
}

/// One step: a line of the script split into words, and the `key=value` expectations after
/// a `=>` word.
#[derive(Clone, Debug)]
pub struct Step {
    /// 1-based line number in the file (the first line of a continued step).
    pub line: usize,
    pub text: String,
    pub words: Vec<String>,
    /// The words after `=>`, as written.
    pub after: Vec<String>,
    /// [`Step::after`] as `key=value` pairs (a word without `=` is a key with an empty
    /// value).
    pub expect: Vec<(String, String)>,
}

impl Step {
    /// Word `i`, or a panic naming what is missing.
    pub fn word(&self, i: usize, what: &str) -> &str {
        self.words
            .get(i)
            .unwrap_or_else(|| panic!("missing {what}"))
    }

    /// The value of expectation `key`, if given (the first, if given more than once).
    pub fn get(&self, key: &str) -> Option<&str> {
        self.expect
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Every value of expectation `key`.
    pub fn all(&self, key: &str) -> Vec<&str> {
        self.expect
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// Panics unless every expectation key is one of `known`.
    pub fn only(&self, known: &[&str]) {
        for (k, _) in &self.expect {
            assert!(
                known.contains(&k.as_str()),
                "unknown expectation {k:?} (known here: {known:?})"
            );
        }
    }
}

impl Script {
    /// Reads and parses `path`.
    pub fn read(path: &Path) -> Script {
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        Script::parse(path, &text)
    }

    /// Parses a scenario: lines up to the first `-- NAME --` are the script (blank lines
    /// and lines starting with `#` skipped; a line ending in `\` continues on the next);
    /// every `-- NAME --` line starts file NAME, which runs to the next one.
    pub fn parse(path: &Path, text: &str) -> Script {
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("a file name")
            .to_string();
        let mut steps = Vec::new();
        let mut files: BTreeMap<String, String> = BTreeMap::new();
        let mut file: Option<String> = None;
        let mut pending: Option<(usize, String)> = None;
        for (i, line) in text.lines().enumerate() {
            if let Some(n) = line.strip_prefix("-- ").and_then(|l| l.strip_suffix(" --")) {
                let n = n.trim().to_string();
                assert!(
                    files.insert(n.clone(), String::new()).is_none(),
                    "{}:{}: file {n:?} given twice",
                    path.display(),
                    i + 1
                );
                file = Some(n);
                continue;
            }
            if let Some(f) = &file {
                let body = files.get_mut(f).expect("file");
                body.push_str(line);
                body.push('\n');
                continue;
            }
            let (start, mut acc) = pending.take().unwrap_or((i + 1, String::new()));
            let t = line.trim();
            if acc.is_empty() && (t.is_empty() || t.starts_with('#')) {
                continue;
            }
            if let Some(head) = t.strip_suffix('\\') {
                acc.push_str(head);
                acc.push(' ');
                pending = Some((start, acc));
                continue;
            }
            acc.push_str(t);
            let words =
                split_words(&acc).unwrap_or_else(|e| panic!("{}:{start}: {e}", path.display()));
            let (words, after) = match words.iter().position(|w| w == "=>") {
                Some(at) => (words[..at].to_vec(), words[at + 1..].to_vec()),
                None => (words, Vec::new()),
            };
            let expect = after
                .iter()
                .map(|w| match w.split_once('=') {
                    // `key>=N`: the key, and the value with its comparison.
                    Some((k, v)) if k.ends_with('>') => {
                        (k.trim_end_matches('>').to_string(), format!(">={v}"))
                    }
                    Some((k, v)) if k.ends_with('<') => {
                        (k.trim_end_matches('<').to_string(), format!("<={v}"))
                    }
                    Some((k, v)) => (k.to_string(), v.to_string()),
                    None => (w.clone(), String::new()),
                })
                .collect();
            assert!(
                !words.is_empty(),
                "{}:{start}: a step without a command",
                path.display()
            );
            steps.push(Step {
                line: start,
                text: acc,
                words,
                after,
                expect,
            });
        }
        assert!(
            pending.is_none(),
            "{}: the last step continues past the script",
            path.display()
        );
        Script {
            path: path.to_path_buf(),
            name,
            steps,
            files,
        }
    }

    /// The text of file `name` of the archive or, when the archive has none, of the file
    /// `name` next to the scenario (objects shared by several scenarios).
    pub fn file(&self, name: &str) -> String {
        if let Some(text) = self.files.get(name) {
            return text.clone();
        }
        let shared = self.path.with_file_name(name);
        std::fs::read_to_string(&shared).unwrap_or_else(|e| {
            panic!(
                "no file {name:?} in the scenario (`-- {name} --`) nor {}: {e}",
                shared.display()
            )
        })
    }

    /// Runs `f` for `step`; a panic in it fails with the file, line and step named.
    pub fn at<T>(&self, step: &Step, f: impl FnOnce() -> T) -> T {
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(v) => v,
            Err(e) => panic!(
                "{}:{}: `{}`: {}",
                self.path.display(),
                step.line,
                step.text,
                panic_text(&e)
            ),
        }
    }
}

/// Splits a step into words at whitespace; double quotes group (`\"` and `\\` inside),
/// anywhere in a word (`has="a b"` is one word `has=a b`).
pub fn split_words(line: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(e) => cur.push(e),
                            None => return Err("a `\\` at the end of the line".into()),
                        },
                        Some(x) => cur.push(x),
                        None => return Err("an unclosed `\"`".into()),
                    }
                }
            }
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        words.push(cur);
    }
    Ok(words)
}

/// The message of a panic payload.
pub fn panic_text(e: &Box<dyn Any + Send>) -> String {
    if let Some(s) = e.downcast_ref::<String>() {
        s.clone()
    } else if let Some(s) = e.downcast_ref::<&str>() {
        s.to_string()
    } else {
        "(a panic without a message)".into()
    }
}

/// The `timer start` / `timer under DURATION` step of every lab kind: `timer` holds the
/// start; `under` fails unless less than DURATION has passed since.
pub fn timer(timer: &mut Option<Instant>, step: &Step) {
    step.only(&[]);
    match &step.words[1..] {
        [s] if s == "start" => *timer = Some(Instant::now()),
        [u, d] if u == "under" => {
            let t = timer.expect("`timer start` first").elapsed();
            assert!(t < duration(d), "took {t:?}, not under {d}");
        }
        _ => panic!("usage: timer start | timer under DURATION"),
    }
}

/// A duration as the scenarios write it: `300ms`, `2s`, `1.5s`.
pub fn duration(s: &str) -> Duration {
    if let Some(ms) = s.strip_suffix("ms") {
        return Duration::from_millis(ms.parse().unwrap_or_else(|_| panic!("bad duration {s:?}")));
    }
    let secs = s
        .strip_suffix('s')
        .and_then(|n| n.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("bad duration {s:?} (e.g. 300ms, 2s)"));
    Duration::from_secs_f64(secs)
}

/// A comma-separated list (`b0,b1`); empty for `""`.
pub fn list(s: &str) -> Vec<String> {
    s.split(',')
        .filter(|x| !x.is_empty())
        .map(str::to_string)
        .collect()
}

/// `name:weight` pairs (`b0:1,b1:3`).
pub fn weights(s: &str) -> Vec<(String, u64)> {
    list(s)
        .iter()
        .map(|p| {
            let (n, w) = p
                .split_once(':')
                .unwrap_or_else(|| panic!("{p:?} is not name:number"));
            (
                n.to_string(),
                w.parse().unwrap_or_else(|_| panic!("{p:?}: not a number")),
            )
        })
        .collect()
}

/// The scenario files (`*.txtar`) of `dir`, sorted; those matching `$EBPF_PROXY_SCENARIO`
/// when it is set.
pub fn scenario_files(dir: &Path) -> Vec<PathBuf> {
    let filter = std::env::var(FILTER).ok().filter(|f| !f.is_empty());
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "txtar"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no *.txtar in {}", dir.display());
    files
        .into_iter()
        .filter(|p| {
            filter.as_deref().is_none_or(|f| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.contains(f))
            })
        })
        .collect()
}

/// Runs `run` on every scenario of `dir` (see [`scenario_files`]), each on its own: a
/// failure is recorded and the next one runs. Panics at the end naming every failure.
pub fn run_dir(dir: &Path, run: impl Fn(&Script)) {
    let files = scenario_files(dir);
    // Parse them all first: a mistake in any file fails before a lab is built.
    let scripts: Vec<Script> = files.iter().map(|p| Script::read(p)).collect();
    let mut failed = Vec::new();
    let all = Instant::now();
    for s in &scripts {
        println!("scenario {} ...", s.path.display());
        let t = Instant::now();
        match catch_unwind(AssertUnwindSafe(|| run(s))) {
            Ok(()) => println!("scenario {}: ok ({:.1?})", s.name, t.elapsed()),
            Err(e) => {
                let msg = panic_text(&e);
                println!("scenario {}: FAILED ({:.1?})\n{msg}", s.name, t.elapsed());
                failed.push(format!("{}: {msg}", s.name));
            }
        }
    }
    println!(
        "{} scenarios of {} in {:.1?}, {} failed",
        scripts.len(),
        dir.display(),
        all.elapsed(),
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "{} of {} scenarios failed:\n{}",
        failed.len(),
        scripts.len(),
        failed.join("\n")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_quotes_and_expectations() {
        assert_eq!(
            split_words(r#"log "a b" has="c \"d\"" x"#).unwrap(),
            ["log", "a b", "has=c \"d\"", "x"]
        );
        let s = Script::parse(
            Path::new("t.txtar"),
            "# c\n\nprobe tcp \\\n  --to x => names=b0,b1 ok distinct>=2 moved<=2\n-- f.yaml --\na: 1\n",
        );
        assert_eq!(s.steps.len(), 1);
        assert_eq!(s.steps[0].line, 3);
        assert_eq!(s.steps[0].words, ["probe", "tcp", "--to", "x"]);
        assert_eq!(s.steps[0].get("names"), Some("b0,b1"));
        assert_eq!(s.steps[0].get("ok"), Some(""));
        assert_eq!(s.steps[0].get("distinct"), Some(">=2"));
        assert_eq!(s.steps[0].get("moved"), Some("<=2"));
        assert_eq!(s.file("f.yaml"), "a: 1\n");
    }
}
