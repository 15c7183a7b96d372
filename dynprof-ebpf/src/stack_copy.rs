//! The user-stack copy of a CPU sample or an off-CPU switch: registers and
//! the top of the user stack, for user space to unwind code built without
//! frame pointers from `.eh_frame` (as `perf --call-graph dwarf` and
//! samply do).
//!
//! A sample taken in user mode carries the user registers itself. In
//! kernel mode (a syscall, a page fault) and at a switch-out, the user
//! registers are the ones saved at kernel entry, `task_pt_regs(current)`,
//! which `bpf_task_pt_regs` (5.15) returns. Before 5.15 they are read where
//! that function finds them, at the top of the task's kernel stack: at
//! `task_struct.stack` (the member's offset from the kernel's BTF) plus a
//! distance measured once at load by [`dynprof_task_regs`]. User space
//! chooses the path (`USER_REGS_FROM_TASK`), and the verifier drops the
//! other branches as dead code, so this object still loads on 5.10.
//! Other helpers used: `bpf_get_current_task` (4.8),
//! `bpf_probe_read_user` (5.5) and `bpf_ringbuf_output` (5.8).
//!
//! CPython frames are read here too, at the sample, so that they are
//! exactly those of the sampled instant (read later from user space, the
//! interpreter would have moved on): the GIL holder's `PyThreadState`,
//! then its `_PyInterpreterFrame` chain, `MAX_PY_FRAMES` at most. They are
//! read in kernel-mode samples as well (the memory is the current task's).
use aya_ebpf::{
    EbpfContext,
    helpers::{bpf_probe_read_kernel, generated},
    macros::{map, raw_tracepoint},
    maps::{Array, LruHashMap, PerCpuArray},
    programs::{PerfEventContext, RawTracePointContext},
};
use dynprof_common::{
    SampleEvent, THREAD_MAPS_MIN, drop_slot,
    unwind::{
        MAX_PY_FRAMES, MAX_PY_THREADS, OFFCPU_COPY_EVERY_NS, OFFCPU_COPY_MAX, OFFCPU_STACK,
        PY_FRAME_VIA_CFRAME, PyFrameRaw, PyOffsets, SAMPLE_STACK, STACK_COPY_MAX,
        STACK_COPY_OFFSET, StackSample, StackSampleHeader, user_regs,
    },
};

/// Largest copy in bytes, set by user space at load: 0 disables the copy
/// (`DYNPROF_STACK_COPY_KB=0`, or a ring too small for copies).
#[unsafe(no_mangle)]
static STACK_COPY_BYTES: u32 = 0;

/// Where the user registers of kernel-mode samples and switch-outs are
/// found (`user_regs::*`), set by user space at load. The branches not
/// chosen are dead code, which the verifier of older kernels prunes before
/// it would reject `bpf_task_pt_regs`.
#[unsafe(no_mangle)]
static USER_REGS_FROM_TASK: u32 = user_regs::NONE;
/// Byte offset of `stack` in `struct task_struct`, from the kernel's BTF
/// (`user_regs::TASK_STACK` and [`dynprof_task_regs`]).
#[unsafe(no_mangle)]
static TASK_STACK_OFFSET: u32 = 0;
/// `task_pt_regs(task) - task->stack`: `THREAD_SIZE - sizeof(pt_regs)`
/// less any padding, which BTF does not give on every kernel; measured by
/// [`dynprof_task_regs`] before the object that uses it is loaded.
#[unsafe(no_mangle)]
static TASK_REGS_DELTA: u32 = 0;
/// The thread whose next system call [`dynprof_task_regs`] measures.
#[unsafe(no_mangle)]
static CALIBRATE_TID: u32 = 0;

/// What [`dynprof_task_regs`] saw: `[task->stack, regs, runs, all]`, the
/// counts of its runs at `CALIBRATE_TID`'s system calls and at anyone's
/// (so that user space can tell a program that never ran from one that
/// missed its thread or failed to read).
#[map]
static TASK_REGS_SEEN: Array<[u64; 4]> = Array::with_max_entries(1, 0);

/// Measures where `task_pt_regs()` is on this kernel, once per dynprof
/// process, in an instance of this object loaded for nothing else: at
/// `sys_enter`, whose first argument is exactly that pointer, of one
/// system call that user space makes (`CALIBRATE_TID`), it records the
/// task's stack base beside it.
#[raw_tracepoint(tracepoint = "sys_enter")]
pub fn dynprof_task_regs(ctx: RawTracePointContext) -> i32 {
    let tid = aya_ebpf::helpers::bpf_get_current_pid_tgid() as u32;
    let Some(p) = TASK_REGS_SEEN.get_ptr_mut(0) else {
        return 0;
    };
    unsafe { (*p)[3] += 1 };
    if tid == 0 || tid != unsafe { core::ptr::read_volatile(&CALIBRATE_TID) } {
        return 0;
    }
    unsafe { (*p)[2] += 1 };
    let regs: u64 = ctx.arg(0);
    if let Some(stack) = task_stack() {
        unsafe {
            (*p)[0] = stack;
            (*p)[1] = regs;
        }
    }
    0
}

/// The current task's `stack` (the base of its kernel stack).
#[inline(always)]
fn task_stack() -> Option<u64> {
    let offset = unsafe { core::ptr::read_volatile(&TASK_STACK_OFFSET) } as u64;
    let task = unsafe { aya_ebpf::helpers::bpf_get_current_task() };
    let stack: u64 = unsafe { bpf_probe_read_kernel((task + offset) as *const u64) }.ok()?;
    (stack != 0).then_some(stack)
}

/// The target's CPython layout, set by user space at load (all zero: not
/// a recognised CPython). One program serves every supported version: the
/// offsets and `flags` carry the differences.
#[unsafe(no_mangle)]
static PY: PyOffsets = PyOffsets {
    tstate_current: 0,
    interp_head: 0,
    interp_threads_head: 0,
    tstate_next: 0,
    tstate_native_thread_id: 0,
    tstate_cframe: 0,
    cframe_current_frame: 0,
    frame_code: 0,
    frame_previous: 0,
    frame_prev_instr: 0,
    frame_is_entry: 0,
    flags: 0,
    pidns_dev: 0,
    pidns_ino: 0,
};

/// Scratch record: too big for the 512-byte BPF stack.
#[map]
static STACK_BUF: PerCpuArray<StackSample> = PerCpuArray::with_max_entries(1, 0);

/// The user registers an unwinder starts from.
#[derive(Clone, Copy)]
struct UserRegs {
    ip: u64,
    sp: u64,
    fp: u64,
    /// arm64's link register (0 on x86-64).
    lr: u64,
}

/// Where the registers are in the architecture's `struct pt_regs` (word
/// indices), and how to tell user mode from the saved mode word.
#[cfg(bpf_target_arch = "aarch64")]
mod arch {
    use dynprof_common::reg_aarch64 as r;
    pub const IP: usize = r::PC as usize;
    pub const SP: usize = r::SP as usize;
    pub const FP: usize = r::FP as usize;
    pub const LR: Option<usize> = Some(r::LR as usize);
    pub const MODE: usize = r::PSTATE as usize;
    /// EL0 in AArch64 state (`PSR_MODE_EL0t`, without the compat bit): a
    /// 32-bit task's stack is not unwound with the 64-bit tables.
    pub fn is_user(pstate: u64) -> bool {
        pstate & 0x1f == 0
    }
}
#[cfg(not(bpf_target_arch = "aarch64"))]
mod arch {
    use dynprof_common::reg_x86_64 as r;
    pub const IP: usize = r::RIP as usize;
    pub const SP: usize = r::RSP as usize;
    pub const FP: usize = r::RBP as usize;
    pub const LR: Option<usize> = None;
    pub const MODE: usize = r::CS as usize;
    /// Saved at privilege level 3.
    pub fn is_user(cs: u64) -> bool {
        cs & 3 == 3
    }
}

/// The user registers saved at the current task's entry into the kernel,
/// when the kernel can say (`USER_REGS_FROM_TASK`).
#[inline(always)]
fn task_user_regs() -> Option<UserRegs> {
    let how = unsafe { core::ptr::read_volatile(&USER_REGS_FROM_TASK) };
    let regs = if how == user_regs::TASK_PT_REGS {
        (unsafe { generated::bpf_task_pt_regs(generated::bpf_get_current_task_btf()) })
            as *const u64
    } else if how == user_regs::TASK_STACK {
        let delta = unsafe { core::ptr::read_volatile(&TASK_REGS_DELTA) } as u64;
        (task_stack()? + delta) as *const u64
    } else {
        return None;
    };
    if regs.is_null() {
        return None;
    }
    let word = |i: usize| unsafe { bpf_probe_read_kernel(regs.wrapping_add(i)) }.ok();
    // A kernel thread's saved registers are not a user context.
    if !arch::is_user(word(arch::MODE)?) {
        return None;
    }
    let sp = word(arch::SP)?;
    (sp != 0).then_some(())?;
    let lr = match arch::LR {
        Some(i) => word(i)?,
        None => 0,
    };
    Some(UserRegs {
        ip: word(arch::IP)?,
        sp,
        fp: word(arch::FP)?,
        lr,
    })
}

/// Will [`emit_with_stack`] copy this sample's user stack? (The copy is on,
/// and the user registers are the sample's own or the kernel can give
/// them.) Asked before any walk: the cpu program then skips the kernel's
/// frame-pointer walk of the user stack, which user space redoes from the
/// copy (framehop follows frame pointers where code has no tables). The
/// walk cost the target ~0.5 µs per sample and filled `STACKS` with
/// stacks nobody read, whose hash collisions then dropped the kernel
/// stacks that are read. A copy that fails after all (an unreadable
/// stack, rare) leaves the sample without native user frames.
#[inline(always)]
pub fn copy_expected(ctx: &PerfEventContext) -> bool {
    let max = unsafe { core::ptr::read_volatile(&STACK_COPY_BYTES) };
    if max == 0 {
        return false;
    }
    let regs = ctx.as_ptr() as *const u64;
    let at = |i: usize| unsafe { *regs.add(i) };
    (arch::is_user(at(arch::MODE)) && at(arch::SP) != 0)
        || unsafe { core::ptr::read_volatile(&USER_REGS_FROM_TASK) } != user_regs::NONE
}

/// Emits `sample` with a copy of the user stack and returns true, or
/// returns false (copy disabled, no user registers, unreadable stack) so
/// that the caller emits the plain sample. A full ring counts a CPU drop.
#[inline(always)]
pub fn emit_with_stack(ctx: &PerfEventContext, mut sample: SampleEvent, flags: u64) -> bool {
    let max = unsafe { core::ptr::read_volatile(&STACK_COPY_BYTES) } as usize;
    let py = unsafe { core::ptr::read_volatile(&PY) };
    if max == 0 && py.interp_head == 0 {
        return false;
    }
    let Some(buf) = STACK_BUF.get_ptr_mut(0) else {
        return false;
    };
    let py_count = forget(buf, read_python(&py, buf, sample.hdr.tid));
    // Direct context loads at constant offsets: the verifier rewrites them
    // to the sampled registers (a helper read of the context would read
    // `bpf_perf_event_data_kern`, not the registers).
    let regs = ctx.as_ptr() as *const u64;
    let at = |i: usize| unsafe { *regs.add(i) };
    let sampled = UserRegs {
        ip: at(arch::IP),
        sp: at(arch::SP),
        fp: at(arch::FP),
        lr: match arch::LR {
            Some(i) => at(i),
            None => 0,
        },
    };
    let user = if arch::is_user(at(arch::MODE)) && sampled.sp != 0 {
        Some(sampled)
    } else {
        task_user_regs()
    };
    sample.hdr.kind = SAMPLE_STACK;
    emit_copy(buf, sample, user, py_count, max, flags, drop_slot::CPU)
}

/// Returns `py_count` through the map value's memory, which the verifier
/// does not track: the count is then one unknown scalar, not one known
/// value per exit of the frame walk (0 to `MAX_PY_FRAMES`), so the copy
/// paths after it are verified once instead of 33 times (the off-CPU
/// program took 160-215 ms to verify for a Python target without this).
#[inline(always)]
fn forget(buf: *mut StackSample, py_count: u32) -> u32 {
    unsafe {
        core::ptr::write_volatile(&raw mut (*buf).hdr.py_count, py_count);
        core::ptr::read_volatile(&raw const (*buf).hdr.py_count)
    }
}

/// Fills `buf`'s header and emits it with a copy of the stack at `user`'s
/// sp, or with the Python frames alone; false when there was neither.
#[inline(always)]
fn emit_copy(
    buf: *mut StackSample,
    sample: SampleEvent,
    user: Option<UserRegs>,
    py_count: u32,
    max: usize,
    flags: u64,
    drop: u32,
) -> bool {
    let r = user.unwrap_or(UserRegs {
        ip: 0,
        sp: 0,
        fp: 0,
        lr: 0,
    });
    unsafe {
        (*buf).hdr = StackSampleHeader {
            sample,
            ip: r.ip,
            sp: r.sp,
            bp: r.fp,
            lr: r.lr,
            len: 0,
            py_count,
        };
    }
    let copied = user.is_some() && copy_stack(buf, r.sp, max, flags, drop);
    if copied {
        return true;
    }
    if py_count == 0 {
        return false;
    }
    // Python frames without a stack copy.
    unsafe {
        (*buf).hdr.ip = 0;
        (*buf).hdr.sp = 0;
        (*buf).hdr.bp = 0;
        (*buf).hdr.lr = 0;
    }
    let bytes = unsafe { core::slice::from_raw_parts(buf as *const u8, STACK_COPY_OFFSET) };
    if crate::EVENTS.output::<[u8]>(bytes, flags).is_err() {
        crate::count_drop(drop);
    }
    true
}

/// The last stack copy taken at a switch-out of a thread: when, and at
/// which place.
#[derive(Clone, Copy)]
#[repr(C)]
pub struct LastCopy {
    ts_ns: u64,
    ip: u64,
    sp: u64,
    user_stack: i32,
    kernel_stack: i32,
}

/// tid -> its last switch-out copy (LRU: threads come and go).
#[map]
static OFFCPU_LAST_COPY: LruHashMap<u32, LastCopy> =
    LruHashMap::with_max_entries(THREAD_MAPS_MIN, 0);

/// What a switch-out carries.
pub enum OffCpuCopy {
    /// No copy (no user registers on this kernel, copy off, or the ring a
    /// quarter full): the frame-pointer stack stands.
    None,
    /// A copy was emitted.
    Copied,
    /// The same place as the thread's last copy, less than
    /// `OFFCPU_COPY_EVERY_NS` ago: not copied, user space reuses that one.
    Repeat,
}

/// At the switch-out of target thread `tid` at `ts_ns` (while it is still
/// `current`): emits its user registers and stack copy (where the kernel
/// gives the registers, and not for a repeat of the last copied place) and
/// its Python frames, for user space to unwind and join to the
/// `OffCpuEvent` of the same thread and time, whose frame-pointer and
/// kernel stack ids these are.
#[inline(always)]
pub fn emit_offcpu_stack(
    tid: u32,
    ts_ns: u64,
    fp_stack: i32,
    kernel_stack: i32,
    flags: u64,
) -> OffCpuCopy {
    let max = unsafe { core::ptr::read_volatile(&STACK_COPY_BYTES) } as usize;
    let max = if max > OFFCPU_COPY_MAX {
        OFFCPU_COPY_MAX
    } else {
        max
    };
    let py = unsafe { core::ptr::read_volatile(&PY) };
    if max == 0 && py.interp_head == 0 {
        return OffCpuCopy::None;
    }
    let Some(buf) = STACK_BUF.get_ptr_mut(0) else {
        return OffCpuCopy::None;
    };
    let py_count = forget(buf, read_python(&py, buf, tid));
    let mut user = if max == 0 { None } else { task_user_regs() };
    let mut outcome = OffCpuCopy::None;
    if let Some(UserRegs { ip, sp, .. }) = user {
        let place = LastCopy {
            ts_ns,
            ip,
            sp,
            user_stack: fp_stack,
            kernel_stack,
        };
        let wake_bytes = unsafe { core::ptr::read_volatile(&crate::WAKE_BYTES) };
        if let Some(last) = unsafe { OFFCPU_LAST_COPY.get(&tid) }
            && last.ip == ip
            && last.sp == sp
            && last.user_stack == fp_stack
            && last.kernel_stack == kernel_stack
            && ts_ns.wrapping_sub(last.ts_ns) < OFFCPU_COPY_EVERY_NS
        {
            user = None;
            outcome = OffCpuCopy::Repeat;
        } else if crate::EVENTS.query(dynprof_common::ringbuf::AVAIL_DATA) >= wake_bytes {
            // The step events must get through.
            user = None;
        } else {
            let _ = OFFCPU_LAST_COPY.insert(&tid, &place, 0);
        }
    }
    if user.is_none() && py_count == 0 {
        return outcome;
    }
    let sample = SampleEvent {
        hdr: dynprof_common::EventHeader {
            kind: OFFCPU_STACK,
            tid,
            ts_ns,
        },
        user_stack: fp_stack,
        kernel_stack,
        cpu: 0,
        _pad: 0,
    };
    let copied = user.is_some();
    emit_copy(buf, sample, user, py_count, max, flags, drop_slot::OFFCPU);
    if copied { OffCpuCopy::Copied } else { outcome }
}

#[inline(always)]
fn read_u64(addr: u64) -> u64 {
    unsafe { aya_ebpf::helpers::bpf_probe_read_user(addr as *const u64) }.unwrap_or(0)
}

/// The current thread's id as the target sees it: in its PID namespace
/// when user space named one (`bpf_get_ns_current_pid_tgid`, 5.7), else
/// `tid`; 0 when the thread is not in that namespace.
#[inline(always)]
fn target_tid(py: &PyOffsets, tid: u32) -> u32 {
    if py.pidns_ino == 0 {
        return tid;
    }
    let mut info = aya_ebpf::bindings::bpf_pidns_info { pid: 0, tgid: 0 };
    let r = unsafe {
        generated::bpf_get_ns_current_pid_tgid(
            py.pidns_dev,
            py.pidns_ino,
            &mut info,
            core::mem::size_of::<aya_ebpf::bindings::bpf_pidns_info>() as u32,
        )
    };
    if r == 0 { info.pid } else { 0 }
}

/// The `PyThreadState` of thread `tid` (the target's id): the fast path's
/// when that is it (the GIL holder, a thread running bytecode), else from
/// the interpreter's thread list.
#[inline(always)]
fn thread_state(py: &PyOffsets, tid: u32) -> u64 {
    if py.tstate_current != 0 {
        let tstate = read_u64(py.tstate_current);
        if tstate != 0 && read_u64(tstate + py.tstate_native_thread_id) as u32 == tid {
            return tstate;
        }
    }
    let interp = read_u64(py.interp_head);
    if interp == 0 {
        return 0;
    }
    let mut t = read_u64(interp + py.interp_threads_head);
    for _ in 0..MAX_PY_THREADS {
        if t == 0 {
            return 0;
        }
        if read_u64(t + py.tstate_native_thread_id) as u32 == tid {
            return t;
        }
        t = read_u64(t + py.tstate_next);
    }
    0
}

/// Reads thread `tid`'s CPython frames into `buf.py`, innermost first;
/// returns how many. 0 for a thread without Python frames, or when no
/// interpreter was recognised.
#[inline(always)]
fn read_python(py: &PyOffsets, buf: *mut StackSample, tid: u32) -> u32 {
    if py.interp_head == 0 {
        return 0;
    }
    let read = read_u64;
    let tid = target_tid(py, tid);
    if tid == 0 {
        return 0;
    }
    let tstate = thread_state(py, tid);
    if tstate == 0 {
        return 0;
    }
    let mut frame = read(tstate + py.tstate_cframe);
    if py.flags & PY_FRAME_VIA_CFRAME != 0 {
        if frame == 0 {
            return 0;
        }
        frame = read(frame + py.cframe_current_frame);
    }
    let mut n = 0u32;
    for i in 0..MAX_PY_FRAMES {
        if frame == 0 {
            break;
        }
        let entry: u8 = unsafe {
            aya_ebpf::helpers::bpf_probe_read_user((frame + py.frame_is_entry) as *const u8)
        }
        .unwrap_or(0);
        let f = PyFrameRaw {
            code: read(frame + py.frame_code),
            instr: read(frame + py.frame_prev_instr),
            is_entry: entry as u32,
            _pad: 0,
            addr: frame,
        };
        unsafe { *(&raw mut (*buf).py).cast::<PyFrameRaw>().add(i) = f };
        n = i as u32 + 1;
        frame = read(frame + py.frame_previous);
    }
    n
}

/// Tries the stack copy from `STACK_COPY_MAX` down; true once one was
/// read and emitted.
#[inline(always)]
fn copy_stack(buf: *mut StackSample, sp: u64, max: usize, flags: u64, drop: u32) -> bool {
    if max >= STACK_COPY_MAX && copy::<STACK_COPY_MAX>(buf, sp, flags, drop) {
        return true;
    }
    if max >= 8192 && copy::<8192>(buf, sp, flags, drop) {
        return true;
    }
    if max >= 4096 && copy::<4096>(buf, sp, flags, drop) {
        return true;
    }
    if max >= 2048 && copy::<2048>(buf, sp, flags, drop) {
        return true;
    }
    max >= 1024 && copy::<1024>(buf, sp, flags, drop)
}

/// Copies `N` bytes from `sp` and emits header + copy; false when the read
/// fails (some page of the range is unmapped).
#[inline(always)]
fn copy<const N: usize>(buf: *mut StackSample, sp: u64, flags: u64, drop: u32) -> bool {
    let r = unsafe {
        generated::bpf_probe_read_user(
            (&raw mut (*buf).stack).cast(),
            N as u32,
            sp as *const core::ffi::c_void,
        )
    };
    if r != 0 {
        return false;
    }
    unsafe { (*buf).hdr.len = N as u32 };
    let bytes = unsafe { core::slice::from_raw_parts(buf as *const u8, STACK_COPY_OFFSET + N) };
    if crate::EVENTS.output::<[u8]>(bytes, flags).is_err() {
        crate::count_drop(drop);
    }
    true
}
