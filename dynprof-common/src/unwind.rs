//! The user-stack copy that the `cpu` program emits with a sample, so that
//! user space can unwind code built without frame pointers from its
//! `.eh_frame` (see `dynprof/src/symbols/unwind.rs` and docs/stacks.md),
//! and the CPython frames read at the same sample.
use crate::SampleEvent;

/// Event kind of a [`StackSampleHeader`] record (after [`crate::kind`]'s).
pub const SAMPLE_STACK: u32 = 5;
/// Event kind of the stacks of a thread switched out: the same layout
/// (user registers and stack copy where the kernel gives the registers,
/// Python frames); `sample.hdr.ts_ns` is the switch-out time of the
/// `OffCpuEvent` it belongs to, `sample.user_stack` its frame-pointer id.
pub const OFFCPU_STACK: u32 = 6;

/// The largest copy of the user stack taken per sample, in bytes. The
/// program tries this size first, then halves down to
/// [`STACK_COPY_MIN`]: `bpf_probe_read_user` fails as a whole when any
/// page of the range is unmapped, which happens when the sampled `sp` lies
/// closer than the copy size to the top of its stack mapping.
pub const STACK_COPY_MAX: usize = 16384;
/// The largest copy taken at a switch-out: threads block far more often
/// than a sampling clock ticks, and blocking calls are near the stack's top
/// of user frames less often than hot loops are deep in them.
pub const OFFCPU_COPY_MAX: usize = 8192;
/// A thread's stack is copied at a switch-out at most once per this many
/// nanoseconds while it blocks at the same place (the same user ip and sp
/// at kernel entry, and the same frame-pointer and kernel stack ids): a
/// thread that blocks thousands of times a second in one loop (a
/// ping-pong, a queue) would otherwise fill the ring with the same 8 KiB.
/// Those switch-outs are marked `kind::OFFCPU_REPEAT`, and user space
/// gives them the stack it unwound from the thread's last copy.
pub const OFFCPU_COPY_EVERY_NS: u64 = 10_000_000;
/// The smallest copy tried before the sample is sent without one.
pub const STACK_COPY_MIN: usize = 1024;

/// Where the `cpu` and `offcpu` programs find the user registers of a
/// sample taken in kernel mode or of a switch-out (the registers saved at
/// the task's entry into the kernel): the `USER_REGS_FROM_TASK` global.
pub mod user_regs {
    /// Nowhere: those stacks keep their frame-pointer walk.
    pub const NONE: u32 = 0;
    /// `bpf_task_pt_regs(bpf_get_current_task_btf())`, Linux 5.15+.
    pub const TASK_PT_REGS: u32 = 1;
    /// At `task_struct.stack + TASK_REGS_DELTA`, where `task_pt_regs()`
    /// puts them: the member's offset from the kernel's BTF, the distance
    /// measured once at load (`dynprof_task_regs`). For kernels before 5.15.
    pub const TASK_STACK: u32 = 2;
}

/// Head of a stack-copy record; the Python frames, then `len` bytes of the
/// user stack from `sp` up, follow it in the ring record.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StackSampleHeader {
    /// `hdr.kind` is [`SAMPLE_STACK`]; the frame-pointer stack id stays in
    /// `user_stack`, the fast path when it is deep and agrees.
    pub sample: SampleEvent,
    /// User registers at the sample: the instruction and stack pointers,
    /// the frame pointer (x86-64: rbp; arm64: x29) and, on arm64, the link
    /// register x30 (a leaf function's return address; 0 on x86-64).
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    pub lr: u64,
    /// Bytes of stack that follow the Python frames.
    pub len: u32,
    /// Entries of `py` that are filled, innermost first.
    pub py_count: u32,
}

/// CPython frames read per sample at most.
pub const MAX_PY_FRAMES: usize = 32;
/// Thread states of the interpreter's list looked at per sample at most.
pub const MAX_PY_THREADS: usize = 64;

/// One `_PyInterpreterFrame` as read at the sample; user space names it
/// from its code object.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PyFrameRaw {
    /// `f_code` (3.11, 3.12) or `f_executable` (3.13+; in 3.14 a tagged
    /// `_PyStackRef` whose low bits user space clears).
    pub code: u64,
    /// `prev_instr` (3.11, 3.12) or `instr_ptr` (3.13+): the instruction
    /// being executed (its line).
    pub instr: u64,
    /// The byte at [`PyOffsets::frame_is_entry`]: 3.11's `is_entry` (the
    /// first frame of one C-level `_PyEval_EvalFrameDefault` call), or
    /// 3.12+'s `owner`, whose value 3 marks the shim frame each such call
    /// pushes (user space reads it by version).
    pub is_entry: u32,
    pub _pad: u32,
    /// The frame's own address in the target. A 3.12+ shim frame is a
    /// local of its `_PyEval_EvalFrameDefault` call, so its address falls
    /// in that call's C stack frame: user space places the call's Python
    /// frames there even where the evaluator has no symbol.
    pub addr: u64,
}

/// [`PyOffsets::flags`]: the thread state holds a `_PyCFrame*` at
/// `tstate_cframe` whose `current_frame` is at `cframe_current_frame`
/// (3.11, 3.12); without it, `tstate_cframe` is the offset of
/// `current_frame` itself (3.13+).
pub const PY_FRAME_VIA_CFRAME: u64 = 1;

/// Where the sampled thread's CPython frames are, set by user space at
/// load for a target whose interpreter it recognised (`interp_head` 0:
/// none). Offsets are in bytes, from the interpreter's own structures
/// (a version table, or its `_Py_DebugOffsets`). The target controls the
/// memory they lead to: the program reads it with `bpf_probe_read_user`
/// only, in bounded loops.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyOffsets {
    /// Address, in the target, of a `PyThreadState*` that is likely the
    /// sampled thread's (3.11: `_PyRuntime.gilstate.tstate_current`, the
    /// GIL holder; 3.13+: the main interpreter's `_gil.last_holder`), a
    /// fast path checked against the thread id; 0: none (3.12).
    pub tstate_current: u64,
    /// Address, in the target, of `_PyRuntime.interpreters.head`: when the
    /// fast path misses (blocked, or in C code that released the GIL, as
    /// torch ops and autograd do), the thread's `PyThreadState` is found
    /// in the main interpreter's list (`threads.head`, then `next`).
    pub interp_head: u64,
    pub interp_threads_head: u64,
    pub tstate_next: u64,
    /// `PyThreadState.native_thread_id`: checked against the sampled
    /// thread's id as the target sees it (in its PID namespace).
    pub tstate_native_thread_id: u64,
    /// `PyThreadState.cframe` (then `_PyCFrame.current_frame`), or
    /// `PyThreadState.current_frame` (see [`PY_FRAME_VIA_CFRAME`]).
    pub tstate_cframe: u64,
    pub cframe_current_frame: u64,
    /// `_PyInterpreterFrame` fields (see [`PyFrameRaw`]).
    pub frame_code: u64,
    pub frame_previous: u64,
    pub frame_prev_instr: u64,
    pub frame_is_entry: u64,
    /// [`PY_FRAME_VIA_CFRAME`].
    pub flags: u64,
    /// The target's PID namespace (`st_dev`, `st_ino` of
    /// `/proc/PID/ns/pid`) when it is not the root one: thread ids are
    /// compared as the target sees them (`bpf_get_ns_current_pid_tgid`).
    /// Both 0: the kernel's ids are the target's.
    pub pidns_dev: u64,
    pub pidns_ino: u64,
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for PyOffsets {}

/// The per-CPU scratch record the program fills before emitting its first
/// `size_of::<StackSampleHeader>() + len` bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct StackSample {
    pub hdr: StackSampleHeader,
    pub py: [PyFrameRaw; MAX_PY_FRAMES],
    pub stack: [u8; STACK_COPY_MAX],
}

/// Bytes of a record before its stack copy.
pub const STACK_COPY_OFFSET: usize =
    core::mem::size_of::<StackSampleHeader>() + MAX_PY_FRAMES * core::mem::size_of::<PyFrameRaw>();
