//! Decoding ring-buffer records into the `dynprof-common` event structs.
use dynprof_common::{
    ApiEvent, EventHeader, OffCpuEvent, SampleEvent, StepEvent, kind,
    unwind::{
        MAX_PY_FRAMES, OFFCPU_STACK, PyFrameRaw, SAMPLE_STACK, STACK_COPY_MAX, STACK_COPY_OFFSET,
        StackSampleHeader,
    },
};

use crate::symbols::unwind::UserRegs;

#[derive(Clone, Debug)]
pub enum Decoded {
    Step(StepEvent),
    Api(ApiEvent),
    Sample(SampleEvent),
    /// A CPU sample with a copy of its user stack (boxed: up to 16 KiB).
    SampleStack(Box<StackCopy>),
    OffCpu(OffCpuEvent),
    /// The stacks of a thread at its switch-out (`sample.hdr`: tid and
    /// switch-out time; `sample.user_stack`: the frame-pointer id), joined
    /// to the `OffCpu` event of the same tid and `ts_ns`.
    OffCpuStack(Box<StackCopy>),
}

/// A CPU sample or a switch-out with the user registers and the top of
/// the user stack.
#[derive(Clone)]
pub struct StackCopy {
    /// `hdr.kind` is `kind::SAMPLE` again; `user_stack` is the frame-pointer
    /// stack id.
    pub sample: SampleEvent,
    pub regs: UserRegs,
    /// The stack from `regs.sp` up; empty when only Python frames came
    /// (no user registers on this kernel, or an unreadable stack).
    pub stack: Vec<u8>,
    /// CPython frames read at the sample, innermost first.
    pub py: Vec<PyFrameRaw>,
}

impl std::fmt::Debug for StackCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StackCopy")
            .field("sample", &self.sample)
            .field("regs", &self.regs)
            .field("stack_bytes", &self.stack.len())
            .field("py_frames", &self.py.len())
            .finish()
    }
}

fn read<T: Copy>(b: &[u8]) -> Option<T> {
    (b.len() >= size_of::<T>()).then(|| unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<T>()) })
}

/// Returns None for a record too short for its kind (never trusted blindly).
pub fn decode(b: &[u8]) -> Option<Decoded> {
    let hdr: EventHeader = read(b)?;
    Some(match hdr.kind {
        kind::STEP => Decoded::Step(read(b)?),
        kind::API => Decoded::Api(read(b)?),
        kind::SAMPLE => Decoded::Sample(read(b)?),
        kind::OFFCPU | kind::OFFCPU_REPEAT => Decoded::OffCpu(read(b)?),
        OFFCPU_STACK => Decoded::OffCpuStack(Box::new(stack_copy(b)?)),
        SAMPLE_STACK => {
            let mut c = stack_copy(b)?;
            c.sample.hdr.kind = kind::SAMPLE;
            Decoded::SampleStack(Box::new(c))
        }
        _ => return None,
    })
}

/// A `SAMPLE_STACK` or `OFFCPU_STACK` record.
fn stack_copy(b: &[u8]) -> Option<StackCopy> {
    let h: StackSampleHeader = read(b)?;
    let len = (h.len as usize).min(STACK_COPY_MAX);
    Some(StackCopy {
        sample: h.sample,
        regs: UserRegs {
            ip: h.ip,
            sp: h.sp,
            bp: h.bp,
            lr: h.lr,
        },
        stack: b.get(STACK_COPY_OFFSET..)?.get(..len)?.to_vec(),
        py: py_frames(b, &h)?,
    })
}

/// The Python frames of a `SAMPLE_STACK` or `OFFCPU_STACK` record.
fn py_frames(b: &[u8], h: &StackSampleHeader) -> Option<Vec<PyFrameRaw>> {
    let py_bytes = b.get(size_of::<StackSampleHeader>()..STACK_COPY_OFFSET)?;
    Some(
        py_bytes
            .chunks_exact(size_of::<PyFrameRaw>())
            .take((h.py_count as usize).min(MAX_PY_FRAMES))
            .filter_map(read::<PyFrameRaw>)
            .collect(),
    )
}
