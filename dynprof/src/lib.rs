//! dynprof: attach to a running AI job by PID, find its training-step
//! boundaries with uprobes, and collect exactly at those boundaries.
//!
//! Data flows one way: `target` (/proc) → `symbols`/`probes` (ELF, USDT) →
//! kernel (`dynprof-ebpf`: count, gate, emit) → `session` (event loop, step
//! clock) → `window` (plans, scheduler) → `collect` → `output`.
pub mod bpf;
pub mod cli;
pub mod collect;
pub mod commands;
pub mod job;
pub mod output;
pub mod probes;
pub mod session;
pub mod symbols;
pub mod sys;
pub mod target;
pub mod trigger;
pub mod types;
pub mod window;
