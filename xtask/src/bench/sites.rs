//! Section 7: the probe cost at PyTorch's own probe sites.
//!
//! bench/torch_bench.py (`site SITE N`) calls one site in a tight loop with
//! no training step around it:
//!   cs  record_function("Optimizer.step#Bench.step"): its name reaches
//!       `c10::ivalue::ConstantString::create` (the step marker's symbol;
//!       starts with `push %r15` on Debian's torch 1.13, emulated);
//!   bw  backward() of a one-element graph: `torch::autograd::Engine::execute`
//!       (the aux marker's symbol; starts with `push %rbp`).
//! The loop's thread CPU time is read bare, with the empty uprobe, and with
//! the marker program (and, at `cs`, its string filter). A Python call may
//! hit the symbol more than once, so the per-trap cost divides by the hits
//! the marker program counted (HITS map, no filter), not by the calls.

use std::{process::Command, time::Duration};

use anyhow::{Context as _, Result, bail};

use super::{
    Ctx, Section,
    fig::{Figure, Goal, Unit},
    json::Json,
    probe::ProbeHelper,
    procs::Proc,
    say, stats,
};

pub const CS_SPEC: &str = "libtorch_cpu:c10::ivalue::ConstantString::create(std::string)";
pub const CS_FILTER: &str = ",arg=1:str,prefix=Optimizer.step#";
pub const BW_SPEC: &str = "libtorch_cpu:torch::autograd::Engine::execute";

/// (site, spec, what, N quick, N full).
const SITES: [(&str, &str, &str, u64, u64); 2] = [
    ("cs", CS_SPEC, "ConstantString::create", 100_000, 300_000),
    ("bw", BW_SPEC, "Engine::execute", 30_000, 100_000),
];

/// (name, program, filter).
const CONDS: [(&str, &str, &str); 4] = [
    ("bare", "", ""),
    ("empty", "empty", ""),
    ("marker", "marker", ""),
    ("marker_filter", "marker", CS_FILTER),
];

fn conds_of(site: &str) -> usize {
    if site == "cs" { 4 } else { 3 }
}

/// torch_bench.py: `site SITE N` → thread CPU ns of the loop.
pub fn time_site(py: &mut Proc, site: &str, n: u64) -> Result<f64> {
    py.send(&format!("site {site} {n}"))?;
    let l = py.wait_prefix(Duration::from_secs(600), "result")?;
    l.text
        .split_whitespace()
        .nth(7)
        .and_then(|v| v.parse().ok())
        .context("bad result line")
}

pub fn start_torch(ctx: &Ctx, warmup: u32) -> Result<Proc> {
    let mut cmd = Command::new(&ctx.python);
    cmd.arg(ctx.src.join("torch_bench.py"))
        .args(["--warmup", &warmup.to_string()]);
    let mut py = Proc::spawn("torch_bench.py", &mut cmd)?;
    py.wait_prefix(Duration::from_secs(180), "ready")
        .context("starting PyTorch")?;
    Ok(py)
}

pub fn run(ctx: &Ctx) -> Result<Section> {
    let reps = ctx.reps();
    let mut py = start_torch(ctx, 50)?;
    let pid = py.pid();
    let n_of = |s: usize| if ctx.quick() { SITES[s].3 } else { SITES[s].4 };
    for (s, site) in SITES.iter().enumerate() {
        time_site(&mut py, site.0, n_of(s) / 4)?;
    }
    let mut times = vec![vec![Vec::<f64>::new(); CONDS.len()]; SITES.len()];
    // Traps per call, from the marker program's HITS count without filter.
    let mut hits_per_call = vec![Vec::<f64>::new(); SITES.len()];
    let mut raw_helpers = Vec::new();
    for rep in 0..reps {
        for (s, site) in SITES.iter().enumerate() {
            let n = n_of(s);
            let nc = conds_of(site.0);
            for k in 0..nc {
                let ci = (k + rep) % nc;
                let (name, prog, filter) = CONDS[ci];
                let helper = if prog.is_empty() {
                    None
                } else {
                    Some(ProbeHelper::attach(
                        ctx,
                        pid,
                        &format!("{}{filter}", site.1),
                        prog,
                    )?)
                };
                times[s][ci].push(time_site(&mut py, site.0, n)?);
                if let Some(h) = helper {
                    let sum = h.finish()?;
                    let hits = sum.u64("hits").unwrap_or(0);
                    if name == "marker" {
                        if hits < n {
                            bail!("{}: {hits} hits for {n} calls", site.2);
                        }
                        hits_per_call[s].push(hits as f64 / n as f64);
                    }
                    raw_helpers.push(Json::obj(vec![
                        ("rep", Json::int(rep as u64)),
                        ("site", Json::s(site.0)),
                        ("cond", Json::s(name)),
                        ("hits", Json::int(hits)),
                        ("drops", Json::int(sum.u64("drops").unwrap_or(0))),
                    ]));
                }
            }
            say(format!(
                "sites rep {} {}: ns/call bare {:.0}, empty {:.0}, marker {:.0}",
                rep + 1,
                site.0,
                times[s][0][rep] / n as f64,
                times[s][1][rep] / n as f64,
                times[s][2][rep] / n as f64,
            ));
        }
    }
    let _ = py.send("quit");
    let _ = py.wait_exit(Duration::from_secs(10));

    // Per trap, per repetition: (t_cond − t_bare) / hits.
    let per_trap = |s: usize, ci: usize| -> Vec<f64> {
        (0..reps)
            .map(|r| {
                let hits = hits_per_call[s][r] * n_of(s) as f64;
                (times[s][ci][r] - times[s][0][r]) / hits
            })
            .collect()
    };
    let mut sec = Section::new("");
    for (s, site) in SITES.iter().enumerate() {
        let empty = per_trap(s, 1);
        let marker = per_trap(s, 2);
        let hpc = stats::median(&hits_per_call[s]).unwrap_or(f64::NAN);
        sec.figures.push(
            Figure::new(
                &format!("torch_{}_marker_over_empty", site.0),
                &format!("marker ÷ empty uprobe at {} (emulated push)", site.2),
                Unit::Ratio,
                Goal::AtMost(1.10),
                "≤ 1.10",
            )
            .samples(marker.iter().zip(&empty).map(|(a, b)| a / b).collect())
            .resolve(0.02),
        );
        sec.figures.push(
            Figure::new(
                &format!("torch_{}_empty_ns", site.0),
                &format!("empty uprobe per trap at {}", site.2),
                Unit::Ns,
                Goal::Info,
                "",
            )
            .samples(empty.clone()),
        );
        sec.figures.push(
            Figure::new(
                &format!("torch_{}_marker_ns", site.0),
                &format!("marker per trap at {}", site.2),
                Unit::Ns,
                Goal::Info,
                "",
            )
            .samples(marker.clone())
            .note(format!(
                "{hpc:.2} traps per Python call; bare call {:.2} µs",
                stats::median(&times[s][0]).unwrap_or(0.0) / n_of(s) as f64 / 1e3
            )),
        );
        if site.0 == "bw" {
            ctx.bw_trap_ns.set(stats::median(&marker).unwrap_or(0.0));
        } else {
            let filter = per_trap(s, 3);
            ctx.cs_trap_ns.set(stats::median(&filter).unwrap_or(0.0));
            sec.figures.push(
                Figure::new(
                    "torch_cs_marker_filter_ns",
                    "marker + string filter per trap at ConstantString::create",
                    Unit::Ns,
                    Goal::Info,
                    "",
                )
                .samples(filter),
            );
        }
    }
    sec.raw = Json::obj(vec![
        (
            "sites",
            Json::Arr(
                SITES
                    .iter()
                    .enumerate()
                    .map(|(s, site)| {
                        Json::obj(vec![
                            ("site", Json::s(site.0)),
                            ("spec", Json::s(site.1)),
                            ("calls_per_run", Json::int(n_of(s))),
                            ("hits_per_call", Json::nums(&hits_per_call[s])),
                            (
                                "loop_thread_cpu_ns",
                                Json::Obj(
                                    CONDS[..conds_of(site.0)]
                                        .iter()
                                        .enumerate()
                                        .map(|(ci, c)| (c.0.to_string(), Json::nums(&times[s][ci])))
                                        .collect(),
                                ),
                            ),
                        ])
                    })
                    .collect(),
            ),
        ),
        ("helpers", Json::Arr(raw_helpers)),
    ]);
    Ok(sec)
}
