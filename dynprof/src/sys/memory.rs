//! dynprof's own memory: its peak RSS, giving freed heap back, and
//! unnamed files to spill window events into.
use std::{fs::File, path::Path};

use anyhow::{Context as _, Result};

/// dynprof's peak resident set size so far (`VmHWM` of /proc/self/status),
/// in bytes.
pub fn peak_rss_bytes() -> Result<u64> {
    let st = procfs::process::Process::myself()
        .and_then(|p| p.status())
        .context("reading /proc/self/status")?;
    st.vmhwm
        .map(|kb| kb * 1024)
        .context("/proc/self/status has no VmHWM")
}

/// A read-write file in `dir` that has no name (O_TMPFILE where the
/// filesystem supports it, else created and unlinked at once): it never
/// shows up in the directory and is freed when dynprof exits, however.
pub fn unnamed_temp_file(dir: &Path) -> Result<File> {
    tempfile::tempfile_in(dir)
        .with_context(|| format!("creating an unnamed spill file in {}", dir.display()))
}

/// Hands the heap's free pages back to the kernel (glibc `malloc_trim`):
/// after a large, short-lived allocation (a library's symbol tables) the
/// freed memory would otherwise stay resident in malloc's arenas and add
/// to a long-running process's RSS.
pub fn trim_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only walks malloc's own arenas; no pointer of
    // ours is involved.
    unsafe {
        libc::malloc_trim(0);
    }
}
