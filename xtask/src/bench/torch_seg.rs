//! Section 1's driver: one torch_bench.py process and one timed segment per
//! condition (split from torch.rs, which computes the figures).
//!
//!
//! One bench/torch_bench.py process (Debian python3-torch, the small MLP of
//! tests/fixtures/torch_train.py) serves every condition, so the import cost
//! is paid once and the conditions interleave cheaply:
//!   bare │ idle (dynprof attached, auto markers, no window) │ window (all
//!   steps, collectors api,cpu,offcpu) │ torch.profiler (CPU) │ the same
//!   with_stack │ py-spy record.
//! Each repetition runs bare then every condition; one more bare closes the
//! last repetition. A condition's ratio is its steps/s over the mean of the
//! two bare runs that bracket it, so linear drift cancels.
//! While dynprof is attached: its CPU time (/proc/PID/task/*/schedstat,
//! ns resolution; utime+stime kept too) and VmHWM, and from the JSON step
//! lines (`DYNPROF_RECV_NS=1`) the boundary → user-space latency.

use std::{
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use super::{
    Ctx,
    json::Json,
    procs::{self, Proc},
    say,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cond {
    Bare,
    Idle,
    Window,
    Prof,
    ProfStack,
    PySpy,
}

impl Cond {
    pub(super) fn key(self) -> &'static str {
        match self {
            Cond::Bare => "bare",
            Cond::Idle => "idle",
            Cond::Window => "window",
            Cond::Prof => "torch_profiler",
            Cond::ProfStack => "torch_profiler_stack",
            Cond::PySpy => "py_spy",
        }
    }
}

/// What one timed segment produced.
#[derive(Default, Clone)]
pub(super) struct Seg {
    pub(super) steps_per_s: f64,
    /// torch.profiler's own __exit__ (trace building), ns.
    pub(super) exit_ns: f64,
    /// dynprof while attached: CPU % of one core over the segment.
    pub(super) dp_cpu_pct: Option<f64>,
    pub(super) dp_cpu_pct_ticks: Option<f64>,
    pub(super) dp_hwm_kb: Option<u64>,
    /// CPU % while attached with no steps at all.
    pub(super) dp_quiet_cpu_pct: Option<f64>,
    pub(super) latencies_ns: Vec<f64>,
    pub(super) drops: u64,
    pub(super) events: u64,
    pub(super) first_step_seen: Option<u64>,
    /// The target's context switches per second during the segment.
    pub(super) target_cs_per_s: Option<f64>,
    /// Steps per CPU-second of the training thread (CLOCK_THREAD_CPUTIME_ID).
    pub(super) cpu_sps: f64,
}

pub struct Torch<'a> {
    pub(super) ctx: &'a Ctx,
    pub(super) py: Proc,
    pub(super) steps: u64,
    pub bare_sps: f64,
    /// Steps per CPU-second of the training thread in the last `run`.
    pub(super) last_cpu_sps: f64,
}

impl<'a> Torch<'a> {
    pub fn start(ctx: &'a Ctx) -> Result<Torch<'a>> {
        let mut cmd = Command::new(&ctx.python);
        cmd.arg(ctx.src.join("torch_bench.py"));
        let mut py = Proc::spawn("torch_bench.py", &mut cmd)?;
        py.wait_prefix(Duration::from_secs(180), "ready")
            .context("starting PyTorch")?;
        let mut t = Torch {
            ctx,
            py,
            steps: 0,
            bare_sps: 0.0,
            last_cpu_sps: 0.0,
        };
        // Calibrate: how many steps make one segment.
        let (sps, _) = t.run("bare", 100)?;
        let seg_s = if ctx.quick() { 1.0 } else { 4.0 };
        t.steps = ((sps * seg_s) as u64).clamp(50, 200_000);
        t.bare_sps = sps;
        say(format!(
            "torch: {sps:.0} steps/s bare; {} steps per segment",
            t.steps
        ));
        Ok(t)
    }

    pub fn pid(&self) -> u32 {
        self.py.pid()
    }

    /// `run MODE N` → (steps/s, profiler exit ns).
    pub(super) fn run(&mut self, mode: &str, n: u64) -> Result<(f64, f64)> {
        self.py.send(&format!("run {mode} {n}"))?;
        let l = self.py.wait_prefix(Duration::from_secs(600), "result")?;
        let f: Vec<&str> = l.text.split_whitespace().collect();
        let elapsed: f64 = f
            .get(3)
            .and_then(|v| v.parse().ok())
            .context("bad result line")?;
        let exit: f64 = f.get(6).and_then(|v| v.parse().ok()).unwrap_or(0.0);
        let cpu: f64 = f.get(7).and_then(|v| v.parse().ok()).unwrap_or(f64::NAN);
        self.last_cpu_sps = n as f64 / (cpu / 1e9);
        Ok((n as f64 / (elapsed / 1e9), exit))
    }

    pub(super) fn segment(&mut self, c: Cond) -> Result<Seg> {
        let n = self.steps;
        match c {
            Cond::Bare => {
                let (cs0, w0) = (ctx_switches(self.pid()), Instant::now());
                let sps = self.run("bare", n)?.0;
                let cs1 = ctx_switches(self.pid());
                let cs = match (cs0, cs1) {
                    (Some(a), Some(b)) => Some((b - a) as f64 / w0.elapsed().as_secs_f64()),
                    _ => None,
                };
                Ok(Seg {
                    steps_per_s: sps,
                    target_cs_per_s: cs,
                    ..Default::default()
                })
            }
            Cond::Prof | Cond::ProfStack => {
                // torch.profiler's exit builds its trace at tens of ms per
                // step here; --quick profiles fewer steps (steps/s is per step).
                let n = if self.ctx.quick() { n.min(30) } else { n };
                let (sps, exit) = self.run(
                    if c == Cond::Prof {
                        "prof"
                    } else {
                        "prof_stack"
                    },
                    n,
                )?;
                Ok(Seg {
                    steps_per_s: sps,
                    exit_ns: exit,
                    ..Default::default()
                })
            }
            Cond::PySpy => {
                let bin = self.ctx.pyspy.clone().map_err(anyhow::Error::msg)?;
                let out = self.ctx.work.join("py-spy.svg");
                let mut cmd = Command::new(bin);
                cmd.args([
                    "record",
                    "--pid",
                    &self.pid().to_string(),
                    "--rate",
                    "100",
                    "--output",
                ])
                .arg(&out);
                let mut spy = Proc::spawn("py-spy", &mut cmd)?;
                spy.wait_for(Duration::from_secs(30), |l| {
                    l.text.contains("Sampling process")
                })?;
                let (sps, _) = self.run("bare", n)?;
                let _ = spy.stop(Duration::from_secs(60));
                Ok(Seg {
                    steps_per_s: sps,
                    ..Default::default()
                })
            }
            Cond::Idle | Cond::Window => {
                let mut cmd = self.ctx.dynprof_cmd();
                cmd.env("DYNPROF_RECV_NS", "1").args([
                    "attach",
                    "--pid",
                    &self.pid().to_string(),
                    "--json",
                ]);
                if c == Cond::Window {
                    let out = self.ctx.work.join("torch-window");
                    let _ = std::fs::remove_dir_all(&out);
                    cmd.args(window_args(self.ctx, n + 10))
                        .arg("--output")
                        .arg(&out);
                }
                let mut dp = Proc::spawn("dynprof attach", &mut cmd)?;
                dp.wait_event(Duration::from_secs(60), "attached")?;
                let dpid = dp.pid();
                let mut seg = Seg::default();
                // Attached, no steps at all: what waiting costs.
                let quiet = if self.ctx.quick() { 0.5 } else { 1.0 };
                let (c0, w0) = (procs::cpu_ns(dpid), Instant::now());
                std::thread::sleep(Duration::from_secs_f64(quiet));
                let (c1, w1) = (procs::cpu_ns(dpid), Instant::now());
                if let (Some(a), Some(b)) = (c0, c1) {
                    seg.dp_quiet_cpu_pct =
                        Some((b - a) as f64 / (w1 - w0).as_nanos() as f64 * 100.0);
                }
                let (c0, t0, w0) = (
                    procs::cpu_ns(dpid),
                    procs::stat_cpu_ticks(dpid),
                    Instant::now(),
                );
                let cs0 = ctx_switches(self.pid());
                let (sps, _) = self.run("bare", n)?;
                let cs1 = ctx_switches(self.pid());
                // Let the last events reach dynprof before sampling its CPU.
                std::thread::sleep(Duration::from_millis(20));
                let (c1, t1, w1) = (
                    procs::cpu_ns(dpid),
                    procs::stat_cpu_ticks(dpid),
                    Instant::now(),
                );
                let wall = (w1 - w0).as_nanos() as f64;
                if let (Some(a), Some(b)) = (cs0, cs1) {
                    seg.target_cs_per_s = Some((b - a) as f64 / (wall / 1e9));
                }
                if let (Some(a), Some(b)) = (c0, c1) {
                    seg.dp_cpu_pct = Some((b - a) as f64 / wall * 100.0);
                }
                if let (Some(a), Some(b)) = (t0, t1) {
                    seg.dp_cpu_pct_ticks = Some((b - a) as f64 * 1e7 / wall * 100.0);
                }
                seg.dp_hwm_kb = procs::status_kb(dpid, "VmHWM");
                let _ = dp.stop(Duration::from_secs(60));
                seg.steps_per_s = sps;
                for (_, j) in dp.events("step") {
                    if let (Some(ts), Some(rx)) = (j.u64("ts_ns"), j.u64("recv_ns")) {
                        seg.latencies_ns.push(rx.saturating_sub(ts) as f64);
                    }
                    seg.events += 1;
                    if seg.first_step_seen.is_none() {
                        seg.first_step_seen = j.u64("step");
                    }
                }
                if let Some((_, sum)) = dp.events("summary").pop() {
                    if let Some(Json::Obj(kv)) = sum.get("drops") {
                        seg.drops = kv.iter().filter_map(|(_, v)| v.as_u64()).sum();
                    }
                } else {
                    bail!("dynprof attach printed no summary{}", stderr_tail(&dp));
                }
                Ok(seg)
            }
        }
    }

    pub fn quit(mut self) {
        let _ = self.py.send("quit");
        let _ = self.py.wait_exit(Duration::from_secs(10));
    }
}

pub(super) fn stderr_tail(p: &Proc) -> String {
    let t: Vec<&str> = p
        .seen
        .iter()
        .filter(|l| l.stream == procs::Stream::Err)
        .map(|l| l.text.as_str())
        .collect();
    if t.is_empty() {
        String::new()
    } else {
        format!(": {}", t[t.len().saturating_sub(4)..].join(" | "))
    }
}

/// Plan flags for a window over the next `steps` steps with all collectors.
pub fn window_args(ctx: &Ctx, steps: u64) -> Vec<String> {
    let _ = ctx;
    vec![
        "--start-step".into(),
        "-1".into(),
        "--active".into(),
        steps.to_string(),
        "--collect".into(),
        "api,cpu,offcpu".into(),
    ]
}

/// Voluntary + involuntary context switches of all of `pid`'s threads.
pub(super) fn ctx_switches(pid: u32) -> Option<u64> {
    let mut total = 0;
    for e in std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
    {
        let st = std::fs::read_to_string(e.path().join("status")).ok()?;
        for l in st.lines() {
            if let Some(v) = l
                .strip_prefix("voluntary_ctxt_switches:")
                .or_else(|| l.strip_prefix("nonvoluntary_ctxt_switches:"))
            {
                total += v.trim().parse::<u64>().ok()?;
            }
        }
    }
    Some(total)
}
