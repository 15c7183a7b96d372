//! The `api` collector: entry and return probes on device-runtime APIs
//! (CANN ACL, CUDA runtime and driver, HCCL/NCCL collectives, PyTorch's
//! c10d waits, user-added symbols).
//!
//! The kernel times each call itself (`dynprof_api_enter` stores the entry
//! time per (thread, API) while the window gate is open, the return probe
//! emits one [`ApiEvent`] with the exact duration), so user space only
//! labels calls and keeps those that began in the window's recorded steps.
//! Calls stay on the thread that made them (CANN's task-queue thread
//! included); `output` attributes them to steps by their start time.
use anyhow::Result;
use dynprof_common::ApiEvent;

use super::{
    Collector, WindowInfo,
    apis::{self, ApiSet, ApiSpec, ApiTable},
    builtin::DropBase,
    spill::{EventBuf, EventPool},
    stacks::ThreadNames,
};
use crate::{
    bpf::Kernel,
    output::model::{ApiCall, ApiClass, WindowData},
    session::Decoded,
    target::Target,
    types::Builtin,
};

/// How long an arm waits for the symbol prefetch to finish before it goes
/// on without the libraries still being read: long enough for the small
/// runtime libraries the prefetch reads first (the CANN and CUDA sets come
/// before c10d's libtorch_cpu), short enough not to hold up a job's other
/// ranks, whose plans are served by the same thread.
const PREFETCH_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// `DYNPROF_API_SLOTS=0`: every thread's API stack in the hash, none in
/// an `API_SLOTS` slot (the bench compares the two; a way out should the
/// slots ever misbehave).
pub const SLOTS_ENV: &str = "DYNPROF_API_SLOTS";

pub struct ApiCollector {
    /// Threads get `API_SLOTS` slots (unless [`SLOTS_ENV`] is `0`).
    slots: bool,
    sets: Vec<ApiSet>,
    user: Vec<ApiSpec>,
    table: ApiTable,
    events: EventBuf<ApiEvent>,
    names: ThreadNames,
    attached: usize,
    warned_empty: bool,
    drops: DropBase,
    /// The API sets' symbol lookups, read from attach on a thread of their
    /// own; taken in at each arm until it is done.
    prefetch: Option<std::sync::Arc<apis::Prefetch>>,
    /// Set libraries the last `arm` left to a later one (still being read).
    pending: Vec<String>,
    /// The API names the last `arm` probed, sorted.
    traced: Vec<String>,
}

impl ApiCollector {
    pub fn new(sets: Vec<ApiSet>, user: Vec<ApiSpec>, pool: EventPool) -> Self {
        Self {
            slots: std::env::var_os(SLOTS_ENV).is_none_or(|v| v != "0"),
            sets,
            user,
            table: ApiTable::default(),
            events: EventBuf::new(pool),
            names: ThreadNames::default(),
            attached: 0,
            warned_empty: false,
            drops: DropBase::default(),
            prefetch: None,
            pending: Vec::new(),
            traced: Vec::new(),
        }
    }

    /// Probes attached by the last `arm`.
    pub fn attached(&self) -> usize {
        self.attached
    }
}

impl Collector for ApiCollector {
    fn kind(&self) -> Builtin {
        Builtin::Api
    }

    fn prepare(&mut self, target: &Target) {
        // An arm that came first has read the libraries itself.
        if !self.table.looked_up() {
            self.prefetch = Some(apis::Prefetch::start(target, &self.sets));
        }
    }

    fn arm(&mut self, kernel: &mut Kernel, target: &Target) -> Result<()> {
        self.names.set_pid(target.host_pid.0);
        self.drops.arm(kernel);
        // Resolved at every arm: a library dlopen'ed since the last window
        // (a CUDA or CANN plugin) is picked up. Libraries the prefetch is
        // still reading are left to a later arm rather than waited for.
        let mut set_lookups = apis::SetLookups::Read;
        if let Some(p) = &self.prefetch {
            let (found, done) = p.take(PREFETCH_WAIT);
            self.table.absorb(found);
            if done {
                self.prefetch = None;
            } else {
                set_lookups = apis::SetLookups::CachedOnly;
            }
        }
        let res = apis::resolve(target, &self.sets, &self.user, &mut self.table, set_lookups)?;
        for m in &res.misses {
            log::warn!("api: {m}");
        }
        for d in &res.deferred {
            log::warn!(
                "api: {d}: its symbols are still being read; its APIs are probed from a later window"
            );
        }
        self.pending = res.deferred.clone();
        // Before any probe of this window attaches (see `ApiSlot`); with
        // nothing to attach, no thread needs one.
        let tids = if self.slots && !res.apis.is_empty() {
            target.threads()
        } else {
            Vec::new()
        };
        match kernel.assign_api_slots(&tids) {
            Ok(n) => log::debug!("api: {n} threads have a stack slot"),
            // The hash serves them all: slower, not wrong.
            Err(e) => log::warn!("api: giving threads their stack slots: {e:#}"),
        }
        let mut attached = 0;
        self.traced.clear();
        for a in &res.apis {
            match kernel.attach_api(a.index, &a.attach_path, &a.object, a.file_offset) {
                Ok(()) => {
                    attached += 1;
                    self.traced.push(a.name.clone());
                }
                Err(e) => log::warn!(
                    "api: attaching {} in {} (offset {:#x}): {e:#}",
                    a.symbol,
                    a.object,
                    a.file_offset
                ),
            }
        }
        self.attached = attached;
        self.traced.sort_unstable();
        self.traced.dedup();
        if attached == 0 && res.deferred.is_empty() && !self.warned_empty {
            self.warned_empty = true;
            log::warn!(
                "api: no runtime API to trace in PID {} (no CANN/CUDA library mapped{}); api_summary.csv will be empty",
                target.host_pid,
                if res.searched.is_empty() {
                    String::new()
                } else {
                    format!("; searched {}", res.searched.join(", "))
                }
            );
        } else {
            log::debug!("api: {attached} APIs probed in {}", res.searched.join(", "));
        }
        Ok(())
    }

    fn disarm(&mut self, kernel: &mut Kernel) {
        kernel.detach_apis();
        self.attached = 0;
        self.drops.disarm();
    }

    fn window_opened(&mut self, w: &WindowInfo) {
        self.events.set_spill_dir(&w.dir);
    }

    fn on_event(&mut self, ev: &Decoded) {
        if let Decoded::Api(a) = ev {
            self.names.saw(a.hdr.tid);
            self.events.push(*a);
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
        data.drops.api = d.api;
        data.drops.api_nesting = d.api_nesting;
        let taken = self.events.take_window(start_ts_ns, end_ts_ns)?;
        super::builtin::note_budget(data, self.events.pool(), |o| o.api = taken.over_budget);
        let evs = taken.events;
        let mut calls: Vec<ApiCall> = evs
            .iter()
            .map(|e| {
                let (name, class) = self.table.name(e.api).unwrap_or(("?", ApiClass::Call));
                ApiCall {
                    tid: e.hdr.tid,
                    api: name.to_string(),
                    start_ts_ns: e.hdr.ts_ns,
                    dur_ns: e.dur_ns,
                    ret: e.ret,
                    class,
                }
            })
            .collect();
        calls = drop_wrapped(calls);
        self.names
            .fill(&mut data.thread_names, calls.iter().map(|c| c.tid));
        data.api_calls.extend(calls);
        data.api_libraries_pending = self.pending.clone();
        data.apis_traced = self.traced.clone();
        data.api_calls.sort_by_key(|c| (c.start_ts_ns, c.tid));
        Ok(())
    }
}

/// One library's API may be a thin wrapper around the same API of another
/// (a CANN shim forwarding to the runtime library): both are probed, so the
/// inner call is dropped when a call of the same name on the same thread
/// contains it.
pub fn drop_wrapped(mut calls: Vec<ApiCall>) -> Vec<ApiCall> {
    // Outer first: by thread, name, start, then longest first.
    calls.sort_by(|a, b| {
        (a.tid, &a.api, a.start_ts_ns, std::cmp::Reverse(a.dur_ns)).cmp(&(
            b.tid,
            &b.api,
            b.start_ts_ns,
            std::cmp::Reverse(b.dur_ns),
        ))
    });
    let mut out: Vec<ApiCall> = Vec::with_capacity(calls.len());
    for c in calls {
        if let Some(p) = out.last()
            && p.tid == c.tid
            && p.api == c.api
            && c.start_ts_ns >= p.start_ts_ns
            && c.start_ts_ns + c.dur_ns <= p.start_ts_ns + p.dur_ns
        {
            continue;
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(tid: u32, api: &str, s: u64, d: u64) -> ApiCall {
        ApiCall {
            tid,
            api: api.into(),
            start_ts_ns: s,
            dur_ns: d,
            ret: 0,
            class: ApiClass::Call,
        }
    }

    #[test]
    fn wrapped_calls_are_dropped_but_sequential_ones_kept() {
        let v = drop_wrapped(vec![
            call(1, "aclrtLaunchKernel", 100, 50),
            call(1, "aclrtLaunchKernel", 110, 30), // inner, forwarded
            call(1, "aclrtLaunchKernel", 200, 10),
            call(2, "aclrtLaunchKernel", 110, 30), // other thread
            call(1, "aclrtMemcpy", 120, 5),        // other API, nested
        ]);
        let mut got: Vec<(u32, &str, u64)> = v
            .iter()
            .map(|c| (c.tid, c.api.as_str(), c.start_ts_ns))
            .collect();
        got.sort();
        assert_eq!(
            got,
            vec![
                (1, "aclrtLaunchKernel", 100),
                (1, "aclrtLaunchKernel", 200),
                (1, "aclrtMemcpy", 120),
                (2, "aclrtLaunchKernel", 110)
            ]
        );
    }
}
