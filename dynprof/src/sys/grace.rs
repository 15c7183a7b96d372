//! Waiting until every eBPF program that was running has ended, so that
//! what they wrote can be read and reset without one of them writing it
//! at the same moment.
//!
//! A uprobe's program runs in an RCU read-side critical section (5.10:
//! with preemption off, `__uprobe_perf_func`; 6.x: `rcu_read_lock`,
//! `bpf_prog_run_array_uprobe`), and `membarrier(MEMBARRIER_CMD_GLOBAL)`
//! is `synchronize_rcu()` (kernel/sched/membarrier.c): when it returns,
//! every program that began before the call has ended, and its stores are
//! visible to the caller. It takes a grace period: 7–25 ms on this
//! project's 2-CPU VM.
use rustix::thread::{MembarrierCommand, membarrier, membarrier_query};

/// Whether [`wait_for_programs`] can be relied on. The kernel refuses the
/// command under `nohz_full`, and skips the grace period when only one CPU
/// is online (a program preempted there, on a fully preemptible kernel,
/// would not be waited for); with one CPU usable by dynprof it is not
/// used either, which also covers that case.
pub fn supported() -> bool {
    membarrier_query().contains_command(MembarrierCommand::Global)
        && std::thread::available_parallelism().is_ok_and(|n| n.get() > 1)
}

/// Waits for an RCU grace period (see the module's comment).
pub fn wait_for_programs() -> std::io::Result<()> {
    membarrier(MembarrierCommand::Global).map_err(std::io::Error::from)
}
