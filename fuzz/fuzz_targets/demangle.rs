//! Symbol names from the target's ELF files: C++ demangling and the
//! parameter-stripping that `--marker` matching does on them.
#![no_main]

use dynprof::symbols::elf;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let name = String::from_utf8_lossy(data);
    let full = elf::demangle(&name);
    let _ = elf::strip_params(&full);
    let _ = elf::strip_params(&name);
});
