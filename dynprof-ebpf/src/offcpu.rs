//! The offcpu collector: a target thread's time off the CPU, from
//! sched_switch, with its stacks at switch-out.
use super::*;

// Offsets in the sched/sched_switch tracepoint record (stable ABI, see
// /sys/kernel/tracing/events/sched/sched_switch/format).
const PREV_PID: usize = 24;
const PREV_STATE: usize = 32;
const NEXT_PID: usize = 56;
/// The task-state bits of `prev_state` (`TASK_REPORT`, and the idle bit
/// above it): none set is the `R` (runnable) the tracepoint prints, and
/// preemption adds `TASK_REPORT_MAX` (`R+`) above them.
const STATE_BITS: i64 = 0xff;

/// Off-CPU time: remember when a target thread leaves the CPU (with its
/// stacks, taken while it is still `current`), emit when it comes back.
#[tracepoint]
pub fn dynprof_sched_switch(ctx: TracePointContext) -> u32 {
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(tid) = target_tid() {
        let prev: i32 = unsafe { ctx.read_at(PREV_PID) }.unwrap_or(-1);
        if prev as u32 == tid && tid != 0 && gate_open() {
            let state: i64 = unsafe { ctx.read_at(PREV_STATE) }.unwrap_or(-1);
            let user_stack = stack_id(&ctx, BPF_F_USER_STACK as u64, drop_slot::OFFCPU_STACK);
            let kernel_stack = stack_id(&ctx, 0, drop_slot::OFFCPU_STACK);
            // The stacks first: whether this switch-out repeats the last
            // copied place goes into its record.
            let copy = stack_copy::emit_offcpu_stack(tid, now, user_stack, kernel_stack, batched());
            let rec = OffCpuStart {
                ts_ns: now,
                user_stack,
                kernel_stack,
                repeat: u32::from(matches!(copy, stack_copy::OffCpuCopy::Repeat)),
                runnable: u32::from(state & STATE_BITS == 0),
            };
            if OFFCPU_START.insert(tid, rec, 0).is_err() {
                count_drop(drop_slot::OFFCPU);
            }
        }
    }
    let next: i32 = unsafe { ctx.read_at(NEXT_PID) }.unwrap_or(0);
    if next <= 0 {
        return 0;
    }
    let next = next as u32;
    if let Some(start) = unsafe { OFFCPU_START.get(&next) }.copied() {
        let _ = OFFCPU_START.remove(&next);
        emit(
            OffCpuEvent {
                hdr: EventHeader {
                    kind: if start.repeat != 0 {
                        kind::OFFCPU_REPEAT
                    } else {
                        kind::OFFCPU
                    },
                    tid: next,
                    ts_ns: start.ts_ns,
                },
                dur_ns: now.saturating_sub(start.ts_ns),
                user_stack: start.user_stack,
                kernel_stack: start.kernel_stack,
                runnable: start.runnable,
                _pad: 0,
            },
            drop_slot::OFFCPU,
            batched(),
        );
    }
    0
}
