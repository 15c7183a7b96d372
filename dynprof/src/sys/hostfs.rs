//! Files dynprof writes on the host (window directories, logs, lock files,
//! hook logs), created so that nobody else on the host can redirect them.
//!
//! dynprof runs as root; the directories it writes into may be reachable by
//! other users (a sticky `/tmp`, a job owner's `--config-dir`). Path-based
//! `File::create` follows a symlink planted at the name, and a predictable
//! temporary name can be planted in advance. So:
//!
//! - an output root is validated once ([`OutputRoot::open`]): every
//!   component from `/` is opened with `O_PATH|O_NOFOLLOW` and `fstat`ed; a
//!   symlink, a directory owned by another user, or one that others may
//!   write without the sticky bit is refused, naming the component and why;
//! - everything below is created relative to a held directory descriptor
//!   ([`HostDir`]): `mkdirat`, `openat(O_CREAT|O_EXCL|O_NOFOLLOW)`,
//!   temporary names with 64 random bits, `renameat`; a rename of an
//!   ancestor by someone else cannot redirect a descriptor we already hold.
use std::{
    borrow::Cow,
    fs::File,
    io::{self, Read as _, Write},
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    path::{Component, Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use rustix::{
    fs::{self as rfs, AtFlags, FileType, Mode, OFlags, RenameFlags, ResolveFlags},
    process::{Gid, Uid},
};

/// Default mode of directories dynprof creates for windows.
pub const DIR_MODE: u32 = 0o750;
/// Default mode of files dynprof creates.
pub const FILE_MODE: u32 = 0o640;
/// Mode of output-root components dynprof has to create: traversable, so
/// that a window handed over with `--chown` can be reached by its new owner.
pub const ROOT_DIR_MODE: u32 = 0o755;

/// A directory held open; every name below it is resolved relative to the
/// descriptor, one component at a time, never following a symlink.
#[derive(Debug)]
pub struct HostDir {
    fd: OwnedFd,
    path: PathBuf,
}

/// Refuses anything but one plain path component.
fn single(name: &str) -> io::Result<&str> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("`{}` is not a single file name", escape_untrusted(name)),
        ));
    }
    Ok(name)
}

/// Largest job-written config file dynprof reads (profiler_config.json;
/// the vendor template is under 1 KiB).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// `<prefix>.<16 hex digits from getrandom>` : nobody can plant it in advance.
pub fn random_name(prefix: &str) -> String {
    let mut b = [0u8; 8];
    // getrandom(2) without flags blocks only before the pool is initialised
    // (early boot); an error here is a broken kernel, so fall back to a mix
    // of clock and PID rather than fail (O_EXCL still protects the create).
    if rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as u64;
        b = (t ^ (u64::from(std::process::id()) << 40)).to_le_bytes();
    }
    format!("{prefix}.{:016x}", u64::from_le_bytes(b))
}

impl HostDir {
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn stat(&self) -> io::Result<rfs::Stat> {
        Ok(rfs::fstat(&self.fd)?)
    }

    pub fn try_clone(&self) -> io::Result<HostDir> {
        Ok(HostDir {
            fd: self.fd.try_clone()?,
            path: self.path.clone(),
        })
    }

    /// Opens an existing subdirectory; a symlink at `name` is an error (ELOOP).
    pub fn open_subdir(&self, name: &str) -> io::Result<HostDir> {
        let name = single(name)?;
        let fd = rfs::openat(
            &self.fd,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(HostDir {
            fd,
            path: self.path.join(name),
        })
    }

    /// Creates `name` (an existing directory is fine) and opens it.
    pub fn create_subdir(&self, name: &str, mode: u32) -> io::Result<HostDir> {
        let name = single(name)?;
        match rfs::mkdirat(&self.fd, name, Mode::from_raw_mode(mode)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(e.into()),
        }
        self.open_subdir(name)
    }

    /// Creates the symlink `name` → `to` (never replacing an existing entry).
    /// The link is for readers; nothing here follows it.
    pub fn symlink(&self, to: &Path, name: &str) -> io::Result<()> {
        let name = single(name)?;
        rfs::symlinkat(to, &self.fd, name)?;
        Ok(())
    }

    /// Creates a new directory with an unpredictable name
    /// `.<prefix>.<random>_tmp`; returns its name and the open directory.
    pub fn create_temp_dir(&self, prefix: &str) -> io::Result<(String, HostDir)> {
        for _ in 0..16 {
            let name = format!("{}_tmp", random_name(&format!(".{prefix}")));
            match rfs::mkdirat(&self.fd, name.as_str(), Mode::from_raw_mode(DIR_MODE)) {
                Ok(()) => {
                    let d = self.open_subdir(&name)?;
                    return Ok((name, d));
                }
                Err(rustix::io::Errno::EXIST) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "no free temporary name",
        ))
    }

    /// Creates a new file `name` (never an existing one, never through a
    /// symlink) with mode 0640, open for writing.
    pub fn create_file(&self, name: &str) -> io::Result<File> {
        self.create_file_mode(name, FILE_MODE)
    }

    pub fn create_file_mode(&self, name: &str, mode: u32) -> io::Result<File> {
        let name = single(name)?;
        let fd = rfs::openat(
            &self.fd,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(mode),
        )?;
        Ok(File::from(fd))
    }

    /// Opens an existing regular file for reading, without following a
    /// symlink or blocking on a FIFO.
    pub fn open_read(&self, name: &str) -> io::Result<File> {
        let name = single(name)?;
        let fd = rfs::openat(
            &self.fd,
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let st = rfs::fstat(&fd)?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a regular file", self.path.join(name).display()),
            ));
        }
        Ok(File::from(fd))
    }

    /// The text of the regular file `name` ([`HostDir::open_read`]: no
    /// link, FIFO or device), refused past `max` bytes.
    pub fn read_capped(&self, name: &str, max: u64) -> io::Result<String> {
        let f = self.open_read(name)?;
        let mut text = String::new();
        io::Read::take(f, max + 1).read_to_string(&mut text)?;
        if text.len() as u64 > max {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("larger than {max} bytes"),
            ));
        }
        Ok(text)
    }

    /// Opens `name` for appending (created 0640 if absent), never through a
    /// symlink; refuses anything but a regular file with one link owned by
    /// root, by dynprof's euid or by `owner` (a log in a user's directory).
    pub fn open_append(&self, name: &str, owner: Option<u32>, mode: u32) -> io::Result<File> {
        let name = single(name)?;
        let fd = rfs::openat(
            &self.fd,
            name,
            OFlags::WRONLY
                | OFlags::APPEND
                | OFlags::CREATE
                | OFlags::NOFOLLOW
                | OFlags::NONBLOCK
                | OFlags::CLOEXEC,
            Mode::from_raw_mode(mode),
        )?;
        let st = rfs::fstat(&fd)?;
        let euid = rustix::process::geteuid().as_raw();
        let why = if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            Some("is not a regular file")
        } else if st.st_nlink != 1 {
            Some("has more than one hard link")
        } else if st.st_uid != 0 && st.st_uid != euid && Some(st.st_uid) != owner {
            Some("is owned by another user")
        } else {
            None
        };
        if let Some(why) = why {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "{} {why}; not writing to it",
                    self.path.join(name).display()
                ),
            ));
        }
        Ok(File::from(fd))
    }

    /// Writes `name` completely or not at all: a new file under a random
    /// name (O_EXCL|O_NOFOLLOW), fsynced, then renamed over `name`.
    pub fn write_atomic(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        self.write_atomic_with(name, |w| w.write_all(bytes))
    }

    /// [`HostDir::write_atomic`] for content produced as a stream: `fill`
    /// writes into a buffered temporary file, which replaces `name` only if
    /// `fill`, the flush and the fsync all succeeded.
    pub fn write_atomic_with(
        &self,
        name: &str,
        fill: impl FnOnce(&mut dyn Write) -> io::Result<()>,
    ) -> io::Result<()> {
        let name = single(name)?;
        let (tmp, f) = self.create_temp_file(name)?;
        let r = (|| {
            let mut w = io::BufWriter::with_capacity(1 << 20, f);
            fill(&mut w)?;
            let f = w.into_inner().map_err(|e| e.into_error())?;
            f.sync_all()?;
            Ok(rfs::renameat(&self.fd, tmp.as_str(), &self.fd, name)?)
        })();
        if r.is_err() {
            let _ = rfs::unlinkat(&self.fd, tmp.as_str(), AtFlags::empty());
        }
        r
    }

    /// A new file `.<name>.<random>.tmp`, for a later [`HostDir::rename`].
    pub fn create_temp_file(&self, name: &str) -> io::Result<(String, File)> {
        for _ in 0..16 {
            let tmp = format!("{}.tmp", random_name(&format!(".{name}")));
            match self.create_file(&tmp) {
                Ok(f) => return Ok((tmp, f)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "no free temporary name",
        ))
    }

    /// Renames `from` to `to` inside this directory, replacing `to`.
    pub fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        Ok(rfs::renameat(
            &self.fd,
            single(from)?,
            &self.fd,
            single(to)?,
        )?)
    }

    /// Renames `from` to `to` unless `to` exists (EEXIST then).
    pub fn rename_noreplace(&self, from: &str, to: &str) -> io::Result<()> {
        Ok(rfs::renameat_with(
            &self.fd,
            single(from)?,
            &self.fd,
            single(to)?,
            RenameFlags::NOREPLACE,
        )?)
    }

    pub fn unlink(&self, name: &str) -> io::Result<()> {
        Ok(rfs::unlinkat(&self.fd, single(name)?, AtFlags::empty())?)
    }

    /// Removes `name` and everything below it, never following a symlink.
    pub fn remove_tree(&self, name: &str) -> io::Result<()> {
        let name = single(name)?;
        match rfs::unlinkat(&self.fd, name, AtFlags::empty()) {
            Ok(()) => return Ok(()),
            Err(rustix::io::Errno::ISDIR | rustix::io::Errno::PERM) => {}
            Err(e) => return Err(e.into()),
        }
        let sub = self.open_subdir(name)?;
        for n in sub.names()? {
            sub.remove_tree(&n)?;
        }
        Ok(rfs::unlinkat(&self.fd, name, AtFlags::REMOVEDIR)?)
    }

    /// The entries of this directory (without `.` and `..`).
    pub fn names(&self) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        for e in rfs::Dir::read_from(&self.fd)? {
            let e = e?;
            let n = e.file_name().to_string_lossy().into_owned();
            if n != "." && n != ".." {
                out.push(n);
            }
        }
        Ok(out)
    }

    /// Hands this directory and everything below it to `uid:gid`, never
    /// following a symlink (`fchown` on held descriptors, `fchownat` with
    /// `AT_SYMLINK_NOFOLLOW` for the other entries).
    pub fn chown_tree(&self, uid: u32, gid: Option<u32>) -> io::Result<()> {
        let (u, g) = (Some(Uid::from_raw(uid)), gid.map(Gid::from_raw));
        for n in self.names()? {
            let st = rfs::statat(&self.fd, n.as_str(), AtFlags::SYMLINK_NOFOLLOW)?;
            if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
                self.open_subdir(&n)?.chown_tree(uid, gid)?;
            } else {
                rfs::chownat(&self.fd, n.as_str(), u, g, AtFlags::SYMLINK_NOFOLLOW)?;
            }
        }
        Ok(rfs::fchown(&self.fd, u, g)?)
    }

    /// fsync of the directory (its entries reach the disk).
    pub fn sync(&self) {
        let _ = rfs::fsync(&self.fd);
    }
}

impl AsFd for HostDir {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// `path` made absolute (against the working directory) with `.` and `..`
/// removed lexically. Lexical `..` is what the caller meant: the walk that
/// follows refuses symlinks, so no component can mean anything else.
pub fn absolute_clean(path: &Path) -> io::Result<PathBuf> {
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()?.join(path)
    };
    let mut clean = PathBuf::from("/");
    for c in abs.components() {
        match c {
            Component::ParentDir => {
                clean.pop();
            }
            Component::Normal(n) => clean.push(n),
            Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
        }
    }
    Ok(clean)
}

/// Why a directory on the way to an output root cannot be trusted, or None.
fn distrust(st: &rfs::Stat) -> Option<String> {
    let euid = rustix::process::geteuid().as_raw();
    let egid = rustix::process::getegid().as_raw();
    let mode = st.st_mode & 0o7777;
    let sticky = mode & 0o1000 != 0;
    if st.st_uid != 0 && st.st_uid != euid {
        return Some(format!(
            "it is owned by uid {} (neither root nor dynprof's uid {euid}), who could rename or replace what dynprof writes below it",
            st.st_uid
        ));
    }
    if mode & 0o002 != 0 && !sticky {
        return Some(format!(
            "every user may write to it (mode {mode:04o}) and it lacks the sticky bit, so anyone could rename or replace what dynprof writes below it"
        ));
    }
    // A group of root (gid 0) or of dynprof itself is the operator's own.
    if mode & 0o020 != 0 && !sticky && st.st_gid != 0 && st.st_gid != egid {
        return Some(format!(
            "group {} may write to it (mode {mode:04o}) and it lacks the sticky bit, so its members could rename or replace what dynprof writes below it",
            st.st_gid
        ));
    }
    None
}

/// The directory windows go into: validated once, then held open.
#[derive(Debug)]
pub struct OutputRoot {
    dir: HostDir,
}

impl OutputRoot {
    /// Opens `path` (creating missing components, mode 0755), refusing a
    /// path through a symlink or a directory another user could change.
    pub fn open(path: &Path) -> Result<Self> {
        let clean =
            absolute_clean(path).with_context(|| format!("output directory {}", path.display()))?;
        let refuse = |at: &Path, why: &str| -> anyhow::Error {
            anyhow::anyhow!(
                "refusing output directory {}: {} {why}; choose a directory only root (or you) can change, e.g. one under /var/lib or a root-owned sticky /tmp",
                path.display(),
                at.display(),
            )
        };
        let mut fd = rfs::open(
            "/",
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .context("opening /")?;
        let mut at = PathBuf::from("/");
        let st = rfs::fstat(&fd)?;
        if let Some(why) = distrust(&st) {
            return Err(refuse(&at, &why));
        }
        for c in clean.components().skip(1) {
            let Component::Normal(name) = c else { continue };
            at.push(name);
            let open = |fd: &OwnedFd| {
                rfs::openat(
                    fd,
                    name,
                    OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
            };
            let next = match open(&fd) {
                Err(rustix::io::Errno::NOENT) => {
                    match rfs::mkdirat(&fd, name, Mode::from_raw_mode(ROOT_DIR_MODE)) {
                        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                        Err(e) => {
                            return Err(io::Error::from(e))
                                .with_context(|| format!("creating {}", at.display()));
                        }
                    }
                    open(&fd)
                }
                r => r,
            }
            .map_err(io::Error::from)
            .with_context(|| format!("opening {}", at.display()))?;
            let st = rfs::fstat(&next)?;
            match FileType::from_raw_mode(st.st_mode) {
                FileType::Symlink => {
                    return Err(refuse(
                        &at,
                        "is a symbolic link (links anywhere in the path are refused: whoever controls the link controls where root writes)",
                    ));
                }
                FileType::Directory => {}
                _ => return Err(refuse(&at, "is not a directory")),
            }
            if let Some(why) = distrust(&st) {
                return Err(refuse(&at, &why));
            }
            fd = next;
        }
        let fd = rfs::openat(
            &fd,
            ".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(io::Error::from)
        .with_context(|| format!("opening {}", clean.display()))?;
        Ok(Self {
            dir: HostDir { fd, path: clean },
        })
    }

    pub fn dir(&self) -> &HostDir {
        &self.dir
    }

    pub fn path(&self) -> &Path {
        &self.dir.path
    }

    /// The directory `rel` below the root (created as needed), where `rel`
    /// comes from [`confine_relative`]: no symlink is followed, and every
    /// existing component must be as trustworthy as the root itself.
    pub fn subdir(&self, rel: &Path) -> Result<HostDir> {
        let mut d = self.dir.try_clone()?;
        for c in rel.components() {
            let Component::Normal(n) = c else {
                bail!(
                    "{}: only plain names are allowed below the output directory",
                    rel.display()
                );
            };
            let n = n.to_str().context("non-UTF-8 directory name")?;
            let next = d.create_subdir(n, ROOT_DIR_MODE).map_err(|e| {
                if e.raw_os_error() == Some(libc::ELOOP) || e.raw_os_error() == Some(libc::ENOTDIR)
                {
                    anyhow::anyhow!(
                        "{} is a symbolic link or not a directory; refused",
                        d.path.join(n).display()
                    )
                } else {
                    anyhow::Error::from(e).context(format!("creating {}", d.path.join(n).display()))
                }
            })?;
            if let Some(why) = distrust(&next.stat()?) {
                bail!("refusing {}: {why}", next.path.display());
            }
            d = next;
        }
        Ok(d)
    }
}

/// A path a target (e.g. profiler_config.json's `prof_dir`) asks for, made
/// relative to the output root: relative only, no `..`, no control
/// characters. `./` means the root itself (an empty path).
pub fn confine_relative(s: &str) -> std::result::Result<PathBuf, String> {
    if s.chars().any(|c| c.is_control()) {
        return Err("control characters are not allowed".into());
    }
    let p = Path::new(s);
    if p.is_absolute() {
        return Err("absolute paths are not allowed (it must be relative to the output directory dynprof was given)".into());
    }
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::CurDir => {}
            Component::Normal(n) => out.push(n),
            Component::ParentDir => return Err("`..` is not allowed".into()),
            Component::RootDir | Component::Prefix(_) => {
                return Err("absolute paths are not allowed".into());
            }
        }
    }
    Ok(out)
}

/// Opens the directory at `path` (for writing by name inside it), refusing
/// a symlink anywhere in the path (`openat2` with `RESOLVE_NO_SYMLINKS`).
pub fn open_dir_nofollow(path: &Path) -> io::Result<HostDir> {
    let fd = rfs::openat2(
        rfs::CWD,
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )?;
    Ok(HostDir {
        fd,
        path: path.to_path_buf(),
    })
}

/// Creates `path` and its missing parents (mode `mode`) one component at a
/// time from `/`, never following a symlink (ELOOP/ENOTDIR instead), and
/// returns it open. Unlike [`OutputRoot::open`] it does not judge owners:
/// for directories that belong to a job's user by design (`--config-dir`).
pub fn create_dir_all_nofollow(path: &Path, mode: u32) -> io::Result<HostDir> {
    let clean = absolute_clean(path)?;
    let mut d = open_dir_nofollow(Path::new("/"))?;
    for c in clean.components() {
        if let Component::Normal(n) = c {
            let n = n
                .to_str()
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "non-UTF-8 path"))?;
            d = d.create_subdir(n, mode)?;
        }
    }
    Ok(d)
}

fn split(path: &Path) -> io::Result<(&Path, &str)> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no file name"))?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    Ok((parent, name))
}

/// [`HostDir::write_atomic`] for a path: the parent is opened without
/// following any symlink, the file goes through a random O_EXCL temp.
pub fn write_atomic_path(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let (parent, name) = split(path)?;
    open_dir_nofollow(parent)?.write_atomic(name, bytes)
}

/// [`HostDir::read_capped`] for a path (its directories opened without
/// following links).
pub fn read_path_capped(path: &Path, max: u64) -> io::Result<String> {
    let (parent, name) = split(path)?;
    open_dir_nofollow(parent)?.read_capped(name, max)
}

/// [`HostDir::write_atomic_with`] for a path.
pub fn write_atomic_path_with(
    path: &Path,
    fill: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> io::Result<()> {
    let (parent, name) = split(path)?;
    open_dir_nofollow(parent)?.write_atomic_with(name, fill)
}

/// [`HostDir::create_file`] for a path (parent created if missing, 0750).
pub fn create_file_path(path: &Path) -> io::Result<File> {
    let (parent, name) = split(path)?;
    let dir = match open_dir_nofollow(parent) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let (pp, pn) = split(parent)?;
            open_dir_nofollow(pp)?.create_subdir(pn, DIR_MODE)?
        }
        r => r?,
    };
    dir.create_file(name)
}

/// `s` with every control character (newline, escape, …) and Unicode line
/// separator written as a Rust escape, so that a string a target chose
/// stays on one log line and cannot drive a terminal.
pub fn escape_untrusted(s: &str) -> Cow<'_, str> {
    let bad = |c: char| c.is_control() || c == '\u{2028}' || c == '\u{2029}';
    if !s.chars().any(bad) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if bad(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// The effective uid and gid of a process (`/proc/PID/status`), for
/// handing its windows over with `--chown target`.
pub fn process_owner(pid: u32) -> Result<(u32, u32)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let field = |k: &str| -> Option<u32> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|r| r.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
    };
    match (field("Uid:"), field("Gid:")) {
        (Some(u), Some(g)) => Ok((u, g)),
        _ => bail!("/proc/{pid}/status has no Uid/Gid lines"),
    }
}

/// The primary group of `uid` from /etc/passwd, if it is listed there.
pub fn primary_gid(uid: u32) -> Option<u32> {
    let text = std::fs::read_to_string("/etc/passwd").ok()?;
    text.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() > 3 && f[2].parse() == Ok(uid))
            .then(|| f[3].parse().ok())
            .flatten()
    })
}

#[cfg(test)]
mod tests;
