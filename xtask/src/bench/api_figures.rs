//! Section 2's figures and raw samples, from what [`super::api`] measured.

use super::{
    Section,
    api::{FLOOR_SPEC, Measured},
    fig::{Figure, Goal, Unit},
    json::Json,
    stats,
};

pub(super) fn section(m: &Measured) -> Section {
    let mut s = Section::new("");
    s.figures = overhead(m);
    s.figures.extend(capacity(m));
    s.raw = raw(m);
    s
}

/// Per call: the api collector's arms and the kernel's floor, measured on
/// the trainer's CPU and computed from the programs' own run time.
fn overhead(m: &Measured) -> Vec<Figure> {
    let (calls_per_step, bare_s) = (m.calls_per_step, m.bare_s);
    let Measured { cpu, prog, .. } = m;
    let mut figures = Vec::new();
    let per_call = |c: f64, bare: f64| (c - bare) / calls_per_step as f64;
    let api_ns: Vec<f64> = cpu.iter().map(|c| per_call(c[2], c[0])).collect();
    let floor_ns: Vec<f64> = cpu.iter().map(|c| per_call(c[1], c[0])).collect();
    let hash_ns: Vec<f64> = cpu.iter().map(|c| per_call(c[3], c[0])).collect();
    figures.push(
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
    figures.push(
        Figure::new(
            "api_ns_per_call",
            "API collector, added per call",
            Unit::Ns,
            Goal::Info,
            "",
        )
        .samples(api_ns.clone()),
    );
    figures.push(
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
    figures.push(fig);
    let hash = computed(1);
    if !hash.is_empty() {
        figures.push(
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
            figures.push(Figure::new(key, name, Unit::Ns, Goal::Info, "").samples(v));
        }
    }
    let v: Vec<f64> = prog.iter().filter_map(|(pf, _)| *pf).collect();
    if !v.is_empty() {
        figures.push(
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
    figures.push(
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
    figures.push(
        Figure::new(
            "api_slot_minus_hash_ns_per_call",
            "API collector per call, stack slots − hash",
            Unit::Ns,
            Goal::Info,
            "",
        )
        .samples(api_ns.iter().zip(&hash_ns).map(|(a, h)| a - h).collect()),
    );
    figures
}

/// Steps/s with a window open, events/s without drops (one and two
/// calling threads), the consumer's CPU per event and the ring sweep.
fn capacity(m: &Measured) -> Vec<Figure> {
    let calls_per_step = m.calls_per_step;
    let Measured {
        bare,
        wins,
        rings,
        sweep,
        wins2,
        ..
    } = m;
    let mut figures = Vec::new();
    let ok: Vec<f64> = wins
        .iter()
        .filter(|w| w.drops == 0)
        .map(|w| w.events_per_s())
        .collect();
    let ratio: Vec<f64> = wins
        .iter()
        .zip(bare)
        .map(|(w, b)| w.steps_per_s / b)
        .collect();
    let bare_calls = stats::median(bare).unwrap_or(0.0) * (calls_per_step + 2) as f64;
    figures.push(
        Figure::new("api_on_over_off", "steps/s, api collector on ÷ off", Unit::Ratio, Goal::Info, "")
            .samples(ratio)
            .note(format!(
                "acl_trainer --calls-per-step {calls_per_step}: {:.2}M API calls/s bare. With the collector every call takes an entry \
                 uprobe and a return uprobe (two traps, ~{:.0} µs per call here), so the target itself cannot call faster than the rate below",
                bare_calls / 1e6,
                1e6 / stats::median(&wins.iter().map(|w| w.events_per_s()).collect::<Vec<_>>()).unwrap_or(1.0)
            )),
    );
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
    figures.push(f);
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
    figures.push(f2);
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
        figures.push(
            Figure::new(
                "api_drain_ns_per_event",
                "dynprof CPU per API event while the window runs",
                Unit::Ns,
                Goal::Info,
                "",
            )
            .samples(drain_ns.clone()),
        );
        figures.push(
            Figure::new(
                "api_session_ns_per_event",
                "dynprof CPU per API event, whole session (incl. writing the window)",
                Unit::Ns,
                Goal::Info,
                "",
            )
            .samples(total_ns.clone()),
        );
        figures.push(
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
    figures.push(f);
    figures
}

fn raw(m: &Measured) -> Json {
    let Measured {
        calls_per_step,
        win_steps,
        bare,
        cpu,
        wins,
        sweep,
        ..
    } = m;
    Json::obj(vec![
        ("calls_per_step", Json::int(*calls_per_step)),
        ("window_steps", Json::int(*win_steps)),
        ("off_steps_per_s", Json::nums(bare)),
        (
            "cpu_ns_per_step_bare_floor_api_hash",
            Json::Arr(cpu.iter().map(|c| Json::nums(c)).collect()),
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
    ])
}
