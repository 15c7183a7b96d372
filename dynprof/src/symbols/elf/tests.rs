use super::*;
use object::read::ReadRef as _;

#[test]
fn strips_parameters_but_not_templates() {
    assert_eq!(strip_params("a::b(int)"), "a::b");
    assert_eq!(strip_params("a::b<c(d)>::e(int)"), "a::b<c(d)>::e");
    assert_eq!(strip_params("plain"), "plain");
}

#[test]
fn cold_fragments_are_not_entry_points() {
    assert!(is_cold_fragment(
        "_ZN5torch8autograd6Engine7executeERKSt6vector.cold"
    ));
    assert!(is_cold_fragment("foo.cold.3"));
    assert!(!is_cold_fragment("foo.constprop.0"));
    assert!(!is_cold_fragment("coldstart"));
}

#[test]
fn needles_follow_itanium_mangling() {
    assert_eq!(
        mangled_needles("torch::autograd::Engine::execute"),
        vec!["5torch", "8autograd", "6Engine", "7execute"]
    );
}

/// An ELF64 x86-64 executable with only these PT_LOAD program headers,
/// each `(vaddr, file offset, memsz)`, written to a fresh file.
fn elf_with_segments(name: &str, loads: &[(u64, u64, u64)]) -> std::path::PathBuf {
    let mut b = Vec::new();
    b.extend_from_slice(b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0");
    b.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    b.extend_from_slice(&62u16.to_le_bytes()); // EM_X86_64
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes()); // e_entry
    b.extend_from_slice(&64u64.to_le_bytes()); // e_phoff
    b.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
    b.extend_from_slice(&0u32.to_le_bytes());
    for v in [64u16, 56, loads.len() as u16, 64, 0, 0] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    for &(vaddr, off, memsz) in loads {
        b.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
        b.extend_from_slice(&5u32.to_le_bytes()); // R X
        for v in [off, vaddr, vaddr, 0, memsz, 0x1000] {
            b.extend_from_slice(&v.to_le_bytes());
        }
    }
    let path = std::env::temp_dir().join(format!("dynprof-{name}-{}", std::process::id()));
    std::fs::write(&path, &b).unwrap();
    path
}

#[test]
fn string_range_ending_before_it_starts_is_an_error() {
    // Found by the `elf` fuzz target: a section name offset past the end
    // of the string table's range overflowed `end - start`.
    let sparse = Sparse {
        len: 200,
        chunks: vec![(100, b"abc\0".to_vec())],
        total: 4,
        unwind_only: Vec::new(),
    };
    // As the section headers give it: a start past the end.
    let backwards = std::ops::Range {
        start: 101,
        end: 50,
    };
    assert_eq!((&sparse).read_bytes_at_until(backwards, 0), Err(()));
    assert_eq!((&sparse).read_bytes_at_until(101..104, 0), Ok(&b"bc"[..]));
}

#[test]
fn segment_ending_past_2_64_does_not_overflow() {
    // Found by the `elf` fuzz target: `start + size` overflowed (a panic
    // in debug builds, a wrong offset in release).
    let path = elf_with_segments(
        "overflow",
        &[(u64::MAX - 0xfff, 0, 0x2000), (0x40_0000, 0x1000, 0x1000)],
    );
    let img = ElfImage::open(&path);
    std::fs::remove_file(&path).unwrap();
    let img = img.unwrap();
    assert_eq!(img.vaddr_to_offset(u64::MAX), Some(0xfff));
    assert_eq!(img.vaddr_to_offset(0x40_0010), Some(0x1010));
    assert_eq!(img.vaddr_to_offset(0x3f_ffff), None);
    assert_eq!(img.vaddr_to_offset(0x40_1000), None);
}

#[test]
fn finds_a_function_in_the_test_binary() {
    let exe = std::env::current_exe().unwrap();
    let img = ElfImage::open(&exe).unwrap();
    let hits = img.find_function("main");
    assert_eq!(hits.len(), 1, "{hits:?}");
    assert!(hits[0].file_offset > 0);
    // Only headers and tables were read, not the code.
    let size = std::fs::metadata(&exe).unwrap().len();
    assert!(img.sparse.total < size, "{} of {size}", img.sparse.total);
}

#[test]
fn one_pass_for_several_names_finds_what_each_name_finds() {
    let exe = std::env::current_exe().unwrap();
    let img = ElfImage::open(&exe).unwrap();
    let specs = ["main", "no_such_function_anywhere", "main"];
    let all = img.find_functions(&specs);
    assert_eq!(all.len(), 3);
    for (spec, hits) in specs.iter().zip(&all) {
        let one = img.find_function(spec);
        assert_eq!(
            hits.iter().map(|h| h.file_offset).collect::<Vec<_>>(),
            one.iter().map(|h| h.file_offset).collect::<Vec<_>>(),
            "{spec}"
        );
    }
    assert_eq!((all[0].len(), all[1].len()), (1, 0));
}

fn this_binary() -> Vec<u8> {
    std::fs::read(std::env::current_exe().unwrap()).unwrap()
}

fn shdr_field(bytes: &mut [u8], name: &str) -> usize {
    // Offset of the section header of `name` in a little-endian ELF64.
    let img = ElfImage::from_bytes(Path::new("t"), bytes).unwrap();
    let file = img.file();
    let object::File::Elf64(elf) = &file else {
        panic!("ELF64 expected")
    };
    let shoff = elf.elf_header().e_shoff.get(Endianness::Little) as usize;
    let index = elf
        .elf_section_table()
        .section_by_name(Endianness::Little, name.as_bytes())
        .unwrap()
        .0
        .0;
    shoff + index * 64
}

#[test]
fn a_section_claiming_2_pow_60_bytes_is_an_error_not_an_allocation() {
    let mut bytes = this_binary();
    let sh = shdr_field(&mut bytes, ".dynsym");
    // sh_size is at offset 32 of an ELF64 section header.
    bytes[sh + 32..sh + 40].copy_from_slice(&(1u64 << 60).to_le_bytes());
    let e = ElfImage::from_bytes(Path::new("huge.so"), &bytes).unwrap_err();
    let msg = format!("{e:#}");
    assert!(msg.contains("huge.so is not a valid ELF object"), "{msg}");
    assert!(msg.contains("over dynprof's cap"), "{msg}");
}

#[test]
fn a_truncated_file_is_an_error() {
    let bytes = this_binary();
    for keep in [0, 3, 16, 63, 64, 1000, bytes.len() / 2, bytes.len() - 1] {
        let r = ElfImage::from_bytes(Path::new("cut.so"), &bytes[..keep]);
        // Section headers sit at the end: every cut loses them.
        let e = r.unwrap_err();
        assert!(format!("{e:#}").contains("cut.so"), "{keep}: {e:#}");
    }
}

#[test]
fn a_file_that_shrinks_while_read_is_an_error_not_a_crash() {
    let dir = std::env::temp_dir().join(format!("dynprof-elf-shrink-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("lib.so");
    std::fs::write(&path, this_binary()).unwrap();
    let f = rootfs::open_regular(&path).unwrap();
    // After fstat, before the reads: what a hostile target does.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(4096)
        .unwrap();
    let e = ElfImage::from_file(&path, f).unwrap_err();
    assert!(format!("{e:#}").contains("reading its"), "{e:#}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// MiniDebugInfo that is not xz (or is an xz bomb) is hidden from
/// blazesym, whose error would otherwise lose the file's `.dynsym` names
/// too; the file itself still reads.
#[test]
fn unreadable_minidebuginfo_is_hidden_not_fatal() {
    let mut bytes = this_binary();
    // `.gnu.version_r` has the same length as `.gnu_debugdata`: renamed,
    // its contents are a `.gnu_debugdata` that is not xz.
    let img = ElfImage::from_bytes(Path::new("t"), &bytes).unwrap();
    let file = img.file();
    let object::File::Elf64(elf) = &file else {
        panic!("ELF64 expected")
    };
    let table = elf.elf_section_table();
    let (_, sh) = table
        .section_by_name(Endianness::Little, b".gnu.version_r")
        .expect("the test binary has .gnu.version_r");
    let strtab = elf.elf_header().e_shstrndx.get(Endianness::Little) as usize;
    let names_off = table
        .section(object::SectionIndex(strtab))
        .unwrap()
        .sh_offset
        .get(Endianness::Little) as usize;
    let at = names_off + sh.sh_name.get(Endianness::Little) as usize;
    drop(file);
    bytes[at..at + 14].copy_from_slice(b".gnu_debugdata");

    let img = ElfImage::from_bytes(Path::new("bad-debugdata"), &bytes).unwrap();
    let file = img.file();
    let object::File::Elf64(elf) = &file else {
        panic!("ELF64 expected")
    };
    let table = elf.elf_section_table();
    assert!(
        table
            .section_by_name(Endianness::Little, b".gnu_debugdata")
            .is_none(),
        "the unreadable .gnu_debugdata is still visible in the copy"
    );
    assert!(!img.find_function("main").is_empty());
}

#[test]
fn minidebuginfo_over_the_cap_is_refused() {
    use std::io::Write as _;
    let mut enc = xz2::write::XzEncoder::new(Vec::new(), 6);
    enc.write_all(&vec![0u8; 3 << 20]).unwrap();
    let xz = enc.finish().unwrap();
    assert!(xz.len() < 4096, "{} bytes", xz.len());
    assert_eq!(super::debugdata::fits(&xz, 4 << 20).unwrap(), 3 << 20);
    let e = super::debugdata::fits(&xz, 2 << 20).unwrap_err();
    assert!(
        format!("{e:#}").contains("over dynprof's cap of 2 MiB"),
        "{e:#}"
    );
    assert!(super::debugdata::fits(b"not xz", 4 << 20).is_err());
}

/// The PLT sections found are the ones readelf lists, by file offset.
#[test]
fn plt_ranges_match_readelf() {
    let exe = std::env::current_exe().unwrap();
    let img = ElfImage::open(&exe).unwrap();
    let out = std::process::Command::new("readelf")
        .arg("-SW")
        .arg(&exe)
        .output()
        .expect("readelf (binutils)");
    let text = String::from_utf8(out.stdout).unwrap();
    // `[13] .plt  PROGBITS  000000000000b020 00b020 000560 10 AX 0 0 16`
    let mut want: Vec<std::ops::Range<u64>> = text
        .lines()
        .filter_map(|l| {
            let l = l.split_once(']')?.1;
            let f: Vec<&str> = l.split_whitespace().collect();
            let name = *f.first()?;
            [".plt", ".plt.sec", ".plt.got", ".iplt"]
                .contains(&name)
                .then(|| {
                    let off = u64::from_str_radix(f[3], 16).unwrap();
                    let size = u64::from_str_radix(f[4], 16).unwrap();
                    off..off + size
                })
        })
        .collect();
    assert!(!want.is_empty(), "readelf lists no PLT section:\n{text}");
    let mut got = img.plt_ranges();
    want.sort_by_key(|r| r.start);
    got.sort_by_key(|r| r.start);
    assert_eq!(got, want);
}

#[test]
fn debuglinks_are_plain_names_with_their_crc() {
    let link = |name: &[u8], crc: [u8; 4]| {
        let mut v = name.to_vec();
        v.push(0);
        while !v.len().is_multiple_of(4) {
            v.push(0);
        }
        v.extend_from_slice(&crc);
        v
    };
    assert_eq!(
        parse_debuglink(&link(b"libfoo.so.debug", [0x78, 0x56, 0x34, 0x12]), true),
        Some(DebugLink {
            name: "libfoo.so.debug".to_string(),
            crc: 0x1234_5678
        })
    );
    // Four bytes of name: a whole word of padding after the NUL.
    assert_eq!(
        parse_debuglink(&link(b"abcd", [0x12, 0x34, 0x56, 0x78]), false),
        Some(DebugLink {
            name: "abcd".to_string(),
            crc: 0x1234_5678
        })
    );
    for bad in [
        &b"../../etc/shadow"[..],
        b"a/b.debug",
        b"..",
        b".",
        b"",
        b"x\nb",
    ] {
        assert_eq!(
            parse_debuglink(&link(bad, [1, 2, 3, 4]), true),
            None,
            "{bad:?}"
        );
    }
    assert_eq!(
        parse_debuglink(&link(&[b'a'; 256], [1, 2, 3, 4]), true),
        None
    );
    // No NUL, or no room for the CRC.
    assert_eq!(parse_debuglink(b"name.debug", true), None);
    assert_eq!(parse_debuglink(b"ab\0\0\x01\x02", true), None);
}

#[test]
fn cfi_prefers_the_table_that_covers_the_code() {
    let eh = |n: usize| Some((0x1000..0x1000 + n as u64, vec![0u8; n].into()));
    let hdr = Some((0x900..0x924, vec![0u8; 0x24].into()));
    // -fno-asynchronous-unwind-tables -g: the C runtime's .eh_frame is
    // smaller than the code's .debug_frame.
    let c = Cfi::choose(eh(0x88), hdr.clone(), Some(vec![0; 0x290].into())).unwrap();
    assert_eq!(c.name(), ".debug_frame");
    // The usual build: .eh_frame only, or a larger .eh_frame.
    let c = Cfi::choose(eh(0x4000), hdr.clone(), None).unwrap();
    assert!(matches!(c, Cfi::EhFrame { hdr: Some(_), .. }));
    let c = Cfi::choose(eh(0x4000), None, Some(vec![0; 0x100].into())).unwrap();
    assert_eq!(c.name(), ".eh_frame");
    // Either alone; neither.
    assert_eq!(
        Cfi::choose(None, None, Some(vec![0; 8].into()))
            .unwrap()
            .name(),
        ".debug_frame"
    );
    assert!(Cfi::choose(None, hdr, None).is_none());
}

#[test]
fn the_symbol_snapshot_holds_the_symbol_tables_but_not_the_unwind_tables() {
    let exe = std::env::current_exe().unwrap();
    let img = ElfImage::open(&exe).unwrap();
    let file = img.file();
    let range = |name: &str| {
        let (off, size) = file.section_by_name(name).unwrap().file_range().unwrap();
        off..off + size
    };
    let (eh, symtab) = (range(".eh_frame"), range(".symtab"));
    assert!(img.unwind_sections().is_some(), "the unwinder's tables");
    let pieces: Vec<std::ops::Range<u64>> = img
        .sparse()
        .symbol_chunks()
        .map(|(o, b)| o..o + b.len() as u64)
        .collect();
    assert!(
        pieces
            .iter()
            .any(|p| p.start <= symtab.start && symtab.end <= p.end),
        ".symtab {symtab:?} not among {pieces:?}"
    );
    assert!(
        pieces
            .iter()
            .all(|p| p.end <= eh.start || p.start >= eh.end),
        ".eh_frame {eh:?} copied: {pieces:?}"
    );
}
