//! `dynprof report DIR` on a job window: a per-rank table and the
//! `straggler:` verdict.
use std::path::Path;

use anyhow::{Context as _, Result};
use serde_json::{Value, json};

use super::{JOB_META_FILE, JOB_STEPS_FILE, table, verdict};

/// Caps on what `report` reads from a job directory (it may be copied
/// from anywhere).
const MAX_CSV: u64 = 64 << 20;
const MAX_META: u64 = 4 << 20;

/// True when `dir` is a job window (it holds `job_steps.csv`, or only
/// `job_meta.json` when the window was not recorded).
pub fn is_job_dir(dir: &Path) -> bool {
    dir.join(JOB_STEPS_FILE).is_file() || dir.join(JOB_META_FILE).is_file()
}

fn read_capped(path: &Path, max: u64) -> Result<String> {
    crate::sys::hostfs::read_path_capped(path, max)
        .with_context(|| format!("reading {}", path.display()))
}

pub struct JobAnalysis {
    pub stats: Vec<verdict::RankStat>,
    pub verdict: verdict::Verdict,
    pub meta: Value,
}

pub fn analyze(dir: &Path) -> Result<JobAnalysis> {
    let meta: Value = match read_capped(&dir.join(JOB_META_FILE), MAX_META) {
        Ok(t) => serde_json::from_str(&t).with_context(|| format!("parsing {JOB_META_FILE}"))?,
        Err(_) => Value::Null,
    };
    if !dir.join(JOB_STEPS_FILE).is_file() {
        anyhow::bail!(
            "{}: the job window was not recorded: {}",
            dir.display(),
            meta.get("error")
                .and_then(Value::as_str)
                .unwrap_or("no job_steps.csv")
        );
    }
    let rows = table::from_csv(&read_capped(&dir.join(JOB_STEPS_FILE), MAX_CSV)?)?;
    let stats = verdict::per_rank(&rows);
    let verdict = verdict::verdict(&stats);
    Ok(JobAnalysis {
        stats,
        verdict,
        meta,
    })
}

fn ms(ns: u64) -> String {
    format!("{:.3}", ns as f64 / 1e6)
}

pub fn render(dir: &Path, a: &JobAnalysis) -> String {
    let mut s = format!("job window {}\n", dir.display());
    if let Some(p) = a.meta.get("plan").and_then(|p| p.get("job_steps")) {
        s.push_str(&format!("job steps {}\n", p.as_str().unwrap_or("?")));
    }
    s.push_str(&format!(
        "{:>5} {:>8} {:>6} {:>10} {:>11} {:>13} {:>12} {:>10} {:>8}\n",
        "rank",
        "pid",
        "steps",
        "step_ms",
        "compute_ms",
        "coll_wait_ms",
        "dev_wait_ms",
        "api/step",
        "last_in"
    ));
    let ranks = a.meta.get("ranks").and_then(Value::as_array);
    for st in &a.stats {
        let pid = ranks
            .and_then(|v| v.iter().find(|r| r.get("rank") == Some(&json!(st.rank.0))))
            .and_then(|r| r.get("host_pid"))
            .map_or("-".to_string(), |p| p.to_string());
        s.push_str(&format!(
            "{:>5} {:>8} {:>6} {:>10} {:>11} {:>13} {:>12} {:>10.1} {:>8}\n",
            st.rank.0,
            pid,
            st.steps,
            ms(st.mean_duration_ns),
            ms(st.mean_compute_ns),
            ms(st.mean_collective_wait_ns),
            ms(st.mean_device_wait_ns),
            st.api_calls_per_step,
            st.last_into_collective
        ));
    }
    for r in ranks.into_iter().flatten() {
        if let Some(why) = r.get("problem").and_then(Value::as_str) {
            s.push_str(&format!(
                "rank {}: {why}\n",
                r.get("rank").map_or("?".into(), |v| v.to_string())
            ));
        }
    }
    if let Some(v) = a.meta.get("verification") {
        let skew = v.get("max_skew_ns").and_then(Value::as_u64).unwrap_or(0);
        let ok = v.get("ok").and_then(Value::as_bool).unwrap_or(false);
        let unclear = v
            .get("unclear")
            .and_then(Value::as_array)
            .filter(|u| !u.is_empty())
            .map(|u| {
                let names: Vec<String> = u.iter().map(|r| r.to_string()).collect();
                format!(
                    "; ranks not clearly on the same iterations: {}",
                    names.join(", ")
                )
            })
            .unwrap_or_default();
        s.push_str(&format!(
            "alignment: {} (largest start spread of one job step over the ranks: {} ms{unclear})\n",
            if ok { "checked" } else { "NOT confirmed" },
            ms(skew)
        ));
    }
    s.push_str(&a.verdict.text);
    s.push('\n');
    s
}

pub fn to_json(a: &JobAnalysis) -> Value {
    json!({
        "job": a.meta,
        "ranks": a.stats,
        "stragglers": a.verdict.stragglers,
        "verdict": a.verdict.text,
    })
}

/// `dynprof report DIR [--json]` for a job directory.
pub fn run(dir: &Path, json_out: bool) -> Result<()> {
    let a = analyze(dir)?;
    if json_out {
        println!("{}", serde_json::to_string_pretty(&to_json(&a))?);
    } else {
        print!("{}", render(dir, &a));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> std::path::PathBuf {
        let d =
            std::env::temp_dir().join(format!("dynprof-job-report-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn table_alignment_line_and_verdict() {
        let d = dir("ok");
        let mut csv = format!("{}\n", table::HEADER);
        for step in [5u64, 6] {
            for (rank, compute) in [(0u32, 2_000_000u64), (1, 30_000_000), (2, 2_500_000)] {
                let start = step * 100_000_000;
                csv.push_str(&format!(
                    "{rank},{step},{start},{},32000000,{compute},{},0,4\n",
                    start + 32_000_000,
                    32_000_000 - compute
                ));
            }
        }
        std::fs::write(d.join(JOB_STEPS_FILE), csv).unwrap();
        std::fs::write(
            d.join(JOB_META_FILE),
            r#"{"plan":{"job_steps":"5..=6"},"verification":{"ok":true,"max_skew_ns":1500000},
                "ranks":[{"rank":0,"host_pid":100},{"rank":1,"host_pid":101},{"rank":2,"host_pid":102},
                         {"rank":3,"host_pid":103,"problem":"not attached: gone"}]}"#,
        )
        .unwrap();
        assert!(is_job_dir(&d));
        let a = analyze(&d).unwrap();
        let text = render(&d, &a);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[1], "job steps 5..=6");
        assert!(
            lines
                .iter()
                .any(|l| l.split_whitespace().collect::<Vec<_>>()
                    == [
                        "1", "101", "2", "32.000", "30.000", "2.000", "0.000", "4.0", "2"
                    ]),
            "{text}"
        );
        assert!(text.contains("rank 3: not attached: gone"), "{text}");
        assert!(
            text.contains(
                "alignment: checked (largest start spread of one job step over the ranks: 1.500 ms)"
            ),
            "{text}"
        );
        assert!(
            lines.last().unwrap().starts_with("straggler: rank 1: "),
            "{text}"
        );
        assert_eq!(to_json(&a)["stragglers"], serde_json::json!([1]));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn unrecorded_window_says_why() {
        let d = dir("err");
        std::fs::write(
            d.join(JOB_META_FILE),
            r#"{"error":"the ranks are not in lockstep"}"#,
        )
        .unwrap();
        assert!(is_job_dir(&d));
        let e = format!("{:#}", analyze(&d).err().unwrap());
        assert!(
            e.contains("was not recorded: the ranks are not in lockstep"),
            "{e}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }
}
