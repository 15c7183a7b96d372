//! `dynprof attach`: resolve markers, load, attach, run the session.
use std::{io::IsTerminal as _, time::Duration};

use anyhow::{Result, bail};
use clap::Args;

use super::driver::{
    Drive, MarkerWait, RingArgs, collectors, drive, marker_spec, markers_or_auto, needs,
};
use crate::{probes::MarkerArg, target::Target};

const MARKER_HELP: &str = "\
Step marker (repeatable). Default: auto.
  auto                          detect the framework from /proc/PID/maps
                                (PyTorch: the optimizer step, plus backward as aux)
  OBJECT:SYMBOL[+OFF][,OPT...]  a uprobe; OBJECT is `exe`, a path, or a library
                                name fragment (libtorch_cpu); SYMBOL is mangled or
                                demangled (torch::autograd::Engine::execute)
  usdt:OBJECT:PROVIDER:NAME[,OPT...]
  python:FUNC                   a Python function (USDT function__return)
OPT: role=step|aux   arg=N:cstr|str   prefix=TEXT | eq=TEXT   name=LABEL
Example (x86-64; arm64 passes this function's name in arg=0, docs/attach.md):
  libtorch_cpu:c10::ivalue::ConstantString::create(std::string),arg=1:str,prefix=Optimizer.step#";

#[derive(Args, Debug, Clone)]
pub struct AttachArgs {
    /// PID of the running job: a host PID, or with --in-pidns the PID seen
    /// inside that PID namespace (see `dynprof ps`).
    #[arg(long, short = 'p', value_name = "PID", allow_negative_numbers = true,
          value_parser = crate::cli::int(1, crate::cli::PID_MAX),
          required_unless_present_any = ["job", "pids"], conflicts_with_all = ["job", "pids"])]
    pub pid: Option<u32>,

    /// Job mode: every rank of a training job. REF is a launcher PID (its
    /// AI descendants are the ranks), pid:[INODE] or a container id. The
    /// window flags are in job steps (docs/job-mode.md).
    #[arg(long, value_name = "REF", conflicts_with = "pids")]
    pub job: Option<String>,

    /// Job mode: keep attaching the ranks that appear under --job REF
    /// after the start (an elastic restart's new workers, a rank started
    /// late). The ranks are aligned again once no window is in flight.
    /// Keeps CAP_BPF and the uprobe capabilities for the whole run
    /// (docs/job-mode.md, docs/capabilities.md).
    #[arg(long)]
    pub follow: bool,

    /// Job mode on exactly these PIDs (comma-separated).
    #[arg(long, value_name = "A,B,C", value_delimiter = ',',
          value_parser = crate::cli::int(1, crate::cli::PID_MAX))]
    pub pids: Option<Vec<u32>>,

    /// Read --pid in this PID namespace: a host PID of any process in it,
    /// /proc/X/ns/pid, pid:[INODE], or a container id (>= 12 hex chars).
    #[arg(long, value_name = "REF")]
    pub in_pidns: Option<String>,

    #[command(flatten)]
    pub window: crate::commands::args::WindowArgs,

    #[arg(long = "marker", short = 'm', value_name = "SPEC", long_help = MARKER_HELP,
          value_parser = marker_spec)]
    pub markers: Vec<MarkerArg>,

    /// Print JSON lines on stdout (attached, step..., summary) instead of live text.
    #[arg(long)]
    pub json: bool,

    /// Detach after this many step boundaries.
    #[arg(long, value_name = "N", allow_negative_numbers = true,
          value_parser = crate::cli::int(1, crate::cli::STEPS_MAX))]
    pub steps: Option<u64>,

    /// Detach after this many seconds.
    #[arg(long, value_name = "SECS", allow_negative_numbers = true,
          value_parser = crate::cli::secs(crate::cli::Zero::Refused))]
    pub duration: Option<Duration>,

    #[command(flatten)]
    pub ring: RingArgs,

    /// Job mode across nodes: a common start instant (UNIX seconds, e.g.
    /// `date +%s.%N` plus a margin). The window starts --start-step S
    /// (default 10) job steps after the reference rank's first step
    /// boundary at or after that instant, so every node's dynprof given the
    /// same instant and S records the same iterations (clocks NTP-synced
    /// well within a step; docs/fleet.md).
    #[arg(long, value_name = "UNIX_SECS", value_parser = unix_time)]
    pub start_at: Option<Duration>,
}

/// `--start-at`: seconds since the UNIX epoch, fractions allowed.
fn unix_time(s: &str) -> Result<Duration, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v < 1e11 => Ok(Duration::from_secs_f64(v)),
        _ => Err(format!(
            "{s} is not a UNIX time in seconds (e.g. `date +%s.%N`)"
        )),
    }
}

pub async fn run(args: AttachArgs) -> Result<()> {
    // Bad collector flags (--cpu-hz, --api, --debug-dir) before any target
    // is looked at.
    args.window.collector_opts.options()?;
    if args.follow && args.job.is_none() {
        bail!(
            "--follow needs --job REF (a launcher PID, pid:[INODE] or a container id): \
             it attaches the ranks that appear under REF later; --pids names a fixed set"
        );
    }
    match (&args.job, &args.pids) {
        (Some(r), _) => {
            return super::job::run(args.clone(), crate::job::discover::JobRef::parse(r)?).await;
        }
        (_, Some(p)) => {
            return super::job::run(args.clone(), crate::job::discover::JobRef::pids(p)?).await;
        }
        _ => {}
    }
    if args.start_at.is_some() {
        bail!("--start-at is for job mode (--job or --pids)");
    }
    let Some(pid) = args.pid else {
        bail!("give --pid, --job or --pids");
    };
    let markers = markers_or_auto(&args.markers);
    // Before anything touches the target: a missing capability is named
    // here, not met as a bare EACCES half-way through attaching.
    let mode = args.window.mode(
        std::io::stdin().is_terminal(),
        args.steps.is_some() || args.duration.is_some() || args.json,
    )?;
    crate::sys::caps::check(&needs(&args.window, &mode)?)?;
    let target = Target::open(crate::target::resolve_pid(pid, args.in_pidns.as_deref())?)?;
    // Before anything reads the target's maps or takes the lock: without
    // privileges those fail with a bare EACCES that names no capability.
    crate::bpf::preflight()?;
    let lock = crate::sys::lock::acquire(target.host_pid, "attach")?;
    let wait = match args.window.wait_for_marker {
        Some(d) if !d.is_zero() => MarkerWait::For(d),
        _ => MarkerWait::No,
    };
    let d = Drive {
        window: &args.window,
        markers,
        json: args.json,
        steps: args.steps,
        duration: args.duration,
        ring: args.ring,
        mode_name: "attach",
        collectors: collectors(&args.window)?,
        hooks: args.window.build_hooks(&target)?,
    };
    drive(d, target, None, lock, wait).await.map(|_| ())
}
