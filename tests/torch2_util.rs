//! Helpers for the PyTorch 2.x tests (`#[path = "torch2_util.rs"] mod torch2_util;`):
//! the interpreter of the tests, from the venv that `cargo
//! xtask setup` installs once into a cache outside the checkout
//! (xtask/src/setup.rs, `torch2_venv`): `$DYNPROF_TORCH2_VENV`, by default
//! /var/cache/dynprof/venv-torch2. `DYNPROF_TORCH2_PYTHON` names another
//! interpreter. `cargo xtask test` sets both that and
//! DYNPROF_REQUIRE_TORCH2=1, so in CI a missing venv fails the tests that
//! use it; a plain `cargo test` without the venv prints a LOUD skip line
//! and passes.
#![allow(dead_code, unreachable_pub)] // shared by two test crates; each uses a part

use std::path::PathBuf;

/// Same default as `TORCH2_VENV_DEFAULT` in xtask/src/setup.rs
/// (xtask/tests/doc_links.rs checks that they agree).
const TORCH2_VENV_DEFAULT: &str = "/var/cache/dynprof/venv-torch2";

pub fn torch2_python(test: &str) -> Option<String> {
    let py = std::env::var("DYNPROF_TORCH2_PYTHON").unwrap_or_else(|_| {
        let venv = std::env::var("DYNPROF_TORCH2_VENV")
            .ok()
            .filter(|d| !d.is_empty())
            .unwrap_or_else(|| TORCH2_VENV_DEFAULT.into());
        format!("{venv}/bin/python")
    });
    if PathBuf::from(&py).exists() {
        return Some(py);
    }
    if std::env::var("DYNPROF_REQUIRE_TORCH2").is_ok_and(|v| v == "1") {
        panic!(
            "{test}: {py} is missing and DYNPROF_REQUIRE_TORCH2=1 forbids skipping; \
             `cargo xtask setup` installs it"
        );
    }
    use std::io::Write as _;
    let _ = writeln!(
        std::io::stderr(),
        "\n!!!!!!!! SKIPPED (no PyTorch 2.x venv at {py}; `cargo xtask setup` installs it, see docs/attach.md): {test} !!!!!!!!\n"
    );
    None
}

pub fn check_version(py: &str) -> String {
    let out = std::process::Command::new(py)
        .args(["-c", "import torch; print(torch.__version__)"])
        .output()
        .expect("running the torch 2 python");
    let v = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        v.starts_with('2'),
        "{py} has torch {v:?}, not 2.x: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    v
}
