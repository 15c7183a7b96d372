//! The controller's planning: a job window's plan sent to each rank in its
//! own step indices (`try_plan`), ended on a common job step (`stop`), or
//! refused; and the job directory each window gets.
use super::*;

impl Controller {
    /// A job directory for window `n` below `prof_dir`.
    pub(super) fn job_dir(
        &self,
        n: u64,
        prof_dir: Option<&Path>,
    ) -> Result<(crate::sys::hostfs::HostDir, String, PathBuf)> {
        let name = format!(
            "{}{}_{}_{n}",
            job::JOB_DIR_PREFIX,
            crate::sys::clock::local_timestamp(),
            self.s.members[0].host_pid
        );
        let parent = match prof_dir {
            Some(rel) => self.s.root.subdir(rel)?,
            None => self.s.root.dir().try_clone()?,
        };
        let dir = parent
            .create_subdir(&name, 0o755)
            .with_context(|| format!("creating {name} in {}", parent.path().display()))?;
        let path = dir.path().to_path_buf();
        Ok((dir, name, path))
    }

    /// The job's alignment failed: `job_meta.json` with the error, so that
    /// `dynprof report` says why nothing was recorded.
    pub(super) fn write_error(&mut self, why: &str) {
        self.planned += 1;
        let meta = json!({"ranks": self.s.members, "error": why, "rank_source": self.s.source});
        match self.job_dir(self.planned, None) {
            Ok((dir, _, _)) => {
                let _ = dir.write_atomic(
                    job::JOB_META_FILE,
                    serde_json::to_string_pretty(&meta)
                        .unwrap_or_default()
                        .as_bytes(),
                );
            }
            Err(e) => log::error!("{e:#}"),
        }
    }

    /// Plans `req` on its ranks.
    pub(super) fn try_plan(&mut self, req: JobRequest) -> PlanOutcome {
        let Some(a) = self.alignment.clone() else {
            return PlanOutcome::NotYet(Box::new(req));
        };
        let Some(now) = self.job_now() else {
            return PlanOutcome::NotYet(Box::new(req));
        };
        let lead = align::lead_steps(a.period_ns, self.live().len());
        let live: Vec<Rank> = self
            .live()
            .iter()
            .map(|r| r.rank())
            .filter(|r| a.ranks.iter().any(|x| x.rank == *r))
            .collect();
        let sel = match job::window::select_ranks(&live, req.rank_list.as_deref()) {
            Ok(s) => s,
            Err(why) => {
                self.refused(&req, &why);
                return PlanOutcome::Refused;
            }
        };
        if !sel.unknown.is_empty() {
            self.notice(format!(
                "rank_list names {:?}, which are not running ranks of this job",
                sel.unknown
            ));
        }
        let requested = match req.series {
            Some((s0, n)) => {
                job::window::repeat_start(s0, req.plan.warmup, req.plan.active, req.plan.gap, n)
                    as i64
            }
            None => req.plan.start_step,
        };
        let start_at = (self.planned == 0 && req.source == Source::Flags)
            .then_some(self.s.start_at)
            .flatten();
        let (start, moved) = match start_at {
            None => align::job_start(requested, now, lead),
            Some(at) => {
                // The reference rank's first boundary at or after the
                // common instant; until it is seen, wait.
                let first = self
                    .s
                    .ranks
                    .iter()
                    .find(|r| r.rank() == a.reference)
                    .and_then(|r| {
                        r.tap
                            .borrow()
                            .hits
                            .iter()
                            .find(|x| x.0.ts_ns >= at.mono_ns)
                            .map(|x| x.0.step)
                    });
                let Some(b) = first else {
                    return PlanOutcome::NotYet(Box::new(req));
                };
                let want = b + at.after_steps;
                let (s, moved) = align::job_start(want as i64, now, lead);
                if moved {
                    eprintln!(
                        "dynprof: job: WARNING: job step {want} ({} after the first boundary at --start-at) is too close to be planned; other nodes may start at {want}",
                        at.after_steps
                    );
                }
                (s, moved)
            }
        };
        self.planned += 1;
        let n = self.planned;
        let (dir, name, path) = match self.job_dir(n, req.prof_dir.as_deref()) {
            Ok(v) => v,
            Err(e) => {
                self.refused(&req, &format!("{e:#}"));
                return PlanOutcome::Refused;
            }
        };
        let rel_base = req.prof_dir.clone().unwrap_or_default().join(&name);
        let open = req.plan.open_ended();
        let last = if open {
            u64::MAX
        } else {
            start + req.plan.warmup + req.plan.active - 1
        };
        let mut ranks = Vec::new();
        for r in self
            .s
            .ranks
            .iter()
            .filter(|r| sel.ranks.contains(&r.rank()))
        {
            let rank = r.rank();
            let own_last = if open {
                Some(u64::MAX)
            } else {
                a.own_step(rank, last)
            };
            let (Some(own), Some(own_last)) = (a.own_step(rank, start), own_last) else {
                continue;
            };
            let rank_dir = job::rank_dir_name(rank);
            if let Err(e) = dir.create_subdir(&rank_dir, 0o755) {
                log::error!("creating {rank_dir}: {e}");
                continue;
            }
            let mut p = req.plan;
            p.start_step = own as i64;
            p.repeat = 0;
            p.gap = 0;
            let mut pr = PlanRequest::new(p, req.source);
            pr.collect = Some(req.collect.clone());
            pr.output = Some(rel_base.join(&rank_dir));
            let mut md = json!({"job_start_step": start, "rank": rank.0, "job_window": n});
            if let Some(m) = &req.metadata {
                md["metadata"] = m.clone();
            }
            pr.metadata = Some(md);
            pr.config = req.config.clone();
            pr.change = req.change;
            let _ = r.tx.send(Command::Plan(Box::new(pr)));
            ranks.push((rank, own, own_last));
        }
        let gone: Vec<(Member, String)> = self
            .s
            .ranks
            .iter()
            .filter(|r| !r.alive() && !sel.ranks.contains(&r.rank()))
            .map(|r| {
                let why = r
                    .ended
                    .borrow()
                    .as_ref()
                    .and_then(|e| e.problem.clone())
                    .unwrap_or_else(|| "its session ended".into());
                (r.member.clone(), why)
            })
            .collect();
        if moved && req.series.is_none() && start_at.is_none() {
            self.notice(format!(
                "start step {requested} was too close once the ranks were aligned; the window starts at job step {start}"
            ));
        } else if moved && req.series.is_some() {
            self.notice(format!(
                "repeat window {n} asked for job step {requested}, too close to be planned once every rank had opened the window before; it starts at job step {start}"
            ));
        }
        let steps = if open {
            format!("{}.. until `stop`", start + req.plan.warmup)
        } else {
            format!("{}..={last}", start + req.plan.warmup)
        };
        let what = format!(
            "job window {n} records job steps {steps} on rank(s) {}: {}",
            sel.ranks
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(","),
            path.display()
        );
        if let Some(c) = &mut self.s.config
            && req.source == Source::ConfigFile
        {
            c.monitor_result(req.change, true, &what);
        }
        self.notice(what.clone());
        self.running = Some(Running {
            req,
            n,
            dir,
            path,
            ranks,
            gone,
            start,
            requested,
            moved,
            passed: HashMap::new(),
        });
        PlanOutcome::Planned(what)
    }

    /// `stop` (or `quit`) during a job window: it ends on the same job
    /// step on every rank, the first one every rank's plan can still
    /// reach (the same lead as a start), and never before its first
    /// recorded step.
    pub(super) fn end_running(&mut self) -> String {
        let (Some(a), Some(now)) = (self.alignment.clone(), self.job_now()) else {
            return "error: the ranks are not aligned; the window cannot be ended".into();
        };
        let lead = align::lead_steps(a.period_ns, self.live().len());
        let Some(run) = self.running.as_mut() else {
            return "no job window open or pending".into();
        };
        let end = now.saturating_add(lead).max(run.first());
        if end >= run.last() {
            return format!(
                "job window {} ends at job step {} anyway",
                run.n,
                run.last()
            );
        }
        run.req.plan.active = end - run.first() + 1;
        for (rank, _, own_last) in &mut run.ranks {
            let Some(own) = a.own_step(*rank, end) else {
                continue;
            };
            *own_last = own;
            if let Some(r) = self.s.ranks.iter().find(|r| r.rank() == *rank) {
                let _ = r.tx.send(Command::EndAt(own));
            }
        }
        let msg = format!(
            "job window {} ends after job step {end} ({} recorded steps)",
            run.n, run.req.plan.active
        );
        self.notice(msg.clone());
        msg
    }

    pub(super) fn refused(&mut self, req: &JobRequest, why: &str) {
        if let Some(c) = &mut self.s.config
            && req.source == Source::ConfigFile
        {
            c.monitor_result(req.change, false, why);
        }
        self.notice(format!("window refused: {why}"));
        if req.source == Source::Flags {
            self.failures
                .push(format!("job window not recorded: {why}"));
        }
    }
}
