//! Step and aux markers: count the hit, evaluate the plan, flip the gate,
//! emit the boundary; and the empty probes the bench compares them with.
use super::*;

/// Does the marker's string argument start with its prefix?
#[inline(always)]
fn prefix_matches(regs: *const pt_regs, cfg: &MarkerConfig) -> bool {
    let Some(mut value) = read_reg(regs, cfg.arg_reg) else {
        return false;
    };
    if cfg.arg_in_memory != 0 {
        let addr = (value as i64).wrapping_add(cfg.arg_offset) as *const u64;
        value = match unsafe { bpf_probe_read_user(addr) } {
            Ok(v) => v,
            Err(_) => return false,
        };
    }
    if cfg.arg_mode == arg_mode::STD_STRING {
        // libstdc++: the first word of a std::string is `_M_p`, the data.
        value = match unsafe { bpf_probe_read_user(value as *const u64) } {
            Ok(v) => v,
            Err(_) => return false,
        };
    }
    // Zeroed, so bytes past the string's NUL compare as 0: a prefix that
    // ends in NUL (user space's `eq=`) then tests whole-string equality.
    // Left uninitialised on purpose: zeroing it compiles to a memset call,
    // which BPF cannot make. The helper NUL-terminates what it reads, so a
    // shorter string mismatches at its NUL before any stale byte is compared,
    // and a prefix that ends in NUL (user space's `eq=`) tests equality.
    let mut buf = core::mem::MaybeUninit::<[u8; PREFIX_LEN]>::uninit();
    let got = unsafe {
        generated::bpf_probe_read_user_str(
            buf.as_mut_ptr().cast(),
            PREFIX_LEN as u32,
            value as *const _,
        )
    };
    if got < 0 {
        return false;
    }
    let buf = buf.as_ptr() as *const u8;
    let n = cfg.prefix_len as usize;
    let mut i = 0;
    while i < PREFIX_LEN {
        if i >= n {
            break;
        }
        // SAFETY: i < PREFIX_LEN, the length of both arrays.
        if unsafe { *buf.add(i) != *cfg.prefix.as_ptr().add(i) } {
            return false;
        }
        i += 1;
    }
    true
}

/// Attached at every step and aux marker; the cookie is the marker index.
#[uprobe]
pub fn dynprof_marker(ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let marker = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
    marker_hit(ctx.regs, tid, marker)
}

/// [`dynprof_marker`] for kernels without attach cookies: the marker is
/// found by the probed address.
#[uprobe]
pub fn dynprof_marker_ip(ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let Some(ip) = read_reg(ctx.regs, reg::IP) else {
        return 0;
    };
    let Some(marker) = (unsafe { MARKER_BY_IP.get(&ip) }).copied() else {
        count_drop(drop_slot::UNKNOWN_ADDR);
        return 0;
    };
    marker_hit(ctx.regs, tid, marker)
}

#[inline(always)]
fn marker_hit(regs: *const pt_regs, tid: u32, marker: u32) -> u32 {
    let Some(cfg) = MARKERS.get(marker) else {
        return 0;
    };
    if cfg.arg_mode != arg_mode::NONE && !prefix_matches(regs, cfg) {
        return 0;
    }
    let ts_ns = unsafe { bpf_ktime_get_ns() };
    if let Some(h) = HITS.get_ptr_mut(marker) {
        unsafe { *h += 1 };
    }
    let Some(state) = STATE.get_ptr_mut(0) else {
        return 0;
    };
    let (step, gate, wake) = if cfg.role == role::STEP {
        // Several threads may hit step markers; the count must not lose one
        // (`KernelState`). The main thread is the only writer of
        // `main_hits`, so a plain add is exact there and saves the locked
        // instruction; the others add atomically. aya-build links for BPF
        // cpu v1, whose XADD cannot return the old value: add, then read
        // back. Two threads hitting at the same instant may read the same
        // index.
        let k = unsafe {
            let main = &raw mut (*state).main_hits;
            let other = &raw mut (*state).other_hits;
            if tid == core::ptr::read_volatile(&TARGET_TGID) {
                let n = core::ptr::read_volatile(main).wrapping_add(1);
                core::ptr::write_volatile(main, n);
                n.wrapping_add(core::ptr::read_volatile(other))
            } else {
                atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(other, 1);
                step_count(state)
            }
        };
        let (open, wake) = match PLAN.get(0) {
            Some(p) => p.at(k),
            None => (false, false),
        };
        let was_open = unsafe { (*state).gate != 0 };
        unsafe { (*state).gate = open as u64 };
        let wake = wake || open != was_open;
        // A step user space need not act on, outside any window: one word
        // in the step log instead of a ring-buffer record, unless the
        // reader has fallen behind (then the ring buffer holds it, and the
        // slot, which may still be unread, is left alone).
        if !wake && !open && log_has_room(k) {
            if let Some(slot) = STEP_LOG.get_ptr_mut(steplog::slot_index(k)) {
                unsafe { core::ptr::write_volatile(slot, steplog::pack(k, marker, ts_ns)) };
                if let Some(t) = STEP_LOG.get_ptr_mut(steplog::LAST_TID) {
                    unsafe { core::ptr::write_volatile(t, tid as u64) };
                }
                return 0;
            }
        }
        (k, open, wake)
    } else {
        (step_count(state), unsafe { (*state).gate != 0 }, false)
    };
    let flags = if wake {
        ringbuf::FORCE_WAKEUP
    } else {
        batched()
    };
    emit(
        StepEvent {
            hdr: EventHeader {
                kind: kind::STEP,
                tid,
                ts_ns,
            },
            marker,
            role: cfg.role,
            step,
            gate: gate as u32,
            woke: (flags == ringbuf::FORCE_WAKEUP) as u32,
        },
        drop_slot::STEP,
        flags,
    );
    0
}

/// The step index now: both counters, read volatile since other CPUs write
/// them (`KernelState::step_hits` on the user-space side).
#[inline(always)]
fn step_count(state: *const KernelState) -> u64 {
    // SAFETY: `state` is the STATE map's value, valid for this program run.
    unsafe {
        core::ptr::read_volatile(&raw const (*state).main_hits)
            .wrapping_add(core::ptr::read_volatile(&raw const (*state).other_hits))
    }
}

/// Fewer than `steplog::MAX_UNREAD` steps before `k` are unread.
#[inline(always)]
fn log_has_room(k: u64) -> bool {
    match STEP_LOG.get(steplog::CURSOR) {
        Some(c) => k.wrapping_sub(unsafe { core::ptr::read_volatile(c) }) < steplog::MAX_UNREAD,
        None => false,
    }
}

/// An empty uprobe, the baseline that `cargo xtask bench` compares the
/// marker program against.
#[uprobe]
pub fn dynprof_empty(_ctx: ProbeContext) -> u32 {
    0
}

/// An empty return probe: with [`dynprof_empty`] at the same function, the
/// kernel's floor under the api collector's entry + return probes.
#[uretprobe]
pub fn dynprof_empty_ret(_ctx: RetProbeContext) -> u32 {
    0
}
