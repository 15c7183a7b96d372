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
    // Decided before the copy's own walks (the CPython frame chain), as the
    // 5.10 verifier's budget needs: a stack id taken after them multiplied
    // the states it explores past its 1M instructions.
    let user_stack = if stack_copy::copy_expected(&ctx) {
        STACK_EMPTY
    } else {
        stack_id(&ctx, BPF_F_USER_STACK as u64, drop_slot::CPU_STACK)
    };
    let sample = SampleEvent {
        hdr: EventHeader {
            kind: kind::SAMPLE,
            tid,
            ts_ns: unsafe { bpf_ktime_get_ns() },
        },
        user_stack,
        kernel_stack,
        cpu: unsafe { bpf_get_smp_processor_id() },
        _pad: 0,
    };
    let flags = batched();
    if !stack_copy::emit_with_stack(&ctx, sample, flags) {
        emit(sample, drop_slot::CPU, flags);
    }
    0
}
