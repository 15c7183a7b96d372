//! `dynprof ps`: a fixture trainer that maps libraries named like PyTorch's
//! and CUDA's, in its own PID namespace, with rank variables, started by a
//! launcher named `torchrun`. Needs root (unshare).

mod common;
#[path = "containers_util.rs"]
mod containers_util;

use std::process::Command;

use common::*;
use containers_util::*;
use serde_json::Value;

/// A stand-in for torchrun: sets the rank variables and runs its arguments
/// as a child (which dies with it).
const LAUNCHER: &str = r#"
import ctypes, os, signal, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
env = dict(os.environ, RANK="3", LOCAL_RANK="1", WORLD_SIZE="8")
child = subprocess.Popen(sys.argv[1:], env=env, preexec_fn=lambda: libc.prctl(1, signal.SIGKILL))
sys.exit(child.wait())
"#;

fn ps_json(all: bool) -> Vec<Value> {
    let mut args = vec!["ps", "--json"];
    if all {
        args.push("--all");
    }
    let r = dynprof(&args);
    assert!(r.ok, "{r:#?}");
    assert!(
        r.events.len() == r.stdout.lines().count(),
        "every line is one JSON object: {}",
        r.stdout
    );
    r.events
}

fn entry(list: &[Value], pid: u32) -> Option<&Value> {
    list.iter().find(|e| e["host_pid"] == pid)
}

#[test]
fn ps_finds_trainer_in_pidns_with_rank_and_marks_launcher() {
    require_privileges!();
    let dir = scratch_dir("ps_finds_trainer_in_pidns_with_rank_and_marks_launcher");
    let fx = fixtures();
    // Libraries that look like PyTorch and the CUDA runtime to /proc/PID/maps.
    let torch = dir.join("libtorch_cpu.so");
    let cudart = dir.join("libcudart.so.12");
    std::fs::copy(&fx.libfixture_marker, &torch).unwrap();
    std::fs::copy(&fx.libfixture_marker, &cudart).unwrap();
    let launcher = dir.join("torchrun");
    std::fs::write(&launcher, LAUNCHER).unwrap();
    let preload = format!("LD_PRELOAD={}:{}", torch.display(), cudart.display());

    let mut cmd = Command::new(PYTHON3);
    cmd.arg(&launcher)
        .arg("unshare")
        .args(PIDNS)
        .args(["env", &preload])
        .arg(&fx.trainer)
        .args([
            "--log",
            &dir.join("trainer.log").to_string_lossy(),
            "--step-ms",
            "20",
        ]);
    let p = Proc::spawn_ready(&mut cmd);
    assert_eq!(p.pid, 1, "the trainer is PID 1 in its namespace");
    let py = p.host_pid();
    let trainer = find_below(py, "trainer");
    let unshare = children(py)[0];

    let list = ps_json(false);
    let t =
        entry(&list, trainer).unwrap_or_else(|| panic!("trainer {trainer} not listed: {list:#?}"));
    let runtimes: Vec<&str> = t["runtimes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        runtimes.contains(&"torch") && runtimes.contains(&"cuda"),
        "{t}"
    );
    assert_eq!(t["ns_pids"], serde_json::json!([trainer, 1]), "{t}");
    assert_eq!(t["ns_pid"], 1);
    assert_eq!(t["pid_ns"], pidns_of(trainer).as_str());
    assert_eq!(
        (
            t["rank"].as_u64(),
            t["local_rank"].as_u64(),
            t["world_size"].as_u64()
        ),
        (Some(3), Some(1), Some(8)),
        "{t}"
    );
    assert_eq!(t["markers"], "Optimizer.step+backward", "{t}");
    assert!(t["launcher"].is_null(), "{t}");
    assert_eq!(t["ai"], true);

    let l = entry(&list, py).unwrap_or_else(|| panic!("launcher {py} not listed: {list:#?}"));
    assert_eq!(l["launcher"], "torchrun", "{l}");
    assert_eq!(l["workers"], serde_json::json!([trainer]), "{l}");
    assert!(
        entry(&list, unshare).is_none(),
        "plain processes are not listed without --all"
    );

    // --all lists everything, the wrapper included.
    let all = ps_json(true);
    assert!(entry(&all, unshare).is_some());
    assert_eq!(
        entry(&all, std::process::id()).map(|e| e["ai"].clone()),
        Some(Value::Bool(false))
    );

    // The table.
    let r = dynprof(&["ps"]);
    assert!(r.ok, "{r:#?}");
    let header = r.stdout.lines().next().unwrap();
    for col in [
        "HOST PID",
        "NS PIDS",
        "CONTAINER",
        "RANK/LOCAL/WORLD",
        "RUNTIMES",
        "MARKERS",
        "COMMAND",
    ] {
        assert!(header.contains(col), "{header}");
    }
    let row = r
        .stdout
        .lines()
        .find(|l| l.split_whitespace().next() == Some(&trainer.to_string()))
        .unwrap();
    assert!(
        row.contains(&format!("{trainer}>1"))
            && row.contains("3/1/8")
            && row.contains("torch,cuda"),
        "{row}"
    );
    let row = r
        .stdout
        .lines()
        .find(|l| l.split_whitespace().next() == Some(&py.to_string()))
        .unwrap();
    assert!(
        row.contains("LAUNCHER (torchrun)") && row.contains(&trainer.to_string()),
        "{row}"
    );
}

#[test]
fn ps_detects_real_pytorch() {
    // Debian's python3-torch, when installed; ps only reads /proc.
    let probe = Command::new(PYTHON3).args(["-c", "import torch"]).output();
    if !probe.is_ok_and(|o| o.status.success()) {
        eprintln!(
            "\n!!!!!!!! SKIPPED ps_detects_real_pytorch: python3 cannot import torch !!!!!!!!\n"
        );
        return;
    }
    let script =
        "import os, sys, time, torch\nprint('ready', os.getpid(), flush=True)\nsys.stdin.read()\n";
    let mut cmd = Command::new(PYTHON3);
    cmd.args(["-c", script])
        .env("RANK", "0")
        .env("WORLD_SIZE", "1");
    // stdin is /dev/null in Proc::spawn: read() returns at once, so keep the
    // interpreter alive with a pipe instead.
    cmd.stdin(std::process::Stdio::piped());
    let mut child = cmd.stdout(std::process::Stdio::piped()).spawn().unwrap();
    let pid = wait_ready(&mut child).unwrap();
    let list = ps_json(false);
    let _ = child.kill();
    let _ = child.wait();
    let t = entry(&list, pid).unwrap_or_else(|| panic!("python {pid} not listed: {list:#?}"));
    let runtimes: Vec<&str> = t["runtimes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        runtimes.contains(&"torch") && runtimes.contains(&"python"),
        "{t}"
    );
    assert_eq!(t["markers"], "Optimizer.step+backward");
    assert_eq!(t["rank"], 0);
}
