//! Section 14: a window's overhead on PyTorch, resolved (thread CPU per step).
//!
//! Section 1 compares steps/s (wall clock, and per CPU-second) of one
//! window against the bare runs around it, 5 times; on this machine its
//! spread (0.84 … 1.07) is wider than the 3 % the target is about. This
//! section answers the same question the way section 8 answers it for an
//! idle attach: the training thread's CPU time per step
//! (CLOCK_THREAD_CPUTIME_ID) over many interleaved segments, B W B W … B,
//! where W is `dynprof attach` with a window over the whole segment
//! (collectors api, cpu and offcpu, unwinding on). Each W is compared with
//! the mean of the two B around it; the figure is the mean of those ratios
//! with its standard error.
//!
//! What the thread's CPU time holds: the uprobe traps, the off-CPU
//! program at each of its switches and, on a kernel without
//! `CONFIG_IRQ_TIME_ACCOUNTING` (this one), the sampling interrupt with
//! its stack copy, all of which run on the training thread. What it does
//! not hold: dynprof's own user-space work (reading the ring, unwinding,
//! aggregating), which runs on another CPU when one is free. That is
//! measured too, per step, and a second ratio charges it to the step as
//! if the job had no CPU to spare.

use std::time::Duration;

use anyhow::{Result, bail};

use super::{
    Ctx, Section,
    fig::{Figure, Goal, Unit},
    idle::steps_cpu_ns,
    json::Json,
    procs::{self, Proc},
    say,
    sites::start_torch,
    stats,
    torch_seg::{stderr_tail, window_args},
};

/// One W segment.
struct Windowed {
    /// The training thread's CPU ns per step.
    thread_ns: f64,
    /// dynprof's CPU ns (all threads) per step while the window collected.
    dynprof_ns: f64,
    /// Steps the window recorded, of the segment's.
    recorded: u64,
    drops: u64,
}

fn windowed(ctx: &Ctx, py: &mut Proc, n: u64) -> Result<Windowed> {
    let out = ctx.work.join("window-cpu");
    let _ = std::fs::remove_dir_all(&out);
    let mut cmd = ctx.dynprof_cmd();
    cmd.args(["attach", "--pid", &py.pid().to_string(), "--json"])
        .args(window_args(ctx, n + 10))
        .arg("--output")
        .arg(&out);
    let mut dp = Proc::spawn("dynprof attach (window)", &mut cmd)?;
    dp.wait_event(Duration::from_secs(60), "attached")?;
    let c0 = procs::cpu_ns(dp.pid());
    let thread = steps_cpu_ns(py, n)?;
    let c1 = procs::cpu_ns(dp.pid());
    let _ = dp.stop(Duration::from_secs(120));
    let Some((_, w)) = dp.events("window").pop() else {
        bail!("dynprof wrote no window{}", stderr_tail(&dp));
    };
    let w = w.get("window").cloned().unwrap_or(Json::Null);
    let recorded = match (w.u64("first_recorded"), w.u64("last_recorded")) {
        (Some(a), Some(b)) if b >= a => b - a + 1,
        _ => 0,
    };
    let drops = dp
        .events("summary")
        .pop()
        .and_then(|(_, s)| match s.get("drops") {
            Some(Json::Obj(kv)) => Some(kv.iter().filter_map(|(_, v)| v.as_u64()).sum()),
            _ => None,
        })
        .unwrap_or(0);
    let dynprof = match (c0, c1) {
        (Some(a), Some(b)) => b.saturating_sub(a) as f64,
        _ => f64::NAN,
    };
    Ok(Windowed {
        thread_ns: thread / n as f64,
        dynprof_ns: dynprof / n as f64,
        recorded,
        drops,
    })
}

pub fn run(ctx: &Ctx) -> Result<Section> {
    let mut py = start_torch(ctx, 200)?;
    let cal = steps_cpu_ns(&mut py, 200)? / 200.0;
    let seg_s = if ctx.quick() { 0.5 } else { 2.0 };
    let n = ((seg_s * 1e9 / cal) as u64).clamp(100, 100_000);
    let pairs = if ctx.quick() {
        2 * ctx.reps()
    } else {
        6 * ctx.reps()
    };
    say(format!(
        "window: {:.0} µs of thread CPU per step; {n} steps per segment, {pairs} windows",
        cal / 1e3
    ));
    let mut bare = vec![steps_cpu_ns(&mut py, n)? / n as f64];
    let mut w = Vec::new();
    for i in 0..pairs {
        w.push(windowed(ctx, &mut py, n)?);
        bare.push(steps_cpu_ns(&mut py, n)? / n as f64);
        if (i + 1) % 10 == 0 {
            say(format!("window: {} of {pairs} windows", i + 1));
        }
    }
    let _ = py.send("quit");
    let _ = py.wait_exit(Duration::from_secs(10));

    let around = |i: usize| (bare[i] + bare[i + 1]) / 2.0;
    let rel: Vec<f64> = (0..pairs).map(|i| around(i) / w[i].thread_ns).collect();
    let rel_all: Vec<f64> = (0..pairs)
        .map(|i| around(i) / (w[i].thread_ns + w[i].dynprof_ns))
        .collect();
    let added: Vec<f64> = (0..pairs)
        .map(|i| (w[i].thread_ns - around(i)) / 1e3)
        .collect();
    let dp_us: Vec<f64> = w.iter().map(|x| x.dynprof_ns / 1e3).collect();
    let coverage: Vec<f64> = w.iter().map(|x| x.recorded as f64 / n as f64).collect();
    let drops: u64 = w.iter().map(|x| x.drops).sum();
    let step_us = stats::median(&bare).unwrap_or(cal) / 1e3;
    let (add_m, add_se) = stats::mean_se(&added).unwrap_or((f64::NAN, f64::NAN));
    let cov_min = coverage.iter().copied().fold(f64::INFINITY, f64::min);

    let mut s = Section::new("");
    s.figures.push(
        Figure::new(
            "window_over_bare_thread_cpu",
            "window (api, cpu, offcpu, unwinding) ÷ bare, training-thread CPU per step, interleaved",
            Unit::Ratio,
            Goal::AtLeast(0.97),
            "≥ 0.97",
        )
        .mean_se(rel)
        .note(format!(
            "{pairs} windows of {n} steps, each against the mean of the bare segments around it; \
             {add_m:.1} ± {add_se:.1} µs added per {step_us:.0} µs step (mean ± SE); the windows \
             recorded ≥ {:.0} % of their segment's steps; {drops} events dropped",
            cov_min * 100.0
        )),
    );
    s.figures.push(
        Figure::new(
            "window_over_bare_all_cpu",
            "the same, dynprof's own CPU charged to the step (as if no CPU were free)",
            Unit::Ratio,
            Goal::Info,
            "",
        )
        .mean_se(rel_all)
        .note(format!(
            "dynprof used {:.1} µs of CPU per step while the window collected (all its threads; \
             writing the window after it closes not counted)",
            stats::mean_se(&dp_us).map_or(f64::NAN, |m| m.0)
        )),
    );
    s.figures.push(
        Figure::new(
            "window_added_us_per_step",
            "window: training-thread CPU added per step",
            Unit::Us,
            Goal::Info,
            "",
        )
        .mean_se(added),
    );
    s.raw = Json::obj(vec![
        ("steps_per_segment", Json::int(n)),
        ("bare_thread_cpu_ns_per_step", Json::nums(&bare)),
        (
            "window_thread_cpu_ns_per_step",
            Json::nums(&w.iter().map(|x| x.thread_ns).collect::<Vec<_>>()),
        ),
        (
            "window_dynprof_cpu_ns_per_step",
            Json::nums(&w.iter().map(|x| x.dynprof_ns).collect::<Vec<_>>()),
        ),
        (
            "window_steps_recorded",
            Json::nums(&w.iter().map(|x| x.recorded as f64).collect::<Vec<_>>()),
        ),
        ("drops", Json::int(drops)),
    ]);
    Ok(s)
}
