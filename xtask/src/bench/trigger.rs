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

use anyhow::Result;

use super::{
    Ctx, Section,
    fig::{Figure, Goal, Unit},
    json::Json,
};

pub fn run(ctx: &Ctx) -> Result<Section> {
    let mut s = Section::new("");
    s.figures.push(
        Figure::new(
            "wrong_start_windows",
            "windows starting at the wrong step, of 100",
            Unit::Count,
            Goal::AtMost(0.0),
            "0",
        )
        .missing("this dynprof has no windows yet (`attach --start-step`)"),
    );
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
    let mut raw = Json::obj(vec![]);
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
