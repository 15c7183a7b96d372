//! The [`WindowHook`]: msprof's `start` at a window's first recorded
//! boundary, `stop` at its end, and its `PROF_*` directories linked into the
//! window.
use super::*;

impl WindowHook for MsprofHook {
    fn name(&self) -> &'static str {
        "msprof"
    }

    fn prepare(&mut self, target: &Target) -> Result<()> {
        let env = target.environ().ok();
        let mode = env.as_deref().and_then(|e| env_value(e, "PROFILING_MODE"));
        if env.is_some() && mode != Some("dynamic") {
            let msg = format!(
                "msprof attach needs the job to be started with PROFILING_MODE=dynamic in its environment \
                 (PID {} has {}); it cannot be added later. Skipping --collector msprof and continuing with \
                 the built-in collectors. To use msprof next time: `export PROFILING_MODE=dynamic` before \
                 launching the job",
                target.host_pid,
                mode.map_or("no PROFILING_MODE".to_string(), |m| format!(
                    "PROFILING_MODE={m}"
                ))
            );
            eprintln!("dynprof: {msg}");
            self.mode = Mode::Disabled(msg);
            return Ok(());
        }
        if let Err(e) = self.setup(target) {
            let msg = format!("{e:#}");
            eprintln!(
                "dynprof: error: --collector msprof: {msg}; windows will be kept but marked incomplete"
            );
            self.mode = Mode::Broken(msg);
            return Ok(());
        }
        self.mode = Mode::Ready;
        // Connect now, so the first `start` costs only a write.
        match self.ensure_conn() {
            Ok(_) => {}
            Err(e) => eprintln!("dynprof: error: msprof: {e:#} (will retry at the first window)"),
        }
        self.shared.lock().in_window = false;
        let shared = self.shared.clone();
        self.supervisor = Some(
            std::thread::Builder::new()
                .name("msprof-supervisor".into())
                .spawn(move || supervisor(shared))?,
        );
        Ok(())
    }

    fn on_window_start(&mut self, w: &WindowInfo, _target: &Target) -> Result<()> {
        if !matches!(self.mode, Mode::Ready) {
            return Ok(());
        }
        let called = monotonic_ns();
        let mut win = Win {
            hook_called_ns: called,
            conn: None,
            error: None,
            start_write_begin_ns: None,
            start_written_ns: None,
            start_latency_ns: None,
            out_from: 0,
            prompts_at_start: 0,
        };
        match self.ensure_conn() {
            Err(e) => win.error = Some(format!("msprof unavailable at window start: {e:#}")),
            Ok(seq) => {
                let mut g = self.shared.lock();
                let c = g.conn.as_mut().expect("ensured");
                {
                    let o = c.out.lock().unwrap();
                    win.out_from = o.lines.len();
                    win.prompts_at_start = o.prompts;
                }
                match c.write_cmd("start") {
                    Ok((t0, t)) => {
                        c.cmds += 1;
                        win.start_write_begin_ns = Some(t0);
                        win.start_written_ns = Some(t);
                        // `start` answers the first recorded step's boundary.
                        win.start_latency_ns =
                            (w.start_ts_ns > 0).then(|| t.saturating_sub(w.start_ts_ns));
                    }
                    Err(e) => win.error = Some(format!("writing `start` to msprof: {e}")),
                }
                win.conn = Some(seq);
            }
        }
        if let Some(e) = &win.error {
            log::warn!("msprof: window {}: {e}", w.id);
        }
        self.win = Some(win);
        Ok(())
    }

    fn on_window_end(&mut self, w: &WindowInfo, target: &Target) -> Result<Value> {
        match &self.mode {
            Mode::Disabled(reason) => return Ok(json!({"enabled": false, "reason": reason})),
            Mode::Broken(e) => bail!("msprof: {e}"),
            Mode::New => bail!("msprof: not prepared"),
            Mode::Ready => {}
        }
        let Some(win) = self.win.take() else {
            bail!("msprof: window end without a start")
        };
        let mut error = win.error.clone();
        let mut stop_written_ns = None;
        let mut stop_ack_ns = None;
        let mut lines: Vec<(u64, String)> = Vec::new();
        let mut cmds = 0;
        let mut conn_started_ns = None;
        let mut quit_for_limit = false;
        if error.is_none() {
            let mut g = self.shared.lock();
            let timeout = self.cfg.timeout;
            let max = self.cfg.max_commands;
            match g.conn.as_mut() {
                None => error = Some("msprof session vanished during the window".into()),
                Some(c) if c.eof() => {
                    let tail = c.out.lock().unwrap().tail(5);
                    let status = c.child.try_wait().ok().flatten().map(|s| s.to_string());
                    error = Some(format!(
                        "msprof exited unexpectedly during the window (connection {}, status {}); last output: {:?}",
                        c.seq,
                        status.as_deref().unwrap_or("unknown"),
                        tail
                    ));
                }
                Some(c) => match c.write_cmd("stop") {
                    Err(e) => error = Some(format!("writing `stop` to msprof: {e}")),
                    Ok((_, t)) => {
                        c.cmds += 1;
                        stop_written_ns = Some(t);
                        // The stop is done when the prompt returns (start's
                        // prompt + stop's), or msprof ends the session.
                        let want = win.prompts_at_start + 2;
                        let out = c.out.clone();
                        let deadline = Instant::now() + timeout;
                        loop {
                            let (p, eof) = {
                                let o = out.lock().unwrap();
                                (o.prompts, o.eof)
                            };
                            if p >= want {
                                stop_ack_ns = Some(monotonic_ns());
                                break;
                            }
                            if eof {
                                let c = g.conn.as_ref().expect("still there");
                                if c.cmds < max
                                    && !out
                                        .lock()
                                        .unwrap()
                                        .lines
                                        .iter()
                                        .any(|(_, l)| l.contains("closed the connection"))
                                {
                                    error = Some(format!(
                                        "msprof exited right after `stop` (connection {}); last output: {:?}",
                                        c.seq,
                                        out.lock().unwrap().tail(5)
                                    ));
                                }
                                break;
                            }
                            if Instant::now() >= deadline {
                                error = Some(format!(
                                    "msprof did not acknowledge `stop` within {timeout:?}"
                                ));
                                break;
                            }
                            g = self
                                .shared
                                .cv
                                .wait_timeout(g, Duration::from_millis(20))
                                .unwrap()
                                .0;
                        }
                    }
                },
            }
            if let Some(c) = g.conn.as_mut() {
                cmds = c.cmds;
                conn_started_ns = Some(c.started_ns);
                lines = c
                    .out
                    .lock()
                    .unwrap()
                    .lines
                    .get(win.out_from..)
                    .map(<[_]>::to_vec)
                    .unwrap_or_default();
                // Proactively end a connection that has reached msprof's limit;
                // the supervisor reconnects before the next window.
                if c.cmds + 2 > max && !c.eof() {
                    let _ = c.write_cmd("quit");
                    c.quit_sent = true;
                    quit_for_limit = true;
                }
            }
            g.in_window = false;
            self.shared.cv.notify_all();
        } else {
            self.shared.lock().in_window = false;
            self.shared.cv.notify_all();
        }
        let args_used: Vec<String> = self.args_in_use.clone();
        let args_change = self.follow_config();
        let (dirs, list_error) = self.link_dirs(w, target);
        if error.is_none() {
            error = list_error;
        }
        let events = std::mem::take(&mut self.shared.lock().events);
        let errors: Vec<&String> = lines
            .iter()
            .map(|(_, l)| l)
            .filter(|l| l.contains("ERROR"))
            .collect();
        let found = self.found.as_ref();
        let meta = json!({
            "enabled": true,
            "msprof": found.map(|f| &f.path),
            "msprof_found_via": found.map(|f| &f.via),
            "command": self.launch.as_ref().map(|l| l.argv.join(" ")),
            "pid_arg": self.pid_arg,
            "output_in_target": self.output,
            "output_host": self.link_base,
            "runs_as": self.runs_as,
            "connection": win.conn,
            "commands_in_connection": cmds,
            "connection_started_ns": conn_started_ns,
            "boundary_ts_ns": w.start_ts_ns,
            // boundary -> hook called is the event loop's share of the
            // latency; hook called -> written is msprof's (a reconnect).
            "hook_called_ns": win.hook_called_ns,
            "start_write_begin_ns": win.start_write_begin_ns,
            "start_written_ns": win.start_written_ns,
            "start_latency_ns": win.start_latency_ns,
            "stop_written_ns": stop_written_ns,
            "stop_ack_ns": stop_ack_ns,
            "prof_dirs": dirs,
            "output": lines.iter().map(|(t, l)| json!([t, l])).collect::<Vec<_>>(),
            // msprof documents ERROR lines after repeated start/stop as normal.
            "errors_recorded_as_normal": errors,
            "session_events": events,
            "quit_for_command_limit": quit_for_limit,
            "collection_args": args_used,
            "collection_args_change": args_change,
            "error": error,
        });
        if let Some(e) = error {
            // The window itself is kept; meta.json marks it incomplete.
            let _ = hostfs::write_atomic_path(
                &w.dir.join(META_FILE),
                &serde_json::to_vec_pretty(&meta).unwrap_or_default(),
            );
            bail!("msprof: {e} (the window is kept; msprof details in {META_FILE})");
        }
        Ok(meta)
    }

    fn shutdown(&mut self, _target: &Target) -> Result<()> {
        let conn = {
            let mut g = self.shared.lock();
            g.shutdown = true;
            self.shared.cv.notify_all();
            // Wait out a reconnect under way so its session is quit too.
            let deadline = Instant::now() + self.cfg.timeout;
            while g.spawning && Instant::now() < deadline {
                g = self
                    .shared
                    .cv
                    .wait_timeout(g, Duration::from_millis(20))
                    .unwrap()
                    .0;
            }
            g.conn.take()
        };
        if let Some(s) = self.supervisor.take() {
            let _ = s.join();
        }
        if let Some(mut c) = conn {
            if !c.eof() {
                let _ = c.write_cmd("quit");
                let deadline = Instant::now() + Duration::from_secs(5);
                while !c.eof() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            let st = c.reap();
            log::info!("msprof: quit ({st})");
        }
        Ok(())
    }
}

impl Drop for MsprofHook {
    fn drop(&mut self) {
        // Never leave our msprof running (only ours: its own process group).
        let mut g = self.shared.lock();
        g.shutdown = true;
        if let Some(mut c) = g.conn.take() {
            if !c.eof() {
                let _ = c.write_cmd("quit");
                std::thread::sleep(Duration::from_millis(50));
                if !c.eof() {
                    c.kill();
                }
            }
            drop(g);
            c.reap();
        }
        self.shared.cv.notify_all();
    }
}
