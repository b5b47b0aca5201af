//! Mount points from `/proc/self/mounts`: the cgroup v2 root (default attach point) and the
//! BPF file system (where maps and links are pinned).

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};

/// First mount point of file system type `fstype` (optionally exactly at `at`).
pub fn find_mount(fstype: &str, at: Option<&Path>) -> Result<Option<PathBuf>> {
    let mounts = fs::read_to_string("/proc/self/mounts").context("reading /proc/self/mounts")?;
    for line in mounts.lines() {
        let mut f = line.split_whitespace();
        let (_dev, Some(mnt), Some(ty)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let mnt = PathBuf::from(unescape_mount(mnt));
        if ty == fstype && at.is_none_or(|a| a == mnt) {
            return Ok(Some(mnt));
        }
    }
    Ok(None)
}

/// Undoes the octal escapes (`\040` for a space) of `/proc/self/mounts`.
fn unescape_mount(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The cgroup v2 mount point (on hybrid hosts e.g. `/sys/fs/cgroup/unified`).
///
/// Errors: no cgroup2 file system is mounted (the remedy is in the message).
pub fn cgroup2_root() -> Result<PathBuf> {
    find_mount("cgroup2", None)?.context(
        "no cgroup2 file system is mounted (see /proc/self/mounts); \
         mount one, e.g. `mount -t cgroup2 none /sys/fs/cgroup/unified`",
    )
}

/// Inode of the initial cgroup namespace (the kernel's `PROC_CGROUP_INIT_INO`).
const INITIAL_CGROUP_NS: u64 = 0xEFFF_FFFB;

/// Whether this process runs in the node's (initial) cgroup namespace, read from
/// `/proc/self/ns/cgroup` (`cgroup:[INODE]`); `None` when that cannot be read. In another
/// namespace (a container's, the default for pods on cgroup v2) a cgroup2 mount shows only
/// the namespace's subtree, so its root is not the node's.
pub(crate) fn in_initial_cgroup_namespace() -> Option<bool> {
    let link = fs::read_link("/proc/self/ns/cgroup").ok()?;
    let ino: u64 = link
        .to_str()?
        .strip_prefix("cgroup:[")?
        .strip_suffix(']')?
        .parse()
        .ok()?;
    Some(ino == INITIAL_CGROUP_NS)
}

/// Mounts bpffs at `path` unless a bpf file system is mounted exactly there. Returns `true`
/// when it mounted it now.
///
/// Errors: the mount(2) failed (not root, no CONFIG_BPF_SYSCALL); the message has the remedy.
pub fn ensure_bpffs(path: &Path) -> Result<bool> {
    mount_bpffs(path)
        .map_err(|e| anyhow::anyhow!("{e:#} (run `mount -t bpf bpf {}` as root)", path.display()))
}

/// [`ensure_bpffs`] without the remedy in its error, for callers that state it themselves.
pub(crate) fn mount_bpffs(path: &Path) -> Result<bool> {
    if find_mount("bpf", Some(path))?.is_some() {
        return Ok(false);
    }
    let target = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .with_context(|| format!("bpffs path {} holds a NUL byte", path.display()))?;
    // The directories this call creates, outermost first: removed again when the creation
    // or the mount fails, so a failed start leaves nothing behind.
    let created: Vec<&Path> = {
        let mut missing: Vec<&Path> = path.ancestors().take_while(|p| !p.exists()).collect();
        missing.reverse();
        missing
    };
    let undo = || {
        for dir in created.iter().rev() {
            let _ = fs::remove_dir(dir);
        }
    };
    if let Err(e) = fs::create_dir_all(path) {
        undo();
        return Err(e).with_context(|| format!("create {}", path.display()));
    }
    // SAFETY: plain mount(2) with valid NUL-terminated strings and no data.
    let rc = unsafe {
        libc::mount(
            c"bpf".as_ptr(),
            target.as_ptr(),
            c"bpf".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        undo();
        bail!(
            "bpffs is not mounted at {} and mounting it failed: {err}",
            path.display()
        );
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unescapes_spaces() {
        assert_eq!(unescape_mount(r"/mnt/a\040b"), "/mnt/a b");
        assert_eq!(unescape_mount("/sys/fs/bpf"), "/sys/fs/bpf");
        assert_eq!(unescape_mount("/x\\"), "/x\\");
    }
}
