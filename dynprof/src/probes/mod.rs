//! Markers: the grammar, framework presets, and resolution to file offsets.
pub mod insn;
pub mod presets;
pub mod resolve;
pub mod semaphore;
pub mod spec;

pub use resolve::{
    FileCache, ResolvedProbe, attach_order, resolve_markers, resolve_markers_cached,
};
pub use spec::{MarkerArg, MarkerSpec, Role};
