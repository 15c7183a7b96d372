//! Which ranks one job window covers, and when the next window of a
//! `--repeat` starts: decided here, without root, before the controller
//! sends any rank its plan.
use super::Rank;

/// The ranks a window covers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    pub ranks: Vec<Rank>,
    /// Numbers in `rank_list` that are no rank of the job (or no longer run).
    pub unknown: Vec<i64>,
}

/// The live ranks a window covers: all of them, or with a
/// profiler_config.json `is_rank` filter, those in `rank_list`. A filter
/// that names none of them is refused (a window of nobody records nothing).
pub fn select_ranks(live: &[Rank], rank_list: Option<&[i64]>) -> Result<Selection, String> {
    let Some(list) = rank_list else {
        return Ok(Selection {
            ranks: live.to_vec(),
            unknown: Vec::new(),
        });
    };
    let ranks: Vec<Rank> = live
        .iter()
        .copied()
        .filter(|r| list.contains(&i64::from(r.0)))
        .collect();
    let unknown: Vec<i64> = list
        .iter()
        .copied()
        .filter(|n| !live.iter().any(|r| i64::from(r.0) == *n))
        .collect();
    if ranks.is_empty() {
        return Err(format!(
            "is_rank is set and rank_list {list:?} names none of the job's running ranks {:?}",
            live.iter().map(|r| r.0).collect::<Vec<_>>()
        ));
    }
    Ok(Selection { ranks, unknown })
}

/// The job step window `n` (0 = the first) of a repeated plan asks for:
/// `gap` steps after the end of the one before.
pub fn repeat_start(first_start: u64, warmup: u64, active: u64, gap: u64, n: u64) -> u64 {
    first_start + n * (warmup + active + gap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_filter_covers_every_live_rank() {
        let live = [Rank(0), Rank(1), Rank(3)];
        assert_eq!(
            select_ranks(&live, None).unwrap(),
            Selection {
                ranks: live.to_vec(),
                unknown: vec![]
            }
        );
    }

    #[test]
    fn rank_list_restricts_and_names_strangers() {
        let live = [Rank(0), Rank(1), Rank(2), Rank(3)];
        assert_eq!(
            select_ranks(&live, Some(&[3, 1, 7])).unwrap(),
            Selection {
                ranks: vec![Rank(1), Rank(3)],
                unknown: vec![7]
            }
        );
        let e = select_ranks(&live, Some(&[5])).unwrap_err();
        assert!(
            e.contains("rank_list [5]") && e.contains("[0, 1, 2, 3]"),
            "{e}"
        );
        assert!(select_ranks(&live, Some(&[])).is_err());
    }

    #[test]
    fn repeats_follow_each_other_by_the_gap() {
        assert_eq!(repeat_start(20, 1, 3, 10, 0), 20);
        assert_eq!(repeat_start(20, 1, 3, 10, 1), 34);
        assert_eq!(repeat_start(20, 1, 3, 0, 2), 28);
    }
}
