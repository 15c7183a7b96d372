//! `cargo xtask bench [--quick]`: dynprof's overhead, trigger precision,
//! attach time, throughput and footprint, measured side by side with the
//! alternatives on this machine. Prints one table (each figure beside its
//! target, misses marked) and writes `bench/results.json` with the raw
//! samples, the machine and the dynprof version.
//!
//! Methodology: conditions are interleaved (A B A B …) so drift cancels;
//! every figure is the median of ≥ 5 repetitions with min and max, and a
//! ratio to the same run's baseline. The bench reports; it never gates:
//! it exits 0 unless it could not run at all.

mod agent;
mod api;
mod api_figures;
mod attach_time;
mod ctx;
mod fig;
mod idle;
mod job;
mod json;
mod offcpu;
mod probe;
mod procs;
mod sites;
mod stacks;
mod stats;
mod torch;
mod torch_seg;
mod trigger;
mod vms;
mod window;

use std::time::Instant;

use anyhow::{Context as _, Result, bail};

use fig::{Figure, Goal, Unit};
use json::Json;

pub use ctx::Ctx;

#[derive(Clone, Debug)]
pub struct Opts {
    pub quick: bool,
    pub reps: usize,
    /// Run only these sections (for development): probe, torch, attach, api, trigger.
    pub only: Vec<String>,
    /// Where to write results (default bench/results.json).
    pub out: Option<std::path::PathBuf>,
    /// Use the existing target/release/dynprof (development).
    pub no_build: bool,
}

const SECTIONS: [&str; 13] = [
    "probe", "sites", "idle", "window", "torch", "attach", "api", "trigger", "job", "stacks",
    "offcpu", "agent", "later",
];

fn parse(args: &[String]) -> Result<Opts> {
    let mut o = Opts {
        quick: false,
        reps: 5,
        only: Vec::new(),
        out: None,
        no_build: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => o.quick = true,
            "--no-build" => o.no_build = true,
            "--reps" => {
                o.reps = it
                    .next()
                    .context("--reps needs a value")?
                    .parse()
                    .context("--reps")?
            }
            "--only" => o.only.extend(
                it.next()
                    .context("--only needs a value")?
                    .split(',')
                    .map(str::to_string),
            ),
            "--out" => o.out = Some(it.next().context("--out needs a value")?.into()),
            "-h" | "--help" => {
                println!(
                    "cargo xtask bench [--quick] [--reps N] [--only {}] [--out FILE]\n\
                     Prints the results table and writes bench/results.json.",
                    SECTIONS.join(",")
                );
                std::process::exit(0);
            }
            other => bail!("unknown bench argument `{other}` (try --help)"),
        }
    }
    if o.reps < 5 {
        eprintln!(
            "[bench] note: --reps {} is below the methodology's 5",
            o.reps
        );
    }
    for s in &o.only {
        if !SECTIONS.contains(&s.as_str()) {
            bail!("unknown section `{s}` (sections: {})", SECTIONS.join(", "));
        }
    }
    Ok(o)
}

/// What one section hands back.
pub struct Section {
    pub title: String,
    pub figures: Vec<Figure>,
    pub raw: Json,
}

impl Section {
    pub fn new(title: &str) -> Section {
        Section {
            title: title.into(),
            figures: Vec::new(),
            raw: Json::obj(vec![]),
        }
    }
}

pub fn say(msg: impl AsRef<str>) {
    eprintln!("[bench] {}", msg.as_ref());
}

/// A figure the issue asks for that this bench does not measure yet: kept
/// in the table so that it is not forgotten.
pub fn run(args: &[String]) -> Result<()> {
    let opts = parse(args)?;
    let started = Instant::now();
    let ctx = Ctx::prepare(&opts)?;
    let prepared = started.elapsed();
    let want = |s: &str| opts.only.is_empty() || opts.only.iter().any(|o| o == s);

    let mut sections: Vec<Section> = Vec::new();
    type Runner = fn(&Ctx) -> Result<Section>;
    // Sections 6 and 7 first: section 8 uses the per-trap cost of 7.
    let plan: [(&str, &str, Runner); 13] = [
        (
            "probe",
            "6. Probe cost per hit by first instruction (hitloop)",
            probe::run,
        ),
        (
            "sites",
            "7. Probe cost per trap at PyTorch's own probe sites",
            sites::run,
        ),
        (
            "idle",
            "8. Idle overhead on PyTorch, resolved (thread CPU per step)",
            idle::run,
        ),
        (
            "window",
            "14. A window's overhead on PyTorch, resolved (thread CPU per step)",
            window::run,
        ),
        (
            "torch",
            "1. Overhead on real PyTorch (steps/s ÷ bare) and 5. footprint",
            torch::run,
        ),
        (
            "api",
            "2. High API-call rate (acl_trainer + libascendcl.so)",
            api::run,
        ),
        ("trigger", "3. Trigger precision and latency", trigger::run),
        ("attach", "4. Attach time on real PyTorch", attach_time::run),
        ("job", "9. Job mode: 1, 2, 4, 8 native ranks", job::run),
        (
            "stacks",
            "10. Stacks: stack copy + unwinding vs torch.profiler with_stack and py-spy --native",
            stacks::run,
        ),
        (
            "offcpu",
            "13. Off-CPU collector: cost per context switch (pingpong)",
            offcpu::run,
        ),
        (
            "agent",
            "11. dynprof agent with 8 PyTorch ranks",
            agent::run,
        ),
        (
            "later",
            "12. VMs: probe cost as ratios (QEMU TCG, Linux 5.10)",
            vms::run,
        ),
    ];
    for (key, title, f) in plan {
        if !want(key) {
            continue;
        }
        say(format!("── {title}"));
        let t = Instant::now();
        let mut s = match f(&ctx) {
            Ok(s) => s,
            Err(e) => {
                say(format!("{key}: could not run: {e:#}"));
                let mut s = Section::new(title);
                s.figures.push(
                    Figure::new(key, "section", Unit::Count, Goal::Info, "")
                        .missing(format!("could not run: {e:#}")),
                );
                s.raw = Json::obj(vec![("error", Json::s(format!("{e:#}")))]);
                s
            }
        };
        s.title = title.to_string();
        s.raw
            .push("section_s", Json::num(t.elapsed().as_secs_f64()));
        say(format!("{key}: {:.1} s", t.elapsed().as_secs_f64()));
        sections.push(s);
    }

    let tables: Vec<(String, Vec<Figure>)> = sections
        .iter()
        .map(|s| (s.title.clone(), s.figures.clone()))
        .collect();
    let table = fig::table(&tables);
    println!();
    println!("dynprof {} on {}", ctx.version_line(), ctx.machine_line());
    println!("{table}");
    let misses: Vec<&Figure> = tables
        .iter()
        .flat_map(|(_, f)| f)
        .filter(|f| f.status() == "MISS")
        .collect();
    println!(
        "{} figures, {} with a target met, {} MISS, {} too noisy to call, {} not measured; {:.0} s measuring (+{:.0} s building){}",
        tables.iter().map(|(_, f)| f.len()).sum::<usize>(),
        tables
            .iter()
            .flat_map(|(_, f)| f)
            .filter(|f| f.status() == "ok")
            .count(),
        misses.len(),
        tables
            .iter()
            .flat_map(|(_, f)| f)
            .filter(|f| f.status() == "noisy")
            .count(),
        tables
            .iter()
            .flat_map(|(_, f)| f)
            .filter(|f| f.kind == "not measured")
            .count(),
        (started.elapsed() - prepared).as_secs_f64(),
        prepared.as_secs_f64(),
        if opts.quick { " (--quick)" } else { "" }
    );

    let results = Json::obj(vec![
        ("schema", Json::s("dynprof-bench/1")),
        ("quick", Json::Bool(opts.quick)),
        ("reps", Json::int(opts.reps as u64)),
        ("duration_s", Json::num(started.elapsed().as_secs_f64())),
        ("build_s", Json::num(prepared.as_secs_f64())),
        ("dynprof", ctx.version_json()),
        ("machine", ctx.machine_json()),
        (
            "methodology",
            Json::s(
                "conditions interleaved A B A B …; each figure is the median of the repetitions with min and max; \
                 ratios are to the baseline of the same run (bracketing bare runs); absolute figures vary between \
                 runs, the ratios are the claim",
            ),
        ),
        (
            "sections",
            Json::Arr(
                sections
                    .iter()
                    .map(|s| {
                        Json::obj(vec![
                            ("title", Json::s(&s.title)),
                            (
                                "figures",
                                Json::Arr(s.figures.iter().map(Figure::to_json).collect()),
                            ),
                            ("raw", s.raw.clone()),
                        ])
                    })
                    .collect(),
            ),
        ),
        ("table_markdown", Json::s(fig::markdown(&tables))),
    ]);
    let out = opts
        .out
        .clone()
        .unwrap_or_else(|| crate::util::workspace_root().join("bench/results.json"));
    if let Some(d) = out.parent() {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    std::fs::write(&out, results.pretty()).with_context(|| format!("writing {}", out.display()))?;
    println!("results: {}", out.display());
    Ok(())
}
