//! Native unwinding of a user-stack copy from `.eh_frame` (or `.debug_frame`), for code built
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

use framehop::{FrameAddress, Module, Unwinder as _};

pub use dynprof_common::unwind::{STACK_COPY_MAX, STACK_COPY_MIN};

use super::elf::{Cfi, UnwindSections};

/// Environment variable: the largest stack copy per sample in KiB
/// (default 16, at most 16; 0 turns the copy, and so unwinding without
/// frame pointers, off).
pub const STACK_COPY_ENV: &str = "DYNPROF_STACK_COPY_KB";

/// Frames unwound at most per stack (the kernel's frame-pointer walk
/// stops at 127).
pub const MAX_FRAMES: usize = 256;

/// What the `cpu` program is told to copy, in bytes: 0 where copies are
/// unsupported (registers are read on x86-64 and arm64 only) or turned off. At most a
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
    if !cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) {
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
    /// The frame pointer (x86-64: rbp; arm64: x29).
    pub bp: u64,
    /// arm64's link register x30: where a leaf function, which keeps its
    /// return address in a register, returns to (0 on x86-64).
    pub lr: u64,
}

/// framehop's unwinder for the architecture dynprof runs on (the target's:
/// dynprof attaches to processes of its own machine).
#[cfg(target_arch = "aarch64")]
mod arch {
    use framehop::aarch64::PtrAuthMask;
    pub(super) use framehop::aarch64::{
        CacheAarch64 as Cache, UnwindRegsAarch64 as Regs, UnwinderAarch64 as Unwinder,
    };

    /// Linux gives user space 48-bit addresses (52 only on request);
    /// pointer authentication, where a library uses it, signs the bits
    /// above, which are cleared from return addresses.
    pub(super) fn regs(u: &super::UserRegs) -> Regs {
        Regs::new_with_ptr_auth_mask(PtrAuthMask(u64::MAX >> 16), u.lr, u.sp, u.bp)
    }
}
#[cfg(not(target_arch = "aarch64"))]
mod arch {
    pub(super) use framehop::x86_64::{
        CacheX86_64 as Cache, UnwindRegsX86_64 as Regs, UnwinderX86_64 as Unwinder,
    };

    pub(super) fn regs(u: &super::UserRegs) -> Regs {
        Regs::new(u.ip, u.sp, u.bp)
    }
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
    let mut info = framehop::ExplicitModuleSectionInfo {
        base_svma: 0,
        text_svma: s.text.clone(),
        ..Default::default()
    };
    match &s.cfi {
        Cfi::EhFrame { eh_frame, hdr } => {
            info.eh_frame_svma = Some(eh_frame.0.clone());
            info.eh_frame = Some(eh_frame.1.clone());
            info.eh_frame_hdr_svma = hdr.as_ref().map(|h| h.0.clone());
            info.eh_frame_hdr = hdr.as_ref().map(|h| h.1.clone());
        }
        Cfi::DebugFrame(d) => info.debug_frame = Some(d.clone()),
    }
    Some(Module::new(name.to_string(), avma, bias, info))
}

/// What the caller knows about the mapping at an address.
pub enum Lookup {
    /// No executable mapping there: not code (a bad return address).
    Nothing,
    /// Executable memory with no file behind it (JIT code such as oneDNN's
    /// kernels, or the vDSO): no tables to unwind it with.
    Anonymous(Range<u64>),
    /// A file mapping's range, and its module when its tables could be read.
    Mapping(Range<u64>, Option<UnwindModule>),
}

/// How far above a JIT frame's stack pointer [`NativeUnwinder`] looks for
/// the return address into the code that called it. oneDNN's kernels save
/// six registers and keep a few hundred bytes of spill slots.
pub const JIT_SCAN_BYTES: u64 = 4096;

/// Frames a scanned return address must unwind through to be taken.
pub const JIT_VALIDATE_FRAMES: usize = 3;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Code in a file: framehop unwinds it (from its tables, or by frame
    /// pointers where the file had none).
    File {
        tables: bool,
    },
    Anonymous,
}

/// One target's unwinder: the modules loaded so far and framehop's cache.
#[derive(Default)]
pub struct NativeUnwinder {
    unwinder: arch::Unwinder<Arc<[u8]>>,
    cache: arch::Cache,
    /// Mapping ranges already looked up, and what they hold.
    seen: Vec<(Range<u64>, Kind)>,
    /// Frames recovered without tables since the last
    /// [`Self::take_recovered`].
    recovered: Recovered,
}

/// Callers of frames without tables (JIT code, the `[uprobes]` page)
/// recovered by [`NativeUnwinder::unwind`], by way; logged per window so
/// that a debug log shows how much of a profile rests on them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Recovered {
    /// From a validated return address found by scanning the stack.
    pub scanned: u64,
    /// From arm64's link register at the leaf.
    pub link_register: u64,
}

impl NativeUnwinder {
    pub fn new() -> Self {
        Self::default()
    }

    /// The callers recovered without tables since the last call.
    pub fn take_recovered(&mut self) -> Recovered {
        std::mem::take(&mut self.recovered)
    }

    /// Unwinds a stack copy (`stack` holds the bytes from `regs.sp` up)
    /// into addresses, leaf first: the sampled ip, then return addresses.
    /// `lookup` is asked once per mapping, the first time an address of
    /// the stack falls into it; its module is added before framehop
    /// unwinds through it, so no frame is guessed for want of tables.
    ///
    /// A frame in anonymous executable memory (JIT code) has no tables
    /// and, in oneDNN's kernels, no frame pointer. Its caller is found by
    /// scanning the stack above it for the first word that is an address
    /// in a file's code *and* from which the unwinding goes on sensibly
    /// (one more frame in code, higher on the stack), as Breakpad's stack
    /// scanning does; a stale return address left below the frame fails
    /// that check far more often than not. On arm64 a leaf's return
    /// address is in x30 instead, and is tried first
    /// ([`Self::link_register`]). docs/stacks.md.
    ///
    /// Each frame comes with its stack pointer: frame `i`'s locals lie in
    /// `sps[i]..sps[i + 1]` (see [`frame_holding`]).
    pub fn unwind(
        &mut self,
        regs: UserRegs,
        stack: &[u8],
        mut lookup: impl FnMut(u64) -> Lookup,
    ) -> UnwoundStack {
        let base = regs.sp;
        let mut read = |addr: u64| read_word(stack, base, addr);
        let mut r = arch::regs(&regs);
        let mut addr = FrameAddress::from_instruction_pointer(regs.ip);
        let mut out = vec![regs.ip];
        let mut sps = vec![regs.sp];
        while out.len() < MAX_FRAMES {
            let next = match self.kind(addr.address_for_lookup(), &mut lookup) {
                None => break,
                Some(Kind::Anonymous) => {
                    let leaf = out.len() == 1;
                    let found = match leaf
                        .then(|| self.link_register(&regs, &r, stack, base, &mut lookup))
                        .flatten()
                    {
                        Some(f) => {
                            self.recovered.link_register += 1;
                            Some(f)
                        }
                        None => {
                            let f = self.scan(&r, stack, base, &mut lookup);
                            self.recovered.scanned += u64::from(f.is_some());
                            f
                        }
                    };
                    let Some((ra, caller_sp)) = found else {
                        break;
                    };
                    r.set_sp(caller_sp);
                    Some(ra)
                }
                Some(Kind::File { .. }) => {
                    match self
                        .unwinder
                        .unwind_frame(addr, &mut r, &mut self.cache, &mut read)
                    {
                        Ok(n) => n,
                        Err(_) => break,
                    }
                }
            };
            let Some(ra) = next.and_then(FrameAddress::from_return_address) else {
                break;
            };
            out.push(ra.address());
            sps.push(r.sp());
            addr = ra;
        }
        UnwoundStack { ips: out, sps }
    }

    /// What is mapped at `addr`, asking `lookup` the first time.
    fn kind(&mut self, addr: u64, lookup: &mut impl FnMut(u64) -> Lookup) -> Option<Kind> {
        if let Some((_, k)) = self.seen.iter().find(|(r, _)| r.contains(&addr)) {
            return Some(*k);
        }
        let (range, kind) = match lookup(addr) {
            Lookup::Nothing => return None,
            Lookup::Anonymous(range) => (range, Kind::Anonymous),
            Lookup::Mapping(range, m) => {
                let tables = m.is_some();
                if let Some(m) = m {
                    self.unwinder.add_module(m);
                }
                (range, Kind::File { tables })
            }
        };
        // A lookup that does not cover the address would be asked again
        // for every frame; answer from it once and do not keep it.
        if range.contains(&addr) {
            self.seen.push((range, kind));
        }
        Some(kind)
    }

    /// The return address of the JIT frame whose stack pointer is
    /// `at.sp()`, and its caller's stack pointer (just above the stack slot
    /// the address was found in).
    fn scan(
        &mut self,
        at: &arch::Regs,
        stack: &[u8],
        base: u64,
        lookup: &mut impl FnMut(u64) -> Lookup,
    ) -> Option<(u64, u64)> {
        let end = base.saturating_add(stack.len() as u64);
        let mut slot = at.sp();
        while slot < at.sp().saturating_add(JIT_SCAN_BYTES) && slot.saturating_add(8) <= end {
            let word = read_word(stack, base, slot).ok()?;
            if self.plausible_return(word, slot + 8, at, stack, base, lookup) {
                return Some((word, slot + 8));
            }
            slot += 8;
        }
        None
    }

    /// arm64: a leaf in code without tables (a JIT kernel; an instruction
    /// single-stepped in the `[uprobes]` page at a probed function's
    /// entry) keeps its return address in x30, never on the stack, where
    /// [`Self::scan`] looks. Its caller's stack pointer is unknown (the
    /// leaf may have saved registers below it): the lowest 16-byte aligned
    /// one from `sp` up from which the unwinding goes on sensibly is taken
    /// ([`Self::plausible_return`]). `None` on x86-64, where a call pushes
    /// the return address.
    fn link_register(
        &mut self,
        regs: &UserRegs,
        at: &arch::Regs,
        stack: &[u8],
        base: u64,
        lookup: &mut impl FnMut(u64) -> Lookup,
    ) -> Option<(u64, u64)> {
        if !cfg!(target_arch = "aarch64") {
            return None;
        }
        // Pointer authentication signs the bits above the 48-bit address.
        let lr = regs.lr & (u64::MAX >> 16);
        if lr == 0 {
            return None;
        }
        let end = base.saturating_add(stack.len() as u64);
        let mut sp = at.sp();
        while sp < at.sp().saturating_add(JIT_SCAN_BYTES) && sp <= end {
            if self.plausible_return(lr, sp, at, stack, base, lookup) {
                return Some((lr, sp));
            }
            sp += 16;
        }
        None
    }

    /// Is `word` a return address into a file's code from which, with
    /// `caller_sp` as the caller's stack pointer, unwinding goes on for
    /// [`JIT_VALIDATE_FRAMES`] more frames, each in a file's code and
    /// higher on the stack? A stale return address left below the live
    /// frames (a `free` called earlier from the same depth, say) usually
    /// unwinds into one plausible frame by chance, rarely into three.
    fn plausible_return(
        &mut self,
        word: u64,
        caller_sp: u64,
        at: &arch::Regs,
        stack: &[u8],
        base: u64,
        lookup: &mut impl FnMut(u64) -> Lookup,
    ) -> bool {
        // Pointers into the stack itself are the commonest words there.
        if word < 0x1000 || (base..base + stack.len() as u64).contains(&word) {
            return false;
        }
        if self.kind(word - 1, lookup) != Some(Kind::File { tables: true }) {
            return false;
        }
        let mut r = *at;
        r.set_sp(caller_sp);
        let mut read = |addr: u64| read_word(stack, base, addr);
        let mut addr = word;
        for _ in 0..JIT_VALIDATE_FRAMES {
            let Some(ra) = FrameAddress::from_return_address(addr) else {
                return false;
            };
            let sp = r.sp();
            match self
                .unwinder
                .unwind_frame(ra, &mut r, &mut self.cache, &mut read)
            {
                // "Outermost frame" this close to a JIT frame means a zero
                // word was read as the return address: uninitialised stack,
                // not a root (threads start several frames below any JIT
                // code).
                Ok(None) => return false,
                Ok(Some(next)) => {
                    if r.sp() <= sp
                        || next < 0x1000
                        || !matches!(self.kind(next - 1, lookup), Some(Kind::File { .. }))
                    {
                        return false;
                    }
                    addr = next;
                }
                Err(_) => return false,
            }
        }
        true
    }
}

/// A stack unwound from a copy: return addresses (leaf first, the sampled
/// ip first) and, for each, the stack pointer while that frame ran.
#[derive(Debug, Default)]
pub struct UnwoundStack {
    pub ips: Vec<u64>,
    pub sps: Vec<u64>,
}

/// The frame (leaf-first index into `sps`) whose stack memory holds
/// `addr`: `sps[i] <= addr < sps[i + 1]`. The outermost frame's extent is
/// unknown, so an address above the last stack pointer is in no frame.
pub fn frame_holding(sps: &[u64], addr: u64) -> Option<usize> {
    sps.windows(2).position(|w| w[0] <= addr && addr < w[1])
}

/// The 8 bytes of the stack copy (which starts at address `base`) at
/// address `addr`.
fn read_word(stack: &[u8], base: u64, addr: u64) -> Result<u64, ()> {
    let off = usize::try_from(addr.checked_sub(base).ok_or(())?).map_err(|_| ())?;
    let word = stack.get(off..off.checked_add(8).ok_or(())?).ok_or(())?;
    Ok(u64::from_le_bytes(word.try_into().map_err(|_| ())?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_belongs_to_the_frame_whose_stack_holds_it() {
        let sps = [0x1000, 0x1040, 0x10c0, 0x2000];
        assert_eq!(frame_holding(&sps, 0x1000), Some(0));
        assert_eq!(frame_holding(&sps, 0x1080), Some(1));
        assert_eq!(frame_holding(&sps, 0x1fff), Some(2));
        // Below the leaf's sp (the red zone), or in the outermost frame,
        // whose end is unknown.
        assert_eq!(frame_holding(&sps, 0xff8), None);
        assert_eq!(frame_holding(&sps, 0x2000), None);
        // A frame of no size holds nothing.
        assert_eq!(frame_holding(&[0x1000, 0x1000, 0x1010], 0x1000), Some(1));
    }

    #[test]
    fn copy_size_fits_the_ring() {
        // The user's setting would change the expectations.
        if std::env::var_os(STACK_COPY_ENV).is_some() {
            return;
        }
        let (max, min) = (STACK_COPY_MAX as u32, STACK_COPY_MIN as u32);
        if !cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) {
            assert_eq!(stack_copy_bytes(4 << 20), 0);
            return;
        }
        assert_eq!(stack_copy_bytes(4 << 20), max);
        assert_eq!(stack_copy_bytes(64 << 10), 4096);
        assert_eq!(stack_copy_bytes(16 << 10), min);
        assert_eq!(stack_copy_bytes(4 << 10), 0);
    }
}
