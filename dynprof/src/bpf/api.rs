//! A window's API probes: attaching and detaching them, and the target's
//! threads in `API_SLOTS` (see [`ApiSlot`]), where the probes find the
//! stacks of the threads that existed when they were attached without a
//! hash lookup.
use std::{num::NonZeroU32, os::fd::AsFd as _, path::Path};

use anyhow::{Context as _, Result};
use aya::{
    maps::{Array, HashMap as BpfHashMap},
    programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope},
};
use dynprof_common::{API_SLOTS_MAX, API_SLOTS_MIN, API_STACK_DEPTH, ApiFrame, ApiSlot, ApiStack};

use super::{API_ENTER_IP_PROG, API_ENTER_PROG, API_EXIT_PROG, API_EXIT_STACK_PROG, Kernel};
use crate::{compat::ProbeIdentity, sys::uprobe as sys_uprobe};

/// `API_SLOTS`' size for a target with `threads` threads at attach: 2 per
/// thread, a power of two, so that the threads' ids (mostly consecutive:
/// a job starts its threads together) rarely share a slot.
pub(super) fn api_slot_entries(threads: Option<u64>) -> u32 {
    let want = u32::try_from(threads.unwrap_or(0).saturating_mul(2)).unwrap_or(u32::MAX);
    want.checked_next_power_of_two()
        .unwrap_or(API_SLOTS_MAX)
        .clamp(API_SLOTS_MIN, API_SLOTS_MAX)
}

/// At most this many threads get a slot per window: each is a map write
/// when the probes attach and another when they are detached, on the
/// event loop ahead of a boundary (~1 µs each). A training process's
/// threads that call the runtime start early and have the lowest ids.
const MAX_GIVEN: usize = 512;

/// Which thread gets which of `slots` slots (a power of two), as
/// `(slot, tid)` by slot: a slot shared by several threads goes to the
/// lowest id (the main thread and the threads started with it, which
/// are the ones that call the runtime in a training job), and at most
/// `max` threads, the lowest ids, get one; the others use the hash.
fn slot_plan(tids: &[u32], slots: u32, max: usize) -> Vec<(u32, u32)> {
    debug_assert!(slots.is_power_of_two());
    let mut plan: Vec<(u32, u32)> = tids
        .iter()
        .filter(|&&t| t != 0)
        .map(|&t| (t & (slots - 1), t))
        .collect();
    plan.sort_unstable();
    plan.dedup_by_key(|p| p.0);
    if plan.len() > max {
        plan.sort_unstable_by_key(|p| p.1);
        plan.truncate(max);
        plan.sort_unstable();
    }
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
    /// Attaches entry and return probes of one runtime API (`api` = cookie).
    /// `object` is the library's path as the target sees it.
    pub fn attach_api(
        &mut self,
        api: u32,
        path: &Path,
        object: &str,
        file_offset: u64,
    ) -> Result<()> {
        if self.paths.probe_identity == ProbeIdentity::Address {
            return self.attach_api_by_address(api, path, object, file_offset);
        }
        let pid = NonZeroU32::new(self.pid.0).expect("non-zero pid");
        for (ret, name) in [(false, API_ENTER_PROG), (true, API_EXIT_PROG)] {
            let link = self.uprobe(name)?.attach(
                UProbeAttachPoint {
                    location: UProbeAttachLocation::AbsoluteOffset(file_offset),
                    cookie: Some(api as u64),
                },
                path,
                UProbeScope::OneProcess(pid),
            )?;
            self.api_links.push((ret, link));
        }
        Ok(())
    }

    /// [`Kernel::attach_api`] without attach cookies: the entry program
    /// finds the API by address, the return program pairs returns with
    /// entries on a per-thread stack.
    fn attach_api_by_address(
        &mut self,
        api: u32,
        path: &Path,
        object: &str,
        file_offset: u64,
    ) -> Result<()> {
        let addrs = self.register_addresses(
            "API_BY_IP",
            path,
            object,
            file_offset,
            api,
            self.api_addrs.len(),
        )?;
        self.api_addrs.extend(addrs);
        let entry = sys_uprobe::open_uprobe(path, file_offset, None, self.pid)?;
        let ret = sys_uprobe::open_uretprobe(path, file_offset, self.pid)?;
        let enter = self.uprobe(API_ENTER_IP_PROG)?.fd()?.as_fd();
        let a = sys_uprobe::attach_program(enter, entry, api as u64)?;
        self.api_attachments.push(a);
        let exit = self.uprobe(API_EXIT_STACK_PROG)?.fd()?.as_fd();
        let a = sys_uprobe::attach_program(exit, ret, api as u64)?;
        self.api_attachments.push(a);
        Ok(())
    }

    pub fn detach_apis(&mut self) {
        // Probes first: returns after this see none, so the stacks left by
        // calls in flight can be emptied for the next window without a
        // program refilling them meanwhile.
        self.api_attachments.clear();
        for (ret, link) in std::mem::take(&mut self.api_links) {
            let name = if ret { API_EXIT_PROG } else { API_ENTER_PROG };
            if let Ok(p) = self.uprobe(name) {
                let _ = p.detach(link);
            }
        }
        if !self.api_addrs.is_empty()
            && let Some(Ok(mut m)) = self
                .ebpf
                .map_mut("API_BY_IP")
                .map(BpfHashMap::<_, u64, u32>::try_from)
        {
            for a in std::mem::take(&mut self.api_addrs) {
                let _ = m.remove(&a);
            }
        }
        if let Some(Ok(mut m)) = self
            .ebpf
            .map_mut("API_STACK")
            .map(BpfHashMap::<_, u32, dynprof_common::ApiStack>::try_from)
        {
            let tids: Vec<u32> = m.keys().filter_map(|k| k.ok()).collect();
            for t in tids {
                let _ = m.remove(&t);
            }
        }
        self.clear_api_slots();
    }

    /// Gives the target's threads `tids` their slots, each with an empty
    /// stack; returns how many got one. Only while no API probe is
    /// attached (else nothing changes): then no program reads a slot as it
    /// changes, and no call in flight has its frame elsewhere.
    pub fn assign_api_slots(&mut self, tids: &[u32]) -> Result<usize> {
        if !self.api_links.is_empty() || !self.api_attachments.is_empty() {
            return Ok(0);
        }
        self.clear_api_slots();
        let plan = slot_plan(tids, self.api_slot_count, MAX_GIVEN);
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
        let plan = slot_plan(&[1064, 1001, 1000, 0, 1002], 64, 512);
        assert_eq!(plan, vec![(40, 1000), (41, 1001), (42, 1002)]);
        assert!(slot_plan(&[], 64, 512).is_empty());
    }

    /// A job's threads, started together, have consecutive ids: every one
    /// gets a slot.
    #[test]
    fn consecutive_threads_all_get_slots() {
        let tids: Vec<u32> = (40_000..40_000 + 100).collect();
        let slots = api_slot_entries(Some(100));
        let plan = slot_plan(&tids, slots, 512);
        assert_eq!(plan.len(), 100);
        assert!(plan.iter().all(|&(s, t)| s == t % slots));
    }

    /// Past the cap, the lowest ids keep their slots.
    #[test]
    fn at_most_max_threads_get_a_slot() {
        // 64 slots; 1000..1100: 1000..1063 each have their own slot, then
        // 1064.. share with them and lose.
        let tids: Vec<u32> = (1000..1100).rev().collect();
        let plan = slot_plan(&tids, 64, 10);
        let mut got: Vec<u32> = plan.iter().map(|p| p.1).collect();
        got.sort_unstable();
        assert_eq!(got, (1000..1010).collect::<Vec<_>>());
        assert!(
            plan.windows(2).all(|w| w[0].0 < w[1].0),
            "by slot: {plan:?}"
        );
    }
}
