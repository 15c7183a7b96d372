//! The controller: the job's plan, discovery that waits for a starting job,
//! and the loop that aligns the ranks and sends each its plan.
use super::*;

/// The plan as the user gave it, in job steps.
pub(super) fn job_plan(args: &AttachArgs) -> Result<crate::window::Plan> {
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

/// What the controller holds per rank: its number, tap, command channel,
/// and whether its session still runs.
pub(super) type CtlRank = (
    Rank,
    Rc<RefCell<TapData>>,
    mpsc::UnboundedSender<Command>,
    Rc<std::cell::Cell<bool>>,
);

/// `--start-at`, in this host's CLOCK_MONOTONIC.
#[derive(Clone, Copy, Debug)]
pub(super) struct StartAt {
    pub(super) mono_ns: u64,
    pub(super) after_steps: u64,
}

impl StartAt {
    /// Default job steps after the first boundary at the instant.
    const DEFAULT_AFTER: u64 = 10;

    pub(super) fn new(unix: Duration, start_step: Option<i64>) -> Self {
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
pub(super) async fn control(
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
pub(super) fn discover_waiting(
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
pub(super) fn rank_window(rank_dir: &Path) -> Option<String> {
    let mut v: Vec<String> = std::fs::read_dir(rank_dir)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("PROF_"))
        .collect();
    v.sort();
    v.pop()
}
