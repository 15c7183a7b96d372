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
    Ctx, Section,
    fig::{Figure, Goal, Unit},
    json::{self, Json},
    probe::ProbeHelper,
    procs::{self, Proc},
    say, stats,
};

const FLOOR_SPEC: &str = "libascendcl:aclrtLaunchKernel";

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

struct Win {
    steps_per_s: f64,
    events: u64,
    window_s: f64,
    drops: u64,
    api_drops: u64,
    dp_cpu_ns: u64,
    drain_cpu_ns: u64,
    hwm_kb: u64,
}

impl Win {
    fn events_per_s(&self) -> f64 {
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

/// `BPF_PROG_TYPE_KPROBE`: uprobe programs (dynprof's markers, the api
/// programs, the bench's empty probes).
const PROG_TYPE_KPROBE: &str = "2";

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
    let s0 = procs::bpf_prog_stats(owner, PROG_TYPE_KPROBE);
    std::thread::sleep(Duration::from_millis(500));
    let s1 = procs::bpf_prog_stats(owner, PROG_TYPE_KPROBE);
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
    let mut floor = Vec::new();
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
        floor.push([c_bare, c_floor, c_api, c_hash]);
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
    // Ring-buffer sweep at the same rate: where do drops begin?
    let rings: &[u32] = if ctx.quick() {
        &[64, 16, 4]
    } else {
        &[1024, 256, 128, 64, 32, 16, 8, 4]
    };
    let mut sweep: Vec<(u32, Win)> = Vec::new();
    for &kb in rings {
        match window(ctx, &target, &log, win_steps, kb, &format!("ring{kb}")) {
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
    let _ = target.stop(Duration::from_secs(10));

    // The same windows with the launches split over two calling threads:
    // one thread's two traps per call cap what it can produce, so this is
    // where the pipeline's own capacity shows.
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

    let mut s = Section::new("");
    // Per call: (CPU per step probed − CPU per step bare) / calls per step.
    let per_call = |c: f64, bare: f64| (c - bare) / calls_per_step as f64;
    let api_ns: Vec<f64> = floor.iter().map(|c| per_call(c[2], c[0])).collect();
    let floor_ns: Vec<f64> = floor.iter().map(|c| per_call(c[1], c[0])).collect();
    let hash_ns: Vec<f64> = floor.iter().map(|c| per_call(c[3], c[0])).collect();
    s.figures.push(
        Figure::new(
            "api_per_call_over_floor",
            "API collector per call ÷ kernel floor (empty entry + return probe)",
            Unit::Ratio,
            Goal::AtMost(1.15),
            "≤ 1.15",
        )
        .samples(api_ns.iter().zip(&floor_ns).map(|(a, f)| a / f).collect())
        .resolve(0.02)
        .note(format!(
            "per call = (trainer CPU per step probed − bare) / {calls_per_step} calls (schedstat of the trainer over {bare_s} s, steps from \
             its log); the api collector in an open window; the floor \
             is an empty uprobe + an empty uretprobe on aclrtLaunchKernel (2000 of the 2002 traced calls per step), attached by \
             `dynprof __probe-cost --prog floor`"
        )),
    );
    s.figures.push(
        Figure::new(
            "api_ns_per_call",
            "API collector, added per call",
            Unit::Ns,
            Goal::Info,
            "",
        )
        .samples(api_ns.clone()),
    );
    s.figures.push(
        Figure::new(
            "api_floor_ns_per_call",
            "kernel floor (empty entry + return probe), per call",
            Unit::Ns,
            Goal::Info,
            "",
        )
        .samples(floor_ns.clone()),
    );
    // The programs' own time (bpf_stats) is what the arms differ by; the
    // trap costs the same in every arm. Computed per repetition: (floor +
    // the programs' time above the empty ones') ÷ floor, floor the
    // trainer-CPU figure of the same repetition.
    let computed = |arm: usize| -> Vec<f64> {
        prog.iter()
            .zip(&floor_ns)
            .filter_map(|((pf, p), f)| Some(1.0 + (p[arm]? - (*pf)?) / f))
            .collect()
    };
    let mut fig = Figure::new(
        "api_per_call_over_floor_computed",
        "the same, computed from the programs' own run time (bpf_stats)",
        Unit::Ratio,
        Goal::AtMost(1.15),
        "≤ 1.15",
    )
    .note(
        "1 + (api programs' run time per call − the empty entry and return programs' per call) ÷ the floor per call, each repetition; \
         bpf_stats' own two clock reads per run are in both and cancel; what a program costs the target beyond its run time \
         (caches, the ring's pages) is not in it",
    );
    let as_built = computed(0);
    fig = if as_built.is_empty() {
        fig.missing(
            "no run_time_ns in the programs' fdinfo (kernel.bpf_stats_enabled could not be set?)",
        )
    } else {
        fig.samples(as_built)
    };
    s.figures.push(fig);
    let hash = computed(1);
    if !hash.is_empty() {
        s.figures.push(
            Figure::new(
                "api_hash_per_call_over_floor_computed",
                "the same computed, DYNPROF_API_SLOTS=0",
                Unit::Ratio,
                Goal::Info,
                "",
            )
            .samples(hash),
        );
    }
    for (i, (key, name)) in [
        (
            "api_prog_ns_per_call",
            "api programs' run time per call (entry + return, bpf_stats)",
        ),
        ("api_hash_prog_ns_per_call", "the same, DYNPROF_API_SLOTS=0"),
    ]
    .into_iter()
    .enumerate()
    {
        let v: Vec<f64> = prog.iter().filter_map(|(_, p)| p[i]).collect();
        if !v.is_empty() {
            s.figures
                .push(Figure::new(key, name, Unit::Ns, Goal::Info, "").samples(v));
        }
    }
    let v: Vec<f64> = prog.iter().filter_map(|(pf, _)| *pf).collect();
    if !v.is_empty() {
        s.figures.push(
            Figure::new(
                "api_floor_prog_ns_per_call",
                "the floor's empty programs' run time per call (bpf_stats)",
                Unit::Ns,
                Goal::Info,
                "",
            )
            .samples(v),
        );
    }
    s.figures.push(
        Figure::new(
            "api_hash_per_call_over_floor",
            "the same, every thread's stack in the hash (DYNPROF_API_SLOTS=0)",
            Unit::Ratio,
            Goal::Info,
            "",
        )
        .samples(hash_ns.iter().zip(&floor_ns).map(|(a, f)| a / f).collect())
        .note(
            "the api collector as before the stack slots: a hash lookup of the thread's stack at entry and at return; \
             the same repetitions as the line above, the two arms alternating which runs first",
        ),
    );
    s.figures.push(
        Figure::new(
            "api_slot_minus_hash_ns_per_call",
            "API collector per call, stack slots − hash",
            Unit::Ns,
            Goal::Info,
            "",
        )
        .samples(api_ns.iter().zip(&hash_ns).map(|(a, h)| a - h).collect()),
    );
    let ratio: Vec<f64> = wins
        .iter()
        .zip(&bare)
        .map(|(w, b)| w.steps_per_s / b)
        .collect();
    let bare_calls = stats::median(&bare).unwrap_or(0.0) * (calls_per_step + 2) as f64;
    s.figures.push(
        Figure::new("api_on_over_off", "steps/s, api collector on ÷ off", Unit::Ratio, Goal::Info, "")
            .samples(ratio)
            .note(format!(
                "acl_trainer --calls-per-step {calls_per_step}: {:.2}M API calls/s bare. With the collector every call takes an entry \
                 uprobe and a return uprobe (two traps, ~{:.0} µs per call here), so the target itself cannot call faster than the rate below",
                bare_calls / 1e6,
                1e6 / stats::median(&wins.iter().map(|w| w.events_per_s()).collect::<Vec<_>>()).unwrap_or(1.0)
            )),
    );
    let ok: Vec<f64> = wins
        .iter()
        .filter(|w| w.drops == 0)
        .map(|w| w.events_per_s())
        .collect();
    let mut f = Figure::new(
        "api_events_per_s_zero_drops",
        "API events/s sustained with zero drops (capacity, bounded by the producer's traps)",
        Unit::PerSec,
        Goal::Info,
        "",
    )
    .samples(ok.clone());
    if ok.len() < wins.len() {
        f.note = format!(
            "{} of {} windows had drops at the default ring",
            wins.len() - ok.len(),
            wins.len()
        );
    }
    s.figures.push(f);
    let ok2: Vec<f64> = wins2
        .iter()
        .filter(|w| w.drops == 0)
        .map(|w| w.events_per_s())
        .collect();
    let mut f2 = Figure::new(
        "api_events_per_s_zero_drops_2t",
        "API events/s sustained with zero drops, 2 calling threads (capacity)",
        Unit::PerSec,
        Goal::Info,
        "",
    )
    .samples(ok2.clone())
    .note(format!(
        "acl_trainer --launch-threads 2: each step's {calls_per_step} launches split over two threads calling at once (the \
         simulated runtime serializes them on one mutex); {} of {} windows without drops. Median {:.0}k/s against {:.0}k/s \
         with one thread: {}",
        ok2.len(),
        wins2.len(),
        stats::median(&ok2).unwrap_or(0.0) / 1e3,
        stats::median(&ok).unwrap_or(0.0) / 1e3,
        if stats::median(&ok2).unwrap_or(0.0) < 1.3 * stats::median(&ok).unwrap_or(f64::INFINITY) {
            "a second calling thread adds little, so the limit is on the producer side (the two traps per call and the \
             kernel paths both threads share), not dynprof's reader, whose CPU per event gives the capacity below"
        } else {
            "the rate scales with calling threads: one thread's traps were the limit"
        }
    ));
    if ok2.is_empty() {
        f2 = f2.missing("no window without drops");
    }
    s.figures.push(f2);
    // Consumer capacity, computed from dynprof's CPU per event while the
    // window runs (drain, decode, keep), and the whole session's.
    let drain_ns: Vec<f64> = wins
        .iter()
        .filter(|w| w.events > 0)
        .map(|w| w.drain_cpu_ns as f64 / w.events as f64)
        .collect();
    let total_ns: Vec<f64> = wins
        .iter()
        .filter(|w| w.events > 0)
        .map(|w| w.dp_cpu_ns as f64 / w.events as f64)
        .collect();
    if let Some(m) = stats::median(&drain_ns) {
        s.figures.push(
            Figure::new(
                "api_drain_ns_per_event",
                "dynprof CPU per API event while the window runs",
                Unit::Ns,
                Goal::Info,
                "",
            )
            .samples(drain_ns.clone()),
        );
        s.figures.push(
            Figure::new(
                "api_session_ns_per_event",
                "dynprof CPU per API event, whole session (incl. writing the window)",
                Unit::Ns,
                Goal::Info,
                "",
            )
            .samples(total_ns.clone()),
        );
        s.figures.push(
            Figure::new("api_consumer_capacity", "consumer capacity, one core, while the window runs", Unit::PerSec, Goal::Info, "")
                .value(1e9 / m)
                .computed()
                .note("1 s ÷ dynprof's CPU time per event during the window (ring drain, decode, buffering); writing trace.json etc. comes after the window"),
        );
    }
    let onset = sweep
        .iter()
        .filter(|(_, w)| w.api_drops > 0)
        .map(|(kb, _)| *kb)
        .max();
    let clean = sweep
        .iter()
        .filter(|(_, w)| w.api_drops == 0)
        .map(|(kb, _)| *kb)
        .min();
    let rate = stats::median(&ok).unwrap_or(0.0);
    let mut f = Figure::new(
        "api_drop_onset",
        "ring size (KiB) where drops begin, at that rate",
        Unit::Count,
        Goal::Info,
        "",
    );
    f = match onset {
        Some(kb) => f.value(kb as f64).note(format!(
            "no drops at the default 4096 KiB ring up to the highest rate the probed target reaches ({:.0}k events/s); drops appear with a ring of {kb} KiB or less{}",
            rate / 1e3,
            clean.map(|c| format!(", none at {c} KiB")).unwrap_or_default()
        )),
        None => f.missing(format!(
            "no drops at any ring size tried ({} KiB) at {:.0}k events/s, the highest rate the probed target reaches",
            rings.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", "),
            rate / 1e3
        )),
    };
    s.figures.push(f);
    s.raw = Json::obj(vec![
        ("calls_per_step", Json::int(calls_per_step)),
        ("window_steps", Json::int(win_steps)),
        ("off_steps_per_s", Json::nums(&bare)),
        (
            "cpu_ns_per_step_bare_floor_api_hash",
            Json::Arr(floor.iter().map(|c| Json::nums(c)).collect()),
        ),
        ("floor_spec", Json::s(FLOOR_SPEC)),
        (
            "on_steps_per_s",
            Json::nums(&wins.iter().map(|w| w.steps_per_s).collect::<Vec<_>>()),
        ),
        (
            "on_events",
            Json::nums(&wins.iter().map(|w| w.events as f64).collect::<Vec<_>>()),
        ),
        (
            "on_window_s",
            Json::nums(&wins.iter().map(|w| w.window_s).collect::<Vec<_>>()),
        ),
        (
            "on_drops",
            Json::nums(&wins.iter().map(|w| w.drops as f64).collect::<Vec<_>>()),
        ),
        (
            "dynprof_cpu_ns",
            Json::nums(&wins.iter().map(|w| w.dp_cpu_ns as f64).collect::<Vec<_>>()),
        ),
        (
            "dynprof_drain_cpu_ns",
            Json::nums(
                &wins
                    .iter()
                    .map(|w| w.drain_cpu_ns as f64)
                    .collect::<Vec<_>>(),
            ),
        ),
        (
            "dynprof_vmhwm_kb",
            Json::nums(&wins.iter().map(|w| w.hwm_kb as f64).collect::<Vec<_>>()),
        ),
        (
            "ring_sweep",
            Json::Arr(
                sweep
                    .iter()
                    .map(|(kb, w)| {
                        Json::obj(vec![
                            ("ring_kb", Json::int(*kb as u64)),
                            ("events", Json::int(w.events)),
                            ("events_per_s", Json::num(w.events_per_s())),
                            ("api_drops", Json::int(w.api_drops)),
                        ])
                    })
                    .collect(),
            ),
        ),
    ]);
    Ok(s)
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
