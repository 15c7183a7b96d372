//! One rank: what its tap records of the session, resolving its markers
//! on a thread, attaching it with its own kernel object and scheduler.
use super::*;

/// What one rank's tap saw.
#[derive(Default)]
pub(super) struct TapData {
    pub(super) hits: VecDeque<(Hit, u32)>,
    /// Threads that crossed a step boundary: only their off-CPU time is
    /// kept (gloo's and the data loader's own threads are idle most of
    /// the time and would fill the buffer for nothing).
    pub(super) step_tids: Vec<u32>,
    pub(super) offcpu: Vec<OffCpu>,
    pub(super) offcpu_dropped: u64,
    /// Hits per marker label, read on each session tick (for `status`: an
    /// aux marker counts only while it is attached, around job windows).
    pub(super) marker_hits: std::collections::BTreeMap<String, u64>,
}

/// A session observer that records the rank's boundaries and the off-CPU
/// intervals (present while the offcpu collector is armed).
pub(super) struct StepTap(pub(super) Rc<RefCell<TapData>>);

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
            // Blocked intervals only: a step thread preempted while it
            // computes (ranks sharing cores with each other or with other
            // jobs) is not waiting for its peers.
            Decoded::OffCpu(o) if o.runnable == 0 && d.step_tids.contains(&o.hdr.tid) => {
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
    fn on_tick(&mut self, ctx: &mut Ctx) -> Result<()> {
        self.0.borrow_mut().marker_hits = crate::session::marker_hits(ctx.kernel, ctx.probes);
        Ok(())
    }
    // `wants_exit` stays false: the session ends when the scheduler (or a
    // limit) says so.
}

/// One attached rank, ready to run.
pub(super) struct Attached {
    pub(super) member: Member,
    pub(super) session: Session,
    pub(super) observers: Vec<Box<dyn Observer<Command>>>,
    pub(super) tx: mpsc::UnboundedSender<Command>,
    pub(super) rx: mpsc::UnboundedReceiver<Command>,
    pub(super) tap: Rc<RefCell<TapData>>,
    pub(super) lock: lock::TargetLock,
    pub(super) ended: Rc<RefCell<Option<Ended>>>,
    /// Whether it has aux markers, attached only around its windows (the
    /// uprobe capabilities are then kept for the whole run).
    pub(super) aux_in_windows: bool,
}

/// How a rank's session ended (set once, when it has).
#[derive(Clone, Debug)]
pub(super) struct Ended {
    /// Why its later windows are missing; None when it ended on `quit`.
    pub(super) problem: Option<String>,
    pub(super) summary: Option<serde_json::Value>,
}

/// What the controller holds per attached rank.
pub(super) struct CtlRank {
    pub(super) member: Member,
    pub(super) target: Target,
    pub(super) tap: Rc<RefCell<TapData>>,
    pub(super) tx: mpsc::UnboundedSender<Command>,
    pub(super) ended: Rc<RefCell<Option<Ended>>>,
}

impl CtlRank {
    pub(super) fn rank(&self) -> Rank {
        self.member.rank
    }
    pub(super) fn alive(&self) -> bool {
        self.ended.borrow().is_none()
    }
    /// Its latest own step index.
    pub(super) fn own_now(&self) -> Option<u64> {
        self.tap.borrow().hits.back().map(|h| h.0.step)
    }
}

/// A rank whose markers are resolved and whose eBPF object is loaded: the
/// slow parts of attach (ELF symbols of libtorch; the kernel's BTF, map
/// allocation and the verifier), done for all ranks at once on threads.
pub(super) struct Resolved {
    pub(super) target: Target,
    pub(super) lock: lock::TargetLock,
    pub(super) resolved: Vec<probes::ResolvedProbe>,
    pub(super) kernel: crate::bpf::Kernel,
}

/// `--wait-for-marker`, as the ranks found at start wait for their markers.
pub(super) fn marker_wait(args: &AttachArgs) -> MarkerWait {
    match args.window.wait_for_marker {
        Some(d) if !d.is_zero() => MarkerWait::For(d),
        _ => MarkerWait::No,
    }
}

/// A rank whose markers are resolved and whose load plan is made: the
/// first, parallel half of [`resolve_rank`].
pub(super) struct Prepared {
    pub(super) target: Target,
    pub(super) lock: lock::TargetLock,
    pub(super) resolved: Vec<probes::ResolvedProbe>,
}

/// Opens and locks the rank's target, resolves its markers (ELF symbols)
/// and plans its eBPF object.
pub(super) fn prepare_rank(
    args: &AttachArgs,
    m: &Member,
    wait: MarkerWait,
) -> Result<(Prepared, crate::bpf::LoadPlan)> {
    let target = Target::open(m.host_pid)?;
    let lock = lock::acquire(target.host_pid, "attach")?;
    let markers = markers_or_auto(&args.markers);
    let (resolved, _) = resolve_waiting(
        &target,
        &markers,
        &args.window.collector_opts.debug_dirs,
        wait,
        false,
    )?;
    let plan = args.ring.plan(target.host_pid)?;
    Ok((
        Prepared {
            target,
            lock,
            resolved,
        },
        plan,
    ))
}

/// Loads a prepared rank's object through the job's shared `loader`, then
/// runs the verifier on its programs: the uprobe ones, and the collectors'
/// here, in parallel, rather than on the event loop at the first window.
pub(super) fn load_rank<'a>(
    m: &Member,
    p: Prepared,
    plan: &'a crate::bpf::LoadPlan,
    loader: &std::sync::Mutex<crate::bpf::Loader<'a>>,
    collect: &[Builtin],
) -> Result<Resolved> {
    let mut kernel = {
        let mut l = loader
            .lock()
            .map_err(|_| anyhow::anyhow!("the eBPF loader was poisoned by a panic"))?;
        l.load(plan)?
    };
    kernel.verify_uprobe_programs()?;
    if let Err(e) = kernel.verify_collector_programs(
        collect.contains(&Builtin::Cpu),
        collect.contains(&Builtin::Offcpu),
    ) {
        log::warn!("rank {}: {e:#} (the window will say so)", m.rank);
    }
    Ok(Resolved {
        target: p.target,
        lock: p.lock,
        resolved: p.resolved,
        kernel,
    })
}

/// Both halves for one rank, with a loader of its own (a rank that
/// appears later, `--follow`).
pub(super) fn resolve_rank(
    args: &AttachArgs,
    m: &Member,
    wait: MarkerWait,
    collect: &[Builtin],
) -> Result<Resolved> {
    let (p, plan) = prepare_rank(args, m, wait)?;
    let loader = std::sync::Mutex::new(crate::bpf::Loader::new());
    load_rank(m, p, &plan, &loader, collect)
}

pub(super) fn attach_rank(
    args: &AttachArgs,
    m: &Member,
    r: Resolved,
    collect: &[Builtin],
) -> Result<Attached> {
    let Resolved {
        target,
        lock,
        resolved,
        mut kernel,
    } = r;
    kernel.repair_semaphores(&lock::lock_dir());
    // Each job window's plan names its own directory below --output
    // (`PROF_JOB_…/rankN`); the session runs until the job is done with it.
    let mut sched = Scheduler::new(SchedulerOptions {
        output: args.window.output.clone(),
        exit_when_done: false,
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
    // Aux markers (e.g. the backward pass) are attached only around job
    // windows, as for one PID: each hit is a uprobe trap on every idle step.
    // The scheduler attaches them when a job window's plan arrives and
    // detaches them with the collectors.
    let window_markers: Vec<probes::ResolvedProbe> = resolved
        .iter()
        .filter(|p| p.role == probes::Role::Aux)
        .cloned()
        .collect();
    sched.set_window_markers(window_markers.clone());
    // No plan yet: it comes once the ranks are aligned.
    sched.begin(&mut kernel, &target, None)?;
    for p in probes::attach_order(&resolved)
        .filter(|p| !window_markers.iter().any(|w| w.index == p.index))
    {
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
    let mut session = Session::new(kernel, target, resolved);
    session.clock.aux_in_windows_only = !window_markers.is_empty();
    session.realtime_boundaries = args.window.realtime_boundaries;
    Ok(Attached {
        member: m.clone(),
        aux_in_windows: !window_markers.is_empty(),
        session,
        observers,
        tx,
        rx,
        tap,
        lock,
        ended: Rc::new(RefCell::new(None)),
    })
}

pub(super) fn quit(tx: &mpsc::UnboundedSender<Command>) {
    let (reply, _r) = std::sync::mpsc::channel();
    let _ = tx.send(Command::Console(ConsoleCommand {
        req: ConsoleRequest::Quit,
        reply,
    }));
}

/// Runs one attached rank's session as a task on the job's `LocalSet`;
/// when it ends, the rank's `ended` says how.
pub(super) fn spawn_rank(
    a: Attached,
    limits: (Option<u64>, Option<Duration>),
) -> tokio::task::JoinHandle<()> {
    let Attached {
        member,
        mut session,
        mut observers,
        tx,
        rx,
        tap: _,
        lock,
        ended,
        aux_in_windows: _,
    } = a;
    tokio::task::spawn_local(async move {
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
        let end = match &r {
            Ok(s) => {
                eprintln!(
                    "dynprof: rank {}: detached ({})",
                    member.rank,
                    s.end.describe()
                );
                Ended {
                    problem: match &s.end {
                        crate::session::EndReason::TargetExited => {
                            Some("the rank exited during the session".into())
                        }
                        crate::session::EndReason::Done => None,
                        other => Some(format!("its session ended ({})", other.describe())),
                    },
                    summary: serde_json::to_value(s).ok(),
                }
            }
            Err(e) => {
                eprintln!("dynprof: rank {}: session failed: {e:#}", member.rank);
                Ended {
                    problem: Some(format!("session failed: {e:#}")),
                    summary: None,
                }
            }
        };
        drop(lock);
        *ended.borrow_mut() = Some(end);
    })
}

impl Attached {
    /// What the controller holds of it.
    pub(super) fn ctl(&self) -> CtlRank {
        CtlRank {
            member: self.member.clone(),
            target: self.session.target.clone(),
            tap: Rc::clone(&self.tap),
            tx: self.tx.clone(),
            ended: Rc::clone(&self.ended),
        }
    }
}
