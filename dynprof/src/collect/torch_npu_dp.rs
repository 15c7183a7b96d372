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
    path::PathBuf,
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

use super::{WindowHook, WindowInfo, msprof::monotonic_ns};
use crate::{
    sys::{
        rootfs::{FileKind, TargetRoot},
        targetdir::{self, Owner},
    },
    target::Target,
};

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

/// At most this much of `profiler_config.json` is read as the template
/// (torch_npu's own is ~1 KiB; the file is the job's to fill).
const MAX_TEMPLATE: usize = 1 << 20;
/// At most this much new dp log text is read per check.
const MAX_LOG_READ: usize = 4 << 20;
/// At most this much of one step_trace_time.csv is read.
const MAX_CSV: usize = 16 << 20;

struct Request {
    window: u32,
    observed_step: u64,
    start_step: i64,
    written_ns: u64,
    /// dp_*.log sizes at write time: only later lines answer this request.
    log_sizes: BTreeMap<String, u64>,
    pt_before: BTreeSet<String>,
}

/// Every file here lives in a directory the job's user owns, so each one is
/// reached through the target's root descriptor (`sys::targetdir`): a link
/// the job planted resolves inside its own root, a FIFO is refused
/// unopened, and every read is capped.
pub struct TorchNpuDp {
    cfg: DpConfig,
    root: Option<TargetRoot>,
    /// `config_dir` and `prof_dir` as the target names them (absolute).
    config_dir: String,
    prof_dir: String,
    /// The same on the host, for the report only (never opened).
    host_dir: PathBuf,
    host_prof_dir: PathBuf,
    /// Who owns `config_dir`: the rewritten file goes to them.
    owner: Owner,
    template: Value,
    pending: Vec<Request>,
}

fn is_dp_log(name: &str) -> bool {
    name.starts_with("dp_") && name.ends_with(".log")
}

/// Steps in an analysed capture's step_trace_time.csv (`Step` column).
fn csv_steps(text: &str) -> Vec<i64> {
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
            root: None,
            config_dir: String::new(),
            prof_dir: String::new(),
            host_dir: PathBuf::new(),
            host_prof_dir: PathBuf::new(),
            owner: Owner { uid: 0, gid: 0 },
            template: default_template(),
            pending: Vec::new(),
        }
    }

    fn log_dir(&self) -> String {
        format!("{}/log", self.config_dir.trim_end_matches('/'))
    }

    /// The dp logs and their sizes (empty when the directory is missing).
    fn dp_logs(&self) -> BTreeMap<String, u64> {
        let Some(root) = &self.root else {
            return BTreeMap::new();
        };
        targetdir::list_files(root, &self.log_dir(), is_dp_log)
            .map(|v| v.into_iter().collect())
            .unwrap_or_default()
    }

    fn pt_dirs(&self) -> BTreeSet<String> {
        let Some(root) = &self.root else {
            return BTreeSet::new();
        };
        targetdir::list_subdirs(root, &self.prof_dir, "")
            .map(|v| {
                v.into_iter()
                    .filter(|n| n.ends_with("_ascend_pt"))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Checks a request against torch_npu's log and output dir.
    fn check(&self, r: &Request) -> Value {
        let mut new_text = String::new();
        let mut read_errors = Vec::new();
        if let Some(root) = &self.root {
            for (name, len) in self.dp_logs() {
                let from = r.log_sizes.get(&name).copied().unwrap_or(0);
                // A log shorter than before was rotated: read it whole.
                let from = if len < from { 0 } else { from };
                let path = format!("{}/{name}", self.log_dir());
                match targetdir::read_capped(root, &path, from, MAX_LOG_READ) {
                    Ok((b, _)) => new_text.push_str(&String::from_utf8_lossy(&b)),
                    Err(e) => read_errors.push(format!("{path}: {e}")),
                }
            }
        }
        let runs = parse_dp_log(&new_text);
        let new_pt: Vec<String> = self.pt_dirs().difference(&r.pt_before).cloned().collect();
        let csv: Vec<i64> = match &self.root {
            Some(root) => new_pt
                .iter()
                .flat_map(|n| {
                    let p = format!(
                        "{}/{n}/ASCEND_PROFILER_OUTPUT/step_trace_time.csv",
                        self.prof_dir.trim_end_matches('/')
                    );
                    targetdir::read_capped(root, &p, 0, MAX_CSV)
                        .map(|(b, _)| csv_steps(&String::from_utf8_lossy(&b)))
                        .unwrap_or_default()
                })
                .collect(),
            None => Vec::new(),
        };
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
            "log_read_errors": read_errors,
        })
    }
}

/// `prof_dir` as the target names it: relative ones are relative to the
/// job's working directory (`cwd`, as the target sees it, if known).
fn absolute_in_target(prof_dir: &str, cwd: Option<&str>) -> String {
    if prof_dir.starts_with('/') {
        return prof_dir.to_string();
    }
    match cwd {
        Some(c) => format!("{}/{prof_dir}", c.trim_end_matches('/')),
        None => format!("/{prof_dir}"),
    }
}

impl WindowHook for TorchNpuDp {
    fn name(&self) -> &'static str {
        "torch_npu_dp"
    }

    fn prepare(&mut self, target: &Target) -> Result<()> {
        let root = TargetRoot::open(&target.root())
            .with_context(|| format!("opening {}", target.root().display()))?;
        self.config_dir = absolute_in_target(&self.cfg.config_dir, None);
        self.host_dir = target.host_path(&self.config_dir);
        let dir_id = root.stat(&self.config_dir).with_context(|| {
            format!(
                "torch-npu-dp: {} in the job's root (--dp-config-dir, as the job names it)",
                self.config_dir
            )
        })?;
        if dir_id.kind != FileKind::Directory {
            bail!(
                "torch-npu-dp: {} in the job's root is {}, not a directory",
                self.config_dir,
                dir_id.kind.describe()
            );
        }
        let dfd = root.open_dir(&self.config_dir)?;
        let st = rustix::fs::fstat(&dfd)?;
        self.owner = Owner {
            uid: st.st_uid,
            gid: st.st_gid,
        };
        let file = format!(
            "{}/profiler_config.json",
            self.config_dir.trim_end_matches('/')
        );
        let read = targetdir::read_capped(&root, &file, 0, MAX_TEMPLATE + 1);
        match read {
            Ok((b, size)) if size as usize <= MAX_TEMPLATE => {
                match serde_json::from_slice::<Value>(&b) {
                    Ok(v) if v.is_object() => self.template = v,
                    _ => eprintln!(
                        "dynprof: torch-npu-dp: {file} in the job's root is not a JSON object;                          using torch_npu's default template"
                    ),
                }
            }
            Ok((_, size)) => eprintln!(
                "dynprof: torch-npu-dp: {file} in the job's root is {size} bytes (over {} KiB);                  using torch_npu's default template",
                MAX_TEMPLATE >> 10
            ),
            Err(e) => eprintln!(
                "dynprof: torch-npu-dp: {file} in the job's root: {e} (has the job called                  dp.init({})?); using torch_npu's default template",
                self.cfg.config_dir
            ),
        }
        let prof_dir = self
            .cfg
            .prof_dir
            .clone()
            .or_else(|| self.template["prof_dir"].as_str().map(String::from))
            .unwrap_or_else(|| "./".into());
        let cwd = std::fs::read_link(format!("/proc/{}/cwd", target.host_pid))
            .ok()
            .map(|c| c.to_string_lossy().into_owned());
        self.prof_dir = absolute_in_target(&prof_dir, cwd.as_deref());
        self.host_prof_dir = target.host_path(&self.prof_dir);
        self.root = Some(root);
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
        let log_sizes = self.dp_logs();
        let pt_before = self.pt_dirs();
        let root = self
            .root
            .as_ref()
            .context("torch-npu-dp: window before prepare")?;
        targetdir::replace_file(
            root,
            &self.config_dir,
            "profiler_config.json",
            &serde_json::to_vec_pretty(&cfg)?,
            self.owner,
            0o644,
        )
        .with_context(|| {
            format!(
                "writing {}/profiler_config.json in the job's root",
                self.config_dir.trim_end_matches('/')
            )
        })?;
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

    #[test]
    fn csv_step_column_and_prof_dir_in_the_target() {
        assert_eq!(
            csv_steps("Device_id,Step,Computing\n0,41,1.0\n0,42,2.0\n0,x,3\n"),
            vec![41, 42]
        );
        assert!(csv_steps("no step column\n1\n").is_empty());
        assert_eq!(absolute_in_target("/out", Some("/w")), "/out");
        assert_eq!(absolute_in_target("./", Some("/w/")), "/w/./");
        assert_eq!(absolute_in_target("prof", None), "/prof");
    }
}
