//! The `straggler:` verdict from the per-rank step table.
//!
//! Ranks in lockstep all take the same time per step, so step time alone
//! names nobody. What differs is how the step splits: a rank that computes
//! longer makes every other rank wait for it in the next collective
//! (msprof-analyze's "Computing" vs "Communication (not overlapped)";
//! HTA's late collective start). The straggler is the rank whose compute
//! per step stands out above the median rank's, and the evidence is its
//! compute against the median and the others' collective wait.
use serde::Serialize;

use super::{Rank, table::JobStepRow};

/// A rank's compute must exceed the median by this share of the median…
pub const EXCESS_OF_MEDIAN: f64 = 0.25;
/// …and by this share of the step time (noise on tiny computes).
pub const EXCESS_OF_STEP: f64 = 0.10;

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RankStat {
    pub rank: Rank,
    pub steps: u64,
    pub mean_duration_ns: u64,
    pub mean_compute_ns: u64,
    pub mean_collective_wait_ns: u64,
    pub mean_device_wait_ns: u64,
    pub api_calls_per_step: f64,
    /// Job steps in which this rank waited least in collectives, i.e. came
    /// last into them (HTA's late collective start): the others waited for
    /// it.
    pub last_into_collective: u64,
}

pub fn per_rank(rows: &[JobStepRow]) -> Vec<RankStat> {
    // Per job step, the rank with the least collective wait (only steps that
    // more than one rank recorded, and with a unique least).
    let mut last: std::collections::HashMap<Rank, u64> = std::collections::HashMap::new();
    let mut steps: Vec<u64> = rows.iter().map(|r| r.step).collect();
    steps.sort_unstable();
    steps.dedup();
    for s in steps {
        let v: Vec<&JobStepRow> = rows.iter().filter(|r| r.step == s).collect();
        let min = v.iter().map(|r| r.collective_wait_ns).min().unwrap_or(0);
        let least: Vec<&&JobStepRow> = v.iter().filter(|r| r.collective_wait_ns == min).collect();
        if v.len() > 1 && least.len() == 1 {
            *last.entry(least[0].rank).or_default() += 1;
        }
    }
    let mut ranks: Vec<Rank> = rows.iter().map(|r| r.rank).collect();
    ranks.sort();
    ranks.dedup();
    ranks
        .into_iter()
        .map(|rank| {
            let v: Vec<&JobStepRow> = rows.iter().filter(|r| r.rank == rank).collect();
            let n = v.len() as u64;
            let mean = |f: fn(&JobStepRow) -> u64| v.iter().map(|r| f(r)).sum::<u64>() / n.max(1);
            RankStat {
                rank,
                steps: n,
                mean_duration_ns: mean(|r| r.duration_ns),
                mean_compute_ns: mean(|r| r.compute_ns),
                mean_collective_wait_ns: mean(|r| r.collective_wait_ns),
                mean_device_wait_ns: mean(|r| r.device_wait_ns),
                api_calls_per_step: v.iter().map(|r| r.api_calls).sum::<u64>() as f64
                    / n.max(1) as f64,
                last_into_collective: last.get(&rank).copied().unwrap_or(0),
            }
        })
        .collect()
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Verdict {
    pub stragglers: Vec<Rank>,
    /// The whole line, beginning `straggler:`.
    pub text: String,
}

fn ms(ns: u64) -> String {
    format!("{:.1} ms", ns as f64 / 1e6)
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    if v.is_empty() {
        return 0;
    }
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2
    }
}

pub fn verdict(stats: &[RankStat]) -> Verdict {
    if stats.len() < 2 {
        return Verdict {
            stragglers: vec![],
            text: format!("straggler: none (only {} rank recorded steps)", stats.len()),
        };
    }
    let med = median(stats.iter().map(|s| s.mean_compute_ns).collect());
    let step = median(stats.iter().map(|s| s.mean_duration_ns).collect());
    let bar = (med as f64 * EXCESS_OF_MEDIAN).max(step as f64 * EXCESS_OF_STEP);
    let slow: Vec<&RankStat> = stats
        .iter()
        .filter(|s| s.mean_compute_ns as f64 - med as f64 > bar)
        .collect();
    if slow.is_empty() {
        let lo = stats.iter().map(|s| s.mean_compute_ns).min().unwrap_or(0);
        let hi = stats.iter().map(|s| s.mean_compute_ns).max().unwrap_or(0);
        return Verdict {
            stragglers: vec![],
            text: format!(
                "straggler: none stands out: compute per step {} to {} over {} ranks (median {}, step {})",
                ms(lo),
                ms(hi),
                stats.len(),
                ms(med),
                ms(step)
            ),
        };
    }
    let others: Vec<&RankStat> = stats
        .iter()
        .filter(|s| !slow.iter().any(|x| x.rank == s.rank))
        .collect();
    let others_wait = others
        .iter()
        .map(|s| s.mean_collective_wait_ns)
        .sum::<u64>()
        / (others.len() as u64).max(1);
    let names = slow
        .iter()
        .map(|s| format!("rank {}", s.rank))
        .collect::<Vec<_>>()
        .join(", ");
    let evidence = slow
        .iter()
        .map(|s| {
            format!(
                "rank {} computes {} per step vs {} median, waits {} in collectives, \
                 last into the collective in {} of {} steps",
                s.rank,
                ms(s.mean_compute_ns),
                ms(med),
                ms(s.mean_collective_wait_ns),
                s.last_into_collective,
                s.steps
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    Verdict {
        stragglers: slow.iter().map(|s| s.rank).collect(),
        text: format!(
            "straggler: {names}: {evidence}; the other {} rank(s) wait {} per step in collectives (step {})",
            others.len(),
            ms(others_wait),
            ms(step)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(rank: u32, step: u64, compute: u64, wait: u64) -> JobStepRow {
        JobStepRow {
            rank: Rank(rank),
            step,
            start_ts_ns: step * 1000,
            end_ts_ns: step * 1000 + compute + wait,
            duration_ns: compute + wait,
            compute_ns: compute,
            collective_wait_ns: wait,
            device_wait_ns: 0,
            api_calls: 1,
        }
    }

    #[test]
    fn names_the_rank_that_computes_while_the_others_wait() {
        let mut rows = Vec::new();
        for s in 1..=3 {
            rows.push(row(0, s, 10_000_000, 30_000_000));
            rows.push(row(1, s, 11_000_000, 29_000_000));
            rows.push(row(2, s, 38_000_000, 2_000_000));
            rows.push(row(3, s, 9_000_000, 31_000_000));
        }
        let st = per_rank(&rows);
        assert_eq!(st[2].mean_compute_ns, 38_000_000);
        assert_eq!(
            st.iter()
                .map(|s| s.last_into_collective)
                .collect::<Vec<_>>(),
            [0, 0, 3, 0]
        );
        let v = verdict(&st);
        assert_eq!(v.stragglers, vec![Rank(2)]);
        assert!(
            v.text
                .starts_with("straggler: rank 2: rank 2 computes 38.0 ms"),
            "{}",
            v.text
        );
        assert!(
            v.text
                .contains("waits 2.0 ms in collectives, last into the collective in 3 of 3 steps;"),
            "{}",
            v.text
        );
        assert!(
            v.text.contains("the other 3 rank(s) wait 30.0 ms"),
            "{}",
            v.text
        );
    }

    #[test]
    fn balanced_ranks_name_nobody() {
        let rows: Vec<JobStepRow> = (0..4)
            .map(|r| row(r, 1, 20_000_000 + u64::from(r) * 500_000, 5_000_000))
            .collect();
        let v = verdict(&per_rank(&rows));
        assert!(v.stragglers.is_empty());
        assert!(
            v.text.starts_with("straggler: none stands out"),
            "{}",
            v.text
        );
        assert!(
            verdict(&per_rank(&rows[..1]))
                .text
                .starts_with("straggler: none (only 1 rank")
        );
    }
}
