//! Watching the directory (inotify, or polling) and reading the file through
//! the directory descriptor.
use super::*;
use crate::sys::hostfs::MAX_CONFIG_BYTES;

/// Reads profiler_config.json through DIR's descriptor: a symlink, FIFO or
/// device at the name is refused (it would let the job's user make root
/// read, and quote in the log, a file they cannot read), and at most
/// [`MAX_CONFIG_BYTES`] are read.
pub(super) fn read_config(dir: &HostDir) -> std::io::Result<String> {
    dir.read_capped(CONFIG_FILE, MAX_CONFIG_BYTES)
}

/// (mtime, size, content): two events of one save compare equal.
pub(super) fn stamp(dir: &HostDir) -> Option<(SystemTime, u64, String)> {
    let f = dir.open_read(CONFIG_FILE).ok()?;
    let m = f.metadata().ok()?;
    Some((
        m.modified().ok()?,
        m.len(),
        read_config(dir).unwrap_or_default(),
    ))
}

pub(super) fn inotify_watch(dir: &Path) -> Result<i32> {
    // SAFETY: plain syscalls; the fd is owned by the watcher thread.
    let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("inotify_init1");
    }
    let c = CString::new(dir.as_os_str().as_bytes())?;
    let wd = unsafe {
        libc::inotify_add_watch(
            fd,
            c.as_ptr(),
            libc::IN_CLOSE_WRITE | libc::IN_MOVED_TO | libc::IN_CREATE,
        )
    };
    if wd < 0 {
        let e = std::io::Error::last_os_error();
        unsafe { libc::close(fd) };
        return Err(e).with_context(|| format!("inotify_add_watch {}", dir.display()));
    }
    Ok(fd)
}

/// Blocks for the next batch of inotify events; returns the file names.
pub(super) fn inotify_wait(fd: i32) -> std::io::Result<Vec<String>> {
    let mut buf = [0u8; 4096];
    // SAFETY: read into our buffer.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok(Vec::new());
        }
        return Err(e);
    }
    let n = n as usize;
    let mut names = Vec::new();
    let mut off = 0usize;
    let hdr = std::mem::size_of::<libc::inotify_event>();
    while off + hdr <= n {
        // SAFETY: the kernel wrote whole events; read_unaligned copes with alignment.
        let ev: libc::inotify_event =
            unsafe { std::ptr::read_unaligned(buf.as_ptr().add(off).cast()) };
        let name_start = off + hdr;
        let name_end = (name_start + ev.len as usize).min(n);
        let raw = &buf[name_start..name_end];
        let end = raw.iter().position(|b| *b == 0).unwrap_or(raw.len());
        names.push(String::from_utf8_lossy(&raw[..end]).into_owned());
        off = name_end;
    }
    Ok(names)
}
