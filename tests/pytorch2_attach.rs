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
#[path = "torch2_util.rs"]
mod torch2_util;

use std::time::Duration;

use attach_util::*;
use torch2_util::{check_version, torch2_python};

const T: Duration = Duration::from_secs(600);

#[test]
fn pytorch2_auto_sgd_grad_accumulation() {
    require_privileges!();
    let Some(py) = torch2_python("pytorch2_auto_sgd_grad_accumulation") else {
        return;
    };
    let v = check_version(&py);
    let (run, _) = torch_auto(
        std::process::Command::new(&py),
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
        std::process::Command::new(&py),
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

/// Issue 15's PyTorch 2.x check: a ResNet-18 training script
/// (tests/fixtures/resnet_train.py, torchvision's model on synthetic
/// images) in a 20-step, 499 Hz cpu window. Before JIT frames were
/// unwound, 65 % of its samples ended in a bare `[unknown]` with only
/// Python frames above it (oneDNN's kernels run from anonymous memory).
/// Now: almost no sample lacks a module or loses its stack, most are
/// under the script's own training loop, and a sample in JIT code shows
/// the native frames that called it.
#[test]
fn pytorch2_resnet_cpu_window_stacks() {
    require_privileges!();
    let Some(py) = torch2_python("pytorch2_resnet_cpu_window_stacks") else {
        return;
    };
    let v = check_version(&py);
    let dir = common::scratch_dir("pytorch2_resnet_cpu_window_stacks");
    let log = dir.join("steps.log");
    let mut p = common::Proc::spawn_ready(
        std::process::Command::new(&py)
            .arg(common::workspace_root().join("tests/fixtures/resnet_train.py"))
            .arg("--log")
            .arg(&log),
    );
    common::wait_for_log_lines(&log, "step", 1, T);
    let out = dir.join("out");
    let o = std::process::Command::new(common::dynprof_bin())
        .args(["attach", "--pid", &p.pid.to_string(), "--marker", "auto"])
        .args(["--collect", "cpu", "--cpu-hz", "499"])
        .args(["--start-step", "3", "--warmup", "0", "--active", "20"])
        .arg("-o")
        .arg(&out)
        .output()
        .expect("running dynprof");
    p.terminate();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "dynprof attach failed: {stderr}");
    let (win, stacks) = common::window_folded(&out, "cpu", &stderr);
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(win.join("meta.json")).unwrap()).unwrap();
    let stack_drops = meta["drops"]["cpu_stack"]
        .as_u64()
        .expect("drops.cpu_stack");

    let count = |f: &dyn Fn(&[String]) -> bool| -> u64 {
        stacks.iter().filter(|(s, _)| f(s)).map(|s| s.1).sum()
    };
    let total = count(&|_| true);
    let no_module = count(&|s| s.last().is_some_and(|f| f == "[unknown]"));
    // A bare `[unknown]` anywhere: the native chain broke there (the
    // Python frames are then spliced at the root, above the break).
    let broken = count(&|s| s.iter().any(|f| f == "[unknown]"));
    let lost = count(&|s| s.iter().any(|f| f.starts_with("[lost")));
    let in_loop = count(&|s| s.iter().any(|f| f.starts_with("[py] train_step ")));
    let in_jit = count(&|s| s.last().is_some_and(|f| f == "[jit]"));
    // A JIT sample whose caller was found has a native frame (a oneDNN or
    // torch function) right above the JIT frame, not a Python frame.
    let jit_with_caller = count(&|s| {
        s.len() >= 2
            && s[s.len() - 1] == "[jit]"
            && !s[s.len() - 2].starts_with("[py]")
            && s.iter()
                .any(|f| f.starts_with("dnnl") || f.starts_with("at::"))
    });
    eprintln!(
        "torch {v}: {total} samples; no module {no_module}, broken chain {broken}, lost {lost}, \
         under train_step {in_loop}, in JIT code {in_jit} ({jit_with_caller} with their native \
         callers); stack ids dropped {stack_drops}"
    );
    let mut top: Vec<_> = stacks.iter().collect();
    top.sort_by_key(|s| std::cmp::Reverse(s.1));
    for (s, n) in top.iter().take(8) {
        eprintln!("  {n:5} {}", s.join(";"));
    }
    assert!(total >= 100, "too few samples ({total}): {stderr}");
    assert!(
        no_module as f64 <= 0.05 * total as f64,
        "{no_module} of {total} samples end in a frame with no module"
    );
    assert!(
        broken as f64 <= 0.05 * total as f64,
        "{broken} of {total} samples have a broken native chain"
    );
    assert!(
        lost as f64 <= 0.05 * total as f64,
        "{lost} of {total} samples lost their stacks"
    );
    // Stack ids the kernel could not store (`STACKS` bucket collisions),
    // as meta.json reports them: rare, now that samples with a stack copy
    // no longer store a frame-pointer user stack.
    assert!(
        stack_drops as f64 <= 0.01 * total as f64,
        "{stack_drops} stack ids dropped for {total} samples"
    );
    assert!(
        in_loop as f64 >= 0.8 * total as f64,
        "only {in_loop} of {total} samples are under [py] train_step"
    );
    // This model spends much of its time in oneDNN's JIT kernels.
    assert!(in_jit > 0, "no sample in JIT code: {top:?}");
    assert!(
        jit_with_caller as f64 >= 0.9 * in_jit as f64,
        "{jit_with_caller} of {in_jit} JIT samples show the native code that called them"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
