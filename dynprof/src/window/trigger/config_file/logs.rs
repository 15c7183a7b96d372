//! The dp_*.log and monitor_dp_*.log files, as torch_npu writes them, rotated by size.
use super::*;

/// A size-rotated log file in the (user-owned) log directory.
///
/// The directory is held open; the file is opened relative to it with
/// `O_NOFOLLOW|O_APPEND` at every write and must be a regular file with one
/// link, owned by root, dynprof or the directory's owner: a symlink or hard
/// link planted at its name is refused, never written through. Every line
/// is escaped ([`escape_untrusted`]): a string from the target stays one line.
pub struct RotatingLog {
    /// Said once on stderr that the file is refused (not at every line).
    refused: std::sync::atomic::AtomicBool,
    dir: HostDir,
    name: String,
    path: PathBuf,
    /// The log directory's owner (the job's user, typically).
    owner: u32,
    pub(super) max: u64,
}

impl RotatingLog {
    pub fn new(dir: &HostDir, name: &str) -> Result<Self> {
        let max = std::env::var("DYNPROF_CONFIG_LOG_MAX_BYTES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(LOG_MAX_BYTES);
        Ok(Self {
            refused: std::sync::atomic::AtomicBool::new(false),
            dir: dir.try_clone()?,
            name: name.to_string(),
            path: dir.path().join(name),
            owner: dir.stat()?.st_uid,
            max,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn refuse(&self, e: &std::io::Error) {
        if !self
            .refused
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            log::warn!("not logging to {}: {e}", self.path.display());
        }
    }

    pub fn write(&self, level: &str, msg: &str) {
        let line = format!(
            "[{}] [{level}] {}\n",
            crate::sys::clock::local_timestamp_human(),
            escape_untrusted(msg)
        );
        let open = || self.dir.open_append(&self.name, Some(self.owner), 0o644);
        let mut f = match open() {
            Ok(f) => f,
            Err(e) => {
                self.refuse(&e);
                return;
            }
        };
        if f.metadata().map(|m| m.len() >= self.max).unwrap_or(false) {
            let rotated = format!("{}.1", self.name);
            // renameat inside the held directory replaces a name, never
            // follows it.
            if self.dir.rename(&self.name, &rotated).is_ok() {
                match open() {
                    Ok(g) => f = g,
                    Err(e) => {
                        self.refuse(&e);
                        return;
                    }
                }
            }
        }
        let _ = f.write_all(line.as_bytes());
    }
}

pub(super) fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "localhost".into();
    }
    let n = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..n]).into_owned()
}
