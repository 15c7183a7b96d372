//! `dynprof attach --collector msprof` end to end: the window scheduler calls
//! the msprof hook at the boundaries the kernel saw; the stand-in msprof logs
//! when `start`/`stop` arrived; the trainer logs its own optimizer_step calls.
mod common;
#[path = "windows_util.rs"]
mod windows_util;

use std::{collections::BTreeMap, path::Path, process::Command};

use serde_json::Value;

use common::*;
use windows_util::*;

fn ms_log(p: &Path, event: &str) -> Vec<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(p).unwrap_or_default();
    text.lines()
        .filter(|l| l.split_whitespace().next() == Some(event))
        .map(|l| {
            l.split_whitespace()
                .skip(1)
                .filter_map(|f| f.split_once('='))
                .map(|(k, v)| (k.into(), v.into()))
                .collect()
        })
        .collect()
}

fn ts(l: &BTreeMap<String, String>) -> u64 {
    l["ts"].parse().unwrap()
}

/// The trainer as PID 1 of its own PID namespace (`unshare --kill-child`).
fn ns_trainer(log: &Path, env: &[(&str, &str)]) -> (Proc, u32) {
    let mut cmd = Command::new("unshare");
    cmd.args(["--pid", "--fork", "--mount-proc", "--kill-child"])
        .arg(&fixtures().trainer)
        .args([
            "--steps",
            "0",
            // Steps long enough that a loaded 2-core CI machine still
            // delivers each boundary to dynprof before the next one.
            "--step-ms",
            "250",
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
    let u = p.host_pid();
    let children = std::fs::read_to_string(format!("/proc/{u}/task/{u}/children")).unwrap();
    let host = children.split_whitespace().next().unwrap().parse().unwrap();
    wait_for_log_lines(log, "step", 1, T);
    (p, host)
}

fn standin(dir: &Path) -> String {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(
        fixtures().src_dir.join("msprof_standin.py"),
        bin.join("msprof"),
    )
    .unwrap();
    bin.join("msprof").display().to_string()
}

/// A `PROFILING_MODE=dynamic` trainer in its own PID namespace, and a
/// finished `dynprof attach --collector msprof` on it with the stand-in
/// (logging to `mslog`) and `plan`'s flags, which made `windows` windows.
struct MsprofRun {
    _trainer: Proc,
    host: u32,
    log: std::path::PathBuf,
    mslog: std::path::PathBuf,
    dirs: Vec<std::path::PathBuf>,
}

fn msprof_run(name: &str, plan: &[&str], windows: usize) -> MsprofRun {
    let dir = scratch_dir(name);
    let (log, mslog, out) = (
        dir.join("trainer.log"),
        dir.join("msprof.log"),
        dir.join("out"),
    );
    let msprof = standin(&dir);
    let (trainer, host) = ns_trainer(&log, &[("PROFILING_MODE", "dynamic")]);
    let pid = host.to_string();
    let env = format!("MSPROF_STANDIN_LOG={}", mslog.display());
    let msout = dir.join("msprof_out").display().to_string();
    let mut args = plan.to_vec();
    args.extend([
        "--collector",
        "msprof",
        "--msprof",
        &msprof,
        "--msprof-env",
        &env,
        "--msprof-output",
        &msout,
        "--output",
        out.to_str().unwrap(),
        "--json",
    ]);
    let mut d = spawn(&attach_args(&pid, &args), false);
    let dirs = finished_windows(&mut d, &out, windows);
    MsprofRun {
        _trainer: trainer,
        host,
        log,
        mslog,
        dirs,
    }
}

#[test]
fn msprof_start_and_stop_land_inside_the_window_boundaries() {
    require_privileges!();
    let plan = [
        "--start-step",
        "3",
        "--active",
        "2",
        "--repeat",
        "2",
        // Closing a window drains and symbolizes the built-in collectors'
        // events on the event loop (the files are written by a thread):
        // leave room before the next window.
        "--gap",
        "15",
        "--collect",
        "offcpu",
    ];
    // `_trainer` bound, not `..`: the trainer must outlive the checks.
    let MsprofRun {
        _trainer,
        host,
        log,
        mslog,
        dirs,
    } = msprof_run("msprof_e2e", &plan, 3);

    let launch = ms_log(&mslog, "connected");
    assert_eq!(launch.len(), 1, "one session for all windows");
    assert_eq!(
        launch[0]["pid"], "1",
        "the PID inside the target's namespace"
    );
    let target_ns = std::fs::read_link(format!("/proc/{host}/ns/pid")).unwrap();
    assert_eq!(launch[0]["pidns"], target_ns.to_string_lossy());
    let (starts, stops) = (ms_log(&mslog, "start"), ms_log(&mslog, "stop"));
    assert_eq!((starts.len(), stops.len()), (3, 3));
    assert_eq!(ms_log(&mslog, "quit").len(), 1, "quit at detach");

    let mut lats = Vec::new();
    for (i, dir) in dirs.iter().enumerate() {
        let m = meta(dir);
        assert_eq!(m["complete"], true, "{m:#}");
        let rec = recorded(&m);
        let (first, last) = (rec[0], *rec.last().unwrap());
        let open = boundary(&m, first);
        let close = boundary(&m, last + 1);
        let next_call = |t: u64| {
            let calls = log_lines_of(&log, "step");
            let j = call_containing(&calls, t)
                .unwrap_or_else(|| panic!("boundary {t} in no logged call"));
            wait_for_log_lines(&log, "step", j + 2, T)[j + 1].clone()
        };
        let (s, e) = (ts(&starts[i]), ts(&stops[i]));
        // `start` after the first boundary, before the next step's boundary.
        assert!(
            open < s && s < boundary(&m, first + 1),
            "window {}: start {s} not in ({open}, next boundary)",
            i + 1
        );
        // `stop` after the closing boundary, before the trainer's next optimizer_step.
        let after_close = next_call(close);
        assert!(
            close < e && e < after_close.before,
            "window {}: stop {e} not in ({close}, {})",
            i + 1,
            after_close.before
        );
        let h = &m["hooks"]["msprof"];
        assert_eq!(h["prof_dirs"].as_array().unwrap().len(), 1, "{h:#}");
        let name = h["prof_dirs"][0]["name"].as_str().unwrap();
        assert!(dir.join("msprof").join(name).join("end_info").is_file());
        let lat = h["start_latency_ns"].as_u64().unwrap();
        assert_eq!(lat, h["start_written_ns"].as_u64().unwrap() - open);
        let called = h["hook_called_ns"].as_u64().unwrap();
        lats.push((
            lat,
            called - open,
            h["start_written_ns"].as_u64().unwrap() - called,
        ));
    }
    eprintln!(
        "boundary hit -> `start` written (ns) as (total, boundary->hook called, hook->written): {lats:?}"
    );
}

#[test]
fn msprof_without_profiling_mode_is_skipped_and_builtin_collectors_run() {
    require_privileges!();
    let dir = scratch_dir("msprof_e2e_nomode");
    let (log, out) = (dir.join("trainer.log"), dir.join("out"));
    let msprof = standin(&dir);
    let (_p, host) = ns_trainer(&log, &[]);
    let pid = host.to_string();
    let mut d = spawn(
        &attach_args(
            &pid,
            &[
                "--start-step",
                "2",
                "--active",
                "2",
                "--collector",
                "msprof",
                "--msprof",
                &msprof,
                "--collect",
                "cpu,offcpu",
                "--output",
                out.to_str().unwrap(),
            ],
        ),
        false,
    );
    let dirs = finished_windows(&mut d, &out, 1);
    let said: Vec<&String> = d
        .lines
        .iter()
        .filter(|(err, l)| *err && l.contains("PROFILING_MODE=dynamic"))
        .map(|(_, l)| l)
        .collect();
    assert_eq!(said.len(), 1, "exactly one message:\n{}", d.transcript());
    assert!(said[0].contains("built-in collectors"), "{}", said[0]);
    let m = meta(&dirs[0]);
    assert_eq!(m["complete"], true, "{m:#}");
    assert_eq!(m["collectors"]["cpu"], true, "{m:#}");
    assert_eq!(m["hooks"]["msprof"]["enabled"], false);
}

/// `CapEff:` of a process, from /proc.
fn cap_eff(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let hex = s
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .unwrap()
        .trim();
    u64::from_str_radix(hex, 16).unwrap()
}

/// A root job's msprof started again after dynprof gave up its capabilities
/// at attach (`--msprof-max-commands 2` makes dynprof reconnect after each
/// window, as msprof's own limit of 100 does after 50): every window still
/// has its msprof data, each msprof runs as the job's uid and never with a
/// capability the job lacks, and what it ran without is recorded.
#[test]
fn msprof_started_after_the_capability_drop_for_a_root_job() {
    require_privileges!();
    let plan = [
        "--start-step",
        "3",
        "--active",
        "1",
        "--repeat",
        "2",
        "--gap",
        "3",
        "--collect",
        "none",
        "--msprof-max-commands",
        "2",
    ];
    let MsprofRun {
        _trainer,
        host,
        mslog,
        dirs,
        ..
    } = msprof_run("msprof_root_reconnect", &plan, 3);
    // The trainer is still running: its capabilities as /proc shows them.
    let target_eff = cap_eff(host);
    assert_ne!(target_eff, 0, "the trainer runs as root with capabilities");
    for dir in &dirs {
        let m = meta(dir);
        assert_eq!(m["complete"], true, "{m:#}");
        let h = &m["hooks"]["msprof"];
        assert_eq!(h["prof_dirs"].as_array().unwrap().len(), 1, "{h:#}");
    }
    let conns = ms_log(&mslog, "connected");
    // One per window; after the last, dynprof may already have connected
    // again when the session ends (it quits that one too).
    assert!(
        matches!(conns.len(), 3 | 4),
        "one connection per window: {conns:?}"
    );
    let effs: Vec<u64> = conns
        .iter()
        .map(|c| u64::from_str_radix(&c["cap_eff"], 16).unwrap())
        .collect();
    for (c, eff) in conns.iter().zip(&effs) {
        assert_eq!(c["uid"], "0", "msprof runs as the job's uid: {c:?}");
        assert_eq!(
            eff & !target_eff,
            0,
            "a capability the job lacks: {eff:#x} vs {target_eff:#x}"
        );
    }
    // The first connection was made before the drop, with the job's set;
    // the later ones without what dynprof gave up, and say so.
    assert_eq!(effs[0], target_eff);
    assert_ne!(
        effs[1], target_eff,
        "started after the drop: {:#x}",
        effs[1]
    );
    let reconnects: Vec<Value> = dirs
        .iter()
        .flat_map(|d| {
            meta(d)["hooks"]["msprof"]["session_events"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter(|e| e["event"] == "reconnected")
        .collect();
    assert_eq!(reconnects.len(), 2, "{reconnects:#?}");
    for (e, eff) in reconnects.iter().zip(&effs[1..]) {
        assert_eq!(
            e["caps_withheld"],
            format!("{:#x}", target_eff & !eff),
            "{e:#}"
        );
    }
}
