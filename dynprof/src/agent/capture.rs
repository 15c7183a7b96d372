//! `POST /capture`: a job-mode window on one job's ranks, run by a child
//! `dynprof attach --pids …` (the agent hands it those ranks' locks and
//! keeps its own step markers attached, so the step metrics go on
//! counting; it takes the locks back when the child is done), written
//! under `--output` as an ordinary `PROF_JOB_*` directory, listed in
//! `captures.json`.
//!
//! Across nodes: every agent given the same `start_at` (UNIX seconds)
//! starts its window at the same job step, counted from the first step
//! boundary of its reference rank at or after that instant (see
//! docs/fleet.md for the clock assumption).
use std::{process::Stdio, time::Duration};

use serde::{Deserialize, Serialize};
use tokio::io::AsyncBufReadExt as _;

use super::{Shared, metrics::CaptureLabels, metrics::CaptureState};
use crate::types::{Builtin, HostPid};

/// Largest `active`/`warmup`/`start_step` a request may ask for.
pub const MAX_STEPS: u64 = 100_000;
/// How far ahead `start_at` may be.
pub const MAX_AHEAD: Duration = Duration::from_secs(24 * 3600);

/// The JSON body of `POST /capture`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// The job: its `--job` reference (`dynprof ps --jobs`, the `job`
    /// label), or any rank's host PID with `pid`.
    #[serde(default)]
    pub job: Option<String>,
    #[serde(default)]
    pub pid: Option<u32>,
    /// Steps recorded (job steps, as `attach --job --active`).
    pub active: u64,
    #[serde(default)]
    pub warmup: u64,
    /// Job steps after the alignment (or after the first boundary at or
    /// after `start_at`) before the window; default: as soon as possible.
    #[serde(default)]
    pub start_step: Option<u64>,
    /// Built-in collectors (`api`, `cpu`, `offcpu`); default all.
    #[serde(default)]
    pub collect: Option<Vec<String>>,
    /// A common start instant (UNIX seconds) for every node's agent.
    #[serde(default)]
    pub start_at: Option<f64>,
    /// Seconds after which the capture gives up (the ranks are handed back
    /// to the agent); default 600.
    #[serde(default)]
    pub timeout_s: Option<u64>,
}

/// Default and largest `timeout_s`.
pub const DEFAULT_TIMEOUT_S: u64 = 600;
pub const MAX_TIMEOUT_S: u64 = 86_400;

/// A request checked and tied to the ranks it names.
#[derive(Debug)]
pub struct Accepted {
    pub id: String,
    pub pids: Vec<HostPid>,
    pub req: Request,
}

/// One capture, as `GET /captures` and `captures.json` list it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    pub id: String,
    pub node: String,
    pub state: CaptureState,
    pub job: String,
    pub pids: Vec<HostPid>,
    pub request: Request,
    /// The capture's directory under `--output` (it holds the PROF_JOB_*).
    pub dir: String,
    /// The `PROF_JOB_*` directory written, relative to `--output`.
    pub window: Option<String>,
    pub error: Option<String>,
    pub requested_at: String,
}

/// Checks a request's fields (the job is looked up by the caller).
pub fn validate(r: &Request, now_unix: f64) -> Result<(), String> {
    match (&r.job, r.pid) {
        (Some(_), Some(_)) => return Err("give `job` or `pid`, not both".into()),
        (None, None) => {
            return Err(
                "give `job` (a --job reference, the `job` label) or `pid` (a rank's host PID)"
                    .into(),
            );
        }
        (Some(j), None) if j.is_empty() || j.len() > 128 => {
            return Err("`job` must be 1..=128 characters".into());
        }
        _ => {}
    }
    if r.active == 0 || r.active > MAX_STEPS {
        return Err(format!("`active` must be 1..={MAX_STEPS}"));
    }
    if r.warmup > MAX_STEPS || r.start_step.is_some_and(|s| s > MAX_STEPS) {
        return Err(format!(
            "`warmup` and `start_step` must be at most {MAX_STEPS}"
        ));
    }
    if let Some(c) = &r.collect {
        for name in c {
            if Builtin::from_name(name).is_none() {
                return Err(format!(
                    "unknown collector {:?} in `collect`; known: {}",
                    crate::sys::hostfs::escape_untrusted(name),
                    Builtin::names()
                ));
            }
        }
    }
    if r.timeout_s.is_some_and(|t| t == 0 || t > MAX_TIMEOUT_S) {
        return Err(format!("`timeout_s` must be 1..={MAX_TIMEOUT_S}"));
    }
    if let Some(t) = r.start_at {
        if !t.is_finite() || t <= 0.0 {
            return Err("`start_at` must be a UNIX time in seconds".into());
        }
        if t < now_unix - 60.0 {
            return Err(format!(
                "`start_at` {t} is more than a minute in the past (now {now_unix:.3}); are the clocks synced?"
            ));
        }
        if t > now_unix + MAX_AHEAD.as_secs_f64() {
            return Err("`start_at` is more than 24 h ahead".into());
        }
    }
    Ok(())
}

/// The child's command line (after the program name). `timeout_s` counts
/// from `start_at` when that is ahead of `now_unix`.
pub fn child_args(a: &Accepted, out: &std::path::Path, now_unix: f64) -> Vec<String> {
    let r = &a.req;
    let wait = r
        .start_at
        .map_or(0, |t| (t - now_unix).max(0.0).ceil() as u64);
    let mut v = vec![
        "attach".to_string(),
        "--pids".into(),
        a.pids
            .iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(","),
        "--active".into(),
        r.active.to_string(),
        "--warmup".into(),
        r.warmup.to_string(),
        "--output".into(),
        out.display().to_string(),
        "--duration".into(),
        (r.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S) + wait).to_string(),
    ];
    if let Some(s) = r.start_step {
        v.extend(["--start-step".into(), s.to_string()]);
    }
    if let Some(c) = &r.collect {
        v.extend(["--collect".into(), c.join(",")]);
    }
    if let Some(t) = r.start_at {
        v.extend(["--start-at".into(), format!("{t:.6}")]);
    }
    v
}

fn set_state(shared: &Shared, id: &str, f: impl FnOnce(&mut Record)) {
    let text = {
        let mut st = shared.lock();
        let Some(r) = st.captures.iter_mut().find(|r| r.id == id) else {
            return;
        };
        f(r);
        let by = |s| st.captures.iter().filter(|r| r.state == s).count() as i64;
        for s in [
            CaptureState::running,
            CaptureState::written,
            CaptureState::failed,
        ] {
            shared
                .metrics
                .captures
                .get_or_create(&CaptureLabels {
                    node: shared.cfg.node.clone(),
                    state: s,
                })
                .set(by(s));
        }
        serde_json::to_vec_pretty(&st.captures).unwrap_or_default()
    };
    if let Err(e) = shared.output.dir().write_atomic(INDEX_FILE, &text) {
        eprintln!("dynprof: agent: writing {INDEX_FILE}: {e}");
    }
}

/// Why a request was not accepted: an HTTP status and the message.
#[derive(Debug)]
pub struct Refused(pub u16, pub String);

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Checks a request, ties it to the job's ranks on this node (those whose
/// rank `ranks` lists, when given), registers it as running and hands it to
/// the event loop.
pub fn accept(shared: &Shared, req: Request, ranks: Option<&[i64]>) -> Result<Record, Refused> {
    validate(&req, unix_now()).map_err(|e| Refused(400, e))?;
    let (id, pids, job) = {
        let mut st = shared.lock();
        let found = st.jobs.iter().find(|j| match (&req.job, req.pid) {
            (Some(r), _) => j.job_ref == *r,
            (None, Some(p)) => j.ranks.iter().any(|m| m.host_pid == HostPid(p)),
            _ => false,
        });
        let Some(j) = found else {
            return Err(Refused(
                404,
                "no such job on this node (GET /metrics shows the `job` and `pid` labels of the attached ranks)".into(),
            ));
        };
        let pids: Vec<HostPid> = j
            .ranks
            .iter()
            .filter(|m| ranks.is_none_or(|r| r.contains(&i64::from(m.rank.0))))
            .map(|m| m.host_pid)
            .collect();
        let job = j.job_ref.clone();
        if pids.is_empty() {
            return Err(Refused(
                404,
                format!("job {job} has no rank of `rank_list` on this node"),
            ));
        }
        if pids.iter().any(|p| st.busy.contains(p)) {
            return Err(Refused(
                409,
                format!("a capture of job {job} is already running"),
            ));
        }
        // Marked busy now, so a second request is refused at once.
        st.busy.extend(pids.iter().copied());
        let id = format!(
            "{}_{}",
            crate::sys::clock::local_timestamp(),
            st.captures.len() + 1
        );
        (id, pids, job)
    };
    let rec = Record {
        id: id.clone(),
        node: shared.cfg.node.clone(),
        state: CaptureState::running,
        job,
        pids: pids.clone(),
        request: req.clone(),
        dir: format!("CAPTURE_{id}"),
        window: None,
        error: None,
        requested_at: crate::sys::clock::local_timestamp_human(),
    };
    register(shared, rec.clone());
    if shared.capture_tx.send(Accepted { id, pids, req }).is_err() {
        return Err(Refused(503, "the agent is stopping".into()));
    }
    Ok(rec)
}

/// The index of captures under `--output`.
pub const INDEX_FILE: &str = "captures.json";

/// Largest `captures.json` read back at start.
const MAX_INDEX_BYTES: u64 = 16 << 20;

/// What a previous agent left in `captures.json`: its captures stay listed
/// (`GET /captures`, the `dynprof_captures` gauge). One still `running`
/// was cut short by the previous agent's end (SIGKILL, a crash), so it is
/// marked failed with that reason. An unreadable index is reported and left
/// for the operator until the next capture rewrites it.
pub fn load_index(shared: &Shared) {
    let text = match shared.output.dir().read_capped(INDEX_FILE, MAX_INDEX_BYTES) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
        Err(e) => {
            eprintln!(
                "dynprof: agent: {INDEX_FILE} not read ({e}); earlier captures are not listed"
            );
            return;
        }
    };
    let mut records: Vec<Record> = match serde_json::from_str(&text) {
        Ok(r) => r,
        Err(e) => {
            eprintln!(
                "dynprof: agent: {INDEX_FILE} is not a capture list ({e}); earlier captures are not listed, and the next capture rewrites it"
            );
            return;
        }
    };
    for r in &mut records {
        if r.state == CaptureState::running {
            r.state = CaptureState::failed;
            r.error = Some("the agent ended before this capture did (killed or restarted)".into());
        }
    }
    let first = records.first().map(|r| r.id.clone());
    shared.lock().captures = records;
    if let Some(id) = first {
        // Publishes the gauge and rewrites the index with the repairs.
        set_state(shared, &id, |_| {});
    }
}

/// Registers a new capture as running.
pub fn register(shared: &Shared, rec: Record) {
    let id = rec.id.clone();
    shared.lock().captures.push(rec);
    set_state(shared, &id, |_| {});
}

/// Runs the child and records the outcome.
/// `stop` changes when the agent is stopping.
pub async fn execute(shared: &Shared, a: Accepted, mut stop: tokio::sync::watch::Receiver<()>) {
    let id = a.id.clone();
    let dir_name = format!("CAPTURE_{id}");
    let out = match shared.output.dir().create_subdir(&dir_name, 0o755) {
        Ok(d) => d.path().to_path_buf(),
        Err(e) => {
            set_state(shared, &id, |r| {
                r.state = CaptureState::failed;
                r.error = Some(format!("creating {dir_name}: {e}"));
            });
            return;
        }
    };
    eprintln!(
        "dynprof: agent: capture {id}: job-mode window on PIDs {:?}",
        a.pids.iter().map(|p| p.0).collect::<Vec<_>>()
    );
    let mut cmd = tokio::process::Command::new("/proc/self/exe");
    cmd.args(child_args(&a, &out, unix_now()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let result = async {
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("starting dynprof attach: {e}"))?;
        let stderr = child.stderr.take();
        // The child's stderr, passed on line by line as it comes; the last
        // lines are kept for the record's error.
        let read = async {
            let mut tail: std::collections::VecDeque<String> = Default::default();
            if let Some(s) = stderr {
                let mut lines = tokio::io::BufReader::new(s).lines();
                let mut bytes = 0usize;
                while let Ok(Some(l)) = lines.next_line().await {
                    bytes += l.len();
                    // Bounded: a capture says a few lines per rank.
                    if bytes > 1 << 20 {
                        continue;
                    }
                    eprintln!(
                        "dynprof: agent: capture {id}: {}",
                        l.strip_prefix("dynprof: ").unwrap_or(&l)
                    );
                    if tail.len() == 20 {
                        tail.pop_front();
                    }
                    tail.push_back(l);
                }
            }
            tail
        };
        let wait = async {
            tokio::select! {
                st = child.wait() => st,
                _ = stop.changed() => {
                    // The agent is stopping: the child detaches and writes
                    // what it has (SIGTERM), as `dynprof attach` does.
                    if let Some(pid) = child.id() {
                        let _ = crate::sys::signal::terminate(pid);
                    }
                    child.wait().await
                }
            }
        };
        let (tail, st) = tokio::join!(read, wait);
        let st = st.map_err(|e| format!("waiting for dynprof attach: {e}"))?;
        if st.success() {
            Ok(())
        } else {
            let last = tail
                .iter()
                .rev()
                .find(|l| l.contains("error"))
                .or_else(|| tail.back())
                .cloned()
                .unwrap_or_default();
            Err(format!("dynprof attach exited with {st}: {last}"))
        }
    }
    .await;
    let window = std::fs::read_dir(&out).ok().and_then(|rd| {
        rd.filter_map(|e| e.ok()?.file_name().into_string().ok())
            .find(|n| n.starts_with(crate::job::JOB_DIR_PREFIX))
            .map(|n| format!("{dir_name}/{n}"))
    });
    set_state(shared, &id, |r| {
        r.window = window;
        match result {
            Ok(()) => r.state = CaptureState::written,
            Err(e) => {
                r.state = CaptureState::failed;
                r.error = Some(e);
            }
        }
    });
    eprintln!("dynprof: agent: capture {id} done");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: serde_json::Value) -> Result<Request, String> {
        let r: Request = serde_json::from_value(v).map_err(|e| e.to_string())?;
        validate(&r, 1_800_000_000.0).map(|_| r)
    }

    #[test]
    fn requests_checked() {
        use serde_json::json;
        assert!(req(json!({"job": "4242", "active": 3})).is_ok());
        assert!(req(json!({"pid": 7, "active": 3, "warmup": 1, "collect": ["cpu"], "start_at": 1_800_000_010.5})).is_ok());
        for bad in [
            json!({"active": 3}),
            json!({"job": "1", "pid": 1, "active": 3}),
            json!({"job": "1", "active": 0}),
            json!({"job": "1", "active": 3, "collect": ["gpu"]}),
            json!({"job": "1", "active": 3, "start_at": 1.0}),
            json!({"job": "1", "active": 3, "start_at": 1_900_000_000.0}),
            json!({"job": "1", "active": 3, "bogus": 1}),
            json!({"job": "1", "active": "three"}),
            json!({"job": "", "active": 3}),
            json!({"job": "1", "active": 3, "timeout_s": 0}),
        ] {
            assert!(req(bad.clone()).is_err(), "{bad}");
        }
    }

    #[test]
    fn child_command_line() {
        let a = Accepted {
            id: "x".into(),
            pids: vec![HostPid(10), HostPid(11)],
            req: serde_json::from_value(serde_json::json!({"job": "9", "active": 2, "start_at": 5.25, "collect": ["cpu", "offcpu"]})).unwrap(),
        };
        assert_eq!(
            child_args(&a, std::path::Path::new("/o"), 0.0).join(" "),
            "attach --pids 10,11 --active 2 --warmup 0 --output /o --duration 606 --collect cpu,offcpu --start-at 5.250000"
        );
    }
}
