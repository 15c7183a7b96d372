//! The step clock: step-marker hits → step indices and durations.
use std::collections::{BTreeMap, VecDeque};

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::types::StepIndex;

/// One completed step (its boundary hit and the next one were both seen).
#[derive(Clone, Debug, Serialize)]
pub struct CompletedStep {
    pub step: StepIndex,
    pub start_ts_ns: u64,
    pub end_ts_ns: u64,
    pub tid: u32,
    /// Aux hits during the step, by aux label.
    pub aux: BTreeMap<String, u64>,
}

impl CompletedStep {
    pub fn duration_ns(&self) -> u64 {
        self.end_ts_ns.saturating_sub(self.start_ts_ns)
    }
}

pub struct StepClock {
    /// Step hits seen; the last hit index.
    last: Option<(StepIndex, u64, u32)>,
    aux_current: BTreeMap<String, u64>,
    /// Every completed step's duration, in bounded memory: an attach (the
    /// agent's above all) can last weeks, and a list of them would grow by
    /// 8 bytes a step without end. Percentiles to 3 significant digits.
    durations_ns: Histogram<u64>,
    /// Exact sum of `durations_ns`, for the mean.
    sum_ns: u128,
    aux_totals: BTreeMap<String, u64>,
    recent: VecDeque<u64>,
    /// Median of `recent`, computed once per step: the event loop asks for
    /// it every turn (`seen`), and while it polls that is every few µs.
    recent_median_ns: u64,
    pub steps_seen: u64,
    pub first_ts_ns: Option<u64>,
    pub last_ts_ns: Option<u64>,
    /// The aux markers are attached only around windows: a mean over all
    /// steps would mix steps without them, so the summary leaves it out
    /// (the windows' steps.csv has the exact counts).
    pub aux_in_windows_only: bool,
}

impl Default for StepClock {
    fn default() -> Self {
        StepClock {
            last: None,
            aux_current: BTreeMap::new(),
            // Auto-resizing, so no duration is out of range.
            durations_ns: Histogram::new(3).expect("3 significant digits is a valid precision"),
            sum_ns: 0,
            aux_totals: BTreeMap::new(),
            recent: VecDeque::new(),
            recent_median_ns: 0,
            steps_seen: 0,
            first_ts_ns: None,
            last_ts_ns: None,
            aux_in_windows_only: false,
        }
    }
}

impl StepClock {
    /// A step boundary: hit `k` begins step `k` and ends step `k-1`.
    pub fn on_step(&mut self, k: StepIndex, ts_ns: u64, tid: u32) -> Option<CompletedStep> {
        self.steps_seen += 1;
        self.first_ts_ns.get_or_insert(ts_ns);
        self.last_ts_ns = Some(ts_ns);
        let aux = std::mem::take(&mut self.aux_current);
        let done = self.last.map(|(prev, start, ptid)| CompletedStep {
            step: prev,
            start_ts_ns: start,
            end_ts_ns: ts_ns,
            tid: ptid,
            aux,
        });
        if let Some(d) = &done {
            let dur = d.duration_ns();
            // Auto-resizing: recording cannot fail for a u64.
            let _ = self.durations_ns.record(dur);
            self.sum_ns += u128::from(dur);
            self.recent.push_back(dur);
            if self.recent.len() > 20 {
                self.recent.pop_front();
            }
            let mut r: Vec<u64> = self.recent.iter().copied().collect();
            r.sort_unstable();
            self.recent_median_ns = r[r.len() / 2];
            for (k, v) in &d.aux {
                *self.aux_totals.entry(k.clone()).or_default() += v;
            }
        }
        self.last = Some((k, ts_ns, tid));
        done
    }

    pub fn on_aux(&mut self, label: &str) {
        *self.aux_current.entry(label.to_string()).or_default() += 1;
    }

    pub fn current(&self) -> StepIndex {
        self.last.map(|l| l.0).unwrap_or(StepIndex(0))
    }

    /// The latest hit and the median of the last 20 steps (0 before one
    /// completed), for predicting when a coming hit is due (`spin`);
    /// `None` before the first hit.
    pub fn seen(&self) -> Option<super::spin::Seen> {
        let (hit, ts_ns, _) = self.last?;
        Some(super::spin::Seen {
            hit: hit.0,
            ts_ns,
            step_ns: self.recent_median_ns,
        })
    }

    /// Steps per second over the last 20 completed steps.
    pub fn rate(&self) -> f64 {
        let sum: u64 = self.recent.iter().sum();
        if sum == 0 {
            0.0
        } else {
            self.recent.len() as f64 * 1e9 / sum as f64
        }
    }

    pub fn summary(&self) -> StepSummary {
        let d = &self.durations_ns;
        let completed = d.len();
        let mean = if completed == 0 {
            0.0
        } else {
            self.sum_ns as f64 / completed as f64
        };
        let q = |p: f64| {
            if completed == 0 {
                0
            } else {
                d.value_at_quantile(p)
            }
        };
        StepSummary {
            steps: self.steps_seen,
            completed_steps: completed,
            mean_ms: mean / 1e6,
            p50_ms: q(0.50) as f64 / 1e6,
            p99_ms: q(0.99) as f64 / 1e6,
            aux_in_windows_only: self.aux_in_windows_only,
            aux_per_step: self
                .aux_totals
                .iter()
                .filter(|_| !self.aux_in_windows_only)
                .map(|(k, v)| {
                    (
                        k.clone(),
                        if completed == 0 {
                            0.0
                        } else {
                            *v as f64 / completed as f64
                        },
                    )
                })
                .collect(),
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct StepSummary {
    /// Step boundaries seen (marker hits).
    pub steps: u64,
    /// Steps whose start and end were both seen.
    pub completed_steps: u64,
    /// Exact.
    pub mean_ms: f64,
    /// To 3 significant digits (kept in a histogram, not a list).
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Per completed step; empty when `aux_in_windows_only`.
    pub aux_per_step: BTreeMap<String, f64>,
    pub aux_in_windows_only: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_become_steps() {
        let mut c = StepClock::default();
        assert!(c.on_step(StepIndex(1), 100, 7).is_none());
        c.on_aux("backward");
        c.on_aux("backward");
        let s = c.on_step(StepIndex(2), 350, 7).unwrap();
        assert_eq!(
            (s.step, s.start_ts_ns, s.end_ts_ns),
            (StepIndex(1), 100, 350)
        );
        assert_eq!(s.aux["backward"], 2);
        let sum = c.summary();
        assert_eq!((sum.steps, sum.completed_steps), (2, 1));
        assert_eq!(sum.aux_per_step["backward"], 2.0);
    }

    /// Steps of 1, 2, …, 100 ms: the summary's mean is exact, its
    /// percentiles are the nearest-rank ones to 3 significant digits.
    #[test]
    fn summary_of_many_steps() {
        let mut c = StepClock::default();
        let mut ts = 0u64;
        c.on_step(StepIndex(0), ts, 1);
        for k in 1..=100u64 {
            ts += k * 1_000_000;
            c.on_step(StepIndex(k), ts, 1);
        }
        let s = c.summary();
        assert_eq!((s.steps, s.completed_steps), (101, 100));
        assert_eq!(s.mean_ms, 50.5);
        assert!((s.p50_ms - 50.0).abs() <= 0.05, "p50 {}", s.p50_ms);
        assert!((s.p99_ms - 99.0).abs() <= 0.1, "p99 {}", s.p99_ms);
    }

    /// `seen` gives the latest hit and the median of the last 20 steps only.
    #[test]
    fn seen_is_the_median_of_the_last_20_steps() {
        let mut c = StepClock::default();
        assert!(c.seen().is_none());
        c.on_step(StepIndex(5), 1_000, 1);
        assert_eq!(c.seen().unwrap().step_ns, 0, "no step completed yet");
        // 30 steps of 10 µs, then 20 of 3 µs: the older ones are forgotten.
        let mut ts = 1_000;
        let mut k = 5;
        for dur in std::iter::repeat_n(10_000, 30).chain(std::iter::repeat_n(3_000, 20)) {
            ts += dur;
            k += 1;
            c.on_step(StepIndex(k), ts, 1);
        }
        let s = c.seen().unwrap();
        assert_eq!((s.hit, s.ts_ns, s.step_ns), (55, ts, 3_000));
        // 11 of the last 20 long again: the median follows.
        for _ in 0..11 {
            ts += 10_000;
            k += 1;
            c.on_step(StepIndex(k), ts, 1);
        }
        assert_eq!(c.seen().unwrap().step_ns, 10_000);
    }
}
