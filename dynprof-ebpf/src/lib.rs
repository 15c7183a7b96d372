#![no_std]
//! The eBPF programs live in `src/main.rs` (built for bpfel-unknown-none by
//! `dynprof/build.rs`); this empty library only lets `dynprof` name this
//! crate as a build dependency so cargo rebuilds it when it changes.
