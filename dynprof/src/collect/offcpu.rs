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
use anyhow::Result;
use dynprof_common::OffCpuEvent;

use super::{
    Collector,
    builtin::{DropBase, take_window},
    stacks::{self, SharedStacks, ThreadNames},
};
use crate::{
    bpf::Kernel,
    output::model::{OffCpuSpan, WindowData},
    session::Decoded,
    target::Target,
};

pub struct OffCpuCollector {
    store: SharedStacks,
    events: Vec<OffCpuEvent>,
    armed: bool,
    names: ThreadNames,
    drops: DropBase,
}

impl OffCpuCollector {
    pub fn new(store: SharedStacks) -> Self {
        Self {
            store,
            events: Vec::new(),
            armed: false,
            names: ThreadNames::default(),
            drops: DropBase::default(),
        }
    }

    fn update_hold(&mut self) {
        if !self.armed && self.events.is_empty() {
            self.store.borrow_mut().release(stacks::OFFCPU);
        }
    }
}

impl Collector for OffCpuCollector {
    fn name(&self) -> &'static str {
        "offcpu"
    }

    fn arm(&mut self, kernel: &mut Kernel, target: &Target) -> Result<()> {
        self.names.set_pid(target.host_pid.0);
        self.drops.arm(kernel);
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

    fn on_event(&mut self, ev: &Decoded) {
        if let Decoded::OffCpu(o) = ev {
            self.names.saw(o.hdr.tid);
            self.events.push(*o);
        }
    }

    fn drain_into(
        &mut self,
        start_ts_ns: u64,
        end_ts_ns: u64,
        data: &mut WindowData,
        kernel: &mut Kernel,
    ) -> Result<()> {
        let d = self.drops.take(kernel);
        data.drops.offcpu = d.offcpu;
        data.drops.offcpu_stack = d.offcpu_stack;
        let mut evs = take_window(&mut self.events, start_ts_ns, end_ts_ns, |e| e.hdr.ts_ns);
        // Still off-CPU: the switch-in has not happened (or not been read).
        if self.armed {
            match kernel.offcpu_pending() {
                Ok(pending) => {
                    for (tid, rec) in pending {
                        if rec.ts_ns < start_ts_ns || rec.ts_ns >= end_ts_ns {
                            continue;
                        }
                        if evs
                            .iter()
                            .any(|e| e.hdr.tid == tid && e.hdr.ts_ns == rec.ts_ns)
                        {
                            continue;
                        }
                        evs.push(OffCpuEvent {
                            hdr: dynprof_common::EventHeader {
                                kind: dynprof_common::kind::OFFCPU,
                                tid,
                                ts_ns: rec.ts_ns,
                            },
                            dur_ns: end_ts_ns - rec.ts_ns,
                            user_stack: rec.user_stack,
                            kernel_stack: rec.kernel_stack,
                        });
                    }
                }
                Err(e) => log::debug!("offcpu: reading in-flight intervals: {e:#}"),
            }
        }
        {
            let mut store = self.store.borrow_mut();
            store.prefetch(kernel, evs.iter().map(|e| (e.user_stack, e.kernel_stack)));
            for e in &evs {
                let dur_ns = e.dur_ns.min(end_ts_ns - e.hdr.ts_ns);
                let stack = store.stack(kernel, e.user_stack, e.kernel_stack);
                data.offcpu.push(OffCpuSpan {
                    tid: e.hdr.tid,
                    ts_ns: e.hdr.ts_ns,
                    dur_ns,
                    stack,
                });
            }
        }
        data.offcpu.sort_by_key(|s| (s.ts_ns, s.tid));
        self.names
            .fill(&mut data.thread_names, evs.iter().map(|e| e.hdr.tid));
        self.update_hold();
        Ok(())
    }
}
