//! Section 2: A high API-call rate: tests/fixtures/acl_trainer with
//! `--calls-per-step N` on the test libascendcl.so: N aclrtLaunchKernel, a
//! memcpy and a synchronize per step; simulated kernels take 0 µs.
//!
//! - Overhead: the trainer's steps/s with the api collector on (a window of
//!   K steps, `--collect api`) ÷ steps/s with dynprof not attached just
//!   before, per repetition. Both from the trainer's own step log / the
//!   window's boundaries.
//! - Sustained API events/s with zero drops: calls recorded (api_summary.csv)
//!   per second of window (meta.json boundaries), in windows whose drops
//!   are all zero.
//! - Where drops begin: the same window at the default 4 MiB ring and
//!   smaller ones, down to where drops appear; and dynprof's user-space
//!   CPU per event (whole session, trace writing included), from which the
//!   consumer's capacity is computed.

use std::{path::Path, process::Command, time::Duration};

use anyhow::{Context as _, Result, bail};

use super::{
    Ctx, Section, api_figures,
    json::{self, Json},
    probe::ProbeHelper,
    procs::{self, Proc},
    say,
};

pub(super) const FLOOR_SPEC: &str = "libascendcl:aclrtLaunchKernel";

/// `step` lines of the trainer's log: (index, end_ns).
fn step_ends(path: &Path) -> Vec<u64> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() == 4 && f[0] == "step" {
                f[3].parse().ok()
            } else {
                None
            }
        })
        .collect()
}

fn rate_between(ends: &[u64], from: u64, to: u64) -> Option<f64> {
    let v: Vec<u64> = ends
        .iter()
        .copied()
        .filter(|e| *e >= from && *e <= to)
        .collect();
    if v.len() < 3 {
        return None;
    }
    Some((v.len() - 1) as f64 / ((v[v.len() - 1] - v[0]) as f64 / 1e9))
}

pub(super) struct Win {
    pub steps_per_s: f64,
    pub events: u64,
    pub window_s: f64,
    pub drops: u64,
    pub api_drops: u64,
    pub dp_cpu_ns: u64,
    pub drain_cpu_ns: u64,
    pub hwm_kb: u64,
}

impl Win {
    pub(super) fn events_per_s(&self) -> f64 {
        self.events as f64 / self.window_s
    }
}

fn window(
    ctx: &Ctx,
    target: &Proc,
    log: &Path,
    steps: u64,
    ring_kb: u32,
    tag: &str,
) -> Result<Win> {
    let out = ctx.work.join(format!("api-{tag}"));
    let _ = std::fs::remove_dir_all(&out);
    let mut cmd = ctx.dynprof_cmd();
    cmd.args([
        "attach",
        "--pid",
        &target.pid().to_string(),
        "--marker",
        "exe:optimizer_step",
        "--json",
        "--collect",
        "api",
    ])
    .args([
        "--start-step",
        "-1",
        "--active",
        &steps.to_string(),
        "--ring-buffer-kb",
        &ring_kb.to_string(),
        "--output",
    ])
    .arg(&out);
    let mut dp = Proc::spawn("dynprof attach --collect api", &mut cmd)?;
    dp.wait_event(Duration::from_secs(60), "attached")?;
    // dynprof's CPU while the window runs (drain + decode), apart from
    // writing the window afterwards: sampled when the trainer has logged
    // the window's steps.
    let c0 = procs::cpu_ns(dp.pid()).unwrap_or(0);
    let n0 = step_ends(log).len() as u64;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while (step_ends(log).len() as u64) < n0 + steps + 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let drain_cpu = procs::cpu_ns(dp.pid()).unwrap_or(0).saturating_sub(c0);
    let (_, w) = dp.wait_event(Duration::from_secs(300), "window")?;
    let cpu = procs::cpu_ns(dp.pid()).unwrap_or(0);
    let hwm = procs::status_kb(dp.pid(), "VmHWM").unwrap_or(0);
    dp.wait_exit(Duration::from_secs(60))?;
    let dir = w
        .get("window")
        .and_then(|w| w.str("dir"))
        .context("window line without dir")?
        .to_string();
    let meta = json::parse(&std::fs::read_to_string(Path::new(&dir).join("meta.json"))?)
        .context("parsing meta.json")?;
    let (t0, t1, n) = match meta.get("steps") {
        Some(Json::Arr(a)) if a.len() >= 2 => (
            a[0].u64("start_ts_ns").unwrap_or(0),
            a[a.len() - 1].u64("end_ts_ns").unwrap_or(0),
            a.len() as u64,
        ),
        _ => bail!("window {dir} recorded fewer than 2 steps"),
    };
    let (mut drops, mut api_drops) = (0, 0);
    if let Some(Json::Obj(kv)) = meta.get("drops") {
        for (k, v) in kv {
            let v = v.as_u64().unwrap_or(0);
            drops += v;
            if k == "api" {
                api_drops = v;
            }
        }
    }
    let window_s = t1.saturating_sub(t0) as f64 / 1e9;
    Ok(Win {
        steps_per_s: n as f64 / window_s,
        events: api_calls(&Path::new(&dir).join("api_summary.csv"))?,
        window_s,
        drops,
        api_drops,
        dp_cpu_ns: cpu,
        drain_cpu_ns: drain_cpu,
        hwm_kb: hwm,
    })
}

/// The trainer's CPU ns per step over the next `secs` (all its threads'
/// schedstat; steps counted in its log over the same interval).
fn cpu_per_step(pid: u32, log: &Path, secs: f64) -> Result<f64> {
    let (c0, a) = (procs::cpu_ns(pid), procs::monotonic_ns());
    std::thread::sleep(Duration::from_secs_f64(secs));
    let (c1, b) = (procs::cpu_ns(pid), procs::monotonic_ns());
    let steps = step_ends(log)
        .iter()
        .filter(|e| **e >= a && **e <= b)
        .count();
    match (c0, c1) {
        (Some(c0), Some(c1)) if steps >= 3 => Ok((c1 - c0) as f64 / steps as f64),
        _ => bail!("the trainer logged {steps} steps in {secs} s, or its CPU time is unreadable"),
    }
}

/// How the api collector runs in a per-call arm.
#[derive(Clone, Copy)]
enum Arm {
    /// As built: threads' stacks in array slots.
    AsBuilt,
    /// Every thread's stack in the hash (`DYNPROF_API_SLOTS=0`), as before
    /// the slots.
    HashOnly,
}

impl Arm {
    const ALL: [Arm; 2] = [Arm::AsBuilt, Arm::HashOnly];

    fn tag(self) -> &'static str {
        match self {
            Arm::AsBuilt => "cpu",
            Arm::HashOnly => "hash",
        }
    }
}

/// [`cpu_per_step`], then the uprobe programs of process `owner` (dynprof,
/// or the floor's helper) over the next 0.5 s with the kernel's bpf_stats
/// on: their run time per call. An entry and a return run per call, so
/// the count halved is the calls; the step marker's one hit per 2,002
/// calls is left in. The statistics are off while the CPU is measured:
/// their clock reads would add the same to every arm and the floor, and
/// so pull the ratio towards 1.
fn cpu_and_prog_per_call(
    pid: u32,
    log: &Path,
    secs: f64,
    owner: u32,
) -> Result<(f64, Option<f64>)> {
    let c = cpu_per_step(pid, log, secs)?;
    let stats = procs::BpfStats::on("api");
    let s0 = procs::bpf_prog_stats(owner, procs::PROG_TYPE_KPROBE);
    std::thread::sleep(Duration::from_millis(500));
    let s1 = procs::bpf_prog_stats(owner, procs::PROG_TYPE_KPROBE);
    drop(stats);
    let prog = match (s0, s1) {
        (Some((t0, n0)), Some((t1, n1))) if n1 > n0 + 1 && t1 > t0 => {
            Some((t1 - t0) as f64 / ((n1 - n0) as f64 / 2.0))
        }
        _ => None,
    };
    Ok((c, prog))
}

/// [`cpu_and_prog_per_call`] with the api collector in a window that
/// stays open.
fn api_cpu_per_step(
    ctx: &Ctx,
    target: &Proc,
    log: &Path,
    secs: f64,
    rep: usize,
    arm: Arm,
) -> Result<(f64, Option<f64>)> {
    let out = ctx.work.join(format!("api-{}{rep}", arm.tag()));
    let _ = std::fs::remove_dir_all(&out);
    let mut cmd = ctx.dynprof_cmd();
    match arm {
        Arm::AsBuilt => {}
        Arm::HashOnly => {
            cmd.env("DYNPROF_API_SLOTS", "0");
        }
    }
    cmd.args([
        "attach",
        "--pid",
        &target.pid().to_string(),
        "--marker",
        "exe:optimizer_step",
        "--json",
        "--collect",
        "api",
        "--start-step",
        "-1",
        "--active",
        "1000000",
        "--output",
    ])
    .arg(&out);
    let mut dp = Proc::spawn("dynprof attach --collect api (long window)", &mut cmd)?;
    dp.wait_event(Duration::from_secs(60), "attached")?;
    // The window opens at the next step boundary (a few ms at this rate).
    std::thread::sleep(Duration::from_millis(200));
    let c = cpu_and_prog_per_call(target.pid(), log, secs, dp.pid());
    let _ = dp.stop(Duration::from_secs(120));
    let _ = std::fs::remove_dir_all(&out);
    c
}

pub fn run(ctx: &Ctx) -> Result<Section> {
    Ok(api_figures::section(&measure(ctx)?))
}

/// What section 2 measured, raw; [`api_figures::section`] turns it into
/// figures.
pub(super) struct Measured {
    pub calls_per_step: u64,
    /// Seconds of each CPU segment.
    pub bare_s: f64,
    pub win_steps: u64,
    /// Per repetition: the trainer's steps/s, not attached.
    pub bare: Vec<f64>,
    /// Per repetition: the trainer's CPU ns per step bare, with the floor,
    /// with the api collector as built and with every stack in the hash.
    pub cpu: Vec<[f64; 4]>,
    /// Per repetition: the floor's and each arm's programs per call (ns).
    pub prog: Vec<(Option<f64>, [Option<f64>; 2])>,
    /// Per repetition: a K-step api window at the default ring.
    pub wins: Vec<Win>,
    pub rings: &'static [u32],
    /// The same window at smaller rings.
    pub sweep: Vec<(u32, Win)>,
    /// The same window with two calling threads.
    pub wins2: Vec<Win>,
}

fn measure(ctx: &Ctx) -> Result<Measured> {
    let calls_per_step: u64 = 2000;
    let log = ctx.work.join("acl-trainer.log");
    let mut target = Proc::spawn(
        "acl_trainer",
        Command::new(ctx.fixtures.join("acl_trainer"))
            .args(["--calls-per-step", &calls_per_step.to_string(), "--log"])
            .arg(&log),
    )?;
    target.wait_prefix(Duration::from_secs(30), "ready")?;
    std::thread::sleep(Duration::from_millis(500));
    let bare_s = if ctx.quick() { 0.5 } else { 1.5 };
    // Steps per window: ~0.3 s (quick) / 1 s of probed calls at ~100k calls/s.
    let win_steps: u64 = if ctx.quick() { 10 } else { 50 };
    let reps = ctx.reps();
    let mut bare = Vec::new();
    let mut cpu = Vec::new();
    // Per repetition: the floor's and each arm's programs per call (ns).
    let mut prog: Vec<(Option<f64>, [Option<f64>; 2])> = Vec::new();
    let mut wins: Vec<Win> = Vec::new();
    for rep in 0..reps {
        let a = procs::monotonic_ns();
        std::thread::sleep(Duration::from_secs_f64(bare_s));
        let b = procs::monotonic_ns();
        let r = rate_between(&step_ends(&log), a, b).context("the trainer logged no steps")?;
        // Per call, from the trainer's CPU time per step (immune to other
        // processes holding the CPU): bare, with the kernel's floor (an
        // empty entry uprobe and an empty return probe on aclrtLaunchKernel,
        // 2000 of the step's 2002 traced calls), and with the api collector
        // in an open window.
        let c_bare = cpu_per_step(target.pid(), &log, bare_s)?;
        let h = ProbeHelper::attach(ctx, target.pid(), FLOOR_SPEC, "floor")?;
        let (c_floor, p_floor) = cpu_and_prog_per_call(target.pid(), &log, bare_s, h.pid())?;
        h.finish()?;
        // The api arms alternate which goes first, so that drift within a
        // repetition does not favour one.
        let mut c = [0.0; 2];
        let mut p = [None; 2];
        for k in 0..Arm::ALL.len() {
            let i = (k + rep) % Arm::ALL.len();
            (c[i], p[i]) = api_cpu_per_step(ctx, &target, &log, bare_s, rep, Arm::ALL[i])?;
        }
        let [c_api, c_hash] = c;
        prog.push((p_floor, p));
        cpu.push([c_bare, c_floor, c_api, c_hash]);
        let w = window(ctx, &target, &log, win_steps, 4096, &format!("rep{rep}"))?;
        say(format!(
            "api rep {}: off {:.0} steps/s ({:.2}M calls/s), on {:.0} steps/s, {:.0} events/s, drops {}",
            rep + 1,
            r,
            r * (calls_per_step + 2) as f64 / 1e6,
            w.steps_per_s,
            w.events_per_s(),
            w.drops
        ));
        bare.push(r);
        wins.push(w);
    }
    let (rings, sweep) = ring_sweep(ctx, &target, &log, win_steps);
    let _ = target.stop(Duration::from_secs(10));
    let wins2 = two_threads(ctx, calls_per_step, win_steps, reps)?;
    Ok(Measured {
        calls_per_step,
        bare_s,
        win_steps,
        bare,
        cpu,
        prog,
        wins,
        rings,
        sweep,
        wins2,
    })
}

/// The K-step window at smaller rings, at the same rate: where do drops
/// begin? The rings tried, and each window that ran.
fn ring_sweep(
    ctx: &Ctx,
    target: &Proc,
    log: &Path,
    win_steps: u64,
) -> (&'static [u32], Vec<(u32, Win)>) {
    let rings: &'static [u32] = if ctx.quick() {
        &[64, 16, 4]
    } else {
        &[1024, 256, 128, 64, 32, 16, 8, 4]
    };
    let mut sweep: Vec<(u32, Win)> = Vec::new();
    for &kb in rings {
        match window(ctx, target, log, win_steps, kb, &format!("ring{kb}")) {
            Ok(w) => {
                say(format!(
                    "api ring {kb} KiB: {:.0} events/s, api drops {}",
                    w.events_per_s(),
                    w.api_drops
                ));
                sweep.push((kb, w));
            }
            Err(e) => say(format!("api ring {kb} KiB: {e:#}")),
        }
    }
    (rings, sweep)
}

/// The same windows with each step's launches split over two calling
/// threads: one thread's two traps per call cap what it can produce, so
/// this is where the pipeline's own capacity shows.
fn two_threads(ctx: &Ctx, calls_per_step: u64, win_steps: u64, reps: usize) -> Result<Vec<Win>> {
    let log2 = ctx.work.join("acl-trainer-2t.log");
    let mut target2 = Proc::spawn(
        "acl_trainer --launch-threads 2",
        Command::new(ctx.fixtures.join("acl_trainer"))
            .args([
                "--calls-per-step",
                &calls_per_step.to_string(),
                "--launch-threads",
                "2",
                "--log",
            ])
            .arg(&log2),
    )?;
    target2.wait_prefix(Duration::from_secs(30), "ready")?;
    let mut wins2: Vec<Win> = Vec::new();
    for rep in 0..reps {
        match window(
            ctx,
            &target2,
            &log2,
            win_steps,
            4096,
            &format!("2t-rep{rep}"),
        ) {
            Ok(w) => {
                say(format!(
                    "api 2 threads rep {}: {:.0} events/s, drops {}",
                    rep + 1,
                    w.events_per_s(),
                    w.drops
                ));
                wins2.push(w);
            }
            Err(e) => say(format!("api 2 threads rep {}: {e:#}", rep + 1)),
        }
    }
    let _ = target2.stop(Duration::from_secs(10));
    Ok(wins2)
}

/// Total `calls` in an api_summary.csv (`api,calls,total_ns,...`).
fn api_calls(path: &Path) -> Result<u64> {
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
