//! USDT probes from `.note.stapsdt` (the SystemTap SDT v3 note format).
//!
//! aya has no USDT support: dynprof attaches a plain uprobe at the probe's
//! file offset and reads arguments by the operand spec in the note, as
//! libbpf and bcc do.
use anyhow::{Result, bail};
use dynprof_common::{MAX_MARKERS, reg_aarch64, reg_x86_64};

use super::ElfImage;
pub use super::elf::Arch;

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

/// USDT probes of `img` named `provider:name`, at most [`MAX_MARKERS`]
/// (the kernel side's limit): a file with more matching notes is refused
/// before any probe is built, however many notes it holds.
pub fn find(img: &ElfImage, provider: &str, name: &str) -> Result<Vec<UsdtProbe>> {
    let Some((data, base)) = img.stapsdt_notes()? else {
        return Ok(Vec::new());
    };
    parse_notes(
        data,
        base,
        |p, n| p == provider.as_bytes() && n == name.as_bytes(),
        MAX_MARKERS as usize,
        |vaddr| img.vaddr_to_offset(vaddr),
    )
    .map_err(|e| anyhow::anyhow!("{e} ({provider}:{name})"))
}

/// Every USDT probe of `img` (for listings and the fuzzer), at most
/// [`MAX_LISTED`]: more is an error.
pub fn probes(img: &ElfImage) -> Result<Vec<UsdtProbe>> {
    let Some((data, base)) = img.stapsdt_notes()? else {
        return Ok(Vec::new());
    };
    parse_notes(
        data,
        base,
        |_, _| true,
        MAX_LISTED,
        |vaddr| img.vaddr_to_offset(vaddr),
    )
}

/// How many probes [`probes`] lists.
pub const MAX_LISTED: usize = 4096;

/// Parses the bytes of a `.note.stapsdt` section. `want(provider, name)`
/// picks the notes to build probes for (nothing is allocated for the
/// others); more than `limit` picked notes is an error; `to_file_offset`
/// places a probe address in the file (notes it cannot place are skipped).
/// `base` is `.stapsdt.base`'s address, when the object has that section.
pub fn parse_notes(
    data: &[u8],
    base: Option<u64>,
    mut want: impl FnMut(&[u8], &[u8]) -> bool,
    limit: usize,
    to_file_offset: impl Fn(u64) -> Option<u64>,
) -> Result<Vec<UsdtProbe>> {
    let mut out = Vec::new();
    let mut off = 0usize;
    let align4 = |n: usize| n.checked_add(3).map(|n| n & !3);
    let rd32 = |o: usize| -> Option<usize> {
        Some(u32::from_le_bytes(data.get(o..o.checked_add(4)?)?.try_into().ok()?) as usize)
    };
    while let (Some(namesz), Some(descsz), Some(ntype)) = (rd32(off), rd32(off + 4), rd32(off + 8))
    {
        let name_start = off + 12;
        let Some(desc_start) = align4(namesz).and_then(|n| name_start.checked_add(n)) else {
            break;
        };
        let Some(next) = align4(descsz).and_then(|n| desc_start.checked_add(n)) else {
            break;
        };
        if next > data.len() || next <= off {
            break;
        }
        off = next;
        let owner = &data[name_start..name_start + namesz];
        if ntype != 3 || !owner.starts_with(b"stapsdt") || descsz < 24 {
            continue;
        }
        let desc = &data[desc_start..desc_start + descsz];
        let mut strs = desc[24..].split(|b| *b == 0);
        let provider = strs.next().unwrap_or_default();
        let name = strs.next().unwrap_or_default();
        if !want(provider, name) {
            continue;
        }
        if out.len() == limit {
            bail!(
                "more than {limit} USDT probe sites match; dynprof attaches at most {limit} markers"
            );
        }
        let rd64 = |o: usize| u64::from_le_bytes(desc[o..o + 8].try_into().unwrap_or_default());
        let (mut pc, note_base, mut sema) = (rd64(0), rd64(8), rd64(16));
        if let Some(actual) = base {
            // Prelink or a moved section: shift by the same delta as libbpf.
            pc = pc.wrapping_add(actual).wrapping_sub(note_base);
            if sema != 0 {
                sema = sema.wrapping_add(actual).wrapping_sub(note_base);
            }
        }
        let raw_args = String::from_utf8_lossy(strs.next().unwrap_or_default()).into_owned();
        if let Some(file_offset) = to_file_offset(pc) {
            out.push(UsdtProbe {
                args: parse_args(&raw_args).unwrap_or_default(),
                provider: String::from_utf8_lossy(provider).into_owned(),
                name: String::from_utf8_lossy(name).into_owned(),
                vaddr: pc,
                file_offset,
                semaphore_vaddr: sema,
                raw_args,
            });
        }
    }
    Ok(out)
}

/// Parses the note's argument string for this machine (see [`parse_args_for`]).
pub fn parse_args(spec: &str) -> Result<Vec<(i32, ArgLoc)>> {
    parse_args_for(Arch::HOST, spec)
}

/// Parses `8@%rdi -4@-20(%rbp) 4@$3` (x86-64) or `8@x0 -4@[sp, 16] 4@5`
/// (arm64) into sizes and locations, with registers as word indices into
/// that architecture's `pt_regs`.
pub fn parse_args_for(arch: Arch, spec: &str) -> Result<Vec<(i32, ArgLoc)>> {
    operands(spec)
        .into_iter()
        .map(|a| {
            let (size, loc) = a.split_once('@').unwrap_or(("8", a));
            let size: i32 = size.parse().unwrap_or(8);
            let loc = match arch {
                Arch::X86_64 => x86_operand(a, loc)?,
                Arch::Aarch64 => arm64_operand(a, loc)?,
            };
            Ok((size, loc))
        })
        .collect()
}

/// Splits at whitespace outside brackets: arm64 memory operands hold a
/// space (`[sp, 16]`).
fn operands(spec: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, None);
    for (i, c) in spec.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            c if c.is_whitespace() && depth <= 0 => {
                if let Some(s) = start.take() {
                    out.push(&spec[s..i]);
                }
                continue;
            }
            _ => {}
        }
        start.get_or_insert(i);
    }
    if let Some(s) = start {
        out.push(&spec[s..]);
    }
    out
}

fn x86_operand(a: &str, loc: &str) -> Result<ArgLoc> {
    Ok(if let Some(imm) = loc.strip_prefix('$') {
        ArgLoc::Const(imm.parse()?)
    } else if let Some(r) = loc.strip_prefix('%') {
        ArgLoc::Reg(x86_register(r)?)
    } else if let Some((off, rest)) = loc.split_once('(') {
        let r = rest.trim_end_matches(')').trim_start_matches('%');
        let offset = if off.is_empty() { 0 } else { off.parse()? };
        ArgLoc::Mem {
            base: x86_register(r)?,
            offset,
        }
    } else {
        bail!("unsupported USDT argument operand `{a}`")
    })
}

/// arm64 operands as GCC's sys/sdt.h writes them: `x0`/`w0`, `sp`,
/// `[x29]`, `[sp, 16]`, `[x1, -8]`, and immediates (`5`, `-1`).
fn arm64_operand(a: &str, loc: &str) -> Result<ArgLoc> {
    Ok(if let Some(inner) = loc.strip_prefix('[') {
        let inner = inner
            .strip_suffix(']')
            .ok_or_else(|| anyhow::anyhow!("unsupported USDT argument operand `{a}`"))?;
        let (r, off) = match inner.split_once(',') {
            Some((r, off)) => (r.trim(), off.trim().trim_start_matches('#').parse()?),
            None => (inner.trim(), 0),
        };
        ArgLoc::Mem {
            base: arm64_register(r)?,
            offset: off,
        }
    } else if loc.starts_with(|c: char| c.is_ascii_digit() || c == '-' || c == '#') {
        ArgLoc::Const(loc.trim_start_matches('#').parse()?)
    } else {
        ArgLoc::Reg(arm64_register(loc)?)
    })
}

fn arm64_register(name: &str) -> Result<u32> {
    use reg_aarch64 as r;
    if name == "sp" {
        return Ok(r::SP);
    }
    if let Some(n) = name
        .strip_prefix('x')
        .or_else(|| name.strip_prefix('w'))
        .and_then(|n| n.parse::<u32>().ok())
        && n <= 30
    {
        return Ok(r::x(n));
    }
    match name {
        "fp" => Ok(r::FP),
        "lr" => Ok(r::LR),
        other => bail!("unsupported USDT register {other} (arm64)"),
    }
}

fn x86_register(name: &str) -> Result<u32> {
    use reg_x86_64 as reg;
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
    fn parses_arm64_operand_forms() {
        use reg_aarch64 as r;
        let a = parse_args_for(
            Arch::Aarch64,
            "8@x0 -4@w1 8@[sp, 16] -4@[x29, -8] 8@[x19] 4@5 -8@-1 8@sp 8@x30",
        )
        .unwrap();
        assert_eq!(
            a,
            vec![
                (8, ArgLoc::Reg(0)),
                (-4, ArgLoc::Reg(1)),
                (
                    8,
                    ArgLoc::Mem {
                        base: r::SP,
                        offset: 16
                    }
                ),
                (
                    -4,
                    ArgLoc::Mem {
                        base: 29,
                        offset: -8
                    }
                ),
                (
                    8,
                    ArgLoc::Mem {
                        base: 19,
                        offset: 0
                    }
                ),
                (4, ArgLoc::Const(5)),
                (-8, ArgLoc::Const(-1)),
                (8, ArgLoc::Reg(r::SP)),
                (8, ArgLoc::Reg(r::LR)),
            ]
        );
        // pt_regs words: x0..x30, then sp, pc.
        assert_eq!((r::SP, r::PC, r::COUNT), (31, 32, 34));
        for bad in ["8@x31", "8@v0", "8@[x1, 16", "8@%rdi", "4@[q0]"] {
            assert!(
                parse_args_for(Arch::Aarch64, bad).is_err(),
                "{bad} must be refused"
            );
        }
        // The x86 parser refuses arm64 syntax instead of misreading it.
        assert!(parse_args_for(Arch::X86_64, "8@x0").is_err());
    }

    #[test]
    fn operands_split_outside_brackets_only() {
        assert_eq!(
            operands(" 8@[sp, 16]  -4@x1\t4@[x2,#8] "),
            vec!["8@[sp, 16]", "-4@x1", "4@[x2,#8]"]
        );
        assert!(operands("").is_empty());
    }

    #[test]
    fn parses_operand_forms() {
        use reg_x86_64 as reg;
        let a = parse_args_for(Arch::X86_64, "8@%r14 -4@%eax 8@-24(%rbp) 4@$5 8@(%rbx)").unwrap();
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

    /// One `.note.stapsdt` note as GCC's sys/sdt.h lays it out.
    fn note(provider: &str, name: &str, pc: u64) -> Vec<u8> {
        let mut desc = Vec::new();
        desc.extend_from_slice(&pc.to_le_bytes());
        desc.extend_from_slice(&0u64.to_le_bytes());
        desc.extend_from_slice(&0u64.to_le_bytes());
        for s in [provider, name, "8@%rdi"] {
            desc.extend_from_slice(s.as_bytes());
            desc.push(0);
        }
        while desc.len() % 4 != 0 {
            desc.push(0);
        }
        let mut n = Vec::new();
        n.extend_from_slice(&8u32.to_le_bytes());
        n.extend_from_slice(&(desc.len() as u32).to_le_bytes());
        n.extend_from_slice(&3u32.to_le_bytes());
        n.extend_from_slice(b"stapsdt\0");
        n.extend_from_slice(&desc);
        n
    }

    #[test]
    fn picks_named_notes_and_stops_past_the_limit() {
        let mut data = Vec::new();
        for i in 0..1000u64 {
            data.extend(note("other", "probe", 0x1000 + i));
        }
        data.extend(note("py", "step", 0x2000));
        let ps = parse_notes(&data, None, |p, n| p == b"py" && n == b"step", 64, Some).unwrap();
        assert_eq!(ps.len(), 1);
        assert_eq!((ps[0].provider.as_str(), ps[0].file_offset), ("py", 0x2000));
        assert_eq!(ps[0].args, vec![(8, ArgLoc::Reg(reg_x86_64::RDI))]);
        // 100,000 matching notes: refused at the 65th, with 64 probes built at most.
        let one = note("py", "step", 0x3000);
        let many = one.repeat(100_000);
        let built = std::cell::Cell::new(0);
        let e = parse_notes(
            &many,
            None,
            |_, _| true,
            64,
            |v| {
                built.set(built.get() + 1);
                Some(v)
            },
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("more than 64 USDT probe sites"),
            "{e}"
        );
        assert_eq!(built.get(), 64);
    }

    #[test]
    fn malformed_notes_end_the_scan() {
        let mut data = note("py", "step", 0x2000);
        // A second note whose sizes point far past the end.
        data.extend_from_slice(&u32::MAX.to_le_bytes());
        data.extend_from_slice(&u32::MAX.to_le_bytes());
        data.extend_from_slice(&3u32.to_le_bytes());
        let ps = parse_notes(&data, None, |_, _| true, 64, Some).unwrap();
        assert_eq!(ps.len(), 1);
        for cut in 0..data.len() {
            let _ = parse_notes(&data[..cut], None, |_, _| true, 64, Some).unwrap();
        }
    }

    #[test]
    fn rejects_unknown_registers() {
        assert!(parse_args("8@%xmm0").is_err());
    }
}
