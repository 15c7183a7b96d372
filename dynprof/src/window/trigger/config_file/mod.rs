//! `--config-dir DIR`: the torch_npu `dynamic_profile` trigger.
//!
//! On start, `DIR/profiler_config.json` is written as a template with the
//! torch_npu schema and defaults (unless it exists). A watcher thread
//! (inotify on DIR; polling once a second if inotify is unavailable) sends a
//! [`ConfigChanged`] over the session's command channel for every save; the
//! scheduler applies a valid change at the next boundary, or when the
//! current window ends (the last change wins). Invalid JSON or fields are
//! logged with the reason and the last good config stays in force.
//!
//! Logs, as torch_npu writes them: `DIR/log/dp_<host>_<pid>_rank_<r>.log`
//! (INFO/WARNING/ERROR) and `DIR/log/monitor_dp_<host>_<pid>_rank_<r>.log`
//! (whether each change took effect; when dynprof ended). Both rotate by
//! size to `.1`. `<pid>` is the target's host PID, `<r>` its RANK (-1 when
//! unset).
//!
//! `parse`: the JSON and its fields; `logs`: the rotating logs; `watch`:
//! inotify and reading the file through the directory descriptor.
use std::{
    collections::BTreeSet,
    ffi::CString,
    fs,
    io::Write as _,
    os::unix::ffi::OsStrExt as _,
    path::{Component, Path, PathBuf},
    time::{Duration, SystemTime},
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Map, Value, json};
use tokio::sync::mpsc::UnboundedSender;

mod logs;
mod parse;
#[cfg(test)]
mod tests;
mod watch;

pub use logs::RotatingLog;
use logs::hostname;
pub use parse::{Parsed, key_paths, parse, template};
use watch::{inotify_wait, inotify_watch, read_config, stamp};

use super::{PlanRequest, SessionCommand, Source};
use crate::{
    sys::hostfs::{self, HostDir, escape_untrusted},
    target::Target,
    window::Plan,
};

pub const CONFIG_FILE: &str = "profiler_config.json";

/// Rotate a log when it grows past this many bytes
/// (`DYNPROF_CONFIG_LOG_MAX_BYTES` overrides it).
pub const LOG_MAX_BYTES: u64 = 10 * 1024 * 1024;

/// A file change seen by the watcher: the new content, or why it could not be read.
#[derive(Clone, Debug)]
pub struct ConfigChanged {
    pub content: std::result::Result<String, String>,
}

/// DIR's own name may hold only `[A-Za-z0-9_-]`, and no component of its
/// absolute path may be a symlink (the torch_npu PROF_CONFIG_PATH rules).
pub fn check_dir(dir: &Path) -> Result<PathBuf> {
    let abs = if dir.is_absolute() {
        dir.to_path_buf()
    } else {
        std::env::current_dir()?.join(dir)
    };
    let mut clean = PathBuf::new();
    for c in abs.components() {
        match c {
            Component::ParentDir => {
                clean.pop();
            }
            Component::CurDir => {}
            c => clean.push(c),
        }
    }
    let name = clean.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        bail!(
            "--config-dir {}: the directory name `{name}` may contain only letters, digits, `_` and `-` (torch_npu's PROF_CONFIG_PATH rule)",
            dir.display()
        );
    }
    let mut p = PathBuf::new();
    for c in clean.components() {
        p.push(c);
        match fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => bail!(
                "--config-dir {}: {} is a symbolic link; symlinks are not allowed anywhere in the path (torch_npu's PROF_CONFIG_PATH rule)",
                dir.display(),
                p.display()
            ),
            Ok(m) if !m.is_dir() => bail!(
                "--config-dir {}: {} is not a directory",
                dir.display(),
                p.display()
            ),
            Ok(_) => {}
            Err(_) => break, // not created yet; nothing below can be a symlink
        }
    }
    Ok(clean)
}

/// Whose trigger it is: log names, the greeting, the rank filter.
struct Who {
    stem: String,
    what: String,
    rank: Option<u32>,
    job: bool,
}

/// The config-file trigger's state (owned by the scheduler, or in job mode
/// by the job's controller).
pub struct ConfigFileTrigger {
    pub dir: PathBuf,
    pub path: PathBuf,
    /// DIR, held open: every file in it is reached through this descriptor.
    dir_fd: HostDir,
    log: RotatingLog,
    monitor: RotatingLog,
    rank: Option<u32>,
    /// Job mode: one trigger serves every rank, so `is_rank`/`rank_list`
    /// is not checked here; the job applies it ([`Self::rank_filter`]).
    job: bool,
    /// Default output directory relative `prof_dir`s are resolved against.
    output: PathBuf,
    last_good: Option<Parsed>,
    warned: BTreeSet<String>,
    changes: u64,
    /// The file as setup left it: a save after that (even one before the
    /// watcher thread runs) is a change.
    initial: Option<(SystemTime, u64, String)>,
}

impl ConfigFileTrigger {
    /// Checks DIR, creates it and its `log/`, writes the template if the
    /// file does not exist yet.
    pub fn setup(dir: &Path, target: &Target, output: &Path) -> Result<Self> {
        let rank = target.rank.map(i64::from).unwrap_or(-1);
        let who = Who {
            stem: format!("dp_{}_{}_rank_{rank}.log", hostname(), target.host_pid),
            what: format!("target PID {} (rank {rank})", target.host_pid),
            rank: target.rank,
            job: false,
        };
        Self::setup_for(dir, who, output)
    }

    /// The trigger of a whole job (`attach --job`): one file for every rank,
    /// its logs named after the first rank's host PID (`dp_<host>_<pid>_job.log`).
    pub fn setup_job(dir: &Path, first_pid: u32, ranks: usize, output: &Path) -> Result<Self> {
        let who = Who {
            stem: format!("dp_{}_{first_pid}_job.log", hostname()),
            what: format!("a job of {ranks} rank(s) (first PID {first_pid})"),
            rank: None,
            job: true,
        };
        Self::setup_for(dir, who, output)
    }

    /// The `rank_list` of the change last accepted, when `is_rank` is set
    /// (job mode: the job restricts the window to those ranks).
    pub fn rank_filter(&self) -> Option<&[i64]> {
        self.last_good
            .as_ref()
            .filter(|p| p.is_rank)
            .map(|p| p.rank_list.as_slice())
    }

    fn setup_for(dir: &Path, who: Who, output: &Path) -> Result<Self> {
        let dir = check_dir(dir)?;
        // From here on, DIR is reached through one descriptor, created and
        // opened with no symlink anywhere in its path (the job's user owns
        // DIR and may swap anything inside it at any time).
        let dir_fd = hostfs::create_dir_all_nofollow(&dir, 0o755).with_context(|| {
            format!(
                "creating {} (symlinks are not allowed in its path)",
                dir.display()
            )
        })?;
        let log_dir = dir_fd
            .create_subdir("log", 0o755)
            .with_context(|| format!("opening {}/log (a symlink is refused)", dir.display()))?;
        let log = RotatingLog::new(&log_dir, &who.stem)?;
        let monitor = RotatingLog::new(&log_dir, &format!("monitor_{}", who.stem))?;
        let path = dir.join(CONFIG_FILE);
        let mut t = Self {
            dir: dir.clone(),
            path: path.clone(),
            dir_fd,
            log,
            monitor,
            rank: who.rank,
            job: who.job,
            output: output.to_path_buf(),
            last_good: None,
            warned: BTreeSet::new(),
            changes: 0,
            initial: None,
        };
        let text = serde_json::to_string_pretty(&template())? + "\n";
        if t.write_template(text.as_bytes())? {
            t.info(&format!("wrote the template {}", path.display()));
        } else {
            t.info(&format!(
                "{} exists; it takes effect when it is next saved",
                path.display()
            ));
        }
        t.initial = stamp(&t.dir_fd);
        let hello = format!(
            "dynprof {} (PID {}) watching {} for {}",
            env!("CARGO_PKG_VERSION"),
            std::process::id(),
            path.display(),
            who.what,
        );
        t.info(&hello);
        t.monitor.write("INFO", &hello);
        Ok(t)
    }

    /// Writes the template unless a file is already there: a random
    /// O_EXCL|O_NOFOLLOW temporary in DIR, handed to DIR's owner (who edits
    /// it), then renamed to `profiler_config.json` without replacing
    /// anything. Returns whether it was written.
    fn write_template(&self, bytes: &[u8]) -> Result<bool> {
        let d = &self.dir_fd;
        if rustix::fs::statat(d, CONFIG_FILE, rustix::fs::AtFlags::SYMLINK_NOFOLLOW).is_ok() {
            return Ok(false);
        }
        let (tmp, mut f) = d
            .create_temp_file(CONFIG_FILE)
            .with_context(|| format!("creating a temporary file in {}", self.dir.display()))?;
        let st = d.stat()?;
        let r = (|| -> std::io::Result<bool> {
            f.write_all(bytes)?;
            rustix::fs::fchmod(&f, rustix::fs::Mode::from_raw_mode(0o644))?;
            if st.st_uid != rustix::process::geteuid().as_raw() {
                rustix::fs::fchown(
                    &f,
                    Some(rustix::process::Uid::from_raw(st.st_uid)),
                    Some(rustix::process::Gid::from_raw(st.st_gid)),
                )?;
            }
            f.sync_all()?;
            match d.rename_noreplace(&tmp, CONFIG_FILE) {
                Ok(()) => Ok(true),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
                Err(e) => Err(e),
            }
        })();
        if !matches!(r, Ok(true)) {
            let _ = d.unlink(&tmp);
        }
        r.with_context(|| format!("writing {}", self.path.display()))
    }

    pub fn log_path(&self) -> &Path {
        self.log.path()
    }
    pub fn info(&self, m: &str) {
        self.log.write("INFO", m);
    }
    pub fn warn(&self, m: &str) {
        log::warn!("{}", escape_untrusted(m));
        self.log.write("WARNING", m);
    }
    pub fn error(&self, m: &str) {
        log::error!("{}", escape_untrusted(m));
        self.log.write("ERROR", m);
    }

    /// Validates a change; returns the plan to submit, or None (logged why).
    pub fn on_change(&mut self, ev: &ConfigChanged, _target: &Target) -> Option<PlanRequest> {
        self.changes += 1;
        let n = self.changes;
        let text = match &ev.content {
            Ok(t) => t,
            Err(e) => {
                let m = format!(
                    "change {n}: cannot read {}: {e}; the last good config stays in force",
                    self.path.display()
                );
                self.error(&m);
                self.monitor
                    .write("ERROR", &format!("change {n} did not take effect: {e}"));
                return None;
            }
        };
        let parsed = match parse(text) {
            Ok(p) => p,
            Err(e) => {
                let keep = if self.last_good.is_some() {
                    "the last good config stays in force"
                } else {
                    "no config in force"
                };
                self.error(&format!("change {n}: {e:#}; {keep}"));
                self.monitor.write(
                    "ERROR",
                    &format!("change {n} did not take effect: {e:#}; {keep}"),
                );
                return None;
            }
        };
        for f in &parsed.unknown {
            if self.warned.insert(format!("unknown:{f}")) {
                self.warn(&format!(
                    "field `{f}` is not part of the profiler_config.json schema; ignored"
                ));
            }
        }
        for f in &parsed.no_effect {
            if self.warned.insert(format!("noeffect:{f}")) {
                self.warn(&format!(
                    "field `{f}` has no effect in dynprof (accepted, ignored)"
                ));
            }
        }
        let ed = parsed
            .raw
            .get("experimental_config")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        let tmpl_ed = template()["experimental_config"]
            .as_object()
            .cloned()
            .unwrap_or_default();
        let changed_ed: Vec<String> = ed
            .iter()
            .filter(|(k, v)| tmpl_ed.get(*k) != Some(*v))
            .map(|(k, _)| k.clone())
            .collect();
        if !changed_ed.is_empty() && self.warned.insert("experimental_config".into()) {
            self.warn(&format!(
                "experimental_config fields {} have no effect in dynprof (device-side options of the Ascend profiler; use the msprof hook)",
                changed_ed.join(", ")
            ));
        }
        self.last_good = Some(parsed.clone());
        self.info(&format!(
            "change {n}: valid config: {}",
            parsed.plan.describe()
        ));
        if parsed.is_rank && !self.job {
            let ok = self
                .rank
                .is_some_and(|r| parsed.rank_list.contains(&i64::from(r)));
            if !ok {
                let r = self
                    .rank
                    .map(|r| r.to_string())
                    .unwrap_or_else(|| "unknown (RANK not set)".into());
                let m = format!(
                    "change {n} did not take effect: is_rank is set and this target's rank {r} is not in rank_list {:?}",
                    parsed.rank_list
                );
                self.info(&m);
                self.monitor.write("INFO", &m);
                return None;
            }
        }
        if parsed.plan.start_step == 0 {
            let m = format!("change {n} took effect: start_step 0, no collection");
            self.info(&m);
            self.monitor.write("INFO", &m);
            // Still submitted: it cancels a pending plan.
        }
        // The file is the job's input: it may choose a place inside the
        // output directory the operator gave, nothing else.
        let rel = match hostfs::confine_relative(&parsed.prof_dir) {
            Ok(rel) => rel,
            Err(why) => {
                let m = format!(
                    "change {n} did not take effect: prof_dir \"{}\" refused: {why}; windows go below {}",
                    escape_untrusted(&parsed.prof_dir),
                    self.output.display()
                );
                self.error(&m);
                self.monitor.write("ERROR", &m);
                return None;
            }
        };
        let mut req = PlanRequest::new(parsed.plan, Source::ConfigFile);
        req.collect = Some(parsed.collect.clone());
        req.output = (!rel.as_os_str().is_empty()).then_some(rel);
        req.metadata = parsed.metadata.clone();
        req.config = Some(parsed.raw.clone());
        req.change = Some(n);
        Some(req)
    }

    pub fn monitor_result(&mut self, change: Option<u64>, ok: bool, msg: &str) {
        let n = change.unwrap_or(0);
        if ok {
            self.monitor
                .write("INFO", &format!("change {n} took effect: {msg}"));
            self.info(&format!("change {n}: {msg}"));
        } else {
            self.monitor
                .write("ERROR", &format!("change {n} did not take effect: {msg}"));
            self.error(&format!("change {n}: {msg}"));
        }
    }

    pub fn monitor_deferred(&mut self, change: Option<u64>, msg: &str) {
        let n = change.unwrap_or(0);
        self.monitor
            .write("INFO", &format!("change {n} deferred: {msg}"));
        self.info(&format!("change {n} deferred: {msg}"));
    }

    pub fn window_written(&mut self, change: Option<u64>, msg: &str) {
        let n = change.unwrap_or(0);
        self.info(&format!("change {n}: {msg}"));
        self.monitor.write("INFO", &format!("change {n}: {msg}"));
    }

    pub fn ended(&mut self, reason: &str, windows: usize) {
        let m = format!("dynprof ended ({reason}); {windows} window(s) written");
        self.info(&m);
        self.monitor.write("INFO", &m);
    }

    /// Starts the watcher thread. Every save of the file becomes one
    /// [`ConfigChanged`] command.
    pub fn spawn_watcher(&self, tx: UnboundedSender<SessionCommand>) -> Result<()> {
        let dir = self.dir.clone();
        let dir_fd = self.dir_fd.try_clone()?;
        let initial = self.initial.clone();
        let fd = inotify_watch(&dir);
        match &fd {
            Ok(_) => self.info("watching with inotify"),
            Err(e) => self.warn(&format!(
                "inotify unavailable ({e:#}); polling the file every second"
            )),
        }
        std::thread::Builder::new()
            .name("dynprof-config".into())
            .spawn(move || {
                let mut last = initial;
                // A save between setup and now had no watch yet: check once.
                let mut first = true;
                loop {
                    let changed = if std::mem::take(&mut first) {
                        true
                    } else {
                        match &fd {
                            Ok(fd) => match inotify_wait(*fd) {
                                Ok(names) => names.iter().any(|n| n == CONFIG_FILE),
                                Err(_) => {
                                    std::thread::sleep(Duration::from_secs(1));
                                    true
                                }
                            },
                            Err(_) => {
                                std::thread::sleep(Duration::from_secs(1));
                                true
                            }
                        }
                    };
                    if !changed {
                        continue;
                    }
                    let now = stamp(&dir_fd);
                    if now == last || now.is_none() {
                        continue;
                    }
                    // An empty file is a save caught between its truncate and
                    // its write (the check above runs without an event); its
                    // IN_CLOSE_WRITE follows, so wait for that.
                    if now.as_ref().is_some_and(|(_, len, _)| *len == 0) {
                        continue;
                    }
                    last = now.clone();
                    let content = read_config(&dir_fd).map_err(|e| e.to_string());
                    if tx
                        .send(SessionCommand::ConfigChanged(ConfigChanged { content }))
                        .is_err()
                    {
                        return;
                    }
                }
            })
            .context("starting the config watcher thread")?;
        Ok(())
    }
}
