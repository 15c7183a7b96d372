//! `dynprof attach --marker auto` on PyTorch 2.x, from the venv at
//! /opt/dynprof-torch2 (override with DYNPROF_TORCH2_PYTHON). The venv is not
//! part of `cargo xtask setup` (a ~5 GB, 5+ minute download; see
//! docs/attach.md for the one command that installs it). Without it these
//! tests print a LOUD skip line and pass, unless DYNPROF_REQUIRE_TORCH2=1.
#[path = "attach_util.rs"]
mod attach_util;
mod common;

use std::{path::PathBuf, time::Duration};

use attach_util::*;

const T: Duration = Duration::from_secs(600);

fn torch2_python(test: &str) -> Option<String> {
    let py = std::env::var("DYNPROF_TORCH2_PYTHON")
        .unwrap_or_else(|_| "/opt/dynprof-torch2/bin/python".into());
    if PathBuf::from(&py).exists() {
        return Some(py);
    }
    if std::env::var("DYNPROF_REQUIRE_TORCH2").is_ok_and(|v| v == "1") {
        panic!("{test}: {py} is missing and DYNPROF_REQUIRE_TORCH2=1 forbids skipping");
    }
    use std::io::Write as _;
    let _ = writeln!(
        std::io::stderr(),
        "\n!!!!!!!! SKIPPED (no PyTorch 2.x venv at {py}; see docs/attach.md to install it): {test} !!!!!!!!\n"
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
