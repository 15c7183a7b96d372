//! `dynprof launch [options] -- CMD ARGS...`, and the session driver that
//! `attach` and `launch` share: lock the target, pick the trigger, resolve
//! (or wait for) the markers, program the plan, attach, run, report.
//!
//! Launch starts the program gated: the child reports its PID and waits on
//! a pipe before `exec`, so the eBPF object (which needs the PID) is loaded
//! before the program runs a single instruction. Markers whose library is
//! not mapped yet (PyTorch loads `libtorch_cpu` well after start; a plugin
//! may be `dlopen`ed late) are attached as soon as the library appears: the
//! driver re-resolves each time `/proc/PID/maps` changes.
use std::{
    io::{IsTerminal as _, Read as _},
    os::{fd::AsRawFd as _, unix::process::CommandExt as _},
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};
use clap::Args;
use tokio::sync::mpsc;

use super::{
    attach::{self, attached_json, markers_or_auto, print_summary},
    printer::StepPrinter,
};
use crate::{
    bpf::Kernel,
    collect::{Collector, WindowHook},
    probes::{self, MarkerArg, ResolvedProbe},
    session::{Command, Limits, Observer, Session, SessionSummary},
    target::{Target, exited_during},
    trigger::{config_file::ConfigFileTrigger, console},
    types::HostPid,
    window::{
        Scheduler, SchedulerOptions,
        args::{Mode, WindowArgs},
        lock,
    },
};

#[derive(Args, Debug, Clone)]
pub struct LaunchArgs {
    #[command(flatten)]
    pub window: WindowArgs,

    /// Step marker (repeatable); see `dynprof attach --help`. Default: auto.
    #[arg(long = "marker", short = 'm', value_name = "SPEC", value_parser = attach::marker_spec)]
    pub markers: Vec<MarkerArg>,

    /// Print JSON lines on stdout (attached, step..., window..., summary).
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
    pub ring: attach::RingArgs,

    /// The program and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub cmd: Vec<String>,
}

/// Everything the driver needs besides the target.
pub struct Drive<'a> {
    pub window: &'a WindowArgs,
    pub markers: Vec<MarkerArg>,
    pub json: bool,
    pub steps: Option<u64>,
    pub duration: Option<Duration>,
    pub ring: attach::RingArgs,
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
    wait: MarkerWait,
    freeze_target: bool,
) -> Result<(Vec<ResolvedProbe>, Option<Frozen>)> {
    let started = Instant::now();
    let mut said = false;
    // None until the first read: even an empty first map is resolved (and
    // refused) once rather than polled forever as "unchanged".
    let mut last_maps: Option<String> = None;
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
            match probes::resolve_markers(target, markers) {
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
            return Ok((probes::resolve_markers(target, markers)?, None));
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
    let (resolved, frozen) = resolve_waiting(&target, &d.markers, wait, d.mode_name == "launch")
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
    // The plan goes in before the markers, so even step 1 is on time.
    if let Some(s) = &mut sched {
        s.begin(&mut kernel, &target, initial)
            .map_err(|e| exited_during(&target, "arming the collectors", e))?;
    }
    let t_attach = Instant::now();
    for p in probes::attach_order(&resolved) {
        kernel
            .attach_marker(p)
            .map_err(|e| exited_during(&target, "attaching its step markers", e))?;
    }
    let attach_ms = t_attach.elapsed().as_secs_f64() * 1e3;
    drop(frozen);
    // Loaded and attached: keep only what the windows and the detach need.
    let kept = crate::sys::caps::drop_after_attach(&attach::needs(d.window, &mode)?)?;
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

    let (tx, rx) = mpsc::unbounded_channel::<Command>();
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
                        .join(crate::trigger::config_file::CONFIG_FILE)
                        .display()
                        .to_string())
                    .unwrap_or_default()
            );
        }
        _ => {}
    }
    let mut observers: Vec<Box<dyn Observer>> = Vec::new();
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

/// Spawns `cmd` gated before exec: returns its PID while it waits, and a
/// function that lets it exec and returns the `Child`.
fn spawn_gated(
    cmd: &[String],
    stdin_null: bool,
) -> Result<(HostPid, impl FnOnce() -> Result<Child>)> {
    let (mut pid_r, pid_w) = std::io::pipe().context("pipe")?;
    let (gate_r, mut gate_w) = std::io::pipe().context("pipe")?;
    let mut c = std::process::Command::new(&cmd[0]);
    c.args(&cmd[1..]);
    if stdin_null {
        c.stdin(Stdio::null());
    }
    let (pw, gr, gw) = (pid_w.as_raw_fd(), gate_r.as_raw_fd(), gate_w.as_raw_fd());
    // SAFETY: only async-signal-safe calls (getpid, write, read, close) run
    // between fork and exec.
    unsafe {
        c.pre_exec(move || {
            libc::close(gw); // so that our death reads as EOF
            let b = libc::getpid().to_ne_bytes();
            libc::write(pw, b.as_ptr().cast(), b.len());
            libc::close(pw);
            let mut x = [0u8; 1];
            libc::read(gr, x.as_mut_ptr().cast(), 1);
            libc::close(gr);
            Ok(())
        });
    }
    // `spawn` returns only after exec, so it runs on its own thread while
    // this one loads the eBPF object for the gated PID. The thread keeps our
    // ends of the child's pipes until then: if fork fails, dropping them
    // turns the PID read below into an EOF instead of a hang.
    let handle = std::thread::spawn(move || {
        let r = c.spawn();
        drop((pid_w, gate_r));
        r
    });
    let mut b = [0u8; 4];
    if pid_r.read_exact(&mut b).is_err() {
        let e = handle
            .join()
            .map_err(|_| anyhow!("spawn thread panicked"))?
            .err();
        bail!(
            "starting {}: {}",
            cmd[0],
            e.map(|e| e.to_string())
                .unwrap_or_else(|| "no PID reported".into())
        );
    }
    let pid = HostPid(i32::from_ne_bytes(b) as u32);
    let name = cmd[0].clone();
    let release = move || -> Result<Child> {
        use std::io::Write as _;
        let _ = gate_w.write_all(&[1]);
        drop(gate_w);
        let child = handle
            .join()
            .map_err(|_| anyhow!("spawn thread panicked"))?;
        child.with_context(|| format!("starting {name}"))
    };
    Ok((pid, release))
}

pub async fn run(args: LaunchArgs) -> Result<()> {
    let markers = markers_or_auto(&args.markers);
    let stdin_tty = std::io::stdin().is_terminal();
    let mode = args.window.mode(
        stdin_tty,
        args.steps.is_some() || args.duration.is_some() || args.json,
    )?;
    // Validate what can fail before the program starts.
    if let Mode::Flags = mode {
        args.window.flags_request()?;
    }
    if let Mode::ConfigFile(d) = &mode {
        crate::trigger::config_file::check_dir(d)?;
    }
    attach::ring_bytes(args.ring.ring_buffer_kb)?;
    crate::sys::caps::check(&attach::needs(&args.window, &mode)?)?;
    let stdin_null = matches!(mode, Mode::Console { .. });
    let (pid, release) = spawn_gated(&args.cmd, stdin_null)?;
    let prep = (|| -> Result<(lock::TargetLock, Kernel)> {
        let l = lock::acquire(pid, "launch")?;
        let k = args.ring.load(pid)?;
        Ok((l, k))
    })();
    let mut child = release()?;
    let (lk, kernel) = match prep {
        Ok(v) => v,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
    };
    eprintln!("dynprof: launched {} as PID {pid}", args.cmd.join(" "));
    let target = Target::open(pid)?;
    let d = Drive {
        window: &args.window,
        markers,
        json: args.json,
        steps: args.steps,
        duration: args.duration,
        ring: args.ring,
        mode_name: "launch",
        collectors: attach::collectors(&args.window)?,
        hooks: crate::collect::vendor_args::build_hooks_for(&args.window, &target)?,
    };
    let r = drive(d, target, Some(kernel), lk, MarkerWait::WhileAlive).await;
    if let Err(e) = &r {
        eprintln!("dynprof: error: {e:#}");
    }
    // dynprof has detached; the program runs on. Wait for it, like `time`.
    if matches!(child.try_wait(), Ok(None)) {
        eprintln!("dynprof: detached; waiting for PID {pid} to exit");
    }
    let status = child.wait().context("waiting for the launched program")?;
    r?;
    if !status.success() {
        eprintln!("dynprof: PID {pid} exited with {status}");
        std::process::exit(status.code().unwrap_or(1));
    }
    Ok(())
}
