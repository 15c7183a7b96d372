//! `meta.json`: what a window was. The window writes it last into its
//! directory (see [`super::profdir`]); `dynprof report` reads it back.
//!
//! Every field has a default when read, so that a partial or older file
//! still reads (what is absent stays `None`/empty and the report says so).
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::trigger::Source;
use crate::{
    output::model::{Drops, OverBudget},
    types::{HostPid, NsPid, StepIndex, WindowId},
};

/// The file's name in a window directory.
pub const META_FILE: &str = "meta.json";

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct WindowMeta {
    pub dynprof_version: String,
    pub window: Option<WindowId>,
    /// `None` only when read from a file without the field.
    pub complete: Option<bool>,
    pub incomplete_reason: Option<String>,
    pub target: Option<TargetMeta>,
    /// Which trigger asked for the window.
    pub trigger: Option<Source>,
    pub plan: Option<PlanMeta>,
    /// First step inside the kernel gate (warmup included).
    pub first_step: Option<u64>,
    pub first_recorded_step: Option<StepIndex>,
    pub last_recorded_step: Option<StepIndex>,
    pub steps_recorded: usize,
    pub open_ts_ns: u64,
    /// Every boundary seen inside the window.
    pub boundaries: Vec<BoundaryMeta>,
    /// The recorded steps.
    pub steps: Vec<StepMeta>,
    pub collectors: CollectorsMeta,
    /// The runtime APIs the api collector probed for this window, by name
    /// (an API that is here but not in api_summary.csv was never called).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub apis_traced: Vec<String>,
    /// API-set libraries whose symbols were still being read (off the
    /// critical path) when the window's probes were attached: their APIs
    /// are missing from this window, and probed from the next one. Not an
    /// incomplete window: its steps are all there.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub api_libraries_pending: Vec<String>,
    pub drops: Drops,
    pub memory: MemoryMeta,
    /// What each hook returned at the window's end, by hook name.
    pub hooks: Map<String, Value>,
    pub errors: Vec<String>,
    /// Local wall-clock times (`YYYY-mm-dd HH:MM:SS.mmm`).
    pub started_at: String,
    pub ended_at: String,
    /// A config-file request's `metadata`, verbatim.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
    /// A config-file request's whole config, verbatim.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config: Option<Value>,
    /// Which change of profiler_config.json asked for the window.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config_change: Option<u64>,
    /// Who held the USDT semaphores (the kernel or the /proc/PID/mem fallback).
    pub usdt_semaphores: Value,
    /// The kernel's release and the paths dynprof took on it
    /// (`compat::KernelPaths`; docs/portability.md).
    pub kernel: Value,
}

/// The profiled process.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct TargetMeta {
    pub host_pid: Option<HostPid>,
    /// NSpid chain, host PID first.
    pub ns_pids: Vec<NsPid>,
    /// The innermost PID (what `ps` in the container shows).
    pub ns_pid: Option<NsPid>,
    pub container: Option<String>,
    pub comm: String,
    pub cmdline: Vec<String>,
    pub rank: Option<u32>,
}

/// The plan the window belongs to.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PlanMeta {
    pub start_step: i64,
    pub warmup: u64,
    /// `None` for an open-ended window (`until_stop`).
    pub active: Option<u64>,
    pub until_stop: bool,
    pub repeat: u64,
    pub gap: u64,
    /// Which repetition this window is (0 = the first).
    pub cycle: u64,
    /// The kernel's plan in hit indices, while more cycles follow.
    pub kernel: Option<KernelPlanMeta>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct KernelPlanMeta {
    pub start: u64,
    pub end: u64,
    pub span: u64,
    pub period: u64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BoundaryMeta {
    /// The step this boundary begins.
    pub step: u64,
    pub ts_ns: u64,
    /// The step it begins is a warmup step.
    pub warmup: bool,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct StepMeta {
    pub step: Option<StepIndex>,
    pub start_ts_ns: u64,
    pub end_ts_ns: u64,
}

/// Which built-in collectors ran in the window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CollectorsMeta {
    pub api: bool,
    pub cpu: bool,
    pub offcpu: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct MemoryMeta {
    pub budget_bytes: u64,
    pub events_cap: u64,
    pub dropped_over_budget: OverBudget,
    /// dynprof's peak RSS: as of the closing boundary, then updated once the
    /// files are written (the window's own peak is then known).
    pub peak_rss_bytes: Option<u64>,
}

impl WindowMeta {
    /// Parses a meta.json.
    pub fn parse(text: &str) -> serde_json::Result<Self> {
        serde_json::from_str(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_files_read_with_what_they_have() {
        let m = WindowMeta::parse(r#"{"complete": false, "incomplete_reason": "x", "unknown": 1}"#)
            .unwrap();
        assert_eq!(m.complete, Some(false));
        assert_eq!(m.incomplete_reason.as_deref(), Some("x"));
        assert!(m.target.is_none() && m.plan.is_none());
        assert_eq!(WindowMeta::parse("{}").unwrap().complete, None);
        assert!(WindowMeta::parse(r#"{"complete": "yes"}"#).is_err());
    }

    #[test]
    fn round_trips_the_written_keys() {
        let m = WindowMeta {
            window: Some(WindowId(3)),
            complete: Some(true),
            plan: Some(PlanMeta {
                start_step: -1,
                active: None,
                until_stop: true,
                ..PlanMeta::default()
            }),
            ..WindowMeta::default()
        };
        let v = serde_json::to_value(&m).unwrap();
        assert_eq!(v["window"], 3);
        assert_eq!(v["plan"]["active"], Value::Null);
        assert_eq!(v["plan"]["kernel"], Value::Null);
        assert!(v.get("metadata").is_none());
        assert_eq!(WindowMeta::parse(&v.to_string()).unwrap(), m);
    }
}
