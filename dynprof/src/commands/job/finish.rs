//! One job window written: each rank's own window read back, the job's
//! `job_steps.csv`, merged `trace.json`, `job_meta.json` and the verdict.
use super::*;

impl Controller {
    /// Writes the job files of a window whose ranks are all done; a window
    /// with no row at all gets only `job_meta.json` with the error.
    pub(super) fn finish(&mut self, run: Running) {
        let last = run.last();
        // The console's idle timeout counts from the last window, too.
        self.last_activity = Instant::now();
        let r = self.write_window(&run);
        let msg = match &r {
            Ok(m) => m.clone(),
            Err(e) => format!("job window {} not recorded: {e:#}", run.n),
        };
        if let Err(e) = &r {
            eprintln!("dynprof: job window not recorded: {e:#}");
            if run.req.source == Source::Flags {
                self.failures
                    .push(format!("job window not recorded: {e:#}"));
            }
        } else {
            self.written.push(run.path.clone());
        }
        if let Some(c) = &mut self.s.config
            && run.req.source == Source::ConfigFile
        {
            c.window_written(run.req.change, &msg);
        }
        if run.req.source == Source::Console {
            self.notice(msg);
        }
        // Off-CPU intervals before the window's end are not needed again.
        for rk in &self.s.ranks {
            let mut t = rk.tap.borrow_mut();
            let cut = t
                .hits
                .iter()
                .rev()
                .find(|h| {
                    self.alignment
                        .as_ref()
                        .and_then(|a| a.job_step(rk.rank(), h.0.step))
                        .is_some_and(|j| j <= last.saturating_add(1))
                })
                .map(|h| h.0.ts_ns);
            if let Some(cut) = cut {
                t.offcpu.retain(|o| o.ts_ns + o.dur_ns >= cut);
            }
        }
    }

    /// Every rank closed `run`: a `--repeat` plans its next window now.
    pub(super) fn on_closed(&mut self, run: &Running) {
        if let (Trigger::Flags(plan), Source::Flags) = (&self.s.trigger, run.req.source) {
            let (s0, k) = run.req.series.unwrap_or((run.start, 0));
            if k < plan.repeat {
                let mut next = run.req.clone();
                next.series = Some((s0, k + 1));
                self.pending = Some(next);
            }
        }
    }

    fn write_window(&mut self, run: &Running) -> Result<String> {
        let alignment = self.alignment.clone().expect("planned windows are aligned");
        let (first, last) = (run.first(), run.last());
        let job_dir = &run.dir;
        let job_path = &run.path;
        let mut rows = Vec::new();
        let mut waits: Vec<(Rank, Vec<OffCpu>)> = Vec::new();
        let mut rank_meta = Vec::new();
        for rk in self
            .s
            .ranks
            .iter()
            .filter(|r| run.ranks.iter().any(|x| x.0 == r.rank()))
        {
            let m = &rk.member;
            let ended = rk.ended.borrow().clone();
            let mut problem: Option<String> = None;
            let offset = alignment
                .ranks
                .iter()
                .find(|a| a.rank == m.rank)
                .map(|a| a.offset)
                .unwrap_or_default();
            let rank_dir = job_path.join(job::rank_dir_name(m.rank));
            let win = rank_window(&rank_dir);
            let window_dir = win
                .as_ref()
                .map(|w| format!("{}/{w}", job::rank_dir_name(m.rank)));
            let mut own_rows = Vec::new();
            let mut wait_source = None;
            match &win {
                None => {
                    problem = Some(
                        ended
                            .as_ref()
                            .and_then(|e| e.problem.clone())
                            .unwrap_or_else(|| "its window was not written".into()),
                    );
                }
                Some(w) => {
                    let dir = rank_dir.join(w);
                    match crate::sys::hostfs::read_path_capped(&dir.join("steps.csv"), 64 << 20)
                        .map_err(anyhow::Error::from)
                        .and_then(|t| table::parse_steps_csv(&t))
                    {
                        Ok(steps) => {
                            let t = rk.tap.borrow();
                            let tids: HashMap<u64, u32> =
                                t.hits.iter().map(|(h, tid)| (h.step, *tid)).collect();
                            let source = table::WaitSource::of(
                                &steps,
                                run.req.collect.contains(&Builtin::Offcpu),
                            );
                            wait_source = Some(source);
                            own_rows =
                                table::rank_rows(m.rank, offset, &steps, source, &tids, &t.offcpu);
                            let step_tids: std::collections::HashSet<u32> = steps
                                .iter()
                                .filter_map(|s| tids.get(&s.step).copied())
                                .collect();
                            waits.push((
                                m.rank,
                                t.offcpu
                                    .iter()
                                    .filter(|o| step_tids.contains(&o.tid))
                                    .copied()
                                    .collect(),
                            ));
                            if t.offcpu_dropped > 0 {
                                problem = Some(format!(
                                    "{} off-CPU intervals dropped (memory cap)",
                                    t.offcpu_dropped
                                ));
                            }
                        }
                        Err(e) => problem = Some(format!("reading its steps.csv: {e:#}")),
                    }
                    let meta =
                        crate::sys::hostfs::read_path_capped(&dir.join("meta.json"), 4 << 20)
                            .ok()
                            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
                    if let Some(mv) = meta
                        && mv.get("complete") == Some(&json!(false))
                    {
                        let why = mv
                            .get("incomplete_reason")
                            .and_then(|v| v.as_str())
                            .unwrap_or("?");
                        problem = Some(match ended.as_ref().and_then(|e| e.problem.clone()) {
                            Some(p) => format!("{p}; window incomplete: {why}"),
                            None => format!("window incomplete: {why}"),
                        });
                    }
                }
            }
            let got: Vec<u64> = own_rows.iter().map(|r| r.step).collect();
            if problem.is_none() && run.open_ended() {
                // Ended without `stop` (SIGINT, the ranks exited): no
                // common last step was set.
                problem = Some(
                    "the window was not ended by `stop`, so its last step differs between ranks"
                        .into(),
                );
            } else if problem.is_none() && !got.iter().copied().eq(first..=last) {
                problem = Some(format!(
                    "recorded job steps {got:?}, expected {first}..={last}"
                ));
            }
            rows.extend(own_rows);
            rank_meta.push(json!({
                "rank": m.rank,
                "host_pid": m.host_pid,
                "world_size": m.world_size,
                "offset": offset,
                "own_steps": [alignment.own_step(m.rank, first), alignment.own_step(m.rank, last)],
                "window_dir": window_dir,
                "collective_wait_from": wait_source,
                "problem": problem,
                "session": ended.and_then(|e| e.summary),
            }));
        }
        // Ranks of the job not in this window by no choice of the plan:
        // ended before it, left out of the alignment, never attached.
        for (m, why) in &run.gone {
            rank_meta.push(json!({
                "rank": m.rank, "host_pid": m.host_pid, "world_size": m.world_size,
                "problem": why,
            }));
        }
        for (m, why) in &self.s.not_attached {
            rank_meta.push(json!({
                "rank": m.rank, "host_pid": m.host_pid, "world_size": m.world_size,
                "problem": why,
            }));
        }
        rows.sort_by_key(|r| (r.step, r.rank));
        let ranks: Vec<Rank> = run.ranks.iter().map(|r| r.0).collect();
        let check: Vec<(Rank, u64, u64, u64)> = rows
            .iter()
            .map(|r| (r.rank, r.step, r.start_ts_ns, r.duration_ns))
            .collect();
        let verification = align::verify(&ranks, &check);
        let v = verdict::verdict(&verdict::per_rank(&rows));
        let problems: Vec<String> = rank_meta
            .iter()
            .filter_map(|r| {
                let p = r.get("problem")?.as_str()?;
                Some(format!("rank {}: {p}", r["rank"]))
            })
            .collect();
        let complete = problems.is_empty() && verification.ok;
        let plan = &run.req.plan;
        let mut meta = json!({
            "complete": complete,
            "window": run.n,
            "trigger": run.req.source,
            "plan": {
                "job_steps": format!("{first}..={last}"),
                "start_step": run.start, "warmup": plan.warmup, "active": plan.active,
                "requested_start_step": run.requested, "moved": run.moved,
                "repeat": run.req.series.map(|s| s.1),
            },
            "rank_list": run.req.rank_list,
            "job_step_is": "the reference (lowest) rank's own step index, counted from its attach",
            "rank_source": self.s.source,
            "collective_wait_is": "per rank (`collective_wait_from`): time in c10d's collective-wait calls (collective_calls), or else off-CPU time of the thread that crosses the step boundary (step_thread_off_cpu); less device wait either way",
            "alignment": alignment,
            "verification": verification,
            "ranks": rank_meta,
            // --follow: earlier processes of these ranks (an elastic
            // restart's old workers), replaced before this window.
            "replaced": self.s.replaced.iter().map(|m| json!({
                "rank": m.rank, "host_pid": m.host_pid,
            })).collect::<Vec<_>>(),
            "verdict": v.text,
            "stragglers": v.stragglers,
        });
        if let Some(md) = &run.req.metadata {
            meta["metadata"] = md.clone();
        }
        if let Some(c) = &run.req.config {
            meta["config"] = c.clone();
        }
        if rows.is_empty() {
            // Nothing to compare: no table that looks like a (empty) result.
            let why = format!("no rank recorded its window ({})", problems.join("; "));
            meta["error"] = json!(why);
            job_dir.write_atomic(
                job::JOB_META_FILE,
                serde_json::to_string_pretty(&meta)?.as_bytes(),
            )?;
            bail!("{why}");
        }
        job_dir.write_atomic(job::JOB_STEPS_FILE, &table::to_csv(&rows))?;
        job_dir.write_atomic(
            job::trace::TRACE_FILE,
            serde_json::to_string(&job::trace::merged(&rows, &waits))?.as_bytes(),
        )?;
        job_dir.write_atomic(
            job::JOB_META_FILE,
            serde_json::to_string_pretty(&meta)?.as_bytes(),
        )?;
        if let Some(owner) = self.s.chown {
            let _ = job_dir.chown_tree(owner.uid, owner.gid);
        }
        let msg = if complete {
            format!(
                "job window written: {} (job steps {first}..={last})",
                job_path.display()
            )
        } else {
            format!(
                "job window written INCOMPLETE: {} (job steps {first}..={last}){}",
                job_path.display(),
                problems
                    .iter()
                    .map(|p| format!("; {p}"))
                    .collect::<String>()
            )
        };
        // A console window's line goes through the console's printer
        // (`finish`); printed here too, it reached the user twice.
        if run.req.source != Source::Console {
            eprintln!("dynprof: {msg}");
        }
        if !verification.ok {
            eprintln!(
                "dynprof: job: alignment NOT confirmed: ranks {:?} not clearly on the reference's iterations (mean start distance over {:.3} ms, or not half of the neighbouring steps'), missing {:?}; largest start spread {:.3} ms",
                verification.unclear,
                verification.bound_ns as f64 / 1e6,
                verification.missing,
                verification.max_skew_ns as f64 / 1e6
            );
        }
        eprintln!("dynprof: {}", v.text);
        if self.s.json {
            println!(
                "{}",
                json!({"event": "job_window", "dir": job_path, "verdict": v.text, "stragglers": v.stragglers})
            );
        }
        Ok(msg)
    }
}
