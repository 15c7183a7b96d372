//! `dynprof attach`: resolve markers, load, attach, run the session.
use std::time::Duration;

use anyhow::{Result, bail};
use clap::Args;
use serde_json::json;

use std::io::IsTerminal as _;

use crate::{
    bpf::Kernel,
    probes::{self, MarkerArg, ResolvedProbe},
    session::{EndReason, SessionSummary},
    sys::caps::Need,
    target::Target,
    window::args::Mode,
};

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
Example: libtorch_cpu:c10::ivalue::ConstantString::create(std::string),arg=1:str,prefix=Optimizer.step#";

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

    /// Job mode on exactly these PIDs (comma-separated).
    #[arg(long, value_name = "A,B,C", value_delimiter = ',',
          value_parser = crate::cli::int(1, crate::cli::PID_MAX))]
    pub pids: Option<Vec<u32>>,

    /// Read --pid in this PID namespace: a host PID of any process in it,
    /// /proc/X/ns/pid, pid:[INODE], or a container id (>= 12 hex chars).
    #[arg(long, value_name = "REF")]
    pub in_pidns: Option<String>,

    #[command(flatten)]
    pub window: crate::window::args::WindowArgs,

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
}

/// The event ring buffer, shared by `attach` and `launch`.
#[derive(Args, Debug, Clone, Copy)]
pub struct RingArgs {
    /// Ring buffer size in KiB (a power of two, at least 4).
    #[arg(long, default_value_t = 4096, value_name = "KIB", allow_negative_numbers = true,
          value_parser = crate::cli::ring_kb)]
    pub ring_buffer_kb: u32,

    /// Unread KiB in the ring at which dynprof is woken to read it before
    /// the next window boundary or 100 ms tick (default: a quarter of the
    /// ring). Lower: fewer drops in bursts, more wakeups; at least the ring
    /// size: only boundaries and ticks wake dynprof.
    #[arg(long, value_name = "KIB", allow_negative_numbers = true,
          value_parser = crate::cli::int(1, *crate::cli::RING_KB.end()))]
    pub ring_wake_kb: Option<u32>,
}

impl RingArgs {
    /// Loads the eBPF object for `pid` with this ring.
    pub fn load(&self, pid: crate::types::HostPid) -> Result<Kernel> {
        let bytes = ring_bytes(self.ring_buffer_kb)?;
        let wake = match self.ring_wake_kb {
            Some(kb) => u64::from(kb) * 1024,
            None => u64::from(bytes / 4),
        };
        Kernel::load(pid, bytes, wake)
    }
}

/// `--marker SPEC`, parsed while clap reads the command line: a malformed
/// or over-long SPEC is a usage error naming the flag.
pub fn marker_spec(s: &str) -> Result<MarkerArg, String> {
    probes::spec::parse(s).map_err(|e| format!("{e:#}"))
}

/// The `--marker` list, `auto` when none was given.
pub fn markers_or_auto(given: &[MarkerArg]) -> Vec<MarkerArg> {
    if given.is_empty() {
        vec![MarkerArg::Auto]
    } else {
        given.to_vec()
    }
}

pub fn ring_bytes(kb: u32) -> Result<u32> {
    if let Err(e) = crate::cli::ring_kb(&kb.to_string()) {
        bail!("--ring-buffer-kb: {e}");
    }
    Ok(kb * 1024)
}

pub fn attached_json(target: &Target, probes: &[ResolvedProbe]) -> serde_json::Value {
    json!({
        "event": "attached",
        "host_pid": target.host_pid,
        "ns_pids": target.ns_pids,
        "ns_pid": target.inner_pid(),
        "container": target.container,
        "container_runtime": target.container_runtime(),
        "pid_ns": target.pid_ns.map(|i| format!("pid:[{i}]")),
        "rank": target.rank,
        "comm": target.comm,
        "markers": probes.iter().map(|p| json!({
            "label": p.label,
            "role": p.role,
            "spec": p.spec,
            "object": p.object,
            "build_id": p.build_id,
            "symbol": p.symbol,
            "file_offset": p.file_offset,
            "usdt_semaphore": p.semaphore.as_ref().map(|s| s.runtime_addr),
        })).collect::<Vec<_>>(),
    })
}

pub fn print_summary(json_mode: bool, target: &Target, s: &SessionSummary) {
    if json_mode {
        let mut v = serde_json::to_value(s).unwrap_or_default();
        v["event"] = json!("summary");
        v["host_pid"] = json!(target.host_pid);
        v["ns_pids"] = json!(target.ns_pids);
        v["container"] = json!(target.container);
        v["container_runtime"] = json!(target.container_runtime());
        println!("{v}");
        return;
    }
    if s.end == EndReason::TargetExited {
        eprintln!(
            "dynprof: target PID {} exited; keeping what was counted",
            target.host_pid
        );
    }
    let st = &s.steps;
    eprintln!(
        "dynprof: {} steps ({} complete) in {:.1} s; step time mean {:.3} ms, p50 {:.3} ms, p99 {:.3} ms; ended: {}",
        st.steps,
        st.completed_steps,
        s.elapsed_s,
        st.mean_ms,
        st.p50_ms,
        st.p99_ms,
        s.end.describe()
    );
    for (k, v) in &st.aux_per_step {
        eprintln!("dynprof: {k}: {v:.2} per step");
    }
    let d = &s.drops;
    if d.step + d.api + d.cpu + d.offcpu + d.cpu_stack + d.offcpu_stack > 0 {
        eprintln!("dynprof: LOST events: {d:?} (enlarge --ring-buffer-kb)");
    }
}

/// What the session may do, for the capability check at start and the
/// drop after attach: attach always; with windows, the collectors
/// `--collect` allows (all by default: a console or config-file window may
/// choose any of them) and the vendor hooks.
pub fn needs(w: &crate::window::args::WindowArgs, mode: &Mode) -> Result<Vec<Need>> {
    use crate::collect::vendor_args::VendorCollector;
    let mut v = vec![Need::Attach];
    if *mode == Mode::None {
        return Ok(v);
    }
    let builtin = w.collectors()?.unwrap_or_else(|| {
        crate::window::args::COLLECTORS
            .iter()
            .map(|s| s.to_string())
            .collect()
    });
    for c in builtin {
        v.push(match c.as_str() {
            "api" => Need::Api,
            "cpu" => Need::Cpu,
            "offcpu" => Need::Offcpu,
            other => bail!("--collect: unknown collector `{other}`"),
        });
    }
    if w.vendor.wants(VendorCollector::Msprof) {
        v.push(Need::Msprof);
    }
    if w.vendor.wants(VendorCollector::TorchNpuDp) {
        v.push(Need::TorchNpuDp);
    }
    Ok(v)
}

/// The built-in collectors the window scheduler may arm (`--collect`
/// chooses among them; config files choose through `activities`).
pub fn collectors(
    w: &crate::window::args::WindowArgs,
) -> Result<Vec<Box<dyn crate::collect::Collector>>> {
    let opts = w.collector_opts.options()?;
    Ok(crate::collect::build_collectors(
        &crate::output::Collectors::ALL,
        &opts,
    ))
}

pub async fn run(args: AttachArgs) -> Result<()> {
    match (&args.job, &args.pids) {
        (Some(r), _) => {
            return super::job::run(args.clone(), crate::job::discover::JobRef::parse(r)?).await;
        }
        (_, Some(p)) => {
            return super::job::run(args.clone(), crate::job::discover::JobRef::pids(p)?).await;
        }
        _ => {}
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
    let lock = crate::window::lock::acquire(target.host_pid, "attach")?;
    let wait = match args.window.wait_for_marker {
        Some(d) if !d.is_zero() => super::launch::MarkerWait::For(d),
        _ => super::launch::MarkerWait::No,
    };
    let d = super::launch::Drive {
        window: &args.window,
        markers,
        json: args.json,
        steps: args.steps,
        duration: args.duration,
        ring: args.ring,
        mode_name: "attach",
        collectors: collectors(&args.window)?,
        hooks: crate::collect::vendor_args::build_hooks_for(&args.window, &target)?,
    };
    super::launch::drive(d, target, None, lock, wait)
        .await
        .map(|_| ())
}
