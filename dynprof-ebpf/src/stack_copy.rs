//! The user-stack copy of a CPU sample: registers and the top of the user
//! stack, for user space to unwind code built without frame pointers from
//! `.eh_frame` (as `perf --call-graph dwarf` and samply do).
//!
//! Only samples taken in user mode are copied: in kernel mode the sampled
//! registers are the kernel's, and finding the user ones (`task_pt_regs`)
//! needs `bpf_task_pt_regs` (5.15) or BTF offsets; those samples keep their
//! frame-pointer stack. Helpers used: `bpf_probe_read_user` (5.5) and
//! `bpf_ringbuf_output` (5.8), so this loads on 5.10.
use aya_ebpf::{
    EbpfContext,
    helpers::generated,
    macros::map,
    maps::PerCpuArray,
    programs::PerfEventContext,
};
use dynprof_common::{
    SampleEvent, drop_slot,
    unwind::{SAMPLE_STACK, STACK_COPY_MAX, StackSample, StackSampleHeader},
};

/// Largest copy in bytes, set by user space at load: 0 disables the copy
/// (architectures other than x86-64, or `DYNPROF_STACK_COPY_KB=0`).
#[unsafe(no_mangle)]
static STACK_COPY_BYTES: u32 = 0;

/// Scratch record: too big for the 512-byte BPF stack.
#[map]
static STACK_BUF: PerCpuArray<StackSample> = PerCpuArray::with_max_entries(1, 0);

// x86-64 `struct pt_regs` word indices (arch/x86/include/asm/ptrace.h).
const RBP: usize = 4;
const RIP: usize = 16;
const CS: usize = 17;
const RSP: usize = 19;

/// Emits `sample` with a copy of the user stack and returns true, or
/// returns false (copy disabled, kernel-mode sample, unreadable stack) so
/// that the caller emits the plain sample. A full ring counts a CPU drop.
#[inline(always)]
pub fn emit_with_stack(ctx: &PerfEventContext, mut sample: SampleEvent, flags: u64) -> bool {
    let max = unsafe { core::ptr::read_volatile(&STACK_COPY_BYTES) } as usize;
    if max == 0 {
        return false;
    }
    // Direct context loads at constant offsets: the verifier rewrites them
    // to the sampled registers (a helper read of the context would read
    // `bpf_perf_event_data_kern`, not the registers).
    let regs = ctx.as_ptr() as *const u64;
    let (ip, sp, bp, cs) = unsafe {
        (
            *regs.add(RIP),
            *regs.add(RSP),
            *regs.add(RBP),
            *regs.add(CS),
        )
    };
    if cs & 3 != 3 || sp == 0 {
        return false;
    }
    let Some(buf) = STACK_BUF.get_ptr_mut(0) else {
        return false;
    };
    sample.hdr.kind = SAMPLE_STACK;
    unsafe {
        (*buf).hdr = StackSampleHeader {
            sample,
            ip,
            sp,
            bp,
            len: 0,
            _pad: 0,
        };
    }
    if max >= STACK_COPY_MAX && copy::<STACK_COPY_MAX>(buf, sp, flags) {
        return true;
    }
    if max >= 8192 && copy::<8192>(buf, sp, flags) {
        return true;
    }
    if max >= 4096 && copy::<4096>(buf, sp, flags) {
        return true;
    }
    if max >= 2048 && copy::<2048>(buf, sp, flags) {
        return true;
    }
    max >= 1024 && copy::<1024>(buf, sp, flags)
}

/// Copies `N` bytes from `sp` and emits header + copy; false when the read
/// fails (some page of the range is unmapped).
#[inline(always)]
fn copy<const N: usize>(buf: *mut StackSample, sp: u64, flags: u64) -> bool {
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
    let bytes = unsafe {
        core::slice::from_raw_parts(
            buf as *const u8,
            core::mem::size_of::<StackSampleHeader>() + N,
        )
    };
    if crate::EVENTS.output::<[u8]>(bytes, flags).is_err() {
        crate::count_drop(drop_slot::CPU);
    }
    true
}
