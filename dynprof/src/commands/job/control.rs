//! The job's trigger, `--start-at`, and discovery that waits for a
//! starting job. The controller's loop is in `controller`.
use super::*;

/// What starts the job's windows.
pub(super) enum Trigger {
    /// `--start-step/--warmup/--active` (and `--repeat/--gap`).
    Flags(crate::window::Plan),
    /// `--config-dir DIR`: each valid profiler_config.json save is one window.
    ConfigFile(PathBuf),
    /// The `dynprof>` console.
    Console { plain: bool },
}

impl Trigger {
    pub(super) fn mode(&self) -> Mode {
        match self {
            Trigger::Flags(_) => Mode::Flags,
            Trigger::ConfigFile(d) => Mode::ConfigFile(d.clone()),
            Trigger::Console { plain } => Mode::Console { plain: *plain },
        }
    }
}

/// The trigger as the user gave it; flag plans are in job steps.
pub(super) fn job_trigger(args: &AttachArgs) -> Result<Trigger> {
    use std::io::IsTerminal as _;
    let w = &args.window;
    let mode = w.mode(std::io::stdin().is_terminal(), false)?;
    if args.start_at.is_some() && !matches!(mode, Mode::Flags) {
        bail!(
            "--start-at plans one window from flags; it does not combine with the console or --config-dir"
        );
    }
    Ok(match mode {
        Mode::ConfigFile(d) => Trigger::ConfigFile(d),
        Mode::Console { plain } => Trigger::Console { plain },
        Mode::None => bail!(
            "--job/--pids need a window trigger: --active N (and optionally --start-step S, --warmup W, --repeat R, --gap G) in job steps, --config-dir DIR or --interactive"
        ),
        Mode::Flags => {
            let plan = w.plan()?;
            if plan.open_ended() {
                bail!("job mode needs a bounded window (--active N)");
            }
            Trigger::Flags(plan)
        }
    })
}

/// Everything the controller needs, from attach.
pub(super) struct JobSetup {
    pub(super) ranks: Vec<CtlRank>,
    pub(super) members: Vec<Member>,
    pub(super) not_attached: Vec<(Member, String)>,
    /// `--follow`: the processes whose rank a later one took (an elastic
    /// restart's old workers).
    pub(super) replaced: Vec<Member>,
    pub(super) source: job::discover::RankSource,
    pub(super) root: OutputRoot,
    pub(super) collect: Vec<Builtin>,
    pub(super) trigger: Trigger,
    pub(super) start_at: Option<StartAt>,
    pub(super) config: Option<ConfigFileTrigger>,
    pub(super) chown: Option<crate::window::profdir::Owner>,
    pub(super) json: bool,
    pub(super) idle_timeout: Option<Duration>,
}

/// One window asked of the job, in job steps.
#[derive(Clone, Debug)]
pub(super) struct JobRequest {
    pub(super) plan: crate::window::Plan,
    pub(super) source: Source,
    pub(super) collect: Vec<Builtin>,
    /// Below --output (profiler_config.json `prof_dir`, already confined).
    pub(super) prof_dir: Option<PathBuf>,
    /// profiler_config.json `rank_list`, when `is_rank` is set.
    pub(super) rank_list: Option<Vec<i64>>,
    pub(super) metadata: Option<serde_json::Value>,
    pub(super) config: Option<serde_json::Value>,
    pub(super) change: Option<u64>,
    /// `--repeat`: the first window's job start and this window's number in
    /// the series (0 = the first).
    pub(super) series: Option<(u64, u64)>,
}

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
