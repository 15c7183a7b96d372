//! Polling the ring instead of sleeping while a waking boundary is due.
//!
//! The kernel wakes the event loop at the step hits user space acts on
//! (`PlanConfig::wakes`: a window's lead-in, open, first recorded step and
//! close). A wakeup is only as quick as the CPU it lands on: where an idle
//! CPU halts (every virtual machine; deep C-states on bare metal) the woken
//! loop may start milliseconds later, and an msprof `start` written then is
//! that late. So when the step clock predicts that a waking hit is near,
//! the loop stays on its CPU and polls the ring from shortly before the hit
//! until it has been read, then decides again: the next waking hit is
//! often the next step (lead-in, open, close), and with short steps the
//! spin goes on through them.
//!
//! It is bounded three ways: no spinning without an armed plan (an idle
//! attach never spins), at most [`MAX_SPIN_NS`] per waking hit, and
//! at most [`SHARE`] of wall time over time ([`BURST_NS`] saved up), for
//! the whole process: job mode's sessions share one [`Budget`], so eight
//! ranks whose boundaries come at different times cannot spin eight
//! times as much. The
//! kernel's wakeup still comes if the prediction misses. It only helps
//! while a CPU is free: on a one-CPU machine it would take the CPU from the
//! job it waits for (off), and when every CPU is busy the spinning thread
//! is preempted and waits longer than a sleeping one would, so a spin that
//! spends [`CONTENDED`] of its time waiting for its CPU (the thread's
//! schedstat) stops it for a while ([`BACKOFF_NS`], doubling).
//! docs/performance.md has the measurement.

use std::sync::{Arc, Mutex, OnceLock};

use dynprof_common::PlanConfig;

/// Turns the boundary spin off with `0` (it is on where the host has two
/// CPUs or more).
pub const SPIN_ENV: &str = "DYNPROF_BOUNDARY_SPIN";
/// Fixed part of the lead before a predicted hit. It covers the timer that
/// starts the spin being late itself (the same halted-CPU wakeup, ~3 ms
/// at p99 on the bench's VM).
pub const MARGIN_NS: u64 = 4_000_000;
/// The longest spin for one waking hit.
pub const MAX_SPIN_NS: u64 = 20_000_000;
/// The share of wall time the loop may spend spinning, over time.
pub const SHARE: f64 = 0.25;
/// Spin time saved up while not spinning, at most.
pub const BURST_NS: f64 = 100_000_000.0;
/// A spin that has waited for its CPU this share of the time (run-queue
/// wait from schedstat) is contended: every CPU is busy, the spinning
/// thread is preempted and then waits out a slice, where a sleeping one
/// would have been woken ahead of the busy threads. Spinning stops.
pub const CONTENDED: f64 = 0.25;
/// A spin is judged once it has lasted this long.
const JUDGE_NS: u64 = 1_000_000;
/// No spinning for this long after a contended one, doubling up to
/// [`MAX_BACKOFF_NS`] while it stays contended.
pub const BACKOFF_NS: u64 = 1_000_000_000;
pub const MAX_BACKOFF_NS: u64 = 32_000_000_000;

/// What the event loop does until its next decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Sleep until an event, a command or the tick.
    Sleep,
    /// Sleep, and be awake at this CLOCK_MONOTONIC ns to decide again.
    WakeAt(u64),
    /// Poll the ring now, and decide again after.
    Spin,
}

/// What the step clock knows: the latest step hit and a typical step.
#[derive(Clone, Copy, Debug)]
pub struct Seen {
    /// The latest hit index and its CLOCK_MONOTONIC ns.
    pub hit: u64,
    pub ts_ns: u64,
    /// A typical recent step, ns; 0 before a step has completed.
    pub step_ns: u64,
}

/// Whether the next waking hit is due, by the step clock's extrapolation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Due {
    /// No waking hit is planned, or none can be predicted yet.
    No,
    /// Not before this CLOCK_MONOTONIC ns.
    From(u64),
    /// Now: waking hit `hit` is expected until `until` ns (`u64::MAX`:
    /// no step to extrapolate from, and it is the very next hit).
    Now { hit: u64, until: u64 },
}

/// When the plan's next waking hit is due, at `now_ns`. Pure. The spin
/// polls while it is [`Due::Now`], and `--realtime-boundaries` raises the
/// event loop for it when the spin does not.
pub fn due(now_ns: u64, seen: Option<Seen>, plan: &PlanConfig) -> Due {
    // No hit yet: the first is hit 1.
    let s = seen.unwrap_or(Seen {
        hit: 0,
        ts_ns: now_ns,
        step_ns: 0,
    });
    let Some(w) = plan.next_wake(s.hit) else {
        return Due::No;
    };
    if s.step_ns == 0 {
        // No step to extrapolate from (just attached, a window planned
        // right away): only the very next hit is worth waiting for.
        return if w == s.hit + 1 {
            Due::Now {
                hit: w,
                until: u64::MAX,
            }
        } else {
            Due::No
        };
    }
    // Extrapolating over n steps is off by a fraction of them (steps
    // vary): an eighth of the extrapolated time is allowed either way.
    let ahead = (w - s.hit).saturating_mul(s.step_ns);
    let at = s.ts_ns.saturating_add(ahead);
    let allowance = MARGIN_NS.saturating_add(ahead / 8);
    let from = at.saturating_sub(allowance);
    if now_ns < from {
        return Due::From(from);
    }
    Due::Now {
        hit: w,
        until: at.saturating_add(allowance),
    }
}

/// How far ahead of a due boundary `--realtime-boundaries` already sleeps
/// raised, between windows: the timer that would raise it when the
/// boundary becomes due is itself late on a busy CPU (it runs at normal
/// priority), and between windows a wakeup has little to do (the step
/// log, the console).
pub const RAISE_AHEAD_NS: u64 = 1_000_000_000;

/// `--realtime-boundaries`: what the event loop does instead of the
/// spinner's `next`, and whether it waits raised to SCHED_FIFO. Raised
/// while a waking hit is due and the loop is not spinning for it (spinning
/// at SCHED_FIFO would keep the job off that CPU until the hit), and
/// between windows from [`RAISE_AHEAD_NS`] before that; it sleeps raised,
/// so the boundary's wakeup preempts a busy CPU's thread at once. Inside a
/// window only once the close is due: the wakeups before it drain and
/// unwind the window's events, work that can wait. The loop wakes when a
/// hit becomes due even where the spinner would sleep through (the spin
/// off or backing off). Pure.
pub fn realtime(now_ns: u64, seen: Option<Seen>, plan: &PlanConfig, next: Next) -> (Next, bool) {
    if next == Next::Spin {
        return (next, false);
    }
    match due(now_ns, seen, plan) {
        Due::No => (next, false),
        Due::From(t) => {
            let wake = match next {
                Next::WakeAt(u) => u.min(t),
                _ => t,
            };
            let in_window = seen.is_some_and(|s| plan.at(s.hit).0);
            if in_window {
                (Next::WakeAt(wake), false)
            } else if t.saturating_sub(now_ns) <= RAISE_AHEAD_NS {
                (Next::WakeAt(wake), true)
            } else {
                (Next::WakeAt(wake.min(t - RAISE_AHEAD_NS)), false)
            }
        }
        Due::Now { until, .. } => (next, now_ns <= until),
    }
}

/// Spin time: earned at [`SHARE`] of wall time, at most [`BURST_NS`]
/// saved up, spent while at least one of its spinners spins (the time of
/// the thread they run on, counted once however many spin together).
#[derive(Debug)]
pub struct Budget {
    /// Spin time left, ns.
    tokens_ns: f64,
    last_ns: Option<u64>,
    /// Spinners spinning now.
    spinning: u32,
}

impl Default for Budget {
    fn default() -> Self {
        Self {
            tokens_ns: BURST_NS,
            last_ns: None,
            spinning: 0,
        }
    }
}

impl Budget {
    /// Brings the account up to `now_ns`.
    fn advance(&mut self, now_ns: u64) {
        let last = self.last_ns.unwrap_or(now_ns);
        let elapsed = now_ns.saturating_sub(last) as f64;
        self.last_ns = Some(last.max(now_ns));
        if self.spinning > 0 {
            self.tokens_ns -= elapsed;
        }
        self.tokens_ns = (self.tokens_ns + elapsed * SHARE).min(BURST_NS);
    }
}

/// The process's budget, shared by every session's spinner.
fn process_budget() -> Arc<Mutex<Budget>> {
    static B: OnceLock<Arc<Mutex<Budget>>> = OnceLock::new();
    B.get_or_init(Default::default).clone()
}

/// The spin decision for one session. Pure: the caller supplies the
/// clock.
#[derive(Debug)]
pub struct Spinner {
    enabled: bool,
    budget: Arc<Mutex<Budget>>,
    last_ns: Option<u64>,
    spinning: bool,
    /// The waking hit the current spin waits for, and when it began.
    waiting: Option<(u64, u64)>,
    /// Total ns spent spinning, for the session's debug line.
    pub spun_ns: u64,
    /// The current spin's start and the thread's run-queue wait then.
    episode: Option<(u64, u64)>,
    /// No spinning before this (the last spin was contended), and the
    /// next backoff.
    backoff_until: u64,
    backoff_ns: u64,
    /// Spins stopped as contended, for the session's debug line.
    pub contended: u32,
}

impl Spinner {
    /// A spinner with a budget of its own.
    pub fn new(enabled: bool) -> Self {
        Self::with_budget(enabled, Default::default())
    }

    pub fn with_budget(enabled: bool, budget: Arc<Mutex<Budget>>) -> Self {
        Self {
            enabled,
            budget,
            last_ns: None,
            spinning: false,
            waiting: None,
            spun_ns: 0,
            episode: None,
            backoff_until: 0,
            backoff_ns: BACKOFF_NS,
            contended: 0,
        }
    }

    /// On unless [`SPIN_ENV`] is `0`, and only with two CPUs or more; on
    /// the process's budget.
    pub fn configured() -> Self {
        let off = std::env::var(SPIN_ENV).is_ok_and(|v| v.trim() == "0");
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::with_budget(!off && cpus >= 2, process_budget())
    }

    /// What to do at `now_ns`, given what the clock has seen and the plan
    /// in the kernel. `run_delay` reads the thread's run-queue wait so far
    /// (ns; schedstat); it is called only while spinning or starting to.
    pub fn decide(
        &mut self,
        now_ns: u64,
        seen: Option<Seen>,
        plan: &PlanConfig,
        run_delay: &mut dyn FnMut() -> Option<u64>,
    ) -> Next {
        let elapsed = self.last_ns.map_or(0, |l| now_ns.saturating_sub(l));
        self.last_ns = Some(now_ns);
        // Poisoned only if a spinner panicked holding it; the account is
        // still whole numbers.
        let budget = self.budget.clone();
        let mut budget = budget.lock().unwrap_or_else(|e| e.into_inner());
        budget.advance(now_ns);
        let next = self.next(now_ns, elapsed, seen, plan, budget.tokens_ns, run_delay);
        let spin = next == Next::Spin;
        match (self.spinning, spin) {
            (false, true) => budget.spinning += 1,
            (true, false) => budget.spinning = budget.spinning.saturating_sub(1),
            _ => {}
        }
        self.spinning = spin;
        next
    }

    fn next(
        &mut self,
        now_ns: u64,
        elapsed: u64,
        seen: Option<Seen>,
        plan: &PlanConfig,
        tokens_ns: f64,
        run_delay: &mut dyn FnMut() -> Option<u64>,
    ) -> Next {
        if self.spinning {
            self.spun_ns += elapsed;
            if let (Some((t0, d0)), Some(d)) = (self.episode, run_delay()) {
                let wall = now_ns.saturating_sub(t0);
                if wall >= JUDGE_NS && d.saturating_sub(d0) as f64 > CONTENDED * wall as f64 {
                    self.backoff_until = now_ns.saturating_add(self.backoff_ns);
                    self.backoff_ns = (self.backoff_ns * 2).min(MAX_BACKOFF_NS);
                    self.contended += 1;
                    self.episode = None;
                    return Next::Sleep;
                }
            }
        }
        let next = if now_ns < self.backoff_until {
            Next::Sleep
        } else {
            self.choose(now_ns, seen, plan, tokens_ns)
        };
        match (self.spinning, next == Next::Spin) {
            (false, true) => self.episode = run_delay().map(|d| (now_ns, d)),
            (true, false) => {
                // Ended uncontended: the next contended one backs off from
                // the start again.
                if self
                    .episode
                    .is_some_and(|(t0, _)| now_ns.saturating_sub(t0) >= JUDGE_NS)
                {
                    self.backoff_ns = BACKOFF_NS;
                }
                self.episode = None;
            }
            _ => {}
        }
        next
    }

    fn choose(
        &mut self,
        now_ns: u64,
        seen: Option<Seen>,
        plan: &PlanConfig,
        tokens_ns: f64,
    ) -> Next {
        if !self.enabled {
            return Next::Sleep;
        }
        let (w, until) = match due(now_ns, seen, plan) {
            Due::No => return Next::Sleep,
            Due::From(t) => return Next::WakeAt(t),
            Due::Now { hit, until } => (hit, until),
        };
        let began = match self.waiting {
            Some((hit, began)) if hit == w => began,
            _ => {
                self.waiting = Some((w, now_ns));
                now_ns
            }
        };
        if now_ns > until || now_ns - began > MAX_SPIN_NS || tokens_ns <= 0.0 {
            // Missed, too long or over budget: the kernel's wakeup will do.
            return Next::Sleep;
        }
        Next::Spin
    }
}

impl Drop for Spinner {
    /// A session that ends while spinning stops spending the budget.
    fn drop(&mut self) {
        if self.spinning {
            let mut b = self.budget.lock().unwrap_or_else(|e| e.into_inner());
            b.spinning = b.spinning.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::window::Plan;

    const MS: u64 = 1_000_000;

    /// A 1-step window at hit 100: wakes at 98, 99 (lead-in), 100 (open)
    /// and 101 (close).
    fn plan() -> PlanConfig {
        Plan {
            start_step: 100,
            active: 1,
            ..Plan::default()
        }
        .kernel_config(100)
    }

    /// 1-step windows every 4 steps from hit 10, for ever: waking hits
    /// nearly all the time.
    fn dense_plan() -> PlanConfig {
        Plan {
            start_step: 10,
            active: 1,
            repeat: 1_000_000,
            gap: 3,
            ..Plan::default()
        }
        .kernel_config(10)
    }

    /// A decision with no run-queue wait to read.
    fn calm(s: &mut Spinner, now: u64, seen: Option<Seen>, p: &PlanConfig) -> Next {
        s.decide(now, seen, p, &mut || None)
    }

    fn seen(hit: u64, ts_ns: u64) -> Option<Seen> {
        Some(Seen {
            hit,
            ts_ns,
            step_ns: MS,
        })
    }

    #[test]
    fn wakes_before_the_predicted_hit_and_spins_through_the_window() {
        let mut s = Spinner::new(true);
        let p = plan();
        // Hit 50 at t=1000 ms, 1 ms steps: hit 98 is due at 1048 ms, with
        // a lead of 4 ms + 48/8 ms.
        assert_eq!(
            calm(&mut s, 1000 * MS, seen(50, 1000 * MS), &p),
            Next::WakeAt(1038 * MS)
        );
        // Woken, with fresher hits: the lead shrinks with the distance.
        assert_eq!(
            calm(&mut s, 1038 * MS, seen(90, 1040 * MS), &p),
            Next::WakeAt(1043 * MS)
        );
        assert_eq!(calm(&mut s, 1044 * MS, seen(95, 1043 * MS), &p), Next::Spin);
        assert_eq!(calm(&mut s, 1047 * MS, seen(97, 1047 * MS), &p), Next::Spin);
        // Hit 98 read: 99 is the next waking hit, one short step away.
        assert_eq!(calm(&mut s, 1048 * MS, seen(98, 1048 * MS), &p), Next::Spin);
        // The close (101) read: the plan has no waking hit left.
        assert_eq!(
            calm(&mut s, 1052 * MS, seen(101, 1051 * MS), &p),
            Next::Sleep
        );
        assert_eq!(s.spun_ns, 8 * MS);
    }

    #[test]
    fn gives_up_when_the_hit_is_late_or_the_spin_long() {
        let p = plan();
        // Hit 98 predicted at 1048 ms; the target stalls at hit 96.
        let mut s = Spinner::new(true);
        assert_eq!(calm(&mut s, 1045 * MS, seen(96, 1046 * MS), &p), Next::Spin);
        // 1048 ms + (4 + 2/8) ms of slack, then the kernel's wakeup.
        assert_eq!(calm(&mut s, 1052 * MS, seen(96, 1046 * MS), &p), Next::Spin);
        assert_eq!(
            calm(&mut s, 1053 * MS, seen(96, 1046 * MS), &p),
            Next::Sleep
        );
        // A slow step the clock underestimates: never past MAX_SPIN_NS.
        // Hit 96 at 1000 ms, 40 ms steps: due from 1080 − 14 ms.
        let mut s = Spinner::new(true);
        let slow = Some(Seen {
            hit: 96,
            ts_ns: 1000 * MS,
            step_ns: 40 * MS,
        });
        assert_eq!(calm(&mut s, 1060 * MS, slow, &p), Next::WakeAt(1066 * MS));
        assert_eq!(calm(&mut s, 1070 * MS, slow, &p), Next::Spin);
        assert_eq!(calm(&mut s, 1070 * MS + MAX_SPIN_NS, slow, &p), Next::Spin);
        assert_eq!(calm(&mut s, 1071 * MS + MAX_SPIN_NS, slow, &p), Next::Sleep);
    }

    #[test]
    fn spends_at_most_its_share_of_wall_time() {
        // 1-step windows every 4 steps of 1 ms: waking hits nearly all the
        // time, so the budget is what stops it.
        let p = dense_plan();
        let mut s = Spinner::new(true);
        let mut spins = 0u64;
        let t0 = 1000 * MS;
        let n = 20_000u64;
        for i in 0..n {
            // One decision every 0.1 ms; hit i/10 + 10 seen.
            let now = t0 + i * MS / 10;
            let hit = 10 + i / 10;
            if calm(
                &mut s,
                now,
                Some(Seen {
                    hit,
                    ts_ns: t0 + (i / 10) * MS,
                    step_ns: MS,
                }),
                &p,
            ) == Next::Spin
            {
                spins += 1;
            }
        }
        let wall = (n * MS / 10) as f64;
        let share = s.spun_ns as f64 / wall;
        // SHARE of the wall time plus the saved-up burst, no more.
        assert!(
            share <= SHARE + BURST_NS / wall + 0.001,
            "spun {share:.3} of wall time"
        );
        assert!(
            share >= SHARE - 0.05,
            "spun only {share:.3}: the budget was not used"
        );
        assert!(spins > 0 && spins < n);
    }

    /// Two sessions (job mode's ranks) whose windows come at different
    /// steps: with one budget between them the process spins at most
    /// SHARE of wall time; each with its own, it spun well beyond.
    #[test]
    fn sessions_on_one_budget_spin_its_share_together() {
        let every_16 = |start: i64| {
            Plan {
                start_step: start,
                active: 1,
                repeat: 1_000_000,
                gap: 15,
                ..Plan::default()
            }
            .kernel_config(start as u64)
        };
        let (pa, pb) = (every_16(10), every_16(18));
        // The fraction of decisions at which at least one of them spins:
        // 1 ms steps, a decision every 0.1 ms, 20 s.
        let union_share = |a: &mut Spinner, b: &mut Spinner| {
            let t0 = 1000 * MS;
            let n = 200_000u64;
            let mut any = 0u64;
            for i in 0..n {
                let now = t0 + i * MS / 10;
                let seen = Some(Seen {
                    hit: 10 + i / 10,
                    ts_ns: t0 + (i / 10) * MS,
                    step_ns: MS,
                });
                let sa = calm(a, now, seen, &pa) == Next::Spin;
                let sb = calm(b, now, seen, &pb) == Next::Spin;
                any += u64::from(sa || sb);
            }
            any as f64 / n as f64
        };
        let wall = 20e9;
        let shared = Arc::new(Mutex::new(Budget::default()));
        let together = union_share(
            &mut Spinner::with_budget(true, shared.clone()),
            &mut Spinner::with_budget(true, shared),
        );
        assert!(
            together <= SHARE + BURST_NS / wall + 0.002,
            "spun {together:.3} of wall time"
        );
        assert!(together >= SHARE - 0.05, "spun only {together:.3}");
        let apart = union_share(&mut Spinner::new(true), &mut Spinner::new(true));
        assert!(apart > SHARE + 0.1, "each on its own budget: {apart:.3}");
    }

    /// Spinning at the same time is charged once: two sessions spinning
    /// together last as long as one alone.
    #[test]
    fn spinning_together_is_charged_once() {
        let p = dense_plan();
        let run = |spinners: &mut [Spinner]| {
            let t0 = 1000 * MS;
            for i in 0..20_000u64 {
                let now = t0 + i * MS / 10;
                let seen = Some(Seen {
                    hit: 10 + i / 10,
                    ts_ns: t0 + (i / 10) * MS,
                    step_ns: MS,
                });
                for s in spinners.iter_mut() {
                    calm(s, now, seen, &p);
                }
            }
            spinners.iter().map(|s| s.spun_ns).max().unwrap()
        };
        let alone = run(&mut [Spinner::new(true)]);
        let b = Arc::new(Mutex::new(Budget::default()));
        let together = run(&mut [
            Spinner::with_budget(true, b.clone()),
            Spinner::with_budget(true, b),
        ]);
        assert_eq!(together, alone);
    }

    #[test]
    fn without_a_step_time_polls_only_for_the_very_next_hit() {
        // Attached, no hit yet, a window planned at hit 3: hit 1 (its
        // lead-in) is next, when is unknown: polled for, for 20 ms.
        let p = Plan {
            start_step: 3,
            active: 1,
            ..Plan::default()
        }
        .kernel_config(3);
        let mut s = Spinner::new(true);
        assert_eq!(calm(&mut s, 1000 * MS, None, &p), Next::Spin);
        assert_eq!(calm(&mut s, 1000 * MS + MAX_SPIN_NS, None, &p), Next::Spin);
        assert_eq!(calm(&mut s, 1001 * MS + MAX_SPIN_NS, None, &p), Next::Sleep);
        // One hit seen, no step completed: hit 2 is next, polled for anew.
        let one = Some(Seen {
            hit: 1,
            ts_ns: 1030 * MS,
            step_ns: 0,
        });
        assert_eq!(calm(&mut s, 1030 * MS, one, &p), Next::Spin);
        // A window far ahead: nothing to poll for without a step time.
        let far = Plan {
            start_step: 500,
            active: 1,
            ..Plan::default()
        }
        .kernel_config(500);
        let mut s = Spinner::new(true);
        assert_eq!(calm(&mut s, 1000 * MS, one, &far), Next::Sleep);
    }

    /// A spin whose thread waited for its CPU more than a quarter of the
    /// time stops, and none starts again for a second, then two; an
    /// uncontended one resets that.
    #[test]
    fn stops_spinning_while_its_cpu_is_contended() {
        // 1-step windows every 4 steps of 1 ms: always a waking hit near.
        let p = dense_plan();
        let at = |t: u64| {
            Some(Seen {
                hit: 10 + (t - 1000 * MS) / MS,
                ts_ns: t,
                step_ns: MS,
            })
        };
        let mut s = Spinner::new(true);
        // Run-queue wait grows by 1 ms between reads, decisions come every
        // 0.5–2 ms: contended.
        let mut wait = 0u64;
        let busy = |w: &mut u64| {
            *w += MS;
            Some(*w)
        };
        let t = 1000 * MS;
        assert_eq!(s.decide(t, at(t), &p, &mut || busy(&mut wait)), Next::Spin);
        assert_eq!(
            s.decide(t + MS / 2, at(t), &p, &mut || busy(&mut wait)),
            Next::Spin
        );
        assert_eq!(
            s.decide(t + 2 * MS, at(t), &p, &mut || busy(&mut wait)),
            Next::Sleep
        );
        assert_eq!(s.contended, 1);
        // Backed off for 1 s: no spin, the run-queue wait is not read.
        let mut reads = 0;
        let t2 = t + 500 * MS;
        assert_eq!(
            s.decide(t2, at(t2), &p, &mut || {
                reads += 1;
                None
            }),
            Next::Sleep
        );
        assert_eq!(reads, 0);
        // After it, contended again: 2 s this time.
        let t3 = t + 1003 * MS;
        assert_eq!(
            s.decide(t3, at(t3), &p, &mut || busy(&mut wait)),
            Next::Spin
        );
        assert_eq!(
            s.decide(t3 + 2 * MS, at(t3), &p, &mut || busy(&mut wait)),
            Next::Sleep
        );
        let t4 = t3 + 1500 * MS;
        assert_eq!(
            calm(&mut s, t4, at(t4), &p),
            Next::Sleep,
            "still backing off"
        );
        // Uncontended (no wait added) after the backoff: spins, and the
        // backoff is 1 s again.
        let t5 = t3 + 2003 * MS;
        let calm = Some(wait);
        assert_eq!(s.decide(t5, at(t5), &p, &mut || calm), Next::Spin);
        assert_eq!(s.decide(t5 + 2 * MS, at(t5), &p, &mut || calm), Next::Spin);
        assert_eq!(
            s.decide(t5 + 3 * MS, None, &PlanConfig::DISARMED, &mut || calm),
            Next::Sleep
        );
        assert_eq!(s.backoff_ns, BACKOFF_NS);
        assert_eq!(s.contended, 2);
    }

    #[test]
    fn never_spins_without_a_plan_or_when_off() {
        let mut s = Spinner::new(true);
        assert_eq!(
            calm(&mut s, MS, seen(98, MS), &PlanConfig::DISARMED),
            Next::Sleep
        );
        assert_eq!(
            calm(&mut s, 2 * MS, None, &PlanConfig::DISARMED),
            Next::Sleep
        );
        let mut off = Spinner::new(false);
        assert_eq!(
            calm(&mut off, 1047 * MS, seen(98, 1048 * MS), &plan()),
            Next::Sleep
        );
        assert_eq!(off.spun_ns, 0);
    }

    /// `--realtime-boundaries` raises only where the spin would poll and
    /// does not: a waking hit due, the loop sleeping on the ring; and it
    /// wakes for that even where the spinner sleeps.
    #[test]
    fn realtime_is_wanted_only_while_a_boundary_is_due_and_no_spin_waits_for_it() {
        let p = plan();
        let rt = |now, seen, next| realtime(now, seen, &p, next);
        // Hit 50 at 1000 ms, 1 ms steps: hit 98 is due from 1038 ms.
        // Between windows and less than RAISE_AHEAD_NS before: asleep
        // raised already.
        assert_eq!(
            rt(1000 * MS, seen(50, 1000 * MS), Next::WakeAt(1038 * MS)),
            (Next::WakeAt(1038 * MS), true)
        );
        // The spin off (or backing off): woken when it is due all the same.
        assert_eq!(
            rt(1000 * MS, seen(50, 1000 * MS), Next::Sleep),
            (Next::WakeAt(1038 * MS), true)
        );
        // Further ahead: not raised, but woken RAISE_AHEAD_NS before.
        let far = Some(Seen {
            hit: 50,
            ts_ns: 1000 * MS,
            step_ns: 100 * MS,
        });
        // Hit 98 due at 5800 ms, from 5800 − (4 + 600) ms.
        assert_eq!(
            rt(1000 * MS, far, Next::Sleep),
            (Next::WakeAt(5196 * MS - RAISE_AHEAD_NS), false)
        );
        assert_eq!(
            rt(4196 * MS, far, Next::Sleep),
            (Next::WakeAt(5196 * MS), true)
        );
        // Inside a window (a 50-step one from hit 100, 1 ms steps): not
        // before its close (hit 150) is due, the wakeups before it drain
        // and unwind.
        let long = Plan {
            start_step: 100,
            active: 50,
            ..Plan::default()
        }
        .kernel_config(100);
        // The close at 1050 ms, from 1050 − (4 + 40/8) ms.
        assert_eq!(
            realtime(1010 * MS, seen(110, 1010 * MS), &long, Next::Sleep),
            (Next::WakeAt(1041 * MS), false)
        );
        assert_eq!(
            realtime(1041 * MS, seen(110, 1010 * MS), &long, Next::Sleep),
            (Next::Sleep, true)
        );
        assert_eq!(
            rt(1038 * MS, seen(50, 1000 * MS), Next::Sleep),
            (Next::Sleep, true)
        );
        // Spinning for it (a CPU is free): not raised.
        assert_eq!(
            rt(1044 * MS, seen(95, 1043 * MS), Next::Spin),
            (Next::Spin, false)
        );
        assert_eq!(
            rt(1044 * MS, seen(95, 1043 * MS), Next::Sleep),
            (Next::Sleep, true)
        );
        // Through the window's waking hits 98..=101, one step apart.
        assert_eq!(
            rt(1049 * MS, seen(99, 1049 * MS), Next::Sleep),
            (Next::Sleep, true)
        );
        // Late past the allowance (1048 + 4.25 ms for hit 98 seen from 96):
        // the kernel's wakeup comes at normal priority.
        assert!(rt(1052 * MS, seen(96, 1046 * MS), Next::Sleep).1);
        assert!(!rt(1053 * MS, seen(96, 1046 * MS), Next::Sleep).1);
        // The close read: nothing left to wait for.
        assert_eq!(
            rt(1052 * MS, seen(101, 1051 * MS), Next::Sleep),
            (Next::Sleep, false)
        );
        // Before the first hit, only a waking hit 1 is due (not 98).
        assert_eq!(rt(MS, None, Next::Sleep), (Next::Sleep, false));
        // No plan in the kernel: never.
        assert_eq!(
            realtime(
                1038 * MS,
                seen(50, 1000 * MS),
                &PlanConfig::default(),
                Next::Sleep
            ),
            (Next::Sleep, false)
        );
    }
}
