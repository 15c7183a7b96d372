//! `--on-window-start CMD` / `--on-window-end CMD`: user commands run (via
//! `sh -c`) at the window boundaries, e.g. `perf record`, `nsys start`, or a
//! script that snapshots state.
//!
//! - The start hook runs on its own thread; the event loop is not held up.
//!   The end hook waits for the start hook, then runs.
//! - Each runs in its own process group; after `--hook-timeout` the group gets
//!   SIGTERM, and SIGKILL 2 s later.
//! - Output goes to `<window dir>/hooks/<name>.log`; exit codes and timings
//!   (CLOCK_MONOTONIC ns) go to meta.json.
use std::{
    os::unix::process::{CommandExt as _, ExitStatusExt as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::mpsc,
    thread::JoinHandle,
    time::Duration,
};

use anyhow::Result;
use serde::Serialize;
use serde_json::{Value, json};

use super::{WindowHook, WindowInfo, msprof::monotonic_ns};
use crate::target::Target;

/// SIGTERM-to-SIGKILL grace after a hook's timeout.
const KILL_GRACE: Duration = Duration::from_secs(2);

/// One hook execution, as recorded in meta.json.
#[derive(Clone, Debug, Serialize)]
pub struct HookRun {
    pub hook: String,
    pub command: String,
    /// Boundary timestamp the hook belongs to (0 when unknown).
    pub boundary_ts_ns: u64,
    pub spawned_ns: u64,
    /// spawned_ns - boundary_ts_ns.
    pub spawn_latency_ns: Option<u64>,
    pub exited_ns: u64,
    pub duration_ns: u64,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub error: Option<String>,
    pub log: PathBuf,
}

/// The final name of a window directory still being written
/// (`.PROF_x.<random>_tmp` → `PROF_x`; see `window::profdir`).
pub fn final_dir(dir: &Path) -> PathBuf {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    match name
        .strip_prefix('.')
        .and_then(|n| n.strip_suffix("_tmp"))
        .and_then(|n| n.split('.').next())
    {
        Some(n) => dir.with_file_name(n),
        None => dir.to_path_buf(),
    }
}

/// The environment a hook sees.
pub fn hook_env(
    w: &WindowInfo,
    target: &Target,
    event: &str,
    boundary_ts_ns: u64,
) -> Vec<(String, String)> {
    vec![
        ("DYNPROF_HOST_PID".into(), target.host_pid.to_string()),
        ("DYNPROF_NS_PID".into(), target.inner_pid().to_string()),
        (
            "DYNPROF_CONTAINER".into(),
            target
                .container
                .as_ref()
                .map(|c| c.to_string())
                .unwrap_or_default(),
        ),
        ("DYNPROF_STEP".into(), w.first_recorded.to_string()),
        ("DYNPROF_WINDOW".into(), w.id.to_string()),
        ("DYNPROF_WINDOW_DIR".into(), w.dir.display().to_string()),
        (
            "DYNPROF_WINDOW_FINAL_DIR".into(),
            final_dir(&w.dir).display().to_string(),
        ),
        ("DYNPROF_EVENT".into(), event.into()),
        ("DYNPROF_BOUNDARY_TS_NS".into(), boundary_ts_ns.to_string()),
        (
            "DYNPROF_TARGET_ROOT".into(),
            target.root().display().to_string(),
        ),
    ]
}

/// Runs `sh -c cmd` to completion or timeout (blocking; call off the event loop).
pub fn run_hook(
    hook: &str,
    cmd: &str,
    env: &[(String, String)],
    timeout: Duration,
    log: &Path,
    boundary_ts_ns: u64,
) -> HookRun {
    let mut run = HookRun {
        hook: hook.into(),
        command: cmd.into(),
        boundary_ts_ns,
        spawned_ns: 0,
        spawn_latency_ns: None,
        exited_ns: 0,
        duration_ns: 0,
        exit_code: None,
        signal: None,
        timed_out: false,
        error: None,
        log: log.to_path_buf(),
    };
    // A new file (O_EXCL|O_NOFOLLOW) in the window directory, reached
    // without following any symlink: never an existing file or a link.
    let out = crate::sys::hostfs::create_file_path(log);
    let (stdout, stderr) = match out.and_then(|f| Ok((f.try_clone()?, f))) {
        Ok((a, b)) => (Stdio::from(a), Stdio::from(b)),
        Err(e) => {
            run.error = Some(format!("creating {}: {e}", log.display()));
            (Stdio::null(), Stdio::null())
        }
    };
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg(cmd)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr);
    // SAFETY: setpgid is async-signal-safe.
    unsafe {
        c.pre_exec(|| {
            libc::setpgid(0, 0);
            Ok(())
        });
    }
    let spawned = monotonic_ns();
    let mut child = match c.spawn() {
        Ok(ch) => ch,
        Err(e) => {
            run.error = Some(format!("spawning sh -c {cmd:?}: {e}"));
            return run;
        }
    };
    run.spawned_ns = spawned;
    run.spawn_latency_ns = (boundary_ts_ns > 0).then(|| spawned.saturating_sub(boundary_ts_ns));
    let pgid = child.id() as i32;
    let (tx, rx) = mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let st = child.wait();
        let _ = tx.send(st);
    });
    let st = match rx.recv_timeout(timeout) {
        Ok(st) => st,
        Err(_) => {
            run.timed_out = true;
            // SAFETY: signals the hook's own process group.
            unsafe { libc::kill(-pgid, libc::SIGTERM) };
            match rx.recv_timeout(KILL_GRACE) {
                Ok(st) => st,
                Err(_) => {
                    // SAFETY: as above.
                    unsafe { libc::kill(-pgid, libc::SIGKILL) };
                    rx.recv()
                        .unwrap_or_else(|_| Err(std::io::Error::other("waiter gone")))
                }
            }
        }
    };
    // Whatever the shell left behind in its group after a timeout goes too.
    if run.timed_out {
        // SAFETY: as above.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
    }
    let _ = waiter.join();
    run.exited_ns = monotonic_ns();
    run.duration_ns = run.exited_ns - spawned;
    match st {
        Ok(st) => {
            run.exit_code = st.code();
            run.signal = st.signal();
        }
        Err(e) => run.error = Some(format!("waiting for the hook: {e}")),
    }
    run
}

/// The user hooks of one attach.
pub struct UserHooks {
    pub on_start: Option<String>,
    pub on_end: Option<String>,
    pub timeout: Duration,
    /// How long `on_window_end` waits for the hooks before it returns with
    /// their results pending (they then go to `hooks/hooks.json` in the
    /// window's final directory).
    pub wait: Duration,
    running: Option<JoinHandle<HookRun>>,
    /// Finishing threads of earlier windows (joined at shutdown).
    finishing: Vec<JoinHandle<()>>,
}

impl UserHooks {
    pub fn new(
        on_start: Option<String>,
        on_end: Option<String>,
        timeout: Duration,
        wait: Duration,
    ) -> Self {
        Self {
            on_start,
            on_end,
            timeout,
            wait,
            running: None,
            finishing: Vec::new(),
        }
    }
}

fn failed_run(hook: &str, cmd: &str, why: &str) -> HookRun {
    HookRun {
        hook: hook.into(),
        command: cmd.into(),
        boundary_ts_ns: 0,
        spawned_ns: 0,
        spawn_latency_ns: None,
        exited_ns: 0,
        duration_ns: 0,
        exit_code: None,
        signal: None,
        timed_out: false,
        error: Some(why.into()),
        log: PathBuf::new(),
    }
}

/// Writes `v` to `<final dir>/hooks/hooks.json` once the window directory
/// has its final name (or into the temporary one if that never happens).
fn write_late(tmp: &Path, v: &Value) {
    let fin = final_dir(tmp);
    let mut text = serde_json::to_vec_pretty(v).unwrap_or_default();
    text.push(b'\n');
    // The window may belong to the job's user by now (`--chown`): reach it
    // without following links, write through a random O_EXCL temporary.
    let write = |d: &Path| -> std::io::Result<()> {
        crate::sys::hostfs::open_dir_nofollow(d)?
            .create_subdir("hooks", crate::sys::hostfs::DIR_MODE)?
            .write_atomic("hooks.json", &text)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if fin.is_dir() && write(&fin).is_ok() {
            return;
        }
        // Not renamed yet: write into the temporary directory too, so the
        // rename carries the results along.
        let _ = tmp.is_dir() && write(tmp).is_ok();
        if std::time::Instant::now() >= deadline {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl WindowHook for UserHooks {
    fn name(&self) -> &'static str {
        "hooks"
    }

    fn on_window_start(&mut self, w: &WindowInfo, target: &Target) -> Result<()> {
        let Some(cmd) = self.on_start.clone() else {
            return Ok(());
        };
        let env = hook_env(w, target, "start", w.start_ts_ns);
        let log = w.dir.join("hooks").join("on-window-start.log");
        let (timeout, ts) = (self.timeout, w.start_ts_ns);
        self.running = Some(
            std::thread::Builder::new()
                .name("hook-window-start".into())
                .spawn(move || run_hook("on-window-start", &cmd, &env, timeout, &log, ts))?,
        );
        Ok(())
    }

    fn on_window_end(&mut self, w: &WindowInfo, target: &Target) -> Result<Value> {
        // A window no boundary closed (interrupt, exit) ends now.
        let end_ts = if w.end_ts_ns > 0 {
            w.end_ts_ns
        } else {
            monotonic_ns()
        };
        let start = self.running.take();
        let start_cmd = self.on_start.clone().unwrap_or_default();
        let end = self
            .on_end
            .clone()
            .map(|cmd| (cmd, hook_env(w, target, "end", end_ts)));
        let (timeout, dir) = (self.timeout, w.dir.clone());
        // (result, abandoned): whoever comes second decides where it goes.
        let slot = std::sync::Arc::new((
            std::sync::Mutex::new((None::<Value>, false)),
            std::sync::Condvar::new(),
        ));
        let slot2 = slot.clone();
        // Off the event loop: wait for the start hook, then run the end hook.
        let h = std::thread::Builder::new().name("hook-window-end".into()).spawn(move || {
            let start = start.map(|h| h.join().unwrap_or_else(|_| failed_run("on-window-start", &start_cmd, "hook thread panicked")));
            let end = end.map(|(cmd, env)| {
                run_hook("on-window-end", &cmd, &env, timeout, &dir.join("hooks").join("on-window-end.log"), end_ts)
            });
            let v = json!({"on_window_start": start, "on_window_end": end, "timeout_s": timeout.as_secs_f64()});
            let mut g = slot2.0.lock().unwrap();
            if g.1 {
                drop(g);
                // on_window_end already returned: the results go next to meta.json.
                write_late(&dir, &v);
            } else {
                g.0 = Some(v);
                slot2.1.notify_all();
            }
        })?;
        let deadline = std::time::Instant::now() + self.wait;
        let mut g = slot.0.lock().unwrap();
        loop {
            if let Some(v) = g.0.take() {
                drop(g);
                let _ = h.join();
                return Ok(v);
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                g.1 = true;
                drop(g);
                self.finishing.push(h);
                return Ok(json!({
                    "pending": true,
                    "waited_s": self.wait.as_secs_f64(),
                    "results_file": final_dir(&w.dir).join("hooks/hooks.json"),
                    "timeout_s": self.timeout.as_secs_f64(),
                }));
            }
            g = slot.1.wait_timeout(g, deadline - now).unwrap().0;
        }
    }

    fn shutdown(&mut self, _target: &Target) -> Result<()> {
        if let Some(h) = self.running.take() {
            let _ = h.join();
        }
        for h in self.finishing.drain(..) {
            let _ = h.join();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hook log is a new file reached without following links: a symlink
    /// planted at its name is not written through (the hook's output is
    /// dropped and the error recorded). Strings from the target reach the
    /// command only as environment values, which the shell does not run.
    #[test]
    fn hook_log_never_through_a_link_and_target_strings_stay_data() {
        let base = crate::output::tests_support::tempdir("hooks-log");
        let victim = base.join("victim");
        std::fs::write(&victim, "keep").unwrap();
        std::fs::create_dir(base.join("hooks")).unwrap();
        let log = base.join("hooks/on-window-start.log");
        std::os::unix::fs::symlink(&victim, &log).unwrap();
        let run = run_hook(
            "on-window-start",
            "echo written",
            &[],
            Duration::from_secs(10),
            &log,
            0,
        );
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        assert!(
            run.error.as_deref().unwrap_or("").contains("creating"),
            "{run:?}"
        );

        let log2 = base.join("hooks/on-window-end.log");
        let pwned = base.join("pwned");
        let hostile = format!(
            "c1; touch {} #$(touch {})",
            pwned.display(),
            pwned.display()
        );
        let run = run_hook(
            "on-window-end",
            "printf '%s' \"$DYNPROF_CONTAINER\"",
            &[("DYNPROF_CONTAINER".into(), hostile.clone())],
            Duration::from_secs(10),
            &log2,
            0,
        );
        assert_eq!(run.exit_code, Some(0), "{run:?}");
        assert_eq!(std::fs::read_to_string(&log2).unwrap(), hostile);
        assert!(!pwned.exists());
        let _ = std::fs::remove_dir_all(&base);
    }
}
