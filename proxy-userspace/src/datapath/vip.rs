//! VIP markers: one `FRONTENDS` entry per cluster IP, keyed by the address with port 0 and
//! protocol 0 and flagged `FRONTEND_F_VIP_MARKER`, so the programs refuse a port the VIP
//! does not define instead of letting it through. The reconciler writes them; the fake's
//! consistency check reads them the same way.

use proxy_common::{FRONTEND_F_EXTERNAL, FRONTEND_F_VIP_MARKER, Frontend, FrontendKey};

/// True for a frontend whose address gets a VIP marker: cluster IPs only (see
/// `FRONTEND_F_EXTERNAL`).
pub(crate) fn has_marker(f: &Frontend) -> bool {
    f.flags & (FRONTEND_F_VIP_MARKER | FRONTEND_F_EXTERNAL) == 0
}

/// The `FRONTENDS` key of the VIP marker of `addr` (a 16-byte map address).
pub(crate) fn marker_key(addr: [u8; 16]) -> FrontendKey {
    FrontendKey {
        addr,
        port: [0; 2],
        proto: 0,
        scope: 0,
    }
}

/// The `FRONTENDS` value of every VIP marker.
pub(crate) const MARKER: Frontend = Frontend {
    service_id: 0,
    backend_count: 0,
    flags: FRONTEND_F_VIP_MARKER,
    algorithm: 0,
    _pad: [0; 3],
    affinity_timeout_s: 0,
    affinity_group: 0,
};
