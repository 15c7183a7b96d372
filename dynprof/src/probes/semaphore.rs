//! Who holds a USDT semaphore up while dynprof is attached, and the ledger
//! that lets a later dynprof undo what a killed one left raised.
//!
//! With `ref_ctr_offset` (Linux 4.20+) the kernel owns the count: nothing
//! to record, nothing can leak. On older kernels dynprof raises the
//! semaphore itself through /proc/PID/mem, as bcc does; a SIGKILL then
//! leaves it raised. So before each such raise dynprof writes down what it
//! is about to do in `<lock dir>/<target>.usdt.json`: its own PID and start
//! time, the target's, and per semaphore address how many raises are in
//! flight (`pending`) or done (`raised`). A later dynprof holding the
//! target's lock reads it and, if the writer is dead and the target is the
//! same process (PID and start time), lowers each `raised` count. A
//! `pending` entry (killed between writing the ledger and the write to the
//! target) is uncertain and left alone: lowering it could take away a count
//! that belongs to another tool.
use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, anyhow};
use serde::{Deserialize, Serialize};

use crate::{sys::uprobe, types::HostPid};

/// Who raised a marker's semaphore.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SemaphoreOwner {
    /// The kernel (uprobe `ref_ctr_offset`): released however dynprof ends.
    Kernel,
    /// dynprof, through /proc/PID/mem: released on a clean detach, or by
    /// the next dynprof's repair after a kill.
    ProcMem,
}

/// What one repair did to one semaphore.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Repaired {
    pub addr: u64,
    pub lowered_by: u32,
    /// The value after lowering.
    pub now: u16,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Counts {
    pending: u32,
    raised: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct LedgerFile {
    dynprof_pid: u32,
    dynprof_start: u64,
    target_pid: u32,
    target_start: u64,
    /// Keyed by the semaphore's runtime address (hex, as JSON keys are strings).
    semaphores: BTreeMap<String, Counts>,
}

/// This dynprof's ledger for one target (fallback path only).
#[derive(Debug)]
pub struct Ledger {
    path: PathBuf,
    file: LedgerFile,
}

fn ledger_path(dir: &Path, target: HostPid) -> PathBuf {
    dir.join(format!("{target}.usdt.json"))
}

fn key(addr: u64) -> String {
    format!("{addr:#x}")
}

impl Ledger {
    /// An empty ledger for `target`, written on the first raise.
    pub fn new(dir: &Path, target: HostPid) -> Result<Self> {
        let me = std::process::id();
        Ok(Self {
            path: ledger_path(dir, target),
            file: LedgerFile {
                dynprof_pid: me,
                dynprof_start: uprobe::start_time(me)
                    .ok_or_else(|| anyhow!("reading dynprof's own start time"))?,
                target_pid: target.0,
                target_start: uprobe::start_time(target.0)
                    .ok_or_else(|| anyhow!("target PID {target} is gone"))?,
                semaphores: BTreeMap::new(),
            },
        })
    }

    fn save(&self) -> Result<()> {
        if self
            .file
            .semaphores
            .values()
            .all(|c| c.pending == 0 && c.raised == 0)
        {
            return match fs::remove_file(&self.path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(e).with_context(|| format!("removing {}", self.path.display()))
                }
                _ => Ok(()),
            };
        }
        if let Some(dir) = self.path.parent() {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let tmp = self
            .path
            .with_extension(format!("json.{}", std::process::id()));
        let text = serde_json::to_vec(&self.file)?;
        fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
        fs::rename(&tmp, &self.path).with_context(|| format!("renaming to {}", self.path.display()))
    }

    fn counts(&mut self, addr: u64) -> &mut Counts {
        self.file.semaphores.entry(key(addr)).or_default()
    }

    /// Records a raise about to happen; call before writing the target.
    pub fn begin_raise(&mut self, addr: u64) -> Result<()> {
        self.counts(addr).pending += 1;
        self.save()
    }

    /// Turns the pending raise into a done one (`ok`) or drops it.
    pub fn end_raise(&mut self, addr: u64, ok: bool) -> Result<()> {
        let c = self.counts(addr);
        c.pending = c.pending.saturating_sub(1);
        if ok {
            c.raised += 1;
        }
        self.save()
    }

    /// Records a lowering done on detach.
    pub fn lowered(&mut self, addr: u64) -> Result<()> {
        let c = self.counts(addr);
        c.raised = c.raised.saturating_sub(1);
        self.save()
    }
}

/// Undoes what a killed dynprof left raised on `target`, when that is safe
/// to tell: the ledger's writer is dead and the target is the process it
/// wrote about. Call with the target's lock held. A ledger about another
/// process that had this PID is stale and removed.
pub fn repair(dir: &Path, target: HostPid) -> Result<Vec<Repaired>> {
    let path = ledger_path(dir, target);
    let text = match fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let Ok(file) = serde_json::from_slice::<LedgerFile>(&text) else {
        log::warn!("{}: unreadable USDT ledger, removed", path.display());
        let _ = fs::remove_file(&path);
        return Ok(Vec::new());
    };
    if uprobe::is_running(file.dynprof_pid, file.dynprof_start) {
        // Its writer still runs (it should not without the lock): not ours.
        return Ok(Vec::new());
    }
    let mut done = Vec::new();
    if file.target_pid == target.0 && uprobe::start_time(target.0) == Some(file.target_start) {
        for (k, c) in &file.semaphores {
            let Some(addr) = k
                .strip_prefix("0x")
                .and_then(|h| u64::from_str_radix(h, 16).ok())
            else {
                continue;
            };
            if c.raised == 0 {
                continue;
            }
            let delta = -(c.raised.min(u16::MAX as u32) as i32);
            let now = uprobe::adjust_semaphore_in_memory(target, addr, delta)
                .with_context(|| format!("lowering USDT semaphore {addr:#x} in PID {target}"))?;
            done.push(Repaired {
                addr,
                lowered_by: c.raised,
                now,
            });
        }
    }
    fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("dynprof-ledger-{}-{tag}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn ledger_file_exists_only_while_something_is_raised() {
        let d = dir("life");
        let me = HostPid(std::process::id());
        let mut l = Ledger::new(&d, me).unwrap();
        let p = ledger_path(&d, me);
        l.begin_raise(0x1000).unwrap();
        let f: LedgerFile = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
        assert_eq!(
            f.semaphores["0x1000"],
            Counts {
                pending: 1,
                raised: 0
            }
        );
        l.end_raise(0x1000, true).unwrap();
        let f: LedgerFile = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
        assert_eq!(
            f.semaphores["0x1000"],
            Counts {
                pending: 0,
                raised: 1
            }
        );
        l.lowered(0x1000).unwrap();
        assert!(!p.exists(), "nothing raised: no ledger");
        // A live writer's ledger is never touched by repair.
        l.begin_raise(0x2000).unwrap();
        l.end_raise(0x2000, true).unwrap();
        assert_eq!(repair(&d, me).unwrap(), vec![]);
        assert!(p.exists());
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn stale_or_garbled_ledgers_are_removed_without_touching_memory() {
        let d = dir("stale");
        let me = HostPid(std::process::id());
        let p = ledger_path(&d, me);
        fs::write(&p, b"{not json").unwrap();
        assert_eq!(repair(&d, me).unwrap(), vec![]);
        assert!(!p.exists());
        // Written by a dead dynprof about an earlier process with this PID:
        // nothing is lowered (the address would be meaningless), file goes.
        let f = LedgerFile {
            dynprof_pid: u32::MAX - 1,
            dynprof_start: 1,
            target_pid: me.0,
            target_start: uprobe::start_time(me.0).unwrap() + 1,
            semaphores: BTreeMap::from([(
                key(0x10),
                Counts {
                    pending: 0,
                    raised: 3,
                },
            )]),
        };
        fs::write(&p, serde_json::to_vec(&f).unwrap()).unwrap();
        assert_eq!(repair(&d, me).unwrap(), vec![]);
        assert!(!p.exists());
        let _ = fs::remove_dir_all(&d);
    }
}
