//! `--collector msprof` against the msprof stand-in
//! (tests/fixtures/msprof_standin.py), with the fixture trainer as the job,
//! in its own PID namespace (`unshare --pid --fork --mount-proc`).
//!
//! The hook is driven through the `WindowHook` trait the way the window
//! scheduler drives it: `on_window_start` right after a step boundary is seen
//! (here: in the trainer's own step log), `on_window_end` after the last step.

mod common;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use common::*;
use dynprof::{
    collect::{
        WindowHook, WindowInfo,
        msprof::MsprofHook,
        vendor_args::{VendorArgs, VendorCollector, build_hooks},
    },
    target::Target,
    types::{HostPid, StepIndex, WindowId},
};

/// One line of the stand-in's log: `<event> ts=.. pidns=.. pid=.. self=.. n=..`.
#[derive(Debug, Clone)]
struct MsLine {
    event: String,
    kv: BTreeMap<String, String>,
}

impl MsLine {
    fn ts(&self) -> u64 {
        self.kv["ts"].parse().unwrap()
    }
}

fn read_ms_log(p: &Path) -> Vec<MsLine> {
    let text = std::fs::read_to_string(p).unwrap_or_default();
    let end = text.rfind('\n').map_or(0, |i| i + 1);
    text[..end]
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            let mut it = l.split_whitespace();
            let event = it.next().unwrap().to_string();
            let kv = it
                .filter_map(|f| f.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            MsLine { event, kv }
        })
        .collect()
}

fn ms_events(p: &Path, event: &str) -> Vec<MsLine> {
    read_ms_log(p)
        .into_iter()
        .filter(|l| l.event == event)
        .collect()
}

/// Polls the stand-in log until it has `n` lines of `event`.
fn wait_ms(p: &Path, event: &str, n: usize) -> Vec<MsLine> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let v = ms_events(p, event);
        if v.len() >= n {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "no {n} `{event}` lines in {}: {:?}",
            p.display(),
            read_ms_log(p)
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A directory with `msprof` (the stand-in) in it.
fn standin_bin(scratch: &Path) -> PathBuf {
    let bin = scratch.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let src = fixtures().src_dir.join("msprof_standin.py");
    std::os::unix::fs::symlink(&src, bin.join("msprof")).unwrap();
    bin
}

/// The trainer as PID 1 of a new PID namespace (`unshare` around it).
struct NsTrainer {
    unshare: Proc,
    /// The trainer's host PID.
    host: u32,
}

impl NsTrainer {
    fn is_running(&self) -> bool {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.host)).unwrap_or_default();
        !stat.is_empty()
            && !stat
                .rsplit(')')
                .next()
                .unwrap()
                .trim_start()
                .starts_with('Z')
    }
}

impl Drop for NsTrainer {
    fn drop(&mut self) {
        // PID 1 of the namespace: killing it ends the namespace; then unshare exits.
        // SAFETY: kill(2) on the trainer this test started.
        unsafe { libc::kill(self.host as i32, libc::SIGKILL) };
        let _ = self.unshare.wait_timeout(Duration::from_secs(30));
    }
}

fn trainer_in_pidns(log: &Path, step_ms: u64, env: &[(&str, &str)]) -> (NsTrainer, u32) {
    let mut cmd = Command::new("unshare");
    cmd.args(["--pid", "--fork", "--mount-proc", "--kill-child"])
        .arg(&fixtures().trainer)
        .args([
            "--steps",
            "0",
            "--step-ms",
            &step_ms.to_string(),
            "--busy-pct",
            "10",
            "--log",
        ])
        .arg(log)
        .env_remove("PROFILING_MODE");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let p = Proc::spawn_ready(&mut cmd);
    assert_eq!(p.pid, 1, "the trainer is PID 1 in its namespace");
    let u = p.host_pid();
    let children = std::fs::read_to_string(format!("/proc/{u}/task/{u}/children")).unwrap();
    let host: u32 = children
        .split_whitespace()
        .next()
        .expect("unshare's child")
        .parse()
        .unwrap();
    (NsTrainer { unshare: p, host }, host)
}

fn window(id: u32, step: u64, ts: u64, dir: &Path) -> WindowInfo {
    let dir = dir.join(format!(".PROF_test_{id}_tmp"));
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

fn pidns_of(pid: u32) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/pid"))
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

fn msprof_args(scratch: &Path, mslog: &Path) -> VendorArgs {
    VendorArgs {
        collectors: vec![VendorCollector::Msprof],
        msprof_output: Some(scratch.join("msprof_out").display().to_string()),
        msprof_env: vec![format!("MSPROF_STANDIN_LOG={}", mslog.display())],
        ..Default::default()
    }
}

fn one_hook(args: &VendorArgs, target: &Target) -> Box<dyn WindowHook> {
    let mut hooks = build_hooks(args, target).unwrap();
    assert_eq!(hooks.len(), 1);
    hooks.pop().unwrap()
}

/// Processes whose command line contains all of `needles`.
fn pids_with(needles: &[&str]) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cl) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let cl = String::from_utf8_lossy(&cl).replace('\0', " ");
        if needles.iter().all(|n| cl.contains(n)) {
            out.push(pid);
        }
    }
    out
}

#[test]
fn msprof_runs_in_the_target_pidns_and_writes_start_stop_inside_the_window_steps() {
    require_privileges!();
    let scratch = scratch_dir("msprof_boundaries");
    let bin = standin_bin(&scratch);
    let (log, mslog) = (scratch.join("trainer.log"), scratch.join("msprof.log"));
    let path = format!("{}:/usr/bin:/bin", bin.display());
    // msprof is found through the job's own PATH (no --msprof).
    let (trainer, host) =
        trainer_in_pidns(&log, 150, &[("PROFILING_MODE", "dynamic"), ("PATH", &path)]);
    let target = Target::open(HostPid(host)).unwrap();
    assert_eq!(target.inner_pid().0, 1);
    assert_ne!(pidns_of(host), pidns_of(std::process::id()));

    let mut hook = one_hook(&msprof_args(&scratch, &mslog), &target);
    hook.prepare(&target).unwrap();
    let launch = wait_ms(&mslog, "connected", 1);
    // Inside the target's PID namespace, given the PID it has there.
    assert_eq!(launch[0].kv["pidns"], pidns_of(host), "{launch:?}");
    assert_eq!(launch[0].kv["pid"], "1");

    let mut metas = Vec::new();
    for (i, k) in [(1u32, 3u64), (2, 6), (3, 9)] {
        // Boundary of step k: the trainer logged its optimizer_step k.
        let steps = wait_for_log_lines(&log, "step", k as usize, Duration::from_secs(60));
        let b = &steps[k as usize - 1];
        let w = window(i, k, b.after, &scratch);
        let called = mono_ns();
        hook.on_window_start(&w, &target).unwrap();
        let returned = mono_ns();
        // Window of 1 step: ends at the boundary k+1.
        let steps = wait_for_log_lines(&log, "step", k as usize + 1, Duration::from_secs(60));
        let e = steps[k as usize].clone();
        let meta = hook.on_window_end(&w, &target).unwrap();
        let steps = wait_for_log_lines(&log, "step", k as usize + 2, Duration::from_secs(60));
        let next_after_end = steps[k as usize + 1].clone();

        let start = &wait_ms(&mslog, "start", i as usize)[i as usize - 1];
        let stop = &wait_ms(&mslog, "stop", i as usize)[i as usize - 1];
        assert!(
            start.ts() > b.after && start.ts() < e.before,
            "start {start:?} not within step {k}: {b:?} .. {e:?}"
        );
        assert!(
            stop.ts() > e.after && stop.ts() < next_after_end.before,
            "stop {stop:?} not within the step after the window: {e:?} .. {next_after_end:?}"
        );
        assert_eq!(start.kv["pidns"], pidns_of(host));

        // One PROF dir, listed with its host path and linked from the window.
        let dirs = meta["prof_dirs"].as_array().unwrap();
        assert_eq!(dirs.len(), 1, "{meta:#}");
        let name = dirs[0]["name"].as_str().unwrap();
        assert!(name.starts_with("PROF_"), "{name}");
        let link = w.dir.join("msprof").join(name);
        assert!(
            link.join("end_info").is_file(),
            "{} does not lead to the PROF dir",
            link.display()
        );
        assert!(
            Path::new(dirs[0]["host_path"].as_str().unwrap())
                .starts_with(format!("/proc/{host}/root"))
        );
        let lat = meta["start_latency_ns"].as_u64().expect("latency recorded");
        // The latency runs from the window's boundary (`b.after`, given to
        // the hook) to the end of the write of `start`: a moment inside the
        // hook call, after the write began, which was before msprof read
        // it. Orders on one clock, not durations.
        let write_begin = meta["start_write_begin_ns"].as_u64().unwrap();
        let written = b.after + lat;
        assert!(
            called <= write_begin && write_begin <= written && written <= returned,
            "write {write_begin}..{written} (latency {lat} from {b:?}) not inside the hook call \
             {called}..{returned}"
        );
        assert!(write_begin <= start.ts(), "{write_begin} vs {start:?}");
        metas.push(meta);
    }
    // Repeated start/stop ERROR lines are recorded, not failures.
    assert!(
        metas[2]["errors_recorded_as_normal"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l.as_str().unwrap().contains("ERROR"))
    );
    // One session across the windows.
    assert_eq!(ms_events(&mslog, "connected").len(), 1);
    hook.shutdown(&target).unwrap();
    wait_ms(&mslog, "quit", 1);
    assert!(trainer.is_running(), "the target must never be disturbed");
    let lats: Vec<u64> = metas
        .iter()
        .map(|m| m["start_latency_ns"].as_u64().unwrap())
        .collect();
    eprintln!("boundary(log) -> start written latencies (ns): {lats:?}");
}

#[test]
fn msprof_reconnects_after_its_100_command_limit_60_windows_60_dirs() {
    require_privileges!();
    let scratch = scratch_dir("msprof_sixty");
    let bin = standin_bin(&scratch);
    let (log, mslog) = (scratch.join("trainer.log"), scratch.join("msprof.log"));
    let (trainer, host) = trainer_in_pidns(&log, 20, &[("PROFILING_MODE", "dynamic")]);
    let target = Target::open(HostPid(host)).unwrap();
    let mut args = msprof_args(&scratch, &mslog);
    args.msprof = Some(bin.join("msprof").display().to_string());
    let mut hook = one_hook(&args, &target);
    hook.prepare(&target).unwrap();
    let mut all = std::collections::BTreeSet::new();
    for i in 1..=60u32 {
        let w = window(i, i as u64, 0, &scratch);
        hook.on_window_start(&w, &target).unwrap();
        let meta = hook
            .on_window_end(&w, &target)
            .unwrap_or_else(|e| panic!("window {i}: {e:#}"));
        let dirs = meta["prof_dirs"].as_array().unwrap();
        assert_eq!(dirs.len(), 1, "window {i}: {meta:#}");
        assert!(all.insert(dirs[0]["name"].as_str().unwrap().to_string()));
        assert!(
            w.dir
                .join("msprof")
                .join(dirs[0]["name"].as_str().unwrap())
                .is_dir()
        );
    }
    hook.shutdown(&target).unwrap();
    let out = scratch.join("msprof_out");
    let on_disk = std::fs::read_dir(&out)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("PROF_")
        })
        .count();
    assert_eq!(on_disk, 60);
    let connected = ms_events(&mslog, "connected");
    assert_eq!(connected.len(), 2, "{:?}", read_ms_log(&mslog));
    // The first connection took exactly 50 start/stop pairs.
    let first_self = &connected[0].kv["self"];
    let starts_first = ms_events(&mslog, "start")
        .iter()
        .filter(|l| &l.kv["self"] == first_self)
        .count();
    assert_eq!(starts_first, 50);
    assert_eq!(ms_events(&mslog, "limit").len(), 1);
    assert!(trainer.is_running());
}

#[test]
fn msprof_idle_exit_is_reconnected_between_windows() {
    require_privileges!();
    let scratch = scratch_dir("msprof_idle");
    let bin = standin_bin(&scratch);
    let (log, mslog) = (scratch.join("trainer.log"), scratch.join("msprof.log"));
    let (trainer, host) = trainer_in_pidns(&log, 20, &[("PROFILING_MODE", "dynamic")]);
    let target = Target::open(HostPid(host)).unwrap();
    let mut args = msprof_args(&scratch, &mslog);
    args.msprof = Some(bin.join("msprof").display().to_string());
    args.msprof_env.push("MSPROF_STANDIN_IDLE_S=1".into());
    let mut hook = one_hook(&args, &target);
    hook.prepare(&target).unwrap();
    // The session times out while idle; the supervisor reconnects.
    wait_ms(&mslog, "idle_exit", 1);
    wait_ms(&mslog, "connected", 2);
    let w = window(1, 1, 0, &scratch);
    hook.on_window_start(&w, &target).unwrap();
    let meta = hook.on_window_end(&w, &target).unwrap();
    assert_eq!(meta["prof_dirs"].as_array().unwrap().len(), 1, "{meta:#}");
    let events = meta["session_events"].as_array().unwrap();
    assert!(
        events.iter().any(|e| e["reason"] == "idle exit"),
        "{meta:#}"
    );
    hook.shutdown(&target).unwrap();
    assert!(trainer.is_running());
}

#[test]
fn msprof_skipped_with_one_message_without_profiling_mode() {
    let scratch = scratch_dir("msprof_no_mode");
    let bin = standin_bin(&scratch);
    let log = scratch.join("trainer.log");
    let mut p = Proc::spawn_ready(
        Command::new(&fixtures().trainer)
            .args(["--steps", "0", "--log"])
            .arg(&log)
            .env_remove("PROFILING_MODE"),
    );
    let target = Target::open(HostPid(p.host_pid())).unwrap();
    let mut args = msprof_args(&scratch, &scratch.join("msprof.log"));
    args.msprof = Some(bin.join("msprof").display().to_string());
    let mut hook = MsprofHook::new(args.msprof_config().unwrap());
    hook.prepare(&target).unwrap();
    assert!(hook.is_disabled());
    let w = window(1, 1, 0, &scratch);
    hook.on_window_start(&w, &target).unwrap();
    let meta = hook.on_window_end(&w, &target).unwrap();
    assert_eq!(meta["enabled"], false);
    assert!(
        meta["reason"]
            .as_str()
            .unwrap()
            .contains("PROFILING_MODE=dynamic"),
        "{meta}"
    );
    hook.shutdown(&target).unwrap();
    assert!(
        !scratch.join("msprof.log").exists(),
        "msprof must not have been started"
    );
    assert!(p.is_running());
}

#[test]
fn msprof_missing_marks_the_window_incomplete() {
    let scratch = scratch_dir("msprof_missing");
    let log = scratch.join("trainer.log");
    let mut p = Proc::spawn_ready(
        Command::new(&fixtures().trainer)
            .args(["--steps", "0", "--log"])
            .arg(&log)
            .env("PROFILING_MODE", "dynamic")
            .env("PATH", "/usr/bin:/bin"),
    );
    let target = Target::open(HostPid(p.host_pid())).unwrap();
    let mut args = msprof_args(&scratch, &scratch.join("msprof.log"));
    args.msprof = Some("/nonexistent/msprof".into());
    let mut hook = one_hook(&args, &target);
    hook.prepare(&target).unwrap();
    let w = window(1, 1, 0, &scratch);
    hook.on_window_start(&w, &target).unwrap();
    let err = hook.on_window_end(&w, &target).unwrap_err().to_string();
    assert!(
        err.contains("msprof not found") && err.contains("/nonexistent/msprof"),
        "{err}"
    );
    assert!(w.dir.is_dir(), "the window is kept");
    hook.shutdown(&target).unwrap();
    assert!(p.is_running());
}

#[test]
fn msprof_killed_mid_window_keeps_the_window_incomplete_and_recovers() {
    require_privileges!();
    let scratch = scratch_dir("msprof_killed");
    let bin = standin_bin(&scratch);
    let (log, mslog) = (scratch.join("trainer.log"), scratch.join("msprof.log"));
    let (trainer, host) = trainer_in_pidns(&log, 20, &[("PROFILING_MODE", "dynamic")]);
    let target = Target::open(HostPid(host)).unwrap();
    let mut args = msprof_args(&scratch, &mslog);
    args.msprof = Some(bin.join("msprof").display().to_string());
    let out_arg = format!("--output={}", args.msprof_output.as_ref().unwrap());
    let mut hook = one_hook(&args, &target);
    hook.prepare(&target).unwrap();
    let w1 = window(1, 1, 0, &scratch);
    hook.on_window_start(&w1, &target).unwrap();
    wait_ms(&mslog, "start", 1);
    // Only msprof itself: the process that forked it into the PID namespace
    // still has dynprof's command line.
    let victims = pids_with(&["/bin/msprof", &out_arg]);
    assert_eq!(victims.len(), 1, "{victims:?}");
    // SAFETY: kill(2) on the stand-in we found by its unique --output.
    unsafe { libc::kill(victims[0] as i32, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !pids_with(&["/bin/msprof", &out_arg]).is_empty() {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    let err = hook.on_window_end(&w1, &target).unwrap_err().to_string();
    assert!(err.contains("exited"), "{err}");
    assert!(
        w1.dir.join("msprof_meta.json").is_file(),
        "the window is kept with the details"
    );
    // The next window reconnects.
    let w2 = window(2, 5, 0, &scratch);
    hook.on_window_start(&w2, &target).unwrap();
    let meta = hook.on_window_end(&w2, &target).unwrap();
    assert_eq!(meta["prof_dirs"].as_array().unwrap().len(), 1, "{meta:#}");
    hook.shutdown(&target).unwrap();
    assert!(trainer.is_running(), "the target is never disturbed");
}

#[test]
fn msprof_args_map_from_profiler_config() {
    let cfg: serde_json::Value = serde_json::json!({
        "activities": ["CPU", "NPU"], "profile_memory": true,
        "experimental_config": {"profiler_level": "Level1", "aic_metrics": "PipeUtilization", "l2_cache": true, "export_type": ["db"]}
    });
    let a = dynprof::collect::msprof::args_from_profiler_config(&cfg);
    for want in [
        "--task-time=l1",
        "--ai-core=on",
        "--aic-metrics=PipeUtilization",
        "--l2=on",
        "--sys-hardware-mem=on",
        "--runtime-api=on",
        "--type=db",
    ] {
        assert!(a.iter().any(|x| x == want), "{want} missing in {a:?}");
    }
    let args = VendorArgs {
        profiler_config: Some(cfg),
        ..Default::default()
    };
    assert!(
        args.msprof_config()
            .unwrap()
            .collection_args
            .contains(&"--task-time=l1".to_string())
    );
    let args = VendorArgs {
        msprof_args: Some("--aicpu=on  --task-time=on".into()),
        ..Default::default()
    };
    assert_eq!(
        args.msprof_config().unwrap().collection_args,
        ["--aicpu=on", "--task-time=on"]
    );
}

#[test]
fn msprof_follows_profiler_config_switches_in_config_mode() {
    require_privileges!();
    let scratch = scratch_dir("msprof_config_mode");
    let bin = standin_bin(&scratch);
    let (log, mslog) = (scratch.join("trainer.log"), scratch.join("msprof.log"));
    let (trainer, host) = trainer_in_pidns(&log, 20, &[("PROFILING_MODE", "dynamic")]);
    let target = Target::open(HostPid(host)).unwrap();
    let cfg = scratch.join("profiler_config.json");
    let write_cfg = |level: &str| {
        let v = serde_json::json!({"activities": ["NPU"], "experimental_config": {"profiler_level": level, "aic_metrics": "AiCoreNone"}});
        std::fs::write(&cfg, v.to_string()).unwrap();
    };
    write_cfg("Level0");
    let mut args = msprof_args(&scratch, &mslog);
    args.msprof = Some(bin.join("msprof").display().to_string());
    args.profiler_config_path = Some(cfg.clone());
    let mut hook = one_hook(&args, &target);
    hook.prepare(&target).unwrap();
    let w = window(1, 1, 0, &scratch);
    hook.on_window_start(&w, &target).unwrap();
    write_cfg("Level1"); // an edit during the window applies to the next one
    let m1 = hook.on_window_end(&w, &target).unwrap();
    assert!(
        m1["collection_args"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "--task-time=l0"),
        "{m1:#}"
    );
    assert!(
        m1["collection_args_change"]["to"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "--task-time=l1"),
        "{m1:#}"
    );
    let w = window(2, 5, 0, &scratch);
    hook.on_window_start(&w, &target).unwrap();
    let m2 = hook.on_window_end(&w, &target).unwrap();
    assert_eq!(m2["prof_dirs"].as_array().unwrap().len(), 1, "{m2:#}");
    hook.shutdown(&target).unwrap();
    let launches = ms_events(&mslog, "launch");
    assert_eq!(launches.len(), 2, "{:?}", read_ms_log(&mslog));
    assert!(launches[0].kv["argv"].contains("--task-time=l0"));
    assert!(launches[1].kv["argv"].contains("--task-time=l1"));
    assert!(trainer.is_running());
}
