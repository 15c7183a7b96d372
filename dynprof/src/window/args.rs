//! Plan and trigger flags shared by `attach` and `launch`.
use clap::Args;

#[derive(Args, Debug, Clone, Default)]
pub struct WindowArgs {}
