//! Section 10: stacks. What a CPU sample costs with the stack copy and
//! user-space unwinding on (docs/stacks.md), and the window's overhead
//! against torch.profiler `with_stack` and `py-spy --native` at the same
//! sampling frequency.
//!
//! One torch_bench.py process; each repetition runs, interleaved:
//! bare │ dynprof window `--collect cpu` at `HZ` with the 16 KiB stack copy
//! (unwinding) │ the same with `DYNPROF_STACK_COPY_KB=0` (frame pointers
//! only) │ that without the Python frame walk (`DYNPROF_PYTHON_FRAMES=0`) │
//! torch.profiler with_stack │ py-spy record --native at `HZ` │ dynprof
//! sampling another, idle process (the training thread takes the same perf
//! interrupts and the program's early exit; dynprof has nothing to do).
//! The kernel's BPF run-time statistics are on for the section
//! (`kernel.bpf_stats_enabled`), so the cpu program's own time per sample
//! is read from dynprof's program fd, apart from the perf interrupt's.
//! Each figure uses the training thread's CPU time per step
//! (CLOCK_THREAD_CPUTIME_ID) and the mean of the two bare runs around it;
//! py-spy's cost is mostly wall time (it pauses the target per sample), so
//! wall-clock ratios are given as well.

use std::{path::Path, time::Duration};

use anyhow::{Context as _, Result};

use super::{
    Ctx, Section,
    fig::{Figure, Goal, Unit},
    json::Json,
    procs::{self, Proc},
    say,
    sites::start_torch,
    stats,
};

const HZ: &str = "999";
/// Ring bytes of one sample with the copy on: the ring record header
/// (8 bytes), the 64-byte SampleEvent header and the 16 KiB copy.
const RING_BYTES_PER_SAMPLE: f64 = 8.0 + 64.0 + 16384.0;

const CONDS: [&str; 7] = [
    "bare",
    "unwind",
    "fp_only",
    "fp_no_python",
    "prof_stack",
    "pyspy_native",
    "sampling_other",
];
/// `run MODE N` → (wall ns, thread CPU ns).
fn run_steps(py: &mut Proc, mode: &str, n: u64) -> Result<(f64, f64)> {
    py.send(&format!("run {mode} {n}"))?;
    let l = py.wait_prefix(Duration::from_secs(900), "result")?;
    let f: Vec<&str> = l.text.split_whitespace().collect();
    let num = |i: usize| -> Result<f64> {
        f.get(i)
            .and_then(|v| v.parse().ok())
            .context("bad result line")
    };
    Ok((num(3)?, num(7)?))
}

/// Samples in a window's cpu.folded (the last field of each line).
fn folded_samples(dir: &Path) -> f64 {
    std::fs::read_to_string(dir.join("cpu.folded"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// "cpu: N stack copies unwound in T (D each, …)" → D in ns.
fn unwind_each_ns(p: &Proc) -> Option<f64> {
    let l = p
        .seen
        .iter()
        .rev()
        .find(|l| l.text.contains("stack copies unwound in"))?;
    let each = l.text.split(" (").nth(1)?.split(" each").next()?;
    let (num, unit) = each.split_at(each.find(|c: char| c.is_alphabetic() || c == 'µ')?);
    let v: f64 = num.parse().ok()?;
    Some(match unit {
        "ns" => v,
        "µs" | "us" => v * 1e3,
        "ms" => v * 1e6,
        "s" => v * 1e9,
        _ => return None,
    })
}

struct DpRun {
    wall: f64,
    cpu: f64,
    samples: f64,
    dp_cpu_ns: f64,
    unwind_ns: Option<f64>,
    /// The cpu program's run time over the window (all its runs: the
    /// target's samples and the early exits on other processes').
    bpf_ns: Option<f64>,
}

fn dynprof_window(ctx: &Ctx, py: &mut Proc, n: u64, copy: bool, python: bool) -> Result<DpRun> {
    let out = ctx.work.join("stacks-window");
    let _ = std::fs::remove_dir_all(&out);
    let mut cmd = ctx.dynprof_cmd();
    cmd.env("RUST_LOG", "warn,dynprof::collect::cpu=debug");
    if !copy {
        cmd.env("DYNPROF_STACK_COPY_KB", "0");
    }
    if !python {
        cmd.env("DYNPROF_PYTHON_FRAMES", "0");
    }
    cmd.args(["attach", "--pid", &py.pid().to_string(), "--json"])
        .args(["--start-step", "-1", "--active", &(n + 10).to_string()])
        .args(["--collect", "cpu", "--cpu-hz", HZ, "--output"])
        .arg(&out);
    let mut dp = Proc::spawn("dynprof attach --collect cpu", &mut cmd)?;
    dp.wait_event(Duration::from_secs(60), "attached")?;
    let bpf0 = procs::bpf_prog_stats(dp.pid(), procs::PROG_TYPE_PERF_EVENT);
    let (wall, cpu) = run_steps(py, "bare", n)?;
    let dp_cpu = procs::cpu_ns(dp.pid()).unwrap_or(0) as f64;
    let bpf1 = procs::bpf_prog_stats(dp.pid(), procs::PROG_TYPE_PERF_EVENT);
    let _ = dp.stop(Duration::from_secs(120));
    let dir = dp
        .events("window")
        .pop()
        .and_then(|(_, w)| {
            w.get("window")
                .and_then(|w| w.str("dir"))
                .map(str::to_string)
        })
        .context("the window was not written")?;
    let samples = folded_samples(Path::new(&dir));
    let _ = std::fs::remove_dir_all(&out);
    Ok(DpRun {
        wall,
        cpu,
        samples,
        dp_cpu_ns: dp_cpu,
        unwind_ns: unwind_each_ns(&dp),
        bpf_ns: bpf0
            .zip(bpf1)
            .filter(|(a, b)| b.1 > a.1)
            .map(|(a, b)| (b.0 - a.0) as f64),
    })
}

/// `run bare N` while dynprof samples at `HZ` an idle `deepstack --sleep`
/// (it sleeps out its 20 ms steps): system-wide per-CPU sampling, so the
/// training thread takes every interrupt and the cpu program's early exit
/// for another process, and dynprof receives next to no samples.
fn sampling_other(ctx: &Ctx, py: &mut Proc, n: u64) -> Result<(f64, f64)> {
    let mut idle = Proc::spawn(
        "deepstack --sleep",
        std::process::Command::new(ctx.fixtures.join("deepstack")).args([
            "--sleep",
            "--step-ms",
            "20",
        ]),
    )?;
    idle.wait_prefix(Duration::from_secs(30), "ready")
        .context("starting deepstack")?;
    let out = ctx.work.join("stacks-other");
    let _ = std::fs::remove_dir_all(&out);
    let mut cmd = ctx.dynprof_cmd();
    cmd.args(["attach", "--pid", &idle.pid().to_string(), "--json"])
        .args(["--marker", "exe:step_marker", "--start-step", "-1"])
        .args(["--active", "100000", "--collect", "cpu", "--cpu-hz", HZ])
        .arg("--output")
        .arg(&out);
    let mut dp = Proc::spawn("dynprof attach (another process)", &mut cmd)?;
    let r = dp
        .wait_event(Duration::from_secs(60), "attached")
        .and_then(|_| run_steps(py, "bare", n));
    let _ = dp.stop(Duration::from_secs(60));
    let _ = idle.stop(Duration::from_secs(10));
    let _ = std::fs::remove_dir_all(&out);
    r
}

pub fn run(ctx: &Ctx) -> Result<Section> {
    let _stats = procs::BpfStats::on("stacks");
    let mut py = start_torch(ctx, 200)?;
    let (w, _) = run_steps(&mut py, "bare", 200)?;
    let seg_s = if ctx.quick() { 1.0 } else { 3.0 };
    let n = ((seg_s * 1e9 / (w / 200.0)) as u64).clamp(100, 50_000);
    // torch.profiler's exit builds its trace at tens of ms per step.
    let n_prof = if ctx.quick() { n.min(30) } else { n.min(300) };
    let reps = ctx.reps();
    say(format!("stacks: {n} steps per segment, {HZ} Hz"));
    // [cond][rep] = (wall ns/step, cpu ns/step); bare has reps + 1.
    let mut per: Vec<Vec<(f64, f64)>> = vec![Vec::new(); CONDS.len()];
    let mut samples_per_step: Vec<Vec<f64>> = vec![Vec::new(); 4];
    let mut dp_ns_per_sample: Vec<Vec<f64>> = vec![Vec::new(); 4];
    let mut bpf_ns_per_sample: Vec<Vec<f64>> = vec![Vec::new(); 4];
    let mut unwind_ns = Vec::new();
    let mut pyspy_err = None;
    let bare = |py: &mut Proc| -> Result<(f64, f64)> {
        let (w, c) = run_steps(py, "bare", n)?;
        Ok((w / n as f64, c / n as f64))
    };
    per[0].push(bare(&mut py)?);
    for rep in 0..reps {
        for (ci, c) in CONDS.iter().enumerate().skip(1) {
            match *c {
                "unwind" | "fp_only" | "fp_no_python" => {
                    let r = dynprof_window(ctx, &mut py, n, *c == "unwind", *c != "fp_no_python")?;
                    per[ci].push((r.wall / n as f64, r.cpu / n as f64));
                    samples_per_step[ci].push(r.samples / n as f64);
                    dp_ns_per_sample[ci].push(r.dp_cpu_ns / r.samples.max(1.0));
                    if let Some(b) = r.bpf_ns {
                        bpf_ns_per_sample[ci].push(b / r.samples.max(1.0));
                    }
                    if *c == "unwind"
                        && let Some(u) = r.unwind_ns
                    {
                        unwind_ns.push(u);
                    }
                }
                "sampling_other" => {
                    let (w, c) = sampling_other(ctx, &mut py, n)?;
                    per[ci].push((w / n as f64, c / n as f64));
                }
                "prof_stack" => {
                    let (w, c) = run_steps(&mut py, "prof_stack", n_prof)?;
                    per[ci].push((w / n_prof as f64, c / n_prof as f64));
                }
                _ => match ctx.pyspy.clone() {
                    Ok(bin) => {
                        let mut cmd = std::process::Command::new(bin);
                        cmd.args([
                            "record",
                            "--native",
                            "--rate",
                            HZ,
                            "--pid",
                            &py.pid().to_string(),
                        ])
                        .arg("--output")
                        .arg(ctx.work.join("py-spy-native.svg"));
                        let mut spy = Proc::spawn("py-spy --native", &mut cmd)?;
                        spy.wait_for(Duration::from_secs(30), |l| {
                            l.text.contains("Sampling process")
                        })?;
                        per[ci].push(bare(&mut py)?);
                        let _ = spy.stop(Duration::from_secs(60));
                    }
                    Err(e) => pyspy_err = Some(e),
                },
            }
        }
        per[0].push(bare(&mut py)?);
        say(format!("stacks rep {} done", rep + 1));
    }
    let _ = py.send("quit");
    let _ = py.wait_exit(Duration::from_secs(10));

    // Ratio to the mean of the bracketing bare runs: bare / cond per step.
    let ratio = |ci: usize, cpu: bool| -> Vec<f64> {
        per[ci]
            .iter()
            .enumerate()
            .map(|(r, v)| {
                let pick = |x: &(f64, f64)| if cpu { x.1 } else { x.0 };
                (pick(&per[0][r]) + pick(&per[0][r + 1])) / 2.0 / pick(v)
            })
            .collect()
    };
    let added_per_sample = |ci: usize| -> Vec<f64> {
        per[ci]
            .iter()
            .enumerate()
            .map(|(r, v)| {
                let b = (per[0][r].1 + per[0][r + 1].1) / 2.0;
                (v.1 - b) / samples_per_step[ci][r].max(1e-9)
            })
            .collect()
    };
    let mut s = Section::new("");
    s.figures.push(
        Figure::new(
            "stacks_unwind_over_bare",
            &format!("window (cpu {HZ} Hz, stack copy + unwinding) ÷ bare, per CPU-second"),
            Unit::Ratio,
            Goal::AtLeast(0.97),
            "≥ 0.97",
        )
        .samples(ratio(1, true))
        .resolve(0.02),
    );
    s.figures.push(
        Figure::new(
            "stacks_fp_over_bare",
            &format!("window (cpu {HZ} Hz, frame pointers only) ÷ bare, per CPU-second"),
            Unit::Ratio,
            Goal::Info,
            "",
        )
        .samples(ratio(2, true)),
    );
    s.figures.push(
        Figure::new(
            "stacks_fp_no_python_over_bare",
            &format!(
                "window (cpu {HZ} Hz, frame pointers only, no Python frame walk) ÷ bare, per CPU-second"
            ),
            Unit::Ratio,
            Goal::Info,
            "",
        )
        .samples(ratio(3, true)),
    );
    s.figures.push(
        Figure::new(
            "stacks_target_ns_per_sample",
            "target CPU per sample, stack copy on",
            Unit::Ns,
            Goal::Info,
            "",
        )
        .samples(added_per_sample(1))
        .note(format!(
            "{:.2} samples per step at {HZ} Hz; frame pointers only: {:.0} ns per sample; \
             frame pointers without the Python frame walk: {:.0} ns",
            stats::median(&samples_per_step[1]).unwrap_or(f64::NAN),
            stats::median(&added_per_sample(2)).unwrap_or(f64::NAN),
            stats::median(&added_per_sample(3)).unwrap_or(f64::NAN)
        )),
    );
    // The cpu program's own share of that: the kernel's run time of it
    // (bpf_stats) over the window ÷ the target's samples. The rest of a
    // sample's cost is the perf interrupt and its return.
    let mut bf = Figure::new(
        "stacks_bpf_ns_per_sample",
        "cpu eBPF program run time per target sample, stack copy on (kernel bpf_stats)",
        Unit::Ns,
        Goal::Info,
        "",
    );
    bf = if bpf_ns_per_sample[1].is_empty() {
        bf.missing("no run_time_ns in dynprof's program fdinfo (kernel.bpf_stats_enabled could not be set?)")
    } else {
        bf.samples(bpf_ns_per_sample[1].clone()).note(format!(
            "frame pointers only: {:.0} ns; without the Python frame walk: {:.0} ns \
             (each includes the program's early exits on other processes' samples)",
            stats::median(&bpf_ns_per_sample[2]).unwrap_or(f64::NAN),
            stats::median(&bpf_ns_per_sample[3]).unwrap_or(f64::NAN)
        ))
    };
    s.figures.push(bf);
    // The interrupt alone: added CPU per step while dynprof samples another
    // process, per interrupt the training thread takes (as many as the
    // samples it gives when it is the target: samples per step without the
    // Python walk).
    let per_interrupt: Vec<f64> = per[6]
        .iter()
        .enumerate()
        .map(|(r, v)| {
            let b = (per[0][r].1 + per[0][r + 1].1) / 2.0;
            (v.1 - b)
                / samples_per_step[3]
                    .get(r)
                    .copied()
                    .unwrap_or(f64::NAN)
                    .max(1e-9)
        })
        .collect();
    s.figures.push(
        Figure::new(
            "stacks_interrupt_ns_per_sample",
            "target CPU per perf interrupt when dynprof samples another process (the program exits early)",
            Unit::Ns,
            Goal::Info,
            "",
        )
        .samples(per_interrupt)
        .note(format!(
            "sampling another process ÷ bare, per CPU-second: {:.4}",
            stats::median(&ratio(6, true)).unwrap_or(f64::NAN)
        )),
    );
    s.figures.push(
        Figure::new("stacks_dynprof_ns_per_sample", "dynprof CPU per sample while the window runs, stack copy on (attach included, writing not)", Unit::Ns, Goal::Info, "")
            .samples(dp_ns_per_sample[1].clone())
            .note(format!(
                "frame pointers only: {:.0} ns per sample",
                stats::median(&dp_ns_per_sample[2]).unwrap_or(f64::NAN)
            )),
    );
    let mut uf = Figure::new(
        "stacks_unwind_ns",
        "user-space unwinding per stack copy (dynprof's debug log)",
        Unit::Ns,
        Goal::Info,
        "",
    );
    uf = if unwind_ns.is_empty() {
        uf.missing("no `stack copies unwound` line in dynprof's log")
    } else {
        uf.samples(unwind_ns.clone())
    };
    s.figures.push(uf);
    s.figures.push(
        Figure::new("stacks_ring_bytes_per_sample", "ring bytes per sample, stack copy on", Unit::Count, Goal::Info, "")
            .value(RING_BYTES_PER_SAMPLE)
            .computed()
            .note("8-byte ring record header + 64-byte sample header + the 16 KiB copy (docs/stacks.md); 8/4/2/1 KiB when the stack's top is nearer"),
    );
    let slow = |v: Vec<f64>| -> Vec<f64> { v.iter().map(|r| 1.0 - r).collect() };
    s.figures.push(
        Figure::new(
            "stacks_prof_stack_over_bare",
            "torch.profiler with_stack ÷ bare, per CPU-second",
            Unit::Ratio,
            Goal::Info,
            "",
        )
        .samples(ratio(4, true))
        .note(format!(
            "{n_prof} steps per segment (its exit builds the trace)"
        )),
    );
    let dp_slow = slow(ratio(1, true));
    let prof_slow = slow(ratio(4, true));
    s.figures.push(
        Figure::new(
            "stacks_slowdown_over_prof_stack",
            "window slowdown ÷ torch.profiler with_stack slowdown, per CPU-second",
            Unit::Ratio,
            Goal::AtMost(1.0 / 3.0),
            "≤ 0.333",
        )
        .samples(dp_slow.iter().zip(&prof_slow).map(|(a, b)| a / b).collect()),
    );
    if let Some(e) = pyspy_err {
        s.figures.push(
            Figure::new(
                "stacks_pyspy_native_over_bare",
                &format!("py-spy --native {HZ} Hz ÷ bare"),
                Unit::Ratio,
                Goal::Info,
                "",
            )
            .missing(format!("py-spy not available here: {e}")),
        );
    } else {
        s.figures.push(
            Figure::new("stacks_pyspy_native_over_bare", &format!("py-spy --native {HZ} Hz ÷ bare, wall clock"), Unit::Ratio, Goal::Info, "")
                .samples(ratio(5, false))
                .note(format!(
                    "per CPU-second {:.4}: py-spy pauses the target to read it, which costs wall time, not the target's CPU; dynprof's window \
                     at the same rate by wall clock: {:.4}",
                    stats::median(&ratio(5, true)).unwrap_or(f64::NAN),
                    stats::median(&ratio(1, false)).unwrap_or(f64::NAN)
                )),
        );
    }
    s.raw = Json::obj(vec![
        ("hz", Json::s(HZ)),
        ("steps_per_segment", Json::int(n)),
        ("prof_steps_per_segment", Json::int(n_prof)),
        (
            "per_step_wall_ns",
            Json::Obj(
                CONDS
                    .iter()
                    .enumerate()
                    .map(|(i, c)| {
                        (
                            c.to_string(),
                            Json::nums(&per[i].iter().map(|x| x.0).collect::<Vec<_>>()),
                        )
                    })
                    .collect(),
            ),
        ),
        (
            "per_step_thread_cpu_ns",
            Json::Obj(
                CONDS
                    .iter()
                    .enumerate()
                    .map(|(i, c)| {
                        (
                            c.to_string(),
                            Json::nums(&per[i].iter().map(|x| x.1).collect::<Vec<_>>()),
                        )
                    })
                    .collect(),
            ),
        ),
        ("samples_per_step_unwind", Json::nums(&samples_per_step[1])),
        ("samples_per_step_fp_only", Json::nums(&samples_per_step[2])),
        (
            "dynprof_ns_per_sample_unwind",
            Json::nums(&dp_ns_per_sample[1]),
        ),
        (
            "dynprof_ns_per_sample_fp_only",
            Json::nums(&dp_ns_per_sample[2]),
        ),
        ("unwind_ns_each", Json::nums(&unwind_ns)),
        (
            "samples_per_step_fp_no_python",
            Json::nums(&samples_per_step[3]),
        ),
        (
            "bpf_ns_per_sample",
            Json::Obj(
                CONDS[1..4]
                    .iter()
                    .zip(&bpf_ns_per_sample[1..4])
                    .map(|(c, v)| (c.to_string(), Json::nums(v)))
                    .collect(),
            ),
        ),
    ]);
    Ok(s)
}
