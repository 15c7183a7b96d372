//! dynprof's kernel side: count, gate, emit — nothing else.
//!
//! Every program first drops events from other processes (`TARGET_TGID`),
//! then either counts a step boundary and flips the window gate (the marker
//! program), or checks the gate and emits one event (the collectors).
//! All decisions about what a hit *means* are made in user space.
//! Events are written without waking the reader, except at the step hits
//! user space acts on (`PlanConfig::wakes`) or when the ring is filling: a
//! wakeup per event would cost more than the probe itself.
#![no_std]
#![no_main]
// `atomic_xadd` lowers to BPF_XADD; `AtomicU64::fetch_add` is not offered
// for the bpf target.
#![feature(core_intrinsics)]
#![allow(internal_features)]

mod stack_copy;

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_USER_STACK, pt_regs},
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
    API_STACK_DEPTH, ApiEvent, ApiKey, ApiStack, EventHeader, KernelState, MAX_APIS, MAX_MARKERS,
    MAX_PROBE_ADDRS, MarkerConfig, OffCpuEvent, OffCpuStart, PREFIX_LEN, PlanConfig, STACK_EMPTY,
    SampleEvent, StepEvent, arg_mode, drop_slot, kind, reg, ringbuf, role,
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
#[map]
static STACKS: StackTrace = StackTrace::with_max_entries(16384, 0);
#[map]
static API_START: HashMap<ApiKey, u64> = HashMap::with_max_entries(16384, 0);
#[map]
static OFFCPU_START: HashMap<u32, OffCpuStart> = HashMap::with_max_entries(16384, 0);

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
/// Per-thread stack of API calls in flight, for the return probe, which
/// sees the caller's return address instead of the API's: returns come
/// back in the reverse order of entries, so the top frame is the call that
/// returns.
#[map]
static API_STACK: HashMap<u32, ApiStack> = HashMap::with_max_entries(16384, 0);
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

/// Does the marker's string argument start with its prefix?
#[inline(always)]
fn prefix_matches(regs: *const pt_regs, cfg: &MarkerConfig) -> bool {
    let Some(mut value) = read_reg(regs, cfg.arg_reg) else {
        return false;
    };
    if cfg.arg_in_memory != 0 {
        let addr = (value as i64).wrapping_add(cfg.arg_offset) as *const u64;
        value = match unsafe { bpf_probe_read_user(addr) } {
            Ok(v) => v,
            Err(_) => return false,
        };
    }
    if cfg.arg_mode == arg_mode::STD_STRING {
        // libstdc++: the first word of a std::string is `_M_p`, the data.
        value = match unsafe { bpf_probe_read_user(value as *const u64) } {
            Ok(v) => v,
            Err(_) => return false,
        };
    }
    // Zeroed, so bytes past the string's NUL compare as 0: a prefix that
    // ends in NUL (user space's `eq=`) then tests whole-string equality.
    // Left uninitialised on purpose: zeroing it compiles to a memset call,
    // which BPF cannot make. The helper NUL-terminates what it reads, so a
    // shorter string mismatches at its NUL before any stale byte is compared,
    // and a prefix that ends in NUL (user space's `eq=`) tests equality.
    let mut buf = core::mem::MaybeUninit::<[u8; PREFIX_LEN]>::uninit();
    let got = unsafe {
        generated::bpf_probe_read_user_str(
            buf.as_mut_ptr().cast(),
            PREFIX_LEN as u32,
            value as *const _,
        )
    };
    if got < 0 {
        return false;
    }
    let buf = buf.as_ptr() as *const u8;
    let n = cfg.prefix_len as usize;
    let mut i = 0;
    while i < PREFIX_LEN {
        if i >= n {
            break;
        }
        // SAFETY: i < PREFIX_LEN, the length of both arrays.
        if unsafe { *buf.add(i) != *cfg.prefix.as_ptr().add(i) } {
            return false;
        }
        i += 1;
    }
    true
}

/// Attached at every step and aux marker; the cookie is the marker index.
#[uprobe]
pub fn dynprof_marker(ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let marker = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
    marker_hit(ctx.regs, tid, marker)
}

/// [`dynprof_marker`] for kernels without attach cookies: the marker is
/// found by the probed address.
#[uprobe]
pub fn dynprof_marker_ip(ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let Some(ip) = read_reg(ctx.regs, reg::IP) else {
        return 0;
    };
    let Some(marker) = (unsafe { MARKER_BY_IP.get(&ip) }).copied() else {
        count_drop(drop_slot::UNKNOWN_ADDR);
        return 0;
    };
    marker_hit(ctx.regs, tid, marker)
}

#[inline(always)]
fn marker_hit(regs: *const pt_regs, tid: u32, marker: u32) -> u32 {
    let Some(cfg) = MARKERS.get(marker) else {
        return 0;
    };
    if cfg.arg_mode != arg_mode::NONE && !prefix_matches(regs, cfg) {
        return 0;
    }
    let ts_ns = unsafe { bpf_ktime_get_ns() };
    if let Some(h) = HITS.get_ptr_mut(marker) {
        unsafe { *h += 1 };
    }
    let Some(state) = STATE.get_ptr_mut(0) else {
        return 0;
    };
    let (step, gate, wake) = if cfg.role == role::STEP {
        // Several threads may hit step markers; the counter must not lose one.
        // aya-build links for BPF cpu v1, whose XADD cannot return the old
        // value: add atomically (no hit is ever lost), then read back. Two
        // threads hitting at the same instant may read the same index.
        let k = unsafe {
            atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(&raw mut (*state).step_hits, 1);
            core::ptr::read_volatile(&raw const (*state).step_hits)
        };
        let (open, wake) = match PLAN.get(0) {
            Some(p) => p.at(k),
            None => (false, false),
        };
        let was_open = unsafe { (*state).gate != 0 };
        unsafe { (*state).gate = open as u64 };
        (k, open, wake || open != was_open)
    } else {
        unsafe { ((*state).step_hits, (*state).gate != 0, false) }
    };
    let flags = if wake {
        ringbuf::FORCE_WAKEUP
    } else {
        batched()
    };
    emit(
        StepEvent {
            hdr: EventHeader {
                kind: kind::STEP,
                tid,
                ts_ns,
            },
            marker,
            role: cfg.role,
            step,
            gate: gate as u32,
            woke: (flags == ringbuf::FORCE_WAKEUP) as u32,
        },
        drop_slot::STEP,
        flags,
    );
    0
}

/// An empty uprobe, the baseline that `cargo xtask bench` compares the
/// marker program against.
#[uprobe]
pub fn dynprof_empty(_ctx: ProbeContext) -> u32 {
    0
}

/// An empty return probe: with [`dynprof_empty`] at the same function, the
/// kernel's floor under the api collector's entry + return probes.
#[uretprobe]
pub fn dynprof_empty_ret(_ctx: RetProbeContext) -> u32 {
    0
}

/// Entry of a traced runtime API; the cookie is the API index.
#[uprobe]
pub fn dynprof_api_enter(ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    if !gate_open() {
        return 0;
    }
    let api = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
    if api >= MAX_APIS {
        return 0;
    }
    let ts = unsafe { bpf_ktime_get_ns() };
    if API_START.insert(ApiKey { tid, api }, ts, 0).is_err() {
        count_drop(drop_slot::API_NESTING);
    }
    0
}

/// Return of a traced runtime API: one event with the exact duration.
#[uretprobe]
pub fn dynprof_api_exit(ctx: RetProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let api = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
    let key = ApiKey { tid, api };
    // Only calls that began inside the window have a start record.
    let Some(start) = (unsafe { API_START.get(&key) }).copied() else {
        return 0;
    };
    let _ = API_START.remove(&key);
    let now = unsafe { bpf_ktime_get_ns() };
    let ret: i64 = ctx.ret();
    emit(
        ApiEvent {
            hdr: EventHeader {
                kind: kind::API,
                tid,
                ts_ns: start,
            },
            api,
            _pad: 0,
            dur_ns: now.saturating_sub(start),
            ret,
        },
        drop_slot::API,
        batched(),
    );
    0
}

/// [`dynprof_api_enter`] for kernels without attach cookies: the API is
/// found by the probed address, and every call is pushed on the thread's
/// [`ApiStack`] (in the window or not) so that [`dynprof_api_exit_stack`]
/// pairs each return with its entry.
#[uprobe]
pub fn dynprof_api_enter_ip(ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let Some(ip) = read_reg(ctx.regs, reg::IP) else {
        return 0;
    };
    let Some(api) = (unsafe { API_BY_IP.get(&ip) }).copied() else {
        count_drop(drop_slot::UNKNOWN_ADDR);
        return 0;
    };
    let in_window = gate_open();
    let ts = unsafe { bpf_ktime_get_ns() };
    let st = match API_STACK.get_ptr_mut(&tid) {
        Some(p) => p,
        None => {
            let Some(zero) = ZERO_STACK.get(0) else {
                return 0;
            };
            if API_STACK.insert(&tid, zero, 0).is_err() {
                count_drop(drop_slot::API_NESTING);
                return 0;
            }
            match API_STACK.get_ptr_mut(&tid) {
                Some(p) => p,
                None => return 0,
            }
        }
    };
    let depth = unsafe { (*st).depth };
    // Deeper calls than the stack holds are counted, not stored, so that
    // the returns still pop the right frames.
    if (depth as usize) < API_STACK_DEPTH {
        // SAFETY: depth < API_STACK_DEPTH, the length of `frames`.
        let f = unsafe { (*st).frames.as_mut_ptr().add(depth as usize) };
        unsafe {
            (*f).api = api;
            (*f).in_window = in_window as u32;
            (*f).ts_ns = ts;
        }
    } else if in_window {
        count_drop(drop_slot::API_NESTING);
    }
    unsafe { (*st).depth = depth + 1 };
    0
}

/// [`dynprof_api_exit`] for kernels without attach cookies: pops the
/// thread's top [`ApiStack`] frame, and emits it if it began in a window.
#[uretprobe]
pub fn dynprof_api_exit_stack(ctx: RetProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let Some(st) = API_STACK.get_ptr_mut(&tid) else {
        return 0;
    };
    let depth = unsafe { (*st).depth };
    if depth == 0 {
        return 0;
    }
    let top = depth - 1;
    unsafe { (*st).depth = top };
    if (top as usize) >= API_STACK_DEPTH {
        return 0;
    }
    // SAFETY: top < API_STACK_DEPTH, the length of `frames`.
    let f = unsafe { *(*st).frames.as_ptr().add(top as usize) };
    if f.in_window == 0 {
        return 0;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    let ret: i64 = ctx.ret();
    emit(
        ApiEvent {
            hdr: EventHeader {
                kind: kind::API,
                tid,
                ts_ns: f.ts_ns,
            },
            api: f.api,
            _pad: 0,
            dur_ns: now.saturating_sub(f.ts_ns),
            ret,
        },
        drop_slot::API,
        batched(),
    );
    0
}

/// Perf-event CPU sampling, system-wide per CPU, filtered to the target.
#[perf_event]
pub fn dynprof_cpu(ctx: PerfEventContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    if tid == 0 || !gate_open() {
        return 0;
    }
    let user_stack = stack_id(&ctx, BPF_F_USER_STACK as u64, drop_slot::CPU_STACK);
    let kernel_stack = stack_id(&ctx, 0, drop_slot::CPU_STACK);
    let sample = SampleEvent {
        hdr: EventHeader {
            kind: kind::SAMPLE,
            tid,
            ts_ns: unsafe { bpf_ktime_get_ns() },
        },
        user_stack,
        kernel_stack,
        cpu: unsafe { bpf_get_smp_processor_id() },
        _pad: 0,
    };
    let flags = batched();
    if !stack_copy::emit_with_stack(&ctx, sample, flags) {
        emit(sample, drop_slot::CPU, flags);
    }
    0
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

// Offsets in the sched/sched_switch tracepoint record (stable ABI, see
// /sys/kernel/tracing/events/sched/sched_switch/format).
const PREV_PID: usize = 24;
const NEXT_PID: usize = 56;

/// Off-CPU time: remember when a target thread leaves the CPU (with its
/// stacks, taken while it is still `current`), emit when it comes back.
#[tracepoint]
pub fn dynprof_sched_switch(ctx: TracePointContext) -> u32 {
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(tid) = target_tid() {
        let prev: i32 = unsafe { ctx.read_at(PREV_PID) }.unwrap_or(-1);
        if prev as u32 == tid && tid != 0 && gate_open() {
            let rec = OffCpuStart {
                ts_ns: now,
                user_stack: stack_id(&ctx, BPF_F_USER_STACK as u64, drop_slot::OFFCPU_STACK),
                kernel_stack: stack_id(&ctx, 0, drop_slot::OFFCPU_STACK),
            };
            if OFFCPU_START.insert(tid, rec, 0).is_err() {
                count_drop(drop_slot::OFFCPU);
            } else {
                stack_copy::emit_offcpu_python(tid, now, batched());
            }
        }
    }
    let next: i32 = unsafe { ctx.read_at(NEXT_PID) }.unwrap_or(0);
    if next <= 0 {
        return 0;
    }
    let next = next as u32;
    if let Some(start) = unsafe { OFFCPU_START.get(&next) }.copied() {
        let _ = OFFCPU_START.remove(&next);
        emit(
            OffCpuEvent {
                hdr: EventHeader {
                    kind: kind::OFFCPU,
                    tid: next,
                    ts_ns: start.ts_ns,
                },
                dur_ns: now.saturating_sub(start.ts_ns),
                user_stack: start.user_stack,
                kernel_stack: start.kernel_stack,
            },
            drop_slot::OFFCPU,
            batched(),
        );
    }
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
