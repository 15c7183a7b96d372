//! ELF symbols, C++ demangling, USDT notes and build ids; native unwinding.
pub mod demangle;
pub mod elf;
pub mod unwind;
pub mod usdt;

pub use elf::{ElfImage, SymbolHit};
