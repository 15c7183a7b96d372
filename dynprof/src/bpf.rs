//! Loading dynprof's eBPF object and talking to its maps.
//!
//! One `Kernel` per target: the object is loaded with the target's host tgid
//! baked in (`TARGET_TGID`), so every program drops foreign events first.
use std::{
    fs::OpenOptions,
    io::{Read, Seek, SeekFrom, Write},
    num::NonZeroU32,
    path::Path,
};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray, RingBuf, StackTraceMap},
    programs::{
        PerfEvent, TracePoint, UProbe,
        perf_event::{
            PerfEventConfig, PerfEventLinkId, PerfEventScope, SamplePolicy, SoftwareEvent,
        },
        trace_point::TracePointLinkId,
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId, UProbeScope},
    },
};
use dynprof_common::{KernelState, MAX_MARKERS, MarkerConfig, OffCpuStart, PlanConfig, drop_slot};

use crate::{output::model::Drops, probes::ResolvedProbe, types::HostPid};

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/dynprof"));

pub const MARKER_PROG: &str = "dynprof_marker";
pub const EMPTY_PROG: &str = "dynprof_empty";
pub const API_ENTER_PROG: &str = "dynprof_api_enter";
pub const API_EXIT_PROG: &str = "dynprof_api_exit";
pub const CPU_PROG: &str = "dynprof_cpu";
pub const SCHED_PROG: &str = "dynprof_sched_switch";

/// Checks the kernel and our privileges before touching bpf(2), so the
/// user gets one actionable line instead of an EPERM from deep inside aya.
pub fn preflight() -> Result<()> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let cap_eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    preflight_at(Path::new("/"), cap_eff)
}

/// [`preflight`] against a root directory holding `sys/` and a CapEff mask
/// (separate so the messages can be tested without such a kernel).
fn preflight_at(root: &Path, cap_eff: u64) -> Result<()> {
    if !root.join("sys/bus/event_source/devices/uprobe").exists() {
        bail!(
            "this kernel has no uprobe support (/sys/bus/event_source/devices/uprobe is missing) \
             (hint: dynprof needs a kernel built with CONFIG_UPROBE_EVENTS=y)"
        );
    }
    if !root.join("sys/kernel/btf/vmlinux").exists() {
        bail!(
            "this kernel exposes no BTF (/sys/kernel/btf/vmlinux is missing) \
             (hint: dynprof needs a kernel built with CONFIG_DEBUG_INFO_BTF=y)"
        );
    }
    let has = |bit: u32| cap_eff & (1u64 << bit) != 0;
    const CAP_SYS_ADMIN: u32 = 21;
    const CAP_PERFMON: u32 = 38;
    const CAP_BPF: u32 = 39;
    if !has(CAP_SYS_ADMIN) {
        let missing: Vec<&str> = [(CAP_BPF, "CAP_BPF"), (CAP_PERFMON, "CAP_PERFMON")]
            .iter()
            .filter(|(b, _)| !has(*b))
            .map(|(_, n)| *n)
            .collect();
        if !missing.is_empty() {
            bail!(
                "missing privileges: {} (hint: run with sudo, or grant CAP_BPF+CAP_PERFMON+CAP_SYS_PTRACE)",
                missing.join(" and ")
            );
        }
    }
    Ok(())
}

/// Per-marker hook state kept for detach: the link and a raised semaphore.
struct MarkerLink {
    link: UProbeLinkId,
    semaphore: Option<(HostPid, u64)>,
}

pub struct Kernel {
    ebpf: Ebpf,
    pid: HostPid,
    markers: Vec<MarkerLink>,
    api_links: Vec<(bool, UProbeLinkId)>,
    cpu_links: Vec<PerfEventLinkId>,
    sched_link: Option<TracePointLinkId>,
}

impl Kernel {
    /// Loads the object for one target. `ring_bytes` must be a power of two
    /// multiple of the page size; `wake_bytes` is how full the ring may get
    /// before a batched event wakes the reader (`u64::MAX`: only the step
    /// hits of `PlanConfig::wakes` do).
    pub fn load(pid: HostPid, ring_bytes: u32, wake_bytes: u64) -> Result<Self> {
        preflight()?;
        let tgid = pid.0;
        let ebpf = EbpfLoader::new()
            .override_global("TARGET_TGID", &tgid, true)
            .override_global("WAKE_BYTES", &wake_bytes, true)
            .map_max_entries("EVENTS", ring_bytes)
            .load(OBJECT)
            .map_err(|e| anyhow!("loading dynprof's eBPF programs: {e:#}"))?;
        let mut k = Self {
            ebpf,
            pid,
            markers: Vec::new(),
            api_links: Vec::new(),
            cpu_links: Vec::new(),
            sched_link: None,
        };
        for name in [MARKER_PROG, API_ENTER_PROG, API_EXIT_PROG] {
            k.uprobe(name)?
                .load()
                .with_context(|| format!("verifying eBPF program {name}"))?;
        }
        Ok(k)
    }

    fn uprobe(&mut self, name: &str) -> Result<&mut UProbe> {
        let prog = self
            .ebpf
            .program_mut(name)
            .ok_or_else(|| anyhow!("program {name} missing from the object"))?;
        Ok(prog.try_into()?)
    }

    /// Configures and attaches one marker; its index is the attach cookie.
    pub fn attach_marker(&mut self, p: &ResolvedProbe) -> Result<()> {
        if p.index >= MAX_MARKERS {
            bail!("too many markers (at most {MAX_MARKERS})");
        }
        let mut markers: Array<_, MarkerConfig> =
            Array::try_from(self.ebpf.map_mut("MARKERS").expect("MARKERS"))?;
        markers.set(p.index, p.config, 0)?;
        let pid = NonZeroU32::new(self.pid.0).expect("non-zero pid");
        let link = self
            .uprobe(MARKER_PROG)?
            .attach(
                UProbeAttachPoint {
                    location: UProbeAttachLocation::AbsoluteOffset(p.file_offset),
                    cookie: Some(p.index as u64),
                },
                &p.attach_path,
                UProbeScope::OneProcess(pid),
            )
            .with_context(|| {
                format!(
                    "attaching uprobe to {} in {} (offset {:#x})",
                    p.symbol, p.object, p.file_offset
                )
            })?;
        // The semaphore goes up after the probe exists, so the first enabled
        // probe site already fires into our program.
        let semaphore = match &p.semaphore {
            Some(s) => {
                adjust_semaphore(self.pid, s.runtime_addr, 1).with_context(|| {
                    format!(
                        "raising the USDT semaphore of {} in PID {}",
                        p.symbol, self.pid
                    )
                })?;
                Some((self.pid, s.runtime_addr))
            }
            None => None,
        };
        self.markers.push(MarkerLink { link, semaphore });
        Ok(())
    }

    /// Attaches entry and return probes of one runtime API (`api` = cookie).
    pub fn attach_api(&mut self, api: u32, path: &Path, file_offset: u64) -> Result<()> {
        let pid = NonZeroU32::new(self.pid.0).expect("non-zero pid");
        for (ret, name) in [(false, API_ENTER_PROG), (true, API_EXIT_PROG)] {
            let link = self.uprobe(name)?.attach(
                UProbeAttachPoint {
                    location: UProbeAttachLocation::AbsoluteOffset(file_offset),
                    cookie: Some(api as u64),
                },
                path,
                UProbeScope::OneProcess(pid),
            )?;
            self.api_links.push((ret, link));
        }
        Ok(())
    }

    pub fn detach_apis(&mut self) {
        for (ret, link) in std::mem::take(&mut self.api_links) {
            let name = if ret { API_EXIT_PROG } else { API_ENTER_PROG };
            if let Ok(p) = self.uprobe(name) {
                let _ = p.detach(link);
            }
        }
    }

    /// System-wide per-CPU sampling at `hz`; the program keeps the target's samples.
    pub fn attach_cpu_sampler(&mut self, hz: u64) -> Result<()> {
        let prog: &mut PerfEvent = self
            .ebpf
            .program_mut(CPU_PROG)
            .expect("cpu prog")
            .try_into()?;
        if prog.fd().is_err() {
            prog.load().context("verifying the CPU sampling program")?;
        }
        let cpus = aya::util::online_cpus()
            .map_err(|(_, e)| e)
            .context("reading online CPUs")?;
        for cpu in cpus {
            let link = prog
                .attach(
                    PerfEventConfig::Software(SoftwareEvent::CpuClock),
                    PerfEventScope::AllProcessesOneCpu { cpu },
                    SamplePolicy::Frequency(hz),
                    false,
                )
                .with_context(|| format!("opening a perf event on CPU {cpu}"))?;
            self.cpu_links.push(link);
        }
        Ok(())
    }

    pub fn detach_cpu_sampler(&mut self) {
        if let Some(Ok(prog)) = self
            .ebpf
            .program_mut(CPU_PROG)
            .map(<&mut PerfEvent>::try_from)
        {
            for l in std::mem::take(&mut self.cpu_links) {
                let _ = prog.detach(l);
            }
        }
    }

    pub fn attach_offcpu(&mut self) -> Result<()> {
        let prog: &mut TracePoint = self
            .ebpf
            .program_mut(SCHED_PROG)
            .expect("sched prog")
            .try_into()?;
        if prog.fd().is_err() {
            prog.load().context("verifying the off-CPU program")?;
        }
        self.sched_link = Some(
            prog.attach("sched", "sched_switch")
                .context("attaching to sched:sched_switch")?,
        );
        Ok(())
    }

    pub fn detach_offcpu(&mut self) {
        if let Some(l) = self.sched_link.take()
            && let Some(Ok(prog)) = self
                .ebpf
                .program_mut(SCHED_PROG)
                .map(<&mut TracePoint>::try_from)
        {
            let _ = prog.detach(l);
        }
    }

    /// Takes the event ring buffer; call once.
    pub fn take_events(&mut self) -> Result<RingBuf<MapData>> {
        let map = self
            .ebpf
            .take_map("EVENTS")
            .ok_or_else(|| anyhow!("EVENTS ring buffer already taken"))?;
        Ok(RingBuf::try_from(map)?)
    }

    /// Takes the stack-trace map (for symbolization off the event loop).
    pub fn take_stacks(&mut self) -> Result<StackTraceMap<MapData>> {
        let map = self
            .ebpf
            .take_map("STACKS")
            .ok_or_else(|| anyhow!("STACKS already taken"))?;
        Ok(StackTraceMap::try_from(map)?)
    }

    /// The instruction pointers of one `STACKS` entry, leaf first (what
    /// `Symbolizer::user_stack`/`kernel_stack` take). The map stays in the
    /// `Kernel`, so every collector can read it.
    pub fn stack(&self, id: u32) -> Result<Vec<u64>> {
        let map = self
            .ebpf
            .map("STACKS")
            .ok_or_else(|| anyhow!("STACKS was taken"))?;
        let st: StackTraceMap<&MapData> = StackTraceMap::try_from(map)?;
        Ok(st.get(&id, 0)?.frames().iter().map(|f| f.ip).collect())
    }

    /// Empties `STACKS`; returns how many entries were removed. Only safe
    /// when no event that refers to a stack id is still unread.
    pub fn clear_stacks(&mut self) -> Result<usize> {
        let map = self
            .ebpf
            .map_mut("STACKS")
            .ok_or_else(|| anyhow!("STACKS was taken"))?;
        let mut st: StackTraceMap<&mut MapData> = StackTraceMap::try_from(map)?;
        let ids: Vec<u32> = st.stack_ids().filter_map(|r| r.ok()).collect();
        let mut n = 0;
        for id in ids {
            if st.remove(&id).is_ok() {
                n += 1;
            }
        }
        Ok(n)
    }

    /// Target threads that are off-CPU right now, as the off-CPU program
    /// recorded them at switch-out (host tid, record).
    pub fn offcpu_pending(&self) -> Result<Vec<(u32, OffCpuStart)>> {
        let m: BpfHashMap<_, u32, OffCpuStart> =
            BpfHashMap::try_from(self.ebpf.map("OFFCPU_START").expect("OFFCPU_START"))?;
        Ok(m.iter().filter_map(|r| r.ok()).collect())
    }

    pub fn state(&self) -> Result<KernelState> {
        let a: Array<_, KernelState> = Array::try_from(self.ebpf.map("STATE").expect("STATE"))?;
        Ok(a.get(&0, 0)?)
    }

    pub fn set_plan(&mut self, plan: PlanConfig) -> Result<()> {
        let mut a: Array<_, PlanConfig> =
            Array::try_from(self.ebpf.map_mut("PLAN").expect("PLAN"))?;
        a.set(0, plan, 0)?;
        Ok(())
    }

    /// Filtered hits per marker index, summed over CPUs.
    pub fn hits(&self, index: u32) -> Result<u64> {
        let a: PerCpuArray<_, u64> = PerCpuArray::try_from(self.ebpf.map("HITS").expect("HITS"))?;
        Ok(a.get(&index, 0)?.iter().sum())
    }

    pub fn drops(&self) -> Result<Drops> {
        let a: PerCpuArray<_, u64> = PerCpuArray::try_from(self.ebpf.map("DROPS").expect("DROPS"))?;
        let get = |slot: u32| -> Result<u64> { Ok(a.get(&slot, 0)?.iter().sum()) };
        Ok(Drops {
            step: get(drop_slot::STEP)?,
            api: get(drop_slot::API)?,
            cpu: get(drop_slot::CPU)?,
            offcpu: get(drop_slot::OFFCPU)?,
            cpu_stack: get(drop_slot::CPU_STACK)?,
            offcpu_stack: get(drop_slot::OFFCPU_STACK)?,
            api_nesting: get(drop_slot::API_NESTING)?,
        })
    }

    /// Detaches every marker and lowers the semaphores we raised. Dropping
    /// the `Kernel` afterwards unloads all programs and maps.
    pub fn detach_all(&mut self) {
        self.detach_apis();
        self.detach_cpu_sampler();
        self.detach_offcpu();
        for m in std::mem::take(&mut self.markers) {
            if let Ok(p) = self.uprobe(MARKER_PROG) {
                let _ = p.detach(m.link);
            }
            if let Some((pid, addr)) = m.semaphore {
                // The target may have exited; nothing to restore then.
                let _ = adjust_semaphore(pid, addr, -1);
            }
        }
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        self.detach_all();
    }
}

/// Adds `delta` to a USDT semaphore (u16) in the target, as bcc does. The
/// kernel's ref_ctr_offset would do this too, but aya does not expose it.
pub fn adjust_semaphore(pid: HostPid, addr: u64, delta: i32) -> Result<()> {
    let path = format!("/proc/{pid}/mem");
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {path}"))?;
    let mut buf = [0u8; 2];
    f.seek(SeekFrom::Start(addr))?;
    f.read_exact(&mut buf)
        .with_context(|| format!("reading semaphore at {addr:#x}"))?;
    let v = (u16::from_le_bytes(buf) as i32 + delta).clamp(0, u16::MAX as i32) as u16;
    f.seek(SeekFrom::Start(addr))?;
    f.write_all(&v.to_le_bytes())
        .with_context(|| format!("writing semaphore at {addr:#x}"))?;
    Ok(())
}

#[cfg(test)]
mod preflight_tests {
    use super::*;

    fn root(tag: &str, uprobe: bool, btf: bool) -> std::path::PathBuf {
        let d =
            std::env::temp_dir().join(format!("dynprof-preflight-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        if uprobe {
            std::fs::create_dir_all(d.join("sys/bus/event_source/devices/uprobe")).unwrap();
        }
        if btf {
            std::fs::create_dir_all(d.join("sys/kernel/btf")).unwrap();
            std::fs::write(d.join("sys/kernel/btf/vmlinux"), b"").unwrap();
        }
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn err(root: &Path, caps: u64) -> String {
        let e = preflight_at(root, caps).unwrap_err().to_string();
        assert_eq!(e.lines().count(), 1, "{e}");
        assert!(e.contains("hint"), "{e}");
        e
    }

    #[test]
    fn each_missing_piece_gets_one_line_with_a_hint() {
        let all = u64::MAX;
        let e = err(&root("none", false, true), all);
        assert!(
            e.contains("no uprobe support") && e.contains("CONFIG_UPROBE_EVENTS"),
            "{e}"
        );
        let e = err(&root("nobtf", true, false), all);
        assert!(
            e.contains("no BTF") && e.contains("CONFIG_DEBUG_INFO_BTF"),
            "{e}"
        );
        let ok = root("ok", true, true);
        let e = err(&ok, 0);
        assert!(e.contains("CAP_BPF and CAP_PERFMON"), "{e}");
        let e = err(&ok, 1 << 39);
        assert!(e.contains("missing privileges: CAP_PERFMON ("), "{e}");
        assert!(
            preflight_at(&ok, 1 << 21).is_ok(),
            "CAP_SYS_ADMIN is enough"
        );
        assert!(
            preflight_at(&ok, (1 << 38) | (1 << 39)).is_ok(),
            "CAP_BPF+CAP_PERFMON is enough"
        );
        for t in ["none", "nobtf", "ok"] {
            let _ = std::fs::remove_dir_all(root(t, false, false));
        }
    }
}
