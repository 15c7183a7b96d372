//! A pseudo-terminal for driving interactive vendor tools (msprof prompts
//! only when its stdin is a TTY, like most interactive CLIs).
use std::{
    fs::File,
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    process::{Command, Stdio},
};

/// The two ends of a fresh pty. Both are close-on-exec; the slave is handed
/// to the child as stdin/stdout/stderr (dup2 clears the flag there).
pub struct Pty {
    pub master: File,
    pub slave: OwnedFd,
}

/// Opens a pty with echo turned off (so what we read back is only the tool's
/// own output) and a fixed 200x50 window.
pub fn open() -> io::Result<Pty> {
    let mut m: libc::c_int = -1;
    let mut s: libc::c_int = -1;
    let ws = libc::winsize {
        ws_row: 50,
        ws_col: 200,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: openpty writes two fds into m and s; name and termios may be null.
    let rc = unsafe { libc::openpty(&mut m, &mut s, std::ptr::null_mut(), std::ptr::null(), &ws) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just returned by openpty and are owned by nobody else.
    let (master, slave) = unsafe { (File::from_raw_fd(m), OwnedFd::from_raw_fd(s)) };
    for fd in [master.as_raw_fd(), slave.as_raw_fd()] {
        // SAFETY: fcntl on fds we own.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    // SAFETY: termios is plain data; tcgetattr fills it from the slave fd we own.
    unsafe {
        let mut t: libc::termios = std::mem::zeroed();
        if libc::tcgetattr(slave.as_raw_fd(), &mut t) == 0 {
            t.c_lflag &= !(libc::ECHO | libc::ECHONL);
            libc::tcsetattr(slave.as_raw_fd(), libc::TCSANOW, &t);
        }
    }
    Ok(Pty { master, slave })
}

/// Makes `cmd` run as a session leader with the pty's slave as its
/// controlling terminal and stdio. Its process group id is then its pid, so
/// `kill(-pid)` reaches it and everything it forks (the
/// process forked into the target's PID namespace included).
pub fn attach_child(cmd: &mut Command, slave: &OwnedFd) -> io::Result<()> {
    cmd.stdin(Stdio::from(slave.try_clone()?))
        .stdout(Stdio::from(slave.try_clone()?))
        .stderr(Stdio::from(slave.try_clone()?));
    use std::os::unix::process::CommandExt as _;
    // SAFETY: only async-signal-safe calls (setsid, ioctl) between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(())
}
