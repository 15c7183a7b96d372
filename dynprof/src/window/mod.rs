//! Window plans and the scheduler that opens and closes windows at exact
//! step boundaries.
//!
//! A [`Plan`] is what a trigger asks for (flags, console, config file). It is
//! turned into a kernel [`PlanConfig`] in hit indices: the step program
//! evaluates it at every step hit and sets the gate itself, so no user-space
//! round trip decides where a window begins or ends. User space learns of
//! every boundary from the `StepEvent`s (whose `gate` is the kernel's
//! decision at that hit), arms collectors ahead of time and finalizes each
//! window into a `PROF_*` directory ([`profdir`]).
pub mod collector;
pub mod meta;
pub mod profdir;
pub mod scheduler;
pub mod state;
pub mod trigger;
pub mod writer;

use anyhow::{Result, bail};
use dynprof_common::PlanConfig;
use serde::Serialize;

pub use scheduler::{Scheduler, SchedulerOptions, WindowRecord};

/// Step events this many hits before a window wake user space at once (the
/// rest are batched), so that the scheduler arms collectors in time even
/// when steps are slow. At fast rates it arms earlier, from its tick.
pub const WAKE_LEAD: u64 = 2;

/// `active` value of an open-ended window (console `start` … `stop`).
pub const UNTIL_STOP: u64 = u64::MAX;

/// What a trigger asks for, in steps as dynprof numbers them (hit k of the
/// step marker after attach begins step k).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// First step inside the window (warmup included). -1: the next
    /// boundary; 0: no collection.
    pub start_step: i64,
    /// Steps inside the window but not recorded.
    pub warmup: u64,
    /// Steps recorded; [`UNTIL_STOP`] for an open-ended window.
    pub active: u64,
    /// Extra windows after the first one; 0 = once.
    pub repeat: u64,
    /// Steps between the end of one window and the start of the next.
    pub gap: u64,
}

impl Default for Plan {
    fn default() -> Self {
        Self {
            start_step: -1,
            warmup: 0,
            active: 1,
            repeat: 0,
            gap: 0,
        }
    }
}

impl Plan {
    /// The console's `start`: from the next boundary until `stop`.
    pub fn until_stop() -> Self {
        Self {
            active: UNTIL_STOP,
            ..Self::default()
        }
    }

    pub fn open_ended(&self) -> bool {
        self.active == UNTIL_STOP
    }

    /// Rejects plans that can never record anything.
    pub fn validate(&self) -> Result<()> {
        if self.start_step < -1 {
            bail!(
                "start step must be -1 (next boundary), 0 (none) or a step number >= 1 (got {})",
                self.start_step
            );
        }
        if self.active == 0 {
            bail!("active must be at least 1 step");
        }
        Ok(())
    }

    /// Steps inside the gate per window.
    pub fn span(&self) -> u64 {
        if self.open_ended() {
            u64::MAX / 4
        } else {
            self.warmup.saturating_add(self.active)
        }
    }

    /// Steps from one window's start to the next one's.
    pub fn period(&self) -> u64 {
        self.span().saturating_add(self.gap).max(1)
    }

    /// The kernel plan when the first window starts at hit `start`.
    pub fn kernel_config(&self, start: u64) -> PlanConfig {
        let end = if self.open_ended() {
            u64::MAX
        } else {
            start.saturating_add(self.period().saturating_mul(self.repeat.saturating_add(1)))
        };
        PlanConfig {
            armed: 1,
            _pad: 0,
            start,
            end,
            span: self.span(),
            period: self.period(),
            warmup: self.warmup,
            lead: WAKE_LEAD,
        }
    }

    /// Human description, e.g. `start 5, warmup 1, active 3, repeat 0`.
    pub fn describe(&self) -> String {
        let start = match self.start_step {
            -1 => "next boundary".to_string(),
            s => format!("step {s}"),
        };
        let active = if self.open_ended() {
            "until stop".to_string()
        } else {
            self.active.to_string()
        };
        let mut s = format!("start {start}, warmup {}, active {active}", self.warmup);
        if self.repeat > 0 {
            s.push_str(&format!(", repeat {} (gap {})", self.repeat, self.gap));
        }
        s
    }
}

/// The first hit a plan may start at, given the current hit count `c`:
/// `start_step` itself if it is still ahead, the next boundary otherwise.
pub fn first_start(plan: &Plan, c: u64) -> u64 {
    match plan.start_step {
        s if s > 0 && (s as u64) > c => s as u64,
        _ => c + 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hits whose step events wake user space: exactly the ones where
    /// the scheduler acts (arm two steps ahead, open, first recorded step,
    /// close), per cycle; none without a plan.
    #[test]
    fn only_acting_hits_wake_user_space() {
        let p = Plan {
            start_step: 10,
            warmup: 1,
            active: 3,
            repeat: 1,
            gap: 5,
        };
        let cfg = p.kernel_config(10);
        let wake: Vec<u64> = (0..40).filter(|k| cfg.wakes(*k)).collect();
        // cycle 0: 10..=13 in the gate, close at 14; cycle 1 starts at 19.
        assert_eq!(wake, vec![8, 9, 10, 11, 14, 17, 18, 19, 20, 23, 28]);
        assert!((0..40).all(|k| !PlanConfig::DISARMED.wakes(k)));
        let open = Plan {
            start_step: 3,
            warmup: 0,
            active: UNTIL_STOP,
            repeat: 0,
            gap: 0,
        }
        .kernel_config(3);
        let wake: Vec<u64> = (0..1000).filter(|k| open.wakes(*k)).collect();
        assert_eq!(wake, vec![1, 2, 3]);
    }

    #[test]
    fn plan_covers_warmup_and_active() {
        let p = Plan {
            start_step: 5,
            warmup: 1,
            active: 3,
            repeat: 0,
            gap: 0,
        };
        let cfg = p.kernel_config(5);
        let open: Vec<u64> = (0..20).filter(|k| cfg.gate(*k)).collect();
        assert_eq!(open, vec![5, 6, 7, 8]);
    }

    #[test]
    fn repeats_with_gap() {
        let p = Plan {
            start_step: 3,
            warmup: 0,
            active: 2,
            repeat: 2,
            gap: 1,
        };
        let cfg = p.kernel_config(3);
        let open: Vec<u64> = (0..30).filter(|k| cfg.gate(*k)).collect();
        assert_eq!(open, vec![3, 4, 6, 7, 9, 10]);
    }

    #[test]
    fn open_ended_runs_until_end_is_set() {
        let p = Plan {
            start_step: -1,
            warmup: 0,
            active: UNTIL_STOP,
            repeat: 0,
            gap: 0,
        };
        let mut cfg = p.kernel_config(10);
        assert!(cfg.gate(10) && cfg.gate(1_000_000));
        cfg.end = 13;
        let open: Vec<u64> = (0..30).filter(|k| cfg.gate(*k)).collect();
        assert_eq!(open, vec![10, 11, 12]);
    }

    #[test]
    fn past_start_moves_to_next_boundary() {
        let p = Plan {
            start_step: 5,
            ..Plan::default()
        };
        assert_eq!(first_start(&p, 2), 5);
        assert_eq!(first_start(&p, 5), 6);
        assert_eq!(first_start(&Plan::default(), 7), 8);
    }

    /// `next_wake` (closed form) names the same hit as scanning every hit
    /// for `wakes`, for every small plan and position.
    #[test]
    fn next_wake_agrees_with_scanning_every_hit() {
        let mut plans = 0;
        for start in [1u64, 2, 5, 9] {
            for warmup in 0..3 {
                for active in 1..4 {
                    for gap in 0..4 {
                        for repeat in 0..3 {
                            let p = Plan {
                                start_step: start as i64,
                                warmup,
                                active,
                                repeat,
                                gap,
                            };
                            let cfg = p.kernel_config(start);
                            plans += 1;
                            for k in 0..60 {
                                let scan = (k + 1..200).find(|&h| cfg.wakes(h));
                                assert_eq!(cfg.next_wake(k), scan, "{p:?} after hit {k}");
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(plans, 4 * 3 * 3 * 4 * 3);
        // The window example above: lead-in 8, 9, open 10, first recorded
        // 11, one after the other; then the close at 14.
        let cfg = Plan {
            start_step: 10,
            warmup: 1,
            active: 3,
            repeat: 1,
            gap: 5,
        }
        .kernel_config(10);
        assert_eq!(cfg.next_wake(0), Some(8));
        assert_eq!(cfg.next_wake(8), Some(9));
        assert_eq!(cfg.next_wake(11), Some(14));
        assert_eq!(cfg.next_wake(28), None);
        assert_eq!(PlanConfig::DISARMED.next_wake(3), None);
        // Open-ended: a far-off start is found without scanning to it, and
        // after the open the next wake is the lead-in of a nominal second
        // cycle, 2^62 steps on.
        let open = Plan::until_stop().kernel_config(3_000_000_000);
        assert_eq!(open.next_wake(5), Some(2_999_999_998));
        assert_eq!(
            open.next_wake(3_000_000_000),
            Some(3_000_000_000 + u64::MAX / 4 - WAKE_LEAD)
        );
    }
}
