//! Files dynprof writes on the host (issue 11 §4–5, issue 18 leftovers):
//! nothing a job's owner controls — an `--output` directory, a
//! `--config-dir`, planted symlinks, JSON keys — makes root dynprof write
//! outside the operator's output root, follow a link or inject a log line;
//! failed windows and lock files do not linger; exit codes are honest.
mod common;
#[path = "windows_util.rs"]
mod windows_util;

use std::{
    os::unix::fs::{PermissionsExt as _, chown, symlink},
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use common::*;
use serde_json::{Value, json};
use windows_util::*;

/// uid/gid of `nobody`, standing in for a job's owner.
const NOBODY: u32 = 65534;

fn trainer(tag: &str) -> (Proc, PathBuf, PathBuf) {
    let dir = scratch_dir(tag);
    let log = dir.join("trainer.log");
    let mut c = Command::new(&fixtures().trainer);
    c.args(["--steps", "0", "--step-ms", "10"])
        .arg("--log")
        .arg(&log)
        .env("DYNPROF_TEST_SECRET_TOKEN", "hunter2-secret");
    let p = Proc::spawn_ready(&mut c);
    wait_for_log_lines(&log, "step", 1, T);
    (p, log, dir)
}

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// `attach` with a one-window plan into `out`; returns (exit code, stderr).
fn one_window(pid: &str, out: &Path, locks: &Path, extra: &[&str]) -> (i32, String) {
    let mut args = vec!["--start-step", "-1", "-o", out.to_str().unwrap()];
    if !extra.contains(&"--active") {
        args.extend(["--active", "2"]);
    }
    args.extend_from_slice(extra);
    let o = dynprof_cmd(&attach_args(pid, &args))
        .env("DYNPROF_LOCK_DIR", locks)
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn output_that_others_control_is_refused_with_the_reason() {
    require_privileges!();
    let (_p, _log, dir) = trainer("sec_output_refused");
    let pid = _p.pid.to_string();
    let locks = dir.join("locks");

    // Other-user-writable without the sticky bit.
    let open = dir.join("open");
    std::fs::create_dir(&open).unwrap();
    chmod(&open, 0o777);
    let (code, e) = one_window(&pid, &open.join("out"), &locks, &[]);
    assert_ne!(code, 0, "{e}");
    assert!(
        e.contains("refusing output directory") && e.contains("sticky"),
        "{e}"
    );
    assert!(
        e.contains(open.to_str().unwrap()),
        "names the component: {e}"
    );
    assert!(!open.join("out").exists(), "nothing created under it");

    // Owned by another user (the job's owner, who could swap what is inside).
    let foreign = dir.join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    chown(&foreign, Some(NOBODY), Some(NOBODY)).unwrap();
    let (code, e) = one_window(&pid, &foreign, &locks, &[]);
    assert_ne!(code, 0, "{e}");
    assert!(e.contains("owned by uid 65534"), "{e}");
    assert_eq!(std::fs::read_dir(&foreign).unwrap().count(), 0);

    // A symlink anywhere in the path.
    let real = dir.join("real");
    std::fs::create_dir(&real).unwrap();
    symlink(&real, dir.join("link")).unwrap();
    let (code, e) = one_window(&pid, &dir.join("link").join("out"), &locks, &[]);
    assert_ne!(code, 0, "{e}");
    assert!(e.contains("symbolic link") && e.contains("link"), "{e}");
    assert!(
        !real.join("out").exists(),
        "nothing created through the link"
    );

    // The same run into a root-owned sticky 1777 directory works; the window
    // is 0750/0640, and meta.json keeps the command line but not the
    // target's environment.
    let sticky = dir.join("sticky");
    std::fs::create_dir(&sticky).unwrap();
    chmod(&sticky, 0o1777);
    let (code, e) = one_window(&pid, &sticky, &locks, &["--chown", "target"]);
    assert_eq!(code, 0, "{e}");
    let dirs = prof_dirs(&sticky);
    assert_eq!(dirs.len(), 1, "{e}");
    assert!(tmp_dirs(&sticky).is_empty());
    use std::os::unix::fs::MetadataExt as _;
    let md = std::fs::metadata(&dirs[0]).unwrap();
    assert_eq!(md.mode() & 0o777, 0o750);
    // --chown target: the trainer runs as root here, so the owner is 0.
    assert_eq!(md.uid(), 0);
    let mf = std::fs::metadata(dirs[0].join("steps.csv")).unwrap();
    assert_eq!(mf.mode() & 0o777, 0o640);
    let text = std::fs::read_to_string(dirs[0].join("meta.json")).unwrap();
    assert!(
        !text.contains("hunter2-secret"),
        "environment leaked into meta.json"
    );
    assert!(meta(&dirs[0])["target"]["cmdline"].is_array());
}

/// The attack of issue 11: the owner of `--output` waits for the hidden
/// window directory, renames it away, recreates it and plants
/// `<file>.tmp` symlinks to a root-only file. dynprof must refuse such an
/// output up front; the root-only file must not change either way.
#[test]
fn racing_owner_of_output_changes_no_file_outside() {
    require_privileges!();
    let (p, _log, dir) = trainer("sec_output_race");
    let pid = p.pid.to_string();
    let out = dir.join("owned");
    std::fs::create_dir(&out).unwrap();
    chown(&out, Some(NOBODY), Some(NOBODY)).unwrap();
    let victim = dir.join("root_only");
    std::fs::write(&victim, "root secret\n").unwrap();
    chmod(&victim, 0o600);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // The directory's owner, racing (its rights: rename and create in `out`).
    let attacker = {
        let (out, victim, stop) = (out.clone(), victim.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for e in std::fs::read_dir(&out).unwrap().flatten() {
                    let name = e.file_name().into_string().unwrap();
                    if !name.starts_with(".PROF_") || name.contains("stolen") {
                        continue;
                    }
                    n += 1;
                    let _ = std::fs::rename(e.path(), out.join(format!("stolen{n}")));
                    let _ = std::fs::create_dir(e.path());
                    for f in ["steps.csv", "meta.json", "summary.json", "trace.json"] {
                        let _ = symlink(&victim, e.path().join(format!("{f}.tmp")));
                    }
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let (code, e) = one_window(&pid, &out, &dir.join("locks"), &["--active", "20"]);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    attacker.join().unwrap();
    assert_eq!(
        std::fs::read_to_string(&victim).unwrap(),
        "root secret\n",
        "{e}"
    );
    assert_ne!(code, 0, "an output another user owns is refused: {e}");
    assert!(e.contains("owned by uid 65534"), "{e}");
}

/// `YYYYmmddHHMMSSmmm` (local time) of `ms` since the epoch: the timestamp
/// in window directory names.
fn local_stamp(ms: u64) -> String {
    let secs = (ms / 1000) as libc::time_t;
    // SAFETY: localtime_r writes into the tm we pass.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    unsafe { libc::localtime_r(&secs, &mut tm) };
    format!(
        "{:04}{:02}{:02}{:02}{:02}{:02}{:03}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec,
        ms % 1000
    )
}

/// A root-owned sticky output directory (a shared `/tmp`), where the job's
/// user (uid 65534) has planted symlinks at every name dynprof could use for
/// the next seconds (final and hidden window names) pointing at a root-only
/// directory: nothing is written through them, and the window is published
/// under a name of its own.
#[test]
fn sticky_output_with_planted_links_writes_nothing_through_them() {
    require_privileges!();
    let (p, _log, dir) = trainer("sec_output_sticky");
    let pid = p.pid.to_string();
    let out = dir.join("sticky");
    std::fs::create_dir(&out).unwrap();
    chmod(&out, 0o1777);
    let victim = dir.join("root_only_dir");
    std::fs::create_dir(&victim).unwrap();
    chmod(&victim, 0o700);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    for ms in now..now + 15_000 {
        let ts = local_stamp(ms);
        for name in [
            format!("PROF_{ts}_{pid}_1"),
            format!(".PROF_{ts}_{pid}_1_tmp"),
        ] {
            let l = out.join(name);
            symlink(&victim, &l).unwrap();
            std::os::unix::fs::lchown(&l, Some(NOBODY), Some(NOBODY)).unwrap();
        }
    }
    let (code, e) = one_window(&pid, &out, &dir.join("locks"), &[]);
    assert_eq!(code, 0, "{e}");
    assert_eq!(
        std::fs::read_dir(&victim).unwrap().count(),
        0,
        "written through a link"
    );
    let real: Vec<PathBuf> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            !std::fs::symlink_metadata(p)
                .unwrap()
                .file_type()
                .is_symlink()
        })
        .collect();
    assert_eq!(real.len(), 1, "{real:?}");
    let name = real[0].file_name().unwrap().to_str().unwrap();
    assert!(
        name.starts_with("PROF_") && name.ends_with("_1_1"),
        "{name}"
    );
    assert!(meta(&real[0])["complete"].as_bool().unwrap(), "{e}");
    assert!(real[0].join("steps.csv").is_file());
}

#[test]
fn chown_hands_the_window_to_a_uid() {
    require_privileges!();
    let (p, _log, dir) = trainer("sec_chown");
    let pid = p.pid.to_string();
    let out = dir.join("out");
    let (code, e) = one_window(&pid, &out, &dir.join("locks"), &["--chown", "65534:65534"]);
    assert_eq!(code, 0, "{e}");
    let dirs = prof_dirs(&out);
    assert_eq!(dirs.len(), 1, "{e}");
    use std::os::unix::fs::MetadataExt as _;
    for entry in std::iter::once(dirs[0].clone()).chain(
        std::fs::read_dir(&dirs[0])
            .unwrap()
            .map(|e| e.unwrap().path()),
    ) {
        let m = std::fs::symlink_metadata(&entry).unwrap();
        assert_eq!((m.uid(), m.gid()), (NOBODY, NOBODY), "{}", entry.display());
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_string()
}

fn write_config(dir: &Path, v: Value) {
    std::fs::write(
        dir.join("profiler_config.json"),
        serde_json::to_string_pretty(&v).unwrap(),
    )
    .unwrap();
}

#[test]
fn user_owned_config_dir_cannot_write_outside_follow_links_or_inject_lines() {
    require_privileges!();
    let (p, _log, dir) = trainer("sec_config_dir");
    let pid = p.pid.to_string();
    let out = dir.join("out");
    let cfg = dir.join("prof_cfg");
    // The job's user owns the config dir (torch_npu's workflow) and plants
    // links at every name dynprof would use before it starts.
    std::fs::create_dir_all(cfg.join("log")).unwrap();
    let victim = dir.join("root_only");
    std::fs::write(&victim, "root secret\n").unwrap();
    chmod(&victim, 0o600);
    symlink(&victim, cfg.join("profiler_config.json.tmp")).unwrap();
    let monitor = cfg
        .join("log")
        .join(format!("monitor_dp_{}_{pid}_rank_-1.log", hostname()));
    symlink(&victim, &monitor).unwrap();
    for d in [&cfg, &cfg.join("log")] {
        chown(d, Some(NOBODY), Some(NOBODY)).unwrap();
    }
    let anywhere = dir.join("anywhere");
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
    let dp = cfg
        .join("log")
        .join(format!("dp_{}_{pid}_rank_-1.log", hostname()));
    // The template is there, owned by the dir's owner, and written nowhere else.
    let tmpl = std::fs::read_to_string(cfg.join("profiler_config.json")).unwrap();
    assert!(tmpl.contains("prof_dir"));
    let mut base: Value = serde_json::from_str(&tmpl).unwrap();
    // Escapes: an absolute path, `..`, and a key that tries to start a new
    // log line with a shell command.
    base["start_step"] = json!(-1);
    base["prof_dir"] = json!(anywhere.to_str().unwrap());
    write_config(&cfg, base.clone());
    wait_file_contains(&dp, "change 1 did not take effect", T);
    base["prof_dir"] = json!("../x");
    write_config(&cfg, base.clone());
    wait_file_contains(&dp, "change 2 did not take effect", T);
    base["prof_dir"] = json!("sub");
    base["\ntouch X; id > X #"] = json!(1);
    write_config(&cfg, base.clone());
    let dirs = wait_prof_dirs(&out.join("sub"), 1, T);
    unsafe { libc::kill(d.child.id() as i32, libc::SIGINT) };
    assert!(d.wait_exit(T).success(), "{}", d.transcript());

    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "root secret\n");
    assert!(
        !anywhere.exists(),
        "prof_dir outside the output root was created"
    );
    assert!(!dir.join("x").exists() && !out.join("..").join("x").exists());
    assert_eq!(dirs.len(), 1);
    let log = std::fs::read_to_string(&dp).unwrap();
    assert!(log.contains("absolute paths are not allowed"), "{log}");
    assert!(log.contains("`..` is not allowed"), "{log}");
    assert!(
        log.contains("\\ntouch X; id > X #"),
        "escaped key logged: {log}"
    );
    for l in log.lines() {
        assert!(
            l.starts_with('['),
            "a line dynprof did not write: {l:?}\n{log}"
        );
    }
    // The planted links are still links, pointing where they did.
    for l in [cfg.join("profiler_config.json.tmp"), monitor] {
        assert!(
            std::fs::symlink_metadata(&l)
                .unwrap()
                .file_type()
                .is_symlink()
        );
    }
}

#[test]
fn disk_full_exits_nonzero_and_leaves_no_complete_looking_window() {
    require_privileges!();
    let (p, _log, dir) = trainer("sec_disk_full");
    let pid = p.pid.to_string();
    let out = dir.join("out");
    std::fs::create_dir(&out).unwrap();
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs"])
        .arg(&out)
        .status()
        .unwrap();
    assert!(st.success());
    struct Umount(PathBuf);
    impl Drop for Umount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _u = Umount(out.clone());
    // Fill it: every data write of the window fails with ENOSPC.
    {
        use std::io::Write as _;
        let mut f = std::fs::File::create(out.join("filler")).unwrap();
        let chunk = vec![0u8; 4096];
        while f.write_all(&chunk).is_ok() {}
    }
    let (code, e) = one_window(&pid, &out, &dir.join("locks"), &[]);
    assert_eq!(code, 3, "exit code for an unwritten window: {e}");
    assert!(e.contains("could not be written"), "{e}");
    assert!(
        tmp_dirs(&out).is_empty(),
        "hidden window left: {:?}",
        tmp_dirs(&out)
    );
    for d in prof_dirs_any(&out) {
        let name = d.file_name().unwrap().to_str().unwrap().to_string();
        assert!(
            name.ends_with("_incomplete"),
            "complete-looking partial window {name}"
        );
    }
}

/// Every `PROF_*` directory, `_incomplete` ones included.
fn prof_dirs_any(out: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("PROF_")
        })
        .collect()
}

#[test]
fn lock_files_are_removed_on_exit_and_stale_ones_reaped() {
    require_privileges!();
    let (p, _log, dir) = trainer("sec_locks");
    let pid = p.pid.to_string();
    let locks = dir.join("locks");
    std::fs::create_dir(&locks).unwrap();
    chmod(&locks, 0o700);
    // Left by dynprofs that were SIGKILLed (nobody holds them).
    for n in ["4000100.lock", "4000101.lock"] {
        std::fs::write(locks.join(n), "pid=1\nmode=attach\n").unwrap();
    }
    let o = dynprof_cmd(&attach_args(&pid, &["--steps", "2"]))
        .env("DYNPROF_LOCK_DIR", &locks)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let left: Vec<_> = std::fs::read_dir(&locks).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
}
