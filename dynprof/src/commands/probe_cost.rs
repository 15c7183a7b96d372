//! `dynprof __probe-cost` (hidden): a helper for `cargo xtask bench`.
//!
//! Attaches ONE program to one resolved marker of a target: either the real
//! step-marker program (`--prog marker`, with the marker's filter config) or
//! the empty uprobe (`--prog empty`), the baseline the marker's per-hit cost
//! is divided by; or (`--prog floor`) the empty uprobe plus an empty return
//! probe on the same function, the floor under the api collector's cost. It drains the ring buffer (counting, not printing) until
//! its stdin closes, then prints one JSON line with hits, events and drops.
//! The bench times a loop in the target bare / with each program attached.
use std::{io::Read as _, num::NonZeroU32, os::fd::AsRawFd, time::Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::{
    EbpfLoader,
    maps::{Array, PerCpuArray, RingBuf},
    programs::{
        UProbe,
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope},
    },
};
use clap::Args;
use dynprof_common::{MarkerConfig, drop_slot};
use serde_json::json;

use crate::{
    bpf::{EMPTY_PROG, EMPTY_RET_PROG, MARKER_PROG, preflight},
    probes::{self},
    target::Target,
    types::HostPid,
};

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/dynprof"));

#[derive(Args, Debug, Clone)]
pub struct ProbeCostArgs {
    #[arg(long, value_parser = crate::cli::int(1, crate::cli::PID_MAX))]
    pub pid: u32,
    /// One marker SPEC (same grammar as `attach --marker`).
    #[arg(long, value_parser = super::driver::marker_spec)]
    pub marker: probes::MarkerArg,
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
}

pub fn run(a: &ProbeCostArgs) -> Result<()> {
    preflight()?;
    let t0 = Instant::now();
    let target = Target::open(HostPid(a.pid))?;
    let resolved = probes::resolve_markers(&target, std::slice::from_ref(&a.marker))?;
    let p = resolved
        .first()
        .ok_or_else(|| anyhow!("marker did not resolve"))?;
    let t_resolved = t0.elapsed();
    let prog_name = match a.prog.as_str() {
        "marker" => MARKER_PROG,
        "empty" | "floor" => EMPTY_PROG,
        other => bail!("--prog must be marker, empty or floor, not {other}"),
    };
    let tgid = a.pid;
    let mut ebpf = EbpfLoader::new()
        .override_global("TARGET_TGID", &tgid, true)
        .map_max_entries("EVENTS", a.ring_buffer_kb * 1024)
        .load(OBJECT)
        .map_err(|e| anyhow!("loading the eBPF object: {e:#}"))?;
    {
        let mut markers: Array<_, MarkerConfig> =
            Array::try_from(ebpf.map_mut("MARKERS").expect("MARKERS"))?;
        markers.set(0, p.config, 0)?;
    }
    let prog: &mut UProbe = ebpf
        .program_mut(prog_name)
        .ok_or_else(|| anyhow!("{prog_name} missing"))?
        .try_into()?;
    prog.load()
        .with_context(|| format!("verifying {prog_name}"))?;
    let t_loaded = t0.elapsed();
    let pid = NonZeroU32::new(a.pid).expect("non-zero pid");
    let _link = prog.attach(
        UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(p.file_offset),
            cookie: Some(0),
        },
        &p.attach_path,
        UProbeScope::OneProcess(pid),
    )?;
    let _ret_link = if a.prog == "floor" {
        let ret: &mut UProbe = ebpf
            .program_mut(EMPTY_RET_PROG)
            .ok_or_else(|| anyhow!("{EMPTY_RET_PROG} missing"))?
            .try_into()?;
        ret.load()
            .with_context(|| format!("verifying {EMPTY_RET_PROG}"))?;
        Some(ret.attach(
            UProbeAttachPoint {
                location: UProbeAttachLocation::AbsoluteOffset(p.file_offset),
                cookie: None,
            },
            &p.attach_path,
            UProbeScope::OneProcess(pid),
        )?)
    } else {
        None
    };
    let t_attached = t0.elapsed();
    println!(
        "{}",
        json!({
            "event": "attached", "prog": prog_name, "symbol": p.symbol, "file_offset": p.file_offset,
            "first_insn": p.first_insn,
            "resolve_ms": t_resolved.as_secs_f64() * 1e3,
            "load_ms": (t_loaded - t_resolved).as_secs_f64() * 1e3,
            "attach_ms": (t_attached - t_loaded).as_secs_f64() * 1e3,
        })
    );
    let mut ring = RingBuf::try_from(ebpf.take_map("EVENTS").expect("EVENTS"))?;
    let mut events: u64 = 0;
    let stdin = std::io::stdin();
    let mut fds = [
        libc::pollfd {
            fd: ring.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: stdin.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    'outer: loop {
        while let Some(item) = ring.next() {
            let _ = item.len();
            events += 1;
        }
        fds[0].revents = 0;
        fds[1].revents = 0;
        let (nfds, timeout) = if a.drain_every_ms > 0 {
            (1, a.drain_every_ms as i32)
        } else {
            (2, 100)
        };
        // With drain_every_ms, poll only stdin (fds[1]) as the sleep.
        let rc = if a.drain_every_ms > 0 {
            unsafe { libc::poll(fds.as_mut_ptr().add(1), nfds, timeout) }
        } else {
            unsafe { libc::poll(fds.as_mut_ptr(), nfds, timeout) }
        };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e).context("poll");
        }
        if fds[1].revents != 0 {
            let mut buf = [0u8; 64];
            match stdin.lock().read(&mut buf) {
                Ok(0) | Err(_) => break 'outer,
                Ok(_) => {}
            }
        }
    }
    while let Some(_item) = ring.next() {
        events += 1;
    }
    let hits: u64 = {
        let a: PerCpuArray<_, u64> = PerCpuArray::try_from(ebpf.map("HITS").expect("HITS"))?;
        a.get(&0, 0)?.iter().sum()
    };
    let drops: u64 = {
        let a: PerCpuArray<_, u64> = PerCpuArray::try_from(ebpf.map("DROPS").expect("DROPS"))?;
        a.get(&drop_slot::STEP, 0)?.iter().sum()
    };
    println!(
        "{}",
        json!({"event": "summary", "prog": prog_name, "hits": hits, "events": events, "drops": drops})
    );
    Ok(())
}
