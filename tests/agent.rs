//! `dynprof agent` against real PyTorch jobs (Debian's torch 1.13 on CPU):
//! a real Prometheus scrapes it and its step counter agrees with the job's
//! own log; a SIGKILLed agent leaves no probe behind and a restarted one
//! attaches again, once; bad requests get 4xx and the agent keeps running.
//!
//! Each agent follows only the test's own children (`--only-under`), so the
//! host's other jobs (and other tests' targets) are left alone.
#[path = "attach_util.rs"]
mod attach_util;
mod common;

use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use aya::{maps::MapInfo, programs::loaded_programs};
use common::*;

const T: Duration = Duration::from_secs(180);

/// One agent test at a time: they count the kernel's dynprof programs.
static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one() -> std::sync::MutexGuard<'static, ()> {
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A minimal HTTP/1.1 client (one request per connection): status and body.
fn http(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).ok()?;
    let mut resp = Vec::new();
    s.read_to_end(&mut resp).ok()?;
    let resp = String::from_utf8_lossy(&resp).into_owned();
    let status = resp.split_whitespace().nth(1)?.parse().ok()?;
    let (head, rest) = resp.split_once("\r\n\r\n")?;
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Some((status, body))
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((len, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

/// Polls `f` every 50 ms until it returns Some, or panics after `timeout`
/// with `what` and the last state `show` gives.
fn wait_for<R>(
    timeout: Duration,
    what: &str,
    mut f: impl FnMut() -> Option<R>,
    show: impl Fn() -> String,
) -> R {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(r) = f() {
            return r;
        }
        if Instant::now() >= deadline {
            panic!("timed out waiting for {what}; last state:\n{}", show());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A running `dynprof agent`, SIGTERMed and reaped on drop.
struct Agent {
    child: Child,
    port: u16,
    stderr: PathBuf,
}

impl Agent {
    /// Follows the test's own children.
    fn start(dir: &Path, name: &str, extra: &[&str]) -> Agent {
        Self::start_under(dir, name, std::process::id(), extra)
    }

    fn start_under(dir: &Path, name: &str, under: u32, extra: &[&str]) -> Agent {
        Self::start_via(dir, name, under, &[], extra)
    }

    /// `wrapper` runs first and execs the rest (e.g. `unshare -m …`).
    fn start_via(dir: &Path, name: &str, under: u32, wrapper: &[&str], extra: &[&str]) -> Agent {
        let port = free_port();
        let stderr = dir.join(format!("{name}.stderr"));
        let mut cmd = match wrapper.split_first() {
            Some((w, rest)) => {
                let mut c = Command::new(w);
                c.args(rest).arg(dynprof_bin());
                c
            }
            None => Command::new(dynprof_bin()),
        };
        let child = cmd
            .args(["agent", "--listen", &format!("127.0.0.1:{port}")])
            .arg("--output")
            .arg(dir.join(format!("{name}-out")))
            .args(["--rescan", "0.5", "--node", name])
            .args(["--only-under", &under.to_string()])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("starting dynprof agent");
        let mut a = Agent {
            child,
            port,
            stderr,
        };
        wait_for(
            T,
            "the agent's /readyz",
            || {
                if let Ok(Some(st)) = a.child.try_wait() {
                    panic!("the agent exited ({st}):\n{}", a.log());
                }
                a.get("/readyz").filter(|(s, _)| *s == 200)
            },
            String::new,
        );
        a
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    fn get(&self, path: &str) -> Option<(u16, String)> {
        http(self.port, "GET", path, &[], "")
    }

    /// The value of `name{…pid="PID"…}` in /metrics, if that series exists.
    fn metric(&self, name: &str, pid: u32) -> Option<f64> {
        let (_, body) = self.get("/metrics")?;
        let needle = format!("pid=\"{pid}\"");
        body.lines()
            .find(|l| l.starts_with(&format!("{name}{{")) && l.contains(&needle))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child, not reaped yet.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A torch 1.13 training job (our child), logging its optimizer steps.
fn torch_job(dir: &Path, steps: u32, start_file: Option<&Path>) -> (Proc, PathBuf) {
    let log = dir.join("job.log");
    let mut cmd = Command::new(PYTHON3);
    cmd.arg(&fixtures().torch_train_py)
        .args(["--steps", &steps.to_string(), "--step-ms", "20", "--log"])
        .arg(&log)
        .stderr(Stdio::null());
    if let Some(f) = start_file {
        cmd.arg("--start-file").arg(f);
    }
    (Proc::spawn_ready(&mut cmd), log)
}

/// Reads element 0 of an array map by id (bpf(BPF_MAP_LOOKUP_ELEM)).
fn map_value(info: &MapInfo) -> Option<Vec<u8>> {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    let fd = info.fd().ok()?;
    let mut value = vec![0u8; info.value_size() as usize];
    let key = 0u32;
    let mut attr = [0u64; 4];
    attr[0] = fd.as_fd().as_raw_fd() as u64;
    attr[1] = &key as *const u32 as u64;
    attr[2] = value.as_mut_ptr() as u64;
    // SAFETY: BPF_MAP_LOOKUP_ELEM reads key_size bytes at `key` and writes
    // value_size bytes to `value`, both valid for this call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            1 as libc::c_long,
            attr.as_mut_ptr(),
            std::mem::size_of_val(&attr),
        )
    };
    (rc == 0).then_some(value)
}

/// dynprof's step-marker programs loaded for `pid` (dynprof bakes the
/// target's tgid into the program's read-only data): one per attach.
fn marker_programs_for(pid: u32) -> usize {
    let mut n = 0;
    for p in loaded_programs().flatten() {
        if p.name_as_str() != Some("dynprof_marker") {
            continue;
        }
        let hit = p
            .map_ids()
            .ok()
            .flatten()
            .unwrap_or_default()
            .into_iter()
            .any(|id| {
                let Ok(m) = MapInfo::from_id(id) else {
                    return false;
                };
                m.name_as_str().is_some_and(|n| n.contains("rodata"))
                    && map_value(&m).is_some_and(|v| {
                        v.chunks_exact(4)
                            .any(|c| u32::from_le_bytes(c.try_into().unwrap()) == pid)
                    })
            });
        if hit {
            n += 1;
        }
    }
    n
}

/// uprobe perf events still open on `pid`'s behalf: the agent's own fds
/// of type `[perf_event]` (each attached marker holds one).
fn perf_fds_of(agent_pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{agent_pid}/fd"))
        .map(|rd| {
            rd.flatten()
                .filter(|e| {
                    std::fs::read_link(e.path())
                        .is_ok_and(|l| l.to_string_lossy().contains("perf_event"))
                })
                .count()
        })
        .unwrap_or(0)
}

fn prometheus_bin() -> &'static str {
    let p = "/usr/bin/prometheus";
    assert!(
        Path::new(p).exists(),
        "{p} is missing: install Debian's `prometheus` (cargo xtask setup does)"
    );
    p
}

/// Queries Prometheus's HTTP API; the first sample's value, if any.
fn prom_query(port: u16, q: &str) -> Option<f64> {
    let enc: String = q
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let (st, body) = http(port, "GET", &format!("/api/v1/query?query={enc}"), &[], "")?;
    if st != 200 {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    v["data"]["result"][0]["value"][1].as_str()?.parse().ok()
}

#[test]
fn prometheus_scrapes_agent_and_step_count_matches_job_log() {
    require_privileges!();
    let _g = one();
    let prom = prometheus_bin();
    let dir = scratch_dir("agent_prom");
    const STEPS: u32 = 40;
    let start = dir.join("go");
    let (mut job, log) = torch_job(&dir, STEPS, Some(&start));
    let agent = Agent::start(&dir, "node-a", &[]);
    // Attached before the first step: the series exists, at zero.
    let at_attach = wait_for(
        T,
        "the job's series in /metrics",
        || agent.metric("dynprof_steps_total", job.pid),
        || agent.log(),
    );
    assert_eq!(at_attach, 0.0, "no step was taken before --start-file");

    let prom_port = free_port();
    let cfg = dir.join("prometheus.yml");
    std::fs::write(
        &cfg,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: dynprof\n    static_configs:\n      - targets: ['127.0.0.1:{}']\n",
            agent.port
        ),
    )
    .unwrap();
    let mut prom_proc = Proc::spawn(
        Command::new(prom)
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
            .stderr(std::fs::File::create(dir.join("prometheus.stderr")).unwrap()),
    );
    std::fs::write(&start, "").unwrap();
    let st = job.wait_timeout(T).expect("the job finishes its steps");
    assert!(st.success());
    let logged = log_lines_of(&log, "step").len();
    assert_eq!(logged, STEPS as usize, "the job's own log");

    let q = format!("dynprof_steps_total{{pid=\"{}\"}}", job.pid);
    let got = wait_for(
        T,
        "Prometheus to hold the final step count",
        || prom_query(prom_port, &q).filter(|v| *v == logged as f64),
        || {
            format!(
                "prometheus says {:?}; agent says {:?}\n{}",
                prom_query(prom_port, &q),
                agent.metric("dynprof_steps_total", job.pid),
                agent.log()
            )
        },
    );
    assert_eq!(got, logged as f64);
    // Every step but the first closes one interval: STEPS - 1 observations.
    let qc = format!("dynprof_step_duration_seconds_count{{pid=\"{}\"}}", job.pid);
    let count = wait_for(
        T,
        "the histogram's count",
        || prom_query(prom_port, &qc).filter(|v| *v == (logged - 1) as f64),
        || format!("{:?}", prom_query(prom_port, &qc)),
    );
    assert_eq!(count, (logged - 1) as f64);
    // The attached gauge dropped to zero once the job exited.
    let qa = "dynprof_attached_targets{node=\"node-a\"}";
    wait_for(
        T,
        "attached_targets back to 0",
        || prom_query(prom_port, qa).filter(|v| *v == 0.0),
        || agent.log(),
    );
    prom_proc.terminate();
    drop(agent);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn agent_sigkill_and_restart_attaches_once_and_leaks_nothing() {
    require_privileges!();
    let _g = one();
    let dir = scratch_dir("agent_restart");
    let (job, _log) = torch_job(&dir, 0, None);
    let mut a = Agent::start(&dir, "first", &[]);
    wait_for(
        T,
        "steps counted by the first agent",
        || {
            a.metric("dynprof_steps_total", job.pid)
                .filter(|v| *v >= 3.0)
        },
        || a.log(),
    );
    let programs = marker_programs_for(job.pid);
    assert!(
        programs >= 1,
        "the first agent's step-marker program is loaded"
    );
    let perf = perf_fds_of(a.child.id());
    assert!(perf >= 1, "the first agent holds its uprobe perf events");

    // A second agent meanwhile: the per-target lock keeps it off.
    let b = Agent::start(&dir, "second", &[]);
    let line = wait_for(
        T,
        "the second agent to be refused the job",
        || {
            b.log()
                .lines()
                .find(|l| l.contains(&format!("cannot attach to PID {}", job.pid)))
                .map(str::to_string)
        },
        || b.log(),
    );
    assert!(
        line.contains("already controlled by another dynprof"),
        "{line}"
    );
    assert_eq!(
        b.metric("dynprof_steps_total", job.pid),
        None,
        "no series: not attached"
    );
    assert_eq!(marker_programs_for(job.pid), programs, "no second attach");
    drop(b);

    // SIGKILL: its programs (and uprobes) go with its fds.
    a.kill9();
    wait_for(
        T,
        "the killed agent's programs to be unloaded",
        || (marker_programs_for(job.pid) == 0).then_some(()),
        || format!("{} still loaded", marker_programs_for(job.pid)),
    );

    // Restarted: attaches again, exactly once, and counts again.
    let c = Agent::start(&dir, "restarted", &[]);
    let first = wait_for(
        T,
        "the restarted agent's series",
        || c.metric("dynprof_steps_total", job.pid),
        || c.log(),
    );
    wait_for(
        T,
        "metrics to resume",
        || {
            c.metric("dynprof_steps_total", job.pid)
                .filter(|v| *v >= first + 3.0)
        },
        || c.log(),
    );
    assert_eq!(
        marker_programs_for(job.pid),
        programs,
        "attached once, as the first agent was"
    );
    assert_eq!(
        c.log()
            .matches(&format!("attached to PID {}", job.pid))
            .count(),
        1,
        "{}",
        c.log()
    );
    drop(c);
    wait_for(
        T,
        "programs unloaded after SIGTERM",
        || (marker_programs_for(job.pid) == 0).then_some(()),
        String::new,
    );
    drop(job);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_requests_get_4xx_and_agent_keeps_running() {
    require_privileges!();
    let _g = one();
    let dir = scratch_dir("agent_bad");
    let a = Agent::start(&dir, "bad", &[]);
    for (body, want) in [
        ("{bad json", 400),
        ("[]", 400),
        (r#"{"job": "1", "active": 0}"#, 400),
        (r#"{"job": "1", "pid": 2, "active": 3}"#, 400),
        (r#"{"job": "1", "active": 3, "collect": ["gpu"]}"#, 400),
        (r#"{"job": "1", "active": 3, "start_at": 12}"#, 400),
        (r#"{"job": "no-such-job", "active": 3}"#, 404),
    ] {
        let (st, resp) = http(
            a.port,
            "POST",
            "/capture",
            &[("Content-Type", "application/json")],
            body,
        )
        .expect("answered");
        assert_eq!(st, want, "{body} -> {resp}");
        let v: serde_json::Value = serde_json::from_str(&resp)
            .unwrap_or_else(|e| panic!("{body}: not JSON ({e}): {resp}"));
        assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{resp}");
    }
    // Too large a body.
    let big = format!("{{\"job\": \"{}\", \"active\": 1}}", "x".repeat(100_000));
    assert_eq!(
        http(a.port, "POST", "/capture", &[], &big).map(|r| r.0),
        Some(413)
    );
    assert_eq!(a.get("/healthz").map(|r| r.0), Some(200));
    assert_eq!(
        a.get("/captures").map(|r| (r.0, r.1.trim().to_string())),
        Some((200, "[]".into()))
    );
    drop(a);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn token_rules() {
    require_privileges!();
    let _g = one();
    let dir = scratch_dir("agent_token");
    // Not loopback and no token: refused before anything starts.
    let out = Command::new(dynprof_bin())
        .args(["agent", "--listen", "0.0.0.0:0", "--output"])
        .arg(dir.join("out"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("refusing to listen on 0.0.0.0:0 without --token-file"),
        "{err}"
    );

    // A token too short to be one.
    let weak = dir.join("weak");
    std::fs::write(&weak, "abc\n").unwrap();
    let out = Command::new(dynprof_bin())
        .args(["agent", "--listen", "0.0.0.0:0", "--token-file"])
        .arg(&weak)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 16 characters"));

    let tok = dir.join("token");
    std::fs::write(&tok, "0123456789abcdef0123456789abcdef\n").unwrap();
    let a = Agent::start(&dir, "tok", &["--token-file", tok.to_str().unwrap()]);
    let body = r#"{"job": "no-such-job", "active": 3}"#;
    for hdr in [
        vec![],
        vec![("Authorization", "Bearer wrong-token-wrong-token-xx")],
        vec![("Authorization", "0123456789abcdef0123456789abcdef")],
    ] {
        let (st, resp) = http(a.port, "POST", "/capture", &hdr, body).unwrap();
        assert_eq!(st, 401, "{hdr:?}: {resp}");
        assert_eq!(
            http(a.port, "GET", "/captures", &hdr, "").map(|r| r.0),
            Some(401)
        );
    }
    // The right token gets through to the request itself.
    let good = [("Authorization", "Bearer 0123456789abcdef0123456789abcdef")];
    assert_eq!(
        http(a.port, "POST", "/capture", &good, body).map(|r| r.0),
        Some(404)
    );
    assert_eq!(
        http(a.port, "GET", "/captures", &good, "").map(|r| r.0),
        Some(200)
    );
    // /metrics stays open and read-only.
    assert_eq!(a.get("/metrics").map(|r| r.0), Some(200));
    assert_eq!(
        http(a.port, "POST", "/metrics", &[], "").map(|r| r.0),
        Some(405)
    );
    drop(a);
    let _ = std::fs::remove_dir_all(&dir);
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// How the test asks both "nodes" for a capture: it returns the common
/// start instant in this host's CLOCK_MONOTONIC.
enum Trigger {
    /// `POST /capture` to each agent with the same `start_at`.
    Http,
    /// One save of the shared `profiler_config.json` (both agents watch it).
    ConfigDir(PathBuf),
    /// One update of a ConfigMap volume, as kubelet's atomic writer makes
    /// it (both agents watch the same directory).
    ConfigMap(PathBuf),
}

/// Updates `dir` as kubelet's atomic writer does: a new timestamped
/// directory, a `..data_tmp` link to it renamed over `..data`, the file's
/// link `profiler_config.json -> ..data/profiler_config.json` made once,
/// the previous timestamped directory removed.
fn kubelet_update(dir: &Path, version: u32, text: &str) {
    let ts = format!("..2026_12_03_10_00_{version:02}.{version:09}");
    std::fs::create_dir(dir.join(&ts)).unwrap();
    std::fs::write(dir.join(&ts).join("profiler_config.json"), text).unwrap();
    let old = std::fs::read_link(dir.join("..data")).ok();
    std::os::unix::fs::symlink(&ts, dir.join("..data_tmp")).unwrap();
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
    let link = dir.join("profiler_config.json");
    if std::fs::symlink_metadata(&link).is_err() {
        std::os::unix::fs::symlink("..data/profiler_config.json", &link).unwrap();
    }
    if let Some(old) = old {
        std::fs::remove_dir_all(dir.join(old)).unwrap();
    }
}

const CONFIG_LEAD_S: u64 = 4;

/// Two "nodes": one 2-rank DDP job (gloo, lockstep) whose rank 0 only
/// agent A follows and rank 1 only agent B (each under its own shell, as on
/// two hosts). One capture trigger makes both record the same training
/// iterations (each rank's own log says which), after the common instant.
fn two_nodes(tag: &str, trigger: Trigger) {
    let dir = scratch_dir(tag);
    let port = free_port().to_string();
    let script = workspace_root().join("tests/fixtures/ddp_train.py");
    // A shell stays the rank's parent (`; :` keeps it from exec'ing): the
    // rank is "under" it for --only-under.
    let mut shells: Vec<Proc> = (0..2)
        .map(|r| {
            let mut cmd = Command::new("sh");
            cmd.args(["-c", "\"$@\"; :", "sh", PYTHON3])
                .arg(&script)
                .arg("--log")
                .arg(dir.join(format!("rank{r}.log")))
                .args(["--burn-ms", "30"])
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", "0")
                .env("WORLD_SIZE", "2")
                .stderr(Stdio::null());
            Proc::spawn(&mut cmd)
        })
        .collect();
    for s in &mut shells {
        s.pid = wait_ready(&mut s.child).expect("rank ready");
    }
    struct Ranks(Vec<u32>);
    impl Drop for Ranks {
        fn drop(&mut self) {
            for p in &self.0 {
                // SAFETY: kill(2) on the ranks this test started.
                unsafe { libc::kill(*p as i32, libc::SIGKILL) };
            }
        }
    }
    let ranks = Ranks(shells.iter().map(|s| s.pid).collect());
    let lead = CONFIG_LEAD_S.to_string();
    let extra: Vec<&str> = match &trigger {
        Trigger::Http => vec![],
        Trigger::ConfigDir(d) | Trigger::ConfigMap(d) => {
            vec!["--config-dir", d.to_str().unwrap(), "--config-lead", &lead]
        }
    };
    let agents: Vec<Agent> = shells
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let a = Agent::start_under(&dir, &format!("node{i}"), s.host_pid(), &extra);
            wait_for(
                T,
                "the rank attached",
                || a.metric("dynprof_steps_total", s.pid),
                || a.log(),
            );
            a
        })
        .collect();
    // Each agent sees its own rank only.
    assert_eq!(agents[0].metric("dynprof_steps_total", ranks.0[1]), None);
    assert_eq!(agents[1].metric("dynprof_steps_total", ranks.0[0]), None);

    let start_mono = match &trigger {
        Trigger::Http => {
            let start_at = unix_now() + 3.0;
            let start_mono = common::mono_ns() + 3_000_000_000;
            for (a, pid) in agents.iter().zip(&ranks.0) {
                let body = format!(
                    r#"{{"pid": {pid}, "warmup": 1, "active": 3, "start_step": 40, "collect": ["offcpu"], "start_at": {start_at:.6}}}"#
                );
                let (st, resp) = http(a.port, "POST", "/capture", &[], &body).unwrap();
                assert_eq!(st, 202, "{resp}");
            }
            start_mono
        }
        Trigger::ConfigDir(d) => {
            let file = d.join("profiler_config.json");
            // A bad save first: a log line on each node, nothing started.
            std::fs::write(&file, "{\"active\": 0}").unwrap();
            for a in &agents {
                wait_for(
                    T,
                    "the bad config's log line",
                    || a.log().contains("invalid field `active`").then_some(()),
                    || a.log(),
                );
            }
            std::fs::write(
                &file,
                r#"{"start_step": 40, "warmup": 1, "active": 3, "activities": []}"#,
            )
            .unwrap();
            let mtime = std::fs::metadata(&file)
                .unwrap()
                .modified()
                .unwrap()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs_f64();
            let ahead = mtime + CONFIG_LEAD_S as f64 - unix_now();
            (common::mono_ns() as f64 + ahead * 1e9) as u64
        }
        Trigger::ConfigMap(d) => {
            // Without metadata.dynprof_start_at: a log line on each node
            // (the file's time is per node), nothing started.
            kubelet_update(d, 2, r#"{"start_step": 40, "active": 3}"#);
            for a in &agents {
                wait_for(
                    T,
                    "the no-start-instant log line",
                    || {
                        a.log()
                            .contains("give metadata.dynprof_start_at")
                            .then_some(())
                    },
                    || a.log(),
                );
            }
            let start_at = unix_now() + CONFIG_LEAD_S as f64;
            let start_mono = common::mono_ns() + CONFIG_LEAD_S * 1_000_000_000;
            kubelet_update(
                d,
                3,
                &format!(
                    r#"{{"start_step": 40, "warmup": 1, "active": 3, "activities": [], "metadata": {{"dynprof_start_at": {start_at:.6}}}}}"#
                ),
            );
            start_mono
        }
    };
    let mut iterations = Vec::new();
    for (i, (a, pid)) in agents.iter().zip(&ranks.0).enumerate() {
        let rec = wait_for(
            T,
            "the capture to finish",
            || {
                let (_, b) = a.get("/captures")?;
                let v: serde_json::Value = serde_json::from_str(&b).ok()?;
                (v.as_array()?.len() == 1 && v[0]["state"] != "running").then(|| v[0].clone())
            },
            || a.log(),
        );
        assert_eq!(rec["state"], "written", "{rec}\n{}", a.log());
        // The index file on disk says the same.
        let out = dir.join(format!("node{i}-out"));
        let index: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("captures.json")).unwrap())
                .unwrap();
        assert_eq!(index[0]["window"], rec["window"]);
        let csv = std::fs::read_to_string(
            out.join(rec["window"].as_str().unwrap())
                .join("job_steps.csv"),
        )
        .unwrap();
        let log = log_lines_of(dir.join(format!("rank{i}.log")), "step");
        let its: Vec<u64> = csv
            .lines()
            .skip(1)
            .map(|l| {
                let ts: u64 = l.split(',').nth(2).unwrap().parse().unwrap();
                assert!(
                    ts > start_mono,
                    "node{i}: a recorded step starts before the common instant"
                );
                iteration_at(&log, ts, &format!("node{i} (PID {pid})"))
            })
            .collect();
        assert_eq!(its.len(), 3, "node{i}: {csv}");
        // The documented rule: B is the first boundary at or after the
        // instant (optimizer.step() of iteration B), the window starts 40
        // steps later, and 1 step of warmup precedes the 3 recorded.
        let c = log
            .iter()
            .find(|l| l.after >= start_mono)
            .expect("the job stepped past the instant");
        let bs: Vec<u64> = if c.before >= start_mono {
            vec![c.index]
        } else {
            // The instant fell inside that optimizer.step() call.
            vec![c.index, c.index + 1]
        };
        assert!(
            bs.iter().any(|b| its == [b + 41, b + 42, b + 43]),
            "node{i}: recorded iterations {its:?}, expected B+41.. with B in {bs:?}"
        );
        iterations.push((its, bs));
    }
    // The ranks cross a boundary a few milliseconds apart. An instant in
    // that gap (or inside one rank's optimizer.step()) lets the nodes pick
    // neighbouring iterations, as docs/fleet.md says; each node's own rule
    // was checked above. Otherwise both must have picked the same B.
    if iterations[0].1 == iterations[1].1 && iterations[0].1.len() == 1 {
        assert_eq!(
            iterations[0].0, iterations[1].0,
            "both nodes recorded the same training iterations"
        );
    } else {
        eprintln!(
            "the instant fell between the ranks' boundaries (B in {:?} and {:?}): \
             each node checked against its own rank only",
            iterations[0].1, iterations[1].1
        );
    }
    assert_eq!(agents[0].get("/healthz").map(|r| r.0), Some(200));
    drop(agents);
    drop(ranks);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_agents_with_one_start_instant_capture_the_same_iterations() {
    require_privileges!();
    let _g = one();
    two_nodes("agent_two_nodes", Trigger::Http);
}

/// The shared config dir: one save, both nodes, the same iterations; a bad
/// save before it is a log line on each node and starts nothing.
#[test]
fn two_agents_sharing_a_config_dir_capture_the_same_iterations() {
    require_privileges!();
    let _g = one();
    let cfg = scratch_dir("agent_shared_cfg").join("prof_cfg");
    std::fs::create_dir_all(&cfg).unwrap();
    two_nodes("agent_two_nodes_cfg", Trigger::ConfigDir(cfg.clone()));
    let _ = std::fs::remove_dir_all(cfg.parent().unwrap());
}

/// A ConfigMap volume (kubelet's `..data` links, root's) as the shared
/// config dir: one update, both nodes, the same iterations.
#[test]
fn two_agents_sharing_a_configmap_volume_capture_the_same_iterations() {
    require_privileges!();
    let _g = one();
    let cfg = scratch_dir("agent_configmap").join("prof_cfg");
    std::fs::create_dir_all(&cfg).unwrap();
    // The volume as the pod first sees it: the baseline, not a request.
    kubelet_update(&cfg, 1, "{}");
    two_nodes("agent_two_nodes_cm", Trigger::ConfigMap(cfg.clone()));
    let _ = std::fs::remove_dir_all(cfg.parent().unwrap());
}

/// A ConfigMap volume's root as the pod sees it: mode 0777, but mounted
/// read-only (nobody in the pod can plant a name there). The agent, in a
/// mount namespace of its own with that read-only bind mount, follows the
/// links and captures on an update made behind the mount.
#[test]
fn configmap_root_0777_on_a_read_only_mount_is_followed() {
    use std::os::unix::fs::PermissionsExt as _;
    require_privileges!();
    let _g = one();
    let dir = scratch_dir("agent_cm_ro");
    let src = dir.join("volume");
    let cfg = dir.join("prof_cfg");
    std::fs::create_dir(&src).unwrap();
    std::fs::create_dir(&cfg).unwrap();
    std::fs::set_permissions(&src, std::fs::Permissions::from_mode(0o777)).unwrap();
    kubelet_update(&src, 1, "{}");
    let (job, _log) = torch_job(&dir, 0, None);
    let (s, c) = (src.to_str().unwrap(), cfg.to_str().unwrap());
    let a = Agent::start_via(
        &dir,
        "ro",
        std::process::id(),
        &[
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            r#"mount --bind "$1" "$2" && mount -o remount,bind,ro "$2" && shift 2 && exec "$@""#,
            "sh",
            s,
            c,
        ],
        &["--config-dir", c],
    );
    wait_for(
        T,
        "the job attached",
        || a.metric("dynprof_steps_total", job.pid),
        || a.log(),
    );
    let start_at = unix_now() + 2.0;
    kubelet_update(
        &src,
        2,
        &format!(
            r#"{{"start_step": 5, "active": 2, "activities": [], "metadata": {{"dynprof_start_at": {start_at:.6}}}}}"#
        ),
    );
    let rec = wait_for(
        T,
        "the capture to finish",
        || {
            let (_, b) = a.get("/captures")?;
            let v: serde_json::Value = serde_json::from_str(&b).ok()?;
            (v.as_array()?.len() == 1 && v[0]["state"] != "running").then(|| v[0].clone())
        },
        || a.log(),
    );
    assert_eq!(rec["state"], "written", "{rec}\n{}", a.log());
    let csv = std::fs::read_to_string(
        dir.join("ro-out")
            .join(rec["window"].as_str().unwrap())
            .join("job_steps.csv"),
    )
    .unwrap();
    assert_eq!(csv.lines().skip(1).count(), 2, "{csv}");
    assert!(!a.log().contains("refused"), "{}", a.log());
    drop(a);
    drop(job);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Links at the config file that are not kubelet's layout owned by root:
/// one that leads out of the directory, one owned by a user, one in a
/// directory others may write. Each is one log line, never followed.
#[test]
fn config_dir_refuses_escaping_and_user_owned_links() {
    use std::os::unix::fs::PermissionsExt as _;
    require_privileges!();
    let _g = one();
    let dir = scratch_dir("agent_cfg_links");
    let cfg = dir.join("prof_cfg");
    std::fs::create_dir(&cfg).unwrap();
    std::fs::set_permissions(&cfg, std::fs::Permissions::from_mode(0o755)).unwrap();
    let outside = dir.join("outside.json");
    std::fs::write(&outside, r#"{"active": 1}"#).unwrap();
    let link = cfg.join("profiler_config.json");
    std::os::unix::fs::symlink("../outside.json", &link).unwrap();
    let a = Agent::start(&dir, "links", &["--config-dir", cfg.to_str().unwrap()]);
    let shown = link.display().to_string();
    let line = |what: &str| {
        let needle = what.to_string();
        wait_for(
            T,
            what,
            || {
                a.log()
                    .lines()
                    .find(|l| l.contains(&shown) && l.contains(&needle))
                    .map(str::to_string)
            },
            || a.log(),
        )
    };
    let l = line("leads out of");
    assert!(l.ends_with("refused; ignored"), "{l}");
    // A link inside the directory, but a user's.
    std::fs::remove_file(&link).unwrap();
    std::fs::write(cfg.join("real.json"), r#"{"active": 1}"#).unwrap();
    std::os::unix::fs::symlink("real.json", &link).unwrap();
    std::os::unix::fs::lchown(&link, Some(65534), Some(65534)).unwrap();
    line("is owned by uid 65534, not root");
    // Root's link, but in a directory others may write.
    std::os::unix::fs::lchown(&link, Some(0), Some(0)).unwrap();
    std::fs::set_permissions(&cfg, std::fs::Permissions::from_mode(0o1777)).unwrap();
    line("may be written by group or others (mode 1777)");
    assert_eq!(a.get("/healthz").map(|r| r.0), Some(200));
    assert_eq!(
        a.get("/captures").map(|r| (r.0, r.1.trim().to_string())),
        Some((200, "[]".into())),
        "nothing started"
    );
    drop(a);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A capture's child attaches next to the agent's markers: every step the
/// job takes, before, during and after the capture, is in the agent's
/// counter, which ends equal to the job's own log; and the agent holds
/// the process's lock again afterwards.
#[test]
fn steps_during_a_capture_count_in_the_metrics() {
    require_privileges!();
    let _g = one();
    let dir = scratch_dir("agent_capture_steps");
    const STEPS: u32 = 60;
    let start = dir.join("go");
    let (mut job, log) = torch_job(&dir, STEPS, Some(&start));
    let a = Agent::start(&dir, "steps", &[]);
    wait_for(
        T,
        "the job attached",
        || a.metric("dynprof_steps_total", job.pid),
        || a.log(),
    );
    let body = format!(
        r#"{{"pid": {}, "start_step": 5, "active": 3, "collect": ["offcpu"]}}"#,
        job.pid
    );
    let (st, resp) = http(a.port, "POST", "/capture", &[], &body).unwrap();
    assert_eq!(st, 202, "{resp}");
    wait_for(
        T,
        "the capture's child attached next to the agent",
        || {
            (marker_programs_for(job.pid) == 2 && a.log().contains("rank 0: attached"))
                .then_some(())
        },
        || format!("{} programs\n{}", marker_programs_for(job.pid), a.log()),
    );
    std::fs::write(&start, "").unwrap();
    let rec = wait_for(
        T,
        "the capture to finish",
        || {
            let (_, b) = a.get("/captures")?;
            let v: serde_json::Value = serde_json::from_str(&b).ok()?;
            (v.as_array()?.len() == 1 && v[0]["state"] != "running").then(|| v[0].clone())
        },
        || a.log(),
    );
    assert_eq!(rec["state"], "written", "{rec}\n{}", a.log());
    let st = job.wait_timeout(T).expect("the job finishes its steps");
    assert!(st.success());
    let logged = log_lines_of(&log, "step").len();
    assert_eq!(logged, STEPS as usize, "the job's own log");
    // The session ended with the process: every event is counted.
    wait_for(
        T,
        "the agent to see the job exit",
        || {
            a.log()
                .contains(&format!("detached from PID {}", job.pid))
                .then_some(())
        },
        || a.log(),
    );
    assert_eq!(
        a.metric("dynprof_steps_total", job.pid),
        Some(logged as f64),
        "{}",
        a.log()
    );
    assert_eq!(
        a.metric("dynprof_step_duration_seconds_count", job.pid),
        Some((logged - 1) as f64)
    );
    assert!(
        !a.log().contains("not taken back"),
        "the agent took the lock back: {}",
        a.log()
    );
    drop(a);
    let _ = std::fs::remove_dir_all(&dir);
}

/// SIGTERM while a capture waits for its window: the capture's child
/// detaches, the agent records the capture as failed in captures.json,
/// exits 0, and no dynprof program stays loaded for the job.
#[test]
fn sigterm_during_a_capture_detaches_everything_and_records_it() {
    require_privileges!();
    let _g = one();
    let dir = scratch_dir("agent_stop_capture");
    let (job, _log) = torch_job(&dir, 0, None);
    let mut a = Agent::start(&dir, "stopping", &[]);
    wait_for(
        T,
        "the job attached",
        || a.metric("dynprof_steps_total", job.pid),
        || a.log(),
    );
    // A window far ahead: the child attaches and waits.
    let body = format!(
        r#"{{"pid": {}, "start_step": 100000, "active": 1}}"#,
        job.pid
    );
    let (st, resp) = http(a.port, "POST", "/capture", &[], &body).unwrap();
    assert_eq!(st, 202, "{resp}");
    let (st, resp) = http(a.port, "POST", "/capture", &[], &body).unwrap();
    assert_eq!(st, 409, "a second capture of the same job: {resp}");
    wait_for(
        T,
        "the capture's child attached",
        || {
            // The agent's markers stay next to the child's.
            (marker_programs_for(job.pid) == 2 && a.log().contains("rank 0: attached"))
                .then_some(())
        },
        || a.log(),
    );
    // SAFETY: kill(2) on our own child, not reaped yet.
    unsafe { libc::kill(a.child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = a.child.try_wait().unwrap() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "the agent did not stop:\n{}",
            a.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}\n{}", a.log());
    assert!(
        a.log().contains("stopping 1 running capture(s)"),
        "{}",
        a.log()
    );
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("stopping-out/captures.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(index[0]["state"], "failed", "{index}");
    assert_eq!(marker_programs_for(job.pid), 0, "nothing left attached");
    // A new agent on the same --output still lists that capture.
    let b = Agent::start(&dir, "stopping", &[]);
    let (st, body) = b.get("/captures").expect("GET /captures");
    assert_eq!(st, 200, "{body}");
    let listed: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(listed[0]["id"], index[0]["id"], "{listed}");
    assert_eq!(listed[0]["state"], "failed", "{listed}");
    drop(b);
    drop(job);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `curl --unix-socket SOCK` as `who` (setpriv arguments, empty: root):
/// curl's exit code, HTTP status and body.
fn curl_unix(
    sock: &Path,
    who: &[&str],
    method: &str,
    path: &str,
    body: &str,
) -> (i32, u16, String) {
    let mut cmd = if who.is_empty() {
        Command::new("curl")
    } else {
        let mut c = Command::new("setpriv");
        c.args(who).arg("curl");
        c
    };
    let out = cmd
        .args(["-sS", "--max-time", "30", "-o", "-", "-w", "\n%{http_code}"])
        .arg("--unix-socket")
        .arg(sock)
        .args(["-X", method, "-H", "Content-Type: application/json"])
        .args(if body.is_empty() {
            vec![]
        } else {
            vec!["--data-binary", body]
        })
        .arg(format!("http://agent{path}"))
        .output()
        .expect("running curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (b, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (
        out.status.code().unwrap_or(-1),
        code.trim().parse().unwrap_or(0),
        format!("{b}{}", String::from_utf8_lossy(&out.stderr)),
    )
}

/// `connect(2)` to `sock` as uid/gid 65534 (plus `groups`): the errno, or 0.
fn connect_as_nobody(sock: &Path, groups: &str) -> i32 {
    let out = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534"])
        .args(if groups.is_empty() {
            vec!["--clear-groups".to_string()]
        } else {
            vec!["--groups".to_string(), groups.to_string()]
        })
        .args([
            PYTHON3,
            "-c",
            "import socket,sys\ns=socket.socket(socket.AF_UNIX)\ntry:\n s.connect(sys.argv[1]); print(0)\nexcept OSError as e:\n print(e.errno)",
        ])
        .arg(sock)
        .output()
        .expect("running setpriv");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{out:?}"))
}

/// `--socket`: captures over the unix socket end to end; the socket is
/// root:GID 0660, so uid 65534 gets EACCES unless in that group; TCP
/// without a token is metrics-only; a planted file or symlink, or a
/// directory others may write, is refused and left alone.
#[test]
fn unix_socket_serves_captures_to_root_and_its_group_only() {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    require_privileges!();
    let _g = one();
    let dir = scratch_dir("agent_socket");
    let run = dir.join("run");
    std::fs::create_dir(&run).unwrap();
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755)).unwrap();
    let sock = run.join("agent.sock");
    let sock_s = sock.to_str().unwrap();
    let refused = |why: &str| {
        let out = Command::new(dynprof_bin())
            .args([
                "agent",
                "--listen",
                "127.0.0.1:0",
                "--socket",
                sock_s,
                "--output",
            ])
            .arg(dir.join("refused-out"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains(&format!("refusing --socket {sock_s}")),
            "{err}"
        );
        assert!(err.contains(why), "{err}");
    };
    // A planted regular file: refused, left as it was.
    std::fs::write(&sock, "precious").unwrap();
    refused("exists and is a regular file");
    assert_eq!(std::fs::read_to_string(&sock).unwrap(), "precious");
    std::fs::remove_file(&sock).unwrap();
    // A planted symlink: refused, neither followed nor removed.
    let victim = dir.join("victim");
    std::fs::write(&victim, "keep").unwrap();
    std::os::unix::fs::symlink(&victim, &sock).unwrap();
    refused("exists and is a symbolic link");
    assert!(
        std::fs::symlink_metadata(&sock)
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
    std::fs::remove_file(&sock).unwrap();
    // A directory others may write (even sticky): refused.
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o1777)).unwrap();
    refused("may be written by users other than root");
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755)).unwrap();
    assert!(!sock.exists());
    // A stale socket (a killed agent's) is replaced.
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());

    let (job, _log) = torch_job(&dir, 0, None);
    let a = Agent::start(
        &dir,
        "sock",
        &["--socket", sock_s, "--socket-group", "4242"],
    );
    let m = std::fs::symlink_metadata(&sock).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()));
    assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (0, 4242, 0o660));
    wait_for(
        T,
        "the job attached",
        || a.metric("dynprof_steps_total", job.pid),
        || a.log(),
    );
    // Not in the group: EACCES. In it: served.
    assert_eq!(connect_as_nobody(&sock, ""), libc::EACCES);
    assert_eq!(connect_as_nobody(&sock, "4242"), 0);
    let member = ["--reuid", "65534", "--regid", "65534", "--groups", "4242"];
    let (rc, st, body) = curl_unix(&sock, &member, "GET", "/captures", "");
    assert_eq!((rc, st), (0, 200), "{body}");
    let nobody = ["--reuid", "65534", "--regid", "65534", "--clear-groups"];
    let (rc, _, body) = curl_unix(&sock, &nobody, "GET", "/captures", "");
    assert_eq!(rc, 7, "curl cannot connect: {body}");

    // TCP without a token: metrics only.
    let req = format!(
        r#"{{"pid": {}, "start_step": 5, "active": 2, "collect": ["offcpu"]}}"#,
        job.pid
    );
    let (st, resp) = http(a.port, "POST", "/capture", &[], &req).unwrap();
    assert_eq!(st, 403, "{resp}");
    assert!(resp.contains("unix socket"), "{resp}");
    assert_eq!(a.get("/metrics").map(|r| r.0), Some(200));

    // A capture over the socket, end to end.
    let (rc, st, resp) = curl_unix(&sock, &[], "POST", "/capture", &req);
    assert_eq!((rc, st), (0, 202), "{resp}");
    let rec = wait_for(
        T,
        "the capture to finish",
        || {
            let (_, _, b) = curl_unix(&sock, &[], "GET", "/captures", "");
            let v: serde_json::Value = serde_json::from_str(&b).ok()?;
            (v.as_array()?.len() == 1 && v[0]["state"] != "running").then(|| v[0].clone())
        },
        || a.log(),
    );
    assert_eq!(rec["state"], "written", "{rec}\n{}", a.log());
    let csv = std::fs::read_to_string(
        dir.join("sock-out")
            .join(rec["window"].as_str().unwrap())
            .join("job_steps.csv"),
    )
    .unwrap();
    assert_eq!(csv.lines().skip(1).count(), 2, "{csv}");
    drop(a);
    drop(job);
    let _ = std::fs::remove_dir_all(&dir);
}
