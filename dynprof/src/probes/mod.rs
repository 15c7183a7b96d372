//! Markers: the grammar, framework presets, and resolution to file offsets.
pub mod insn;
pub mod presets;
pub mod resolve;
pub mod semaphore;
pub mod spec;

pub use resolve::{ResolvedProbe, attach_order, resolve_markers};
pub use spec::{MarkerArg, MarkerSpec, Role};
