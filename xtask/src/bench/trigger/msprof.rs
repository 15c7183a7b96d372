//! Section 3's msprof part: boundary hit → msprof `start` written, against
//! the stand-in msprof, as built and with `--realtime-boundaries`.

use std::{process::Command, time::Duration};

use anyhow::{Result, bail};

use crate::bench::{
    Ctx, Section,
    fig::{Figure, Goal, Unit},
    json::{self, Json},
    procs::Proc,
    stats,
};

/// Windows driving the stand-in msprof (tests/fixtures/msprof_standin.py)
/// on the fixture trainer (PROFILING_MODE=dynamic, 20 ms steps): the
/// latency from the boundary hit to the end of the `start` write, as
/// dynprof records it in meta.json (hooks.msprof.start_latency_ns). In
/// four chunks, each run as built and with `--realtime-boundaries`, side
/// by side.
pub(super) fn msprof(ctx: &Ctx, s: &mut Section, raw: &mut Json) -> Result<()> {
    let windows: u64 = if ctx.quick() { 20 } else { 100 };
    let dir = ctx.work.join("msprof");
    let _ = std::fs::remove_dir_all(&dir);
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin)?;
    std::os::unix::fs::symlink(
        crate::util::workspace_root().join("tests/fixtures/msprof_standin.py"),
        bin.join("msprof"),
    )?;
    let mut tr = Proc::spawn(
        "trainer",
        Command::new(ctx.fixtures.join("trainer"))
            .args(["--steps", "0", "--step-ms", "20", "--busy-pct", "10"])
            .env("PROFILING_MODE", "dynamic"),
    )?;
    tr.wait_prefix(Duration::from_secs(30), "ready")?;
    let mut arms = [MsprofArm::default(), MsprofArm::default()];
    for chunk in 0..4 {
        for (rt, arm) in arms.iter_mut().enumerate() {
            let out = dir.join(format!("out-{chunk}-{rt}"));
            let mut cmd = ctx.dynprof_cmd();
            cmd.args([
                "attach",
                "--pid",
                &tr.pid().to_string(),
                "--marker",
                "exe:optimizer_step",
                "--json",
            ])
            .args([
                "--start-step",
                "3",
                "--active",
                "1",
                "--repeat",
                &(windows / 4 - 1).to_string(),
                "--gap",
                "10",
            ])
            .args(["--collect", "cpu", "--collector", "msprof", "--msprof"])
            .arg(bin.join("msprof"))
            .arg("--msprof-output")
            .arg(dir.join("msprof_out"))
            .arg("--output")
            .arg(&out);
            if rt == 1 {
                cmd.arg("--realtime-boundaries");
            }
            let mut dp = Proc::spawn("dynprof attach --collector msprof", &mut cmd)?;
            let st = dp.wait_exit(Duration::from_secs(600))?;
            if !st.success() {
                let tail: Vec<String> = dp
                    .seen
                    .iter()
                    .rev()
                    .take(5)
                    .map(|l| l.text.clone())
                    .collect();
                let _ = tr.stop(Duration::from_secs(10));
                bail!("dynprof exited with {st}: {}", tail.join(" | "));
            }
            arm.read(&out)?;
        }
    }
    let _ = tr.stop(Duration::from_secs(10));
    let [plain, rt] = &arms;
    if plain.lat.is_empty() || rt.lat.is_empty() {
        bail!(
            "no window recorded a start latency ({} and {} windows without)",
            plain.missing,
            rt.missing
        );
    }
    let p = |v: &[f64], q: f64| stats::percentile(v, q).unwrap_or(f64::NAN);
    let missing = |a: &MsprofArm| {
        if a.missing > 0 {
            format!("; {} windows recorded no latency", a.missing)
        } else {
            String::new()
        }
    };
    s.figures.push(
        Figure::new("boundary_to_msprof_start_p99_ms", "boundary → msprof `start` written, p99", Unit::Ms, Goal::AtMost(5.0), "≤ 5 ms")
            .value(p(&plain.lat, 99.0))
            .note(format!(
                "{} windows against the stand-in msprof on a pty (fixture trainer, 20 ms steps); p50 {:.3} ms, max {:.3} ms. \
                 Split: boundary → dynprof's hook called p99 {:.3} ms (the event loop getting a CPU), hook → `start` written p99 {:.3} ms{}",
                plain.lat.len(),
                p(&plain.lat, 50.0),
                p(&plain.lat, 100.0),
                p(&plain.loop_share, 99.0),
                p(&plain.write_share, 99.0),
                missing(plain)
            )),
    );
    s.figures.push(
        Figure::new(
            "boundary_to_msprof_start_realtime_p99_ms",
            "boundary → msprof `start` written, p99, with --realtime-boundaries",
            Unit::Ms,
            Goal::Info,
            "",
        )
        .value(p(&rt.lat, 99.0))
        .note(format!(
            "{} windows, in chunks interleaved with the figure above; p50 {:.3} ms, max {:.3} ms; boundary → hook called \
             p99 {:.3} ms, hook → `start` written p99 {:.3} ms{}",
            rt.lat.len(),
            p(&rt.lat, 50.0),
            p(&rt.lat, 100.0),
            p(&rt.loop_share, 99.0),
            p(&rt.write_share, 99.0),
            missing(rt)
        )),
    );
    raw.push("msprof_start_latency_ms", Json::nums(&plain.lat));
    raw.push("msprof_boundary_to_hook_ms", Json::nums(&plain.loop_share));
    raw.push("msprof_hook_to_written_ms", Json::nums(&plain.write_share));
    raw.push("msprof_start_latency_realtime_ms", Json::nums(&rt.lat));
    raw.push(
        "msprof_boundary_to_hook_realtime_ms",
        Json::nums(&rt.loop_share),
    );
    Ok(())
}

/// One arm of [`msprof`]: what its windows' meta.json recorded.
#[derive(Default)]
struct MsprofArm {
    lat: Vec<f64>,
    loop_share: Vec<f64>,
    write_share: Vec<f64>,
    missing: usize,
}

impl MsprofArm {
    fn read(&mut self, out: &std::path::Path) -> Result<()> {
        for e in std::fs::read_dir(out)?.flatten() {
            let Some(m) = std::fs::read_to_string(e.path().join("meta.json"))
                .ok()
                .and_then(|t| json::parse(&t))
            else {
                continue;
            };
            let h = m.get("hooks").and_then(|h| h.get("msprof"));
            match h.and_then(|h| h.u64("start_latency_ns")) {
                Some(ns) => self.lat.push(ns as f64 / 1e6),
                None => self.missing += 1,
            }
            if let Some(h) = h
                && let (Some(b), Some(c), Some(w)) = (
                    h.u64("boundary_ts_ns"),
                    h.u64("hook_called_ns"),
                    h.u64("start_written_ns"),
                )
            {
                self.loop_share.push(c.saturating_sub(b) as f64 / 1e6);
                self.write_share.push(w.saturating_sub(c) as f64 / 1e6);
            }
        }
        Ok(())
    }
}
