//! `trace.json` in the Chrome Trace Event Format, which both the Perfetto UI
//! and `chrome://tracing` open.
//!
//! Layout: one process (the target, pid = host pid); a pseudo-thread
//! [`STEPS_TID`] named "steps" with one slice per step; per real thread its
//! API slices (cat `api`, `device_wait` for synchronize calls or
//! `collective_wait` for c10d's waits), off-CPU
//! slices (cat `offcpu`) and CPU samples as thread-scoped instant events.
//! Times are µs (floats, so ns precision survives) relative to the first
//! step's start; the absolute base is `metadata.ts_base_ns`.
//!
//! The trace is streamed into its file event by event ([`write_trace_json`]
//! into any `Write`): a dense window has millions of events, and the
//! document as a `serde_json::Value` would cost gigabytes.
//!
//! [`write_trace`] always writes `trace.json`, and additionally
//! `trace.json.gz` when the JSON is larger than [`GZIP_THRESHOLD`] (8 MiB):
//! big traces are slow to copy off a cluster node, and Perfetto opens the
//! gzip directly.
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use serde::Serialize;
use serde_json::{Value, json};

use super::model::WindowData;
use super::write_atomic_with;

pub const TRACE_FILE: &str = "trace.json";
pub const TRACE_GZ_FILE: &str = "trace.json.gz";
pub const GZIP_THRESHOLD: usize = 8 << 20;
/// tid of the "steps" pseudo-thread. Linux never hands out tid 0 to a user
/// thread, so it cannot collide with a real one.
pub const STEPS_TID: u32 = 0;
/// Comparisons of float µs timestamps allow this much (1 ns) of rounding.
const EPS_US: f64 = 1e-3;

/// Where a slice comes from: an index into the window's API calls or
/// off-CPU spans. Slices are sorted for nesting before they are written, so
/// they are kept small (no name, no args: those are read from the source
/// when the slice is written).
#[derive(Clone, Copy)]
enum Src {
    Api(usize),
    OffCpu(usize),
}

/// A complete slice before it is written, in absolute ns.
struct Slice {
    tid: u32,
    start: u64,
    dur: u64,
    src: Src,
}

/// Within one thread, trims slices that would partially overlap an
/// enclosing one, so the trace always nests. Real data only does this when
/// probe timestamps disagree by a few ns (e.g. a sched_switch and a uretprobe
/// on the same thread); trace viewers mis-draw such slices. Returns how many
/// were trimmed, which goes into the metadata so it is never silent.
fn make_nested(slices: &mut [Slice]) -> u64 {
    slices.sort_unstable_by(|a, b| {
        (a.tid, a.start, std::cmp::Reverse(a.dur)).cmp(&(b.tid, b.start, std::cmp::Reverse(b.dur)))
    });
    let mut trimmed = 0;
    let mut stack: Vec<(u32, u64)> = Vec::new(); // (tid, end)
    for s in slices.iter_mut() {
        while let Some(&(tid, end)) = stack.last() {
            if tid != s.tid || end <= s.start {
                stack.pop();
            } else {
                break;
            }
        }
        if let Some(&(_, end)) = stack.last()
            && s.start + s.dur > end
        {
            s.dur = end - s.start;
            trimmed += 1;
        }
        stack.push((s.tid, s.start + s.dur));
    }
    trimmed
}

/// A stack written as `root;…;leaf` without building the string.
struct Joined<'a>(&'a [String]);

impl Serialize for Joined<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        struct D<'a>(&'a [String]);
        impl std::fmt::Display for D<'_> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                for (i, fr) in self.0.iter().enumerate() {
                    if i > 0 {
                        f.write_str(";")?;
                    }
                    f.write_str(fr)?;
                }
                Ok(())
            }
        }
        s.collect_str(&D(self.0))
    }
}

/// One trace event as written (`dur` for `X`, `s` for `i`).
#[derive(Serialize)]
struct Event<'a, A: Serialize> {
    ph: &'static str,
    name: &'a str,
    cat: &'static str,
    pid: u32,
    tid: u32,
    ts: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    dur: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    s: Option<&'static str>,
    args: A,
}

#[derive(Serialize)]
struct ApiArgs {
    ret: i64,
    step: Option<u64>,
}

#[derive(Serialize)]
struct OffCpuArgs<'a> {
    stack: Joined<'a>,
    dur_ns: u64,
    /// Preempted (or yielded), not blocked.
    runnable: bool,
}

#[derive(Serialize)]
struct CpuArgs<'a> {
    stack: Joined<'a>,
}

/// Writes `traceEvents` elements one at a time, with the commas between.
struct EventSink<W: Write> {
    w: W,
    first: bool,
}

impl<W: Write> EventSink<W> {
    fn put<T: Serialize>(&mut self, ev: &T) -> Result<()> {
        if !self.first {
            self.w.write_all(b",")?;
        }
        self.first = false;
        serde_json::to_writer(&mut self.w, ev)?;
        Ok(())
    }
}

/// Streams the trace of `data` as JSON into `w`, one event at a time: the
/// document is never held in memory (a dense window has millions of
/// events). Only the API and off-CPU slices are collected first, as small
/// fixed-size records, because making them nest needs them sorted.
pub fn write_trace_json<W: Write>(w: W, data: &WindowData) -> Result<()> {
    let base = data
        .steps
        .iter()
        .map(|s| s.start_ts_ns)
        .min()
        .or_else(|| {
            let api = data.api_calls.iter().map(|c| c.start_ts_ns);
            let cpu = data.samples.iter().map(|s| s.ts_ns);
            let off = data.offcpu.iter().map(|o| o.ts_ns);
            api.chain(cpu).chain(off).min()
        })
        .unwrap_or(0);
    // Signed so that an event before the first step (which the window
    // filter should have removed) shows up as negative rather than wrapping.
    let us = |ns: u64| (ns as i128 - base as i128) as f64 / 1000.0;
    let pid = data.host_pid;
    let mut out = EventSink { w, first: true };
    out.w.write_all(b"{\"traceEvents\":[")?;

    let process_name = if data.process_name.is_empty() {
        format!("pid {pid}")
    } else {
        data.process_name.clone()
    };
    out.put(&json!({"ph":"M","name":"process_name","pid":pid,"tid":STEPS_TID,"args":{"name":process_name}}))?;
    let names: HashMap<u32, &str> = data
        .thread_names
        .iter()
        .map(|(t, n)| (*t, n.as_str()))
        .collect();
    let mut tids: BTreeSet<u32> = data.thread_names.iter().map(|(t, _)| *t).collect();
    tids.extend(data.api_calls.iter().map(|c| c.tid));
    tids.extend(data.samples.iter().map(|s| s.tid));
    tids.extend(data.offcpu.iter().map(|o| o.tid));
    tids.remove(&STEPS_TID);
    out.put(
        &json!({"ph":"M","name":"thread_name","pid":pid,"tid":STEPS_TID,"args":{"name":"steps"}}),
    )?;
    // Keep the steps track on top in Perfetto.
    out.put(&json!({"ph":"M","name":"thread_sort_index","pid":pid,"tid":STEPS_TID,"args":{"sort_index":-1}}))?;
    for tid in &tids {
        let name = match names.get(tid) {
            Some(n) => format!("{n} ({tid})"),
            None => format!("tid {tid}"),
        };
        out.put(&json!({"ph":"M","name":"thread_name","pid":pid,"tid":tid,"args":{"name":name}}))?;
    }

    for s in &data.steps {
        let mut args = serde_json::Map::new();
        args.insert("step".into(), json!(s.step.0));
        args.insert("boundary_tid".into(), json!(s.tid));
        for (k, v) in &s.aux {
            args.insert(format!("aux_{k}"), json!(v));
        }
        out.put(&Event {
            ph: "X",
            name: &format!("step {}", s.step.0),
            cat: "step",
            pid,
            tid: STEPS_TID,
            ts: us(s.start_ts_ns),
            dur: Some(s.end_ts_ns.saturating_sub(s.start_ts_ns) as f64 / 1000.0),
            s: None,
            args: Value::Object(args),
        })?;
    }

    // API calls carry the step they start in, whatever their thread.
    let mut step_starts: Vec<(u64, u64, u64)> = data
        .steps
        .iter()
        .map(|s| (s.start_ts_ns, s.end_ts_ns, s.step.0))
        .collect();
    step_starts.sort_unstable();
    let step_at = |ts: u64| -> Option<u64> {
        let i = step_starts.partition_point(|s| s.0 <= ts).checked_sub(1)?;
        let (_, end, step) = step_starts[i];
        (ts < end).then_some(step)
    };

    let mut slices: Vec<Slice> = Vec::with_capacity(data.api_calls.len() + data.offcpu.len());
    for (i, c) in data.api_calls.iter().enumerate() {
        slices.push(Slice {
            tid: c.tid,
            start: c.start_ts_ns,
            dur: c.dur_ns,
            src: Src::Api(i),
        });
    }
    for (i, o) in data.offcpu.iter().enumerate() {
        slices.push(Slice {
            tid: o.tid,
            start: o.ts_ns,
            dur: o.dur_ns,
            src: Src::OffCpu(i),
        });
    }
    let trimmed = make_nested(&mut slices);
    for s in &slices {
        match s.src {
            Src::Api(i) => {
                let c = &data.api_calls[i];
                out.put(&Event {
                    ph: "X",
                    name: &c.api,
                    cat: c.class.trace_category(),
                    pid,
                    tid: s.tid,
                    ts: us(s.start),
                    dur: Some(s.dur as f64 / 1000.0),
                    s: None,
                    args: ApiArgs {
                        ret: c.ret,
                        step: step_at(c.start_ts_ns),
                    },
                })?;
            }
            Src::OffCpu(i) => {
                let o = &data.offcpu[i];
                out.put(&Event {
                    ph: "X",
                    name: "off-CPU",
                    cat: "offcpu",
                    pid,
                    tid: s.tid,
                    ts: us(s.start),
                    dur: Some(s.dur as f64 / 1000.0),
                    s: None,
                    args: OffCpuArgs {
                        stack: Joined(&o.stack),
                        dur_ns: o.dur_ns,
                        runnable: o.runnable,
                    },
                })?;
            }
        }
    }
    drop(slices);
    for s in &data.samples {
        let leaf = s.stack.last().map(String::as_str).unwrap_or("[unknown]");
        out.put(&Event {
            ph: "i",
            name: leaf,
            cat: "cpu",
            pid,
            tid: s.tid,
            ts: us(s.ts_ns),
            dur: None,
            s: Some("t"),
            args: CpuArgs {
                stack: Joined(&s.stack),
            },
        })?;
    }

    let mut w = out.w;
    w.write_all(b"],\"displayTimeUnit\":\"ns\",\"metadata\":")?;
    serde_json::to_writer(
        &mut w,
        &json!({
            "ts_base_ns": base,
            "host_pid": pid,
            "process_name": data.process_name,
            "steps": data.steps.len(),
            "trimmed_slices": trimmed,
            "drops": data.drops,
            "dropped_over_budget": data.budget.dropped_over_budget,
            "producer": concat!("dynprof ", env!("CARGO_PKG_VERSION")),
        }),
    )?;
    w.write_all(b"}")?;
    w.flush()?;
    Ok(())
}

/// The trace as a JSON value (tests and small windows only: a dense
/// window's document does not belong in memory; [`write_trace`] streams).
pub fn build_trace(data: &WindowData) -> Value {
    let mut v = Vec::new();
    write_trace_json(&mut v, data).expect("writing to a Vec cannot fail");
    serde_json::from_slice(&v).expect("the trace writer writes valid JSON")
}

/// Counts the bytes that go through it.
struct Counting<W> {
    inner: W,
    n: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let k = self.inner.write(b)?;
        self.n += k as u64;
        Ok(k)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes `trace.json` (and `trace.json.gz` above [`GZIP_THRESHOLD`]), both
/// streamed: the JSON straight into its file, the gzip from that file.
pub fn write_trace(dir: &Path, data: &WindowData) -> Result<Vec<PathBuf>> {
    let path = dir.join(TRACE_FILE);
    let mut size = 0u64;
    write_atomic_with(&path, |w| {
        let mut c = Counting { inner: w, n: 0 };
        write_trace_json(&mut c, data).with_context(|| format!("formatting {}", path.display()))?;
        size = c.n;
        Ok(())
    })?;
    let mut out = vec![path.clone()];
    if size > GZIP_THRESHOLD as u64 {
        let gz = dir.join(TRACE_GZ_FILE);
        write_atomic_with(&gz, |w| {
            let mut src = std::fs::File::open(&path)
                .with_context(|| format!("reading back {}", path.display()))?;
            let mut enc = flate2::write::GzEncoder::new(w, flate2::Compression::default());
            std::io::copy(&mut src, &mut enc)
                .and_then(|_| enc.finish().map(|_| ()))
                .with_context(|| format!("compressing {}", gz.display()))
        })?;
        out.push(gz);
    }
    Ok(out)
}

/// What [`validate_trace`] counted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceStats {
    pub events: usize,
    pub metadata: usize,
    pub slices: usize,
    pub instants: usize,
    pub steps: usize,
    /// Distinct (pid, tid) with at least one event, the steps track included.
    pub threads: usize,
    /// Slices by `cat`.
    pub by_cat: BTreeMap<String, usize>,
}

fn num(e: &Value, k: &str, i: usize) -> Result<f64> {
    e.get(k)
        .and_then(Value::as_f64)
        .with_context(|| format!("event {i}: missing or non-numeric {k:?}: {e}"))
}

/// Structural check of a trace: `traceEvents` is an array; every event has a
/// string `ph` and `name` and numeric `pid`/`tid`; `X` events have numeric
/// `ts` and non-negative `dur`; `i` events have `ts` and a scope `s` of
/// g/p/t; `M` events have `args`. `X` slices nest per (pid, tid) — no
/// partial overlaps — and the step slices (cat `step`) are contiguous, each
/// ending where the next begins. Anything else is an error naming the event.
pub fn validate_trace(value: &Value) -> Result<TraceStats> {
    let events = value
        .get("traceEvents")
        .and_then(Value::as_array)
        .context("no traceEvents array")?;
    let mut st = TraceStats::default();
    // (pid, tid) -> (start, end, event index)
    type Spans = Vec<(f64, f64, usize)>;
    let mut per_thread: BTreeMap<(i64, i64), Spans> = BTreeMap::new();
    let mut steps: Vec<(f64, f64, usize)> = Vec::new();
    let mut threads = BTreeSet::new();
    for (i, e) in events.iter().enumerate() {
        st.events += 1;
        let ph = e
            .get("ph")
            .and_then(Value::as_str)
            .with_context(|| format!("event {i}: no ph: {e}"))?;
        ensure!(
            e.get("name").and_then(Value::as_str).is_some(),
            "event {i}: no name: {e}"
        );
        let pid = e.get("pid").and_then(Value::as_i64);
        let tid = e.get("tid").and_then(Value::as_i64);
        let (Some(pid), Some(tid)) = (pid, tid) else {
            bail!("event {i}: pid/tid missing or not integers: {e}");
        };
        match ph {
            "M" => {
                ensure!(
                    e.get("args").is_some_and(Value::is_object),
                    "event {i}: metadata without args: {e}"
                );
                st.metadata += 1;
            }
            "X" => {
                let ts = num(e, "ts", i)?;
                let dur = num(e, "dur", i)?;
                ensure!(
                    dur >= 0.0 && ts.is_finite() && dur.is_finite(),
                    "event {i}: bad ts/dur: {e}"
                );
                st.slices += 1;
                threads.insert((pid, tid));
                let cat = e.get("cat").and_then(Value::as_str).unwrap_or("");
                *st.by_cat.entry(cat.to_string()).or_default() += 1;
                if cat == "step" {
                    steps.push((ts, ts + dur, i));
                }
                per_thread
                    .entry((pid, tid))
                    .or_default()
                    .push((ts, ts + dur, i));
            }
            "i" | "I" => {
                num(e, "ts", i)?;
                let s = e.get("s").and_then(Value::as_str).unwrap_or("t");
                ensure!(
                    matches!(s, "g" | "p" | "t"),
                    "event {i}: bad instant scope {s:?}"
                );
                st.instants += 1;
                threads.insert((pid, tid));
            }
            "B" | "E" | "C" | "b" | "e" | "n" | "s" | "t" | "f" => {
                num(e, "ts", i)?;
                threads.insert((pid, tid));
            }
            other => bail!("event {i}: unknown ph {other:?}"),
        }
    }
    for ((pid, tid), mut v) in per_thread {
        v.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.total_cmp(&a.1)));
        let mut stack: Vec<(f64, usize)> = Vec::new();
        for (s, e, i) in v {
            while stack.last().is_some_and(|&(end, _)| end <= s + EPS_US) {
                stack.pop();
            }
            if let Some(&(end, j)) = stack.last() {
                ensure!(
                    e <= end + EPS_US,
                    "pid {pid} tid {tid}: event {i} [{s}, {e}] partially overlaps event {j} (ends {end})"
                );
            }
            stack.push((e, i));
        }
    }
    steps.sort_by(|a, b| a.0.total_cmp(&b.0));
    for w in steps.windows(2) {
        ensure!(
            (w[0].1 - w[1].0).abs() <= EPS_US,
            "steps not contiguous: event {} ends at {} but the next step (event {}) starts at {}",
            w[0].2,
            w[0].1,
            w[1].2,
            w[1].0
        );
    }
    st.steps = steps.len();
    st.threads = threads.len();
    Ok(st)
}

#[cfg(test)]
mod tests;
