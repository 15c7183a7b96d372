//! The session: one task that owns the event stream, the step clock and
//! the observers (live printer, window scheduler, collectors).
pub mod clock;
pub mod events;
pub mod spin;

use std::{
    os::fd::AsRawFd,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use aya::maps::{MapData, RingBuf};
use serde::Serialize;
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{SignalKind, signal},
    sync::mpsc,
};

pub use clock::{CompletedStep, StepClock, StepSummary};
pub use events::{Decoded, StackCopy};

use dynprof_common::{EventHeader, StepEvent, kind, role};

use crate::{
    bpf::{Kernel, LoggedStep, StepLog},
    output::model::Drops,
    probes::{ResolvedProbe, Role},
    target::Target,
    types::StepIndex,
};

/// Why a session ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EndReason {
    StepsReached,
    Duration,
    Interrupted,
    TargetExited,
    /// An observer (e.g. a finished window plan, or `quit`) asked to stop.
    Done,
}

impl EndReason {
    pub fn describe(&self) -> &'static str {
        match self {
            EndReason::StepsReached => "requested steps reached",
            EndReason::Duration => "duration elapsed",
            EndReason::Interrupted => "interrupted",
            EndReason::TargetExited => "target exited",
            EndReason::Done => "done",
        }
    }
}

/// What observers can reach while handling an event.
pub struct Ctx<'a> {
    pub kernel: &'a mut Kernel,
    pub target: &'a Target,
    pub probes: &'a [ResolvedProbe],
    pub clock: &'a StepClock,
}

/// A consumer of the event stream. Everything but counting steps is an
/// observer: the live printer, the window scheduler, the collectors. `C` is
/// the type of the commands triggers send into the session (the window's
/// `SessionCommand`; `()` for a session without triggers).
pub trait Observer<C = ()> {
    /// Called for every event, after the step clock has seen it. `completed`
    /// is the step a step event just closed, if any.
    fn on_event(
        &mut self,
        ev: &Decoded,
        completed: Option<&CompletedStep>,
        ctx: &mut Ctx,
    ) -> Result<()>;
    /// A command from a trigger (console, config watcher).
    fn on_command(&mut self, _cmd: &mut C, _ctx: &mut Ctx) -> Result<()> {
        Ok(())
    }
    /// Once, before the first event: one-time work (threads, files) that
    /// would otherwise land on the first boundary.
    fn on_start(&mut self, _ctx: &mut Ctx) -> Result<()> {
        Ok(())
    }
    /// About every 100 ms, for housekeeping that must not wait for a step.
    fn on_tick(&mut self, _ctx: &mut Ctx) -> Result<()> {
        Ok(())
    }
    /// The session is ending; flush and finalize.
    fn finish(&mut self, _end: &EndReason, _ctx: &mut Ctx) -> Result<()> {
        Ok(())
    }
    /// True when this observer has nothing left to do and the session may end.
    fn wants_exit(&self) -> bool {
        false
    }
}

/// How often batched events are read and observers get `on_tick`: the
/// delay of the live step lines and status while no window is near.
pub const TICK: Duration = Duration::from_millis(100);

pub struct Limits {
    pub steps: Option<u64>,
    pub duration: Option<Duration>,
}

#[derive(Debug, Serialize)]
pub struct SessionSummary {
    pub end: EndReason,
    #[serde(flatten)]
    pub steps: StepSummary,
    pub drops: Drops,
    pub elapsed_s: f64,
    /// Hits per marker label from the kernel's HITS map (after the string
    /// filter; an aux marker counts only while it was attached).
    pub marker_hits: std::collections::BTreeMap<String, u64>,
    /// `--realtime-boundaries`: how often the event loop was raised to
    /// SCHED_FIFO to wait for a boundary (its thread's count: in job mode,
    /// every rank's). Absent without the flag.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub realtime_raises: Option<u64>,
}

/// HITS per marker label (markers sharing a label are summed).
pub fn marker_hits(
    kernel: &Kernel,
    probes: &[ResolvedProbe],
) -> std::collections::BTreeMap<String, u64> {
    let mut m = std::collections::BTreeMap::new();
    for p in probes {
        *m.entry(p.label.clone()).or_default() += kernel.hits(p.index).unwrap_or(0);
    }
    m
}

pub struct Session {
    pub kernel: Kernel,
    pub target: Target,
    pub probes: Vec<ResolvedProbe>,
    pub clock: StepClock,
    /// `--realtime-boundaries`: wait for a due boundary at SCHED_FIFO
    /// (`sys::sched::RealtimeShare`).
    pub realtime_boundaries: bool,
}

impl Session {
    pub fn new(kernel: Kernel, target: Target, probes: Vec<ResolvedProbe>) -> Self {
        Self {
            kernel,
            target,
            probes,
            clock: StepClock::default(),
            realtime_boundaries: false,
        }
    }

    /// Runs until a limit, a signal, the target's exit or an observer ends it.
    pub async fn run<C>(
        &mut self,
        observers: &mut [Box<dyn Observer<C>>],
        limits: Limits,
        mut commands: Option<mpsc::UnboundedReceiver<C>>,
    ) -> Result<SessionSummary> {
        let started = Instant::now();
        // A short time slice (unless DYNPROF_EVENT_SLICE_US=0), so that a
        // boundary's wakeup need not wait out a busy job's (sys::sched).
        // Per thread: the event loop's.
        match crate::sys::sched::set_slice(crate::sys::sched::configured_slice_us()) {
            Ok(s) => log::debug!("event loop time slice: {s:?}"),
            Err(e) => log::debug!("event loop time slice: not set: {e}"),
        }
        let ring: RingBuf<MapData> = self.kernel.take_events()?;
        // Idle steps come through the step log, not the ring: read both.
        let mut log = self.kernel.take_step_log()?;
        // SAFETY: both fds are owned by the values moved into the AsyncFd and
        // stay open exactly as long as it is registered.
        let mut ring =
            unsafe { AsyncFd::register_with_interest(ring, tokio::io::Interest::READABLE) }
                .map_err(|e| anyhow::anyhow!("registering the ring buffer with tokio: {e}"))?;
        // Readable when the target exits: no polling. `None`: it exited
        // between attach and now, which ends the session at once (after
        // reading what it emitted), as an exit seen later would.
        let pid = self.target.host_pid.0;
        let exit_fd =
            match crate::sys::signal::pidfd(pid).with_context(|| format!("pidfd_open({pid})"))? {
                // SAFETY: the pidfd is owned here and outlives its registration.
                Some(fd) => Some(
                    unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
                        .map_err(|e| anyhow::anyhow!("watching the target's pidfd: {e}"))?,
                ),
                None => None,
            };
        let exited = async {
            if let Some(fd) = &exit_fd {
                let _ = fd.readable().await;
            }
        };
        tokio::pin!(exited);
        let mut sigint = signal(SignalKind::interrupt())?;
        let mut sigterm = signal(SignalKind::terminate())?;
        let mut tick = tokio::time::interval(TICK);
        // A late tick is not worth catching up on: the next drain reads all.
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let deadline = limits.duration.map(|d| tokio::time::Instant::now() + d);
        let sleep_until = async move {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(sleep_until);

        let mut ctx = self.ctx();
        for o in observers.iter_mut() {
            o.on_start(&mut ctx)?;
        }
        // Polls the ring around the waking hits the plan makes (see spin).
        let mut spinner = spin::Spinner::configured();
        // This thread's run-queue wait: a spin that waits for its CPU stops.
        let run_delay = crate::sys::sched::RunDelay::open()
            .map_err(|e| log::debug!("no schedstat for the boundary spin: {e}"))
            .ok();
        // Raised to SCHED_FIFO while the loop sleeps for a boundary:
        // between windows from 1 s ahead, inside one once its close is
        // due, never while spinning (opt-in; see spin::realtime).
        let mut realtime = crate::sys::sched::RealtimeShare::new(self.realtime_boundaries);
        let mut end = 'outer: loop {
            let now = crate::sys::clock::monotonic_ns();
            let seen = self.clock.seen();
            let plan = self.kernel.plan();
            let mut next = spinner.decide(now, seen, &plan, &mut || {
                run_delay.as_ref().and_then(|r| r.read())
            });
            if self.realtime_boundaries {
                let (n, raise) = spin::realtime(now, seen, &plan, next);
                next = n;
                realtime.want(raise);
            }
            let spinning = next == spin::Next::Spin;
            let wake_in = match next {
                // Capped: a plan far ahead is looked at again in a while.
                spin::Next::WakeAt(t) => {
                    Some(Duration::from_nanos(t.saturating_sub(now)).min(Duration::from_secs(10)))
                }
                _ => None,
            };
            tokio::select! {
                // Spinning: one non-blocking read per turn of the runtime.
                _ = tokio::task::yield_now(), if spinning => {
                    if let Some(r) = self.drain(ring.get_mut(), &mut log, observers, &limits)? { break 'outer r; }
                }
                // Woken to decide again, with the hits logged since.
                _ = tokio::time::sleep(wake_in.unwrap_or_default()), if wake_in.is_some() => {
                    if let Some(r) = self.drain(ring.get_mut(), &mut log, observers, &limits)? { break 'outer r; }
                }
                guard = ring.readable_mut() => {
                    let mut guard = guard?;
                    // Cleared before reading: a wakeup that lands while we
                    // drain marks the ring ready again instead of being lost
                    // (the next would be a tick away).
                    guard.clear_ready();
                    let stop = self.drain(guard.get_inner_mut(), &mut log, observers, &limits)?;
                    if let Some(r) = stop { break 'outer r; }
                }
                // What it emitted before it died is read below.
                _ = &mut exited => break EndReason::TargetExited,
                Some(mut cmd) = async { match commands.as_mut() { Some(c) => c.recv().await, None => None } } => {
                    let mut ctx = self.ctx();
                    for o in observers.iter_mut() {
                        o.on_command(&mut cmd, &mut ctx)?;
                    }
                    if !observers.is_empty() && observers.iter().all(|o| o.wants_exit()) { break EndReason::Done; }
                }
                _ = tick.tick() => {
                    // Most events are written without a wakeup (see
                    // `PlanConfig::wakes`): the tick is when they are read.
                    if let Some(r) = self.drain(ring.get_mut(), &mut log, observers, &limits)? { break 'outer r; }
                    let mut ctx = self.ctx();
                    for o in observers.iter_mut() {
                        o.on_tick(&mut ctx)?;
                    }
                    if observers.iter().any(|o| o.wants_exit()) { break EndReason::Done; }
                }
                _ = &mut sleep_until => break EndReason::Duration,
                _ = sigint.recv() => break EndReason::Interrupted,
                _ = sigterm.recv() => break EndReason::Interrupted,
            }
        };
        log::debug!(
            "boundary spin: {:.1} ms in all, {} stopped as contended",
            spinner.spun_ns as f64 / 1e6,
            spinner.contended
        );
        let realtime_raises = self.realtime_boundaries.then(|| realtime.raises());
        // Draining and finishing are work that can wait.
        drop(realtime);
        // Whatever is still in the ring happened before the end and belongs
        // to the output (an interrupted or detached window keeps the steps it
        // recorded); only a step limit cuts it short.
        if end != EndReason::StepsReached {
            while let Some(r) = self.drain(ring.get_mut(), &mut log, observers, &limits)? {
                if r == EndReason::StepsReached {
                    end = r;
                    break;
                }
            }
        }
        // The session is over: its losses are counted now, and every probe
        // is detached before the observers finish. Writing a dense window
        // can take a while, and the target should not pay for a step
        // marker or a sched_switch program nobody reads any more (nor fill
        // the ring with steps counted as lost). The maps stay readable.
        let drops = self.kernel.drops().unwrap_or_else(|e| {
            log::warn!("the kernel's lost-event counters could not be read: {e:#}");
            Drops::default()
        });
        self.kernel.detach_all();
        let marker_hits = marker_hits(&self.kernel, &self.probes);
        let mut ctx = self.ctx();
        for o in observers.iter_mut() {
            o.finish(&end, &mut ctx)?;
        }
        // Anything an observer attached again while finishing.
        self.kernel.detach_all();
        let _ = ring.as_raw_fd();
        Ok(SessionSummary {
            end,
            steps: self.clock.summary(),
            drops,
            elapsed_s: started.elapsed().as_secs_f64(),
            marker_hits,
            realtime_raises,
        })
    }

    /// What observers reach while handling an event.
    fn ctx(&mut self) -> Ctx<'_> {
        Ctx {
            kernel: &mut self.kernel,
            target: &self.target,
            probes: &self.probes,
            clock: &self.clock,
        }
    }

    /// Hands every event waiting in the ring, and every step waiting in the
    /// step log, to the observers, in step order.
    fn drain<C>(
        &mut self,
        ring: &mut RingBuf<MapData>,
        log: &mut StepLog,
        observers: &mut [Box<dyn Observer<C>>],
        limits: &Limits,
    ) -> Result<Option<EndReason>> {
        let mut logged = Vec::new();
        while let Some(item) = ring.next() {
            let Some(ev) = events::decode(&item) else {
                continue;
            };
            drop(item);
            // The logged steps before this event's step come first: a step
            // event begins step k, an aux hit belongs to step k.
            if let Decoded::Step(s) = &ev {
                if s.role == role::STEP {
                    log.ring_step(s.step, &mut logged);
                } else {
                    log.read(Some(s.step.saturating_add(1)), &mut logged);
                }
                if let Some(r) = self.dispatch_logged(log, &mut logged, observers, limits)? {
                    return Ok(Some(r));
                }
            }
            if let Some(r) = self.dispatch(&ev, observers, limits)? {
                return Ok(Some(r));
            }
        }
        log.read(None, &mut logged);
        self.dispatch_logged(log, &mut logged, observers, limits)
    }

    /// Dispatches steps read from the step log as the step events the ring
    /// would have carried. Their slots have no room for a tid: they carry
    /// the tid of the latest logged hit (the training thread, in practice).
    fn dispatch_logged<C>(
        &mut self,
        log: &StepLog,
        logged: &mut Vec<LoggedStep>,
        observers: &mut [Box<dyn Observer<C>>],
        limits: &Limits,
    ) -> Result<Option<EndReason>> {
        if logged.is_empty() {
            return Ok(None);
        }
        let tid = log.last_tid();
        let mut end = None;
        for l in logged.drain(..) {
            if end.is_some() {
                continue;
            }
            let ev = Decoded::Step(StepEvent {
                hdr: EventHeader {
                    kind: kind::STEP,
                    tid,
                    ts_ns: l.ts_ns,
                },
                marker: l.marker,
                role: role::STEP,
                step: l.step,
                gate: 0,
                woke: 0,
            });
            end = self.dispatch(&ev, observers, limits)?;
        }
        Ok(end)
    }

    fn dispatch<C>(
        &mut self,
        ev: &Decoded,
        observers: &mut [Box<dyn Observer<C>>],
        limits: &Limits,
    ) -> Result<Option<EndReason>> {
        let mut completed = None;
        if let Decoded::Step(s) = ev {
            let label = self
                .probes
                .iter()
                .find(|p| p.index == s.marker)
                .map(|p| p.label.as_str())
                .unwrap_or("?");
            match self
                .probes
                .iter()
                .find(|p| p.index == s.marker)
                .map(|p| p.role)
            {
                Some(Role::Aux) => self.clock.on_aux(label),
                _ => {
                    completed = self
                        .clock
                        .on_step(StepIndex(s.step), s.hdr.ts_ns, s.hdr.tid)
                }
            }
        }
        let mut ctx = self.ctx();
        for o in observers.iter_mut() {
            o.on_event(ev, completed.as_ref(), &mut ctx)?;
        }
        if let (Some(n), Decoded::Step(s)) = (limits.steps, ev)
            && s.role == dynprof_common::role::STEP
            && self.clock.steps_seen >= n
        {
            return Ok(Some(EndReason::StepsReached));
        }
        if !observers.is_empty() && observers.iter().any(|o| o.wants_exit()) {
            return Ok(Some(EndReason::Done));
        }
        Ok(None)
    }
}
