//! Word loads and stores at any alignment, each one BPF instruction.
//!
//! Packet headers sit at offsets the compiler cannot prove aligned (an IPv4 address at frame
//! byte 26), and the BPF target assumes strict alignment: `read_unaligned` of a `u32`
//! becomes four byte loads, shifts and ors, and a write four byte stores. The kernel's
//! verifier accepts a misaligned packet or map value access on architectures with efficient
//! unaligned access (x86-64, arm64: `CONFIG_HAVE_EFFICIENT_UNALIGNED_ACCESS`; stack accesses
//! must stay aligned), so these emit the single `ldx`/`stx` through inline assembly.
//! Enabling the target's `allows-misaligned-mem-access` instead would also merge stack
//! stores into misaligned words, which the verifier rejects.
//!
//! Values are in memory byte order (a network-order field reads as its big-endian value
//! seen through `from_ne_bytes`).

use core::arch::asm;

/// The 32-bit word at `p`.
///
/// # Safety
/// `p..p+4` must be readable memory the verifier accepts (packet bytes proven in bounds, a
/// map value, or a 4-byte aligned stack slot).
#[inline(always)]
pub unsafe fn load32(p: usize) -> u32 {
    let v: u64;
    // SAFETY: the caller's contract; one load, no other effect.
    unsafe {
        asm!("{v} = *(u32 *)({p} + 0)", p = in(reg) p, v = lateout(reg) v,
             options(readonly, nostack, preserves_flags));
    }
    v as u32
}

/// The 16-bit word at `p`.
///
/// # Safety
/// As [`load32`], for `p..p+2`.
#[inline(always)]
pub unsafe fn load16(p: usize) -> u16 {
    let v: u64;
    // SAFETY: the caller's contract; one load, no other effect.
    unsafe {
        asm!("{v} = *(u16 *)({p} + 0)", p = in(reg) p, v = lateout(reg) v,
             options(readonly, nostack, preserves_flags));
    }
    v as u16
}

/// Writes the 32-bit word `v` at `p`.
///
/// # Safety
/// `p..p+4` must be writable memory the verifier accepts (as [`load32`]).
#[inline(always)]
pub unsafe fn store32(p: usize, v: u32) {
    // SAFETY: the caller's contract; one store.
    unsafe {
        asm!("*(u32 *)({p} + 0) = {v}", p = in(reg) p, v = in(reg) v as u64,
             options(nostack, preserves_flags));
    }
}

/// Writes the 16-bit word `v` at `p`.
///
/// # Safety
/// As [`store32`], for `p..p+2`.
#[inline(always)]
pub unsafe fn store16(p: usize, v: u16) {
    // SAFETY: the caller's contract; one store.
    unsafe {
        asm!("*(u16 *)({p} + 0) = {v}", p = in(reg) p, v = in(reg) v as u64,
             options(nostack, preserves_flags));
    }
}

/// The 64-bit word at `p`.
///
/// # Safety
/// As [`load32`], for `p..p+8` (8-byte aligned on the stack).
#[inline(always)]
pub unsafe fn load64(p: usize) -> u64 {
    let v: u64;
    // SAFETY: the caller's contract; one load, no other effect.
    unsafe {
        asm!("{v} = *(u64 *)({p} + 0)", p = in(reg) p, v = lateout(reg) v,
             options(readonly, nostack, preserves_flags));
    }
    v
}

/// Writes the 64-bit word `v` at `p`.
///
/// # Safety
/// As [`store32`], for `p..p+8` (8-byte aligned on the stack).
#[inline(always)]
pub unsafe fn store64(p: usize, v: u64) {
    // SAFETY: the caller's contract; one store.
    unsafe {
        asm!("*(u64 *)({p} + 0) = {v}", p = in(reg) p, v = in(reg) v,
             options(nostack, preserves_flags));
    }
}

/// Copies the 16-byte address `src` into `dst` as two 64-bit words. A plain assignment of
/// a byte array becomes a call of the object's byte-by-byte `memmove` (16 turns of a loop).
/// Both must be 8-byte aligned when on the stack (the verifier rejects a misaligned stack
/// word): the address fields of `CtKey`, `CtEntry` and the per-CPU scratch are.
#[inline(always)]
pub fn copy_addr(dst: &mut [u8; 16], src: &[u8; 16]) {
    let (d, s) = (dst.as_mut_ptr() as usize, src.as_ptr() as usize);
    // SAFETY: both are 16 bytes of memory we may read (`src`) and write (`dst`).
    unsafe {
        store64(d, load64(s));
        store64(d + 8, load64(s + 8));
    }
}

/// Zeroes `v` with 64-bit stores, one per word (`size_of::<T>()` a multiple of 8; `v`
/// 8-byte aligned when on the stack). A plain zeroed assignment becomes a call of the
/// object's byte-by-byte `memset`.
///
/// # Safety
/// All-zero bytes must be a valid `T` (plain integers).
#[inline(always)]
pub unsafe fn zero_words<T>(v: &mut T) {
    const { assert!(core::mem::size_of::<T>().is_multiple_of(8)) };
    let p = v as *mut T as usize;
    for i in 0..core::mem::size_of::<T>() / 8 {
        // SAFETY: within `v`, which we may write; all-zero is a valid `T` (the caller's).
        unsafe { store64(p + 8 * i, 0) };
    }
}

/// Sets a conntrack key's protocol and zeroes its padding in one 32-bit store (the byte
/// after the ports and the three reserved bytes; little-endian target), rather than the
/// byte store and the `memset` call of three bytes that field assignments become.
#[inline(always)]
pub fn set_proto(k: &mut proxy_common::nat::CtKey, proto: u8) {
    use proxy_common::nat::CtKey;
    const {
        assert!(
            core::mem::offset_of!(CtKey, proto) % 4 == 0
                && core::mem::offset_of!(CtKey, _pad) == core::mem::offset_of!(CtKey, proto) + 1
                && core::mem::align_of::<CtKey>() >= 4
        )
    };
    // SAFETY: the 4 bytes at `proto` are `proto` and `_pad`, within `k`, 4-byte aligned
    // (asserted above).
    unsafe {
        ((k as *mut CtKey as *mut u8).add(core::mem::offset_of!(CtKey, proto)) as *mut u32)
            .write(proto as u32)
    };
}
