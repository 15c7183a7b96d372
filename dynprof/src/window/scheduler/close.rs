//! Closing a window: hooks' end, collectors sealed and drained, meta.json
//! built, and the files handed to the writer.
use anyhow::Result;
use dynprof_common::PlanConfig;
use serde_json::{Map, Value, json};

use super::*;

impl Scheduler {
    /// Finalizes the open window: hooks, collectors, files, meta.json, rename.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn close_window(
        &mut self,
        s: &OpenSteps,
        complete: bool,
        reason: Option<String>,
        disarm: bool,
        cfg: Option<PlanConfig>,
        kernel: &mut Kernel,
        target: &Target,
    ) -> Result<()> {
        let Some(w) = self.window.take() else {
            return Ok(());
        };
        let mut complete = complete;
        let mut reason = reason;
        let mut errors: Vec<String> = w.errors.clone();

        let mut hooks_meta = Map::new();
        if s.hooks_started {
            for h in &mut self.hooks {
                match h.on_window_end(&w.info, target) {
                    Ok(v) => {
                        hooks_meta.insert(h.name().to_string(), v);
                    }
                    Err(e) => {
                        let m = format!("hook {}: {e:#}", h.name());
                        hooks_meta.insert(h.name().to_string(), json!({ "error": m }));
                        errors.push(m);
                    }
                }
            }
        }

        // The hooks have their stop: what follows (draining, symbolizing,
        // meta.json) can wait, so not at --realtime-boundaries' priority.
        crate::sys::sched::lower_for_work();

        let (start_ts, end_ts) = match (w.steps.first(), w.steps.last()) {
            (Some(a), Some(b)) => (a.start_ts_ns, b.end_ts_ns),
            _ => (w.last_ts_ns, w.last_ts_ns),
        };
        let mut data = WindowData {
            steps: w.steps.clone(),
            process_name: target.comm.clone(),
            host_pid: target.host_pid.0,
            thread_names: thread_names(target),
            ..WindowData::default()
        };
        // The kernel gate is already closed. What only the kernel holds is
        // taken now, then the probes are detached (unless the next cycle is
        // too close to re-attach), before the events are symbolized and the
        // files written: a probe on sched_switch costs every task on the
        // host, and the window is over.
        for &i in &w.collectors {
            self.collectors[i].seal(start_ts, end_ts, kernel);
        }
        if disarm {
            self.disarm_all(kernel);
        }

        let mut ran = Collectors::NONE;
        for &i in &w.collectors {
            let c = &mut self.collectors[i];
            ran.insert(c.kind());
            if let Err(e) = c.drain_into(start_ts, end_ts, &mut data, kernel) {
                errors.push(format!("collector {}: {e:#}", c.name()));
            }
        }

        // Collectors filled their own drop slots, counted from their arm
        // (the gate still closed), which is exact even when the open event
        // was read late; the window counts only the step markers' losses.
        // Unreadable counters make the losses unknown: not complete.
        let drops_now = kernel.drops().unwrap_or_else(|e| {
            errors.push(format!(
                "the kernel's lost-event counters could not be read, so losses are unknown: {e:#}"
            ));
            Default::default()
        });
        data.drops.step = drops_delta(&drops_now, &w.drops_at_open).step;
        let over = &data.budget.dropped_over_budget;
        if over.total() > 0 {
            let m = format!(
                "window {}: too dense for --memory-budget {} MiB: kept {} events, dropped {} past the cap (api {}, cpu {}, offcpu {}); see meta.json `memory`",
                s.id,
                data.budget.budget_bytes >> 20,
                data.budget.events_cap,
                over.total(),
                over.api,
                over.cpu,
                over.offcpu
            );
            log::warn!("{m}");
        }

        if w.steps.is_empty() && complete {
            complete = false;
            reason = Some(if s.last_recorded < s.first_recorded {
                "stopped before any step was recorded".into()
            } else {
                "no step was recorded".into()
            });
        }
        if !errors.is_empty() && complete {
            complete = false;
            reason = Some(errors.join("; "));
        }
        // The kernel gate held exactly the planned steps; fewer recorded
        // means their step events were lost (a full ring), and the window
        // must not pass for complete with steps missing from its tables.
        let planned = (s.last_recorded != u64::MAX && s.last_recorded >= s.first_recorded)
            .then(|| s.last_recorded - s.first_recorded + 1);
        if let Some(planned) = planned
            && complete
            && (w.steps.len() as u64) < planned
        {
            complete = false;
            reason = Some(format!(
                "{} of the {planned} planned steps were recorded: {} step events were lost \
                 (the ring buffer was full; see meta.json `drops`)",
                w.steps.len(),
                data.drops.step
            ));
        }
        let mut meta = Self::meta(
            s,
            &w,
            cfg,
            &data,
            &ran,
            complete,
            reason.as_deref(),
            &errors,
            hooks_meta,
            target,
        );
        // Who held the USDT semaphores (kernel or the /proc/PID/mem fallback).
        meta.usdt_semaphores = serde_json::to_value(kernel.semaphore_report()).unwrap_or_default();
        // The kernel's release and the paths taken on it (docs/portability.md).
        meta.kernel = serde_json::to_value(kernel.paths()).unwrap_or_default();
        // Files are written off the event loop; the notice follows on a tick.
        let job = WriteJob {
            id: s.id,
            first: w.steps.first().map(|s| s.step),
            last: w.steps.last().map(|s| s.step),
            prof: w.prof,
            data,
            ran,
            meta,
            complete,
            reason,
            tag: WriteTag {
                from_config_file: w.req.source == Source::ConfigFile,
                change: w.req.change,
            },
        };
        self.writer_mut()?.submit(job);
        self.last_activity = Instant::now();

        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn meta(
        s: &OpenSteps,
        w: &OpenWindow,
        cfg: Option<PlanConfig>,
        data: &WindowData,
        ran: &Collectors,
        complete: bool,
        reason: Option<&str>,
        errors: &[String],
        hooks: Map<String, Value>,
        target: &Target,
    ) -> WindowMeta {
        let p = &w.req.plan;
        WindowMeta {
            dynprof_version: env!("CARGO_PKG_VERSION").to_string(),
            window: Some(s.id),
            complete: Some(complete),
            incomplete_reason: reason.map(str::to_string),
            target: Some(TargetMeta {
                host_pid: Some(target.host_pid),
                ns_pids: target.ns_pids.clone(),
                ns_pid: Some(target.inner_pid()),
                container: target.container.clone(),
                comm: target.comm.clone(),
                cmdline: target.cmdline.clone(),
                rank: target.rank,
            }),
            trigger: Some(w.req.source),
            plan: Some(PlanMeta {
                start_step: p.start_step,
                warmup: p.warmup,
                active: (!p.open_ended()).then_some(p.active),
                until_stop: p.open_ended(),
                repeat: p.repeat,
                gap: p.gap,
                cycle: s.cycle,
                kernel: cfg.map(|c| KernelPlanMeta {
                    start: c.start,
                    end: c.end,
                    span: c.span,
                    period: c.period,
                }),
            }),
            first_step: Some(s.first_step),
            first_recorded_step: data.steps.first().map(|s| s.step),
            last_recorded_step: data.steps.last().map(|s| s.step),
            steps_recorded: data.steps.len(),
            open_ts_ns: w.open_ts_ns,
            boundaries: w
                .boundaries
                .iter()
                .map(|&(k, ts)| BoundaryMeta {
                    step: k,
                    ts_ns: ts,
                    warmup: k < s.first_recorded,
                })
                .collect(),
            steps: data
                .steps
                .iter()
                .map(|s| StepMeta {
                    step: Some(s.step),
                    start_ts_ns: s.start_ts_ns,
                    end_ts_ns: s.end_ts_ns,
                })
                .collect(),
            collectors: CollectorsMeta {
                api: ran.api,
                cpu: ran.cpu,
                offcpu: ran.offcpu,
            },
            apis_traced: data.apis_traced.clone(),
            api_libraries_pending: data.api_libraries_pending.clone(),
            drops: data.drops.clone(),
            memory: MemoryMeta {
                budget_bytes: data.budget.budget_bytes,
                events_cap: data.budget.events_cap,
                dropped_over_budget: data.budget.dropped_over_budget.clone(),
                // As of the closing boundary; the writer updates it once the
                // files are written (the window's own peak is then known).
                peak_rss_bytes: crate::sys::memory::peak_rss_bytes().ok(),
            },
            hooks,
            errors: errors.to_vec(),
            started_at: w.started_at.clone(),
            ended_at: crate::sys::clock::local_timestamp_human(),
            metadata: w.req.metadata.clone(),
            config: w.req.config.clone(),
            config_change: w.req.change,
            usdt_semaphores: Value::Null,
            kernel: Value::Null,
        }
    }
}

fn drops_delta(now: &Drops, then: &Drops) -> Drops {
    Drops {
        step: now.step.saturating_sub(then.step),
        api: now.api.saturating_sub(then.api),
        cpu: now.cpu.saturating_sub(then.cpu),
        offcpu: now.offcpu.saturating_sub(then.offcpu),
        cpu_stack: now.cpu_stack.saturating_sub(then.cpu_stack),
        offcpu_stack: now.offcpu_stack.saturating_sub(then.offcpu_stack),
        api_nesting: now.api_nesting.saturating_sub(then.api_nesting),
    }
}

/// Host tid → thread name, read now (empty once the target is gone).
fn thread_names(t: &Target) -> Vec<(u32, String)> {
    t.threads()
        .into_iter()
        .filter_map(|tid| {
            let comm = format!("/proc/{}/task/{tid}/comm", t.host_pid);
            let name = std::fs::read_to_string(comm).ok()?;
            Some((tid, name.trim().to_string()))
        })
        .collect()
}
