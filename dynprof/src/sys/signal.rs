//! Signals to dynprof's own children (the agent's capture processes), and
//! pidfds that tell when a target exits.
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

/// A pidfd for `pid` (readable once the process exits), or `None` when no
/// such process exists any more (ESRCH: it exited already).
pub fn pidfd(pid: u32) -> io::Result<Option<std::os::fd::OwnedFd>> {
    let p = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    match rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()) {
        Ok(fd) => Ok(Some(fd)),
        Err(rustix::io::Errno::SRCH) => Ok(None),
        Err(e) => Err(io::Error::from(e)),
    }
}
