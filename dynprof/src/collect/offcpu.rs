//! The `offcpu` collector: how long each target thread was off-CPU, and
//! where, from `sched:sched_switch`.
//!
//! The kernel filters to the target and to the window gate at switch-out,
//! records the time and the stacks (taken while the thread is still
//! `current`), and emits one [`OffCpuEvent`] when the thread is switched
//! back in. In `drain_into`, intervals that began in the recorded steps are
//! kept and clipped at the window's end; threads still off-CPU then (a
//! worker blocked across the boundary) are read from the kernel's
//! in-flight map, so their time inside the window is not lost.
//!
//! Events wait in a bounded [`EventBuf`] (spilled to an unnamed file past a
//! small chunk, capped by the window's memory budget), so a dense window
//! does not grow dynprof's memory.
use std::collections::HashMap;

use anyhow::Result;
use dynprof_common::OffCpuEvent;

use super::{
    Collector, WindowInfo,
    builtin::DropBase,
    spill::{EventBuf, EventPool},
    stacks::{self, SharedStacks, ThreadNames},
};
use crate::{
    bpf::Kernel,
    output::model::{OffCpuSpan, WindowData},
    session::Decoded,
    target::Target,
    types::Builtin,
};

pub struct OffCpuCollector {
    store: SharedStacks,
    events: EventBuf<OffCpuEvent>,
    /// Intervals still in flight when the window was sealed (one per
    /// blocked thread at most), with their duration clipped to the end.
    in_flight: Vec<OffCpuEvent>,
    /// `seal` ran for the window being drained.
    sealed: bool,
    armed: bool,
    names: ThreadNames,
    drops: DropBase,
    /// The user stack id unwound (and joined to Python frames) from a
    /// switch-out's stack copy, by (tid, switch-out time), until the
    /// interval's event arrives (or the window is sealed).
    unwound: HashMap<(u32, u64), i32>,
    /// Per thread: the stack unwound from its last switch-out with a stack
    /// copy. The kernel copies a thread blocking again and again at one
    /// place only every `OFFCPU_COPY_EVERY_NS`, and marks the switch-outs
    /// in between (`kind::OFFCPU_REPEAT`): they get this stack.
    last_copy: HashMap<u32, i32>,
}

/// Switch-outs whose stacks wait for their interval at most; past it
/// (intervals lost, or never ended) the oldest are forgotten.
const MAX_PENDING: usize = 65536;

impl OffCpuCollector {
    pub fn new(store: SharedStacks, pool: EventPool) -> Self {
        Self {
            store,
            events: EventBuf::new(pool),
            in_flight: Vec::new(),
            sealed: false,
            armed: false,
            names: ThreadNames::default(),
            drops: DropBase::default(),
            unwound: HashMap::new(),
            last_copy: HashMap::new(),
        }
    }

    /// The event with the user stack unwound at its switch-out, if one was;
    /// for a repeat of its thread's last copied place, that copy's stack.
    fn join_unwound(&mut self, mut e: OffCpuEvent) -> OffCpuEvent {
        let repeat = e.hdr.kind == dynprof_common::kind::OFFCPU_REPEAT;
        e.hdr.kind = dynprof_common::kind::OFFCPU;
        if let Some(id) = self.unwound.remove(&(e.hdr.tid, e.hdr.ts_ns)) {
            e.user_stack = id;
        } else if repeat && let Some(&id) = self.last_copy.get(&e.hdr.tid) {
            e.user_stack = id;
        }
        e
    }

    fn update_hold(&mut self) {
        if !self.armed && self.events.is_empty() {
            self.store.borrow_mut().release(stacks::OFFCPU);
        }
    }
}

impl Collector for OffCpuCollector {
    fn kind(&self) -> Builtin {
        Builtin::Offcpu
    }

    fn arm(&mut self, kernel: &mut Kernel, target: &Target) -> Result<()> {
        self.names.set_pid(target.host_pid.0);
        self.drops.arm(kernel);
        // Stack ids may not outlive the store's next clearing.
        self.last_copy.clear();
        self.store
            .borrow_mut()
            .acquire(stacks::OFFCPU, kernel, target.host_pid.0);
        if let Err(e) = kernel.attach_offcpu() {
            self.update_hold();
            return Err(e);
        }
        self.armed = true;
        Ok(())
    }

    fn disarm(&mut self, kernel: &mut Kernel) {
        kernel.detach_offcpu();
        self.armed = false;
        self.drops.disarm();
        self.update_hold();
    }

    fn window_opened(&mut self, w: &WindowInfo) {
        self.events.set_spill_dir(&w.dir);
    }

    fn on_event(&mut self, ev: &Decoded) {
        match ev {
            Decoded::OffCpu(o) => {
                self.names.saw(o.hdr.tid);
                let o = self.join_unwound(*o);
                self.events.push(o);
            }
            Decoded::OffCpuStack(copy) => {
                if self.unwound.len() >= MAX_PENDING {
                    let oldest = self.unwound.keys().map(|k| k.1).min().unwrap_or(0);
                    self.unwound.retain(|k, _| k.1 > oldest);
                }
                // Unwound now, while the copy is at hand: only the id waits.
                let id = self.store.borrow_mut().unwind(copy);
                let h = copy.sample.hdr;
                if !copy.stack.is_empty() {
                    if self.last_copy.len() >= MAX_PENDING {
                        self.last_copy.clear();
                    }
                    self.last_copy.insert(h.tid, id);
                }
                // A repeat's record holds Python frames only: its native
                // stack is the last copy's.
                self.unwound.insert((h.tid, h.ts_ns), id);
            }
            _ => {}
        }
    }

    fn seal(&mut self, start_ts_ns: u64, end_ts_ns: u64, kernel: &mut Kernel) {
        self.in_flight.clear();
        self.sealed = true;
        // Still off-CPU: the switch-in has not happened (or not been read).
        if self.armed {
            match kernel.offcpu_pending() {
                Ok(pending) => {
                    for (tid, rec) in pending {
                        if rec.ts_ns < start_ts_ns || rec.ts_ns >= end_ts_ns {
                            continue;
                        }
                        let e = OffCpuEvent {
                            hdr: dynprof_common::EventHeader {
                                kind: dynprof_common::kind::OFFCPU,
                                tid,
                                ts_ns: rec.ts_ns,
                            },
                            dur_ns: end_ts_ns - rec.ts_ns,
                            user_stack: rec.user_stack,
                            kernel_stack: rec.kernel_stack,
                            runnable: rec.runnable,
                            _pad: 0,
                        };
                        // Kept: the interval's own event comes later.
                        let id = self.unwound.get(&(tid, rec.ts_ns)).copied().or_else(|| {
                            (rec.repeat != 0)
                                .then(|| self.last_copy.get(&tid).copied())
                                .flatten()
                        });
                        let e = match id {
                            Some(id) => OffCpuEvent {
                                user_stack: id,
                                ..e
                            },
                            None => e,
                        };
                        self.in_flight.push(e);
                    }
                }
                Err(e) => log::debug!("offcpu: reading in-flight intervals: {e:#}"),
            }
        }
    }

    fn drain_into(
        &mut self,
        start_ts_ns: u64,
        end_ts_ns: u64,
        data: &mut WindowData,
        kernel: &mut Kernel,
    ) -> Result<()> {
        if !self.sealed {
            self.seal(start_ts_ns, end_ts_ns, kernel);
        }
        self.sealed = false;
        let d = self.drops.take(kernel);
        data.drops.offcpu = d.offcpu;
        data.drops.offcpu_stack = d.offcpu_stack;
        let taken = self.events.take_window(start_ts_ns, end_ts_ns);
        let taken = match taken {
            Ok(t) => t,
            Err(e) => {
                self.update_hold();
                return Err(e);
            }
        };
        super::builtin::note_budget(data, self.events.pool(), |o| o.offcpu = taken.over_budget);
        let mut evs = taken.events;
        for p in std::mem::take(&mut self.in_flight) {
            if !evs
                .iter()
                .any(|e| e.hdr.tid == p.hdr.tid && e.hdr.ts_ns == p.hdr.ts_ns)
            {
                evs.push(p);
            }
        }
        self.names
            .fill(&mut data.thread_names, evs.iter().map(|e| e.hdr.tid));
        data.offcpu.reserve_exact(evs.len());
        {
            let mut store = self.store.borrow_mut();
            store.prefetch(kernel, evs.iter().map(|e| (e.user_stack, e.kernel_stack)));
            for e in evs {
                let dur_ns = e.dur_ns.min(end_ts_ns - e.hdr.ts_ns);
                let stack = store.stack(kernel, e.user_stack, e.kernel_stack);
                data.offcpu.push(OffCpuSpan {
                    tid: e.hdr.tid,
                    ts_ns: e.hdr.ts_ns,
                    dur_ns,
                    stack,
                    runnable: e.runnable != 0,
                });
            }
        }
        data.offcpu.sort_unstable_by_key(|s| (s.ts_ns, s.tid));
        crate::output::model::ModuleRef::merge(
            &mut data.modules,
            self.store.borrow().unresolved_modules(),
        );
        self.update_hold();
        Ok(())
    }
}
