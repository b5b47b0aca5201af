//! cgroup v2: the cgroup2 mount and [`TestCgroup`], a child cgroup removed on drop.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Finds the cgroup v2 mount point in `/proc/self/mounts`.
pub fn cgroup2_mount() -> Result<PathBuf> {
    proxy_userspace::mounts::cgroup2_root()
}

/// A child cgroup of the cgroup v2 root, removed on drop (its processes are moved to the
/// root cgroup first).
#[derive(Debug)]
pub struct TestCgroup {
    path: PathBuf,
    root: PathBuf,
}

impl TestCgroup {
    /// Creates `<cgroup2 mount>/<name>`, removing a leftover of the same name first.
    pub fn create(name: &str) -> Result<Self> {
        if name.is_empty() || name.contains('/') || name.starts_with('.') {
            bail!("invalid cgroup name {name:?}");
        }
        let root = cgroup2_mount()?;
        let path = root.join(name);
        if path.exists() {
            remove_cgroup(&path, &root)
                .with_context(|| format!("removing leftover cgroup {}", path.display()))?;
        }
        fs::create_dir(&path).with_context(|| format!("creating cgroup {}", path.display()))?;
        Ok(Self { path, root })
    }

    /// Path of the cgroup directory (for `--cgroup-path` and [`spawn_in`](super::spawn_in)).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Pids currently in the cgroup (not in its descendants).
    pub fn pids(&self) -> Vec<u32> {
        read_pids(&self.path)
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = remove_cgroup(&self.path, &self.root);
    }
}

fn read_pids(cg: &Path) -> Vec<u32> {
    fs::read_to_string(cg.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Removes a cgroup and its descendants, moving their processes to `root`. Bounded: about
/// one second of retries for processes that are still exiting.
fn remove_cgroup(cg: &Path, root: &Path) -> io::Result<()> {
    if let Ok(entries) = fs::read_dir(cg) {
        for e in entries.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                let _ = remove_cgroup(&e.path(), root);
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        for pid in read_pids(cg) {
            // Fails for a zombie, which goes away when reaped; the retry loop covers it.
            let _ = fs::write(root.join("cgroup.procs"), pid.to_string());
        }
        match fs::remove_dir(cg) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => thread::sleep(Duration::from_millis(20)),
        }
    }
}
