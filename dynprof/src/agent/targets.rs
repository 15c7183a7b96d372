//! Following the host's jobs: scan, attach the new ranks, drop the ones
//! that exited, hand a job's ranks to a capture and take them back after.
use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, atomic::Ordering},
    time::Instant,
};

use anyhow::{Result, bail};
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::mpsc,
    task::JoinHandle,
};

use super::{
    Backoff, Shared, TargetInfo,
    capture::{self, Accepted},
    config_dir::ConfigDir,
    labels,
    metrics::{NodeLabels, TargetLabels, TargetSeries},
};
use crate::{
    bpf::Kernel,
    job::{self, group::JobGroup},
    probes::{self, MarkerArg, ResolvedProbe},
    session::{CompletedStep, Ctx, Decoded, Limits, Observer, Session},
    sys::{caps::Need, lock},
    target::Target,
    types::HostPid,
};

/// What the agent may do: attach, and let a capture's child arm any
/// built-in collector.
pub(super) fn needs() -> Vec<Need> {
    vec![Need::Attach, Need::Api, Need::Cpu, Need::Offcpu]
}

/// How long a stopping agent waits for its captures to write what they
/// have (under the DaemonSet's 30 s grace period).
const CAPTURE_STOP: std::time::Duration = std::time::Duration::from_secs(20);

/// Commands into one process's session.
pub(super) enum AgentCmd {
    /// Detach (the agent stops, or the process cannot be shared).
    Stop,
    /// A capture takes the process: release its lock so the capture's
    /// child can attach, and keep counting steps meanwhile (answers true);
    /// or detach if the markers cannot be shared (answers false).
    HandOver(Option<tokio::sync::oneshot::Sender<bool>>),
    /// The capture is done: take the lock back, or detach if another
    /// dynprof took the process meanwhile.
    TakeBack,
}

/// The session observer: counts the step hits into the process's series,
/// and holds the process's lock while nobody else controls it.
struct StepMetrics {
    pid: HostPid,
    series: TargetSeries,
    lock: Option<lock::TargetLock>,
    lost_seen: u64,
    ticks: u32,
    stop: bool,
}

/// Whether the agent's markers may stay attached next to a capture's: a
/// semaphore the agent raised through /proc/PID/mem is recorded under
/// the lock directory, and the capture's child (holding the lock) would
/// take it for a killed dynprof's and lower it. Kernel-owned semaphores
/// and plain uprobes are counted per probe by the kernel: shareable.
fn shareable(kernel: &Kernel) -> bool {
    !kernel
        .semaphore_report()
        .markers
        .iter()
        .any(|m| m.owner == probes::semaphore::SemaphoreOwner::ProcMem)
}

impl Observer<AgentCmd> for StepMetrics {
    fn on_event(&mut self, ev: &Decoded, done: Option<&CompletedStep>, _c: &mut Ctx) -> Result<()> {
        if let Decoded::Step(s) = ev
            && s.role == dynprof_common::role::STEP
        {
            self.series.steps.inc();
            if let Some(c) = done {
                self.series.duration.observe(c.duration_ns() as f64 / 1e9);
            }
        }
        Ok(())
    }

    fn on_command(&mut self, cmd: &mut AgentCmd, ctx: &mut Ctx) -> Result<()> {
        match cmd {
            AgentCmd::Stop => self.stop = true,
            AgentCmd::HandOver(reply) => {
                let share = shareable(ctx.kernel);
                if share {
                    // The capture's child takes the lock; the agent's
                    // probes stay, so no step goes uncounted.
                    self.lock = None;
                } else {
                    self.stop = true;
                }
                if let Some(r) = reply.take() {
                    let _ = r.send(share);
                }
            }
            AgentCmd::TakeBack => match lock::acquire(self.pid, "agent") {
                Ok(l) => self.lock = Some(l),
                Err(e) => {
                    eprintln!(
                        "dynprof: agent: PID {}: not taken back after the capture: {e:#}",
                        self.pid
                    );
                    self.stop = true;
                }
            },
        }
        Ok(())
    }

    fn on_tick(&mut self, ctx: &mut Ctx) -> Result<()> {
        // Losses change rarely: read the drop counters once a second.
        self.ticks += 1;
        if self.ticks.is_multiple_of(10)
            && let Ok(d) = ctx.kernel.drops()
        {
            let total = d.step + d.api + d.cpu + d.offcpu + d.cpu_stack + d.offcpu_stack;
            if total > self.lost_seen {
                self.series.lost.inc_by(total - self.lost_seen);
                self.lost_seen = total;
            }
        }
        Ok(())
    }

    fn wants_exit(&self) -> bool {
        self.stop
    }
}

/// The processes below `root` (through their parents).
fn below(infos: &[crate::discover::ProcInfo], root: HostPid) -> Vec<crate::discover::ProcInfo> {
    let parent: HashMap<HostPid, HostPid> = infos
        .iter()
        .filter_map(|i| Some((i.host_pid, i.ppid?)))
        .collect();
    let under = |mut p: HostPid| {
        for _ in 0..64 {
            match parent.get(&p) {
                Some(pp) if *pp == root => return true,
                Some(pp) => p = *pp,
                None => return false,
            }
        }
        false
    };
    infos
        .iter()
        .filter(|i| under(i.host_pid))
        .cloned()
        .collect()
}

/// The slow, read-only part of an attach (blocking thread): open the
/// process, take its lock, resolve `--marker auto`, read its labels.
struct Prepared {
    target: Target,
    lock: lock::TargetLock,
    probes: Vec<ResolvedProbe>,
    pod: Option<String>,
    namespace: Option<String>,
}

/// One marker resolution at a time: each reads libtorch's symbol tables
/// (tens of MiB while it runs), and 8 ranks of a new job resolving at once
/// would hold eight copies. Serially, and with the freed heap handed back
/// after each, the agent's peak stays near one copy; attaching 8 ranks
/// takes a little longer (the resolutions share 2 cores anyway).
static RESOLVING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn resolve_serially(target: &Target) -> Result<Vec<ResolvedProbe>> {
    let _one = RESOLVING.lock().unwrap_or_else(|e| e.into_inner());
    let r = probes::resolve_markers(target, &[MarkerArg::Auto], &[]);
    crate::sys::memory::trim_heap();
    r
}

fn prepare(pid: HostPid) -> Result<Prepared> {
    let target = Target::open(pid)?;
    let lock = lock::acquire(pid, "agent")?;
    let probes = resolve_serially(&target)?;
    let env = crate::target::read_environ(pid).unwrap_or_default();
    let (pod, namespace) = labels::pod_names(target.container_id.as_ref(), &env);
    Ok(Prepared {
        target,
        lock,
        probes,
        pod,
        namespace,
    })
}

/// One process the agent attached (or is attaching).
struct Running {
    tx: mpsc::UnboundedSender<AgentCmd>,
    task: JoinHandle<()>,
}

/// Why a process's task ended.
enum Ended {
    /// Attached, then its session ended (the process exited, or was handed
    /// to a capture).
    Detached(HostPid, TargetLabels),
    /// Could not be attached.
    Failed(HostPid, String),
}

struct Follower {
    shared: Arc<Shared>,
    running: HashMap<HostPid, Running>,
    backoff: Backoff,
    ended_tx: mpsc::UnboundedSender<Ended>,
    /// Series of exited processes, removed at their deadline.
    lingering: Vec<(Instant, TargetLabels)>,
}

impl Follower {
    fn set_attached_gauge(&self) {
        set_attached_gauge(&self.shared);
    }

    async fn rescan(&mut self) {
        let infos = match tokio::task::spawn_blocking(|| crate::discover::scan(false)).await {
            Ok(v) => v,
            Err(e) => {
                log::error!("scan: {e}");
                return;
            }
        };
        let infos = match self.shared.cfg.only_under {
            Some(root) => below(&infos, root),
            None => infos,
        };
        let jobs = job::group::group(&job::group::procs_of(&infos));
        let alive: HashSet<HostPid> = infos.iter().map(|i| i.host_pid).collect();
        self.backoff.forget_gone(&alive);
        let busy = self.shared.lock().busy.clone();
        let now = Instant::now();
        for j in &jobs {
            for m in &j.ranks {
                let pid = m.host_pid;
                if self.running.contains_key(&pid)
                    || busy.contains(&pid)
                    || !self.backoff.may_try(pid, now)
                {
                    continue;
                }
                self.start(pid, m.rank.0, j);
            }
        }
        self.shared.lock().jobs = jobs;
        if !self.shared.ready.swap(true, Ordering::Relaxed) {
            eprintln!("dynprof: agent: first scan done; ready");
        }
        let now = Instant::now();
        let running = &self.running;
        self.lingering.retain(|(at, l)| {
            let keep = *at > now;
            // A process taken back after a capture has its series again.
            let again = l
                .pid
                .parse()
                .is_ok_and(|p| running.contains_key(&HostPid(p)));
            if !keep && !again {
                self.shared.metrics.remove(l);
            }
            keep
        });
    }

    fn start(&mut self, pid: HostPid, rank: u32, j: &JobGroup) {
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::clone(&self.shared);
        let ended = self.ended_tx.clone();
        let job = j.job_ref.clone();
        let task = tokio::task::spawn_local(async move {
            let r = attach_and_run(&shared, pid, rank, &job, rx).await;
            let _ = ended.send(match r {
                Ok(l) => Ended::Detached(pid, l),
                Err(e) => Ended::Failed(pid, format!("{e:#}")),
            });
        });
        self.running.insert(pid, Running { tx, task });
    }

    fn ended(&mut self, e: Ended) {
        match e {
            Ended::Detached(pid, l) => {
                self.running.remove(&pid);
                self.shared.lock().attached.remove(&pid);
                eprintln!("dynprof: agent: detached from PID {pid}");
                self.lingering
                    .push((Instant::now() + self.shared.cfg.linger, l));
            }
            Ended::Failed(pid, why) => {
                self.running.remove(&pid);
                if self.backoff.failed(pid, Instant::now()) {
                    eprintln!("dynprof: agent: cannot attach to PID {pid}: {why}");
                } else {
                    log::info!("cannot attach to PID {pid}: {why}");
                }
            }
        }
        self.set_attached_gauge();
    }

    /// Hands `pids` to a capture: each session releases its lock and goes
    /// on counting steps, or (markers that cannot be shared) detaches; on
    /// return no lock of `pids` is the agent's.
    async fn release(&mut self, pids: &[HostPid]) {
        {
            let mut st = self.shared.lock();
            st.busy.extend(pids.iter().copied());
        }
        for pid in pids {
            let Some(r) = self.running.get(pid) else {
                continue;
            };
            let (tx, rx) = tokio::sync::oneshot::channel();
            let kept = r.tx.send(AgentCmd::HandOver(Some(tx))).is_ok() && rx.await == Ok(true);
            if !kept && let Some(r) = self.running.remove(pid) {
                let _ = r.task.await;
                self.shared.lock().attached.remove(pid);
            }
        }
        self.set_attached_gauge();
    }

    /// The capture of `pids` is done: the sessions that kept counting
    /// take their locks back.
    fn take_back(&mut self, pids: &[HostPid]) {
        for pid in pids {
            if let Some(r) = self.running.get(pid) {
                let _ = r.tx.send(AgentCmd::TakeBack);
            }
        }
    }
}

fn set_attached_gauge(shared: &Shared) {
    let n = shared.lock().attached.len();
    shared
        .metrics
        .attached
        .get_or_create(&NodeLabels {
            node: shared.cfg.node.clone(),
        })
        .set(n as i64);
}

async fn attach_and_run(
    shared: &Shared,
    pid: HostPid,
    rank: u32,
    job: &str,
    rx: mpsc::UnboundedReceiver<AgentCmd>,
) -> Result<TargetLabels> {
    let p = match tokio::task::spawn_blocking(move || prepare(pid)).await {
        Ok(r) => r?,
        Err(e) => bail!("resolving panicked: {e}"),
    };
    let mut kernel = Kernel::load(
        pid,
        shared.cfg.ring_bytes,
        u64::from(shared.cfg.ring_bytes / 4),
    )?;
    // Under the lock: undo what a killed dynprof (agent) left raised.
    kernel.repair_semaphores(&lock::lock_dir());
    for pr in probes::attach_order(&p.probes) {
        kernel.attach_marker(pr)?;
    }
    let l = TargetLabels {
        node: shared.cfg.node.clone(),
        pid: pid.to_string(),
        rank: rank.to_string(),
        job: job.to_string(),
        container: p
            .target
            .container_id
            .as_ref()
            .map(|c| c.short().to_string())
            .unwrap_or_default(),
        pod_uid: p
            .target
            .container_id
            .as_ref()
            .and_then(|c| c.pod_uid.clone())
            .unwrap_or_default(),
        pod: p.pod.clone().unwrap_or_default(),
        namespace: p.namespace.clone().unwrap_or_default(),
    };
    let series = shared.metrics.target(&l);
    eprintln!(
        "dynprof: agent: attached to PID {pid} (rank {rank} of job {job}): {}",
        p.probes
            .iter()
            .map(|x| format!("{} `{}`", x.role, x.label))
            .collect::<Vec<_>>()
            .join(", ")
    );
    shared.lock().attached.insert(
        pid,
        TargetInfo {
            host_pid: pid,
            rank,
            job: job.to_string(),
        },
    );
    set_attached_gauge(shared);
    let mut session = Session::new(kernel, p.target, p.probes);
    let mut observers: Vec<Box<dyn Observer<AgentCmd>>> = vec![Box::new(StepMetrics {
        pid,
        series,
        lock: Some(p.lock),
        lost_seen: 0,
        ticks: 0,
        stop: false,
    })];
    let r = session
        .run(
            &mut observers,
            Limits {
                steps: None,
                duration: None,
            },
            Some(rx),
        )
        .await;
    // Probes first, then the lock (the observer holds it).
    drop(session);
    drop(observers);
    if let Err(e) = r {
        eprintln!("dynprof: agent: PID {pid}: session failed: {e:#}");
    }
    Ok(l)
}

/// A new save of the shared config file: a capture of every job here.
fn config_saved(shared: &Shared, c: &mut ConfigDir) {
    let Some(asked) = c.poll() else { return };
    let file = c.file().display();
    let asked = match asked {
        Ok(a) => a,
        Err(why) => {
            eprintln!("dynprof: agent: {file}: {why}; ignored");
            return;
        }
    };
    let jobs: Vec<String> = shared
        .lock()
        .jobs
        .iter()
        .map(|j| j.job_ref.clone())
        .collect();
    if jobs.is_empty() {
        eprintln!("dynprof: agent: {file} saved, but no job runs on this node");
    }
    for job in jobs {
        let mut req = asked.req.clone();
        req.job = Some(job.clone());
        match capture::accept(shared, req, asked.ranks.as_deref()) {
            Ok(r) => eprintln!(
                "dynprof: agent: {file} saved: capture {} of job {job}",
                r.id
            ),
            Err(capture::Refused(_, why)) => {
                eprintln!("dynprof: agent: {file} saved: job {job}: {why}")
            }
        }
    }
}

/// The agent's event loop: scans every `--rescan`, runs captures, stops on
/// SIGTERM/SIGINT (every session detaches on the same signal).
pub(super) async fn follow(
    shared: Arc<Shared>,
    mut captures: mpsc::UnboundedReceiver<Accepted>,
) -> Result<()> {
    let (ended_tx, mut ended_rx) = mpsc::unbounded_channel();
    let mut f = Follower {
        shared: Arc::clone(&shared),
        running: HashMap::new(),
        backoff: Backoff::default(),
        ended_tx,
        lingering: Vec::new(),
    };
    f.set_attached_gauge();
    let mut config = match &shared.cfg.config_dir {
        Some(d) => {
            let c = ConfigDir::new(d, shared.cfg.config_lead)?;
            eprintln!(
                "dynprof: agent: watching {} (each save captures every job on this node, on the same iterations as the other nodes)",
                c.file().display()
            );
            Some(c)
        }
        None => None,
    };
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Vec<HostPid>>();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(());
    let mut capturing: Vec<JoinHandle<()>> = Vec::new();
    let mut tick = tokio::time::interval(shared.cfg.rescan);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                f.rescan().await;
                if let Some(c) = &mut config {
                    config_saved(&shared, c);
                }
            }
            Some(e) = ended_rx.recv() => f.ended(e),
            Some(acc) = captures.recv() => {
                f.release(&acc.pids).await;
                let shared = Arc::clone(&shared);
                let done = done_tx.clone();
                let stop = stop_rx.clone();
                capturing.retain(|h| !h.is_finished());
                capturing.push(tokio::task::spawn_local(async move {
                    let pids = acc.pids.clone();
                    capture::execute(&shared, acc, stop).await;
                    let _ = done.send(pids);
                }));
            }
            Some(pids) = done_rx.recv() => {
                f.take_back(&pids);
                let mut st = shared.lock();
                for p in pids {
                    st.busy.remove(&p);
                }
                drop(st);
                // Take the ranks back at once rather than a scan later.
                tick.reset_immediately();
            }
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
    }
    eprintln!(
        "dynprof: agent: stopping; detaching from {} process(es)",
        f.running.len()
    );
    for (_, r) in f.running.drain() {
        let _ = r.tx.send(AgentCmd::Stop);
        let _ = r.task.await;
    }
    // Running captures: their children detach and write what they have.
    capturing.retain(|h| !h.is_finished());
    if !capturing.is_empty() {
        eprintln!(
            "dynprof: agent: stopping {} running capture(s)",
            capturing.len()
        );
        let _ = stop_tx.send(());
        let all = async {
            for h in capturing {
                let _ = h.await;
            }
        };
        if tokio::time::timeout(CAPTURE_STOP, all).await.is_err() {
            eprintln!("dynprof: agent: a capture did not stop within {CAPTURE_STOP:?}; leaving it");
        }
    }
    Ok(())
}
