//! `dynprof report PROF_DIR... [--json]`: reads PROF directories back and
//! answers "host-bound or device-bound, and where?"; with several
//! directories, compares them side by side (before/after).
//!
//! It reads only files (steps.csv, api_summary.csv, cpu.folded,
//! summary.json, meta.json), so a directory copied off the training node
//! reports the same as on it.
//!
//! | module | job |
//! |---|---|
//! | `read` | the files of one directory, parsed (meta.json as [`WindowMeta`]) |
//! | `analyze` | one directory's [`Analysis`] and verdict |
//! | `render` | one analysis as text |
//! | `compare` | several side by side |
mod analyze;
mod compare;
mod python_top;
mod read;
mod render;
pub mod symbolize;
#[cfg(test)]
mod tests;

use std::path::PathBuf;

use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::Value;

pub use analyze::analyze;
pub use compare::{CompareRow, Unit, render_compare};
pub use render::render_one;

use crate::output::{
    Collectors,
    model::Drops,
    tables::{ApiStat, DurationStats, FrameCount},
};
pub use crate::window::meta::META_FILE;
use crate::window::meta::TargetMeta;
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
    /// First name the frames the window could name only as
    /// `[unknown] FILE+0xOFFSET`, from separate debug files found by the
    /// build ids in its modules.json (in each --debug-dir, then
    /// /usr/lib/debug). Rewrites the window's folded stacks, flame graphs,
    /// trace.json and summary.json in place.
    #[arg(long)]
    pub symbolize: bool,
    /// With --symbolize: a directory holding `.build-id/ab/cdef….debug`
    /// files (repeatable).
    #[arg(long = "debug-dir", value_name = "DIR", requires = "symbolize")]
    pub debug_dirs: Vec<PathBuf>,
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
    /// meta.json's target description, if any.
    pub target: Option<TargetMeta>,
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
    /// Python functions of the cpu stacks (`report::python_top`).
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

pub fn run(args: &ReportArgs) -> Result<()> {
    if args.symbolize {
        for d in &args.debug_dirs {
            anyhow::ensure!(d.is_dir(), "--debug-dir {}: not a directory", d.display());
        }
        for dir in &args.dirs {
            let s = symbolize::symbolize_dir(dir, &args.debug_dirs)
                .with_context(|| format!("symbolizing {}", dir.display()))?;
            eprintln!(
                "dynprof: {}: named {} of {} frames known only by offset",
                dir.display(),
                s.named,
                s.unknown_frames
            );
            for (file, how) in &s.modules {
                eprintln!("dynprof:   {file}: {how}");
            }
        }
    }
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
    let rows: Vec<Value> = compare::comparison_rows(analyses)
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
