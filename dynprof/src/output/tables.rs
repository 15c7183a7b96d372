//! `api_summary.csv`, `steps.csv` and `summary.json`: the numbers `report`
//! reads back, so their columns are a contract with it.
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::model::{ApiCall, ApiClass, Drops, OverBudget, StepSpan, WindowData};
use super::{Collectors, write_atomic};

pub const API_SUMMARY_FILE: &str = "api_summary.csv";
pub const STEPS_FILE: &str = "steps.csv";
pub const SUMMARY_FILE: &str = "summary.json";
pub const API_SUMMARY_HEADER: &str = "api,calls,total_ns,mean_ns,p50_ns,p99_ns,max_ns";
/// How many entries the top-N lists in `summary.json` keep.
pub const TOP_N: usize = 20;

/// Nearest-rank percentile of an ascending slice: the smallest value with at
/// least `p`% of the values at or below it. Always an observed value, which
/// keeps the numbers exact and reproducible in tests. 0 for an empty slice.
pub fn nearest_rank(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// count/mean/percentiles of a set of durations.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DurationStats {
    pub count: u64,
    pub total_ns: u64,
    pub mean_ns: u64,
    pub min_ns: u64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
}

impl DurationStats {
    pub fn from_values(mut v: Vec<u64>) -> Self {
        v.sort_unstable();
        let total: u64 = v.iter().sum();
        Self {
            count: v.len() as u64,
            total_ns: total,
            mean_ns: if v.is_empty() {
                0
            } else {
                total / v.len() as u64
            },
            min_ns: v.first().copied().unwrap_or(0),
            p50_ns: nearest_rank(&v, 50.0),
            p99_ns: nearest_rank(&v, 99.0),
            max_ns: v.last().copied().unwrap_or(0),
        }
    }
}

/// One row of `api_summary.csv`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiStat {
    pub api: String,
    pub calls: u64,
    pub total_ns: u64,
    pub mean_ns: u64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
}

/// Per-API statistics, by total time descending (ties by name).
pub fn api_stats<'a>(calls: impl IntoIterator<Item = &'a ApiCall>) -> Vec<ApiStat> {
    let mut by_api: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for c in calls {
        by_api.entry(c.api.as_str()).or_default().push(c.dur_ns);
    }
    let mut out: Vec<ApiStat> = by_api
        .into_iter()
        .map(|(api, durs)| {
            let s = DurationStats::from_values(durs);
            ApiStat {
                api: api.to_string(),
                calls: s.count,
                total_ns: s.total_ns,
                mean_ns: s.mean_ns,
                p50_ns: s.p50_ns,
                p99_ns: s.p99_ns,
                max_ns: s.max_ns,
            }
        })
        .collect();
    out.sort_by(|a, b| b.total_ns.cmp(&a.total_ns).then_with(|| a.api.cmp(&b.api)));
    out
}

/// One row of `steps.csv`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepRow {
    pub step: u64,
    pub start_ts_ns: u64,
    pub end_ts_ns: u64,
    pub duration_ns: u64,
    /// Hits per aux marker, in the order of [`aux_names`].
    pub aux: Vec<u64>,
    pub host_busy_ns: u64,
    pub device_wait_ns: u64,
    /// Wall time in collective-wait calls (c10d's waits) not already in
    /// `device_wait_ns`. Part of `host_busy_ns`, which counts only the
    /// device as a wait.
    pub collective_wait_ns: u64,
    pub api_calls: u64,
}

/// Aux marker names over all steps, sorted, so every row has the same columns.
pub fn aux_names(steps: &[StepSpan]) -> Vec<String> {
    let names: BTreeSet<&str> = steps
        .iter()
        .flat_map(|s| s.aux.iter().map(|(n, _)| n.as_str()))
        .collect();
    names.into_iter().map(str::to_string).collect()
}

/// Index of the step whose `[start, end)` holds `ts`, if any.
fn step_of(steps: &[StepSpan], order: &[usize], ts: u64) -> Option<usize> {
    // `order` sorts steps by start, so the candidate is the last one that
    // starts at or before `ts`.
    let pos = order.partition_point(|&i| steps[i].start_ts_ns <= ts);
    let i = *order.get(pos.checked_sub(1)?)?;
    (ts < steps[i].end_ts_ns).then_some(i)
}

/// Per-step rows. API calls belong to the step in which they *start*,
/// whatever their thread: CANN's task queue issues launches from a worker
/// thread, and those launches are still that step's work.
///
/// `device_wait_ns` is the length of the union of the step's device-wait
/// calls, each clipped to the step end. For one waiting thread this is the
/// plain sum of their durations; the union only matters when waits overlap
/// (two threads waiting at once, or a timeout variant wrapping the plain
/// call), where a sum would count the same wall time twice and could make
/// `host_busy_ns` negative. `collective_wait_ns` is, the same way, the
/// union of the step's collective-wait calls, less what of it was device
/// wait: the two never add up to more than the step.
pub fn step_rows(data: &WindowData) -> (Vec<String>, Vec<StepRow>) {
    let names = aux_names(&data.steps);
    let mut order: Vec<usize> = (0..data.steps.len()).collect();
    order.sort_by_key(|&i| data.steps[i].start_ts_ns);

    let mut calls = vec![0u64; data.steps.len()];
    let mut waits: Vec<Vec<(u64, u64)>> = vec![Vec::new(); data.steps.len()];
    // Device and collective waits together, for the collective share.
    let mut all_waits: Vec<Vec<(u64, u64)>> = vec![Vec::new(); data.steps.len()];
    for c in &data.api_calls {
        let Some(i) = step_of(&data.steps, &order, c.start_ts_ns) else {
            continue;
        };
        calls[i] += 1;
        let end = c
            .start_ts_ns
            .saturating_add(c.dur_ns)
            .min(data.steps[i].end_ts_ns);
        match c.class {
            ApiClass::DeviceWait => {
                waits[i].push((c.start_ts_ns, end));
                all_waits[i].push((c.start_ts_ns, end));
            }
            ApiClass::CollectiveWait => all_waits[i].push((c.start_ts_ns, end)),
            ApiClass::Call => {}
        }
    }

    let rows = data
        .steps
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let duration = s.end_ts_ns.saturating_sub(s.start_ts_ns);
            let wait = union_len(&mut waits[i]).min(duration);
            let collective = union_len(&mut all_waits[i])
                .min(duration)
                .saturating_sub(wait);
            let aux = names
                .iter()
                .map(|n| s.aux.iter().filter(|(k, _)| k == n).map(|(_, v)| *v).sum())
                .collect();
            StepRow {
                step: s.step.0,
                start_ts_ns: s.start_ts_ns,
                end_ts_ns: s.end_ts_ns,
                duration_ns: duration,
                aux,
                host_busy_ns: duration - wait,
                device_wait_ns: wait,
                collective_wait_ns: collective,
                api_calls: calls[i],
            }
        })
        .collect();
    (names, rows)
}

fn union_len(iv: &mut [(u64, u64)]) -> u64 {
    iv.sort_unstable();
    let mut total = 0;
    let mut cur: Option<(u64, u64)> = None;
    for &(s, e) in iv.iter() {
        match cur {
            Some((cs, ce)) if s <= ce => cur = Some((cs, ce.max(e))),
            _ => {
                if let Some((cs, ce)) = cur {
                    total += ce - cs;
                }
                cur = Some((s, e));
            }
        }
    }
    if let Some((cs, ce)) = cur {
        total += ce - cs;
    }
    total
}

/// The `steps.csv` header for a set of aux marker names.
pub fn steps_header(aux: &[String]) -> Vec<String> {
    let mut h: Vec<String> = ["step", "start_ts_ns", "end_ts_ns", "duration_ns"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    h.extend(aux.iter().map(|n| format!("aux_{n}")));
    h.extend(
        [
            "host_busy_ns",
            "device_wait_ns",
            "collective_wait_ns",
            "api_calls",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    h
}

pub fn write_steps(dir: &Path, data: &WindowData) -> Result<PathBuf> {
    let path = dir.join(STEPS_FILE);
    let (names, rows) = step_rows(data);
    let mut w = csv::Writer::from_writer(Vec::new());
    let ctx = || format!("formatting {}", path.display());
    w.write_record(steps_header(&names)).with_context(ctx)?;
    for r in &rows {
        let mut rec = vec![
            r.step.to_string(),
            r.start_ts_ns.to_string(),
            r.end_ts_ns.to_string(),
            r.duration_ns.to_string(),
        ];
        rec.extend(r.aux.iter().map(u64::to_string));
        rec.push(r.host_busy_ns.to_string());
        rec.push(r.device_wait_ns.to_string());
        rec.push(r.collective_wait_ns.to_string());
        rec.push(r.api_calls.to_string());
        w.write_record(&rec).with_context(ctx)?;
    }
    let bytes = w
        .into_inner()
        .map_err(|e| e.into_error())
        .with_context(ctx)?;
    write_atomic(&path, &bytes)?;
    Ok(path)
}

pub fn write_api_summary(dir: &Path, data: &WindowData) -> Result<PathBuf> {
    let path = dir.join(API_SUMMARY_FILE);
    let ctx = || format!("formatting {}", path.display());
    let mut w = csv::Writer::from_writer(Vec::new());
    // Written by hand rather than from ApiStat's serde names so the header
    // exists even with no rows, and is pinned to the documented contract.
    w.write_record(API_SUMMARY_HEADER.split(','))
        .with_context(ctx)?;
    for s in api_stats(&data.api_calls) {
        w.write_record([
            s.api.clone(),
            s.calls.to_string(),
            s.total_ns.to_string(),
            s.mean_ns.to_string(),
            s.p50_ns.to_string(),
            s.p99_ns.to_string(),
            s.max_ns.to_string(),
        ])
        .with_context(ctx)?;
    }
    let bytes = w
        .into_inner()
        .map_err(|e| e.into_error())
        .with_context(ctx)?;
    write_atomic(&path, &bytes)?;
    Ok(path)
}

/// A frame and how many samples it was the leaf of (`self_samples`) or
/// anywhere on the stack of (`inclusive_samples`, counted once per sample
/// even under recursion).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FrameCount {
    pub frame: String,
    pub self_samples: u64,
    pub inclusive_samples: u64,
}

/// Top frames from (stack, weight) pairs: by self count, and by inclusive
/// count, each descending with ties broken by name.
pub fn top_frames<'a, I>(stacks: I, n: usize) -> (Vec<FrameCount>, Vec<FrameCount>)
where
    I: IntoIterator<Item = (&'a [String], u64)>,
{
    let mut counts: HashMap<&'a str, (u64, u64)> = HashMap::new();
    let mut seen: BTreeSet<&'a str> = BTreeSet::new();
    for (stack, weight) in stacks {
        if let Some(leaf) = stack.last() {
            counts.entry(leaf.as_str()).or_default().0 += weight;
        }
        seen.clear();
        for f in stack {
            if seen.insert(f.as_str()) {
                counts.entry(f.as_str()).or_default().1 += weight;
            }
        }
    }
    let all: Vec<FrameCount> = counts
        .into_iter()
        .map(|(f, (s, i))| FrameCount {
            frame: f.to_string(),
            self_samples: s,
            inclusive_samples: i,
        })
        .collect();
    let mut by_self: Vec<FrameCount> = all.iter().filter(|f| f.self_samples > 0).cloned().collect();
    by_self.sort_by(|a, b| {
        b.self_samples
            .cmp(&a.self_samples)
            .then_with(|| a.frame.cmp(&b.frame))
    });
    by_self.truncate(n);
    let mut by_incl = all;
    by_incl.sort_by(|a, b| {
        b.inclusive_samples
            .cmp(&a.inclusive_samples)
            .then_with(|| a.frame.cmp(&b.frame))
    });
    by_incl.truncate(n);
    (by_self, by_incl)
}

/// `summary.json`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub process_name: String,
    pub host_pid: u32,
    pub collectors: Option<Collectors>,
    pub steps: u64,
    pub first_step: Option<u64>,
    pub last_step: Option<u64>,
    pub step_time: DurationStats,
    pub device_wait_ns: u64,
    pub host_busy_ns: u64,
    /// device_wait_ns / total step time, 0..=1.
    pub device_wait_share: f64,
    /// APIs classified as device wait, by total time descending.
    pub device_wait_apis: Vec<ApiStat>,
    pub api_calls: u64,
    pub top_apis: Vec<ApiStat>,
    pub top_cpu_frames_self: Vec<FrameCount>,
    pub top_cpu_frames_inclusive: Vec<FrameCount>,
    pub cpu_samples: u64,
    pub offcpu_spans: u64,
    pub offcpu_ns: u64,
    pub drops: Drops,
    /// Events the window saw but did not keep (`--memory-budget`).
    #[serde(default)]
    pub dropped_over_budget: OverBudget,
}

pub fn summary(data: &WindowData, collectors: &Collectors) -> Summary {
    let (_, rows) = step_rows(data);
    let step_time = DurationStats::from_values(rows.iter().map(|r| r.duration_ns).collect());
    let device_wait_ns: u64 = rows.iter().map(|r| r.device_wait_ns).sum();
    let host_busy_ns: u64 = rows.iter().map(|r| r.host_busy_ns).sum();
    let mut top_apis = api_stats(&data.api_calls);
    top_apis.truncate(TOP_N);
    let (top_self, top_incl) = top_frames(data.samples.iter().map(|s| (&s.stack[..], 1u64)), TOP_N);
    Summary {
        process_name: data.process_name.clone(),
        host_pid: data.host_pid,
        collectors: Some(*collectors),
        steps: rows.len() as u64,
        first_step: data.steps.iter().map(|s| s.step.0).min(),
        last_step: data.steps.iter().map(|s| s.step.0).max(),
        device_wait_share: if step_time.total_ns == 0 {
            0.0
        } else {
            device_wait_ns as f64 / step_time.total_ns as f64
        },
        step_time,
        device_wait_ns,
        host_busy_ns,
        device_wait_apis: api_stats(
            data.api_calls
                .iter()
                .filter(|c| c.class == ApiClass::DeviceWait),
        ),
        api_calls: rows.iter().map(|r| r.api_calls).sum(),
        top_apis,
        top_cpu_frames_self: top_self,
        top_cpu_frames_inclusive: top_incl,
        cpu_samples: data.samples.len() as u64,
        offcpu_spans: data.offcpu.len() as u64,
        offcpu_ns: data.offcpu.iter().map(|o| o.dur_ns).sum(),
        drops: data.drops.clone(),
        dropped_over_budget: data.budget.dropped_over_budget.clone(),
    }
}

pub fn write_summary(dir: &Path, data: &WindowData, collectors: &Collectors) -> Result<PathBuf> {
    let path = dir.join(SUMMARY_FILE);
    let mut bytes = serde_json::to_vec_pretty(&summary(data, collectors))
        .with_context(|| format!("formatting {}", path.display()))?;
    bytes.push(b'\n');
    write_atomic(&path, &bytes)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::StepIndex;

    fn step(n: u64, s: u64, e: u64) -> StepSpan {
        StepSpan {
            step: StepIndex(n),
            start_ts_ns: s,
            end_ts_ns: e,
            tid: 1,
            aux: vec![],
        }
    }
    fn call(tid: u32, api: &str, s: u64, d: u64, wait: bool) -> ApiCall {
        ApiCall {
            tid,
            api: api.into(),
            start_ts_ns: s,
            dur_ns: d,
            ret: 0,
            class: if wait {
                ApiClass::DeviceWait
            } else {
                ApiClass::Call
            },
        }
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(nearest_rank(&v, 50.0), 50);
        assert_eq!(nearest_rank(&v, 99.0), 99);
        assert_eq!(nearest_rank(&[7], 99.0), 7);
        assert_eq!(nearest_rank(&[1, 2, 3], 50.0), 2);
        assert_eq!(nearest_rank(&[], 50.0), 0);
    }

    #[test]
    fn steps_attribute_by_start_and_clip_waits() {
        let mut s0 = step(3, 1000, 2000);
        s0.aux = vec![("backward".into(), 2)];
        let data = WindowData {
            steps: vec![s0, step(4, 2000, 3000)],
            api_calls: vec![
                call(1, "aclrtLaunchKernel", 1100, 10, false),
                // Another thread's launch still counts for the step.
                call(2, "aclrtLaunchKernel", 1200, 10, false),
                // Crosses into step 4: clipped to step 3's end.
                call(1, "aclrtSynchronizeStream", 1900, 300, true),
                // Overlapping waits on two threads are counted once.
                call(1, "aclrtSynchronizeStream", 2100, 400, true),
                call(2, "aclrtSynchronizeStream", 2300, 400, true),
                // Before the window: ignored.
                call(1, "aclrtLaunchKernel", 10, 10, false),
            ],
            ..Default::default()
        };
        let (names, rows) = step_rows(&data);
        assert_eq!(names, vec!["backward"]);
        assert_eq!(rows[0].aux, vec![2]);
        assert_eq!(rows[1].aux, vec![0]);
        assert_eq!(rows[0].api_calls, 3);
        assert_eq!(rows[0].device_wait_ns, 100);
        assert_eq!(rows[0].host_busy_ns, 900);
        assert_eq!(rows[1].api_calls, 2);
        assert_eq!(rows[1].device_wait_ns, 600);
        assert_eq!(
            steps_header(&names).join(","),
            "step,start_ts_ns,end_ts_ns,duration_ns,aux_backward,host_busy_ns,device_wait_ns,collective_wait_ns,api_calls"
        );
        assert_eq!(
            (rows[0].collective_wait_ns, rows[1].collective_wait_ns),
            (0, 0)
        );
    }

    #[test]
    fn collective_waits_are_their_own_column_and_never_count_device_wait_twice() {
        let coll = |tid, s, d| ApiCall {
            class: ApiClass::CollectiveWait,
            ..call(tid, "c10d::Reducer::finalize_backward", s, d, false)
        };
        let data = WindowData {
            steps: vec![step(1, 1000, 2000), step(2, 2000, 3000)],
            api_calls: vec![
                // 300 ns of collective wait.
                coll(1, 1100, 300),
                // A device wait inside a collective wait (an NPU DDP
                // finalize synchronizing its stream): 200 ns device, and
                // the collective call adds only its other 300 ns.
                coll(1, 2000, 500),
                call(1, "aclrtSynchronizeStream", 2100, 200, true),
                // Crosses the window's end: clipped.
                coll(2, 2900, 1000),
            ],
            ..Default::default()
        };
        let (_, rows) = step_rows(&data);
        assert_eq!(
            (
                rows[0].collective_wait_ns,
                rows[0].device_wait_ns,
                rows[0].host_busy_ns
            ),
            (300, 0, 1000)
        );
        assert_eq!(
            (
                rows[1].collective_wait_ns,
                rows[1].device_wait_ns,
                rows[1].api_calls
            ),
            (300 + 100, 200, 3)
        );
    }

    #[test]
    fn api_stats_sorted_by_total() {
        let calls = vec![
            call(1, "a", 0, 10, false),
            call(1, "a", 0, 30, false),
            call(1, "b", 0, 100, false),
        ];
        let s = api_stats(&calls);
        assert_eq!(s[0].api, "b");
        assert_eq!(
            s[1],
            ApiStat {
                api: "a".into(),
                calls: 2,
                total_ns: 40,
                mean_ns: 20,
                p50_ns: 10,
                p99_ns: 30,
                max_ns: 30
            }
        );
    }

    #[test]
    fn frames_self_and_inclusive() {
        let a: Vec<String> = vec!["main".into(), "f".into(), "f".into()];
        let b: Vec<String> = vec!["main".into(), "g".into()];
        let (s, i) = top_frames([(a.as_slice(), 3), (b.as_slice(), 1)], 10);
        assert_eq!(s[0].frame, "f");
        assert_eq!(s[0].self_samples, 3);
        assert_eq!(i[0].frame, "main");
        assert_eq!(i[0].inclusive_samples, 4);
        assert_eq!(
            i.iter().find(|x| x.frame == "f").unwrap().inclusive_samples,
            3
        );
    }
}
