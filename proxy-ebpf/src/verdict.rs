//! What happens to a packet, independent of the hook: every shared module returns a
//! [`Verdict`], and each entry point maps it to its hook's return code (tc: [`Verdict::tc`];
//! XDP: [`Verdict::xdp`]).

use aya_ebpf::bindings::{
    TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC,
    xdp_action::{XDP_DROP, XDP_PASS, XDP_REDIRECT},
};

/// The fate of a packet. Fieldless, so `Option<Verdict>` and `Result<(), Verdict>` are one
/// scalar each (the niche), which BPF subprograms can return in a register.
#[repr(i32)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Let it through, translated or not: the next program of the hook or the stack sees it.
    Pass = 0,
    /// Drop it (the reason is counted where the decision is made).
    Drop = 1,
    /// It was handed to another interface (`bpf_redirect` and friends succeeded).
    Redirect = 2,
    /// Answer it with an ICMP / ICMPv6 port unreachable (`icmp::reject`), which the entry
    /// point has built outside the deep frame that decided it (tc: by a tail call to
    /// `tc_reject`); a hook that cannot drops it.
    Reject = 3,
}

impl Verdict {
    /// The return code of a tcx program: `TCX_NEXT` (`TC_ACT_UNSPEC`, -1) for a packet let
    /// through, so programs attached after ours on the same hook (a CNI's) still see it; at
    /// the end of the chain it passes. During an agent restart the old and the new
    /// generation both run; the second finds nothing to do on a packet the first translated
    /// (no conntrack entry is keyed by a translated tuple on the same side).
    #[inline(always)]
    pub fn tc(self) -> i32 {
        match self {
            Verdict::Pass => TC_ACT_UNSPEC,
            Verdict::Drop | Verdict::Reject => TC_ACT_SHOT,
            Verdict::Redirect => TC_ACT_REDIRECT,
        }
    }

    /// The return code of an XDP program: `XDP_PASS` (the stack, where the tcx programs
    /// see the frame next), `XDP_DROP`, `XDP_REDIRECT` (after a successful `bpf_redirect`).
    /// `XDP_TX` is chosen by the XDP entry point itself. A packet to reject passes: tcx
    /// ingress builds the ICMP answer (it sees the same untranslated packet).
    #[inline(always)]
    pub fn xdp(self) -> u32 {
        match self {
            Verdict::Pass | Verdict::Reject => XDP_PASS,
            Verdict::Drop => XDP_DROP,
            Verdict::Redirect => XDP_REDIRECT,
        }
    }

    /// The verdict of a redirect helper's return value (`TC_ACT_REDIRECT` on success, else
    /// `TC_ACT_SHOT`).
    #[inline(always)]
    pub fn of_redirect(ret: i64) -> Verdict {
        if ret == TC_ACT_REDIRECT as i64 {
            Verdict::Redirect
        } else {
            Verdict::Drop
        }
    }
}
