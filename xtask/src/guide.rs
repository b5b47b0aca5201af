//! The user guide (`docs/`, an mdBook) and README.md: building the book and checking their
//! links.
//!
//! mdbook reports a chapter of SUMMARY.md without its file (`create-missing = false` in
//! docs/book.toml) but no broken link, so [`link_problems`] checks every relative link of
//! README.md and docs/src/**/*.md: the file exists, an `#anchor` names a heading of it, a
//! chapter links only inside docs/src (mdbook copies nothing else into the book), and every
//! chapter is listed in SUMMARY.md (mdbook renders no other).

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::path::{Component, Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Result, bail};

use crate::command::run;
use crate::{target_dir, workspace};

/// The guide's mdBook root, relative to the workspace.
pub const BOOK: &str = "docs";

/// `mdbook build docs` into target/book/, after the link check (both fail the caller).
pub fn build() -> Result<()> {
    let t = Instant::now();
    let problems = link_problems(&workspace())?;
    if !problems.is_empty() {
        bail!(
            "the guide has {} broken link(s):\n  {}",
            problems.len(),
            problems.join("\n  ")
        );
    }
    let dest = target_dir().join("book");
    run(Command::new("mdbook")
        .arg("build")
        .arg(workspace().join(BOOK))
        .arg("--dest-dir")
        .arg(&dest))?;
    eprintln!(
        "xtask: guide built in {} ({:.1?})",
        dest.join("index.html").display(),
        t.elapsed()
    );
    Ok(())
}

/// Every broken link of README.md and docs/src/**/*.md, one line each
/// (`FILE: [target]: what is wrong`); empty when all resolve.
pub fn link_problems(workspace: &Path) -> Result<Vec<String>> {
    let src = workspace.join(BOOK).join("src");
    let mut files = vec![workspace.join("README.md")];
    markdown_files(&src, &mut files)?;
    let mut headings: HashMap<PathBuf, BTreeSet<String>> = HashMap::new();
    let mut problems = Vec::new();
    let mut listed = BTreeSet::new();
    for file in &files {
        let text = fs::read_to_string(file)?;
        let name = file.strip_prefix(workspace).unwrap_or(file).display();
        let dir = file.parent().expect("a file has a directory");
        let in_book = file.starts_with(&src);
        for target in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (target.as_str(), None),
            };
            let resolved = if path.is_empty() {
                file.clone()
            } else {
                normalize(&dir.join(path))
            };
            if file.ends_with("SUMMARY.md") {
                listed.insert(resolved.clone());
            }
            if !resolved.exists() {
                problems.push(format!("{name}: [{target}]: no such file"));
                continue;
            }
            if in_book && !resolved.starts_with(&src) {
                problems.push(format!(
                    "{name}: [{target}]: outside docs/src, so missing from the built book"
                ));
            }
            let Some(anchor) = anchor else { continue };
            if resolved.extension().is_none_or(|e| e != "md") {
                problems.push(format!(
                    "{name}: [{target}]: an anchor into a non-Markdown file"
                ));
                continue;
            }
            if !headings.contains_key(&resolved) {
                let ids = heading_ids(&fs::read_to_string(&resolved)?);
                headings.insert(resolved.clone(), ids);
            }
            if !headings[&resolved].contains(anchor) {
                problems.push(format!("{name}: [{target}]: no heading with that id"));
            }
        }
    }
    for file in files.iter().filter(|f| f.starts_with(&src)) {
        if !file.ends_with("SUMMARY.md") && !listed.contains(file) {
            let name = file.strip_prefix(workspace).unwrap_or(file).display();
            problems.push(format!(
                "{name}: not listed in SUMMARY.md, so not in the built book"
            ));
        }
    }
    Ok(problems)
}

/// The Markdown files below `dir`, sorted, appended to `out`.
fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let mut entries: Vec<PathBuf> = fs::read_dir(dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    entries.sort();
    for p in entries {
        if p.is_dir() {
            markdown_files(&p, out)?;
        } else if p.extension().is_some_and(|e| e == "md") {
            out.push(p);
        }
    }
    Ok(())
}

/// `a/b/../c` -> `a/c`, without touching the file system (links name files that may not
/// exist).
fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

/// The text outside fenced code blocks and inline code spans, where Markdown links live.
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut fence: Option<&str> = None;
    for line in text.lines() {
        let t = line.trim_start();
        match fence {
            Some(f) if t.starts_with(f) => fence = None,
            Some(_) => {}
            None if t.starts_with("```") => fence = Some("```"),
            None if t.starts_with("~~~") => fence = Some("~~~"),
            None => {
                // Drop `code` spans: a run of backticks up to the next run of the same length.
                let mut rest = line;
                while let Some(i) = rest.find('`') {
                    out.push_str(&rest[..i]);
                    let ticks = rest[i..].len() - rest[i..].trim_start_matches('`').len();
                    let after = &rest[i + ticks..];
                    match after.find(&"`".repeat(ticks)) {
                        Some(j) => rest = &after[j + ticks..],
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
                out.push_str(rest);
            }
        }
        out.push('\n');
    }
    out
}

/// The targets of the inline links and images `[text](target)` / `![alt](target)` outside
/// code (a link's text may span lines; targets here have no spaces or parentheses).
fn links(text: &str) -> Vec<String> {
    let prose = prose(text);
    let mut out = Vec::new();
    let mut rest = prose.as_str();
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        if let Some(end) = rest.find(')') {
            let target = rest[..end].trim();
            if !target.is_empty() && !target.contains(char::is_whitespace) {
                out.push(target.to_owned());
            }
        }
    }
    out
}

/// The ids mdbook (and the forge) give the file's headings: the heading's text without its
/// markup, lowercased, whitespace to `-`, anything but letters, digits, `-` and `_` left
/// out; a repeated id gets `-1`, `-2`, ...
fn heading_ids(text: &str) -> BTreeSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut ids = BTreeSet::new();
    let mut fence: Option<&str> = None;
    for line in text.lines() {
        let t = line.trim_start();
        match fence {
            Some(f) if t.starts_with(f) => fence = None,
            Some(_) => continue,
            None if t.starts_with("```") => fence = Some("```"),
            None if t.starts_with("~~~") => fence = Some("~~~"),
            None => {}
        }
        let hashes = line.len() - line.trim_start_matches('#').len();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let id = slug(&heading_text(line[hashes..].trim()));
        let n = seen.entry(id.clone()).or_insert(0);
        ids.insert(if *n == 0 {
            id.clone()
        } else {
            format!("{id}-{n}")
        });
        *n += 1;
    }
    ids
}

/// A heading's text as rendered: `code` and emphasis markers dropped, a link's text kept.
fn heading_text(h: &str) -> String {
    let mut out = String::new();
    let mut rest = h;
    while let Some(i) = rest.find("](") {
        out.push_str(&rest[..i]);
        rest = &rest[i + 2..];
        rest = rest.find(')').map_or("", |e| &rest[e + 1..]);
    }
    out.push_str(rest);
    out.replace(['`', '*', '['], "")
}

fn slug(text: &str) -> String {
    text.chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '-' || c == '_' {
                Some(c.to_lowercase().next().unwrap_or(c))
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_outside_code_only() {
        let text = "See [a](a.md#x) and `[b](b.md)`.\n```\n[c](c.md)\n```\n\
                    ![d](bench/d.png) [e\nf](e.md) [g](https://example.org/g)\n";
        assert_eq!(
            links(text),
            ["a.md#x", "bench/d.png", "e.md", "https://example.org/g"]
        );
    }

    #[test]
    fn heading_ids_as_mdbook_makes_them() {
        let ids = heading_ids(
            "# Install\n## What `cargo xtask setup` installs\n## kube-proxy's flags\n\
             ## North-south (tc, XDP, DSR)\n```\n# not a heading\n```\n## Install\n#no\n",
        );
        let want = [
            "install",
            "install-1",
            "kube-proxys-flags",
            "north-south-tc-xdp-dsr",
            "what-cargo-xtask-setup-installs",
        ];
        assert_eq!(ids, want.map(String::from).into_iter().collect());
    }

    /// README.md and the guide link only to files and headings that exist, and every chapter
    /// is in SUMMARY.md.
    #[test]
    fn guide_links_resolve() {
        let problems = link_problems(&workspace()).unwrap();
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }
}
