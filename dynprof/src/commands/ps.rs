//! `dynprof ps`: find the AI jobs on this host, containers included.
use std::io::Write as _;

use anyhow::Result;
use clap::Args;
use comfy_table::{ContentArrangement, Table, presets::NOTHING};

use crate::discover::{self as ps, ProcInfo};

#[derive(Args, Debug, Clone)]
pub struct PsArgs {
    /// One JSON object per process per line instead of a table.
    #[arg(long)]
    pub json: bool,

    /// Every process, not only those that load a device runtime or framework.
    #[arg(long)]
    pub all: bool,

    /// Group the AI processes into jobs (launcher, PID namespace or parent;
    /// world size; ranks) with the `attach --job` reference of each.
    #[arg(long, conflicts_with = "all")]
    pub jobs: bool,
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map(|x| x.to_string()).unwrap_or_else(|| "-".into())
}

/// `3/1/8`, `-` when nothing is known, `?` when environ was unreadable.
pub fn rank_cell(p: &ProcInfo) -> String {
    if !p.environ_readable {
        return "?".into();
    }
    if p.rank.is_none() && p.local_rank.is_none() && p.world_size.is_none() {
        return "-".into();
    }
    format!(
        "{}/{}/{}",
        opt(p.rank),
        opt(p.local_rank),
        opt(p.world_size)
    )
}

pub fn ns_pids_cell(p: &ProcInfo) -> String {
    p.ns_pids
        .iter()
        .map(|n| n.to_string())
        .collect::<Vec<_>>()
        .join(">")
}

pub fn container_cell(p: &ProcInfo) -> String {
    match &p.container {
        Some(c) => format!("{} ({})", c.short(), c.runtime),
        None => "-".into(),
    }
}

pub fn markers_cell(p: &ProcInfo) -> String {
    match p.launcher {
        Some(kind) => {
            let w: Vec<String> = p.workers.iter().map(|w| w.to_string()).collect();
            if w.is_empty() {
                format!("LAUNCHER ({kind}): profile its workers")
            } else {
                format!("LAUNCHER ({kind}): profile its workers {}", w.join(" "))
            }
        }
        None => p.markers.clone(),
    }
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(n - 1).collect::<String>())
    }
}

pub fn table(procs: &[ProcInfo]) -> Table {
    let mut t = Table::new();
    t.load_preset(NOTHING)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(vec![
            "HOST PID",
            "NS PIDS",
            "CONTAINER",
            "RANK/LOCAL/WORLD",
            "RUNTIMES",
            "MARKERS",
            "COMMAND",
        ]);
    for p in procs {
        let runtimes = if p.runtimes.is_empty() {
            "-".to_string()
        } else {
            p.runtimes.join(",")
        };
        t.add_row(vec![
            p.host_pid.to_string(),
            ns_pids_cell(p),
            container_cell(p),
            rank_cell(p),
            runtimes,
            markers_cell(p),
            truncate(&p.command(), 80),
        ]);
    }
    t
}

pub fn run(args: &PsArgs) -> Result<()> {
    if args.jobs {
        return super::job::ps_jobs(args.json);
    }
    let procs = ps::scan(args.all);
    let mut out = std::io::stdout().lock();
    if args.json {
        for p in &procs {
            writeln!(out, "{}", serde_json::to_string(p)?)?;
        }
    } else if procs.is_empty() {
        eprintln!(
            "dynprof: no process loads a device runtime or framework (CANN, PyTorch, CUDA); \
             `dynprof ps --all` lists every process{}",
            // SAFETY: geteuid has no preconditions.
            if unsafe { libc::geteuid() } != 0 {
                "; run as root to see other users' processes"
            } else {
                ""
            }
        );
    } else {
        writeln!(out, "{}", table(&procs))?;
        if procs
            .iter()
            .any(|p| p.container.is_some() || p.ns_pids.len() > 1)
        {
            eprintln!(
                "dynprof: attach from the host with `dynprof attach --pid HOST_PID`, or \
                 `--pid NS_PID --in-pidns CONTAINER_ID`"
            );
        }
    }
    Ok(())
}
