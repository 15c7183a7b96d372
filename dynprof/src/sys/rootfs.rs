//! Files inside a target's root (`/proc/PID/root`), resolved the way the
//! target itself would resolve them, but never escaping that root.
//!
//! A plain `open("/proc/PID/root/usr/lib/x.so")` follows an absolute symlink
//! inside the container (`x.so -> /etc/shadow`) to the *host's* `/`. Every
//! open here goes through `openat2(2)` relative to a descriptor of the
//! target's root with `RESOLVE_IN_ROOT` (absolute links and `..` stay inside)
//! and `RESOLVE_NO_MAGICLINKS` (no `/proc/self/fd/N`-style jumps).
//!
//! Every file the target controls is also opened the way runc's
//! `filepath-securejoin` reopens a handle: first as `O_PATH` (which never
//! opens the file itself: no FIFO wait, no device driver `open`), then
//! `fstat` (regular files only), then reopened read-only through
//! `/proc/self/fd/N`, which is that very inode. Work on such a file runs
//! under a deadline ([`within`]): a FUSE file served by the target, or a
//! `/proc/PID/environ` read stalled on a userfaultfd page, costs one parked
//! thread, never a hung dynprof.
use std::{
    fs::File,
    io::{self, Read as _},
    os::fd::{AsFd, AsRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    sync::mpsc,
    time::Duration,
};

use rustix::fs::{FileType, Mode, OFlags, ResolveFlags, Stat};

/// How long one file the target controls may take to open and read.
pub const FILE_DEADLINE: Duration = Duration::from_secs(20);

/// A regular file, opened read-only and non-blocking, with what `fstat`
/// said about it once open.
#[derive(Debug)]
pub struct RegularFile {
    pub file: File,
    pub size: u64,
    pub dev: u64,
    pub ino: u64,
}

/// What `fstat` says about a file without opening it (from an `O_PATH` handle).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileId {
    pub kind: FileKind,
    pub size: u64,
    pub dev: u64,
    pub ino: u64,
}

/// The file types dynprof names in messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    Regular,
    Directory,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
    Symlink,
    Unknown,
}

impl FileKind {
    fn of(st: &Stat) -> Self {
        match FileType::from_raw_mode(st.st_mode) {
            FileType::RegularFile => Self::Regular,
            FileType::Directory => Self::Directory,
            FileType::Fifo => Self::Fifo,
            FileType::Socket => Self::Socket,
            FileType::CharacterDevice => Self::CharDevice,
            FileType::BlockDevice => Self::BlockDevice,
            FileType::Symlink => Self::Symlink,
            _ => Self::Unknown,
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Self::Regular => "a regular file",
            Self::Directory => "a directory",
            Self::Fifo => "a FIFO",
            Self::Socket => "a socket",
            Self::CharDevice => "a character device",
            Self::BlockDevice => "a block device",
            Self::Symlink => "a symbolic link",
            Self::Unknown => "not a regular file",
        }
    }
}

fn file_id(st: &Stat) -> FileId {
    FileId {
        kind: FileKind::of(st),
        size: st.st_size.max(0) as u64,
        dev: st.st_dev,
        ino: st.st_ino,
    }
}

/// `fstat` of an `O_PATH` handle, then reopens it for reading if (and only
/// if) it is a regular file.
fn reopen_regular(handle: OwnedFd) -> io::Result<RegularFile> {
    let id = file_id(&rustix::fs::fstat(&handle)?);
    if id.kind != FileKind::Regular {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}, not a regular file: not read", id.kind.describe()),
        ));
    }
    // The magic link of our own descriptor: the inode just checked,
    // whatever now sits at the name.
    let fd = rustix::fs::open(
        format!("/proc/self/fd/{}", handle.as_raw_fd()),
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let now = file_id(&rustix::fs::fstat(&fd)?);
    if (now.dev, now.ino, now.kind) != (id.dev, id.ino, FileKind::Regular) {
        return Err(io::Error::other(
            "the file changed while it was being opened",
        ));
    }
    Ok(RegularFile {
        file: File::from(fd),
        size: now.size,
        dev: now.dev,
        ino: now.ino,
    })
}

/// Opens a regular file named by a host path dynprof built itself, such
/// as `/proc/PID/map_files/<range>` (whose last step is the kernel's link
/// to the mapped inode). Never opens a FIFO or device.
pub fn open_regular(path: &Path) -> io::Result<RegularFile> {
    let handle = rustix::fs::open(path, OFlags::PATH | OFlags::CLOEXEC, Mode::empty())?;
    reopen_regular(handle)
}

/// `stat` of a host path dynprof built itself (following the final link).
pub fn stat_path(path: &Path) -> io::Result<FileId> {
    let handle = rustix::fs::open(path, OFlags::PATH | OFlags::CLOEXEC, Mode::empty())?;
    Ok(file_id(&rustix::fs::fstat(&handle)?))
}

/// A private, sealed copy of the parts of a file that were read: a memfd
/// of the file's size whose holes read as zeros, holding `chunks` at their
/// offsets. Nobody else can write or shrink it (seals), so a library that
/// maps it (blazesym `mmap`s what it symbolizes) cannot be hit by SIGBUS
/// when the target truncates the original. Returned with its
/// `/proc/self/fd/N` path, valid while the `File` lives.
pub fn sealed_sparse_copy<'a>(
    name: &str,
    len: u64,
    chunks: impl Iterator<Item = (u64, &'a [u8])>,
) -> io::Result<(File, PathBuf)> {
    use rustix::fs::{MemfdFlags, SealFlags};
    use std::os::unix::fs::FileExt as _;
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    rustix::fs::ftruncate(&fd, len)?;
    let file = File::from(fd);
    for (offset, bytes) in chunks {
        file.write_all_at(bytes, offset)?;
    }
    rustix::fs::fcntl_add_seals(
        &file,
        SealFlags::SHRINK | SealFlags::GROW | SealFlags::WRITE | SealFlags::SEAL,
    )?;
    let path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
    Ok((file, path))
}

/// Runs `f` on a thread of its own and waits at most `limit` for it. On
/// timeout the thread is left parked in whatever blocked it (it ends with
/// dynprof, or when the call returns): dynprof goes on and stays
/// responsive to signals.
pub fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> io::Result<T> {
    let (tx, rx) = mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("dynprof-file".into())
        .spawn(move || {
            // A panic is carried back and resumed in the caller: a parser
            // bug must not look like a slow file (or hide from the fuzzer).
            let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
        })?;
    match rx.recv_timeout(limit) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("{what} took longer than {} s: given up", limit.as_secs()),
        )),
    }
}

/// Reads at most `cap` bytes of a file through `/proc` that the target
/// fills (`environ`, `cmdline`), under [`FILE_DEADLINE`]. Longer contents
/// are cut at `cap`; the flag says so.
pub fn read_proc_capped(path: &Path, cap: usize) -> io::Result<(Vec<u8>, bool)> {
    let owned = path.to_path_buf();
    let what = format!("reading {}", path.display());
    within(
        FILE_DEADLINE,
        &what,
        move || -> io::Result<(Vec<u8>, bool)> {
            let f = File::open(&owned)?;
            let mut buf = Vec::new();
            f.take(cap as u64 + 1).read_to_end(&mut buf)?;
            let cut = buf.len() > cap;
            buf.truncate(cap);
            Ok((buf, cut))
        },
    )?
}

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

    /// Opens a regular file for reading (`O_PATH`, `fstat`, reopen; see the
    /// module doc). A FIFO, socket or device at `path` is refused unopened.
    pub fn open_regular(&self, path: &str) -> io::Result<RegularFile> {
        reopen_regular(self.open_with(path, OFlags::PATH, Mode::empty())?)
    }

    /// What `path` is inside the root, without opening it.
    pub fn stat(&self, path: &str) -> io::Result<FileId> {
        let handle = self.open_with(path, OFlags::PATH, Mode::empty())?;
        Ok(file_id(&rustix::fs::fstat(handle.as_fd())?))
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

    #[test]
    fn fifos_and_devices_are_refused_unopened() {
        let base = std::env::temp_dir().join(format!("dynprof-rootfs-fifo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let fifo = base.join("lib.so");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        symlink("/dev/zero", base.join("dev.so")).unwrap();
        std::fs::write(base.join("ok.so"), b"\x7fELF").unwrap();
        let root = TargetRoot::open(&base).unwrap();
        // Opening the FIFO for reading would block until a writer came.
        let e = root.open_regular("/lib.so").unwrap_err();
        assert!(e.to_string().contains("a FIFO, not a regular file"), "{e}");
        assert_eq!(root.stat("lib.so").unwrap().kind, FileKind::Fifo);
        // Resolved inside the root: no /dev/zero there.
        assert_eq!(
            root.open_regular("dev.so").unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        let e = open_regular(Path::new("/dev/zero")).unwrap_err();
        assert!(e.to_string().contains("a character device"), "{e}");
        let f = root.open_regular("ok.so").unwrap();
        assert_eq!(f.size, 4);
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn a_stuck_call_times_out() {
        let (_keep, rx) = mpsc::channel::<()>();
        let e = within(Duration::from_millis(50), "waiting", move || rx.recv()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(
            within(Duration::from_secs(5), "adding", || 2 + 2).unwrap(),
            4
        );
    }
}
