//! Everything a window leaves on disk (`dynprof report`, in [`crate::report`],
//! reads it back). Writers take a [`model::WindowData`] and never see the kernel.
pub mod chrome_trace;
pub mod flame;
pub mod model;
pub mod tables;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::types::Builtin;

use model::WindowData;

/// Which collectors ran in a window (summary.json's form of a set of
/// [`Builtin`]s). Files of collectors that did not run
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

    /// Whether `b` ran.
    pub fn has(&self, b: Builtin) -> bool {
        match b {
            Builtin::Api => self.api,
            Builtin::Cpu => self.cpu,
            Builtin::Offcpu => self.offcpu,
        }
    }

    /// Marks `b` as run.
    pub fn insert(&mut self, b: Builtin) {
        match b {
            Builtin::Api => self.api = true,
            Builtin::Cpu => self.cpu = true,
            Builtin::Offcpu => self.offcpu = true,
        }
    }
}

impl FromIterator<Builtin> for Collectors {
    fn from_iter<I: IntoIterator<Item = Builtin>>(it: I) -> Self {
        let mut c = Collectors::NONE;
        for b in it {
            c.insert(b);
        }
        c
    }
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
    if !data.modules.is_empty() {
        let path = dir.join(MODULES_FILE);
        let json = serde_json::json!({ "modules": data.modules });
        let mut bytes = serde_json::to_vec_pretty(&json)?;
        bytes.push(b'\n');
        write_atomic(&path, &bytes)?;
        written.push(path);
    }
    Ok(written)
}

/// The files whose frames are named only `[unknown] NAME+0xOFFSET`, with
/// their build ids (written only when there are such frames).
pub const MODULES_FILE: &str = "modules.json";

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
    pub(crate) fn tempdir(tag: &str) -> PathBuf {
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
