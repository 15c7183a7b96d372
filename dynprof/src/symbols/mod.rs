//! ELF symbols, C++ demangling, USDT notes and build ids; native unwinding
//! and CPython frames.
pub mod debug_files;
pub mod demangle;
pub mod elf;
pub mod perfmap;
pub mod python;
pub mod unwind;
pub mod usdt;

pub use elf::{DebugLink, ElfImage, SymbolHit};

/// Where a separate debug file of build id `id` is, relative to a debug
/// directory (`/usr/lib/debug` or `--debug-dir`): `.build-id/ab/cdef….debug`,
/// as GDB and blazesym look for it. `None` for an id that is not plain
/// hex of a sane length (it comes from the target's file).
pub fn build_id_path(id: &str) -> Option<std::path::PathBuf> {
    let ok = (4..=128).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_hexdigit());
    ok.then(|| {
        let id = id.to_ascii_lowercase();
        std::path::PathBuf::from(format!(".build-id/{}/{}.debug", &id[..2], &id[2..]))
    })
}

#[cfg(test)]
mod build_id_tests {
    use super::*;

    #[test]
    fn build_id_paths_follow_gdb_and_refuse_odd_ids() {
        assert_eq!(
            build_id_path("3F2a9c0b11").unwrap(),
            std::path::Path::new(".build-id/3f/2a9c0b11.debug")
        );
        assert_eq!(build_id_path("ab"), None);
        assert_eq!(build_id_path("../../etc/passwd"), None);
        assert_eq!(build_id_path(&"a".repeat(200)), None);
    }
}
