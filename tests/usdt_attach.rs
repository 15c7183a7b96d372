//! USDT markers: `python:FUNC` (CPython's function__return probe, whose
//! semaphore dynprof raises through /proc/PID/mem and lowers on detach) and
//! `usdt:OBJECT:PROVIDER:NAME` on the native trainer.
#[path = "attach_util.rs"]
mod attach_util;
mod common;

use std::{process::Command, time::Duration};

use attach_util::*;
use common::*;
use dynprof::{
    probes::{resolve_markers, spec},
    target::Target,
    types::HostPid,
};

const T: Duration = Duration::from_secs(120);

/// The semaphore address dynprof will use, resolved without attaching.
fn semaphore_of(pid: u32, marker: &str) -> u64 {
    let target = Target::open(HostPid(pid)).unwrap();
    let arg = spec::parse(marker).unwrap();
    let probes = resolve_markers(&target, &[arg], &[]).unwrap();
    assert!(!probes.is_empty());
    probes[0]
        .semaphore
        .as_ref()
        .unwrap_or_else(|| panic!("{marker}: no USDT semaphore resolved: {probes:?}"))
        .runtime_addr
}

#[test]
fn usdt_python_function_return_counts_every_call_and_restores_the_semaphore() {
    require_privileges!();
    let fx = fixtures();
    let log = scratch_dir("usdt_attach-python").join("steps.log");
    let p = Proc::spawn_ready(
        fx.python(&fx.usdt_train_py)
            .args(["--steps", "0", "--step-ms", "10", "--log"])
            .arg(&log),
    );
    wait_for_log_lines(&log, "step", 1, T);
    let addr = semaphore_of(p.pid, "python:train_step");
    let original = read_u16(p.pid, addr);

    let mut d = Dynprof::attach(p.pid, &["--marker", "python:train_step", "--steps", "15"]);
    let att = d.wait_event("attached", T);
    let m = &att["markers"][0];
    assert_eq!(m["usdt_semaphore"], addr, "{att}");
    assert_eq!(m["symbol"], "python:function__return", "{att}");
    assert!(m["object"].as_str().unwrap().contains("python3"), "{att}");
    // While attached the semaphore is raised by one (the probe sites are
    // live from `attached` on). The trainer is stopped while it is read,
    // right at `attached`: on a slow machine (a TCG VM) dynprof could
    // otherwise reach its 15 steps and detach before the read (seen even
    // when the read followed the first `step` event, which is batched).
    // SAFETY: kill(2) on the trainer this test started.
    unsafe { libc::kill(p.pid as i32, libc::SIGSTOP) };
    let raised = read_u16(p.pid, addr);
    // SAFETY: as above.
    unsafe { libc::kill(p.pid as i32, libc::SIGCONT) };
    assert_eq!(raised, original + 1, "semaphore while attached");
    let run = d.finish(T);
    run.assert_success();
    assert_eq!(
        read_u16(p.pid, addr),
        original,
        "semaphore after detach must be back to its original value"
    );

    let steps = run.steps();
    assert_eq!(steps.len(), 15, "{run}");
    let calls = wait_log_covering(&log, "step", steps.last().unwrap().1, T);
    check_steps_match_calls(&steps, &calls, "usdt_train.py train_step");
    assert_eq!(run.summary()["steps"], 15);
}

fn trainer(tag: &str, extra: &[&str]) -> (Proc, std::path::PathBuf) {
    let fx = fixtures();
    let log = scratch_dir(tag).join("trainer.log");
    let p = Proc::spawn_ready(
        Command::new(&fx.trainer)
            .args(["--steps", "0", "--step-ms", "10"])
            .args(extra)
            .arg("--log")
            .arg(&log),
    );
    wait_for_log_lines(&log, "step", 1, T);
    (p, log)
}

#[test]
fn usdt_native_trainer_probe_by_exe() {
    require_privileges!();
    let (p, log) = trainer("usdt_attach-exe", &[]);
    let run = run_attach(
        p.pid,
        &[
            "--marker",
            "usdt:exe:fixture:optimizer_step",
            "--steps",
            "20",
        ],
        T,
    );
    run.assert_success();
    let steps = run.steps();
    assert_eq!(steps.len(), 20, "{run}");
    let calls = wait_log_covering(&log, "step", steps.last().unwrap().1, T);
    check_steps_match_calls(&steps, &calls, "usdt fixture:optimizer_step");
    let m = &run.attached()["markers"][0];
    assert_eq!(
        m["usdt_semaphore"],
        serde_json::Value::Null,
        "STAP_PROBE1 without a semaphore: {m}"
    );
}

#[test]
fn usdt_native_trainer_probe_by_path_with_string_filter() {
    require_privileges!();
    let (p, log) = trainer("usdt_attach-path", &["--names"]);
    let spec = format!(
        "usdt:{}:fixture:optimizer_step,arg=0:cstr,prefix=Optimizer.step#",
        fixtures().trainer.display()
    );
    let run = run_attach(p.pid, &["--marker", &spec, "--steps", "20"], T);
    run.assert_success();
    let steps = run.steps();
    assert_eq!(steps.len(), 20, "{run}");
    let calls = wait_log_covering(&log, "step", steps.last().unwrap().1, T);
    check_steps_match_calls(&steps, &calls, "usdt by path, filtered");
    check_no_event_in(&steps, &log_lines_of(&log, "zero_grad"), "zero_grad calls");
}
