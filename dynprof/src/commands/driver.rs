//! The session driver `attach` and `launch` share: lock the target, pick
//! the trigger, resolve (or wait for) the markers, program the plan,
//! attach, run, report; and the flags and JSON both print.
use std::{
    io::IsTerminal as _,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use clap::Args;
use serde_json::json;
use tokio::sync::mpsc;

use super::{
    args::{Mode, WindowArgs},
    printer::StepPrinter,
};
use crate::{
    bpf::Kernel,
    collect::{Collector, WindowHook},
    probes::{self, MarkerArg, ResolvedProbe},
    session::{EndReason, Limits, Observer, Session, SessionSummary},
    sys::{caps::Need, lock},
    target::{Target, exited_during},
    types::{Builtin, HostPid},
    window::{
        Scheduler, SchedulerOptions,
        trigger::{SessionCommand, config_file::ConfigFileTrigger, console},
    },
};

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
        let (bytes, wake) = self.sizes()?;
        Kernel::load(pid, bytes, wake)
    }

    /// The load plan for `pid` with this ring, for a shared
    /// [`crate::bpf::Loader`] (job mode).
    pub fn plan(&self, pid: crate::types::HostPid) -> Result<crate::bpf::LoadPlan> {
        let (bytes, wake) = self.sizes()?;
        crate::bpf::LoadPlan::new(pid, bytes, wake)
    }

    /// (ring bytes, wake bytes).
    fn sizes(&self) -> Result<(u32, u64)> {
        let bytes = ring_bytes(self.ring_buffer_kb)?;
        let wake = match self.ring_wake_kb {
            Some(kb) => u64::from(kb) * 1024,
            None => u64::from(bytes / 4),
        };
        Ok((bytes, wake))
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
            "first_insn": p.first_insn,
            "single_stepped": p.first_insn.map(|c| c.single_stepped()),
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
    if let Some(n) = s.realtime_raises {
        eprintln!(
            "dynprof: --realtime-boundaries: the event loop waited for boundaries at SCHED_FIFO {n} time(s)"
        );
    }
    if st.aux_in_windows_only {
        eprintln!(
            "dynprof: aux markers were attached only around windows; their counts are in each window's steps.csv"
        );
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
pub fn needs(w: &crate::commands::args::WindowArgs, mode: &Mode) -> Result<Vec<Need>> {
    use crate::collect::vendor_args::VendorCollector;
    let mut v = vec![Need::Attach];
    if *mode == Mode::None {
        return Ok(v);
    }
    let builtin = w.collectors()?.unwrap_or_else(|| Builtin::ALL.to_vec());
    for c in builtin {
        v.push(match c {
            Builtin::Api => Need::Api,
            Builtin::Cpu => Need::Cpu,
            Builtin::Offcpu => Need::Offcpu,
        });
    }
    if w.vendor.wants(VendorCollector::Msprof) {
        v.push(Need::Msprof);
    }
    if w.vendor.wants(VendorCollector::TorchNpuDp) {
        v.push(Need::TorchNpuDp);
    }
    if w.chown.is_some() {
        v.push(Need::Chown);
    }
    if w.realtime_boundaries {
        v.push(Need::Realtime);
    }
    Ok(v)
}

/// The built-in collectors the window scheduler may arm (`--collect`
/// chooses among them; config files choose through `activities`).
pub fn collectors(
    w: &crate::commands::args::WindowArgs,
) -> Result<Vec<Box<dyn crate::collect::Collector>>> {
    let opts = w.collector_opts.options()?;
    Ok(crate::collect::build_collectors(
        &crate::output::Collectors::ALL,
        &opts,
    ))
}

/// Everything the driver needs besides the target.
pub struct Drive<'a> {
    pub window: &'a WindowArgs,
    pub markers: Vec<MarkerArg>,
    pub json: bool,
    pub steps: Option<u64>,
    pub duration: Option<Duration>,
    pub ring: RingArgs,
    /// `attach` or `launch` (recorded in the lock file).
    pub mode_name: &'static str,
    /// Collectors and hooks the scheduler drives around windows.
    pub collectors: Vec<Box<dyn Collector>>,
    pub hooks: Vec<Box<dyn WindowHook>>,
}

/// How long to wait for markers whose library is not mapped yet.
#[derive(Clone, Copy, Debug)]
pub enum MarkerWait {
    No,
    For(Duration),
    WhileAlive,
}

/// True for resolution failures that a library loaded later can cure.
fn may_appear_later(e: &anyhow::Error) -> bool {
    let s = format!("{e:#}");
    s.contains("is not mapped by PID") || s.contains("found no known framework")
}

/// Holds a launched target stopped (SIGSTOP) while its late-loaded marker
/// library is being attached; SIGCONT on drop.
pub struct Frozen(HostPid);

impl Drop for Frozen {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the launched program.
        unsafe { libc::kill(self.0.0 as i32, libc::SIGCONT) };
    }
}

fn freeze(pid: HostPid) -> Frozen {
    // SAFETY: kill(2) on the launched program.
    unsafe { libc::kill(pid.0 as i32, libc::SIGSTOP) };
    let f = Frozen(pid);
    // Wait (briefly) until it is really stopped.
    for _ in 0..200 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .chars()
            .next();
        if matches!(state, Some('T') | Some('t') | Some('Z') | Some('X') | None) {
            break;
        }
        std::thread::sleep(Duration::from_micros(500));
    }
    f
}

/// Resolves the markers, waiting (per `wait`) for libraries not mapped yet:
/// re-resolves whenever `/proc/PID/maps` changes. With `freeze` (launch
/// mode: our own child), a re-resolution after a maps change runs with the
/// program stopped, and the returned guard keeps it stopped until the
/// caller has attached the probes, so no step slips by in between.
pub fn resolve_waiting(
    target: &Target,
    markers: &[MarkerArg],
    debug_dirs: &[std::path::PathBuf],
    wait: MarkerWait,
    freeze_target: bool,
) -> Result<(Vec<ResolvedProbe>, Option<Frozen>)> {
    let started = Instant::now();
    let mut said = false;
    // None until the first read: even an empty first map is resolved (and
    // refused) once rather than polled forever as "unchanged".
    let mut last_maps: Option<String> = None;
    // The files read so far: each change of the map re-resolves, and a
    // large library or a stripped file's debug-file search is not redone.
    let mut files = probes::FileCache::default();
    loop {
        let maps = match std::fs::read_to_string(format!("/proc/{}/maps", target.host_pid)) {
            Ok(m) => m,
            Err(e) => {
                return Err(crate::target::gone_or(
                    target.host_pid,
                    e,
                    "reading its memory map",
                ));
            }
        };
        if last_maps.as_ref() != Some(&maps) {
            last_maps = Some(maps);
            let frozen = freeze_target.then(|| freeze(target.host_pid));
            match probes::resolve_markers_cached(target, markers, debug_dirs, &mut files) {
                Ok(v) => {
                    if said {
                        eprintln!(
                            "dynprof: step marker found after {:.1} s",
                            started.elapsed().as_secs_f64()
                        );
                    }
                    return Ok((v, frozen));
                }
                Err(e) => {
                    drop(frozen);
                    let keep_waiting = may_appear_later(&e)
                        && match wait {
                            MarkerWait::No => false,
                            MarkerWait::For(d) => started.elapsed() < d,
                            MarkerWait::WhileAlive => true,
                        };
                    if !keep_waiting {
                        return Err(e);
                    }
                    if !said {
                        said = true;
                        let first = format!("{e:#}");
                        eprintln!(
                            "dynprof: the step marker is not loaded yet in PID {}; attaching when it appears ({})",
                            target.host_pid,
                            first.lines().take(3).collect::<Vec<_>>().join(" ")
                        );
                    }
                }
            }
        }
        if !target.is_alive() {
            bail!(
                "PID {} exited before its step marker was loaded",
                target.host_pid
            );
        }
        if let MarkerWait::For(d) = wait
            && started.elapsed() >= d
        {
            return Ok((
                probes::resolve_markers_cached(target, markers, debug_dirs, &mut files)?,
                None,
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Runs one session against `target` with the trigger `d.window` selects.
/// `kernel` may be preloaded (launch); otherwise it is loaded here.
pub async fn drive(
    mut d: Drive<'_>,
    target: Target,
    kernel: Option<Kernel>,
    lock: lock::TargetLock,
    wait: MarkerWait,
) -> Result<SessionSummary> {
    let stdin_tty = std::io::stdin().is_terminal();
    let mode = d.window.mode(
        stdin_tty,
        d.steps.is_some() || d.duration.is_some() || d.json,
    )?;
    let config = match &mode {
        Mode::ConfigFile(dir) => Some(ConfigFileTrigger::setup(dir, &target, &d.window.output)?),
        _ => None,
    };
    let initial = match &mode {
        Mode::Flags => Some(d.window.flags_request()?),
        _ => None,
    };
    let collect = d.window.collectors()?;
    let chown = d.window.chown_owner(target.host_pid)?;

    let t_resolve = Instant::now();
    let (resolved, frozen) = resolve_waiting(
        &target,
        &d.markers,
        &d.window.collector_opts.debug_dirs,
        wait,
        d.mode_name == "launch",
    )
    .map_err(|e| exited_during(&target, "resolving its step markers", e))?;
    let resolve_ms = t_resolve.elapsed().as_secs_f64() * 1e3;
    let t_load = Instant::now();
    let mut kernel = match kernel {
        Some(k) => k,
        None => d
            .ring
            .load(target.host_pid)
            .map_err(|e| exited_during(&target, "loading the eBPF programs", e))?,
    };
    let load_ms = t_load.elapsed().as_secs_f64() * 1e3;
    // Under the target's lock: undo what a killed dynprof left raised.
    kernel.repair_semaphores(&lock::lock_dir());

    let mut sched = (mode != Mode::None).then(|| {
        let mut s = Scheduler::new(SchedulerOptions {
            output: d.window.output.clone(),
            exit_when_done: mode == Mode::Flags,
            idle_timeout: match mode {
                Mode::Console { .. } => d.window.idle_timeout(),
                _ => None,
            },
            json: d.json,
            collect: collect.clone(),
            chown,
        });
        for c in std::mem::take(&mut d.collectors) {
            s.add_collector(c);
        }
        for h in std::mem::take(&mut d.hooks) {
            s.add_hook(h);
        }
        s
    });
    let failures = sched.as_ref().map(|s| s.failures());
    if let (Some(s), Some(c)) = (&mut sched, config) {
        s.set_config_trigger(c);
    }
    // Where windows are possible, aux markers are attached only around
    // them (each hit is a uprobe trap on every idle step); the scheduler
    // attaches them with the collectors, ahead of the window's first
    // boundary. Without windows they count on every step.
    let window_markers: Vec<ResolvedProbe> = match &mut sched {
        Some(s) => {
            let aux: Vec<_> = resolved
                .iter()
                .filter(|p| p.role == probes::Role::Aux)
                .cloned()
                .collect();
            s.set_window_markers(aux.clone());
            aux
        }
        None => Vec::new(),
    };
    // The plan goes in before the markers, so even step 1 is on time.
    if let Some(s) = &mut sched {
        s.begin(&mut kernel, &target, initial)
            .map_err(|e| exited_during(&target, "arming the collectors", e))?;
    }
    let t_attach = Instant::now();
    for p in probes::attach_order(&resolved)
        .filter(|p| !window_markers.iter().any(|w| w.index == p.index))
    {
        kernel
            .attach_marker(p)
            .map_err(|e| exited_during(&target, "attaching its step markers", e))?;
    }
    let attach_ms = t_attach.elapsed().as_secs_f64() * 1e3;
    drop(frozen);
    // Loaded and attached: keep only what the windows and the detach need
    // (and attaching the aux markers again around each window).
    let mut session_needs = needs(d.window, &mode)?;
    if !window_markers.is_empty() {
        session_needs.push(Need::AuxMarkers);
    }
    let kept = crate::sys::caps::drop_after_attach(&session_needs)?;
    log::info!(
        "capabilities kept after attach: {}",
        kept.iter()
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
    let semaphores = kernel.semaphore_report().clone();
    let kernel_paths = kernel.paths().clone();
    let mut session = Session::new(kernel, target, resolved);
    session.clock.aux_in_windows_only = !window_markers.is_empty();
    session.realtime_boundaries = d.window.realtime_boundaries && mode != Mode::None;
    if d.json {
        let mut line = attached_json(&session.target, &session.probes);
        line["usdt_semaphores"] = serde_json::to_value(&semaphores).unwrap_or_default();
        line["kernel"] = serde_json::to_value(&kernel_paths).unwrap_or_default();
        // Opt-in for `cargo xtask bench` (attach time, split by phase).
        if std::env::var_os("DYNPROF_ATTACH_TIMINGS").is_some_and(|v| v == "1") {
            line["timings_ms"] = serde_json::json!({"resolve_ms": resolve_ms, "load_ms": load_ms, "attach_ms": attach_ms});
        }
        println!("{line}");
    } else {
        for p in &session.probes {
            eprintln!(
                "dynprof: attached {} marker `{}` at {}+{:#x} ({})",
                p.role, p.label, p.object, p.file_offset, p.symbol
            );
        }
        for f in &kernel_paths.fallbacks {
            eprintln!("dynprof: kernel {}: {f}", kernel_paths.release);
        }
        if let Some(why) = &semaphores.fallback_reason {
            eprintln!("dynprof: USDT semaphore fallback: {why}");
        }
    }

    let (tx, rx) = mpsc::unbounded_channel::<SessionCommand>();
    match &mode {
        Mode::Console { plain } => console::spawn(tx.clone(), *plain)?,
        Mode::ConfigFile(_) => {
            if let Some(s) = &sched {
                s.spawn_config_watcher(tx.clone())?;
            }
            eprintln!(
                "dynprof: watching {}; edit it to start a window",
                d.window
                    .config_dir
                    .as_ref()
                    .map(|p| p
                        .join(crate::window::trigger::config_file::CONFIG_FILE)
                        .display()
                        .to_string())
                    .unwrap_or_default()
            );
        }
        _ => {}
    }
    let mut observers: Vec<Box<dyn Observer<SessionCommand>>> = Vec::new();
    // Live steps, except where they would drown the console or a
    // long-running config-file session (unless asked for with --json).
    if matches!(mode, Mode::None | Mode::Flags) || (d.json && !matches!(mode, Mode::Console { .. }))
    {
        observers.push(Box::new(StepPrinter::new(d.json)));
    }
    if let Some(s) = sched {
        observers.push(Box::new(s));
    }
    let limits = Limits {
        steps: d.steps,
        duration: d.duration,
    };
    let summary = session
        .run(&mut observers, limits, Some(rx))
        .await
        .context("event loop")?;
    drop(tx);
    print_summary(d.json, &session.target, &summary);
    drop(lock);
    // A window that was asked for and is not on disk is a failure.
    let failed = failures.map_or(0, |f| f.load(std::sync::atomic::Ordering::Relaxed));
    if failed > 0 {
        return Err(crate::window::writer::WindowsNotWritten(failed).into());
    }
    Ok(summary)
}
