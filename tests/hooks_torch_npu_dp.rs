//! `--collector torch-npu-dp` against a small simulation of torch_npu's
//! dynamic_profile loop (written by the test): it polls profiler_config.json
//! every POLL seconds on a thread, starts when its `dp.step()` counter equals
//! `start_step` (-1: the step after it read the file), logs
//! `Start/Stop Dynamic Profiler at N step.` to DIR/log/dp_*.log as torch_npu
//! does, and writes one `*_ascend_pt` directory per capture.
mod common;

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use common::*;
use dynprof::{
    collect::{
        WindowInfo,
        vendor_args::{VendorArgs, build_hooks},
    },
    target::Target,
    types::{HostPid, StepIndex, WindowId},
};

const SIM: &str = r#"
import json, os, sys, threading, time
cfg_dir, prof_root, log_path, poll = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
os.makedirs(os.path.join(cfg_dir, "log"), exist_ok=True)
cfg_file = os.path.join(cfg_dir, "profiler_config.json")
json.dump({"activities": ["CPU", "NPU"], "prof_dir": prof_root, "active": 1, "warmup": 0, "start_step": 0,
           "experimental_config": {"profiler_level": "Level0"}}, open(cfg_file, "w"))
dplog = open(os.path.join(cfg_dir, "log", "dp_sim_%d_rank_0.log" % os.getpid()), "a")
steplog = open(log_path, "w")
state = {"mtime": os.stat(cfg_file).st_mtime_ns, "pending": None}
lock = threading.Lock()
def poller():
    while True:
        time.sleep(poll)
        m = os.stat(cfg_file).st_mtime_ns
        if m != state["mtime"]:
            state["mtime"] = m
            with lock:
                state["pending"] = json.load(open(cfg_file))
threading.Thread(target=poller, daemon=True).start()
print("ready %d" % os.getpid(), flush=True)
cur, prof_left, start_at, cfg = 0, 0, None, None
while True:
    time.sleep(0.02)
    t0 = time.monotonic_ns()
    cur += 1   # dp.step()
    with lock:
        if state["pending"] is not None:
            cfg, state["pending"] = state["pending"], None
            start_at = cur + 1 if cfg["start_step"] == -1 else cfg["start_step"]
    if prof_left:
        prof_left -= 1
        if prof_left == 0:
            dplog.write("2025-01-01 00:00:00 [INFO] Stop Dynamic Profiler at %d step.\n" % cur); dplog.flush()
    elif cfg is not None and cur == start_at:
        prof_left = cfg["active"] + cfg["warmup"]
        os.makedirs(os.path.join(prof_root, "sim_%d_%d_ascend_pt" % (os.getpid(), cur)))
        dplog.write("2025-01-01 00:00:00 [INFO] Start Dynamic Profiler at %d step.\n" % cur); dplog.flush()
        cfg = None
    steplog.write("step %d %d %d\n" % (cur, t0, time.monotonic_ns())); steplog.flush()
"#;

fn wait_dp(dir: &Path, needle: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut count = 0;
        for e in std::fs::read_dir(dir.join("log")).unwrap().flatten() {
            count += std::fs::read_to_string(e.path())
                .unwrap_or_default()
                .matches(needle)
                .count();
        }
        if count >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no {n}x {needle:?} in {}/log",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn torch_npu_dp_writes_start_step_and_reports_the_poll_offset() {
    let scratch = scratch_dir("hooks_torch_npu_dp");
    let (cfg_dir, prof, log) = (
        scratch.join("dpcfg"),
        scratch.join("prof"),
        scratch.join("steps.log"),
    );
    std::fs::create_dir_all(&prof).unwrap();
    std::fs::write(scratch.join("sim.py"), SIM).unwrap();
    let p = Proc::spawn_ready(
        Command::new(PYTHON3)
            .arg(scratch.join("sim.py"))
            .arg(&cfg_dir)
            .arg(&prof)
            .arg(&log)
            .arg("0.3"),
    );
    let target = Target::open(HostPid(p.host_pid())).unwrap();
    let args = VendorArgs {
        dp_config_dir: Some(cfg_dir.display().to_string()),
        dp_active: 2,
        ..Default::default()
    };
    let mut hooks = build_hooks(&args, &target).unwrap();
    assert_eq!(hooks.len(), 1);
    let h = &mut hooks[0];
    h.prepare(&target).unwrap();

    // Window 1 at the sim's step S (dynprof's step = the sim's dp.step() count; K = 0).
    let s = wait_for_log_lines(&log, "step", 3, Duration::from_secs(60))
        .last()
        .unwrap()
        .index;
    let wdir = scratch.join(".PROF_dp_1_tmp");
    std::fs::create_dir_all(&wdir).unwrap();
    let w = WindowInfo {
        id: WindowId(1),
        first_step: StepIndex(s),
        first_recorded: StepIndex(s),
        open_ts_ns: 0,
        start_ts_ns: 0,
        end_ts_ns: 0,
        dir: wdir,
    };
    h.on_window_start(&w, &target).unwrap();
    let written: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(cfg_dir.join("profiler_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(written["start_step"], -1, "lead 0 writes -1");
    assert_eq!(written["active"], 2);
    assert_eq!(
        written["experimental_config"]["profiler_level"], "Level0",
        "the job's own template is kept"
    );
    wait_dp(&cfg_dir, "Stop Dynamic Profiler", 1);
    let meta = h.on_window_end(&w, &target).unwrap();
    let r = &meta["requests"][0];
    assert_eq!(r["captured"], true, "{meta:#}");
    let started = r["torch_npu_started_at_step"].as_i64().unwrap();
    assert_eq!(
        r["torch_npu_stopped_at_step"].as_i64().unwrap(),
        started + 2
    );
    assert_eq!(r["offset_steps"].as_i64().unwrap(), started - s as i64);
    assert!(
        r["offset_steps"].as_i64().unwrap() >= 1,
        "the poll delays the start: {r}"
    );
    assert_eq!(
        r["captured_dynprof_steps"],
        serde_json::json!([started, started + 1])
    );
    assert_eq!(r["capture_dirs"].as_array().unwrap().len(), 1);
    eprintln!("torch_npu poll offset: {} steps", r["offset_steps"]);
    h.shutdown(&target).unwrap();
}

/// The job's user owns its dynamic_profile directory. What it plants there
/// (a link at dynprof's old temporary name, a link at the config file, a
/// log that is a link) must not make root write or read outside the job's
/// root, and the rewritten file belongs to the directory's owner.
#[test]
fn torch_npu_dp_never_writes_through_the_jobs_links() {
    use std::os::unix::fs::{MetadataExt as _, symlink};
    let scratch = scratch_dir("hooks_torch_npu_dp_links");
    let cfg_dir = scratch.join("dpcfg");
    std::fs::create_dir_all(cfg_dir.join("log")).unwrap();
    let victim = scratch.join("root_only");
    std::fs::write(&victim, "root's data\n").unwrap();
    std::fs::write(
        cfg_dir.join("profiler_config.json"),
        r#"{"activities": ["CPU"], "prof_dir": "./", "start_step": 0, "active": 1}"#,
    )
    .unwrap();
    // dynprof's old fixed temporary name, and a log that is a link.
    symlink(&victim, cfg_dir.join(".profiler_config.json.dynprof")).unwrap();
    symlink(&victim, cfg_dir.join("log/dp_planted.log")).unwrap();
    for d in [&cfg_dir, &cfg_dir.join("log")] {
        std::os::unix::fs::lchown(d, Some(65534), Some(65534)).unwrap();
    }
    let p = Proc::spawn_ready(
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(PYTHON3)
            .args([
                "-c",
                "import os, time; print('ready %d' % os.getpid(), flush=True); time.sleep(600)",
            ]),
    );
    let target = Target::open(HostPid(p.host_pid())).unwrap();
    let args = VendorArgs {
        dp_config_dir: Some(cfg_dir.display().to_string()),
        ..Default::default()
    };
    let mut hooks = build_hooks(&args, &target).unwrap();
    let h = &mut hooks[0];
    h.prepare(&target).unwrap();
    let w = WindowInfo {
        id: WindowId(1),
        first_step: StepIndex(5),
        first_recorded: StepIndex(5),
        open_ts_ns: 0,
        start_ts_ns: 0,
        end_ts_ns: 0,
        dir: scratch.join(".PROF_links_1_tmp"),
    };
    h.on_window_start(&w, &target).unwrap();
    assert_eq!(
        std::fs::read_to_string(&victim).unwrap(),
        "root's data\n",
        "a planted link was written through"
    );
    let file = cfg_dir.join("profiler_config.json");
    let meta = std::fs::symlink_metadata(&file).unwrap();
    assert!(meta.file_type().is_file());
    assert_eq!((meta.uid(), meta.gid()), (65534, 65534));
    assert_eq!(meta.mode() & 0o777, 0o644);
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(written["start_step"], -1);
    assert_eq!(written["activities"], serde_json::json!(["CPU"]));
    // The planted log is a link: not read as torch_npu's log.
    let meta = h.on_window_end(&w, &target).unwrap();
    assert_eq!(meta["requests"][0]["captured"], false, "{meta:#}");
    // No temporary file is left behind.
    let left: Vec<String> = std::fs::read_dir(&cfg_dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".dynprof."))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    h.shutdown(&target).unwrap();
}
