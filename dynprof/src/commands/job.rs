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

/// Boundaries kept per rank (for the alignment and each window step's
/// thread); older ones are dropped.
const MAX_HITS: usize = 1 << 16;
/// Off-CPU intervals kept per rank.
const MAX_OFFCPU: usize = 1 << 20;
/// When a slow alignment is explained on stderr.
const ALIGN_NOTICE: Duration = Duration::from_secs(10);
/// How often the controller looks at the boundaries.
const POLL: Duration = Duration::from_millis(20);

/// What one rank's tap saw.
#[derive(Default)]
struct TapData {
    hits: VecDeque<(Hit, u32)>,
    /// Threads that crossed a step boundary: only their off-CPU time is
    /// kept (gloo's and the data loader's own threads are idle most of
    /// the time and would fill the buffer for nothing).
    step_tids: Vec<u32>,
    offcpu: Vec<OffCpu>,
    offcpu_dropped: u64,
}

/// A session observer that records the rank's boundaries and the off-CPU
/// intervals (present while the offcpu collector is armed).
struct StepTap(Rc<RefCell<TapData>>);

impl<C> Observer<C> for StepTap {
    fn on_event(&mut self, ev: &Decoded, _c: Option<&CompletedStep>, _ctx: &mut Ctx) -> Result<()> {
        let mut d = self.0.borrow_mut();
        match ev {
            Decoded::Step(s) if s.role == dynprof_common::role::STEP => {
                if d.hits.len() == MAX_HITS {
                    d.hits.pop_front();
                }
                d.hits.push_back((
                    Hit {
                        step: s.step,
                        ts_ns: s.hdr.ts_ns,
                    },
                    s.hdr.tid,
                ));
                if !d.step_tids.contains(&s.hdr.tid) {
                    d.step_tids.push(s.hdr.tid);
                }
            }
            Decoded::OffCpu(o) if d.step_tids.contains(&o.hdr.tid) => {
                if d.offcpu.len() < MAX_OFFCPU {
                    d.offcpu.push(OffCpu {
                        tid: o.hdr.tid,
                        ts_ns: o.hdr.ts_ns,
                        dur_ns: o.dur_ns,
                    });
                } else {
                    d.offcpu_dropped += 1;
                }
            }
            _ => {}
        }
        Ok(())
    }
    // `wants_exit` stays false: the session ends when the scheduler (or a
    // limit) says so.
}

/// One attached rank, ready to run.
struct Attached {
    member: Member,
    session: Session,
    observers: Vec<Box<dyn Observer<Command>>>,
    tx: mpsc::UnboundedSender<Command>,
    rx: mpsc::UnboundedReceiver<Command>,
    tap: Rc<RefCell<TapData>>,
    lock: lock::TargetLock,
}

/// What the job report records per rank.
#[derive(Default, Clone)]
struct RankOutcome {
    problem: Option<String>,
    window_dir: Option<String>,
    summary: Option<serde_json::Value>,
}

/// A rank whose markers are resolved (the slow, read-only part of attach:
/// ELF symbols of libtorch), done for all ranks at once on threads.
struct Resolved {
    target: Target,
    lock: lock::TargetLock,
    resolved: Vec<probes::ResolvedProbe>,
}

fn resolve_rank(args: &AttachArgs, m: &Member) -> Result<Resolved> {
    let target = Target::open(m.host_pid)?;
    let lock = lock::acquire(target.host_pid, "attach")?;
    let markers = markers_or_auto(&args.markers);
    let wait = match args.window.wait_for_marker {
        Some(d) if !d.is_zero() => MarkerWait::For(d),
        _ => MarkerWait::No,
    };
    let (resolved, _) = resolve_waiting(&target, &markers, wait, false)?;
    Ok(Resolved {
        target,
        lock,
        resolved,
    })
}

fn attach_rank(
    args: &AttachArgs,
    m: &Member,
    r: Resolved,
    rank_out: &Path,
    collect: &[Builtin],
) -> Result<Attached> {
    let Resolved {
        target,
        lock,
        resolved,
    } = r;
    let mut kernel = args.ring.load(target.host_pid)?;
    kernel.repair_semaphores(&lock::lock_dir());
    let mut sched = Scheduler::new(SchedulerOptions {
        output: rank_out.to_path_buf(),
        exit_when_done: true,
        idle_timeout: None,
        json: false,
        collect: Some(collect.to_vec()),
        chown: args.window.chown_owner(target.host_pid)?,
    });
    for c in driver::collectors(&args.window)? {
        sched.add_collector(c);
    }
    for h in args.window.build_hooks(&target)? {
        sched.add_hook(h);
    }
    // No plan yet: it comes once the ranks are aligned.
    sched.begin(&mut kernel, &target, None)?;
    for p in probes::attach_order(&resolved) {
        kernel.attach_marker(p)?;
    }
    let (tx, rx) = mpsc::unbounded_channel::<Command>();
    let rank = m.rank;
    let _ = tx.send(Command::SetNoticePrinter(SetNoticePrinter(Box::new(
        move |msg| eprintln!("dynprof: rank {rank}: {msg}"),
    ))));
    let tap = Rc::new(RefCell::new(TapData::default()));
    let observers: Vec<Box<dyn Observer<Command>>> =
        vec![Box::new(StepTap(Rc::clone(&tap))), Box::new(sched)];
    Ok(Attached {
        member: m.clone(),
        session: Session::new(kernel, target, resolved),
        observers,
        tx,
        rx,
        tap,
        lock,
    })
}

/// The plan as the user gave it, in job steps.
fn job_plan(args: &AttachArgs) -> Result<crate::window::Plan> {
    let w = &args.window;
    if w.interactive || w.config_dir.is_some() {
        bail!(
            "--job/--pids take the window from flags (--start-step, --warmup, --active); the console and config-file triggers are not supported in job mode yet"
        );
    }
    if !w.has_plan_flags() {
        bail!(
            "--job/--pids need a window plan: give --active N (and optionally --start-step S, --warmup W), in job steps"
        );
    }
    let plan = w.plan()?;
    if plan.repeat > 0 {
        bail!("--repeat is not supported in job mode yet: one window per run");
    }
    if plan.open_ended() {
        bail!("job mode needs a bounded window (--active N)");
    }
    Ok(plan)
}

fn quit(tx: &mpsc::UnboundedSender<Command>) {
    let (reply, _r) = std::sync::mpsc::channel();
    let _ = tx.send(Command::Console(ConsoleCommand {
        req: ConsoleRequest::Quit,
        reply,
    }));
}

/// What the controller holds per rank: its number, tap, command channel,
/// and whether its session still runs.
type CtlRank = (
    Rank,
    Rc<RefCell<TapData>>,
    mpsc::UnboundedSender<Command>,
    Rc<std::cell::Cell<bool>>,
);

/// `--start-at`, in this host's CLOCK_MONOTONIC.
#[derive(Clone, Copy, Debug)]
struct StartAt {
    mono_ns: u64,
    after_steps: u64,
}

impl StartAt {
    /// Default job steps after the first boundary at the instant.
    const DEFAULT_AFTER: u64 = 10;

    fn new(unix: Duration, start_step: Option<i64>) -> Self {
        let real_now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let mono_now = crate::sys::clock::monotonic_ns();
        let mono_ns = if unix >= real_now {
            mono_now + (unix - real_now).as_nanos() as u64
        } else {
            mono_now.saturating_sub((real_now - unix).as_nanos() as u64)
        };
        Self {
            mono_ns,
            after_steps: start_step
                .filter(|s| *s > 0)
                .map_or(Self::DEFAULT_AFTER, |s| s as u64),
        }
    }
}

/// Polls the taps until the ranks align, then sends every rank its plan.
/// Returns the alignment and the job steps planned, or why not.
async fn control(
    mut ranks: Vec<CtlRank>,
    plan: crate::window::Plan,
    collect: Vec<Builtin>,
    start_at: Option<StartAt>,
) -> Result<(Alignment, u64, bool), String> {
    let mut said = String::new();
    let started = std::time::Instant::now();
    let mut told = false;
    loop {
        // A rank whose session ended (its process exited) is left out; the
        // others are aligned without it.
        let before = ranks.len();
        ranks.retain(|(r, _, _, alive)| {
            let a = alive.get();
            if !a {
                eprintln!("dynprof: job: rank {r} ended before the ranks were aligned; going on without it");
            }
            a
        });
        if ranks.is_empty() {
            return Err(if before > 0 {
                "every rank's session ended before the ranks were aligned".into()
            } else {
                "no rank left to align".into()
            });
        }
        let snap: Vec<RankHits> = ranks
            .iter()
            .map(|(r, tap, _, _)| RankHits {
                rank: Some(*r),
                hits: tap.borrow().hits.iter().map(|h| h.0).collect(),
            })
            .collect();
        match align::align(&snap) {
            Ok(a) => {
                let now = snap
                    .iter()
                    .find(|h| h.rank == Some(a.reference))
                    .and_then(|h| h.hits.last())
                    .map_or(0, |h| h.step);
                let lead = align::lead_steps(a.period_ns);
                let (start, moved) = match start_at {
                    None => align::job_start(plan.start_step, now, lead),
                    Some(at) => {
                        // The reference rank's first boundary at or after
                        // the common instant; until it is seen, wait.
                        let first = snap
                            .iter()
                            .find(|h| h.rank == Some(a.reference))
                            .and_then(|h| h.hits.iter().find(|x| x.ts_ns >= at.mono_ns))
                            .map(|x| x.step);
                        let Some(b) = first else {
                            tokio::time::sleep(POLL).await;
                            continue;
                        };
                        let want = b + at.after_steps;
                        let (s, moved) = align::job_start(want as i64, now, lead);
                        if moved {
                            eprintln!(
                                "dynprof: job: WARNING: job step {want} ({} after the first boundary at --start-at) is too close to be planned; other nodes may start at {want}",
                                at.after_steps
                            );
                        }
                        (s, moved)
                    }
                };
                for (r, _, tx, _) in &ranks {
                    let Some(own) = a.own_step(*r, start) else {
                        return Err(format!("rank {r} has no step for job step {start}"));
                    };
                    let mut p = plan;
                    p.start_step = own as i64;
                    let mut req = PlanRequest::new(p, Source::Flags);
                    req.collect = Some(collect.clone());
                    req.metadata = Some(json!({"job_start_step": start, "rank": r.0}));
                    let _ = tx.send(Command::Plan(Box::new(req)));
                }
                return Ok((a, start, moved));
            }
            Err(Pending::Fail(why)) => return Err(why),
            Err(Pending::Wait(why)) => {
                // Ranks that stopped stepping (a hung collective, a
                // paused job) keep the alignment waiting: say why once.
                if !told && started.elapsed() >= ALIGN_NOTICE {
                    told = true;
                    eprintln!("dynprof: job: still aligning the ranks: {why}");
                }
                if why != said {
                    log::info!("job alignment: {why}");
                    said = why;
                }
            }
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Discovers the ranks; with `--wait-for-marker SECS`, a job named by its
/// launcher or namespace is re-read until every rank WORLD_SIZE announces
/// has appeared and loaded its framework (a job still starting), or SECS
/// have passed. Then it goes on with the ranks it has.
fn discover_waiting(
    r: &JobRef,
    wait: Option<Duration>,
) -> Result<(Vec<Member>, job::discover::RankSource)> {
    let deadline = wait.map(|d| std::time::Instant::now() + d);
    let mut said = None;
    loop {
        let found = job::discover::discover(r);
        let waiting = !matches!(r, JobRef::Pids(_))
            && deadline.is_some_and(|d| std::time::Instant::now() < d);
        let why = match &found {
            Ok((m, _)) => match job::discover::missing(m) {
                Some(n) if n > 0 => format!("{} of {} ranks found", m.len(), m.len() as u32 + n),
                _ => return found,
            },
            Err(e) if e.is::<job::discover::NoRanksYet>() => "none found yet".to_string(),
            Err(_) => return found,
        };
        if !waiting {
            return found;
        }
        if said.as_ref() != Some(&why) {
            eprintln!("dynprof: job: waiting for its ranks ({why})");
            said = Some(why);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The one `PROF_*` directory a rank's scheduler wrote, if any.
fn rank_window(rank_dir: &Path) -> Option<String> {
    let mut v: Vec<String> = std::fs::read_dir(rank_dir)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("PROF_"))
        .collect();
    v.sort();
    v.pop()
}

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
