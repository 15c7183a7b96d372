//! Finding functions by name in an [`ElfImage`]'s symbol tables: by the
//! mangled name, the full demangled signature or the demangled name
//! without parameters, demangling under a time budget (a hostile file can
//! make demangling slow).
use std::time::Instant;

use object::{Object, ObjectSymbol, SymbolKind};

use super::{ElfImage, Sparse, SymbolHit, limits};
use crate::symbols::demangle;

impl ElfImage {
    /// Finds defined function symbols named `spec`: the mangled name, the
    /// full demangled signature, or the demangled name without parameters.
    /// Duplicates (.symtab and .dynsym both list most symbols) are merged.
    ///
    /// Demangling is what a hostile file can make slow (names whose
    /// demangled form doubles at each level): each name is demangled under
    /// [`demangle`]'s caps, and all of them under [`limits::DEMANGLE_TIME`];
    /// names left once that runs out are compared mangled only, with a warning.
    pub fn find_function(&self, spec: &str) -> Vec<SymbolHit> {
        self.find_functions(&[spec]).pop().unwrap_or_default()
    }

    /// [`Self::find_function`] for several names in one pass over the
    /// symbol tables (libtorch_cpu's take milliseconds per pass); one list
    /// of hits per name, in order. A name that is a candidate for several
    /// specs is demangled once.
    pub fn find_functions(&self, specs: &[&str]) -> Vec<Vec<SymbolHit>> {
        let file = self.file();
        self.find_in(specs, file.symbols().chain(file.dynamic_symbols()))
    }

    /// [`Self::find_functions`] among the exported functions only (the
    /// dynamic symbol table): a library's API. PyTorch 2.x's libtorch_cpu
    /// exports 75k symbols and has 620k in all; the full look took 80 ms
    /// (1.1 s in a debug build), this one a tenth.
    pub fn find_exported_functions(&self, specs: &[&str]) -> Vec<Vec<SymbolHit>> {
        self.find_in(specs, self.file().dynamic_symbols())
    }

    fn find_in<'f>(
        &self,
        specs: &[&str],
        symbols: impl Iterator<Item = object::read::Symbol<'f, 'f, &'f Sparse>>,
    ) -> Vec<Vec<SymbolHit>> {
        let needles: Vec<Vec<String>> = specs.iter().map(|s| mangled_needles(s)).collect();
        // Per spec: (mangled, vaddr, demangled when already known)
        let mut found: Vec<Vec<(&str, u64, Option<String>)>> = vec![Vec::new(); specs.len()];
        // (mangled, vaddr, the specs it may be)
        let mut to_demangle: Vec<(&str, u64, Vec<usize>)> = Vec::new();
        for sym in symbols {
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
            let mut maybe = Vec::new();
            for (i, spec) in specs.iter().enumerate() {
                if name == *spec {
                    found[i].push((name, sym.address(), None));
                } else if name.starts_with("_Z")
                    && needles[i].iter().all(|n| name.contains(n.as_str()))
                {
                    maybe.push(i);
                }
            }
            if !maybe.is_empty() {
                to_demangle.push((name, sym.address(), maybe));
            }
        }
        // Shortest first under the time budget: a file cannot hide a real
        // name behind many long crafted ones.
        to_demangle.sort_by_key(|(n, a, _)| (n.len(), *a));
        let deadline = Instant::now() + limits::DEMANGLE_TIME;
        let mut skipped = vec![0usize; specs.len()];
        for (name, vaddr, maybe) in to_demangle {
            if Instant::now() >= deadline {
                for i in maybe {
                    skipped[i] += 1;
                }
                continue;
            }
            let Some(full) = demangle::cpp(name) else {
                continue;
            };
            for i in maybe {
                if full == specs[i] || strip_params(&full) == specs[i] {
                    found[i].push((name, vaddr, Some(full.clone())));
                }
            }
        }
        for (spec, skipped) in specs.iter().zip(skipped).filter(|(_, n)| *n > 0) {
            log::warn!(
                "{}: demangling took over {} s; {skipped} candidate names for `{spec}` were not \
                 demangled (the longest ones; name the function by its mangled name to reach them)",
                self.path.display(),
                limits::DEMANGLE_TIME.as_secs()
            );
        }
        found
            .into_iter()
            .map(|found| {
                let mut hits: Vec<SymbolHit> = Vec::new();
                for (name, vaddr, demangled) in found {
                    if hits.iter().any(|h| h.vaddr == vaddr) {
                        continue;
                    }
                    if let Some(file_offset) = self.vaddr_to_offset(vaddr) {
                        hits.push(SymbolHit {
                            mangled: name.to_string(),
                            demangled: demangled.unwrap_or_else(|| demangle(name)),
                            vaddr,
                            file_offset,
                        });
                    }
                }
                hits
            })
            .collect()
    }
}

/// Demangles a C++ (Itanium) name, writing libstdc++'s string type as
/// `std::string` the way people write it; returns other names, and names
/// over [`demangle`]'s caps, unchanged.
pub fn demangle(name: &str) -> String {
    demangle::cpp(name).unwrap_or_else(|| name.to_string())
}

/// `foo.cold`, `foo.cold.12`: a function's cold-path fragment.
pub(super) fn is_cold_fragment(name: &str) -> bool {
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
pub(super) fn mangled_needles(spec: &str) -> Vec<String> {
    strip_params(spec)
        .split("::")
        .filter(|p| !p.is_empty() && p.chars().all(|c| c.is_alphanumeric() || c == '_'))
        .map(|p| format!("{}{}", p.len(), p))
        .collect()
}
