//! What the triggers ask of the controller: a console line, a
//! profiler_config.json save, and the `status` answer.
use super::*;

impl Controller {
    pub(super) fn on_command(&mut self, cmd: Command) {
        self.last_activity = Instant::now();
        match cmd {
            Command::SetNoticePrinter(mut p) => {
                let f = std::mem::replace(&mut p.0, Box::new(|_| {}));
                self.printer = Some(f);
            }
            Command::Console(c) => {
                let text = self.console(c.req);
                let _ = c.reply.send(crate::window::trigger::Reply { text });
            }
            Command::ConfigChanged(ev) => self.on_config(&ev),
            // Sent by the controller to the ranks, never to itself.
            Command::Plan(_) | Command::EndAt(_) => {}
        }
    }

    fn console(&mut self, req: ConsoleRequest) -> String {
        match req {
            ConsoleRequest::Status => self.status(),
            ConsoleRequest::Quit => {
                // An open window first ends on the same job step on every
                // rank, so that it is written complete.
                if self.running.as_ref().is_some_and(|r| r.open_ended()) {
                    let m = self.end_running();
                    self.quit_after_window = true;
                    return format!("{m}; detaching from every rank once it is written");
                }
                self.quitting = true;
                "detaching from every rank; the job keeps running".into()
            }
            ConsoleRequest::Stop => {
                if self.running.is_some() {
                    self.end_running()
                } else if self.pending.take().is_some() {
                    "the window waiting to be planned is cancelled".into()
                } else {
                    "no job window open or pending".into()
                }
            }
            ConsoleRequest::Start | ConsoleRequest::Capture(_) => {
                let plan = match req {
                    ConsoleRequest::Capture(plan) => plan,
                    _ => Plan::until_stop(),
                };
                let req = JobRequest {
                    plan,
                    source: Source::Console,
                    collect: self.s.collect.clone(),
                    prof_dir: None,
                    rank_list: None,
                    metadata: None,
                    config: None,
                    change: None,
                    series: None,
                };
                self.submit(req)
            }
        }
    }

    /// A console or config-file window: planned now if it can be, else
    /// when the ranks are aligned or the running window is written (the
    /// last one asked for wins).
    fn submit(&mut self, req: JobRequest) -> String {
        if self.running.is_some() {
            let replaced = self.pending.replace(req).is_some();
            return format!(
                "a job window is running; this one is planned when it is written{}",
                if replaced {
                    " (it replaces the one waiting)"
                } else {
                    ""
                }
            );
        }
        if self.alignment.is_none() {
            self.pending = Some(req);
            return "the ranks are not aligned yet; the window is planned once they are".into();
        }
        match self.try_plan(req) {
            PlanOutcome::Planned(what) => what,
            PlanOutcome::NotYet(req) => {
                self.pending = Some(*req);
                "waiting for the ranks' next boundary to plan the window".into()
            }
            PlanOutcome::Refused => "error: the window was refused (see above)".into(),
        }
    }

    fn on_config(&mut self, ev: &crate::window::trigger::config_file::ConfigChanged) {
        let Some(target) = self.s.ranks.first().map(|r| r.target.clone()) else {
            return;
        };
        let Some(cfg) = &mut self.s.config else {
            return;
        };
        let Some(pr) = cfg.on_change(ev, &target) else {
            return;
        };
        let rank_list = cfg.rank_filter().map(<[i64]>::to_vec);
        if pr.plan.start_step == 0 {
            // No collection: drops a window not planned yet. One already
            // planned runs (its plans are in the ranks' kernels).
            let dropped = self.pending.take().is_some();
            let m = if dropped {
                "start_step 0: the window waiting to be planned is dropped"
            } else {
                "start_step 0: no collection"
            };
            cfg.info(m);
            self.notice(format!(
                "profiler_config.json change {}: {m}",
                pr.change.unwrap_or(0)
            ));
            return;
        }
        let collect =
            with_job_collectors(pr.collect.clone().unwrap_or_else(|| self.s.collect.clone()));
        let change = pr.change;
        let req = JobRequest {
            plan: pr.plan,
            source: Source::ConfigFile,
            collect,
            prof_dir: pr.output.clone(),
            rank_list,
            metadata: pr.metadata.clone(),
            config: pr.config.clone(),
            change,
            series: None,
        };
        let deferred = self.running.is_some() || self.alignment.is_none();
        let m = self.submit(req);
        if deferred && let Some(c) = &mut self.s.config {
            c.monitor_deferred(change, &m);
        }
        self.notice(format!(
            "profiler_config.json change {}: {m}",
            change.unwrap_or(0)
        ));
    }

    fn status(&self) -> String {
        let mut s = format!(
            "job of {} rank(s), {} still attached; ",
            self.s.ranks.len(),
            self.live().len()
        );
        match &self.alignment {
            Some(a) => s.push_str(&format!(
                "aligned (reference rank {}, step period {:.3} ms), job step now {}; ",
                a.reference,
                a.period_ns as f64 / 1e6,
                self.job_now().map_or("?".into(), |n| n.to_string())
            )),
            None => s.push_str("aligning the ranks; "),
        }
        match &self.running {
            Some(r) if r.open_ended() => s.push_str(&format!(
                "job window {} planned for job steps {}.. until `stop`",
                r.n,
                r.first()
            )),
            Some(r) => s.push_str(&format!(
                "job window {} planned for job steps {}..={}",
                r.n,
                r.first(),
                r.last()
            )),
            None => s.push_str("no window"),
        }
        if self.pending.is_some() {
            s.push_str("; one window waiting");
        }
        // Per rank, as of its last tick: aux markers count only while
        // attached, around job windows.
        s.push_str("; marker hits:");
        for r in &self.s.ranks {
            let hits = r.tap.borrow().marker_hits.clone();
            let list: Vec<String> = hits.iter().map(|(l, n)| format!("{l} {n}")).collect();
            s.push_str(&format!(" rank {} [{}]", r.rank(), list.join(", ")));
        }
        s.push_str(&format!("; job windows written {}", self.written.len()));
        if let Some(last) = self.written.last() {
            s.push_str(&format!(" (last: {})", last.display()));
        }
        s
    }
}
