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
    time::{Duration, Instant},
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
    bpf::{LoadPlan, Loader},
    job::{
        self, Rank,
        align::{self, Alignment, Hit, Pending, RankHits},
        discover::{JobRef, Member},
        table::{self, OffCpu},
        verdict,
    },
    probes,
    session::{CompletedStep, Ctx, Decoded, Limits, Observer, Session},
    sys::{hostfs::OutputRoot, lock},
    target::Target,
    types::Builtin,
    window::{
        Plan, Scheduler, SchedulerOptions,
        trigger::{
            ConsoleCommand, ConsoleRequest, PlanRequest, SessionCommand as Command,
            SetNoticePrinter, Source, config_file::ConfigFileTrigger,
        },
    },
};

mod control;
mod controller;
mod finish;
mod follow;
mod plan;
mod rank;
mod triggers;

use control::*;
use controller::*;
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
    let trigger = job_trigger(&args)?;
    let start_at = args
        .start_at
        .map(|t| StartAt::new(t, args.window.start_step));
    let collect = with_job_collectors(
        args.window
            .collectors()?
            .unwrap_or_else(|| Builtin::ALL.to_vec()),
    );
    crate::sys::caps::check(&job_needs(&args, &trigger.mode(), &collect)?)?;
    let (members, source) = discover_waiting(&job_ref, args.window.wait_for_marker)?;
    crate::bpf::preflight()?;
    let root = OutputRoot::open(&args.window.output)?;
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

    let mut not_attached: Vec<(Member, String)> = Vec::new();
    let mut attached = Vec::new();
    // Two parallel passes over the ranks: markers and load plans, then
    // the objects, through one loader (one parse of the kernel's BTF for
    // the job), each verified on its rank's thread.
    let prepared: Vec<Result<(Prepared, LoadPlan)>> = std::thread::scope(|s| {
        let hs: Vec<_> = members
            .iter()
            .map(|m| {
                let a = &args;
                s.spawn(move || prepare_rank(a, m, marker_wait(a)))
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("resolving panicked")))
            })
            .collect()
    });
    // The ranks whose preparation failed keep their error; the others are
    // loaded. Each plan is kept beside its rank (the loader borrows it).
    let mut resolved: Vec<(usize, Result<Resolved>)> = Vec::new();
    let mut ready: Vec<(usize, Prepared)> = Vec::new();
    let mut plans: Vec<LoadPlan> = Vec::new();
    for (i, r) in prepared.into_iter().enumerate() {
        match r {
            Ok((p, plan)) => {
                ready.push((i, p));
                plans.push(plan);
            }
            Err(e) => resolved.push((i, Err(e))),
        }
    }
    let loader = std::sync::Mutex::new(Loader::new());
    std::thread::scope(|s| {
        let hs: Vec<_> = ready
            .into_iter()
            .zip(&plans)
            .map(|((i, p), plan)| {
                let (l, c, m) = (&loader, &collect, &members[i]);
                (i, s.spawn(move || load_rank(m, p, plan, l, c)))
            })
            .collect();
        for (i, h) in hs {
            let r = h
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("loading panicked")));
            resolved.push((i, r));
        }
    });
    resolved.sort_by_key(|(i, _)| *i);
    drop(loader);
    for (m, res) in resolved.into_iter().map(|(i, r)| (&members[i], r)) {
        match res.and_then(|res| attach_rank(&args, m, res, &collect)) {
            Ok(a) => {
                eprintln!("dynprof: rank {}: attached to PID {}", m.rank, m.host_pid);
                attached.push(a);
            }
            Err(e) => {
                eprintln!(
                    "dynprof: rank {}: cannot attach to PID {}: {e:#}",
                    m.rank, m.host_pid
                );
                not_attached.push((m.clone(), format!("not attached: {e:#}")));
            }
        }
    }
    if attached.is_empty() {
        bail!("no rank of the job could be attached");
    }
    // Each rank thread parsed the kernel's BTF and symbol tables in its own
    // malloc arena; give what was freed back before the long idle run.
    crate::sys::memory::trim_heap();
    // The config file is the job's input, set up before capabilities drop
    // (as for a single PID).
    let config = match &trigger {
        Trigger::ConfigFile(dir) => Some(ConfigFileTrigger::setup_job(
            dir,
            members[0].host_pid.0,
            attached.len(),
            &args.window.output,
        )?),
        _ => None,
    };
    // Keep what the windows and the detach need, and the uprobe
    // capabilities to attach aux markers again around each job window.
    let mut session_needs = job_needs(&args, &trigger.mode(), &collect)?;
    if attached.iter().any(|a| a.aux_in_windows) {
        session_needs.push(crate::sys::caps::Need::AuxMarkers);
    }
    if args.follow {
        session_needs.push(crate::sys::caps::Need::LateRanks);
    }
    let kept = crate::sys::caps::drop_after_attach(&session_needs)?;
    log::info!("capabilities kept after attach: {kept:?}");

    let ctl_ranks: Vec<CtlRank> = attached.iter().map(Attached::ctl).collect();
    let (cmd_tx, cmd_rx) = mpsc::unbounded_channel::<Command>();
    match &trigger {
        Trigger::Console { plain } => {
            crate::window::trigger::console::spawn(cmd_tx.clone(), *plain)?
        }
        Trigger::ConfigFile(dir) => {
            if let Some(c) = &config {
                c.spawn_watcher(cmd_tx.clone())?;
            }
            eprintln!(
                "dynprof: job: watching {}; edit it to start a job window",
                dir.join(crate::window::trigger::config_file::CONFIG_FILE)
                    .display()
            );
        }
        Trigger::Flags(_) => {}
    }
    drop(cmd_tx);
    let limits = (args.steps, args.duration);
    let (late_tx, late_rx) = mpsc::unbounded_channel::<CtlRank>();
    let follower = args.follow.then(|| {
        follow::Follower::new(
            args.clone(),
            job_ref.clone(),
            members
                .iter()
                .map(|m| m.host_pid)
                .chain(not_attached.iter().map(|(m, _)| m.host_pid)),
            collect.clone(),
            late_tx,
            limits,
        )
    });
    let following = follower.as_ref().map(follow::Follower::state);
    let mut ctl = Controller::new(JobSetup {
        ranks: ctl_ranks,
        members: members.clone(),
        not_attached,
        replaced: Vec::new(),
        source,
        root,
        collect,
        trigger,
        start_at,
        config,
        chown: args.window.chown_owner(members[0].host_pid)?,
        json: args.json,
        idle_timeout: args.window.idle_timeout(),
    });
    if let Some(state) = following {
        ctl.follow(late_rx, state);
    }
    let all_tx: Vec<_> = attached.iter().map(|a| a.tx.clone()).collect();
    let local = tokio::task::LocalSet::new();
    local
        .run_until(async move {
            let mut handles: Vec<_> = attached
                .into_iter()
                .map(|a| spawn_rank(a, limits))
                .collect();
            let late_handles = follower.as_ref().map(follow::Follower::handles);
            let follow_task = follower.map(|f| tokio::task::spawn_local(f.run()));
            let (r, late_tx) = ctl.run(cmd_rx).await;
            // Nothing more is attached once the controller is done.
            if let Some(t) = follow_task {
                t.abort();
                let _ = t.await;
            }
            if let Some(h) = late_handles {
                handles.extend(h.borrow_mut().drain(..));
            }
            for tx in all_tx.iter().chain(&late_tx) {
                quit(tx);
            }
            drop(all_tx);
            drop(late_tx);
            for h in handles {
                if let Err(e) = h.await {
                    log::error!("rank task: {e}");
                }
            }
            r
        })
        .await
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

/// The collectors a job window arms: `collect` plus `offcpu`, which
/// `job_steps.csv`'s collective wait falls back to for ranks without
/// c10d's collective-wait calls (those come from `api`, in the default
/// set; a `--collect` without it means the fallback for every rank).
/// None stays none (`--collect none`, or a config whose activities name no
/// built-in collector): step timing only, as for one PID, and
/// `collective_wait_from` says `not_recorded`.
fn with_job_collectors(mut collect: Vec<Builtin>) -> Vec<Builtin> {
    if !collect.is_empty() && !collect.contains(&Builtin::Offcpu) {
        collect.push(Builtin::Offcpu);
    }
    collect
}

/// What the job's sessions need: the windows' (`driver::needs`) and the
/// offcpu collector's when the job adds it ([`with_job_collectors`]).
/// Without the latter, the capability drop after attach left the job
/// unable to arm the collector it adds, and every window was incomplete.
fn job_needs(
    args: &AttachArgs,
    mode: &Mode,
    collect: &[Builtin],
) -> Result<Vec<crate::sys::caps::Need>> {
    use crate::sys::caps::Need;
    let mut v = driver::needs(&args.window, mode)?;
    if *mode != Mode::None && collect.contains(&Builtin::Offcpu) && !v.contains(&Need::Offcpu) {
        v.push(Need::Offcpu);
    }
    Ok(v)
}
