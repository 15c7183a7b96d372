//! Stack ids → symbolized stacks, shared by the `cpu` and `offcpu`
//! collectors.
//!
//! The kernel's `STACKS` map is global: both stack collectors store into
//! it and an identical stack gets the same id in both. Ids are read (and
//! symbolized) in `drain_into`; the map is emptied only when a stack
//! collector is armed while no stack collector holds unread ids, i.e. before
//! a new window's gate opens, so a long job never fills it up. Without that
//! a full map would drop new stacks (counted, never silent, but avoidable).
//!
//! Samples that came with a copy of the user stack are unwound from
//! `.eh_frame` as they arrive ([`StackStore::unwind`]) and get an id of
//! their own, at or above [`UNWOUND_BASE`], kept with the frame-pointer id
//! of the same sample: the unwound stack is used, continued by the
//! frame-pointer stack where that went on past the unwound stack's last
//! frame (the copy ended there, or a frame could not be unwound;
//! [`continue_with_fp`]).
//! CPython frames read at the same sample are named on arrival too and
//! spliced in where `_PyEval_EvalFrameDefault` runs (`symbols::python`).
use std::{cell::RefCell, collections::HashMap, rc::Rc};

use dynprof_common::{STACK_EMPTY, unwind::PyFrameRaw};

use super::symbolize::Symbolizer;
use crate::{
    bpf::Kernel,
    output::model::Stack,
    session::StackCopy,
    symbols::{
        python::{self, PyNames},
        unwind::{NativeUnwinder, Recovered, frame_holding},
    },
};

/// A stack built in user space: the sample's frame-pointer id, the
/// addresses unwound from its stack copy (leaf first; `None` without a
/// copy), its Python frames (innermost first, named, with `is_entry`) and,
/// per run of them, the leaf-first index of the native frame that runs it
/// where its shim frame told (`python::splice`).
#[derive(Clone, PartialEq, Eq, Hash)]
struct Unwound {
    fp_id: i32,
    ips: Option<Vec<u64>>,
    py: Vec<(String, bool)>,
    anchors: Vec<Option<usize>>,
}

/// First id of stacks unwound in user space (the kernel's ids stay below
/// the `STACKS` map's size).
pub const UNWOUND_BASE: i32 = 1 << 24;
/// Distinct unwound stacks kept between two clears (at ~1 KiB each, tens
/// of MiB at most); past it, samples keep their frame-pointer stack
/// (counted in `unwound_over_cap`).
const MAX_UNWOUND: usize = 1 << 16;

/// Which stack collector holds ids (bit mask).
pub const CPU: u8 = 1;
pub const OFFCPU: u8 = 2;

pub type SharedStacks = Rc<RefCell<StackStore>>;

#[derive(Default)]
pub struct StackStore {
    pid: Option<u32>,
    /// `--debug-dir`, for each target's symbolizer.
    debug_dirs: Vec<std::path::PathBuf>,
    sym: Option<Symbolizer>,
    user: HashMap<i32, Vec<String>>,
    kernel: HashMap<i32, Vec<String>>,
    /// (user id, kernel id) → the joined stack, shared by every event with
    /// those ids. Bounded by the distinct stacks in the kernel's map.
    joined: HashMap<(i32, i32), Stack>,
    holders: u8,
    /// Ids whose lookup failed although the kernel returned them (removed
    /// under us); reported as lost frames.
    pub lookup_failures: u64,
    /// Addresses read by `prefetch`, not yet symbolized into the caches:
    /// (is_kernel, id) → the kernel's lookup.
    raw: HashMap<(bool, i32), anyhow::Result<Vec<u64>>>,
    unwinder: NativeUnwinder,
    /// Unwound id - UNWOUND_BASE → its stack.
    unwound: Vec<Unwound>,
    unwound_ids: HashMap<Unwound, i32>,
    py_names: Option<PyNames>,
    /// Samples whose unwound stack was not kept ([`MAX_UNWOUND`]).
    pub unwound_over_cap: u64,
    /// Stack copies unwound, and the time it took (the cost per sample
    /// docs/stacks.md quotes; logged at debug level per window).
    pub unwind_count: u64,
    pub unwind_time: std::time::Duration,
}

impl StackStore {
    pub fn shared(debug_dirs: Vec<std::path::PathBuf>) -> SharedStacks {
        Rc::new(RefCell::new(StackStore {
            debug_dirs,
            ..StackStore::default()
        }))
    }

    /// A stack collector is being armed for the target `pid`.
    pub fn acquire(&mut self, who: u8, kernel: &mut Kernel, pid: u32) {
        if self.holders == 0 {
            match kernel.clear_stacks() {
                Ok(n) if n > 0 => {
                    log::debug!("stacks: cleared {n} stack-map entries before arming")
                }
                Ok(_) => {}
                Err(e) => log::warn!("stacks: could not clear the stack map: {e:#}"),
            }
            self.user.clear();
            self.kernel.clear();
            self.joined.clear();
            self.raw.clear();
            self.unwound.clear();
            self.unwound_ids.clear();
        }
        if self.pid != Some(pid) {
            self.pid = Some(pid);
            self.unwinder = NativeUnwinder::new();
            self.py_names = None;
            self.sym = match Symbolizer::new(pid, &self.debug_dirs) {
                Ok(s) => Some(s),
                Err(e) => {
                    log::warn!("stacks: no symbolizer for PID {pid}: {e:#}");
                    None
                }
            };
        }
        self.holders |= who;
    }

    /// Files some frame was named in only by offset (`modules.json`).
    pub fn unresolved_modules(&self) -> Vec<crate::output::model::ModuleRef> {
        self.sym
            .as_ref()
            .map(|s| s.unresolved_modules())
            .unwrap_or_default()
    }

    /// The collector `who` holds no unread stack ids any more.
    pub fn release(&mut self, who: u8) {
        self.holders &= !who;
    }

    /// Unwinds a sample's stack copy and returns the user stack id to
    /// record for it (an unwound id, or its frame-pointer id when nothing
    /// could be unwound).
    pub fn unwind(&mut self, copy: &StackCopy) -> i32 {
        let fp_id = copy.sample.user_stack;
        let t0 = std::time::Instant::now();
        let unwound = match &mut self.sym {
            Some(sym) if !copy.stack.is_empty() => Some(self.unwinder.unwind(
                copy.regs,
                &copy.stack,
                |a| sym.unwind_lookup(a),
            ))
            .filter(|v| !v.ips.is_empty()),
            _ => None,
        };
        let (py, shims) = self.name_python(&copy.py);
        let anchors = match &unwound {
            Some(u) => shims.iter().map(|&a| frame_holding(&u.sps, a)).collect(),
            None => Vec::new(),
        };
        self.unwind_time += t0.elapsed();
        self.unwind_count += 1;
        self.intern(Unwound {
            fp_id,
            ips: unwound.map(|u| u.ips),
            py,
            anchors,
        })
    }

    /// Callers recovered without tables since the last call (for the
    /// per-window debug line).
    pub fn take_recovered(&mut self) -> Recovered {
        self.unwinder.take_recovered()
    }

    /// The named frames, and the addresses of the shims that end their
    /// runs (3.12+).
    fn name_python(&mut self, py: &[PyFrameRaw]) -> (Vec<(String, bool)>, Vec<u64>) {
        if py.is_empty() {
            return (Vec::new(), Vec::new());
        }
        let pid = self.pid.unwrap_or(0);
        let names = self.py_names.get_or_insert_with(|| PyNames::new(pid));
        names.frames_and_shims(py)
    }

    fn intern(&mut self, key: Unwound) -> i32 {
        let fp_id = key.fp_id;
        if key.ips.is_none() && key.py.is_empty() {
            return fp_id;
        }
        if let Some(id) = self.unwound_ids.get(&key) {
            return *id;
        }
        if self.unwound.len() >= MAX_UNWOUND {
            self.unwound_over_cap += 1;
            return fp_id;
        }
        let id = UNWOUND_BASE + self.unwound.len() as i32;
        self.unwound.push(key.clone());
        self.unwound_ids.insert(key, id);
        id
    }

    /// Reads every not yet known stack of `ids` (user id, kernel id) from the
    /// kernel, then symbolizes all their addresses in one batch, so that
    /// the `stack` calls that follow are cache hits.
    pub fn prefetch(&mut self, kernel: &Kernel, ids: impl IntoIterator<Item = (i32, i32)>) {
        for (u, k) in ids {
            let u = match self.unwound_entry(u) {
                Some(e) => e.fp_id,
                None => u,
            };
            for (id, is_kernel) in [(u, false), (k, true)] {
                let cached = if is_kernel { &self.kernel } else { &self.user };
                if id < 0 || cached.contains_key(&id) || self.raw.contains_key(&(is_kernel, id)) {
                    continue;
                }
                self.raw.insert((is_kernel, id), kernel.stack(id as u32));
            }
        }
        let Some(sym) = &mut self.sym else { return };
        let pick = |want: bool| -> Vec<&[u64]> {
            self.raw
                .iter()
                .filter(|((is_kernel, _), _)| *is_kernel == want)
                .filter_map(|(_, r)| r.as_ref().ok().map(Vec::as_slice))
                .collect()
        };
        let (mut user, kern) = (pick(false), pick(true));
        user.extend(self.unwound.iter().filter_map(|e| e.ips.as_deref()));
        sym.warm(&user, &kern);
    }

    fn unwound_entry(&self, id: i32) -> Option<&Unwound> {
        let i = id.checked_sub(UNWOUND_BASE)?;
        self.unwound.get(usize::try_from(i).ok()?)
    }

    /// The addresses of an unwound id, continued by its frame-pointer
    /// stack where that went on past the unwound one's last frame
    /// ([`continue_with_fp`]).
    fn unwound_addresses(&mut self, kernel: &Kernel, id: i32) -> Option<Vec<u64>> {
        let e = self.unwound_entry(id)?;
        let (fp_id, ips) = (e.fp_id, e.ips.clone().unwrap_or_default());
        if fp_id >= 0 {
            let fp = match self.raw.remove(&(false, fp_id)) {
                Some(r) => r,
                None => kernel.stack(fp_id as u32),
            };
            if let Ok(fp) = &fp
                && let Some(joined) = continue_with_fp(&ips, fp)
            {
                return Some(joined);
            }
            self.raw.insert((false, fp_id), fp);
        }
        Some(ips)
    }

    /// The stack of one event: user frames root first, then the kernel
    /// frames (suffixed `_[k]`) root first, as flame graphs draw them.
    pub fn stack(&mut self, kernel: &Kernel, user_id: i32, kernel_id: i32) -> Stack {
        if let Some(s) = self.joined.get(&(user_id, kernel_id)) {
            return s.clone();
        }
        let mut out = self.part(kernel, user_id, false);
        out.extend(self.part(kernel, kernel_id, true));
        if out.is_empty() {
            out.push("[unknown]".to_string());
        }
        let s: Stack = out.into();
        self.joined.insert((user_id, kernel_id), s.clone());
        s
    }

    fn part(&mut self, kernel: &Kernel, id: i32, is_kernel: bool) -> Vec<String> {
        let lost = || {
            if is_kernel {
                "[lost kernel stack]_[k]"
            } else {
                "[lost user stack]"
            }
            .to_string()
        };
        if id == STACK_EMPTY {
            return Vec::new();
        }
        if id < 0 {
            // Counted by the kernel in the *_STACK drop slot.
            return vec![lost()];
        }
        let cache = if is_kernel { &self.kernel } else { &self.user };
        if let Some(s) = cache.get(&id) {
            return s.clone();
        }
        let lookup = match self.raw.remove(&(is_kernel, id)) {
            Some(r) => r,
            None if !is_kernel && id >= UNWOUND_BASE => self
                .unwound_addresses(kernel, id)
                .ok_or_else(|| anyhow::anyhow!("unwound stack id {id} is unknown")),
            None => kernel.stack(id as u32),
        };
        // User frames as leaf-first groups (one per address: a function
        // and what was inlined into it there), for `python::splice`.
        let mut groups: Vec<Vec<String>> = match lookup {
            Ok(ips) => match &mut self.sym {
                Some(sym) if is_kernel => sym
                    .kernel_stack(&ips)
                    .into_iter()
                    .rev()
                    .map(|f| vec![f])
                    .collect(),
                Some(sym) => sym.user_groups(&ips),
                None => ips
                    .iter()
                    .take_while(|&&ip| ip != 0)
                    .map(|ip| vec![format!("{ip:#x}")])
                    .collect(),
            },
            Err(e) => {
                log::debug!("stacks: id {id}: {e:#}");
                self.lookup_failures += 1;
                vec![vec![lost()]]
            }
        };
        let frames = match self.unwound_entry(id).filter(|_| !is_kernel) {
            Some(e) => {
                // Nothing unwound and the walk's stack lost (a `STACKS`
                // bucket taken, counted in the `*_stack` drops): the
                // sample's Python frames stand on a marked loss, not on
                // nothing.
                if groups.is_empty()
                    && e.ips.as_ref().is_none_or(Vec::is_empty)
                    && e.fp_id < 0
                    && e.fp_id != STACK_EMPTY
                {
                    groups.push(vec![lost()]);
                }
                if e.py.is_empty() {
                    groups.into_iter().rev().flatten().collect()
                } else {
                    python::splice(groups, &e.py, &e.anchors)
                }
            }
            None => groups.into_iter().rev().flatten().collect(),
        };
        let cache = if is_kernel {
            &mut self.kernel
        } else {
            &mut self.user
        };
        cache.insert(id, frames.clone());
        frames
    }
}

/// The unwound stack `ips` (leaf first) continued by the frame-pointer
/// stack `fp` of the same sample, where `fp` holds the unwound stack's
/// last frame and goes on past it, or `fp` itself where nothing was
/// unwound; `None` where neither holds.
///
/// The unwinding stops where the stack copy ends (a deep stack) or where
/// a frame cannot be unwound; the kernel's frame-pointer walk covers the
/// whole stack but skips or garbles frames in code without frame records.
/// So the unwound frames are kept, and the walk's frames are taken only
/// from the point where both stacks met: its entry of the unwound stack's
/// last address. On arm64 the two rarely agree from the leaf (a leaf
/// function keeps its return address in x30, which the walk never sees),
/// so agreeing on a prefix, as on x86-64, is not required. Under recursion
/// the last address may occur several times: its n-th occurrence in `fp`
/// is taken, n being its count in `ips` (the walk may skip a frame, never
/// add one).
pub fn continue_with_fp(ips: &[u64], fp: &[u64]) -> Option<Vec<u64>> {
    let fp = &fp[..fp.iter().position(|&ip| ip == 0).unwrap_or(fp.len())];
    let Some((&last, _)) = ips.split_last() else {
        // Nothing unwound (no copy: only Python frames were read): the
        // walk is the native stack.
        return (!fp.is_empty()).then(|| fp.to_vec());
    };
    let nth = ips.iter().filter(|&&a| a == last).count();
    let at = fp
        .iter()
        .enumerate()
        .filter(|(_, a)| **a == last)
        .nth(nth - 1)
        .map(|(i, _)| i)?;
    let tail = &fp[at + 1..];
    if tail.is_empty() {
        return None;
    }
    Some(ips.iter().chain(tail).copied().collect())
}

/// Host tid → thread name, read from /proc the first time a tid is seen
/// (short-lived threads are gone by the time a window is written).
#[derive(Default)]
pub struct ThreadNames {
    pid: u32,
    names: HashMap<u32, String>,
}

impl ThreadNames {
    pub fn set_pid(&mut self, pid: u32) {
        if self.pid != pid {
            self.pid = pid;
            self.names.clear();
        }
    }

    pub fn saw(&mut self, tid: u32) {
        if self.pid == 0 || self.names.contains_key(&tid) {
            return;
        }
        let name = std::fs::read_to_string(format!("/proc/{}/task/{tid}/comm", self.pid))
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        self.names.insert(tid, name);
    }

    /// Adds the names of `tids` that `names` lacks.
    pub fn fill(&self, names: &mut Vec<(u32, String)>, tids: impl IntoIterator<Item = u32>) {
        for tid in tids {
            if names.iter().any(|(t, _)| *t == tid) {
                continue;
            }
            if let Some(n) = self.names.get(&tid).filter(|n| !n.is_empty()) {
                names.push((tid, n.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::continue_with_fp;

    #[test]
    fn an_unwound_prefix_of_the_walk_takes_its_deeper_frames() {
        // x86-64: both agree from the leaf; the copy ended after 3 frames.
        let fp = [1, 2, 3, 4, 5, 0, 0];
        assert_eq!(continue_with_fp(&[1, 2, 3], &fp), Some(vec![1, 2, 3, 4, 5]));
    }

    #[test]
    fn the_walk_continues_from_where_it_met_the_unwound_stack() {
        // arm64: the walk missed the leaf's caller (0x20, held in x30) and
        // garbled nothing after; the unwound stack stopped at 0x40.
        let ips = [0x10, 0x20, 0x30, 0x40];
        let fp = [0x10, 0x30, 0x40, 0x50, 0x60];
        assert_eq!(
            continue_with_fp(&ips, &fp),
            Some(vec![0x10, 0x20, 0x30, 0x40, 0x50, 0x60])
        );
    }

    #[test]
    fn no_meeting_point_or_nothing_past_it_keeps_the_unwound_stack() {
        // The walk never reached the unwound stack's last frame: its
        // frames are not known to belong above it.
        assert_eq!(continue_with_fp(&[1, 2, 3], &[1, 7, 8, 9]), None);
        // The walk ended where the unwinding did.
        assert_eq!(continue_with_fp(&[1, 2, 3], &[1, 3, 0]), None);
    }

    #[test]
    fn nothing_unwound_takes_the_whole_walk() {
        // A sample with Python frames but no copy (DYNPROF_STACK_COPY_KB=0):
        // its native frames are the walk's.
        assert_eq!(continue_with_fp(&[], &[1, 2, 0]), Some(vec![1, 2]));
        assert_eq!(continue_with_fp(&[], &[0, 0]), None);
    }

    #[test]
    fn under_recursion_the_matching_occurrence_is_taken() {
        // f (0xf) recursed: the copy held two of its frames, the walk all
        // three. The tail starts after the walk's second one.
        let ips = [1, 0xf, 0xf];
        let fp = [1, 0xf, 0xf, 0xf, 0x99];
        assert_eq!(
            continue_with_fp(&ips, &fp),
            Some(vec![1, 0xf, 0xf, 0xf, 0x99])
        );
        // The walk holds fewer occurrences than the copy: no meeting point.
        assert_eq!(continue_with_fp(&ips, &[1, 0xf, 0x99]), None);
    }
}
