//! The subcommands' implementations; `main.rs` only parses.
pub mod attach;
pub mod printer;
pub mod ps;
