//! The subcommands' implementations; `main.rs` only parses.
pub mod agent;
pub mod args;
pub mod attach;
pub mod driver;
pub mod job;
pub mod launch;
pub mod printer;
pub mod probe_cost;
pub mod ps;
