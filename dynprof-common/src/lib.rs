//! The kernel/user contract of dynprof.
//!
//! Every type here is `#[repr(C)]` and shared byte-for-byte between the eBPF
//! programs (`dynprof-ebpf`) and user space (`dynprof`). The kernel never sees
//! names: a probe is identified by its attach cookie, an index into user
//! space's marker or API table.
#![no_std]

pub mod steplog;
pub mod unwind;

/// `bpf_ringbuf_submit`/`query` flags (include/uapi/linux/bpf.h).
pub mod ringbuf {
    /// Do not notify the consumer: it reads the record on its next tick.
    pub const NO_WAKEUP: u64 = 1;
    /// Notify even when older records are still unread (the default
    /// notifies only when the ring was empty).
    pub const FORCE_WAKEUP: u64 = 2;
    /// `bpf_ringbuf_query`: bytes not yet consumed.
    pub const AVAIL_DATA: u64 = 0;
}

/// Markers (step and aux probes) user space can configure at once.
pub const MAX_MARKERS: u32 = 64;
/// Runtime APIs the `api` collector can trace at once.
pub const MAX_APIS: u32 = 512;
/// Runtime probe addresses (markers and APIs, each) the no-cookie program
/// variants can tell apart; a library mapped twice counts twice.
pub const MAX_PROBE_ADDRS: u32 = 4096;
/// API calls in flight per thread that the API programs record.
pub const API_STACK_DEPTH: usize = 8;
/// Entries of the maps keyed by a thread of the target (`API_STACK`,
/// `OFFCPU_START`, `OFFCPU_LAST_COPY`) as built: user space
/// sizes them at load from the target's thread count (4 per thread, a
/// power of two, at least this, at most [`THREAD_MAPS_MAX`]). Hash maps
/// are preallocated, so their size is kernel memory and attach time for
/// every attached process (8 ranks used to take 8 x 8 MB with 16,384).
pub const THREAD_MAPS_MIN: u32 = 4096;
pub const THREAD_MAPS_MAX: u32 = 65536;
/// The maps sized by [`THREAD_MAPS_MIN`]'s rule.
pub const THREAD_MAPS: [&str; 3] = ["API_STACK", "OFFCPU_START", "OFFCPU_LAST_COPY"];
/// Longest string-argument prefix the kernel compares.
pub const PREFIX_LEN: usize = 64;

/// A stack id the kernel could not store, as `bpf_get_stackid` reports it:
/// `-EFAULT`, there was no stack (the kernel stack of a sample taken in user
/// mode). Not a loss. Any other negative id is a lost stack (`-EEXIST`: its
/// hash bucket holds another stack), counted in the `*_STACK` drop slots.
pub const STACK_EMPTY: i32 = -14;

/// Event kinds; the first field of every event.
pub mod kind {
    pub const STEP: u32 = 1;
    pub const API: u32 = 2;
    pub const SAMPLE: u32 = 3;
    pub const OFFCPU: u32 = 4;
    /// An `OffCpuEvent` whose switch-out was at the same place as its
    /// thread's last one with a stack copy (same user ip, sp, frame-pointer
    /// and kernel stacks, within `unwind::OFFCPU_COPY_EVERY_NS`), which was
    /// therefore not copied again: user space gives it that copy's stack.
    pub const OFFCPU_REPEAT: u32 = 7;
}

/// Marker roles.
pub mod role {
    /// Each hit is one step boundary.
    pub const STEP: u32 = 0;
    /// Counted per step (e.g. backward passes).
    pub const AUX: u32 = 1;
}

/// How the marker's string argument is read for the prefix filter.
pub mod arg_mode {
    /// No filter: every hit counts.
    pub const NONE: u32 = 0;
    /// The argument is a `const char*`.
    pub const CSTR: u32 = 1;
    /// The argument is a libstdc++ `std::string*` (first word is `_M_p`).
    pub const STD_STRING: u32 = 2;
}

/// Indices of the per-CPU `DROPS` map: one slot per collector, plus
/// stack-map losses, so that losses are attributed and never silent.
pub mod drop_slot {
    pub const STEP: u32 = 0;
    pub const API: u32 = 1;
    pub const CPU: u32 = 2;
    pub const OFFCPU: u32 = 3;
    pub const CPU_STACK: u32 = 4;
    pub const OFFCPU_STACK: u32 = 5;
    pub const API_NESTING: u32 = 6;
    /// A no-cookie program hit at an address user space did not register
    /// (a library mapped after attach).
    pub const UNKNOWN_ADDR: u32 = 7;
    pub const COUNT: u32 = 8;
}

/// x86-64 registers a marker argument can live in, as word indices into the
/// kernel's `struct pt_regs` (arch/x86/include/asm/ptrace.h). Function
/// arguments 0..5 are the SysV registers; USDT operands may name any of them.
pub mod reg_x86_64 {
    pub const R15: u32 = 0;
    pub const R14: u32 = 1;
    pub const R13: u32 = 2;
    pub const R12: u32 = 3;
    pub const RBP: u32 = 4;
    pub const RBX: u32 = 5;
    pub const R11: u32 = 6;
    pub const R10: u32 = 7;
    pub const R9: u32 = 8;
    pub const R8: u32 = 9;
    pub const RAX: u32 = 10;
    pub const RCX: u32 = 11;
    pub const RDX: u32 = 12;
    pub const RSI: u32 = 13;
    pub const RDI: u32 = 14;
    pub const RIP: u32 = 16;
    /// The code segment selector: its low two bits are the privilege
    /// level the registers were saved at (3: user mode).
    pub const CS: u32 = 17;
    pub const RSP: u32 = 19;
    pub const SP: u32 = RSP;
    /// The instruction pointer, which a uprobe handler sees at the probe.
    pub const IP: u32 = RIP;
    /// How far above a function's entry stack pointer its caller's is
    /// after it returns: `ret` pops the return address.
    pub const RETURN_POPS: u64 = 8;
    /// Integer argument registers of the SysV ABI, in order.
    pub const ARGS: [u32; 6] = [RDI, RSI, RDX, RCX, R8, R9];
    /// Words in `struct pt_regs`.
    pub const COUNT: u32 = 21;
}

/// arm64 registers as word indices into the kernel's `struct pt_regs`,
/// whose head is `struct user_pt_regs` (arch/arm64/include/uapi/asm/ptrace.h):
/// `regs[31]` (x0..x30), `sp`, `pc`, `pstate`.
pub mod reg_aarch64 {
    /// `xN` (and its 32-bit view `wN`) for N in 0..=30.
    pub const fn x(n: u32) -> u32 {
        n
    }
    /// The frame pointer, x29.
    pub const FP: u32 = 29;
    /// The link register, x30.
    pub const LR: u32 = 30;
    pub const SP: u32 = 31;
    pub const PC: u32 = 32;
    /// The saved PSTATE: its low five bits are the exception level and
    /// execution state the registers were saved at (0: EL0, AArch64 user
    /// mode; bit 4 set: a 32-bit compat task).
    pub const PSTATE: u32 = 33;
    /// The instruction pointer, which a uprobe handler sees at the probe.
    pub const IP: u32 = PC;
    /// How far above a function's entry stack pointer its caller's is
    /// after it returns: none, the return address is in the link register.
    pub const RETURN_POPS: u64 = 0;
    /// Integer argument registers of AAPCS64 (x0..x7), in order.
    pub const ARGS: [u32; 8] = [0, 1, 2, 3, 4, 5, 6, 7];
    /// Words of `struct user_pt_regs` (x0..x30, sp, pc, pstate).
    pub const COUNT: u32 = 34;
}

/// The registers of the architecture being built: the eBPF object is built
/// per target (aya-build passes `bpf_target_arch`), user space per host.
#[cfg(any(bpf_target_arch = "aarch64", target_arch = "aarch64"))]
pub use reg_aarch64 as reg;
#[cfg(not(any(bpf_target_arch = "aarch64", target_arch = "aarch64")))]
pub use reg_x86_64 as reg;

/// Per-marker configuration, written by user space into `MARKERS[cookie]`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MarkerConfig {
    /// [`role`]
    pub role: u32,
    /// [`arg_mode`]
    pub arg_mode: u32,
    /// [`reg`] holding the argument (or the base of a memory operand).
    pub arg_reg: u32,
    /// 1 when the argument is in memory at `arg_reg + arg_offset` (USDT
    /// operands such as `8@-24(%rbp)`), 0 when it is the register itself.
    pub arg_in_memory: u32,
    pub arg_offset: i64,
    /// Bytes of `prefix` that must match; 0 matches everything.
    pub prefix_len: u32,
    pub _pad: u32,
    pub prefix: [u8; PREFIX_LEN],
}

impl MarkerConfig {
    pub const fn zeroed() -> Self {
        Self {
            role: role::STEP,
            arg_mode: arg_mode::NONE,
            arg_reg: 0,
            arg_in_memory: 0,
            arg_offset: 0,
            prefix_len: 0,
            _pad: 0,
            prefix: [0; PREFIX_LEN],
        }
    }
}

/// The window plan in hit indices, written by user space into `PLAN[0]`.
///
/// The step program evaluates it at every step hit `k` and sets the gate:
/// `active = armed && start <= k < end && (k - start) % period < span`.
/// A periodic plan (warmup + active, repeated with a gap) therefore needs no
/// user-space round trip at any boundary.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanConfig {
    pub armed: u32,
    pub _pad: u32,
    /// First hit index inside the window.
    pub start: u64,
    /// First hit index after the last cycle (exclusive).
    pub end: u64,
    /// Steps per cycle that are inside the window (warmup + active).
    pub span: u64,
    /// Steps per cycle (span + gap); never 0.
    pub period: u64,
    /// Steps per cycle inside the gate but not recorded; only used to decide
    /// which hits wake user space ([`PlanConfig::wakes`]).
    pub warmup: u64,
    /// Hits this many steps before a cycle starts wake user space, so that
    /// it arms the collectors ahead of the window.
    pub lead: u64,
}

impl PlanConfig {
    /// No plan: the gate closes at the next hit and stays closed.
    pub const DISARMED: PlanConfig = PlanConfig {
        armed: 0,
        _pad: 0,
        start: 0,
        end: 0,
        span: 0,
        period: 1,
        warmup: 0,
        lead: 0,
    };

    /// The gate at step hit `k`: inside a cycle's first `span` steps.
    #[inline(always)]
    pub fn gate(&self, k: u64) -> bool {
        self.at(k).0
    }

    /// Does step hit `k` need user space *now*? True at the hits where it
    /// has work: the lead-in that arms collectors, a cycle's first hit
    /// (window opens), its first recorded step (start hooks, msprof
    /// `start`) and the hit that closes it. Every other step event is
    /// batched: written without a wakeup and read on user space's next
    /// tick, which is what makes an attached-but-idle dynprof cost nothing
    /// per step.
    #[inline(always)]
    pub fn wakes(&self, k: u64) -> bool {
        self.at(k).1
    }

    /// `(gate, wakes)` at hit `k`, with one division: the step program
    /// evaluates both at every hit.
    #[inline(always)]
    pub fn at(&self, k: u64) -> (bool, bool) {
        if self.armed == 0 || self.period == 0 {
            return (false, false);
        }
        if k < self.start {
            return (false, self.start - k <= self.lead);
        }
        if k > self.end {
            return (false, false);
        }
        let r = (k - self.start) % self.period;
        let to_next = self.period - r;
        let gate = k < self.end && r < self.span;
        let wake = r == 0
            || r == self.warmup
            || r == self.span
            || (to_next <= self.lead && k.saturating_add(to_next) < self.end);
        (gate, wake)
    }

    /// The first hit after `k` that wakes user space, if any: what the
    /// event loop expects next. Closed form (the candidates are the hits
    /// where one of [`PlanConfig::at`]'s wake conditions begins), so that
    /// a plan millions of steps long costs nothing to ask. User space only.
    pub fn next_wake(&self, k: u64) -> Option<u64> {
        if self.armed == 0 || self.period == 0 {
            return None;
        }
        let j = k.checked_add(1)?;
        let mut c = [
            j,
            self.start.saturating_sub(self.lead),
            self.start,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
        ];
        if j >= self.start {
            let base = self.start + (j - self.start) / self.period * self.period;
            let next = base.saturating_add(self.period);
            for (i, b) in [base, next].into_iter().enumerate() {
                c[3 + i * 4] = b;
                c[4 + i * 4] = b.saturating_add(self.warmup);
                c[5 + i * 4] = b.saturating_add(self.span);
                c[6 + i * 4] = b.saturating_add(self.period).saturating_sub(self.lead);
            }
        }
        c.into_iter()
            .filter(|&h| h > k && h <= self.end && self.wakes(h))
            .min()
    }
}

/// Kernel-owned state, `STATE[0]`: the step counter and the gate that the
/// collector programs read. Only the step program writes it.
///
/// The counter is split in two so that the usual stepping thread pays no
/// locked instruction: a `lock xadd` was ~15-20 ns of the ~65 ns the step
/// program adds to a hit (bpf_stats, 2026-12-06). The target's main thread
/// (tid == tgid, one thread for the process's whole life) adds to
/// `main_hits` with a plain load and store, since no other thread ever
/// writes that word; every other thread adds to `other_hits` atomically.
/// No hit is lost either way, and the sum is the step count.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct KernelState {
    /// Step hits by the target's main thread.
    pub main_hits: u64,
    /// Step hits by every other thread.
    pub other_hits: u64,
    /// 1 while the current step lies inside a window.
    pub gate: u64,
}

impl KernelState {
    /// Number of step hits since load; hit k begins step k.
    pub fn step_hits(&self) -> u64 {
        self.main_hits.wrapping_add(self.other_hits)
    }
}

/// Common header of every ring-buffer event.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EventHeader {
    /// [`kind`]
    pub kind: u32,
    /// Thread id as the host sees it.
    pub tid: u32,
    /// `bpf_ktime_get_ns()`: CLOCK_MONOTONIC.
    pub ts_ns: u64,
}

/// A step or aux marker hit that passed the filters.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StepEvent {
    pub hdr: EventHeader,
    /// Marker index (the attach cookie).
    pub marker: u32,
    /// [`role`]
    pub role: u32,
    /// For step markers: this hit's index k (hit k begins step k). For aux
    /// markers: the step in progress.
    pub step: u64,
    /// Gate after this hit: 1 when step `step` is inside a window.
    pub gate: u32,
    /// 1 when this event woke user space; 0 when it was batched (read on
    /// the next tick). See [`PlanConfig::wakes`].
    pub woke: u32,
}

/// One completed runtime API call, timed in the kernel so that exact
/// durations cost one event instead of two.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ApiEvent {
    /// `ts_ns` is the entry time.
    pub hdr: EventHeader,
    /// API index (the attach cookie).
    pub api: u32,
    pub _pad: u32,
    pub dur_ns: u64,
    /// The return register (an `aclError` / `cudaError_t` for most APIs).
    pub ret: i64,
}

/// One perf-event CPU sample of a target thread.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SampleEvent {
    pub hdr: EventHeader,
    /// `STACKS` ids; negative when there is none: [`STACK_EMPTY`] (no
    /// stack to take, not a loss) or another `-errno` (a lost stack).
    pub user_stack: i32,
    pub kernel_stack: i32,
    pub cpu: u32,
    pub _pad: u32,
}

/// One off-CPU interval of a target thread; `hdr.ts_ns` is the switch-out.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct OffCpuEvent {
    pub hdr: EventHeader,
    pub dur_ns: u64,
    pub user_stack: i32,
    pub kernel_stack: i32,
    /// 1: the thread was still runnable when it left the CPU (preempted,
    /// or it yielded): it waited for a CPU, it did not block. sched_switch
    /// reports that state as `R` or `R+`.
    pub runnable: u32,
    pub _pad: u32,
}

/// One API call in flight ([`ApiStack`]).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ApiFrame {
    pub api: u32,
    /// 1 when the call began with the window gate open.
    pub in_window: u32,
    pub ts_ns: u64,
    /// The stack pointer at the call's first instruction: without attach
    /// cookies, what tells which frame a return belongs to (the stack
    /// grows down, so frames above it whose returns were never seen, left
    /// by a C++ exception or a longjmp, have lower ones).
    pub sp: u64,
}

/// A thread's API calls in flight (several at once: a memcpy that
/// synchronizes). Without attach cookies, `depth` may exceed
/// [`API_STACK_DEPTH`]: the calls beyond it are not stored but still
/// counted, so returns keep matching their entries; with cookies, a call
/// beyond it is not recorded (an `api_nesting` drop).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ApiStack {
    pub depth: u32,
    pub _pad: u32,
    pub frames: [ApiFrame; API_STACK_DEPTH],
}

/// A thread's [`ApiStack`] in the `API_SLOTS` array, at index
/// `tid & API_SLOT_MASK`. User space gives each slot to one thread of the
/// target (`owner`) before the API probes attach, for threads that exist
/// then; other threads use the `API_STACK` hash. An array element is found
/// without a helper call (the verifier inlines the lookup), where the hash
/// cost one lookup at entry and one at return. The programs never claim a
/// slot themselves: BPF cpu v1 (5.10) has no compare-and-exchange, and
/// two threads taking one slot at once would mix their calls unseen.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ApiSlot {
    /// Host tid of the slot's thread; 0 for none.
    pub owner: u32,
    pub _pad: u32,
    pub stack: ApiStack,
}
/// Bounds of `API_SLOTS`' size: 2 per thread at attach, a power of two.
pub const API_SLOTS_MIN: u32 = 64;
pub const API_SLOTS_MAX: u32 = 4096;

/// Switch-out record kept per thread until it runs again.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct OffCpuStart {
    pub ts_ns: u64,
    pub user_stack: i32,
    pub kernel_stack: i32,
    /// 1: at the same place as the thread's last copied switch-out (see
    /// [`kind::OFFCPU_REPEAT`]).
    pub repeat: u32,
    /// 1: still runnable at the switch-out ([`OffCpuEvent::runnable`]).
    pub runnable: u32,
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    unsafe impl aya::Pod for MarkerConfig {}
    unsafe impl aya::Pod for PlanConfig {}
    unsafe impl aya::Pod for KernelState {}
    unsafe impl aya::Pod for OffCpuStart {}
    unsafe impl aya::Pod for ApiStack {}
    unsafe impl aya::Pod for ApiSlot {}
}
