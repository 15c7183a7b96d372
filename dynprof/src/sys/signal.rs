//! Signals to dynprof's own children (the agent's capture processes).
use std::io;

/// Sends SIGTERM to `pid`. The caller must still own the child unreaped
/// (so the PID cannot have been reused).
pub fn terminate(pid: u32) -> io::Result<()> {
    let p = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    rustix::process::kill_process(p, rustix::process::Signal::TERM).map_err(io::Error::from)
}
