//! Symbol lookup in one ELF object, by mangled or demangled name.
use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use object::{Object, ObjectSegment, ObjectSymbol, SymbolKind};

/// A function symbol found in an object, with the file offset uprobes need.
#[derive(Clone, Debug)]
pub struct SymbolHit {
    pub mangled: String,
    pub demangled: String,
    pub vaddr: u64,
    pub file_offset: u64,
}

/// An ELF file mapped read-only (through the target's mount namespace).
///
/// Mapped rather than read: libtorch_cpu is 120–450 MB and only its symbol
/// tables and program headers are touched, so reading it whole dominated
/// attach time.
pub struct ElfImage {
    pub path: PathBuf,
    data: memmap2::Mmap,
}

impl ElfImage {
    pub fn open(path: &Path) -> Result<Self> {
        let file =
            fs::File::open(path).with_context(|| format!("opening ELF {}", path.display()))?;
        // SAFETY: a mapped library is not truncated while the target runs it;
        // dynprof only reads the mapping.
        let data = unsafe { memmap2::Mmap::map(&file) }
            .with_context(|| format!("mapping ELF {}", path.display()))?;
        object::File::parse(&*data)
            .with_context(|| format!("{} is not a valid ELF object", path.display()))?;
        Ok(Self {
            path: path.to_path_buf(),
            data,
        })
    }

    pub fn file(&self) -> object::File<'_> {
        // Parsed once in `open`, so this cannot fail.
        object::File::parse(&*self.data).expect("validated in ElfImage::open")
    }

    pub fn build_id(&self) -> Option<String> {
        let id = self.file().build_id().ok()??;
        Some(id.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// Translates a virtual address to a file offset through the PT_LOAD
    /// segment containing it (what the kernel's uprobe API takes).
    pub fn vaddr_to_offset(&self, vaddr: u64) -> Option<u64> {
        self.file().segments().find_map(|seg| {
            let (start, size) = (seg.address(), seg.size());
            let (file_off, _) = seg.file_range();
            // Checked: the file's program headers may claim any address and
            // size, e.g. a segment that ends past 2^64.
            let delta = vaddr.checked_sub(start).filter(|d| *d < size)?;
            file_off.checked_add(delta)
        })
    }

    /// Finds defined function symbols named `spec`: the mangled name, the
    /// full demangled signature, or the demangled name without parameters.
    /// Duplicates (.symtab and .dynsym both list most symbols) are merged.
    pub fn find_function(&self, spec: &str) -> Vec<SymbolHit> {
        let file = self.file();
        let needles = mangled_needles(spec);
        let mut hits: Vec<SymbolHit> = Vec::new();
        for sym in file.symbols().chain(file.dynamic_symbols()) {
            if sym.kind() != SymbolKind::Text || sym.is_undefined() || sym.address() == 0 {
                continue;
            }
            let Ok(name) = sym.name() else { continue };
            // Strip symbol versions such as `foo@@GLIBC_2.2.5`.
            let name = name.split('@').next().unwrap_or(name);
            // GCC's `foo.cold` (demangled `foo() [clone .cold]`) is the
            // unlikely-path fragment split off `foo`, not an entry point: a
            // probe there never marks a call, and counting it as a second
            // candidate made step markers on such functions "ambiguous".
            if is_cold_fragment(name) {
                continue;
            }
            let matched = if name == spec {
                Some(demangle(name))
            } else if name.starts_with("_Z") && needles.iter().all(|n| name.contains(n.as_str())) {
                let full = demangle(name);
                (full == spec || strip_params(&full) == spec).then_some(full)
            } else {
                None
            };
            if let Some(demangled) = matched {
                if hits.iter().any(|h| h.vaddr == sym.address()) {
                    continue;
                }
                if let Some(file_offset) = self.vaddr_to_offset(sym.address()) {
                    hits.push(SymbolHit {
                        mangled: name.to_string(),
                        demangled,
                        vaddr: sym.address(),
                        file_offset,
                    });
                }
            }
        }
        hits
    }

    pub fn data(&self) -> &[u8] {
        &self.data
    }
}

/// Demangles a C++ (Itanium) name, writing libstdc++'s string type as
/// `std::string` the way people write it; returns other names unchanged.
pub fn demangle(name: &str) -> String {
    if let Ok(sym) = cpp_demangle::Symbol::new(name)
        && let Ok(s) = sym.demangle(&cpp_demangle::DemangleOptions::default())
    {
        return s
            .replace(
                "std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >",
                "std::string",
            )
            .replace(
                "std::basic_string<char, std::char_traits<char>, std::allocator<char> >",
                "std::string",
            );
    }
    name.to_string()
}

/// `foo.cold`, `foo.cold.12`: a function's cold-path fragment.
fn is_cold_fragment(name: &str) -> bool {
    name.ends_with(".cold") || name.contains(".cold.")
}

/// `ns::Class::f(int, char)` → `ns::Class::f`.
pub fn strip_params(demangled: &str) -> &str {
    let mut depth = 0i32;
    for (i, c) in demangled.char_indices() {
        match c {
            '<' => depth += 1,
            '>' => depth -= 1,
            '(' if depth == 0 && i > 0 => return &demangled[..i],
            _ => {}
        }
    }
    demangled
}

/// Cheap pre-filter: every identifier of a demangled spec appears in the
/// mangled name as `<len><ident>`. Demangling all of libtorch's ~10^5 symbols
/// would take seconds; this keeps resolution well under a second.
fn mangled_needles(spec: &str) -> Vec<String> {
    strip_params(spec)
        .split("::")
        .filter(|p| !p.is_empty() && p.chars().all(|c| c.is_alphanumeric() || c == '_'))
        .map(|p| format!("{}{}", p.len(), p))
        .collect()
}

pub fn require_elf(path: &Path) -> Result<()> {
    if !path.exists() {
        bail!("{} does not exist", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
        fs::write(&path, &b).unwrap();
        path
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
        fs::remove_file(&path).unwrap();
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
    }
}
