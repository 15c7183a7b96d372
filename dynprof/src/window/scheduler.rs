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
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Result;
use dynprof_common::{PlanConfig, role};
use serde::Serialize;
use serde_json::{Map, Value, json};

use super::{
    Plan,
    profdir::ProfDir,
    writer::{WriteJob, WriteTag, Writer, Written},
};
use crate::{
    bpf::Kernel,
    collect::{Collector, WindowHook, WindowInfo},
    output::{
        Collectors,
        model::{Drops, StepSpan, WindowData},
    },
    session::{CompletedStep, Ctx, Decoded, EndReason, Observer},
    sys::hostfs::OutputRoot,
    target::Target,
    trigger::{
        ConsoleCommand, ConsoleRequest, NoticePrinter, PlanRequest, Reply, SetNoticePrinter,
        Source,
        config_file::{ConfigChanged, ConfigFileTrigger},
    },
    types::{StepIndex, WindowId},
};

/// Arm collectors when the window is at most this many boundaries away
/// (the kernel wakes us for exactly these hits)…
const ARM_AHEAD: u64 = super::WAKE_LEAD;
/// …or this many seconds away at the current step rate, whichever is more
/// (attaching the API uprobes and perf events takes a few milliseconds).
const ARM_AHEAD_S: f64 = 0.5;

/// Steps ahead of a window at which its collectors are armed.
fn arm_ahead(rate: f64) -> u64 {
    let by_time = if rate.is_finite() && rate > 0.0 {
        (rate * ARM_AHEAD_S).ceil() as u64
    } else {
        0
    };
    ARM_AHEAD.max(by_time.min(10_000))
}

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
    pub collect: Option<Vec<String>>,
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

struct ActivePlan {
    req: PlanRequest,
    cfg: PlanConfig,
    /// Last step inside the window once `stop` fixed it (open-ended plans).
    stop_last: Option<u64>,
    /// No more cycles after the current window (stopped).
    final_cycle: bool,
}

impl ActivePlan {
    fn cycles(&self) -> u64 {
        self.req.plan.repeat.saturating_add(1)
    }
    fn cycle_start(&self, cycle: u64) -> u64 {
        self.cfg
            .start
            .saturating_add(cycle.saturating_mul(self.cfg.period))
    }
}

struct OpenWindow {
    id: WindowId,
    cycle: u64,
    first_step: u64,
    first_recorded: u64,
    /// Planned last recorded step (u64::MAX while open-ended).
    last_recorded: u64,
    open_ts_ns: u64,
    last_ts_ns: u64,
    boundaries: Vec<(u64, u64)>,
    steps: Vec<StepSpan>,
    prof: ProfDir,
    hooks_started: bool,
    drops_at_open: Drops,
    collectors: Vec<usize>,
    started_at: String,
    req: PlanRequest,
    info: WindowInfo,
}

pub struct Scheduler {
    opts: SchedulerOptions,
    collectors: Vec<Box<dyn Collector>>,
    armed: Vec<bool>,
    hooks: Vec<Box<dyn WindowHook>>,
    plan: Option<ActivePlan>,
    window: Option<OpenWindow>,
    /// A request that arrived while a window was open: applied when it ends.
    deferred: Option<PlanRequest>,
    next_id: u32,
    written: Vec<WindowRecord>,
    done: bool,
    quit: bool,
    prepared: bool,
    last_activity: Instant,
    config: Option<ConfigFileTrigger>,
    printer: Option<NoticePrinter>,
    /// Collector names armed for the current plan (for `Collectors`).
    plan_collectors: Vec<usize>,
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
}

impl Scheduler {
    pub fn new(opts: SchedulerOptions) -> Self {
        Self {
            opts,
            collectors: Vec::new(),
            armed: Vec::new(),
            hooks: Vec::new(),
            plan: None,
            window: None,
            deferred: None,
            next_id: 1,
            written: Vec::new(),
            done: false,
            quit: false,
            prepared: false,
            last_activity: Instant::now(),
            config: None,
            printer: None,
            plan_collectors: Vec::new(),
            target: None,
            rate: 0.0,
            writer: None,
            root: None,
            failures: Arc::new(AtomicUsize::new(0)),
        }
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
        self.armed.push(false);
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
        tx: tokio::sync::mpsc::UnboundedSender<crate::session::Command>,
    ) -> Result<()> {
        match &self.config {
            Some(c) => c.spawn_watcher(tx),
            None => Ok(()),
        }
    }

    /// Windows written so far.
    pub fn written(&self) -> &[WindowRecord] {
        &self.written
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
            let msg = self.submit(req, kernel)?;
            self.notice(msg);
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

    fn collector_indices(&self, req: &PlanRequest) -> Vec<usize> {
        (0..self.collectors.len())
            .filter(
                |i| match req.collect.as_ref().or(self.opts.collect.as_ref()) {
                    None => true,
                    Some(names) => names.iter().any(|n| n == self.collectors[*i].name()),
                },
            )
            .collect()
    }

    /// Programs a request now (or defers it while a window is open).
    fn submit(&mut self, req: PlanRequest, kernel: &mut Kernel) -> Result<String> {
        req.plan.validate()?;
        if let Some(w) = &self.window {
            let msg = format!(
                "window {} is open; the new plan ({}) starts when it ends (a later change replaces it)",
                w.id,
                req.plan.describe()
            );
            self.deferred = Some(req);
            return Ok(msg);
        }
        self.program_now(req, kernel)
    }

    fn program_now(&mut self, req: PlanRequest, kernel: &mut Kernel) -> Result<String> {
        if req.plan.start_step == 0 {
            // "no collection": cancel whatever is pending.
            self.cancel_plan(kernel);
            return Ok("start_step 0: no collection planned".into());
        }
        if self.plan.is_some() {
            self.cancel_plan(kernel);
        }
        let cfg = super::program(kernel, &req.plan)?;
        let c = kernel.state()?.step_hits;
        let p = &req.plan;
        let msg = if p.open_ended() {
            format!("window opens at step {} and runs until `stop`", cfg.start)
        } else {
            let first = cfg.start + p.warmup;
            let mut m = format!("window records steps {}..{}", first, first + p.active - 1);
            if p.warmup > 0 {
                m.push_str(&format!(" (warmup from step {})", cfg.start));
            }
            if p.repeat > 0 {
                m.push_str(&format!(
                    ", {} more time(s) every {} steps",
                    p.repeat, cfg.period
                ));
            }
            if p.start_step > 0 && cfg.start != p.start_step as u64 {
                m.push_str(&format!(" (step {} had already begun)", p.start_step));
            }
            m
        };
        self.plan_collectors = self.collector_indices(&req);
        self.plan = Some(ActivePlan {
            req,
            cfg,
            stop_last: None,
            final_cycle: false,
        });
        if cfg.start <= c + arm_ahead(self.rate) {
            self.arm(kernel);
        }
        Ok(msg)
    }

    fn cancel_plan(&mut self, kernel: &mut Kernel) {
        if self.plan.take().is_some()
            && let Err(e) = super::disarm(kernel)
        {
            log::warn!("disarming the kernel plan: {e:#}");
        }
        if self.window.is_none() {
            self.disarm_all(kernel);
        }
    }

    fn arm(&mut self, kernel: &mut Kernel) {
        let Some(target) = self.target.clone() else {
            return;
        };
        for i in self.plan_collectors.clone() {
            if self.armed[i] {
                continue;
            }
            match self.collectors[i].arm(kernel, &target) {
                Ok(()) => self.armed[i] = true,
                Err(e) => {
                    let msg = format!(
                        "collector {} could not be armed: {e:#}",
                        self.collectors[i].name()
                    );
                    log::warn!("{msg}");
                    if let Some(c) = &mut self.config {
                        c.error(&msg);
                    }
                }
            }
        }
    }

    fn disarm_all(&mut self, kernel: &mut Kernel) {
        for (i, c) in self.collectors.iter_mut().enumerate() {
            if self.armed[i] {
                c.disarm(kernel);
                self.armed[i] = false;
            }
        }
    }

    fn status(&self, ctx: &Ctx) -> String {
        let c = ctx.clock;
        let mut s = format!(
            "steps seen {} (current step {}), {:.2} steps/s; ",
            c.steps_seen,
            c.current(),
            c.rate()
        );
        match (&self.window, &self.plan) {
            (Some(w), _) => {
                let last = if w.last_recorded == u64::MAX {
                    "until stop".into()
                } else {
                    w.last_recorded.to_string()
                };
                s.push_str(&format!(
                    "window {} open since step {} (recording {}..{}, {} recorded so far)",
                    w.id,
                    w.first_step,
                    w.first_recorded,
                    last,
                    w.steps.len()
                ));
            }
            (None, Some(p)) => {
                s.push_str(&format!("window pending: opens at step {}", p.cfg.start))
            }
            (None, None) => s.push_str("no window"),
        }
        s.push_str(&format!("; windows written {}", self.written.len()));
        if let Some(last) = self.written.last() {
            s.push_str(&format!(" (last: {})", last.dir.display()));
        }
        s
    }

    fn console(&mut self, req: ConsoleRequest, ctx: &mut Ctx) -> String {
        self.last_activity = Instant::now();
        let r: Result<String> = (|| match req {
            ConsoleRequest::Status => Ok(self.status(ctx)),
            ConsoleRequest::Start | ConsoleRequest::Capture(_) => {
                if let Some(w) = &self.window {
                    return Ok(format!(
                        "window {} is already open (since step {}); `stop` it first",
                        w.id, w.first_step
                    ));
                }
                if let Some(p) = &self.plan {
                    return Ok(format!(
                        "a window is already pending (opens at step {}); `stop` cancels it",
                        p.cfg.start
                    ));
                }
                let plan = match req {
                    ConsoleRequest::Capture(p) => p,
                    _ => Plan {
                        start_step: -1,
                        warmup: 0,
                        active: super::UNTIL_STOP,
                        repeat: 0,
                        gap: 0,
                    },
                };
                self.submit(PlanRequest::new(plan, Source::Console), ctx.kernel)
            }
            ConsoleRequest::Stop => self.stop(ctx.kernel),
            ConsoleRequest::Quit => {
                self.quit = true;
                if self.window.is_some() {
                    let m = self.stop(ctx.kernel)?;
                    Ok(format!("{m}; detaching after it is written"))
                } else {
                    self.cancel_plan(ctx.kernel);
                    self.done = true;
                    Ok("detaching; the target keeps running".into())
                }
            }
        })();
        r.unwrap_or_else(|e| format!("error: {e:#}"))
    }

    /// Closes the open window at the next boundary, or cancels a pending plan.
    fn stop(&mut self, kernel: &mut Kernel) -> Result<String> {
        self.deferred = None;
        let Some(p) = &mut self.plan else {
            return Ok("no window open or pending".into());
        };
        let Some(w) = &mut self.window else {
            self.cancel_plan(kernel);
            return Ok("pending window cancelled".into());
        };
        let (cfg, last) = super::program_stop(kernel, p.cfg)?;
        p.cfg = cfg;
        p.stop_last = Some(last);
        p.final_cycle = true;
        if last < w.last_recorded {
            w.last_recorded = last;
        }
        Ok(format!(
            "window {} closes at the next boundary (step {})",
            w.id,
            last + 1
        ))
    }

    fn on_step(
        &mut self,
        k: u64,
        ts: u64,
        gate: bool,
        completed: Option<&CompletedStep>,
        ctx: &mut Ctx,
    ) -> Result<()> {
        self.rate = ctx.clock.rate();
        // 1. the open window: collect the step that just ended, then close.
        let mut close = false;
        if let Some(w) = &mut self.window {
            if let Some(c) = completed
                && c.step.0 >= w.first_recorded
                && c.step.0 <= w.last_recorded
            {
                w.steps.push(StepSpan {
                    step: c.step,
                    start_ts_ns: c.start_ts_ns,
                    end_ts_ns: c.end_ts_ns,
                    tid: c.tid,
                    aux: c.aux.iter().map(|(k, v)| (k.clone(), *v)).collect(),
                });
            }
            if k >= w.first_step {
                w.boundaries.push((k, ts));
                w.last_ts_ns = ts;
            }
            if k > w.last_recorded || (!gate && k > w.first_step) {
                if k <= w.last_recorded {
                    // The kernel closed the gate earlier than planned (stop).
                    w.last_recorded = k.saturating_sub(1);
                }
                w.info.end_ts_ns = ts;
                close = true;
            } else if k >= w.first_recorded && !w.hooks_started {
                w.hooks_started = true;
                w.info.start_ts_ns = ts;
                let info = w.info.clone();
                for h in &mut self.hooks {
                    if let Err(e) = h.on_window_start(&info, ctx.target) {
                        log::warn!("hook {}: window start: {e:#}", h.name());
                    }
                }
            }
        }
        if close {
            self.close_window(true, None, ctx)?;
        }
        // 2. a new window opens where the kernel opened the gate.
        if self.window.is_none()
            && gate
            && let Some(p) = &self.plan
        {
            let cfg = p.cfg;
            // Before `start`: a stale plan write opened the gate early.
            if k >= cfg.start && k < cfg.end && (k - cfg.start) % cfg.period < cfg.span {
                let cycle = (k - cfg.start) / cfg.period;
                let base = cfg.start + cycle * cfg.period;
                if let Err(e) = self.open_window(cycle, base, k, ts, ctx) {
                    // E.g. an unwritable output directory: give up this
                    // plan, keep the session (and other triggers) alive.
                    self.failures.fetch_add(1, Ordering::Relaxed);
                    let m = format!("window could not be opened, plan cancelled: {e:#}");
                    log::error!("{m}");
                    if let Some(c) = &mut self.config {
                        c.error(&m);
                    }
                    self.notice(m);
                    self.cancel_plan(ctx.kernel);
                    if self.opts.exit_when_done {
                        self.done = true;
                    }
                }
            }
        }
        // 3. arm ahead of the next window.
        if self.window.is_none()
            && let Some(p) = &self.plan
        {
            let next = ((k.saturating_sub(p.cfg.start)) / p.cfg.period
                + u64::from(k >= p.cfg.start))
            .min(p.cycles());
            if next < p.cycles() && p.cycle_start(next) <= k + arm_ahead(self.rate) {
                self.arm(ctx.kernel);
            }
        }
        Ok(())
    }

    fn open_window(&mut self, cycle: u64, base: u64, k: u64, ts: u64, ctx: &mut Ctx) -> Result<()> {
        let p = self.plan.as_ref().expect("plan");
        let req = p.req.clone();
        let stop_last = p.stop_last;
        // Make sure collectors are armed (a window at the next boundary).
        self.arm(ctx.kernel);
        let id = WindowId(self.next_id);
        self.next_id += 1;
        let chown = self.opts.chown;
        let root = self.root()?;
        // A config file's `prof_dir` was confined to a relative path below
        // the root when it was parsed; no symlink is followed here either.
        let parent = match &req.output {
            Some(rel) => root.subdir(rel)?,
            None => root.dir().try_clone()?,
        };
        let mut prof = ProfDir::create(&parent, ctx.target.host_pid, id)?;
        prof.set_owner(chown);
        let first_recorded = base + req.plan.warmup;
        let last_recorded = match stop_last {
            Some(l) => l,
            None if req.plan.open_ended() => u64::MAX,
            None => first_recorded + req.plan.active - 1,
        };
        if k != base {
            log::warn!(
                "window {id}: the boundary of step {base} was not seen (lost event?); opened at step {k}"
            );
        }
        let info = WindowInfo {
            id,
            first_step: StepIndex(base),
            first_recorded: StepIndex(first_recorded),
            open_ts_ns: ts,
            start_ts_ns: if k >= first_recorded { ts } else { 0 },
            end_ts_ns: 0,
            dir: prof.tmp.clone(),
        };
        let collectors: Vec<usize> = (0..self.collectors.len())
            .filter(|i| self.armed[*i])
            .collect();
        let mut w = OpenWindow {
            id,
            cycle,
            first_step: base,
            first_recorded,
            last_recorded,
            open_ts_ns: ts,
            last_ts_ns: ts,
            boundaries: vec![(k, ts)],
            steps: Vec::new(),
            prof,
            hooks_started: false,
            drops_at_open: ctx.kernel.drops().unwrap_or_default(),
            collectors,
            started_at: super::profdir::local_timestamp_human(),
            req,
            info,
        };
        if k >= first_recorded {
            w.hooks_started = true;
            for h in &mut self.hooks {
                if let Err(e) = h.on_window_start(&w.info, ctx.target) {
                    log::warn!("hook {}: window start: {e:#}", h.name());
                }
            }
        }
        self.window = Some(w);
        Ok(())
    }

    /// Finalizes the open window: hooks, collectors, files, meta.json, rename.
    fn close_window(
        &mut self,
        complete: bool,
        reason: Option<String>,
        ctx: &mut Ctx,
    ) -> Result<()> {
        let Some(w) = self.window.take() else {
            return Ok(());
        };
        let mut complete = complete;
        let mut reason = reason;
        let mut errors: Vec<String> = Vec::new();

        let mut hooks_meta = Map::new();
        if w.hooks_started {
            for h in &mut self.hooks {
                match h.on_window_end(&w.info, ctx.target) {
                    Ok(v) => {
                        hooks_meta.insert(h.name().to_string(), v);
                    }
                    Err(e) => {
                        let m = format!("hook {}: {e:#}", h.name());
                        hooks_meta.insert(h.name().to_string(), json!({ "error": m }));
                        errors.push(m);
                    }
                }
            }
        }

        let (start_ts, end_ts) = match (w.steps.first(), w.steps.last()) {
            (Some(a), Some(b)) => (a.start_ts_ns, b.end_ts_ns),
            _ => (w.last_ts_ns, w.last_ts_ns),
        };
        let mut data = WindowData {
            steps: w.steps.clone(),
            process_name: ctx.target.comm.clone(),
            host_pid: ctx.target.host_pid.0,
            thread_names: thread_names(ctx.target),
            ..WindowData::default()
        };
        // What comes next for the plan?
        let mut plan_done = true;
        if let Some(p) = &self.plan {
            plan_done = p.final_cycle || w.cycle + 1 >= p.cycles();
        }
        // The kernel gate is already closed. What only the kernel holds is
        // taken now, then the probes are detached (unless the next cycle is
        // too close to re-attach), before the events are symbolized and the
        // files written: a probe on sched_switch costs every task on the
        // host, and the window is over.
        for &i in &w.collectors {
            self.collectors[i].seal(start_ts, end_ts, ctx.kernel);
        }
        let k_now = ctx.clock.current().0;
        if plan_done {
            self.plan = None;
            self.disarm_all(ctx.kernel);
        } else if let Some(p) = &self.plan
            && p.cycle_start(w.cycle + 1) > k_now + arm_ahead(self.rate) + 1
        {
            self.disarm_all(ctx.kernel);
        }

        let mut ran = Collectors::NONE;
        for &i in &w.collectors {
            let c = &mut self.collectors[i];
            match c.name() {
                "api" => ran.api = true,
                "cpu" => ran.cpu = true,
                "offcpu" => ran.offcpu = true,
                _ => {}
            }
            if let Err(e) = c.drain_into(start_ts, end_ts, &mut data, ctx.kernel) {
                errors.push(format!("collector {}: {e:#}", c.name()));
            }
        }
        // Collectors filled their own drop slots, counted from their arm
        // (the gate still closed), which is exact even when the open event
        // was read late; the window counts only the step markers' losses.
        let drops_now = ctx.kernel.drops().unwrap_or_default();
        data.drops.step = drops_delta(&drops_now, &w.drops_at_open).step;
        let over = &data.budget.dropped_over_budget;
        if over.total() > 0 {
            let m = format!(
                "window {}: too dense for --memory-budget {} MiB: kept {} events, dropped {} past the cap (api {}, cpu {}, offcpu {}); see meta.json `memory`",
                w.id,
                data.budget.budget_bytes >> 20,
                data.budget.events_cap,
                over.total(),
                over.api,
                over.cpu,
                over.offcpu
            );
            log::warn!("{m}");
        }

        if w.steps.is_empty() && complete {
            complete = false;
            reason = Some(if w.last_recorded < w.first_recorded {
                "stopped before any step was recorded".into()
            } else {
                "no step was recorded".into()
            });
        }
        if !errors.is_empty() && complete {
            complete = false;
            reason = Some(errors.join("; "));
        }
        let mut meta = self.meta(
            &w,
            &data,
            &ran,
            complete,
            reason.as_deref(),
            &errors,
            hooks_meta,
            ctx.target,
        );
        // Who held the USDT semaphores (kernel or the /proc/PID/mem fallback).
        meta["usdt_semaphores"] =
            serde_json::to_value(ctx.kernel.semaphore_report()).unwrap_or_default();
        // The kernel's release and the paths taken on it (docs/portability.md).
        meta["kernel"] = serde_json::to_value(ctx.kernel.paths()).unwrap_or_default();
        // Files are written off the event loop; the notice follows on a tick.
        let job = WriteJob {
            id: w.id,
            first: w.steps.first().map(|s| s.step),
            last: w.steps.last().map(|s| s.step),
            prof: w.prof,
            data,
            ran,
            meta,
            complete,
            reason,
            tag: WriteTag {
                from_config_file: w.req.source == Source::ConfigFile,
                change: w.req.change,
            },
        };
        self.writer_mut()?.submit(job);
        self.last_activity = Instant::now();

        // A change that arrived during the window applies now (last one wins).
        if plan_done {
            if let Some(req) = self.deferred.take() {
                let change = req.change;
                let r = self.program_now(req, ctx.kernel);
                let m = match &r {
                    Ok(m) => format!("deferred plan applied: {m}"),
                    Err(e) => format!("deferred plan refused: {e:#}"),
                };
                if let Some(c) = &mut self.config {
                    c.monitor_result(change, r.is_ok(), &m);
                }
                self.notice(m);
            } else if self.opts.exit_when_done || self.quit {
                self.done = true;
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn meta(
        &self,
        w: &OpenWindow,
        data: &WindowData,
        ran: &Collectors,
        complete: bool,
        reason: Option<&str>,
        errors: &[String],
        hooks: Map<String, Value>,
        target: &Target,
    ) -> Value {
        let p = &w.req.plan;
        let cfg = self.plan.as_ref().map(|ap| ap.cfg);
        let mut m = json!({
            "dynprof_version": env!("CARGO_PKG_VERSION"),
            "window": w.id,
            "complete": complete,
            "incomplete_reason": reason,
            "target": {
                "host_pid": target.host_pid,
                "ns_pids": target.ns_pids,
                "ns_pid": target.inner_pid(),
                "container": target.container,
                "comm": target.comm,
                "cmdline": target.cmdline,
                "rank": target.rank,
            },
            "trigger": w.req.source,
            "plan": {
                "start_step": p.start_step,
                "warmup": p.warmup,
                "active": if p.open_ended() { Value::Null } else { json!(p.active) },
                "until_stop": p.open_ended(),
                "repeat": p.repeat,
                "gap": p.gap,
                "cycle": w.cycle,
                "kernel": cfg.map(|c| json!({"start": c.start, "end": c.end, "span": c.span, "period": c.period})),
            },
            "first_step": w.first_step,
            "first_recorded_step": data.steps.first().map(|s| s.step),
            "last_recorded_step": data.steps.last().map(|s| s.step),
            "steps_recorded": data.steps.len(),
            "open_ts_ns": w.open_ts_ns,
            "boundaries": w.boundaries.iter().map(|(k, ts)| json!({
                "step": k,
                "ts_ns": ts,
                "warmup": *k < w.first_recorded,
            })).collect::<Vec<_>>(),
            "steps": data.steps.iter().map(|s| json!({
                "step": s.step,
                "start_ts_ns": s.start_ts_ns,
                "end_ts_ns": s.end_ts_ns,
            })).collect::<Vec<_>>(),
            "collectors": {"api": ran.api, "cpu": ran.cpu, "offcpu": ran.offcpu},
            "drops": data.drops,
            "memory": {
                "budget_bytes": data.budget.budget_bytes,
                "events_cap": data.budget.events_cap,
                "dropped_over_budget": data.budget.dropped_over_budget,
                // As of the closing boundary; the writer updates it once the
                // files are written (the window's own peak is then known).
                "peak_rss_bytes": crate::sys::memory::peak_rss_bytes().ok(),
            },
            "hooks": hooks,
            "errors": errors,
            "started_at": w.started_at,
            "ended_at": super::profdir::local_timestamp_human(),
        });
        if let Some(md) = &w.req.metadata {
            m["metadata"] = md.clone();
        }
        if let Some(c) = &w.req.config {
            m["config"] = c.clone();
        }
        if let Some(n) = w.req.change {
            m["config_change"] = json!(n);
        }
        m
    }

    fn on_config(&mut self, ev: &ConfigChanged, ctx: &mut Ctx) {
        self.last_activity = Instant::now();
        let Some(cfg) = &mut self.config else { return };
        let Some(req) = cfg.on_change(ev, ctx.target) else {
            return;
        };
        let change = req.change;
        let deferred = self.window.is_some();
        let r = self.submit(req, ctx.kernel);
        let (ok, m) = match &r {
            Ok(m) => (true, m.clone()),
            Err(e) => (false, format!("refused: {e:#}")),
        };
        if let Some(cfg) = &mut self.config {
            if deferred {
                cfg.monitor_deferred(change, &m);
            } else {
                cfg.monitor_result(change, ok, &m);
            }
        }
        self.notice(format!(
            "profiler_config.json change {}: {m}",
            change.unwrap_or(0)
        ));
    }
}

fn drops_delta(now: &Drops, then: &Drops) -> Drops {
    Drops {
        step: now.step.saturating_sub(then.step),
        api: now.api.saturating_sub(then.api),
        cpu: now.cpu.saturating_sub(then.cpu),
        offcpu: now.offcpu.saturating_sub(then.offcpu),
        cpu_stack: now.cpu_stack.saturating_sub(then.cpu_stack),
        offcpu_stack: now.offcpu_stack.saturating_sub(then.offcpu_stack),
        api_nesting: now.api_nesting.saturating_sub(then.api_nesting),
    }
}

/// Host tid → thread name, read now (empty once the target is gone).
pub fn thread_names(t: &Target) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    let dir = format!("/proc/{}/task", t.host_pid);
    if let Ok(rd) = std::fs::read_dir(Path::new(&dir)) {
        for e in rd.flatten() {
            let Some(tid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            if let Ok(name) = std::fs::read_to_string(e.path().join("comm")) {
                out.push((tid, name.trim().to_string()));
            }
        }
    }
    out.sort();
    out
}

impl Observer for Scheduler {
    fn on_event(
        &mut self,
        ev: &Decoded,
        completed: Option<&CompletedStep>,
        ctx: &mut Ctx,
    ) -> Result<()> {
        self.remember_target(ctx.target);
        self.prepare_hooks(ctx.target);
        for (i, c) in self.collectors.iter_mut().enumerate() {
            if self.armed[i] {
                c.on_event(ev);
            }
        }
        if let Decoded::Step(s) = ev
            && s.role == role::STEP
        {
            self.on_step(s.step, s.hdr.ts_ns, s.gate != 0, completed, ctx)?;
        }
        Ok(())
    }

    fn on_command(&mut self, cmd: &mut dyn std::any::Any, ctx: &mut Ctx) -> Result<()> {
        self.remember_target(ctx.target);
        if let Some(c) = cmd.downcast_mut::<ConsoleCommand>() {
            let text = self.console(c.req.clone(), ctx);
            let _ = c.reply.send(Reply { text });
        } else if let Some(ev) = cmd.downcast_ref::<ConfigChanged>() {
            self.on_config(ev, ctx);
        } else if let Some(p) = cmd.downcast_mut::<SetNoticePrinter>() {
            let f: NoticePrinter = std::mem::replace(&mut p.0, Box::new(|_| {}));
            self.printer = Some(f);
        } else if let Some(req) = cmd.downcast_mut::<PlanRequest>() {
            let r = self.submit(req.clone(), ctx.kernel)?;
            self.notice(r);
        }
        Ok(())
    }

    fn on_tick(&mut self, ctx: &mut Ctx) -> Result<()> {
        self.report_written(false);
        self.remember_target(ctx.target);
        self.prepare_hooks(ctx.target);
        if let Some(t) = self.opts.idle_timeout
            && !self.done
            && self.window.is_none()
            && self.plan.is_none()
            && self.last_activity.elapsed() >= t
        {
            self.notice(format!(
                "idle for {} s without a command or window; detaching",
                t.as_secs()
            ));
            self.done = true;
        }
        Ok(())
    }

    fn finish(&mut self, end: &EndReason, ctx: &mut Ctx) -> Result<()> {
        self.remember_target(ctx.target);
        if self.window.is_some() {
            // No cycle follows: the window's probes go as soon as it closes.
            if let Some(p) = &mut self.plan {
                p.final_cycle = true;
            }
            let reason = match end {
                EndReason::Done if self.quit => "detached (quit)".to_string(),
                EndReason::Done => "detached".to_string(),
                other => other.describe().to_string(),
            };
            self.close_window(false, Some(reason), ctx)?;
        } else if let Some(p) = &self.plan {
            let msg = format!(
                "the planned window (step {}) was never reached: {}",
                p.cfg.start,
                end.describe()
            );
            self.notice(msg);
        }
        self.plan = None;
        let _ = super::disarm(ctx.kernel);
        self.disarm_all(ctx.kernel);
        for h in &mut self.hooks {
            if let Err(e) = h.shutdown(ctx.target) {
                log::warn!("hook {}: shutdown: {e:#}", h.name());
            }
        }
        self.report_written(true);
        if let Some(c) = &mut self.config {
            c.ended(end.describe(), self.written.len());
        }
        Ok(())
    }

    fn wants_exit(&self) -> bool {
        self.done
    }
}
