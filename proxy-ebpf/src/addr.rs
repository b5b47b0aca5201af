//! The L4 address: (address, port, protocol), the shape every hook and map speaks of a
//! frontend, a backend, a client or one end of a packet's tuple.

/// An L4 address. 20 bytes, the layout of `proxy_common::FrontendKey` without its scope.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct L4Addr {
    /// Address, 16 bytes in network byte order; IPv4 stored IPv4-mapped.
    pub addr: [u8; 16],
    /// Port, network byte order (zero when unknown).
    pub port: [u8; 2],
    /// IANA protocol number.
    pub proto: u8,
    /// Reserved; always 0.
    pub _pad: u8,
}

impl L4Addr {
    /// `addr`:`port` over `proto`.
    #[inline(always)]
    pub const fn new(addr: [u8; 16], port: [u8; 2], proto: u8) -> L4Addr {
        L4Addr {
            addr,
            port,
            proto,
            _pad: 0,
        }
    }

    /// The all-zero address (filled in place later, to keep it off the stack twice).
    #[inline(always)]
    pub const fn zero() -> L4Addr {
        L4Addr::new([0; 16], [0; 2], 0)
    }
}
