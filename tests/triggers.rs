//! Triggers: the interactive console (piped and through a real pty, idle
//! timeout), the profiler_config.json trigger, the per-target lock, and
//! launch mode with a marker library that is dlopen()ed late.
mod common;
#[path = "windows_util.rs"]
mod windows_util;

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use common::*;
use serde_json::{Value, json};
use windows_util::*;

fn trainer_env(tag: &str, step_ms: &str, env: &[(&str, &str)]) -> (Proc, PathBuf, PathBuf) {
    let dir = scratch_dir(tag);
    let log = dir.join("trainer.log");
    let mut c = Command::new(&fixtures().trainer);
    c.args(["--steps", "0", "--step-ms", step_ms])
        .arg("--log")
        .arg(&log);
    for (k, v) in env {
        c.env(k, v);
    }
    let p = Proc::spawn_ready(&mut c);
    wait_for_log_lines(&log, "step", 1, T);
    (p, log, dir)
}

fn trainer(tag: &str, step_ms: &str) -> (Proc, PathBuf, PathBuf) {
    trainer_env(tag, step_ms, &[])
}

/// Waits until the trainer has logged `n` more steps than now.
fn let_steps_pass(log: &Path, n: usize) {
    let have = log_lines_of(log, "step").len();
    wait_for_log_lines(log, "step", have + n, T);
}

// ------------------------------------------------------------------ console

#[test]
fn console_piped_stdin_drives_windows() {
    require_privileges!();
    let (mut p, log, dir) = trainer("console_piped", "10");
    let out = dir.join("out");
    let pid = p.pid.to_string();
    let mut d = spawn(
        &attach_args(&pid, &["--interactive", "-o", out.to_str().unwrap()]),
        true,
    );
    d.wait_for("console ready", T);
    d.send("status");
    let i = d.wait_for("steps seen", T);
    assert!(d.lines[i].1.contains("no window"), "{}", d.transcript());
    d.send("capture 2 warmup 1");
    d.wait_for("window records steps", T);
    d.wait_for("window 1 written", T);
    d.send("start");
    d.wait_for("runs until `stop`", T);
    let_steps_pass(&log, 4);
    d.send("status");
    d.wait_for("window 2 open", T);
    d.send("stop");
    d.wait_for("closes at the next boundary", T);
    d.wait_for("window 2 written", T);
    d.send("frobnicate");
    d.wait_for("unknown command `frobnicate`", T);
    d.send("help");
    d.wait_for("capture A [warmup W] [at S]", T);
    d.send("status");
    d.wait_for("windows written 2", T);
    d.send("quit");
    d.wait_for("detaching", T);
    assert!(d.wait_exit(T).success(), "{}", d.transcript());

    let dirs = prof_dirs(&out);
    assert_eq!(dirs.len(), 2);
    let m1 = meta(&dirs[0]);
    assert_eq!(m1["trigger"], "console");
    assert_eq!(m1["complete"], true);
    let r1 = recorded(&m1);
    assert_eq!(r1.len(), 2);
    assert_eq!(
        m1["first_step"].as_u64().unwrap() + 1,
        r1[0],
        "warmup 1 step"
    );
    let m2 = meta(&dirs[1]);
    assert_eq!(m2["complete"], true, "{m2}");
    assert_eq!(m2["plan"]["until_stop"], true);
    assert!(recorded(&m2).len() >= 3, "{m2}");
    assert!(p.is_running(), "quit leaves the target running");
}

#[test]
fn console_piped_eof_quits_and_idle_timeout_detaches() {
    require_privileges!();
    let (mut p, _log, dir) = trainer("console_eof_idle", "10");
    let pid = p.pid.to_string();
    let out = dir.join("out");
    // EOF on stdin = quit.
    let mut d = spawn(
        &attach_args(&pid, &["--interactive", "-o", out.to_str().unwrap()]),
        true,
    );
    d.wait_for("console ready", T);
    d.close_stdin();
    d.wait_for("detaching", T);
    assert!(d.wait_exit(T).success(), "{}", d.transcript());
    drop(d);
    // Idle timeout: stdin stays open, no command is sent.
    let mut d = spawn(
        &attach_args(
            &pid,
            &[
                "--interactive",
                "--idle-timeout",
                "1",
                "-o",
                out.to_str().unwrap(),
            ],
        ),
        true,
    );
    d.wait_for("console ready", T);
    d.wait_for("idle for 1 s", T);
    assert!(d.wait_exit(T).success(), "{}", d.transcript());
    assert!(prof_dirs(&out).is_empty());
    assert!(p.is_running());
}

#[test]
fn console_through_a_real_pty() {
    require_privileges!();
    let (mut p, _log, dir) = trainer("console_pty", "10");
    let out = dir.join("out");
    // script(1) gives dynprof a pty as stdin/stdout: no plan flags + a TTY
    // = the console, with rustyline's prompt and line editing.
    let inner = format!(
        "{} attach --pid {} --marker exe:optimizer_step -o {}",
        dynprof_bin().display(),
        p.pid,
        out.display()
    );
    let mut c = Command::new("script");
    c.args(["-qfec", &inner, "/dev/null"])
        .env("TERM", "xterm")
        .env("RUST_LOG", "warn");
    let mut d = spawn_cmd(&mut c, true, vec![inner.clone()]);
    // Type only at a prompt, as a user does: rustyline reads keys in raw
    // mode, which it enters before drawing the prompt and leaves after each
    // line; a line typed in between reaches it in cooked mode, mangled.
    d.wait_for("console ready", T);
    let i = d.wait_for("dynprof> ", T);
    // Keys go through the pty; the echo shows the line after the prompt.
    d.type_keys("status\r");
    d.wait_for_from(i, "status", T);
    let i = d.wait_for_from(i, "steps seen", T);
    d.wait_for_from(i, "dynprof> ", T);
    d.type_keys("capture 1\r");
    let i = d.wait_for_from(i, "window records steps", T);
    let i = d.wait_for_from(i, "window 1 written", T);
    let i = d.wait_for_from(i, "dynprof> ", T);
    // Typed ahead: two lines arrive in one read. The second must not be
    // lost with the first line's read buffer.
    d.type_keys("status\rquit\r");
    let i = d.wait_for_from(i, "windows written 1", T);
    d.wait_for_from(i, "detaching", T);
    assert!(d.wait_exit(T).success(), "{}", d.transcript());
    assert_eq!(prof_dirs(&out).len(), 1);
    assert!(p.is_running());
}

// ------------------------------------------------------------- config file

/// The torch_npu default profiler_config.json, verbatim from its docs.
const TORCH_NPU_DEFAULT: &str = r#"{
  "activities": ["CPU", "NPU"],
  "prof_dir": "./",
  "analyse": false,
  "record_shapes": false,
  "profile_memory": false,
  "with_stack": false,
  "with_flops": false,
  "with_modules": false,
  "active": 1,
  "warmup": 0,
  "start_step": 0,
  "is_rank": false,
  "rank_list": [],
  "experimental_config": {
    "profiler_level": "Level0",
    "aic_metrics": "AiCoreNone",
    "l2_cache": false,
    "op_attr": false,
    "gc_detect_threshold": null,
    "data_simplification": true,
    "record_op_args": false,
    "export_type": ["text"],
    "mstx": false,
    "mstx_domain_include": [],
    "mstx_domain_exclude": [],
    "host_sys": [],
    "sys_io": false,
    "sys_interconnection": false
  }
}"#;

fn key_paths(v: &Value, prefix: &str, out: &mut Vec<String>) {
    if let Value::Object(o) = v {
        for (k, val) in o {
            let p = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            out.push(p.clone());
            key_paths(val, &p, out);
        }
    }
}

/// Writes a config: the template with `changes` applied.
fn write_config(dir: &Path, changes: Value) {
    let mut v: Value = serde_json::from_str(TORCH_NPU_DEFAULT).unwrap();
    for (k, val) in changes.as_object().unwrap() {
        v[k] = val.clone();
    }
    // Written in place (open/truncate/write/close), as an editor would.
    std::fs::write(
        dir.join("profiler_config.json"),
        serde_json::to_string_pretty(&v).unwrap(),
    )
    .unwrap();
}

fn log_file(cfg: &Path, prefix: &str) -> PathBuf {
    let logs = cfg.join("log");
    std::fs::read_dir(&logs)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            let n = p.file_name().unwrap().to_str().unwrap();
            n.starts_with(prefix) && n.ends_with(".log")
        })
        .unwrap_or_else(|| panic!("no {prefix}*.log in {}", logs.display()))
}

#[test]
fn config_file_template_edit_invalid_and_unknown_fields() {
    require_privileges!();
    let (mut p, _log, dir) = trainer("config_edit", "10");
    let cfg = dir.join("prof_cfg");
    let out = dir.join("out");
    let pid = p.pid.to_string();
    let mut d = spawn(
        &attach_args(
            &pid,
            &[
                "--config-dir",
                cfg.to_str().unwrap(),
                "-o",
                out.to_str().unwrap(),
            ],
        ),
        false,
    );
    d.wait_for("edit it to start a window", T);

    // The template has exactly torch_npu's keys (and values).
    let tmpl: Value =
        serde_json::from_str(&std::fs::read_to_string(cfg.join("profiler_config.json")).unwrap())
            .unwrap();
    let want: Value = serde_json::from_str(TORCH_NPU_DEFAULT).unwrap();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    key_paths(&tmpl, "", &mut a);
    key_paths(&want, "", &mut b);
    a.sort();
    b.sort();
    assert_eq!(a, b);
    assert_eq!(tmpl, want);
    let dp = log_file(&cfg, "dp_");
    let monitor = log_file(&cfg, "monitor_dp_");
    assert!(
        dp.file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .ends_with(&format!("_{pid}_rank_-1.log")),
        "{}",
        dp.display()
    );
    wait_file_contains(&dp, "[INFO]", T);

    // An edit triggers a window; prof_dir and metadata are honoured.
    write_config(
        &cfg,
        json!({"start_step": -1, "warmup": 1, "active": 2, "prof_dir": ".", "metadata": {"run": "first"}}),
    );
    let dirs = wait_prof_dirs(&out, 1, T);
    let m = meta(&dirs[0]);
    assert_eq!(m["trigger"], "config_file");
    assert_eq!(m["complete"], true, "{m}");
    assert_eq!(m["metadata"]["run"], "first");
    assert_eq!(recorded(&m).len(), 2);
    assert_eq!(m["config"]["active"], 2);
    wait_file_contains(&monitor, "change 1 took effect", T);

    // Invalid JSON: logged with the reason; the last good config stays.
    std::fs::write(
        cfg.join("profiler_config.json"),
        "{ \"start_step\": -1, oops",
    )
    .unwrap();
    let t = wait_file_contains(&dp, "invalid JSON", T);
    assert!(t.contains("the last good config stays in force"), "{t}");
    wait_file_contains(&monitor, "change 2 did not take effect", T);
    // An invalid field likewise.
    write_config(&cfg, json!({"start_step": -1, "active": "three"}));
    wait_file_contains(&dp, "invalid field `active`", T);
    assert_eq!(
        prof_dirs(&out).len(),
        1,
        "invalid configs must not start windows"
    );

    // Unknown and no-effect fields: accepted, one warning each.
    write_config(
        &cfg,
        json!({"start_step": -1, "active": 1, "prof_dir": ".", "my_field": 1, "analyse": true}),
    );
    wait_prof_dirs(&out, 2, T);
    write_config(
        &cfg,
        json!({"start_step": -1, "active": 1, "prof_dir": ".", "my_field": 2, "analyse": true}),
    );
    wait_prof_dirs(&out, 3, T);
    let t = std::fs::read_to_string(&dp).unwrap();
    assert_eq!(
        t.matches("field `my_field` is not part of").count(),
        1,
        "{t}"
    );
    assert_eq!(t.matches("field `analyse` has no effect").count(), 1, "{t}");

    unsafe { libc::kill(d.child.id() as i32, libc::SIGINT) };
    assert!(d.wait_exit(T).success(), "{}", d.transcript());
    wait_file_contains(&monitor, "dynprof ended", T);
    assert!(p.is_running());
}

#[test]
fn config_file_edit_during_window_is_deferred_and_last_wins() {
    require_privileges!();
    let (mut p, _log, dir) = trainer("config_deferred", "10");
    let cfg = dir.join("prof_cfg");
    let out = dir.join("out");
    let pid = p.pid.to_string();
    let mut d = spawn(
        &attach_args(
            &pid,
            &[
                "--config-dir",
                cfg.to_str().unwrap(),
                "-o",
                out.to_str().unwrap(),
            ],
        ),
        false,
    );
    d.wait_for("edit it to start a window", T);
    let monitor = log_file(&cfg, "monitor_dp_");
    // A long window (500 steps of 10 ms).
    write_config(
        &cfg,
        json!({"start_step": -1, "active": 500, "prof_dir": ".", "metadata": {"tag": "A"}}),
    );
    let until = Instant::now() + T;
    while tmp_dirs(&out).is_empty() {
        assert!(
            Instant::now() < until,
            "window A never opened:\n{}",
            d.transcript()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    write_config(
        &cfg,
        json!({"start_step": -1, "active": 2, "prof_dir": ".", "metadata": {"tag": "B"}}),
    );
    // (By content, not by change number: one save may be seen as two
    // changes of the same content when it races the watcher's start.)
    wait_file_contains(&monitor, "warmup 0, active 2) starts when it ends", T);
    write_config(
        &cfg,
        json!({"start_step": -1, "active": 3, "prof_dir": ".", "metadata": {"tag": "C"}}),
    );
    wait_file_contains(&monitor, "warmup 0, active 3) starts when it ends", T);
    let dirs = wait_prof_dirs(&out, 2, T);
    let a = meta(&dirs[0]);
    assert_eq!(a["metadata"]["tag"], "A");
    assert_eq!(
        recorded(&a).len(),
        500,
        "the deferred edits must not cut window A short"
    );
    let c = meta(&dirs[1]);
    assert_eq!(c["metadata"]["tag"], "C", "the last edit wins");
    assert_eq!(recorded(&c).len(), 3);
    // C starts after A ended.
    assert!(c["first_step"].as_u64().unwrap() > a["last_recorded_step"].as_u64().unwrap());
    unsafe { libc::kill(d.child.id() as i32, libc::SIGINT) };
    assert!(d.wait_exit(T).success());
    assert_eq!(prof_dirs(&out).len(), 2, "B never ran");
    assert!(p.is_running());
}

#[test]
fn config_file_rank_filter() {
    require_privileges!();
    let (p, _log, dir) = trainer_env("config_rank", "10", &[("RANK", "3")]);
    let cfg = dir.join("prof_cfg");
    let out = dir.join("out");
    let pid = p.pid.to_string();
    let mut d = spawn(
        &attach_args(
            &pid,
            &[
                "--config-dir",
                cfg.to_str().unwrap(),
                "-o",
                out.to_str().unwrap(),
            ],
        ),
        false,
    );
    d.wait_for("edit it to start a window", T);
    let monitor = log_file(&cfg, "monitor_dp_");
    assert!(
        monitor.to_str().unwrap().ends_with("_rank_3.log"),
        "{}",
        monitor.display()
    );
    write_config(
        &cfg,
        json!({"start_step": -1, "is_rank": true, "rank_list": [0, 1], "prof_dir": "."}),
    );
    let t = wait_file_contains(&monitor, "change 1 did not take effect", T);
    assert!(t.contains("rank 3 is not in rank_list"), "{t}");
    write_config(
        &cfg,
        json!({"start_step": -1, "is_rank": true, "rank_list": [1, 3], "prof_dir": "."}),
    );
    let dirs = wait_prof_dirs(&out, 1, T);
    assert_eq!(meta(&dirs[0])["target"]["rank"], 3);
    unsafe { libc::kill(d.child.id() as i32, libc::SIGINT) };
    assert!(d.wait_exit(T).success());
    assert_eq!(
        prof_dirs(&out).len(),
        1,
        "only the matching change made a window"
    );
}

#[test]
fn config_dir_symlink_or_bad_name_is_refused() {
    let dir = scratch_dir("config_dir_refused");
    let pid = std::process::id().to_string();
    let locks = dir.join("locks");
    let run = |cfg: &Path| {
        let o = dynprof_cmd(&[
            "attach",
            "--pid",
            &pid,
            "--config-dir",
            cfg.to_str().unwrap(),
        ])
        .env("DYNPROF_LOCK_DIR", &locks)
        .output()
        .unwrap();
        assert!(!o.status.success());
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let e = run(&dir.join("bad.name"));
    assert!(e.contains("may contain only letters, digits"), "{e}");
    std::fs::create_dir_all(dir.join("real")).unwrap();
    std::os::unix::fs::symlink(dir.join("real"), dir.join("link")).unwrap();
    let e = run(&dir.join("link").join("cfg"));
    assert!(e.contains("symbolic link"), "{e}");
    assert!(
        !dir.join("real").join("cfg").exists(),
        "nothing may be created through the symlink"
    );
}

// --------------------------------------------------------------------- lock

#[test]
fn lock_refuses_a_second_controller_and_survives_sigkill() {
    require_privileges!();
    let (mut p, _log, _dir) = trainer("lock_contention", "10");
    let pid = p.pid.to_string();
    let mut a = spawn(&attach_args(&pid, &["--interactive"]), true);
    a.wait_for("console ready", T);
    let o = dynprof_cmd(&attach_args(&pid, &["--steps", "2"]))
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{e}");
    assert!(
        e.contains(&format!(
            "already controlled by another dynprof (PID {}",
            a.child.id()
        )),
        "{e}"
    );
    assert!(e.contains("mode attach") && e.contains("since "), "{e}");
    // SIGKILL the holder: the kernel drops its flock; the next attach works.
    unsafe { libc::kill(a.child.id() as i32, libc::SIGKILL) };
    let _ = a.child.wait();
    let o = dynprof_cmd(&attach_args(&pid, &["--steps", "2"]))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(p.is_running());
}

// ------------------------------------------------------------------- launch

#[test]
fn launch_attaches_a_marker_library_dlopened_later() {
    require_privileges!();
    let dir = scratch_dir("launch_dlopen");
    let log = dir.join("dlopen.log");
    let out = dir.join("out");
    let fx = fixtures();
    let mut d = spawn(
        &[
            "launch",
            "--marker",
            "libfixture_marker:lib_step",
            "--start-step",
            "3",
            "--warmup",
            "1",
            "--active",
            "2",
            "-o",
            out.to_str().unwrap(),
            "--json",
            "--",
            fx.dlopen_trainer.to_str().unwrap(),
            "--log",
            log.to_str().unwrap(),
            "--steps",
            "30",
            "--step-ms",
            "10",
            "--delay-ms",
            "2000",
        ],
        false,
    );
    d.wait_for("not loaded yet", T);
    assert!(d.wait_exit(T).success(), "{}", d.transcript());
    let dirs = prof_dirs(&out);
    assert_eq!(dirs.len(), 1, "{}", d.transcript());
    let m = meta(&dirs[0]);
    assert_eq!(m["complete"], true, "{m}");
    assert_eq!(recorded(&m), vec![4, 5]);
    // The marker was attached after the dlopen (the library did not exist
    // in the process before); every boundary is inside the program's own
    // call, numbered consistently with the live step stream.
    let calls = log_lines_of(&log, "step");
    assert_eq!(calls.len(), 30);
    let steps = d.json_steps();
    assert_eq!(steps.first().map(|s| s.0), Some(1));
    let dl = log_lines_of(&log, "dlopen");
    assert!(
        steps[0].1 > dl[0].after,
        "the first step follows the dlopen"
    );
    let j1 = call_containing(&calls, steps[0].1).expect("hit 1 inside a call");
    for k in 3..=6u64 {
        let j = call_containing(&calls, boundary(&m, k))
            .unwrap_or_else(|| panic!("boundary {k} inside no call"));
        assert_eq!(j as u64, j1 as u64 + k - 1);
    }
}
