//! The files of one PROF directory, parsed.
use std::{fs, path::Path};

use anyhow::{Context, Result};

use super::*;

pub(super) fn read_opt(path: &Path) -> Result<Option<String>> {
    match fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

pub(super) fn parse_steps(path: &Path, text: &str) -> Result<Vec<StepLine>> {
    let mut r = csv::Reader::from_reader(text.as_bytes());
    let headers = r
        .headers()
        .with_context(|| format!("reading header of {}", path.display()))?
        .clone();
    let col = |name: &str| -> Result<usize> {
        headers
            .iter()
            .position(|h| h == name)
            .with_context(|| format!("{}: no column {name:?}", path.display()))
    };
    let (c_step, c_dur, c_wait, c_busy, c_calls) = (
        col("step")?,
        col("duration_ns")?,
        col("device_wait_ns")?,
        col("host_busy_ns")?,
        col("api_calls")?,
    );
    let mut out = Vec::new();
    for (i, rec) in r.records().enumerate() {
        let rec = rec.with_context(|| format!("{}: row {}", path.display(), i + 1))?;
        let get = |c: usize| -> Result<u64> {
            rec.get(c).unwrap_or("").parse().with_context(|| {
                format!(
                    "{}: row {}, column {}",
                    path.display(),
                    i + 1,
                    headers.get(c).unwrap_or("?")
                )
            })
        };
        out.push(StepLine {
            step: get(c_step)?,
            duration_ns: get(c_dur)?,
            device_wait_ns: get(c_wait)?,
            host_busy_ns: get(c_busy)?,
            api_calls: get(c_calls)?,
        });
    }
    Ok(out)
}

pub(super) fn parse_api_summary(path: &Path, text: &str) -> Result<Vec<ApiStat>> {
    let mut r = csv::Reader::from_reader(text.as_bytes());
    let mut out = Vec::new();
    for (i, rec) in r.records().enumerate() {
        let rec = rec.with_context(|| format!("{}: row {}", path.display(), i + 1))?;
        let n = |c: usize| -> Result<u64> {
            rec.get(c)
                .unwrap_or("")
                .parse()
                .with_context(|| format!("{}: row {}, column {}", path.display(), i + 1, c + 1))
        };
        out.push(ApiStat {
            api: rec.get(0).unwrap_or("").to_string(),
            calls: n(1)?,
            total_ns: n(2)?,
            mean_ns: n(3)?,
            p50_ns: n(4)?,
            p99_ns: n(5)?,
            max_ns: n(6)?,
        });
    }
    out.sort_by(|a, b| b.total_ns.cmp(&a.total_ns).then_with(|| a.api.cmp(&b.api)));
    Ok(out)
}
