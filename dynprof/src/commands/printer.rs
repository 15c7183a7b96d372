//! Live step output: one line per step on stderr, or JSON lines on stdout.
use std::io::Write;

use anyhow::Result;
use serde_json::json;

use crate::{
    probes::Role,
    session::{CompletedStep, Ctx, Decoded, Observer},
};

pub struct StepPrinter {
    pub json: bool,
}

impl Observer for StepPrinter {
    fn on_event(&mut self, ev: &Decoded, completed: Option<&CompletedStep>, ctx: &mut Ctx) -> Result<()> {
        let Decoded::Step(s) = ev else { return Ok(()) };
        let probe = ctx.probes.iter().find(|p| p.index == s.marker);
        if probe.map(|p| p.role) == Some(Role::Aux) {
            return Ok(());
        }
        let label = probe.map(|p| p.label.as_str()).unwrap_or("?");
        if self.json {
            let t = ctx.target;
            let line = json!({
                "event": "step",
                "step": s.step,
                "ts_ns": s.hdr.ts_ns,
                "host_pid": t.host_pid,
                "ns_pids": t.ns_pids,
                "ns_pid": t.inner_pid(),
                "container": t.container,
                "container_runtime": t.container_runtime(),
                "tid": s.hdr.tid,
                "marker": label,
                "window": s.gate != 0,
            });
            let mut out = std::io::stdout().lock();
            writeln!(out, "{line}")?;
            out.flush()?;
        } else {
            let mut line = format!("step {:>6}", s.step);
            if let Some(c) = completed {
                line.push_str(&format!("  prev {:>9.3} ms  {:>7.2} steps/s", c.duration_ns() as f64 / 1e6, ctx.clock.rate()));
                for (k, v) in &c.aux {
                    line.push_str(&format!("  {k}={v}"));
                }
            }
            if s.gate != 0 {
                line.push_str("  [window]");
            }
            eprintln!("{line}");
        }
        Ok(())
    }
}
