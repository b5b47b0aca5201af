//! The image's root filesystem: the contents listed in [`super`] copied from this machine,
//! each host path mirrored with the symbolic links met on the way, and the libraries `ldd`
//! finds for the tools and the agent.

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use super::{
    AGENT, AGENT_LINKS, DEBIAN_PACKAGES, DIRS, ETC_FILES, HOST_FILES, Link, TOOL_LINKS, XTABLES_LIB,
};
use crate::command::show;

/// What [`write_rootfs`] wrote: counts and the bytes of regular files.
#[derive(Debug, Default)]
pub struct RootfsSummary {
    pub files: usize,
    pub links: usize,
    pub dirs: usize,
    /// Sum of the regular files' sizes, in bytes.
    pub bytes: u64,
}

/// Whether the agent binary goes into the root filesystem. Its libraries and
/// [`AGENT_LINKS`] always do.
pub enum Agent<'a> {
    /// The agent binary at `path`, copied to [`AGENT`] (`cargo xtask image`).
    Include(&'a Path),
    /// All but the agent binary at `path` (its libraries, its links, left dangling until
    /// it arrives): the Containerfile's final stage copies the binary
    /// (`cargo xtask image-rootfs`).
    AllButBinary(&'a Path),
}

/// Writes the image's files into `root`, which must not exist or be empty (it is created):
/// [`HOST_FILES`] and the libraries `ldd` lists for them, for the xtables modules and for the
/// agent; the xtables modules; [`TOOL_LINKS`]; [`AGENT_LINKS`]; [`DIRS`]; [`ETC_FILES`]; and
/// the agent binary as `agent` says.
///
/// Errors name the file that is missing (install [`DEBIAN_PACKAGES`], or run
/// `cargo xtask build` for the agent), a library `ldd` cannot find, or the path that could
/// not be written.
pub fn write_rootfs(root: &Path, agent: Agent<'_>) -> Result<RootfsSummary> {
    if root.exists() && fs::read_dir(root)?.next().is_some() {
        bail!("{} is not empty; remove it first", root.display());
    }
    fs::create_dir_all(root).with_context(|| format!("creating {}", root.display()))?;
    let agent_bin = match agent {
        Agent::Include(p) | Agent::AllButBinary(p) => p,
    };
    if !agent_bin.is_file() {
        bail!(
            "the agent binary {} is missing (run `cargo xtask build`)",
            agent_bin.display()
        );
    }
    for f in HOST_FILES {
        if fs::metadata(f).is_err() {
            bail!(
                "{f} is missing on this machine: install the Debian packages {} \
                 (`cargo xtask setup` does)",
                DEBIAN_PACKAGES.join(" ")
            );
        }
    }

    // Libraries of the programs first: the xtables modules' directory is found from them.
    let mut elf: Vec<PathBuf> = HOST_FILES.iter().map(PathBuf::from).collect();
    elf.push(agent_bin.to_owned());
    let mut libs = ldd(&elf)?;
    let xtables_dir = libs
        .iter()
        .find(|l| {
            l.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(XTABLES_LIB))
        })
        .and_then(|l| l.parent())
        .map(|d| d.join("xtables"))
        .context("ldd lists no libxtables.so.* for the iptables binaries")?;
    let modules: Vec<PathBuf> = fs::read_dir(&xtables_dir)
        .with_context(|| {
            format!(
                "reading the xtables modules' directory {}",
                xtables_dir.display()
            )
        })?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    let modules: Vec<PathBuf> = modules
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "so"))
        .collect();
    if modules.is_empty() {
        bail!("no xtables modules (*.so) in {}", xtables_dir.display());
    }
    // A module is a regular file or a link to one in the same directory; ldd reads both.
    libs.extend(ldd(&modules)?);

    let mut copied = BTreeSet::new();
    let mut sum = RootfsSummary::default();
    let paths = HOST_FILES
        .iter()
        .map(PathBuf::from)
        .chain(modules)
        .chain(libs);
    for p in paths {
        mirror(root, &p, &mut copied, &mut sum)?;
    }
    for l in TOOL_LINKS {
        make_link(root, l, &mut sum)?;
    }
    if let Agent::Include(bin) = agent {
        let dest = inside(root, Path::new(AGENT));
        create_dirs(root, dest.parent().expect("AGENT is a file path"), &mut sum)?;
        copy_file(bin, &dest, &mut sum)?;
    }
    // Both modes: a stage from scratch has no `ln`, so the Containerfile gets the links here.
    for l in AGENT_LINKS {
        make_link(root, l, &mut sum)?;
    }
    for (d, mode) in DIRS {
        let dest = inside(root, Path::new(d));
        create_dirs(root, &dest, &mut sum)?;
        fs::set_permissions(&dest, fs::Permissions::from_mode(mode))
            .with_context(|| format!("chmod {mode:o} {}", dest.display()))?;
    }
    for (f, text) in ETC_FILES {
        let dest = inside(root, Path::new(f));
        create_dirs(root, dest.parent().expect("a file path"), &mut sum)?;
        fs::write(&dest, text).with_context(|| format!("writing {}", dest.display()))?;
        fs::set_permissions(&dest, fs::Permissions::from_mode(0o644))?;
        sum.files += 1;
        sum.bytes += text.len() as u64;
    }
    Ok(sum)
}

/// The path of the absolute image path `p` inside `root`.
pub(super) fn inside(root: &Path, p: &Path) -> PathBuf {
    root.join(p.strip_prefix("/").unwrap_or(p))
}

/// Creates `dir` (inside `root`) and its missing parents with mode 0755.
fn create_dirs(root: &Path, dir: &Path, sum: &mut RootfsSummary) -> Result<()> {
    let mut missing = Vec::new();
    let mut d = dir;
    while d != root && !d.exists() {
        missing.push(d);
        d = d.parent().context("a directory outside the root")?;
    }
    for d in missing.into_iter().rev() {
        fs::create_dir(d).with_context(|| format!("creating {}", d.display()))?;
        fs::set_permissions(d, fs::Permissions::from_mode(0o755))?;
        sum.dirs += 1;
    }
    Ok(())
}

/// Copies a regular file without its set-user-ID and set-group-ID bits: in the image
/// everything runs as root, so they would only draw scanners' notice.
fn copy_file(src: &Path, dest: &Path, sum: &mut RootfsSummary) -> Result<()> {
    fs::copy(src, dest)
        .with_context(|| format!("copying {} to {}", src.display(), dest.display()))?;
    let mode = fs::metadata(src)?.permissions().mode() & 0o777;
    fs::set_permissions(dest, fs::Permissions::from_mode(mode))?;
    sum.files += 1;
    sum.bytes += fs::metadata(dest)?.len();
    Ok(())
}

fn make_link(root: &Path, l: Link, sum: &mut RootfsSummary) -> Result<()> {
    let dest = inside(root, Path::new(l.path));
    create_dirs(root, dest.parent().expect("a link path"), sum)?;
    symlink(l.target, &dest)
        .with_context(|| format!("linking {} -> {}", dest.display(), l.target))?;
    sum.links += 1;
    Ok(())
}

/// Copies the host path `path` into `root` at the same path. A symbolic link met on the way,
/// a directory such as `/lib -> usr/lib` or the file itself, is recreated as it is and
/// followed, so the image resolves `path` exactly as the host does. `done` holds the host
/// paths already handled.
fn mirror(
    root: &Path,
    path: &Path,
    done: &mut BTreeSet<PathBuf>,
    sum: &mut RootfsSummary,
) -> Result<()> {
    let mut todo = path.to_owned();
    // Linux gives up after 40 links in one lookup; so does this.
    for _ in 0..40 {
        match mirror_step(root, &todo, done, sum)? {
            None => return Ok(()),
            Some(next) => todo = next,
        }
    }
    bail!("too many levels of symbolic links in {}", path.display())
}

/// Walks `path` component by component from `/`, creating directories in `root` and
/// copying the final file. Returns the path to continue with when a component is a
/// symbolic link (after recreating it), None when the file has been copied.
fn mirror_step(
    root: &Path,
    path: &Path,
    done: &mut BTreeSet<PathBuf>,
    sum: &mut RootfsSummary,
) -> Result<Option<PathBuf>> {
    let comps: Vec<Component> = path.components().collect();
    let mut host = PathBuf::from("/");
    for (i, c) in comps.iter().enumerate() {
        match c {
            Component::RootDir | Component::CurDir => continue,
            Component::ParentDir => {
                host.pop();
                continue;
            }
            Component::Prefix(_) => bail!("not a Unix path: {}", path.display()),
            Component::Normal(n) => host.push(n),
        }
        let rest: PathBuf = comps[i + 1..].iter().collect();
        let meta = fs::symlink_metadata(&host)
            .with_context(|| format!("{} (for {})", host.display(), path.display()))?;
        let dest = inside(root, &host);
        if meta.file_type().is_symlink() {
            let target = fs::read_link(&host)?;
            if done.insert(host.clone()) {
                symlink(&target, &dest).with_context(|| {
                    format!("linking {} -> {}", dest.display(), target.display())
                })?;
                sum.links += 1;
            }
            let base = host.parent().expect("a link has a parent").to_owned();
            return Ok(Some(base.join(target).join(rest)));
        }
        if meta.is_dir() {
            if done.insert(host.clone()) {
                fs::create_dir(&dest).with_context(|| format!("creating {}", dest.display()))?;
                fs::set_permissions(&dest, fs::Permissions::from_mode(0o755))?;
                sum.dirs += 1;
            }
        } else if meta.is_file() && rest.as_os_str().is_empty() {
            if done.insert(host.clone()) {
                copy_file(&host, &dest, sum)?;
            }
            return Ok(None);
        } else {
            bail!(
                "{} (for {}) is neither a directory, a regular file nor a link",
                host.display(),
                path.display()
            );
        }
    }
    // The path named a directory: nothing more to copy.
    Ok(None)
}

/// The libraries (and the dynamic loader) `ldd` lists for `files`, as the absolute paths it
/// prints. Fails when a library is not found.
fn ldd(files: &[PathBuf]) -> Result<BTreeSet<PathBuf>> {
    let mut c = Command::new("ldd");
    c.args(files);
    let out = c
        .output()
        .context("running ldd (Debian package libc-bin)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "{} failed: {}{}",
            show(&c),
            text.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    parse_ldd(&text)
}

/// Paths in `ldd`'s output: `name => /path (0x...)` and `/path (0x...)` (the loader), for one
/// file or several (then each file's list follows a `file:` line). `linux-vdso.so.1` has no
/// path and is skipped; `name => not found` is an error.
pub(super) fn parse_ldd(text: &str) -> Result<BTreeSet<PathBuf>> {
    let mut out = BTreeSet::new();
    let mut file = "";
    for line in text.lines() {
        if !line.starts_with(char::is_whitespace) {
            file = line.trim_end_matches(':');
            continue;
        }
        let line = line.trim();
        let lib = match line.split_once(" => ") {
            Some((name, rest)) => {
                if rest.starts_with("not found") {
                    bail!("ldd: {name} (needed by {file}) not found");
                }
                rest
            }
            None => line,
        };
        let path = lib.split(" (").next().unwrap_or("");
        if path.starts_with('/') {
            out.insert(PathBuf::from(path));
        }
    }
    Ok(out)
}
