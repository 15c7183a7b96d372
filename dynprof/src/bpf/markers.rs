//! Attaching and detaching step and aux markers (uprobes with the marker
//! program), with their USDT semaphores and, without attach cookies, their
//! registered addresses.
use std::os::fd::AsFd as _;

use anyhow::{Context as _, Result, bail};
use aya::maps::{Array, HashMap as BpfHashMap};
use dynprof_common::{MAX_MARKERS, MarkerConfig};

use super::{Kernel, MarkerLink, MarkerSemaphore, SEMAPHORE_ENV};
use crate::{
    compat::ProbeIdentity,
    probes::{
        ResolvedProbe,
        semaphore::{Ledger, SemaphoreOwner},
    },
    sys::uprobe as sys_uprobe,
};

impl Kernel {
    /// Configures and attaches one marker; its index is the attach cookie.
    /// A USDT semaphore is handed to the kernel (`ref_ctr_offset`) where it
    /// can take it, else raised through /proc/PID/mem and recorded.
    pub fn attach_marker(&mut self, p: &ResolvedProbe) -> Result<()> {
        if p.index >= MAX_MARKERS {
            bail!("too many markers (at most {MAX_MARKERS})");
        }
        let mut markers: Array<_, MarkerConfig> =
            Array::try_from(self.ebpf.map_mut("MARKERS").expect("MARKERS"))?;
        markers.set(p.index, p.config, 0)?;
        let what = || {
            format!(
                "attaching uprobe to {} in {} (offset {:#x})",
                p.symbol, p.object, p.file_offset
            )
        };
        let mut owner = None;
        let event = match &p.semaphore {
            Some(s) if self.semaphores.kernel_owned_supported && !self.forced_proc_mem => {
                match sys_uprobe::open_uprobe(
                    &p.attach_path,
                    p.file_offset,
                    Some(s.file_offset),
                    self.pid,
                ) {
                    Ok(fd) => {
                        owner = Some(SemaphoreOwner::Kernel);
                        fd
                    }
                    // The kernel refuses an offset that differs from that of
                    // an existing uprobe on the same site (another tool's,
                    // set without one): hold the semaphore ourselves.
                    Err(e)
                        if e.downcast_ref::<sys_uprobe::OpenError>()
                            .is_some_and(|o| o.errno == libc::EINVAL) =>
                    {
                        self.semaphores.fallback_reason = Some(format!(
                            "the kernel refused ref_ctr_offset {:#x} for {} ({e}); another uprobe on the same site without it?",
                            s.file_offset, p.symbol
                        ));
                        sys_uprobe::open_uprobe(&p.attach_path, p.file_offset, None, self.pid)
                            .with_context(what)?
                    }
                    Err(e) => return Err(e).with_context(what),
                }
            }
            Some(_) => {
                self.semaphores.fallback_reason = Some(if self.forced_proc_mem {
                    format!(
                        "{SEMAPHORE_ENV}=proc_mem: dynprof raises USDT semaphores through /proc/PID/mem"
                    )
                } else {
                    "this kernel's uprobe PMU has no ref_ctr_offset (Linux < 4.20): \
                     dynprof raises USDT semaphores through /proc/PID/mem"
                        .into()
                });
                sys_uprobe::open_uprobe(&p.attach_path, p.file_offset, None, self.pid)
                    .with_context(what)?
            }
            None => sys_uprobe::open_uprobe(&p.attach_path, p.file_offset, None, self.pid)
                .with_context(what)?,
        };
        let [marker_prog, _, _] = self.uprobe_programs();
        let mut addrs = Vec::new();
        if self.paths.probe_identity == ProbeIdentity::Address {
            addrs = self
                .register_addresses(
                    "MARKER_BY_IP",
                    &p.attach_path,
                    &p.object,
                    p.file_offset,
                    p.index,
                    self.marker_addrs,
                )
                .with_context(what)?;
            self.marker_addrs += addrs.len();
        }
        let prog = self.uprobe(marker_prog)?.fd()?.as_fd();
        let attachment =
            sys_uprobe::attach_program(prog, event, p.index as u64).with_context(what)?;
        if self.paths.probe_identity == ProbeIdentity::Cookie && !attachment.cookie_delivered {
            bail!(
                "{}: the kernel took the marker program without its attach cookie although it \
                 reported bpf perf links (Linux 5.15+)",
                what()
            );
        }
        // The fallback raises the semaphore after the probe exists, so the
        // first enabled probe site already fires into our program.
        let mut proc_mem_semaphore = None;
        if let Some(s) = &p.semaphore
            && owner.is_none()
        {
            self.raise_in_memory(s.runtime_addr).with_context(|| {
                format!(
                    "raising the USDT semaphore of {} in PID {}",
                    p.symbol, self.pid
                )
            })?;
            proc_mem_semaphore = Some(s.runtime_addr);
            owner = Some(SemaphoreOwner::ProcMem);
        }
        if let (Some(s), Some(owner)) = (&p.semaphore, owner) {
            // A marker attached again (around each window) is listed once.
            self.semaphores.markers.retain(|m| m.index != p.index);
            self.semaphores.markers.push(MarkerSemaphore {
                index: p.index,
                addr: s.runtime_addr,
                owner,
            });
        }
        self.markers.push(MarkerLink {
            index: p.index,
            _attachment: attachment,
            proc_mem_semaphore,
            addrs,
        });
        Ok(())
    }

    /// The fallback: +1 through /proc/PID/mem, written down in the ledger
    /// first so that a later dynprof can undo it if this one is killed.
    fn raise_in_memory(&mut self, addr: u64) -> Result<()> {
        if self.ledger.is_none() {
            self.ledger = Some(Ledger::new(&crate::sys::lock::lock_dir(), self.pid)?);
        }
        let ledger = self.ledger.as_mut().expect("just set");
        ledger.begin_raise(addr)?;
        let r = sys_uprobe::adjust_semaphore_in_memory(self.pid, addr, 1);
        ledger.end_raise(addr, r.is_ok())?;
        r.map(|_| ())
    }

    /// The bench's baselines (`dynprof __probe-cost`): the empty uprobe at
    /// a marker's site, and with `floor` the empty return probe too. Works
    /// with and without attach cookies (the empty programs read none);
    /// [`Kernel::detach_marker`] removes them like a marker.
    pub fn attach_empty(&mut self, p: &ResolvedProbe, floor: bool) -> Result<()> {
        let what = || format!("attaching the empty uprobe to {}", p.symbol);
        for (name, ret) in [(super::EMPTY_PROG, false), (super::EMPTY_RET_PROG, true)] {
            if ret && !floor {
                continue;
            }
            let prog = self.uprobe(name)?;
            if prog.fd().is_err() {
                prog.load()
                    .with_context(|| format!("verifying eBPF program {name}"))?;
            }
            let event = if ret {
                sys_uprobe::open_uretprobe(&p.attach_path, p.file_offset, self.pid)
            } else {
                sys_uprobe::open_uprobe(&p.attach_path, p.file_offset, None, self.pid)
            }
            .with_context(what)?;
            let fd = self.uprobe(name)?.fd()?.as_fd();
            let attachment = sys_uprobe::attach_program(fd, event, 0).with_context(what)?;
            self.markers.push(MarkerLink {
                index: p.index,
                _attachment: attachment,
                proc_mem_semaphore: None,
                addrs: Vec::new(),
            });
        }
        Ok(())
    }

    /// Whether the marker with this index is attached now.
    pub fn marker_attached(&self, index: u32) -> bool {
        self.markers.iter().any(|m| m.index == index)
    }

    /// Detaches one marker (aux markers between windows); its config and
    /// its HITS count stay, so attaching it again continues the count.
    pub fn detach_marker(&mut self, index: u32) {
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.markers)
            .into_iter()
            .partition(|m| m.index == index);
        self.markers = kept;
        for m in gone {
            self.release_marker(m);
        }
    }

    /// Detaches every marker and lowers the semaphores dynprof raised.
    pub(super) fn detach_markers(&mut self) {
        for m in std::mem::take(&mut self.markers) {
            self.release_marker(m);
        }
    }

    fn release_marker(&mut self, m: MarkerLink) {
        let MarkerLink {
            _attachment,
            proc_mem_semaphore,
            addrs,
            ..
        } = m;
        // Closing the event removes the uprobe (and lowers a
        // kernel-owned semaphore) before we lower our own.
        drop(_attachment);
        if let Some(addr) = proc_mem_semaphore {
            // The target may have exited; nothing to restore then, and
            // nothing for a later repair either.
            let _ = sys_uprobe::adjust_semaphore_in_memory(self.pid, addr, -1);
            if let Some(l) = &mut self.ledger {
                let _ = l.lowered(addr);
            }
        }
        if !addrs.is_empty() {
            self.marker_addrs = self.marker_addrs.saturating_sub(addrs.len());
            if let Some(Ok(mut map)) = self
                .ebpf
                .map_mut("MARKER_BY_IP")
                .map(BpfHashMap::<_, u64, u32>::try_from)
            {
                for a in addrs {
                    let _ = map.remove(&a);
                }
            }
        }
    }
}
