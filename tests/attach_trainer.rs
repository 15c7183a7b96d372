//! `dynprof attach` on the native fixtures: one step event per call, each
//! inside its own call's logged CLOCK_MONOTONIC interval; aux counting;
//! string-argument filters (C string and libstdc++ std::string*).
#[path = "attach_util.rs"]
mod attach_util;
mod common;

use std::{process::Command, time::Duration};

use attach_util::*;
use common::*;

const T: Duration = Duration::from_secs(120);

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
    // The loop is running once a step is logged.
    wait_for_log_lines(&log, "step", 1, T);
    (p, log)
}

#[test]
fn attach_trainer_one_event_per_optimizer_step_inside_its_call() {
    require_privileges!();
    let (mut p, log) = trainer("attach_trainer-exact", &["--backward-per-step", "3"]);
    let run = run_attach(
        p.pid,
        &[
            "--marker",
            "exe:optimizer_step",
            "--marker",
            "libfixture_backward:backward,role=aux",
            "--steps",
            "25",
        ],
        T,
    );
    run.assert_success();
    let steps = run.steps();
    assert_eq!(steps.len(), 25, "{run}");
    let calls = wait_log_covering(&log, "step", steps.last().unwrap().1, T);
    let m = check_steps_match_calls(&steps, &calls, "trainer optimizer_step");
    assert_eq!(m.len(), 25);

    let att = run.attached();
    let markers = att["markers"].as_array().unwrap();
    assert_eq!(markers.len(), 2, "{att}");
    assert_eq!(markers[0]["role"], "step");
    assert_eq!(markers[0]["symbol"], "optimizer_step");
    assert_eq!(markers[0]["object"], fixtures().trainer.to_str().unwrap());
    assert!(markers[0]["file_offset"].as_u64().unwrap() > 0);
    assert!(
        markers[0]["build_id"]
            .as_str()
            .is_some_and(|b| b.len() >= 16),
        "{att}"
    );
    assert_eq!(markers[1]["role"], "aux");
    assert_eq!(
        markers[1]["object"],
        fixtures().libfixture_backward.to_str().unwrap()
    );
    for e in run.of("step") {
        assert_eq!(e["host_pid"], p.pid);
        assert_eq!(e["tid"], p.pid, "the trainer is single-threaded");
        assert_eq!(e["marker"], "optimizer_step");
    }

    let sum = run.summary();
    assert_eq!(sum["steps"], 25, "{sum}");
    assert_eq!(sum["completed_steps"], 24, "{sum}");
    assert_eq!(sum["end"], "steps_reached");
    assert_eq!(aux_per_step(sum, "backward"), 3.0, "{sum}");
    assert_eq!(sum["drops"]["step"], 0);
    // Read from the kernel's HITS map at the end, after the capability
    // drop (on 5.10 that needs CAP_BPF kept: every bpf(2) is gated there).
    let hits = sum["marker_hits"]["optimizer_step"].as_u64().unwrap_or(0);
    assert!(
        hits >= 25,
        "the kernel counted {hits} hits for 25 steps: {sum}"
    );
    // Step times: p50 between the shortest and longest logged step period.
    let periods: Vec<u64> = m
        .windows(2)
        .map(|w| calls[w[1]].before - calls[w[0]].before)
        .collect();
    let p50_ns = sum["p50_ms"].as_f64().unwrap() * 1e6;
    let (lo, hi) = (
        *periods.iter().min().unwrap() as f64,
        *periods.iter().max().unwrap() as f64,
    );
    assert!(
        p50_ns >= lo * 0.5 && p50_ns <= hi * 1.5,
        "p50 {p50_ns} vs logged periods {lo}..{hi}"
    );
    assert!(p.is_running(), "the trainer must survive the attach");
}

#[test]
fn attach_trainer_cstr_prefix_filter_counts_only_step_names() {
    require_privileges!();
    // --names: optimizer_step is also called with "Optimizer.zero_grad#...".
    let (p, log) = trainer("attach_trainer-cstr", &["--names"]);
    let run = run_attach(
        p.pid,
        &[
            "--marker",
            "exe:optimizer_step,arg=0:cstr,prefix=Optimizer.step#",
            "--steps",
            "20",
        ],
        T,
    );
    run.assert_success();
    let steps = run.steps();
    assert_eq!(steps.len(), 20, "{run}");
    let calls = wait_log_covering(&log, "step", steps.last().unwrap().1, T);
    check_steps_match_calls(&steps, &calls, "trainer --names, prefix filter");
    check_no_event_in(&steps, &log_lines_of(&log, "zero_grad"), "zero_grad calls");
    // The kernel counted exactly as many filtered hits.
    assert_eq!(run.summary()["steps"], 20);
}

#[test]
fn attach_trainer_without_filter_sees_zero_grad_too() {
    // Control for the filter test: the same marker unfiltered fires twice per step.
    require_privileges!();
    let (p, log) = trainer("attach_trainer-nofilter", &["--names"]);
    let run = run_attach(
        p.pid,
        &["--marker", "exe:optimizer_step", "--steps", "20"],
        T,
    );
    run.assert_success();
    let steps = run.steps();
    let last = steps.last().unwrap().1;
    let mut calls: Vec<LogLine> = wait_log_covering(&log, "step", last, T);
    calls.extend(log_lines_of(&log, "zero_grad"));
    calls.sort_by_key(|c| c.before);
    let m = check_steps_match_calls(&steps, &calls, "trainer --names, no filter");
    let kinds: Vec<&str> = m.iter().map(|&i| calls[i].kind.as_str()).collect();
    assert!(
        kinds.contains(&"zero_grad") && kinds.contains(&"step"),
        "{kinds:?}"
    );
}

fn strtrainer_case(tag: &str, marker: &str) {
    let fx = fixtures();
    let log = scratch_dir(tag).join("steps.log");
    let p = Proc::spawn_ready(
        Command::new(&fx.strtrainer)
            .args(["--steps", "0", "--step-ms", "10", "--log"])
            .arg(&log),
    );
    wait_for_log_lines(&log, "step", 1, T);
    let spec = format!("{marker},arg=0:str,prefix=Optimizer.step#");
    let run = run_attach(p.pid, &["--marker", &spec, "--steps", "20"], T);
    run.assert_success();
    let steps = run.steps();
    assert_eq!(steps.len(), 20, "{run}");
    let calls = wait_log_covering(&log, "step", steps.last().unwrap().1, T);
    check_steps_match_calls(&steps, &calls, &format!("strtrainer {marker}"));
    let m = &run.attached()["markers"][0];
    assert_eq!(m["symbol"], "record_name(std::string const&)", "{m}");
}

#[test]
fn attach_strtrainer_std_string_filter_demangled() {
    require_privileges!();
    strtrainer_case(
        "attach_trainer-str-demangled",
        "exe:record_name(std::string const&)",
    );
}

#[test]
fn attach_strtrainer_std_string_filter_mangled() {
    require_privileges!();
    strtrainer_case(
        "attach_trainer-str-mangled",
        "exe:_Z11record_nameRKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE",
    );
}

/// Idle steps reach dynprof through the kernel's step log, 16,384 words
/// read on each tick, and through the ring buffer once 8,192 of them are
/// unread. dynprof is stopped while the trainer makes 20,000 steps, more
/// than the log holds: every step must still arrive once, numbered in
/// order, each stamped inside its own call as the trainer logged it.
#[test]
fn attach_trainer_stalled_reader_loses_no_step() {
    require_privileges!();
    let fx = fixtures();
    let log = scratch_dir("attach_trainer-stalled").join("trainer.log");
    let mut p = Proc::spawn_ready(
        Command::new(&fx.trainer)
            .args([
                "--steps",
                "0",
                "--step-us",
                "100",
                "--backward-per-step",
                "0",
            ])
            .arg("--log")
            .arg(&log),
    );
    wait_for_log_lines(&log, "step", 1, T);
    const N: u64 = 30_000;
    let mut d = Dynprof::attach(
        p.pid,
        &["--marker", "exe:optimizer_step", "--steps", &N.to_string()],
    );
    d.wait_event("step", T);
    d.signal(libc::SIGSTOP);
    let stopped_at = log_lines_of(&log, "step").len();
    wait_for_log_lines(&log, "step", stopped_at + 20_000, T);
    d.signal(libc::SIGCONT);
    let run = d.finish(T);
    run.assert_success();
    let sum = run.summary();
    assert_eq!(sum["steps"], N, "{sum}");
    assert_eq!(sum["drops"]["step"], 0, "{sum}");
    let steps = run.steps();
    assert_eq!(steps.len() as u64, N);
    let calls = wait_log_covering(&log, "step", steps.last().unwrap().1, T);
    // Hit k is the trainer's call `first + k - 1`: find `first` by the first
    // event's time, then check every event against its own call.
    let first = calls
        .iter()
        .position(|c| c.before <= steps[0].1 && steps[0].1 <= c.after)
        .unwrap_or_else(|| panic!("step 1 at {} lies in no logged call", steps[0].1));
    for (n, &(k, ts)) in steps.iter().enumerate() {
        assert_eq!(
            k,
            n as u64 + 1,
            "steps must be numbered 1, 2, ... once each"
        );
        let c = &calls[first + n];
        assert!(
            c.before <= ts && ts <= c.after,
            "step {k} at {ts} is not inside trainer call {} [{}, {}]",
            c.index,
            c.before,
            c.after
        );
    }
    assert!(p.is_running(), "the trainer must survive the attach");
}

#[test]
fn attach_trainer_live_text_output() {
    require_privileges!();
    let (p, _log) = trainer("attach_trainer-live", &[]);
    let (st, out, err) = run_dynprof(Command::new(dynprof_bin()).args([
        "attach",
        "--pid",
        &p.pid.to_string(),
        "--marker",
        "exe:optimizer_step",
        "--steps",
        "5",
    ]));
    assert!(st.success(), "{st}\n{err}");
    assert!(out.is_empty(), "live mode writes to stderr only: {out}");
    assert!(
        err.contains("attached step marker `optimizer_step`"),
        "{err}"
    );
    let step_lines: Vec<&str> = err
        .lines()
        .filter(|l| l.trim_start().starts_with("step "))
        .collect();
    assert_eq!(step_lines.len(), 5, "{err}");
    assert!(
        step_lines[1].contains("steps/s") && step_lines[1].contains(" ms"),
        "{err}"
    );
    assert!(
        err.contains("5 steps (4 complete)") && err.contains("p50") && err.contains("p99"),
        "{err}"
    );
}
