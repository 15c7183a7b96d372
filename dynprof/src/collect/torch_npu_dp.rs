//! `--collector torch-npu-dp --dp-config-dir DIR`: for a job that already uses
//! torch_npu `dynamic_profile` (`dp.init(DIR)` or PROF_CONFIG_PATH=DIR).
//!
//! At a window's first boundary (dynprof step S) dynprof rewrites the job's
//! `DIR/profiler_config.json` with `start_step = S + K + L` (K =
//! `--dp-step-offset`, L = `--dp-lead-steps`; L = 0 writes -1, "the step after
//! torch_npu reads the file"). torch_npu only notices the change at its next
//! poll (every ~2 s, or its measured step time) and starts when its own step
//! counter equals start_step, so its capture lands later than the window.
//!
//! How dynprof reads what torch_npu captured (assumptions, from the torch_npu
//! sources and docs):
//! - torch_npu logs `Start Dynamic Profiler at N step.` and `Stop Dynamic
//!   Profiler at M step.` to `DIR/log/dp_*.log`; its counter N is the number
//!   of `dp.step()` calls so far, and the profiler covers the steps between
//!   those two calls. With K = torch_npu's counter at dynprof's step 0
//!   boundary, dynprof step `N - K` is the first one captured.
//! - Each capture is a new `*_ascend_pt` directory under the config's
//!   `prof_dir`; when analysed, its `ASCEND_PROFILER_OUTPUT/step_trace_time.csv`
//!   lists the captured steps in the `Step` column (torch_npu numbering).
//!
//! The offset reported is `first captured dynprof step - S`: what torch_npu's
//! poll interval costs compared with a boundary-exact window.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};
use serde_json::{Value, json};

use super::{WindowHook, WindowInfo, msprof::monotonic_ns};
use crate::target::Target;

#[derive(Clone, Debug)]
pub struct DpConfig {
    /// The job's dynamic_profile directory, as the target sees it.
    pub config_dir: String,
    /// torch_npu's step counter at dynprof's step-0 boundary.
    pub step_offset: i64,
    /// Steps ahead of the observed boundary; 0 = write -1.
    pub lead_steps: u64,
    /// `active` to write.
    pub active: u64,
    /// `prof_dir` to write (default: the template's).
    pub prof_dir: Option<String>,
}

/// torch_npu's default template (its documentation), used when the job's
/// own file cannot be read.
pub fn default_template() -> Value {
    json!({
        "activities": ["CPU", "NPU"], "prof_dir": "./", "analyse": false, "record_shapes": false,
        "profile_memory": false, "with_stack": false, "with_flops": false, "with_modules": false,
        "active": 1, "warmup": 0, "start_step": 0, "is_rank": false, "rank_list": [],
        "experimental_config": {
            "profiler_level": "Level0", "aic_metrics": "AiCoreNone", "l2_cache": false, "op_attr": false,
            "gc_detect_threshold": null, "data_simplification": true, "record_op_args": false,
            "export_type": ["text"], "mstx": false, "mstx_domain_include": [], "mstx_domain_exclude": [],
            "host_sys": [], "sys_io": false, "sys_interconnection": false
        }
    })
}

/// `(start N, stop M)` pairs from dp_*.log text, in order.
pub fn parse_dp_log(text: &str) -> Vec<(Option<i64>, Option<i64>)> {
    let num = |l: &str, key: &str| -> Option<i64> {
        let rest = &l[l.find(key)? + key.len()..];
        rest.split_whitespace().next()?.parse().ok()
    };
    let mut out: Vec<(Option<i64>, Option<i64>)> = Vec::new();
    for l in text.lines() {
        if let Some(n) = num(l, "Start Dynamic Profiler at ") {
            out.push((Some(n), None));
        } else if let Some(m) = num(l, "Stop Dynamic Profiler at ") {
            match out.last_mut() {
                Some(last) if last.1.is_none() => last.1 = Some(m),
                _ => out.push((None, Some(m))),
            }
        }
    }
    out
}

struct Request {
    window: u32,
    observed_step: u64,
    start_step: i64,
    written_ns: u64,
    /// dp_*.log sizes at write time: only later lines answer this request.
    log_sizes: BTreeMap<PathBuf, u64>,
    pt_before: BTreeSet<String>,
}

pub struct TorchNpuDp {
    cfg: DpConfig,
    host_dir: PathBuf,
    host_prof_dir: PathBuf,
    template: Value,
    pending: Vec<Request>,
}

fn dp_logs(dir: &Path) -> BTreeMap<PathBuf, u64> {
    std::fs::read_dir(dir.join("log"))
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| {
                    let n = e.file_name().to_string_lossy().into_owned();
                    n.starts_with("dp_") && n.ends_with(".log")
                })
                .map(|e| (e.path(), e.metadata().map(|m| m.len()).unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default()
}

fn pt_dirs(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with("_ascend_pt"))
                .collect()
        })
        .unwrap_or_default()
}

/// Steps in an analysed capture's step_trace_time.csv (`Step` column).
fn csv_steps(pt: &Path) -> Vec<i64> {
    let Ok(text) = std::fs::read_to_string(pt.join("ASCEND_PROFILER_OUTPUT/step_trace_time.csv"))
    else {
        return Vec::new();
    };
    let mut lines = text.lines();
    let Some(col) = lines
        .next()
        .and_then(|h| h.split(',').position(|c| c.trim() == "Step"))
    else {
        return Vec::new();
    };
    lines
        .filter_map(|l| l.split(',').nth(col)?.trim().parse().ok())
        .collect()
}

impl TorchNpuDp {
    pub fn new(cfg: DpConfig) -> Self {
        Self {
            cfg,
            host_dir: PathBuf::new(),
            host_prof_dir: PathBuf::new(),
            template: default_template(),
            pending: Vec::new(),
        }
    }

    /// Checks a request against torch_npu's log and output dir.
    fn check(&self, r: &Request) -> Value {
        let mut new_text = String::new();
        for (p, len) in dp_logs(&self.host_dir) {
            let from = r.log_sizes.get(&p).copied().unwrap_or(0);
            if let Ok(b) = std::fs::read(&p) {
                let from = if (b.len() as u64) < from {
                    0
                } else {
                    from as usize
                }; // rotated
                new_text.push_str(&String::from_utf8_lossy(&b[from.min(b.len())..]));
            }
            let _ = len;
        }
        let runs = parse_dp_log(&new_text);
        let new_pt: Vec<String> = pt_dirs(&self.host_prof_dir)
            .difference(&r.pt_before)
            .cloned()
            .collect();
        let csv: Vec<i64> = new_pt
            .iter()
            .flat_map(|n| csv_steps(&self.host_prof_dir.join(n)))
            .collect();
        let k = self.cfg.step_offset;
        let first = runs.first().copied();
        let (started, stopped) = first.unwrap_or((None, None));
        let captured_dynprof = match (started, stopped) {
            (Some(n), Some(m)) => Some(json!([n - k, m - k - 1])),
            (Some(n), None) => Some(json!([n - k, null])),
            _ => None,
        };
        json!({
            "window": r.window,
            "observed_step": r.observed_step,
            "start_step_written": r.start_step,
            "written_ns": r.written_ns,
            "torch_npu_started_at_step": started,
            "torch_npu_stopped_at_step": stopped,
            "captured_dynprof_steps": captured_dynprof,
            "offset_steps": started.map(|n| n - k - r.observed_step as i64),
            "capture_dirs": new_pt.iter().map(|n| self.host_prof_dir.join(n)).collect::<Vec<_>>(),
            "steps_in_step_trace_time_csv": csv,
            "captured": started.is_some(),
        })
    }
}

impl WindowHook for TorchNpuDp {
    fn name(&self) -> &'static str {
        "torch_npu_dp"
    }

    fn prepare(&mut self, target: &Target) -> Result<()> {
        self.host_dir = target.host_path(&self.cfg.config_dir);
        let file = self.host_dir.join("profiler_config.json");
        match std::fs::read_to_string(&file)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        {
            Some(v) if v.is_object() => self.template = v,
            _ => eprintln!(
                "dynprof: torch-npu-dp: {} is missing or not JSON (has the job called dp.init({})?); using torch_npu's default template",
                file.display(),
                self.cfg.config_dir
            ),
        }
        let prof_dir = self
            .cfg
            .prof_dir
            .clone()
            .or_else(|| self.template["prof_dir"].as_str().map(String::from))
            .unwrap_or_else(|| "./".into());
        // A relative prof_dir is relative to the job's working directory.
        self.host_prof_dir = if prof_dir.starts_with('/') {
            target.host_path(&prof_dir)
        } else {
            std::fs::read_link(format!("/proc/{}/cwd", target.host_pid))
                .map(|cwd| target.host_path(&cwd.join(&prof_dir).to_string_lossy()))
                .unwrap_or_else(|_| target.host_path(&prof_dir))
        };
        Ok(())
    }

    fn on_window_start(&mut self, w: &WindowInfo, _target: &Target) -> Result<()> {
        let observed = w.first_recorded.0;
        let start_step = if self.cfg.lead_steps == 0 {
            -1
        } else {
            observed as i64 + self.cfg.step_offset + self.cfg.lead_steps as i64
        };
        let mut cfg = self.template.clone();
        cfg["start_step"] = json!(start_step);
        cfg["active"] = json!(self.cfg.active);
        cfg["warmup"] = json!(0);
        if let Some(p) = &self.cfg.prof_dir {
            cfg["prof_dir"] = json!(p);
        }
        let log_sizes = dp_logs(&self.host_dir);
        let pt_before = pt_dirs(&self.host_prof_dir);
        let file = self.host_dir.join("profiler_config.json");
        let tmp = self.host_dir.join(".profiler_config.json.dynprof");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&cfg)?)
            .and_then(|_| std::fs::rename(&tmp, &file))
            .with_context(|| format!("writing {}", file.display()))?;
        self.pending.push(Request {
            window: w.id.0,
            observed_step: observed,
            start_step,
            written_ns: monotonic_ns(),
            log_sizes,
            pt_before,
        });
        Ok(())
    }

    fn on_window_end(&mut self, _w: &WindowInfo, _target: &Target) -> Result<Value> {
        // torch_npu may not have polled yet: report what is known for every
        // request still open, and keep the unanswered ones for later windows
        // and for shutdown.
        let reports: Vec<Value> = self.pending.iter().map(|r| self.check(r)).collect();
        let done: Vec<bool> = reports
            .iter()
            .map(|r| r["torch_npu_stopped_at_step"].is_i64())
            .collect();
        let mut i = 0;
        self.pending.retain(|_| {
            let keep = !done[i];
            i += 1;
            keep
        });
        Ok(json!({
            "config_file": self.host_dir.join("profiler_config.json"),
            "prof_dir": self.host_prof_dir,
            "requests": reports,
            "note": "torch_npu reads profiler_config.json only at its next poll; offset_steps = first captured step - the window's first step",
        }))
    }

    fn shutdown(&mut self, _target: &Target) -> Result<()> {
        for r in &self.pending {
            let v = self.check(r);
            eprintln!("dynprof: torch-npu-dp: window {}: {v}", r.window);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dp_log_lines() {
        let t = "2025-01-01 INFO Start Dynamic Profiler at 17 step.\nx\n2025 INFO Stop Dynamic Profiler at 20 step.\n\
                 Start Dynamic Profiler at 40 step.\n";
        assert_eq!(
            parse_dp_log(t),
            vec![(Some(17), Some(20)), (Some(40), None)]
        );
    }
}
