//! Section 4: Attach time on real PyTorch: from starting `dynprof attach` to its
//! first step event, p50 over ≥ 5 runs against one running
//! tests/fixtures/torch_train.py. When dynprof reports the phases (opt-in
//! `DYNPROF_ATTACH_TIMINGS=1` adds `timings_ms` to the `attached` line) the
//! time is split into symbol resolution, program load and attach; the rest
//! is process start-up plus waiting for the next step boundary.

use std::{process::Command, time::Duration};

use anyhow::{Context as _, Result};

use super::{
    Ctx, Section,
    fig::{Figure, Goal, Unit},
    json::Json,
    procs::Proc,
    say, stats,
};

pub fn run(ctx: &Ctx) -> Result<Section> {
    let script = crate::util::workspace_root().join("tests/fixtures/torch_train.py");
    let mut cmd2 = Command::new(&ctx.python);
    cmd2.arg(&script).args(["--steps", "0"]);
    let mut py = Proc::spawn("torch_train.py", &mut cmd2)?;
    py.wait_prefix(Duration::from_secs(180), "ready")
        .context("starting torch_train.py")?;
    std::thread::sleep(Duration::from_millis(500));

    let runs = ctx.reps().max(5);
    let mut total = Vec::new();
    let mut to_attached = Vec::new();
    let mut phases: [Vec<f64>; 4] = Default::default();
    let names = ["target_ms", "resolve_ms", "load_ms", "attach_ms"];
    for i in 0..runs {
        let mut c = ctx.dynprof_cmd();
        c.env("DYNPROF_ATTACH_TIMINGS", "1").args([
            "attach",
            "--pid",
            &py.pid().to_string(),
            "--json",
            "--steps",
            "1",
        ]);
        let mut dp = Proc::spawn("dynprof attach", &mut c)?;
        let (al, aj) = dp.wait_event(Duration::from_secs(60), "attached")?;
        let (sl, _) = dp.wait_event(Duration::from_secs(60), "step")?;
        let _ = dp.wait_exit(Duration::from_secs(30));
        let t = (sl.at - dp.started).as_secs_f64() * 1e3;
        total.push(t);
        to_attached.push((al.at - dp.started).as_secs_f64() * 1e3);
        if let Some(tm) = aj.get("timings_ms") {
            for (k, n) in names.iter().enumerate() {
                if let Some(v) = tm.f64(n) {
                    phases[k].push(v);
                }
            }
        }
        say(format!(
            "attach run {}: first step after {t:.1} ms (attached line after {:.1} ms)",
            i + 1,
            to_attached[i]
        ));
    }
    let _ = py.stop(Duration::from_secs(10));

    let mut s = Section::new("");
    s.figures.push(
        Figure::new(
            "attach_to_first_step_p50_ms",
            "attach → first step event, p50",
            Unit::Ms,
            Goal::AtMost(1000.0),
            "≤ 1 s",
        )
        .value(stats::percentile(&total, 50.0).unwrap_or(f64::NAN))
        .samples(total.clone()),
    );
    s.figures.push(
        Figure::new(
            "attach_to_attached_ms",
            "attach → `attached` line (all set up)",
            Unit::Ms,
            Goal::Info,
            "",
        )
        .samples(to_attached.clone()),
    );
    let labels = [
        "  of which: target (/proc)",
        "  of which: symbol resolution",
        "  of which: program load (verifier)",
        "  of which: uprobe attach",
    ];
    if phases[1].is_empty() {
        s.figures.push(
            Figure::new(
                "attach_split",
                "split: resolution / load / attach",
                Unit::Ms,
                Goal::Info,
                "",
            )
            .missing("this dynprof does not report attach phases (DYNPROF_ATTACH_TIMINGS)"),
        );
    } else {
        for (k, l) in labels.iter().enumerate() {
            if !phases[k].is_empty() {
                s.figures.push(
                    Figure::new(names[k], l, Unit::Ms, Goal::Info, "").samples(phases[k].clone()),
                );
            }
        }
    }
    s.raw = Json::obj(vec![
        ("to_first_step_ms", Json::nums(&total)),
        ("to_attached_ms", Json::nums(&to_attached)),
        (
            "phases_ms",
            Json::Obj(
                names
                    .iter()
                    .enumerate()
                    .map(|(k, n)| (n.to_string(), Json::nums(&phases[k])))
                    .collect(),
            ),
        ),
    ]);
    Ok(s)
}
