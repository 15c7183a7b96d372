//! The per-window output directory:
//! `<output>/PROF_<YYYYmmddHHMMSSmmm>_<hostpid>_<window#>/`.
//!
//! A window is written into a hidden `.PROF_…_tmp` sibling and renamed when
//! its files and `meta.json` are all on disk, so a `PROF_*` directory is
//! either complete or carries `"complete": false` with the reason; `meta.json`
//! is always the last file written, so a directory without it was never
//! finished (and `dynprof report` says so).
use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};

use crate::{
    output::write_atomic,
    types::{HostPid, WindowId},
};

/// Local wall-clock time as `YYYYmmddHHMMSSmmm`.
pub fn local_timestamp() -> String {
    let (tm, ms) = local_tm();
    format!(
        "{:04}{:02}{:02}{:02}{:02}{:02}{:03}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec,
        ms
    )
}

/// Local wall-clock time as `YYYY-mm-dd HH:MM:SS.mmm`.
pub fn local_timestamp_human() -> String {
    let (tm, ms) = local_tm();
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}.{:03}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec,
        ms
    )
}

fn local_tm() -> (libc::tm, u32) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = now.as_secs() as libc::time_t;
    // SAFETY: localtime_r writes into the tm we pass; tzset reads the environment.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    unsafe {
        libc::localtime_r(&secs, &mut tm);
    }
    (tm, now.subsec_millis())
}

/// A window directory being written.
#[derive(Debug)]
pub struct ProfDir {
    /// The hidden directory the files go into until [`ProfDir::finish`].
    pub tmp: PathBuf,
    /// The final name.
    pub dir: PathBuf,
}

impl ProfDir {
    /// Creates `<output>/.PROF_<ts>_<pid>_<n>_tmp`.
    pub fn create(output: &Path, pid: HostPid, id: WindowId) -> Result<Self> {
        fs::create_dir_all(output)
            .with_context(|| format!("creating output directory {}", output.display()))?;
        let name = format!("PROF_{}_{}_{}", local_timestamp(), pid, id);
        let dir = output.join(&name);
        let tmp = output.join(format!(".{name}_tmp"));
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        Ok(Self { tmp, dir })
    }

    /// Writes `meta.json` last and renames the directory to its final name.
    pub fn finish(self, meta: &serde_json::Value) -> Result<PathBuf> {
        let text = serde_json::to_vec_pretty(meta)?;
        write_atomic(&self.tmp.join("meta.json"), &text)?;
        sync_dir(&self.tmp);
        fs::rename(&self.tmp, &self.dir).with_context(|| {
            format!("renaming {} to {}", self.tmp.display(), self.dir.display())
        })?;
        if let Some(parent) = self.dir.parent() {
            sync_dir(parent);
        }
        Ok(self.dir)
    }
}

fn sync_dir(p: &Path) {
    if let Ok(f) = fs::File::open(p) {
        let _ = f.sync_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamp_shape() {
        let t = local_timestamp();
        assert_eq!(t.len(), 17, "{t}");
        assert!(t.chars().all(|c| c.is_ascii_digit()));
    }

    #[test]
    fn tmp_then_final() {
        let out = std::env::temp_dir().join(format!("dynprof-profdir-{}", std::process::id()));
        let p = ProfDir::create(&out, HostPid(42), WindowId(3)).unwrap();
        assert!(
            p.tmp
                .file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with(".PROF_")
        );
        fs::write(p.tmp.join("steps.csv"), "x").unwrap();
        let d = p.finish(&serde_json::json!({"complete": true})).unwrap();
        let name = d.file_name().unwrap().to_str().unwrap().to_string();
        assert!(
            name.starts_with("PROF_") && name.ends_with("_42_3"),
            "{name}"
        );
        assert!(d.join("meta.json").is_file() && d.join("steps.csv").is_file());
        let _ = fs::remove_dir_all(&out);
    }
}
