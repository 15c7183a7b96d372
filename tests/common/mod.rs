//! Helpers shared by dynprof's integration tests (`mod common;`).
//!
//! - [`fixtures()`] builds the native target programs of `tests/fixtures/`
//!   once per test process (under a file lock shared with other test
//!   binaries and with `cargo xtask demo`) and returns their paths.
//! - [`require_privileges!`] skips a test loudly when BPF is not allowed
//!   (or fails it when `DYNPROF_REQUIRE_PRIVILEGED=1`, as in CI).
//! - [`Proc`] owns a spawned target and kills it on drop.
//! - [`read_log`] / [`wait_for_log_lines`] parse and follow the fixtures'
//!   `<kind> <index> <before_ns> <after_ns>` logs (CLOCK_MONOTONIC ns);
//!   [`read_acl_log`] parses the simulated ACL runtime's log.
#![allow(dead_code, unreachable_pub)] // shared by many test crates; each uses a part

use std::{
    fs::File,
    io::{BufRead as _, BufReader, Read as _},
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{OnceLock, mpsc},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};

// ---------------------------------------------------------------- paths

/// The cargo workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("dynprof/ has a parent")
        .to_path_buf()
}

/// Cargo's target directory (`$CARGO_TARGET_DIR` or `<workspace>/target`),
/// the same rule `cargo xtask` uses.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) if !d.is_empty() => {
            let d = PathBuf::from(d);
            if d.is_absolute() {
                d
            } else {
                workspace_root().join(d)
            }
        }
        _ => workspace_root().join("target"),
    }
}

/// The dynprof binary built for this test run.
pub fn dynprof_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_dynprof"))
}

/// Debian's python3 (3.11, built with USDT probes; python3-torch lives there).
pub const PYTHON3: &str = "/usr/bin/python3";

/// Debian bookworm's arm64 python3.11 with python3-torch 1.13 and its
/// dependencies, unpacked by `cargo xtask setup` (xtask/src/pyroots.rs).
pub const TORCH_ARM64_ROOT: &str = "/var/cache/dynprof/python-rootfs/torch1.13-arm64";

/// Debian's PyTorch 1.13 under its python3.11, for the machine the test
/// runs on: the host's [`PYTHON3`] on x86-64; on arm64 (the arm64 VM;
/// Kunpeng hosts are arm64) the tree at [`TORCH_ARM64_ROOT`], run in place
/// with its libraries on `LD_LIBRARY_PATH` and the host's arm64 glibc.
pub fn torch_python() -> Command {
    if cfg!(target_arch = "aarch64") {
        let root = Path::new(TORCH_ARM64_ROOT);
        let py = root.join("usr/bin/python3.11");
        assert!(
            py.is_file(),
            "no arm64 PyTorch at {} (cargo xtask setup unpacks it)",
            root.display()
        );
        let mut cmd = Command::new(py);
        // libgloo is in /usr/lib, not the multiarch directory.
        let dirs = [
            "lib/aarch64-linux-gnu",
            "usr/lib/aarch64-linux-gnu",
            "usr/lib",
        ];
        let path: Vec<String> = dirs
            .iter()
            .map(|d| root.join(d).display().to_string())
            .collect();
        cmd.env("LD_LIBRARY_PATH", path.join(":"));
        cmd
    } else {
        Command::new(PYTHON3)
    }
}

/// A fresh, empty scratch directory `<target>/test-tmp/<tag>` (removed first
/// if it exists). Use the test name as tag so parallel tests never share one.
pub fn scratch_dir(tag: &str) -> PathBuf {
    let dir = target_dir().join("test-tmp").join(tag);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    dir
}

// ---------------------------------------------------------------- fixtures

/// Paths of the built fixtures (all absolute).
#[derive(Debug)]
pub struct Fixtures {
    /// `<target>/fixtures`
    pub dir: PathBuf,
    /// `tests/fixtures` (sources)
    pub src_dir: PathBuf,
    pub trainer: PathBuf,
    pub libfixture_backward: PathBuf,
    pub strtrainer: PathBuf,
    pub libascendcl: PathBuf,
    pub acl_trainer: PathBuf,
    pub dlopen_trainer: PathBuf,
    pub libfixture_marker: PathBuf,
    /// Two threads ping-ponging over pipes: a dense off-CPU target.
    pub pingpong: PathBuf,
    /// Several threads hitting one step marker at once.
    pub stepthreads: PathBuf,
    /// 12 calls deep without frame pointers (tests/unwind_native.rs).
    pub deepstack: PathBuf,
    /// The same, built with `-fno-unwind-tables
    /// -fno-asynchronous-unwind-tables`: its
    /// functions' tables are in `.debug_frame` only.
    pub deepstack_debug_frame: PathBuf,
    /// Python scripts (run them with [`PYTHON3`]; see [`Fixtures::python`]).
    pub usdt_train_py: PathBuf,
    pub torch_train_py: PathBuf,
}

impl Fixtures {
    /// `Command` running a fixture script under Debian's python3 with
    /// PyTorch ([`torch_python`]: the arm64 tree on arm64).
    pub fn python(&self, script: &Path) -> Command {
        let mut cmd = torch_python();
        cmd.arg(script);
        cmd
    }
}

/// Builds every C/C++ fixture once per test process (make rebuilds only what
/// is older than its sources) and returns the paths. Panics with the
/// compiler's output if the build fails.
pub fn fixtures() -> &'static Fixtures {
    static FIXTURES: OnceLock<Fixtures> = OnceLock::new();
    FIXTURES.get_or_init(|| {
        build_fixtures().unwrap_or_else(|e| panic!("building test fixtures: {e:#}"))
    })
}

fn build_fixtures() -> Result<Fixtures> {
    let src_dir = workspace_root().join("tests/fixtures");
    // `cargo xtask vm-test --arch aarch64` builds them for arm64 on the host
    // (the VM has no arm64 compiler) and points here.
    if let Some(dir) = std::env::var_os("DYNPROF_FIXTURES_DIR") {
        return fixtures_in(PathBuf::from(dir), src_dir);
    }
    let dir = target_dir().join("fixtures");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;

    // Same lock file as `cargo xtask demo` (which uses flock(1)).
    let lock_path = dir.join(".build.lock");
    let lock = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .with_context(|| format!("opening {}", lock_path.display()))?;
    // SAFETY: plain flock(2) on a file descriptor we own; released on close.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        bail!(
            "flock {}: {}",
            lock_path.display(),
            std::io::Error::last_os_error()
        );
    }
    let out = Command::new("make")
        .arg("--no-print-directory")
        .arg("-C")
        .arg(&src_dir)
        .arg(format!("OUT={}", dir.display()))
        .output()
        .context("running make (is it installed? run `cargo xtask setup`)")?;
    drop(lock);
    if !out.status.success() {
        bail!(
            "make failed ({}); gcc, g++, make and systemtap-sdt-dev are needed: run `cargo xtask setup`\n\
             --- stdout ---\n{}\n--- stderr ---\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    fixtures_in(dir, src_dir)
}

fn fixtures_in(dir: PathBuf, src_dir: PathBuf) -> Result<Fixtures> {
    let f = Fixtures {
        trainer: dir.join("trainer"),
        libfixture_backward: dir.join("libfixture_backward.so"),
        strtrainer: dir.join("strtrainer"),
        libascendcl: dir.join("libascendcl.so"),
        acl_trainer: dir.join("acl_trainer"),
        dlopen_trainer: dir.join("dlopen_trainer"),
        libfixture_marker: dir.join("libfixture_marker.so"),
        pingpong: dir.join("pingpong"),
        stepthreads: dir.join("stepthreads"),
        deepstack: dir.join("deepstack"),
        deepstack_debug_frame: dir.join("deepstack_debug_frame"),
        usdt_train_py: src_dir.join("usdt_train.py"),
        torch_train_py: src_dir.join("torch_train.py"),
        dir,
        src_dir,
    };
    for p in [
        &f.trainer,
        &f.libfixture_backward,
        &f.strtrainer,
        &f.libascendcl,
        &f.acl_trainer,
        &f.dlopen_trainer,
        &f.libfixture_marker,
        &f.deepstack,
        &f.deepstack_debug_frame,
        &f.usdt_train_py,
        &f.torch_train_py,
    ] {
        if !p.is_file() {
            bail!("fixture {} missing after the build", p.display());
        }
    }
    Ok(f)
}

// ---------------------------------------------------------------- privileges

const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

fn cap_eff() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .unwrap_or(0)
}

/// Tries to create (and closes) a one-entry BPF array map.
fn can_create_bpf_map() -> bool {
    // union bpf_attr for BPF_MAP_CREATE: map_type, key_size, value_size, max_entries, ...
    let mut attr = [0u32; 32];
    attr[0] = 2; // BPF_MAP_TYPE_ARRAY
    attr[1] = 4;
    attr[2] = 4;
    attr[3] = 1;
    // SAFETY: bpf(BPF_MAP_CREATE=0) reads `size` bytes of `attr`, which is zeroed beyond the fields set.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            0 as libc::c_long,
            attr.as_mut_ptr(),
            std::mem::size_of_val(&attr),
        )
    };
    if fd >= 0 {
        // SAFETY: fd was just returned to us.
        unsafe { libc::close(fd as i32) };
        true
    } else {
        false
    }
}

/// True if this process may load BPF programs and attach uprobes: root (or
/// CAP_BPF + CAP_PERFMON) and a BPF map can actually be created.
pub fn privileged() -> bool {
    static P: OnceLock<bool> = OnceLock::new();
    *P.get_or_init(|| {
        let caps = cap_eff();
        let has = |bit: u32| caps >> bit & 1 == 1;
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let capable = root || has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON));
        capable && (can_create_bpf_map() || has(CAP_BPF) || has(CAP_SYS_ADMIN))
    })
}

/// Whether a missing privilege must fail the test instead of skipping it
/// (`DYNPROF_REQUIRE_PRIVILEGED=1`, set by `.ci/run`).
pub fn privileges_required() -> bool {
    std::env::var("DYNPROF_REQUIRE_PRIVILEGED").is_ok_and(|v| v == "1")
}

/// Called by [`require_privileges!`]; returns true if the test must return now.
pub fn skip_unprivileged(test: &str) -> bool {
    if privileged() {
        return false;
    }
    if privileges_required() {
        panic!(
            "{test}: needs root / CAP_BPF+CAP_PERFMON, and DYNPROF_REQUIRE_PRIVILEGED=1 forbids skipping"
        );
    }
    // Written straight to fd 2 so libtest's output capture cannot hide it.
    use std::io::Write as _;
    let _ = writeln!(
        std::io::stderr(),
        "\n!!!!!!!! SKIPPED (needs root / CAP_BPF+CAP_PERFMON): {test} !!!!!!!!\n"
    );
    true
}

/// Returns early from the calling test (after a loud notice on stderr) when
/// the process cannot use BPF. With `DYNPROF_REQUIRE_PRIVILEGED=1` it panics.
#[macro_export]
macro_rules! require_privileges {
    () => {{
        fn __here() {}
        fn __name_of<T>(_: T) -> &'static str {
            ::std::any::type_name::<T>()
        }
        let name = __name_of(__here);
        let name = name.strip_suffix("::__here").unwrap_or(name);
        let name = name.strip_suffix("::{{closure}}").unwrap_or(name);
        if $crate::common::skip_unprivileged(name) {
            return;
        }
    }};
}

// ---------------------------------------------------------------- processes

/// A spawned target program; killed (SIGKILL) and reaped on drop.
pub struct Proc {
    pub child: Child,
    /// The pid the program printed in its `ready <pid>` line (0 until known).
    pub pid: u32,
}

impl Proc {
    /// Spawns `cmd` with stdout piped (for the ready line) and stdin closed.
    pub fn spawn(cmd: &mut Command) -> Proc {
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {:?}: {e}", cmd.get_program()));
        Proc { child, pid: 0 }
    }

    /// Spawns `cmd` and waits (up to 120 s) for its `ready <pid>` line.
    pub fn spawn_ready(cmd: &mut Command) -> Proc {
        let mut p = Proc::spawn(cmd);
        p.pid =
            wait_ready(&mut p.child).unwrap_or_else(|e| panic!("{:?}: {e:#}", cmd.get_program()));
        p
    }

    /// The host pid of the spawned process.
    pub fn host_pid(&self) -> u32 {
        self.child.id()
    }

    /// True while the process has not exited.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends SIGTERM and waits for the exit (fixtures exit 0 on SIGTERM).
    pub fn terminate(&mut self) -> ExitStatus {
        // SAFETY: kill(2) on our own child's pid, which we have not reaped yet.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        self.child.wait().expect("waiting for the child")
    }

    /// Waits for the process to exit on its own, up to `timeout`.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads the `ready <pid>` line from the child's stdout (which must be
/// piped), within 120 s, and returns the pid. The rest of stdout is drained
/// in the background so the child never blocks on, or dies from, a full or
/// closed pipe.
pub fn wait_ready(child: &mut Child) -> Result<u32> {
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow!("child stdout is not piped"))?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut r = BufReader::new(stdout);
        let mut line = String::new();
        let res = r.read_line(&mut line).map(|_| line);
        let _ = tx.send(res);
        let _ = std::io::copy(&mut r, &mut std::io::sink());
    });
    // Importing PyTorch takes minutes under TCG.
    let limit = if emulated() { 900 } else { 120 };
    let line = match rx.recv_timeout(Duration::from_secs(limit)) {
        Ok(r) => r.context("reading the child's stdout")?,
        Err(_) => bail!("no `ready <pid>` line within {limit} s"),
    };
    if line.is_empty() {
        let st = child.try_wait().ok().flatten();
        bail!("the child closed stdout without printing `ready <pid>` (exit status: {st:?})");
    }
    line.trim()
        .strip_prefix("ready ")
        .and_then(|p| p.trim().parse().ok())
        .ok_or_else(|| anyhow!("expected `ready <pid>`, got {:?}", line.trim()))
}

// ---------------------------------------------------------------- logs

/// One line of a fixture log: `<kind> <index> <before_ns> <after_ns>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    pub kind: String,
    pub index: u64,
    /// CLOCK_MONOTONIC ns just before the logged call.
    pub before: u64,
    /// CLOCK_MONOTONIC ns just after it.
    pub after: u64,
}

fn complete_lines(path: &Path) -> Vec<String> {
    let mut s = String::new();
    match File::open(path) {
        Ok(mut f) => {
            f.read_to_string(&mut s)
                .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => panic!("opening {}: {e}", path.display()),
    }
    // A line still being written (no newline yet) is not returned.
    let end = s.rfind('\n').map_or(0, |i| i + 1);
    s[..end]
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect()
}

/// Parses a fixture log (missing file = empty). Only complete lines are
/// returned; a malformed complete line panics.
pub fn read_log(path: impl AsRef<Path>) -> Vec<LogLine> {
    let path = path.as_ref();
    complete_lines(path)
        .into_iter()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let parsed = (f.len() == 4)
                .then(|| Some((f[1].parse().ok()?, f[2].parse().ok()?, f[3].parse().ok()?)))
                .flatten();
            let Some((index, before, after)) = parsed else {
                panic!("{}: malformed log line {l:?}", path.display());
            };
            LogLine {
                kind: f[0].to_owned(),
                index,
                before,
                after,
            }
        })
        .collect()
}

/// The lines of `kind` in a log.
pub fn log_lines_of(path: impl AsRef<Path>, kind: &str) -> Vec<LogLine> {
    read_log(path)
        .into_iter()
        .filter(|l| l.kind == kind)
        .collect()
}

/// Polls the log until it has at least `n` lines of `kind`; returns all lines
/// of that kind, or `None` on timeout.
pub fn try_wait_for_log_lines(
    path: impl AsRef<Path>,
    kind: &str,
    n: usize,
    timeout: Duration,
) -> Option<Vec<LogLine>> {
    let path = path.as_ref();
    let deadline = Instant::now() + timeout;
    loop {
        let lines = log_lines_of(path, kind);
        if lines.len() >= n {
            return Some(lines);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Like [`try_wait_for_log_lines`] but panics on timeout, showing the log.
pub fn wait_for_log_lines(
    path: impl AsRef<Path>,
    kind: &str,
    n: usize,
    timeout: Duration,
) -> Vec<LogLine> {
    let path = path.as_ref();
    try_wait_for_log_lines(path, kind, n, timeout).unwrap_or_else(|| {
        let have = complete_lines(path);
        panic!(
            "{}: wanted {n} `{kind}` lines within {timeout:?}; the log has {} lines, last ones: {:?}",
            path.display(),
            have.len(),
            &have[have.len().saturating_sub(5)..]
        )
    })
}

/// One line of the simulated ACL runtime's log (`ACL_SIM_LOG`):
/// `<api> <tid> <t_enter_ns> <t_exit_ns> <waited_ns>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AclLogLine {
    pub api: String,
    pub tid: u32,
    pub enter: u64,
    pub exit: u64,
    /// How long a synchronize call actually blocked; 0 for other calls.
    pub waited: u64,
}

/// Parses an `ACL_SIM_LOG` file (missing file = empty; complete lines only).
pub fn read_acl_log(path: impl AsRef<Path>) -> Vec<AclLogLine> {
    let path = path.as_ref();
    complete_lines(path)
        .into_iter()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let parsed = (f.len() == 5)
                .then(|| {
                    Some((
                        f[1].parse().ok()?,
                        f[2].parse().ok()?,
                        f[3].parse().ok()?,
                        f[4].parse().ok()?,
                    ))
                })
                .flatten();
            let Some((tid, enter, exit, waited)) = parsed else {
                panic!("{}: malformed ACL log line {l:?}", path.display());
            };
            AclLogLine {
                api: f[0].to_owned(),
                tid,
                enter,
                exit,
                waited,
            }
        })
        .collect()
}

// ---------------------------------------------------------------- waiting on files and memory

/// Waits (up to `timeout`) until `p` contains `needle`; returns its text.
pub fn wait_file_contains(p: &Path, needle: &str, timeout: Duration) -> String {
    let until = Instant::now() + timeout;
    loop {
        let t = std::fs::read_to_string(p).unwrap_or_default();
        if t.contains(needle) {
            return t;
        }
        assert!(
            Instant::now() < until,
            "{}: no {needle:?} within {timeout:?}; it has:\n{t}",
            p.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runtime address of file offset `fo` of the mapping of `path` in `pid`
/// (the test's own reading of /proc/PID/maps, independent of dynprof's).
pub fn runtime_addr(pid: u32, path: &Path, fo: u64) -> u64 {
    let want = std::fs::canonicalize(path).unwrap();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    for l in maps.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() < 6 || Path::new(f[5]) != want {
            continue;
        }
        let (a, b) = f[0].split_once('-').unwrap();
        let (start, end) = (
            u64::from_str_radix(a, 16).unwrap(),
            u64::from_str_radix(b, 16).unwrap(),
        );
        let off = u64::from_str_radix(f[2], 16).unwrap();
        if fo >= off && fo < off + (end - start) {
            return start + (fo - off);
        }
    }
    panic!(
        "file offset {fo:#x} of {} not mapped in {pid}",
        want.display()
    );
}

/// Which optimizer.step() call of a job's log (`LogLine::index`) holds the
/// boundary at `ts`: exactly one must.
pub fn iteration_at(log: &[LogLine], ts: u64, what: &str) -> u64 {
    let hits: Vec<&LogLine> = log
        .iter()
        .filter(|l| l.before <= ts && ts <= l.after)
        .collect();
    assert_eq!(
        hits.len(),
        1,
        "{what}: boundary {ts} is inside {} optimizer.step() calls",
        hits.len()
    );
    hits[0].index
}

/// The one `PROF_*` window directory in `out` (`stderr`: dynprof's, for
/// the message when there is none).
pub fn prof_dir(out: &Path, stderr: &str) -> PathBuf {
    std::fs::read_dir(out)
        .unwrap_or_else(|e| panic!("{}: {e}: {stderr}", out.display()))
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("PROF_")
        })
        .unwrap_or_else(|| panic!("no PROF_ directory in {}: {stderr}", out.display()))
}

/// The summed weight (samples, or µs off-CPU) of the folded stacks for
/// which `keep` holds: what the stack tests compare with a total.
pub fn weight(stacks: &[(Vec<String>, u64)], keep: impl Fn(&[String]) -> bool) -> u64 {
    stacks.iter().filter(|(s, _)| keep(s)).map(|(_, n)| n).sum()
}

/// The offcpu check of `py_hot.py --queue` (tests/python_frames.rs,
/// tests/python_versions.rs), 40 steps: the training thread waits in
/// `train_step -> wait_for_batch -> Queue.get` for what a `producer`
/// thread puts every 10 ms. At least 200 ms off-CPU in all, and at least
/// 30 % of it under each of the two, by their `[py]` frames.
pub fn check_offcpu_queue_wait(stacks: &[(Vec<String>, u64)], label: &str) {
    for (s, n) in stacks {
        eprintln!("  {n:8} {}", s.join(";"));
    }
    let py_names = |s: &[String]| -> Vec<String> {
        s.iter()
            .filter_map(|f| {
                let rest = f.strip_prefix("[py] ")?;
                Some(rest.split_once(" (").map_or(rest, |(n, _)| n).to_string())
            })
            .collect()
    };
    let total: u64 = stacks.iter().map(|s| s.1).sum();
    let waiting = weight(stacks, |s| {
        py_names(s)
            .windows(3)
            .any(|w| w == ["train_step", "wait_for_batch", "Queue.get"])
    });
    let producing = weight(stacks, |s| py_names(s).iter().any(|f| f == "producer"));
    eprintln!(
        "{label}: off-CPU µs: {total} in all, {waiting} waiting for a batch, {producing} in producer"
    );
    // 40 steps of ~10 ms each, both threads blocked most of the time.
    assert!(total >= 200_000, "{label}: only {total} µs off-CPU");
    assert!(
        waiting as f64 >= 0.3 * total as f64,
        "{label}: {waiting} of {total} µs waiting for a batch"
    );
    assert!(
        producing as f64 >= 0.3 * total as f64,
        "{label}: {producing} of {total} µs in producer"
    );
}

/// The one `PROF_*` window in `out` and the stacks of its `NAME.folded`
/// (frames root first, sample count). A missing file panics with the
/// window's meta.json and dynprof's `stderr`, which say why.
pub fn window_folded(out: &Path, name: &str, stderr: &str) -> (PathBuf, Vec<(Vec<String>, u64)>) {
    let prof = prof_dir(out, stderr);
    let stacks = std::fs::read_to_string(prof.join(format!("{name}.folded")))
        .unwrap_or_else(|e| {
            let meta = std::fs::read_to_string(prof.join("meta.json")).unwrap_or_default();
            panic!(
                "{}: {e}\nmeta.json: {meta}\nstderr: {stderr}",
                prof.display()
            )
        })
        .lines()
        .filter_map(|l| {
            let (s, n) = l.rsplit_once(' ')?;
            Some((s.split(';').map(str::to_string).collect(), n.parse().ok()?))
        })
        .collect();
    (prof, stacks)
}

/// Running in a QEMU TCG guest (`cargo xtask vm-test` sets this): the
/// guest's clock runs on while its vCPUs wait for the host, so tests bound
/// only what emulation does not stretch (docs/portability.md).
pub fn emulated() -> bool {
    std::env::var_os("DYNPROF_TEST_EMULATED").is_some()
}

/// CLOCK_MONOTONIC in ns: the clock of the fixtures' logs and of dynprof's
/// timestamps.
pub fn mono_ns() -> u64 {
    dynprof::sys::clock::monotonic_ns()
}
