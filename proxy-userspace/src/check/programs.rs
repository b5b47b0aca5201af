//! The embedded object against this kernel: the program types, map types and helpers it
//! uses, probed as `bpftool feature probe` does, then a load (verification) of every
//! program with its attach type.

use std::collections::BTreeSet;

use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported, is_map_supported, is_program_supported},
};
use aya_obj::{
    Object, ProgramSection,
    generated::{BPF_CALL, BPF_JMP, bpf_func_id},
};

use super::{CheckResult, MIN_KERNEL, Status};
use crate::datapath::loader;

/// Short name of a program type, as bpftool prints it.
fn program_type_name(t: ProgramType) -> &'static str {
    match t {
        ProgramType::CgroupSockAddr => "cgroup_sock_addr",
        ProgramType::SchedClassifier => "sched_cls",
        ProgramType::CgroupSkb => "cgroup_skb",
        ProgramType::CgroupSock => "cgroup_sock",
        ProgramType::Xdp => "xdp",
        _ => "other",
    }
}

/// The program type of an object section, for the types this project uses.
fn program_type(section: &ProgramSection) -> Option<ProgramType> {
    match section {
        ProgramSection::CgroupSockAddr { .. } => Some(ProgramType::CgroupSockAddr),
        ProgramSection::SchedClassifier => Some(ProgramType::SchedClassifier),
        ProgramSection::CgroupSkb { .. } => Some(ProgramType::CgroupSkb),
        ProgramSection::CgroupSock { .. } => Some(ProgramType::CgroupSock),
        ProgramSection::Xdp { .. } => Some(ProgramType::Xdp),
        _ => None,
    }
}

/// A helper id of a call instruction as aya's [`BpfHelper`].
fn helper(id: i32) -> Option<BpfHelper> {
    let id = u32::try_from(id).ok()?;
    if id == 0 || id >= bpf_func_id::__BPF_FUNC_MAX_ID as u32 {
        return None;
    }
    // SAFETY: `bpf_func_id` is `repr(u32)` with every value from 0 to `__BPF_FUNC_MAX_ID`
    // defined (the kernel's helper list is dense), checked above.
    Some(unsafe { std::mem::transmute::<u32, bpf_func_id>(id) })
}

/// `BPF_FUNC_map_lookup_elem` as `map_lookup_elem`.
fn helper_name(h: BpfHelper) -> String {
    format!("{h:?}").trim_start_matches("BPF_FUNC_").to_string()
}

/// What the embedded object uses: program types (with their programs), map types, and the
/// helpers called by the programs of each type.
#[derive(Debug, Default)]
struct Uses {
    programs: Vec<(ProgramType, String)>,
    map_types: BTreeSet<String>,
    maps: Vec<(String, MapType)>,
    helpers: Vec<(ProgramType, BpfHelper)>,
}

fn uses(obj: &Object) -> Uses {
    let mut u = Uses::default();
    // Each program linked with the subprograms it reaches (`.text` functions called, and
    // `bpf_loop` callbacks), as the loader links them: a helper counts for the program
    // types whose programs call it, wherever the call is.
    let mut linked = obj.clone();
    let text_sections = linked
        .functions
        .keys()
        .map(|(section, _)| *section)
        .collect();
    let linked_ok = linked.relocate_calls(&text_sections).is_ok();
    let mut names: Vec<&String> = obj.programs.keys().collect();
    names.sort();
    for name in names {
        let p = &obj.programs[name];
        let Some(t) = program_type(&p.section) else {
            continue;
        };
        u.programs.push((t, name.clone()));
        // Unlinked (an object the linker refuses; loading it fails and says so): the
        // functions of the program's own section.
        let functions: Vec<&aya_obj::Function> = if linked_ok {
            linked
                .functions
                .get(&p.function_key())
                .into_iter()
                .collect()
        } else {
            obj.functions
                .values()
                .filter(|f| f.section_index.0 == p.section_index)
                .collect()
        };
        for f in functions {
            for insn in &f.instructions {
                if insn.code == (BPF_JMP | BPF_CALL) as u8
                    && insn.src_reg() == 0
                    && let Some(h) = helper(insn.imm)
                    && !u.helpers.contains(&(t, h))
                {
                    u.helpers.push((t, h));
                }
            }
        }
    }
    let mut maps: Vec<(&String, u32)> = obj.maps.iter().map(|(n, m)| (n, m.map_type())).collect();
    maps.sort();
    for (name, t) in maps {
        if let Some(mt) = loader::map_type(t) {
            u.map_types.insert(format!("{mt:?}"));
            u.maps.push((name.clone(), mt));
        }
    }
    u
}

/// What to do when a probe fails for lack of privileges.
const ROOT: &str = "run as root (or with CAP_BPF, CAP_NET_ADMIN and CAP_SYS_ADMIN)";

/// Program type, map type, helper and attach type probes, then a load of every program.
pub(super) fn programs() -> Vec<CheckResult> {
    if loader::OBJECT.is_empty() {
        return vec![CheckResult::bad(
            "programs",
            Status::Fail,
            "this binary was built without the eBPF object",
            "build it with `cargo xtask build`",
        )];
    }
    let obj = match Object::parse(loader::OBJECT) {
        Ok(o) => o,
        Err(e) => {
            return vec![CheckResult::bad(
                "programs",
                Status::Fail,
                format!("the embedded eBPF object does not parse: {e}"),
                "rebuild with `cargo xtask build`",
            )];
        }
    };
    let u = uses(&obj);
    vec![
        program_types(&u),
        map_types(&u),
        helpers(&u),
        // Attach types and the verifier: load every program, attach nothing.
        verified(),
    ]
}

/// The program types the object's programs have.
fn program_types(u: &Uses) -> CheckResult {
    let mut types: Vec<ProgramType> = Vec::new();
    for (t, _) in &u.programs {
        if !types.contains(t) {
            types.push(*t);
        }
    }
    let mut missing = Vec::new();
    let mut errors = Vec::new();
    for t in &types {
        match is_program_supported(*t) {
            Ok(true) => {}
            Ok(false) => missing.push(program_type_name(*t)),
            Err(e) => errors.push(format!("{}: {e}", program_type_name(*t))),
        }
    }
    let names: Vec<&str> = types.iter().map(|t| program_type_name(*t)).collect();
    probe_result(
        "program types",
        &names.join(", "),
        &missing,
        &errors,
        "a kernel with CONFIG_BPF_SYSCALL and CONFIG_CGROUP_BPF (Linux >= 5.18)",
        ROOT,
    )
}

/// The map types of the object's maps.
fn map_types(u: &Uses) -> CheckResult {
    let mut missing = Vec::new();
    let mut errors = Vec::new();
    let mut seen: Vec<MapType> = Vec::new();
    for (_, t) in &u.maps {
        if seen.contains(t) {
            continue;
        }
        seen.push(*t);
        match is_map_supported(*t) {
            Ok(true) => {}
            Ok(false) => missing.push(format!("{t:?}")),
            Err(e) => errors.push(format!("{t:?}: {e}")),
        }
    }
    let all: Vec<&str> = u.map_types.iter().map(String::as_str).collect();
    probe_result(
        "map types",
        &all.join(", "),
        &missing,
        &errors,
        "a newer kernel (Linux >= 5.18)",
        ROOT,
    )
}

/// The helpers, per program type that calls them.
fn helpers(u: &Uses) -> CheckResult {
    let mut missing = Vec::new();
    let mut errors = Vec::new();
    for (t, h) in &u.helpers {
        match is_helper_supported(*t, *h) {
            Ok(true) => {}
            Ok(false) => missing.push(format!("{} in {}", helper_name(*h), program_type_name(*t))),
            Err(e) => errors.push(format!("{}: {e}", helper_name(*h))),
        }
    }
    let all: BTreeSet<String> = u.helpers.iter().map(|(_, h)| helper_name(*h)).collect();
    let all: Vec<String> = all.into_iter().collect();
    probe_result(
        "helpers",
        &all.join(", "),
        &missing,
        &errors,
        "Linux >= 5.18 (bpf_set_retval)",
        ROOT,
    )
}

/// Every program loaded (verified) with its attach type, nothing attached.
fn verified() -> CheckResult {
    match loader::verify_programs() {
        Ok(loaded) => CheckResult::ok(
            "programs",
            format!(
                "{} programs pass the verifier with their attach types: {}",
                loaded.len(),
                loaded.join(", ")
            ),
        ),
        Err(e) => {
            let msg = crate::error_chain(&e);
            let remedy = if msg.contains("Operation not permitted") {
                ROOT.to_string()
            } else {
                format!(
                    "use Linux >= {}.{}; with a newer kernel, report the verifier log above",
                    MIN_KERNEL.0, MIN_KERNEL.1
                )
            };
            CheckResult::bad("programs", Status::Fail, msg, remedy)
        }
    }
}
/// Probe errors (`name: message`) grouped by message, each name once:
/// `bpf_prog_load failed: a, b, c`.
pub fn group_errors(errors: &[String]) -> String {
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for e in errors {
        let (name, msg) = e.split_once(": ").unwrap_or(("", e));
        let msg = msg.replace('`', "");
        let names = match groups.iter_mut().find(|(m, _)| *m == msg) {
            Some((_, names)) => names,
            None => {
                groups.push((msg, Vec::new()));
                &mut groups.last_mut().expect("just pushed").1
            }
        };
        if !name.is_empty() && !names.iter().any(|n| n == name) {
            names.push(name.to_string());
        }
    }
    groups
        .iter()
        .map(|(msg, names)| {
            if names.is_empty() {
                msg.clone()
            } else {
                format!("{msg} for {}", names.join(", "))
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn probe_result(
    check: &'static str,
    all: &str,
    missing: &[impl AsRef<str>],
    errors: &[String],
    newer: &str,
    root: &str,
) -> CheckResult {
    if !missing.is_empty() {
        let m: Vec<&str> = missing.iter().map(AsRef::as_ref).collect();
        return CheckResult::bad(
            check,
            Status::Fail,
            format!("not supported by this kernel: {}", m.join(", ")),
            format!("use {newer}"),
        );
    }
    if !errors.is_empty() {
        return CheckResult::bad(
            check,
            Status::Fail,
            format!("probing failed: {}", group_errors(errors)),
            root,
        );
    }
    CheckResult::ok(check, format!("{all} (probed)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_errors_are_grouped_with_each_name_once() {
        let errors: Vec<String> = [
            "map_lookup_elem: `bpf_prog_load` failed",
            "get_socket_cookie: `bpf_prog_load` failed",
            "map_lookup_elem: `bpf_prog_load` failed",
            "set_retval: something else",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            group_errors(&errors),
            "bpf_prog_load failed for map_lookup_elem, get_socket_cookie; something else for set_retval"
        );
    }

    #[test]
    fn the_object_uses_what_the_docs_say() {
        if loader::OBJECT.is_empty() {
            return;
        }
        let u = uses(&Object::parse(loader::OBJECT).unwrap());
        let progs: Vec<&str> = u.programs.iter().map(|(_, n)| n.as_str()).collect();
        for p in loader::PROGRAMS {
            assert!(progs.contains(&p), "{p} in {progs:?}");
        }
        let helpers: Vec<String> = u.helpers.iter().map(|(_, h)| helper_name(*h)).collect();
        for h in ["set_retval", "get_socket_cookie", "map_lookup_elem"] {
            assert!(helpers.iter().any(|x| x == h), "{h} in {helpers:?}");
        }
        // Helpers called only from subprograms count for the types whose programs reach
        // them, and only for those.
        let of = |t: ProgramType| -> Vec<String> {
            u.helpers
                .iter()
                .filter(|(pt, _)| *pt == t)
                .map(|(_, h)| helper_name(*h))
                .collect()
        };
        let (sock, tc) = (
            of(ProgramType::CgroupSockAddr),
            of(ProgramType::SchedClassifier),
        );
        for h in ["loop", "get_prandom_u32"] {
            assert!(sock.iter().any(|x| x == h), "{h} in {sock:?}");
            assert!(tc.iter().any(|x| x == h), "{h} in {tc:?}");
        }
        assert!(tc.iter().any(|x| x == "fib_lookup"), "{tc:?}");
        assert!(!sock.iter().any(|x| x == "fib_lookup"), "{sock:?}");
        assert!(u.map_types.contains("Hash"), "{:?}", u.map_types);
    }
}
