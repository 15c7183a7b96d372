//! The step clock: step-marker hits → step indices and durations.
use std::collections::{BTreeMap, VecDeque};

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

#[derive(Default)]
pub struct StepClock {
    /// Step hits seen; the last hit index.
    last: Option<(StepIndex, u64, u32)>,
    aux_current: BTreeMap<String, u64>,
    durations_ns: Vec<u64>,
    aux_totals: BTreeMap<String, u64>,
    recent: VecDeque<u64>,
    pub steps_seen: u64,
    pub first_ts_ns: Option<u64>,
    pub last_ts_ns: Option<u64>,
    /// The aux markers are attached only around windows: a mean over all
    /// steps would mix steps without them, so the summary leaves it out
    /// (the windows' steps.csv has the exact counts).
    pub aux_in_windows_only: bool,
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
            self.durations_ns.push(dur);
            self.recent.push_back(dur);
            if self.recent.len() > 20 {
                self.recent.pop_front();
            }
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
        let mut recent: Vec<u64> = self.recent.iter().copied().collect();
        recent.sort_unstable();
        let step_ns = recent.get(recent.len() / 2).copied().unwrap_or(0);
        Some(super::spin::Seen {
            hit: hit.0,
            ts_ns,
            step_ns,
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
        let mut d = self.durations_ns.clone();
        d.sort_unstable();
        let completed = d.len() as u64;
        let mean = if d.is_empty() {
            0.0
        } else {
            d.iter().sum::<u64>() as f64 / d.len() as f64
        };
        StepSummary {
            steps: self.steps_seen,
            completed_steps: completed,
            mean_ms: mean / 1e6,
            p50_ms: percentile(&d, 50.0) as f64 / 1e6,
            p99_ms: percentile(&d, 99.0) as f64 / 1e6,
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
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Per completed step; empty when `aux_in_windows_only`.
    pub aux_per_step: BTreeMap<String, f64>,
    pub aux_in_windows_only: bool,
}

/// Nearest-rank percentile of sorted values.
pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
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

    #[test]
    fn nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), 50);
        assert_eq!(percentile(&v, 99.0), 99);
        assert_eq!(percentile(&[5], 99.0), 5);
    }
}
