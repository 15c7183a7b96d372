//! What one window captured, in user-space terms: the input of every output
//! writer (`trace.json`, tables, flamegraphs) and what `report` reads back.
use serde::{Deserialize, Serialize};

use crate::types::StepIndex;

/// One recorded step: from its boundary hit to the next.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StepSpan {
    pub step: StepIndex,
    pub start_ts_ns: u64,
    pub end_ts_ns: u64,
    /// Host tid that hit the boundary that began this step.
    pub tid: u32,
    /// Aux marker hits during this step, by aux marker name.
    pub aux: Vec<(String, u64)>,
}

/// One completed runtime API call.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ApiCall {
    pub tid: u32,
    pub api: String,
    pub start_ts_ns: u64,
    pub dur_ns: u64,
    pub ret: i64,
    /// What its time is to the step tables.
    pub class: ApiClass,
}

/// What an API call's time is. The step tables add up each class's calls
/// per step (`device_wait_ns`, `collective_wait_ns` in `steps.csv`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum ApiClass {
    /// The call's own host time (a launch, a copy, an allocation).
    #[default]
    Call,
    /// The host waits for the device (synchronize calls).
    DeviceWait,
    /// The host waits for its peers in a collective (c10d's work wait,
    /// DDP's wait for the gradient allreduce).
    CollectiveWait,
}

impl ApiClass {
    /// The Chrome trace category of its slices.
    pub fn trace_category(self) -> &'static str {
        match self {
            ApiClass::Call => "api",
            ApiClass::DeviceWait => "device_wait",
            ApiClass::CollectiveWait => "collective_wait",
        }
    }
}

/// A symbolized stack, root first, leaf last; kernel frames are suffixed
/// `_[k]` as in the flamegraph convention. Shared: a dense window has
/// millions of events but few distinct stacks, and each event holds one
/// pointer to its stack rather than a copy of its frames.
pub type Stack = std::sync::Arc<[String]>;

/// One CPU sample.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CpuSample {
    pub tid: u32,
    pub ts_ns: u64,
    pub stack: Stack,
}

/// One off-CPU interval.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OffCpuSpan {
    pub tid: u32,
    pub ts_ns: u64,
    pub dur_ns: u64,
    pub stack: Stack,
    /// Still runnable when it left the CPU (preempted, or it yielded):
    /// the interval is a wait for a CPU, not a block.
    #[serde(default)]
    pub runnable: bool,
}

/// Per-collector losses, from the kernel's DROPS map over the window.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Drops {
    pub step: u64,
    pub api: u64,
    pub cpu: u64,
    pub offcpu: u64,
    pub cpu_stack: u64,
    pub offcpu_stack: u64,
    pub api_nesting: u64,
}

/// Events a window's collectors saw but did not keep, because the window
/// already held as many as `--memory-budget` allows.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct OverBudget {
    pub api: u64,
    pub cpu: u64,
    pub offcpu: u64,
}

impl OverBudget {
    pub fn total(&self) -> u64 {
        self.api + self.cpu + self.offcpu
    }
}

/// The memory budget a window's collectors ran under.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct WindowBudget {
    /// `--memory-budget` in bytes (0: no collector ran).
    pub budget_bytes: u64,
    /// Events the window could keep, over all its collectors.
    pub events_cap: u64,
    /// Events dropped past that cap, by collector.
    pub dropped_over_budget: OverBudget,
}

/// Everything a window's collectors produced, filtered to its recorded steps.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct WindowData {
    pub steps: Vec<StepSpan>,
    pub api_calls: Vec<ApiCall>,
    pub samples: Vec<CpuSample>,
    pub offcpu: Vec<OffCpuSpan>,
    /// Host tid -> thread name (from /proc/PID/task/TID/comm).
    pub thread_names: Vec<(u32, String)>,
    pub process_name: String,
    pub host_pid: u32,
    pub drops: Drops,
    #[serde(default)]
    pub budget: WindowBudget,
    /// Mapped files some of whose frames are `[unknown] NAME+0xOFFSET`
    /// (written to `modules.json`, for `report --symbolize`).
    #[serde(default)]
    pub modules: Vec<ModuleRef>,
    /// Libraries of the API sets whose symbols were still being read when
    /// the window's probes were attached: their APIs are missing from this
    /// window (meta.json `api_libraries_pending`).
    #[serde(default)]
    pub api_libraries_pending: Vec<String>,
    /// The APIs the api collector probed for the window, by name, sorted.
    #[serde(default)]
    pub apis_traced: Vec<String>,
}

/// A mapped file that frames name only by offset: enough to name them
/// later, offline, from its separate debug file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleRef {
    /// The file name as frames show it (`[unknown] NAME+0x…`).
    pub name: String,
    /// Its path in the target, as /proc/PID/maps showed it.
    pub path: String,
    /// Its GNU build id (hex), when the file could be read.
    pub build_id: Option<String>,
    /// Its loadable segments, (file offset, file size, virtual address):
    /// a frame's offset is a file offset, debug files are addressed by
    /// virtual address.
    pub segments: Vec<(u64, u64, u64)>,
    /// Its `.gnu_debuglink`, when it has one: how a debug file without a
    /// build id (or one of a file without) is found and checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub debuglink: Option<crate::symbols::DebugLink>,
}

impl ModuleRef {
    /// Adds `more` to `into`, one entry per name (the first seen wins).
    pub fn merge(into: &mut Vec<ModuleRef>, more: Vec<ModuleRef>) {
        for m in more {
            if !into.iter().any(|o| o.name == m.name) {
                into.push(m);
            }
        }
    }
}
