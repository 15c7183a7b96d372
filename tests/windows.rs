//! Window plans against the native trainer: exact steps, boundaries inside
//! the target's own logged calls, warmup excluded, next-boundary start,
//! repeats, and a target that exits mid-window.
mod common;
#[path = "windows_util.rs"]
mod windows_util;

use std::process::Command;

use common::*;
use windows_util::*;

fn trainer(tag: &str, step_ms: &str) -> (Proc, std::path::PathBuf, std::path::PathBuf) {
    let dir = scratch_dir(tag);
    let log = dir.join("trainer.log");
    let p = Proc::spawn_ready(
        Command::new(&fixtures().trainer)
            .args(["--steps", "0", "--step-ms", step_ms])
            .arg("--log")
            .arg(&log),
    );
    wait_for_log_lines(&log, "step", 1, T);
    (p, log, dir)
}

/// Maps dynprof's hit numbers to the trainer's logged calls through the
/// first `--json` step line; returns (calls, offset) with
/// `call index = hit + offset`.
fn calls_and_offset(d: &Running, log: &std::path::Path, last_hit: u64) -> (Vec<LogLine>, i64) {
    let steps = d.json_steps();
    let (k1, ts1) = steps[0];
    let calls = log_lines_of(log, "step");
    let j1 = call_containing(&calls, ts1)
        .unwrap_or_else(|| panic!("hit {k1} at {ts1} is inside no logged call"));
    let offset = j1 as i64 - k1 as i64;
    let need = (last_hit as i64 + offset + 1) as usize;
    let calls = wait_for_log_lines(log, "step", need, T);
    (calls, offset)
}

#[test]
fn windows_plan_records_exactly_the_planned_steps() {
    require_privileges!();
    let (mut p, log, dir) = trainer("windows_plan_exact", "20");
    let out = dir.join("out");
    let pid = p.pid.to_string();
    let mut d = spawn(
        &attach_args(
            &pid,
            &[
                "--start-step",
                "5",
                "--warmup",
                "1",
                "--active",
                "3",
                "--output",
                out.to_str().unwrap(),
                "--json",
            ],
        ),
        false,
    );
    let st = d.wait_exit(T);
    assert!(st.success(), "{}", d.transcript());
    let dirs = prof_dirs(&out);
    assert_eq!(dirs.len(), 1, "{dirs:?}\n{}", d.transcript());
    assert!(tmp_dirs(&out).is_empty());
    let name = dirs[0].file_name().unwrap().to_str().unwrap().to_string();
    assert!(name.ends_with(&format!("_{pid}_1")), "{name}");
    assert_eq!(name.len(), "PROF_".len() + 17 + 1 + pid.len() + 2, "{name}");

    let m = meta(&dirs[0]);
    assert_eq!(m["complete"], true, "{m}");
    assert_eq!(m["trigger"], "flags");
    assert_eq!(m["plan"]["start_step"], 5);
    assert_eq!(m["plan"]["warmup"], 1);
    assert_eq!(m["plan"]["active"], 3);
    assert_eq!(m["first_recorded_step"], 6);
    assert_eq!(m["last_recorded_step"], 8);
    assert_eq!(
        recorded(&m),
        vec![6, 7, 8],
        "warmup step 5 must not be recorded"
    );
    assert_eq!(m["target"]["host_pid"], p.pid);
    assert!(m["dynprof_version"].is_string());
    assert!(m["target"]["ns_pids"].is_array());

    // steps.csv: exactly 6..8, contiguous, each duration = end - start.
    let rows = steps_csv(&dirs[0]);
    assert_eq!(rows.iter().map(|r| r.0).collect::<Vec<_>>(), vec![6, 7, 8]);
    for r in &rows {
        assert_eq!(r.3, r.2 - r.1);
    }
    assert_eq!(rows[0].2, rows[1].1);
    assert_eq!(rows[1].2, rows[2].1);
    for (k, r) in (6..=8).zip(&rows) {
        assert_eq!(r.1, boundary(&m, k));
        assert_eq!(r.2, boundary(&m, k + 1));
    }

    // Every boundary (5 = warmup, 6..9) is inside the target's own call of
    // the same step, numbered consistently with the live step stream.
    let (calls, off) = calls_and_offset(&d, &log, 9);
    for k in 5..=9u64 {
        let ts = boundary(&m, k);
        let j = call_containing(&calls, ts)
            .unwrap_or_else(|| panic!("boundary {k} ({ts}) is inside no logged call"));
        assert_eq!(
            j as i64,
            k as i64 + off,
            "boundary {k} is in the wrong call"
        );
    }
    let warm: Vec<bool> = m["boundaries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["warmup"].as_bool().unwrap())
        .collect();
    assert!(warm[0]);
    assert!(warm[1..].iter().all(|w| !w));
    // The window line in the JSON stream names the directory.
    let w: Vec<_> = d
        .stdout_json()
        .into_iter()
        .filter(|v| v["event"] == "window")
        .collect();
    assert_eq!(w.len(), 1);
    assert_eq!(w[0]["window"]["dir"], dirs[0].to_str().unwrap());
    assert!(p.is_running(), "the target must survive");
}

#[test]
fn windows_next_boundary_start() {
    require_privileges!();
    let (mut p, log, dir) = trainer("windows_next_boundary", "15");
    let out = dir.join("out");
    let pid = p.pid.to_string();
    let mut d = spawn(
        &attach_args(
            &pid,
            &[
                "--start-step",
                "-1",
                "--active",
                "2",
                "-o",
                out.to_str().unwrap(),
                "--json",
            ],
        ),
        false,
    );
    assert!(d.wait_exit(T).success(), "{}", d.transcript());
    let dirs = prof_dirs(&out);
    assert_eq!(dirs.len(), 1);
    let m = meta(&dirs[0]);
    assert_eq!(m["complete"], true, "{m}");
    assert_eq!(m["plan"]["start_step"], -1);
    let first = m["first_step"].as_u64().unwrap();
    assert!(first >= 1);
    assert_eq!(recorded(&m), vec![first, first + 1]);
    let (calls, off) = calls_and_offset(&d, &log, first + 2);
    for k in first..=first + 2 {
        let j = call_containing(&calls, boundary(&m, k)).expect("boundary inside a logged call");
        assert_eq!(j as i64, k as i64 + off);
    }
    assert!(p.is_running());
}

#[test]
fn windows_repeat_with_gap() {
    require_privileges!();
    let (mut p, _log, dir) = trainer("windows_repeat", "10");
    let out = dir.join("out");
    let pid = p.pid.to_string();
    let mut d = spawn(
        &attach_args(
            &pid,
            &[
                "--start-step",
                "3",
                "--active",
                "2",
                "--repeat",
                "2",
                "--gap",
                "1",
                "-o",
                out.to_str().unwrap(),
            ],
        ),
        false,
    );
    assert!(d.wait_exit(T).success(), "{}", d.transcript());
    let dirs = prof_dirs(&out);
    assert_eq!(dirs.len(), 3, "{}", d.transcript());
    let want = [vec![3, 4], vec![6, 7], vec![9, 10]];
    for (i, (dir, w)) in dirs.iter().zip(want).enumerate() {
        assert_eq!(window_number(dir), i as u32 + 1);
        let m = meta(dir);
        assert_eq!(m["complete"], true);
        assert_eq!(m["plan"]["cycle"], i);
        assert_eq!(recorded(&m), w);
        assert_eq!(steps_csv(dir).iter().map(|r| r.0).collect::<Vec<_>>(), w);
    }
    assert!(p.is_running());
}

#[test]
fn windows_target_exit_mid_window_keeps_incomplete_output() {
    require_privileges!();
    let (mut p, log, dir) = trainer("windows_target_exit", "10");
    let out = dir.join("out");
    let pid = p.pid.to_string();
    let mut d = spawn(
        &attach_args(
            &pid,
            &[
                "--start-step",
                "2",
                "--active",
                "100000",
                "-o",
                out.to_str().unwrap(),
            ],
        ),
        false,
    );
    // The window is open once its hidden directory exists; let a few more
    // steps pass, then kill the target.
    let until = std::time::Instant::now() + T;
    while tmp_dirs(&out).is_empty() {
        assert!(
            std::time::Instant::now() < until,
            "no window opened:\n{}",
            d.transcript()
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let n = log_lines_of(&log, "step").len();
    wait_for_log_lines(&log, "step", n + 4, T);
    unsafe { libc::kill(p.pid as i32, libc::SIGKILL) };
    let _ = p.child.wait();
    assert!(d.wait_exit(T).success(), "{}", d.transcript());
    assert!(
        tmp_dirs(&out).is_empty(),
        "the hidden directory must be renamed"
    );
    let dirs = prof_dirs(&out);
    assert_eq!(dirs.len(), 1);
    let m = meta(&dirs[0]);
    assert_eq!(m["complete"], false, "{m}");
    assert_eq!(m["incomplete_reason"], "target exited");
    let steps = recorded(&m);
    assert!(steps.len() >= 3, "{m}");
    assert_eq!(steps[0], 2);
    assert_eq!(steps_csv(&dirs[0]).len(), steps.len());
    // `dynprof report` flags it.
    let r = dynprof_cmd(&["report", dirs[0].to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&r.stdout).to_string() + &String::from_utf8_lossy(&r.stderr);
    assert!(
        text.contains("INCOMPLETE") && text.contains("target exited"),
        "{text}"
    );
}

#[test]
fn windows_interrupted_mid_window_keeps_incomplete_output() {
    require_privileges!();
    let (mut p, log, dir) = trainer("windows_interrupted", "10");
    let out = dir.join("out");
    let pid = p.pid.to_string();
    let mut d = spawn(
        &attach_args(
            &pid,
            &[
                "--start-step",
                "-1",
                "--active",
                "100000",
                "-o",
                out.to_str().unwrap(),
            ],
        ),
        false,
    );
    let until = std::time::Instant::now() + T;
    while tmp_dirs(&out).is_empty() {
        assert!(
            std::time::Instant::now() < until,
            "no window opened:\n{}",
            d.transcript()
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let n = log_lines_of(&log, "step").len();
    wait_for_log_lines(&log, "step", n + 3, T);
    unsafe { libc::kill(d.child.id() as i32, libc::SIGINT) };
    assert!(d.wait_exit(T).success(), "{}", d.transcript());
    let dirs = prof_dirs(&out);
    assert_eq!(dirs.len(), 1);
    assert!(tmp_dirs(&out).is_empty());
    let m = meta(&dirs[0]);
    assert_eq!(m["complete"], false);
    assert_eq!(m["incomplete_reason"], "interrupted");
    assert!(!recorded(&m).is_empty());
    assert!(
        p.is_running(),
        "an interrupted dynprof leaves the target running"
    );
}

/// Real PyTorch, launch mode: `libtorch_cpu` is loaded by `import torch`,
/// long after the interpreter starts, so the auto marker is attached late;
/// the window then covers exactly the script's own optimizer steps 4..5,
/// with two backward passes each as the aux column.
#[test]
fn windows_launch_pytorch_auto_marker() {
    require_privileges!();
    let fx = fixtures();
    let dir = scratch_dir("windows_launch_pytorch");
    let log = dir.join("torch.log");
    let out = dir.join("out");
    let mut d = spawn(
        &[
            "launch",
            "--start-step",
            "3",
            "--warmup",
            "1",
            "--active",
            "2",
            "-o",
            out.to_str().unwrap(),
            "--json",
            "--",
            PYTHON3,
            fx.torch_train_py.to_str().unwrap(),
            "--steps",
            "10",
            "--accum",
            "2",
            "--log",
            log.to_str().unwrap(),
        ],
        false,
    );
    assert!(
        d.wait_exit(std::time::Duration::from_secs(300)).success(),
        "{}",
        d.transcript()
    );
    let dirs = prof_dirs(&out);
    assert_eq!(dirs.len(), 1, "{}", d.transcript());
    let m = meta(&dirs[0]);
    assert_eq!(m["complete"], true, "{m}");
    assert_eq!(recorded(&m), vec![4, 5]);
    let calls = log_lines_of(&log, "step");
    assert_eq!(calls.len(), 10);
    // Attached before training began: dynprof's step k is the script's step k.
    for k in 3..=6u64 {
        let j = call_containing(&calls, boundary(&m, k))
            .unwrap_or_else(|| panic!("boundary {k} inside no optimizer.step"));
        assert_eq!(calls[j].index, k);
    }
    let csv = std::fs::read_to_string(dirs[0].join("steps.csv")).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let col = header
        .iter()
        .position(|h| h.contains("backward"))
        .unwrap_or_else(|| panic!("no backward column: {csv}"));
    for row in csv.lines().skip(1) {
        assert_eq!(row.split(',').nth(col), Some("2"), "{csv}");
    }
}

/// `--collect none`: a window with step timing only; nothing else is armed
/// or written, and `none` cannot be mixed with collectors.
#[test]
fn windows_collect_none_records_step_timing_only() {
    require_privileges!();
    let (_p, _log, dir) = trainer("windows_collect_none", "10");
    let out = dir.join("out");
    let pid = _p.pid.to_string();
    let mut d = spawn(
        &attach_args(
            &pid,
            &[
                "--start-step",
                "3",
                "--active",
                "2",
                "--collect",
                "none",
                "--output",
                out.to_str().unwrap(),
            ],
        ),
        false,
    );
    assert!(d.wait_exit(T).success(), "{}", d.transcript());
    let dirs = prof_dirs(&out);
    assert_eq!(dirs.len(), 1, "{}", d.transcript());
    let m = meta(&dirs[0]);
    assert_eq!(m["complete"], true, "{m}");
    assert_eq!(recorded(&m), vec![3, 4]);
    assert_eq!(
        m["collectors"],
        serde_json::json!({"api": false, "cpu": false, "offcpu": false})
    );
    for f in ["steps.csv", "trace.json", "summary.json", "meta.json"] {
        assert!(dirs[0].join(f).is_file(), "{f} missing");
    }
    for f in ["api_summary.csv", "cpu.folded", "offcpu.folded"] {
        assert!(
            !dirs[0].join(f).exists(),
            "{f} written without its collector"
        );
    }
    let o = dynprof_cmd(&[
        "attach",
        "--pid",
        &pid,
        "--start-step",
        "3",
        "--collect",
        "none,cpu",
    ])
    .output()
    .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("unknown collector `none`") && err.contains("or `none` for step timing only"),
        "{err}"
    );
}

/// Four threads, the main one among them, hit the step marker together
/// 200,000 times; the window planned at hit 200,001 must open at the main
/// thread's lone call after they joined, and close at the next one. The
/// kernel counts the main thread's hits with a plain add and the other
/// threads' atomically (`KernelState`): a hit lost between the two would
/// open the window a call late.
#[test]
fn windows_start_at_the_planned_hit_when_threads_step_at_once() {
    require_privileges!();
    const THREADS: u64 = 4;
    const CALLS: u64 = 50_000;
    let n = THREADS * CALLS;
    let dir = scratch_dir("windows_step_threads");
    let log = dir.join("stepthreads.log");
    let p = Proc::spawn_ready(
        Command::new(&fixtures().stepthreads)
            .args(["--threads", &THREADS.to_string()])
            .args(["--calls", &CALLS.to_string()])
            .arg("--log")
            .arg(&log),
    );
    let out = dir.join("out");
    let pid = p.pid.to_string();
    let start = (n + 1).to_string();
    let mut d = spawn(
        &[
            "attach",
            "--pid",
            &pid,
            "--marker",
            "exe:step_here",
            "--start-step",
            &start,
            "--active",
            "1",
            "--collect",
            "none",
            "--output",
            out.to_str().unwrap(),
        ],
        false,
    );
    d.wait_for("attached step marker", T);
    // SAFETY: kill(2) on the fixture's pid, which this test owns.
    assert_eq!(unsafe { libc::kill(p.pid as i32, libc::SIGUSR1) }, 0);
    assert!(d.wait_exit(T).success(), "{}", d.transcript());
    let dirs = prof_dirs(&out);
    assert_eq!(dirs.len(), 1, "{}", d.transcript());
    let m = meta(&dirs[0]);
    assert_eq!(m["complete"], true, "{m}");
    assert_eq!(recorded(&m), vec![n + 1]);
    // Every call up to the window's end is in the log once a later one is.
    let end = boundary(&m, n + 2);
    let deadline = std::time::Instant::now() + T;
    let calls = loop {
        let calls = read_log(&log);
        if calls.iter().any(|c| c.before > end) {
            break calls;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the fixture logged no call after the window's end"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    let call_at = |ts: u64| {
        calls
            .iter()
            .find(|c| c.before <= ts && ts <= c.after)
            .map(|c| (c.kind.as_str(), c.index))
    };
    // The lone calls are logged by number: `last n+1`, `after n+2`,
    // `extra n+3`, ….
    assert_eq!(
        call_at(boundary(&m, n + 1)),
        Some(("last", n + 1)),
        "hit {} must be the main thread's lone call after the {n} concurrent ones \
         (a later call: hits were lost)",
        n + 1
    );
    assert_eq!(call_at(end), Some(("after", n + 2)));
}
