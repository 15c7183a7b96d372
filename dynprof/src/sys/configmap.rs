//! Reading one file of a directory that may be a Kubernetes ConfigMap
//! volume (the agent's `--config-dir`). kubelet's atomic writer lays it out
//! as
//!
//! ```text
//! DIR/profiler_config.json -> ..data/profiler_config.json
//! DIR/..data               -> ..2026_12_03_10_00_00.123456789
//! DIR/..2026_12_03_10_00_00.123456789/profiler_config.json
//! ```
//!
//! and updates it by writing a new timestamped directory, pointing a new
//! symlink `..data_tmp` at it and renaming that over `..data`. A plain
//! file (shared storage) is read as before: never through a symlink. A
//! symlink at the name is followed only if the whole layout is root's:
//!
//! - DIR is root-owned and not writable by group or others, unless it is
//!   on a read-only mount (a ConfigMap volume's root is mode 0777 but
//!   mounted read-only into the pod: nobody there can plant a name);
//! - the symlinks at the name and at `..data` are owned by root;
//! - the file is opened with `openat2(RESOLVE_BENEATH |
//!   RESOLVE_NO_MAGICLINKS)` from DIR: a link that leads out of DIR
//!   (absolute, or through `..`) fails (EXDEV) instead of being followed;
//! - every directory on the way and the file itself are root-owned and not
//!   writable by group or others, and the file is a regular file.
use std::{
    io::{self, Read as _},
    os::fd::{AsFd, OwnedFd},
    path::{Path, PathBuf},
    time::SystemTime,
};

use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags, ResolveFlags, StatVfsMountFlags};

/// What the directory holds at the name.
#[derive(Debug, PartialEq, Eq)]
pub enum Found {
    Missing,
    /// A regular file in DIR itself (shared storage).
    Plain {
        text: String,
        mtime: SystemTime,
    },
    /// The file reached through kubelet's atomic-writer links; `data` is
    /// the timestamped directory `..data` pointed at when it was read.
    AtomicWriter {
        text: String,
        mtime: SystemTime,
        data: String,
    },
}

/// Reads `dir/name` (at most `max` bytes). An error is a refusal, worded
/// for the log.
pub fn read(dir: &Path, name: &str, max: u64) -> Result<Found, String> {
    let shown = dir.join(name);
    let shown = shown.display();
    let dfd = rfs::openat2(
        rfs::CWD,
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
    .map_err(|e| format!("{}: {}", dir.display(), io::Error::from(e)))?;
    let st = match rfs::statat(&dfd, name, AtFlags::SYMLINK_NOFOLLOW) {
        Err(rustix::io::Errno::NOENT) => return Ok(Found::Missing),
        Err(e) => return Err(format!("{shown}: {}", io::Error::from(e))),
        Ok(st) => st,
    };
    match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => {
            let fd = rfs::openat(
                &dfd,
                name,
                OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| format!("{shown}: {}", io::Error::from(e)))?;
            let (text, mtime) = read_fd(fd, max).map_err(|e| format!("{shown}: {e}"))?;
            Ok(Found::Plain { text, mtime })
        }
        FileType::Symlink => {
            let (text, mtime, data) = atomic_writer(&dfd, dir, name, max)
                .map_err(|why| format!("{shown} is a symbolic link and {why}; refused"))?;
            Ok(Found::AtomicWriter { text, mtime, data })
        }
        _ => Err(format!("{shown} is not a regular file")),
    }
}

/// Why `st` is not root's alone, if it is not.
fn not_roots(st: &rfs::Stat) -> Option<String> {
    let mode = st.st_mode & 0o7777;
    if st.st_uid != 0 {
        Some(format!("is owned by uid {}, not root", st.st_uid))
    } else if mode & 0o022 != 0 {
        Some(format!(
            "may be written by group or others (mode {mode:04o})"
        ))
    } else {
        None
    }
}

fn atomic_writer(
    dfd: &OwnedFd,
    dir: &Path,
    name: &str,
    max: u64,
) -> Result<(String, SystemTime, String), String> {
    let io = |e: rustix::io::Errno| io::Error::from(e).to_string();
    let dst = rfs::fstat(dfd).map_err(io)?;
    let ro = rfs::fstatvfs(dfd)
        .map(|v| v.f_flag.contains(StatVfsMountFlags::RDONLY))
        .unwrap_or(false);
    if let Some(why) = not_roots(&dst).filter(|_| !(ro && dst.st_uid == 0)) {
        return Err(format!(
            "its directory {} {why} (only a root-owned directory that nobody else can write, or a read-only mount such as a ConfigMap volume, may hold links)",
            dir.display()
        ));
    }
    // The links themselves: root's.
    let link = rfs::statat(dfd, name, AtFlags::SYMLINK_NOFOLLOW).map_err(io)?;
    if link.st_uid != 0 {
        return Err(format!("is owned by uid {}, not root", link.st_uid));
    }
    let target = PathBuf::from(
        rfs::readlinkat(dfd, name, Vec::new())
            .map_err(io)?
            .to_string_lossy()
            .into_owned(),
    );
    // `..data/NAME`: the first component is the `..data` link.
    let mut data = String::new();
    if let Some(std::path::Component::Normal(first)) = target.components().next() {
        let first = first.to_string_lossy();
        if let Ok(st) = rfs::statat(dfd, first.as_ref(), AtFlags::SYMLINK_NOFOLLOW)
            && FileType::from_raw_mode(st.st_mode) == FileType::Symlink
        {
            if st.st_uid != 0 {
                return Err(format!(
                    "{} is owned by uid {}, not root",
                    dir.join(first.as_ref()).display(),
                    st.st_uid
                ));
            }
            data = rfs::readlinkat(dfd, first.as_ref(), Vec::new())
                .map_err(io)?
                .to_string_lossy()
                .into_owned();
        }
    }
    let fd = rfs::openat2(
        dfd,
        name,
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
    )
    .map_err(|e| match e {
        rustix::io::Errno::XDEV => format!(
            "leads out of {} (to {}); only links inside it are followed",
            dir.display(),
            target.display()
        ),
        e => format!("cannot be opened inside {}: {}", dir.display(), io(e)),
    })?;
    let st = rfs::fstat(&fd).map_err(io)?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(format!("{} is not a regular file", target.display()));
    }
    if let Some(why) = not_roots(&st) {
        return Err(format!("its file {} {why}", target.display()));
    }
    // The directories between: root's, nobody else may write them.
    let mut between: Vec<&Path> = target
        .ancestors()
        .skip(1)
        .filter(|p| !p.as_os_str().is_empty())
        .collect();
    between.reverse();
    for p in between {
        let pfd = rfs::openat2(
            dfd,
            p,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
        )
        .map_err(io)?;
        let pst = rfs::fstat(&pfd).map_err(io)?;
        if let Some(why) = not_roots(&pst) {
            return Err(format!("{} {why}", dir.join(p).display()));
        }
    }
    let (text, mtime) = read_fd(fd, max)?;
    Ok((text, mtime, data))
}

fn read_fd(fd: OwnedFd, max: u64) -> Result<(String, SystemTime), String> {
    let st = rfs::fstat(fd.as_fd()).map_err(|e| io::Error::from(e).to_string())?;
    let mtime = SystemTime::UNIX_EPOCH
        + std::time::Duration::new(st.st_mtime as u64, st.st_mtime_nsec as u32);
    let mut text = String::new();
    io::Read::take(std::fs::File::from(fd), max + 1)
        .read_to_string(&mut text)
        .map_err(|e| e.to_string())?;
    if text.len() as u64 > max {
        return Err(format!("larger than {max} bytes"));
    }
    Ok((text, mtime))
}
