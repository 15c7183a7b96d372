//! Loading dynprof's eBPF object and talking to its maps.
//!
//! One `Kernel` per target: the object is loaded with the target's host tgid
//! baked in (`TARGET_TGID`), so every program drops foreign events first.
use std::path::Path;

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
        uprobe::UProbeLinkId,
    },
};
use dynprof_common::{
    KernelState, MAX_PROBE_ADDRS, OffCpuStart, PlanConfig, THREAD_MAPS, THREAD_MAPS_MAX,
    THREAD_MAPS_MIN, drop_slot, unwind::user_regs,
};

use crate::{
    compat::{self, KernelModeStacks, KernelPaths, ProbeIdentity, TaskStackRegs},
    output::model::Drops,
    probes::semaphore::{self, Ledger, Repaired, SemaphoreOwner},
    sys::uprobe::{self as sys_uprobe, PerfAttachment},
    types::HostPid,
};

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/dynprof"));

pub const MARKER_PROG: &str = "dynprof_marker";
/// The marker program for kernels without attach cookies (< 5.15).
pub const MARKER_IP_PROG: &str = "dynprof_marker_ip";
pub const API_ENTER_IP_PROG: &str = "dynprof_api_enter_ip";
pub const API_EXIT_STACK_PROG: &str = "dynprof_api_exit_stack";
pub const EMPTY_PROG: &str = "dynprof_empty";
/// An empty uretprobe; with [`EMPTY_PROG`], the bench's floor for an API call.
pub const EMPTY_RET_PROG: &str = "dynprof_empty_ret";
pub const API_ENTER_PROG: &str = "dynprof_api_enter";
pub const API_EXIT_PROG: &str = "dynprof_api_exit";
pub const CPU_PROG: &str = "dynprof_cpu";
pub const SCHED_PROG: &str = "dynprof_sched_switch";
/// Set to `proc_mem` to hold USDT semaphores through /proc/PID/mem.
pub const SEMAPHORE_ENV: &str = "DYNPROF_USDT_SEMAPHORE";

mod api;
mod markers;
mod preflight;
mod steplog;
mod task_regs;

pub use preflight::preflight;
pub use steplog::{LoggedStep, StepLog};

/// Per-marker hook state kept for detach: the perf event with the program
/// on it (closing it removes the uprobe and, with `ref_ctr_offset`, lowers
/// the semaphore), and a semaphore dynprof raised itself (fallback).
struct MarkerLink {
    index: u32,
    _attachment: PerfAttachment,
    proc_mem_semaphore: Option<u64>,
    /// Addresses registered in `MARKER_BY_IP` for it (no-cookie path).
    addrs: Vec<u64>,
}

/// How the markers' USDT semaphores are held, for the `attached` event and
/// meta.json.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SemaphoreReport {
    /// Whether this kernel's uprobes take `ref_ctr_offset` (4.20+).
    pub kernel_owned_supported: bool,
    /// Per marker index with a semaphore: its runtime address and owner.
    pub markers: Vec<MarkerSemaphore>,
    /// Why a semaphore fell back to /proc/PID/mem, if one did.
    pub fallback_reason: Option<String>,
    /// What an earlier, killed dynprof left raised and this one lowered.
    pub repaired: Vec<Repaired>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct MarkerSemaphore {
    pub index: u32,
    pub addr: u64,
    pub owner: SemaphoreOwner,
}

pub struct Kernel {
    ebpf: Ebpf,
    pid: HostPid,
    markers: Vec<MarkerLink>,
    /// Kept only once a semaphore is raised through /proc/PID/mem.
    ledger: Option<Ledger>,
    semaphores: SemaphoreReport,
    /// `DYNPROF_USDT_SEMAPHORE=proc_mem`: use the fallback even where the
    /// kernel could own the semaphore (tests; a site another tool already
    /// probes without the offset).
    forced_proc_mem: bool,
    /// The kernel's features and the paths chosen for them.
    paths: KernelPaths,
    api_links: Vec<(bool, UProbeLinkId)>,
    /// API probes of the no-cookie path, opened by `sys::uprobe`.
    api_attachments: Vec<PerfAttachment>,
    /// Addresses registered in `MARKER_BY_IP` / `API_BY_IP`.
    marker_addrs: usize,
    api_addrs: Vec<u64>,
    /// `API_SLOTS`' size, and the slots given to threads for this window.
    api_slot_count: u32,
    api_slots: Vec<u32>,
    cpu_links: Vec<PerfEventLinkId>,
    sched_link: Option<TracePointLinkId>,
    /// What `PLAN[0]` holds (only `set_plan` writes it): the event loop
    /// predicts its next wakeup from it.
    plan: PlanConfig,
}

/// Entries of the maps keyed by the target's threads, for a target with
/// `threads` threads at attach: 4 per thread (an API call in flight per
/// thread, nested a few deep; one off-CPU interval per thread), so that
/// threads started later fit too. A full map loses the call or interval
/// and counts it in the collector's drops.
fn thread_map_entries(threads: Option<u64>) -> u32 {
    let want = threads.unwrap_or(0).saturating_mul(4);
    let want = u32::try_from(want).unwrap_or(u32::MAX);
    want.checked_next_power_of_two()
        .unwrap_or(THREAD_MAPS_MAX)
        .clamp(THREAD_MAPS_MIN, THREAD_MAPS_MAX)
}

/// The target's thread count (`/proc/PID/stat`), if it can be read.
fn thread_count(pid: HostPid) -> Option<u64> {
    let p = procfs::process::Process::new(i32::try_from(pid.0).ok()?).ok()?;
    u64::try_from(p.stat().ok()?.num_threads).ok()
}

/// Everything one target's object is loaded with, decided before the
/// loader exists: the kernel's paths, the target's CPython layout, the ring
/// and map sizes. A [`Loader`] borrows it while it loads.
pub struct LoadPlan {
    pid: HostPid,
    tgid: u32,
    ring_bytes: u32,
    wake_bytes: u64,
    stack_copy: u32,
    /// `user_regs::*`, and with `TASK_STACK`, where (see `bpf/task_regs.rs`).
    user_regs_from_task: u32,
    task_stack_offset: u32,
    task_regs_delta: u32,
    python: dynprof_common::unwind::PyOffsets,
    thread_maps: u32,
    api_slots: u32,
    /// `api_slots - 1`, the programs' `API_SLOT_MASK`.
    api_slot_mask: u32,
    paths: KernelPaths,
}

impl LoadPlan {
    /// The plan for `pid`. `ring_bytes` must be a power of two multiple of
    /// the page size; `wake_bytes` is how full the ring may get before a
    /// batched event wakes the reader (`u64::MAX`: only the step hits of
    /// `PlanConfig::wakes` do).
    pub fn new(pid: HostPid, ring_bytes: u32, wake_bytes: u64) -> Result<Self> {
        preflight()?;
        let mut features = crate::sys::kernel::probe();
        let forced = match std::env::var(compat::FEATURES_ENV) {
            Ok(v) => compat::apply_override(&mut features, &v)?,
            Err(_) => None,
        };
        if !features.task_pt_regs && features.task_stack_regs == TaskStackRegs::NotMeasured {
            features.task_stack_regs = task_regs::task_stack_regs();
        }
        let mut paths = compat::choose(&features)?;
        paths.fallbacks.extend(forced);
        for f in &paths.fallbacks {
            log::info!("kernel {}: {f}", paths.release);
        }
        let stack_copy = crate::symbols::unwind::stack_copy_bytes(ring_bytes);
        if stack_copy == 0 {
            // No copy to unwind (turned off, or a ring too small for it):
            // frame pointers in kernel mode too, whatever the kernel offers.
            paths.kernel_mode_stacks = KernelModeStacks::FramePointers;
        }
        let user_regs_from_task = match paths.kernel_mode_stacks {
            KernelModeStacks::Unwound => user_regs::TASK_PT_REGS,
            KernelModeStacks::UnwoundFromTaskStack => user_regs::TASK_STACK,
            KernelModeStacks::FramePointers => user_regs::NONE,
        };
        let (task_stack_offset, task_regs_delta) = match features.task_stack_regs {
            TaskStackRegs::Found {
                stack_offset,
                regs_delta,
            } => (stack_offset, regs_delta),
            _ => (0, 0),
        };
        let (want_py, bad) = crate::symbols::python::frames_wanted(
            std::env::var(crate::symbols::python::FRAMES_ENV)
                .ok()
                .as_deref(),
        );
        if let Some(b) = bad {
            log::warn!("{b}");
        }
        let python = if want_py {
            crate::symbols::python::detect(pid.0)
                .map(|i| i.offsets)
                .unwrap_or_default()
        } else {
            log::info!(
                "Python frames turned off ({}); samples keep native stacks",
                crate::symbols::python::FRAMES_ENV
            );
            Default::default()
        };
        let threads = thread_count(pid);
        let api_slots = api::api_slot_entries(threads);
        Ok(Self {
            pid,
            tgid: pid.0,
            ring_bytes,
            wake_bytes,
            stack_copy,
            user_regs_from_task,
            task_stack_offset,
            task_regs_delta,
            python,
            thread_maps: thread_map_entries(threads),
            api_slots,
            api_slot_mask: api_slots - 1,
            paths,
        })
    }
}

/// Loads dynprof's object for one target after another. aya parses the
/// kernel's BTF (several MB) each time a loader is made, which was a fifth
/// of job mode's attach CPU with one loader per rank; one loader serves a
/// whole job. Map creation is serialised through it; the verifier, the
/// slow part, runs afterwards on the ranks' threads.
pub struct Loader<'a>(EbpfLoader<'a>);

impl Default for Loader<'_> {
    fn default() -> Self {
        Self(EbpfLoader::new())
    }
}

impl<'a> Loader<'a> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Creates `plan`'s maps and relocates its programs; none is verified
    /// yet ([`Kernel::verify_uprobe_programs`]).
    pub fn load(&mut self, plan: &'a LoadPlan) -> Result<Kernel> {
        let ebpf = self
            .0
            .override_global("TARGET_TGID", &plan.tgid, true)
            .override_global("WAKE_BYTES", &plan.wake_bytes, true)
            .override_global("STACK_COPY_BYTES", &plan.stack_copy, true)
            .override_global("USER_REGS_FROM_TASK", &plan.user_regs_from_task, true)
            .override_global("TASK_STACK_OFFSET", &plan.task_stack_offset, true)
            .override_global("TASK_REGS_DELTA", &plan.task_regs_delta, true)
            .override_global("PY", &plan.python, true)
            .override_global("API_SLOT_MASK", &plan.api_slot_mask, true)
            .map_max_entries("API_SLOTS", plan.api_slots)
            .map_max_entries("EVENTS", plan.ring_bytes)
            .map_max_entries(THREAD_MAPS[0], plan.thread_maps)
            .map_max_entries(THREAD_MAPS[1], plan.thread_maps)
            .map_max_entries(THREAD_MAPS[2], plan.thread_maps)
            .load(OBJECT)
            .map_err(|e| anyhow!("loading dynprof's eBPF programs: {e:#}"))?;
        let paths = plan.paths.clone();
        Ok(Kernel {
            ebpf,
            pid: plan.pid,
            markers: Vec::new(),
            ledger: None,
            semaphores: SemaphoreReport {
                kernel_owned_supported: paths.semaphores == compat::SemaphorePath::Kernel,
                ..Default::default()
            },
            forced_proc_mem: std::env::var_os(SEMAPHORE_ENV).is_some_and(|v| v == "proc_mem"),
            paths,
            api_links: Vec::new(),
            api_attachments: Vec::new(),
            marker_addrs: 0,
            api_addrs: Vec::new(),
            api_slot_count: plan.api_slots,
            api_slots: Vec::new(),
            cpu_links: Vec::new(),
            sched_link: None,
            // The map's initial value: all zero, not armed.
            plan: PlanConfig::default(),
        })
    }
}

impl Kernel {
    /// Loads the object for one target, its uprobe programs verified (see
    /// [`LoadPlan::new`] for the arguments).
    pub fn load(pid: HostPid, ring_bytes: u32, wake_bytes: u64) -> Result<Self> {
        let plan = LoadPlan::new(pid, ring_bytes, wake_bytes)?;
        let mut k = Loader::new().load(&plan)?;
        k.verify_uprobe_programs()?;
        Ok(k)
    }

    /// Runs the verifier on the marker and API programs.
    pub fn verify_uprobe_programs(&mut self) -> Result<()> {
        for name in self.uprobe_programs() {
            self.uprobe(name)?
                .load()
                .with_context(|| format!("verifying eBPF program {name}"))?;
        }
        Ok(())
    }

    /// The marker, API entry and API return programs for this kernel.
    fn uprobe_programs(&self) -> [&'static str; 3] {
        match self.paths.probe_identity {
            ProbeIdentity::Cookie => [MARKER_PROG, API_ENTER_PROG, API_EXIT_PROG],
            ProbeIdentity::Address => [MARKER_IP_PROG, API_ENTER_IP_PROG, API_EXIT_STACK_PROG],
        }
    }

    /// The kernel's release and the paths dynprof takes on it, for the
    /// `attached` event and meta.json.
    pub fn paths(&self) -> &KernelPaths {
        &self.paths
    }

    /// Hits of a no-cookie program at an address user space never
    /// registered (a library mapped after the probe was attached).
    pub fn unknown_address_hits(&self) -> u64 {
        let Some(Ok(a)) = self.ebpf.map("DROPS").map(PerCpuArray::<_, u64>::try_from) else {
            return 0;
        };
        a.get(&drop_slot::UNKNOWN_ADDR, 0)
            .map(|v| v.iter().sum())
            .unwrap_or(0)
    }

    /// Registers every runtime address of a probe in `map` (no-cookie
    /// path), before the probe is attached so its first hit is known.
    fn register_addresses(
        &mut self,
        map: &str,
        path: &Path,
        object: &str,
        file_offset: u64,
        index: u32,
        registered: usize,
    ) -> Result<Vec<u64>> {
        let addrs = sys_uprobe::probe_addresses(self.pid, path, object, file_offset)?;
        if addrs.is_empty() {
            bail!(
                "{} (offset {file_offset:#x}) is not mapped in PID {}: without attach cookies \
                 (Linux < 5.15) dynprof identifies a probe by its runtime address",
                path.display(),
                self.pid
            );
        }
        if registered + addrs.len() > MAX_PROBE_ADDRS as usize {
            bail!("too many probe addresses (at most {MAX_PROBE_ADDRS} without attach cookies)");
        }
        let mut m: BpfHashMap<_, u64, u32> =
            BpfHashMap::try_from(self.ebpf.map_mut(map).expect("address map"))?;
        for a in &addrs {
            m.insert(a, index, 0)
                .with_context(|| format!("registering probe address {a:#x} in {map}"))?;
        }
        Ok(addrs)
    }

    fn uprobe(&mut self, name: &str) -> Result<&mut UProbe> {
        let prog = self
            .ebpf
            .program_mut(name)
            .ok_or_else(|| anyhow!("program {name} missing from the object"))?;
        Ok(prog.try_into()?)
    }

    /// Lowers what a killed dynprof left raised on this target (see
    /// `probes::semaphore`); call once, with the target's lock held.
    /// A failed repair is only warned about: it must not stop the profile.
    pub fn repair_semaphores(&mut self, lock_dir: &Path) {
        match semaphore::repair(lock_dir, self.pid) {
            Ok(r) => self.semaphores.repaired = r,
            Err(e) => log::warn!("USDT semaphore repair for PID {}: {e:#}", self.pid),
        }
        for r in &self.semaphores.repaired {
            log::warn!(
                "lowered USDT semaphore {:#x} of PID {} by {} (left raised by a killed dynprof); now {}",
                r.addr,
                self.pid,
                r.lowered_by,
                r.now
            );
        }
    }

    pub fn semaphore_report(&self) -> &SemaphoreReport {
        &self.semaphores
    }

    /// Verifies the cpu and off-CPU programs (once; the attach functions
    /// call it too), for callers that want it before their collector is
    /// first armed. Arming runs on the event loop ahead of a
    /// window; job mode arms its ranks one after another there, and for a
    /// Python target each verification takes tens of milliseconds (the
    /// frame walk and the stack copy), enough for the last rank to miss
    /// the lead. Its rank threads call this in parallel at attach.
    pub fn verify_collector_programs(&mut self, cpu: bool, offcpu: bool) -> Result<()> {
        if cpu {
            let prog: &mut PerfEvent = self
                .ebpf
                .program_mut(CPU_PROG)
                .expect("cpu prog")
                .try_into()?;
            if prog.fd().is_err() {
                prog.load().context("verifying the CPU sampling program")?;
            }
        }
        if offcpu {
            let prog: &mut TracePoint = self
                .ebpf
                .program_mut(SCHED_PROG)
                .expect("sched prog")
                .try_into()?;
            if prog.fd().is_err() {
                prog.load().context("verifying the off-CPU program")?;
            }
        }
        Ok(())
    }

    /// System-wide per-CPU sampling at `hz`; the program keeps the target's samples.
    pub fn attach_cpu_sampler(&mut self, hz: u64) -> Result<()> {
        self.verify_collector_programs(true, false)?;
        let prog: &mut PerfEvent = self
            .ebpf
            .program_mut(CPU_PROG)
            .expect("cpu prog")
            .try_into()?;
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
        self.verify_collector_programs(false, true)?;
        let prog: &mut TracePoint = self
            .ebpf
            .program_mut(SCHED_PROG)
            .expect("sched prog")
            .try_into()?;
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

    /// Maps the idle step log (`dynprof_common::steplog`); call once, with
    /// [`Self::take_events`]: whoever reads the ring must read the log too.
    pub fn take_step_log(&mut self) -> Result<StepLog> {
        match self.ebpf.take_map("STEP_LOG") {
            Some(aya::maps::Map::Array(data)) => StepLog::map(data),
            Some(_) => bail!("STEP_LOG is not an array map"),
            None => bail!("STEP_LOG already taken"),
        }
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
        self.plan = plan;
        Ok(())
    }

    /// The plan in `PLAN[0]`.
    pub fn plan(&self) -> PlanConfig {
        self.plan
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
        let unknown = self.unknown_address_hits();
        if unknown > 0 {
            log::warn!(
                "{unknown} probe hits in PID {} came from addresses dynprof had not registered \
                 (a library mapped after attach); without attach cookies (Linux < 5.15) they \
                 were not counted",
                self.pid
            );
        }
        self.detach_apis();
        self.detach_cpu_sampler();
        self.detach_offcpu();
        self.detach_markers();
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        self.detach_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_maps_hold_four_entries_per_thread_within_bounds() {
        // Unknown, or a small process: the built-in size.
        assert_eq!(thread_map_entries(None), 4096);
        assert_eq!(thread_map_entries(Some(1)), 4096);
        assert_eq!(thread_map_entries(Some(1024)), 4096);
        // A PyTorch rank with 1,500 threads: 6,000 rounded up.
        assert_eq!(thread_map_entries(Some(1500)), 8192);
        assert_eq!(thread_map_entries(Some(16384)), 65536);
        // Past the cap, and absurd counts, stay at the cap.
        assert_eq!(thread_map_entries(Some(100_000)), 65536);
        assert_eq!(thread_map_entries(Some(u64::MAX)), 65536);
    }
}
