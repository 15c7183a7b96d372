//! The api collector: entry and return uprobes on runtime APIs, one event
//! per call with its exact duration (cookie or, before 5.15, address).
use super::*;

/// Entry of a traced runtime API; the cookie is the API index.
#[uprobe]
pub fn dynprof_api_enter(ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    if !gate_open() {
        return 0;
    }
    let api = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
    if api >= MAX_APIS {
        return 0;
    }
    let ts = unsafe { bpf_ktime_get_ns() };
    if API_START.insert(ApiKey { tid, api }, ts, 0).is_err() {
        count_drop(drop_slot::API_NESTING);
    }
    0
}

/// Return of a traced runtime API: one event with the exact duration.
#[uretprobe]
pub fn dynprof_api_exit(ctx: RetProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let api = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
    let key = ApiKey { tid, api };
    // Only calls that began inside the window have a start record.
    let Some(start) = (unsafe { API_START.get(&key) }).copied() else {
        return 0;
    };
    let _ = API_START.remove(&key);
    let now = unsafe { bpf_ktime_get_ns() };
    let ret: i64 = ctx.ret();
    emit(
        ApiEvent {
            hdr: EventHeader {
                kind: kind::API,
                tid,
                ts_ns: start,
            },
            api,
            _pad: 0,
            dur_ns: now.saturating_sub(start),
            ret,
        },
        drop_slot::API,
        batched(),
    );
    0
}

/// [`dynprof_api_enter`] for kernels without attach cookies: the API is
/// found by the probed address, and every call is pushed on the thread's
/// [`ApiStack`] (in the window or not) so that [`dynprof_api_exit_stack`]
/// pairs each return with its entry.
#[uprobe]
pub fn dynprof_api_enter_ip(ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let Some(ip) = read_reg(ctx.regs, reg::IP) else {
        return 0;
    };
    let Some(api) = (unsafe { API_BY_IP.get(&ip) }).copied() else {
        count_drop(drop_slot::UNKNOWN_ADDR);
        return 0;
    };
    let in_window = gate_open();
    let ts = unsafe { bpf_ktime_get_ns() };
    let st = match API_STACK.get_ptr_mut(&tid) {
        Some(p) => p,
        None => {
            let Some(zero) = ZERO_STACK.get(0) else {
                return 0;
            };
            if API_STACK.insert(&tid, zero, 0).is_err() {
                count_drop(drop_slot::API_NESTING);
                return 0;
            }
            match API_STACK.get_ptr_mut(&tid) {
                Some(p) => p,
                None => return 0,
            }
        }
    };
    let depth = unsafe { (*st).depth };
    // Deeper calls than the stack holds are counted, not stored, so that
    // the returns still pop the right frames.
    if (depth as usize) < API_STACK_DEPTH {
        // SAFETY: depth < API_STACK_DEPTH, the length of `frames`.
        let f = unsafe { (*st).frames.as_mut_ptr().add(depth as usize) };
        unsafe {
            (*f).api = api;
            (*f).in_window = in_window as u32;
            (*f).ts_ns = ts;
        }
    } else if in_window {
        count_drop(drop_slot::API_NESTING);
    }
    unsafe { (*st).depth = depth + 1 };
    0
}

/// [`dynprof_api_exit`] for kernels without attach cookies: pops the
/// thread's top [`ApiStack`] frame, and emits it if it began in a window.
#[uretprobe]
pub fn dynprof_api_exit_stack(ctx: RetProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let Some(st) = API_STACK.get_ptr_mut(&tid) else {
        return 0;
    };
    let depth = unsafe { (*st).depth };
    if depth == 0 {
        return 0;
    }
    let top = depth - 1;
    unsafe { (*st).depth = top };
    if (top as usize) >= API_STACK_DEPTH {
        return 0;
    }
    // SAFETY: top < API_STACK_DEPTH, the length of `frames`.
    let f = unsafe { *(*st).frames.as_ptr().add(top as usize) };
    if f.in_window == 0 {
        return 0;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    let ret: i64 = ctx.ret();
    emit(
        ApiEvent {
            hdr: EventHeader {
                kind: kind::API,
                tid,
                ts_ns: f.ts_ns,
            },
            api: f.api,
            _pad: 0,
            dur_ns: now.saturating_sub(f.ts_ns),
            ret,
        },
        drop_slot::API,
        batched(),
    );
    0
}
