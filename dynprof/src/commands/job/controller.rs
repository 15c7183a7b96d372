//! The controller: one task next to the ranks' sessions. It aligns the
//! ranks once, then turns every window the trigger asks for (flags and
//! their repeats, a profiler_config.json save, a console `capture`) into
//! one plan per rank in that rank's own step indices, waits until each
//! rank's window is written, and writes the job window's files.
use super::*;

/// A job window whose plans were sent.
pub(super) struct Running {
    pub(super) req: JobRequest,
    pub(super) n: u64,
    pub(super) dir: crate::sys::hostfs::HostDir,
    pub(super) path: PathBuf,
    /// The ranks it covers, each with its own index of the window's first
    /// (warmup) and last job step.
    pub(super) ranks: Vec<(Rank, u64, u64)>,
    /// Ranks the job still had but that ended before this window.
    pub(super) gone: Vec<(Member, String)>,
    pub(super) start: u64,
    pub(super) requested: i64,
    pub(super) moved: bool,
    /// When each rank was first seen past the window's end without a
    /// directory of its own (its plan refused, or never opened).
    pub(super) passed: HashMap<Rank, Instant>,
}

impl Running {
    pub(super) fn first(&self) -> u64 {
        self.start + self.req.plan.warmup
    }
    /// The last job step; `u64::MAX` while a `start` window waits for
    /// `stop`.
    pub(super) fn last(&self) -> u64 {
        if self.req.plan.open_ended() {
            return u64::MAX;
        }
        self.first() + self.req.plan.active - 1
    }
    /// A `start` window whose end `stop` has not fixed yet.
    pub(super) fn open_ended(&self) -> bool {
        self.req.plan.open_ended()
    }
}

/// What became of a window asked for.
pub(super) enum PlanOutcome {
    /// Its plans were sent; what they record.
    Planned(String),
    /// Not yet (the ranks are not aligned, or `--start-at`'s instant has
    /// not come): keep it waiting.
    NotYet(Box<JobRequest>),
    /// Refused; the reason was said.
    Refused,
}

/// How long a rank's window may take to appear once the rank is past it.
const NOT_OPENED_GRACE: Duration = Duration::from_secs(2);
const WRITE_GRACE: Duration = Duration::from_secs(300);
/// Boundaries per rank an alignment looks at: many times the 20 reference
/// boundaries it scores, plus the step period's.
const ALIGN_HITS: usize = 512;
/// The controller's tick while nothing is aligning, planned or in flight.
const IDLE_POLL: Duration = Duration::from_millis(250);

/// The latest boundary in a snapshot (0 when empty).
fn live_latest_ts(snap: &[RankHits]) -> u64 {
    snap.iter()
        .filter_map(|r| r.hits.last())
        .map(|h| h.ts_ns)
        .max()
        .unwrap_or(0)
}

pub(super) struct Controller {
    pub(super) s: JobSetup,
    pub(super) alignment: Option<Alignment>,
    /// Alignments refused so far, and the latest boundary they used.
    pub(super) align_refusals: u32,
    pub(super) align_after_ns: u64,
    pub(super) pending: Option<JobRequest>,
    /// The window whose plans were sent and that some rank has not closed.
    pub(super) running: Option<Running>,
    /// Windows every rank has closed, waiting for their directories.
    pub(super) closing: Vec<Running>,
    pub(super) printer: Option<crate::window::trigger::NoticePrinter>,
    /// Job windows planned so far (numbers the directories).
    pub(super) planned: u64,
    pub(super) written: Vec<PathBuf>,
    pub(super) failures: Vec<String>,
    pub(super) quitting: bool,
    /// `quit` with a `start` window open: detach once it is written.
    pub(super) quit_after_window: bool,
    pub(super) last_activity: Instant,
    /// `--follow`: ranks attached later, and whether the REF is gone.
    pub(super) late: Option<(mpsc::UnboundedReceiver<CtlRank>, super::follow::FollowState)>,
    /// Ranks attached later, waiting for no job window to be in flight.
    pub(super) arrivals: Vec<CtlRank>,
}

impl Controller {
    pub(super) fn new(s: JobSetup) -> Self {
        let pending = match &s.trigger {
            Trigger::Flags(plan) => Some(JobRequest {
                plan: *plan,
                source: Source::Flags,
                collect: s.collect.clone(),
                prof_dir: None,
                rank_list: None,
                metadata: None,
                config: None,
                change: None,
                series: None,
            }),
            _ => None,
        };
        Self {
            s,
            alignment: None,
            align_refusals: 0,
            align_after_ns: 0,
            pending,
            running: None,
            closing: Vec::new(),
            printer: None,
            planned: 0,
            written: Vec::new(),
            failures: Vec::new(),
            quitting: false,
            quit_after_window: false,
            last_activity: Instant::now(),
            late: None,
            arrivals: Vec::new(),
        }
    }

    /// `--follow`: take the ranks the follower attaches.
    pub(super) fn follow(
        &mut self,
        rx: mpsc::UnboundedReceiver<CtlRank>,
        state: super::follow::FollowState,
    ) {
        self.late = Some((rx, state));
    }

    /// Ranks may still come (`--follow`, and the REF is not gone).
    fn following(&self) -> bool {
        self.late.as_ref().is_some_and(|(_, s)| !s.gone.get())
    }

    /// Takes in the ranks attached late, once no job window is in flight
    /// (a window's ranks and their plans stay as they were sent). Each
    /// replaces the ended rank of its number; the ranks are then aligned
    /// again, since new workers count their steps from their own start.
    fn take_arrivals(&mut self) {
        if let Some((rx, _)) = &mut self.late {
            while let Ok(r) = rx.try_recv() {
                self.arrivals.push(r);
            }
        }
        if self.arrivals.is_empty() || self.running.is_some() || !self.closing.is_empty() {
            return;
        }
        for r in std::mem::take(&mut self.arrivals) {
            let rank = r.rank();
            if self.s.ranks.iter().any(|o| o.rank() == rank && o.alive()) {
                self.notice(format!(
                    "rank {rank} appeared again as PID {} while PID {} still runs; left out",
                    r.member.host_pid,
                    self.s
                        .ranks
                        .iter()
                        .find(|o| o.rank() == rank && o.alive())
                        .map_or(0, |o| o.member.host_pid.0)
                ));
                quit(&r.tx);
                continue;
            }
            if let Some(i) = self.s.ranks.iter().position(|o| o.rank() == rank) {
                let old = self.s.ranks.remove(i);
                self.s.replaced.push(old.member);
            }
            self.s.members.retain(|m| m.rank != rank);
            self.s.members.push(r.member.clone());
            self.s.members.sort_by_key(|m| m.rank);
            self.s.not_attached.retain(|(m, _)| m.rank != rank);
            self.notice(format!(
                "rank {rank} is now PID {}; aligning the ranks again",
                r.member.host_pid
            ));
            self.s.ranks.push(r);
            self.alignment = None;
            self.align_refusals = 0;
        }
        self.s.ranks.sort_by_key(|r| r.rank());
    }

    pub(super) fn notice(&mut self, msg: String) {
        match &mut self.printer {
            Some(p) => p(format!("job: {msg}")),
            None => eprintln!("dynprof: job: {msg}"),
        }
    }

    pub(super) fn live(&self) -> Vec<&CtlRank> {
        self.s.ranks.iter().filter(|r| r.alive()).collect()
    }

    /// The latest job step any live, aligned rank has reached.
    pub(super) fn job_now(&self) -> Option<u64> {
        let a = self.alignment.as_ref()?;
        self.live()
            .iter()
            .filter_map(|r| a.job_step(r.rank(), r.own_now()?))
            .max()
    }

    /// Runs until the trigger is done (flags), `quit`, or every rank ended
    /// (with `--follow`: and the REF is gone). Returns, with the result,
    /// the command senders of every rank it held.
    pub(super) async fn run(
        mut self,
        rx: mpsc::UnboundedReceiver<Command>,
    ) -> (Result<()>, Vec<mpsc::UnboundedSender<Command>>) {
        let r = self.run_loop(rx).await;
        (r, self.s.ranks.iter().map(|r| r.tx.clone()).collect())
    }

    async fn run_loop(&mut self, mut rx: mpsc::UnboundedReceiver<Command>) -> Result<()> {
        let mut said = String::new();
        let started = Instant::now();
        let mut told = false;
        let mut left_out: Vec<Rank> = Vec::new();
        let mut commands_open = true;
        let mut quit_sent = false;
        loop {
            while commands_open {
                match rx.try_recv() {
                    Ok(cmd) => self.on_command(cmd),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => commands_open = false,
                }
            }
            self.take_arrivals();
            if self.alignment.is_none() {
                // A rank whose session ended (its process exited) is left
                // out; the others are aligned without it.
                for r in &self.s.ranks {
                    if !r.alive() && !left_out.contains(&r.rank()) {
                        left_out.push(r.rank());
                        eprintln!(
                            "dynprof: job: rank {} ended before the ranks were aligned; going on without it",
                            r.rank()
                        );
                    }
                }
                let live = self.live();
                if live.is_empty() && !self.following() {
                    let why = "every rank's session ended before the ranks were aligned";
                    self.write_error(why);
                    bail!("job window not recorded: {why}");
                }
                // No live rank while following: between an elastic
                // restart's old and new workers.
                // Each rank's latest boundaries only (this runs every tick
                // until aligned), and after a refusal only those crossed
                // since.
                let snap: Vec<RankHits> = live
                    .iter()
                    .map(|r| {
                        let tap = r.tap.borrow();
                        let skip = tap.hits.len().saturating_sub(ALIGN_HITS);
                        RankHits {
                            rank: Some(r.rank()),
                            hits: tap
                                .hits
                                .iter()
                                .skip(skip)
                                .map(|h| h.0)
                                .filter(|h| h.ts_ns > self.align_after_ns)
                                .collect(),
                        }
                    })
                    .collect();
                match if snap.is_empty() {
                    Err(Pending::Wait("no live rank".into()))
                } else {
                    align::align(&snap)
                } {
                    Ok(a) => {
                        log::info!("job aligned: {a:?}");
                        self.alignment = Some(a);
                    }
                    Err(Pending::Fail(why)) => {
                        self.align_refusals += 1;
                        let n = self.align_refusals;
                        let flags = matches!(self.s.trigger, Trigger::Flags(_));
                        if flags && n >= align::ATTEMPTS {
                            eprintln!(
                                "dynprof: job: cannot align the ranks ({n} attempts): {why}; detaching"
                            );
                            self.write_error(&why);
                            bail!("job window not recorded: {why}");
                        }
                        // A load spike can hold back a few boundaries of
                        // ranks in lockstep: try again on fresh ones. A
                        // console or config-file job waits for its next
                        // request rather than ending (said at attempts 1,
                        // 2, 4, 8, … so that it does not flood the console).
                        if n.is_power_of_two() {
                            eprintln!(
                                "dynprof: job: cannot align the ranks yet (attempt {n}): {why}; trying again on the next boundaries"
                            );
                        }
                        self.align_after_ns = live_latest_ts(&snap);
                    }
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
            }
            // Closed on every rank: the next window may be planned while
            // this one's directories are written (a --repeat's gap counts
            // from the close, not from the write).
            // A --repeat's next window is planned as soon as every rank has
            // opened this one: each rank's scheduler holds it until this
            // window closes and then programs it at that very boundary, so
            // the gap does not depend on how long the close takes here.
            if self
                .running
                .as_ref()
                .is_some_and(|r| self.closed(r) || (self.has_next(r) && self.opened(r)))
            {
                let r = self.running.take().expect("checked");
                self.on_closed(&r);
                self.closing.push(r);
            }
            let mut i = 0;
            while i < self.closing.len() {
                if self.written_by_all(i) {
                    let r = self.closing.remove(i);
                    self.finish(r);
                } else {
                    i += 1;
                }
            }
            if self.running.is_none()
                && self.alignment.is_some()
                && !self.quitting
                && let Some(req) = self.pending.take()
                && let PlanOutcome::NotYet(req) = self.try_plan(req)
            {
                // Not yet (--start-at's instant not reached): keep it.
                self.pending = Some(*req);
            }
            if self.quit_after_window && self.running.is_none() && self.closing.is_empty() {
                self.quitting = true;
            }
            let all_ended = self.s.ranks.iter().all(|r| !r.alive()) && !self.following();
            let flags_done = matches!(self.s.trigger, Trigger::Flags(_))
                && self.pending.is_none()
                && self.planned > 0;
            if self.running.is_none()
                && self.closing.is_empty()
                && (all_ended || flags_done || self.quitting)
            {
                break;
            }
            if (self.quitting || all_ended) && !quit_sent {
                // Ending with a window open: its ranks close it (incomplete)
                // when their sessions end.
                quit_sent = true;
                for r in &self.s.ranks {
                    quit(&r.tx);
                }
            }
            if let (Trigger::Console { .. }, Some(t)) = (&self.s.trigger, self.s.idle_timeout)
                && self.running.is_none()
                && self.pending.is_none()
                && self.last_activity.elapsed() >= t
            {
                self.notice(format!(
                    "idle for {} s without a command or window; detaching",
                    t.as_secs()
                ));
                self.quitting = true;
            }
            // Idle (aligned, no window asked for or in flight): a slow tick,
            // woken at once by a command, so that an idle job costs no
            // more than the ranks' own sessions.
            let busy = self.alignment.is_none()
                || self.pending.is_some()
                || self.running.is_some()
                || !self.closing.is_empty()
                || !self.arrivals.is_empty()
                || self.quitting;
            let tick = if busy { POLL } else { IDLE_POLL };
            if commands_open {
                tokio::select! {
                    cmd = rx.recv() => match cmd {
                        Some(cmd) => self.on_command(cmd),
                        None => commands_open = false,
                    },
                    () = tokio::time::sleep(tick) => {}
                }
            } else {
                tokio::time::sleep(tick).await;
            }
        }
        let reason = if self.quitting {
            "quit"
        } else if matches!(self.s.trigger, Trigger::Flags(_)) && self.pending.is_none() {
            "done"
        } else {
            "every rank's session ended"
        };
        let n = self.written.len();
        if let Some(c) = &mut self.s.config {
            c.ended(reason, n);
        }
        if !self.failures.is_empty() {
            bail!("{}", self.failures.join("; "));
        }
        Ok(())
    }

    /// Whether every rank of `run` has crossed the boundary that ends its
    /// window (or ended).
    fn closed(&self, run: &Running) -> bool {
        run.ranks.iter().all(|(rank, _, own_last)| {
            self.s
                .ranks
                .iter()
                .find(|r| r.rank() == *rank)
                .is_none_or(|r| !r.alive() || r.own_now().is_some_and(|k| k > *own_last))
        })
    }

    /// Whether every rank of `run` has opened its window (or ended).
    fn opened(&self, run: &Running) -> bool {
        run.ranks.iter().all(|(rank, own_start, _)| {
            self.s
                .ranks
                .iter()
                .find(|r| r.rank() == *rank)
                .is_none_or(|r| !r.alive() || r.own_now().is_some_and(|k| k >= *own_start))
        })
    }

    /// Whether `run` is a `--repeat` window with more to come.
    fn has_next(&self, run: &Running) -> bool {
        match (&self.s.trigger, run.req.source) {
            (Trigger::Flags(plan), Source::Flags) => {
                run.req.series.map_or(0, |s| s.1) < plan.repeat
            }
            _ => false,
        }
    }

    /// Whether every rank of window `i` (planned, maybe still open) has
    /// written its window, or will not.
    fn written_by_all(&mut self, i: usize) -> bool {
        let run = &mut self.closing[i];
        let mut done = true;
        for (rank, _, own_last) in &run.ranks {
            let rank_dir = run.path.join(job::rank_dir_name(*rank));
            if rank_window(&rank_dir).is_some() {
                continue;
            }
            let Some(r) = self.s.ranks.iter().find(|r| r.rank() == *rank) else {
                continue;
            };
            if !r.alive() {
                continue;
            }
            if r.own_now().is_none_or(|k| k <= *own_last) {
                done = false;
                continue;
            }
            // Past the boundary that closes its window: the directory
            // should be there (hidden while it is written).
            let since = *run.passed.entry(*rank).or_insert_with(Instant::now);
            let writing = hidden_window(&rank_dir);
            if (!writing && since.elapsed() < NOT_OPENED_GRACE)
                || (writing && since.elapsed() < WRITE_GRACE)
            {
                done = false;
            }
        }
        done
    }
}

/// Whether a rank's window is being written (its hidden directory).
fn hidden_window(rank_dir: &Path) -> bool {
    std::fs::read_dir(rank_dir).is_ok_and(|rd| {
        rd.filter_map(|e| e.ok())
            .any(|e| e.file_name().to_string_lossy().starts_with(".PROF_"))
    })
}
