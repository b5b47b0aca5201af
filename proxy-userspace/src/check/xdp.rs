//! Native XDP per interface, as the kernel reports it (informational).

use super::{CheckResult, Status};

/// Per interface of this network namespace (not `lo`), whether its driver runs XDP
/// natively (`--xdp native`; without it `--xdp best-effort` falls back to generic XDP). The
/// answer is the kernel's own: the `xdp-features` of the generic netlink family `netdev`
/// (Linux >= 6.3, `Documentation/netlink/specs/netdev.yaml`); `basic` (XDP_PASS, DROP,
/// ABORTED in the driver) means native XDP. Informational: never a failure.
pub(super) fn xdp() -> CheckResult {
    let names: Vec<(String, u32)> = crate::datapath::tc::interface_addresses()
        .map(|m| m.into_keys().collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .filter(|n| n != "lo")
        .filter_map(|n| Some((n.clone(), crate::datapath::tc::if_index(&n)?)))
        .collect();
    let mut parts = Vec::new();
    for (name, index) in &names {
        match netdev::xdp_features(*index) {
            Ok(f) => parts.push(format!(
                "{name}: {}",
                xdp_description(&netdev::describe(f), crate::datapath::veth::is_veth(name))
            )),
            Err(e) => {
                return CheckResult::bad(
                    "xdp",
                    Status::Warn,
                    format!("cannot read the interfaces' XDP features: {e}"),
                    "Linux >= 6.3 reports them (netlink family netdev); --xdp best-effort still works",
                );
            }
        }
    }
    if parts.is_empty() {
        parts.push("no interface besides lo".into());
    }
    CheckResult::ok("xdp", parts.join("; "))
}

/// An interface's XDP row: a native veth gets the condition that makes it usable (see
/// [`crate::datapath::veth`]).
fn xdp_description(features: &str, veth: bool) -> String {
    if veth && features.starts_with("native") {
        format!(
            "{features}, but frames sent back need an XDP program on the peer (veth: --xdp best-effort keeps it on tcx; --xdp native needs --xdp-veth-peers-ready)"
        )
    } else {
        features.to_string()
    }
}

/// The generic netlink family `netdev`: `dev-get` of one interface's `xdp-features`.
mod netdev {
    use std::io;

    const NETLINK_GENERIC: i32 = 16;
    const GENL_ID_CTRL: u16 = 0x10;
    const CTRL_CMD_GETFAMILY: u8 = 3;
    const CTRL_ATTR_FAMILY_ID: u16 = 1;
    const CTRL_ATTR_FAMILY_NAME: u16 = 2;
    const NETDEV_CMD_DEV_GET: u8 = 1;
    const NETDEV_A_DEV_IFINDEX: u16 = 1;
    const NETDEV_A_DEV_XDP_FEATURES: u16 = 3;
    const NLM_F_REQUEST: u16 = 1;
    const NLMSG_ERROR: u16 = 2;
    /// `enum netdev_xdp_act` bits and their names.
    const ACTS: [(u64, &str); 3] = [(1, "basic"), (2, "redirect"), (4, "ndo-xmit")];

    /// "native (basic, redirect, ndo-xmit)" or "generic only".
    pub fn describe(f: u64) -> String {
        if f & 1 == 0 {
            return "generic only (no native XDP in its driver)".into();
        }
        let acts: Vec<&str> = ACTS
            .iter()
            .filter(|(b, _)| f & b != 0)
            .map(|(_, n)| *n)
            .collect();
        format!("native ({})", acts.join(", "))
    }

    /// One netlink request with a genetlink header and attributes; the attributes of the
    /// answer.
    fn request(
        fd: i32,
        ty: u16,
        cmd: u8,
        attrs: &[(u16, &[u8])],
    ) -> io::Result<Vec<(u16, Vec<u8>)>> {
        let mut msg = vec![0u8; 20];
        for (t, v) in attrs {
            let len = 4 + v.len();
            msg.extend_from_slice(&(len as u16).to_ne_bytes());
            msg.extend_from_slice(&t.to_ne_bytes());
            msg.extend_from_slice(v);
            msg.resize(msg.len().next_multiple_of(4), 0);
        }
        let total = msg.len() as u32;
        msg[0..4].copy_from_slice(&total.to_ne_bytes());
        msg[4..6].copy_from_slice(&ty.to_ne_bytes());
        msg[6..8].copy_from_slice(&NLM_F_REQUEST.to_ne_bytes());
        msg[16] = cmd;
        msg[17] = 1; // version
        // SAFETY: send(2)/recv(2) of buffers we own on a socket we own.
        let sent = unsafe { libc::send(fd, msg.as_ptr().cast(), msg.len(), 0) };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut buf = vec![0u8; 8192];
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        parse_reply(&buf[..n as usize])
    }

    /// The attributes of a genetlink answer, or the error it carries.
    pub(super) fn parse_reply(b: &[u8]) -> io::Result<Vec<(u16, Vec<u8>)>> {
        let bad = || io::Error::new(io::ErrorKind::InvalidData, "short netlink answer");
        if b.len() < 16 {
            return Err(bad());
        }
        let len = (u32::from_ne_bytes(b[0..4].try_into().unwrap()) as usize).min(b.len());
        let ty = u16::from_ne_bytes(b[4..6].try_into().unwrap());
        if ty == NLMSG_ERROR {
            let code = i32::from_ne_bytes(b.get(16..20).ok_or_else(bad)?.try_into().unwrap());
            return Err(io::Error::from_raw_os_error(-code));
        }
        let mut out = Vec::new();
        let mut off = 20;
        while off + 4 <= len {
            let alen = u16::from_ne_bytes(b[off..off + 2].try_into().unwrap()) as usize;
            let aty = u16::from_ne_bytes(b[off + 2..off + 4].try_into().unwrap()) & 0x3fff;
            if alen < 4 || off + alen > len {
                break;
            }
            out.push((aty, b[off + 4..off + alen].to_vec()));
            off += alen.next_multiple_of(4);
        }
        Ok(out)
    }

    /// The `xdp-features` bit set of interface `ifindex`.
    pub fn xdp_features(ifindex: u32) -> io::Result<u64> {
        // SAFETY: a netlink socket we close below.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                NETLINK_GENERIC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let r = (|| {
            let fam = request(
                fd,
                GENL_ID_CTRL,
                CTRL_CMD_GETFAMILY,
                &[(CTRL_ATTR_FAMILY_NAME, b"netdev\0")],
            )?;
            let id = fam
                .iter()
                .find(|(t, v)| *t == CTRL_ATTR_FAMILY_ID && v.len() >= 2)
                .map(|(_, v)| u16::from_ne_bytes([v[0], v[1]]))
                .ok_or_else(|| io::Error::other("no netlink family netdev"))?;
            let dev = request(
                fd,
                id,
                NETDEV_CMD_DEV_GET,
                &[(NETDEV_A_DEV_IFINDEX, &ifindex.to_ne_bytes())],
            )?;
            dev.iter()
                .find(|(t, v)| *t == NETDEV_A_DEV_XDP_FEATURES && v.len() >= 8)
                .map(|(_, v)| u64::from_ne_bytes(v[..8].try_into().unwrap()))
                .ok_or_else(|| io::Error::other("no xdp-features in the answer"))
        })();
        // SAFETY: our own socket.
        unsafe { libc::close(fd) };
        r
    }
}

#[cfg(test)]
mod tests {
    use super::netdev::{describe, parse_reply};

    #[test]
    fn a_native_veth_is_flagged() {
        assert_eq!(
            super::xdp_description("native (basic)", false),
            "native (basic)"
        );
        let v = super::xdp_description("native (basic, redirect, ndo-xmit)", true);
        assert!(
            v.starts_with("native (basic, redirect, ndo-xmit), but frames sent back need an XDP program on the peer"),
            "{v}"
        );
        assert_eq!(
            super::xdp_description("generic only (no native XDP in its driver)", true),
            "generic only (no native XDP in its driver)"
        );
    }

    #[test]
    fn xdp_features_are_read_from_a_netdev_answer() {
        // nlmsghdr (len 36, type 0x20), genl header, then ifindex 4 and xdp-features 7.
        let mut b = vec![0u8; 20];
        b.extend_from_slice(&8u16.to_ne_bytes());
        b.extend_from_slice(&1u16.to_ne_bytes());
        b.extend_from_slice(&4u32.to_ne_bytes());
        b.extend_from_slice(&12u16.to_ne_bytes());
        b.extend_from_slice(&3u16.to_ne_bytes());
        b.extend_from_slice(&7u64.to_ne_bytes());
        let len = b.len() as u32;
        b[0..4].copy_from_slice(&len.to_ne_bytes());
        b[4..6].copy_from_slice(&0x20u16.to_ne_bytes());
        let attrs = parse_reply(&b).unwrap();
        assert_eq!(attrs[1], (3, 7u64.to_ne_bytes().to_vec()));
        assert_eq!(describe(7), "native (basic, redirect, ndo-xmit)");
        assert!(describe(0).starts_with("generic only"));
        // An error answer: -ENODEV.
        let mut e = vec![0u8; 20];
        e[0..4].copy_from_slice(&20u32.to_ne_bytes());
        e[4..6].copy_from_slice(&2u16.to_ne_bytes());
        e[16..20].copy_from_slice(&(-19i32).to_ne_bytes());
        assert_eq!(parse_reply(&e).unwrap_err().raw_os_error(), Some(19));
    }
}
