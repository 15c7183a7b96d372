//! 3. Trigger precision and latency.
//!
//! - 100 windows requested with an explicit start step; count those whose
//!   first recorded step differs from the request (goal 0).
//! - boundary hit → user space (the JSON step line's `recv_ns` − `ts_ns`)
//!   is measured in the PyTorch section while attached idle.
//! - boundary hit → msprof `start` written, against the stand-in msprof.
//! - For comparison, computed: the expected start delay of a poll-based
//!   trigger (torch_npu dynamic_profile polls every 2 s, Kineto/dynolog
//!   every 5 s) at the measured PyTorch step rate. A request lands at a
//!   uniformly random phase of the poll: the expected wait is P/2, then the
//!   capture starts at the next step boundary (another T/2 on average).

use std::{collections::HashMap, process::Command, time::Duration};

use anyhow::{Context as _, Result, bail};

use super::{
    Ctx, Section,
    fig::{Figure, Goal, Unit},
    json::{self, Json},
    procs::{Proc, Stream},
    say, stats,
};

pub fn run(ctx: &Ctx) -> Result<Section> {
    let mut s = Section::new("");
    let mut raw = Json::obj(vec![]);
    if ctx.has_flag("--interactive") {
        if let Err(e) = windows(ctx, &mut s, &mut raw) {
            say(format!("trigger windows: {e:#}"));
            s.figures.push(
                Figure::new(
                    "wrong_start_windows",
                    "windows starting at the wrong step, of 100",
                    Unit::Count,
                    Goal::AtMost(0.0),
                    "0",
                )
                .missing(format!("could not run: {e:#}")),
            );
        }
    } else {
        s.figures.push(
            Figure::new(
                "wrong_start_windows",
                "windows starting at the wrong step, of 100",
                Unit::Count,
                Goal::AtMost(0.0),
                "0",
            )
            .missing("this dynprof has no windows yet (`attach --interactive`)"),
        );
    }
    s.figures.push(
        Figure::new(
            "boundary_to_msprof_start_p99_ms",
            "boundary → msprof `start` written, p99",
            Unit::Ms,
            Goal::AtMost(5.0),
            "≤ 5 ms",
        )
        .missing("this dynprof has no msprof collector yet"),
    );
    poll_figures(ctx, &mut s, &mut raw);
    s.raw = raw;
    Ok(s)
}

/// Expected start delay of 2 s and 5 s polls at the measured step rate.
fn poll_figures(ctx: &Ctx, s: &mut Section, raw: &mut Json) {
    let sps = ctx.torch_sps.get();
    if sps <= 0.0 {
        s.figures.push(
            Figure::new(
                "poll_delay",
                "poll-trigger start delay",
                Unit::Ms,
                Goal::Info,
                "",
            )
            .missing("needs the PyTorch step rate (section 1)"),
        );
        return;
    }
    let t_ms = 1e3 / sps;
    for (key, name, p_ms) in [
        ("poll_2s", "2 s poll (torch_npu dynamic_profile)", 2000.0),
        ("poll_5s", "5 s poll (Kineto/dynolog)", 5000.0),
    ] {
        let ms = p_ms / 2.0 + t_ms / 2.0;
        let steps = ms / t_ms;
        s.figures.push(
            Figure::new(&format!("{key}_expected_delay_steps"), &format!("{name}: expected start delay"), Unit::Steps, Goal::Info, "")
                .value(steps)
                .computed()
                .note(format!(
                    "{ms:.0} ms = P/2 + T/2 at the measured {sps:.0} steps/s (T = {t_ms:.2} ms); worst case P + T = {:.0} steps; dynprof opens at the boundary itself",
                    (p_ms + t_ms) / t_ms
                )),
        );
        raw.push(
            key,
            Json::obj(vec![
                ("period_ms", Json::num(p_ms)),
                ("step_ms", Json::num(t_ms)),
                ("expected_delay_ms", Json::num(ms)),
                ("expected_delay_steps", Json::num(steps)),
            ]),
        );
    }
}

/// `step <i> <before_ns> <after_ns>` lines of a fixture log.
fn read_log(path: &std::path::Path) -> Result<HashMap<u64, (u64, u64)>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut m = HashMap::new();
    for l in text.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() == 4 && f[0] == "step" {
            if let (Ok(i), Ok(a), Ok(b)) = (f[1].parse(), f[2].parse(), f[3].parse()) {
                m.insert(i, (a, b));
            }
        }
    }
    Ok(m)
}

/// 100 windows, each requested through the console (`capture 1 at S`, S a
/// few steps ahead of the last step seen) on real PyTorch
/// (tests/fixtures/torch_train.py, which logs CLOCK_MONOTONIC around each
/// optimizer.step()). A window starts at the wrong step when its first
/// recorded step is not S, or when the boundary ts_ns dynprof recorded for
/// it does not fall inside the target's own logged interval of the step
/// that dynprof's S corresponds to (offset fixed from the first window).
fn windows(ctx: &Ctx, s: &mut Section, raw: &mut Json) -> Result<()> {
    let n_windows = 100;
    let ahead = 5;
    let log = ctx.work.join("trigger-torch.log");
    let out = ctx.work.join("trigger-windows");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    let script = crate::util::workspace_root().join("tests/fixtures/torch_train.py");
    let mut py = Proc::spawn(
        "torch_train.py",
        Command::new(&ctx.python)
            .arg(&script)
            .arg("--log")
            .arg(&log),
    )?;
    py.wait_prefix(Duration::from_secs(180), "ready")?;
    let mut cmd = ctx.dynprof_cmd();
    cmd.env("DYNPROF_RECV_NS", "1")
        .args([
            "attach",
            "--pid",
            &py.pid().to_string(),
            "--interactive",
            "--json",
            "--idle-timeout",
            "0",
            "--output",
        ])
        .arg(&out);
    if ctx.has_flag("--collect") {
        cmd.args(["--collect", "cpu"]);
    }
    let mut dp = Proc::spawn("dynprof attach --interactive", &mut cmd)?;
    dp.wait_event(Duration::from_secs(60), "attached")?;
    dp.wait_event(Duration::from_secs(30), "step")?;
    let mut requests: Vec<(u64, Json)> = Vec::new();
    let t = Duration::from_secs(30);
    for k in 0..n_windows {
        dp.pump();
        let last = dp.seen.iter().rev().find_map(|l| {
            l.json()
                .filter(|j| j.str("event") == Some("step"))
                .and_then(|j| j.u64("step"))
        });
        let Some(last) = last else {
            bail!("no step events seen")
        };
        let want = last + ahead;
        dp.send(&format!("capture 1 at {want}"))?;
        let (_, w) = dp
            .wait_event(t, "window")
            .with_context(|| format!("window {} (capture 1 at {want})", k + 1))?;
        requests.push((want, w));
    }
    dp.send("quit")?;
    let _ = dp.wait_exit(Duration::from_secs(30));
    let _ = py.stop(Duration::from_secs(10));

    // Check each window against the target's own log.
    let tlog = read_log(&log)?;
    let mut offset: Option<i64> = None;
    let mut wrong = 0u64;
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    for (want, w) in &requests {
        let win = w.get("window").cloned().unwrap_or(Json::Null);
        let first = win.u64("first_recorded");
        let dir = win.str("dir").unwrap_or_default().to_string();
        let meta = std::fs::read_to_string(std::path::Path::new(&dir).join("meta.json"))
            .ok()
            .and_then(|t| json::parse(&t));
        let ts = meta.as_ref().and_then(|m| match m.get("steps") {
            Some(Json::Arr(a)) => a.first().and_then(|x| x.u64("start_ts_ns")),
            _ => None,
        });
        // Which target step holds this boundary?
        let target_step = ts.and_then(|ts| {
            tlog.iter()
                .find(|(_, (a, b))| *a <= ts && ts <= *b)
                .map(|(i, _)| *i)
        });
        if offset.is_none() {
            if let Some(ti) = target_step {
                offset = Some(ti as i64 - *want as i64);
            }
        }
        let expect_target = offset.map(|o| (*want as i64 + o) as u64);
        let ok = first == Some(*want) && target_step.is_some() && target_step == expect_target;
        if !ok {
            wrong += 1;
            if notes.len() < 3 {
                notes.push(format!("asked {want}: first recorded {first:?}, boundary in target step {target_step:?} (expected {expect_target:?})"));
            }
        }
        rows.push(Json::obj(vec![
            ("requested", Json::int(*want)),
            ("first_recorded", first.map(Json::int).unwrap_or(Json::Null)),
            ("start_ts_ns", ts.map(Json::int).unwrap_or(Json::Null)),
            (
                "target_step",
                target_step.map(Json::int).unwrap_or(Json::Null),
            ),
            ("ok", Json::Bool(ok)),
        ]));
    }
    // Boundary → user space for these steps, too.
    let lat: Vec<f64> = dp
        .seen
        .iter()
        .filter(|l| l.stream == Stream::Out)
        .filter_map(|l| l.json())
        .filter(|j| j.str("event") == Some("step"))
        .filter_map(|j| Some(j.u64("recv_ns")?.saturating_sub(j.u64("ts_ns")?) as f64 / 1e6))
        .collect();
    let mut f = Figure::new(
        "wrong_start_windows",
        &format!("windows starting at the wrong step, of {}", requests.len()),
        Unit::Count,
        Goal::AtMost(0.0),
        "0",
    )
    .value(wrong as f64);
    let mut note = format!(
        "real PyTorch (torch_train.py); each `capture 1 at S` with S = last step seen + {ahead}; checked against meta.json and the target's own CLOCK_MONOTONIC log"
    );
    if !notes.is_empty() {
        note.push_str(&format!("; misses: {}", notes.join("; ")));
    }
    f = f.note(note);
    s.figures.push(f);
    if !lat.is_empty() {
        s.figures.push(
            Figure::new("windows_boundary_to_user_p99_ms", "boundary → user space p99 (during the windows)", Unit::Ms, Goal::AtMost(1.0), "≤ 1 ms")
                .value(stats::percentile(&lat, 99.0).unwrap_or(f64::NAN))
                .note(format!(
                    "{} step events with collector cpu armed around windows; p50 {:.3} ms, max {:.3} ms",
                    lat.len(),
                    stats::percentile(&lat, 50.0).unwrap_or(f64::NAN),
                    stats::percentile(&lat, 100.0).unwrap_or(f64::NAN)
                )),
        );
    }
    raw.push("windows", Json::Arr(rows));
    raw.push("windows_boundary_to_user_ms", Json::nums(&lat));
    raw.push(
        "windows_offset_dynprof_to_target_step",
        offset.map(|o| Json::num(o as f64)).unwrap_or(Json::Null),
    );
    Ok(())
}
