//! Native unwinding of a user-stack copy from `.eh_frame`, for code built
//! without frame pointers (distribution libpython, libtorch, OpenBLAS).
//!
//! The `cpu` program sends the user registers and the top
//! [`STACK_COPY_MAX`] bytes of the user stack with each user-mode sample
//! (`dynprof-ebpf/src/stack_copy.rs`); user space unwinds it with the
//! `framehop` crate, as samply does with perf's copies. The unwind tables
//! come from the target's mapped files through the hostile-file-safe reader
//! ([`super::elf::ElfImage`]: capped reads, no mmap), loaded lazily: a
//! module is added the first time an unwound address falls in a mapping
//! that has none, and the stack is unwound again. See docs/stacks.md.
use std::{ops::Range, sync::Arc};

use framehop::{
    Module, Unwinder as _,
    x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64},
};

pub use dynprof_common::unwind::{STACK_COPY_MAX, STACK_COPY_MIN};

use super::elf::UnwindSections;

/// Environment variable: the largest stack copy per sample in KiB
/// (default 16, at most 16; 0 turns the copy, and so unwinding without
/// frame pointers, off).
pub const STACK_COPY_ENV: &str = "DYNPROF_STACK_COPY_KB";

/// Frames unwound at most per stack (the kernel's frame-pointer walk
/// stops at 127).
pub const MAX_FRAMES: usize = 256;

/// What the `cpu` program is told to copy, in bytes: 0 where copies are
/// unsupported (only x86-64's registers are read) or turned off. At most a
/// sixteenth of the ring (`ring_bytes`), so that a small ring still holds
/// many samples: a 4 KiB ring gets no copy, a 64 KiB one 4 KiB copies.
pub fn stack_copy_bytes(ring_bytes: u32) -> u32 {
    let want = configured_copy_bytes();
    let fits = ring_bytes / 16;
    let mut size = STACK_COPY_MAX as u32;
    while size > want.min(fits) {
        size /= 2;
    }
    if size < STACK_COPY_MIN as u32 {
        0
    } else {
        size
    }
}

fn configured_copy_bytes() -> u32 {
    if !cfg!(target_arch = "x86_64") {
        return 0;
    }
    let kb = match std::env::var(STACK_COPY_ENV) {
        Ok(v) => match v.trim().parse::<u32>() {
            Ok(kb) => kb,
            Err(_) => {
                log::warn!("{STACK_COPY_ENV}={v:?} is not a number of KiB; using the default");
                (STACK_COPY_MAX / 1024) as u32
            }
        },
        Err(_) => (STACK_COPY_MAX / 1024) as u32,
    };
    (kb.saturating_mul(1024)).min(STACK_COPY_MAX as u32)
}

/// User registers at a sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UserRegs {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
}

pub type UnwindModule = Module<Arc<[u8]>>;

/// The executable mapping of one file at `avma`, whose first byte is at
/// file offset `file_offset`, as a framehop module; `None` when the
/// segments do not place that offset.
pub fn module(
    name: &str,
    avma: Range<u64>,
    file_offset: u64,
    s: &UnwindSections,
) -> Option<UnwindModule> {
    let svma_at_start = s.offset_to_vaddr(file_offset)?;
    // avma = svma + bias; framehop wants the address `base_svma` (0 here)
    // is mapped at, and looks addresses up relative to it in 32 bits.
    let bias = avma.start.checked_sub(svma_at_start)?;
    let arc = |v: &Vec<u8>| -> Arc<[u8]> { Arc::from(v.as_slice()) };
    let info = framehop::ExplicitModuleSectionInfo {
        base_svma: 0,
        text_svma: s.text.clone(),
        eh_frame_svma: Some(s.eh_frame.0.clone()),
        eh_frame: Some(arc(&s.eh_frame.1)),
        eh_frame_hdr_svma: s.eh_frame_hdr.as_ref().map(|h| h.0.clone()),
        eh_frame_hdr: s.eh_frame_hdr.as_ref().map(|h| arc(&h.1)),
        ..Default::default()
    };
    Some(Module::new(name.to_string(), avma, bias, info))
}

/// What the caller knows about the mapping at an address.
pub enum Lookup {
    /// No executable file mapping there: the address is not code dynprof
    /// can find tables for (JIT code, or a bad return address).
    Nothing,
    /// The mapping's range, and its module when its tables could be read.
    Mapping(Range<u64>, Option<UnwindModule>),
}

/// One target's unwinder: the modules loaded so far and framehop's cache.
#[derive(Default)]
pub struct NativeUnwinder {
    unwinder: UnwinderX86_64<Arc<[u8]>>,
    cache: CacheX86_64,
    /// Mapping ranges already looked up (with or without a module).
    seen: Vec<Range<u64>>,
}

impl NativeUnwinder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Unwinds a stack copy (`stack` holds the bytes from `regs.sp` up)
    /// into addresses, leaf first: the sampled ip, then return addresses.
    /// `lookup` is asked once per mapping, the first time an address of
    /// the stack falls into it.
    pub fn unwind(
        &mut self,
        regs: UserRegs,
        stack: &[u8],
        mut lookup: impl FnMut(u64) -> Lookup,
    ) -> Vec<u64> {
        // Each round loads the module of the first address with none and
        // unwinds again: the frames after it were guessed (framehop falls
        // back to frame pointers where it has no tables).
        loop {
            let frames = self.unwind_once(regs, stack);
            let unseen = frames
                .iter()
                .copied()
                .find(|a| !self.seen.iter().any(|r| r.contains(a)));
            let Some(addr) = unseen else { return frames };
            match lookup(addr) {
                Lookup::Nothing => {
                    // Keep what was unwound up to the unknown address.
                    let n = frames.iter().position(|a| *a == addr).unwrap_or(0);
                    return frames[..=n].to_vec();
                }
                Lookup::Mapping(range, m) => {
                    if !range.contains(&addr) {
                        // A lookup that does not cover the address would
                        // loop forever.
                        return frames;
                    }
                    self.seen.push(range);
                    if let Some(m) = m {
                        self.unwinder.add_module(m);
                    }
                }
            }
        }
    }

    fn unwind_once(&mut self, regs: UserRegs, stack: &[u8]) -> Vec<u64> {
        let sp = regs.sp;
        let mut read = |addr: u64| -> Result<u64, ()> {
            let off = addr.checked_sub(sp).ok_or(())? as usize;
            let word = stack.get(off..off.checked_add(8).ok_or(())?).ok_or(())?;
            Ok(u64::from_le_bytes(word.try_into().map_err(|_| ())?))
        };
        let mut it = self.unwinder.iter_frames(
            regs.ip,
            UnwindRegsX86_64::new(regs.ip, regs.sp, regs.bp),
            &mut self.cache,
            &mut read,
        );
        let mut out = Vec::new();
        while out.len() < MAX_FRAMES {
            match it.next() {
                Ok(Some(f)) => out.push(f.address()),
                Ok(None) | Err(_) => break,
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_size_fits_the_ring() {
        // The user's setting would change the expectations.
        if std::env::var_os(STACK_COPY_ENV).is_some() {
            return;
        }
        let (max, min) = (STACK_COPY_MAX as u32, STACK_COPY_MIN as u32);
        if !cfg!(target_arch = "x86_64") {
            assert_eq!(stack_copy_bytes(4 << 20), 0);
            return;
        }
        assert_eq!(stack_copy_bytes(4 << 20), max);
        assert_eq!(stack_copy_bytes(64 << 10), 4096);
        assert_eq!(stack_copy_bytes(16 << 10), min);
        assert_eq!(stack_copy_bytes(4 << 10), 0);
    }
}
