//! `dynprof launch [options] -- CMD ARGS...`: start the program gated, then
//! run the session driver ([`super::driver`]) on it.
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
    time::Duration,
};

use anyhow::{Context as _, Result, anyhow, bail};
use clap::Args;

use super::{
    args::{Mode, WindowArgs},
    driver::{self, Drive, MarkerWait, drive, markers_or_auto},
};
use crate::{bpf::Kernel, probes::MarkerArg, sys::lock, target::Target, types::HostPid};

#[derive(Args, Debug, Clone)]
pub struct LaunchArgs {
    #[command(flatten)]
    pub window: WindowArgs,

    /// Step marker (repeatable); see `dynprof attach --help`. Default: auto.
    #[arg(long = "marker", short = 'm', value_name = "SPEC", value_parser = driver::marker_spec)]
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
    pub ring: driver::RingArgs,

    /// The program and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub cmd: Vec<String>,
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
    // Bad collector flags before the program is started.
    args.window.collector_opts.options()?;
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
        crate::window::trigger::config_file::check_dir(d)?;
    }
    driver::ring_bytes(args.ring.ring_buffer_kb)?;
    crate::sys::caps::check(&driver::needs(&args.window, &mode)?)?;
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
        collectors: driver::collectors(&args.window)?,
        hooks: args.window.build_hooks(&target)?,
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
