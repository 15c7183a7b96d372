//! Aux markers are attached only around windows: on real PyTorch (Debian's
//! python3-torch), `--marker auto`'s backward marker (Engine::execute) traps
//! on no idle step, and the window's steps still count exactly one backward
//! pass each.
mod common;
#[path = "windows_util.rs"]
mod windows_util;

use std::process::Command;

use common::*;
use windows_util::*;

/// `label N` from the console status line's `marker hits:` list.
fn hits_of(status: &str, label: &str) -> u64 {
    let list = status
        .split("marker hits:")
        .nth(1)
        .unwrap_or_else(|| panic!("no marker hits in {status:?}"));
    list.split(',')
        .map(str::trim)
        .find_map(|e| e.strip_prefix(label)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {label} in {status:?}"))
}

#[test]
fn aux_marker_traps_only_around_windows_on_pytorch() {
    require_privileges!();
    let fx = fixtures();
    let dir = scratch_dir("aux_windows_torch");
    let log = dir.join("torch.log");
    let out = dir.join("out");
    let p = Proc::spawn_ready(
        Command::new(PYTHON3)
            .arg(&fx.torch_train_py)
            .args(["--steps", "0", "--log"])
            .arg(&log),
    );
    wait_for_log_lines(&log, "step", 1, T);
    let pid = p.pid.to_string();
    let mut d = spawn(
        &[
            "attach",
            "--pid",
            &pid,
            "--marker",
            "auto",
            "--interactive",
            "-o",
            out.to_str().unwrap(),
        ],
        true,
    );
    d.wait_for("console ready", T);
    // Twenty idle steps with the markers attached.
    let have = log_lines_of(&log, "step").len();
    wait_for_log_lines(&log, "step", have + 20, T);
    d.send("status");
    let i = d.wait_for("marker hits", T);
    let idle = d.lines[i].1.clone();
    assert!(idle.contains("no window"), "{idle}");
    assert!(hits_of(&idle, "Optimizer.step") >= 20, "{idle}");
    assert_eq!(hits_of(&idle, "backward"), 0, "{}", d.transcript());

    d.send("capture 3");
    d.wait_for("window records steps", T);
    d.wait_for("window 1 written", T);
    let dirs = prof_dirs(&out);
    assert_eq!(dirs.len(), 1, "{}", d.transcript());
    let m = meta(&dirs[0]);
    assert_eq!(m["complete"], true, "{m}");
    assert_eq!(recorded(&m).len(), 3, "{m}");
    let csv = std::fs::read_to_string(dirs[0].join("steps.csv")).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let col = header
        .iter()
        .position(|h| *h == "aux_backward")
        .unwrap_or_else(|| panic!("no backward column: {csv}"));
    let rows: Vec<&str> = csv.lines().skip(1).collect();
    assert_eq!(rows.len(), 3, "{csv}");
    for row in rows {
        assert_eq!(row.split(',').nth(col), Some("1"), "{csv}");
    }
    d.send("quit");
    d.wait_for("detaching", T);
    assert!(d.wait_exit(T).success(), "{}", d.transcript());
}
