//! The per-window output directory:
//! `<output>/PROF_<YYYYmmddHHMMSSmmm>_<hostpid>_<window#>/`.
//!
//! A window is written into a hidden `.PROF_…_tmp` sibling and renamed when
//! its files and `meta.json` are all on disk, so a `PROF_*` directory is
//! either complete or carries `"complete": false` with the reason; one whose
//! files could not all be written (disk full) is named `PROF_…_incomplete`;
//! `meta.json` is always the last file written, so a directory without it
//! was never finished (and `dynprof report` says so).
use std::{fs, path::PathBuf};

use anyhow::{Context as _, Result};

use crate::{
    sys::{clock::local_timestamp, hostfs::HostDir},
    types::{HostPid, WindowId},
};

/// Who a finished window is handed to (`--chown`): uid, and gid when known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    pub gid: Option<u32>,
}

/// A window directory being written.
///
/// It is created under an unpredictable hidden name
/// `.PROF_<ts>_<pid>_<n>.<random>_tmp` (mode 0750, owned by dynprof) and
/// held open: files go in with `openat` on that descriptor
/// ([`ProfDir::create_file`]), so neither a link planted in the output
/// directory nor a rename of the hidden directory can send them elsewhere.
/// A window that is dropped unfinished is renamed to a visible
/// `PROF_…_incomplete` (or removed), never left hidden.
#[derive(Debug)]
pub struct ProfDir {
    /// The hidden directory the files go into until [`ProfDir::finish`]
    /// (for code that writes by path; prefer [`ProfDir::create_file`]).
    pub tmp: PathBuf,
    /// The final name.
    pub dir: PathBuf,
    parent: HostDir,
    tmp_name: String,
    name: String,
    handle: HostDir,
    owner: Option<Owner>,
    /// Renamed (or given up) already: nothing for Drop to do.
    settled: bool,
}

impl ProfDir {
    /// Creates `<parent>/.PROF_<ts>_<pid>_<n>.<random>_tmp`.
    pub fn create(parent: &HostDir, pid: HostPid, id: WindowId) -> Result<Self> {
        let name = format!("PROF_{}_{}_{}", local_timestamp(), pid, id);
        let parent = parent
            .try_clone()
            .with_context(|| format!("opening {}", parent.path().display()))?;
        let (tmp_name, handle) = parent.create_temp_dir(&name).with_context(|| {
            format!("creating a window directory in {}", parent.path().display())
        })?;
        Ok(Self {
            tmp: parent.path().join(&tmp_name),
            dir: parent.path().join(&name),
            parent,
            tmp_name,
            name,
            handle,
            owner: None,
            settled: false,
        })
    }

    /// Hands the finished window (directory and files) to `owner`.
    pub fn set_owner(&mut self, owner: Option<Owner>) {
        self.owner = owner;
    }

    /// The window directory, held open.
    pub fn handle(&self) -> &HostDir {
        &self.handle
    }

    /// Creates a new file in the window (0640, O_EXCL|O_NOFOLLOW on the
    /// held directory descriptor).
    pub fn create_file(&self, name: &str) -> std::io::Result<fs::File> {
        self.handle.create_file(name)
    }

    /// Writes `name` in the window, completely or not at all.
    pub fn write_file(&self, name: &str, bytes: &[u8]) -> std::io::Result<()> {
        self.handle.write_atomic(name, bytes)
    }

    /// Writes `meta.json` last and renames the directory to its final name
    /// (`PROF_…_incomplete` when `files_missing`: some file of the window
    /// could not be written). If meta.json itself cannot be written, the
    /// directory is renamed `PROF_…_incomplete` (or removed) and the error
    /// returned.
    pub fn finish(mut self, meta: &impl serde::Serialize, files_missing: bool) -> Result<PathBuf> {
        let text = serde_json::to_vec_pretty(meta)?;
        let written = self
            .handle
            .write_atomic("meta.json", &text)
            .with_context(|| format!("writing {}/meta.json", self.tmp.display()));
        if let Err(e) = written {
            let left = self.abandon();
            return Err(match left {
                Some(p) => e.context(format!("window left as {}", p.display())),
                None => e.context("window removed"),
            });
        }
        self.handle.sync();
        if let Some(o) = self.owner {
            self.handle
                .chown_tree(o.uid, o.gid)
                .with_context(|| format!("--chown {}: {}", o.uid, self.tmp.display()))?;
        }
        let base = if files_missing {
            format!("{}_incomplete", self.name)
        } else {
            self.name.clone()
        };
        let dir = self.publish(&base)?;
        self.parent.sync();
        Ok(dir)
    }

    /// Renames the hidden directory to `base` (or `base_1`, … if someone
    /// took the name) without replacing anything.
    fn publish(&mut self, base: &str) -> Result<PathBuf> {
        let mut last = None;
        for i in 0..10 {
            let name = if i == 0 {
                base.to_string()
            } else {
                format!("{base}_{i}")
            };
            match self.parent.rename_noreplace(&self.tmp_name, &name) {
                Ok(()) => {
                    self.settled = true;
                    return Ok(self.parent.path().join(name));
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("renaming {} to {name}", self.tmp.display()));
                }
            }
        }
        Err(anyhow::Error::from(last.expect("tried")))
            .with_context(|| format!("renaming {}: every name is taken", self.tmp.display()))
    }

    /// Gives the window up: renames it to a visible `PROF_…_incomplete`, or
    /// removes it if even that fails. Returns where it is, if anywhere.
    pub fn abandon(&mut self) -> Option<PathBuf> {
        if self.settled {
            return None;
        }
        let base = format!("{}_incomplete", self.name);
        match self.publish(&base) {
            Ok(p) => Some(p),
            Err(e) => {
                log::warn!("{e:#}; removing {}", self.tmp.display());
                let _ = self.parent.remove_tree(&self.tmp_name);
                self.settled = true;
                None
            }
        }
    }
}

impl Drop for ProfDir {
    fn drop(&mut self) {
        if !self.settled
            && let Some(p) = self.abandon()
        {
            log::warn!("window left unfinished: {}", p.display());
        }
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

    fn root(tag: &str) -> crate::sys::hostfs::OutputRoot {
        let out = crate::output::tests_support::tempdir(tag);
        crate::sys::hostfs::OutputRoot::open(&out).unwrap()
    }

    #[test]
    fn tmp_then_final() {
        let r = root("profdir");
        let p = ProfDir::create(r.dir(), HostPid(42), WindowId(3)).unwrap();
        let tmp = p.tmp.clone();
        let tname = tmp.file_name().unwrap().to_str().unwrap().to_string();
        assert!(
            tname.starts_with(".PROF_") && tname.ends_with("_tmp"),
            "{tname}"
        );
        // Unpredictable: a second window of the same name gets another one.
        let q = ProfDir::create(r.dir(), HostPid(42), WindowId(3)).unwrap();
        assert_ne!(q.tmp, tmp);
        drop(q);
        use std::io::Write as _;
        p.create_file("steps.csv").unwrap().write_all(b"x").unwrap();
        assert!(p.create_file("steps.csv").is_err(), "O_EXCL");
        let d = p
            .finish(&serde_json::json!({"complete": true}), false)
            .unwrap();
        let name = d.file_name().unwrap().to_str().unwrap().to_string();
        assert!(
            name.starts_with("PROF_") && name.ends_with("_42_3"),
            "{name}"
        );
        assert!(d.join("meta.json").is_file() && d.join("steps.csv").is_file());
        assert!(!tmp.exists());
        let _ = fs::remove_dir_all(r.path());
    }

    /// A window given up (dropped unfinished, or with files missing) is a
    /// visible `PROF_…_incomplete`; nothing hidden stays behind.
    #[test]
    fn unfinished_windows_are_visible_and_marked() {
        let r = root("profdir-incomplete");
        let p = ProfDir::create(r.dir(), HostPid(42), WindowId(1)).unwrap();
        drop(p);
        let q = ProfDir::create(r.dir(), HostPid(42), WindowId(2)).unwrap();
        let d = q
            .finish(&serde_json::json!({"complete": false}), true)
            .unwrap();
        assert!(
            d.to_str().unwrap().ends_with("_42_2_incomplete"),
            "{}",
            d.display()
        );
        let mut names: Vec<String> = fs::read_dir(r.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(names[0].ends_with("_42_1_incomplete"), "{names:?}");
        assert!(names[1].ends_with("_42_2_incomplete"), "{names:?}");
        let _ = fs::remove_dir_all(r.path());
    }
}
