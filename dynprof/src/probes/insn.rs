//! The class of a probed instruction, for the `attached` line.
//!
//! A uprobe's cost per hit depends on the instruction it replaces: the
//! kernel emulates a few (push of a register, nops, relative branches) and
//! single-steps every other one out of line, a second trap. Measured on
//! this project's 6.18 test VM (docs/performance.md, section 6): ~0.4 µs
//! per hit at a `push`, ~0.2 µs at a 5-byte nop, ~14 µs at a rip-relative
//! `mov` or an `endbr64`. A tiny classifier of the first bytes is enough to say which case
//! a marker is in; a full decoder (iced-x86) would add a large dependency
//! for one field.
use std::{fs::File, os::unix::fs::FileExt as _, path::Path};

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum InsnClass {
    /// `push %reg`: emulated by the kernel.
    Push,
    /// `nop` / `nopl` / `nopw`: emulated (skipped).
    Nop,
    /// `call`/`jmp`/`jcc` with a relative target: emulated.
    Branch,
    /// `endbr64`, which CET builds (-fcf-protection) begin functions with:
    /// single-stepped like any other instruction (the bench measured
    /// ~14 µs per hit on 6.18, the same as a rip-relative `mov`).
    Endbr64,
    /// Anything else: executed out of line with a single-step trap.
    Other,
}

impl InsnClass {
    pub fn single_stepped(self) -> bool {
        matches!(self, InsnClass::Other | InsnClass::Endbr64)
    }
}

/// Classifies the x86-64 instruction that starts `b`; `None` when `b` is
/// empty.
pub fn classify_x86_64(b: &[u8]) -> Option<InsnClass> {
    let at = |i: usize| b.get(i).copied();
    let first = at(0)?;
    // A REX prefix (0x40..=0x4f) selects r8..r15 for push.
    let (op, rest) = if (0x40..=0x4f).contains(&first) {
        (at(1), 1)
    } else {
        (Some(first), 0)
    };
    let class = match (op, at(rest + 1)) {
        (Some(0x50..=0x57), _) => InsnClass::Push,
        _ if rest == 1 => InsnClass::Other,
        (Some(0x90), _) | (Some(0x0f), Some(0x1f)) => InsnClass::Nop,
        (Some(0xe8 | 0xe9 | 0xeb | 0x70..=0x7f), _) => InsnClass::Branch,
        (Some(0x0f), Some(0x80..=0x8f)) => InsnClass::Branch,
        (Some(0x66), _) => match (at(1), at(2), at(3)) {
            // 66 90 (xchg %ax,%ax), 66 0f 1f …, 66 2e 0f 1f … (nopw %cs:…).
            (Some(0x90), _, _)
            | (Some(0x0f), Some(0x1f), _)
            | (Some(0x2e), Some(0x0f), Some(0x1f)) => InsnClass::Nop,
            _ => InsnClass::Other,
        },
        (Some(0xf3), _) if b.get(1..4) == Some(&[0x0f, 0x1e, 0xfa]) => InsnClass::Endbr64,
        _ => InsnClass::Other,
    };
    Some(class)
}

/// The class of the instruction at `file_offset` of `path` (the path the
/// uprobe is attached through), or `None` when it cannot be read or this
/// is not x86-64.
pub fn at_offset(path: &Path, file_offset: u64) -> Option<InsnClass> {
    if !cfg!(target_arch = "x86_64") {
        return None;
    }
    let f = File::open(path).ok()?;
    let mut buf = [0u8; 8];
    let n = f.read_at(&mut buf, file_offset).ok()?;
    classify_x86_64(&buf[..n])
}

#[cfg(test)]
mod tests {
    use super::{InsnClass::*, *};

    #[test]
    fn classes_of_first_instructions() {
        // push %rbx; push %r15 (41 57); push %rbp.
        assert_eq!(classify_x86_64(&[0x53, 0x5b, 0xc3]), Some(Push));
        assert_eq!(classify_x86_64(&[0x41, 0x57, 0x41]), Some(Push));
        assert_eq!(classify_x86_64(&[0x55, 0x48, 0x89, 0xe5]), Some(Push));
        // nop, nopl 0x0(%rax,%rax,1), nopw %cs:0x0(%rax,%rax,1).
        assert_eq!(classify_x86_64(&[0x90]), Some(Nop));
        assert_eq!(classify_x86_64(&[0x0f, 0x1f, 0x44, 0x00, 0x00]), Some(Nop));
        assert_eq!(classify_x86_64(&[0x66, 0x2e, 0x0f, 0x1f, 0x84]), Some(Nop));
        // call rel32, jmp rel8, jne rel32.
        assert_eq!(classify_x86_64(&[0xe8, 0, 0, 0, 0]), Some(Branch));
        assert_eq!(classify_x86_64(&[0xeb, 0x10]), Some(Branch));
        assert_eq!(classify_x86_64(&[0x0f, 0x85, 0, 0, 0, 0]), Some(Branch));
        assert_eq!(classify_x86_64(&[0xf3, 0x0f, 0x1e, 0xfa]), Some(Endbr64));
        // mov 0x2bd0(%rip),%rdx; movzbl (%rdi),%eax; sub $8,%rsp; rex.W mov.
        assert_eq!(
            classify_x86_64(&[0x48, 0x8b, 0x15, 0xd0, 0x2b, 0, 0]),
            Some(Other)
        );
        assert_eq!(classify_x86_64(&[0x0f, 0xb6, 0x07]), Some(Other));
        assert_eq!(classify_x86_64(&[0x48, 0x83, 0xec, 0x08]), Some(Other));
        assert_eq!(classify_x86_64(&[0xf3, 0x0f]), Some(Other));
        assert_eq!(classify_x86_64(&[0x41]), Some(Other));
        assert_eq!(classify_x86_64(&[]), None);
        assert!(Other.single_stepped() && Endbr64.single_stepped());
        assert!(!Push.single_stepped() && !Nop.single_stepped() && !Branch.single_stepped());
    }
}
