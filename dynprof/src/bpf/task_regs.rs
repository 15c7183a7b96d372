//! Where a task's user registers are on kernels without `bpf_task_pt_regs`
//! (before 5.15, so openEuler 22.03 and Debian 11): at the top of its
//! kernel stack, where `task_pt_regs()` puts them.
//!
//! `task_struct.stack` comes from the kernel's BTF. The distance from it to
//! the registers is `THREAD_SIZE - sizeof(pt_regs)` less a padding that
//! depends on the architecture and the configuration (KASAN doubles the
//! stack, arm64's 64 KiB pages make it 64 KiB, x86's FRED adds 16 bytes),
//! and BTF does not give `THREAD_SIZE` on every kernel. So it is measured,
//! not computed: `sys_enter`'s first argument is exactly that pointer, and
//! one system call of dynprof's own, under a raw tracepoint program in an
//! instance of the object loaded for nothing else, shows it beside the
//! stack base. Once per process.
use std::sync::OnceLock;

use anyhow::{Context as _, Result, anyhow};
use aya::{EbpfLoader, maps::Array, programs::RawTracePoint};

use super::OBJECT;
use crate::compat::{self, TaskStackRegs};

const PROG: &str = "dynprof_task_regs";
/// System calls made (1 ms apart) before giving up on one attach.
const ATTEMPTS: usize = 20;
/// Attaches tried. In the arm64 5.10 guest under QEMU, a freshly attached
/// program did not run at anyone's system call in about half of the
/// processes (while another process made system calls in a tight loop);
/// attaching it again made it run, after 1 to 3 more attaches in 8 runs.
/// The cause is not found (x86-64 guests and this host never showed it).
const ATTACHES: usize = 8;

/// [`measure`]'s answer, once per process.
pub(super) fn task_stack_regs() -> TaskStackRegs {
    static FOUND: OnceLock<TaskStackRegs> = OnceLock::new();
    FOUND
        .get_or_init(|| match measure_again() {
            Ok((stack_offset, regs_delta)) => {
                log::debug!(
                    "user registers at task_struct.stack (byte {stack_offset}) + {regs_delta}"
                );
                TaskStackRegs::Found {
                    stack_offset,
                    regs_delta,
                }
            }
            Err(e) => {
                log::warn!("the user registers of kernel-mode stacks cannot be found: {e:#}");
                TaskStackRegs::Failed(format!("{e:#}"))
            }
        })
        .clone()
}

/// [`measure`], with the program attached afresh up to `ATTACHES` times
/// while it did not run at all.
fn measure_again() -> Result<(u32, u32)> {
    let mut tries = 1;
    loop {
        match measure() {
            Err(e) if tries < ATTACHES && e.downcast_ref::<NeverRan>().is_some() => {
                log::debug!("{e}; attaching again");
                tries += 1;
            }
            other => return other,
        }
    }
}

/// The program did not run at any system call, anyone's.
#[derive(Debug)]
struct NeverRan;

impl std::fmt::Display for NeverRan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the measuring program did not run at {ATTEMPTS} system calls"
        )
    }
}

impl std::error::Error for NeverRan {}

/// (byte offset of `task_struct.stack`, distance to the registers).
fn measure() -> Result<(u32, u32)> {
    let stack_offset = crate::sys::btf::kernel_member_offset("task_struct", "stack")?;
    let tid = rustix::thread::gettid().as_raw_nonzero().get() as u32;
    let mut ebpf = EbpfLoader::new()
        .override_global("TASK_STACK_OFFSET", &stack_offset, true)
        .override_global("CALIBRATE_TID", &tid, true)
        // Only the program and its one-entry map are used: the big maps
        // are made as small as the kernel allows.
        // (64 KiB: a multiple of every page size the ring must be.)
        .map_max_entries("EVENTS", 64 * 1024)
        .map_max_entries("STACKS", 1)
        .load(OBJECT)
        .map_err(|e| anyhow!("loading the measuring program: {e:#}"))?;
    let prog: &mut RawTracePoint = ebpf
        .program_mut(PROG)
        .with_context(|| format!("no program {PROG} in dynprof's object"))?
        .try_into()?;
    prog.load()
        .with_context(|| format!("verifying eBPF program {PROG}"))?;
    let _link = prog
        .attach("sys_enter")
        .context("attaching to the sys_enter raw tracepoint")?;
    let seen: Array<_, [u64; 4]> = Array::try_from(
        ebpf.map("TASK_REGS_SEEN")
            .context("no map TASK_REGS_SEEN in dynprof's object")?,
    )?;
    // The system call measured: any one, made by this thread (the map
    // lookups below are system calls too).
    let mut last = [0; 4];
    for attempt in 0..ATTEMPTS {
        let _ = rustix::process::getppid();
        last = seen.get(&0, 0)?;
        if last[0] != 0 {
            log::debug!("sys_enter measured at attempt {attempt}");
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let [stack, regs, runs, all] = last;
    log::debug!(
        "sys_enter measurement: stack {stack:#x}, regs {regs:#x}, {runs} run(s), {all} in all, tid {tid}"
    );
    if all == 0 {
        return Err(NeverRan.into());
    }
    if runs == 0 {
        anyhow::bail!(
            "the measuring program ran {all} times, never at this thread's {ATTEMPTS} system calls"
        );
    }
    Ok((stack_offset, compat::regs_delta(stack, regs)?))
}
