//! Every `dynprof attach` error: one clear line (the resolution error lists
//! what it tried below its line) with a hint, and a non-zero exit; and the
//! target exiting mid-run, which is not an error.
#[path = "attach_util.rs"]
mod attach_util;
mod common;

use std::{process::Command, time::Duration};

use attach_util::*;
use common::*;

const T: Duration = Duration::from_secs(120);

fn dynprof(args: &[&str]) -> (std::process::ExitStatus, String, String) {
    run_dynprof(Command::new(dynprof_bin()).args(args))
}

/// The `dynprof: error: ...` lines of stderr, and clap's `error: ...` for
/// a flag value refused while parsing (a malformed --marker).
fn error_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.starts_with("dynprof: error:") || l.starts_with("error:"))
        .collect()
}

fn running_trainer(tag: &str) -> (Proc, std::path::PathBuf) {
    let fx = fixtures();
    let log = scratch_dir(tag).join("trainer.log");
    let p = Proc::spawn_ready(
        Command::new(&fx.trainer)
            .args(["--steps", "0", "--step-ms", "10", "--log"])
            .arg(&log),
    );
    wait_for_log_lines(&log, "step", 1, T);
    (p, log)
}

/// A PID that belonged to a process that has exited and been reaped.
fn dead_pid() -> u32 {
    let mut c = Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

#[test]
fn errors_no_such_pid() {
    let pid = dead_pid();
    let (st, out, err) = dynprof(&[
        "attach",
        "--pid",
        &pid.to_string(),
        "--marker",
        "exe:optimizer_step",
    ]);
    assert!(!st.success(), "{err}");
    assert_eq!(st.code(), Some(1));
    assert!(out.is_empty());
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {err}");
    assert!(
        lines[0].contains(&format!("no process with PID {pid}")),
        "{err}"
    );
    assert!(lines[0].contains("hint"), "{err}");
}

#[test]
fn errors_malformed_spec_points_at_the_bad_part() {
    // Parsed before the PID is looked at: no target needed.
    for (spec, bad, what) in [
        ("exe:optimizer_step,role=bogus", "bogus", "role must be"),
        ("exe:optimizer_step+0xZZ", "0xZZ", "OFFSET"),
        ("usdt:exe:justone", "justone", "PROVIDER:NAME"),
        ("exe:f,arg=1:wide,prefix=x", "wide", "KIND"),
        ("nocolon", "nocolon", "no `:`"),
    ] {
        let (st, _, err) = dynprof(&["attach", "--pid", "1", "--marker", spec]);
        // A usage error, like any other bad flag value.
        assert_eq!(st.code(), Some(2), "{spec}: {err}");
        let errs = error_lines(&err);
        assert_eq!(errs.len(), 1, "{spec}: {err}");
        assert!(
            errs[0].contains(what) && errs[0].contains(spec),
            "{spec}: {err}"
        );
        // The echoed SPEC, then a caret under the bad part.
        let lines: Vec<&str> = err.lines().collect();
        let echo = lines
            .iter()
            .position(|l| l.trim() == spec)
            .unwrap_or_else(|| panic!("{spec}: no echo: {err}"));
        let caret = lines[echo + 1];
        let col = caret
            .find('^')
            .unwrap_or_else(|| panic!("{spec}: no caret: {err}"));
        let spec_col = lines[echo].find(spec).unwrap();
        assert_eq!(
            &lines[echo][col..col + bad.len()],
            bad,
            "{spec}: caret at the wrong place:\n{err}"
        );
        assert!(col >= spec_col);
        assert!(err.contains("hint:"), "{spec}: {err}");
    }
}

#[test]
fn errors_no_marker_resolves_lists_what_was_tried() {
    let (p, _log) = running_trainer("errors_attach-unresolved");
    let (st, out, err) = dynprof(&[
        "attach",
        "--pid",
        &p.pid.to_string(),
        "--marker",
        "exe:no_such_function",
        "--marker",
        "libnotmapped:whatever",
    ]);
    assert!(!st.success(), "{err}");
    assert!(out.is_empty());
    let errs = error_lines(&err);
    assert_eq!(errs.len(), 1, "{err}");
    assert!(errs[0].contains("no step marker resolved"), "{err}");
    let trainer = fixtures().trainer.display().to_string();
    assert!(err.contains("exe:no_such_function"), "{err}");
    assert!(
        err.contains(&format!("{trainer}: no symbol `no_such_function`")),
        "{err}"
    );
    assert!(err.contains("libnotmapped:whatever"), "{err}");
    assert!(
        err.contains("a library matching `libnotmapped` is not mapped"),
        "{err}"
    );
    assert!(err.contains("hint:"), "{err}");
}

#[test]
fn errors_auto_finds_no_framework_and_says_what_it_looked_for() {
    let (p, _log) = running_trainer("errors_attach-auto");
    let (st, _, err) = dynprof(&["attach", "--pid", &p.pid.to_string()]);
    assert!(!st.success(), "{err}");
    let errs = error_lines(&err);
    assert_eq!(errs.len(), 1, "{err}");
    assert!(
        errs[0].contains("--marker auto") && errs[0].contains("libtorch_cpu"),
        "{err}"
    );
    assert!(
        errs[0].contains("--marker exe:SYMBOL") && errs[0].contains("hint"),
        "it should say how to name a symbol: {err}"
    );
}

#[test]
fn errors_missing_privileges_names_the_capability() {
    // Needs root to drop to nobody (65534).
    require_privileges!();
    let (p, _log) = running_trainer("errors_attach-unprivileged");
    let (st, out, err) = run_dynprof(
        Command::new("setpriv")
            .args([
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "--inh-caps=-all",
            ])
            .arg(dynprof_bin())
            .args([
                "attach",
                "--pid",
                &p.pid.to_string(),
                "--marker",
                "exe:optimizer_step",
            ]),
    );
    assert!(!st.success(), "{err}");
    assert!(out.is_empty());
    // One line naming every missing capability, then one line per
    // capability and part saying why it is needed, then the hint.
    let lines: Vec<&str> = err.lines().collect();
    assert!(
        lines[0].starts_with("dynprof: error: missing capabilities: "),
        "{err}"
    );
    assert!(
        lines[0].contains("CAP_BPF") && lines[0].contains("CAP_PERFMON"),
        "{err}"
    );
    assert!(
        lines[1..lines.len() - 1]
            .iter()
            .all(|l| l.starts_with("  CAP_")),
        "{err}"
    );
    assert!(lines[lines.len() - 1].starts_with("hint:"), "{err}");
    assert!(p.is_running_check());
}

trait Running {
    fn is_running_check(&self) -> bool;
}
impl Running for Proc {
    fn is_running_check(&self) -> bool {
        std::path::Path::new(&format!("/proc/{}", self.pid)).exists()
    }
}

#[test]
fn errors_target_exit_mid_run_keeps_counts_and_exits_0_json() {
    require_privileges!();
    let (mut p, log) = running_trainer("errors_attach-exit-json");
    let mut d = Dynprof::attach(p.pid, &["--marker", "exe:optimizer_step"]);
    d.wait_event("attached", T);
    for _ in 0..5 {
        d.wait_event("step", T);
    }
    // SIGTERM: the trainer finishes its current step and exits 0.
    assert!(p.terminate().success());
    let run = d.finish(T);
    run.assert_success();
    let sum = run.summary();
    assert_eq!(sum["end"], "target_exited", "{run}");
    let steps = run.steps();
    assert!(steps.len() >= 5);
    assert_eq!(sum["steps"], steps.len() as u64, "{run}");
    // Every step after the attach was counted, up to the very last one.
    let calls = log_lines_of(&log, "step");
    let m = check_steps_match_calls(&steps, &calls, "trainer until exit");
    assert_eq!(
        *m.last().unwrap(),
        calls.len() - 1,
        "the last logged step must have been counted: {run}"
    );
}

#[test]
fn errors_target_exit_mid_run_says_so_live() {
    require_privileges!();
    let (mut p, _log) = running_trainer("errors_attach-exit-live");
    let mut d = Dynprof::spawn(
        Command::new(dynprof_bin()).args([
            "attach",
            "--pid",
            &p.pid.to_string(),
            "--marker",
            "exe:optimizer_step",
        ]),
        vec![],
    );
    d.wait_stderr("attached step marker", T);
    d.wait_stderr("step ", T);
    assert!(p.terminate().success());
    let run = d.finish(T);
    assert!(run.status.success(), "{run}");
    let pid = p.pid;
    assert!(
        run.stderr.contains(&format!(
            "target PID {pid} exited; keeping what was counted"
        )),
        "{run}"
    );
    assert!(run.stderr.contains("ended: target exited"), "{run}");
}
