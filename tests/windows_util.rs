//! Helpers for the window and trigger tests
//! (`#[path = "windows_util.rs"] mod windows_util;`): run dynprof, follow
//! its output line by line, read PROF_* directories back.
#![allow(dead_code, unreachable_pub)] // shared by many test crates; each uses a part

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, ExitStatus, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::common::{LogLine, dynprof_bin};

pub const T: Duration = Duration::from_secs(120);

/// A running dynprof whose stdout and stderr are followed line by line;
/// killed on drop.
pub struct Running {
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    rx: mpsc::Receiver<(bool, String)>,
    /// Everything read so far: (is_stderr, line).
    pub lines: Vec<(bool, String)>,
    pub args: Vec<String>,
}

pub fn dynprof_cmd(args: &[&str]) -> Command {
    let mut c = Command::new(dynprof_bin());
    c.args(args);
    c.env("RUST_LOG", "warn");
    c
}

pub fn spawn(args: &[&str], piped_stdin: bool) -> Running {
    let mut c = dynprof_cmd(args);
    spawn_cmd(
        &mut c,
        piped_stdin,
        args.iter().map(|s| s.to_string()).collect(),
    )
}

pub fn spawn_cmd(c: &mut Command, piped_stdin: bool, args: Vec<String>) -> Running {
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    c.stdin(if piped_stdin {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    let mut child = c.spawn().expect("spawning dynprof");
    let (tx, rx) = mpsc::channel();
    let out = child.stdout.take().unwrap();
    let err = child.stderr.take().unwrap();
    let tx2 = tx.clone();
    std::thread::spawn(move || follow(out, false, tx));
    std::thread::spawn(move || follow(err, true, tx2));
    let stdin = child.stdin.take();
    Running {
        child,
        stdin,
        rx,
        lines: Vec::new(),
        args,
    }
}

/// Forwards `r` line by line. A console prompt is an unfinished line that
/// the program waits on: it is forwarded as soon as it is drawn, so that a
/// test can type only once the console is reading.
fn follow(mut r: impl std::io::Read, is_err: bool, tx: mpsc::Sender<(bool, String)>) {
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = match r.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        pending.extend_from_slice(&buf[..n]);
        while let Some(nl) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line[..nl])
                .trim_end_matches('\r')
                .to_string();
            if tx.send((is_err, line)).is_err() {
                return;
            }
        }
        if String::from_utf8_lossy(&pending).contains("dynprof> ") {
            let _ = tx.send((is_err, String::from_utf8_lossy(&pending).to_string()));
            pending.clear();
        }
    }
    if !pending.is_empty() {
        let _ = tx.send((is_err, String::from_utf8_lossy(&pending).to_string()));
    }
}

impl Running {
    fn pump(&mut self, until: Instant) -> bool {
        let now = Instant::now();
        if now >= until {
            return false;
        }
        match self.rx.recv_timeout(until - now) {
            Ok(l) => {
                self.lines.push(l);
                true
            }
            Err(_) => false,
        }
    }

    /// Waits for a line (stdout or stderr) containing `needle`, searching
    /// from line index `from`; returns its index.
    pub fn wait_for_from(&mut self, from: usize, needle: &str, timeout: Duration) -> usize {
        let until = Instant::now() + timeout;
        let mut i = from;
        loop {
            while i < self.lines.len() {
                if self.lines[i].1.contains(needle) {
                    return i;
                }
                i += 1;
            }
            if !self.pump(until) {
                panic!(
                    "no line containing {needle:?} within {timeout:?}; dynprof {:?} said:\n{}",
                    self.args,
                    self.transcript()
                );
            }
        }
    }

    pub fn wait_for(&mut self, needle: &str, timeout: Duration) -> usize {
        self.wait_for_from(0, needle, timeout)
    }

    /// One line to a piped console, newline added.
    pub fn send(&mut self, line: &str) {
        self.type_keys(&format!("{line}\n"));
    }

    /// Writes `keys` exactly, in one write, as a terminal sends what is
    /// typed: Enter is `\r`, and no newline is added (through a pty in raw
    /// mode a `\n` would be one more key, Ctrl-J).
    pub fn type_keys(&mut self, keys: &str) {
        let s = self.stdin.as_mut().expect("stdin piped");
        s.write_all(keys.as_bytes())
            .expect("writing to dynprof's stdin");
        s.flush().unwrap();
    }

    pub fn close_stdin(&mut self) {
        self.stdin.take();
    }

    /// Waits for the exit, collecting the rest of the output.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let until = Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                // Drain what is left.
                while self.pump(Instant::now() + Duration::from_millis(500)) {}
                return st;
            }
            if Instant::now() >= until {
                panic!(
                    "dynprof {:?} did not exit within {timeout:?}:\n{}",
                    self.args,
                    self.transcript()
                );
            }
            self.pump(Instant::now() + Duration::from_millis(20).min(until - Instant::now()));
        }
    }

    pub fn transcript(&self) -> String {
        self.lines
            .iter()
            .map(|(e, l)| format!("{} {l}\n", if *e { "E|" } else { "O|" }))
            .collect()
    }

    pub fn stdout_json(&self) -> Vec<Value> {
        self.lines
            .iter()
            .filter(|(e, _)| !e)
            .filter_map(|(_, l)| serde_json::from_str(l).ok())
            .collect()
    }

    /// (step, ts_ns) of the `--json` step lines.
    pub fn json_steps(&self) -> Vec<(u64, u64)> {
        self.stdout_json()
            .iter()
            .filter(|v| v["event"] == "step")
            .map(|v| (v["step"].as_u64().unwrap(), v["ts_ns"].as_u64().unwrap()))
            .collect()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits for a `dynprof attach` that must succeed, and returns its `n`
/// finished `PROF_*` directories (exactly `n`).
pub fn finished_windows(d: &mut Running, out: &Path, n: usize) -> Vec<PathBuf> {
    let st = d.wait_exit(T);
    assert!(st.success(), "{}", d.transcript());
    let dirs = prof_dirs(out);
    assert_eq!(dirs.len(), n, "{dirs:?}\n{}", d.transcript());
    dirs
}

/// Finished `PROF_*` directories in `out`, by window number.
pub fn prof_dirs(out: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(out)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.is_dir()
                        && p.file_name()
                            .unwrap()
                            .to_str()
                            .unwrap()
                            .starts_with("PROF_")
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort_by_key(|p| window_number(p));
    v
}

/// Hidden directories still being written.
pub fn tmp_dirs(out: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(out)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .unwrap()
                        .to_str()
                        .unwrap()
                        .starts_with(".PROF_")
                })
                .collect()
        })
        .unwrap_or_default()
}

pub fn window_number(p: &Path) -> u32 {
    p.file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .rsplit('_')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// Polls until `out` holds at least `n` finished windows.
pub fn wait_prof_dirs(out: &Path, n: usize, timeout: Duration) -> Vec<PathBuf> {
    let until = Instant::now() + timeout;
    loop {
        let v = prof_dirs(out);
        if v.len() >= n {
            return v;
        }
        assert!(
            Instant::now() < until,
            "{}: wanted {n} PROF_* dirs within {timeout:?}, have {v:?}",
            out.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for `d` to exit successfully with exactly `n` windows in `out`,
/// each complete: their directories and meta.json.
pub fn complete_windows(d: &mut Running, out: &Path, n: usize) -> Vec<(PathBuf, Value)> {
    let st = d.wait_exit(T);
    assert!(st.success(), "{}", d.transcript());
    let dirs = prof_dirs(out);
    assert_eq!(dirs.len(), n, "{}", d.transcript());
    dirs.into_iter()
        .map(|dir| {
            let m = meta(&dir);
            assert_eq!(m["complete"], true, "{m:#}");
            (dir, m)
        })
        .collect()
}

pub fn meta(dir: &Path) -> Value {
    let t = std::fs::read_to_string(dir.join("meta.json"))
        .unwrap_or_else(|e| panic!("{}/meta.json: {e}", dir.display()));
    serde_json::from_str(&t).unwrap()
}

/// steps.csv rows: (step, start_ts_ns, end_ts_ns, duration_ns).
pub fn steps_csv(dir: &Path) -> Vec<(u64, u64, u64, u64)> {
    let t = std::fs::read_to_string(dir.join("steps.csv")).unwrap();
    let mut lines = t.lines();
    let header = lines.next().unwrap();
    assert!(
        header.starts_with("step,start_ts_ns,end_ts_ns,duration_ns"),
        "{header}"
    );
    lines
        .map(|l| {
            let f: Vec<u64> = l.split(',').take(4).map(|x| x.parse().unwrap()).collect();
            (f[0], f[1], f[2], f[3])
        })
        .collect()
}

/// Index of the log line whose [before, after] contains `ts`.
pub fn call_containing(calls: &[LogLine], ts: u64) -> Option<usize> {
    calls.iter().position(|c| c.before <= ts && ts <= c.after)
}

/// Recorded steps of a window as numbers.
pub fn recorded(m: &Value) -> Vec<u64> {
    m["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["step"].as_u64().unwrap())
        .collect()
}

/// Boundary ts of hit `k` from meta.json.
pub fn boundary(m: &Value, k: u64) -> u64 {
    m["boundaries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["step"] == k)
        .unwrap_or_else(|| panic!("no boundary {k} in {m}"))["ts_ns"]
        .as_u64()
        .unwrap()
}

/// `attach --pid PID --marker exe:optimizer_step ARGS…`: dynprof on one of
/// the fixture trainers, whose step function is `optimizer_step`.
pub fn attach_args<'a>(pid: &'a str, args: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["attach", "--pid", pid, "--marker", "exe:optimizer_step"];
    v.extend_from_slice(args);
    v
}
