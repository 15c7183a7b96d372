//! Checks the test fixtures themselves (no BPF involved): they build, run,
//! export the symbols the profiler will look for, and write well-formed
//! CLOCK_MONOTONIC logs.

mod common;

use std::{process::Command, time::Duration};

use common::*;
use object::{Object as _, ObjectSymbol as _};

fn dynamic_symbols(path: &std::path::Path) -> Vec<String> {
    let data = std::fs::read(path).unwrap();
    let file = object::File::parse(&*data).unwrap();
    file.dynamic_symbols()
        .filter(|s| s.is_definition())
        .filter_map(|s| s.name().ok().map(str::to_owned))
        .collect()
}

/// Steps are numbered 1..=n, each well-formed and later than the previous one,
/// all inside [t0, t1].
fn check_steps(lines: &[LogLine], n: u64, t0: u64, t1: u64) {
    let steps: Vec<_> = lines.iter().filter(|l| l.kind == "step").collect();
    assert_eq!(steps.len() as u64, n, "step lines: {lines:?}");
    let mut prev = 0;
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s.index, i as u64 + 1);
        assert!(s.before <= s.after, "{s:?}");
        assert!(s.before >= prev, "steps out of order: {s:?}");
        assert!(
            s.before >= t0 && s.after <= t1,
            "{s:?} is not CLOCK_MONOTONIC within [{t0}, {t1}]"
        );
        prev = s.after;
    }
}

#[test]
fn fixtures_build_and_export_their_symbols() {
    let fx = fixtures();
    let trainer = dynamic_symbols(&fx.trainer);
    for sym in ["optimizer_step", "compute"] {
        assert!(
            trainer.iter().any(|s| s == sym),
            "trainer does not export {sym}"
        );
    }
    let data = std::fs::read(&fx.trainer).unwrap();
    let file = object::File::parse(&*data).unwrap();
    assert!(
        file.section_by_name(".note.stapsdt").is_some(),
        "trainer has no USDT notes"
    );

    assert!(
        dynamic_symbols(&fx.libfixture_backward)
            .iter()
            .any(|s| s == "backward")
    );
    assert!(
        dynamic_symbols(&fx.libfixture_marker)
            .iter()
            .any(|s| s == "lib_step")
    );
    assert!(
        dynamic_symbols(&fx.strtrainer)
            .iter()
            .any(|s| s == "_Z11record_nameRKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE")
    );
    let acl = dynamic_symbols(&fx.libascendcl);
    for sym in [
        "aclInit",
        "aclFinalize",
        "aclrtSetDevice",
        "aclrtResetDevice",
        "aclrtCreateStream",
        "aclrtDestroyStream",
        "aclrtCreateEvent",
        "aclrtDestroyEvent",
        "aclrtLaunchKernel",
        "aclrtMemcpy",
        "aclrtMemcpyAsync",
        "aclrtSynchronizeStream",
        "aclrtSynchronizeStreamWithTimeout",
        "aclrtSynchronizeDevice",
        "aclrtSynchronizeEvent",
        "aclrtRecordEvent",
        "aclrtMalloc",
        "aclrtFree",
        "aclopCompileAndExecute",
        "aclmdlExecute",
        "aclsimSetKernelUs",
    ] {
        assert!(
            acl.iter().any(|s| s == sym),
            "libascendcl.so does not export {sym}"
        );
    }
    let acl_trainer = dynamic_symbols(&fx.acl_trainer);
    for sym in ["optimizer_step", "hot_cpu_work"] {
        assert!(
            acl_trainer.iter().any(|s| s == sym),
            "acl_trainer does not export {sym}"
        );
    }
}

#[test]
fn trainer_logs_steps_backward_and_zero_grad() {
    let fx = fixtures();
    let dir = scratch_dir("fixtures_smoke-trainer");
    let log = dir.join("trainer.log");
    let t0 = mono_ns();
    let mut p = Proc::spawn_ready(
        Command::new(&fx.trainer)
            .args([
                "--steps",
                "3",
                "--step-ms",
                "5",
                "--backward-per-step",
                "2",
                "--names",
                "--log",
            ])
            .arg(&log),
    );
    assert_eq!(p.pid, p.host_pid());
    let st = p
        .wait_timeout(Duration::from_secs(30))
        .expect("trainer did not finish");
    assert!(st.success(), "{st}");
    let t1 = mono_ns();
    let lines = read_log(&log);
    check_steps(&lines, 3, t0, t1);
    let backward: Vec<_> = lines.iter().filter(|l| l.kind == "backward").collect();
    assert_eq!(backward.len(), 6);
    for step in 1..=3 {
        assert_eq!(backward.iter().filter(|b| b.index == step).count(), 2);
    }
    assert_eq!(lines.iter().filter(|l| l.kind == "zero_grad").count(), 3);
    // Each step's backward passes come before its optimizer step.
    for b in &backward {
        let s = lines
            .iter()
            .find(|l| l.kind == "step" && l.index == b.index)
            .unwrap();
        assert!(b.after <= s.before);
    }
}

#[test]
fn trainer_runs_forever_and_exits_cleanly_on_sigterm() {
    let fx = fixtures();
    let dir = scratch_dir("fixtures_smoke-sigterm");
    let log = dir.join("trainer.log");
    let mut p = Proc::spawn_ready(
        Command::new(&fx.trainer)
            .args(["--steps", "0", "--step-ms", "2", "--log"])
            .arg(&log),
    );
    wait_for_log_lines(&log, "step", 3, Duration::from_secs(30));
    let st = p.terminate();
    assert!(st.success(), "trainer exit on SIGTERM: {st}");
}

fn run_acl(tag: &str, args: &[&str]) -> (Vec<LogLine>, Vec<AclLogLine>, u64, u64) {
    let fx = fixtures();
    let dir = scratch_dir(&format!("fixtures_smoke-{tag}"));
    let log = dir.join("steps.log");
    let acl_log = dir.join("acl.log");
    let t0 = mono_ns();
    let mut p = Proc::spawn_ready(
        Command::new(&fx.acl_trainer)
            .args(args)
            .arg("--log")
            .arg(&log)
            .env("ACL_SIM_LOG", &acl_log),
    );
    let st = p
        .wait_timeout(Duration::from_secs(30))
        .expect("acl_trainer did not finish");
    assert!(st.success(), "{st}");
    let t1 = mono_ns();
    (read_log(&log), read_acl_log(&acl_log), t0, t1)
}

#[test]
fn acl_trainer_synchronize_waits_when_device_work_exceeds_cpu_work() {
    // 8 launches + 1 async copy of 2 ms each = 18 ms of device work per step,
    // against 1 ms of CPU work: every synchronize must block (~17 ms).
    let (lines, acl, t0, t1) = run_acl(
        "acl-wait",
        &[
            "--steps",
            "3",
            "--launches",
            "8",
            "--kernel-us",
            "2000",
            "--cpu-us",
            "1000",
        ],
    );
    check_steps(&lines, 3, t0, t1);
    let count = |api: &str| acl.iter().filter(|l| l.api == api).count();
    assert_eq!(count("aclrtLaunchKernel"), 24);
    assert_eq!(count("aclrtMemcpyAsync"), 3);
    assert_eq!(count("aclInit"), 1);
    assert_eq!(count("aclFinalize"), 1);
    let syncs: Vec<_> = acl
        .iter()
        .filter(|l| l.api == "aclrtSynchronizeStream")
        .collect();
    assert_eq!(syncs.len(), 3);
    for s in &syncs {
        assert!(s.waited > 0, "synchronize should block: {s:?}");
        assert!(s.exit - s.enter >= s.waited, "{s:?}");
        // The stream drains no earlier than the last queued item's start + 2 ms.
        let last_enqueue = acl
            .iter()
            .filter(|l| {
                (l.api == "aclrtLaunchKernel" || l.api == "aclrtMemcpyAsync") && l.enter < s.enter
            })
            .map(|l| l.enter)
            .max()
            .unwrap();
        assert!(
            s.exit >= last_enqueue + 2_000_000,
            "{s:?} returned before the stream drained"
        );
    }
    for l in &acl {
        assert!(l.enter <= l.exit && l.enter >= t0 && l.exit <= t1, "{l:?}");
        if l.api != "aclrtSynchronizeStream" {
            assert_eq!(l.waited, 0, "{l:?}");
        }
    }
    // The synchronize of step i happens before optimizer step i.
    for (i, s) in syncs.iter().enumerate() {
        let step = lines
            .iter()
            .find(|l| l.kind == "step" && l.index == i as u64 + 1)
            .unwrap();
        assert!(s.exit <= step.before);
    }
}

#[test]
fn acl_trainer_synchronize_does_not_wait_when_cpu_work_dominates() {
    let (lines, acl, t0, t1) = run_acl(
        "acl-nowait",
        &[
            "--steps",
            "3",
            "--launches",
            "4",
            "--kernel-us",
            "10",
            "--cpu-us",
            "2000",
        ],
    );
    check_steps(&lines, 3, t0, t1);
    let syncs: Vec<_> = acl
        .iter()
        .filter(|l| l.api == "aclrtSynchronizeStream")
        .collect();
    assert_eq!(syncs.len(), 3);
    assert!(syncs.iter().all(|s| s.waited == 0), "{syncs:?}");
}

#[test]
fn acl_trainer_task_queue_thread_launches_while_main_thread_synchronizes() {
    let (lines, acl, t0, t1) = run_acl(
        "acl-queue",
        &[
            "--steps",
            "3",
            "--launches",
            "8",
            "--kernel-us",
            "2000",
            "--cpu-us",
            "1000",
            "--threads-queue",
        ],
    );
    check_steps(&lines, 3, t0, t1);
    let launch_tids: std::collections::BTreeSet<u32> = acl
        .iter()
        .filter(|l| l.api == "aclrtLaunchKernel")
        .map(|l| l.tid)
        .collect();
    let sync_tids: std::collections::BTreeSet<u32> = acl
        .iter()
        .filter(|l| l.api == "aclrtSynchronizeStream")
        .map(|l| l.tid)
        .collect();
    assert_eq!(launch_tids.len(), 1);
    assert_eq!(sync_tids.len(), 1);
    assert_ne!(
        launch_tids, sync_tids,
        "launches should come from the queue thread"
    );
    assert!(
        acl.iter()
            .filter(|l| l.api == "aclrtSynchronizeStream")
            .all(|s| s.waited > 0)
    );
}

#[test]
fn acl_trainer_high_rate_mode_turns_the_log_off() {
    let (lines, acl, t0, t1) = run_acl("acl-rate", &["--steps", "3", "--calls-per-step", "10000"]);
    check_steps(&lines, 3, t0, t1);
    assert!(acl.is_empty(), "ACL_SIM_LOG_OFF should silence the ACL log");
}

#[test]
fn strtrainer_logs_steps() {
    let fx = fixtures();
    let log = scratch_dir("fixtures_smoke-strtrainer").join("steps.log");
    let t0 = mono_ns();
    let mut p = Proc::spawn_ready(
        Command::new(&fx.strtrainer)
            .args(["--steps", "3", "--step-ms", "2", "--log"])
            .arg(&log),
    );
    assert!(
        p.wait_timeout(Duration::from_secs(30))
            .expect("strtrainer did not finish")
            .success()
    );
    check_steps(&read_log(&log), 3, t0, mono_ns());
}

#[test]
fn dlopen_trainer_loads_its_library_late() {
    let fx = fixtures();
    let log = scratch_dir("fixtures_smoke-dlopen").join("steps.log");
    let t0 = mono_ns();
    let mut p = Proc::spawn_ready(
        Command::new(&fx.dlopen_trainer)
            .args([
                "--steps",
                "3",
                "--step-ms",
                "2",
                "--delay-ms",
                "200",
                "--log",
            ])
            .arg(&log),
    );
    // Not mapped before the delay is over.
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", p.pid)).unwrap();
    assert!(!maps.contains("libfixture_marker.so"));
    assert!(
        p.wait_timeout(Duration::from_secs(30))
            .expect("dlopen_trainer did not finish")
            .success()
    );
    let lines = read_log(&log);
    let dl = lines
        .iter()
        .find(|l| l.kind == "dlopen")
        .expect("dlopen line");
    assert!(
        dl.before >= t0 + 200_000_000,
        "dlopen came before --delay-ms"
    );
    check_steps(&lines, 3, t0, mono_ns());
    assert!(
        lines
            .iter()
            .filter(|l| l.kind == "step")
            .all(|s| s.before >= dl.after)
    );
}

#[test]
fn usdt_train_py_logs_steps() {
    let fx = fixtures();
    let log = scratch_dir("fixtures_smoke-usdt-py").join("steps.log");
    let t0 = mono_ns();
    let mut p = Proc::spawn_ready(
        fx.python(&fx.usdt_train_py)
            .args(["--steps", "3", "--step-ms", "4", "--log"])
            .arg(&log),
    );
    assert!(
        p.wait_timeout(Duration::from_secs(60))
            .expect("usdt_train.py did not finish")
            .success()
    );
    check_steps(&read_log(&log), 3, t0, mono_ns());
}

#[test]
fn torch_train_py_logs_optimizer_steps_and_backward_passes() {
    let fx = fixtures();
    let log = scratch_dir("fixtures_smoke-torch").join("steps.log");
    let t0 = mono_ns();
    let mut p = Proc::spawn_ready(
        fx.python(&fx.torch_train_py)
            .args([
                "--steps",
                "3",
                "--accum",
                "2",
                "--optimizer",
                "adam",
                "--dataloader",
                "--log",
            ])
            .arg(&log),
    );
    assert!(
        p.wait_timeout(Duration::from_secs(120))
            .expect("torch_train.py did not finish")
            .success()
    );
    let lines = read_log(&log);
    check_steps(&lines, 3, t0, mono_ns());
    assert_eq!(lines.iter().filter(|l| l.kind == "backward").count(), 6);
}

#[test]
fn require_privileges_skips_or_passes() {
    require_privileges!();
    assert!(privileged());
}
