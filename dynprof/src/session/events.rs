//! Decoding ring-buffer records into the `dynprof-common` event structs.
use dynprof_common::{ApiEvent, EventHeader, OffCpuEvent, SampleEvent, StepEvent, kind};

#[derive(Clone, Copy, Debug)]
pub enum Decoded {
    Step(StepEvent),
    Api(ApiEvent),
    Sample(SampleEvent),
    OffCpu(OffCpuEvent),
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
        kind::OFFCPU => Decoded::OffCpu(read(b)?),
        _ => return None,
    })
}
