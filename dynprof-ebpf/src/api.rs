//! The api collector: entry and return uprobes on runtime APIs, one event
//! per call with its exact duration (cookie or, before 5.15, address).
use super::*;

/// The thread's stack in its `API_SLOTS` slot, if user space gave it one.
#[inline(always)]
fn slot_stack(tid: u32) -> Option<*mut ApiStack> {
    let mask = unsafe { core::ptr::read_volatile(&API_SLOT_MASK) };
    let s = API_SLOTS.get_ptr_mut(tid & mask)?;
    if unsafe { (*s).owner } == tid {
        Some(unsafe { &raw mut (*s).stack })
    } else {
        None
    }
}

/// The thread's stack: its slot, else its `API_STACK` entry.
#[inline(always)]
fn existing_stack(tid: u32) -> Option<*mut ApiStack> {
    slot_stack(tid).or_else(|| API_STACK.get_ptr_mut(&tid))
}

/// The thread's [`ApiStack`]: its slot, else its `API_STACK` entry,
/// created (zeroed) on its first call.
#[inline(always)]
fn thread_stack(tid: u32) -> Option<*mut ApiStack> {
    if let Some(p) = existing_stack(tid) {
        return Some(p);
    }
    let zero = ZERO_STACK.get(0)?;
    if API_STACK.insert(&tid, zero, 0).is_err() {
        count_drop(drop_slot::API_NESTING);
        return None;
    }
    API_STACK.get_ptr_mut(&tid)
}

/// The event of a call that returned `ret`, begun at `start_ns`: what both
/// return programs write once they have found the call's frame.
#[inline(always)]
fn emit_call(tid: u32, api: u32, start_ns: u64, ret: i64) {
    let now = unsafe { bpf_ktime_get_ns() };
    emit(
        ApiEvent {
            hdr: EventHeader {
                kind: kind::API,
                tid,
                ts_ns: start_ns,
            },
            api,
            _pad: 0,
            dur_ns: now.saturating_sub(start_ns),
            ret,
        },
        drop_slot::API,
        batched(),
    );
}

/// Entry of a traced runtime API; the cookie is the API index. A call that
/// begins in the window is pushed on the thread's [`ApiStack`]: in its
/// `API_SLOTS` slot (no helper call) or else one hash lookup, where a hash
/// entry per call cost an insert and a delete (bench section 2).
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
    let Some(st) = thread_stack(tid) else {
        return 0;
    };
    let depth = unsafe { (*st).depth };
    if depth as usize >= API_STACK_DEPTH {
        count_drop(drop_slot::API_NESTING);
        return 0;
    }
    // SAFETY: depth < API_STACK_DEPTH, the length of `frames`.
    let f = unsafe { (*st).frames.as_mut_ptr().add(depth as usize) };
    unsafe {
        (*f).api = api;
        (*f).in_window = 1;
        (*f).ts_ns = ts;
        (*st).depth = depth + 1;
    }
    0
}

/// Return of a traced runtime API: one event with the exact duration.
/// Its frame is the innermost one of this API on the thread's stack,
/// normally the top; frames above it are calls whose return was never
/// seen (a C++ exception or longjmp unwound through them), dropped with
/// it so that the stack does not fill with them.
#[uretprobe]
pub fn dynprof_api_exit(ctx: RetProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let api = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
    // Only calls that began inside the window have a frame.
    let Some(st) = existing_stack(tid) else {
        return 0;
    };
    let depth = unsafe { (*st).depth } as usize;
    // Scanned upwards, keeping the last match: an index that only grows
    // from 0 is what the verifier can bound (walking down from the top,
    // the compiler's pointer arithmetic went below the map value).
    // Only the index is carried out of the loop, and the frame read again
    // after it: a frame carried in registers was not provably set on every
    // path the verifier walks.
    let mut found = API_STACK_DEPTH;
    for i in 0..API_STACK_DEPTH {
        if i >= depth {
            break;
        }
        // SAFETY: i < API_STACK_DEPTH, the length of `frames`.
        if unsafe { (*(*st).frames.as_ptr().add(i)).api } == api {
            found = i;
        }
    }
    if found >= API_STACK_DEPTH {
        return 0;
    }
    // SAFETY: found < API_STACK_DEPTH, the length of `frames`.
    let f = unsafe { *(*st).frames.as_ptr().add(found) };
    unsafe { (*st).depth = found as u32 };
    emit_call(tid, api, f.ts_ns, ctx.ret());
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
    let Some(sp) = read_reg(ctx.regs, reg::SP) else {
        return 0;
    };
    let in_window = gate_open();
    let ts = unsafe { bpf_ktime_get_ns() };
    let Some(st) = thread_stack(tid) else {
        return 0;
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
            (*f).sp = sp;
        }
    } else if in_window {
        count_drop(drop_slot::API_NESTING);
    }
    unsafe { (*st).depth = depth + 1 };
    0
}

/// [`dynprof_api_exit`] for kernels without attach cookies: the returning
/// call is the frame whose entry stack pointer the return left just below
/// the caller's ([`reg::RETURN_POPS`]), normally the top. Frames above it
/// (deeper, lower stack pointers) are calls whose return was never seen (a
/// C++ exception or longjmp unwound through them): popped with it, so that
/// every later return still finds its own frame. Emitted if it began in a
/// window.
#[uretprobe]
pub fn dynprof_api_exit_stack(ctx: RetProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let Some(sp) = read_reg(ctx.regs, reg::SP) else {
        return 0;
    };
    let entry_sp = sp.wrapping_sub(reg::RETURN_POPS);
    let Some(st) = existing_stack(tid) else {
        return 0;
    };
    let depth = unsafe { (*st).depth };
    if depth == 0 {
        return 0;
    }
    let stored = if (depth as usize) < API_STACK_DEPTH {
        depth as usize
    } else {
        API_STACK_DEPTH
    };
    // The innermost stored frame at or above the entry stack pointer (the
    // stack pointers fall from frame 0 up). Scanned upwards, carrying only
    // the index, as in `dynprof_api_exit`.
    let mut at = API_STACK_DEPTH;
    for i in 0..API_STACK_DEPTH {
        if i >= stored {
            break;
        }
        // SAFETY: i < API_STACK_DEPTH, the length of `frames`.
        if unsafe { (*(*st).frames.as_ptr().add(i)).sp } >= entry_sp {
            at = i;
        }
    }
    if at >= API_STACK_DEPTH {
        // Every stored frame is deeper than the returning call: all were
        // left without a return (and so were any deeper uncounted ones).
        unsafe { (*st).depth = 0 };
        return 0;
    }
    // SAFETY: at < API_STACK_DEPTH, the length of `frames`.
    let f = unsafe { *(*st).frames.as_ptr().add(at) };
    if f.sp != entry_sp {
        // Frame `at` is the caller's: the returning call is deeper. One of
        // the calls beyond what is stored, if the stack is that deep (it
        // pops one of them); else one whose entry was never seen, and the
        // frames above `at` were left without a return.
        if at + 1 == stored && depth as usize > stored {
            unsafe { (*st).depth = depth - 1 };
        } else {
            unsafe { (*st).depth = at as u32 + 1 };
        }
        return 0;
    }
    unsafe { (*st).depth = at as u32 };
    if f.in_window == 0 {
        return 0;
    }
    emit_call(tid, f.api, f.ts_ns, ctx.ret());
    0
}
