//! Which step of each rank is the same job iteration.
//!
//! Each rank counts its own steps from its own attach (hit k of its step
//! marker begins its step k), and the ranks are attached one after another,
//! so the same iteration has a different index on each rank. Job steps are
//! the reference rank's (the lowest rank's) own indices.
//!
//! The rule, applied to the boundary timestamps every rank reported:
//! 1. `T0` is the latest of the ranks' first reported boundaries: at `T0`
//!    every rank was attached and counting.
//! 2. The step period `P` is the median gap between the reference rank's
//!    boundaries.
//! 3. The reference boundaries are the reference rank's first [`VOTES`]
//!    consecutive boundaries after `T0 + P/2`: every rank was attached well
//!    before them, so every rank counted them.
//! 4. For each rank, every index offset that makes one of its boundaries
//!    the nearest to a reference boundary (and the offsets next to those)
//!    is scored by the mean distance, over all [`VOTES`] reference
//!    boundaries, between each reference boundary and the rank's own
//!    boundary at that offset. The best offset is taken when its median
//!    distance is within `2P/5` and its mean is at most half the
//!    runner-up's. Ranks in lockstep cross a boundary a few milliseconds
//!    apart; on a loaded host (8 ranks on 2 cores) single boundaries are
//!    more than half a step apart, which defeats a per-boundary nearest
//!    match, but over six boundaries the right offset is still clearly the
//!    nearest while its neighbours are a whole step away on average. Ranks
//!    that run half a step apart, or drift apart (different periods), give
//!    no clear best, and job mode refuses to guess.
//!
//! The offsets and the evidence (each rank's matched indices, timestamps and
//! distance to the reference) are recorded; after the window, [`verify`]
//! checks the recorded steps' own timestamps against the same bound.
use serde::Serialize;

use super::Rank;

/// One step-marker hit of one rank: own index and CLOCK_MONOTONIC time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hit {
    pub step: u64,
    pub ts_ns: u64,
}

/// A rank's boundaries so far, ascending.
#[derive(Clone, Debug, Default)]
pub struct RankHits {
    pub rank: Option<Rank>,
    pub hits: Vec<Hit>,
}

/// Why there is no alignment yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pending {
    /// More boundaries are needed (say which).
    Wait(String),
    /// The boundaries contradict lockstep: no alignment will come.
    Fail(String),
}

/// What one rank's alignment rests on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RankAlign {
    pub rank: Rank,
    /// own step index = job step + offset.
    pub offset: i64,
    /// Reference-rank indices of the two consecutive boundaries recorded as
    /// evidence (both matched with `offset`).
    pub reference_hits: [u64; 2],
    /// Own indices matched to them.
    pub own_hits: [u64; 2],
    pub ts_ns: [u64; 2],
    /// Signed distance to the reference boundary, ns.
    pub delta_ns: [i64; 2],
    /// How many of the reference boundaries are within `2P/5` of the
    /// rank's own at `offset`.
    pub votes: u32,
    /// Reference boundaries the offset was scored on.
    pub boundaries: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Alignment {
    pub reference: Rank,
    /// Reference rank's median step period when aligned.
    pub period_ns: u64,
    /// Latest first boundary over all ranks (every rank counting).
    pub all_attached_ts_ns: u64,
    /// Job steps (reference own indices) of the first two reference
    /// boundaries.
    pub reference_steps: [u64; 2],
    pub ranks: Vec<RankAlign>,
}

impl Alignment {
    fn of(&self, r: Rank) -> Option<&RankAlign> {
        self.ranks.iter().find(|a| a.rank == r)
    }

    /// Rank `r`'s own index of job step `j` (None below its step 1).
    pub fn own_step(&self, r: Rank, j: u64) -> Option<u64> {
        let v = i128::from(j) + i128::from(self.of(r)?.offset);
        (v >= 1).then(|| u64::try_from(v).ok()).flatten()
    }

    /// The job step of rank `r`'s own step `k`.
    pub fn job_step(&self, r: Rank, k: u64) -> Option<u64> {
        let v = i128::from(k) - i128::from(self.of(r)?.offset);
        (v >= 1).then(|| u64::try_from(v).ok()).flatten()
    }

    /// The largest |distance| to the reference seen while aligning.
    pub fn max_delta_ns(&self) -> u64 {
        self.ranks
            .iter()
            .flat_map(|a| a.delta_ns)
            .map(|d| d.unsigned_abs())
            .max()
            .unwrap_or(0)
    }
}

/// Reference boundaries each rank's offset is scored on, at least; up to
/// [`MAX_VOTES`] while the best offset is not clear.
pub const VOTES: usize = 6;
pub const MAX_VOTES: usize = 20;

/// Alignments a flags plan tries, each on fresh boundaries, before job
/// mode gives up on ranks that are not in lockstep.
pub const ATTEMPTS: u32 = 3;

/// How far apart two ranks may cross the same boundary: two fifths of a
/// step (the nearest boundary is unambiguous below half a step).
pub fn tolerance(period_ns: u64) -> u64 {
    period_ns / 5 * 2
}

fn median(mut v: Vec<u64>) -> Option<u64> {
    v.sort_unstable();
    v.get(v.len() / 2).copied()
}

fn nearest(hits: &[Hit], ts: u64) -> Option<Hit> {
    hits.iter().copied().min_by_key(|h| h.ts_ns.abs_diff(ts))
}

/// Mean |distance| between each reference boundary `(step, ts)` and the
/// rank's own boundary at `step + offset` (None when one is missing).
fn mean_distance(
    own: impl Fn(u64) -> Option<u64>,
    refs: &[(u64, u64)],
    offset: i64,
) -> Option<u64> {
    let mut sum = 0u64;
    for &(step, ts) in refs {
        let t = own(u64::try_from(step as i64 + offset).ok()?)?;
        sum = sum.saturating_add(t.abs_diff(ts));
    }
    Some(sum / refs.len().max(1) as u64)
}

/// Whether the best offset's mean distance makes it the same iteration:
/// within half a step, and at most half the runner-up's (a neighbouring
/// offset of ranks in lockstep is a whole step away on average).
fn clear(best: u64, runner_up: Option<u64>, period: u64) -> bool {
    best <= period / 2 && runner_up.is_none_or(|r| best.saturating_mul(2) <= r)
}

/// Aligns the ranks (see the module doc). `ranks[i].rank` must be set; the
/// reference is the lowest rank.
pub fn align(ranks: &[RankHits]) -> Result<Alignment, Pending> {
    let Some(reference) = ranks.iter().filter_map(|r| r.rank).min() else {
        return Err(Pending::Fail("no ranks".into()));
    };
    let mut t0 = 0;
    for r in ranks {
        match r.hits.first() {
            Some(h) => t0 = t0.max(h.ts_ns),
            None => {
                return Err(Pending::Wait(format!(
                    "rank {} has not crossed a step boundary yet",
                    r.rank.map_or("?".into(), |x| x.to_string())
                )));
            }
        }
    }
    let refh = &ranks
        .iter()
        .find(|r| r.rank == Some(reference))
        .expect("reference is one of them")
        .hits;
    let gaps: Vec<u64> = refh
        .windows(2)
        .map(|w| w[1].ts_ns.saturating_sub(w[0].ts_ns))
        .collect();
    if gaps.len() < 2 {
        return Err(Pending::Wait(format!(
            "rank {reference} has {} boundaries; 3 give its step period",
            refh.len()
        )));
    }
    let period = median(gaps).unwrap_or(0).max(1);
    let after = t0.saturating_add(period / 2);
    let Some(i) = refh.iter().position(|h| h.ts_ns > after) else {
        return Err(Pending::Wait(format!(
            "rank {reference} has not crossed a boundary after every rank was attached"
        )));
    };
    // The reference boundaries every rank has reported the boundary after
    // (the candidate offsets one above are scored on it), up to MAX_VOTES.
    let tolerance = tolerance(period);
    let reported = |b: &Hit| {
        ranks.iter().all(|r| {
            r.hits.last().map_or(0, |h| h.ts_ns) >= b.ts_ns.saturating_add(period + tolerance)
        })
    };
    let n = refh[i..]
        .iter()
        .take(MAX_VOTES)
        .take_while(|b| reported(b))
        .count();
    if n < VOTES {
        let laggard = ranks
            .iter()
            .min_by_key(|r| r.hits.last().map_or(0, |h| h.ts_ns))
            .and_then(|r| r.rank)
            .unwrap_or(reference);
        return Err(Pending::Wait(format!(
            "{n} of the {VOTES} boundaries after every rank was attached are reported by every \
             rank (rank {laggard} is the latest)"
        )));
    }
    let refs = &refh[i..i + n];
    if refs.windows(2).any(|w| w[1].step != w[0].step + 1) {
        return Err(Pending::Fail(format!(
            "rank {reference}'s boundaries {}..{} are not consecutive (lost events)",
            refs[0].step,
            refs[n - 1].step
        )));
    }
    let reference_steps = [refs[0].step, refs[1].step];
    let mut out = Vec::new();
    for r in ranks {
        let rank = r.rank.unwrap_or(reference);
        // The offsets that make one of its boundaries the nearest to a
        // reference boundary, and their neighbours: the candidates.
        let mut cands: Vec<i64> = Vec::new();
        for b in refs {
            let h = nearest(&r.hits, b.ts_ns).expect("rank has hits");
            let d = h.step as i64 - b.step as i64;
            for c in [d - 1, d, d + 1] {
                if !cands.contains(&c) {
                    cands.push(c);
                }
            }
        }
        let own = |step: u64| {
            r.hits
                .binary_search_by_key(&step, |h| h.step)
                .ok()
                .map(|k| r.hits[k].ts_ns)
        };
        let pairs: Vec<(u64, u64)> = refs.iter().map(|b| (b.step, b.ts_ns)).collect();
        let mut scored: Vec<(u64, i64)> = cands
            .iter()
            .filter_map(|&c| Some((mean_distance(own, &pairs, c)?, c)))
            .collect();
        scored.sort_unstable();
        let best = scored.first().copied();
        let runner_up = scored.get(1).map(|x| x.0);
        let Some((_, offset)) = best.filter(|b| clear(b.0, runner_up, period)) else {
            if n < MAX_VOTES {
                // A loaded host spreads single boundaries over more than
                // half a step: more of them decide.
                return Err(Pending::Wait(format!(
                    "rank {rank}: no clear index offset over {n} boundaries yet; waiting for more"
                )));
            }
            let ms = |x: Option<u64>| x.map_or(f64::NAN, |x| x as f64 / 1e6);
            return Err(Pending::Fail(format!(
                "rank {rank}: no index offset matches rank {reference}'s {n} boundaries {}..{}: \
                 the nearest offset is {:.3} ms away on average and the next {:.3} ms (needs at \
                 most half a step, {:.3} ms, and half the next one's): the ranks are not in \
                 lockstep, so their steps cannot be matched",
                refs[0].step,
                refs[n - 1].step,
                ms(best.map(|b| b.0)),
                ms(runner_up),
                period as f64 / 2e6
            )));
        };
        let m: Vec<(Hit, i64)> = refs
            .iter()
            .map(|b| {
                let step = (b.step as i64 + offset) as u64;
                let ts = own(step).expect("scored");
                (
                    Hit { step, ts_ns: ts },
                    (i128::from(ts) - i128::from(b.ts_ns)) as i64,
                )
            })
            .collect();
        let votes = m.iter().filter(|x| x.1.unsigned_abs() <= tolerance).count();
        // The evidence: the consecutive pair nearest to the reference.
        let j = (0..n - 1)
            .min_by_key(|&j| m[j].1.unsigned_abs() + m[j + 1].1.unsigned_abs())
            .expect("n > 1");
        out.push(RankAlign {
            rank,
            offset,
            reference_hits: [refs[j].step, refs[j + 1].step],
            own_hits: [m[j].0.step, m[j + 1].0.step],
            ts_ns: [m[j].0.ts_ns, m[j + 1].0.ts_ns],
            delta_ns: [m[j].1, m[j + 1].1],
            votes: votes as u32,
            boundaries: n as u32,
        });
    }
    out.sort_by_key(|a| a.rank);
    Ok(Alignment {
        reference,
        period_ns: period,
        all_attached_ts_ns: t0,
        reference_steps,
        ranks: out,
    })
}

/// The first job step a window may start at: the one asked for (`-1`: the
/// next), or later when the plan cannot reach every rank's kernel in time.
/// `now` is the reference rank's latest step; `lead` the steps the plans
/// need to be written everywhere.
pub fn job_start(requested: i64, now: u64, lead: u64) -> (u64, bool) {
    let earliest = now.saturating_add(lead).saturating_add(1);
    if requested > 0 && requested as u64 >= earliest {
        (requested as u64, false)
    } else {
        (earliest, requested > 0)
    }
}

/// Steps of lead for a step period and a number of ranks: half a second
/// (the plans are written after the step events are read, which is up to a
/// tick late) and a tenth of a second per rank, in steps, plus two. The
/// ranks take their plans one after another on one thread, and a rank
/// whose window is that close arms its collectors as it takes the plan
/// (tens of milliseconds with many uprobes into a large library), so the
/// last rank's plan arrives that much later.
pub fn lead_steps(period_ns: u64, ranks: usize) -> u64 {
    let lead_ns = 500_000_000u64.saturating_add(100_000_000u64.saturating_mul(ranks as u64));
    lead_ns.div_ceil(period_ns.max(1)).min(10_000) + 2
}

/// The after-the-fact check: each recorded job step's start, per rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Verification {
    /// Largest spread of one job step's start over the ranks, ns.
    pub max_skew_ns: u64,
    /// The job step where it was largest.
    pub worst_step: Option<u64>,
    /// Half the median step duration: the most a rank's steps may start
    /// from the reference rank's same job steps, on average.
    pub bound_ns: u64,
    /// Ranks whose recorded steps are not clearly the reference rank's same
    /// iterations: their mean start distance is over the bound, or not at
    /// most half of what it is one step earlier or later.
    pub unclear: Vec<Rank>,
    /// Job steps some rank did not record.
    pub missing: Vec<(Rank, u64)>,
    pub ok: bool,
}

/// Checks that every rank's recorded job steps are the reference rank's
/// same iterations, by the rule of [`align`]: over the window, the mean
/// distance between their starts is within half a step and at most half
/// of what it is with the rank shifted one step either way. (One step's
/// spread may exceed half a step on a loaded host without any doubt about
/// which iteration it is; it is reported as `max_skew_ns`.)
/// `rows` is (rank, job step, start, duration).
pub fn verify(ranks: &[Rank], rows: &[(Rank, u64, u64, u64)]) -> Verification {
    use std::collections::{BTreeMap, BTreeSet};
    let mut by_step: BTreeMap<u64, Vec<(Rank, u64)>> = BTreeMap::new();
    let mut start: BTreeMap<(Rank, u64), u64> = BTreeMap::new();
    for (r, j, t, _) in rows {
        by_step.entry(*j).or_default().push((*r, *t));
        start.insert((*r, *j), *t);
    }
    let period = median(rows.iter().map(|r| r.3).collect()).unwrap_or(0);
    let bound = period / 2;
    let mut max_skew = 0;
    let mut worst = None;
    let mut missing = Vec::new();
    for (j, v) in &by_step {
        let have: BTreeSet<Rank> = v.iter().map(|x| x.0).collect();
        missing.extend(ranks.iter().filter(|r| !have.contains(r)).map(|r| (*r, *j)));
        let lo = v.iter().map(|x| x.1).min().unwrap_or(0);
        let hi = v.iter().map(|x| x.1).max().unwrap_or(0);
        if hi - lo >= max_skew {
            max_skew = hi - lo;
            worst = Some(*j);
        }
    }
    let mut unclear = Vec::new();
    if let Some(&reference) = ranks.iter().min() {
        let refs: Vec<(u64, u64)> = by_step
            .keys()
            .filter_map(|&j| Some((j, *start.get(&(reference, j))?)))
            .collect();
        // Inner steps: the neighbours one step either way were recorded.
        let inner = refs.get(1..refs.len().saturating_sub(1)).unwrap_or(&[]);
        for &r in ranks.iter().filter(|&&r| r != reference) {
            let own = |j: u64| start.get(&(r, j)).copied();
            let ok = if inner.is_empty() {
                mean_distance(own, &refs, 0).is_some_and(|m| m < bound.max(1))
            } else {
                let runner = [-1, 1]
                    .iter()
                    .filter_map(|&s| mean_distance(own, inner, s))
                    .min();
                mean_distance(own, inner, 0).is_some_and(|m| clear(m, runner, period))
            };
            if !ok {
                unclear.push(r);
            }
        }
    }
    Verification {
        max_skew_ns: max_skew,
        worst_step: worst,
        bound_ns: bound,
        ok: missing.is_empty() && !by_step.is_empty() && unclear.is_empty(),
        unclear,
        missing,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// Ranks in lockstep at 100 ms per step for 40 iterations, attached at
    /// different iterations (rank 1 two iterations before rank 0, rank 2
    /// one after), crossing each boundary up to 3 ms apart.
    fn lockstep() -> Vec<RankHits> {
        let mk = |rank: u32, first_iter: u64, skew: u64| RankHits {
            rank: Some(Rank(rank)),
            hits: (first_iter..40)
                .map(|it| Hit {
                    step: it - first_iter + 1,
                    ts_ns: 1_000 * MS + it * 100 * MS + skew,
                })
                .collect(),
        };
        vec![mk(1, 3, 3 * MS), mk(0, 5, 0), mk(2, 6, MS)]
    }

    #[test]
    fn lockstep_ranks_align_on_the_same_iteration() {
        let a = align(&lockstep()).unwrap();
        assert_eq!(a.reference, Rank(0));
        assert_eq!(a.period_ns, 100 * MS);
        // T0 = rank 2's first boundary (iteration 6); the first reference
        // boundary after T0 + 50 ms is iteration 7 = rank 0's step 3.
        assert_eq!(a.reference_steps, [3, 4]);
        let off: Vec<(u32, i64)> = a.ranks.iter().map(|r| (r.rank.0, r.offset)).collect();
        // iteration it = rank 0 step it-4, rank 1 step it-2, rank 2 step it-5.
        assert_eq!(off, vec![(0, 0), (1, 2), (2, -1)]);
        assert_eq!(a.own_step(Rank(1), 10), Some(12));
        assert_eq!(a.own_step(Rank(2), 10), Some(9));
        assert_eq!(a.own_step(Rank(2), 1), None);
        assert_eq!(a.job_step(Rank(1), 12), Some(10));
        assert_eq!(a.max_delta_ns(), 3 * MS);
        assert_eq!(a.ranks[1].own_hits, [5, 6]);
    }

    #[test]
    fn waits_until_every_rank_reported_the_reference_iteration() {
        let mut r = lockstep();
        // Rank 2 has reported only up to iteration 7 (its events are late).
        r[2].hits.truncate(2);
        assert!(matches!(align(&r), Err(Pending::Wait(_))));
        r[2].hits.clear();
        let Err(Pending::Wait(why)) = align(&r) else {
            panic!()
        };
        assert!(why.contains("rank 2"), "{why}");
    }

    #[test]
    fn refuses_ranks_out_of_lockstep() {
        let mut r = lockstep();
        // Rank 2 runs 45 ms behind: its nearest boundary is 46 ms off.
        for h in &mut r[2].hits {
            h.ts_ns += 45 * MS;
        }
        let Err(Pending::Fail(why)) = align(&r) else {
            panic!()
        };
        assert!(why.contains("not in lockstep"), "{why}");
    }

    #[test]
    fn one_late_boundary_does_not_refuse_ranks_in_lockstep() {
        let mut r = lockstep();
        // A loaded host held rank 2 back 60 ms at iteration 8 (more than
        // 2P/5): that boundary has no vote, the other five agree.
        for h in &mut r[2].hits {
            if h.ts_ns == 1_000 * MS + 8 * 100 * MS + MS {
                h.ts_ns += 60 * MS;
            }
        }
        let a = align(&r).unwrap();
        let r2 = a.ranks.iter().find(|x| x.rank == Rank(2)).unwrap();
        // Scored on all 20 reference boundaries; 19 are within 2P/5.
        assert_eq!((r2.offset, r2.votes, r2.boundaries), (-1, 19, 20));
        // The evidence is a pair both matched with that offset.
        assert_eq!(r2.own_hits[0] as i64 - r2.reference_hits[0] as i64, -1);
        assert_eq!(r2.own_hits[1], r2.own_hits[0] + 1);
    }

    #[test]
    fn a_loaded_host_spreading_boundaries_over_half_a_step_still_aligns() {
        let mut r = lockstep();
        // 8 ranks on 2 cores: rank 2 crosses its boundaries up to 55 ms
        // (over half a step) from rank 0's. Only 2 of each 6 are within
        // 2P/5, so no per-boundary match would do; on average the right
        // offset is 34 ms away, its neighbours about a step.
        let skew = [55i64, -48, 10, -45, 42, -5];
        for (k, h) in r[2].hits.iter_mut().enumerate() {
            h.ts_ns = (h.ts_ns as i64 - MS as i64 + skew[k % 6] * MS as i64) as u64;
        }
        let a = align(&r).unwrap();
        let r2 = a.ranks.iter().find(|x| x.rank == Rank(2)).unwrap();
        assert_eq!(r2.offset, -1);
        assert!(r2.votes < r2.boundaries / 2, "{r2:?}");
        // The evidence pair is the nearest consecutive one: -5 ms then
        // 55 ms (the pattern repeats), or 10 and -45.
        assert_eq!(r2.own_hits[1], r2.own_hits[0] + 1);
        assert_eq!(
            r2.own_hits[0] as i64 - r2.reference_hits[0] as i64,
            -1,
            "{r2:?}"
        );
    }

    #[test]
    fn an_unclear_offset_waits_for_more_boundaries_then_refuses() {
        let mut r = lockstep();
        for h in &mut r[2].hits {
            h.ts_ns += 45 * MS;
        }
        // 12 reference boundaries are reported: not clear, wait for more.
        let short: Vec<RankHits> = r
            .iter()
            .map(|x| RankHits {
                rank: x.rank,
                hits: x
                    .hits
                    .iter()
                    .copied()
                    .filter(|h| h.ts_ns < 2_900 * MS)
                    .collect(),
            })
            .collect();
        let Err(Pending::Wait(why)) = align(&short) else {
            panic!("{:?}", align(&short))
        };
        assert!(why.contains("rank 2: no clear index offset"), "{why}");
        let Err(Pending::Fail(why)) = align(&r) else {
            panic!()
        };
        assert!(why.contains("20 boundaries"), "{why}");
    }

    #[test]
    fn ranks_with_different_periods_gather_no_quorum() {
        let mut r = lockstep();
        // Rank 2 steps every 130 ms instead of 100: it drifts 30 ms per
        // iteration, so the nearest boundaries give changing offsets.
        let first = r[2].hits[0].ts_ns;
        for (k, h) in r[2].hits.iter_mut().enumerate() {
            h.ts_ns = first + k as u64 * 130 * MS;
        }
        r[2].hits.extend((14..40).map(|k| Hit {
            step: k + 1,
            ts_ns: first + k * 130 * MS,
        }));
        let Err(Pending::Fail(why)) = align(&r) else {
            panic!("{:?}", align(&r))
        };
        assert!(why.contains("not in lockstep"), "{why}");
    }

    #[test]
    fn start_moves_when_too_close() {
        assert_eq!(job_start(50, 10, 5), (50, false));
        assert_eq!(job_start(12, 10, 5), (16, true));
        assert_eq!(job_start(-1, 10, 5), (16, false));
        // 0.5 s + 0.1 s per rank.
        assert_eq!(lead_steps(100 * MS, 0), 7);
        assert_eq!(lead_steps(100 * MS, 1), 8);
        assert_eq!(lead_steps(100 * MS, 8), 15);
        assert_eq!(lead_steps(6 * MS, 4), 152);
        assert_eq!(lead_steps(0, 8), 10_002);
    }

    #[test]
    fn verify_flags_skew_and_missing_steps() {
        let rk = [Rank(0), Rank(1)];
        // A loaded host: single starts 60 ms apart at 100 ms steps (over
        // the half-step bound), 35 ms on average, and at least 75 ms with
        // rank 1 shifted by one: clearly the same iterations.
        let loaded: Vec<(Rank, u64, u64, u64)> = (0..8u64)
            .flat_map(|j| {
                let t = 1_000 + j * 100;
                let skew = if j % 2 == 0 { 60 } else { 10 };
                let own = if j % 2 == 0 { t + skew } else { t - skew };
                [(Rank(0), j + 5, t, 100), (Rank(1), j + 5, own, 100)]
            })
            .collect();
        let v = verify(&rk, &loaded);
        assert!(v.ok, "{v:?}");
        assert_eq!((v.max_skew_ns, v.bound_ns), (60, 50));
        let good = [
            (Rank(0), 5, 1_000, 100),
            (Rank(1), 5, 1_010, 100),
            (Rank(0), 6, 1_100, 100),
            (Rank(1), 6, 1_103, 100),
        ];
        let v = verify(&rk, &good);
        assert!(v.ok, "{v:?}");
        assert_eq!((v.max_skew_ns, v.worst_step, v.bound_ns), (10, Some(5), 50));
        // Rank 1 one step late: starts a whole period apart.
        let bad = [(Rank(0), 5, 1_000, 100), (Rank(1), 5, 1_100, 100)];
        assert!(!verify(&rk, &bad).ok);
        let v = verify(&rk, &good[..3]);
        assert_eq!(v.missing, vec![(Rank(1), 6)]);
        assert!(!v.ok);
    }
}
