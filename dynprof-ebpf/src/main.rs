//! dynprof's kernel side: count, gate, emit — nothing else.
//!
//! Every program first drops events from other processes (`TARGET_TGID`),
//! then either counts a step boundary and flips the window gate (the marker
//! program), or checks the gate and emits one event (the collectors).
//! All decisions about what a hit *means* are made in user space.
//! Events are written without waking the reader, except at the step hits
//! user space acts on (`PlanConfig::wakes`) or when the ring is filling: a
//! wakeup per event would cost more than the probe itself. Steps outside
//! windows are not ring events at all but one word in `STEP_LOG`.
#![no_std]
#![no_main]
// `atomic_xadd` lowers to BPF_XADD; `AtomicU64::fetch_add` is not offered
// for the bpf target.
#![feature(core_intrinsics)]
#![allow(internal_features)]

mod api;
mod cpu;
mod marker;
mod offcpu;
mod stack_copy;

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_MMAPABLE, BPF_F_USER_STACK, pt_regs},
    helpers::{
        bpf_get_attach_cookie, bpf_get_current_pid_tgid, bpf_get_smp_processor_id,
        bpf_ktime_get_ns, bpf_probe_read_kernel, bpf_probe_read_user, generated,
    },
    macros::{map, perf_event, tracepoint, uprobe, uretprobe},
    maps::{Array, HashMap, PerCpuArray, RingBuf, StackTrace},
    programs::{
        PerfEventContext, ProbeContext, RetProbeContext, TracePointContext, tracing::StackIdContext,
    },
};
use dynprof_common::{
    API_SLOTS_MIN, API_STACK_DEPTH, ApiEvent, ApiSlot, ApiStack, EventHeader, KernelState,
    MAX_APIS, MAX_MARKERS, MAX_PROBE_ADDRS, MarkerConfig, OffCpuEvent, OffCpuStart, PREFIX_LEN,
    PlanConfig, STACK_EMPTY, SampleEvent, StepEvent, THREAD_MAPS_MIN, arg_mode, drop_slot, kind,
    reg, ringbuf, role, steplog,
};

/// Host tgid of the target, set by user space before load.
#[unsafe(no_mangle)]
static TARGET_TGID: u32 = 0;
/// Unread bytes in `EVENTS` above which a batched event still wakes user
/// space (a quarter of the ring, set at load), so a burst never fills the
/// ring while the consumer sleeps until its next tick.
#[unsafe(no_mangle)]
static WAKE_BYTES: u64 = 1024 * 1024;

#[map]
static MARKERS: Array<MarkerConfig> = Array::with_max_entries(MAX_MARKERS, 0);
#[map]
static PLAN: Array<PlanConfig> = Array::with_max_entries(1, 0);
#[map]
static STATE: Array<KernelState> = Array::with_max_entries(1, 0);
/// Per-marker hits that passed the filters.
#[map]
static HITS: PerCpuArray<u64> = PerCpuArray::with_max_entries(MAX_MARKERS, 0);
/// Per-collector losses; see `drop_slot`.
#[map]
static DROPS: PerCpuArray<u64> = PerCpuArray::with_max_entries(drop_slot::COUNT, 0);
/// Size is set by user space at load (`--ring-buffer-kb`).
#[map]
pub(crate) static EVENTS: RingBuf = RingBuf::with_byte_size(4 * 1024 * 1024, 0);
/// Steps outside windows, one word each, read by user space through mmap
/// instead of the ring buffer: see `dynprof_common::steplog`.
#[map]
static STEP_LOG: Array<u64> = Array::with_max_entries(steplog::MAP_ENTRIES, BPF_F_MMAPABLE);
#[map]
static STACKS: StackTrace = StackTrace::with_max_entries(16384, 0);
#[map]
static OFFCPU_START: HashMap<u32, OffCpuStart> = HashMap::with_max_entries(THREAD_MAPS_MIN, 0);

// Kernels without attach cookies (bpf_get_attach_cookie and perf links
// came in 5.15) load the `*_ip` program variants instead: they find the
// marker or API by the probed address, which is the instruction pointer a
// uprobe handler sees (kernel/events/uprobes.c, handle_swbp: "change it in
// advance for ->handler()"). User space fills these maps with every runtime
// address of each probe in the target.
/// Runtime probe address -> marker index.
#[map]
static MARKER_BY_IP: HashMap<u64, u32> = HashMap::with_max_entries(MAX_PROBE_ADDRS, 0);
/// Runtime probe address -> API index.
#[map]
static API_BY_IP: HashMap<u64, u32> = HashMap::with_max_entries(MAX_PROBE_ADDRS, 0);
/// Per-thread stack of API calls in flight, for the return probe. Without
/// cookies it sees the caller's return address instead of the API's:
/// returns come back in the reverse order of entries, so the top frame is
/// the call that returns. With cookies it finds the frame by its API.
#[map]
static API_STACK: HashMap<u32, ApiStack> = HashMap::with_max_entries(THREAD_MAPS_MIN, 0);
/// Threads' API stacks by slot (`ApiSlot`), filled by user space; sized
/// at load, with `API_SLOT_MASK` one less than its size.
#[map]
static API_SLOTS: Array<ApiSlot> = Array::with_max_entries(API_SLOTS_MIN, 0);
/// `API_SLOTS`' size less one (a power of two), set at load.
#[unsafe(no_mangle)]
static API_SLOT_MASK: u32 = API_SLOTS_MIN - 1;
/// One all-zero `ApiStack`, never written: the initial value of a thread's
/// stack (a zeroed local would compile to a memset call BPF cannot make).
#[map]
static ZERO_STACK: Array<ApiStack> = Array::with_max_entries(1, 0);

#[inline(always)]
fn target_tid() -> Option<u32> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = unsafe { core::ptr::read_volatile(&TARGET_TGID) };
    if (pid_tgid >> 32) as u32 == tgid {
        Some(pid_tgid as u32)
    } else {
        None
    }
}

#[inline(always)]
pub(crate) fn count_drop(slot: u32) {
    if let Some(p) = DROPS.get_ptr_mut(slot) {
        unsafe { *p += 1 };
    }
}

#[inline(always)]
fn gate_open() -> bool {
    match STATE.get(0) {
        Some(s) => unsafe { core::ptr::read_volatile(&raw const s.gate) != 0 },
        None => false,
    }
}

/// Submit flags of a batched event: no wakeup, unless the ring is filling.
#[inline(always)]
fn batched() -> u64 {
    let wake_bytes = unsafe { core::ptr::read_volatile(&WAKE_BYTES) };
    if EVENTS.query(ringbuf::AVAIL_DATA) >= wake_bytes {
        ringbuf::FORCE_WAKEUP
    } else {
        ringbuf::NO_WAKEUP
    }
}

#[inline(always)]
fn emit<T: 'static>(ev: T, slot: u32, flags: u64) {
    match EVENTS.reserve::<T>(0) {
        Some(mut e) => {
            e.write(ev);
            e.submit(flags);
        }
        None => count_drop(slot),
    }
}

/// Reads one saved register by its word index in `pt_regs`. Through a
/// helper on purpose: the verifier rejects context loads at a computed
/// offset, and LLVM turns a per-register `match` into exactly that.
#[inline(always)]
fn read_reg(regs: *const pt_regs, r: u32) -> Option<u64> {
    if r >= reg::COUNT {
        return None;
    }
    let addr = regs as usize + r as usize * 8;
    unsafe { bpf_probe_read_kernel(addr as *const u64) }.ok()
}

/// A `STACKS` id, or the helper's negative errno. `-EFAULT` means there was
/// no stack to take (the kernel stack of a sample taken in user mode): not
/// a loss, so not counted. Anything else (`-EEXIST`: the hash bucket holds
/// another stack; `-ENOMEM`) loses the stack and is counted in `slot`.
#[inline(always)]
fn stack_id<C: StackIdContext>(ctx: &C, flags: u64, slot: u32) -> i32 {
    match ctx.get_stackid(&STACKS, flags) {
        Ok(id) => id as i32,
        Err(e) => {
            if e != STACK_EMPTY {
                count_drop(slot);
            }
            e
        }
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
