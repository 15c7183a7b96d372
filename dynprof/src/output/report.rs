//! `dynprof report PROF_DIR... [--json]`: reads PROF directories back and
//! answers "host-bound or device-bound, and where?"; with several
//! directories, compares them side by side (before/after).
//!
//! It reads only files (steps.csv, api_summary.csv, cpu.folded,
//! summary.json, meta.json), so a directory copied off the training node
//! reports the same as on it.
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use comfy_table::{Cell, CellAlignment, Table, presets::UTF8_FULL_CONDENSED};
use serde::Serialize;
use serde_json::Value;

use super::Collectors;
use super::flame::{CPU_FOLDED, parse_folded};
use super::model::Drops;
use super::tables::{
    API_SUMMARY_FILE, ApiStat, DurationStats, FrameCount, STEPS_FILE, SUMMARY_FILE, Summary,
    nearest_rank, top_frames,
};

pub const META_FILE: &str = "meta.json";
/// Device-wait share at or above which a window is called device-bound.
pub const DEVICE_BOUND_THRESHOLD: f64 = 0.5;
/// Above this many steps the per-step table is summarized.
const MAX_STEP_ROWS: usize = 20;
const TOP: usize = 10;

#[derive(clap::Args, Debug)]
pub struct ReportArgs {
    /// PROF directories written by dynprof; several are compared side by
    /// side, the first being the baseline.
    #[arg(required = true, value_name = "PROF_DIR")]
    pub dirs: Vec<PathBuf>,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// One step as `report` sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StepLine {
    pub step: u64,
    pub duration_ns: u64,
    pub device_wait_ns: u64,
    pub host_busy_ns: u64,
    pub api_calls: u64,
}

impl StepLine {
    pub fn device_wait_share(&self) -> f64 {
        ratio(self.device_wait_ns, self.duration_ns)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Bound {
    HostBound,
    DeviceBound,
    /// Not enough data to say (no steps, or device waits not measured).
    Unknown,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Verdict {
    pub bound: Bound,
    /// Rounded percentage quoted in `text`.
    pub percent: u32,
    pub top_frame: Option<String>,
    pub text: String,
}

/// Everything `report` derives from one PROF directory.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Analysis {
    pub dir: PathBuf,
    /// From meta.json; `None` when it is absent (the window code writes it
    /// last, so its absence alone suggests an interrupted window).
    pub complete: Option<bool>,
    pub incomplete_reason: Option<String>,
    /// meta.json's target description, verbatim, if any.
    pub target: Option<Value>,
    pub process_name: String,
    pub host_pid: u32,
    pub collectors: Option<Collectors>,
    pub steps: Vec<StepLine>,
    pub step_time: DurationStats,
    pub device_wait_ns: u64,
    pub host_busy_ns: u64,
    pub device_wait_share: f64,
    /// Device-wait APIs by total time; the first one names the wait.
    pub device_wait_apis: Vec<String>,
    pub api_calls: u64,
    pub top_apis: Vec<ApiStat>,
    pub cpu_samples: u64,
    pub top_frames_self: Vec<FrameCount>,
    pub top_frames_inclusive: Vec<FrameCount>,
    /// Python functions of the cpu stacks (`output::python_top`).
    pub top_python: Vec<FrameCount>,
    /// Self samples of every leaf frame, so a comparison can show a frame
    /// that is in one directory's top list but not another's.
    #[serde(skip)]
    pub self_samples: std::collections::HashMap<String, u64>,
    pub drops: Drops,
    pub verdict: Verdict,
    /// Things the reader must know: missing files, drops, incompleteness.
    pub warnings: Vec<String>,
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

fn pct(x: f64) -> u32 {
    (x * 100.0).round() as u32
}

fn read_opt(path: &Path) -> Result<Option<String>> {
    match fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

fn parse_steps(path: &Path, text: &str) -> Result<Vec<StepLine>> {
    let mut r = csv::Reader::from_reader(text.as_bytes());
    let headers = r
        .headers()
        .with_context(|| format!("reading header of {}", path.display()))?
        .clone();
    let col = |name: &str| -> Result<usize> {
        headers
            .iter()
            .position(|h| h == name)
            .with_context(|| format!("{}: no column {name:?}", path.display()))
    };
    let (c_step, c_dur, c_wait, c_busy, c_calls) = (
        col("step")?,
        col("duration_ns")?,
        col("device_wait_ns")?,
        col("host_busy_ns")?,
        col("api_calls")?,
    );
    let mut out = Vec::new();
    for (i, rec) in r.records().enumerate() {
        let rec = rec.with_context(|| format!("{}: row {}", path.display(), i + 1))?;
        let get = |c: usize| -> Result<u64> {
            rec.get(c).unwrap_or("").parse().with_context(|| {
                format!(
                    "{}: row {}, column {}",
                    path.display(),
                    i + 1,
                    headers.get(c).unwrap_or("?")
                )
            })
        };
        out.push(StepLine {
            step: get(c_step)?,
            duration_ns: get(c_dur)?,
            device_wait_ns: get(c_wait)?,
            host_busy_ns: get(c_busy)?,
            api_calls: get(c_calls)?,
        });
    }
    Ok(out)
}

fn parse_api_summary(path: &Path, text: &str) -> Result<Vec<ApiStat>> {
    let mut r = csv::Reader::from_reader(text.as_bytes());
    let mut out = Vec::new();
    for (i, rec) in r.records().enumerate() {
        let rec = rec.with_context(|| format!("{}: row {}", path.display(), i + 1))?;
        let n = |c: usize| -> Result<u64> {
            rec.get(c)
                .unwrap_or("")
                .parse()
                .with_context(|| format!("{}: row {}, column {}", path.display(), i + 1, c + 1))
        };
        out.push(ApiStat {
            api: rec.get(0).unwrap_or("").to_string(),
            calls: n(1)?,
            total_ns: n(2)?,
            mean_ns: n(3)?,
            p50_ns: n(4)?,
            p99_ns: n(5)?,
            max_ns: n(6)?,
        });
    }
    out.sort_by(|a, b| b.total_ns.cmp(&a.total_ns).then_with(|| a.api.cmp(&b.api)));
    Ok(out)
}

/// Reads and analyzes one PROF directory.
pub fn analyze(dir: &Path) -> Result<Analysis> {
    let md = fs::metadata(dir).with_context(|| format!("{}", dir.display()))?;
    if !md.is_dir() {
        bail!("{} is not a directory", dir.display());
    }
    let steps_text = read_opt(&dir.join(STEPS_FILE))?;
    let summary_text = read_opt(&dir.join(SUMMARY_FILE))?;
    let meta_text = read_opt(&dir.join(META_FILE))?;
    if steps_text.is_none() && summary_text.is_none() {
        bail!(
            "{} is not a dynprof PROF directory: it has neither {STEPS_FILE} nor {SUMMARY_FILE}",
            dir.display()
        );
    }
    let mut warnings = Vec::new();

    let meta: Option<Value> = match meta_text {
        Some(t) => Some(
            serde_json::from_str(&t)
                .with_context(|| format!("parsing {}", dir.join(META_FILE).display()))?,
        ),
        None => None,
    };
    let complete = meta
        .as_ref()
        .and_then(|m| m.get("complete"))
        .and_then(Value::as_bool);
    let incomplete_reason = meta.as_ref().and_then(|m| {
        ["incomplete_reason", "reason", "error"]
            .iter()
            .find_map(|k| m.get(*k).and_then(Value::as_str))
            .map(str::to_string)
    });
    let target = meta.as_ref().and_then(|m| m.get("target")).cloned();
    match (&meta, complete) {
        (None, _) => warnings.push(format!(
            "no {META_FILE}: the window may not have finished; completeness unknown"
        )),
        (Some(_), Some(false)) => warnings.push(format!(
            "INCOMPLETE: {}",
            incomplete_reason
                .as_deref()
                .unwrap_or("meta.json marks this window incomplete (no reason given)")
        )),
        (Some(_), None) => warnings.push(format!("{META_FILE} has no \"complete\" field")),
        _ => {}
    }

    let summary: Option<Summary> = match &summary_text {
        Some(t) => Some(
            serde_json::from_str(t)
                .with_context(|| format!("parsing {}", dir.join(SUMMARY_FILE).display()))?,
        ),
        None => {
            warnings.push(format!(
                "no {SUMMARY_FILE}: drops and collector set unknown"
            ));
            None
        }
    };
    let collectors = summary.as_ref().and_then(|s| s.collectors);

    let steps = match &steps_text {
        Some(t) => parse_steps(&dir.join(STEPS_FILE), t)?,
        None => {
            warnings.push(format!("no {STEPS_FILE}: per-step numbers unavailable"));
            Vec::new()
        }
    };

    let api_path = dir.join(API_SUMMARY_FILE);
    let top_apis = match read_opt(&api_path)? {
        Some(t) => parse_api_summary(&api_path, &t)?,
        None => {
            if collectors.is_none_or(|c| c.api) {
                warnings.push(format!("no {API_SUMMARY_FILE}"));
            }
            Vec::new()
        }
    };
    let api_measured = collectors.map(|c| c.api).unwrap_or(!top_apis.is_empty());

    let folded_path = dir.join(CPU_FOLDED);
    let mut self_samples = std::collections::HashMap::new();
    let mut top_python = Vec::new();
    let (cpu_samples, top_frames_self, top_frames_inclusive) = match read_opt(&folded_path)? {
        Some(t) => {
            let stacks =
                parse_folded(&t).with_context(|| format!("parsing {}", folded_path.display()))?;
            let total = stacks.iter().map(|(_, c)| c).sum();
            for (st, c) in &stacks {
                if let Some(leaf) = st.last() {
                    *self_samples.entry(leaf.clone()).or_insert(0) += c;
                }
            }
            let (s, i) = top_frames(stacks.iter().map(|(s, c)| (s.as_slice(), *c)), TOP);
            top_python =
                super::python_top::top_python(stacks.iter().map(|(s, c)| (s.as_slice(), *c)), TOP);
            (total, s, i)
        }
        None => {
            if collectors.is_none_or(|c| c.cpu) {
                warnings.push(format!("no {CPU_FOLDED}"));
            }
            (0, Vec::new(), Vec::new())
        }
    };

    // Step numbers come from steps.csv when present (it is the per-step
    // truth); summary.json covers a directory without it.
    let (step_time, device_wait_ns, host_busy_ns, api_calls) = if steps_text.is_some() {
        (
            DurationStats::from_values(steps.iter().map(|s| s.duration_ns).collect()),
            steps.iter().map(|s| s.device_wait_ns).sum(),
            steps.iter().map(|s| s.host_busy_ns).sum(),
            steps.iter().map(|s| s.api_calls).sum(),
        )
    } else {
        let s = summary.as_ref().expect("checked above");
        (
            s.step_time.clone(),
            s.device_wait_ns,
            s.host_busy_ns,
            s.api_calls,
        )
    };
    let device_wait_share = ratio(device_wait_ns, step_time.total_ns);
    let device_wait_apis: Vec<String> = summary
        .as_ref()
        .map(|s| s.device_wait_apis.iter().map(|a| a.api.clone()).collect())
        .unwrap_or_default();
    let drops = summary
        .as_ref()
        .map(|s| s.drops.clone())
        .unwrap_or_default();
    let dropped = drops_list(&drops);
    if !dropped.is_empty() {
        warnings.push(format!("events were lost: {}", dropped.join(", ")));
    }
    if let Some(o) = summary
        .as_ref()
        .map(|s| &s.dropped_over_budget)
        .filter(|o| o.total() > 0)
    {
        warnings.push(format!(
            "window too dense for --memory-budget: {} events not kept (api {}, cpu {}, offcpu {})",
            o.total(),
            o.api,
            o.cpu,
            o.offcpu
        ));
    }

    let top_frame = top_frames_self.first().map(|f| f.frame.clone());
    let verdict = verdict(
        step_time.count,
        api_measured,
        device_wait_share,
        device_wait_apis.first().map(String::as_str),
        top_frame,
    );

    Ok(Analysis {
        dir: dir.to_path_buf(),
        complete,
        incomplete_reason,
        target,
        process_name: summary
            .as_ref()
            .map(|s| s.process_name.clone())
            .unwrap_or_default(),
        host_pid: summary.as_ref().map(|s| s.host_pid).unwrap_or(0),
        collectors,
        steps,
        step_time,
        device_wait_ns,
        host_busy_ns,
        device_wait_share,
        device_wait_apis,
        api_calls,
        top_apis,
        cpu_samples,
        top_frames_self,
        top_frames_inclusive,
        top_python,
        self_samples,
        drops,
        verdict,
        warnings,
    })
}

fn drops_list(d: &Drops) -> Vec<String> {
    let Drops {
        step,
        api,
        cpu,
        offcpu,
        cpu_stack,
        offcpu_stack,
        api_nesting,
    } = d;
    [
        ("step", step),
        ("api", api),
        ("cpu", cpu),
        ("offcpu", offcpu),
        ("cpu_stack", cpu_stack),
        ("offcpu_stack", offcpu_stack),
        ("api_nesting", api_nesting),
    ]
    .iter()
    .filter(|(_, n)| **n > 0)
    .map(|(k, n)| format!("{k}={n}"))
    .collect()
}

fn verdict(
    steps: u64,
    api_measured: bool,
    share: f64,
    wait_api: Option<&str>,
    top_frame: Option<String>,
) -> Verdict {
    let frame_txt = format!(
        "top frame: {}",
        top_frame.as_deref().unwrap_or("n/a (no CPU samples)")
    );
    if steps == 0 {
        return Verdict {
            bound: Bound::Unknown,
            percent: 0,
            top_frame,
            text: format!("unknown: no complete steps recorded; {frame_txt}"),
        };
    }
    if !api_measured {
        return Verdict {
            bound: Bound::Unknown,
            percent: 0,
            top_frame,
            text: format!(
                "unknown: the api collector did not run, so device waits were not measured; {frame_txt}"
            ),
        };
    }
    if share >= DEVICE_BOUND_THRESHOLD {
        let p = pct(share);
        let api = wait_api.map(|a| format!(" ({a})")).unwrap_or_default();
        Verdict {
            bound: Bound::DeviceBound,
            percent: p,
            text: format!("device-bound: {p}% of step time in device waits{api}; {frame_txt}"),
            top_frame,
        }
    } else {
        let p = pct(1.0 - share);
        Verdict {
            bound: Bound::HostBound,
            percent: p,
            text: format!("host-bound: {p}% of step time outside device waits; {frame_txt}"),
            top_frame,
        }
    }
}

pub fn run(args: &ReportArgs) -> Result<()> {
    let analyses = args
        .dirs
        .iter()
        .map(|d| analyze(d))
        .collect::<Result<Vec<_>>>()?;
    let out = if args.json {
        let mut s = serde_json::to_string_pretty(&to_json(&analyses))?;
        s.push('\n');
        s
    } else if analyses.len() == 1 {
        render_one(&analyses[0])
    } else {
        render_compare(&analyses)
    };
    print!("{out}");
    Ok(())
}

/// One analysis as is; several as `{"dirs": [...], "comparison": [...]}`.
pub fn to_json(analyses: &[Analysis]) -> Value {
    if let [one] = analyses {
        return serde_json::to_value(one).expect("analysis serializes");
    }
    let rows: Vec<Value> = comparison_rows(analyses)
        .into_iter()
        .map(|r| {
            serde_json::json!({
                "metric": r.metric,
                "values": r.values,
                "ratios_to_first": r.values.iter().map(|v| match (v, r.values[0]) {
                    (Some(v), Some(b)) if b != 0.0 => Some(v / b),
                    _ => None,
                }).collect::<Vec<_>>(),
            })
        })
        .collect();
    serde_json::json!({"dirs": analyses, "comparison": rows})
}

fn ms(ns: u64) -> String {
    format!("{:.3} ms", ns as f64 / 1e6)
}

fn table() -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t
}

fn right(s: impl ToString) -> Cell {
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
    if let Some(t) = &a.target {
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

fn step_table(steps: &[StepLine]) -> String {
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

fn comparison_rows(an: &[Analysis]) -> Vec<CompareRow> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::model::*;
    use crate::output::tests_support::tempdir;
    use crate::output::write_window_files;
    use crate::types::StepIndex;

    /// 4 steps of 10 ms from t=1 s. Per step: two launches (one from a
    /// task-queue thread), one sync of `wait_ns`, and CPU samples split 3:1
    /// between `hot` and `other` frames.
    fn window(wait_ns: u64, hot: &str) -> WindowData {
        let t0 = 1_000_000_000u64;
        let step_ns = 10_000_000u64;
        let mut d = WindowData {
            process_name: "trainer".into(),
            host_pid: 777,
            thread_names: vec![(777, "trainer".into()), (778, "acl_taskq".into())],
            ..Default::default()
        };
        for k in 0..4u64 {
            let s = t0 + k * step_ns;
            d.steps.push(StepSpan {
                step: StepIndex(k + 5),
                start_ts_ns: s,
                end_ts_ns: s + step_ns,
                tid: 777,
                aux: vec![("backward".into(), 1)],
            });
            d.api_calls.push(ApiCall {
                tid: 777,
                api: "aclrtLaunchKernel".into(),
                start_ts_ns: s + 100_000,
                dur_ns: 20_000,
                ret: 0,
                device_wait: false,
            });
            d.api_calls.push(ApiCall {
                tid: 778,
                api: "aclrtLaunchKernel".into(),
                start_ts_ns: s + 200_000,
                dur_ns: 20_000,
                ret: 0,
                device_wait: false,
            });
            let sync_start = s + step_ns - wait_ns - 1_000;
            d.api_calls.push(ApiCall {
                tid: 777,
                api: "aclrtSynchronizeStream".into(),
                start_ts_ns: sync_start,
                dur_ns: wait_ns,
                ret: 0,
                device_wait: true,
            });
            d.offcpu.push(OffCpuSpan {
                tid: 777,
                ts_ns: sync_start + 500,
                dur_ns: wait_ns - 1_000,
                stack: vec![
                    "main".into(),
                    "aclrtSynchronizeStream".into(),
                    "schedule_[k]".into(),
                ]
                .into(),
            });
            for j in 0..4u64 {
                let leaf = if j < 3 { hot } else { "other" };
                d.samples.push(CpuSample {
                    tid: 777,
                    ts_ns: s + 300_000 + j * 10_000,
                    stack: vec!["main".into(), "train_step".into(), leaf.into()].into(),
                });
            }
        }
        d
    }

    fn write(d: &WindowData, meta: Option<&str>) -> PathBuf {
        let dir = tempdir("report");
        let files = write_window_files(&dir, d, &Collectors::ALL).unwrap();
        for f in [
            "steps.csv",
            "api_summary.csv",
            "cpu.folded",
            "flamegraph.svg",
            "offcpu.folded",
            "offcpu.svg",
            "trace.json",
            "summary.json",
        ] {
            assert!(files.contains(&dir.join(f)), "{f} not written: {files:?}");
            assert!(dir.join(f).exists());
        }
        assert!(
            !std::fs::read_dir(&dir).unwrap().any(|e| e
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".tmp"))
        );
        if let Some(m) = meta {
            std::fs::write(dir.join(META_FILE), m).unwrap();
        }
        dir
    }

    #[test]
    fn host_bound_window() {
        // 2.8 ms of 10 ms waiting: 72% outside device waits.
        let dir = write(
            &window(2_800_000, "hot_cpu_work"),
            Some(r#"{"complete":true,"target":{"pid":777}}"#),
        );
        let a = analyze(&dir).unwrap();
        assert_eq!(a.complete, Some(true));
        assert_eq!(a.step_time.count, 4);
        assert_eq!(a.step_time.mean_ns, 10_000_000);
        assert_eq!(a.device_wait_ns, 4 * 2_800_000);
        assert_eq!(a.host_busy_ns, 4 * 7_200_000);
        assert_eq!(a.api_calls, 12);
        assert_eq!(
            a.steps[0],
            StepLine {
                step: 5,
                duration_ns: 10_000_000,
                device_wait_ns: 2_800_000,
                host_busy_ns: 7_200_000,
                api_calls: 3
            }
        );
        assert_eq!(a.top_apis[0].api, "aclrtSynchronizeStream");
        assert_eq!(a.top_apis[0].total_ns, 4 * 2_800_000);
        assert_eq!(a.top_apis[1].calls, 8);
        assert_eq!(a.cpu_samples, 16);
        assert_eq!(
            a.top_frames_self[0],
            FrameCount {
                frame: "hot_cpu_work".into(),
                self_samples: 12,
                inclusive_samples: 12
            }
        );
        assert_eq!(a.top_frames_inclusive[0].inclusive_samples, 16);
        assert_eq!(a.verdict.bound, Bound::HostBound);
        assert_eq!(
            a.verdict.text,
            "host-bound: 72% of step time outside device waits; top frame: hot_cpu_work"
        );
        assert!(a.warnings.is_empty(), "{:?}", a.warnings);
        let text = render_one(&a);
        println!("{text}");
        assert!(text.contains("verdict: host-bound: 72%"), "{text}");
        assert!(text.contains("aclrtLaunchKernel"));
        let j = to_json(std::slice::from_ref(&a));
        assert_eq!(j["verdict"]["bound"], "host-bound");
        assert_eq!(j["step_time"]["p99_ns"], 10_000_000);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn device_bound_window_and_comparison() {
        let before = write(&window(6_400_000, "wait_loop"), None);
        let a = analyze(&before).unwrap();
        assert_eq!(a.complete, None);
        assert!(a.warnings[0].contains("no meta.json"));
        assert_eq!(a.device_wait_ns, 4 * 6_400_000);
        assert_eq!(a.verdict.bound, Bound::DeviceBound);
        assert_eq!(
            a.verdict.text,
            "device-bound: 64% of step time in device waits (aclrtSynchronizeStream); top frame: wait_loop"
        );

        let after = write(
            &window(2_800_000, "hot_cpu_work"),
            Some(r#"{"complete":false,"incomplete_reason":"target exited"}"#),
        );
        let b = analyze(&after).unwrap();
        assert!(
            b.warnings.iter().any(|w| w == "INCOMPLETE: target exited"),
            "{:?}",
            b.warnings
        );
        let text = render_compare(&[a.clone(), b.clone()]);
        println!("{text}");
        assert!(text.contains("INCOMPLETE (target exited)"), "{text}");
        assert!(text.contains("[2]/[1]"), "{text}");
        // Device wait per step 6.4 ms -> 2.8 ms.
        assert!(text.contains("0.44x"), "{text}");
        let j = to_json(&[a, b]);
        let row = j["comparison"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["metric"] == "device wait / step")
            .unwrap();
        assert_eq!(row["values"][0], 6_400_000.0);
        assert_eq!(row["ratios_to_first"][1], 0.4375);
        std::fs::remove_dir_all(&before).unwrap();
        std::fs::remove_dir_all(&after).unwrap();
    }

    #[test]
    fn not_a_prof_dir_and_missing_api() {
        let dir = tempdir("report-empty");
        let e = analyze(&dir).unwrap_err().to_string();
        assert!(e.contains("not a dynprof PROF directory"), "{e}");
        assert!(analyze(&dir.join("nope")).is_err());

        let only_cpu = Collectors {
            api: false,
            cpu: true,
            offcpu: false,
        };
        write_window_files(&dir, &window(1_000_000, "f"), &only_cpu).unwrap();
        assert!(!dir.join(API_SUMMARY_FILE).exists());
        assert!(!dir.join("offcpu.folded").exists());
        let a = analyze(&dir).unwrap();
        assert_eq!(a.verdict.bound, Bound::Unknown);
        assert!(a.verdict.text.contains("api collector did not run"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn many_steps_are_summarized() {
        let steps: Vec<StepLine> = (0..50)
            .map(|i| StepLine {
                step: i,
                duration_ns: 1_000 + i,
                device_wait_ns: i * 10,
                host_busy_ns: 1_000 - 9 * i,
                api_calls: 1,
            })
            .collect();
        let t = step_table(&steps);
        assert!(t.contains("50 steps; device-wait share min 0.0%"), "{t}");
        assert!(t.contains("slowest 5"));
        assert!(t.contains(" 49 "));
    }
}
