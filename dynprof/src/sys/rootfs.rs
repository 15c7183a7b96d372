//! Files inside a target's root (`/proc/PID/root`), resolved the way the
//! target itself would resolve them, but never escaping that root.
//!
//! A plain `open("/proc/PID/root/usr/lib/x.so")` follows an absolute symlink
//! inside the container (`x.so -> /etc/shadow`) to the *host's* `/`. Every
//! open here goes through `openat2(2)` relative to a descriptor of the
//! target's root with `RESOLVE_IN_ROOT` (absolute links and `..` stay inside)
//! and `RESOLVE_NO_MAGICLINKS` (no `/proc/self/fd/N`-style jumps).
use std::{
    fs::File,
    io,
    os::fd::OwnedFd,
    path::{Path, PathBuf},
};

use rustix::fs::{Mode, OFlags, ResolveFlags};

/// A target's root directory, held open.
#[derive(Debug)]
pub struct TargetRoot {
    fd: OwnedFd,
    /// `/proc/<hostpid>/root`, for messages.
    pub path: PathBuf,
}

impl TargetRoot {
    /// Opens `/proc/<pid>/root` (the root directory the target sees).
    pub fn open(proc_root: &Path) -> io::Result<Self> {
        let fd = rustix::fs::open(
            proc_root,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Self {
            fd,
            path: proc_root.to_path_buf(),
        })
    }

    /// Opens `path` (as the target names it: absolute or relative to its
    /// root) with `flags`, never leaving the root. `O_CLOEXEC` is always added.
    pub fn open_with(&self, path: &str, flags: OFlags, mode: Mode) -> io::Result<OwnedFd> {
        let rel = path.trim_start_matches('/');
        let rel = if rel.is_empty() { "." } else { rel };
        Ok(rustix::fs::openat2(
            &self.fd,
            rel,
            flags | OFlags::CLOEXEC,
            mode,
            ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
        )?)
    }

    /// Opens a file for reading, without blocking on a FIFO or device.
    pub fn open_read(&self, path: &str) -> io::Result<File> {
        self.open_with(path, OFlags::RDONLY | OFlags::NONBLOCK, Mode::empty())
            .map(File::from)
    }

    /// Opens a directory (for `*at` calls and listing).
    pub fn open_dir(&self, path: &str) -> io::Result<OwnedFd> {
        self.open_with(path, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn absolute_links_and_dotdot_stay_inside() {
        let base = std::env::temp_dir().join(format!("dynprof-rootfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(base.join("etc")).unwrap();
        std::fs::write(base.join("etc/hostname"), "inside\n").unwrap();
        // Both point at the host's /etc/hostname if followed naively.
        symlink("/etc/hostname", base.join("abs")).unwrap();
        symlink("../../../../../../etc/hostname", base.join("rel")).unwrap();
        let root = TargetRoot::open(&base).unwrap();
        for p in ["abs", "/rel", "etc/../../etc/hostname"] {
            let t = std::io::read_to_string(root.open_read(p).unwrap()).unwrap();
            assert_eq!(t, "inside\n", "{p}");
        }
        let _ = std::fs::remove_dir_all(&base);
    }
}
