//! `dynprof attach --job REF` / `--pids A,B,C`: every rank of a training
//! job in one dynprof process, windows on the same job iterations.
//!
//! One thread, one event loop: each rank has its own eBPF object, session
//! and window scheduler (the kernel gate stays exact per rank), run as a
//! task next to the others. A controller task reads every rank's step
//! boundaries, aligns the ranks ([`crate::job::align`]) and then sends each
//! scheduler the plan in that rank's own step indices. When the windows are
//! written, the job directory gets `job_steps.csv`, `job_meta.json` and the
//! verdict.
use std::{
    cell::RefCell,
    collections::{HashMap, VecDeque},
    path::{Path, PathBuf},
    rc::Rc,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use serde_json::json;
use tokio::sync::mpsc;

use super::{
    args::Mode,
    attach::AttachArgs,
    driver::{self, MarkerWait, markers_or_auto, resolve_waiting},
};
use crate::{
    job::{
        self, Rank,
        align::{self, Alignment, Hit, Pending, RankHits},
        discover::{JobRef, Member},
        table::{self, OffCpu},
        verdict,
    },
    probes,
    session::{CompletedStep, Ctx, Decoded, Limits, Observer, Session, SessionSummary},
    sys::{hostfs::OutputRoot, lock},
    target::Target,
    types::Builtin,
    window::{
        Scheduler, SchedulerOptions,
        trigger::{
            ConsoleCommand, ConsoleRequest, PlanRequest, SessionCommand as Command,
            SetNoticePrinter, Source,
        },
    },
};

mod control;
mod rank;

use control::*;
use rank::*;

/// Boundaries kept per rank (for the alignment and each window step's
/// thread); older ones are dropped.
pub(super) const MAX_HITS: usize = 1 << 16;
/// Off-CPU intervals kept per rank.
pub(super) const MAX_OFFCPU: usize = 1 << 20;
/// When a slow alignment is explained on stderr.
pub(super) const ALIGN_NOTICE: Duration = Duration::from_secs(10);
/// How often the controller looks at the boundaries.
pub(super) const POLL: Duration = Duration::from_millis(20);

pub async fn run(args: AttachArgs, job_ref: JobRef) -> Result<()> {
    let plan = job_plan(&args)?;
    let start_at = args
        .start_at
        .map(|t| StartAt::new(t, args.window.start_step));
    crate::sys::caps::check(&driver::needs(&args.window, &Mode::Flags)?)?;
    let (members, source) = discover_waiting(&job_ref, args.window.wait_for_marker)?;
    crate::bpf::preflight()?;
    // The collective wait is the step thread's off-CPU time: always collect it.
    let mut collect = args
        .window
        .collectors()?
        .unwrap_or_else(|| Builtin::ALL.to_vec());
    if !collect.contains(&Builtin::Offcpu) {
        collect.push(Builtin::Offcpu);
    }
    let root = OutputRoot::open(&args.window.output)?;
    let job_name = format!(
        "{}{}_{}",
        job::JOB_DIR_PREFIX,
        crate::sys::clock::local_timestamp(),
        members[0].host_pid
    );
    let job_dir = root
        .dir()
        .create_subdir(&job_name, 0o755)
        .with_context(|| format!("creating {job_name} in {}", args.window.output.display()))?;
    let job_path: PathBuf = job_dir.path().to_path_buf();
    eprintln!(
        "dynprof: job of {} rank(s) (ranks from {:?}): {}",
        members.len(),
        source,
        members
            .iter()
            .map(|m| format!("rank {} = PID {}", m.rank, m.host_pid))
            .collect::<Vec<_>>()
            .join(", ")
    );

    let mut outcomes: HashMap<Rank, RankOutcome> = HashMap::new();
    let mut attached = Vec::new();
    let resolved: Vec<Result<Resolved>> = std::thread::scope(|s| {
        let hs: Vec<_> = members
            .iter()
            .map(|m| {
                let a = &args;
                s.spawn(move || resolve_rank(a, m))
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("resolving panicked")))
            })
            .collect()
    });
    for (m, res) in members.iter().zip(resolved) {
        let name = job::rank_dir_name(m.rank);
        let r = res.and_then(|res| {
            job_dir
                .create_subdir(&name, 0o755)
                .with_context(|| format!("creating {name}"))?;
            attach_rank(&args, m, res, &job_path.join(&name), &collect)
        });
        match r {
            Ok(a) => {
                eprintln!("dynprof: rank {}: attached to PID {}", m.rank, m.host_pid);
                attached.push(a);
            }
            Err(e) => {
                eprintln!(
                    "dynprof: rank {}: cannot attach to PID {}: {e:#}",
                    m.rank, m.host_pid
                );
                outcomes.entry(m.rank).or_default().problem = Some(format!("not attached: {e:#}"));
            }
        }
    }
    if attached.is_empty() {
        // Nothing was recorded: leave no directory that looks like a window.
        drop(job_dir);
        let _ = root.dir().remove_tree(&job_name);
        bail!("no rank of the job could be attached");
    }
    let kept = crate::sys::caps::drop_after_attach(&driver::needs(&args.window, &Mode::Flags)?)?;
    log::info!("capabilities kept after attach: {kept:?}");

    let alive: Vec<Rc<std::cell::Cell<bool>>> = attached
        .iter()
        .map(|_| Rc::new(std::cell::Cell::new(true)))
        .collect();
    let ctl_ranks: Vec<CtlRank> = attached
        .iter()
        .zip(&alive)
        .map(|(a, al)| {
            (
                a.member.rank,
                Rc::clone(&a.tap),
                a.tx.clone(),
                Rc::clone(al),
            )
        })
        .collect();
    let all_tx: Vec<_> = attached.iter().map(|a| a.tx.clone()).collect();
    let limits = (args.steps, args.duration);
    let local = tokio::task::LocalSet::new();
    let (results, control_result, taps) = local
        .run_until(async move {
            let mut handles = Vec::new();
            let mut taps = Vec::new();
            for (a, alive) in attached.into_iter().zip(alive) {
                let Attached {
                    member,
                    mut session,
                    mut observers,
                    tx,
                    rx,
                    tap,
                    lock,
                } = a;
                taps.push((member.clone(), tap));
                handles.push(tokio::task::spawn_local(async move {
                    let r = session
                        .run(
                            &mut observers,
                            Limits {
                                steps: limits.0,
                                duration: limits.1,
                            },
                            Some(rx),
                        )
                        .await;
                    drop(observers);
                    drop(tx);
                    match &r {
                        Ok(s) => eprintln!(
                            "dynprof: rank {}: detached ({})",
                            member.rank,
                            s.end.describe()
                        ),
                        Err(e) => eprintln!("dynprof: rank {}: session failed: {e:#}", member.rank),
                    }
                    drop(lock);
                    alive.set(false);
                    (member, r)
                }));
            }
            let ctl = control(ctl_ranks, plan, collect, start_at).await;
            if let Err(why) = &ctl {
                eprintln!("dynprof: job: cannot align the ranks: {why}; detaching");
                for tx in &all_tx {
                    quit(tx);
                }
            }
            drop(all_tx);
            let mut results: Vec<(Member, Result<SessionSummary>)> = Vec::new();
            for h in handles {
                match h.await {
                    Ok(v) => results.push(v),
                    Err(e) => log::error!("rank task: {e}"),
                }
            }
            (results, ctl, taps)
        })
        .await;

    for (m, r) in &results {
        let o = outcomes.entry(m.rank).or_default();
        match r {
            Ok(s) => {
                o.summary = serde_json::to_value(s).ok();
                if s.end == crate::session::EndReason::TargetExited {
                    o.problem = Some("the rank exited during the session".into());
                }
            }
            Err(e) => o.problem = Some(format!("session failed: {e:#}")),
        }
    }
    let (alignment, start, moved) = match control_result {
        Ok(v) => v,
        Err(why) => {
            let meta = json!({"ranks": members, "error": why, "rank_source": source});
            let _ = job_dir.write_atomic(
                job::JOB_META_FILE,
                serde_json::to_string_pretty(&meta)?.as_bytes(),
            );
            bail!("job window not recorded: {why}");
        }
    };
    if moved {
        eprintln!(
            "dynprof: job: start step {} was too close once the ranks were aligned; the window starts at job step {start}",
            plan.start_step
        );
    }
    let first = start + plan.warmup;
    let last = first + plan.active - 1;

    // Rows from each rank's own window.
    let mut rows = Vec::new();
    let mut waits: Vec<(Rank, Vec<OffCpu>)> = Vec::new();
    let mut rank_meta = Vec::new();
    for (m, tap) in &taps {
        let o = outcomes.entry(m.rank).or_default();
        let rank_dir = job_path.join(job::rank_dir_name(m.rank));
        let Some(offset) = alignment
            .ranks
            .iter()
            .find(|a| a.rank == m.rank)
            .map(|a| a.offset)
        else {
            o.problem
                .get_or_insert_with(|| "its session ended before the ranks were aligned".into());
            rank_meta.push(json!({
                "rank": m.rank, "host_pid": m.host_pid, "world_size": m.world_size,
                "problem": o.problem, "session": o.summary,
            }));
            continue;
        };
        let win = rank_window(&rank_dir);
        o.window_dir = win
            .as_ref()
            .map(|w| format!("{}/{w}", job::rank_dir_name(m.rank)));
        let mut own_rows = Vec::new();
        match &win {
            None => {
                o.problem
                    .get_or_insert_with(|| "its window was not written".into());
            }
            Some(w) => {
                let dir = rank_dir.join(w);
                match crate::sys::hostfs::read_path_capped(&dir.join("steps.csv"), 64 << 20)
                    .map_err(anyhow::Error::from)
                    .and_then(|t| table::parse_steps_csv(&t))
                {
                    Ok(steps) => {
                        let t = tap.borrow();
                        let tids: HashMap<u64, u32> =
                            t.hits.iter().map(|(h, tid)| (h.step, *tid)).collect();
                        own_rows = table::rank_rows(m.rank, offset, &steps, &tids, &t.offcpu);
                        let step_tids: std::collections::HashSet<u32> = steps
                            .iter()
                            .filter_map(|s| tids.get(&s.step).copied())
                            .collect();
                        waits.push((
                            m.rank,
                            t.offcpu
                                .iter()
                                .filter(|o| step_tids.contains(&o.tid))
                                .copied()
                                .collect(),
                        ));
                        if t.offcpu_dropped > 0 {
                            o.problem = Some(format!(
                                "{} off-CPU intervals dropped (memory cap)",
                                t.offcpu_dropped
                            ));
                        }
                    }
                    Err(e) => o.problem = Some(format!("reading its steps.csv: {e:#}")),
                }
                let meta = crate::sys::hostfs::read_path_capped(&dir.join("meta.json"), 4 << 20)
                    .ok()
                    .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
                if let Some(mv) = meta
                    && mv.get("complete") == Some(&json!(false))
                {
                    o.problem = Some(format!(
                        "window incomplete: {}",
                        mv.get("incomplete_reason")
                            .and_then(|v| v.as_str())
                            .unwrap_or("?")
                    ));
                }
            }
        }
        let got: Vec<u64> = own_rows.iter().map(|r| r.step).collect();
        if o.problem.is_none() && got != (first..=last).collect::<Vec<_>>() {
            o.problem = Some(format!(
                "recorded job steps {got:?}, expected {first}..={last}"
            ));
        }
        rows.extend(own_rows);
        rank_meta.push(json!({
            "rank": m.rank,
            "host_pid": m.host_pid,
            "world_size": m.world_size,
            "offset": offset,
            "own_steps": [alignment.own_step(m.rank, first), alignment.own_step(m.rank, last)],
            "window_dir": o.window_dir,
            "problem": o.problem,
            "session": o.summary,
        }));
    }
    for m in &members {
        if !taps.iter().any(|(t, _)| t.rank == m.rank) {
            rank_meta.push(json!({
                "rank": m.rank, "host_pid": m.host_pid, "world_size": m.world_size,
                "problem": outcomes.get(&m.rank).and_then(|o| o.problem.clone()),
            }));
        }
    }
    rows.sort_by_key(|r| (r.step, r.rank));
    // The ranks that were aligned (and planned) must all have recorded
    // every job step; one left out before alignment is a problem of its own.
    let ranks: Vec<Rank> = alignment.ranks.iter().map(|a| a.rank).collect();
    let check: Vec<(Rank, u64, u64, u64)> = rows
        .iter()
        .map(|r| (r.rank, r.step, r.start_ts_ns, r.duration_ns))
        .collect();
    let verification = align::verify(&ranks, &check);
    let v = verdict::verdict(&verdict::per_rank(&rows));
    let problems: Vec<String> = rank_meta
        .iter()
        .filter_map(|r| {
            let p = r.get("problem")?.as_str()?;
            Some(format!("rank {}: {p}", r["rank"]))
        })
        .collect();
    let complete = problems.is_empty() && verification.ok;
    let mut meta = json!({
        "complete": complete,
        "plan": {
            "job_steps": format!("{first}..={last}"),
            "start_step": start, "warmup": plan.warmup, "active": plan.active,
            "requested_start_step": plan.start_step, "moved": moved,
        },
        "job_step_is": "the reference (lowest) rank's own step index, counted from its attach",
        "rank_source": source,
        "collective_wait_is": "off-CPU time of the thread that crosses the step boundary, less device wait",
        "alignment": alignment,
        "verification": verification,
        "ranks": rank_meta,
        "verdict": v.text,
        "stragglers": v.stragglers,
    });
    if rows.is_empty() {
        // Nothing to compare: no table that looks like a (empty) result.
        let why = format!("no rank recorded its window ({})", problems.join("; "));
        meta["error"] = json!(why);
        job_dir.write_atomic(
            job::JOB_META_FILE,
            serde_json::to_string_pretty(&meta)?.as_bytes(),
        )?;
        bail!("job window not recorded: {why}");
    }
    job_dir.write_atomic(job::JOB_STEPS_FILE, &table::to_csv(&rows))?;
    job_dir.write_atomic(
        job::trace::TRACE_FILE,
        serde_json::to_string(&job::trace::merged(&rows, &waits))?.as_bytes(),
    )?;
    job_dir.write_atomic(
        job::JOB_META_FILE,
        serde_json::to_string_pretty(&meta)?.as_bytes(),
    )?;
    if let Some(owner) = args.window.chown_owner(members[0].host_pid)? {
        let _ = job_dir.chown_tree(owner.uid, owner.gid);
    }
    if complete {
        eprintln!(
            "dynprof: job window written: {} (job steps {first}..={last})",
            job_path.display()
        );
    } else {
        eprintln!(
            "dynprof: job window written INCOMPLETE: {} (job steps {first}..={last}){}",
            job_path.display(),
            problems
                .iter()
                .map(|p| format!("; {p}"))
                .collect::<String>()
        );
    }
    if !verification.ok {
        eprintln!(
            "dynprof: job: alignment NOT confirmed: largest start spread {:.3} ms (bound {:.3} ms), missing {:?}",
            verification.max_skew_ns as f64 / 1e6,
            verification.bound_ns as f64 / 1e6,
            verification.missing
        );
    }
    eprintln!("dynprof: {}", v.text);
    if args.json {
        println!(
            "{}",
            json!({"event": "job_window", "dir": job_path, "verdict": v.text, "stragglers": v.stragglers})
        );
    }
    Ok(())
}

/// `dynprof ps --jobs`.
pub fn ps_jobs(json_out: bool) -> Result<()> {
    use crate::job::group;
    let procs = group::procs_of(&crate::discover::scan(true));
    let jobs = group::group(&procs);
    if json_out {
        for j in &jobs {
            println!("{}", serde_json::to_string(j)?);
        }
        return Ok(());
    }
    if jobs.is_empty() {
        eprintln!("dynprof: no process loads a device runtime or framework (CANN, PyTorch, CUDA)");
        return Ok(());
    }
    println!(
        "{:<20} {:<26} {:<14} {:>5}  RANKS (rank=host PID)",
        "--job REF", "HELD BY", "CONTAINER", "WORLD"
    );
    for j in &jobs {
        let held = match &j.key {
            group::JobKey::Launcher { launcher, .. } => format!("launcher {launcher}"),
            group::JobKey::PidNamespace { .. } => "PID namespace".to_string(),
            group::JobKey::Parent { comm, .. } => format!("parent {comm}"),
        };
        println!(
            "{:<20} {:<26} {:<14} {:>5}  {}",
            j.job_ref,
            held,
            j.container.as_deref().unwrap_or("-"),
            j.world_size.map_or("-".to_string(), |w| w.to_string()),
            j.ranks
                .iter()
                .map(|m| format!("{}={}", m.rank, m.host_pid))
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    Ok(())
}
