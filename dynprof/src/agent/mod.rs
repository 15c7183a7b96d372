//! `dynprof agent`: a long-running node daemon. It finds the AI jobs on
//! the host by itself (the `dynprof ps` scan, grouped into jobs as
//! `ps --jobs` does), attaches step markers (`--marker auto`, no collector)
//! to every rank, follows jobs that start and end, exports per-rank step
//! time for Prometheus, and runs job-mode captures on request.
//!
//! One thread, one event loop (as job mode): each attached process has its
//! own eBPF object and session task; the HTTP server runs on the same loop
//! and reads the metrics through shared handles. Resolving markers (reading
//! libtorch's symbol tables) runs on blocking threads so a scrape never
//! waits for it.
//!
//! Restart safety: each attached process is held under the per-target lock
//! (`sys::lock`), so a second agent, or a user's own `dynprof attach`,
//! never attaches twice; the lock and every uprobe go with the process's
//! fds when the agent dies, and a restarted agent lowers the USDT
//! semaphores a killed one left raised (`Kernel::repair_semaphores`) before
//! it attaches again.
pub mod capture;
pub mod config_dir;
pub mod http;
pub mod labels;
pub mod metrics;
mod targets;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex, atomic::AtomicBool},
    time::Duration,
};

use anyhow::{Context as _, Result};
use tokio::sync::mpsc;

use crate::{job::group::JobGroup, sys::hostfs::OutputRoot, types::HostPid};

/// How the agent was configured (`dynprof agent` flags).
pub struct Config {
    pub listen: SocketAddr,
    /// The unix socket for capture requests (`--socket`), and the group
    /// that may use it besides root (`--socket-group`).
    pub socket: Option<PathBuf>,
    pub socket_group: Option<u32>,
    pub output: PathBuf,
    pub node: String,
    /// The bearer token capture requests must carry (required when
    /// `listen` is not a loopback address).
    pub token: Option<String>,
    pub rescan: Duration,
    pub linger: Duration,
    pub ring_bytes: u32,
    /// The shared `profiler_config.json` directory, and the lead added to
    /// its modification time for the common start instant.
    pub config_dir: Option<PathBuf>,
    pub config_lead: Duration,
    /// Follow only the processes below this one (tests).
    pub only_under: Option<HostPid>,
}

/// One attached process, as `/captures` and the logs describe it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TargetInfo {
    pub host_pid: HostPid,
    pub rank: u32,
    pub job: String,
}

/// What the event loop and the HTTP handlers share.
pub struct Shared {
    pub cfg: Config,
    pub metrics: metrics::Metrics,
    /// The first scan is done (`/readyz`).
    pub ready: AtomicBool,
    pub state: Mutex<State>,
    pub output: OutputRoot,
    /// Capture requests accepted by `POST /capture`, for the event loop.
    pub capture_tx: mpsc::UnboundedSender<capture::Accepted>,
}

#[derive(Default)]
pub struct State {
    /// The jobs of the last scan.
    pub jobs: Vec<JobGroup>,
    /// Processes with step markers attached.
    pub attached: BTreeMap<HostPid, TargetInfo>,
    /// Processes a capture holds: not attached by the agent meanwhile.
    pub busy: HashSet<HostPid>,
    pub captures: Vec<capture::Record>,
}

impl Shared {
    pub fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A handler that panicked mid-update leaves plain data behind.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Runs the agent until SIGTERM or SIGINT.
pub async fn run(cfg: Config) -> Result<()> {
    let needs = targets::needs();
    crate::sys::caps::check(&needs)?;
    crate::bpf::preflight()?;
    let output = OutputRoot::open(&cfg.output)?;
    // Bound while the agent still holds CAP_CHOWN (for --socket-group).
    let unix = cfg
        .socket
        .as_deref()
        .map(|p| crate::sys::unixsock::bind_private(p, cfg.socket_group))
        .transpose()?;
    // The agent attaches for as long as it runs, and a capture's child
    // attaches its collectors: it keeps what those need, nothing else.
    let kept = crate::sys::caps::drop_after_attach(&needs)?;
    log::info!("capabilities kept: {kept:?}");
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("listening on {}", cfg.listen))?;
    let (capture_tx, capture_rx) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared {
        metrics: metrics::Metrics::new(),
        ready: AtomicBool::new(false),
        state: Mutex::new(State::default()),
        output,
        capture_tx,
        cfg,
    });
    capture::load_index(&shared);
    eprintln!(
        "dynprof: agent on node {} listening on http://{} (GET /metrics /healthz /readyz /captures, POST /capture); captures under {}",
        shared.cfg.node,
        listener.local_addr().unwrap_or(shared.cfg.listen),
        shared.output.path().display()
    );
    if let (Some(l), Some(p)) = (unix, &shared.cfg.socket) {
        let l = tokio::net::UnixListener::from_std(l)
            .with_context(|| format!("--socket {}", p.display()))?;
        eprintln!(
            "dynprof: agent: capture requests on unix socket {} (mode {}){}",
            p.display(),
            if shared.cfg.socket_group.is_some() {
                "0660"
            } else {
                "0600"
            },
            if shared.cfg.token.is_none() {
                "; TCP serves metrics only"
            } else {
                ""
            }
        );
        let app = http::unix_router(Arc::clone(&shared));
        tokio::spawn(async move {
            if let Err(e) = axum::serve(l, app).await {
                eprintln!("dynprof: agent: unix socket server stopped: {e}");
            }
        });
    }
    let app = http::router(Arc::clone(&shared));
    tokio::spawn(async move {
        if let Err(e) = axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        {
            eprintln!("dynprof: agent: HTTP server stopped: {e}");
        }
    });
    let local = tokio::task::LocalSet::new();
    local.run_until(targets::follow(shared, capture_rx)).await
}

/// The previous scan's failures, retried with a growing pause so a
/// process without a step marker costs one resolution per pause, not per
/// scan.
#[derive(Default)]
struct Backoff(HashMap<HostPid, (std::time::Instant, u32)>);

impl Backoff {
    const FIRST: Duration = Duration::from_secs(30);
    const MAX: Duration = Duration::from_secs(600);

    fn may_try(&self, pid: HostPid, now: std::time::Instant) -> bool {
        self.0.get(&pid).is_none_or(|(at, _)| now >= *at)
    }

    /// Records a failure; returns true the first time (worth a log line).
    fn failed(&mut self, pid: HostPid, now: std::time::Instant) -> bool {
        let e = self.0.entry(pid).or_insert((now, 0));
        let first = e.1 == 0;
        let pause = Self::FIRST.saturating_mul(1 << e.1.min(10)).min(Self::MAX);
        *e = (now + pause, e.1 + 1);
        first
    }

    fn forget_gone(&mut self, alive: &HashSet<HostPid>) {
        self.0.retain(|p, _| alive.contains(p));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_caps() {
        let mut b = Backoff::default();
        let p = HostPid(7);
        let t0 = std::time::Instant::now();
        assert!(b.may_try(p, t0));
        assert!(b.failed(p, t0));
        assert!(!b.may_try(p, t0 + Duration::from_secs(29)));
        assert!(b.may_try(p, t0 + Duration::from_secs(30)));
        assert!(!b.failed(p, t0));
        assert!(!b.may_try(p, t0 + Duration::from_secs(59)));
        for _ in 0..20 {
            b.failed(p, t0);
        }
        assert!(b.may_try(p, t0 + Backoff::MAX));
        b.forget_gone(&HashSet::new());
        assert!(b.may_try(p, t0));
    }
}
