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

    // Far enough ahead that no boundary passes while the aux marker is
    // attached (dynprof would mark the window incomplete if one did).
    d.send("capture 3 warmup 50");
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

/// Windows far apart on the C trainer (3 backward passes per step): the
/// aux marker is attached and detached around each of them, with and
/// without attach cookies (the no-cookie path registers its address again
/// each time), and every recorded step counts exactly 3.
fn repeated_windows(tag: &str, env: Option<(&str, &str)>) {
    let dir = scratch_dir(tag);
    let log = dir.join("trainer.log");
    let out = dir.join("out");
    let p = Proc::spawn_ready(
        Command::new(&fixtures().trainer)
            .args([
                "--steps",
                "0",
                "--step-ms",
                "20",
                "--backward-per-step",
                "3",
            ])
            .arg("--log")
            .arg(&log),
    );
    wait_for_log_lines(&log, "step", 1, T);
    let pid = p.pid.to_string();
    let mut cmd = dynprof_cmd(&[
        "attach",
        "--pid",
        &pid,
        "--marker",
        "exe:optimizer_step",
        "--marker",
        "libfixture_backward:backward,role=aux",
        "--start-step",
        "5",
        "--active",
        "2",
        "--repeat",
        "2",
        "--gap",
        "100",
        "--collect",
        "none",
        "--json",
        "-o",
        out.to_str().unwrap(),
    ]);
    if let Some((k, v)) = env {
        cmd.env(k, v);
    }
    let mut d = spawn_cmd(&mut cmd, false, vec![tag.into()]);
    assert!(d.wait_exit(T).success(), "{}", d.transcript());
    let dirs = prof_dirs(&out);
    assert_eq!(dirs.len(), 3, "{}", d.transcript());
    for (w, dir) in dirs.iter().enumerate() {
        let m = meta(dir);
        assert_eq!(m["complete"], true, "{m}");
        let first = 5 + 102 * w as u64;
        assert_eq!(recorded(&m), vec![first, first + 1], "{m}");
        let csv = std::fs::read_to_string(dir.join("steps.csv")).unwrap();
        let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
        let col = header
            .iter()
            .position(|h| *h == "aux_backward")
            .unwrap_or_else(|| panic!("no backward column: {csv}"));
        let rows: Vec<&str> = csv.lines().skip(1).collect();
        assert_eq!(rows.len(), 2, "{csv}");
        for row in rows {
            assert_eq!(row.split(',').nth(col), Some("3"), "{csv}");
        }
    }
    let sum = d
        .stdout_json()
        .into_iter()
        .find(|v| v["event"] == "summary")
        .unwrap_or_else(|| panic!("no summary: {}", d.transcript()));
    let steps = sum["steps"].as_u64().unwrap();
    let backward = sum["marker_hits"]["backward"].as_u64().unwrap();
    assert!(steps >= 5 + 2 * 102 + 2, "{sum}");
    // Attached around each window only (at most ~26 steps ahead of it at
    // 50 steps/s), never across the 100-step gaps: an aux marker attached
    // throughout would count 3 per step.
    assert!(backward >= 3 * 3 * 2, "{sum}");
    assert!(backward < 2 * steps, "{sum}");
    assert_eq!(sum["aux_in_windows_only"], true, "{sum}");
}

#[test]
fn aux_marker_attached_again_for_each_window() {
    require_privileges!();
    repeated_windows("aux_windows_repeat", None);
}

#[test]
fn aux_marker_attached_again_for_each_window_without_cookies() {
    require_privileges!();
    repeated_windows(
        "aux_windows_repeat_nocookie",
        Some(("DYNPROF_KERNEL_FEATURES", "no_attach_cookie")),
    );
}
