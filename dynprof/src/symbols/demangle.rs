//! Demangling under caps: symbol names come from files the target controls.
//!
//! Itanium mangling compresses repeated types with back-references, so a
//! 200-byte name can stand for a demangled text that doubles at each
//! reference (`pair<pair<…>, pair<…>>`): one such name kept cpp_demangle
//! busy for a third of a second, and 100 of them made `--marker auto` take
//! 33.6 s. Each name is therefore demangled only when it is short enough,
//! with a recursion limit, and into a writer that stops at a fixed length.
use std::fmt;

/// Mangled names longer than this are left mangled (libtorch's longest is
/// ~3 KiB).
pub const MAX_MANGLED: usize = 16 << 10;
/// Demangled text beyond this stops the demangler.
pub const MAX_DEMANGLED: usize = 64 << 10;
/// Nesting depth for parsing and printing (cpp_demangle's default is higher).
pub const RECURSION_LIMIT: u32 = 64;

/// A `fmt::Write` that fails once `cap` bytes are written: the demangler
/// stops at the first write past it instead of producing the rest.
struct Capped {
    out: String,
    cap: usize,
}

impl fmt::Write for Capped {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if self.out.len() + s.len() > self.cap {
            return Err(fmt::Error);
        }
        self.out.push_str(s);
        Ok(())
    }
}

/// A C++ (Itanium) name demangled, with libstdc++'s string type written
/// `std::string`; `None` for other names and names over the caps.
pub fn cpp(name: &str) -> Option<String> {
    if !name.starts_with("_Z") || name.len() > MAX_MANGLED {
        return None;
    }
    let parse = cpp_demangle::ParseOptions::default().recursion_limit(RECURSION_LIMIT);
    let sym = cpp_demangle::Symbol::new_with_options(name, &parse).ok()?;
    let opts = cpp_demangle::DemangleOptions::default().recursion_limit(RECURSION_LIMIT);
    let mut w = Capped {
        out: String::new(),
        cap: MAX_DEMANGLED,
    };
    sym.structured_demangle(&mut w, &opts).ok()?;
    Some(
        w.out
            .replace(
                "std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >",
                "std::string",
            )
            .replace(
                "std::basic_string<char, std::char_traits<char>, std::allocator<char> >",
                "std::string",
            ),
    )
}

/// A frame name for a flame graph: Rust (legacy or v0, without the hash),
/// then C++, else the name as it is.
pub fn frame(name: &str) -> String {
    if name.len() <= MAX_MANGLED
        && (name.starts_with("_R") || name.starts_with("_ZN"))
        && let Ok(d) = rustc_demangle::try_demangle(name)
    {
        // rustc-demangle bounds its own output and recursion.
        let mut w = Capped {
            out: String::new(),
            cap: MAX_DEMANGLED,
        };
        if fmt::write(&mut w, format_args!("{d:#}")).is_ok() {
            return w.out;
        }
    }
    cpp(name).unwrap_or_else(|| name.to_string())
}

/// A mangled name whose demangled text doubles with each back-reference:
/// `PREFIX(pair<int,int>, pair<pair<int,int>,pair<int,int>>, …)`, the kind
/// of name a hostile library carries (for tests and the fuzzer).
/// `prefix` is `_Z` and a name, e.g. `_ZN5train4stepE`, which itself adds
/// `prefix_subs` substitution candidates (`train` here: 1). With `levels`
/// = 40 the full text would be terabytes.
pub fn doubling_name(prefix: &str, prefix_subs: usize, levels: usize) -> String {
    // `S_` is candidate 0, `S0_` candidate 1, `S1_` 2…, in base 36.
    let sref = |i: usize| {
        if i == 0 {
            return "S_".to_string();
        }
        let (mut n, mut digits) = (i - 1, Vec::new());
        loop {
            digits.push(b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"[n % 36]);
            n /= 36;
            if n == 0 {
                break;
            }
        }
        digits.reverse();
        format!("S{}_", String::from_utf8(digits).unwrap_or_default())
    };
    let p = prefix_subs;
    // std::pair is candidate p, pair<int,int> p+1, level k adds p+2+k.
    let mut s = format!("{prefix}St4pairIiiE");
    for k in 0..levels {
        let r = sref(p + 1 + k);
        s.push_str(&format!("{}I{r}{r}E", sref(p)));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinary_names() {
        assert_eq!(
            cpp("_ZN5torch8autograd6Engine7executeEv").as_deref(),
            Some("torch::autograd::Engine::execute()")
        );
        assert_eq!(
            cpp("_ZN3foo3barERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE").as_deref(),
            Some("foo::bar(std::string const&)")
        );
        assert_eq!(cpp("main"), None);
        assert_eq!(frame("main"), "main");
        assert_eq!(
            frame("_ZN4core3ptr13drop_in_place17h0123456789abcdefE"),
            "core::ptr::drop_in_place"
        );
    }

    #[test]
    fn a_doubling_name_stops_at_the_cap() {
        let small = doubling_name("_Z1f", 0, 3);
        let text = cpp(&small).expect("3 levels demangle");
        assert_eq!(
            text,
            "f(std::pair<int, int>, std::pair<std::pair<int, int>, std::pair<int, int> >, \
             std::pair<std::pair<std::pair<int, int>, std::pair<int, int> >, \
             std::pair<std::pair<int, int>, std::pair<int, int> > >, \
             std::pair<std::pair<std::pair<std::pair<int, int>, std::pair<int, int> >, \
             std::pair<std::pair<int, int>, std::pair<int, int> > >, \
             std::pair<std::pair<std::pair<int, int>, std::pair<int, int> >, \
             std::pair<std::pair<int, int>, std::pair<int, int> > > >)"
        );
        let named = cpp(&doubling_name("_ZN5train4stepE", 1, 1)).unwrap();
        assert_eq!(
            named,
            "train::step(std::pair<int, int>, std::pair<std::pair<int, int>, std::pair<int, int> >)"
        );
        // 40 levels: 2^40 `int`s. Uncapped this never returns.
        let huge = doubling_name("_Z1f", 0, 40);
        assert!(huge.len() < 600, "{}", huge.len());
        assert_eq!(cpp(&huge), None);
        assert_eq!(frame(&huge), huge);
    }

    #[test]
    fn over_long_names_stay_mangled() {
        let long = format!("_Z{}", "a".repeat(MAX_MANGLED));
        assert_eq!(cpp(&long), None);
    }
}
