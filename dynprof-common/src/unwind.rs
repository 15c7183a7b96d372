//! The user-stack copy that the `cpu` program emits with a sample, so that
//! user space can unwind code built without frame pointers from its
//! `.eh_frame` (see `dynprof/src/symbols/unwind.rs` and docs/stacks.md).
use crate::SampleEvent;

/// Event kind of a [`StackSampleHeader`] record (after [`crate::kind`]'s).
pub const SAMPLE_STACK: u32 = 5;

/// The largest copy of the user stack taken per sample, in bytes. The
/// program tries this size first, then halves down to
/// [`STACK_COPY_MIN`]: `bpf_probe_read_user` fails as a whole when any
/// page of the range is unmapped, which happens when the sampled `sp` lies
/// closer than the copy size to the top of its stack mapping.
pub const STACK_COPY_MAX: usize = 16384;
/// The smallest copy tried before the sample is sent without one.
pub const STACK_COPY_MIN: usize = 1024;

/// Head of a stack-copy record; `len` bytes of the user stack, from `sp`
/// up, follow it in the ring record.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StackSampleHeader {
    /// `hdr.kind` is [`SAMPLE_STACK`]; the frame-pointer stack id stays in
    /// `user_stack`, the fast path when it is deep and agrees.
    pub sample: SampleEvent,
    /// User registers at the sample (x86-64: rip, rsp, rbp).
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    /// Bytes of stack that follow.
    pub len: u32,
    pub _pad: u32,
}

/// The per-CPU scratch record the program fills before emitting its first
/// `size_of::<StackSampleHeader>() + len` bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct StackSample {
    pub hdr: StackSampleHeader,
    pub stack: [u8; STACK_COPY_MAX],
}
