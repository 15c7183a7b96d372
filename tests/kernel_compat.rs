//! Kernel portability (docs/portability.md): the `attached` event and
//! meta.json name the kernel and the paths taken on it, and the no-cookie
//! path (Linux < 5.15, forced here with DYNPROF_KERNEL_FEATURES) counts
//! exactly what the cookie path counts: steps, aux hits and API calls.
//! `cargo xtask vm-test` runs these on Debian's 5.10 too, where the
//! no-cookie path is the only one.
#[path = "attach_util.rs"]
mod attach_util;
mod common;

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use attach_util::*;
use common::*;

const T: Duration = Duration::from_secs(180);
const NO_COOKIE: (&str, &str) = ("DYNPROF_KERNEL_FEATURES", "no_attach_cookie");

fn osrelease() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap()
        .trim()
        .to_string()
}

/// Attach cookies came with Linux 5.15.
fn kernel_has_cookies() -> bool {
    let r = osrelease();
    let mut it = r.split(|c: char| !c.is_ascii_digit());
    let major: u32 = it.next().unwrap().parse().unwrap();
    let minor: u32 = it.next().unwrap().parse().unwrap();
    (major, minor) >= (5, 15)
}

fn trainer(tag: &str) -> (Proc, PathBuf) {
    let log = scratch_dir(tag).join("trainer.log");
    let p = Proc::spawn_ready(
        Command::new(&fixtures().trainer)
            .args([
                "--steps",
                "0",
                "--step-ms",
                "10",
                "--backward-per-step",
                "3",
            ])
            .arg("--log")
            .arg(&log),
    );
    wait_for_log_lines(&log, "step", 1, T);
    (p, log)
}

fn exact_steps(tag: &str, env: Option<(&str, &str)>) -> Finished {
    let (mut p, log) = trainer(tag);
    let args: Vec<String> = [
        "attach",
        "--pid",
        &p.pid.to_string(),
        "--json",
        "--marker",
        "exe:optimizer_step",
        "--marker",
        "libfixture_backward:backward,role=aux",
        "--steps",
        "20",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut cmd = Command::new(dynprof_bin());
    cmd.args(&args);
    if let Some((k, v)) = env {
        cmd.env(k, v);
    }
    let run = Dynprof::spawn(&mut cmd, args).finish(T);
    run.assert_success();
    let steps = run.steps();
    assert_eq!(steps.len(), 20, "{run}");
    let calls = wait_log_covering(&log, "step", steps.last().unwrap().1, T);
    assert_eq!(
        check_steps_match_calls(&steps, &calls, "trainer optimizer_step").len(),
        20
    );
    let sum = run.summary();
    assert_eq!(sum["steps"], 20, "{sum}");
    assert_eq!(aux_per_step(sum, "backward"), 3.0, "{sum}");
    assert_eq!(sum["drops"]["step"], 0, "{sum}");
    assert!(p.is_running(), "the trainer must survive the attach");
    run
}

#[test]
fn kernel_compat_attached_event_names_the_kernel_and_its_paths() {
    require_privileges!();
    let run = exact_steps("kernel_compat-native", None);
    let k = &run.attached()["kernel"];
    assert_eq!(k["release"], osrelease(), "{k}");
    let want = if kernel_has_cookies() {
        "cookie"
    } else {
        "address"
    };
    assert_eq!(k["probe_identity"], want, "{k}");
    let fallbacks = k["fallbacks"].as_array().unwrap();
    if want == "address" {
        assert!(
            fallbacks
                .iter()
                .any(|f| f.as_str().unwrap().contains("5.15")),
            "{k}"
        );
    }
}

#[test]
fn kernel_compat_without_cookies_counts_exact_steps_and_aux_hits() {
    require_privileges!();
    let run = exact_steps("kernel_compat-nocookie", Some(NO_COOKIE));
    let k = &run.attached()["kernel"];
    assert_eq!(k["probe_identity"], "address", "{k}");
    let fallbacks: Vec<&str> = k["fallbacks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap())
        .collect();
    assert!(
        fallbacks
            .iter()
            .any(|f| f.contains("bpf_get_attach_cookie") && f.contains("5.15")),
        "{fallbacks:?}"
    );
    assert!(
        fallbacks.iter().any(|f| f.contains("no_attach_cookie")),
        "the forced fallback is said: {fallbacks:?}"
    );
}

fn json_file(p: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .unwrap()
}

/// The api collector without cookies: every call of the window's steps is
/// recorded once, with its API's name (entries found by address, returns
/// paired on the per-thread stack).
#[test]
fn kernel_compat_without_cookies_api_window_counts_every_call() {
    require_privileges!();
    let dir = scratch_dir("kernel_compat-api");
    let calls_per_step = 50u64;
    let mut trainer = Command::new(&fixtures().acl_trainer);
    trainer
        .args([
            "--calls-per-step",
            &calls_per_step.to_string(),
            // 1 s of host work per step: the scheduler arms the API probes
            // two steps ahead of the window, and arming takes long in a
            // TCG VM (shorter steps there open the window before the
            // probes exist, and the first calls go unseen).
            "--cpu-us",
            "1000000",
        ])
        .arg("--log")
        .arg(dir.join("trainer.log"))
        .env("ACL_SIM_LOG", dir.join("acl.log"));
    let p = Proc::spawn_ready(&mut trainer);
    let (summary, meta, stderr, prof) = api_window(
        &dir,
        p.pid,
        &["--marker", "exe:optimizer_step"],
        Some(NO_COOKIE),
    );
    // Each step: `calls_per_step` launches plus a synchronize and one more
    // call (as in collectors_cli_small_ring_buffer).
    assert_eq!(
        summary["api_calls"].as_u64(),
        Some(3 * (calls_per_step + 2)),
        "{summary}\n{meta}\n{stderr}\n{}",
        std::fs::read_to_string(prof.join("api_summary.csv")).unwrap_or_default()
    );
    assert_eq!(summary["drops"]["api"].as_u64(), Some(0), "{summary}");
    assert_eq!(meta["kernel"]["probe_identity"], "address", "{meta}");
    assert_eq!(meta["kernel"]["release"], osrelease(), "{meta}");
}

/// A window of 3 steps from step 3 with `--collect api` and `args`, with
/// `env` set: (summary.json, meta.json, dynprof's stderr, the PROF dir).
fn api_window(
    dir: &Path,
    pid: u32,
    args: &[&str],
    env: Option<(&str, &str)>,
) -> (serde_json::Value, serde_json::Value, String, PathBuf) {
    let out = dir.join("out");
    let mut cmd = Command::new(dynprof_bin());
    cmd.args(["attach", "--pid", &pid.to_string(), "--json"])
        .args(["--start-step", "3", "--active", "3", "--collect", "api"])
        .args(args)
        .arg("-o")
        .arg(&out);
    if let Some((k, v)) = env {
        cmd.env(k, v);
    }
    let o = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "dynprof attach failed: {stderr}");
    let prof: Vec<PathBuf> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("PROF_")
        })
        .collect();
    assert_eq!(prof.len(), 1, "{prof:?}\n{stderr}");
    let summary = json_file(&prof[0].join("summary.json"));
    let meta = json_file(&prof[0].join("meta.json"));
    (summary, meta, stderr, prof[0].clone())
}

/// A traced call left by longjmp (as a C++ exception leaves one) never
/// returns: each of the trainer's steps calls `api_outer` twice and
/// `api_inner` twice, one of which longjmps back into `api_outer`. A
/// window of 3 steps has exactly 6 `api_outer` and 3 `api_inner` calls,
/// with attach cookies (frames matched by API) and without (frames matched
/// by stack pointer; before, the return of `api_outer` popped the stale
/// `api_inner` frame and every later return was paired one frame off).
#[test]
fn kernel_compat_api_calls_left_by_longjmp_are_dropped() {
    require_privileges!();
    let dir = scratch_dir("kernel_compat-longjmp");
    let mut trainer = Command::new(&fixtures().trainer);
    trainer.args(["--unwind-through", "--step-ms", "20"]);
    let p = Proc::spawn_ready(&mut trainer);
    let args = [
        "--marker",
        "exe:optimizer_step",
        "--api",
        "exe:api_outer",
        "--api",
        "exe:api_inner",
    ];
    for (how, env) in [("cookies", None), ("no cookies", Some(NO_COOKIE))] {
        if env.is_none() && !kernel_has_cookies() {
            continue;
        }
        let (summary, meta, stderr, _) = api_window(&dir.join(how), p.pid, &args, env);
        let calls = |name: &str| {
            summary["top_apis"]
                .as_array()
                .unwrap()
                .iter()
                .find(|a| a["api"] == name)
                .map_or(0, |a| a["calls"].as_u64().unwrap())
        };
        eprintln!(
            "{how}: api_outer {}, api_inner {}",
            calls("api_outer"),
            calls("api_inner")
        );
        assert_eq!(
            (calls("api_outer"), calls("api_inner")),
            (6, 3),
            "{how}: {summary}\n{stderr}"
        );
        assert_eq!(summary["api_calls"], 9, "{how}: {summary}");
        assert_eq!(summary["drops"]["api_nesting"], 0, "{how}: {summary}");
        assert_eq!(
            meta["apis_traced"],
            serde_json::json!(["api_inner", "api_outer"]),
            "{meta}"
        );
        let want = if env.is_some() { "address" } else { "cookie" };
        assert_eq!(meta["kernel"]["probe_identity"], want, "{meta}");
    }
}
