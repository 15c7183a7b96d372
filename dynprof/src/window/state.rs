//! The window logic as a state machine: which plan is programmed, which
//! window is open, what a step boundary, a request, `stop`, `quit` or the end
//! of the session does to them, and what the scheduler must carry out
//! ([`Action`]s: arm, open, close, start hooks, notices).
//!
//! It holds no file, collector or kernel object. The one thing it drives
//! directly is the kernel's plan register, through the small [`PlanRegister`]
//! trait (a step counter and a plan slot), because programming a plan is a
//! read-write-reread loop against a counter the target keeps moving. Tests
//! drive it with a counter in memory, without root.
use anyhow::{Result, bail};
use dynprof_common::PlanConfig;

use super::{
    Plan, first_start,
    trigger::{ConsoleRequest, PlanRequest, Source},
};
use crate::types::{Builtin, WindowId};

/// The kernel's plan slot and step counter (`bpf::Kernel` in a session).
pub trait PlanRegister {
    /// Step marker hits so far.
    fn step_hits(&mut self) -> Result<u64>;
    /// Replaces the plan the step program evaluates at every hit.
    fn set_plan(&mut self, cfg: PlanConfig) -> Result<()>;
}

/// Programs `plan` into the kernel, starting at the first boundary the
/// counter has not reached yet. The counter moves while we write: re-read it
/// after the write and start over if the start already passed.
pub fn program(reg: &mut impl PlanRegister, plan: &Plan) -> Result<PlanConfig> {
    let mut c = reg.step_hits()?;
    for _ in 0..16 {
        let cfg = plan.kernel_config(first_start(plan, c));
        reg.set_plan(cfg)?;
        let c2 = reg.step_hits()?;
        if c2 < cfg.start {
            return Ok(cfg);
        }
        c = c2;
    }
    bail!(
        "the step counter moves too fast to program a window (more than 16 steps during one map update)"
    )
}

/// Ends the current cycle of `cfg` at the next boundary: returns the new
/// config and the last step inside the window.
pub fn program_stop(reg: &mut impl PlanRegister, mut cfg: PlanConfig) -> Result<(PlanConfig, u64)> {
    let mut c = reg.step_hits()?;
    for _ in 0..16 {
        cfg.end = (c + 1).max(cfg.start + 1);
        reg.set_plan(cfg)?;
        let c2 = reg.step_hits()?;
        if c2 < cfg.end {
            return Ok((cfg, cfg.end - 1));
        }
        c = c2;
    }
    bail!("the step counter moves too fast to close the window")
}

/// No window from now on.
pub fn disarm(reg: &mut impl PlanRegister) -> Result<()> {
    reg.set_plan(PlanConfig::DISARMED)
}

/// A plan programmed into the kernel.
#[derive(Clone, Debug)]
pub struct ActivePlan {
    pub req: PlanRequest,
    pub cfg: PlanConfig,
    /// Last step inside the window once `stop` fixed it (open-ended plans).
    pub stop_last: Option<u64>,
    /// No more cycles after the current window (stopped).
    pub final_cycle: bool,
}

impl ActivePlan {
    pub fn cycles(&self) -> u64 {
        self.req.plan.repeat.saturating_add(1)
    }
    pub fn cycle_start(&self, cycle: u64) -> u64 {
        self.cfg
            .start
            .saturating_add(cycle.saturating_mul(self.cfg.period))
    }
}

/// The open window, in steps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenSteps {
    pub id: WindowId,
    /// Which repetition of the plan (0 = the first window).
    pub cycle: u64,
    /// First step inside the kernel gate (warmup included).
    pub first_step: u64,
    pub first_recorded: u64,
    /// Planned last recorded step (u64::MAX while open-ended).
    pub last_recorded: u64,
    /// The hooks were told the first recorded step began.
    pub hooks_started: bool,
}

/// What the scheduler carries out, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Attach the collectors a plan asks for (`None`: the session default).
    Arm { collect: Option<Vec<Builtin>> },
    /// Detach every armed collector.
    DisarmAll,
    /// The step that just ended is one of the open window's recorded steps.
    Record,
    /// This boundary lies inside the open window (its timestamp is kept).
    Boundary,
    /// The open window's first recorded step just began.
    StartHooks,
    /// Finalize the window: hooks, collectors, files. `disarm`: detach the
    /// collectors after sealing (no next cycle close enough to keep them).
    /// `kernel`: the plan's kernel config while more cycles follow.
    Close {
        steps: OpenSteps,
        complete: bool,
        reason: Option<String>,
        /// Timestamp of the boundary that closed it; 0 when none did.
        end_ts_ns: u64,
        disarm: bool,
        kernel: Option<PlanConfig>,
    },
    /// Create the window (after arming its collectors); `start_hooks` when
    /// it opens on a recorded step already (no warmup).
    Open {
        steps: OpenSteps,
        req: Box<PlanRequest>,
        start_hooks: bool,
    },
    /// A plan request was answered (applied, deferred-then-applied or
    /// refused); config-file requests log it in their monitor.
    Answered {
        change: Option<u64>,
        ok: bool,
        msg: String,
    },
    /// Something to tell the user.
    Notice(String),
}

/// One step boundary as the scheduler saw it.
#[derive(Clone, Copy, Debug)]
pub struct Boundary {
    /// Hit index: this boundary begins step `k`.
    pub k: u64,
    pub ts_ns: u64,
    /// The kernel's gate decision at this hit.
    pub gate: bool,
    /// The step this boundary ended, if the clock completed one.
    pub completed: Option<u64>,
    /// Steps to arm collectors ahead of a window at the current rate.
    pub lead: u64,
    /// The step clock's current step after this boundary.
    pub now: u64,
}

/// Plans, the open window and the request waiting for it to end.
#[derive(Debug)]
pub struct WindowState {
    plan: Option<ActivePlan>,
    window: Option<OpenSteps>,
    /// A request that arrived while a window was open: applied when it ends
    /// (a later one replaces it).
    deferred: Option<PlanRequest>,
    next_id: u32,
    /// End the session when the plan is done (flags mode).
    exit_when_done: bool,
    quit: bool,
    done: bool,
}

impl WindowState {
    pub fn new(exit_when_done: bool) -> Self {
        Self {
            plan: None,
            window: None,
            deferred: None,
            next_id: 1,
            exit_when_done,
            quit: false,
            done: false,
        }
    }

    pub fn plan(&self) -> Option<&ActivePlan> {
        self.plan.as_ref()
    }
    pub fn window(&self) -> Option<&OpenSteps> {
        self.window.as_ref()
    }
    pub fn deferred(&self) -> Option<&PlanRequest> {
        self.deferred.as_ref()
    }
    /// `quit` was asked for on the console.
    pub fn quitting(&self) -> bool {
        self.quit
    }
    /// The session should end.
    pub fn done(&self) -> bool {
        self.done
    }
    /// Ends the session (idle timeout).
    pub fn set_done(&mut self) {
        self.done = true;
    }

    /// A plan request: programmed now, or deferred while a window is open.
    pub fn submit(
        &mut self,
        req: PlanRequest,
        reg: &mut impl PlanRegister,
        lead: u64,
        out: &mut Vec<Action>,
    ) -> Result<String> {
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
        self.program_now(req, reg, lead, out)
    }

    fn program_now(
        &mut self,
        req: PlanRequest,
        reg: &mut impl PlanRegister,
        lead: u64,
        out: &mut Vec<Action>,
    ) -> Result<String> {
        if req.plan.start_step == 0 {
            // "no collection": cancel whatever is pending.
            self.cancel_plan(reg, out);
            return Ok("start_step 0: no collection planned".into());
        }
        // Replacing a pending plan keeps the collectors armed when the new
        // one starts within the lead too: the scheduler arms a near plan's
        // collectors before submitting it, so that they cover its first step.
        let replacing = self.plan.take().is_some();
        if replacing && let Err(e) = disarm(reg) {
            log::warn!("disarming the kernel plan: {e:#}");
        }
        let drop_collectors = replacing && self.window.is_none();
        let cfg = match program(reg, &req.plan) {
            Ok(cfg) => cfg,
            Err(e) => {
                if drop_collectors {
                    out.push(Action::DisarmAll);
                }
                return Err(e);
            }
        };
        let c = reg.step_hits()?;
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
        let collect = req.collect.clone();
        self.plan = Some(ActivePlan {
            req,
            cfg,
            stop_last: None,
            final_cycle: false,
        });
        if cfg.start <= c + lead {
            out.push(Action::Arm { collect });
        } else if drop_collectors {
            out.push(Action::DisarmAll);
        }
        Ok(msg)
    }

    /// Drops the plan (kernel and all); the collectors go too unless a
    /// window still needs them.
    pub fn cancel_plan(&mut self, reg: &mut impl PlanRegister, out: &mut Vec<Action>) {
        if self.plan.take().is_some()
            && let Err(e) = disarm(reg)
        {
            log::warn!("disarming the kernel plan: {e:#}");
        }
        if self.window.is_none() {
            out.push(Action::DisarmAll);
        }
    }

    /// Closes the open window at the next boundary, or cancels a pending plan.
    pub fn stop(&mut self, reg: &mut impl PlanRegister, out: &mut Vec<Action>) -> Result<String> {
        self.deferred = None;
        let Some(p) = &mut self.plan else {
            return Ok("no window open or pending".into());
        };
        let Some(w) = &mut self.window else {
            self.cancel_plan(reg, out);
            return Ok("pending window cancelled".into());
        };
        let (cfg, last) = program_stop(reg, p.cfg)?;
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

    /// Job mode's `stop`: the window (open, or planned open-ended) records
    /// up to this rank's own step `last`, the same job step on every rank.
    /// When the step counter is already past it, the window closes at the
    /// next boundary, as `stop` does (it then holds more steps than the
    /// other ranks', which the job's verification reports).
    pub fn end_at(
        &mut self,
        last: u64,
        reg: &mut impl PlanRegister,
        out: &mut Vec<Action>,
    ) -> Result<String> {
        let Some(p) = &mut self.plan else {
            return Ok("no window open or pending".into());
        };
        let now = reg.step_hits()?;
        if last < now || last < p.cfg.start {
            let m = self.stop(reg, out)?;
            return Ok(format!("step {last} has already begun: {m}"));
        }
        self.deferred = None;
        let mut cfg = p.cfg;
        cfg.end = last + 1;
        reg.set_plan(cfg)?;
        p.cfg = cfg;
        p.stop_last = Some(last);
        p.final_cycle = true;
        if let Some(w) = &mut self.window
            && last < w.last_recorded
        {
            w.last_recorded = last;
        }
        Ok(format!("the window closes after step {last}"))
    }

    /// A console command other than `status` (which only reads).
    pub fn console(
        &mut self,
        req: ConsoleRequest,
        reg: &mut impl PlanRegister,
        lead: u64,
        out: &mut Vec<Action>,
    ) -> Result<String> {
        match req {
            ConsoleRequest::Status => Ok(String::new()),
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
                    _ => Plan::until_stop(),
                };
                self.submit(PlanRequest::new(plan, Source::Console), reg, lead, out)
            }
            ConsoleRequest::Stop => self.stop(reg, out),
            ConsoleRequest::Quit => {
                self.quit = true;
                if self.window.is_some() {
                    let m = self.stop(reg, out)?;
                    Ok(format!("{m}; detaching after it is written"))
                } else {
                    self.cancel_plan(reg, out);
                    self.done = true;
                    Ok("detaching; the target keeps running".into())
                }
            }
        }
    }

    /// A step boundary of the step marker.
    pub fn on_step(&mut self, b: Boundary, reg: &mut impl PlanRegister, out: &mut Vec<Action>) {
        let k = b.k;
        // 1. the open window: keep the step that just ended, then close.
        let mut close = false;
        if let Some(w) = &mut self.window {
            if let Some(c) = b.completed
                && c >= w.first_recorded
                && c <= w.last_recorded
            {
                out.push(Action::Record);
            }
            if k >= w.first_step {
                out.push(Action::Boundary);
            }
            if k > w.last_recorded || (!b.gate && k > w.first_step) {
                if k <= w.last_recorded {
                    // The kernel closed the gate earlier than planned (stop).
                    w.last_recorded = k.saturating_sub(1);
                }
                close = true;
            } else if k >= w.first_recorded && !w.hooks_started {
                w.hooks_started = true;
                out.push(Action::StartHooks);
            }
        }
        if close {
            self.close(true, None, b.ts_ns, b, reg, out);
        }
        // 2. a new window opens where the kernel opened the gate.
        if self.window.is_none()
            && b.gate
            && let Some(p) = &self.plan
        {
            let cfg = p.cfg;
            // Before `start`: a stale plan write opened the gate early.
            if k >= cfg.start && k < cfg.end && (k - cfg.start) % cfg.period < cfg.span {
                let cycle = (k - cfg.start) / cfg.period;
                let base = cfg.start + cycle * cfg.period;
                let first_recorded = base + p.req.plan.warmup;
                let last_recorded = match p.stop_last {
                    Some(l) => l,
                    None if p.req.plan.open_ended() => u64::MAX,
                    None => first_recorded + p.req.plan.active - 1,
                };
                let id = WindowId(self.next_id);
                self.next_id += 1;
                let steps = OpenSteps {
                    id,
                    cycle,
                    first_step: base,
                    first_recorded,
                    last_recorded,
                    hooks_started: k >= first_recorded,
                };
                // Make sure collectors are armed (a window at the next boundary).
                out.push(Action::Arm {
                    collect: p.req.collect.clone(),
                });
                out.push(Action::Open {
                    steps: steps.clone(),
                    req: Box::new(p.req.clone()),
                    start_hooks: steps.hooks_started,
                });
                self.window = Some(steps);
            }
        }
        // 3. arm ahead of the next window.
        if self.window.is_none()
            && let Some(p) = &self.plan
        {
            let next = ((k.saturating_sub(p.cfg.start)) / p.cfg.period
                + u64::from(k >= p.cfg.start))
            .min(p.cycles());
            if next < p.cycles() && p.cycle_start(next) <= k + b.lead {
                out.push(Action::Arm {
                    collect: p.req.collect.clone(),
                });
            }
        }
    }

    /// The scheduler could not create the window [`Action::Open`] asked
    /// for (e.g. an unwritable output directory): give up the plan, keep the
    /// session (and other triggers) alive.
    pub fn open_failed(&mut self, reg: &mut impl PlanRegister, out: &mut Vec<Action>) {
        self.window = None;
        self.cancel_plan(reg, out);
        if self.exit_when_done {
            self.done = true;
        }
    }

    /// The session ends (detach, interrupt, target exit, limits): an open
    /// window is closed incomplete with `reason`; a pending one is reported
    /// as never reached (`why`).
    pub fn finish(
        &mut self,
        reason: String,
        why: &str,
        now: u64,
        reg: &mut impl PlanRegister,
        out: &mut Vec<Action>,
    ) {
        if self.window.is_some() {
            // No cycle follows: the window's probes go as soon as it closes.
            if let Some(p) = &mut self.plan {
                p.final_cycle = true;
            }
            let b = Boundary {
                k: now,
                ts_ns: 0,
                gate: false,
                completed: None,
                lead: 0,
                now,
            };
            self.close(false, Some(reason), 0, b, reg, out);
        } else if let Some(p) = &self.plan {
            out.push(Action::Notice(format!(
                "the planned window (step {}) was never reached: {why}",
                p.cfg.start
            )));
        }
        self.plan = None;
        let _ = disarm(reg);
        out.push(Action::DisarmAll);
    }

    fn close(
        &mut self,
        complete: bool,
        reason: Option<String>,
        end_ts_ns: u64,
        b: Boundary,
        reg: &mut impl PlanRegister,
        out: &mut Vec<Action>,
    ) {
        let Some(w) = self.window.take() else {
            return;
        };
        let plan_done = self
            .plan
            .as_ref()
            .is_none_or(|p| p.final_cycle || w.cycle + 1 >= p.cycles());
        // The kernel gate is already closed. The probes are detached unless
        // the next cycle is too close to re-attach.
        let (disarm, kernel) = match &self.plan {
            _ if plan_done => (true, None),
            Some(p) => (p.cycle_start(w.cycle + 1) > b.now + b.lead + 1, Some(p.cfg)),
            None => (true, None),
        };
        if plan_done {
            self.plan = None;
        }
        // A change that arrived during the window applies now (last one
        // wins). When it starts within the lead, the collectors stay armed
        // across the close: disarmed and armed again after its plan is
        // programmed, they would miss its first steps.
        let mut next = Vec::new();
        let mut keep_armed = false;
        if plan_done && let Some(req) = self.deferred.take() {
            let change = req.change;
            let r = self.program_now(req, reg, b.lead, &mut next);
            keep_armed = next.iter().any(|a| matches!(a, Action::Arm { .. }));
            let (ok, msg) = match &r {
                Ok(m) => (true, format!("deferred plan applied: {m}")),
                Err(e) => (false, format!("deferred plan refused: {e:#}")),
            };
            next.push(Action::Answered { change, ok, msg });
        } else if plan_done && (self.exit_when_done || self.quit) {
            self.done = true;
        }
        out.push(Action::Close {
            steps: w,
            complete,
            reason,
            end_ts_ns,
            disarm: disarm && !keep_armed,
            kernel,
        });
        out.extend(next);
    }
}

#[cfg(test)]
mod tests;
