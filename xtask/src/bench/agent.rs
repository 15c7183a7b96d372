//! Section 11: `dynprof agent` with 8 real PyTorch ranks (Debian torch 1.13,
//! `tests/fixtures/torch_train.py` at 10 steps/s each).
//!
//! The agent follows only the bench's own children (`--only-under`), so
//! jobs elsewhere on the machine do not change its load. Once its
//! `dynprof_attached_targets` reads 8:
//! - idle CPU: the agent's utime+stime over `IDLE_S`, as % of one core;
//! - RSS: VmRSS at the end of that interval (and VmHWM);
//! - `/metrics` latency: `SCRAPES` sequential GETs over loopback, each
//!   timed from connect to the end of the body.

use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use super::{
    Ctx, Section,
    fig::{Figure, Goal, Unit},
    json::Json,
    procs::{self, Proc},
    say, stats,
};

const RANKS: usize = 8;
const IDLE_S: u64 = 20;
const SCRAPES: usize = 200;
const SIGTERM: i32 = 15;

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// One HTTP/1.1 GET with `Connection: close`; (status, body).
fn get(port: u16, path: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )?;
    let mut buf = String::new();
    s.read_to_string(&mut buf)?;
    let status = buf
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("no HTTP status line")?;
    let body = buf
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    Ok((status, body))
}

/// The sum of a metric's series in /metrics (`name` or `name{…}`).
fn metric_sum(port: u16, name: &str) -> Option<f64> {
    let (st, body) = get(port, "/metrics").ok()?;
    if st != 200 {
        return None;
    }
    let v: f64 = body
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with([' ', '{']))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    Some(v)
}

fn attached(port: u16) -> Option<f64> {
    metric_sum(port, "dynprof_attached_targets")
}

pub fn run(ctx: &Ctx) -> Result<Section> {
    let mut s = Section::new("");
    let script = crate::util::workspace_root().join("tests/fixtures/torch_train.py");
    let mut ranks: Vec<Proc> = Vec::new();
    for r in 0..RANKS {
        let mut cmd = Command::new(&ctx.python);
        cmd.arg(&script)
            .args(["--step-ms", "100"])
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", RANKS.to_string());
        ranks.push(Proc::spawn(&format!("torch rank {r}"), &mut cmd)?);
    }
    for p in &mut ranks {
        p.wait_prefix(Duration::from_secs(120), "ready")?;
    }
    let port = free_port()?;
    let out = ctx.work.join("agent-out");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    let mut cmd = Command::new(&ctx.dynprof);
    cmd.args(["agent", "--listen", &format!("127.0.0.1:{port}")])
        .arg("--output")
        .arg(&out)
        .args(["--only-under", &std::process::id().to_string()]);
    let mut agent = Proc::spawn("dynprof agent", &mut cmd)?;
    let t0 = Instant::now();
    let result = (|| -> Result<()> {
        // Attached to all 8 (the first rescan resolves libtorch's symbols
        // for each rank: seconds).
        loop {
            if attached(port) == Some(RANKS as f64) {
                break;
            }
            if t0.elapsed() > Duration::from_secs(180) {
                bail!(
                    "the agent did not attach to {RANKS} ranks within 180 s (attached: {:?})",
                    attached(port)
                );
            }
            agent.pump();
            std::thread::sleep(Duration::from_millis(200));
        }
        let attach_s = t0.elapsed().as_secs_f64();
        say(format!(
            "agent: {RANKS} ranks attached after {attach_s:.1} s"
        ));
        let pid = agent.pid();
        let s0 = metric_sum(port, "dynprof_steps_total").unwrap_or(0.0);
        let c0 = procs::cpu_ns(pid).context("the agent's CPU time")?;
        let w0 = Instant::now();
        std::thread::sleep(Duration::from_secs(IDLE_S));
        let c1 = procs::cpu_ns(pid).context("the agent's CPU time")?;
        let wall = w0.elapsed().as_secs_f64();
        let s1 = metric_sum(port, "dynprof_steps_total").unwrap_or(0.0);
        // The agent was following steps all along, not idling detached.
        let steps_per_s = (s1 - s0) / wall;
        if steps_per_s < 1.0 {
            bail!(
                "the agent counted {} steps in {wall:.0} s: not following the ranks",
                s1 - s0
            );
        }
        let cpu_pct = 100.0 * c1.saturating_sub(c0) as f64 / 1e9 / wall;
        let rss_mib = procs::status_kb(pid, "VmRSS").unwrap_or(0) as f64 / 1024.0;
        let hwm_mib = procs::status_kb(pid, "VmHWM").unwrap_or(0) as f64 / 1024.0;

        let mut lat = Vec::with_capacity(SCRAPES);
        for _ in 0..SCRAPES {
            let t = Instant::now();
            let (st, body) = get(port, "/metrics")?;
            lat.push(t.elapsed().as_secs_f64() * 1e3);
            if st != 200 || !body.contains("dynprof_steps_total") {
                bail!("/metrics answered {st} without dynprof_steps_total");
            }
        }
        let p50 = stats::percentile(&lat, 50.0).unwrap_or(f64::NAN);
        let p99 = stats::percentile(&lat, 99.0).unwrap_or(f64::NAN);
        s.figures.push(
            Figure::new(
                "agent_idle_cpu_pct",
                "agent, 8 attached PyTorch ranks idle: CPU (% of one core)",
                Unit::PctCore,
                Goal::AtMost(1.0),
                "≤ 1% of a core",
            )
            .value(cpu_pct)
            .note(format!(
                "over {IDLE_S} s, while it counted {steps_per_s:.0} steps/s across the ranks"
            )),
        );
        s.figures.push(
            Figure::new(
                "agent_idle_rss_mib",
                "agent, 8 attached ranks: RSS (MiB)",
                Unit::MiB,
                Goal::AtMost(100.0),
                "≤ 100 MiB",
            )
            .value(rss_mib)
            .note(format!("peak (VmHWM) {hwm_mib:.1} MiB")),
        );
        s.figures.push(
            Figure::new(
                "agent_metrics_p99_ms",
                "agent: /metrics latency at 8 ranks, p99 (ms)",
                Unit::Ms,
                Goal::AtMost(5.0),
                "≤ 5 ms",
            )
            .value(p99)
            .note(format!("{SCRAPES} sequential scrapes; p50 {p50:.2} ms")),
        );
        s.raw = Json::obj(vec![
            ("attach_s", Json::num(attach_s)),
            ("idle_cpu_pct", Json::num(cpu_pct)),
            ("steps_per_s", Json::num(steps_per_s)),
            ("rss_mib", Json::num(rss_mib)),
            ("hwm_mib", Json::num(hwm_mib)),
            ("metrics_ms", Json::nums(&lat)),
        ]);
        Ok(())
    })();
    agent.signal(SIGTERM);
    let _ = agent.wait_exit(Duration::from_secs(20));
    for p in &mut ranks {
        p.signal(SIGTERM);
        let _ = p.wait_exit(Duration::from_secs(5));
    }
    result?;
    Ok(s)
}
