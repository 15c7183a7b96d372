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
//!
//! | module | job |
//! |---|---|
//! | `config` | collection arguments: `--msprof-args`, a profiler_config.json, the default |
//! | `session` | one msprof process on a pty, and the supervisor that reconnects |
//! | `hook` | the [`WindowHook`]: start/stop at the boundaries, msprof's `PROF_*` linked into the window |
//! | `locate` | finding msprof in the target's root |
//! | `pty` | the pty msprof talks through |
mod config;
mod hook;
pub mod locate;
pub mod pty;
mod session;

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
        hostfs,
        rootfs::TargetRoot,
        targetdir::{self, Owner},
    },
    target::{Target, env_value},
    types::HostPid,
};

/// The window's subdirectory holding links to msprof's `PROF_*` directories.
const LINK_DIR: &str = "msprof";
/// msprof's details when a window fails, next to meta.json.
const META_FILE: &str = "msprof_meta.json";

/// Kept here for the other vendor collectors and the tests.
pub use crate::sys::clock::monotonic_ns;
pub use config::{DEFAULT_COLLECTION_ARGS, MsprofConfig, args_from_profiler_config};
use session::{Launch, Shared, State, spawn_conn, supervisor};

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
                crate::sys::hostfs::MAX_CONFIG_BYTES,
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
        let mut out = Vec::new();
        for name in new {
            let in_target = format!("{}/{}", self.output.trim_end_matches('/'), name);
            // Outside a container the plain path outlives the target; inside
            // one, /proc/PID/root is the only way in from the host. The link
            // is for the reader; dynprof itself never follows it.
            let link_to = self.link_base.join(&name);
            // Like every window file: the window directory is reached
            // without following links, the link made relative to it.
            let linked = hostfs::open_dir_nofollow(&w.dir)
                .and_then(|d| d.create_subdir(LINK_DIR, hostfs::DIR_MODE))
                .and_then(|d| d.symlink(&link_to, &name))
                .map_err(|e| e.to_string());
            out.push(json!({
                "name": name,
                "path_in_target": in_target,
                "host_path": target.host_path(&in_target),
                // Relative to the window directory (which is renamed when
                // the window is finished).
                "link": linked.as_ref().ok().map(|_| format!("{LINK_DIR}/{name}")),
                "link_error": linked.err(),
            }));
        }
        (out, None)
    }
}
