//! `--collector msprof`: drives Ascend's `msprof --dynamic=on --pid=N` (attach
//! mode) at the window boundaries.
//!
//! - msprof runs *as the target* ([`crate::sys::exec`]): in its cgroups and
//!   every one of its namespaces, chrooted to its root, with its uid, gids,
//!   capability sets and no_new_privs, never as root; with the target's
//!   environment and its innermost-namespace PID, as the vendor documentation
//!   requires for jobs in containers; through a pty, because it is an
//!   interactive tool.
//! - msprof's `--output` directory is made, checked and listed only through
//!   a descriptor of the target's root ([`crate::sys::targetdir`]), owned by
//!   the target's uid; the default name is unpredictable.
//! - One session is kept across windows: `start` is written at the window's
//!   first boundary, `stop` at its end, `quit` at detach.
//! - msprof's limits (100 start/stop commands per connection, the 30-minute
//!   idle exit) end a session; a supervisor thread reconnects between windows,
//!   so any number of windows can be captured.
//! - The target is never touched: dynprof only ever signals its own msprof.
pub mod locate;
pub mod pty;

use std::{
    collections::BTreeSet,
    io::{Read as _, Write as _},
    path::PathBuf,
    process::Child,
    sync::{Arc, Condvar, Mutex, MutexGuard},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Result, anyhow, bail};
use serde_json::{Value, json};

use super::{WindowHook, WindowInfo};
use crate::{
    sys::{
        creds::NsKind,
        exec::{AsTarget, ExecOptions, command_in_target},
        rootfs::TargetRoot,
        targetdir::{self, Owner},
    },
    target::{Target, env_value},
    types::HostPid,
};

/// CLOCK_MONOTONIC in ns (the clock of the kernel's boundary timestamps).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The collection arguments used when neither `--msprof-args` nor a
/// profiler_config.json gives any (the vendor documentation's example).
pub const DEFAULT_COLLECTION_ARGS: &[&str] =
    &["--model-execution=on", "--runtime-api=on", "--aicpu=on"];

/// Maps torch_npu `profiler_config.json` fields (`activities`,
/// `experimental_config`, `profile_memory`) to msprof collection switches.
pub fn args_from_profiler_config(cfg: &Value) -> Vec<String> {
    let mut a: Vec<String> = Vec::new();
    let acts: Vec<String> = cfg["activities"]
        .as_array()
        .map(|v| {
            v.iter()
                .filter_map(|s| s.as_str().map(str::to_uppercase))
                .collect()
        })
        .unwrap_or_else(|| vec!["CPU".into(), "NPU".into()]);
    let exp = &cfg["experimental_config"];
    if acts.iter().any(|s| s == "CPU") {
        a.push("--ascendcl=on".into());
        a.push("--runtime-api=on".into());
    }
    if acts.iter().any(|s| s == "NPU") {
        let level = exp["profiler_level"].as_str().unwrap_or("Level0");
        a.push(match level {
            "Level1" | "Level2" => "--task-time=l1".into(),
            "Level_none" | "LevelNone" => "--task-time=off".into(),
            _ => "--task-time=l0".into(),
        });
        if level == "Level2" {
            a.push("--aicpu=on".into());
        }
        match exp["aic_metrics"].as_str() {
            None | Some("AiCoreNone") | Some("") => a.push("--ai-core=off".into()),
            Some(m) => {
                a.push("--ai-core=on".into());
                a.push(format!("--aic-metrics={m}"));
            }
        }
        if exp["l2_cache"].as_bool() == Some(true) {
            a.push("--l2=on".into());
        }
    }
    if cfg["profile_memory"].as_bool() == Some(true) {
        a.push("--sys-hardware-mem=on".into());
    }
    if exp["mstx"].as_bool() == Some(true) {
        a.push("--msproftx=on".into());
    }
    if let Some(t) = exp["export_type"]
        .as_array()
        .and_then(|v| v.first())
        .and_then(|v| v.as_str())
    {
        a.push(format!("--type={t}"));
    }
    a
}

/// How the msprof hook is set up (from `VendorArgs`).
#[derive(Clone, Debug)]
pub struct MsprofConfig {
    /// `--msprof PATH` (a path inside the target's filesystem, or a command name).
    pub msprof: Option<String>,
    /// Collection arguments appended after `--output`.
    pub collection_args: Vec<String>,
    /// `--output` as the target sees it; default
    /// `/tmp/dynprof_msprof_<hostpid>_<random>` (made fresh, owned by the job's uid).
    pub output: Option<String>,
    /// Extra `KEY=VALUE`s for msprof's environment.
    pub env: Vec<(String, String)>,
    /// Config-file mode: profiler_config.json, whose `activities` and
    /// `experimental_config` give the collection switches when
    /// `collection_args` is empty. Re-read after every window; a change
    /// reconnects msprof with the new switches before the next window.
    pub profiler_config_path: Option<PathBuf>,
    /// start+stop commands per connection before dynprof reconnects (msprof: 100).
    pub max_commands: u32,
    /// How long to wait for msprof's prompt (at connect and after `stop`).
    pub timeout: Duration,
    /// `--msprof-allow-unconfined`: run msprof even though the job has a
    /// seccomp filter or LSM label dynprof cannot copy.
    pub allow_unconfined: bool,
}

impl Default for MsprofConfig {
    fn default() -> Self {
        Self {
            msprof: None,
            collection_args: Vec::new(),
            output: None,
            env: Vec::new(),
            profiler_config_path: None,
            max_commands: 100,
            timeout: Duration::from_secs(30),
            allow_unconfined: false,
        }
    }
}

/// What msprof printed on one connection.
#[derive(Default)]
struct Output {
    /// (CLOCK_MONOTONIC ns, line)
    lines: Vec<(u64, String)>,
    partial: Vec<u8>,
    prompts: u64,
    eof: bool,
}

impl Output {
    fn feed(&mut self, data: &[u8]) {
        let ts = monotonic_ns();
        self.partial.extend_from_slice(data);
        loop {
            // A prompt is `>` (plus a space) at the start of a line.
            if self.partial.starts_with(b"> ") || self.partial.as_slice() == b">" {
                let n = if self.partial.starts_with(b"> ") {
                    2
                } else {
                    1
                };
                self.partial.drain(..n);
                self.prompts += 1;
                continue;
            }
            let Some(nl) = self.partial.iter().position(|&b| b == b'\n') else {
                break;
            };
            let line: Vec<u8> = self.partial.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line)
                .trim_end_matches(['\n', '\r'])
                .to_string();
            if !line.trim().is_empty() {
                self.lines.push((ts, line));
            }
        }
    }

    fn tail(&self, n: usize) -> Vec<String> {
        self.lines[self.lines.len().saturating_sub(n)..]
            .iter()
            .map(|(_, l)| l.clone())
            .collect()
    }
}

/// One msprof session (one connection to the job's profiling server).
struct Conn {
    seq: u32,
    child: Child,
    /// Process group (= the child's pid: it is a session leader).
    pgid: i32,
    master: std::fs::File,
    out: Arc<Mutex<Output>>,
    reader: Option<JoinHandle<()>>,
    /// start + stop commands written on this connection.
    cmds: u32,
    quit_sent: bool,
    started_ns: u64,
}

impl Conn {
    fn eof(&self) -> bool {
        self.out.lock().unwrap().eof
    }

    /// Writes one command line; returns (ns before the write, ns after it).
    fn write_cmd(&mut self, cmd: &str) -> std::io::Result<(u64, u64)> {
        let line = format!("{cmd}\n");
        let t0 = monotonic_ns();
        self.master.write_all(line.as_bytes())?;
        Ok((t0, monotonic_ns()))
    }

    fn kill(&mut self) {
        // SAFETY: signals our own child's process group (never the target).
        unsafe { libc::kill(-self.pgid, libc::SIGKILL) };
    }

    /// Reaps the child (after EOF, or after killing it). Returns its status.
    fn reap(mut self) -> String {
        let st = match self.child.try_wait() {
            Ok(Some(st)) => st.to_string(),
            _ => {
                let deadline = Instant::now() + Duration::from_secs(2);
                loop {
                    if let Ok(Some(st)) = self.child.try_wait() {
                        break st.to_string();
                    }
                    if Instant::now() > deadline {
                        self.kill();
                        break self.child.wait().map(|s| s.to_string()).unwrap_or_default();
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        };
        drop(self.master);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        st
    }
}

#[derive(Default)]
struct State {
    conn: Option<Conn>,
    seq: u32,
    spawning: bool,
    in_window: bool,
    shutdown: bool,
    /// Reconnects and session ends since the last window's meta.
    events: Vec<Value>,
    /// How to (re)start msprof; replaced when the collection switches change.
    launch: Option<Arc<Launch>>,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Everything needed to (re)start msprof.
struct Launch {
    /// msprof (a path inside the target's root) and its arguments.
    argv: Vec<String>,
    env: Vec<(String, String)>,
    timeout: Duration,
    /// Whom msprof runs as (credentials are re-read at every connection).
    target: HostPid,
    exec: ExecOptions,
    /// start+stop commands per connection (`--msprof-max-commands`).
    max_commands: u32,
}

fn spawn_conn(l: &Launch, seq: u32, shared: &Arc<Shared>) -> Result<Conn> {
    let pty = pty::open().map_err(|e| anyhow!("opening a pty for msprof: {e}"))?;
    let as_target = AsTarget::prepare(l.target, l.exec)
        .map_err(|e| anyhow!("cannot run msprof as PID {}: {e:#}", l.target))?;
    let mut cmd = command_in_target(&l.argv[0])?;
    cmd.args(&l.argv[1..])
        .env_clear()
        .envs(l.env.iter().map(|(k, v)| (k, v)));
    pty::attach_child(&mut cmd, &pty.slave)?;
    let started_ns = monotonic_ns();
    let child = as_target
        .spawn(&mut cmd)
        .map_err(|e| anyhow!("starting {} as PID {}: {e:#}", l.argv[0], l.target))?;
    drop(cmd); // closes our copies of the slave, so EOF comes when msprof exits
    drop(pty.slave);
    let pgid = child.id() as i32;
    let out = Arc::new(Mutex::new(Output::default()));
    let mut rd = pty.master.try_clone()?;
    let (out2, shared2) = (out.clone(), shared.clone());
    let reader = std::thread::Builder::new()
        .name(format!("msprof-pty-{seq}"))
        .spawn(move || {
            let mut buf = [0u8; 4096];
            loop {
                match rd.read(&mut buf) {
                    Ok(0) | Err(_) => break, // EIO once every slave fd is closed
                    Ok(n) => out2.lock().unwrap().feed(&buf[..n]),
                }
                let _g = shared2.lock();
                shared2.cv.notify_all();
            }
            out2.lock().unwrap().eof = true;
            let _g = shared2.lock();
            shared2.cv.notify_all();
        })?;
    let mut conn = Conn {
        seq,
        child,
        pgid,
        master: pty.master,
        out,
        reader: Some(reader),
        cmds: 0,
        quit_sent: false,
        started_ns,
    };
    // Wait for the first prompt: msprof is connected and accepts commands.
    let deadline = Instant::now() + l.timeout;
    let mut g = shared.lock();
    loop {
        let (prompts, eof) = {
            let o = conn.out.lock().unwrap();
            (o.prompts, o.eof)
        };
        if prompts > 0 {
            return Ok(conn);
        }
        if eof || Instant::now() >= deadline {
            drop(g);
            let timed_out = !eof;
            if timed_out {
                conn.kill();
            }
            let tail = conn.out.lock().unwrap().tail(5);
            let st = conn.reap();
            if timed_out {
                bail!(
                    "msprof gave no `>` prompt within {:?} ({}); its output: {:?}",
                    l.timeout,
                    l.argv.join(" "),
                    tail
                );
            }
            bail!(
                "msprof exited before its prompt ({st}); command `{}`; its output: {:?}",
                l.argv.join(" "),
                tail
            );
        }
        g = shared
            .cv
            .wait_timeout(g, Duration::from_millis(50))
            .unwrap()
            .0;
    }
}

/// Ends of sessions between windows are expected (command limit, idle exit):
/// the supervisor reconnects then, off the event loop.
fn supervisor(shared: Arc<Shared>) {
    let mut g = shared.lock();
    loop {
        if g.shutdown {
            return;
        }
        let dead = !g.in_window && !g.spawning && g.conn.as_ref().is_some_and(|c| c.eof());
        if !dead {
            g = shared
                .cv
                .wait_timeout(g, Duration::from_millis(500))
                .unwrap()
                .0;
            continue;
        }
        let Some(launch) = g.launch.clone() else {
            return;
        };
        let old = g.conn.take().expect("checked above");
        let (seq, cmds, quit_sent) = (old.seq, old.cmds, old.quit_sent);
        let tail = old.out.lock().unwrap().tail(3);
        g.spawning = true;
        drop(g);
        let status = old.reap();
        let reason = if quit_sent {
            "dynprof ended it (command limit, or new collection switches)".to_string()
        } else if tail
            .iter()
            .any(|l| l.contains("No collection") || l.to_lowercase().contains("idle"))
        {
            "idle exit".to_string()
        } else if cmds >= launch.max_commands
            || tail.iter().any(|l| l.contains("closed the connection"))
        {
            "command limit".to_string()
        } else {
            format!("msprof exited ({status})")
        };
        let t0 = monotonic_ns();
        let res = spawn_conn(&launch, seq + 1, &shared);
        g = shared.lock();
        g.spawning = false;
        g.seq = seq + 1;
        let ev = match res {
            Ok(c) => {
                g.conn = Some(c);
                json!({"event": "reconnected", "ended_connection": seq, "reason": reason, "output_tail": tail,
                       "new_connection": seq + 1, "reconnect_ns": monotonic_ns() - t0, "at_ns": t0})
            }
            Err(e) => {
                json!({"event": "reconnect_failed", "ended_connection": seq, "reason": reason, "output_tail": tail,
                       "error": format!("{e:#}"), "at_ns": t0})
            }
        };
        log::info!("msprof: {ev}");
        g.events.push(ev);
        shared.cv.notify_all();
    }
}

enum Mode {
    /// Not prepared yet.
    New,
    /// PROFILING_MODE=dynamic missing: msprof cannot attach; skipped.
    Disabled(String),
    /// msprof not found (or cannot be set up): every window is marked incomplete.
    Broken(String),
    Ready,
}

/// Per-window bookkeeping between start and end.
struct Win {
    /// When the scheduler called on_window_start.
    hook_called_ns: u64,
    conn: Option<u32>,
    error: Option<String>,
    start_write_begin_ns: Option<u64>,
    start_written_ns: Option<u64>,
    start_latency_ns: Option<u64>,
    out_from: usize,
    prompts_at_start: u64,
}

pub struct MsprofHook {
    cfg: MsprofConfig,
    mode: Mode,
    shared: Arc<Shared>,
    launch: Option<Arc<Launch>>,
    /// argv up to and including `--output=`; collection switches follow.
    base_argv: Vec<String>,
    args_in_use: Vec<String>,
    supervisor: Option<JoinHandle<()>>,
    found: Option<locate::Found>,
    /// msprof's `--output`: the canonical path inside the target's root.
    output: String,
    /// What the window's links point at: `output` when the target shares
    /// dynprof's mounts and root, else `/proc/<pid>/root/<output>`. Never
    /// opened by dynprof.
    link_base: PathBuf,
    /// The target's root, held open: the output dir is listed through it.
    root: Option<TargetRoot>,
    /// Names of the output dir's PROF_* entries already attributed.
    known: BTreeSet<String>,
    win: Option<Win>,
    pid_arg: u32,
    /// Whom msprof runs as (for msprof_meta.json).
    runs_as: Option<Value>,
}

/// 16 random hex digits, so that no other user can create msprof's output
/// directory in advance.
fn random_suffix() -> Result<String> {
    let name = crate::sys::hostfs::random_name("");
    Ok(name.trim_start_matches('.').to_string())
}

/// True when `/proc/<pid>/root` is dynprof's own `/`.
fn same_root(pid: HostPid) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    match (
        std::fs::metadata("/"),
        std::fs::metadata(format!("/proc/{pid}/root")),
    ) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

impl MsprofHook {
    pub fn new(cfg: MsprofConfig) -> Self {
        Self {
            cfg,
            mode: Mode::New,
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                cv: Condvar::new(),
            }),
            launch: None,
            base_argv: Vec::new(),
            args_in_use: Vec::new(),
            supervisor: None,
            found: None,
            output: String::new(),
            link_base: PathBuf::new(),
            root: None,
            known: BTreeSet::new(),
            win: None,
            pid_arg: 0,
            runs_as: None,
        }
    }

    /// True when msprof was skipped because the job lacks PROFILING_MODE=dynamic.
    pub fn is_disabled(&self) -> bool {
        matches!(self.mode, Mode::Disabled(_))
    }

    fn setup(&mut self, target: &Target) -> Result<()> {
        let env = target.environ().unwrap_or_default();
        let root = TargetRoot::open(&target.root())
            .map_err(|e| anyhow!("opening {}: {e}", target.root().display()))?;
        let found =
            locate::locate(&root, self.cfg.msprof.as_deref(), &env).map_err(|e| anyhow!(e))?;
        let exec = ExecOptions {
            allow_unconfined: self.cfg.allow_unconfined,
        };
        // Refuse now, clearly, what cannot be reproduced (seccomp, LSM, ids).
        let plan = AsTarget::prepare(target.host_pid, exec)
            .map_err(|e| anyhow!("cannot run msprof as PID {}: {e:#}", target.host_pid))?;
        let c = &plan.creds.creds;
        let owner = Owner {
            uid: c.uids.effective,
            gid: c.gids.effective,
        };
        self.runs_as = Some(json!({
            "host_uid": c.uids, "host_gid": c.gids, "groups": c.groups,
            "uid_in_target_userns": plan.inner_uid(), "gid_in_target_userns": plan.inner_gid(),
            "caps": c.caps, "no_new_privs": c.no_new_privs, "seccomp": c.seccomp,
            "namespaces_entered": plan.creds.foreign_ns, "cgroups": plan.creds.cgroups,
            "lsm_label_not_reproduced": plan.creds.lsm_label,
        }));
        let own_mounts = !plan.creds.foreign_ns.contains(&NsKind::Mnt);
        drop(plan);
        self.pid_arg = target.inner_pid().0;
        let (out, fresh) = match &self.cfg.output {
            Some(o) => (o.clone(), false),
            None => (
                format!(
                    "/tmp/dynprof_msprof_{}_{}",
                    target.host_pid,
                    random_suffix()?
                ),
                true,
            ),
        };
        let dir = targetdir::ensure_dir(&root, &out, owner, fresh)
            .map_err(|e| anyhow!("msprof's --output: {e}"))?;
        self.output = dir.path;
        // Only a process with dynprof's mounts and root sees the same files
        // under the same path (a container may mount its own /tmp).
        self.link_base = if own_mounts && same_root(target.host_pid) {
            PathBuf::from(&self.output)
        } else {
            target.host_path(&self.output)
        };
        self.known = targetdir::list_subdirs(&root, &self.output, "PROF_")
            .map_err(|e| anyhow!("listing msprof's --output {}: {e}", self.output))?
            .into_iter()
            .collect();
        self.root = Some(root);

        let mut argv: Vec<String> = Vec::new();
        argv.push(found.path.clone());
        argv.push("--dynamic=on".into());
        argv.push(format!("--pid={}", self.pid_arg));
        argv.push(format!("--output={}", self.output));
        self.base_argv = argv;
        self.args_in_use = self.collection_args();
        // The job's environment (PATH, LD_LIBRARY_PATH, ASCEND_*), minus what
        // only the job itself may carry.
        let mut menv: Vec<(String, String)> = env
            .into_iter()
            .filter(|(k, _)| k != "PROFILING_MODE" && k != "PROFILING_OPTIONS")
            .collect();
        if !menv.iter().any(|(k, _)| k == "TERM") {
            menv.push(("TERM".into(), "dumb".into()));
        }
        if !menv.iter().any(|(k, _)| k == "PATH") {
            menv.push((
                "PATH".into(),
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            ));
        }
        for (k, v) in &self.cfg.env {
            menv.retain(|(kk, _)| kk != k);
            menv.push((k.clone(), v.clone()));
        }
        self.found = Some(found);
        let mut argv = self.base_argv.clone();
        argv.extend(self.args_in_use.iter().cloned());
        self.set_launch(Launch {
            argv,
            env: menv,
            timeout: self.cfg.timeout,
            target: target.host_pid,
            exec,
            max_commands: self.cfg.max_commands,
        });
        Ok(())
    }

    fn set_launch(&mut self, l: Launch) {
        let l = Arc::new(l);
        self.launch = Some(l.clone());
        self.shared.lock().launch = Some(l);
    }

    /// The collection switches: `--msprof-args`, else profiler_config.json's
    /// (config-file mode), else the vendor documentation's example.
    pub fn collection_args(&self) -> Vec<String> {
        if !self.cfg.collection_args.is_empty() {
            return self.cfg.collection_args.clone();
        }
        if let Some(p) = &self.cfg.profiler_config_path
            // The job's user writes this file: no link, FIFO or device, 1 MiB at most.
            && let Some(v) = crate::sys::hostfs::read_path_capped(
                p,
                crate::trigger::config_file::MAX_CONFIG_BYTES,
            )
            .ok()
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        {
            let a = args_from_profiler_config(&v);
            if !a.is_empty() {
                return a;
            }
        }
        DEFAULT_COLLECTION_ARGS
            .iter()
            .map(|s| s.to_string())
            .collect()
    }

    /// Config-file mode: when profiler_config.json now asks for other
    /// switches, end the session; the next one starts with them.
    fn follow_config(&mut self) -> Option<Value> {
        self.cfg.profiler_config_path.as_ref()?;
        let now = self.collection_args();
        if now == self.args_in_use {
            return None;
        }
        let old = std::mem::replace(&mut self.args_in_use, now.clone());
        let mut argv = self.base_argv.clone();
        argv.extend(now.iter().cloned());
        let l = self.launch.as_ref()?;
        self.set_launch(Launch {
            argv,
            env: l.env.clone(),
            timeout: l.timeout,
            target: l.target,
            exec: l.exec,
            max_commands: l.max_commands,
        });
        let mut g = self.shared.lock();
        if let Some(c) = g.conn.as_mut()
            && !c.eof()
            && !c.quit_sent
        {
            let _ = c.write_cmd("quit");
            c.quit_sent = true;
        }
        self.shared.cv.notify_all();
        Some(json!({"event": "collection_args_changed", "from": old, "to": now}))
    }

    /// Makes sure a live connection exists (waits for a reconnect under way,
    /// or connects now) and marks the window open, so the supervisor leaves
    /// the connection alone. Returns its sequence number.
    fn ensure_conn(&mut self) -> Result<u32> {
        let launch = self
            .launch
            .clone()
            .ok_or_else(|| anyhow!("msprof is not set up"))?;
        let deadline = Instant::now() + self.cfg.timeout + Duration::from_secs(5);
        let mut g = self.shared.lock();
        loop {
            if g.spawning {
                if Instant::now() >= deadline {
                    bail!(
                        "msprof reconnect still under way after {:?}",
                        self.cfg.timeout
                    );
                }
                g = self
                    .shared
                    .cv
                    .wait_timeout(g, Duration::from_millis(20))
                    .unwrap()
                    .0;
                continue;
            }
            if let Some(c) = &g.conn
                && !c.eof()
                && !c.quit_sent
            {
                let seq = c.seq;
                g.in_window = true;
                return Ok(seq);
            }
            break;
        }
        // Dead, ending (quit sent at the command limit) or none: connect now
        // (at the boundary this costs latency, which is recorded).
        let old = g.conn.take();
        let seq = g.seq + 1;
        g.spawning = true;
        drop(g);
        let mut ended = None;
        if let Some(old) = old {
            let (s, q) = (old.seq, old.quit_sent);
            let st = old.reap(); // waits for the exit (quit was sent), then kills
            ended = Some(json!({"ended_connection": s, "status": st, "quit_sent": q}));
        }
        let t0 = monotonic_ns();
        let res = spawn_conn(&launch, seq, &self.shared);
        let mut g = self.shared.lock();
        g.spawning = false;
        g.seq = seq;
        self.shared.cv.notify_all();
        match res {
            Ok(c) => {
                g.conn = Some(c);
                g.in_window = true;
                g.events
                    .push(json!({"event": "connected", "connection": seq,
                                      "previous": ended, "connect_ns": monotonic_ns() - t0}));
                Ok(seq)
            }
            Err(e) => {
                g.events.push(json!({"event": "connect_failed", "previous": ended, "error": format!("{e:#}")}));
                Err(e)
            }
        }
    }

    /// The PROF_* directories msprof made during the window, listed through
    /// the target's root descriptor; each gets a symlink in the window.
    fn link_dirs(&mut self, w: &WindowInfo, target: &Target) -> (Vec<Value>, Option<String>) {
        let Some(root) = &self.root else {
            return (Vec::new(), None);
        };
        let now: BTreeSet<String> = match targetdir::list_subdirs(root, &self.output, "PROF_") {
            Ok(v) => v.into_iter().collect(),
            Err(e) => {
                return (
                    Vec::new(),
                    Some(format!("listing msprof's --output {}: {e}", self.output)),
                );
            }
        };
        let new: Vec<String> = now.difference(&self.known).cloned().collect();
        self.known = now;
        let link_dir = w.dir.join("msprof");
        let mut out = Vec::new();
        for name in new {
            let in_target = format!("{}/{}", self.output.trim_end_matches('/'), name);
            // Outside a container the plain path outlives the target; inside
            // one, /proc/PID/root is the only way in from the host. The link
            // is for the reader; dynprof itself never follows it.
            let link_to = self.link_base.join(&name);
            let link = link_dir.join(&name);
            let linked = std::fs::create_dir_all(&link_dir)
                .and_then(|_| std::os::unix::fs::symlink(&link_to, &link))
                .map_err(|e| e.to_string());
            out.push(json!({
                "name": name,
                "path_in_target": in_target,
                "host_path": target.host_path(&in_target),
                // Relative to the window directory (which is renamed when
                // the window is finished).
                "link": linked.as_ref().ok().map(|_| format!("msprof/{name}")),
                "link_error": linked.err(),
            }));
        }
        (out, None)
    }
}

impl WindowHook for MsprofHook {
    fn name(&self) -> &'static str {
        "msprof"
    }

    fn prepare(&mut self, target: &Target) -> Result<()> {
        let env = target.environ().ok();
        let mode = env.as_deref().and_then(|e| env_value(e, "PROFILING_MODE"));
        if env.is_some() && mode != Some("dynamic") {
            let msg = format!(
                "msprof attach needs the job to be started with PROFILING_MODE=dynamic in its environment \
                 (PID {} has {}); it cannot be added later. Skipping --collector msprof and continuing with \
                 the built-in collectors. To use msprof next time: `export PROFILING_MODE=dynamic` before \
                 launching the job",
                target.host_pid,
                mode.map_or("no PROFILING_MODE".to_string(), |m| format!(
                    "PROFILING_MODE={m}"
                ))
            );
            eprintln!("dynprof: {msg}");
            self.mode = Mode::Disabled(msg);
            return Ok(());
        }
        if let Err(e) = self.setup(target) {
            let msg = format!("{e:#}");
            eprintln!(
                "dynprof: error: --collector msprof: {msg}; windows will be kept but marked incomplete"
            );
            self.mode = Mode::Broken(msg);
            return Ok(());
        }
        self.mode = Mode::Ready;
        // Connect now, so the first `start` costs only a write.
        match self.ensure_conn() {
            Ok(_) => {}
            Err(e) => eprintln!("dynprof: error: msprof: {e:#} (will retry at the first window)"),
        }
        self.shared.lock().in_window = false;
        let shared = self.shared.clone();
        self.supervisor = Some(
            std::thread::Builder::new()
                .name("msprof-supervisor".into())
                .spawn(move || supervisor(shared))?,
        );
        Ok(())
    }

    fn on_window_start(&mut self, w: &WindowInfo, _target: &Target) -> Result<()> {
        if !matches!(self.mode, Mode::Ready) {
            return Ok(());
        }
        let called = monotonic_ns();
        let mut win = Win {
            hook_called_ns: called,
            conn: None,
            error: None,
            start_write_begin_ns: None,
            start_written_ns: None,
            start_latency_ns: None,
            out_from: 0,
            prompts_at_start: 0,
        };
        match self.ensure_conn() {
            Err(e) => win.error = Some(format!("msprof unavailable at window start: {e:#}")),
            Ok(seq) => {
                let mut g = self.shared.lock();
                let c = g.conn.as_mut().expect("ensured");
                {
                    let o = c.out.lock().unwrap();
                    win.out_from = o.lines.len();
                    win.prompts_at_start = o.prompts;
                }
                match c.write_cmd("start") {
                    Ok((t0, t)) => {
                        c.cmds += 1;
                        win.start_write_begin_ns = Some(t0);
                        win.start_written_ns = Some(t);
                        // `start` answers the first recorded step's boundary.
                        win.start_latency_ns =
                            (w.start_ts_ns > 0).then(|| t.saturating_sub(w.start_ts_ns));
                    }
                    Err(e) => win.error = Some(format!("writing `start` to msprof: {e}")),
                }
                win.conn = Some(seq);
            }
        }
        if let Some(e) = &win.error {
            log::warn!("msprof: window {}: {e}", w.id);
        }
        self.win = Some(win);
        Ok(())
    }

    fn on_window_end(&mut self, w: &WindowInfo, target: &Target) -> Result<Value> {
        match &self.mode {
            Mode::Disabled(reason) => return Ok(json!({"enabled": false, "reason": reason})),
            Mode::Broken(e) => bail!("msprof: {e}"),
            Mode::New => bail!("msprof: not prepared"),
            Mode::Ready => {}
        }
        let Some(win) = self.win.take() else {
            bail!("msprof: window end without a start")
        };
        let mut error = win.error.clone();
        let mut stop_written_ns = None;
        let mut stop_ack_ns = None;
        let mut lines: Vec<(u64, String)> = Vec::new();
        let mut cmds = 0;
        let mut conn_started_ns = None;
        let mut quit_for_limit = false;
        if error.is_none() {
            let mut g = self.shared.lock();
            let timeout = self.cfg.timeout;
            let max = self.cfg.max_commands;
            match g.conn.as_mut() {
                None => error = Some("msprof session vanished during the window".into()),
                Some(c) if c.eof() => {
                    let tail = c.out.lock().unwrap().tail(5);
                    let status = c.child.try_wait().ok().flatten().map(|s| s.to_string());
                    error = Some(format!(
                        "msprof exited unexpectedly during the window (connection {}, status {}); last output: {:?}",
                        c.seq,
                        status.as_deref().unwrap_or("unknown"),
                        tail
                    ));
                }
                Some(c) => match c.write_cmd("stop") {
                    Err(e) => error = Some(format!("writing `stop` to msprof: {e}")),
                    Ok((_, t)) => {
                        c.cmds += 1;
                        stop_written_ns = Some(t);
                        // The stop is done when the prompt returns (start's
                        // prompt + stop's), or msprof ends the session.
                        let want = win.prompts_at_start + 2;
                        let out = c.out.clone();
                        let deadline = Instant::now() + timeout;
                        loop {
                            let (p, eof) = {
                                let o = out.lock().unwrap();
                                (o.prompts, o.eof)
                            };
                            if p >= want {
                                stop_ack_ns = Some(monotonic_ns());
                                break;
                            }
                            if eof {
                                let c = g.conn.as_ref().expect("still there");
                                if c.cmds < max
                                    && !out
                                        .lock()
                                        .unwrap()
                                        .lines
                                        .iter()
                                        .any(|(_, l)| l.contains("closed the connection"))
                                {
                                    error = Some(format!(
                                        "msprof exited right after `stop` (connection {}); last output: {:?}",
                                        c.seq,
                                        out.lock().unwrap().tail(5)
                                    ));
                                }
                                break;
                            }
                            if Instant::now() >= deadline {
                                error = Some(format!(
                                    "msprof did not acknowledge `stop` within {timeout:?}"
                                ));
                                break;
                            }
                            g = self
                                .shared
                                .cv
                                .wait_timeout(g, Duration::from_millis(20))
                                .unwrap()
                                .0;
                        }
                    }
                },
            }
            if let Some(c) = g.conn.as_mut() {
                cmds = c.cmds;
                conn_started_ns = Some(c.started_ns);
                lines = c
                    .out
                    .lock()
                    .unwrap()
                    .lines
                    .get(win.out_from..)
                    .map(<[_]>::to_vec)
                    .unwrap_or_default();
                // Proactively end a connection that has reached msprof's limit;
                // the supervisor reconnects before the next window.
                if c.cmds + 2 > max && !c.eof() {
                    let _ = c.write_cmd("quit");
                    c.quit_sent = true;
                    quit_for_limit = true;
                }
            }
            g.in_window = false;
            self.shared.cv.notify_all();
        } else {
            self.shared.lock().in_window = false;
            self.shared.cv.notify_all();
        }
        let args_used: Vec<String> = self.args_in_use.clone();
        let args_change = self.follow_config();
        let (dirs, list_error) = self.link_dirs(w, target);
        if error.is_none() {
            error = list_error;
        }
        let events = std::mem::take(&mut self.shared.lock().events);
        let errors: Vec<&String> = lines
            .iter()
            .map(|(_, l)| l)
            .filter(|l| l.contains("ERROR"))
            .collect();
        let found = self.found.as_ref();
        let meta = json!({
            "enabled": true,
            "msprof": found.map(|f| &f.path),
            "msprof_found_via": found.map(|f| &f.via),
            "command": self.launch.as_ref().map(|l| l.argv.join(" ")),
            "pid_arg": self.pid_arg,
            "output_in_target": self.output,
            "output_host": self.link_base,
            "runs_as": self.runs_as,
            "connection": win.conn,
            "commands_in_connection": cmds,
            "connection_started_ns": conn_started_ns,
            "boundary_ts_ns": w.start_ts_ns,
            // boundary -> hook called is the event loop's share of the
            // latency; hook called -> written is msprof's (a reconnect).
            "hook_called_ns": win.hook_called_ns,
            "start_write_begin_ns": win.start_write_begin_ns,
            "start_written_ns": win.start_written_ns,
            "start_latency_ns": win.start_latency_ns,
            "stop_written_ns": stop_written_ns,
            "stop_ack_ns": stop_ack_ns,
            "prof_dirs": dirs,
            "output": lines.iter().map(|(t, l)| json!([t, l])).collect::<Vec<_>>(),
            // msprof documents ERROR lines after repeated start/stop as normal.
            "errors_recorded_as_normal": errors,
            "session_events": events,
            "quit_for_command_limit": quit_for_limit,
            "collection_args": args_used,
            "collection_args_change": args_change,
            "error": error,
        });
        if let Some(e) = error {
            // The window itself is kept; meta.json marks it incomplete.
            let _ = std::fs::write(
                w.dir.join("msprof_meta.json"),
                serde_json::to_vec_pretty(&meta).unwrap_or_default(),
            );
            bail!("msprof: {e} (the window is kept; msprof details in msprof_meta.json)");
        }
        Ok(meta)
    }

    fn shutdown(&mut self, _target: &Target) -> Result<()> {
        let conn = {
            let mut g = self.shared.lock();
            g.shutdown = true;
            self.shared.cv.notify_all();
            // Wait out a reconnect under way so its session is quit too.
            let deadline = Instant::now() + self.cfg.timeout;
            while g.spawning && Instant::now() < deadline {
                g = self
                    .shared
                    .cv
                    .wait_timeout(g, Duration::from_millis(20))
                    .unwrap()
                    .0;
            }
            g.conn.take()
        };
        if let Some(s) = self.supervisor.take() {
            let _ = s.join();
        }
        if let Some(mut c) = conn {
            if !c.eof() {
                let _ = c.write_cmd("quit");
                let deadline = Instant::now() + Duration::from_secs(5);
                while !c.eof() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            let st = c.reap();
            log::info!("msprof: quit ({st})");
        }
        Ok(())
    }
}

impl Drop for MsprofHook {
    fn drop(&mut self) {
        // Never leave our msprof running (only ours: its own process group).
        let mut g = self.shared.lock();
        g.shutdown = true;
        if let Some(mut c) = g.conn.take() {
            if !c.eof() {
                let _ = c.write_cmd("quit");
                std::thread::sleep(Duration::from_millis(50));
                if !c.eof() {
                    c.kill();
                }
            }
            drop(g);
            c.reap();
        }
        self.shared.cv.notify_all();
    }
}
