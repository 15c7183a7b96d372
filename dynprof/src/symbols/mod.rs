//! ELF symbols, C++ demangling, USDT notes and build ids; native unwinding
//! and CPython frames.
pub mod demangle;
pub mod elf;
pub mod python;
pub mod unwind;
pub mod usdt;

pub use elf::{ElfImage, SymbolHit};
