//! What the window scheduler drives: the contract between a window and the
//! collectors and hooks armed around it. The window owns it (it calls these
//! at its boundaries); `collect` implements it.
use anyhow::Result;
use serde::Serialize;

use crate::{
    bpf::Kernel,
    output::model::WindowData,
    session::Decoded,
    target::Target,
    types::{Builtin, StepIndex, WindowId},
};

/// A window as the scheduler knows it when calling collectors and hooks.
#[derive(Clone, Debug, Serialize)]
pub struct WindowInfo {
    pub id: WindowId,
    /// First step inside the kernel gate (warmup included).
    pub first_step: StepIndex,
    /// First recorded step (after warmup).
    pub first_recorded: StepIndex,
    /// Boundary timestamp (CLOCK_MONOTONIC ns) of `first_step`'s hit.
    pub open_ts_ns: u64,
    /// Boundary timestamp of `first_recorded`'s hit, the one start hooks
    /// answer (`open_ts_ns` without warmup); 0 until it is reached.
    pub start_ts_ns: u64,
    /// Boundary timestamp of the hit that closed the window; 0 when no
    /// boundary closed it (interrupt, target exit, detach).
    pub end_ts_ns: u64,
    /// Where this window's files go (the directory exists, being written).
    pub dir: std::path::PathBuf,
}

pub trait Collector {
    /// Which built-in collector this is.
    fn kind(&self) -> Builtin;
    fn name(&self) -> &'static str {
        self.kind().name()
    }
    /// Called once when the session starts running (after capabilities
    /// are dropped; possibly after a first arm): work that need not wait
    /// for an arm, started early so that arms are short (the api collector
    /// reads symbol tables on a thread of its own).
    fn prepare(&mut self, _target: &Target) {}
    /// Attaches probes. Called at least one step before the window opens
    /// (or immediately, for a window that opens at the next boundary).
    fn arm(&mut self, kernel: &mut Kernel, target: &Target) -> Result<()>;
    /// Detaches probes after the window closed.
    fn disarm(&mut self, kernel: &mut Kernel);
    /// The window `w` just opened (its directory exists): spill files go
    /// there from now on.
    fn window_opened(&mut self, _w: &WindowInfo) {}
    /// The window's gate closed at `end_ts_ns`: take what only the kernel
    /// holds (e.g. intervals still in flight) now, because the probes may be
    /// detached before [`Collector::drain_into`].
    fn seal(&mut self, _start_ts_ns: u64, _end_ts_ns: u64, _kernel: &mut Kernel) {}
    /// Every event while armed (the kernel only emits inside the gate).
    fn on_event(&mut self, ev: &Decoded);
    /// Moves what was gathered between `start_ts_ns` and `end_ts_ns` (the
    /// recorded steps' bounds) into `data`, dropping the rest (warmup).
    fn drain_into(
        &mut self,
        start_ts_ns: u64,
        end_ts_ns: u64,
        data: &mut WindowData,
        kernel: &mut Kernel,
    ) -> Result<()>;
}

pub trait WindowHook {
    fn name(&self) -> &'static str;
    /// Called once when dynprof attaches, before any window (e.g. start msprof).
    fn prepare(&mut self, _target: &Target) -> Result<()> {
        Ok(())
    }
    /// The window's first recorded step just began (boundary hit seen).
    fn on_window_start(&mut self, w: &WindowInfo, target: &Target) -> Result<()>;
    /// The window's last step just ended. Returns metadata for meta.json
    /// (under `hooks.<name>`); an Err marks the window incomplete.
    fn on_window_end(&mut self, w: &WindowInfo, target: &Target) -> Result<serde_json::Value>;
    /// dynprof is detaching.
    fn shutdown(&mut self, _target: &Target) -> Result<()> {
        Ok(())
    }
}
