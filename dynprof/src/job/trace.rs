//! The job window's merged `trace.json` (Chrome trace format, Perfetto and
//! chrome://tracing read it): one process track per rank, the job steps as
//! slices on each, and the step thread's off-CPU intervals (collective
//! wait on a CPU job) as slices under them, so the straggler is the track
//! whose steps have no wait in them.
use serde_json::{Value, json};

use super::{
    Rank,
    table::{JobStepRow, OffCpu},
};

pub const TRACE_FILE: &str = "trace.json";

/// Chrome traces are in microseconds.
fn us(ns: u64) -> f64 {
    ns as f64 / 1e3
}

/// `waits`: per rank, the step thread's off-CPU intervals (clipped to the
/// rows' steps here). Timestamps are CLOCK_MONOTONIC, shared by the ranks of
/// one host, so the tracks line up as they ran.
pub fn merged(rows: &[JobStepRow], waits: &[(Rank, Vec<OffCpu>)]) -> Value {
    let mut ev = Vec::new();
    let mut ranks: Vec<Rank> = rows.iter().map(|r| r.rank).collect();
    ranks.sort();
    ranks.dedup();
    for r in &ranks {
        ev.push(json!({"ph": "M", "name": "process_name", "pid": r.0, "args": {"name": format!("rank {r}")}}));
        ev.push(json!({"ph": "M", "name": "process_sort_index", "pid": r.0, "args": {"sort_index": r.0}}));
    }
    for row in rows {
        ev.push(json!({
            "ph": "X", "name": format!("job step {}", row.step), "cat": "step",
            "pid": row.rank.0, "tid": 0,
            "ts": us(row.start_ts_ns), "dur": us(row.duration_ns),
            "args": {"compute_ns": row.compute_ns, "collective_wait_ns": row.collective_wait_ns,
                     "device_wait_ns": row.device_wait_ns, "api_calls": row.api_calls},
        }));
    }
    for (rank, offs) in waits {
        for o in offs {
            let end = o.ts_ns.saturating_add(o.dur_ns);
            // Only inside a recorded step of this rank.
            let Some(step) = rows
                .iter()
                .find(|r| r.rank == *rank && o.ts_ns < r.end_ts_ns && end > r.start_ts_ns)
            else {
                continue;
            };
            let a = o.ts_ns.max(step.start_ts_ns);
            let b = end.min(step.end_ts_ns);
            ev.push(json!({
                "ph": "X", "name": "off-CPU (wait)", "cat": "wait",
                "pid": rank.0, "tid": 0, "ts": us(a), "dur": us(b - a),
            }));
        }
    }
    json!({"traceEvents": ev, "displayTimeUnit": "ms"})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_track_per_rank_with_steps_and_clipped_waits() {
        let row = |rank: u32, start: u64| JobStepRow {
            rank: Rank(rank),
            step: 7,
            start_ts_ns: start,
            end_ts_ns: start + 10_000,
            duration_ns: 10_000,
            compute_ns: 4_000,
            collective_wait_ns: 6_000,
            device_wait_ns: 0,
            api_calls: 0,
        };
        let rows = [row(0, 100_000), row(1, 101_000)];
        let waits = vec![(
            Rank(1),
            vec![
                OffCpu {
                    tid: 5,
                    ts_ns: 105_000,
                    dur_ns: 20_000,
                },
                OffCpu {
                    tid: 5,
                    ts_ns: 1_000,
                    dur_ns: 10,
                },
            ],
        )];
        let t = merged(&rows, &waits);
        let ev = t["traceEvents"].as_array().unwrap();
        let names: Vec<&str> = ev
            .iter()
            .filter(|e| e["name"] == "process_name")
            .map(|e| e["args"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["rank 0", "rank 1"]);
        let steps: Vec<(u64, f64)> = ev
            .iter()
            .filter(|e| e["cat"] == "step")
            .map(|e| (e["pid"].as_u64().unwrap(), e["ts"].as_f64().unwrap()))
            .collect();
        assert_eq!(steps, [(0, 100.0), (1, 101.0)]);
        let w: Vec<(f64, f64)> = ev
            .iter()
            .filter(|e| e["cat"] == "wait")
            .map(|e| (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap()))
            .collect();
        // 105..125 µs clipped to the step's end at 111 µs; the one outside is dropped.
        assert_eq!(w, [(105.0, 6.0)]);
    }
}
