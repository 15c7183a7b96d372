//! `cargo xtask bench`: benchmarks. Not implemented yet.

use anyhow::Result;

pub fn run(_args: &[String]) -> Result<()> {
    println!("cargo xtask bench: not implemented yet");
    std::process::exit(1);
}
