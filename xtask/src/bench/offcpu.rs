//! Section 13: what the off-CPU collector adds to each context switch of
//! the target, with the user-stack copy for unwinding (docs/stacks.md) and
//! with frame-pointer stacks only (`DYNPROF_STACK_COPY_KB=0`).
//!
//! The target is tests/fixtures/pingpong: two threads bounce a byte over
//! pipes, so every round trip switches twice, and one step is `ROUNDS`
//! round trips. Interleaved in one run: B U B F B U B F … B, where B is a
//! bare stretch of steps (nothing attached), U a window `--collect offcpu`
//! with the copy, F the same with frame pointers only. Each attached
//! stretch is compared with the mean of the bare stretches around it.
//! Step durations come from the fixture's own log (CLOCK_MONOTONIC before
//! and after each step); switches per step from the kernel's voluntary and
//! involuntary switch counts of the target's threads over the bare
//! stretches. The cost per switch is (window step − bare step) ÷ switches
//! per step: the sched_switch program, the ring, and dynprof's consumer
//! competing for the 2 cores, i.e. what the target feels. The program's own
//! share comes from the kernel's bpf_stats. All of it twice: with the
//! threads where the scheduler puts them, and pinned to one CPU
//! ([`placement`] says why).

use std::{path::Path, process::Command, time::Duration};

use anyhow::{Context as _, Result};

use super::{
    Ctx, Section,
    fig::{Figure, Goal, Unit},
    procs::{self, Proc},
    say, stats,
};

/// Round trips per step: about 20–40 ms per step here.
const ROUNDS: &str = "2000";
const SIGTERM: i32 = 15;

/// All context switches of `pid`'s threads, voluntary and not: each is
/// one switch-out the sched_switch program takes stacks at. (In a ping-
/// pong about half are involuntary: the woken thread preempts its waker
/// before the waker blocks.)
fn all_switches(pid: u32) -> u64 {
    ctxt_switches(
        pid,
        &["voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:"],
    )
}

fn ctxt_switches(pid: u32, keys: &[&str]) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .map(|s| {
            s.lines()
                .filter_map(|l| keys.iter().find_map(|k| l.strip_prefix(k)))
                .filter_map(|v| v.trim().parse::<u64>().ok())
                .sum::<u64>()
        })
        .sum()
}

/// The fixture log's steps so far: (index, duration ns). A step's
/// duration is from its boundary (the marker call) to the next one's; the
/// last logged boundary has no duration yet and is left out.
fn log_steps(log: &Path) -> Vec<(u64, u64)> {
    let starts: Vec<(u64, u64)> = std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.first() != Some(&"step") {
                return None;
            }
            Some((f.get(1)?.parse().ok()?, f.get(2)?.parse().ok()?))
        })
        .collect();
    starts
        .windows(2)
        .map(|w| (w[0].0, w[1].1.saturating_sub(w[0].1)))
        .collect()
}

/// Waits until the log has `n` more steps than `from`; returns the count.
fn wait_steps(log: &Path, from: usize, n: usize) -> Result<usize> {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let k = log_steps(log).len();
        if k >= from + n {
            return Ok(k);
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "pingpong stopped stepping"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn mean_dur(log: &Path, from: usize, to: usize) -> Option<f64> {
    let s = log_steps(log);
    let v: Vec<f64> = s.get(from..to)?.iter().map(|x| x.1 as f64).collect();
    stats::mean_se(&v).map(|m| m.0)
}

/// One window of `n` steps on the running pingpong; the mean duration of
/// the steps well inside it.
fn window(ctx: &Ctx, pid: u32, log: &Path, n: usize, copy: bool) -> Result<Window> {
    let out = ctx.work.join("offcpu-window");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    let mut cmd = ctx.dynprof_cmd();
    if !copy {
        cmd.env("DYNPROF_STACK_COPY_KB", "0");
    }
    cmd.args(["attach", "--pid", &pid.to_string(), "--json"])
        .args(["--marker", "exe:optimizer_step"])
        .args(["--start-step", "-1", "--active", &n.to_string()])
        .args(["--collect", "offcpu", "--output"])
        .arg(&out);
    let mut dp = Proc::spawn("dynprof attach --collect offcpu", &mut cmd)?;
    dp.wait_event(Duration::from_secs(60), "attached")?;
    let at = log_steps(log).len();
    let c0 = procs::cpu_ns(dp.pid()).unwrap_or(0);
    // The program's own run time over the window's middle steps (from the
    // log: the window opens at the first boundary after `attached`). Not
    // over attached → window written: outside the window the gate is shut
    // and the runs exit early, and once the window is written the program
    // no longer runs while the target goes on switching at its bare rate.
    wait_steps(log, 0, at + 3)?;
    let bpf0 = procs::bpf_prog_stats(dp.pid(), procs::PROG_TYPE_TRACEPOINT);
    let sw0 = all_switches(pid);
    wait_steps(log, 0, at + n - 3)?;
    let bpf1 = procs::bpf_prog_stats(dp.pid(), procs::PROG_TYPE_TRACEPOINT);
    let sw1 = all_switches(pid);
    dp.wait_event(Duration::from_secs(300), "window")?;
    let dp_ns = procs::cpu_ns(dp.pid()).unwrap_or(0).saturating_sub(c0) as f64;
    // Per switch-out of the target and per run (every switch on the
    // machine runs it, and one run serves both the thread switched out and
    // the one switched in).
    let prog = match (bpf0, bpf1) {
        (Some((t0, n0)), Some((t1, n1))) if n1 > n0 && sw1 > sw0 => Some((
            (t1 - t0) as f64 / (sw1 - sw0) as f64,
            (t1 - t0) as f64 / (n1 - n0) as f64,
        )),
        _ => None,
    };
    dp.wait_exit(Duration::from_secs(300))?;
    let _ = std::fs::remove_dir_all(&out);
    // The window opens at the boundary after `attached` and holds n steps;
    // two steps of margin on each side.
    let step = mean_dur(log, at + 2, at + n - 2).context("window steps missing from the log")?;
    Ok(Window {
        step_ns: step,
        dynprof_ns_per_step: dp_ns / n as f64,
        prog,
    })
}

/// One off-CPU window's figures.
struct Window {
    /// Mean step duration inside it.
    step_ns: f64,
    /// dynprof's own CPU from `attached` to the window written, per step.
    dynprof_ns_per_step: f64,
    /// The sched_switch program's run time (kernel bpf_stats) per
    /// switch-out of the target, and per run.
    prog: Option<(f64, f64)>,
}

pub fn run(ctx: &Ctx) -> Result<Section> {
    let _stats = procs::BpfStats::on("offcpu");
    let mut s = Section::new("");
    for pinned in [false, true] {
        s.figures.extend(placement(ctx, pinned)?);
    }
    Ok(s)
}

/// The section's figures for one placement of pingpong's two threads:
/// where the scheduler puts them, or both on CPU 1 (`taskset -c 1`). On
/// this machine a wakeup that must bring an idle vCPU out of halt costs
/// tens of µs (the guest's haltpoll governor does not poll), so while the
/// threads sit on two CPUs a step is many times slower than while they
/// share one; which of the two a stretch gets depends on whatever else
/// wakes up, dynprof included. Pinned, every switch is between the two
/// threads on one CPU, and the step time shows the window's own cost.
fn placement(ctx: &Ctx, pinned: bool) -> Result<Vec<Figure>> {
    let tag = if pinned { "_pinned" } else { "" };
    let log = ctx.work.join(format!("offcpu-pingpong{tag}.log"));
    let _ = std::fs::remove_file(&log);
    let mut cmd = if pinned {
        let mut c = Command::new("taskset");
        c.args(["-c", "1"]).arg(ctx.fixtures.join("pingpong"));
        c
    } else {
        Command::new(ctx.fixtures.join("pingpong"))
    };
    cmd.args(["--rounds", ROUNDS, "--log"]).arg(&log);
    // taskset execs pingpong: the child's pid is pingpong's.
    let mut pp = Proc::spawn("pingpong", &mut cmd)?;
    let pid = pp.pid();
    let n = if ctx.quick() { 20 } else { 60 };
    let reps = if ctx.quick() { 2 } else { ctx.reps() };
    let r = (|| -> Result<_> {
        wait_steps(&log, 0, 5)?;
        let mut bare = Vec::new();
        let mut per_step_switches = Vec::new();
        let mut bare_stretch = |bare: &mut Vec<f64>| -> Result<()> {
            let from = log_steps(&log).len();
            let s0 = all_switches(pid);
            let to = wait_steps(&log, from, n)?;
            let s1 = all_switches(pid);
            let k = log_steps(&log);
            let steps = (to - from) as f64;
            per_step_switches.push((s1 - s0) as f64 / steps);
            let v: Vec<f64> = k[from + 1..to].iter().map(|x| x.1 as f64).collect();
            bare.push(stats::mean_se(&v).map_or(f64::NAN, |m| m.0));
            Ok(())
        };
        bare_stretch(&mut bare)?;
        let (mut unwind, mut fp) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            for copy in [true, false] {
                let w = window(ctx, pid, &log, n, copy)?;
                bare_stretch(&mut bare)?;
                let b = (bare[bare.len() - 2] + bare[bare.len() - 1]) / 2.0;
                if copy { &mut unwind } else { &mut fp }.push((w, b));
            }
        }
        Ok((unwind, fp, per_step_switches))
    })();
    pp.signal(SIGTERM);
    let _ = pp.wait_exit(Duration::from_secs(10));
    let (unwind, fp, sw) = r?;
    let sw_step = stats::median(&sw).unwrap_or(f64::NAN);
    let place = if pinned {
        "threads pinned to one CPU"
    } else {
        "threads placed by the scheduler"
    };
    say(format!(
        "offcpu ({place}): {sw_step:.0} context switches per step; unwind (window step ns, bare step ns) {:?}; fp {:?}",
        unwind
            .iter()
            .map(|(w, b)| (w.step_ns, *b))
            .collect::<Vec<_>>(),
        fp.iter().map(|(w, b)| (w.step_ns, *b)).collect::<Vec<_>>(),
    ));
    type Runs = [(Window, f64)];
    let per_switch =
        |v: &Runs| -> Vec<f64> { v.iter().map(|(w, b)| (w.step_ns - b) / sw_step).collect() };
    let ratio = |v: &Runs| -> Vec<f64> { v.iter().map(|(w, b)| w.step_ns / b).collect() };
    let dp_per_switch = |v: &Runs| -> Vec<f64> {
        v.iter()
            .map(|(w, _)| w.dynprof_ns_per_step / sw_step)
            .collect()
    };
    let mut figs = vec![
        Figure::new(
            &format!("offcpu_switches_per_step{tag}"),
            &format!("pingpong ({place}): context switches per step, voluntary and not (bare)"),
            Unit::Count,
            Goal::Info,
            "",
        )
        .samples(sw.clone()),
    ];
    for (key, what, v) in [
        ("unwind", "with the user-stack copy (unwinding)", &unwind),
        ("fp", "frame pointers only (DYNPROF_STACK_COPY_KB=0)", &fp),
    ] {
        figs.push(
            Figure::new(
                &format!("offcpu_step_ratio_{key}{tag}"),
                &format!("off-CPU window {what}, {place}: step time ÷ bare"),
                Unit::Ratio,
                Goal::Info,
                "",
            )
            .samples(ratio(v)),
        );
        figs.push(
            Figure::new(
                &format!("offcpu_switch_ns_{key}{tag}"),
                &format!("off-CPU window {what}, {place}: added per context switch"),
                Unit::Ns,
                Goal::Info,
                "",
            )
            .samples(per_switch(v)),
        );
        figs.push(
            Figure::new(
                &format!("offcpu_dynprof_ns_per_switch_{key}{tag}"),
                &format!(
                    "off-CPU window {what}, {place}: dynprof's own CPU per switch (attach included)"
                ),
                Unit::Ns,
                Goal::Info,
                "",
            )
            .samples(dp_per_switch(v)),
        );
        let prog: Vec<(f64, f64)> = v.iter().filter_map(|(w, _)| w.prog).collect();
        let mut f = Figure::new(
            &format!("offcpu_prog_ns_per_switch_{key}{tag}"),
            &format!(
                "off-CPU window {what}, {place}: sched_switch program run time per switch-out of the target (kernel bpf_stats)"
            ),
            Unit::Ns,
            Goal::Info,
            "",
        );
        if prog.is_empty() {
            f = f.missing("no run_time_ns in dynprof's program fdinfo (kernel.bpf_stats_enabled could not be set?)");
        } else {
            f = f.samples(prog.iter().map(|p| p.0).collect());
        }
        figs.push(f);
        if !prog.is_empty() {
            figs.push(
                Figure::new(
                    &format!("offcpu_prog_ns_per_run_{key}{tag}"),
                    &format!(
                        "off-CPU window {what}, {place}: sched_switch program run time per run (every switch on the machine)"
                    ),
                    Unit::Ns,
                    Goal::Info,
                    "",
                )
                .samples(prog.iter().map(|p| p.1).collect()),
            );
        }
    }
    Ok(figs)
}
