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
//! 4. For each rank, the boundary nearest in time to each reference boundary
//!    is its same iteration, provided it is within `2P/5` (ranks in lockstep
//!    cross a boundary a few milliseconds apart; on a loaded host the spread
//!    grows, and only near `P/2` could the match be wrong). Each such match
//!    votes for an index offset; the rank's offset is the one at least
//!    [`QUORUM`] of the [`VOTES`] agree on, so that one boundary a loaded
//!    host delayed does not refuse a job in lockstep, while ranks that drift
//!    apart (different periods) never gather a quorum. Otherwise the ranks
//!    are not in lockstep and job mode refuses to guess.
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
    /// How many of the [`VOTES`] reference boundaries gave `offset`.
    pub votes: u32,
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

/// Reference boundaries each rank's offset is voted on.
pub const VOTES: usize = 6;
/// Votes one offset needs. Four of six always include two consecutive
/// boundaries, which are recorded as the evidence.
pub const QUORUM: usize = 4;

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
    let Some(refs) = refh.get(i..i + VOTES) else {
        return Err(Pending::Wait(format!(
            "rank {reference} needs {VOTES} boundaries after every rank was attached"
        )));
    };
    if refs.windows(2).any(|w| w[1].step != w[0].step + 1) {
        return Err(Pending::Fail(format!(
            "rank {reference}'s boundaries {}..{} are not consecutive (lost events)",
            refs[0].step,
            refs[VOTES - 1].step
        )));
    }
    let last_ref = refs[VOTES - 1];
    let tolerance = tolerance(period);
    let mut out = Vec::new();
    for r in ranks {
        let rank = r.rank.unwrap_or(reference);
        let last = r.hits.last().map_or(0, |h| h.ts_ns);
        if last < last_ref.ts_ns.saturating_add(tolerance) {
            return Err(Pending::Wait(format!(
                "rank {rank} has not reported the iteration of job step {} yet",
                last_ref.step
            )));
        }
        // (offset, matched own hit, distance) per reference boundary, or
        // None where the nearest boundary is beyond the tolerance.
        let matches: Vec<Option<(i64, Hit, i64)>> = refs
            .iter()
            .map(|b| {
                let h = nearest(&r.hits, b.ts_ns).expect("rank has hits");
                let d = i128::from(h.ts_ns) - i128::from(b.ts_ns);
                (d.unsigned_abs() <= u128::from(tolerance))
                    .then(|| (h.step as i64 - b.step as i64, h, d as i64))
            })
            .collect();
        let mut tally: Vec<(i64, usize)> = Vec::new();
        for (off, _, _) in matches.iter().flatten() {
            match tally.iter_mut().find(|(o, _)| o == off) {
                Some((_, n)) => *n += 1,
                None => tally.push((*off, 1)),
            }
        }
        let best = tally.iter().max_by_key(|(_, n)| *n).copied();
        let Some((offset, votes)) = best.filter(|(_, n)| *n >= QUORUM) else {
            let worst = refs
                .iter()
                .filter_map(|b| {
                    let h = nearest(&r.hits, b.ts_ns)?;
                    Some((i128::from(h.ts_ns) - i128::from(b.ts_ns)).unsigned_abs())
                })
                .max()
                .unwrap_or(0);
            return Err(Pending::Fail(format!(
                "rank {rank}: only {} of rank {reference}'s {VOTES} boundaries {}..{} match one of its \
                 own within {:.3} ms with one index offset (nearest up to {:.3} ms away; step period \
                 {:.3} ms): the ranks are not in lockstep, so their steps cannot be matched",
                best.map_or(0, |b| b.1),
                refs[0].step,
                last_ref.step,
                tolerance as f64 / 1e6,
                worst as f64 / 1e6,
                period as f64 / 1e6
            )));
        };
        let agrees = |m: &Option<(i64, Hit, i64)>| m.is_some_and(|(o, _, _)| o == offset);
        let j = (0..VOTES - 1)
            .find(|&j| agrees(&matches[j]) && agrees(&matches[j + 1]))
            .expect("QUORUM of VOTES includes two consecutive boundaries");
        let (Some((_, h0, d0)), Some((_, h1, d1))) = (matches[j], matches[j + 1]) else {
            unreachable!("both agree");
        };
        out.push(RankAlign {
            rank,
            offset,
            reference_hits: [refs[j].step, refs[j + 1].step],
            own_hits: [h0.step, h1.step],
            ts_ns: [h0.ts_ns, h1.ts_ns],
            delta_ns: [d0, d1],
            votes: votes as u32,
        });
    }
    out.sort_by_key(|a| a.rank);
    Ok(Alignment {
        reference,
        period_ns: period,
        all_attached_ts_ns: t0,
        reference_steps: [refs[0].step, refs[1].step],
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

/// Steps of lead for a step period: half a second of steps (the plans are
/// written after the step events are read, which is up to a tick late)
/// plus two.
pub fn lead_steps(period_ns: u64) -> u64 {
    let per_half_s = 500_000_000u64.div_ceil(period_ns.max(1));
    per_half_s.min(10_000) + 2
}

/// The after-the-fact check: each recorded job step's start, per rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Verification {
    /// Largest spread of one job step's start over the ranks, ns.
    pub max_skew_ns: u64,
    /// The job step where it was largest.
    pub worst_step: Option<u64>,
    /// Bound: half the median step duration. Within it, a rank's step is
    /// nearer to the other ranks' same job step than to any neighbour: the
    /// match cannot be off by one. (The alignment itself asks for 2/5 of a
    /// step, to leave a margin; afterwards, a rank preempted for a few
    /// milliseconds at a boundary of a short step must not fail the check.)
    pub bound_ns: u64,
    /// Job steps some rank did not record.
    pub missing: Vec<(Rank, u64)>,
    pub ok: bool,
}

/// Checks that every rank's recorded job steps started within half a step
/// of each other (see [`Verification::bound_ns`]). `rows` is (rank, job step, start, duration).
pub fn verify(ranks: &[Rank], rows: &[(Rank, u64, u64, u64)]) -> Verification {
    use std::collections::{BTreeMap, BTreeSet};
    let mut by_step: BTreeMap<u64, Vec<(Rank, u64)>> = BTreeMap::new();
    for (r, j, start, _) in rows {
        by_step.entry(*j).or_default().push((*r, *start));
    }
    let bound = median(rows.iter().map(|r| r.3).collect()).unwrap_or(0) / 2;
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
    Verification {
        max_skew_ns: max_skew,
        worst_step: worst,
        bound_ns: bound,
        ok: missing.is_empty() && !by_step.is_empty() && max_skew < bound,
        missing,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// Ranks in lockstep at 100 ms per step, attached at different
    /// iterations (rank 1 two iterations before rank 0, rank 2 one after),
    /// crossing each boundary up to 3 ms apart.
    fn lockstep() -> Vec<RankHits> {
        let mk = |rank: u32, first_iter: u64, skew: u64| RankHits {
            rank: Some(Rank(rank)),
            hits: (first_iter..20)
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
        assert_eq!((r2.offset, r2.votes), (-1, 5));
        // The evidence is a pair both matched with that offset.
        assert_eq!(r2.own_hits[0] as i64 - r2.reference_hits[0] as i64, -1);
        assert_eq!(r2.own_hits[1], r2.own_hits[0] + 1);
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
        assert_eq!(lead_steps(100 * MS), 7);
        assert_eq!(lead_steps(0), 10_002);
    }

    #[test]
    fn verify_flags_skew_and_missing_steps() {
        let rk = [Rank(0), Rank(1)];
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
