//! One msprof process (a connection) on a pty, what it printed, and the
//! supervisor thread that reconnects after msprof's own limits end one.
use super::*;

/// What msprof printed on one connection.
#[derive(Default)]
pub(super) struct Output {
    /// (CLOCK_MONOTONIC ns, line)
    pub(super) lines: Vec<(u64, String)>,
    pub(super) partial: Vec<u8>,
    pub(super) prompts: u64,
    pub(super) eof: bool,
}

impl Output {
    pub(super) fn feed(&mut self, data: &[u8]) {
        let ts = monotonic_ns();
        self.partial.extend_from_slice(data);
        loop {
            // A prompt is `>` (plus a space) at the start of a line.
            if self.partial.starts_with(b"> ") || self.partial.as_slice() == b">" {
                let n = if self.partial.starts_with(b"> ") {
                    2
                } else {
                    1
                };
                self.partial.drain(..n);
                self.prompts += 1;
                continue;
            }
            let Some(nl) = self.partial.iter().position(|&b| b == b'\n') else {
                break;
            };
            let line: Vec<u8> = self.partial.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line)
                .trim_end_matches(['\n', '\r'])
                .to_string();
            if !line.trim().is_empty() {
                self.lines.push((ts, line));
            }
        }
    }

    pub(super) fn tail(&self, n: usize) -> Vec<String> {
        self.lines[self.lines.len().saturating_sub(n)..]
            .iter()
            .map(|(_, l)| l.clone())
            .collect()
    }
}

/// One msprof session (one connection to the job's profiling server).
pub(super) struct Conn {
    pub(super) seq: u32,
    pub(super) child: Child,
    /// Process group (= the child's pid: it is a session leader).
    pub(super) pgid: i32,
    pub(super) master: std::fs::File,
    pub(super) out: Arc<Mutex<Output>>,
    pub(super) reader: Option<JoinHandle<()>>,
    /// start + stop commands written on this connection.
    pub(super) cmds: u32,
    pub(super) quit_sent: bool,
    pub(super) started_ns: u64,
    /// The target's permitted capabilities this msprof runs without
    /// (`AsTarget::withheld_caps`).
    pub(super) caps_withheld: u64,
}

impl Conn {
    pub(super) fn eof(&self) -> bool {
        self.out.lock().unwrap().eof
    }

    /// Writes one command line; returns (ns before the write, ns after it).
    pub(super) fn write_cmd(&mut self, cmd: &str) -> std::io::Result<(u64, u64)> {
        let line = format!("{cmd}\n");
        let t0 = monotonic_ns();
        self.master.write_all(line.as_bytes())?;
        Ok((t0, monotonic_ns()))
    }

    pub(super) fn kill(&mut self) {
        // SAFETY: signals our own child's process group (never the target).
        unsafe { libc::kill(-self.pgid, libc::SIGKILL) };
    }

    /// Reaps the child (after EOF, or after killing it). Returns its status.
    pub(super) fn reap(mut self) -> String {
        let st = match self.child.try_wait() {
            Ok(Some(st)) => st.to_string(),
            _ => {
                let deadline = Instant::now() + Duration::from_secs(2);
                loop {
                    if let Ok(Some(st)) = self.child.try_wait() {
                        break st.to_string();
                    }
                    if Instant::now() > deadline {
                        self.kill();
                        break self.child.wait().map(|s| s.to_string()).unwrap_or_default();
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        };
        drop(self.master);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        st
    }
}

#[derive(Default)]
pub(super) struct State {
    pub(super) conn: Option<Conn>,
    pub(super) seq: u32,
    pub(super) spawning: bool,
    pub(super) in_window: bool,
    pub(super) shutdown: bool,
    /// Reconnects and session ends since the last window's meta.
    pub(super) events: Vec<Value>,
    /// How to (re)start msprof; replaced when the collection switches change.
    pub(super) launch: Option<Arc<Launch>>,
}

pub(super) struct Shared {
    pub(super) state: Mutex<State>,
    pub(super) cv: Condvar,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Everything needed to (re)start msprof.
pub(super) struct Launch {
    /// msprof (a path inside the target's root) and its arguments.
    pub(super) argv: Vec<String>,
    pub(super) env: Vec<(String, String)>,
    pub(super) timeout: Duration,
    /// Whom msprof runs as (credentials are re-read at every connection).
    pub(super) target: HostPid,
    pub(super) exec: ExecOptions,
    /// start+stop commands per connection (`--msprof-max-commands`).
    pub(super) max_commands: u32,
}

pub(super) fn spawn_conn(l: &Launch, seq: u32, shared: &Arc<Shared>) -> Result<Conn> {
    let pty = pty::open().map_err(|e| anyhow!("opening a pty for msprof: {e}"))?;
    let as_target = AsTarget::prepare(l.target, l.exec)
        .map_err(|e| anyhow!("cannot run msprof as PID {}: {e:#}", l.target))?;
    // Not 0 on a reconnect after the drop at attach, for a target that
    // holds capabilities dynprof gave up (a root job): recorded with the
    // reconnect in msprof_meta.json.
    let caps_withheld = as_target.withheld_caps();
    let mut cmd = command_in_target(&l.argv[0])?;
    cmd.args(&l.argv[1..])
        .env_clear()
        .envs(l.env.iter().map(|(k, v)| (k, v)));
    pty::attach_child(&mut cmd, &pty.slave)?;
    let started_ns = monotonic_ns();
    let child = as_target
        .spawn(&mut cmd)
        .map_err(|e| anyhow!("starting {} as PID {}: {e:#}", l.argv[0], l.target))?;
    drop(cmd); // closes our copies of the slave, so EOF comes when msprof exits
    drop(pty.slave);
    let pgid = child.id() as i32;
    let out = Arc::new(Mutex::new(Output::default()));
    let mut rd = pty.master.try_clone()?;
    let (out2, shared2) = (out.clone(), shared.clone());
    let reader = std::thread::Builder::new()
        .name(format!("msprof-pty-{seq}"))
        .spawn(move || {
            let mut buf = [0u8; 4096];
            loop {
                match rd.read(&mut buf) {
                    Ok(0) | Err(_) => break, // EIO once every slave fd is closed
                    Ok(n) => out2.lock().unwrap().feed(&buf[..n]),
                }
                let _g = shared2.lock();
                shared2.cv.notify_all();
            }
            out2.lock().unwrap().eof = true;
            let _g = shared2.lock();
            shared2.cv.notify_all();
        })?;
    let mut conn = Conn {
        seq,
        child,
        pgid,
        master: pty.master,
        out,
        reader: Some(reader),
        cmds: 0,
        quit_sent: false,
        started_ns,
        caps_withheld,
    };
    // Wait for the first prompt: msprof is connected and accepts commands.
    let deadline = Instant::now() + l.timeout;
    let mut g = shared.lock();
    loop {
        let (prompts, eof) = {
            let o = conn.out.lock().unwrap();
            (o.prompts, o.eof)
        };
        if prompts > 0 {
            return Ok(conn);
        }
        if eof || Instant::now() >= deadline {
            drop(g);
            let timed_out = !eof;
            if timed_out {
                conn.kill();
            }
            let tail = conn.out.lock().unwrap().tail(5);
            let st = conn.reap();
            if timed_out {
                bail!(
                    "msprof gave no `>` prompt within {:?} ({}); its output: {:?}",
                    l.timeout,
                    l.argv.join(" "),
                    tail
                );
            }
            bail!(
                "msprof exited before its prompt ({st}); command `{}`; its output: {:?}",
                l.argv.join(" "),
                tail
            );
        }
        g = shared
            .cv
            .wait_timeout(g, Duration::from_millis(50))
            .unwrap()
            .0;
    }
}

/// Ends of sessions between windows are expected (command limit, idle exit):
/// the supervisor reconnects then, off the event loop.
pub(super) fn supervisor(shared: Arc<Shared>) {
    let mut g = shared.lock();
    loop {
        if g.shutdown {
            return;
        }
        let dead = !g.in_window && !g.spawning && g.conn.as_ref().is_some_and(|c| c.eof());
        if !dead {
            g = shared
                .cv
                .wait_timeout(g, Duration::from_millis(500))
                .unwrap()
                .0;
            continue;
        }
        let Some(launch) = g.launch.clone() else {
            return;
        };
        let old = g.conn.take().expect("checked above");
        let (seq, cmds, quit_sent) = (old.seq, old.cmds, old.quit_sent);
        let tail = old.out.lock().unwrap().tail(3);
        g.spawning = true;
        drop(g);
        let status = old.reap();
        let reason = if quit_sent {
            "dynprof ended it (command limit, or new collection switches)".to_string()
        } else if tail
            .iter()
            .any(|l| l.contains("No collection") || l.to_lowercase().contains("idle"))
        {
            "idle exit".to_string()
        } else if cmds >= launch.max_commands
            || tail.iter().any(|l| l.contains("closed the connection"))
        {
            "command limit".to_string()
        } else {
            format!("msprof exited ({status})")
        };
        let t0 = monotonic_ns();
        let res = spawn_conn(&launch, seq + 1, &shared);
        g = shared.lock();
        g.spawning = false;
        g.seq = seq + 1;
        let ev = match res {
            Ok(c) => {
                let withheld = format!("{:#x}", c.caps_withheld);
                g.conn = Some(c);
                json!({"event": "reconnected", "ended_connection": seq, "reason": reason, "output_tail": tail,
                       "new_connection": seq + 1, "reconnect_ns": monotonic_ns() - t0, "at_ns": t0,
                       "caps_withheld": withheld})
            }
            Err(e) => {
                json!({"event": "reconnect_failed", "ended_connection": seq, "reason": reason, "output_tail": tail,
                       "error": format!("{e:#}"), "at_ns": t0})
            }
        };
        log::info!("msprof: {ev}");
        g.events.push(ev);
        shared.cv.notify_all();
    }
}
