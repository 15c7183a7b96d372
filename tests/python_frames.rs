//! CPython 3.11 frames in cpu windows (issue 15, docs/stacks.md).
//!
//! `tests/fixtures/py_hot.py` runs under Debian's python3.11: per step,
//! `train_step` → `caller` → `hot` (4 units of work) and `cold` (1 unit).
//! A cpu window must show `[py] train_step;[py] caller;[py] hot` joined
//! under the interpreter's `_PyEval_EvalFrameDefault`, and `hot`'s share of
//! the samples in hot or cold close to the job's 80 %.

mod common;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use common::*;

const PYTHON311: &str = "/usr/bin/python3.11";

fn cpu_window(pid: u32, out: &Path) -> (PathBuf, Vec<(Vec<String>, u64)>) {
    window(pid, out, "cpu")
}

/// One window of `collect` ("cpu": cpu.folded, or "offcpu": offcpu.folded,
/// counts in µs) on 40 steps of `python:train_step`.
fn window(pid: u32, out: &Path, collect: &str) -> (PathBuf, Vec<(Vec<String>, u64)>) {
    let o = Command::new(dynprof_bin())
        .args([
            "attach",
            "--pid",
            &pid.to_string(),
            "--marker",
            "python:train_step",
            "--collect",
            collect,
            "--cpu-hz",
            "499",
            "--start-step",
            "2",
            "--warmup",
            "0",
            "--active",
            "40",
            "--json",
            "-o",
        ])
        .arg(out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "dynprof attach failed: {stderr}");
    window_folded(out, collect, &stderr)
}

/// The function name of a `[py] NAME (FILE:LINE)` frame.
fn py_fn(frame: &str) -> Option<&str> {
    let rest = frame.strip_prefix("[py] ")?;
    Some(rest.split_once(" (").map_or(rest, |(n, _)| n))
}

#[test]
fn python_frames_hot_function_under_its_caller() {
    require_privileges!();
    if !Path::new(PYTHON311).exists() {
        eprintln!("SKIPPED: no {PYTHON311}");
        return;
    }
    let dir = scratch_dir("python_frames_hot_function_under_its_caller");
    let script = workspace_root().join("tests/fixtures/py_hot.py");
    let mut p = Proc::spawn_ready(
        Command::new(PYTHON311)
            .arg(&script)
            .args(["--units", "100000"]),
    );
    let (prof, stacks) = cpu_window(p.pid, &dir.join("out"));
    p.terminate();
    let total: u64 = stacks.iter().map(|s| s.1).sum();
    for (s, n) in &stacks {
        eprintln!("  {n:5} {}", s.join(";"));
    }
    assert!(total >= 30, "too few samples: {total}");
    let (mut hot, mut cold, mut joined, mut user_mode) = (0u64, 0u64, 0u64, 0u64);
    for (s, n) in &stacks {
        let py: Vec<(usize, &str)> = s
            .iter()
            .enumerate()
            .filter_map(|(i, f)| Some((i, py_fn(f)?)))
            .collect();
        let names: Vec<&str> = py.iter().map(|p| p.1).collect();
        let leaf = names.last().copied();
        if leaf == Some("hot") {
            hot += n;
        } else if leaf == Some("cold") {
            cold += n;
        } else {
            continue;
        }
        // Called from `caller`, called from `train_step`, directly.
        assert!(
            names.ends_with(&["train_step", "caller", "hot"])
                || names.ends_with(&["train_step", "caller", "cold"]),
            "{}",
            s.join(";")
        );
        // In a user-mode sample (no kernel frames) the first Python frame
        // sits right under an evaluator frame, with the native frames below
        // it. A kernel-mode sample has only the frame-pointer user stack
        // (no user registers to unwind from), so its Python frames may
        // stand at the root instead: not counted.
        if s.iter().any(|f| f.ends_with("_[k]")) {
            continue;
        }
        user_mode += n;
        let first = py[0].0;
        if first > 0 && s[first - 1] == "_PyEval_EvalFrameDefault" {
            joined += n;
        }
    }
    eprintln!("hot {hot}, cold {cold}, joined {joined} of {user_mode} user-mode, {total} samples");
    let in_job = hot + cold;
    assert!(
        in_job as f64 >= 0.8 * total as f64,
        "only {in_job} of {total} samples in hot or cold"
    );
    assert!(
        user_mode as f64 >= 0.8 * in_job as f64,
        "{user_mode} of {in_job}"
    );
    // All but the rare sample taken in the evaluator's symbol-less `.cold`
    // part (1 of 308 in one run of five; docs/stacks.md, Splicing).
    assert!(
        joined * 100 >= user_mode * 99,
        "Python frames not joined to the interpreter's: {joined} of {user_mode}"
    );
    let share = hot as f64 / in_job as f64;
    // The job splits its work 4:1 (80 %).
    assert!(
        (0.7..=0.9).contains(&share),
        "hot's share {share:.2}, expected about 0.80"
    );
    // The flame graph draws them in the Python colour (rgb(80,180,90)).
    let svg = std::fs::read_to_string(prof.join("flamegraph.svg")).unwrap();
    assert!(
        svg.contains("[py] hot (py_hot.py:"),
        "no [py] hot frame in the SVG"
    );
    assert!(
        svg.contains("rgb(80,180,90)"),
        "no frame in the Python colour"
    );
    // The report's top Python functions: hot first, then cold, by self
    // samples; caller holds them all (inclusive).
    let o = Command::new(dynprof_bin())
        .arg("report")
        .arg(&prof)
        .arg("--json")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let r = if r.is_array() { r[0].clone() } else { r };
    let top = r["top_python"]
        .as_array()
        .expect("top_python in the report");
    let name = |i: usize| top[i]["frame"].as_str().unwrap_or("").to_string();
    assert_eq!(name(0), "[py] hot (py_hot.py)", "{top:?}");
    assert_eq!(name(1), "[py] cold (py_hot.py)", "{top:?}");
    assert_eq!(top[0]["self_samples"].as_u64(), Some(hot), "{top:?}");
    let caller = top
        .iter()
        .find(|f| f["frame"] == "[py] caller (py_hot.py)")
        .expect("caller in the table");
    assert!(caller["inclusive_samples"].as_u64().unwrap() >= hot + cold);
    let text = Command::new(dynprof_bin())
        .arg("report")
        .arg(&prof)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&text.stdout).contains("Top Python functions"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Where the py-spy comparison looks for py-spy 0.4 (`pip install
/// py-spy` into a venv there; nothing in the checkout), unless
/// `DYNPROF_PY_SPY` names another binary.
const PY_SPY: &str = "/var/cache/dynprof/pyspy-venv/bin/py-spy";

/// py-spy names frames `func (file.py:LINE)`; only the job's own count.
fn spy_name(f: &str) -> Option<&str> {
    let (n, loc) = f.split_once(" (")?;
    loc.starts_with("py_hot.py").then_some(n)
}

/// Leaf Python function → share of the samples that have Python frames,
/// from folded stacks whose Python frames `name` recognises.
fn leaf_shares(
    stacks: &[(Vec<String>, u64)],
    name: impl Fn(&str) -> Option<&str>,
) -> Vec<(String, f64)> {
    let mut by: std::collections::BTreeMap<String, u64> = Default::default();
    let mut total = 0;
    for (s, n) in stacks {
        if let Some(leaf) = s.iter().filter_map(|f| name(f)).last() {
            *by.entry(leaf.to_string()).or_default() += n;
            total += n;
        }
    }
    let mut v: Vec<(String, f64)> = by
        .into_iter()
        .map(|(k, n)| (k, n as f64 / total.max(1) as f64))
        .collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v
}

/// The same job under py-spy (`record --nonblocking`, same rate, at the
/// same time): the top Python functions agree in rank, and in share
/// within 6 percentage points.
#[test]
fn python_frames_agree_with_py_spy() {
    require_privileges!();
    let py_spy = std::env::var("DYNPROF_PY_SPY").unwrap_or_else(|_| PY_SPY.to_string());
    if !Path::new(PYTHON311).exists() || !Path::new(&py_spy).exists() {
        eprintln!("SKIPPED: needs {PYTHON311} and py-spy at {py_spy}");
        return;
    }
    let dir = scratch_dir("python_frames_agree_with_py_spy");
    let script = workspace_root().join("tests/fixtures/py_hot.py");
    let mut p = Proc::spawn_ready(
        Command::new(PYTHON311)
            .arg(&script)
            .args(["--units", "100000"]),
    );
    let raw = dir.join("py-spy.txt");
    let spy = Command::new(&py_spy)
        .args([
            "record",
            "--nonblocking",
            "-r",
            "499",
            "-d",
            "4",
            "-f",
            "raw",
            "-o",
        ])
        .arg(&raw)
        .args(["-p", &p.pid.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (_, ours) = cpu_window(p.pid, &dir.join("out"));
    let spy_out = spy.wait_with_output().unwrap();
    p.terminate();
    assert!(
        spy_out.status.success(),
        "py-spy: {}",
        String::from_utf8_lossy(&spy_out.stderr)
    );
    let theirs: Vec<(Vec<String>, u64)> = std::fs::read_to_string(&raw)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let (s, n) = l.rsplit_once(' ')?;
            Some((s.split(';').map(str::to_string).collect(), n.parse().ok()?))
        })
        .collect();
    let a = leaf_shares(&ours, py_fn);
    let b = leaf_shares(&theirs, spy_name);
    eprintln!("dynprof {a:?}\npy-spy  {b:?}");
    assert!(a.len() >= 2 && b.len() >= 2, "{a:?} {b:?}");
    for i in 0..2 {
        assert_eq!(a[i].0, b[i].0, "rank {i}: {a:?} vs {b:?}");
        assert!(
            (a[i].1 - b[i].1).abs() <= 0.06,
            "{}: {:.3} vs py-spy {:.3}",
            a[i].0,
            a[i].1,
            b[i].1
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A second thread in C code with the GIL released (`zlib.compress`):
/// it is not the GIL holder, so its thread state is found in the
/// interpreter's thread list. Its samples in zlib show the Python function
/// that called it.
#[test]
fn python_frames_thread_without_the_gil() {
    require_privileges!();
    if !Path::new(PYTHON311).exists() {
        eprintln!("SKIPPED: no {PYTHON311}");
        return;
    }
    let dir = scratch_dir("python_frames_thread_without_the_gil");
    let script = workspace_root().join("tests/fixtures/py_hot.py");
    let mut p = Proc::spawn_ready(Command::new(PYTHON311).arg(&script).args([
        "--units",
        "100000",
        "--zlib-thread",
    ]));
    let (_, stacks) = cpu_window(p.pid, &dir.join("out"));
    p.terminate();
    // Samples in zlib's compressor (user mode: no kernel frames).
    let in_zlib: Vec<(Vec<String>, u64)> = stacks
        .into_iter()
        .filter(|(s, _)| {
            s.iter()
                .any(|f| f.starts_with("deflate") || f.contains("libz.so"))
                && !s.iter().any(|f| f.ends_with("_[k]"))
        })
        .collect();
    let total = weight(&in_zlib, |_| true);
    let named = weight(&in_zlib, |s| {
        s.iter()
            .filter_map(|f| py_fn(f))
            .any(|f| f == "zlib_worker")
    });
    for (s, n) in in_zlib.iter().take(5) {
        eprintln!("  {n:5} {}", s.join(";"));
    }
    eprintln!("{named} of {total} zlib samples under [py] zlib_worker");
    assert!(total >= 20, "too few zlib samples: {total}");
    assert!(named as f64 >= 0.9 * total as f64, "{named} of {total}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// offcpu: each step blocks in `wait_for_batch` → `Queue.get` until a
/// producer thread's item arrives (every 10 ms). The switch-outs carry
/// their Python frames: the main thread's off-CPU time is under
/// `[py] train_step;[py] wait_for_batch;[py] Queue.get`, the producer's
/// sleeps under `[py] producer`.
#[test]
fn python_frames_offcpu_queue_wait() {
    require_privileges!();
    if !Path::new(PYTHON311).exists() {
        eprintln!("SKIPPED: no {PYTHON311}");
        return;
    }
    let dir = scratch_dir("python_frames_offcpu_queue_wait");
    let script = workspace_root().join("tests/fixtures/py_hot.py");
    let mut p = Proc::spawn_ready(
        Command::new(PYTHON311)
            .arg(&script)
            .args(["--units", "1000", "--queue"]),
    );
    let (_, stacks) = window(p.pid, &dir.join("out"), "offcpu");
    p.terminate();
    check_offcpu_queue_wait(&stacks, "python3.11");
    let _ = std::fs::remove_dir_all(&dir);
}
