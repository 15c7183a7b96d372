//! Live step output: one line per step on stderr, or JSON lines on stdout.
use std::io::Write;

use anyhow::Result;
use serde_json::json;

use crate::{
    probes::Role,
    session::{CompletedStep, Ctx, Decoded, EndReason, Observer},
    sys::clock::monotonic_ns,
};

/// Lines are buffered and written once per batch of events: at a
/// boundary that woke dynprof, on the session tick and at the end. One
/// write per step would cost a syscall per step, which at thousands of
/// steps per second is most of an idle dynprof's CPU.
pub struct StepPrinter {
    json: bool,
    buf: String,
    /// The constant members of a JSON step line, serialized once.
    fixed: Option<String>,
}

/// Flush before the buffer grows past this.
const FLUSH_BYTES: usize = 64 * 1024;

impl StepPrinter {
    pub fn new(json: bool) -> Self {
        Self {
            json,
            buf: String::new(),
            fixed: None,
        }
    }

    fn flush(&mut self) -> Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        if self.json {
            let mut out = std::io::stdout().lock();
            out.write_all(self.buf.as_bytes())?;
            out.flush()?;
        } else {
            std::io::stderr().lock().write_all(self.buf.as_bytes())?;
        }
        self.buf.clear();
        Ok(())
    }
}

impl<C> Observer<C> for StepPrinter {
    fn on_event(
        &mut self,
        ev: &Decoded,
        completed: Option<&CompletedStep>,
        ctx: &mut Ctx,
    ) -> Result<()> {
        let Decoded::Step(s) = ev else { return Ok(()) };
        // Opt-in for `cargo xtask bench` (boundary → user-space latency).
        let recv_ns = recv_ns_enabled().then(monotonic_ns);
        let probe = ctx.probes.iter().find(|p| p.index == s.marker);
        if probe.map(|p| p.role) == Some(Role::Aux) {
            return Ok(());
        }
        let label = probe.map(|p| p.label.as_str()).unwrap_or("?");
        if self.json {
            use std::fmt::Write as _;
            // What never changes (the target's identity) is serialized once.
            let fixed = self.fixed.get_or_insert_with(|| {
                let t = ctx.target;
                let v = json!({
                    "host_pid": t.host_pid,
                    "ns_pids": t.ns_pids,
                    "ns_pid": t.inner_pid(),
                    "container": t.container,
                    "container_runtime": t.container_runtime(),
                });
                let s = v.to_string();
                s[1..s.len() - 1].to_string()
            });
            let _ = write!(
                self.buf,
                "{{\"event\":\"step\",\"step\":{},\"ts_ns\":{},\"tid\":{},\"marker\":{},\"window\":{},{fixed}",
                s.step,
                s.hdr.ts_ns,
                s.hdr.tid,
                serde_json::Value::from(label),
                s.gate != 0,
            );
            if let Some(r) = recv_ns {
                // Only events that woke us measure the wakeup path; batched
                // ones wait for the tick by design.
                let _ = write!(self.buf, ",\"recv_ns\":{r},\"woke\":{}", s.woke != 0);
            }
            self.buf.push_str("}\n");
        } else {
            let mut line = format!("step {:>6}", s.step);
            if let Some(c) = completed {
                line.push_str(&format!(
                    "  prev {:>9.3} ms  {:>7.2} steps/s",
                    c.duration_ns() as f64 / 1e6,
                    ctx.clock.rate()
                ));
                for (k, v) in &c.aux {
                    line.push_str(&format!("  {k}={v}"));
                }
            }
            if s.gate != 0 {
                line.push_str("  [window]");
            }
            self.buf.push_str(&line);
            self.buf.push('\n');
        }
        if s.woke != 0 || self.buf.len() >= FLUSH_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    fn on_tick(&mut self, _ctx: &mut Ctx) -> Result<()> {
        self.flush()
    }

    fn finish(&mut self, _end: &EndReason, _ctx: &mut Ctx) -> Result<()> {
        self.flush()
    }
}

/// `DYNPROF_RECV_NS=1` adds `recv_ns` (CLOCK_MONOTONIC when user space got
/// the event; the clock of the kernel's `ts_ns`) to JSON step lines.
fn recv_ns_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("DYNPROF_RECV_NS").is_some_and(|v| v == "1"))
}
