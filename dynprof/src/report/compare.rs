//! Several analyses side by side, the first being the baseline.

use comfy_table::Cell;

use super::{
    render::{right, table},
    *,
};

/// One metric across directories; `None` where a directory lacks it.
pub struct CompareRow {
    pub metric: String,
    pub values: Vec<Option<f64>>,
    /// How to print a value.
    pub unit: Unit,
}

#[derive(Clone, Copy)]
pub enum Unit {
    Count,
    Ms,
    Percent,
}

pub(super) fn comparison_rows(an: &[Analysis]) -> Vec<CompareRow> {
    let per = |f: &dyn Fn(&Analysis) -> Option<f64>| an.iter().map(f).collect::<Vec<_>>();
    let has = |a: &Analysis| a.step_time.count > 0;
    let mut rows = vec![
        CompareRow {
            metric: "steps".into(),
            values: per(&|a| Some(a.step_time.count as f64)),
            unit: Unit::Count,
        },
        CompareRow {
            metric: "step mean".into(),
            values: per(&|a| has(a).then_some(a.step_time.mean_ns as f64)),
            unit: Unit::Ms,
        },
        CompareRow {
            metric: "step p50".into(),
            values: per(&|a| has(a).then_some(a.step_time.p50_ns as f64)),
            unit: Unit::Ms,
        },
        CompareRow {
            metric: "step p99".into(),
            values: per(&|a| has(a).then_some(a.step_time.p99_ns as f64)),
            unit: Unit::Ms,
        },
        CompareRow {
            metric: "step max".into(),
            values: per(&|a| has(a).then_some(a.step_time.max_ns as f64)),
            unit: Unit::Ms,
        },
        CompareRow {
            metric: "device wait / step".into(),
            values: per(&|a| has(a).then(|| a.device_wait_ns as f64 / a.step_time.count as f64)),
            unit: Unit::Ms,
        },
        CompareRow {
            metric: "host busy / step".into(),
            values: per(&|a| has(a).then(|| a.host_busy_ns as f64 / a.step_time.count as f64)),
            unit: Unit::Ms,
        },
        CompareRow {
            metric: "device-wait share".into(),
            values: per(&|a| has(a).then_some(a.device_wait_share)),
            unit: Unit::Percent,
        },
        CompareRow {
            metric: "api calls / step".into(),
            values: per(&|a| has(a).then(|| a.api_calls as f64 / a.step_time.count as f64)),
            unit: Unit::Count,
        },
    ];
    // Union of each directory's top APIs, as time per step so windows of
    // different lengths compare.
    let mut apis: Vec<String> = Vec::new();
    for a in an {
        for s in a.top_apis.iter().take(5) {
            if !apis.contains(&s.api) {
                apis.push(s.api.clone());
            }
        }
    }
    for api in apis {
        rows.push(CompareRow {
            metric: format!("{api} / step"),
            values: per(&|a| {
                has(a).then(|| {
                    a.top_apis
                        .iter()
                        .find(|s| s.api == api)
                        .map(|s| s.total_ns)
                        .unwrap_or(0) as f64
                        / a.step_time.count as f64
                })
            }),
            unit: Unit::Ms,
        });
    }
    let mut frames: Vec<String> = Vec::new();
    for a in an {
        for f in a.top_frames_self.iter().take(5) {
            if !frames.contains(&f.frame) {
                frames.push(f.frame.clone());
            }
        }
    }
    for fr in frames {
        rows.push(CompareRow {
            metric: format!("cpu self: {fr}"),
            values: per(&|a| {
                (a.cpu_samples > 0)
                    .then(|| ratio(a.self_samples.get(&fr).copied().unwrap_or(0), a.cpu_samples))
            }),
            unit: Unit::Percent,
        });
    }
    rows
}

fn fmt_val(v: Option<f64>, unit: Unit) -> String {
    match (v, unit) {
        (None, _) => "-".into(),
        (Some(v), Unit::Count) if v.fract() == 0.0 => format!("{v:.0}"),
        (Some(v), Unit::Count) => format!("{v:.1}"),
        (Some(v), Unit::Ms) => format!("{:.3} ms", v / 1e6),
        (Some(v), Unit::Percent) => format!("{:.1}%", v * 100.0),
    }
}

/// Side-by-side report: one column per directory, then each later
/// directory's ratio to the first.
pub fn render_compare(an: &[Analysis]) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    for (i, a) in an.iter().enumerate() {
        let status = match a.complete {
            Some(true) => "complete".to_string(),
            Some(false) => format!(
                "INCOMPLETE ({})",
                a.incomplete_reason.as_deref().unwrap_or("no reason given")
            ),
            None => "completeness unknown".to_string(),
        };
        let _ = writeln!(o, "[{}] {}  [{status}]", i + 1, a.dir.display());
        for w in &a.warnings {
            let _ = writeln!(o, "    warning: {w}");
        }
    }
    let mut t = table();
    let mut header = vec!["metric".to_string()];
    header.extend((1..=an.len()).map(|i| format!("[{i}]")));
    header.extend((2..=an.len()).map(|i| format!("[{i}]/[1]")));
    t.set_header(header);
    for r in comparison_rows(an) {
        let mut row = vec![Cell::new(&r.metric)];
        row.extend(r.values.iter().map(|v| right(fmt_val(*v, r.unit))));
        let base = r.values[0];
        row.extend(r.values.iter().skip(1).map(|v| {
            right(match (v, base) {
                (Some(v), Some(b)) if b != 0.0 => format!("{:.2}x", v / b),
                _ => "-".into(),
            })
        }));
        t.add_row(row);
    }
    let _ = writeln!(o, "\n{t}\n");
    for (i, a) in an.iter().enumerate() {
        let _ = writeln!(o, "verdict [{}]: {}", i + 1, a.verdict.text);
    }
    o
}
