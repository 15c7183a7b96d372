//! The idle step log: how the step program reports a step without a
//! ring-buffer write.
//!
//! Most steps lie outside any window, and their only readers are the step
//! clock, live lines and metrics, which read them on the 100 ms tick anyway.
//! A ring-buffer record costs the probed thread ~70 ns (reserve + submit take
//! the ring's spinlock); an aligned 8-byte store into an mmap-able array
//! costs almost nothing. So a step hit that neither opens, closes nor leads
//! into a window, and falls outside one, is written only here, as one word
//! that user space reads through `mmap`. Steps that user space must act on
//! go through the ring buffer as before and leave their slot alone; the
//! reader keeps the two streams in step order by the step index that ring
//! events carry.
//!
//! Layout of the `STEP_LOG` array: word 0 is the reader's cursor (the next
//! step index it will read, written by user space only); word 1 is the tid
//! of the latest logged step hit (written by the kernel: no slot has room
//! for a tid, and here it costs no bpf(2) call, which kernels before 5.19
//! with `unprivileged_bpf_disabled` set refuse without CAP_BPF); word
//! `2 + (k mod LEN)` is the slot of step k. A slot is one word, written by one store, so
//! a reader never sees half of one (8-byte aligned stores are single-copy
//! atomic on x86-64 and arm64) and no ordering between words is needed:
//!
//! ```text
//! 63        51 50    45 44 .. 0
//! [ tag (13) ][ marker ][ ts_ns mod 2^45 ]
//! ```
//!
//! - `tag` is the lap plus one, (k / `LEN` + 1) mod 2^13: it tells the
//!   slot's current step from the one `LEN` steps before (not yet
//!   overwritten), and an all-zero slot (never written) from step k.
//! - `marker` is the step marker's index (`MAX_MARKERS` = 64 fits 6 bits).
//! - `ts_ns`: `bpf_ktime_get_ns` modulo 2^45 (9.8 hours): the reader
//!   restores the high bits from its own CLOCK_MONOTONIC, since it reads a
//!   slot within a tick or two of its write (a dynprof stopped for longer
//!   than 4.9 hours would misdate the steps logged before it stopped).
//!
//! The kernel logs a step only while fewer than `LEN / 2` steps are unread
//! (`k - cursor`); past that (a reader that stalls, or more than ~80,000
//! steps/s for a 100 ms tick) the step goes to the ring buffer without
//! touching its slot, so no unread slot is ever overwritten. 16,384 slots
//! are 128 KiB of kernel memory.

const LEN_BITS: u32 = 14;
/// Slots in the log (a power of two).
pub const LEN: u64 = 1 << LEN_BITS;
/// Entries of the `STEP_LOG` map: the cursor, the tid, then the slots.
pub const MAP_ENTRIES: u32 = 2 + LEN as u32;
/// Index of the reader's cursor.
pub const CURSOR: u32 = 0;
/// Index of the latest logged step hit's tid.
pub const LAST_TID: u32 = 1;
/// Unread steps past which the kernel writes to the ring buffer instead.
pub const MAX_UNREAD: u64 = LEN / 2;

const TS_BITS: u32 = 45;
const TS_MASK: u64 = (1 << TS_BITS) - 1;
const MARKER_SHIFT: u32 = 45;
const MARKER_MASK: u64 = 0x3f;
const TAG_SHIFT: u32 = 51;
const TAG_MASK: u64 = (1 << (64 - TAG_SHIFT)) - 1;

/// The map index of step `k`'s slot.
#[inline(always)]
pub fn slot_index(k: u64) -> u32 {
    2 + (k & (LEN - 1)) as u32
}

#[inline(always)]
fn tag(k: u64) -> u64 {
    ((k >> LEN_BITS) + 1) & TAG_MASK
}

/// Step `k`'s slot word.
#[inline(always)]
pub fn pack(k: u64, marker: u32, ts_ns: u64) -> u64 {
    (tag(k) << TAG_SHIFT) | ((marker as u64 & MARKER_MASK) << MARKER_SHIFT) | (ts_ns & TS_MASK)
}

/// What the reader finds in step `k`'s slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// Step k, logged here: its marker and its time mod 2^45.
    Logged { marker: u32, ts_low: u64 },
    /// The slot still holds an older step: step k has not been hit yet, or
    /// its event went to the ring buffer.
    Other,
}

#[inline(always)]
pub fn unpack(word: u64, k: u64) -> Slot {
    if (word >> TAG_SHIFT) & TAG_MASK != tag(k) {
        return Slot::Other;
    }
    Slot::Logged {
        marker: ((word >> MARKER_SHIFT) & MARKER_MASK) as u32,
        ts_low: word & TS_MASK,
    }
}

/// The full timestamp whose low 45 bits are `ts_low`, nearest to `now_ns`
/// (within ±4.9 hours: a slot is read a tick or two after its write, and
/// may be written just after `now_ns` was read).
pub fn restore_ts(ts_low: u64, now_ns: u64) -> u64 {
    let d = ts_low.wrapping_sub(now_ns) & TS_MASK;
    // Sign-extend the 45-bit difference.
    let d = ((d << (64 - TS_BITS)) as i64) >> (64 - TS_BITS);
    now_ns.wrapping_add(d as u64)
}
