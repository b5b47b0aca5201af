//! Conversions between the maps' 16-byte address form (network byte order, IPv4 stored
//! IPv4-mapped, see the crate root) and the address fields of `bpf_sock_addr`
//! (`user_ip4`, `user_ip6`).

/// Builds the 16-byte form of an IPv4 address given as `bpf_sock_addr.user_ip4` holds it
/// (network byte order in a `u32`, so its memory bytes are the address bytes).
#[inline(always)]
pub const fn v4_mapped(ip4_be: u32) -> [u8; 16] {
    let b = ip4_be.to_ne_bytes();
    [
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, b[0], b[1], b[2], b[3],
    ]
}

/// True when a 16-byte address is IPv4-mapped (`::ffff:0:0/96`).
#[inline(always)]
pub const fn is_v4_mapped(a: &[u8; 16]) -> bool {
    a[0] == 0
        && a[1] == 0
        && a[2] == 0
        && a[3] == 0
        && a[4] == 0
        && a[5] == 0
        && a[6] == 0
        && a[7] == 0
        && a[8] == 0
        && a[9] == 0
        && a[10] == 0xff
        && a[11] == 0xff
}

/// The IPv4 address of a mapped address as `bpf_sock_addr.user_ip4` holds it.
#[inline(always)]
pub const fn v4_of_mapped(a: &[u8; 16]) -> u32 {
    u32::from_ne_bytes([a[12], a[13], a[14], a[15]])
}

/// 16 address bytes -> the four `u32` words of `bpf_sock_addr.user_ip6` (memory order kept).
#[inline(always)]
pub const fn words_of(a: &[u8; 16]) -> [u32; 4] {
    [
        u32::from_ne_bytes([a[0], a[1], a[2], a[3]]),
        u32::from_ne_bytes([a[4], a[5], a[6], a[7]]),
        u32::from_ne_bytes([a[8], a[9], a[10], a[11]]),
        u32::from_ne_bytes([a[12], a[13], a[14], a[15]]),
    ]
}

/// The four `u32` words of `bpf_sock_addr.user_ip6` -> 16 address bytes.
#[inline(always)]
pub const fn bytes_of(w: &[u32; 4]) -> [u8; 16] {
    let (a, b, c, d) = (
        w[0].to_ne_bytes(),
        w[1].to_ne_bytes(),
        w[2].to_ne_bytes(),
        w[3].to_ne_bytes(),
    );
    [
        a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3], d[0], d[1], d[2],
        d[3],
    ]
}
