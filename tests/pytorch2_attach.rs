//! `dynprof attach --marker auto` on PyTorch 2.x, from the venv that
//! `cargo xtask setup` installs once into a cache outside the checkout
//! (xtask/src/setup.rs, `torch2_venv`): `$DYNPROF_TORCH2_VENV`, by default
//! /var/cache/dynprof/venv-torch2. `DYNPROF_TORCH2_PYTHON` names another
//! interpreter. `cargo xtask test` sets both that and DYNPROF_REQUIRE_TORCH2=1,
//! so in CI a missing venv fails these tests; a plain `cargo test` without the
//! venv prints a LOUD skip line and passes.
#[path = "attach_util.rs"]
mod attach_util;
mod common;

use std::{path::PathBuf, time::Duration};

use attach_util::*;

const T: Duration = Duration::from_secs(600);

/// Same default as `TORCH2_VENV_DEFAULT` in xtask/src/setup.rs
/// (xtask/tests/doc_links.rs checks that they agree).
const TORCH2_VENV_DEFAULT: &str = "/var/cache/dynprof/venv-torch2";

fn torch2_python(test: &str) -> Option<String> {
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

fn check_version(py: &str) -> String {
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

#[test]
fn pytorch2_auto_sgd_grad_accumulation() {
    require_privileges!();
    let Some(py) = torch2_python("pytorch2_auto_sgd_grad_accumulation") else {
        return;
    };
    let v = check_version(&py);
    let (run, _) = torch_auto(
        &py,
        "pytorch2_attach-sgd-accum",
        &["--optimizer", "sgd", "--accum", "3"],
        T,
    );
    assert_eq!(
        aux_per_step(run.summary(), "backward"),
        3.0,
        "torch {v}: {}",
        run.summary()
    );
}

#[test]
fn pytorch2_auto_adam_dataloader() {
    require_privileges!();
    let Some(py) = torch2_python("pytorch2_auto_adam_dataloader") else {
        return;
    };
    let v = check_version(&py);
    let (run, _) = torch_auto(
        &py,
        "pytorch2_attach-adam-dl",
        &["--optimizer", "adam", "--dataloader"],
        T,
    );
    assert_eq!(
        aux_per_step(run.summary(), "backward"),
        1.0,
        "torch {v}: {}",
        run.summary()
    );
}
