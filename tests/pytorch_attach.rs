//! `dynprof attach --marker auto` on real PyTorch (Debian's python3-torch
//! 1.13 under /usr/bin/python3; in the arm64 VM, bookworm's arm64 build:
//! `torch_python`), checked against tests/fixtures/torch_train.py's
//! own time.monotonic_ns() log: one step event per optimizer.step(), inside
//! that call's interval; backward passes counted as aux.
#[path = "attach_util.rs"]
mod attach_util;
mod common;

use std::time::Duration;

use attach_util::*;
use common::*;

fn torch13(tag: &str, args: &[&str]) -> Finished {
    torch_auto(torch_python(), tag, args, Duration::from_secs(300)).0
}

fn assert_torch13_marker(run: &Finished) {
    let m = &run.attached()["markers"][0];
    assert_eq!(
        m["symbol"], "c10::ivalue::ConstantString::create(std::string)",
        "{m}"
    );
}

#[test]
fn pytorch_auto_sgd() {
    require_privileges!();
    let run = torch13("pytorch_attach-sgd", &["--optimizer", "sgd"]);
    assert_torch13_marker(&run);
    assert_eq!(aux_per_step(run.summary(), "backward"), 1.0);
}

#[test]
fn pytorch_auto_adam() {
    require_privileges!();
    let run = torch13("pytorch_attach-adam", &["--optimizer", "adam"]);
    assert_torch13_marker(&run);
    assert_eq!(aux_per_step(run.summary(), "backward"), 1.0);
}

#[test]
fn pytorch_auto_grad_accumulation_4() {
    require_privileges!();
    let run = torch13("pytorch_attach-accum4", &["--accum", "4"]);
    // One step event per optimizer.step (checked in torch_auto), four
    // backward passes per step.
    assert_eq!(
        aux_per_step(run.summary(), "backward"),
        4.0,
        "{}",
        run.summary()
    );
}

#[test]
fn pytorch_auto_dataloader() {
    require_privileges!();
    let run = torch13(
        "pytorch_attach-dataloader",
        &["--dataloader", "--optimizer", "adam"],
    );
    assert_eq!(aux_per_step(run.summary(), "backward"), 1.0);
}
