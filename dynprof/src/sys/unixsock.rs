//! The agent's private unix socket (`dynprof agent --socket PATH`): the
//! socket file's permissions are the authorization, so it is made where
//! nobody but root can replace it, and nothing else is ever unlinked.
//!
//! - the parent directory is created if missing (mode 0755, like an output
//!   root) and every component from `/` must be one only root can change
//!   ([`OutputRoot::open`]); the parent itself must be root-owned and
//!   writable by nobody else (not even with the sticky bit: anyone who can
//!   create names there could plant one first);
//! - an existing entry at the name is replaced only if it is a socket that
//!   nobody serves (a killed agent's); a regular file, directory or symlink
//!   is refused, never followed or unlinked;
//! - the socket is bound under umask 0177 (so it is never connectable by
//!   others, not even between bind and chmod): root's, 0600; with a group
//!   it is then chowned to root:GID (CAP_CHOWN) and set to 0660.
use std::{
    os::{fd::AsFd, unix::net::UnixListener},
    path::Path,
};

use anyhow::{Context as _, Result, bail};
use rustix::{
    fs::{self as rfs, AtFlags, FileType, Mode},
    process::{Gid, Uid},
};

use super::hostfs::{OutputRoot, escape_untrusted};

/// Binds the socket at `path`: 0600 root, or 0660 root:`group`.
pub fn bind_private(path: &Path, group: Option<u32>) -> Result<UnixListener> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| !n.is_empty())
        .with_context(|| format!("--socket {}: no file name", path.display()))?;
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let refuse = |why: String| -> anyhow::Error {
        anyhow::anyhow!(
            "refusing --socket {}: {why}; use a path in a directory only root can write, e.g. /run/dynprof/agent.sock",
            path.display()
        )
    };
    let root = OutputRoot::open(parent).map_err(|e| refuse(format!("{e:#}")))?;
    let dir = root.dir();
    let st = dir.stat()?;
    let mode = st.st_mode & 0o7777;
    if st.st_uid != 0 {
        return Err(refuse(format!(
            "{} is owned by uid {}, not root",
            dir.path().display(),
            st.st_uid
        )));
    }
    if mode & 0o022 != 0 {
        return Err(refuse(format!(
            "{} may be written by users other than root (mode {mode:04o})",
            dir.path().display()
        )));
    }
    let fd = dir.as_fd();
    match rfs::statat(fd, name, AtFlags::SYMLINK_NOFOLLOW) {
        Err(rustix::io::Errno::NOENT) => {}
        Err(e) => return Err(e).with_context(|| format!("--socket {}", path.display())),
        Ok(old) => {
            let kind = FileType::from_raw_mode(old.st_mode);
            if kind != FileType::Socket {
                return Err(refuse(format!(
                    "{} exists and is a {} (only a stale socket is replaced; nothing else is followed or removed)",
                    escape_untrusted(&path.to_string_lossy()),
                    kind_name(kind)
                )));
            }
            let via = dir_path(&fd, name);
            if std::os::unix::net::UnixStream::connect(&via).is_ok() {
                bail!(
                    "--socket {}: another process (a running agent?) serves it; stop it first",
                    path.display()
                );
            }
            rfs::unlinkat(fd, name, AtFlags::empty())
                .with_context(|| format!("removing the stale socket {}", path.display()))?;
        }
    }
    // Bound through the held directory descriptor: the name is created in
    // the directory validated above, whatever happens to the path.
    let via = dir_path(&fd, name);
    let old = rustix::process::umask(Mode::from_raw_mode(0o177));
    let bound = UnixListener::bind(&via);
    rustix::process::umask(old);
    let l = bound.with_context(|| format!("binding --socket {}", path.display()))?;
    // Created by root (umask 0177): root:root-or-egid 0600 already; a
    // group takes a chown (CAP_CHOWN) and 0660.
    if let Some(g) = group {
        rfs::chownat(
            fd,
            name,
            Some(Uid::ROOT),
            Some(Gid::from_raw(g)),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .with_context(|| {
            format!(
                "--socket-group {g}: chown {} (needs CAP_CHOWN)",
                path.display()
            )
        })?;
        rfs::chmodat(fd, name, Mode::from_raw_mode(0o660), AtFlags::empty())
            .with_context(|| format!("chmod --socket {}", path.display()))?;
    }
    l.set_nonblocking(true)?;
    Ok(l)
}

/// `/proc/self/fd/N/name`: a path that resolves through the held directory.
fn dir_path(fd: &impl AsFd, name: &str) -> std::path::PathBuf {
    use std::os::fd::AsRawFd as _;
    Path::new(&format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd())).join(name)
}

fn kind_name(k: FileType) -> &'static str {
    match k {
        FileType::RegularFile => "regular file",
        FileType::Directory => "directory",
        FileType::Symlink => "symbolic link",
        FileType::Fifo => "FIFO",
        FileType::CharacterDevice => "character device",
        FileType::BlockDevice => "block device",
        FileType::Socket => "socket",
        FileType::Unknown => "file of unknown type",
    }
}
