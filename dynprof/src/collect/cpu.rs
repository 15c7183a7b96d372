//! The `cpu` collector: perf-event sampling of the target's threads.
//!
//! One software `cpu-clock` event per CPU at `hz` (default 99: off any
//! round multiple of the kernel's tick, so sampling does not lock step with
//! periodic work), system-wide; the program keeps only the target's samples,
//! and only while the window gate is open. User and kernel stacks come from
//! the `STACKS` map and are symbolized in `drain_into` (blazesym, through
//! `/proc/PID`, so that containers work). User-mode samples also carry a
//! copy of the user stack, unwound from `.eh_frame` on arrival
//! (`stacks::StackStore::unwind`, docs/stacks.md).
use anyhow::Result;
use dynprof_common::SampleEvent;

use super::{
    Collector, WindowInfo,
    builtin::DropBase,
    spill::{EventBuf, EventPool},
    stacks::{self, SharedStacks, ThreadNames},
};
use crate::{
    bpf::Kernel,
    output::model::{CpuSample, ModuleRef, WindowData},
    session::Decoded,
    target::Target,
    types::Builtin,
};

pub const DEFAULT_HZ: u64 = 99;

pub struct CpuCollector {
    hz: u64,
    store: SharedStacks,
    events: EventBuf<SampleEvent>,
    armed: bool,
    names: ThreadNames,
    drops: DropBase,
}

impl CpuCollector {
    pub fn new(hz: u64, store: SharedStacks, pool: EventPool) -> Self {
        Self {
            hz,
            store,
            events: EventBuf::new(pool),
            armed: false,
            names: ThreadNames::default(),
            drops: DropBase::default(),
        }
    }

    fn update_hold(&mut self) {
        if !self.armed && self.events.is_empty() {
            self.store.borrow_mut().release(stacks::CPU);
        }
    }
}

impl Collector for CpuCollector {
    fn kind(&self) -> Builtin {
        Builtin::Cpu
    }

    fn arm(&mut self, kernel: &mut Kernel, target: &Target) -> Result<()> {
        self.names.set_pid(target.host_pid.0);
        self.drops.arm(kernel);
        self.store
            .borrow_mut()
            .acquire(stacks::CPU, kernel, target.host_pid.0);
        if let Err(e) = kernel.attach_cpu_sampler(self.hz) {
            kernel.detach_cpu_sampler();
            self.update_hold();
            return Err(e);
        }
        self.armed = true;
        Ok(())
    }

    fn disarm(&mut self, kernel: &mut Kernel) {
        kernel.detach_cpu_sampler();
        self.armed = false;
        self.drops.disarm();
        self.update_hold();
    }

    fn window_opened(&mut self, w: &WindowInfo) {
        self.events.set_spill_dir(&w.dir);
    }

    fn on_event(&mut self, ev: &Decoded) {
        match ev {
            Decoded::Sample(s) => {
                self.names.saw(s.hdr.tid);
                self.events.push(*s);
            }
            // Unwound now, while the target's mappings are those of the
            // sample; only the resulting id is kept (and spilled).
            Decoded::SampleStack(c) => {
                self.names.saw(c.sample.hdr.tid);
                let mut s = c.sample;
                s.user_stack = self.store.borrow_mut().unwind(c);
                self.events.push(s);
            }
            _ => {}
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
        data.drops.cpu = d.cpu;
        data.drops.cpu_stack = d.cpu_stack;
        let taken = match self.events.take_window(start_ts_ns, end_ts_ns) {
            Ok(t) => t,
            Err(e) => {
                self.update_hold();
                return Err(e);
            }
        };
        super::builtin::note_budget(data, self.events.pool(), |o| o.cpu = taken.over_budget);
        let evs = taken.events;
        self.names
            .fill(&mut data.thread_names, evs.iter().map(|e| e.hdr.tid));
        data.samples.reserve_exact(evs.len());
        {
            let mut store = self.store.borrow_mut();
            store.prefetch(kernel, evs.iter().map(|e| (e.user_stack, e.kernel_stack)));
            for e in evs {
                let stack = store.stack(kernel, e.user_stack, e.kernel_stack);
                data.samples.push(CpuSample {
                    tid: e.hdr.tid,
                    ts_ns: e.hdr.ts_ns,
                    stack,
                });
            }
        }
        data.samples.sort_unstable_by_key(|s| (s.ts_ns, s.tid));
        ModuleRef::merge(&mut data.modules, self.store.borrow().unresolved_modules());
        {
            let mut store = self.store.borrow_mut();
            let recovered = store.take_recovered();
            if store.unwind_count > 0 {
                log::debug!(
                    "cpu: {} stack copies unwound in {:?} ({:?} each, tables loaded included); \
                     callers of frames without tables recovered: {} by stack scan, {} from \
                     the link register",
                    store.unwind_count,
                    store.unwind_time,
                    store.unwind_time / store.unwind_count as u32,
                    recovered.scanned,
                    recovered.link_register
                );
            }
            if store.unwound_over_cap > 0 {
                log::warn!(
                    "cpu: {} samples kept their frame-pointer stack: over the cap on distinct \
                     unwound stacks",
                    store.unwound_over_cap
                );
            }
            store.unwind_count = 0;
            store.unwind_time = Default::default();
            store.unwound_over_cap = 0;
        }
        self.update_hold();
        Ok(())
    }
}
