use anyhow::Result;
use clap::{Parser, Subcommand};
use dynprof::commands::attach::{self, AttachArgs};

/// Attach-mode profiler for AI training and inference jobs.
///
/// Attaches to an already-running process by PID, finds its training-step
/// boundaries with uprobes, and collects exactly at those boundaries. The
/// target needs nothing at launch: no env var, no code change, no restart.
#[derive(Parser, Debug)]
#[command(name = "dynprof", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Attach to a running job and follow its training steps.
    #[command(after_help = "\
Examples:
  sudo dynprof attach --pid 4242                                   # live steps (auto markers)
  sudo dynprof attach --pid 4242 --marker exe:train_step --steps 100 --json
  sudo dynprof attach --pid 7 --in-pidns 3f2a9c1b7d4e              # PID 7 inside that container
  sudo dynprof attach --pid 4242 --start-step 100 --warmup 1 --active 3 -o out
  sudo dynprof attach --pid 4242 --interactive                     # dynprof> start / stop / quit
  sudo dynprof attach --pid 4242 --config-dir /tmp/dp              # watch profiler_config.json
  sudo dynprof attach --job 31337 --warmup 1 --active 3 -o out      # every rank of a job (docs/job-mode.md)")]
    Attach(AttachArgs),
    /// Start a program and attach to it at once (markers in libraries it
    /// loads later are attached when they appear).
    ///
    /// Example: sudo dynprof launch --start-step 10 --active 5 -o out -- python train.py
    Launch(dynprof::commands::launch::LaunchArgs),
    /// Summarize one PROF_* window directory, or compare several side by side.
    #[command(after_help = "\
Examples:
  dynprof report out/PROF_20261202120000123_4242_1
  dynprof report before/PROF_* after/PROF_* --json
  dynprof report --symbolize --debug-dir ./dbgsym out/PROF_20261202120000123_4242_1")]
    Report(dynprof::report::ReportArgs),
    /// Bench helper (`cargo xtask bench`): one program on one marker, drained silently.
    #[command(name = "__probe-cost", hide = true)]
    ProbeCost(dynprof::commands::probe_cost::ProbeCostArgs),
    /// List the AI jobs on this host (containers included): processes that
    /// load CANN, PyTorch or CUDA, with host and container PIDs, container,
    /// rank, runtimes and the step markers `attach` would use. Launchers
    /// (torchrun, mpirun, ...) are marked: profile their workers instead.
    #[command(
        after_help = "Examples:\n  sudo dynprof ps\n  sudo dynprof ps --all --json\n  sudo dynprof ps --jobs"
    )]
    Ps(dynprof::commands::ps::PsArgs),
    /// Node daemon: finds the AI jobs on this host by itself, attaches step
    /// markers to every rank (step timing only, idle cost), follows jobs
    /// that start and end, serves per-rank step time to Prometheus, and
    /// runs job-mode captures on request (docs/fleet.md).
    #[command(after_help = "\
Endpoints:
  GET  /metrics    Prometheus/OpenMetrics: dynprof_steps_total, dynprof_step_duration_seconds,
                   dynprof_attached_targets, dynprof_events_lost_total, dynprof_captures
                   (labels node, pid, rank, job, container, pod_uid, pod, namespace)
  GET  /healthz    alive;  GET /readyz: the first scan is done
  POST /capture    {\"job\": \"4242\", \"warmup\": 1, \"active\": 3, \"collect\": [\"cpu\"]}
                   (+ \"start_at\": UNIX secs: the same iterations on every node)
  GET  /captures   the captures and their PROF_JOB_* directories
  (/capture and /captures: loopback peers, or `Authorization: Bearer <token>` with --token-file)

Examples:
  sudo dynprof agent                                   # 127.0.0.1:9464
  sudo dynprof agent --listen 0.0.0.0:9464 --token-file /etc/dynprof/token --node gpu-17
  curl -s localhost:9464/metrics | grep dynprof_steps_total
  curl -s -XPOST localhost:9464/capture -d '{\"job\": \"4242\", \"active\": 3}'")]
    Agent(dynprof::commands::agent::AgentArgs),
}

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_target(false)
        .init();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("dynprof: error: {e:#}");
        // Exit codes: docs/exit-codes.md.
        let code = match e.downcast_ref::<dynprof::window::writer::WindowsNotWritten>() {
            Some(_) => dynprof::window::writer::WindowsNotWritten::EXIT_CODE,
            None => 1,
        };
        std::process::exit(code);
    }
}

fn run(cli: Cli) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    match cli.command {
        Command::Attach(a) => rt.block_on(attach::run(a)),
        Command::Launch(a) => rt.block_on(dynprof::commands::launch::run(a)),
        Command::Report(r) => match r.dirs.as_slice() {
            [d] if dynprof::job::report::is_job_dir(d) => dynprof::job::report::run(d, r.json),
            _ => dynprof::report::run(&r),
        },
        Command::ProbeCost(p) => dynprof::commands::probe_cost::run(&p),
        Command::Ps(p) => dynprof::commands::ps::run(&p),
        Command::Agent(a) => rt.block_on(dynprof::commands::agent::run(a)),
    }
}
