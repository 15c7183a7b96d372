//! `--on-window-start` / `--on-window-end` hooks, driven through the
//! `WindowHook` trait as the window scheduler drives them; and the parsing of
//! the vendor flags.

mod common;
#[path = "windows_util.rs"]
mod windows_util;

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use clap::Parser as _;
use common::*;
use dynprof::{
    collect::{
        WindowHook, WindowInfo,
        msprof::monotonic_ns,
        vendor_args::{VendorArgs, VendorCollector, build_hooks},
    },
    target::Target,
    types::{HostPid, StepIndex, WindowId},
};

#[derive(clap::Parser)]
struct Cli {
    #[command(flatten)]
    v: VendorArgs,
}

fn window(id: u32, step: u64, ts: u64, dir: &Path) -> WindowInfo {
    let dir = dir.join(format!(".PROF_hooks_{id}_tmp"));
    std::fs::create_dir_all(&dir).unwrap();
    WindowInfo {
        id: WindowId(id),
        first_step: StepIndex(step),
        first_recorded: StepIndex(step),
        open_ts_ns: ts,
        start_ts_ns: ts,
        end_ts_ns: 0,
        dir,
    }
}

fn target_proc(scratch: &Path) -> (Proc, Target) {
    let p = Proc::spawn_ready(
        Command::new(&fixtures().trainer)
            .args(["--steps", "0", "--log"])
            .arg(scratch.join("trainer.log")),
    );
    let t = Target::open(HostPid(p.host_pid())).unwrap();
    (p, t)
}

fn hooks_for(args: &VendorArgs, t: &Target) -> Box<dyn WindowHook> {
    let mut v = build_hooks(args, t).unwrap();
    assert_eq!(v.len(), 1);
    v.pop().unwrap()
}

fn wait_file(p: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(s) = std::fs::read_to_string(p)
            && s.ends_with('\n')
        {
            return s;
        }
        assert!(Instant::now() < deadline, "{} never written", p.display());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The hooks' results of a window: in meta.json, or, for hooks slower
/// than --hook-wait, in hooks/hooks.json once they end.
fn hook_results(dir: &Path, m: &serde_json::Value) -> serde_json::Value {
    let h = m["hooks"]["hooks"].clone();
    if h["pending"] == true {
        serde_json::from_str(&wait_file(&dir.join("hooks/hooks.json"))).unwrap()
    } else {
        h
    }
}

#[test]
fn vendor_flags_parse() {
    let c = Cli::try_parse_from([
        "x",
        "--collector",
        "msprof,torch-npu-dp",
        "--msprof",
        "/usr/local/Ascend/ascend-toolkit/latest/bin/msprof",
        "--msprof-args=--task-time=l1 --aicpu=on",
        "--dp-config-dir",
        "/cfg",
        "--on-window-start",
        "echo hi",
        "--hook-timeout",
        "5",
    ])
    .unwrap();
    assert_eq!(
        c.v.collectors,
        [VendorCollector::Msprof, VendorCollector::TorchNpuDp]
    );
    assert_eq!(
        c.v.msprof_config().unwrap().collection_args,
        ["--task-time=l1", "--aicpu=on"]
    );
    assert_eq!(c.v.hook_timeout, 5.0);
    let d = Cli::try_parse_from(["x"]).unwrap().v;
    assert_eq!(
        (d.hook_timeout, d.msprof_max_commands, d.dp_active),
        (30.0, 100, 1)
    );
    assert!(Cli::try_parse_from(["x", "--collector", "nope"]).is_err());
}

#[test]
fn hooks_get_the_environment_and_timings() {
    let scratch = scratch_dir("hooks_env");
    let (mut p, t) = target_proc(&scratch);
    let args = VendorArgs {
        on_window_start: Some(
            "env | grep ^DYNPROF_ | sort > \"$DYNPROF_WINDOW_DIR/start.env\"; \
             /usr/bin/python3 -c 'import time; print(time.monotonic_ns())' > \"$DYNPROF_WINDOW_DIR/start.ts\""
                .into(),
        ),
        on_window_end: Some("env | grep ^DYNPROF_ | sort > \"$DYNPROF_WINDOW_DIR/end.env\"; exit 3".into()),
        hook_wait: 120.0,
        ..Default::default()
    };
    let mut h = hooks_for(&args, &t);
    h.prepare(&t).unwrap();
    let boundary = monotonic_ns();
    let w = window(7, 42, boundary, &scratch);
    h.on_window_start(&w, &t).unwrap();
    let meta = h.on_window_end(&w, &t).unwrap();
    h.shutdown(&t).unwrap();

    let env = std::fs::read_to_string(w.dir.join("start.env")).unwrap();
    let get = |k: &str| {
        env.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("{k} in {env}"))
            .to_string()
    };
    assert_eq!(get("DYNPROF_HOST_PID"), t.host_pid.to_string());
    assert_eq!(get("DYNPROF_NS_PID"), t.inner_pid().to_string());
    assert_eq!(get("DYNPROF_STEP"), "42");
    assert_eq!(get("DYNPROF_WINDOW"), "7");
    assert_eq!(get("DYNPROF_WINDOW_DIR"), w.dir.display().to_string());
    assert!(get("DYNPROF_WINDOW_FINAL_DIR").ends_with("/PROF_hooks_7"));
    assert_eq!(get("DYNPROF_EVENT"), "start");
    assert_eq!(get("DYNPROF_BOUNDARY_TS_NS"), boundary.to_string());
    assert!(env.contains("DYNPROF_CONTAINER="));
    let end_env = std::fs::read_to_string(w.dir.join("end.env")).unwrap();
    assert!(end_env.contains("DYNPROF_EVENT=end") && end_env.contains("DYNPROF_WINDOW=7"));

    let s = &meta["on_window_start"];
    assert_eq!(s["exit_code"], 0, "{meta:#}");
    let (spawned, exited) = (
        s["spawned_ns"].as_u64().unwrap(),
        s["exited_ns"].as_u64().unwrap(),
    );
    let inside: u64 = std::fs::read_to_string(w.dir.join("start.ts"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        boundary <= spawned && spawned <= inside && inside <= exited,
        "{boundary} {spawned} {inside} {exited}"
    );
    assert_eq!(s["spawn_latency_ns"].as_u64().unwrap(), spawned - boundary);
    assert_eq!(s["duration_ns"].as_u64().unwrap(), exited - spawned);
    assert_eq!(meta["on_window_end"]["exit_code"], 3);
    assert_eq!(meta["on_window_end"]["timed_out"], false);
    eprintln!("boundary -> start hook spawned: {} ns", spawned - boundary);
    assert!(p.is_running());
}

#[test]
fn the_start_hook_does_not_block_the_caller() {
    let scratch = scratch_dir("hooks_nonblocking");
    let (_p, t) = target_proc(&scratch);
    let fifo = scratch.join("gate");
    assert_eq!(
        Command::new("mkfifo").arg(&fifo).status().unwrap().code(),
        Some(0)
    );
    // The start hook blocks until the test opens the fifo for writing.
    let args = VendorArgs {
        on_window_start: Some(format!(
            "read x < {}; echo \"got $x\" > \"$DYNPROF_WINDOW_DIR/gate.out\"",
            fifo.display()
        )),
        hook_wait: 120.0,
        ..Default::default()
    };
    let mut h = hooks_for(&args, &t);
    let w = window(1, 1, monotonic_ns(), &scratch);
    h.on_window_start(&w, &t).unwrap(); // returns while the hook is blocked
    assert!(!w.dir.join("gate.out").exists());
    std::fs::write(&fifo, "open\n").unwrap();
    let meta = h.on_window_end(&w, &t).unwrap(); // waits for the start hook
    assert_eq!(wait_file(&w.dir.join("gate.out")), "got open\n");
    assert_eq!(meta["on_window_start"]["exit_code"], 0);
    assert!(meta["on_window_end"].is_null());
}

#[test]
fn a_hook_past_its_timeout_is_killed_with_its_process_group() {
    let scratch = scratch_dir("hooks_timeout");
    let (mut p, t) = target_proc(&scratch);
    let args = VendorArgs {
        // A child in the hook's process group that would outlive the shell.
        on_window_end: Some(
            "sleep 1000 & echo $! > \"$DYNPROF_WINDOW_DIR/child.pid\"; wait".into(),
        ),
        hook_timeout: 0.5,
        hook_wait: 120.0,
        ..Default::default()
    };
    let mut h = hooks_for(&args, &t);
    let w = window(1, 1, monotonic_ns(), &scratch);
    h.on_window_start(&w, &t).unwrap();
    let meta = h.on_window_end(&w, &t).unwrap();
    let e = &meta["on_window_end"];
    assert_eq!(e["timed_out"], true, "{meta:#}");
    assert!(e["exit_code"].is_null());
    assert_eq!(e["signal"], libc::SIGTERM);
    assert!(e["duration_ns"].as_u64().unwrap() >= 500_000_000);
    let child: u32 = wait_file(&w.dir.join("child.pid")).trim().parse().unwrap();
    // The grandchild got the signal too (gone, or a zombie awaiting its reaper).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{child}/stat")).unwrap_or_default();
        if stat.is_empty()
            || stat
                .rsplit(')')
                .next()
                .unwrap()
                .trim_start()
                .starts_with('Z')
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the hook's child {child} survived: {stat}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(p.is_running(), "the target is not in the hook's group");
}

#[test]
fn hooks_run_at_the_window_boundaries_of_a_real_attach() {
    require_privileges!();
    let scratch = scratch_dir("hooks_e2e");
    let (log, out) = (scratch.join("trainer.log"), scratch.join("out"));
    let p = Proc::spawn_ready(
        Command::new(&fixtures().trainer)
            .args(["--steps", "0", "--step-ms", "50", "--log"])
            .arg(&log),
    );
    let pid = p.pid.to_string();
    let rec = "/usr/bin/python3 -c 'import time; print(time.monotonic_ns())' > \"$DYNPROF_WINDOW_DIR/$DYNPROF_EVENT.ts\"; \
               echo \"$DYNPROF_STEP $DYNPROF_WINDOW $DYNPROF_HOST_PID\" > \"$DYNPROF_WINDOW_DIR/$DYNPROF_EVENT.env\"";
    let mut d = windows_util::spawn(
        &windows_util::attach_args(
            &pid,
            &[
                "--start-step",
                "3",
                // With warmup the start hook answers the first *recorded* step's
                // boundary, not the window's first one.
                "--warmup",
                "1",
                "--active",
                "2",
                "--repeat",
                "1",
                "--gap",
                "1",
                "--on-window-start",
                rec,
                "--on-window-end",
                rec,
                "--output",
                out.to_str().unwrap(),
            ],
        ),
        false,
    );
    for (dir, m) in windows_util::complete_windows(&mut d, &out, 2) {
        let first = windows_util::recorded(&m)[0];
        let open = windows_util::boundary(&m, first);
        let h = hook_results(&dir, &m);
        assert_eq!(h["on_window_start"]["exit_code"], 0, "{h:#}");
        assert_eq!(h["on_window_end"]["exit_code"], 0, "{h:#}");
        let started: u64 = std::fs::read_to_string(dir.join("start.ts"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(
            started > open,
            "the start hook ran after the window's first boundary"
        );
        assert_eq!(
            h["on_window_start"]["spawn_latency_ns"].as_u64().unwrap(),
            h["on_window_start"]["spawned_ns"].as_u64().unwrap() - open
        );
        assert_eq!(
            h["on_window_start"]["boundary_ts_ns"].as_u64(),
            Some(open),
            "{h:#}"
        );
        // The end hook answers the boundary that closed the window.
        let last = *windows_util::recorded(&m).last().unwrap();
        assert_eq!(
            h["on_window_end"]["boundary_ts_ns"].as_u64(),
            Some(windows_util::boundary(&m, last + 1)),
            "{h:#}"
        );
        let env = std::fs::read_to_string(dir.join("start.env")).unwrap();
        assert_eq!(env.trim(), format!("{first} {} {pid}", m["window"]));
        assert!(dir.join("hooks/on-window-start.log").is_file());
        eprintln!(
            "boundary -> start hook spawned: {} ns",
            h["on_window_start"]["spawn_latency_ns"]
        );
    }
}

/// `--realtime-boundaries`: the event loop waits for due boundaries at
/// SCHED_FIFO, and what it starts then (the hooks, at the very boundary)
/// must not inherit that policy: a hook that spins at real-time priority
/// would keep the job off its CPU. Each hook records its own shell's
/// scheduling policy and real-time priority (/proc/PID/stat fields 41 and
/// 40). Without the spin (off here), the loop is raised at every due
/// boundary, which the summary counts.
#[test]
fn hooks_run_at_normal_priority_under_realtime_boundaries() {
    require_privileges!();
    let scratch = scratch_dir("hooks_rt");
    let out = scratch.join("out");
    let p = Proc::spawn_ready(Command::new(&fixtures().trainer).args([
        "--steps",
        "0",
        "--step-ms",
        "20",
    ]));
    let pid = p.pid.to_string();
    let rec = "cut -d' ' -f41,40 /proc/$$/stat > \"$DYNPROF_WINDOW_DIR/$DYNPROF_EVENT.sched\"";
    let args = windows_util::attach_args(
        &pid,
        &[
            "--json",
            "--realtime-boundaries",
            "--collect",
            "none",
            "--start-step",
            "5",
            "--active",
            "2",
            "--repeat",
            "1",
            "--gap",
            "3",
            "--on-window-start",
            rec,
            "--on-window-end",
            rec,
            "--output",
            out.to_str().unwrap(),
        ],
    );
    let mut c = windows_util::dynprof_cmd(&args);
    c.env("DYNPROF_BOUNDARY_SPIN", "0");
    let mut d =
        windows_util::spawn_cmd(&mut c, false, args.iter().map(|s| s.to_string()).collect());
    for (dir, m) in windows_util::complete_windows(&mut d, &out, 2) {
        assert_eq!(windows_util::recorded(&m).len(), 2, "{m:#}");
        let h = hook_results(&dir, &m);
        for ev in ["start", "end"] {
            assert_eq!(h[format!("on_window_{ev}")]["exit_code"], 0, "{h:#}");
            // "rt_priority policy": 0 0 is SCHED_OTHER (1 1 would be FIFO 1).
            let sched = std::fs::read_to_string(dir.join(format!("{ev}.sched"))).unwrap();
            assert_eq!(
                sched.trim(),
                "0 0",
                "the {ev} hook's rt_priority and policy"
            );
        }
    }
    let summary = d
        .stdout_json()
        .into_iter()
        .find(|v| v["event"] == "summary")
        .unwrap_or_else(|| panic!("no summary line\n{}", d.transcript()));
    let raises = summary["realtime_raises"].as_u64().unwrap_or(0);
    assert!(raises >= 1, "the event loop was never raised: {summary}");
}

#[test]
fn hook_results_after_the_wait_go_next_to_meta_json() {
    let scratch = scratch_dir("hooks_late");
    let (_p, t) = target_proc(&scratch);
    let fifo = scratch.join("gate");
    assert_eq!(
        Command::new("mkfifo").arg(&fifo).status().unwrap().code(),
        Some(0)
    );
    let args = VendorArgs {
        on_window_end: Some(format!("read x < {}; exit 4", fifo.display())),
        hook_wait: 0.0,
        ..Default::default()
    };
    let mut h = hooks_for(&args, &t);
    let w = window(3, 1, monotonic_ns(), &scratch);
    h.on_window_start(&w, &t).unwrap();
    let meta = h.on_window_end(&w, &t).unwrap(); // returns at once
    assert_eq!(meta["pending"], true, "{meta:#}");
    // What the scheduler does next: meta.json, then the rename.
    let fin = scratch.join("PROF_hooks_3");
    assert_eq!(
        Path::new(meta["results_file"].as_str().unwrap()),
        fin.join("hooks/hooks.json")
    );
    std::fs::rename(&w.dir, &fin).unwrap();
    std::fs::write(&fifo, "go\n").unwrap();
    let late: serde_json::Value =
        serde_json::from_str(&wait_file(&fin.join("hooks/hooks.json"))).unwrap();
    assert_eq!(late["on_window_end"]["exit_code"], 4, "{late:#}");
    h.shutdown(&t).unwrap();
}
