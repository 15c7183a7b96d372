//! `job_steps.csv`: one row per rank per recorded job step.
//!
//! Built from what each rank's own window wrote (`steps.csv`: boundaries,
//! device wait, collective wait, API calls) and the off-CPU intervals of
//! the thread that crosses the rank's step boundaries. A rank's collective
//! wait comes from one of two sources ([`WaitSource`]): its time in c10d's
//! collective-wait calls when the `api` collector saw any (a PyTorch job,
//! whatever its backend), or else the step thread's off-CPU time in the
//! step, less device wait (native ranks with a collective library of
//! their own). The rest of the step is compute.
use std::collections::HashMap;

use anyhow::{Context as _, Result, bail};
use serde::{Deserialize, Serialize};

use super::Rank;

pub const HEADER: &str = "rank,step,start_ts_ns,end_ts_ns,duration_ns,compute_ns,collective_wait_ns,device_wait_ns,api_calls";

/// One step of one rank's own window (its `steps.csv`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OwnStep {
    pub step: u64,
    pub start_ts_ns: u64,
    pub end_ts_ns: u64,
    pub device_wait_ns: u64,
    /// `None` in a `steps.csv` without the column (an older dynprof).
    pub collective_wait_ns: Option<u64>,
    pub api_calls: u64,
}

/// Where a rank's `collective_wait_ns` came from (recorded per rank in
/// `job_meta.json`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitSource {
    /// Wall time in c10d's collective-wait calls (`Reducer::finalize_backward`,
    /// `Work::wait`), less device wait. Blocking elsewhere (a data loader
    /// queue, I/O) and preemption during compute are not counted.
    CollectiveCalls,
    /// Off-CPU time of the step thread inside the step, blocked (not
    /// preempted: runnable intervals are left out), less device wait: no
    /// collective-wait call was seen, so any blocking counts.
    StepThreadOffCpu,
    /// Neither was recorded (the window armed no `api` and no `offcpu`):
    /// `collective_wait_ns` is 0 and means nothing.
    NotRecorded,
}

impl WaitSource {
    /// Collective-wait calls if the rank made any in these steps, else the
    /// step thread's off-CPU time if `offcpu` was recorded.
    pub fn of(steps: &[OwnStep], offcpu_recorded: bool) -> WaitSource {
        if steps.iter().any(|s| s.collective_wait_ns.unwrap_or(0) > 0) {
            WaitSource::CollectiveCalls
        } else if offcpu_recorded {
            WaitSource::StepThreadOffCpu
        } else {
            WaitSource::NotRecorded
        }
    }
}

/// One off-CPU interval of one thread, in which it blocked (intervals in
/// which it was runnable, preempted, are not collected for the job).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OffCpu {
    pub tid: u32,
    pub ts_ns: u64,
    pub dur_ns: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobStepRow {
    pub rank: Rank,
    pub step: u64,
    pub start_ts_ns: u64,
    pub end_ts_ns: u64,
    pub duration_ns: u64,
    pub compute_ns: u64,
    pub collective_wait_ns: u64,
    pub device_wait_ns: u64,
    pub api_calls: u64,
}

/// Reads a rank window's `steps.csv` by column name (aux columns vary).
pub fn parse_steps_csv(text: &str) -> Result<Vec<OwnStep>> {
    let mut rd = csv::Reader::from_reader(text.as_bytes());
    let h = rd.headers().context("steps.csv header")?.clone();
    let col = |name: &str| {
        h.iter()
            .position(|c| c == name)
            .with_context(|| format!("steps.csv has no column `{name}`"))
    };
    let (s, a, b, dw, api) = (
        col("step")?,
        col("start_ts_ns")?,
        col("end_ts_ns")?,
        col("device_wait_ns")?,
        col("api_calls")?,
    );
    let cw = col("collective_wait_ns").ok();
    let mut out = Vec::new();
    for (i, rec) in rd.records().enumerate() {
        let rec = rec.with_context(|| format!("steps.csv row {}", i + 1))?;
        let num = |c: usize| -> Result<u64> {
            rec.get(c).and_then(|v| v.parse().ok()).with_context(|| {
                format!(
                    "steps.csv row {}: column {} is not a number",
                    i + 1,
                    h.get(c).unwrap_or("?")
                )
            })
        };
        let st = OwnStep {
            step: num(s)?,
            start_ts_ns: num(a)?,
            end_ts_ns: num(b)?,
            device_wait_ns: num(dw)?,
            collective_wait_ns: cw.map(num).transpose()?,
            api_calls: num(api)?,
        };
        if st.end_ts_ns < st.start_ts_ns {
            bail!("steps.csv row {}: step ends before it starts", i + 1);
        }
        out.push(st);
    }
    Ok(out)
}

fn overlap(a0: u64, a1: u64, b0: u64, b1: u64) -> u64 {
    a1.min(b1).saturating_sub(a0.max(b0))
}

/// The rows of one rank: its own steps renumbered as job steps
/// (`own - offset`), with the collective wait of `source`: the step's
/// collective-wait calls, or the off-CPU time of `step_tid[own step]`
/// inside the step. Steps below job step 1 are dropped.
pub fn rank_rows(
    rank: Rank,
    offset: i64,
    steps: &[OwnStep],
    source: WaitSource,
    step_tid: &HashMap<u64, u32>,
    offcpu: &[OffCpu],
) -> Vec<JobStepRow> {
    let mut out = Vec::new();
    for s in steps {
        let job = i128::from(s.step) - i128::from(offset);
        let Ok(job) = u64::try_from(job) else {
            continue;
        };
        if job == 0 {
            continue;
        }
        let dur = s.end_ts_ns - s.start_ts_ns;
        let off_cpu = || -> u64 {
            let Some(tid) = step_tid.get(&s.step) else {
                return 0;
            };
            offcpu
                .iter()
                .filter(|o| o.tid == *tid)
                .map(|o| {
                    overlap(
                        o.ts_ns,
                        o.ts_ns.saturating_add(o.dur_ns),
                        s.start_ts_ns,
                        s.end_ts_ns,
                    )
                })
                .sum()
        };
        let device = s.device_wait_ns.min(dur);
        let wait = match source {
            // Already less device wait (`steps.csv`).
            WaitSource::CollectiveCalls => s.collective_wait_ns.unwrap_or(0),
            WaitSource::StepThreadOffCpu => off_cpu().saturating_sub(device),
            WaitSource::NotRecorded => 0,
        }
        .min(dur - device);
        out.push(JobStepRow {
            rank,
            step: job,
            start_ts_ns: s.start_ts_ns,
            end_ts_ns: s.end_ts_ns,
            duration_ns: dur,
            compute_ns: dur - device - wait,
            collective_wait_ns: wait,
            device_wait_ns: device,
            api_calls: s.api_calls,
        });
    }
    out
}

pub fn to_csv(rows: &[JobStepRow]) -> Vec<u8> {
    let mut s = String::from(HEADER);
    s.push('\n');
    for r in rows {
        s.push_str(&format!(
            "{},{},{},{},{},{},{},{},{}\n",
            r.rank,
            r.step,
            r.start_ts_ns,
            r.end_ts_ns,
            r.duration_ns,
            r.compute_ns,
            r.collective_wait_ns,
            r.device_wait_ns,
            r.api_calls
        ));
    }
    s.into_bytes()
}

pub fn from_csv(text: &str) -> Result<Vec<JobStepRow>> {
    let first = text.lines().next().unwrap_or("");
    if first.trim() != HEADER {
        bail!("{} does not start with `{HEADER}`", super::JOB_STEPS_FILE);
    }
    let mut rd = csv::Reader::from_reader(text.as_bytes());
    let mut out = Vec::new();
    for (i, rec) in rd.deserialize::<JobStepRow>().enumerate() {
        let r = rec.with_context(|| format!("{} row {}", super::JOB_STEPS_FILE, i + 1))?;
        if r.end_ts_ns < r.start_ts_ns
            || r.duration_ns != r.end_ts_ns - r.start_ts_ns
            || r.compute_ns
                .checked_add(r.collective_wait_ns)
                .and_then(|v| v.checked_add(r.device_wait_ns))
                != Some(r.duration_ns)
        {
            bail!(
                "{} row {}: duration does not equal end - start = compute + collective wait + device wait",
                super::JOB_STEPS_FILE,
                i + 1
            );
        }
        out.push(r);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_cpu_of_the_step_thread_inside_the_step_is_collective_wait() {
        let steps = [
            OwnStep {
                step: 7,
                start_ts_ns: 1000,
                end_ts_ns: 2000,
                device_wait_ns: 0,
                collective_wait_ns: Some(0),
                api_calls: 3,
            },
            OwnStep {
                step: 8,
                start_ts_ns: 2000,
                end_ts_ns: 3000,
                device_wait_ns: 100,
                collective_wait_ns: Some(0),
                api_calls: 0,
            },
        ];
        let tid: HashMap<u64, u32> = [(7, 42), (8, 42)].into();
        let off = [
            // straddles the boundary between steps 7 and 8: 300 + 200
            OffCpu {
                tid: 42,
                ts_ns: 1700,
                dur_ns: 500,
            },
            // another thread (gloo's own): not the step's wait
            OffCpu {
                tid: 43,
                ts_ns: 1100,
                dur_ns: 800,
            },
            // before the window
            OffCpu {
                tid: 42,
                ts_ns: 100,
                dur_ns: 200,
            },
        ];
        assert_eq!(WaitSource::of(&steps, true), WaitSource::StepThreadOffCpu);
        // Without offcpu recorded there is no source, and no wait.
        assert_eq!(WaitSource::of(&steps, false), WaitSource::NotRecorded);
        let none = rank_rows(Rank(3), 2, &steps, WaitSource::NotRecorded, &tid, &off);
        assert!(
            none.len() == 2 && none.iter().all(|r| r.collective_wait_ns == 0),
            "{none:?}"
        );
        let rows = rank_rows(Rank(3), 2, &steps, WaitSource::StepThreadOffCpu, &tid, &off);
        assert_eq!(rows.len(), 2);
        assert_eq!(
            (rows[0].step, rows[0].collective_wait_ns, rows[0].compute_ns),
            (5, 300, 700)
        );
        // step 8: 200 off-CPU of which 100 already device wait
        assert_eq!(
            (
                rows[1].step,
                rows[1].collective_wait_ns,
                rows[1].device_wait_ns,
                rows[1].compute_ns
            ),
            (6, 100, 100, 800)
        );
        let back = from_csv(std::str::from_utf8(&to_csv(&rows)).unwrap()).unwrap();
        assert_eq!(back, rows);
        // Own steps at or below the offset have no job step.
        assert!(rank_rows(Rank(0), 8, &steps, WaitSource::StepThreadOffCpu, &tid, &off).is_empty());
    }

    #[test]
    fn collective_wait_calls_replace_off_cpu_when_the_rank_made_any() {
        let step = |n, a, b, coll| OwnStep {
            step: n,
            start_ts_ns: a,
            end_ts_ns: b,
            device_wait_ns: 50,
            collective_wait_ns: coll,
            api_calls: 1,
        };
        let steps = [step(7, 1000, 2000, Some(600)), step(8, 2000, 3000, Some(0))];
        assert_eq!(WaitSource::of(&steps, true), WaitSource::CollectiveCalls);
        assert_eq!(WaitSource::of(&steps, false), WaitSource::CollectiveCalls);
        let tid: HashMap<u64, u32> = [(7, 42), (8, 42)].into();
        // The step thread blocked in a data loader queue, not a collective:
        // off-CPU, but not collective wait under this source.
        let off = [OffCpu {
            tid: 42,
            ts_ns: 2100,
            dur_ns: 700,
        }];
        let rows = rank_rows(Rank(1), 0, &steps, WaitSource::CollectiveCalls, &tid, &off);
        assert_eq!(
            rows.iter()
                .map(|r| (r.step, r.collective_wait_ns, r.device_wait_ns, r.compute_ns))
                .collect::<Vec<_>>(),
            vec![(7, 600, 50, 350), (8, 0, 50, 950)]
        );
        // No column (an older steps.csv), or no call at all: off-CPU.
        assert_eq!(
            WaitSource::of(&[step(7, 1000, 2000, None)], true),
            WaitSource::StepThreadOffCpu
        );
        // A wait the step cannot hold is capped at the step less device wait.
        let rows = rank_rows(
            Rank(1),
            0,
            &[step(7, 1000, 2000, Some(5000))],
            WaitSource::CollectiveCalls,
            &tid,
            &[],
        );
        assert_eq!((rows[0].collective_wait_ns, rows[0].compute_ns), (950, 0));
    }

    #[test]
    fn steps_csv_by_column_name_and_bad_rows_refused() {
        let t = "step,start_ts_ns,end_ts_ns,duration_ns,backward,host_busy_ns,device_wait_ns,api_calls\n4,10,30,20,1,20,0,2\n";
        assert_eq!(
            parse_steps_csv(t).unwrap(),
            vec![OwnStep {
                step: 4,
                start_ts_ns: 10,
                end_ts_ns: 30,
                device_wait_ns: 0,
                collective_wait_ns: None,
                api_calls: 2
            }]
        );
        let t = "step,start_ts_ns,end_ts_ns,duration_ns,host_busy_ns,device_wait_ns,collective_wait_ns,api_calls\n4,10,30,20,20,0,7,2\n";
        assert_eq!(parse_steps_csv(t).unwrap()[0].collective_wait_ns, Some(7));
        let t = "step,start_ts_ns,end_ts_ns,duration_ns,host_busy_ns,device_wait_ns,collective_wait_ns,api_calls\n4,10,30,20,20,0,7,2\n";
        assert_eq!(parse_steps_csv(t).unwrap()[0].collective_wait_ns, Some(7));
        assert!(parse_steps_csv("step,start_ts_ns\n1,2\n").is_err());
        assert!(
            parse_steps_csv("step,start_ts_ns,end_ts_ns,device_wait_ns,api_calls\n1,9,3,0,0\n")
                .is_err()
        );
        let e = from_csv(&format!("{HEADER}\n0,1,10,20,10,5,4,0,0\n")).unwrap_err();
        assert!(
            format!("{e:#}").contains("compute + collective wait"),
            "{e:#}"
        );
        assert!(from_csv("rank,step\n").is_err());
    }
}
