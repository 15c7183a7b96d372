//! What reaches the scheduler from the session: events, trigger commands
//! (console, profiler_config.json, job-mode plans), ticks and the end.
use super::*;

impl Scheduler {
    fn status(&self, ctx: &Ctx) -> String {
        let c = ctx.clock;
        let mut s = format!(
            "steps seen {} (current step {}), {:.2} steps/s; ",
            c.steps_seen,
            c.current(),
            c.rate()
        );
        match (self.state.window(), self.state.plan()) {
            (Some(w), _) => {
                let last = if w.last_recorded == u64::MAX {
                    "until stop".into()
                } else {
                    w.last_recorded.to_string()
                };
                let recorded = self.window.as_ref().map_or(0, |o| o.steps.len());
                s.push_str(&format!(
                    "window {} open since step {} (recording {}..{}, {} recorded so far)",
                    w.id, w.first_step, w.first_recorded, last, recorded
                ));
            }
            (None, Some(p)) => {
                s.push_str(&format!("window pending: opens at step {}", p.cfg.start))
            }
            (None, None) => s.push_str("no window"),
        }
        s.push_str(&format!("; windows written {}", self.written.len()));
        // Aux markers count only while attached (around windows).
        let hits = crate::session::marker_hits(ctx.kernel, ctx.probes);
        s.push_str("; marker hits:");
        for (label, n) in hits {
            s.push_str(&format!(" {label} {n},"));
        }
        s.pop();
        if let Some(last) = self.written.last() {
            s.push_str(&format!(" (last: {})", last.dir.display()));
        }
        s
    }

    fn console(&mut self, req: ConsoleRequest, ctx: &mut Ctx) -> Result<String> {
        self.last_activity = Instant::now();
        if req == ConsoleRequest::Status {
            return Ok(self.status(ctx));
        }
        if self.state.plan().is_none() {
            // A console window starts at the next boundary (refused while
            // one is pending or open).
            match &req {
                ConsoleRequest::Start => {
                    self.attach_window_markers(ctx.kernel);
                    self.arm(ctx.kernel, None);
                }
                ConsoleRequest::Capture(plan) => {
                    self.attach_window_markers(ctx.kernel);
                    self.arm_before(ctx.kernel, plan, None, 0);
                }
                _ => {}
            }
        }
        let mut out = Vec::new();
        let r = self.state.console(req, ctx.kernel, self.lead(), &mut out);
        self.carry_out(out, ctx.kernel, ctx.target, None)?;
        Ok(r.unwrap_or_else(|e| format!("error: {e:#}")))
    }

    /// A plan from outside the session (job mode): submitted like a
    /// console `capture`, its answer printed as a notice.
    fn on_plan(&mut self, req: PlanRequest, ctx: &mut Ctx) -> Result<()> {
        self.last_activity = Instant::now();
        self.attach_window_markers(ctx.kernel);
        self.arm_before(ctx.kernel, &req.plan, req.collect.as_ref(), 0);
        let mut out = Vec::new();
        let r = self.state.submit(req, ctx.kernel, self.lead(), &mut out);
        self.carry_out(out, ctx.kernel, ctx.target, None)?;
        self.notice(r.unwrap_or_else(|e| format!("plan refused: {e:#}")));
        Ok(())
    }

    fn on_config(&mut self, ev: &ConfigChanged, ctx: &mut Ctx) {
        self.last_activity = Instant::now();
        let Some(cfg) = &mut self.config else { return };
        let Some(req) = cfg.on_change(ev, ctx.target) else {
            return;
        };
        let change = req.change;
        let deferred = self.state.window().is_some();
        self.attach_window_markers(ctx.kernel);
        self.arm_before(ctx.kernel, &req.plan, req.collect.as_ref(), 0);
        let mut out = Vec::new();
        let r = self.state.submit(req, ctx.kernel, self.lead(), &mut out);
        if let Err(e) = self.carry_out(out, ctx.kernel, ctx.target, None) {
            log::error!("{e:#}");
        }
        let (ok, m) = match &r {
            Ok(m) => (true, m.clone()),
            Err(e) => (false, format!("refused: {e:#}")),
        };
        if let Some(cfg) = &mut self.config {
            if deferred {
                cfg.monitor_deferred(change, &m);
            } else {
                cfg.monitor_result(change, ok, &m);
            }
        }
        self.notice(format!(
            "profiler_config.json change {}: {m}",
            change.unwrap_or(0)
        ));
    }
}

impl Observer<SessionCommand> for Scheduler {
    fn on_event(
        &mut self,
        ev: &Decoded,
        completed: Option<&CompletedStep>,
        ctx: &mut Ctx,
    ) -> Result<()> {
        self.remember_target(ctx.target);
        self.prepare_hooks(ctx.target);
        self.prepare_collectors(ctx.target);
        for (i, c) in self.collectors.iter_mut().enumerate() {
            if self.armed[i].is_some() {
                c.on_event(ev);
            }
        }
        if let Decoded::Step(s) = ev
            && s.role == role::STEP
        {
            self.on_step(s.step, s.hdr.ts_ns, s.gate != 0, completed, ctx)?;
        }
        Ok(())
    }

    fn on_command(&mut self, cmd: &mut SessionCommand, ctx: &mut Ctx) -> Result<()> {
        self.remember_target(ctx.target);
        match cmd {
            SessionCommand::Console(c) => {
                let text = self.console(c.req.clone(), ctx)?;
                let _ = c.reply.send(Reply { text });
            }
            SessionCommand::ConfigChanged(ev) => self.on_config(ev, ctx),
            SessionCommand::SetNoticePrinter(p) => {
                let f: NoticePrinter = std::mem::replace(&mut p.0, Box::new(|_| {}));
                self.printer = Some(f);
            }
            SessionCommand::Plan(req) => self.on_plan((**req).clone(), ctx)?,
            SessionCommand::EndAt(last) => {
                self.last_activity = Instant::now();
                let mut out = Vec::new();
                let r = self.state.end_at(*last, ctx.kernel, &mut out);
                self.carry_out(out, ctx.kernel, ctx.target, None)?;
                self.notice(r.unwrap_or_else(|e| format!("stop refused: {e:#}")));
            }
        }
        Ok(())
    }

    fn on_start(&mut self, ctx: &mut Ctx) -> Result<()> {
        self.remember_target(ctx.target);
        self.prepare_hooks(ctx.target);
        self.prepare_collectors(ctx.target);
        Ok(())
    }

    fn on_tick(&mut self, ctx: &mut Ctx) -> Result<()> {
        self.report_written(false);
        self.remember_target(ctx.target);
        self.prepare_hooks(ctx.target);
        self.prepare_collectors(ctx.target);
        if let Some(t) = self.opts.idle_timeout
            && !self.state.done()
            && self.state.window().is_none()
            && self.state.plan().is_none()
            && self.last_activity.elapsed() >= t
        {
            self.notice(format!(
                "idle for {} s without a command or window; detaching",
                t.as_secs()
            ));
            self.state.set_done();
        }
        Ok(())
    }

    fn finish(&mut self, end: &EndReason, ctx: &mut Ctx) -> Result<()> {
        self.remember_target(ctx.target);
        let reason = match end {
            EndReason::Done if self.state.quitting() => "detached (quit)".to_string(),
            EndReason::Done => "detached".to_string(),
            other => other.describe().to_string(),
        };
        let mut out = Vec::new();
        let now = ctx.clock.current().0;
        self.state
            .finish(reason, end.describe(), now, ctx.kernel, &mut out);
        self.carry_out(out, ctx.kernel, ctx.target, None)?;
        for h in &mut self.hooks {
            if let Err(e) = h.shutdown(ctx.target) {
                log::warn!("hook {}: shutdown: {e:#}", h.name());
            }
        }
        self.report_written(true);
        if let Some(c) = &mut self.config {
            c.ended(end.describe(), self.written.len());
        }
        Ok(())
    }

    fn wants_exit(&self) -> bool {
        self.state.done()
    }
}
