//! Batched reads and writes of BPF maps (`BPF_MAP_LOOKUP_BATCH`, `BPF_MAP_UPDATE_BATCH`,
//! Linux >= 5.6; hash maps, and reads of arrays): one system call per [`CHUNK`] entries
//! instead of one (write) or two (read: next key, then value) per entry, which is what
//! makes a full read or a first write of 30,000 Services' maps (about 700,000 entries) cost
//! tens of milliseconds instead of a second. aya 0.14 has no batch operations, so these are
//! the raw `bpf(2)` commands on the map's file descriptor.

use std::io;
use std::os::fd::{AsFd, AsRawFd};

/// Entries per system call. A hash map's batch read returns whole buckets, so this must
/// exceed the longest bucket (a few entries at the maps' load factors).
pub const CHUNK: usize = 4096;

/// `BPF_MAP_LOOKUP_BATCH` (`enum bpf_cmd`).
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
/// `BPF_MAP_UPDATE_BATCH` (`enum bpf_cmd`).
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;

/// The `batch` member of `union bpf_attr` (include/uapi/linux/bpf.h).
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

fn bpf(cmd: libc::c_long, attr: &mut BatchAttr) -> io::Result<()> {
    // SAFETY: `attr` is a valid `bpf_attr` prefix for the batch commands; the buffers it
    // points to are owned by the caller, sized for `count` entries, and outlive the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut BatchAttr,
            std::mem::size_of::<BatchAttr>() as libc::c_uint,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Every entry of the hash map `map` (key type `K`, value type `V`, which must be the map's
/// key and value layouts), in the kernel's bucket order. Entries added or removed while it
/// reads may or may not be seen, as with key-by-key iteration.
///
/// Errors: the system call's (EINVAL for a map that is not a hash map or a kernel older than
/// 5.6).
pub fn read_all<K: aya::Pod, V: aya::Pod>(map: impl AsFd) -> io::Result<Vec<(K, V)>> {
    let mut out = Vec::new();
    for_each(map, |k: &K, v: &V| out.push((*k, *v)))?;
    Ok(out)
}

/// Passes every entry of the map `map` to `f`, [`CHUNK`] entries per system call, without
/// holding more than one chunk: for hash maps (as [`read_all`]) and arrays (every index,
/// in order; a large array is read in a few calls instead of one per index).
///
/// Errors: the system call's (EINVAL for a map kind without batch reads or a kernel older
/// than 5.6).
pub fn for_each<K: aya::Pod, V: aya::Pod>(
    map: impl AsFd,
    mut f: impl FnMut(&K, &V),
) -> io::Result<()> {
    // SAFETY: `Pod` types are plain data, valid when all-zero.
    let zero_k: K = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let zero_v: V = unsafe { std::mem::zeroed() };
    let mut keys = vec![zero_k; CHUNK];
    let mut values = vec![zero_v; CHUNK];
    // The position token: a bucket index (u32) for hash maps, an index for arrays; room
    // for any map kind.
    let mut token = [0u64; 8];
    let mut next = [0u64; 8];
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { token.as_ptr() as u64 },
            out_batch: next.as_mut_ptr() as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd: map.as_fd().as_raw_fd() as u32,
            ..Default::default()
        };
        let r = bpf(BPF_MAP_LOOKUP_BATCH, &mut attr);
        let n = (attr.count as usize).min(CHUNK);
        let end = match r {
            Ok(()) => false,
            // The end: the last entries came with it.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
            Err(e) => return Err(e),
        };
        keys[..n]
            .iter()
            .zip(&values[..n])
            .for_each(|(k, v)| f(k, v));
        if end {
            return Ok(());
        }
        token = next;
        first = false;
    }
}

/// Creates or replaces `entries` in the hash map `map`, [`CHUNK`] per system call, in
/// order.
///
/// Errors: the system call's, with how many entries were written before it (the kernel
/// stops at the first entry it cannot write, e.g. E2BIG for a full map).
pub fn write_all<K: aya::Pod, V: aya::Pod>(
    map: impl AsFd,
    keys: &[K],
    values: &[V],
) -> Result<(), (usize, io::Error)> {
    assert_eq!(keys.len(), values.len(), "one value per key");
    let mut done = 0;
    for (k, v) in keys.chunks(CHUNK).zip(values.chunks(CHUNK)) {
        let mut attr = BatchAttr {
            keys: k.as_ptr() as u64,
            values: v.as_ptr() as u64,
            count: k.len() as u32,
            map_fd: map.as_fd().as_raw_fd() as u32,
            ..Default::default()
        };
        if let Err(e) = bpf(BPF_MAP_UPDATE_BATCH, &mut attr) {
            return Err((done + attr.count as usize, e));
        }
        done += k.len();
    }
    Ok(())
}

/// `BPF_MAP_LOOKUP_AND_DELETE_ELEM` (`enum bpf_cmd`).
const BPF_MAP_LOOKUP_AND_DELETE_ELEM: libc::c_long = 21;

/// The element member of `union bpf_attr` (map_fd, key, value, flags).
#[repr(C)]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// Removes `key` from the per-CPU hash map `map` (values `u64`) and returns its value on
/// each of the `cpus` possible CPUs, in one system call (`BPF_MAP_LOOKUP_AND_DELETE_ELEM`
/// on a per-CPU hash, Linux >= 5.14; aya 0.14 does not expose it): a count the programs
/// add between a read and a delete would be lost. `None` when the key is absent.
pub fn take_per_cpu_u64<K: aya::Pod>(
    map: impl AsFd,
    key: &K,
    cpus: usize,
) -> io::Result<Option<Vec<u64>>> {
    let mut values = vec![0u64; cpus];
    let mut attr = ElemAttr {
        map_fd: map.as_fd().as_raw_fd() as u32,
        _pad: 0,
        key: key as *const K as u64,
        value: values.as_mut_ptr() as u64,
        flags: 0,
    };
    // SAFETY: `attr` is a valid `bpf_attr` prefix for the element commands; the key and the
    // value buffer (one 8-byte value per possible CPU, the kernel's per-CPU layout for a
    // `u64`) outlive the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_LOOKUP_AND_DELETE_ELEM,
            &mut attr as *mut ElemAttr,
            std::mem::size_of::<ElemAttr>() as libc::c_uint,
        )
    };
    if r == 0 {
        return Ok(Some(values));
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ENOENT) {
        Ok(None)
    } else {
        Err(e)
    }
}
