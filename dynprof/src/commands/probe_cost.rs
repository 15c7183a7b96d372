//! `dynprof __probe-cost` (hidden): a helper for `cargo xtask bench`.
//!
//! Attaches ONE program to one resolved marker of a target: either the real
//! step-marker program (`--prog marker`, with the marker's filter config,
//! through [`Kernel::attach_marker`]: with attach cookies where the kernel
//! has them, by probe address where it does not) or the empty uprobe
//! (`--prog empty`), the baseline the marker's per-hit cost is divided by;
//! or (`--prog floor`) the empty uprobe plus an empty return probe on the
//! same function, the floor under the api collector's cost. It drains the
//! ring buffer (counting, not printing) until its stdin closes, then prints
//! one JSON line with hits, events and drops. The bench times a loop in the
//! target bare / with each program attached.
//!
//! `--hitloop PATH` runs that whole measurement here instead, for the VMs
//! of `cargo xtask vm-test --probe-cost`, where no bench harness runs: it
//! starts bench/hitloop and, per repetition and site, times `go SITE N`
//! bare, with the empty uprobe and with the marker program, printing one
//! JSON `sample` line each.
use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    os::fd::AsRawFd,
    path::PathBuf,
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::Instant,
};

use anyhow::{Context as _, Result, anyhow, bail};
use clap::Args;
use serde_json::{Value, json};

use crate::{
    bpf::Kernel,
    probes::{self, MarkerArg},
    session::{Decoded, events::decode},
    target::Target,
    types::HostPid,
};

#[derive(Args, Debug, Clone)]
pub struct ProbeCostArgs {
    #[arg(long, value_parser = crate::cli::int(1, crate::cli::PID_MAX),
          required_unless_present = "hitloop")]
    pub pid: Option<u32>,
    /// One marker SPEC (same grammar as `attach --marker`).
    #[arg(long, value_parser = super::driver::marker_spec, required_unless_present = "hitloop")]
    pub marker: Option<MarkerArg>,
    /// `marker` (the step-marker program), `empty` (the empty uprobe) or
    /// `floor` (empty uprobe + empty return probe).
    #[arg(long, default_value = "marker")]
    pub prog: String,
    #[arg(long, default_value_t = 4096, value_parser = crate::cli::ring_kb)]
    pub ring_buffer_kb: u32,
    /// 0: block in poll(2) on the ring buffer, as `attach` does (epoll);
    /// N: never block on it, drain every N ms instead. With a consumer that
    /// lags, the kernel's adaptive wakeup (irq_work) fires once per drain
    /// instead of once per event.
    #[arg(long, default_value_t = 0, value_parser = crate::cli::int(0u64, 60_000))]
    pub drain_every_ms: u64,
    /// Run the whole measurement on this hitloop binary (bench/hitloop.c).
    #[arg(long, conflicts_with_all = ["pid", "marker"])]
    pub hitloop: Option<PathBuf>,
    /// With --hitloop: the sites, comma-separated.
    #[arg(long, default_value = "push,nop5,riprel,endbr")]
    pub sites: String,
    /// With --hitloop: calls per timed loop.
    #[arg(long, default_value_t = 20_000)]
    pub n: u64,
    /// With --hitloop: repetitions (the order of the conditions rotates).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
}

/// One program attached, its ring drained by a thread until [`finish`].
///
/// [`finish`]: Attached::finish
struct Attached {
    kernel: Kernel,
    index: u32,
    stop: Arc<AtomicBool>,
    drain: JoinHandle<Result<u64>>,
    info: Value,
}

fn attach(pid: HostPid, marker: &MarkerArg, a: &ProbeCostArgs) -> Result<Attached> {
    let t0 = Instant::now();
    let target = Target::open(pid)?;
    let resolved = probes::resolve_markers(&target, std::slice::from_ref(marker), &[])?;
    let p = resolved
        .first()
        .ok_or_else(|| anyhow!("marker did not resolve"))?;
    let t_resolved = t0.elapsed();
    let ring_bytes = super::driver::ring_bytes(a.ring_buffer_kb)?;
    // The wakeup threshold `attach` uses by default.
    let mut kernel = Kernel::load(pid, ring_bytes, u64::from(ring_bytes / 4))?;
    let t_loaded = t0.elapsed();
    match a.prog.as_str() {
        "marker" => kernel.attach_marker(p)?,
        "empty" => kernel.attach_empty(p, false)?,
        "floor" => kernel.attach_empty(p, true)?,
        other => bail!("--prog must be marker, empty or floor, not {other}"),
    }
    let t_attached = t0.elapsed();
    let prog_name = match a.prog.as_str() {
        "marker" => match kernel.paths().probe_identity {
            crate::compat::ProbeIdentity::Cookie => crate::bpf::MARKER_PROG,
            crate::compat::ProbeIdentity::Address => crate::bpf::MARKER_IP_PROG,
        },
        _ => crate::bpf::EMPTY_PROG,
    };
    let info = json!({
        "event": "attached", "prog": prog_name, "symbol": p.symbol, "file_offset": p.file_offset,
        "first_insn": p.first_insn,
        "kernel": kernel.paths(),
        "resolve_ms": t_resolved.as_secs_f64() * 1e3,
        "load_ms": (t_loaded - t_resolved).as_secs_f64() * 1e3,
        "attach_ms": (t_attached - t_loaded).as_secs_f64() * 1e3,
    });
    let mut ring = kernel.take_events()?;
    let mut log = kernel.take_step_log()?;
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let every = a.drain_every_ms;
    let drain = std::thread::spawn(move || -> Result<u64> {
        let mut events = 0u64;
        let mut logged = Vec::new();
        loop {
            // As the session reads them: ring events and logged steps, the
            // latter counted as the events they replace.
            while let Some(item) = ring.next() {
                if let Some(Decoded::Step(s)) = decode(&item)
                    && s.role == dynprof_common::role::STEP
                {
                    log.ring_step(s.step, &mut logged);
                }
                events += 1;
            }
            log.read(None, &mut logged);
            events += logged.len() as u64;
            logged.clear();
            if stop2.load(Ordering::Relaxed) {
                return Ok(events);
            }
            if every > 0 {
                std::thread::sleep(std::time::Duration::from_millis(every));
                continue;
            }
            let mut fd = libc::pollfd {
                fd: ring.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            // 1 ms: hitloop hits ~2M times a second, and the step log holds
            // `steplog::MAX_UNREAD` (8,192) unread steps before the kernel
            // falls back to the ring buffer; a job's steps come at most tens
            // of thousands a second, which the session's 100 ms tick reads.
            if unsafe { libc::poll(&mut fd, 1, 1) } < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e).context("poll");
                }
            }
        }
    });
    Ok(Attached {
        kernel,
        index: p.index,
        stop,
        drain,
        info,
    })
}

impl Attached {
    /// Detaches; returns the summary (hits counted by the marker program,
    /// events, drops).
    fn finish(mut self) -> Result<Value> {
        self.kernel.detach_all();
        self.stop.store(true, Ordering::Relaxed);
        let events = self
            .drain
            .join()
            .map_err(|_| anyhow!("the drain thread panicked"))??;
        let hits = self.kernel.hits(self.index)?;
        let drops = self.kernel.drops()?.step;
        Ok(
            json!({"event": "summary", "prog": self.info["prog"], "hits": hits, "events": events, "drops": drops}),
        )
    }
}

pub fn run(a: &ProbeCostArgs) -> Result<()> {
    if let Some(h) = &a.hitloop {
        return run_hitloop(a, h);
    }
    let (Some(pid), Some(marker)) = (a.pid, &a.marker) else {
        bail!("--pid and --marker are required without --hitloop");
    };
    let att = attach(HostPid(pid), marker, a)?;
    println!("{}", att.info);
    // Until stdin closes.
    let mut buf = [0u8; 64];
    let stdin = std::io::stdin();
    loop {
        match stdin.lock().read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    println!("{}", att.finish()?);
    Ok(())
}

/// The conditions of one site, in the order of the first repetition.
const CONDS: [&str; 3] = ["bare", "empty", "marker"];

fn run_hitloop(a: &ProbeCostArgs, path: &std::path::Path) -> Result<()> {
    let mut child = Command::new(path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", path.display()))?;
    let mut stdin = child.stdin.take().expect("piped");
    let mut out = BufReader::new(child.stdout.take().expect("piped"));
    let mut line = String::new();
    let mut read_line = |want: &str| -> Result<String> {
        line.clear();
        out.read_line(&mut line)?;
        if !line.starts_with(want) {
            bail!("hitloop said {line:?}, expected `{want} …`");
        }
        Ok(line.trim().to_string())
    };
    read_line("ready")?;
    let pid = HostPid(child.id());
    let sites: Vec<&str> = a.sites.split(',').map(str::trim).collect();
    let mut go = |site: &str, read: &mut dyn FnMut(&str) -> Result<String>| -> Result<Vec<u64>> {
        writeln!(stdin, "go {site} {}", a.n)?;
        let done = read("done")?;
        Ok(done
            .split_whitespace()
            .skip(1)
            .filter_map(|v| v.parse().ok())
            .collect())
    };
    // Warm the loops (page faults, frequency).
    for s in &sites {
        go(s, &mut read_line)?;
    }
    for rep in 0..a.reps {
        for (si, site) in sites.iter().enumerate() {
            for k in 0..CONDS.len() {
                let cond = CONDS[(k + rep + si) % CONDS.len()];
                let att = match cond {
                    "bare" => None,
                    prog => {
                        let mut args = a.clone();
                        args.prog = prog.to_string();
                        let spec = probes::spec::parse(&format!("exe:bench_{site}"))?;
                        Some(attach(pid, &spec, &args)?)
                    }
                };
                let first_insn = att.as_ref().map(|x| x.info["first_insn"].clone());
                let kernel = att.as_ref().map(|x| x.info["kernel"].clone());
                let t = go(site, &mut read_line)?;
                let sum = att.map(Attached::finish).transpose()?;
                println!(
                    "{}",
                    json!({
                        "event": "sample", "rep": rep, "site": site, "cond": cond, "n": t.first(),
                        "wall_ns": t.get(1), "thread_ns": t.get(2),
                        "hits": sum.as_ref().map(|s| s["hits"].clone()),
                        "drops": sum.as_ref().map(|s| s["drops"].clone()),
                        "first_insn": first_insn, "kernel": kernel,
                        "arch": std::env::consts::ARCH,
                    })
                );
            }
        }
    }
    drop(stdin);
    let _ = child.wait();
    Ok(())
}
