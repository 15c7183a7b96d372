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
use std::{
    collections::BTreeSet,
    ffi::CString,
    fs,
    io::{Read as _, Write as _},
    os::unix::ffi::OsStrExt as _,
    path::{Component, Path, PathBuf},
    time::{Duration, SystemTime},
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Map, Value, json};
use tokio::sync::mpsc::UnboundedSender;

use super::{PlanRequest, Source};
use crate::{
    session::Command,
    sys::hostfs::{self, HostDir, escape_untrusted},
    target::Target,
    window::Plan,
};

pub const CONFIG_FILE: &str = "profiler_config.json";

/// Rotate a log when it grows past this many bytes
/// (`DYNPROF_CONFIG_LOG_MAX_BYTES` overrides it).
pub const LOG_MAX_BYTES: u64 = 10 * 1024 * 1024;

/// The torch_npu default `profiler_config.json`, key for key.
pub fn template() -> Value {
    json!({
        "activities": ["CPU", "NPU"],
        "prof_dir": "./",
        "analyse": false,
        "record_shapes": false,
        "profile_memory": false,
        "with_stack": false,
        "with_flops": false,
        "with_modules": false,
        "active": 1,
        "warmup": 0,
        "start_step": 0,
        "is_rank": false,
        "rank_list": [],
        "experimental_config": {
            "profiler_level": "Level0",
            "aic_metrics": "AiCoreNone",
            "l2_cache": false,
            "op_attr": false,
            "gc_detect_threshold": null,
            "data_simplification": true,
            "record_op_args": false,
            "export_type": ["text"],
            "mstx": false,
            "mstx_domain_include": [],
            "mstx_domain_exclude": [],
            "host_sys": [],
            "sys_io": false,
            "sys_interconnection": false
        }
    })
}

/// Top-level fields of the torch_npu schema (the template plus the two
/// optional ones).
const KNOWN: &[&str] = &[
    "activities",
    "prof_dir",
    "analyse",
    "record_shapes",
    "profile_memory",
    "with_stack",
    "with_flops",
    "with_modules",
    "active",
    "warmup",
    "start_step",
    "is_rank",
    "rank_list",
    "async_mode",
    "experimental_config",
    "metadata",
];

/// torch_npu fields dynprof accepts but cannot act on (a non-default value
/// gets one warning).
const NO_EFFECT: &[&str] = &[
    "analyse",
    "record_shapes",
    "profile_memory",
    "with_flops",
    "with_modules",
    "async_mode",
];

/// A file change seen by the watcher: the new content, or why it could not be read.
#[derive(Clone, Debug)]
pub struct ConfigChanged {
    pub content: std::result::Result<String, String>,
}

/// A validated config: what dynprof will do with it.
#[derive(Clone, Debug, PartialEq)]
pub struct Parsed {
    pub plan: Plan,
    pub collect: Vec<String>,
    pub prof_dir: String,
    pub is_rank: bool,
    pub rank_list: Vec<i64>,
    pub metadata: Option<Value>,
    pub raw: Value,
    /// Fields present that dynprof cannot act on, or does not know.
    pub no_effect: Vec<String>,
    pub unknown: Vec<String>,
}

/// Validates a `profiler_config.json` text. Missing fields take the
/// torch_npu defaults.
pub fn parse(text: &str) -> Result<Parsed> {
    let raw: Value =
        serde_json::from_str(text).map_err(|e| anyhow::anyhow!("invalid JSON: {e}"))?;
    let Some(obj) = raw.as_object() else {
        bail!("invalid config: the top level must be a JSON object")
    };
    let defaults = template();
    let get = |k: &str| {
        obj.get(k)
            .or_else(|| defaults.get(k))
            .cloned()
            .unwrap_or(Value::Null)
    };
    let boolean = |k: &str| -> Result<bool> {
        match get(k) {
            Value::Bool(b) => Ok(b),
            Value::Null => Ok(false),
            v => bail!("invalid field `{k}`: expected true or false, got {v}"),
        }
    };
    let int = |k: &str, min: i64| -> Result<i64> {
        match get(k).as_i64() {
            Some(v) if v >= min => Ok(v),
            Some(v) => bail!("invalid field `{k}`: must be >= {min}, got {v}"),
            None => bail!("invalid field `{k}`: expected an integer, got {}", get(k)),
        }
    };
    let start_step = int("start_step", -1)?;
    let warmup = int("warmup", 0)? as u64;
    let active = int("active", 1)? as u64;
    let is_rank = boolean("is_rank")?;
    let rank_list = match get("rank_list") {
        Value::Array(a) => a
            .iter()
            .map(|v| {
                v.as_i64().filter(|r| *r >= 0).ok_or_else(|| {
                    anyhow::anyhow!("invalid field `rank_list`: {v} is not a rank number")
                })
            })
            .collect::<Result<Vec<_>>>()?,
        v => bail!("invalid field `rank_list`: expected a list of rank numbers, got {v}"),
    };
    let activities: Vec<String> = match get("activities") {
        Value::Array(a) => a
            .iter()
            .map(|v| match v.as_str() {
                Some(s @ ("CPU" | "NPU")) => Ok(s.to_string()),
                _ => bail!("invalid field `activities`: {v} is not \"CPU\" or \"NPU\""),
            })
            .collect::<Result<Vec<_>>>()?,
        v => {
            bail!("invalid field `activities`: expected a list such as [\"CPU\", \"NPU\"], got {v}")
        }
    };
    let prof_dir = match get("prof_dir") {
        Value::String(s) if !s.is_empty() => s,
        v => bail!("invalid field `prof_dir`: expected a non-empty path string, got {v}"),
    };
    let with_stack = boolean("with_stack")?;
    for k in NO_EFFECT {
        boolean(k)?;
    }
    if !matches!(get("experimental_config"), Value::Object(_) | Value::Null) {
        bail!("invalid field `experimental_config`: expected an object");
    }
    let metadata = match obj.get("metadata") {
        None | Some(Value::Null) => None,
        Some(v @ Value::Object(_)) => Some(v.clone()),
        Some(v) => bail!("invalid field `metadata`: expected an object, got {v}"),
    };
    // activities / with_stack → collectors.
    let mut collect = Vec::new();
    if activities.iter().any(|a| a == "NPU") {
        collect.push("api".to_string());
    }
    if activities.iter().any(|a| a == "CPU") {
        collect.push("cpu".to_string());
    }
    if with_stack {
        collect.push("offcpu".to_string());
    }
    let no_effect = NO_EFFECT
        .iter()
        .filter(|k| {
            obj.get(**k)
                .is_some_and(|v| v != &defaults.get(**k).cloned().unwrap_or(Value::Bool(false)))
        })
        .map(|k| k.to_string())
        .collect();
    let unknown = obj
        .keys()
        .filter(|k| !KNOWN.contains(&k.as_str()))
        .cloned()
        .collect();
    Ok(Parsed {
        plan: Plan {
            start_step,
            warmup,
            active,
            repeat: 0,
            gap: 0,
        },
        collect,
        prof_dir,
        is_rank,
        rank_list,
        metadata,
        raw,
        no_effect,
        unknown,
    })
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

/// A size-rotated log file in the (user-owned) log directory.
///
/// The directory is held open; the file is opened relative to it with
/// `O_NOFOLLOW|O_APPEND` at every write and must be a regular file with one
/// link, owned by root, dynprof or the directory's owner: a symlink or hard
/// link planted at its name is refused, never written through. Every line
/// is escaped ([`escape_untrusted`]): a string from the target stays one line.
pub struct RotatingLog {
    /// Said once on stderr that the file is refused (not at every line).
    refused: std::sync::atomic::AtomicBool,
    dir: HostDir,
    name: String,
    path: PathBuf,
    /// The log directory's owner (the job's user, typically).
    owner: u32,
    max: u64,
}

impl RotatingLog {
    pub fn new(dir: &HostDir, name: &str) -> Result<Self> {
        let max = std::env::var("DYNPROF_CONFIG_LOG_MAX_BYTES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(LOG_MAX_BYTES);
        Ok(Self {
            refused: std::sync::atomic::AtomicBool::new(false),
            dir: dir.try_clone()?,
            name: name.to_string(),
            path: dir.path().join(name),
            owner: dir.stat()?.st_uid,
            max,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn refuse(&self, e: &std::io::Error) {
        if !self
            .refused
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            log::warn!("not logging to {}: {e}", self.path.display());
        }
    }

    pub fn write(&self, level: &str, msg: &str) {
        let line = format!(
            "[{}] [{level}] {}\n",
            crate::sys::clock::local_timestamp_human(),
            escape_untrusted(msg)
        );
        let open = || self.dir.open_append(&self.name, Some(self.owner), 0o644);
        let mut f = match open() {
            Ok(f) => f,
            Err(e) => {
                self.refuse(&e);
                return;
            }
        };
        if f.metadata().map(|m| m.len() >= self.max).unwrap_or(false) {
            let rotated = format!("{}.1", self.name);
            // renameat inside the held directory replaces a name, never
            // follows it.
            if self.dir.rename(&self.name, &rotated).is_ok() {
                match open() {
                    Ok(g) => f = g,
                    Err(e) => {
                        self.refuse(&e);
                        return;
                    }
                }
            }
        }
        let _ = f.write_all(line.as_bytes());
    }
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "localhost".into();
    }
    let n = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// The config-file trigger's state (owned by the scheduler).
pub struct ConfigFileTrigger {
    pub dir: PathBuf,
    pub path: PathBuf,
    /// DIR, held open: every file in it is reached through this descriptor.
    dir_fd: HostDir,
    log: RotatingLog,
    monitor: RotatingLog,
    rank: Option<u32>,
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
        let rank = target.rank.map(i64::from).unwrap_or(-1);
        let stem = format!("dp_{}_{}_rank_{rank}.log", hostname(), target.host_pid);
        let log = RotatingLog::new(&log_dir, &stem)?;
        let monitor = RotatingLog::new(&log_dir, &format!("monitor_{stem}"))?;
        let path = dir.join(CONFIG_FILE);
        let mut t = Self {
            dir: dir.clone(),
            path: path.clone(),
            dir_fd,
            log,
            monitor,
            rank: target.rank,
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
            "dynprof {} (PID {}) watching {} for target PID {} (rank {rank})",
            env!("CARGO_PKG_VERSION"),
            std::process::id(),
            path.display(),
            target.host_pid,
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
    pub fn monitor_path(&self) -> &Path {
        self.monitor.path()
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
        if parsed.is_rank {
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
    pub fn spawn_watcher(&self, tx: UnboundedSender<Command>) -> Result<()> {
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
                    if tx.send(Box::new(ConfigChanged { content })).is_err() {
                        return;
                    }
                }
            })
            .context("starting the config watcher thread")?;
        Ok(())
    }
}

/// Largest profiler_config.json read (the template is under 1 KiB).
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Reads profiler_config.json through DIR's descriptor: a symlink, FIFO or
/// device at the name is refused (it would let the job's user make root
/// read, and quote in the log, a file they cannot read), and at most
/// [`MAX_CONFIG_BYTES`] are read.
fn read_config(dir: &HostDir) -> std::io::Result<String> {
    let f = dir.open_read(CONFIG_FILE)?;
    let mut text = String::new();
    std::io::Read::take(f, MAX_CONFIG_BYTES + 1).read_to_string(&mut text)?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {MAX_CONFIG_BYTES} bytes"),
        ));
    }
    Ok(text)
}

/// (mtime, size, content): two events of one save compare equal.
fn stamp(dir: &HostDir) -> Option<(SystemTime, u64, String)> {
    let f = dir.open_read(CONFIG_FILE).ok()?;
    let m = f.metadata().ok()?;
    Some((
        m.modified().ok()?,
        m.len(),
        read_config(dir).unwrap_or_default(),
    ))
}

fn inotify_watch(dir: &Path) -> Result<i32> {
    // SAFETY: plain syscalls; the fd is owned by the watcher thread.
    let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("inotify_init1");
    }
    let c = CString::new(dir.as_os_str().as_bytes())?;
    let wd = unsafe {
        libc::inotify_add_watch(
            fd,
            c.as_ptr(),
            libc::IN_CLOSE_WRITE | libc::IN_MOVED_TO | libc::IN_CREATE,
        )
    };
    if wd < 0 {
        let e = std::io::Error::last_os_error();
        unsafe { libc::close(fd) };
        return Err(e).with_context(|| format!("inotify_add_watch {}", dir.display()));
    }
    Ok(fd)
}

/// Blocks for the next batch of inotify events; returns the file names.
fn inotify_wait(fd: i32) -> std::io::Result<Vec<String>> {
    let mut buf = [0u8; 4096];
    // SAFETY: read into our buffer.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok(Vec::new());
        }
        return Err(e);
    }
    let n = n as usize;
    let mut names = Vec::new();
    let mut off = 0usize;
    let hdr = std::mem::size_of::<libc::inotify_event>();
    while off + hdr <= n {
        // SAFETY: the kernel wrote whole events; read_unaligned copes with alignment.
        let ev: libc::inotify_event =
            unsafe { std::ptr::read_unaligned(buf.as_ptr().add(off).cast()) };
        let name_start = off + hdr;
        let name_end = (name_start + ev.len as usize).min(n);
        let raw = &buf[name_start..name_end];
        let end = raw.iter().position(|b| *b == 0).unwrap_or(raw.len());
        names.push(String::from_utf8_lossy(&raw[..end]).into_owned());
        off = name_end;
    }
    Ok(names)
}

/// Keys of a JSON object, recursively (`a.b` for nested objects).
pub fn key_paths(v: &Value) -> BTreeSet<String> {
    fn walk(prefix: &str, v: &Map<String, Value>, out: &mut BTreeSet<String>) {
        for (k, val) in v {
            let p = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            out.insert(p.clone());
            if let Value::Object(o) = val {
                walk(&p, o, out);
            }
        }
    }
    let mut out = BTreeSet::new();
    if let Value::Object(o) = v {
        walk("", o, &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_parses_to_no_collection() {
        let p = parse(&template().to_string()).unwrap();
        assert_eq!(p.plan.start_step, 0);
        assert_eq!(p.collect, vec!["api", "cpu"]);
        assert!(p.unknown.is_empty() && p.no_effect.is_empty());
    }

    #[test]
    fn fields_map_and_validate() {
        let p = parse(r#"{"start_step": -1, "warmup": 2, "active": 3, "with_stack": true, "activities": ["CPU"], "metadata": {"a": 1}, "foo": 1, "analyse": true}"#).unwrap();
        assert_eq!(
            p.plan,
            Plan {
                start_step: -1,
                warmup: 2,
                active: 3,
                repeat: 0,
                gap: 0
            }
        );
        assert_eq!(p.collect, vec!["cpu", "offcpu"]);
        assert_eq!(p.unknown, vec!["foo"]);
        assert_eq!(p.no_effect, vec!["analyse"]);
        assert!(p.metadata.is_some());
        assert!(parse("{").unwrap_err().to_string().contains("invalid JSON"));
        assert!(
            parse(r#"{"active": 0}"#)
                .unwrap_err()
                .to_string()
                .contains("`active`")
        );
        assert!(
            parse(r#"{"start_step": "5"}"#)
                .unwrap_err()
                .to_string()
                .contains("`start_step`")
        );
        assert!(
            parse(r#"{"activities": ["GPU"]}"#)
                .unwrap_err()
                .to_string()
                .contains("activities")
        );
    }

    #[test]
    fn dir_rules() {
        let base = std::env::temp_dir().join(format!("dynprof-cfgdir-{}", std::process::id()));
        fs::create_dir_all(&base).unwrap();
        assert!(check_dir(&base.join("good_dir-1")).is_ok());
        assert!(
            check_dir(&base.join("bad.dir"))
                .unwrap_err()
                .to_string()
                .contains("letters, digits")
        );
        fs::create_dir_all(base.join("real")).unwrap();
        let _ = std::os::unix::fs::symlink(base.join("real"), base.join("link"));
        assert!(
            check_dir(&base.join("link").join("cfg"))
                .unwrap_err()
                .to_string()
                .contains("symbolic link")
        );
        let _ = fs::remove_dir_all(&base);
    }

    #[test]
    fn log_rotates() {
        let base = std::env::temp_dir().join(format!("dynprof-cfglog-{}", std::process::id()));
        fs::create_dir_all(&base).unwrap();
        let mut l = RotatingLog::new(&hostfs::open_dir_nofollow(&base).unwrap(), "x.log").unwrap();
        l.max = 100;
        for i in 0..10 {
            l.write(
                "INFO",
                &format!("line {i} with some padding to grow the file"),
            );
        }
        assert!(base.join("x.log.1").is_file());
        assert!(fs::metadata(base.join("x.log")).unwrap().len() < 200);
        // A newline in a message stays on its line.
        let _ = fs::remove_file(base.join("x.log"));
        l.write("WARNING", "field `\ntouch X; id > X #` ignored");
        let text = fs::read_to_string(base.join("x.log")).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(
            text.contains("field `\\ntouch X; id > X #` ignored"),
            "{text}"
        );
        // A symlink planted at the log's name is not written through.
        let victim = base.join("victim");
        fs::write(&victim, "keep").unwrap();
        let _ = fs::remove_file(base.join("x.log"));
        std::os::unix::fs::symlink(&victim, base.join("x.log")).unwrap();
        l.write("INFO", "hello");
        assert_eq!(fs::read_to_string(&victim).unwrap(), "keep");
        let _ = fs::remove_dir_all(&base);
    }
}
