//! dynprof: attach to a running AI job by PID, find its training-step
//! boundaries with uprobes, and collect exactly at those boundaries.
//!
//! Data flows one way, and a module only imports the ones before it:
//! `sys`/`types` → `target` (/proc) → `symbols`/`probes` (ELF, USDT) →
//! `output::model` → `bpf` (the kernel side, `dynprof-ebpf`: count, gate,
//! emit) → `session` (event loop, step clock) → `window` (plans, triggers,
//! scheduler, and the [`window::collector`] contract it drives) → `collect`
//! (the collectors and hooks implementing it) → `discover`/`commands`.
//! No module imports one that imports it back.
// Every dependency of the library is used by it (the binary and the test
// crates share the manifest, so the lint is set here, not workspace-wide).
#![warn(unused_crate_dependencies)]
// The binary's logger (main.rs); the library only logs through `log`.
use env_logger as _;
// A dev-dependency of tests/deploy_manifests.rs, not of the unit tests.
#[cfg(test)]
use serde_yaml as _;

pub mod agent;
pub mod bpf;
pub mod cli;
pub mod collect;
pub mod commands;
pub mod compat;
pub mod discover;
pub mod job;
pub mod output;
pub mod probes;
pub mod report;
pub mod session;
pub mod symbols;
pub mod sys;
pub mod target;
pub mod types;
pub mod window;
