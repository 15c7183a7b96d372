//! Publishes finished windows off the event loop.
//!
//! Writing a window (trace.json, flame graphs, tables, each fsynced, then
//! meta.json and the rename that makes the `PROF_*` directory visible) takes
//! from a few to hundreds of milliseconds. The scheduler hands the drained
//! [`WindowData`] to this thread at the closing boundary, so that the next
//! boundaries (a repeat's next window, a msprof `start`) are not handled late.
//! Jobs are written in order; the scheduler collects the results on its tick
//! and waits for all of them before the session ends.
use std::{
    path::PathBuf,
    sync::mpsc::{self, Receiver, Sender},
    thread::JoinHandle,
};

use anyhow::{Context as _, Result};

use super::{WindowRecord, meta::WindowMeta, profdir::ProfDir};
use crate::{
    output::{Collectors, model::WindowData, write_window_files},
    types::{StepIndex, WindowId},
};

/// The session ended with window(s) asked for but not written (disk
/// full, unwritable output): `dynprof` exits with [`WindowsNotWritten::EXIT_CODE`].
#[derive(Debug)]
pub struct WindowsNotWritten(pub usize);

impl WindowsNotWritten {
    /// See docs/exit-codes.md.
    pub const EXIT_CODE: i32 = 3;
}

impl std::fmt::Display for WindowsNotWritten {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} requested window(s) could not be written (see the messages above)",
            self.0
        )
    }
}

impl std::error::Error for WindowsNotWritten {}

/// One window to publish.
pub struct WriteJob {
    pub id: WindowId,
    pub prof: ProfDir,
    pub data: WindowData,
    pub ran: Collectors,
    /// meta.json as of the closing boundary; the writer adds its own errors.
    pub meta: WindowMeta,
    pub complete: bool,
    pub reason: Option<String>,
    pub first: Option<StepIndex>,
    pub last: Option<StepIndex>,
    /// Returned untouched with the result (who asked for the window).
    pub tag: WriteTag,
}

/// What the scheduler needs back to report a written window.
#[derive(Clone, Debug)]
pub struct WriteTag {
    pub from_config_file: bool,
    pub change: Option<u64>,
}

/// A published window, or why it could not be published.
pub struct Written {
    pub id: WindowId,
    pub tag: WriteTag,
    pub result: Result<WindowRecord>,
}

pub struct Writer {
    tx: Option<Sender<WriteJob>>,
    rx: Receiver<Written>,
    handle: Option<JoinHandle<()>>,
    pending: usize,
    /// Written on the caller's thread because the writer had died.
    late: Vec<Written>,
}

impl Writer {
    pub fn spawn() -> Result<Self> {
        let (tx, jobs) = mpsc::channel::<WriteJob>();
        let (done, rx) = mpsc::channel::<Written>();
        let handle = std::thread::Builder::new()
            .name("dynprof-writer".into())
            .spawn(move || {
                // Writing can wait; the event loop handling the next
                // boundaries cannot. On a busy machine the two compete for
                // the same CPU, so the writer yields to it (nice +10 and the
                // default time slice, for this thread only).
                if let Err(e) = crate::sys::sched::background() {
                    log::debug!("writer: could not lower its priority: {e}");
                }
                for job in jobs {
                    let (id, tag) = (job.id, job.tag.clone());
                    let result = publish(job);
                    if done.send(Written { id, tag, result }).is_err() {
                        break;
                    }
                }
            })
            .context("starting the window writer thread")?;
        Ok(Self {
            tx: Some(tx),
            rx,
            handle: Some(handle),
            pending: 0,
            late: Vec::new(),
        })
    }

    pub fn submit(&mut self, job: WriteJob) {
        let (id, tag) = (job.id, job.tag.clone());
        let tx = self
            .tx
            .as_ref()
            .expect("the writer's channel lives until drop");
        match tx.send(job) {
            Ok(()) => self.pending += 1,
            // The thread is gone (it panicked): write here rather than lose it.
            Err(mpsc::SendError(job)) => {
                let result = publish(job);
                self.late.push(Written { id, tag, result });
            }
        }
    }

    /// Windows written since the last call, without waiting.
    pub fn finished(&mut self) -> Vec<Written> {
        let mut out = std::mem::take(&mut self.late);
        while let Ok(w) = self.rx.try_recv() {
            self.pending -= 1;
            out.push(w);
        }
        out
    }

    /// Waits until every submitted window is written.
    pub fn wait_all(&mut self) -> Vec<Written> {
        let mut out = self.finished();
        while self.pending > 0 {
            match self.rx.recv() {
                Ok(w) => {
                    self.pending -= 1;
                    out.push(w);
                }
                Err(_) => {
                    log::error!(
                        "the window writer thread died with {} window(s) unwritten",
                        self.pending
                    );
                    self.pending = 0;
                }
            }
        }
        out
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Writes the files, then meta.json, then renames: a directory is visible
/// only once it is whole, and says so if a file could not be written.
fn publish(job: WriteJob) -> Result<WindowRecord> {
    let WriteJob {
        id,
        prof,
        data,
        ran,
        mut meta,
        mut complete,
        mut reason,
        first,
        last,
        ..
    } = job;
    let mut files_missing = false;
    if let Err(e) = write_window_files(&prof.tmp, &data, &ran) {
        files_missing = true;
        let m = format!("writing window files: {e:#}");
        meta.errors.push(m.clone());
        if complete {
            complete = false;
            reason = Some(m);
        }
        meta.complete = Some(complete);
        meta.incomplete_reason = reason.clone();
    }
    // dynprof's peak RSS including this window's writing.
    if let Ok(rss) = crate::sys::memory::peak_rss_bytes() {
        meta.memory.peak_rss_bytes = Some(rss);
    }
    let dir: PathBuf = prof
        .finish(&meta, files_missing)
        .context("finishing the window directory")?;
    if files_missing {
        // The directory says so (`PROF_…_incomplete`, complete: false), but
        // a window that was asked for is not on disk: the exit code says so.
        anyhow::bail!(
            "{}: {}",
            dir.display(),
            reason.as_deref().unwrap_or("files could not be written")
        );
    }
    Ok(WindowRecord {
        id,
        dir,
        complete,
        incomplete_reason: reason,
        first_recorded: first,
        last_recorded: last,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::HostPid;

    fn job(out: &crate::sys::hostfs::HostDir, id: u32, tag: Option<u64>) -> WriteJob {
        let prof = ProfDir::create(out, HostPid(7), WindowId(id)).unwrap();
        WriteJob {
            id: WindowId(id),
            prof,
            data: WindowData::default(),
            ran: Collectors::NONE,
            meta: WindowMeta {
                window: Some(WindowId(id)),
                complete: Some(true),
                ..WindowMeta::default()
            },
            complete: true,
            reason: None,
            first: Some(StepIndex(u64::from(id) * 10)),
            last: Some(StepIndex(u64::from(id) * 10 + 2)),
            tag: WriteTag {
                from_config_file: tag.is_some(),
                change: tag,
            },
        }
    }

    /// Windows are published in the order they closed, each renamed from its
    /// hidden directory only once meta.json is in it, and `wait_all` returns
    /// only when all of them are.
    #[test]
    fn publishes_in_order_and_waits_for_all() {
        let root =
            crate::sys::hostfs::OutputRoot::open(&crate::output::tests_support::tempdir("writer"))
                .unwrap();
        let out = root.dir();
        let mut w = Writer::spawn().unwrap();
        let jobs: Vec<WriteJob> = (1..=3)
            .map(|i| job(out, i, (i == 2).then_some(9)))
            .collect();
        let tmps: Vec<PathBuf> = jobs.iter().map(|j| j.prof.tmp.clone()).collect();
        for j in jobs {
            w.submit(j);
        }
        let done = w.wait_all();
        assert_eq!(
            done.iter().map(|d| d.id.0).collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
        assert_eq!(done[1].tag.change, Some(9));
        for (d, tmp) in done.iter().zip(&tmps) {
            let rec = d.result.as_ref().unwrap();
            assert!(rec.complete);
            assert!(!tmp.exists(), "{} left behind", tmp.display());
            let meta: serde_json::Value =
                serde_json::from_slice(&std::fs::read(rec.dir.join("meta.json")).unwrap()).unwrap();
            assert_eq!(meta["window"], d.id.0);
            assert!(rec.dir.join("steps.csv").exists());
        }
        assert!(w.finished().is_empty());
        let _ = std::fs::remove_dir_all(root.path());
    }
}
