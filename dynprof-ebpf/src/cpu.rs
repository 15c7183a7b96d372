//! The cpu collector: per-CPU sampling, filtered to the target; stack ids,
//! and the user-stack copy of `stack_copy` for unwinding in user space.
use super::*;

/// Perf-event CPU sampling, system-wide per CPU, filtered to the target.
#[perf_event]
pub fn dynprof_cpu(ctx: PerfEventContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    if tid == 0 || !gate_open() {
        return 0;
    }
    let kernel_stack = stack_id(&ctx, 0, drop_slot::CPU_STACK);
    let mut sample = SampleEvent {
        hdr: EventHeader {
            kind: kind::SAMPLE,
            tid,
            ts_ns: unsafe { bpf_ktime_get_ns() },
        },
        // Walked below only where no stack copy stands in for it.
        user_stack: STACK_EMPTY,
        kernel_stack,
        cpu: unsafe { bpf_get_smp_processor_id() },
        _pad: 0,
    };
    let flags = batched();
    let fp_user = || stack_id(&ctx, BPF_F_USER_STACK as u64, drop_slot::CPU_STACK);
    if !stack_copy::emit_with_stack(&ctx, sample, flags, fp_user) {
        sample.user_stack = fp_user();
        emit(sample, drop_slot::CPU, flags);
    }
    0
}
