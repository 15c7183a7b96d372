//! The window scheduler: a session [`Observer`] that turns plans into kernel
//! gates, follows the boundaries through the step events, drives collectors
//! and hooks, and writes one `PROF_*` directory per window.
//!
//! Timeline of one window of plan `S, W, A` (hit k begins step k):
//! - plan programmed: `PlanConfig { start: S, span: W+A, … }`; collectors are
//!   armed now if `S` is at most two boundaries away, else at hit `S-2`;
//! - hit `S` (gate 0→1 in the kernel): the window opens, its directory is
//!   created (hidden, `.PROF_…_tmp`);
//! - hit `S+W`: the first recorded step begins → `WindowHook::on_window_start`;
//! - hit `S+W+A` (gate 1→0, or the next cycle's start when `gap` is 0): the
//!   last recorded step ended → `on_window_end`, collectors drained, files and
//!   meta.json written, directory renamed; collectors disarmed unless the next
//!   cycle is at most two steps away.
use std::{
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Result;
use dynprof_common::{PlanConfig, role};
use serde::Serialize;
use serde_json::json;

use super::{
    collector::{Collector, WindowHook, WindowInfo},
    meta::{
        BoundaryMeta, CollectorsMeta, KernelPlanMeta, MemoryMeta, PlanMeta, StepMeta, TargetMeta,
        WindowMeta,
    },
    profdir::ProfDir,
    state::{Action, Boundary, OpenSteps, PlanRegister, WindowState},
    trigger::{
        ConsoleRequest, NoticePrinter, PlanRequest, Reply, SessionCommand, Source,
        config_file::{ConfigChanged, ConfigFileTrigger},
    },
    writer::{WriteJob, WriteTag, Writer, Written},
};
use crate::{
    bpf::Kernel,
    output::{
        Collectors,
        model::{Drops, StepSpan, WindowData},
    },
    probes::ResolvedProbe,
    session::{CompletedStep, Ctx, Decoded, EndReason, Observer},
    sys::hostfs::OutputRoot,
    target::Target,
    types::{Builtin, StepIndex, WindowId},
};

mod arm;
mod close;
mod observer;

use arm::{BEGIN_ARM_STEPS, late_start};

pub struct SchedulerOptions {
    /// Default output directory for `PROF_*` windows.
    pub output: PathBuf,
    /// End the session when the flags plan is done.
    pub exit_when_done: bool,
    /// Console mode: detach after this long without a command or window.
    pub idle_timeout: Option<Duration>,
    /// Print window notices as JSON lines on stdout.
    pub json: bool,
    /// Collectors for plans that do not name theirs (`--collect`); `None` = all.
    pub collect: Option<Vec<Builtin>>,
    /// `--chown`: who finished windows are handed to.
    pub chown: Option<super::profdir::Owner>,
}

/// One window written to disk.
#[derive(Clone, Debug, Serialize)]
pub struct WindowRecord {
    pub id: WindowId,
    pub dir: PathBuf,
    pub complete: bool,
    pub incomplete_reason: Option<String>,
    pub first_recorded: Option<StepIndex>,
    pub last_recorded: Option<StepIndex>,
}

/// The open window's files and what it gathered (its steps are in
/// [`WindowState`]).
struct OpenWindow {
    open_ts_ns: u64,
    last_ts_ns: u64,
    boundaries: Vec<(u64, u64)>,
    steps: Vec<StepSpan>,
    prof: ProfDir,
    drops_at_open: Drops,
    collectors: Vec<usize>,
    started_at: String,
    req: PlanRequest,
    info: WindowInfo,
    /// Collectors the window asked for that could not be armed.
    errors: Vec<String>,
}

/// Where a step boundary's actions are carried out.
#[derive(Clone, Copy)]
struct At<'a> {
    k: u64,
    ts: u64,
    completed: Option<&'a CompletedStep>,
}

impl PlanRegister for Kernel {
    fn step_hits(&mut self) -> Result<u64> {
        Ok(self.state()?.step_hits())
    }
    fn set_plan(&mut self, cfg: PlanConfig) -> Result<()> {
        Kernel::set_plan(self, cfg)
    }
}

pub struct Scheduler {
    opts: SchedulerOptions,
    collectors: Vec<Box<dyn Collector>>,
    /// Per collector: `None` while disarmed, else the first step whose
    /// start came after it was armed (step hits then + 1). A window whose
    /// first recorded step is earlier lacks that collector's data for the
    /// steps between, and says so.
    armed: Vec<Option<u64>>,
    /// Why each collector's last arming failed (cleared when it arms): a
    /// window that asked for it records the reason and is not complete.
    arm_error: Vec<Option<String>>,
    hooks: Vec<Box<dyn WindowHook>>,
    /// Plans, the open window's steps, the deferred request.
    state: WindowState,
    window: Option<OpenWindow>,
    written: Vec<WindowRecord>,
    prepared: bool,
    /// Collectors' [`Collector::prepare`] ran (on the session's first tick
    /// or event).
    collectors_prepared: bool,
    last_activity: Instant,
    config: Option<ConfigFileTrigger>,
    printer: Option<NoticePrinter>,
    /// The session's target (known from `begin` or the first callback).
    target: Option<Target>,
    /// Steps per second, as of the last step event.
    rate: f64,
    /// Publishes closed windows off the event loop (started on first use).
    writer: Option<Writer>,
    /// `opts.output`, validated and held open (see [`crate::sys::hostfs`]).
    root: Option<OutputRoot>,
    /// Windows that were asked for but could not be written (exit code).
    failures: Arc<AtomicUsize>,
    /// Aux markers attached only while a window is planned or open (they
    /// are uprobe traps on every idle step otherwise): attached when a plan
    /// is submitted, before its kernel plan is programmed (so even a window
    /// at the next boundary counts them from its first step), and for later
    /// cycles with the collectors, ahead of the boundary that opens the
    /// window; detached with the collectors.
    window_markers: Vec<ResolvedProbe>,
    /// Why the window markers could not be attached, if they could not.
    markers_error: Option<String>,
    /// The first step whose start they were attached before (step hits
    /// after attaching + 1): earlier steps' aux counts are short.
    markers_live_from: Option<u64>,
}

impl Scheduler {
    pub fn new(opts: SchedulerOptions) -> Self {
        Self {
            state: WindowState::new(opts.exit_when_done),
            opts,
            collectors: Vec::new(),
            armed: Vec::new(),
            arm_error: Vec::new(),
            hooks: Vec::new(),
            window: None,
            written: Vec::new(),
            prepared: false,
            collectors_prepared: false,
            last_activity: Instant::now(),
            config: None,
            printer: None,
            target: None,
            rate: 0.0,
            writer: None,
            root: None,
            failures: Arc::new(AtomicUsize::new(0)),
            window_markers: Vec::new(),
            markers_error: None,
            markers_live_from: None,
        }
    }

    /// Hands the scheduler the markers to attach only around windows (the
    /// aux markers); the caller attaches the rest. Call before [`begin`],
    /// which attaches them at once if the flags plan starts within reach.
    ///
    /// [`begin`]: Scheduler::begin
    pub fn set_window_markers(&mut self, probes: Vec<ResolvedProbe>) {
        self.window_markers = probes;
    }

    /// Counts windows that were asked for but could not be written; read it
    /// after the session to choose the exit code.
    pub fn failures(&self) -> Arc<AtomicUsize> {
        Arc::clone(&self.failures)
    }

    /// The output root, validated on first use: a path through a symlink or
    /// a directory another user could change is refused here.
    fn root(&mut self) -> Result<&OutputRoot> {
        if self.root.is_none() {
            self.root = Some(OutputRoot::open(&self.opts.output)?);
        }
        Ok(self.root.as_ref().expect("just set"))
    }

    /// Registers a collector; plans arm it when their `collect` list names it
    /// (or always, when the list is `None`).
    pub fn add_collector(&mut self, c: Box<dyn Collector>) {
        self.collectors.push(c);
        self.armed.push(None);
        self.arm_error.push(None);
    }

    /// Registers a hook; it is driven at every window's boundaries.
    pub fn add_hook(&mut self, h: Box<dyn WindowHook>) {
        self.hooks.push(h);
    }

    /// Installs the config-file trigger (it logs through the scheduler's
    /// decisions: each change took effect, was deferred, or was refused).
    pub fn set_config_trigger(&mut self, c: ConfigFileTrigger) {
        self.config = Some(c);
    }

    /// Starts the config-file watcher thread (if a config trigger is set).
    pub fn spawn_config_watcher(
        &self,
        tx: tokio::sync::mpsc::UnboundedSender<SessionCommand>,
    ) -> Result<()> {
        match &self.config {
            Some(c) => c.spawn_watcher(tx),
            None => Ok(()),
        }
    }

    /// Call before the session runs (ideally before the markers are
    /// attached): prepares hooks and programs the flags plan, if any.
    pub fn begin(
        &mut self,
        kernel: &mut Kernel,
        target: &Target,
        initial: Option<PlanRequest>,
    ) -> Result<()> {
        self.remember_target(target);
        // Before anything is attached: a bad --output is a startup error.
        self.root()?;
        self.prepare_hooks(target);
        if let Some(req) = initial {
            // Before the plan, as for every submitted plan (a launched
            // target is still stopped here). The step rate is not known
            // yet: a window this close is armed for now.
            self.attach_window_markers(kernel);
            self.arm_before(kernel, &req.plan, req.collect.as_ref(), BEGIN_ARM_STEPS);
            let mut out = Vec::new();
            let r = self.state.submit(req, kernel, self.lead(), &mut out);
            self.carry_out(out, kernel, target, None)?;
            self.notice(r?);
        }
        Ok(())
    }

    fn remember_target(&mut self, t: &Target) {
        if self.target.is_none() {
            self.target = Some(t.clone());
        }
    }

    fn prepare_hooks(&mut self, target: &Target) {
        if self.prepared {
            return;
        }
        self.prepared = true;
        for h in &mut self.hooks {
            if let Err(e) = h.prepare(target) {
                log::warn!("hook {}: prepare failed: {e:#}", h.name());
            }
        }
    }

    /// Not in [`Self::begin`]: that runs before capabilities are dropped,
    /// and a collector's prepare may start a thread, which must not exist
    /// then (the drop reaches the threads that exist; one started in
    /// between would keep every capability). The session runs after it.
    fn prepare_collectors(&mut self, target: &Target) {
        if self.collectors_prepared {
            return;
        }
        self.collectors_prepared = true;
        for c in &mut self.collectors {
            c.prepare(target);
        }
        // The writer thread too, now (the session's start) rather than at
        // the first window's close: on a CPU the job keeps busy, starting a
        // thread there held the event loop for 2–3 ms (a slice of the job's
        // thread), late for the boundaries after it (bench section 3). A
        // failure is reported at the close.
        if let Err(e) = self.writer_mut() {
            log::debug!("window writer not started yet: {e:#}");
        }
    }

    fn writer_mut(&mut self) -> Result<&mut Writer> {
        if self.writer.is_none() {
            self.writer = Some(Writer::spawn()?);
        }
        Ok(self.writer.as_mut().expect("just set"))
    }

    /// Reports the windows the writer has published (all of them, waiting,
    /// when `wait`).
    fn report_written(&mut self, wait: bool) {
        let Some(wr) = self.writer.as_mut() else {
            return;
        };
        let done = if wait { wr.wait_all() } else { wr.finished() };
        for Written { id, tag, result } in done {
            let msg = match result {
                Ok(rec) => {
                    let steps_txt = match (rec.first_recorded, rec.last_recorded) {
                        (Some(a), Some(b)) => format!("steps {a}..{b}"),
                        _ => "no steps".into(),
                    };
                    let msg = if rec.complete {
                        format!("window {id} written: {} ({steps_txt})", rec.dir.display())
                    } else {
                        format!(
                            "window {id} written INCOMPLETE ({}): {} ({steps_txt})",
                            rec.incomplete_reason.as_deref().unwrap_or("?"),
                            rec.dir.display()
                        )
                    };
                    if self.opts.json {
                        println!("{}", json!({ "event": "window", "window": rec }));
                    }
                    self.written.push(rec);
                    msg
                }
                Err(e) => {
                    self.failures.fetch_add(1, Ordering::Relaxed);
                    let m = format!("window {id} could not be written: {e:#}");
                    log::error!("{m}");
                    m
                }
            };
            if let Some(c) = &mut self.config
                && tag.from_config_file
            {
                c.window_written(tag.change, &msg);
            }
            self.notice(msg);
            self.last_activity = Instant::now();
        }
    }

    fn notice(&mut self, msg: String) {
        if msg.is_empty() {
            return;
        }
        match &mut self.printer {
            Some(p) => p(msg),
            None => eprintln!("dynprof: {msg}"),
        }
    }

    /// Carries out what the window state decided, in order. `at`: the step
    /// boundary being handled, if any.
    fn carry_out(
        &mut self,
        actions: Vec<Action>,
        kernel: &mut Kernel,
        target: &Target,
        at: Option<At<'_>>,
    ) -> Result<()> {
        let mut queue: std::collections::VecDeque<Action> = actions.into();
        while let Some(a) = queue.pop_front() {
            match a {
                Action::Arm { collect } => self.arm(kernel, collect.as_ref()),
                Action::DisarmAll => self.disarm_all(kernel),
                Action::Record => {
                    if let (
                        Some(w),
                        Some(At {
                            completed: Some(c), ..
                        }),
                    ) = (&mut self.window, at)
                    {
                        w.steps.push(StepSpan {
                            step: c.step,
                            start_ts_ns: c.start_ts_ns,
                            end_ts_ns: c.end_ts_ns,
                            tid: c.tid,
                            aux: c.aux.iter().map(|(k, v)| (k.clone(), *v)).collect(),
                        });
                    }
                }
                Action::Boundary => {
                    if let (Some(w), Some(at)) = (&mut self.window, at) {
                        w.boundaries.push((at.k, at.ts));
                        w.last_ts_ns = at.ts;
                    }
                }
                Action::StartHooks => {
                    if let (Some(w), Some(at)) = (&mut self.window, at) {
                        w.info.start_ts_ns = at.ts;
                        let info = w.info.clone();
                        for h in &mut self.hooks {
                            if let Err(e) = h.on_window_start(&info, target) {
                                log::warn!("hook {}: window start: {e:#}", h.name());
                            }
                        }
                    }
                }
                Action::Close {
                    steps,
                    complete,
                    reason,
                    end_ts_ns,
                    disarm,
                    kernel: cfg,
                } => {
                    if let Some(w) = &mut self.window
                        && end_ts_ns != 0
                    {
                        w.info.end_ts_ns = end_ts_ns;
                    }
                    self.close_window(&steps, complete, reason, disarm, cfg, kernel, target)?;
                }
                Action::Open {
                    steps,
                    req,
                    start_hooks,
                } => {
                    let (k, ts) = at.map(|a| (a.k, a.ts)).unwrap_or_default();
                    if let Err(e) =
                        self.open_window(&steps, *req, start_hooks, k, ts, kernel, target)
                    {
                        // E.g. an unwritable output directory: give up this
                        // plan, keep the session (and other triggers) alive.
                        self.failures.fetch_add(1, Ordering::Relaxed);
                        let m = format!("window could not be opened, plan cancelled: {e:#}");
                        log::error!("{m}");
                        if let Some(c) = &mut self.config {
                            c.error(&m);
                        }
                        self.notice(m);
                        let mut more = Vec::new();
                        self.state.open_failed(kernel, &mut more);
                        for a in more.into_iter().rev() {
                            queue.push_front(a);
                        }
                    }
                }
                Action::Answered { change, ok, msg } => {
                    if let Some(c) = &mut self.config {
                        c.monitor_result(change, ok, &msg);
                    }
                    self.notice(msg);
                }
                Action::Notice(m) => self.notice(m),
            }
        }
        Ok(())
    }

    /// A step boundary: the window state decides, this carries it out.
    fn on_step(
        &mut self,
        k: u64,
        ts: u64,
        gate: bool,
        completed: Option<&CompletedStep>,
        ctx: &mut Ctx,
    ) -> Result<()> {
        self.rate = ctx.clock.rate();
        let b = Boundary {
            k,
            ts_ns: ts,
            gate,
            completed: completed.map(|c| c.step.0),
            lead: self.lead(),
            now: ctx.clock.current().0,
        };
        let mut out = Vec::new();
        self.state.on_step(b, ctx.kernel, &mut out);
        self.carry_out(out, ctx.kernel, ctx.target, Some(At { k, ts, completed }))
    }

    #[allow(clippy::too_many_arguments)]
    fn open_window(
        &mut self,
        steps: &OpenSteps,
        req: PlanRequest,
        start_hooks: bool,
        k: u64,
        ts: u64,
        kernel: &mut Kernel,
        target: &Target,
    ) -> Result<()> {
        let id = steps.id;
        let base = steps.first_step;
        let chown = self.opts.chown;
        let root = self.root()?;
        // A config file's `prof_dir` was confined to a relative path below
        // the root when it was parsed; no symlink is followed here either.
        let parent = match &req.output {
            Some(rel) => root.subdir(rel)?,
            None => root.dir().try_clone()?,
        };
        let mut prof = ProfDir::create(&parent, target.host_pid, id)?;
        prof.set_owner(chown);
        if k != base {
            log::warn!(
                "window {id}: the boundary of step {base} was not seen (lost event?); opened at step {k}"
            );
        }
        let info = WindowInfo {
            id,
            first_step: StepIndex(base),
            first_recorded: StepIndex(steps.first_recorded),
            open_ts_ns: ts,
            start_ts_ns: if start_hooks { ts } else { 0 },
            end_ts_ns: 0,
            dir: prof.tmp.clone(),
        };
        let collectors: Vec<usize> = (0..self.collectors.len())
            .filter(|i| self.armed[*i].is_some())
            .collect();
        // A collector the window asked for that is not armed: its data is
        // missing, and the window must not pass for complete.
        let mut errors: Vec<String> = self
            .collector_indices(req.collect.as_ref())
            .into_iter()
            .filter_map(|i| match self.armed[i] {
                None => Some(self.arm_error[i].clone().unwrap_or_else(|| {
                    format!("collector {} was not armed", self.collectors[i].name())
                })),
                Some(from) => late_start(
                    &format!("collector {}", self.collectors[i].name()),
                    from,
                    steps,
                ),
            })
            .collect();
        // Its steps' aux columns would be short.
        errors.extend(self.markers_error.clone());
        if let Some(from) = self.markers_live_from {
            errors.extend(late_start("the aux markers", from, steps));
        }
        let w = OpenWindow {
            open_ts_ns: ts,
            last_ts_ns: ts,
            boundaries: vec![(k, ts)],
            steps: Vec::new(),
            prof,
            drops_at_open: kernel.drops().unwrap_or_default(),
            collectors,
            started_at: crate::sys::clock::local_timestamp_human(),
            req,
            info,
            errors,
        };
        if start_hooks {
            for h in &mut self.hooks {
                if let Err(e) = h.on_window_start(&w.info, target) {
                    log::warn!("hook {}: window start: {e:#}", h.name());
                }
            }
        }
        self.window = Some(w);
        Ok(())
    }
}
