//! USDT probes from `.note.stapsdt` (the SystemTap SDT v3 note format).
//!
//! aya has no USDT support: dynprof attaches a plain uprobe at the probe's
//! file offset and reads arguments by the operand spec in the note, as
//! libbpf and bcc do.
use anyhow::{Result, bail};
use dynprof_common::reg;
use object::{Object, ObjectSection};

use super::ElfImage;

/// Where one USDT argument lives at the probe site.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgLoc {
    /// `%reg`
    Reg(u32),
    /// `off(%reg)`
    Mem { base: u32, offset: i64 },
    /// `$imm`
    Const(i64),
}

#[derive(Clone, Debug)]
pub struct UsdtProbe {
    pub provider: String,
    pub name: String,
    /// Probe address (the `nop`), adjusted for `.stapsdt.base`.
    pub vaddr: u64,
    pub file_offset: u64,
    /// Virtual address of the u16 semaphore, 0 when the probe has none.
    pub semaphore_vaddr: u64,
    pub args: Vec<(i32, ArgLoc)>,
    pub raw_args: String,
}

pub fn probes(img: &ElfImage) -> Result<Vec<UsdtProbe>> {
    let file = img.file();
    let Some(notes) = file.section_by_name(".note.stapsdt") else {
        return Ok(Vec::new());
    };
    let data = notes.data()?;
    let base_addr = file.section_by_name(".stapsdt.base").map(|s| s.address());
    let mut out = Vec::new();
    let mut off = 0usize;
    let align4 = |n: usize| (n + 3) & !3;
    while off + 12 <= data.len() {
        let rd32 = |o: usize| u32::from_le_bytes(data[o..o + 4].try_into().unwrap()) as usize;
        let (namesz, descsz, ntype) = (rd32(off), rd32(off + 4), rd32(off + 8));
        let name_start = off + 12;
        let desc_start = name_start + align4(namesz);
        let next = desc_start + align4(descsz);
        if next > data.len() {
            break;
        }
        let owner = &data[name_start..name_start + namesz];
        if ntype == 3 && owner.starts_with(b"stapsdt") && descsz >= 24 {
            let desc = &data[desc_start..desc_start + descsz];
            let rd64 = |o: usize| u64::from_le_bytes(desc[o..o + 8].try_into().unwrap());
            let (mut pc, note_base, mut sema) = (rd64(0), rd64(8), rd64(16));
            if let Some(actual) = base_addr {
                // Prelink or a moved section: shift by the same delta as libbpf.
                pc = pc.wrapping_add(actual).wrapping_sub(note_base);
                if sema != 0 {
                    sema = sema.wrapping_add(actual).wrapping_sub(note_base);
                }
            }
            let mut strs = desc[24..]
                .split(|b| *b == 0)
                .map(|s| String::from_utf8_lossy(s).into_owned());
            let provider = strs.next().unwrap_or_default();
            let name = strs.next().unwrap_or_default();
            let raw_args = strs.next().unwrap_or_default();
            if let Some(file_offset) = img.vaddr_to_offset(pc) {
                out.push(UsdtProbe {
                    args: parse_args(&raw_args).unwrap_or_default(),
                    provider,
                    name,
                    vaddr: pc,
                    file_offset,
                    semaphore_vaddr: sema,
                    raw_args,
                });
            }
        }
        off = next;
    }
    Ok(out)
}

/// Parses `8@%rdi -4@-20(%rbp) 4@$3` into sizes and locations.
pub fn parse_args(spec: &str) -> Result<Vec<(i32, ArgLoc)>> {
    spec.split_whitespace()
        .map(|a| {
            let (size, loc) = a.split_once('@').unwrap_or(("8", a));
            let size: i32 = size.parse().unwrap_or(8);
            let loc = if let Some(imm) = loc.strip_prefix('$') {
                ArgLoc::Const(imm.parse()?)
            } else if let Some(r) = loc.strip_prefix('%') {
                ArgLoc::Reg(register(r)?)
            } else if let Some((off, rest)) = loc.split_once('(') {
                let r = rest.trim_end_matches(')').trim_start_matches('%');
                let offset = if off.is_empty() { 0 } else { off.parse()? };
                ArgLoc::Mem {
                    base: register(r)?,
                    offset,
                }
            } else {
                bail!("unsupported USDT argument operand `{a}`")
            };
            Ok((size, loc))
        })
        .collect()
}

fn register(name: &str) -> Result<u32> {
    Ok(match name {
        "rdi" | "edi" | "di" | "dil" => reg::RDI,
        "rsi" | "esi" | "si" | "sil" => reg::RSI,
        "rdx" | "edx" | "dx" | "dl" => reg::RDX,
        "rcx" | "ecx" | "cx" | "cl" => reg::RCX,
        "r8" | "r8d" | "r8w" | "r8b" => reg::R8,
        "r9" | "r9d" | "r9w" | "r9b" => reg::R9,
        "rax" | "eax" | "ax" | "al" => reg::RAX,
        "rbx" | "ebx" | "bx" | "bl" => reg::RBX,
        "rbp" | "ebp" | "bp" | "bpl" => reg::RBP,
        "rsp" | "esp" | "sp" | "spl" => reg::RSP,
        "r10" | "r10d" | "r10w" | "r10b" => reg::R10,
        "r11" | "r11d" | "r11w" | "r11b" => reg::R11,
        "r12" | "r12d" | "r12w" | "r12b" => reg::R12,
        "r13" | "r13d" | "r13w" | "r13b" => reg::R13,
        "r14" | "r14d" | "r14w" | "r14b" => reg::R14,
        "r15" | "r15d" | "r15w" | "r15b" => reg::R15,
        "rip" => reg::RIP,
        other => bail!("unsupported USDT register %{other}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_operand_forms() {
        let a = parse_args("8@%r14 -4@%eax 8@-24(%rbp) 4@$5 8@(%rbx)").unwrap();
        assert_eq!(a[0], (8, ArgLoc::Reg(reg::R14)));
        assert_eq!(a[1], (-4, ArgLoc::Reg(reg::RAX)));
        assert_eq!(
            a[2],
            (
                8,
                ArgLoc::Mem {
                    base: reg::RBP,
                    offset: -24
                }
            )
        );
        assert_eq!(a[3], (4, ArgLoc::Const(5)));
        assert_eq!(
            a[4],
            (
                8,
                ArgLoc::Mem {
                    base: reg::RBX,
                    offset: 0
                }
            )
        );
    }

    #[test]
    fn rejects_unknown_registers() {
        assert!(parse_args("8@%xmm0").is_err());
    }
}
