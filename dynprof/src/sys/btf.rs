//! One fact from the kernel's BTF: the byte offset of a member in a kernel
//! struct (`task_struct.stack`, for the user registers on kernels before
//! 5.15; see `bpf::task_regs`).
//!
//! Hand-written because the two maintained readers do not fit: aya-obj's
//! parser keeps struct members crate-private, and btf-rs is LGPL. This
//! reader walks the type section once (every kind's record length, from
//! the kernel's `Documentation/bpf/btf.rst`), bounds-checks every read, and
//! answers only "where is member M of struct S".
use anyhow::{Context, Result, bail};

const MAGIC: u16 = 0xeb9f;
const KIND_STRUCT: u32 = 4;

/// The kernel's own BTF.
pub const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

/// Byte offset of `member` in struct `strukt` of the BTF in `data` (native
/// byte order, as the kernel exposes it).
pub fn member_offset(data: &[u8], strukt: &str, member: &str) -> Result<u32> {
    let u16_at = |at: usize| -> Option<u16> {
        Some(u16::from_ne_bytes(data.get(at..at + 2)?.try_into().ok()?))
    };
    let u32_at = |at: usize| -> Option<u32> {
        Some(u32::from_ne_bytes(data.get(at..at + 4)?.try_into().ok()?))
    };
    if u16_at(0) != Some(MAGIC) {
        bail!("not BTF in this byte order (magic {:#x?})", u16_at(0));
    }
    let field = |i: usize| u32_at(8 + 4 * i).context("BTF header cut short");
    let hdr_len = u32_at(4).context("BTF header cut short")? as usize;
    let (type_off, type_len, str_off, str_len) = (field(0)?, field(1)?, field(2)?, field(3)?);
    let types = hdr_len + type_off as usize..hdr_len + type_off as usize + type_len as usize;
    let strings = hdr_len + str_off as usize..hdr_len + str_off as usize + str_len as usize;
    if types.end > data.len() || strings.end > data.len() {
        bail!("BTF sections run past the data ({} bytes)", data.len());
    }
    let name = |off: u32| -> Option<&[u8]> {
        let s = data.get(strings.start + off as usize..strings.end)?;
        Some(&s[..s.iter().position(|&b| b == 0)?])
    };
    let mut at = types.start;
    while at + 12 <= types.end {
        let (name_off, info) = (u32_at(at).unwrap_or(0), u32_at(at + 4).unwrap_or(0));
        let (kind, vlen) = ((info >> 24) & 0x1f, (info & 0xffff) as usize);
        let kind_flag = info >> 31 == 1;
        at += 12;
        let tail = match kind {
            // INT, VAR, DECL_TAG: one word.
            1 | 14 | 17 => 4,
            // PTR, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC, FLOAT,
            // TYPE_TAG: nothing.
            2 | 7..=12 | 16 | 18 => 0,
            // ARRAY: type, index type, count.
            3 => 12,
            // STRUCT, UNION, DATASEC, ENUM64: 12 bytes per member.
            4 | 5 | 15 | 19 => 12 * vlen,
            // ENUM, FUNC_PROTO: 8 bytes per value / parameter.
            6 | 13 => 8 * vlen,
            other => bail!("BTF type kind {other} is unknown to dynprof"),
        };
        if kind == KIND_STRUCT && name(name_off) == Some(strukt.as_bytes()) {
            for m in 0..vlen {
                let rec = at + 12 * m;
                let m_name = u32_at(rec).context("BTF member cut short")?;
                if name(m_name) != Some(member.as_bytes()) {
                    continue;
                }
                let raw = u32_at(rec + 8).context("BTF member cut short")?;
                // With kind_flag, the top byte is a bitfield's size.
                let bits = if kind_flag { raw & 0x00ff_ffff } else { raw };
                if bits % 8 != 0 {
                    bail!("{strukt}.{member} is a bitfield (bit offset {bits})");
                }
                return Ok(bits / 8);
            }
            bail!("struct {strukt} has no member {member} in the kernel's BTF");
        }
        at += tail;
    }
    bail!("no struct {strukt} in the kernel's BTF")
}

/// [`member_offset`] in the running kernel's BTF.
pub fn kernel_member_offset(strukt: &str, member: &str) -> Result<u32> {
    let data = std::fs::read(VMLINUX).with_context(|| format!("reading {VMLINUX}"))?;
    member_offset(&data, strukt, member).with_context(|| format!("in {VMLINUX}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A BTF blob: `types` (records) and `strings` (NUL-separated names).
    fn blob(types: &[u32], strings: &[u8]) -> Vec<u8> {
        let tlen = (types.len() * 4) as u32;
        let mut b = Vec::new();
        b.extend(MAGIC.to_ne_bytes());
        b.extend([1u8, 0]);
        for w in [24u32, 0, tlen, tlen, strings.len() as u32] {
            b.extend(w.to_ne_bytes());
        }
        for w in types {
            b.extend(w.to_ne_bytes());
        }
        b.extend(strings);
        b
    }

    // Strings: 0 "", 1 "int", 5 "task_struct", 17 "state", 23 "stack",
    // 29 "pt_regs", 37 "x".
    const STRINGS: &[u8] = b"\0int\0task_struct\0state\0stack\0pt_regs\0x\0";

    fn info(kind: u32, vlen: u32, kind_flag: bool) -> u32 {
        (u32::from(kind_flag) << 31) | (kind << 24) | vlen
    }

    /// int; an enum before the struct (its values must be skipped);
    /// struct pt_regs { x }; struct task_struct { state; stack at byte 16 }.
    // One BTF type record per line, as the kernel lays them out.
    #[rustfmt::skip]
    fn kernel_like(kind_flag: bool, stack_bits: u32) -> Vec<u8> {
        blob(
            &[
                1, info(1, 0, false), 8, 64, // [1] INT "int", 8 bytes
                0, info(6, 2, false), 4, 37, 0, 37, 1, // [2] ENUM, 2 values
                29, info(4, 1, false), 8, 37, 1, 0, // [3] STRUCT pt_regs { x }
                5, info(4, 2, kind_flag), 24, // [4] STRUCT task_struct
                17, 1, 0, // state: int at bit 0
                23, 1, stack_bits, // stack
            ],
            STRINGS,
        )
    }

    #[test]
    fn finds_a_member_past_other_kinds() {
        assert_eq!(
            member_offset(&kernel_like(false, 128), "task_struct", "stack").unwrap(),
            16
        );
        assert_eq!(
            member_offset(&kernel_like(false, 128), "pt_regs", "x").unwrap(),
            0
        );
        // With kind_flag the bitfield size (0 here) shares the word.
        assert_eq!(
            member_offset(&kernel_like(true, 128), "task_struct", "stack").unwrap(),
            16
        );
    }

    #[test]
    fn says_what_is_missing() {
        let b = kernel_like(false, 128);
        let e = member_offset(&b, "task_struct", "nope").unwrap_err();
        assert!(e.to_string().contains("no member nope"), "{e}");
        let e = member_offset(&b, "mm_struct", "stack").unwrap_err();
        assert!(e.to_string().contains("no struct mm_struct"), "{e}");
        let e = member_offset(&kernel_like(false, 129), "task_struct", "stack").unwrap_err();
        assert!(e.to_string().contains("bitfield"), "{e}");
    }

    #[test]
    fn hostile_blobs_are_errors_not_panics() {
        let good = kernel_like(false, 128);
        for cut in 0..good.len() {
            let _ = member_offset(&good[..cut], "task_struct", "stack");
        }
        let mut bad = good.clone();
        bad[0] ^= 0xff;
        assert!(member_offset(&bad, "task_struct", "stack").is_err());
        // A type length far past the data.
        let mut long = good.clone();
        long[12..16].copy_from_slice(&u32::MAX.to_ne_bytes());
        assert!(member_offset(&long, "task_struct", "stack").is_err());
        // An unknown kind.
        let odd = blob(&[1, info(31, 0, false), 0], STRINGS);
        assert!(member_offset(&odd, "task_struct", "stack").is_err());
    }

    /// The running kernel's BTF has `task_struct.stack`, pointer-aligned
    /// (the struct starts with `thread_info` or a state word).
    #[test]
    fn the_running_kernel_has_task_struct_stack() {
        if !std::path::Path::new(VMLINUX).exists() {
            eprintln!("SKIP: no {VMLINUX}");
            return;
        }
        let off = kernel_member_offset("task_struct", "stack").unwrap();
        assert!(off > 0 && off.is_multiple_of(8) && off < 4096, "{off}");
    }
}
