//! Helpers for the attach tests (`#[path = "attach_util.rs"] mod attach_util;`):
//! run `dynprof attach --json`, follow its JSON lines, and check step events
//! against a fixture's own CLOCK_MONOTONIC log.
#![allow(dead_code, unreachable_pub)] // shared by many test crates; each uses a part

use std::{
    io::{BufRead as _, BufReader, Read as _},
    path::Path,
    process::{Child, Command, ExitStatus, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::common::{
    LogLine, Proc, dynprof_bin, fixtures, log_lines_of, scratch_dir, wait_for_log_lines,
};

/// A running `dynprof attach --json`; killed on drop.
pub struct Dynprof {
    child: Child,
    lines: mpsc::Receiver<String>,
    stderr: mpsc::Receiver<String>,
    /// Every JSON line received so far, in order.
    pub events: Vec<Value>,
    /// Stdout lines that were not JSON (should be none).
    pub junk: Vec<String>,
    pub args: Vec<String>,
    /// Stderr lines consumed by `wait_stderr`.
    stderr_seen: Vec<String>,
}

/// What a finished `dynprof attach --json` left behind.
#[derive(Debug)]
pub struct Finished {
    pub status: ExitStatus,
    pub events: Vec<Value>,
    pub stderr: String,
}

impl Finished {
    pub fn of(&self, kind: &str) -> Vec<&Value> {
        self.events.iter().filter(|e| e["event"] == kind).collect()
    }
    pub fn attached(&self) -> &Value {
        self.of("attached")
            .first()
            .copied()
            .unwrap_or_else(|| panic!("no `attached` line; {self}"))
    }
    pub fn summary(&self) -> &Value {
        self.of("summary")
            .last()
            .copied()
            .unwrap_or_else(|| panic!("no `summary` line; {self}"))
    }
    /// (step, ts_ns) of every step event.
    pub fn steps(&self) -> Vec<(u64, u64)> {
        self.of("step")
            .iter()
            .map(|e| (e["step"].as_u64().unwrap(), e["ts_ns"].as_u64().unwrap()))
            .collect()
    }
    pub fn assert_success(&self) {
        assert!(self.status.success(), "dynprof failed: {self}");
    }
}

impl std::fmt::Display for Finished {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit {}; stderr:\n{}\nstdout:", self.status, self.stderr)?;
        for e in &self.events {
            write!(f, "\n{e}")?;
        }
        Ok(())
    }
}

fn pump<R: std::io::Read + Send + 'static>(r: R) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

impl Dynprof {
    /// Starts `dynprof attach --pid PID --json ARGS...`.
    pub fn attach(pid: u32, args: &[&str]) -> Dynprof {
        let mut all: Vec<String> = vec![
            "attach".into(),
            "--pid".into(),
            pid.to_string(),
            "--json".into(),
        ];
        all.extend(args.iter().map(|s| s.to_string()));
        Self::spawn(Command::new(dynprof_bin()).args(&all), all)
    }

    pub fn spawn(cmd: &mut Command, args: Vec<String>) -> Dynprof {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning dynprof: {e}"));
        let lines = pump(child.stdout.take().unwrap());
        let stderr = pump(child.stderr.take().unwrap());
        Dynprof {
            child,
            lines,
            stderr,
            events: Vec::new(),
            junk: Vec::new(),
            args,
            stderr_seen: Vec::new(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn push(&mut self, line: String) -> Option<Value> {
        match serde_json::from_str::<Value>(&line) {
            Ok(v) => {
                self.events.push(v.clone());
                Some(v)
            }
            Err(_) => {
                self.junk.push(line);
                None
            }
        }
    }

    fn stderr_so_far(&mut self) -> String {
        let rest: Vec<String> = self.stderr.try_iter().collect();
        self.stderr_seen.extend(rest);
        self.stderr_seen.join("\n")
    }

    /// Waits for a stderr line containing `needle` (live mode) and returns it.
    pub fn wait_stderr(&mut self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stderr.recv_timeout(left) {
                Ok(line) => {
                    self.stderr_seen.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(e) => {
                    let st = self.child.try_wait().ok().flatten();
                    panic!(
                        "dynprof {:?}: no stderr line with {needle:?} ({e:?}; exit status {st:?}); stderr:\n{}",
                        self.args,
                        self.stderr_seen.join("\n")
                    );
                }
            }
        }
    }

    /// Waits for the next JSON event of `kind` (earlier ones are kept in
    /// `events`). Panics with dynprof's output if it exits or `timeout` passes.
    pub fn wait_event(&mut self, kind: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(v) = self.push(line)
                        && v["event"] == kind
                    {
                        return v;
                    }
                }
                Err(e) => {
                    let st = self.child.try_wait().ok().flatten();
                    let stderr = self.stderr_so_far();
                    panic!(
                        "dynprof {:?}: no `{kind}` event ({e:?}; exit status {st:?}); events so far: {:?}\nstderr:\n{stderr}",
                        self.args, self.events
                    );
                }
            }
        }
    }

    /// Sends a signal to dynprof.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own unreaped child.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    /// Waits (up to `timeout`, then kills it) for dynprof to exit and
    /// collects the rest of its output.
    pub fn finish(mut self, timeout: Duration) -> Finished {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                break st;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let st = self.child.wait().unwrap();
                let rest: Vec<String> = self.lines.try_iter().collect();
                let stderr = self.stderr_so_far();
                panic!(
                    "dynprof {:?} did not exit within {timeout:?} (killed: {st}); events: {:?} {rest:?}\nstderr:\n{stderr}",
                    self.args, self.events
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        // The pump threads end at EOF, which follows the exit.
        for line in std::mem::replace(&mut self.lines, mpsc::channel().1).iter() {
            self.push(line);
        }
        let rest: Vec<String> = std::mem::replace(&mut self.stderr, mpsc::channel().1)
            .iter()
            .collect();
        self.stderr_seen.extend(rest);
        let stderr = self.stderr_seen.join("\n");
        assert!(
            self.junk.is_empty(),
            "non-JSON stdout lines with --json: {:?}",
            self.junk
        );
        Finished {
            status,
            events: std::mem::take(&mut self.events),
            stderr,
        }
    }
}

impl Drop for Dynprof {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `dynprof attach --pid PID --json ARGS...` to completion.
pub fn run_attach(pid: u32, args: &[&str], timeout: Duration) -> Finished {
    Dynprof::attach(pid, args).finish(timeout)
}

/// Runs dynprof with arbitrary arguments (no --json added) and returns
/// (status, stdout, stderr).
pub fn run_dynprof(cmd: &mut Command) -> (ExitStatus, String, String) {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning dynprof");
    let mut out = String::new();
    let mut err = String::new();
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = se.read_to_string(&mut s);
        s
    });
    let _ = so.read_to_string(&mut out);
    err.push_str(&t.join().unwrap());
    let st = child.wait().unwrap();
    (st, out, err)
}

/// Polls the fixture log until some `kind` line ends at or after `ts` (the
/// call holding the last event has been logged); returns all `kind` lines.
pub fn wait_log_covering(path: &Path, kind: &str, ts: u64, timeout: Duration) -> Vec<LogLine> {
    let deadline = Instant::now() + timeout;
    loop {
        let lines = log_lines_of(path, kind);
        if lines.last().is_some_and(|l| l.after >= ts) {
            return lines;
        }
        if Instant::now() >= deadline {
            panic!(
                "{}: no `{kind}` line ends after ts {ts} within {timeout:?}; last: {:?}",
                path.display(),
                lines.last()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Each step event must fall inside exactly one logged call's own
/// [before, after] interval, events must be numbered 1, 2, 3..., and the
/// matched calls must be consecutive: every call between the first and the
/// last matched one has exactly one event. Returns the matched call indices
/// (positions in `calls`).
pub fn check_steps_match_calls(steps: &[(u64, u64)], calls: &[LogLine], what: &str) -> Vec<usize> {
    assert!(!steps.is_empty(), "{what}: no step events");
    let mut matched = Vec::new();
    for (n, &(k, ts)) in steps.iter().enumerate() {
        assert_eq!(
            k,
            n as u64 + 1,
            "{what}: step events must be numbered 1, 2, ...: {steps:?}"
        );
        let hits: Vec<usize> = calls
            .iter()
            .enumerate()
            .filter(|(_, c)| c.before <= ts && ts <= c.after)
            .map(|(i, _)| i)
            .collect();
        assert!(
            hits.len() == 1,
            "{what}: step event {k} at {ts} lies in {} logged calls (want exactly 1); neighbours: {:?}",
            hits.len(),
            calls
                .iter()
                .filter(|c| c.after + 200_000_000 >= ts && c.before <= ts + 200_000_000)
                .collect::<Vec<_>>()
        );
        matched.push(hits[0]);
    }
    for w in matched.windows(2) {
        assert!(
            w[1] == w[0] + 1,
            "{what}: calls {}..{} matched events {} then {}: a call got no event or two events (matched {matched:?})",
            calls[w[0]].index,
            calls[w[1]].index,
            w[0],
            w[1]
        );
    }
    matched
}

/// No event may fall inside any of `calls` (e.g. filtered-out zero_grad calls).
pub fn check_no_event_in(steps: &[(u64, u64)], calls: &[LogLine], what: &str) {
    for &(k, ts) in steps {
        if let Some(c) = calls.iter().find(|c| c.before <= ts && ts <= c.after) {
            panic!("{what}: step event {k} at {ts} fell inside {c:?}");
        }
    }
}

/// The summary's aux hits per step for `label`.
pub fn aux_per_step(summary: &Value, label: &str) -> f64 {
    summary["aux_per_step"][label]
        .as_f64()
        .unwrap_or_else(|| panic!("summary has no aux_per_step[{label}]: {summary}"))
}

/// Reads a u16 (a USDT semaphore) from another process's memory.
pub fn read_u16(pid: u32, addr: u64) -> u16 {
    use std::os::unix::fs::FileExt as _;
    let f = std::fs::File::open(format!("/proc/{pid}/mem")).expect("opening /proc/PID/mem");
    let mut b = [0u8; 2];
    f.read_exact_at(&mut b, addr)
        .expect("reading /proc/PID/mem");
    u16::from_le_bytes(b)
}

// ---------------------------------------------------------------- PyTorch

pub const TORCH_STEPS: usize = 12;

/// Starts torch_train.py with `args`, waits for `ready` and the first logged
/// step, attaches with `--marker auto --steps TORCH_STEPS`, checks every event
/// against the log and returns (run, log path).
pub fn torch_auto(
    mut python: std::process::Command,
    tag: &str,
    args: &[&str],
    timeout: Duration,
) -> (Finished, std::path::PathBuf) {
    let fx = fixtures();
    let log = scratch_dir(tag).join("steps.log");
    let p = Proc::spawn_ready(
        python
            .arg(&fx.torch_train_py)
            .args(["--steps", "0"])
            .args(args)
            .arg("--log")
            .arg(&log),
    );
    wait_for_log_lines(&log, "step", 1, timeout);
    let run = run_attach(
        p.pid,
        &["--marker", "auto", "--steps", &TORCH_STEPS.to_string()],
        timeout,
    );
    run.assert_success();
    let steps = run.steps();
    assert_eq!(steps.len(), TORCH_STEPS, "{run}");
    let calls = wait_log_covering(&log, "step", steps.last().unwrap().1, timeout);
    let m = check_steps_match_calls(&steps, &calls, &format!("torch_train.py {args:?}"));
    // Backward passes never count as steps.
    check_no_event_in(&steps, &log_lines_of(&log, "backward"), "backward calls");

    let markers = run.attached()["markers"].as_array().unwrap().clone();
    let step_markers: Vec<_> = markers.iter().filter(|m| m["role"] == "step").collect();
    assert_eq!(
        step_markers.len(),
        1,
        "auto takes one step marker: {markers:?}"
    );
    assert!(
        step_markers[0]["object"]
            .as_str()
            .unwrap()
            .contains("libtorch_cpu"),
        "{markers:?}"
    );
    assert!(
        markers
            .iter()
            .any(|m| m["role"] == "aux" && m["label"] == "backward"),
        "{markers:?}"
    );
    for e in run.of("step") {
        assert_eq!(e["marker"], "Optimizer.step");
        assert_eq!(e["host_pid"], p.pid);
    }
    let sum = run.summary();
    assert_eq!(sum["steps"], TORCH_STEPS as u64);
    assert_eq!(sum["completed_steps"], TORCH_STEPS as u64 - 1);
    assert_eq!(sum["drops"]["step"], 0);
    let _ = m;
    eprintln!(
        "{tag}: step marker {} ({}), p50 {} ms",
        step_markers[0]["symbol"], step_markers[0]["object"], sum["p50_ms"]
    );
    (run, log)
}
