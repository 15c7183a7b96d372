//! Reading the idle step log (`dynprof_common::steplog`): steps the kernel
//! wrote as one word each instead of a ring-buffer record.
//!
//! The session merges them with the ring buffer's events in step order:
//! before it hands on a ring event that carries a step index it reads the
//! log up to that step, and after each drain it reads as far as the kernel
//! has written. Deciding what a slot holds is pure ([`scan`]); this module
//! only adds the mapping and the cursor the kernel reads back.
use anyhow::{Context as _, Result};
use dynprof_common::steplog::{self, Slot};

use crate::sys::mapmem::MappedWords;

/// A step read from the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoggedStep {
    pub step: u64,
    pub marker: u32,
    /// CLOCK_MONOTONIC of the hit, as the ring's `ts_ns`.
    pub ts_ns: u64,
}

/// Reads slots from step `next` on: up to `limit` (exclusive), or, without
/// one, while the slots hold logged steps. Returns the new cursor.
///
/// A slot that does not hold its step went to the ring buffer, or has not
/// been hit yet. With a limit (a ring event for step `limit` or later has
/// been read) it is passed over: that step's event was read before, or was
/// lost (the ring was full: counted in `drops.step`), or a second thread
/// took the index and has not written it yet, which the step clock
/// tolerates as it tolerates two threads racing. Without one, it ends the
/// scan: its ring event may still be on its way, and the steps after it
/// must not overtake it.
fn scan(
    mut next: u64,
    limit: Option<u64>,
    word: impl Fn(u32) -> u64,
    now_ns: u64,
    out: &mut Vec<LoggedStep>,
) -> u64 {
    loop {
        if limit.is_some_and(|l| next >= l) {
            return next;
        }
        match steplog::unpack(word(steplog::slot_index(next)), next) {
            Slot::Logged { marker, ts_low } => out.push(LoggedStep {
                step: next,
                marker,
                ts_ns: steplog::restore_ts(ts_low, now_ns),
            }),
            Slot::Other if limit.is_some() => {}
            Slot::Other => return next,
        }
        next += 1;
    }
}

/// The mapped log and the reader's cursor.
pub struct StepLog {
    words: MappedWords,
    next: u64,
    /// The map's fd (the mapping alone would keep the map alive too).
    _map: aya::maps::MapData,
}

impl StepLog {
    pub(super) fn map(map: aya::maps::MapData) -> Result<StepLog> {
        use std::os::fd::AsFd as _;
        let words = MappedWords::map(map.fd().as_fd(), steplog::MAP_ENTRIES as usize)
            .context("mapping the step log (BPF_F_MMAPABLE array, Linux 5.5)")?;
        // Hit 1 begins step 1: nothing before it is ever written.
        words.store(steplog::CURSOR as usize, 1);
        Ok(StepLog {
            words,
            next: 1,
            _map: map,
        })
    }

    /// Appends to `out` the logged steps before `limit`, or all written so
    /// far, and tells the kernel how far it has read.
    pub fn read(&mut self, limit: Option<u64>, out: &mut Vec<LoggedStep>) {
        let now = crate::sys::clock::monotonic_ns();
        self.next = scan(self.next, limit, |i| self.words.load(i as usize), now, out);
        self.words.store(steplog::CURSOR as usize, self.next);
    }

    /// The tid of the latest logged step hit.
    pub fn last_tid(&self) -> u32 {
        self.words.load(steplog::LAST_TID as usize) as u32
    }

    /// A ring event that begins step `k` was read: appends to `out` the
    /// logged steps before it (they happened first), and marks the log
    /// done up to `k`.
    pub fn ring_step(&mut self, k: u64, out: &mut Vec<LoggedStep>) {
        self.read(Some(k), out);
        self.passed(k);
    }

    /// The log's steps up to `k` are done.
    fn passed(&mut self, k: u64) {
        if k >= self.next {
            self.next = k + 1;
            self.words.store(steplog::CURSOR as usize, self.next);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dynprof_common::steplog::{LEN, pack};

    const T0: u64 = 5_000_000_000_000;

    /// The log after steps `ks` were logged (the others went to the ring).
    fn log(ks: &[u64]) -> Vec<u64> {
        let mut v = vec![0u64; steplog::MAP_ENTRIES as usize];
        for &k in ks {
            v[steplog::slot_index(k) as usize] = pack(k, 3, T0 + k * 1000);
        }
        v
    }

    fn steps(out: &[LoggedStep]) -> Vec<u64> {
        out.iter().map(|s| s.step).collect()
    }

    #[test]
    fn reads_logged_steps_and_stops_at_one_still_in_the_ring() {
        let v = log(&[1, 2, 4]);
        let mut out = vec![];
        let next = scan(1, None, |i| v[i as usize], T0 + 10_000, &mut out);
        assert_eq!(steps(&out), [1, 2]);
        assert_eq!(next, 3, "step 4 must wait for step 3's ring event");
        assert_eq!(out[1].marker, 3);
        assert_eq!(out[1].ts_ns, T0 + 2000);
    }

    #[test]
    fn a_ring_event_releases_the_steps_before_it() {
        let v = log(&[1, 3]);
        let mut out = vec![];
        // The ring event of step 4 arrives; step 2's came before it.
        let next = scan(1, Some(4), |i| v[i as usize], T0, &mut out);
        assert_eq!(steps(&out), [1, 3]);
        assert_eq!(next, 4);
    }

    #[test]
    fn a_slot_of_the_previous_lap_is_not_read_as_this_step() {
        // Step LEN + 4 is written; LEN + 5's slot still holds step 5.
        let v = log(&[5, LEN + 4]);
        let mut out = vec![];
        let next = scan(LEN + 4, None, |i| v[i as usize], T0 + LEN * 1000, &mut out);
        assert_eq!(steps(&out), [LEN + 4]);
        assert_eq!(next, LEN + 5);
        // Nothing written at all: nothing read.
        let zero = vec![0u64; steplog::MAP_ENTRIES as usize];
        out.clear();
        assert_eq!(scan(1, None, |i| zero[i as usize], T0, &mut out), 1);
        assert!(out.is_empty());
    }

    #[test]
    fn reads_across_the_wrap_of_the_slots() {
        let ks: Vec<u64> = (LEN - 2..LEN + 3).collect();
        let v = log(&ks);
        let mut out = vec![];
        let next = scan(LEN - 2, None, |i| v[i as usize], T0 + LEN * 1000, &mut out);
        assert_eq!(steps(&out), (LEN - 2..LEN + 3).collect::<Vec<_>>());
        assert_eq!(next, LEN + 3);
    }

    #[test]
    fn timestamps_keep_their_high_bits_across_the_45_bit_wrap() {
        let wrap = 1u64 << 45;
        // Written just before the low bits wrapped, read just after.
        let ts = 7 * wrap - 500;
        let low = ts & (wrap - 1);
        assert_eq!(steplog::restore_ts(low, 7 * wrap + 2_000_000), ts);
        // Written just after `now` was read.
        assert_eq!(steplog::restore_ts((ts + 300) & (wrap - 1), ts), ts + 300);
        // Plain case.
        assert_eq!(
            steplog::restore_ts(12345, 3 * wrap + 99_999),
            3 * wrap + 12345
        );
    }
}
