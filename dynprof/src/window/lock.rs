//! One controller per target: an exclusive `flock` on
//! `/run/dynprof/<hostpid>.lock`, held for the whole session.
//!
//! The kernel releases a flock when its holder dies, however it dies, so a
//! lock left behind by a SIGKILLed dynprof never blocks anyone; the file
//! itself is left in place (deleting it would race with a new holder).
use std::{
    fs::{self, File, OpenOptions},
    io::{Read as _, Seek as _, SeekFrom, Write as _},
    os::{fd::AsRawFd as _, unix::fs::OpenOptionsExt as _},
    path::PathBuf,
};

use anyhow::{Context as _, Result, bail};

use crate::types::HostPid;

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
    _file: File,
    pub path: PathBuf,
}

/// Takes the target's lock or fails naming the holder (PID, mode, since when).
pub fn acquire(target: HostPid, mode: &str) -> Result<TargetLock> {
    let dir = lock_dir();
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("{target}.lock"));
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: flock(2) on a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(err).with_context(|| format!("locking {}", path.display()));
        }
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        let field = |k: &str| {
            holder
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{k}=")))
                .map(str::to_string)
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
    let content = format!(
        "pid={}\nmode={mode}\nsince={}\n",
        std::process::id(),
        super::profdir::local_timestamp_human()
    );
    file.set_len(0)?;
    file.seek(SeekFrom::Start(0))?;
    file.write_all(content.as_bytes())?;
    file.flush()?;
    Ok(TargetLock { _file: file, path })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_lock_names_the_holder() {
        let dir = std::env::temp_dir().join(format!("dynprof-lock-test-{}", std::process::id()));
        // SAFETY: tests in this module are the only users of the variable.
        unsafe { std::env::set_var("DYNPROF_LOCK_DIR", &dir) };
        let a = acquire(HostPid(4_000_001), "attach").unwrap();
        let e = acquire(HostPid(4_000_001), "launch")
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("PID {}", std::process::id())), "{e}");
        assert!(e.contains("mode attach"), "{e}");
        drop(a);
        acquire(HostPid(4_000_001), "launch").unwrap();
        let _ = fs::remove_dir_all(&dir);
    }
}
