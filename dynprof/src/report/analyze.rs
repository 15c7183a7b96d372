//! One PROF directory's analysis: steps, device wait, top APIs and
//! frames, losses, and the verdict.
use std::{fs, path::Path};

use anyhow::{Context, Result, bail};

use super::{
    read::{parse_api_summary, parse_steps, read_opt},
    *,
};
use crate::output::{
    flame::{CPU_FOLDED, parse_folded},
    model::Drops,
    tables::{API_SUMMARY_FILE, STEPS_FILE, SUMMARY_FILE, Summary, top_frames},
};
use crate::window::meta::WindowMeta;

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

    let meta: Option<WindowMeta> = match meta_text {
        Some(t) => Some(
            WindowMeta::parse(&t)
                .with_context(|| format!("parsing {}", dir.join(META_FILE).display()))?,
        ),
        None => None,
    };
    let complete = meta.as_ref().and_then(|m| m.complete);
    let incomplete_reason = meta.as_ref().and_then(|m| m.incomplete_reason.clone());
    let target = meta.as_ref().and_then(|m| m.target.clone());
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
