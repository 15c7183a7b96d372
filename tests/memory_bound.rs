//! Bounded memory in dense windows (issue 18, item 1): against a target
//! whose two threads ping-pong over pipes (hundreds of thousands of
//! off-CPU intervals a second), dynprof's peak RSS stays under
//! `--memory-budget` while it collects and while it writes the window, the
//! window says how many events it could not keep, and its trace.json is
//! whole. Before the budget, a 300-step window of this target took dynprof
//! to 2.6 GiB (docs/reliability.md).
mod common;
#[path = "windows_util.rs"]
mod windows_util;

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use common::*;
use dynprof::output::chrome_trace::validate_trace;
use serde_json::Value;
use windows_util::*;

const BUDGET: &str = "64MiB";
const BUDGET_BYTES: u64 = 64 << 20;
/// Events a 64 MiB window keeps: (64 MiB - 40 MiB reserved for dynprof
/// itself) / 256 bytes per event, the documented sizing.
const EVENTS_CAP: u64 = 98_304;
/// The writer thread runs at nice +10: on a loaded 2-core machine writing
/// ~100k events can take minutes.
const T_WRITE: Duration = Duration::from_secs(900);

fn pingpong(tag: &str) -> (Proc, PathBuf) {
    let dir = scratch_dir(tag);
    let log = dir.join("pingpong.log");
    let p = Proc::spawn_ready(
        Command::new(&fixtures().pingpong)
            .args(["--steps", "0", "--rounds", "1000"])
            .arg("--log")
            .arg(&log),
    );
    wait_for_log_lines(&log, "step", 1, T);
    (p, dir)
}

/// Follows `VmHWM` of a running process from /proc until it exits: the
/// last value read is its peak RSS so far.
struct PeakWatch {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    handle: Option<JoinHandle<()>>,
}

fn vmhwm(pid: u32) -> Option<u64> {
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = st.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

impl PeakWatch {
    fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(0));
        let (s, p) = (stop.clone(), peak.clone());
        let handle = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match vmhwm(pid) {
                    Some(v) => {
                        p.fetch_max(v, Ordering::Relaxed);
                    }
                    None => break,
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        Self {
            stop,
            peak,
            handle: Some(handle),
        }
    }

    /// The highest VmHWM read (call after the process exited).
    fn peak(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        self.peak.load(Ordering::Relaxed)
    }
}

fn summary(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap()
}

/// trace.json parses, passes the structural check, and holds exactly the
/// window's kept off-CPU intervals (and CPU samples).
fn check_trace(dir: &Path, offcpu: u64, samples: u64, meta: &Value) {
    let raw = std::fs::read(dir.join("trace.json")).unwrap();
    let v: Value = serde_json::from_slice(&raw)
        .unwrap_or_else(|e| panic!("{}/trace.json is not valid JSON: {e}", dir.display()));
    let st = validate_trace(&v).unwrap();
    assert_eq!(
        st.by_cat.get("offcpu").copied().unwrap_or(0) as u64,
        offcpu,
        "{:?}",
        st.by_cat
    );
    assert_eq!(st.instants as u64, samples);
    assert_eq!(st.steps as u64, meta["steps_recorded"].as_u64().unwrap());
    assert_eq!(
        v["metadata"]["dropped_over_budget"],
        meta["memory"]["dropped_over_budget"]
    );
}

/// The memory section of meta.json: the budget and cap it ran under, and
/// a peak RSS under the budget.
fn check_memory(m: &Value) -> &Value {
    let mem = &m["memory"];
    assert_eq!(mem["budget_bytes"], BUDGET_BYTES, "{m}");
    assert_eq!(mem["events_cap"], EVENTS_CAP, "{m}");
    let peak = mem["peak_rss_bytes"].as_u64().expect("peak_rss_bytes");
    assert!(
        peak > 0 && peak < BUDGET_BYTES,
        "meta.json peak RSS {peak} is not under the {BUDGET} budget"
    );
    mem
}

#[test]
fn dense_offcpu_window_stays_under_the_budget() {
    require_privileges!();
    let (p, dir) = pingpong("memory_dense_offcpu");
    let out = dir.join("out");
    let pid = p.pid.to_string();
    // 150 steps of 1000 round trips: ~300,000 off-CPU intervals, three
    // times what a 64 MiB window keeps.
    let mut d = spawn(
        &attach_args(
            &pid,
            &[
                "--collect",
                "offcpu",
                "--start-step",
                "5",
                "--active",
                "150",
                "--memory-budget",
                BUDGET,
                "--output",
                out.to_str().unwrap(),
            ],
        ),
        false,
    );
    let watch = PeakWatch::start(d.child.id());
    let st = d.wait_exit(T_WRITE);
    let watched = watch.peak();
    assert!(st.success(), "{}", d.transcript());
    assert!(
        watched > 0 && watched < BUDGET_BYTES,
        "dynprof's VmHWM reached {watched} bytes, over the {BUDGET} budget"
    );
    let dirs = prof_dirs(&out);
    assert_eq!(dirs.len(), 1, "{dirs:?}\n{}", d.transcript());
    let m = meta(&dirs[0]);
    assert_eq!(m["complete"], true, "{m}");
    assert_eq!(m["steps_recorded"], 150);
    let mem = check_memory(&m);
    let dropped = mem["dropped_over_budget"]["offcpu"].as_u64().unwrap();
    assert!(dropped > 0, "a 300k-event window was kept whole: {mem}");
    assert_eq!(mem["dropped_over_budget"]["cpu"], 0);
    // What was kept is the cap (a few events that raced the gate may fall
    // outside the window's bounds; one interval per thread may still be in
    // flight at the end and is added).
    let s = summary(&dirs[0]);
    let kept = s["offcpu_spans"].as_u64().unwrap();
    assert!(
        (EVENTS_CAP - 100..=EVENTS_CAP + 2).contains(&kept),
        "kept {kept} off-CPU intervals, cap {EVENTS_CAP}"
    );
    assert_eq!(s["dropped_over_budget"]["offcpu"], dropped);
    check_trace(&dirs[0], kept, 0, &m);
    // The window says so on the console and in the report.
    d.wait_for("too dense for --memory-budget", T);
    let rep = dynprof_cmd(&["report", dirs[0].to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&rep.stdout);
    assert!(
        text.contains(&format!(
            "window too dense for --memory-budget: {dropped} events not kept"
        )),
        "{text}"
    );
    drop(p);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigterm_mid_window_writes_it_within_the_budget() {
    require_privileges!();
    let (p, dir) = pingpong("memory_sigterm");
    let out = dir.join("out");
    let pid = p.pid.to_string();
    let mut d = spawn(
        &attach_args(
            &pid,
            &[
                "--collect",
                "offcpu,cpu",
                "--cpu-hz",
                "4999",
                "--start-step",
                "5",
                "--active",
                "1000000",
                "--memory-budget",
                BUDGET,
                "--output",
                out.to_str().unwrap(),
            ],
        ),
        false,
    );
    let watch = PeakWatch::start(d.child.id());
    // 130 steps into the window: ~260k off-CPU intervals seen, past the cap.
    d.wait_for(&format!("step {:>6}", 135), T_WRITE);
    assert_eq!(tmp_dirs(&out).len(), 1, "the window is open");
    // SAFETY: kill(2) on our own unreaped child.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGTERM) };
    let st = d.wait_exit(T_WRITE);
    let watched = watch.peak();
    assert!(
        st.code().is_some(),
        "killed by a signal: {st}\n{}",
        d.transcript()
    );
    assert!(
        watched > 0 && watched < BUDGET_BYTES,
        "dynprof's VmHWM reached {watched} bytes, over the {BUDGET} budget"
    );
    let dirs = prof_dirs(&out);
    assert_eq!(dirs.len(), 1, "{dirs:?}\n{}", d.transcript());
    assert!(tmp_dirs(&out).is_empty());
    let m = meta(&dirs[0]);
    assert_eq!(m["complete"], false, "{m}");
    assert_eq!(m["incomplete_reason"], "interrupted", "{m}");
    assert!(m["steps_recorded"].as_u64().unwrap() >= 130, "{m}");
    let mem = check_memory(&m);
    let over = &mem["dropped_over_budget"];
    assert!(
        over["offcpu"].as_u64().unwrap() + over["cpu"].as_u64().unwrap() > 0,
        "{mem}"
    );
    let s = summary(&dirs[0]);
    let kept_off = s["offcpu_spans"].as_u64().unwrap();
    let kept_cpu = s["cpu_samples"].as_u64().unwrap();
    // One pool for the window, whichever collector filled it.
    assert!(
        (EVENTS_CAP - 100..=EVENTS_CAP + 2).contains(&(kept_off + kept_cpu)),
        "kept {kept_off} off-CPU + {kept_cpu} samples, cap {EVENTS_CAP}"
    );
    assert!(kept_cpu > 0, "no CPU sample at 4999 Hz");
    check_trace(&dirs[0], kept_off, kept_cpu, &m);
    drop(p);
    let _ = std::fs::remove_dir_all(&dir);
}
