//! Everything a window leaves on disk, and `dynprof report`, which reads it
//! back. Writers take a [`model::WindowData`] and never see the kernel.
pub mod chrome_trace;
pub mod flame;
pub mod model;
pub mod python_top;
pub mod report;
pub mod tables;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use model::WindowData;

/// Which collectors ran in a window. Files of collectors that did not run
/// are not written at all, so that an absent `cpu.folded` means "not
/// collected" rather than "collected nothing".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Collectors {
    pub api: bool,
    pub cpu: bool,
    pub offcpu: bool,
}

impl Default for Collectors {
    fn default() -> Self {
        Self::ALL
    }
}

impl Collectors {
    pub const ALL: Collectors = Collectors {
        api: true,
        cpu: true,
        offcpu: true,
    };
    pub const NONE: Collectors = Collectors {
        api: false,
        cpu: false,
        offcpu: false,
    };
}

/// Writes every per-window output file into `dir` (which must exist) and
/// returns their paths. `steps.csv`, `summary.json` and `trace.json` are
/// always written; `api_summary.csv`, `cpu.folded`/`flamegraph.svg` and
/// `offcpu.folded`/`offcpu.svg` only for collectors that ran. Each file is
/// complete or absent (see [`write_atomic`]); `meta.json` and the atomicity
/// of the directory as a whole belong to the window code.
pub fn write_window_files(
    dir: &Path,
    data: &WindowData,
    collectors: &Collectors,
) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    written.push(tables::write_steps(dir, data)?);
    if collectors.api {
        written.push(tables::write_api_summary(dir, data)?);
    }
    if collectors.cpu {
        written.extend(flame::write_cpu(dir, &data.samples)?);
    }
    if collectors.offcpu {
        written.extend(flame::write_offcpu(dir, &data.offcpu)?);
    }
    written.extend(chrome_trace::write_trace(dir, data)?);
    written.push(tables::write_summary(dir, data, collectors)?);
    Ok(written)
}

/// Writes `path` completely or not at all: a new file under an
/// unpredictable name next to it (`O_CREAT|O_EXCL|O_NOFOLLOW`), fsynced,
/// then renamed over `path`. The parent directory is opened without
/// following any symlink (see [`crate::sys::hostfs`]), so a link planted in
/// a window directory or on its path is never written through.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    crate::sys::hostfs::write_atomic_path(path, bytes)
        .with_context(|| format!("writing {}", path.display()))
}

/// Like [`write_atomic`], for content written as a stream: `fill` writes
/// into a buffered temporary file, which is synced and renamed only if it
/// succeeded (a window's trace is never held in memory whole).
pub fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&mut dyn std::io::Write) -> Result<()>,
) -> Result<()> {
    // `fill`'s own error is kept whole (its context chain), not flattened
    // into an io::Error.
    let mut failed = None;
    let r = crate::sys::hostfs::write_atomic_path_with(path, |w| {
        fill(w).map_err(|e| {
            let io = std::io::Error::other(format!("{e:#}"));
            failed = Some(e);
            io
        })
    });
    match (r, failed) {
        (Ok(()), _) => Ok(()),
        (Err(_), Some(e)) => Err(e.context(format!("writing {}", path.display()))),
        (Err(e), None) => Err(e).with_context(|| format!("writing {}", path.display())),
    }
}

#[cfg(test)]
pub(crate) mod tests_support {
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A fresh directory per call; tests run in parallel threads of one process.
    pub fn tempdir(tag: &str) -> PathBuf {
        static N: AtomicU32 = AtomicU32::new(0);
        let d = std::env::temp_dir().join(format!(
            "dynprof-test-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
