//! Processes: commands run or spawned inside a cgroup and a network namespace, closures
//! run in a namespace, and [`ChildGuard`], which ends its child on drop.

use std::ffi::CString;
use std::fs;
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Prepares `cmd` so that the child joins `cgroup` (a cgroup v2 directory) and then the
/// network namespace at `netns` before it executes.
///
/// The cgroup is joined first so that every socket the program creates belongs to it. The
/// mount namespace is not changed (unlike `ip netns exec`, which remounts `/sys`), so the
/// child still sees the root `/sys/fs/cgroup` and `/sys/fs/bpf`.
pub fn configure_in(
    netns: Option<&Path>,
    cgroup: Option<&Path>,
    cmd: &mut Command,
) -> io::Result<()> {
    let procs = cgroup
        .map(|c| CString::new(c.join("cgroup.procs").as_os_str().as_bytes()))
        .transpose()
        .map_err(io::Error::other)?;
    let ns = netns
        .map(|p| CString::new(p.as_os_str().as_bytes()))
        .transpose()
        .map_err(io::Error::other)?;
    // SAFETY: the closure runs in the forked child before exec and only calls
    // async-signal-safe functions (prctl, open, write, setns, close) on data prepared before
    // fork.
    unsafe {
        cmd.pre_exec(move || {
            // Die with the test or demo that started us, even when it is SIGKILLed, so no
            // server or agent outlives its run.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            if let Some(procs) = &procs {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                // "0" moves the writing process itself.
                let n = libc::write(fd, b"0".as_ptr().cast(), 1);
                let err = io::Error::last_os_error();
                libc::close(fd);
                if n < 0 {
                    return Err(err);
                }
            }
            if let Some(ns) = &ns {
                let fd = libc::open(ns.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                let r = libc::setns(fd, libc::CLONE_NEWNET);
                let err = io::Error::last_os_error();
                libc::close(fd);
                if r != 0 {
                    return Err(err);
                }
            }
            Ok(())
        });
    }
    Ok(())
}

/// Spawns `cmd` inside `cgroup` and the network namespace `netns` (see [`configure_in`]).
pub fn spawn_in(
    netns: Option<&Path>,
    cgroup: Option<&Path>,
    cmd: &mut Command,
) -> io::Result<Child> {
    configure_in(netns, cgroup, cmd)?;
    cmd.spawn()
}

/// Runs `cmd` inside `cgroup` and `netns`, waits at most `timeout` and returns its output.
///
/// Standard input is `/dev/null` unless the caller set it. On timeout the child is killed
/// and an error of kind [`io::ErrorKind::TimedOut`] carrying the output so far is returned.
/// A non-zero exit status is not an error: check `output.status`.
pub fn output_in(
    netns: Option<&Path>,
    cgroup: Option<&Path>,
    cmd: &mut Command,
    timeout: Duration,
) -> io::Result<Output> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    // Command has no getter for stdin; a caller that wants input uses spawn_in.
    cmd.stdin(Stdio::null());
    let mut child = spawn_in(netns, cgroup, cmd)?;
    let out = child.stdout.take().map(read_all_thread);
    let err = child.stderr.take().map(read_all_thread);
    let mut guard = ChildGuard::new(child);
    let status = guard.wait_timeout(timeout)?;
    // The pipes close when the child exits (or was killed), unless it left grandchildren
    // holding them; those readers are then abandoned.
    let collect = |h: Option<thread::JoinHandle<Vec<u8>>>| -> Vec<u8> {
        h.and_then(|h| {
            let deadline = Instant::now() + Duration::from_secs(2);
            while !h.is_finished() && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(5));
            }
            if h.is_finished() { h.join().ok() } else { None }
        })
        .unwrap_or_default()
    };
    match status {
        Some(status) => Ok(Output {
            status,
            stdout: collect(out),
            stderr: collect(err),
        }),
        None => {
            guard.kill();
            let stdout = collect(out);
            let stderr = collect(err);
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "{:?} did not finish within {timeout:?}; stdout: {:?}; stderr: {:?}",
                    cmd,
                    String::from_utf8_lossy(&stdout),
                    String::from_utf8_lossy(&stderr)
                ),
            ))
        }
    }
}

fn read_all_thread<R: Read + Send + 'static>(mut r: R) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = r.read_to_end(&mut buf);
        buf
    })
}

/// Runs `f` on a new thread that first joins the network namespace at `netns` (the
/// calling thread keeps its namespace). Sockets `f` creates belong to that namespace, but
/// not to a test cgroup: use [`spawn_in`] for traffic that must pass cgroup programs.
pub fn in_netns<T: Send>(netns: &Path, f: impl FnOnce() -> T + Send) -> io::Result<T> {
    let file = fs::File::open(netns)?;
    thread::scope(|s| {
        s.spawn(move || {
            use std::os::fd::AsRawFd;
            // SAFETY: valid fd; affects only this thread, which ends after `f`.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(f())
        })
        .join()
        .map_err(|_| io::Error::other("thread in netns panicked"))?
    })
}

/// Runs a short command (bounded by `timeout`) and fails unless it exits 0; returns stdout.
pub fn run_checked(netns: Option<&Path>, cmd: &mut Command, timeout: Duration) -> Result<String> {
    let out = output_in(netns, None, cmd, timeout).with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{:?} failed ({}): {}",
            cmd,
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A child process that is killed and reaped when the guard is dropped.
#[derive(Debug)]
pub struct ChildGuard {
    child: Option<Child>,
}

impl ChildGuard {
    /// Takes ownership of `child`.
    pub fn new(child: Child) -> Self {
        Self { child: Some(child) }
    }

    /// Spawns `cmd` with [`spawn_in`] and guards it.
    pub fn spawn_in(
        netns: Option<&Path>,
        cgroup: Option<&Path>,
        cmd: &mut Command,
    ) -> io::Result<Self> {
        spawn_in(netns, cgroup, cmd).map(Self::new)
    }

    /// Process id of the child.
    pub fn id(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or(0)
    }

    /// The guarded child (e.g. to take its stdin/stdout).
    pub fn child_mut(&mut self) -> &mut Child {
        self.child
            .as_mut()
            .expect("ChildGuard holds a child until dropped")
    }

    /// Exit status if the child has exited, without blocking.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        match self.child.as_mut() {
            Some(c) => c.try_wait(),
            None => Ok(None),
        }
    }

    /// Waits at most `timeout` for the child to exit; `None` if it is still running.
    pub fn wait_timeout(&mut self, timeout: Duration) -> io::Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait()? {
                return Ok(Some(s));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// Sends `SIGTERM`, waits at most `grace`, then kills. Returns the exit status.
    pub fn terminate(&mut self, grace: Duration) -> io::Result<ExitStatus> {
        if let Some(s) = self.try_wait()? {
            return Ok(s);
        }
        let pid = self.id() as libc::pid_t;
        if pid > 0 {
            // SAFETY: plain syscall on the pid of our own unreaped child.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        if let Some(s) = self.wait_timeout(grace)? {
            return Ok(s);
        }
        let c = self.child_mut();
        let _ = c.kill();
        c.wait()
    }

    /// Kills the child and reaps it (idempotent).
    pub fn kill(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Gives up the guard and returns the child without killing it.
    pub fn into_inner(mut self) -> Child {
        self.child
            .take()
            .expect("ChildGuard holds a child until dropped")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}
