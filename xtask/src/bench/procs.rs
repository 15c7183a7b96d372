//! Child processes driven line by line (stdout and stderr read on threads),
//! and what /proc says about a process's CPU time and memory.

use std::{
    io::{BufRead, BufReader, Write},
    path::Path,
    process::{Child, ChildStdin, Command, ExitStatus, Stdio},
    sync::mpsc::{Receiver, RecvTimeoutError, channel},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};

use super::json::{self, Json};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    Out,
    Err,
}

#[derive(Clone, Debug)]
pub struct Line {
    pub at: Instant,
    pub stream: Stream,
    pub text: String,
}

impl Line {
    pub fn json(&self) -> Option<Json> {
        if self.stream == Stream::Out && self.text.starts_with('{') {
            json::parse(&self.text)
        } else {
            None
        }
    }
}

pub struct Proc {
    pub name: String,
    pub child: Child,
    pub started: Instant,
    stdin: Option<ChildStdin>,
    rx: Receiver<Line>,
    /// Every line read so far, in order (stdout and stderr).
    pub seen: Vec<Line>,
    cursor: usize,
    pub exit: Option<ExitStatus>,
}

pub fn monotonic_ns() -> u64 {
    let mut ts = libc_timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { clock_gettime(1, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[repr(C)]
struct libc_timespec {
    tv_sec: i64,
    tv_nsec: i64,
}
unsafe extern "C" {
    fn clock_gettime(clk: i32, ts: *mut libc_timespec) -> i32;
    fn kill(pid: i32, sig: i32) -> i32;
}

pub const SIGINT: i32 = 2;
pub const SIGKILL: i32 = 9;

impl Proc {
    pub fn spawn(name: &str, cmd: &mut Command) -> Result<Proc> {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let shown = crate::util::display(cmd);
        let started = Instant::now();
        let mut child = cmd.spawn().with_context(|| format!("starting `{shown}`"))?;
        let (tx, rx) = channel();
        let out = child.stdout.take().expect("piped");
        let err = child.stderr.take().expect("piped");
        for (stream, r) in [
            (Stream::Out, Box::new(out) as Box<dyn std::io::Read + Send>),
            (Stream::Err, Box::new(err)),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(r).lines() {
                    let Ok(text) = line else { break };
                    let l = Line {
                        at: Instant::now(),
                        stream,
                        text,
                    };
                    if tx.send(l).is_err() {
                        break;
                    }
                }
            });
        }
        let stdin = child.stdin.take();
        Ok(Proc {
            name: name.to_string(),
            child,
            started,
            stdin,
            rx,
            seen: Vec::new(),
            cursor: 0,
            exit: None,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the next unread line matching `pred`; lines skipped on the
    /// way stay in `seen`.
    pub fn wait_for(
        &mut self,
        timeout: Duration,
        mut pred: impl FnMut(&Line) -> bool,
    ) -> Result<Line> {
        let deadline = Instant::now() + timeout;
        loop {
            while self.cursor < self.seen.len() {
                let l = &self.seen[self.cursor];
                self.cursor += 1;
                if pred(l) {
                    return Ok(l.clone());
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(l) => self.seen.push(l),
                Err(RecvTimeoutError::Timeout) => bail!(
                    "{}: timed out after {:?}{}",
                    self.name,
                    timeout,
                    self.tail()
                ),
                Err(RecvTimeoutError::Disconnected) => {
                    let st = self.child.wait().ok();
                    bail!(
                        "{}: exited ({:?}) before the expected line{}",
                        self.name,
                        st,
                        self.tail()
                    )
                }
            }
        }
    }

    /// Waits for a stdout line starting with `prefix`.
    pub fn wait_prefix(&mut self, timeout: Duration, prefix: &str) -> Result<Line> {
        self.wait_for(timeout, |l| {
            l.stream == Stream::Out && l.text.starts_with(prefix)
        })
    }

    /// Waits for a JSON stdout line with `"event": event`.
    pub fn wait_event(&mut self, timeout: Duration, event: &str) -> Result<(Line, Json)> {
        let mut found = None;
        self.wait_for(timeout, |l| match l.json() {
            Some(j) if j.str("event") == Some(event) => {
                found = Some(j);
                true
            }
            _ => false,
        })
        .map(|l| (l, found.expect("set with the match")))
    }

    /// Reads whatever arrived, without waiting.
    pub fn pump(&mut self) {
        while let Ok(l) = self.rx.try_recv() {
            self.seen.push(l);
        }
    }

    fn tail(&self) -> String {
        let mut t: Vec<&str> = self
            .seen
            .iter()
            .rev()
            .take(6)
            .map(|l| l.text.as_str())
            .collect();
        t.reverse();
        if t.is_empty() {
            String::new()
        } else {
            format!("; last output: {}", t.join(" | "))
        }
    }

    pub fn send(&mut self, line: &str) -> Result<()> {
        let s = self
            .stdin
            .as_mut()
            .ok_or_else(|| anyhow!("{}: stdin closed", self.name))?;
        writeln!(s, "{line}")
            .and_then(|_| s.flush())
            .with_context(|| format!("{}: writing `{line}`", self.name))
    }

    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    pub fn signal(&self, sig: i32) {
        if self.exit.is_none() {
            unsafe { kill(self.child.id() as i32, sig) };
        }
    }

    /// Waits for exit, reading output; kills it after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        if let Some(s) = self.exit {
            return Ok(s);
        }
        let deadline = Instant::now() + timeout;
        loop {
            self.pump();
            if let Some(s) = self.child.try_wait()? {
                // Let the reader threads finish.
                while let Ok(l) = self.rx.recv_timeout(Duration::from_millis(200)) {
                    self.seen.push(l);
                }
                self.exit = Some(s);
                return Ok(s);
            }
            if Instant::now() >= deadline {
                self.signal(SIGKILL);
                let s = self.child.wait()?;
                self.exit = Some(s);
                bail!(
                    "{}: did not exit within {:?}; killed{}",
                    self.name,
                    timeout,
                    self.tail()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGINT, then wait (SIGKILL after `timeout`).
    pub fn stop(&mut self, timeout: Duration) -> Result<ExitStatus> {
        self.signal(SIGINT);
        self.wait_exit(timeout)
    }

    /// All JSON stdout lines with `"event": event` read so far.
    pub fn events(&self, event: &str) -> Vec<(Line, Json)> {
        self.seen
            .iter()
            .filter_map(|l| {
                l.json()
                    .filter(|j| j.str("event") == Some(event))
                    .map(|j| (l.clone(), j))
            })
            .collect()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.exit.is_none() && matches!(self.child.try_wait(), Ok(None)) {
            self.signal(SIGKILL);
            let _ = self.child.wait();
        }
    }
}

/// CPU time of all threads of `pid` in ns (sum of /proc/PID/task/*/schedstat),
/// falling back to utime+stime of /proc/PID/stat at tick resolution.
pub fn cpu_ns(pid: u32) -> Option<u64> {
    let mut total = 0u64;
    let mut any = false;
    if let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for e in rd.flatten() {
            if let Ok(s) = std::fs::read_to_string(e.path().join("schedstat"))
                && let Some(v) = s
                    .split_whitespace()
                    .next()
                    .and_then(|v| v.parse::<u64>().ok())
            {
                total += v;
                any = true;
            }
        }
    }
    if any {
        return Some(total);
    }
    stat_cpu_ticks(pid).map(|t| t * 10_000_000)
}

/// utime+stime from /proc/PID/stat, in clock ticks (100 Hz on Linux).
pub fn stat_cpu_ticks(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // fields 14 and 15 of stat(5), counted from `state` (field 3).
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// cutime+cstime of this process (fields 16 and 17 of stat(5)): the CPU
/// of every child it has waited for, in clock ticks (100 Hz). The
/// difference across one child's run is that child's CPU, threads that
/// exited before it included.
pub fn waited_children_cpu_ticks() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/stat").ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(13)?.parse::<u64>().ok()? + f.get(14)?.parse::<u64>().ok()?)
}

/// A field of /proc/PID/status in kB (VmHWM, VmRSS).
pub fn status_kb(pid: u32, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

pub fn read_trimmed(p: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

/// `BPF_PROG_TYPE_PERF_EVENT` in a program fd's fdinfo: dynprof's only
/// program of that type is the cpu sampler.
pub const PROG_TYPE_PERF_EVENT: &str = "7";
/// `BPF_PROG_TYPE_KPROBE`: uprobe programs (dynprof's markers, the api
/// programs, the bench's empty probes).
pub const PROG_TYPE_KPROBE: &str = "2";
/// `BPF_PROG_TYPE_TRACEPOINT`: dynprof's only one is the off-CPU
/// collector's sched_switch program.
pub const PROG_TYPE_TRACEPOINT: &str = "5";

/// The kernel's total run time (ns) and run count of `pid`'s BPF programs
/// of `prog_type`, from its fds' fdinfo (with `kernel.bpf_stats_enabled`).
pub fn bpf_prog_stats(pid: u32, prog_type: &str) -> Option<(u64, u64)> {
    let mut found = None;
    for e in std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .ok()?
        .flatten()
    {
        let Ok(text) = std::fs::read_to_string(e.path()) else {
            continue;
        };
        let field = |k: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(k)?.strip_prefix(':'))
                .map(str::trim)
        };
        if field("prog_type") != Some(prog_type) {
            continue;
        }
        let (Some(t), Some(n)) = (
            field("run_time_ns").and_then(|v| v.parse::<u64>().ok()),
            field("run_cnt").and_then(|v| v.parse::<u64>().ok()),
        ) else {
            continue;
        };
        let (t0, n0) = found.unwrap_or((0, 0));
        found = Some((t0 + t, n0 + n));
    }
    found
}

/// Turns the kernel's BPF run-time statistics on while alive, and back to
/// what they were after.
pub struct BpfStats(Option<String>);

impl BpfStats {
    const PATH: &str = "/proc/sys/kernel/bpf_stats_enabled";
    pub fn on(section: &str) -> Self {
        let old = std::fs::read_to_string(Self::PATH).ok();
        if std::fs::write(Self::PATH, "1").is_err() {
            super::say(format!(
                "{section}: could not turn kernel.bpf_stats_enabled on; no BPF run times"
            ));
        }
        Self(old)
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        if let Some(v) = &self.0 {
            let _ = std::fs::write(Self::PATH, v.trim());
        }
    }
}
