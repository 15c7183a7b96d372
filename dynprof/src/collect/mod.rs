//! Collectors, armed around windows by the window scheduler.
//!
//! Two kinds:
//! - [`Collector`]: built-in eBPF collectors (api, cpu, offcpu). Armed about
//!   one step before a window, gated in the kernel at the window's exact
//!   boundaries, detached after it. They see every event while armed and hand
//!   the window's share over as [`WindowData`].
//! - [`WindowHook`]: things driven at the boundaries themselves (msprof,
//!   torch_npu dynamic_profile, user hooks). They get the boundary as soon as
//!   user space learns of it and report metadata for `meta.json`.
pub mod api;
pub mod apis;
pub mod builtin;
pub mod cpu;
pub mod hooks;
pub mod msprof;
pub mod offcpu;
pub mod spill;
pub mod stacks;
pub mod symbolize;
pub mod torch_npu_dp;
pub mod vendor_args;

pub use builtin::{CollectArgs, CollectorOptions, build_collectors, parse_collect};

pub use crate::window::collector::{Collector, WindowHook, WindowInfo};
