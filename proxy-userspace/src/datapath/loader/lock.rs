//! The pin directory's lock: one agent per pin directory, and a cleanup that waits for the
//! agent to stop.

use std::{fs, fs::File, path::Path};

use anyhow::{Context, Result, bail};

/// An exclusive lock on a pin directory, held while the agent runs, so two agents never
/// write the same maps (each would undo the other's entries). Released on drop or exit.
#[derive(Debug)]
pub struct PinDirLock(#[allow(dead_code)] File);

/// Creates `dir` if needed and locks it (`flock(LOCK_EX | LOCK_NB)`).
///
/// Errors: another process holds the lock (another agent uses this pin directory).
pub fn lock_pin_dir(dir: &Path) -> Result<PinDirLock> {
    fs::create_dir_all(dir).with_context(|| format!("create pin directory {}", dir.display()))?;
    let f = File::open(dir).with_context(|| format!("open pin directory {}", dir.display()))?;
    use std::os::fd::AsRawFd;
    // SAFETY: flock(2) on a descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            bail!(
                "another ebpf-proxy agent is using the pin directory {}; stop it or choose another --pin-dir",
                dir.display()
            );
        }
        return Err(e).with_context(|| format!("lock pin directory {}", dir.display()));
    }
    Ok(PinDirLock(f))
}

/// Waits (at most `wait`) until no agent holds the lock of the pin directory `dir`, then
/// holds it, so that a cleanup never races an agent that is still stopping (or running,
/// which would pin again what the cleanup removes). `None` when `dir` does not exist.
///
/// Errors: an agent still holds the lock after `wait`; the directory cannot be opened.
pub fn wait_pin_dir_free(dir: &Path, wait: std::time::Duration) -> Result<Option<PinDirLock>> {
    let f = match File::open(dir) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("open pin directory {}", dir.display())),
    };
    use std::os::fd::AsRawFd;
    let deadline = std::time::Instant::now() + wait;
    loop {
        // SAFETY: flock(2) on a descriptor we own.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(Some(PinDirLock(f)));
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(e).with_context(|| format!("lock pin directory {}", dir.display()));
        }
        if std::time::Instant::now() >= deadline {
            bail!(
                "an ebpf-proxy agent still runs on the pin directory {} (it holds its lock; waited {} s): stop it first (delete its DaemonSet, or SIGTERM), or it would pin again what the cleanup removes",
                dir.display(),
                wait.as_secs()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cleanup_waits_for_the_agents_lock_and_then_holds_it() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("pins");
        assert!(
            wait_pin_dir_free(&dir, std::time::Duration::ZERO)
                .unwrap()
                .is_none(),
            "nothing to wait for without the directory"
        );
        let agent = lock_pin_dir(&dir).unwrap();
        let e = wait_pin_dir_free(&dir, std::time::Duration::from_millis(200)).unwrap_err();
        assert!(
            e.to_string().contains("still runs on the pin directory"),
            "{e}"
        );
        // The agent stops meanwhile: the cleanup goes on, and holds the lock itself.
        let stopper = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            drop(agent);
        });
        let held = wait_pin_dir_free(&dir, std::time::Duration::from_secs(5)).unwrap();
        assert!(held.is_some());
        stopper.join().unwrap();
        assert!(lock_pin_dir(&dir).is_err(), "the cleanup holds the lock");
    }
}
