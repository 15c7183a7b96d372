//! The target's threads in `API_SLOTS` (see [`ApiSlot`]): each window's
//! API probes find the stacks of the threads that existed when they were
//! attached in an array, without a hash lookup.
use anyhow::{Context as _, Result};
use aya::maps::Array;
use dynprof_common::{API_SLOTS_MAX, API_SLOTS_MIN, API_STACK_DEPTH, ApiFrame, ApiSlot, ApiStack};

use super::Kernel;

/// `API_SLOTS`' size for a target with `threads` threads at attach: 2 per
/// thread, a power of two, so that the threads' ids (mostly consecutive:
/// a job starts its threads together) rarely share a slot.
pub(super) fn api_slot_entries(threads: Option<u64>) -> u32 {
    let want = u32::try_from(threads.unwrap_or(0).saturating_mul(2)).unwrap_or(u32::MAX);
    want.checked_next_power_of_two()
        .unwrap_or(API_SLOTS_MAX)
        .clamp(API_SLOTS_MIN, API_SLOTS_MAX)
}

/// Which thread gets which of `slots` slots (a power of two), as
/// `(slot, tid)` by slot: a slot shared by several threads goes to the
/// lowest id (the main thread and the threads started with it, which
/// are the ones that call the runtime in a training job); the others use
/// the hash.
fn slot_plan(tids: &[u32], slots: u32) -> Vec<(u32, u32)> {
    debug_assert!(slots.is_power_of_two());
    let mut plan: Vec<(u32, u32)> = tids
        .iter()
        .filter(|&&t| t != 0)
        .map(|&t| (t & (slots - 1), t))
        .collect();
    plan.sort_unstable();
    plan.dedup_by_key(|p| p.0);
    plan
}

fn empty_slot(owner: u32) -> ApiSlot {
    let frame = ApiFrame {
        api: 0,
        in_window: 0,
        ts_ns: 0,
        sp: 0,
    };
    ApiSlot {
        owner,
        _pad: 0,
        stack: ApiStack {
            depth: 0,
            _pad: 0,
            frames: [frame; API_STACK_DEPTH],
        },
    }
}

impl Kernel {
    /// Gives the target's threads `tids` their slots, each with an empty
    /// stack; returns how many got one. Only while no API probe is
    /// attached (else nothing changes): then no program reads a slot as it
    /// changes, and no call in flight has its frame elsewhere.
    pub fn assign_api_slots(&mut self, tids: &[u32]) -> Result<usize> {
        if !self.api_links.is_empty() || !self.api_attachments.is_empty() {
            return Ok(0);
        }
        self.clear_api_slots();
        let plan = slot_plan(tids, self.api_slot_count);
        let mut slots: Array<_, ApiSlot> = Array::try_from(
            self.ebpf
                .map_mut("API_SLOTS")
                .context("the API_SLOTS map is missing")?,
        )?;
        for &(slot, tid) in &plan {
            slots
                .set(slot, empty_slot(tid), 0)
                .with_context(|| format!("writing API slot {slot}"))?;
            self.api_slots.push(slot);
        }
        Ok(plan.len())
    }

    /// Frees the slots [`Kernel::assign_api_slots`] gave (their threads
    /// may be gone by the next window, and their ids reused).
    pub(super) fn clear_api_slots(&mut self) {
        let taken = std::mem::take(&mut self.api_slots);
        if taken.is_empty() {
            return;
        }
        if let Some(Ok(mut slots)) = self
            .ebpf
            .map_mut("API_SLOTS")
            .map(Array::<_, ApiSlot>::try_from)
        {
            for slot in taken {
                let _ = slots.set(slot, empty_slot(0), 0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_for_two_per_thread() {
        assert_eq!(api_slot_entries(None), API_SLOTS_MIN);
        assert_eq!(api_slot_entries(Some(20)), API_SLOTS_MIN);
        assert_eq!(api_slot_entries(Some(33)), 128);
        assert_eq!(api_slot_entries(Some(1000)), 2048);
        assert_eq!(api_slot_entries(Some(1 << 40)), API_SLOTS_MAX);
    }

    #[test]
    fn a_shared_slot_goes_to_the_lowest_tid() {
        // 64 slots: 1000 and 1064 share slot 40, 1001 has 41; 0 is no thread.
        let plan = slot_plan(&[1064, 1001, 1000, 0, 1002], 64);
        assert_eq!(plan, vec![(40, 1000), (41, 1001), (42, 1002)]);
        assert!(slot_plan(&[], 64).is_empty());
    }

    /// A job's threads, started together, have consecutive ids: every one
    /// gets a slot.
    #[test]
    fn consecutive_threads_all_get_slots() {
        let tids: Vec<u32> = (40_000..40_000 + 100).collect();
        let slots = api_slot_entries(Some(100));
        let plan = slot_plan(&tids, slots);
        assert_eq!(plan.len(), 100);
        assert!(plan.iter().all(|&(s, t)| s == t % slots));
    }
}
