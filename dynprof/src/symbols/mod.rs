//! ELF symbols, C++ demangling, USDT notes and build ids.
pub mod demangle;
pub mod elf;
pub mod usdt;

pub use elf::{ElfImage, SymbolHit};
