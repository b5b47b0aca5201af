//! The kernel's own statistics of ebpf-proxy's programs: run count and run time of every
//! program attached through the agent's pinned links, while `BPF_ENABLE_STATS` is on (the
//! file descriptor it returns keeps the statistics on; closing it turns them off, so
//! nothing is left enabled after the bench).

use std::{collections::BTreeMap, fs, os::fd::OwnedFd, path::Path};

use anyhow::{Context, Result};
use aya::{
    programs::{links::FdLink, links::PinnedLink, loaded_programs},
    sys::{Stats, enable_stats},
};

/// The programs measured, in report order: (program name, what it is).
pub const PROGRAMS: [(&str, &str); 12] = [
    ("connect4", "connect() of IPv4 sockets"),
    ("connect6", "connect() of IPv6 sockets"),
    ("sendmsg4", "sendmsg() of unconnected IPv4 UDP"),
    ("sendmsg6", "sendmsg() of unconnected IPv6 UDP"),
    ("recvmsg4", "recvmsg() of IPv4 UDP"),
    ("recvmsg6", "recvmsg() of IPv6 UDP"),
    ("getpeername4", "getpeername() of IPv4 sockets"),
    ("getpeername6", "getpeername() of IPv6 sockets"),
    ("sock_release", "release of every socket"),
    (
        "sock_egress",
        "cgroup skb egress: every packet of every socket",
    ),
    ("tc_ingress", "tcx ingress: every packet entering"),
    ("tc_egress", "tcx egress: every packet leaving"),
];

/// The floor program (`floor:<hook>`, see [`Floor`]) that shares program `name`'s kernel
/// path: the `sock_addr` hooks one, `sock_release` the other; none for the packet programs.
pub fn floor_of(name: &str) -> Option<&'static str> {
    match name {
        "sock_release" => Some("floor:sock_release"),
        n if n.starts_with("connect")
            || n.starts_with("sendmsg")
            || n.starts_with("recvmsg")
            || n.starts_with("getpeername") =>
        {
            Some("floor:connect4")
        }
        _ => None,
    }
}

/// Turns the statistics on while the returned descriptor lives.
pub fn enable() -> Result<OwnedFd> {
    enable_stats(Stats::RunTime).context("BPF_ENABLE_STATS (needs Linux >= 5.8 and CAP_SYS_ADMIN)")
}

/// Program name -> program id of the programs attached through the `link_*` pins under
/// `dir` (a program attached to several interfaces is one program).
pub fn attached(dir: &Path) -> BTreeMap<String, u32> {
    let mut ids = BTreeMap::new();
    let Ok(entries) = fs::read_dir(dir) else {
        return ids;
    };
    let mut by_id = BTreeMap::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("link_") {
            continue;
        }
        // Dropping the link closes our descriptor only; the pin keeps it attached.
        let Ok(link) = PinnedLink::from_pin(e.path()) else {
            continue;
        };
        let link: FdLink = link.into();
        if let Ok(info) = link.info() {
            by_id.insert(info.program_id(), ());
        }
    }
    for p in loaded_programs().flatten() {
        if by_id.contains_key(&p.id())
            && let Some(n) = p.name_as_str()
        {
            ids.insert(n.to_string(), p.id());
        }
    }
    ids
}

/// Run count and run time (ns) of each program in `ids`, now.
pub fn snapshot(ids: &BTreeMap<String, u32>) -> BTreeMap<String, (u64, u64)> {
    let mut out = BTreeMap::new();
    for p in loaded_programs().flatten() {
        if let Some((name, _)) = ids.iter().find(|(_, id)| **id == p.id()) {
            out.insert(
                name.clone(),
                (p.run_count(), p.run_time().as_nanos() as u64),
            );
        }
    }
    out
}

/// One program's cost over a measured interval.
#[derive(Clone, Debug, Default)]
pub struct Cost {
    /// Invocations.
    pub runs: u64,
    /// Time in the program, nanoseconds.
    pub ns: u64,
}

/// The costs between two snapshots, by program name (programs that did not run included,
/// with zero).
pub fn delta(
    before: &BTreeMap<String, (u64, u64)>,
    after: &BTreeMap<String, (u64, u64)>,
) -> BTreeMap<String, Cost> {
    after
        .iter()
        .map(|(name, (runs, ns))| {
            let (r0, n0) = before.get(name).copied().unwrap_or((0, 0));
            (
                name.clone(),
                Cost {
                    runs: runs.saturating_sub(r0),
                    ns: ns.saturating_sub(n0),
                },
            )
        })
        .collect()
}

/// What the statistics count for *any* program on a hook: programs that only return
/// "allow" (`r0 = 1; exit`), attached next to ebpf-proxy's on the bench cgroup for the same
/// client run. The kernel times each program from a clock read before the call to one
/// after it, so this floor is the statistics' own cost per invocation (the clock read and
/// the call into the program); the hook's dispatch (walking the cgroup's programs, building
/// the context) is outside every program's figures. What ebpf-proxy's programs take above
/// it is their own work.
///
/// Loaded and attached with raw `bpf()` calls (aya loads only from an object file) through
/// links held by this process: closing the descriptors (drop, exit, a crash) detaches them.
pub struct Floor {
    /// (hook, program id); hooks `connect4` (`cgroup/connect4`, the `sock_addr` path every
    /// address hook shares) and `sock_release` (`cgroup/sock_release`).
    pub ids: Vec<(&'static str, u32)>,
    _fds: Vec<OwnedFd>,
}

/// `BPF_PROG_TYPE_CGROUP_SOCK` and `BPF_PROG_TYPE_CGROUP_SOCK_ADDR` (uapi `enum bpf_prog_type`).
const PROG_TYPE_CGROUP_SOCK: u32 = 9;
const PROG_TYPE_CGROUP_SOCK_ADDR: u32 = 18;
/// `BPF_CGROUP_INET4_CONNECT` and `BPF_CGROUP_INET_SOCK_RELEASE` (uapi `enum bpf_attach_type`).
const ATTACH_INET4_CONNECT: u32 = 10;
const ATTACH_INET_SOCK_RELEASE: u32 = 34;
/// `bpf()` commands (uapi `enum bpf_cmd`).
const CMD_PROG_LOAD: libc::c_long = 5;
const CMD_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const CMD_LINK_CREATE: libc::c_long = 28;

/// One `bpf()` call with `attr` (a zero-padded `union bpf_attr`); the returned descriptor or
/// the OS error.
pub(crate) fn bpf(cmd: libc::c_long, attr: &mut [u64; 16]) -> std::io::Result<libc::c_long> {
    // SAFETY: `attr` is a valid, writable buffer of the size passed; the pointers inside it
    // point at live buffers of this call's caller.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.as_mut_ptr(),
            std::mem::size_of_val(attr) as libc::c_uint,
        )
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Loads `r0 = 1; exit` as `name`, of `prog_type` for `attach_type`.
fn load_noop(name: &str, prog_type: u32, attach_type: u32) -> Result<OwnedFd> {
    use std::os::fd::FromRawFd;
    // BPF_ALU64 | BPF_MOV | BPF_K to r0, imm 1; BPF_JMP | BPF_EXIT.
    let insns: [u64; 2] = [0xb7 | (1u64 << 32), 0x95];
    let license = c"GPL";
    let mut attr = [0u64; 16];
    attr[0] = prog_type as u64 | (insns.len() as u64) << 32;
    attr[1] = insns.as_ptr() as u64;
    attr[2] = license.as_ptr() as u64;
    // prog_name: bytes 48..64.
    let mut pn = [0u8; 16];
    pn[..name.len().min(15)].copy_from_slice(&name.as_bytes()[..name.len().min(15)]);
    attr[6] = u64::from_ne_bytes(pn[..8].try_into().unwrap());
    attr[7] = u64::from_ne_bytes(pn[8..].try_into().unwrap());
    // prog_ifindex (64) 0, expected_attach_type (68).
    attr[8] = (attach_type as u64) << 32;
    let fd = bpf(CMD_PROG_LOAD, &mut attr).with_context(|| format!("load {name}"))?;
    // SAFETY: a descriptor the kernel just returned to us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The id of the program behind `fd`.
fn prog_id(fd: &OwnedFd) -> Result<u32> {
    use std::os::fd::AsRawFd;
    // `struct bpf_prog_info` up to `id` (type u32, id u32); the kernel fills what fits.
    let mut info = [0u32; 2];
    let mut attr = [0u64; 16];
    attr[0] = fd.as_raw_fd() as u64 | (std::mem::size_of_val(&info) as u64) << 32;
    attr[1] = info.as_mut_ptr() as u64;
    bpf(CMD_OBJ_GET_INFO_BY_FD, &mut attr).context("program info")?;
    Ok(info[1])
}

impl Floor {
    /// Loads the two programs and attaches them to the cgroup at `cgroup`, which must be one
    /// of the bench's own child cgroups (`ebpf-proxy-bench*`; anything else is refused).
    pub fn attach(cgroup: &Path) -> Result<Floor> {
        use std::os::fd::{AsRawFd, FromRawFd};
        anyhow::ensure!(
            cgroup
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("ebpf-proxy-bench")),
            "refusing to attach to {}: not a bench cgroup",
            cgroup.display()
        );
        let cg = fs::File::open(cgroup).with_context(|| format!("open {}", cgroup.display()))?;
        let mut ids = Vec::new();
        let mut fds = Vec::new();
        for (hook, name, ty, at) in [
            (
                "connect4",
                "floor_connect4",
                PROG_TYPE_CGROUP_SOCK_ADDR,
                ATTACH_INET4_CONNECT,
            ),
            (
                "sock_release",
                "floor_release",
                PROG_TYPE_CGROUP_SOCK,
                ATTACH_INET_SOCK_RELEASE,
            ),
        ] {
            let prog = load_noop(name, ty, at)?;
            let mut attr = [0u64; 16];
            // prog_fd, target_fd, attach_type, flags.
            attr[0] = prog.as_raw_fd() as u64 | (cg.as_raw_fd() as u64) << 32;
            attr[1] = at as u64;
            let link = bpf(CMD_LINK_CREATE, &mut attr).with_context(|| format!("attach {name}"))?;
            // SAFETY: a descriptor the kernel just returned to us; owned at once, so any
            // error below detaches the program again.
            fds.push(unsafe { OwnedFd::from_raw_fd(link as i32) });
            ids.push((hook, prog_id(&prog)?));
            fds.push(prog);
        }
        Ok(Floor { ids, _fds: fds })
    }

    /// Program name (`floor:<hook>`) -> id, for [`snapshot`].
    pub fn named(&self) -> BTreeMap<String, u32> {
        self.ids
            .iter()
            .map(|(h, id)| (format!("floor:{h}"), *id))
            .collect()
    }
}
