//! Helpers for the container tests (`#[path = "containers_util.rs"] mod containers_util;`):
//! trainers in real PID / mount namespaces made with `unshare`, process-tree
//! walks, fake-but-real container cgroups, and a blocking `dynprof attach --json`.
#![allow(dead_code, unreachable_pub)] // shared by many test crates; each uses a part

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::common::{Proc, dynprof_bin, fixtures, log_lines_of, try_wait_for_log_lines};

/// Direct children of a process (from /proc/PID/task/PID/children).
pub fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

pub fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// The chain of first children below `pid` (pid itself first), down to a leaf.
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut out = vec![pid];
    let mut cur = pid;
    while let Some(&c) = children(cur).first() {
        out.push(c);
        cur = c;
    }
    out
}

/// The first process named `name` in the first-child chain below `pid`.
pub fn find_below(pid: u32, name: &str) -> u32 {
    let chain = descendants(pid);
    *chain.iter().find(|p| comm(**p) == name).unwrap_or_else(|| {
        panic!(
            "no `{name}` below {pid}: {:?}",
            chain.iter().map(|p| (p, comm(*p))).collect::<Vec<_>>()
        )
    })
}

pub fn nspid(pid: u32) -> Vec<u32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect()
}

pub fn pidns_of(pid: u32) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/pid"))
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

/// `unshare` arguments for one new PID namespace with its own /proc; the
/// namespace dies with the unshare process.
pub const PIDNS: &[&str] = &["--pid", "--fork", "--kill-child", "--mount-proc"];

pub fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// A trainer `levels` PID namespaces deep, started as
/// `unshare ... [unshare ...] sh -c 'trainer ARGS & wait'`, so that in the
/// innermost namespace sh is PID 1 and the trainer PID 2.
pub struct NsTrainer {
    pub proc: Proc,
    /// Host PIDs: [outer unshare, (inner unshares...), sh, trainer].
    pub chain: Vec<u32>,
    pub log: PathBuf,
}

impl NsTrainer {
    pub fn start(levels: usize, log: &Path, extra: &[&str]) -> NsTrainer {
        let fx = fixtures();
        let mut cmd = Command::new("unshare");
        cmd.args(PIDNS);
        for _ in 1..levels {
            cmd.arg("unshare").args(PIDNS);
        }
        let mut inner = format!(
            "{} --log {} --step-ms 20",
            sh_quote(&fx.trainer.to_string_lossy()),
            sh_quote(&log.to_string_lossy())
        );
        for e in extra {
            inner.push(' ');
            inner.push_str(&sh_quote(e));
        }
        cmd.args(["sh", "-c", &format!("{inner} & wait")]);
        let proc = Proc::spawn_ready(&mut cmd);
        assert_eq!(
            proc.pid, 2,
            "the trainer is PID 2 in its namespace (after sh)"
        );
        let chain = descendants(proc.host_pid());
        assert_eq!(
            chain.len(),
            levels + 2,
            "unshare x{levels}, sh, trainer: {chain:?}"
        );
        assert_eq!(comm(*chain.last().unwrap()), "trainer");
        NsTrainer {
            proc,
            chain,
            log: log.to_path_buf(),
        }
    }

    pub fn trainer(&self) -> u32 {
        *self.chain.last().unwrap()
    }

    pub fn sh(&self) -> u32 {
        self.chain[self.chain.len() - 2]
    }
}

/// What a finished `dynprof` run printed.
#[derive(Debug)]
pub struct Run {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
    pub events: Vec<Value>,
}

impl Run {
    pub fn of(&self, kind: &str) -> Vec<&Value> {
        self.events.iter().filter(|e| e["event"] == kind).collect()
    }
    pub fn attached(&self) -> &Value {
        self.of("attached")
            .first()
            .copied()
            .unwrap_or_else(|| panic!("no `attached` line: {self:#?}"))
    }
    pub fn step_ts(&self) -> Vec<u64> {
        self.of("step")
            .iter()
            .map(|e| e["ts_ns"].as_u64().unwrap())
            .collect()
    }
}

/// Runs dynprof to completion with ARGS (a 60 s `--duration` guards attach runs).
pub fn dynprof(args: &[&str]) -> Run {
    let mut all: Vec<&str> = args.to_vec();
    if args.first() == Some(&"attach") && !args.contains(&"--duration") {
        all.extend(["--duration", "60"]);
    }
    let out = Command::new(dynprof_bin())
        .args(&all)
        .output()
        .expect("running dynprof");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let events = stdout
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    Run {
        ok: out.status.success(),
        stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        events,
    }
}

/// `dynprof attach --pid PID --json --steps N ARGS...`, which must succeed.
pub fn attach_ok(pid: &str, steps: u64, args: &[&str]) -> Run {
    let steps = steps.to_string();
    let mut all = vec!["attach", "--pid", pid, "--json", "--steps", &steps];
    all.extend(args);
    let r = dynprof(&all);
    assert!(r.ok, "dynprof {all:?} failed: {r:#?}");
    r
}

/// Every step timestamp falls inside one of the log's `kind` intervals
/// (waits until the log covers the last one).
pub fn assert_steps_in_log(run: &Run, log: &Path, kind: &str, min_steps: usize) {
    let ts = run.step_ts();
    assert!(ts.len() >= min_steps, "want >= {min_steps} steps: {run:#?}");
    let last = *ts.iter().max().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let lines = log_lines_of(log, kind);
        if lines.last().is_some_and(|l| l.after >= last) || Instant::now() > deadline {
            break;
        }
        try_wait_for_log_lines(log, kind, lines.len() + 1, Duration::from_secs(5));
    }
    let lines = log_lines_of(log, kind);
    for t in ts {
        assert!(
            lines.iter().any(|l| l.before <= t && t <= l.after),
            "step at {t} is inside no `{kind}` interval of {}",
            log.display()
        );
    }
}

/// A cgroup directory we created (rmdir'ed on drop, once its processes are gone).
pub struct Cgroup {
    pub dir: PathBuf,
    parent: Option<PathBuf>,
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::remove_dir(&self.dir).is_err()
            && Instant::now() < deadline
            && self.dir.exists()
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(p) = &self.parent {
            let _ = std::fs::remove_dir(p);
        }
    }
}

/// Creates `<hierarchy>/dynprof-test-<pid>-<tag>/<leaf>` in the first
/// writable cgroup hierarchy (v2 at /sys/fs/cgroup, else a v1 or hybrid one).
/// None when no hierarchy is writable.
pub fn make_cgroup(tag: &str, leaf: &str) -> Option<Cgroup> {
    let roots = [
        "/sys/fs/cgroup",
        "/sys/fs/cgroup/unified",
        "/sys/fs/cgroup/pids",
        "/sys/fs/cgroup/systemd",
    ];
    for r in roots {
        let r = Path::new(r);
        if !r.join("cgroup.procs").exists() {
            continue;
        }
        let parent = r.join(format!("dynprof-test-{}-{tag}", std::process::id()));
        if std::fs::create_dir_all(&parent).is_err() {
            continue;
        }
        let dir = parent.join(leaf);
        if std::fs::create_dir(&dir).is_ok() {
            return Some(Cgroup {
                dir,
                parent: Some(parent),
            });
        }
        let _ = std::fs::remove_dir(&parent);
    }
    None
}
