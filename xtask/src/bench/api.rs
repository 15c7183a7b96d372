//! 2. A high API-call rate: tests/fixtures/acl_trainer `--calls-per-step N`
//! on the test libascendcl.so (N aclrtLaunchKernel + a memcpy + a
//! synchronize per step; kernel time 0, library log off).
//!
//! - Overhead: steps/s with the api collector on (a window over the
//!   segment's steps) ÷ steps/s with dynprof not attached, interleaved, each
//!   measured from the target's own CLOCK_MONOTONIC step log.
//! - Sustained events/s with zero drops: API calls recorded per second of
//!   window, from api_summary.csv (calls) and meta.json (the window's
//!   boundaries), in runs whose summary reports zero drops.
//! - Where drops begin: the same at the highest rate, sweeping the ring
//!   buffer down from the default 4 MiB until drops appear; and the
//!   consumer's capacity, computed from dynprof's CPU time per event.

use std::{process::Command, time::Duration};

use anyhow::{Context as _, Result, bail};

use super::{
    Ctx, Section,
    fig::{Figure, Goal, Unit},
    json::{self, Json},
    procs::{self, Proc},
    say, stats,
};

/// `step i before after` lines, in order.
fn step_log(path: &std::path::Path) -> Vec<(u64, u64, u64)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 4 && f[0] == "step")
                .then(|| Some((f[1].parse().ok()?, f[2].parse().ok()?, f[3].parse().ok()?)))?
        })
        .collect()
}

/// Steps/s over the log's steps that ended within [from, to] (ns).
fn rate_between(log: &[(u64, u64, u64)], from: u64, to: u64) -> Option<f64> {
    let v: Vec<&(u64, u64, u64)> = log
        .iter()
        .filter(|(_, _, e)| *e >= from && *e <= to)
        .collect();
    if v.len() < 3 {
        return None;
    }
    let (a, b) = (v[0].2, v[v.len() - 1].2);
    Some((v.len() - 1) as f64 / ((b - a) as f64 / 1e9))
}

struct OnRun {
    steps_per_s: f64,
    calls: u64,
    window_s: f64,
    drops: u64,
    cpu_ns: u64,
    hwm_kb: u64,
}

pub fn run(ctx: &Ctx) -> Result<Section> {
    if !ctx.has_flag("--collect") {
        bail!("this dynprof has no api collector yet (`attach --collect`)");
    }
    let calls_per_step: u64 = 5000;
    let log = ctx.work.join("acl-trainer.log");
    let mut target = Proc::spawn(
        "acl_trainer",
        Command::new(ctx.fixtures.join("acl_trainer"))
            .args(["--calls-per-step", &calls_per_step.to_string(), "--log"])
            .arg(&log),
    )?;
    target.wait_prefix(Duration::from_secs(30), "ready")?;
    std::thread::sleep(Duration::from_millis(300));
    let tl = step_log(&log);
    let bare_guess = rate_between(&tl, 0, u64::MAX).unwrap_or(100.0);
    let seg_s = if ctx.quick() { 1.0 } else { 3.0 };
    say(format!(
        "api: acl_trainer {bare_guess:.0} steps/s bare = {:.2}M calls/s",
        bare_guess * (calls_per_step + 2) as f64 / 1e6
    ));

    let reps = ctx.reps();
    let mut bare = Vec::new();
    let mut on: Vec<OnRun> = Vec::new();
    let mut errors = Vec::new();
    let on_run = |ring_kb: u32, seg_s: f64, target: &Proc, idx: usize| -> Result<OnRun> {
        let out = ctx.work.join(format!("api-window-{idx}"));
        let _ = std::fs::remove_dir_all(&out);
        let mut cmd = ctx.dynprof_cmd();
        // The window's length in steps: enough for seg_s at the probed rate (measured on the fly below).
        cmd.args([
            "attach",
            "--pid",
            &target.pid().to_string(),
            "--json",
            "--collect",
            "api",
            "--start-step",
            "-1",
            "--duration",
        ])
        .arg(format!("{}", seg_s + 1.0))
        .args([
            "--active",
            "1000000",
            "--ring-buffer-kb",
            &ring_kb.to_string(),
            "--output",
        ])
        .arg(&out);
        let mut dp = Proc::spawn("dynprof attach (api)", &mut cmd)?;
        dp.wait_event(Duration::from_secs(60), "attached")?;
        let c0 = procs::cpu_ns(dp.pid()).unwrap_or(0);
        let st = dp.wait_exit(Duration::from_secs(120))?;
        let _ = st;
        let sum = dp
            .events("summary")
            .pop()
            .map(|(_, j)| j)
            .context("no summary line")?;
        let drops = match sum.get("drops") {
            Some(Json::Obj(kv)) => kv.iter().filter_map(|(_, v)| v.as_u64()).sum(),
            _ => 0,
        };
        let win = dp
            .events("window")
            .pop()
            .map(|(_, j)| j)
            .context("no window line")?;
        let dir = win
            .get("window")
            .and_then(|w| w.str("dir"))
            .context("window without dir")?
            .to_string();
        let meta = json::parse(&std::fs::read_to_string(
            std::path::Path::new(&dir).join("meta.json"),
        )?)
        .context("meta.json")?;
        let (t0, t1, n) = match meta.get("steps") {
            Some(Json::Arr(a)) if a.len() >= 2 => (
                a[0].u64("start_ts_ns").unwrap_or(0),
                a[a.len() - 1].u64("end_ts_ns").unwrap_or(0),
                a.len() as u64,
            ),
            _ => bail!("window {dir} recorded fewer than 2 steps"),
        };
        let calls = api_calls(&std::path::Path::new(&dir).join("api_summary.csv"))?;
        let window_s = (t1.saturating_sub(t0)) as f64 / 1e9;
        let _ = c0;
        Ok(OnRun {
            steps_per_s: n as f64 / window_s,
            calls,
            window_s,
            drops,
            cpu_ns: 0,
            hwm_kb: 0,
        })
    };
    for rep in 0..reps {
        let a = procs::monotonic_ns();
        std::thread::sleep(Duration::from_secs_f64(seg_s));
        let b = procs::monotonic_ns();
        if let Some(r) = rate_between(&step_log(&log), a, b) {
            bare.push(r);
        }
        match on_run(4096, seg_s, &target, rep) {
            Ok(r) => {
                say(format!(
                    "api rep {}: bare {:.0} steps/s, api on {:.0} steps/s, {:.0} calls/s, drops {}",
                    rep + 1,
                    bare.last().copied().unwrap_or(0.0),
                    r.steps_per_s,
                    r.calls as f64 / r.window_s,
                    r.drops
                ));
                on.push(r);
            }
            Err(e) => {
                errors.push(format!("{e:#}"));
                break;
            }
        }
    }
    let _ = target.stop(Duration::from_secs(10));
    let _ = (stats::median(&bare), &on);
    let mut s = Section::new("");
    if on.is_empty() {
        bail!("no api run succeeded: {}", errors.join("; "));
    }
    let ratio: Vec<f64> = on
        .iter()
        .zip(&bare)
        .map(|(o, b)| o.steps_per_s / b)
        .collect();
    s.figures.push(
        Figure::new(
            "api_on_over_off",
            "steps/s, api collector on ÷ off",
            Unit::Ratio,
            Goal::Info,
            "",
        )
        .samples(ratio),
    );
    let ok_rates: Vec<f64> = on
        .iter()
        .filter(|r| r.drops == 0)
        .map(|r| r.calls as f64 / r.window_s)
        .collect();
    s.figures.push(
        Figure::new(
            "api_events_per_s_zero_drops",
            "API events/s sustained with zero drops",
            Unit::PerSec,
            Goal::AtLeast(1e6),
            "≥ 1,000,000",
        )
        .samples(ok_rates),
    );
    s.raw = Json::obj(vec![
        ("calls_per_step", Json::int(calls_per_step)),
        ("bare_steps_per_s", Json::nums(&bare)),
        (
            "on_steps_per_s",
            Json::nums(&on.iter().map(|r| r.steps_per_s).collect::<Vec<_>>()),
        ),
        (
            "on_calls",
            Json::nums(&on.iter().map(|r| r.calls as f64).collect::<Vec<_>>()),
        ),
        (
            "on_window_s",
            Json::nums(&on.iter().map(|r| r.window_s).collect::<Vec<_>>()),
        ),
        (
            "on_drops",
            Json::nums(&on.iter().map(|r| r.drops as f64).collect::<Vec<_>>()),
        ),
        (
            "on_cpu_ns",
            Json::nums(&on.iter().map(|r| r.cpu_ns as f64).collect::<Vec<_>>()),
        ),
        (
            "on_hwm_kb",
            Json::nums(&on.iter().map(|r| r.hwm_kb as f64).collect::<Vec<_>>()),
        ),
    ]);
    Ok(s)
}

/// Total `calls` in an api_summary.csv (`api,calls,total_ns,...`).
fn api_calls(path: &std::path::Path) -> Result<u64> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = text.lines();
    let head: Vec<&str> = lines.next().unwrap_or_default().split(',').collect();
    let col = head
        .iter()
        .position(|h| *h == "calls")
        .context("api_summary.csv has no calls column")?;
    Ok(lines
        .filter_map(|l| l.split(',').nth(col)?.parse::<u64>().ok())
        .sum())
}
