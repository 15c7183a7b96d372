//! Triggers produce plans and commands for the window scheduler; they never
//! touch probes or files themselves.
//!
//! - flags (`--start-step` …): one [`PlanRequest`] handed to the scheduler
//!   before the session starts;
//! - [`console`]: the `dynprof>` prompt, on its own thread, sending
//!   [`ConsoleCommand`]s over the session's command channel;
//! - [`config_file`]: a `profiler_config.json` watcher sending
//!   [`config_file::ConfigChanged`] over the same channel.
pub mod config_file;
pub mod console;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{types::Builtin, window::Plan};

/// Where a plan came from (recorded in meta.json).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    Flags,
    Console,
    ConfigFile,
}

/// A plan plus what the window should collect and where it goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanRequest {
    pub plan: Plan,
    pub source: Source,
    /// Collector names to arm (`api`, `cpu`, `offcpu`); `None` = all registered.
    /// The collectors this window arms (`None`: the session's default).
    pub collect: Option<Vec<Builtin>>,
    /// Output directory; `None` = the scheduler's default.
    pub output: Option<PathBuf>,
    /// Copied into meta.json (`metadata` of profiler_config.json).
    pub metadata: Option<serde_json::Value>,
    /// The whole config that produced this plan (config-file trigger).
    pub config: Option<serde_json::Value>,
    /// Config-file change number, for the monitor log.
    pub change: Option<u64>,
}

impl PlanRequest {
    pub fn new(plan: Plan, source: Source) -> Self {
        Self {
            plan,
            source,
            collect: None,
            output: None,
            metadata: None,
            config: None,
            change: None,
        }
    }
}

/// What the console asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConsoleRequest {
    /// A window from the next boundary until `stop`.
    Start,
    /// Close the open window at the next boundary (or cancel a pending one).
    Stop,
    Capture(Plan),
    Status,
    /// End any window cleanly, detach, leave the target running.
    Quit,
}

/// A console command and where its answer goes.
pub struct ConsoleCommand {
    pub req: ConsoleRequest,
    pub reply: std::sync::mpsc::Sender<Reply>,
}

#[derive(Clone, Debug)]
pub struct Reply {
    pub text: String,
}

/// Where asynchronous notices (window written, idle timeout) are printed
/// while the console owns the terminal.
pub type NoticePrinter = Box<dyn FnMut(String) + Send>;

/// Sent once by the console so that the scheduler prints through it.
pub struct SetNoticePrinter(pub NoticePrinter);

/// What the triggers send into the session, on its command channel.
pub enum SessionCommand {
    /// A console line to answer.
    Console(ConsoleCommand),
    /// profiler_config.json was saved.
    ConfigChanged(config_file::ConfigChanged),
    /// The console prints notices now (above its prompt).
    SetNoticePrinter(SetNoticePrinter),
    /// A plan decided outside this session (job mode: the job's aligned
    /// start, in this rank's own step indices).
    Plan(Box<PlanRequest>),
    /// Job mode's `stop`: the window ends after this rank's own step (the
    /// same job step on every rank).
    EndAt(u64),
}
