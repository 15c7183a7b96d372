//! `dynprof agent`: the flags, checked; the daemon itself is [`crate::agent`].
use std::{io::Read as _, net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{Context as _, Result, bail};
use clap::Args;

#[derive(Args, Debug, Clone)]
pub struct AgentArgs {
    /// Address and port of the HTTP endpoints. Anything but a loopback
    /// address needs --token-file.
    #[arg(long, value_name = "ADDR:PORT", default_value = "127.0.0.1:9464")]
    pub listen: SocketAddr,

    /// Also serve the endpoints on a unix socket at PATH (e.g.
    /// /run/dynprof/agent.sock), created root-owned 0600: the socket file's
    /// permissions authorize capture requests. Its directory must be
    /// writable by root only. Without --token-file, TCP then serves
    /// metrics only (docs/fleet.md).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,

    /// With --socket: members of group GID may use the socket too (mode 0660).
    #[arg(long, value_name = "GID", requires = "socket",
          value_parser = crate::cli::int(0u32, u32::MAX))]
    pub socket_group: Option<u32>,

    /// Where captures are written (one CAPTURE_<id>/PROF_JOB_* per capture,
    /// and the index captures.json). Must be a directory only root can change.
    #[arg(
        long,
        short = 'o',
        value_name = "DIR",
        default_value = "/var/lib/dynprof/captures"
    )]
    pub output: PathBuf,

    /// The `node` label (default: $NODE_NAME, else the host name). In a
    /// DaemonSet, set NODE_NAME from spec.nodeName.
    #[arg(long, value_name = "NAME", env = "NODE_NAME")]
    pub node: Option<String>,

    /// A file holding the bearer token that POST /capture and GET /captures
    /// must present (`Authorization: Bearer <token>`). Required when
    /// --listen is not a loopback address; /metrics stays open.
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,

    /// Seconds between scans for new and ended jobs.
    #[arg(long, value_name = "SECS", default_value = "5", allow_negative_numbers = true,
          value_parser = crate::cli::secs(crate::cli::Zero::Refused))]
    pub rescan: Duration,

    /// Seconds an exited process's series stay in /metrics (so the scrape
    /// after its last step sees the final count).
    #[arg(long, value_name = "SECS", default_value = "60", allow_negative_numbers = true,
          value_parser = crate::cli::secs(crate::cli::Zero::Allowed))]
    pub linger: Duration,

    /// Ring buffer per attached process, in KiB (a power of two, >= 4):
    /// step events only.
    #[arg(long, default_value_t = 256, value_name = "KIB", allow_negative_numbers = true,
          value_parser = crate::cli::ring_kb)]
    pub ring_buffer_kb: u32,

    /// Watch DIR/profiler_config.json (the torch_npu schema), shared by
    /// every node's agent on shared storage: each save captures every job
    /// on every node, on the same iterations (docs/fleet.md).
    #[arg(long, value_name = "DIR")]
    pub config_dir: Option<PathBuf>,

    /// With --config-dir: the common start instant is the file's
    /// modification time plus SECS (unless the file's
    /// metadata.dynprof_start_at gives one). More than --rescan, so every
    /// node has seen the save by then.
    #[arg(long, value_name = "SECS", default_value = "15", allow_negative_numbers = true,
          value_parser = crate::cli::secs(crate::cli::Zero::Refused))]
    pub config_lead: Duration,

    /// Tests only: follow just the processes below this PID (so a test's
    /// agent leaves the host's other jobs alone).
    #[arg(long, value_name = "PID", hide = true,
          value_parser = crate::cli::int(1, crate::cli::PID_MAX))]
    pub only_under: Option<u32>,
}

/// Reads the token: one line, at least 16 characters.
fn read_token(path: &std::path::Path) -> Result<String> {
    let mut s = String::new();
    std::fs::File::open(path)
        .with_context(|| format!("--token-file {}", path.display()))?
        .take(4096)
        .read_to_string(&mut s)
        .with_context(|| format!("--token-file {}: not UTF-8 text", path.display()))?;
    let t = s.trim();
    if t.len() < 16 || t.chars().any(|c| c.is_whitespace() || c.is_control()) {
        bail!(
            "--token-file {}: the token must be one word of at least 16 characters (e.g. `openssl rand -hex 32`)",
            path.display()
        );
    }
    Ok(t.to_string())
}

fn host_name() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}

pub fn config(a: &AgentArgs) -> Result<crate::agent::Config> {
    let token = a.token_file.as_deref().map(read_token).transpose()?;
    if token.is_none() && !a.listen.ip().is_loopback() {
        bail!(
            "refusing to listen on {} without --token-file: capture requests start work as root on this node; \
             give --token-file FILE (a bearer token), or listen on 127.0.0.1",
            a.listen
        );
    }
    let node = a
        .node
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(host_name);
    Ok(crate::agent::Config {
        listen: a.listen,
        socket: a.socket.clone(),
        socket_group: a.socket_group,
        output: a.output.clone(),
        node,
        token,
        rescan: a.rescan,
        linger: a.linger,
        ring_bytes: super::driver::ring_bytes(a.ring_buffer_kb)?,
        only_under: a.only_under.map(crate::types::HostPid),
        config_dir: a.config_dir.clone(),
        config_lead: a.config_lead,
    })
}

pub async fn run(a: AgentArgs) -> Result<()> {
    crate::agent::run(config(&a)?).await
}
