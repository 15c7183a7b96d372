//! One controller per target: an exclusive `flock` on
//! `/run/dynprof/<hostpid>.lock`, held for the whole session.
//!
//! The kernel releases a flock when its holder dies, however it dies, so a
//! lock left behind by a SIGKILLed dynprof never blocks anyone. Files do not
//! pile up: the holder unlinks its file on exit *while still holding the
//! flock*, and anyone who finds a file nobody holds (a killed dynprof's)
//! unlinks it the same way. An acquirer that wins the flock re-checks that
//! the name still points at the inode it locked and starts over otherwise,
//! so an unlink can never split one target between two locks.
//!
//! The directory is created 0700 and validated like an output root (no
//! symlink, no directory another user could change on the way); lock files
//! are opened relative to it with `O_NOFOLLOW`.
use std::{
    fs::File,
    io::{Read as _, Seek as _, SeekFrom, Write as _},
    path::PathBuf,
};

use anyhow::{Context as _, Result, bail};
use rustix::fs::{self as rfs, AtFlags, FileType, FlockOperation, Mode, OFlags};

use crate::{
    sys::hostfs::{HostDir, OutputRoot},
    types::HostPid,
};

/// Where the locks live; `DYNPROF_LOCK_DIR` overrides it (for unprivileged
/// runs and tests).
pub fn lock_dir() -> PathBuf {
    std::env::var_os("DYNPROF_LOCK_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/dynprof"))
}

/// Held while it lives; dropping it (or dying) releases the target.
#[derive(Debug)]
pub struct TargetLock {
    file: File,
    dir: HostDir,
    name: String,
    pub path: PathBuf,
}

impl Drop for TargetLock {
    fn drop(&mut self) {
        // Still holding the flock: nobody else can be between "locked" and
        // "checked the name" on this inode.
        if same_inode(&self.dir, &self.name, &self.file) {
            let _ = self.dir.unlink(&self.name);
        }
    }
}

/// The lock directory, created 0700 if missing, then validated.
fn open_dir() -> Result<HostDir> {
    let path = lock_dir();
    if let Some(parent) = path.parent() {
        // Only the last component is created here (0700); the parents must
        // exist (e.g. /run) and are checked by the walk below.
        let parent = OutputRoot::open(parent)
            .with_context(|| format!("lock directory {}", path.display()))?;
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .context("lock directory has no name")?;
        let d = parent.dir().create_subdir(name, 0o700).with_context(|| {
            format!(
                "opening lock directory {} (a symlink is refused)",
                path.display()
            )
        })?;
        drop(d);
    }
    let root = OutputRoot::open(&path)?;
    let dir = root.dir().try_clone()?;
    let st = dir.stat()?;
    if st.st_mode & 0o077 != 0 {
        // An older dynprof made it 0755; only its owner reads the holders.
        rfs::fchmod(&dir, Mode::from_raw_mode(0o700))
            .with_context(|| format!("chmod 0700 {}", path.display()))?;
    }
    Ok(dir)
}

fn same_inode(dir: &HostDir, name: &str, f: &File) -> bool {
    match (
        rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW),
        rfs::fstat(f),
    ) {
        (Ok(a), Ok(b)) => a.st_dev == b.st_dev && a.st_ino == b.st_ino,
        _ => false,
    }
}

fn open_lock(dir: &HostDir, name: &str, create: bool) -> std::io::Result<File> {
    let mut flags = OFlags::RDWR | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
    if create {
        flags |= OFlags::CREATE;
    }
    let fd = rfs::openat(dir, name, flags, Mode::from_raw_mode(0o600))?;
    let st = rfs::fstat(&fd)?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{name} is not a regular file"),
        ));
    }
    Ok(File::from(fd))
}

fn try_flock(f: &File) -> std::io::Result<bool> {
    match rfs::flock(f, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(true),
        Err(rustix::io::Errno::WOULDBLOCK) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Unlinks every `*.lock` nobody holds (left by a killed dynprof).
/// Returns how many were removed.
pub fn reap_stale(dir: &HostDir) -> usize {
    let mut n = 0;
    for name in dir.names().unwrap_or_default() {
        if !name.ends_with(".lock") {
            continue;
        }
        let Ok(f) = open_lock(dir, &name, false) else {
            continue;
        };
        if try_flock(&f).unwrap_or(false) && same_inode(dir, &name, &f) && dir.unlink(&name).is_ok()
        {
            n += 1;
        }
    }
    n
}

/// Takes the target's lock or fails naming the holder (PID, mode, since when).
pub fn acquire(target: HostPid, mode: &str) -> Result<TargetLock> {
    let dir = open_dir()?;
    let reaped = reap_stale(&dir);
    if reaped > 0 {
        log::info!(
            "removed {reaped} stale lock file(s) from {}",
            dir.path().display()
        );
    }
    let name = format!("{target}.lock");
    let path = dir.path().join(&name);
    let mut file = loop {
        let mut file = open_lock(&dir, &name, true)
            .with_context(|| format!("opening {} (a symlink is refused)", path.display()))?;
        if !try_flock(&file).with_context(|| format!("locking {}", path.display()))? {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let field = |k: &str| {
                holder
                    .lines()
                    .find_map(|l| l.strip_prefix(&format!("{k}=")))
                    .map(|v| crate::sys::hostfs::escape_untrusted(v).into_owned())
                    .unwrap_or_else(|| "?".into())
            };
            bail!(
                "PID {target} is already controlled by another dynprof (PID {}, mode {}, since {}; lock {}); \
                 only one dynprof may control a target at a time",
                field("pid"),
                field("mode"),
                field("since"),
                path.display()
            );
        }
        // Its previous holder (or a reaper) may have unlinked the name
        // between our open and our flock: then this inode locks nothing.
        if same_inode(&dir, &name, &file) {
            break file;
        }
    };
    let content = format!(
        "pid={}\nmode={mode}\nsince={}\n",
        std::process::id(),
        crate::sys::clock::local_timestamp_human()
    );
    file.set_len(0)?;
    file.seek(SeekFrom::Start(0))?;
    file.write_all(content.as_bytes())?;
    file.flush()?;
    Ok(TargetLock {
        file,
        dir,
        name,
        path,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt as _, symlink};

    /// One test: the lock directory comes from the environment.
    #[test]
    fn lock_names_holder_is_removed_and_reaps_stale() {
        let dir = std::env::temp_dir().join(format!("dynprof-lock-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // SAFETY: this is the only test that sets the variable.
        unsafe { std::env::set_var("DYNPROF_LOCK_DIR", &dir) };
        let a = acquire(HostPid(4_000_001), "attach").unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        let e = acquire(HostPid(4_000_001), "launch")
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("PID {}", std::process::id())), "{e}");
        assert!(e.contains("mode attach"), "{e}");
        drop(a);
        assert!(!dir.join("4000001.lock").exists(), "lock file left behind");
        let b = acquire(HostPid(4_000_001), "launch").unwrap();
        // Stale files (nobody holds them) go at the next acquire; a held one stays.
        std::fs::write(dir.join("4000002.lock"), "pid=1\n").unwrap();
        std::fs::write(dir.join("4000003.lock"), "pid=1\n").unwrap();
        let c = acquire(HostPid(4_000_004), "attach").unwrap();
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, vec!["4000001.lock", "4000004.lock"]);
        drop((b, c));
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        // A planted symlink is never opened.
        let victim = dir.with_extension("victim");
        std::fs::write(&victim, "keep").unwrap();
        symlink(&victim, dir.join("4000005.lock")).unwrap();
        assert!(acquire(HostPid(4_000_005), "attach").is_err());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        let _ = std::fs::remove_file(&victim);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
