//! One analysis as text.

use comfy_table::{Cell, CellAlignment, Table, presets::UTF8_FULL_CONDENSED};

use super::*;
use crate::output::tables::nearest_rank;

pub(super) fn ms(ns: u64) -> String {
    format!("{:.3} ms", ns as f64 / 1e6)
}

pub(super) fn table() -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t
}

pub(super) fn right(s: impl ToString) -> Cell {
    Cell::new(s.to_string()).set_alignment(CellAlignment::Right)
}

/// The human report for one directory.
pub fn render_one(a: &Analysis) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let status = match a.complete {
        Some(true) => "complete".to_string(),
        Some(false) => format!(
            "INCOMPLETE ({})",
            a.incomplete_reason.as_deref().unwrap_or("no reason given")
        ),
        None => "completeness unknown (no meta.json)".to_string(),
    };
    let _ = writeln!(o, "PROF dir: {}  [{status}]", a.dir.display());
    if !a.process_name.is_empty() || a.host_pid != 0 {
        let _ = writeln!(o, "target:   {} (pid {})", a.process_name, a.host_pid);
    }
    if let Some(t) = &a.target
        && let Ok(t) = serde_json::to_string(t)
    {
        let _ = writeln!(o, "meta:     {t}");
    }
    for w in &a.warnings {
        let _ = writeln!(o, "warning:  {w}");
    }
    let st = &a.step_time;
    let _ = writeln!(o, "\nSteps: {}", st.count);
    if st.count > 0 {
        let mut t = table();
        t.set_header(vec![
            "mean",
            "p50",
            "p99",
            "min",
            "max",
            "device wait",
            "host busy",
        ]);
        t.add_row(vec![
            right(ms(st.mean_ns)),
            right(ms(st.p50_ns)),
            right(ms(st.p99_ns)),
            right(ms(st.min_ns)),
            right(ms(st.max_ns)),
            right(format!("{}%", pct(a.device_wait_share))),
            right(format!("{}%", pct(1.0 - a.device_wait_share))),
        ]);
        let _ = writeln!(o, "{t}");
        let _ = writeln!(o, "\nPer step:");
        let _ = writeln!(o, "{}", step_table(&a.steps));
    }
    if !a.top_apis.is_empty() {
        let _ = writeln!(o, "\nTop APIs by time:");
        let mut t = table();
        t.set_header(vec![
            "api",
            "calls",
            "total",
            "mean",
            "p50",
            "p99",
            "max",
            "% of steps",
        ]);
        for s in a.top_apis.iter().take(TOP) {
            t.add_row(vec![
                Cell::new(&s.api),
                right(s.calls),
                right(ms(s.total_ns)),
                right(ms(s.mean_ns)),
                right(ms(s.p50_ns)),
                right(ms(s.p99_ns)),
                right(ms(s.max_ns)),
                right(format!(
                    "{:.1}%",
                    100.0 * ratio(s.total_ns, a.step_time.total_ns)
                )),
            ]);
        }
        let _ = writeln!(o, "{t}");
    }
    if a.cpu_samples > 0 {
        let _ = writeln!(o, "\nTop CPU frames ({} samples):", a.cpu_samples);
        let mut t = table();
        t.set_header(vec!["frame", "self", "self %", "inclusive", "incl %"]);
        for f in a.top_frames_self.iter().take(TOP) {
            t.add_row(vec![
                Cell::new(&f.frame),
                right(f.self_samples),
                right(format!(
                    "{:.1}%",
                    100.0 * ratio(f.self_samples, a.cpu_samples)
                )),
                right(f.inclusive_samples),
                right(format!(
                    "{:.1}%",
                    100.0 * ratio(f.inclusive_samples, a.cpu_samples)
                )),
            ]);
        }
        let _ = writeln!(o, "{t}");
    }
    if !a.top_python.is_empty() {
        let _ = writeln!(o, "\nTop Python functions ({} samples):", a.cpu_samples);
        let mut t = table();
        t.set_header(vec!["function", "self", "self %", "inclusive", "incl %"]);
        for f in &a.top_python {
            let share = |n: u64| format!("{:.1}%", 100.0 * ratio(n, a.cpu_samples));
            t.add_row(vec![
                Cell::new(&f.frame),
                right(f.self_samples),
                right(share(f.self_samples)),
                right(f.inclusive_samples),
                right(share(f.inclusive_samples)),
            ]);
        }
        let _ = writeln!(o, "{t}");
    }
    let _ = writeln!(o, "\nverdict: {}", a.verdict.text);
    o
}

pub(super) fn step_table(steps: &[StepLine]) -> String {
    let mut t = table();
    t.set_header(vec![
        "step",
        "duration",
        "device wait",
        "wait %",
        "host busy",
        "api calls",
    ]);
    let row = |s: &StepLine| {
        vec![
            right(s.step),
            right(ms(s.duration_ns)),
            right(ms(s.device_wait_ns)),
            right(format!("{}%", pct(s.device_wait_share()))),
            right(ms(s.host_busy_ns)),
            right(s.api_calls),
        ]
    };
    if steps.len() <= MAX_STEP_ROWS {
        for s in steps {
            t.add_row(row(s));
        }
        return t.to_string();
    }
    // Many steps: the distribution of the share, then the slowest steps,
    // which are the ones worth opening in the trace.
    let mut shares: Vec<u64> = steps
        .iter()
        .map(|s| (s.device_wait_share() * 10_000.0).round() as u64)
        .collect();
    shares.sort_unstable();
    let p = |q: f64| format!("{:.1}%", nearest_rank(&shares, q) as f64 / 100.0);
    let mut slow: Vec<&StepLine> = steps.iter().collect();
    slow.sort_by(|a, b| b.duration_ns.cmp(&a.duration_ns).then(a.step.cmp(&b.step)));
    for s in slow.into_iter().take(5) {
        t.add_row(row(s));
    }
    format!(
        "{} steps; device-wait share min {} / p50 {} / p99 {} / max {}\nslowest 5:\n{t}",
        steps.len(),
        p(0.0),
        p(50.0),
        p(99.0),
        p(100.0)
    )
}
