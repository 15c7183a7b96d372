//! CPython 3.11 (without PyTorch, and on arm64 in the arm64 VM), 3.12,
//! 3.13 and 3.14 frames in cpu and offcpu windows, on real interpreters
//! (issue 15, docs/stacks.md): the hot-function-under-caller and
//! queue-wait checks of tests/python_frames.rs, with Debian trixie's
//! python3.13 and sid's python3.14 run from root filesystems that `cargo xtask setup` builds
//! under /var/cache/dynprof/python-rootfs (xtask/src/pyroots.rs), and the
//! machine image's pyenv CPython 3.12 (shared libpython, so the
//! interpreter's code and `_PyRuntime` are in `libpython3.12.so`) run on
//! the host.
//!
//! The interpreter runs as `unshare --mount --pid --fork chroot ROOT
//! python3.X py_hot.py`: a container-like target (own PID namespace, own
//! root) that dynprof attaches to from outside by host PID. So these also
//! check that the frames of a thread are found by the id the interpreter
//! knows it by (its PID namespace's), and that the ELF is read through
//! `/proc/PID/root`.
//!
//! Without the root filesystems the tests skip with a message, except
//! under CI (`CI` set), where they fail.

mod common;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use common::*;

const ROOTFS_DIR: &str = "/var/cache/dynprof/python-rootfs";
/// Written last by xtask/src/pyroots.rs.
const STAMP: &str = ".dynprof-rootfs-complete";

/// The root filesystem with python3.`minor`, or `None` (after saying so)
/// when a developer has not built it; under CI a missing one fails.
fn rootfs(minor: u8) -> Option<PathBuf> {
    let root = Path::new(ROOTFS_DIR).join(format!("python3.{minor}"));
    if root.join(STAMP).is_file() && root.join(format!("usr/bin/python3.{minor}")).is_file() {
        return Some(root);
    }
    let msg = format!(
        "no python3.{minor} root filesystem at {} (built by `cargo xtask setup`)",
        root.display()
    );
    if std::env::var_os("CI").is_some() {
        panic!("{msg}; required under CI");
    }
    eprintln!("SKIPPED: {msg}");
    None
}

/// The host PIDs of `pid`'s children.
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect()
}

/// The function name of a `[py] NAME (FILE:LINE)` frame.
fn py_fn(frame: &str) -> Option<&str> {
    let rest = frame.strip_prefix("[py] ")?;
    Some(rest.split_once(" (").map_or(rest, |(n, _)| n))
}

/// The line of a `[py] NAME (FILE:LINE)` frame.
fn py_line(frame: &str) -> Option<u32> {
    frame.strip_suffix(')')?.rsplit_once(':')?.1.parse().ok()
}

/// Lines `first..=last` of `def NAME` in `script` (its body runs to the
/// next blank line).
fn def_lines(script: &str, name: &str) -> (u32, u32) {
    let lines: Vec<&str> = script.lines().collect();
    let start = lines
        .iter()
        .position(|l| l.starts_with(&format!("def {name}(")))
        .unwrap_or_else(|| panic!("no def {name}"));
    let len = lines[start..]
        .iter()
        .position(|l| l.trim().is_empty())
        .unwrap();
    (start as u32 + 1, (start + len) as u32)
}

/// The pyenv CPython 3.12 of the machine image (`DYNPROF_PY312` names
/// another), or `None` after a LOUD skip line: no registry this project may
/// use ships a 3.12 (Debian has 3.11 and 3.13).
fn host_python312() -> Option<PathBuf> {
    let py = std::env::var_os("DYNPROF_PY312")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/root/.pyenv/versions/3.12.1/bin/python3.12".into());
    if py.is_file() {
        return Some(py);
    }
    eprintln!(
        "\n!!!!!!!! SKIPPED (no CPython 3.12 at {}; set DYNPROF_PY312): a python312 test !!!!!!!!\n",
        py.display()
    );
    None
}

/// Debian bookworm's own CPython 3.11 for the machine the test runs on:
/// the host's /usr/bin/python3.11 on x86-64; on arm64 (the arm64 VM), the
/// arm64 build that `cargo xtask setup` unpacks (xtask/src/pyroots.rs),
/// run in place with the tree's zlib and expat. Kunpeng hosts are arm64,
/// and 3.11's `_PyRuntime` layout differs there (a longer
/// `pthread_mutex_t`). Missing: a skip line, or a failure under CI.
fn debian_python311() -> Option<Interp> {
    let (py, libs) = if cfg!(target_arch = "aarch64") {
        let root = Path::new(ROOTFS_DIR).join("python3.11-arm64");
        (
            root.join("usr/bin/python3.11"),
            Some(format!(
                "{}:{}",
                root.join("lib/aarch64-linux-gnu").display(),
                root.join("usr/lib/aarch64-linux-gnu").display()
            )),
        )
    } else {
        (PathBuf::from("/usr/bin/python3.11"), None)
    };
    if py.is_file() {
        return Some(Interp::Host(11, py, libs));
    }
    let msg = format!(
        "no Debian CPython 3.11 at {} (cargo xtask setup)",
        py.display()
    );
    if std::env::var_os("CI").is_some() {
        panic!("{msg}; required under CI");
    }
    eprintln!("SKIPPED: {msg}");
    None
}

/// Where the interpreter comes from.
enum Interp {
    /// A Debian root filesystem's `/usr/bin/python3.MINOR`, chrooted in
    /// its own PID namespace.
    Rootfs(u8),
    /// An interpreter on the host, by path, with the `LD_LIBRARY_PATH`
    /// it needs (if any).
    Host(u8, PathBuf, Option<String>),
}

/// py_hot.py running under an interpreter, ready.
struct Job {
    /// Our child: the interpreter, or `unshare` above it.
    proc: Proc,
    /// The interpreter's host PID.
    python: u32,
    /// The script's copy inside a root filesystem, removed at the end.
    copy: Option<PathBuf>,
}

impl Job {
    /// Starts py_hot.py with `args` under `interp`; `None` when the
    /// interpreter is missing (after the skip line).
    fn start(interp: &Interp, args: &[&str]) -> Option<Job> {
        let fixture = workspace_root().join("tests/fixtures/py_hot.py");
        match interp {
            Interp::Host(_, py, libs) => {
                let mut cmd = Command::new(py);
                if let Some(l) = libs {
                    cmd.env("LD_LIBRARY_PATH", l);
                }
                let proc = Proc::spawn_ready(cmd.arg(&fixture).args(args));
                let python = proc.host_pid();
                Some(Job {
                    proc,
                    python,
                    copy: None,
                })
            }
            Interp::Rootfs(minor) => {
                let root = rootfs(*minor)?;
                // The script goes inside the root (the chrooted interpreter
                // sees only it), in a directory of this job's own: tests
                // of one version run in parallel, and each removes its
                // copy when it stops.
                static JOBS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
                let n = JOBS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let inside = PathBuf::from(format!(
                    "/tmp/dynprof-test-{}-{minor}-{n}",
                    std::process::id()
                ));
                let host_side = root.join(inside.strip_prefix("/").unwrap());
                std::fs::create_dir_all(&host_side).unwrap();
                std::fs::copy(&fixture, host_side.join("py_hot.py")).unwrap();
                let proc = Proc::spawn_ready(
                    Command::new("unshare")
                        .args(["--mount", "--pid", "--fork", "--kill-child", "chroot"])
                        .arg(&root)
                        .arg(format!("/usr/bin/python3.{minor}"))
                        .arg(inside.join("py_hot.py"))
                        .args(args),
                );
                assert_eq!(proc.pid, 1, "python is PID 1 of its own namespace");
                let kids = children(proc.host_pid());
                assert_eq!(kids.len(), 1, "unshare's one child: {kids:?}");
                let python = kids[0];
                let exe = std::fs::read_link(format!("/proc/{python}/exe")).unwrap();
                assert!(
                    exe.ends_with(format!("usr/bin/python3.{minor}")),
                    "{}",
                    exe.display()
                );
                Some(Job {
                    proc,
                    python,
                    copy: Some(host_side),
                })
            }
        }
    }

    /// Stops the interpreter with SIGTERM (its handler ends the loop) and
    /// checks that it exited cleanly. `unshare --fork` ignores SIGTERM
    /// while it waits for its child: the interpreter is stopped instead,
    /// and unshare exits with it.
    fn stop(mut self) {
        // SAFETY: kill(2) on a process of our own child's tree, still running.
        unsafe { libc::kill(self.python as i32, libc::SIGTERM) };
        let st = self.proc.child.wait().unwrap();
        assert!(st.success(), "the job: {st}");
        if let Some(copy) = self.copy.take() {
            let _ = std::fs::remove_dir_all(copy);
        }
    }
}

fn minor(interp: &Interp) -> u8 {
    match interp {
        Interp::Rootfs(m) | Interp::Host(m, ..) => *m,
    }
}

fn hot_function_under_its_caller(interp: Interp) {
    hot_function_with(interp, "", &[]);
}

/// The cpu window's check with more idle Python threads (started after the
/// main thread) than the eBPF program's walk of the thread list reads.
fn hot_function_behind_many_threads(interp: Interp) {
    let n = (dynprof_common::unwind::MAX_PY_THREADS + 6).to_string();
    hot_function_with(interp, "_threads", &["--idle-threads", &n]);
}

/// The cpu window's check on py_hot.py run with `extra` options, in a
/// scratch directory of its own (`tag`: tests run in parallel).
fn hot_function_with(interp: Interp, tag: &str, extra: &[&str]) {
    let minor = minor(&interp);
    let dir = scratch_dir(&format!("python_versions_{minor}{tag}"));
    let script =
        std::fs::read_to_string(workspace_root().join("tests/fixtures/py_hot.py")).unwrap();
    let mut args = vec!["--native-step", "--units", "100000"];
    args.extend_from_slice(extra);
    let Some(job) = Job::start(&interp, &args) else {
        return;
    };
    let o = attach_py_hot(job.python, &dir.join("out"), "cpu");
    job.stop();
    check_hot(minor, &dir, &script, &o);
}

/// `dynprof attach` with collector `collect` for 40 steps of py_hot.py at
/// 499 Hz.
fn attach_py_hot(python: u32, out: &Path, collect: &str) -> std::process::Output {
    Command::new(dynprof_bin())
        .args([
            "attach",
            "--pid",
            &python.to_string(),
            // CPython 3.12+ has no function__return USDT probe: steps are
            // counted by the libc call the script makes after each one.
            "--marker",
            "libc.so.6:getppid",
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
        .unwrap()
}

/// An offcpu window on py_hot.py --queue: the training thread waits in
/// `wait_for_batch` -> `Queue.get` for what a `producer` thread puts every
/// 10 ms; both blocked most of the time, found by their Python frames at
/// each switch-out (the producer's from the interpreter's thread list, as
/// it does not hold the GIL while it sleeps).
fn offcpu_queue_wait(interp: Interp) {
    let minor = minor(&interp);
    let dir = scratch_dir(&format!("python_versions_offcpu_{minor}"));
    let Some(job) = Job::start(&interp, &["--native-step", "--units", "1000", "--queue"]) else {
        return;
    };
    let o = attach_py_hot(job.python, &dir.join("out"), "offcpu");
    job.stop();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "dynprof attach failed: {stderr}");
    let (_, stacks) = window_folded(&dir.join("out"), "offcpu", &stderr);
    check_offcpu_queue_wait(&stacks, &format!("python3.{minor}"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The window's stacks: most samples in `hot` or `cold` under their
/// caller, named by a line of their own body, joined to the interpreter's
/// native frames, `hot` with about 80 % (the job's split).
fn check_hot(minor: u8, dir: &Path, script: &str, o: &std::process::Output) {
    let out = dir.join("out");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "dynprof attach failed: {stderr}");
    let (_, stacks) = window_folded(&out, "cpu", &stderr);
    let total: u64 = stacks.iter().map(|s| s.1).sum();
    for (s, n) in &stacks {
        eprintln!("  {n:5} {}", s.join(";"));
    }
    assert!(total >= 30, "too few samples: {total}");

    let (hot_first, hot_last) = def_lines(script, "hot");
    let (cold_first, cold_last) = def_lines(script, "cold");
    let (mut hot, mut cold, mut joined, mut user_mode) = (0u64, 0u64, 0u64, 0u64);
    for (s, n) in &stacks {
        let py: Vec<(usize, &str)> = s
            .iter()
            .enumerate()
            .filter_map(|(i, f)| Some((i, py_fn(f)?)))
            .collect();
        let names: Vec<&str> = py.iter().map(|p| p.1).collect();
        let leaf = py.last().map(|&(i, _)| s[i].as_str());
        let lines = match names.last() {
            Some(&"hot") => {
                hot += n;
                hot_first..=hot_last
            }
            Some(&"cold") => {
                cold += n;
                cold_first..=cold_last
            }
            _ => continue,
        };
        // Named from the right code object and line table: a line of the
        // function's own body, in the script.
        let leaf = leaf.unwrap();
        assert!(leaf.contains("(py_hot.py:"), "{leaf}");
        let line = py_line(leaf).unwrap_or_else(|| panic!("no line in {leaf}"));
        assert!(lines.contains(&line), "{leaf}: not in lines {lines:?}");
        assert!(
            names.ends_with(&["<module>", "main", "train_step", "caller", "hot"])
                || names.ends_with(&["<module>", "main", "train_step", "caller", "cold"]),
            "{}",
            s.join(";")
        );
        if s.iter().any(|f| f.ends_with("_[k]")) {
            continue;
        }
        user_mode += n;
        // Joined: the outermost Python frame sits right under the
        // evaluator call that runs it, itself right under the
        // `PyEval_EvalCode` that started the script. Debian's 3.14 (GCC,
        // PGO) splits `_PyEval_EvalFrameDefault`: the running part has no
        // symbol in the stripped binary (`[unknown] python3.14+0x…`), and
        // is found by the address of the run's shim frame (docs/stacks.md).
        let first = py[0].0;
        let evaluator = |f: &str| {
            f == "_PyEval_EvalFrameDefault"
                || (minor >= 14 && f.starts_with(&format!("[unknown] python3.{minor}+")))
        };
        if first >= 2 && evaluator(&s[first - 1]) && s[first - 2] == "PyEval_EvalCode" {
            joined += n;
        }
    }
    eprintln!(
        "python3.{minor}: hot {hot}, cold {cold}, joined {joined} of {user_mode} user-mode, \
         {total} samples"
    );
    let in_job = hot + cold;
    assert!(
        in_job as f64 >= 0.8 * total as f64,
        "only {in_job} of {total} samples in hot or cold"
    );
    assert!(
        user_mode as f64 >= 0.8 * in_job as f64,
        "{user_mode} of {in_job}"
    );
    assert_eq!(
        joined, user_mode,
        "Python frames not joined to the interpreter's"
    );
    let share = hot as f64 / in_job as f64;
    // The job splits its work 4:1 (80 %).
    assert!(
        (0.7..=0.9).contains(&share),
        "hot's share {share:.2}, expected about 0.80"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn python311_hot_function_under_its_caller() {
    require_privileges!();
    let Some(py) = debian_python311() else { return };
    hot_function_under_its_caller(py);
}

/// More Python threads than the eBPF program's walk of the interpreter's
/// thread list reads (`MAX_PY_THREADS`, 64), all started after the main
/// thread, which is then last in the list: the hot main thread is found
/// only through `_PyRuntime`'s pointer to the thread holding the GIL, at
/// the offset of this machine's table (on arm64, where it differs from
/// x86-64's, a wrong offset leaves these samples without Python frames).
#[test]
fn python311_hot_function_behind_many_threads() {
    require_privileges!();
    let Some(py) = debian_python311() else { return };
    hot_function_behind_many_threads(py);
}

/// 3.12's way to the running thread: the main interpreter's GIL holder
/// (`_gil.last_holder`, at the offset of dynprof's 3.12 table).
#[test]
fn python312_hot_function_behind_many_threads() {
    require_privileges!();
    let Some(py) = host_python312() else { return };
    hot_function_behind_many_threads(Interp::Host(12, py, None));
}

/// 3.13's way to the running thread: the main interpreter's GIL holder,
/// at the offset its `_Py_DebugOffsets` gives.
#[test]
fn python313_hot_function_behind_many_threads() {
    require_privileges!();
    hot_function_behind_many_threads(Interp::Rootfs(13));
}

#[test]
fn python314_hot_function_behind_many_threads() {
    require_privileges!();
    hot_function_behind_many_threads(Interp::Rootfs(14));
}

#[test]
fn python311_offcpu_queue_wait() {
    require_privileges!();
    let Some(py) = debian_python311() else { return };
    offcpu_queue_wait(py);
}

#[test]
fn python312_hot_function_under_its_caller() {
    require_privileges!();
    let Some(py) = host_python312() else { return };
    hot_function_under_its_caller(Interp::Host(12, py, None));
}

#[test]
fn python313_hot_function_under_its_caller() {
    require_privileges!();
    hot_function_under_its_caller(Interp::Rootfs(13));
}

#[test]
fn python314_hot_function_under_its_caller() {
    require_privileges!();
    hot_function_under_its_caller(Interp::Rootfs(14));
}

#[test]
fn python312_offcpu_queue_wait() {
    require_privileges!();
    let Some(py) = host_python312() else { return };
    offcpu_queue_wait(Interp::Host(12, py, None));
}

#[test]
fn python313_offcpu_queue_wait() {
    require_privileges!();
    offcpu_queue_wait(Interp::Rootfs(13));
}

#[test]
fn python314_offcpu_queue_wait() {
    require_privileges!();
    offcpu_queue_wait(Interp::Rootfs(14));
}
