//! kube-proxy's rule sets: applying them with `iptables-restore` and `nft -f` inside the
//! lab's client namespaces, resetting them, and their runs.

use std::fs;
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use proxy_testkit::kube_proxy_rules as rules;
use proxy_testkit::testbed::{self, ChildGuard};
use rules::Svc;

use super::conn_rate::{data_path, vip_target};
use super::driver::Env;
use super::report::{Case, Results, Sample};
use super::{LAB, Opts, STOP, check_stop};

/// Runs `program args` with `input` on stdin inside the case's client namespace; returns
/// how long it took. Never runs in the root namespace: the spawn fails if setns fails.
fn apply_in(
    env: &Env,
    case: Case,
    program: &str,
    args: &[&str],
    input: &Path,
    timeout: Duration,
) -> Result<Duration> {
    let pod = &env.clients[&case];
    ensure!(
        pod.netns.starts_with(&format!("{LAB}-")),
        "refusing to run {program} outside a bench namespace"
    );
    apply_in_netns(&pod.path(), program, args, input, timeout)
}

/// Runs `program args` with `input` on stdin inside the bench namespace at `ns` (a path
/// under /run/netns whose name starts with the bench's prefix [`LAB`]); returns how long
/// it took.
pub(super) fn apply_in_netns(
    ns: &Path,
    program: &str,
    args: &[&str],
    input: &Path,
    timeout: Duration,
) -> Result<Duration> {
    ensure!(
        ns.parent() == Some(Path::new(testbed::NETNS_RUN_DIR))
            && ns
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(LAB)),
        "refusing to run {program} outside a bench namespace ({})",
        ns.display()
    );
    let ns = ns.to_path_buf();
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(fs::File::open(input)?)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let t = Instant::now();
    let mut child = ChildGuard::spawn_in(Some(&ns), None, &mut cmd)?;
    let mut err = child.child_mut().stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let mut status = None;
    while status.is_none() && t.elapsed() < timeout && !STOP.load(Ordering::SeqCst) {
        status = child.wait_timeout(Duration::from_millis(200).min(timeout))?;
    }
    let took = t.elapsed();
    check_stop()?;
    let Some(status) = status else {
        child.kill();
        bail!("{program} {args:?} did not finish within {timeout:?}");
    };
    let stderr = reader.join().unwrap_or_default();
    ensure!(
        status.success(),
        "{program} {args:?} failed ({status}): {}",
        stderr.trim()
    );
    Ok(took)
}

fn reset_rules(env: &Env, o: &Opts, case: Case) -> Result<()> {
    let scratch = env.scratch.path().join("reset.txt");
    match case {
        Case::Iptables => {
            fs::write(&scratch, rules::IPTABLES_EMPTY)?;
            apply_in(
                env,
                case,
                &o.iptables_restore,
                &["-w", "5"],
                &scratch,
                Duration::from_secs(600),
            )?;
        }
        _ => {
            // Creating it first makes the delete succeed when it does not exist yet.
            fs::write(
                &scratch,
                "add table ip kube-proxy\ndelete table ip kube-proxy\n",
            )?;
            apply_in(
                env,
                case,
                "nft",
                &["-f", "-"],
                &scratch,
                Duration::from_secs(600),
            )?;
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub(super) fn run_rules(
    env: &Env,
    o: &Opts,
    case: Case,
    svcs: &[Svc],
    real: usize,
    change_svc: usize,
    results: &mut Results,
    run: usize,
) -> Result<()> {
    let r = run_rules_inner(env, o, case, svcs, real, change_svc, results, run);
    // The next case and N start from empty tables (not timed).
    let reset = reset_rules(env, o, case);
    r.and(reset)
}

#[allow(clippy::too_many_arguments)]
fn run_rules_inner(
    env: &Env,
    o: &Opts,
    case: Case,
    svcs: &[Svc],
    real: usize,
    change_svc: usize,
    results: &mut Results,
    run: usize,
) -> Result<()> {
    let n = svcs.len();
    reset_rules(env, o, case)?;
    let file = env.scratch.path().join("rules.txt");
    let (text, program, args): (String, &str, &[&str]) = match case {
        Case::Iptables => (
            rules::iptables_full(svcs),
            o.iptables_restore.as_str(),
            &["-w", "5", "--noflush", "--counters"],
        ),
        _ => (rules::nft_full(svcs), "nft", &["-f", "-"]),
    };
    fs::write(&file, &text)?;
    let lines = text.lines().count();
    drop(text);
    let took = match apply_in(
        env,
        case,
        program,
        args,
        &file,
        Duration::from_secs(o.peer_timeout),
    ) {
        Err(e) if e.to_string().contains("did not finish within") => {
            eprintln!(
                "  {case:?} cold: {program} of {lines} lines timed out after {} s",
                o.peer_timeout
            );
            results.timed_out.insert(case.key().to_string(), n);
            results.add(case, n, run, Sample::TimedOutS(o.peer_timeout as f64));
            results.add(case, n, run, Sample::RuleLines(lines as f64));
            return Ok(());
        }
        r => r?,
    };
    eprintln!(
        "  {case:?} cold: {program} of {lines} lines took {:.1} ms",
        took.as_secs_f64() * 1e3
    );
    results.add(case, n, run, Sample::ColdMs(took.as_secs_f64() * 1e3));
    results.add(case, n, run, Sample::RuleLines(lines as f64));

    data_path(env, o, case, &vip_target(real), n, results, run)?;

    if o.change_at.contains(&n) {
        let mut cur = svcs[change_svc].clone();
        for k in 0..o.changes {
            check_stop()?;
            let mut next = cur.clone();
            next.endpoints[rules::ENDPOINTS - 1].0 = rules::change_addr(k);
            let text = match case {
                Case::Iptables => {
                    let mut all = svcs.to_vec();
                    all[change_svc] = next.clone();
                    rules::iptables_change(&all, &cur, &next)
                }
                _ => rules::nft_change(&cur, &next),
            };
            fs::write(&file, text)?;
            let took = apply_in(env, case, program, args, &file, Duration::from_secs(120))?;
            results.add(case, n, run, Sample::ChangeMs(took.as_secs_f64() * 1e3));
            cur = next;
        }
        results.log_change(case, n, run);
    }
    let _ = fs::remove_file(&file);
    Ok(())
}
