//! Helpers for the collector tests (`#[path = "collectors_util.rs"] mod collectors_util;`):
//! a library-level driver that records one window, the acl_trainer fixture,
//! and readers of the window's files.
#![allow(dead_code, unreachable_pub)] // shared by two test crates; each uses a part

use std::{
    cell::RefCell,
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    rc::Rc,
    sync::Mutex,
    time::Duration,
};

use crate::common::*;
use dynprof::{
    bpf::Kernel,
    collect::{Collector, CollectorOptions, build_collectors},
    output::{
        Collectors,
        chrome_trace::validate_trace,
        model::{Drops, StepSpan, WindowData},
        write_window_files,
    },
    probes::{self, MarkerArg},
    session::{CompletedStep, Ctx, Decoded, Limits, Observer, Session},
    target::Target,
    types::HostPid,
};
use dynprof_common::{PlanConfig, role};

/// One BPF-heavy test at a time: they measure wall-clock waits on a small
/// machine, and parallel targets would only add noise.
pub static SERIAL: Mutex<()> = Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn drops_delta(now: &Drops, then: &Drops) -> Drops {
    Drops {
        step: now.step - then.step,
        api: now.api - then.api,
        cpu: now.cpu - then.cpu,
        offcpu: now.offcpu - then.offcpu,
        cpu_stack: now.cpu_stack - then.cpu_stack,
        offcpu_stack: now.offcpu_stack - then.offcpu_stack,
        api_nesting: now.api_nesting - then.api_nesting,
    }
}

/// A minimal window driver: one window over hits `start..end` (hit k begins
/// step k; no warmup), drained at hit `end`.
pub struct Driver {
    collectors: Vec<Box<dyn Collector>>,
    which: Collectors,
    start: u64,
    end: u64,
    steps: Vec<StepSpan>,
    dir: PathBuf,
    drops_at_arm: Drops,
    data: Option<WindowData>,
    /// Every API event received, for the exact-drops check.
    api_events: u64,
    /// Drain on a tick once the kernel has counted this many hits, with the
    /// window's bounds unknown (0..MAX): used when step events may be lost.
    drain_on_hits: Option<u64>,
    /// (window data, API events received), once drained.
    result: Rc<RefCell<Option<(WindowData, u64)>>>,
}

impl Driver {
    fn drain(&mut self, start_ts: u64, end_ts: u64, ctx: &mut Ctx) {
        let mut data = WindowData {
            steps: self.steps.clone(),
            process_name: ctx.target.comm.clone(),
            host_pid: ctx.target.host_pid.0,
            ..WindowData::default()
        };
        for c in &mut self.collectors {
            c.drain_into(start_ts, end_ts, &mut data, ctx.kernel)
                .unwrap();
        }
        for c in &mut self.collectors {
            c.disarm(ctx.kernel);
        }
        // Each collector fills its own drop slots (counted from its arm);
        // armed at the same moment as this snapshot, they must agree with it.
        let total = drops_delta(&ctx.kernel.drops().unwrap(), &self.drops_at_arm);
        data.drops.step = total.step;
        let mut expect = total;
        if !self.which.api {
            (expect.api, expect.api_nesting) = (0, 0);
        }
        if !self.which.cpu {
            (expect.cpu, expect.cpu_stack) = (0, 0);
        }
        if !self.which.offcpu {
            (expect.offcpu, expect.offcpu_stack) = (0, 0);
        }
        assert_eq!(data.drops, expect, "collectors' own drop counts");
        write_window_files(&self.dir, &data, &self.which).unwrap();
        *self.result.borrow_mut() = Some((data.clone(), self.api_events));
        self.data = Some(data);
    }
}

impl Observer for Driver {
    fn on_event(
        &mut self,
        ev: &Decoded,
        completed: Option<&CompletedStep>,
        ctx: &mut Ctx,
    ) -> anyhow::Result<()> {
        if self.data.is_some() {
            return Ok(());
        }
        if matches!(ev, Decoded::Api(_)) {
            self.api_events += 1;
        }
        for c in &mut self.collectors {
            c.on_event(ev);
        }
        if let Decoded::Step(s) = ev
            && s.role == role::STEP
            && self.drain_on_hits.is_none()
        {
            if let Some(c) = completed
                && c.step.0 >= self.start
                && c.step.0 < self.end
            {
                self.steps.push(StepSpan {
                    step: c.step,
                    start_ts_ns: c.start_ts_ns,
                    end_ts_ns: c.end_ts_ns,
                    tid: c.tid,
                    aux: Vec::new(),
                });
            }
            if s.step >= self.end && !self.steps.is_empty() {
                let (a, b) = (
                    self.steps[0].start_ts_ns,
                    self.steps.last().unwrap().end_ts_ns,
                );
                self.drain(a, b, ctx);
            }
        }
        Ok(())
    }

    fn on_tick(&mut self, ctx: &mut Ctx) -> anyhow::Result<()> {
        if self.data.is_none()
            && let Some(n) = self.drain_on_hits
            && ctx.kernel.state()?.step_hits() >= n
        {
            self.drain(0, u64::MAX, ctx);
        }
        Ok(())
    }

    fn wants_exit(&self) -> bool {
        self.data.is_some()
    }
}

pub struct Run {
    pub data: WindowData,
    pub dir: PathBuf,
    pub api_events: u64,
}

/// Attaches to `pid` with `markers`, records hits `start..end` with the
/// collectors `which`, and returns what the window captured.
#[allow(clippy::too_many_arguments)]
pub fn record_window(
    pid: u32,
    markers: Vec<MarkerArg>,
    which: Collectors,
    opts: CollectorOptions,
    (start, end): (u64, u64),
    ring_kb: u32,
    dir: &Path,
    drain_on_hits: Option<u64>,
) -> Run {
    let target = Target::open(HostPid(pid)).unwrap();
    let resolved = probes::resolve_markers(&target, &markers, &[]).unwrap();
    // Only step boundaries wake the reader: with thousands of calls per step,
    // a small ring then overflows for certain, whatever the machine's speed.
    let wake_bytes = if ring_kb <= 4 {
        u64::MAX
    } else {
        u64::from(ring_kb) * 256
    };
    let mut kernel = Kernel::load(target.host_pid, ring_kb * 1024, wake_bytes).unwrap();
    for p in &resolved {
        kernel.attach_marker(p).unwrap();
    }
    let mut collectors = build_collectors(&which, &opts);
    for c in &mut collectors {
        c.arm(&mut kernel, &target).unwrap();
    }
    // The window is placed relative to the hits counted once everything is
    // attached: arming takes a few ms, and a fast job must not be inside
    // the window before the collectors' probes exist.
    let base = kernel.state().unwrap().step_hits();
    let (start, end) = (base + start, base + end);
    let drain_on_hits = drain_on_hits.map(|n| base + n);
    let span = end - start;
    kernel
        .set_plan(PlanConfig {
            armed: 1,
            _pad: 0,
            start,
            end,
            span,
            period: span,
            warmup: 0,
            lead: 0,
        })
        .unwrap();
    let drops_at_arm = kernel.drops().unwrap();
    let mut session = Session::new(kernel, target, resolved);
    let driver = Driver {
        collectors,
        which,
        start,
        end,
        steps: Vec::new(),
        dir: dir.to_path_buf(),
        drops_at_arm,
        data: None,
        api_events: 0,
        drain_on_hits,
        result: Default::default(),
    };
    let result = driver.result.clone();
    let mut observers: Vec<Box<dyn Observer>> = vec![Box::new(driver)];
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let limits = Limits {
        steps: None,
        duration: Some(Duration::from_secs(120)),
    };
    let summary = rt
        .block_on(session.run(&mut observers, limits, None))
        .unwrap();
    let (data, api_events) = result
        .borrow_mut()
        .take()
        .unwrap_or_else(|| panic!("the window never closed: {summary:?}"));
    Run {
        data,
        dir: dir.to_path_buf(),
        api_events,
    }
}

pub fn exe_marker(sym: &str) -> Vec<MarkerArg> {
    vec![probes::spec::parse(&format!("exe:{sym}")).unwrap()]
}

pub fn acl_trainer(dir: &Path, args: &[&str]) -> (Proc, PathBuf) {
    let f = fixtures();
    let acl_log = dir.join("acl.log");
    let mut cmd = Command::new(&f.acl_trainer);
    cmd.args(args)
        .arg("--log")
        .arg(dir.join("trainer.log"))
        .env("ACL_SIM_LOG", &acl_log);
    (Proc::spawn_ready(&mut cmd), acl_log)
}

pub fn count_by<'a>(it: impl Iterator<Item = &'a str>) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for s in it {
        *m.entry(s.to_string()).or_default() += 1;
    }
    m
}

/// Per-step `steps.csv` columns by name.
pub fn steps_csv(dir: &Path) -> Vec<BTreeMap<String, u64>> {
    let mut r = csv::Reader::from_path(dir.join("steps.csv")).unwrap();
    let h: Vec<String> = r.headers().unwrap().iter().map(str::to_string).collect();
    r.records()
        .map(|rec| {
            let rec = rec.unwrap();
            h.iter()
                .zip(rec.iter())
                .filter_map(|(k, v)| v.parse().ok().map(|v| (k.clone(), v)))
                .collect()
        })
        .collect()
}

/// The main checks shared by the ACL configurations; returns the per-step
/// device waits (ours, the library's) in ns.
pub fn check_acl_window(
    run: &Run,
    acl_log: &Path,
    launches: u64,
    main_tid: u32,
    queue_thread: bool,
) -> Vec<(u64, u64)> {
    let d = &run.data;
    let steps = &d.steps;
    assert_eq!(steps.len(), 5, "{steps:?}");
    let (w0, w1) = (steps[0].start_ts_ns, steps.last().unwrap().end_ts_ns);
    let log = read_acl_log(acl_log);

    // --- no event outside the window
    for c in &d.api_calls {
        assert!(
            c.start_ts_ns >= w0 && c.start_ts_ns + c.dur_ns <= w1,
            "API call outside the window: {c:?}"
        );
    }
    for s in &d.samples {
        assert!(
            s.ts_ns >= w0 && s.ts_ns < w1,
            "sample outside the window: {}",
            s.ts_ns
        );
    }
    for o in &d.offcpu {
        assert!(
            o.ts_ns >= w0 && o.ts_ns + o.dur_ns <= w1,
            "off-CPU span outside the window: {} +{}",
            o.ts_ns,
            o.dur_ns
        );
    }

    // --- API calls per step: exact, and the same calls the library logged
    let rows = steps_csv(&run.dir);
    assert_eq!(rows.len(), 5);
    let mut waits = Vec::new();
    for (i, s) in steps.iter().enumerate() {
        let ours: Vec<_> = d
            .api_calls
            .iter()
            .filter(|c| c.start_ts_ns >= s.start_ts_ns && c.start_ts_ns < s.end_ts_ns)
            .collect();
        let theirs: Vec<_> = log
            .iter()
            .filter(|l| l.enter >= s.start_ts_ns && l.enter < s.end_ts_ns)
            .collect();
        let counts = count_by(ours.iter().map(|c| c.api.as_str()));
        let expected: BTreeMap<String, u64> = [
            ("aclrtLaunchKernel".to_string(), launches),
            ("aclrtMemcpyAsync".to_string(), 1),
            ("aclrtSynchronizeStream".to_string(), 1),
        ]
        .into();
        assert_eq!(counts, expected, "step {}", s.step);
        assert_eq!(
            count_by(theirs.iter().map(|l| l.api.as_str())),
            expected,
            "library log, step {}",
            s.step
        );
        assert_eq!(rows[i]["api_calls"], launches + 2);
        let mut sync_brackets = 0u64;
        // Each probed call brackets the library's own timing of it exactly:
        // same thread, entry before its t_enter, return after its t_exit.
        for l in &theirs {
            let c = ours
                .iter()
                .find(|c| {
                    c.api == l.api
                        && c.tid == l.tid
                        && c.start_ts_ns <= l.enter
                        && c.start_ts_ns + c.dur_ns >= l.exit
                })
                .unwrap_or_else(|| panic!("no probed call brackets {l:?}"));
            assert_eq!(c.ret, 0);
            // ...and nothing more of the thread's time: the bracket lies
            // between the thread's neighbouring calls as the library logged
            // them (the previous call's t_exit, the next call's t_enter).
            // An order, not a duration, so preemption cannot fail it.
            let end = c.start_ts_ns + c.dur_ns;
            if let Some(prev) = log
                .iter()
                .filter(|o| o.tid == l.tid && o.exit <= l.enter)
                .map(|o| o.exit)
                .max()
            {
                assert!(
                    c.start_ts_ns > prev,
                    "{c:?} begins before the thread's previous call ended ({prev}): {l:?}"
                );
            }
            if let Some(next) = log
                .iter()
                .filter(|o| o.tid == l.tid && o.enter >= l.exit)
                .map(|o| o.enter)
                .min()
            {
                assert!(
                    end < next,
                    "{c:?} ends after the thread's next call began ({next}): {l:?}"
                );
            }
            if l.api == "aclrtSynchronizeStream" {
                sync_brackets += c.dur_ns;
            }
            assert_eq!(
                c.class == dynprof::output::model::ApiClass::DeviceWait,
                l.api == "aclrtSynchronizeStream"
            );
            if queue_thread && l.api != "aclrtSynchronizeStream" {
                assert_ne!(
                    c.tid, main_tid,
                    "launches must stay on the task-queue thread"
                );
            } else {
                assert_eq!(c.tid, main_tid);
            }
        }
        let lib_wait: u64 = theirs
            .iter()
            .filter(|l| l.api == "aclrtSynchronizeStream")
            .map(|l| l.waited)
            .sum();
        // The step's device wait is its one synchronize call, as probed.
        assert_eq!(rows[i]["device_wait_ns"], sync_brackets, "step {}", s.step);
        waits.push((rows[i]["device_wait_ns"], lib_wait));
    }
    // device_wait_ns against the library's own measurement: the probes
    // bracket the whole call, the library times only its clock_nanosleep,
    // so ours holds theirs. How much more it holds is the library's
    // bookkeeping inside the call plus the trampolines, and any preemption
    // there (tens of microseconds, or a whole time slice on a loaded 2-CPU
    // machine, or QEMU's 100 ms round-robin in a guest): not a duration
    // this test bounds. The order checks above bound it instead: the
    // bracket ends before the thread's next call begins.
    for (i, (ours, lib)) in waits.iter().enumerate() {
        assert!(
            *ours >= *lib,
            "step {i}: device_wait_ns {ours} < library waited {lib}"
        );
    }
    // --- trace.json
    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run.dir.join("trace.json")).unwrap()).unwrap();
    let st = validate_trace(&trace).unwrap();
    assert_eq!(st.steps, 5);
    assert_eq!(st.by_cat.get("device_wait").copied().unwrap_or(0), 5);
    waits
}

pub fn folded(dir: &Path, name: &str) -> Vec<(String, u64)> {
    std::fs::read_to_string(dir.join(name))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let (s, n) = l.rsplit_once(' ')?;
            Some((s.to_string(), n.parse().ok()?))
        })
        .collect()
}
