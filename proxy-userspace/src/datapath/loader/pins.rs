//! Where the pins live and what they are on: the pin directory's name and path, the link
//! pins' names, and the file system checks (bpffs, cgroup v2).

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

use super::cgroup2_root;

/// Where the pins live: `<bpffs>/<pin_dir>` (see `check_pin_dir_name`).
pub fn pin_dir(bpffs: &Path, pin_dir: &str) -> PathBuf {
    bpffs.join(pin_dir)
}

/// Checks that a `--pin-dir` is a plain name (letters, digits, `-`, `_`; bpffs rejects dots),
/// so no path outside the BPF file system can be addressed through it.
pub fn check_pin_dir_name(pin_dir: &str) -> Result<()> {
    if pin_dir.is_empty()
        || !pin_dir
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        bail!(
            "--pin-dir {pin_dir:?} must be a plain name of letters, digits, '-' and '_' (it is created under --bpffs)"
        );
    }
    Ok(())
}

const BPF_FS_MAGIC: i64 = 0xcafe4a11;

const CGROUP2_SUPER_MAGIC: i64 = 0x63677270;

fn fs_magic(path: &Path) -> std::io::Result<i64> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(std::io::Error::other)?;
    // SAFETY: statfs(2) into a zeroed struct we own.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.f_type as i64)
}

/// True when `path` is on a BPF file system.
pub fn is_on_bpffs(path: &Path) -> bool {
    fs_magic(path).is_ok_and(|m| m == BPF_FS_MAGIC)
}

/// Checks that `cgroup` is a cgroup v2 directory, with a remedy in the error.
pub fn check_cgroup(cgroup: &Path) -> Result<()> {
    let hint = || match cgroup2_root() {
        Ok(root) => format!(
            "cgroup v2 is mounted at {}; pass it or a directory below it",
            root.display()
        ),
        Err(e) => format!("{e:#}"),
    };
    match fs_magic(cgroup) {
        Ok(CGROUP2_SUPER_MAGIC) if cgroup.is_dir() => Ok(()),
        Ok(_) => bail!(
            "--cgroup-path {} is not a cgroup v2 directory ({})",
            cgroup.display(),
            hint()
        ),
        Err(e) => bail!("--cgroup-path {}: {e} ({})", cgroup.display(), hint()),
    }
}

/// Path of the pinned link of program `prog`.
pub fn link_pin(dir: &Path, prog: &str) -> PathBuf {
    dir.join(format!("link_{prog}"))
}
