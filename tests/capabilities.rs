//! dynprof with only the capabilities docs/capabilities.md lists: as uid
//! 65534 it attaches to another user's job and collects a window; after
//! attach it keeps only the session's set (CapEff = CapPrm = that set,
//! nothing inheritable or ambient); a missing capability is named.
#[path = "attach_util.rs"]
mod attach_util;
mod common;
#[path = "windows_util.rs"]
mod windows_util;

use std::{os::unix::fs::PermissionsExt as _, path::Path, process::Command, time::Duration};

use attach_util::*;
use common::*;

const T: Duration = Duration::from_secs(120);

const CAP_DAC_READ_SEARCH: u32 = 2;
const CAP_SYS_PTRACE: u32 = 19;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_SYS_NICE: u32 = 23;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;
const CAP_CHECKPOINT_RESTORE: u32 = 40;

fn mask(caps: &[u32]) -> u64 {
    caps.iter().fold(0, |m, c| m | 1 << c)
}

/// docs/capabilities.md: attach with every built-in collector.
const DOCUMENTED: &[u32] = &[
    CAP_DAC_READ_SEARCH,
    CAP_SYS_PTRACE,
    CAP_SYS_ADMIN,
    CAP_PERFMON,
    CAP_BPF,
    CAP_CHECKPOINT_RESTORE,
];
/// The same, as setpriv spells it.
const DOCUMENTED_SETPRIV: &str =
    "+dac_read_search,+sys_ptrace,+sys_admin,+perfmon,+bpf,+checkpoint_restore";

/// `setpriv` running dynprof as uid/gid 65534 with only `caps` (effective,
/// permitted, inheritable, ambient and bounding).
fn as_nobody(caps: &str, lock_dir: &Path) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        &format!("--inh-caps=-all,{caps}"),
        &format!("--ambient-caps=-all,{caps}"),
        &format!("--bounding-set=-all,{caps}"),
        "--",
    ])
    .arg(dynprof_bin())
    .env("DYNPROF_LOCK_DIR", lock_dir);
    c
}

/// A directory uid 65534 may write (scratch dirs belong to root).
fn nobody_dir(tag: &str) -> std::path::PathBuf {
    let d = scratch_dir(tag);
    std::os::unix::fs::chown(&d, Some(65534), Some(65534)).unwrap();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
    d
}

/// CapInh, CapPrm, CapEff, CapBnd, CapAmb of a process.
fn cap_sets(pid: u32) -> [(String, u64); 5] {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"].map(|k| {
        let v = status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{k}:")))
            .unwrap_or_else(|| panic!("no {k} in {status}"));
        (k.to_string(), u64::from_str_radix(v.trim(), 16).unwrap())
    })
}

fn assert_sets(pid: u32, eff_prm: u64, bnd: u64, what: &str) {
    let sets = cap_sets(pid);
    let want = [
        ("CapInh", 0),
        ("CapPrm", eff_prm),
        ("CapEff", eff_prm),
        ("CapBnd", bnd),
        ("CapAmb", 0),
    ];
    for ((k, got), (wk, w)) in sets.iter().zip(want) {
        assert_eq!(k, wk);
        assert_eq!(*got, w, "{what}: {k} is {got:016x}, expected {w:016x}");
    }
}

fn trainer() -> Proc {
    Proc::spawn_ready(Command::new(&fixtures().trainer).args(["--steps", "0", "--step-ms", "10"]))
}

#[test]
fn caps_nonroot_with_the_documented_set_collects_a_window() {
    require_privileges!();
    let target = trainer(); // root's job; dynprof runs as another user
    let lock = nobody_dir("caps-nonroot-lock");
    let out = nobody_dir("caps-nonroot-out");
    let pid = target.pid.to_string();
    let args: Vec<String> = [
        "attach",
        "--pid",
        &pid,
        "--json",
        "--marker",
        "exe:optimizer_step",
        "--start-step",
        "3",
        "--active",
        "4",
        "-o",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([out.display().to_string()])
    .collect();
    let mut dp = Dynprof::spawn(
        as_nobody(DOCUMENTED_SETPRIV, &lock).args(&args),
        args.clone(),
    );
    dp.wait_event("attached", T);
    // Every built-in collector arms again at each window: the session keeps
    // the whole set, but nothing inheritable or ambient (hooks, msprof), and
    // the bounding set setpriv gave.
    assert_sets(
        dp.pid(),
        mask(DOCUMENTED),
        mask(DOCUMENTED),
        "uid 65534 after attach",
    );
    let f = dp.finish(T);
    f.assert_success();
    let dirs = windows_util::prof_dirs(&out);
    assert_eq!(dirs.len(), 1, "{f}");
    let steps: Vec<u64> = windows_util::steps_csv(&dirs[0])
        .iter()
        .map(|r| r.0)
        .collect();
    assert_eq!(steps, vec![3, 4, 5, 6], "{f}");
    for file in [
        "cpu.folded",
        "offcpu.folded",
        "api_summary.csv",
        "meta.json",
        "trace.json",
    ] {
        assert!(dirs[0].join(file).is_file(), "{file} missing: {f}");
    }
    let owner = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&dirs[0]).unwrap());
    assert_eq!(owner, 65534, "written as uid 65534");
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_dir_all(&lock);
}

#[test]
fn caps_root_keeps_only_the_session_set_after_attach() {
    require_privileges!();
    let target = trainer();
    // A cpu window far ahead: the session runs, armed for it.
    let out = scratch_dir("caps-root-cpu");
    let out_s = out.display().to_string();
    let cpu = mask(&[CAP_SYS_PTRACE, CAP_PERFMON, CAP_BPF, CAP_CHECKPOINT_RESTORE]);
    // --realtime-boundaries keeps CAP_SYS_NICE on top, and only it.
    let rt = cpu | mask(&[CAP_SYS_NICE]);
    for (extra, kept) in [(None, cpu), (Some("--realtime-boundaries"), rt)] {
        let mut args = vec!["--marker", "exe:optimizer_step", "--collect", "cpu"];
        args.extend(extra);
        args.extend(["--start-step", "1000000", "-o", &out_s]);
        let mut dp = Dynprof::attach(target.pid, &args);
        dp.wait_event("attached", T);
        let what = format!("root, --collect cpu {}", extra.unwrap_or(""));
        assert_sets(dp.pid(), kept, kept, &what);
    }
    // No windows: only the detach's semaphore write through /proc/PID/mem.
    let mut dp = Dynprof::attach(
        target.pid,
        &["--marker", "exe:optimizer_step", "--steps", "1000000"],
    );
    dp.wait_event("attached", T);
    let ptrace = mask(&[CAP_SYS_PTRACE]);
    assert_sets(dp.pid(), ptrace, ptrace, "root, no windows");
    // The kept set is enough to run and end cleanly.
    dp.wait_event("step", T);
    dp.signal(libc::SIGINT);
    let f = dp.finish(T);
    f.assert_success();
    assert!(!f.steps().is_empty(), "{f}");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn caps_a_missing_capability_is_named_before_the_target_is_touched() {
    require_privileges!();
    let target = trainer();
    let lock = nobody_dir("caps-missing-lock");
    let (st, out, err) = run_dynprof(as_nobody("+bpf,+perfmon,+sys_ptrace", &lock).args([
        "attach",
        "--pid",
        &target.pid.to_string(),
        "--marker",
        "exe:optimizer_step",
        "--steps",
        "5",
    ]));
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(out.is_empty(), "{out}");
    assert!(
        err.starts_with("dynprof: error: missing capability: CAP_SYS_ADMIN\n"),
        "{err}"
    );
    assert!(err.contains("uprobe perf events"), "{err}");
    // Nothing was taken: no lock file.
    assert_eq!(std::fs::read_dir(&lock).unwrap().count(), 0, "{err}");
    // --collect offcpu needs CAP_DAC_READ_SEARCH on top.
    let (st, _, err) = run_dynprof(
        as_nobody("+bpf,+perfmon,+sys_ptrace,+sys_admin", &lock).args([
            "attach",
            "--pid",
            &target.pid.to_string(),
            "--marker",
            "exe:optimizer_step",
            "--collect",
            "offcpu",
            "--start-step",
            "3",
        ]),
    );
    assert_eq!(st.code(), Some(1), "{err}");
    // (CAP_SYS_ADMIN stands in for CAP_CHECKPOINT_RESTORE, as in the kernel.)
    assert!(
        err.starts_with("dynprof: error: missing capability: CAP_DAC_READ_SEARCH\n"),
        "{err}"
    );
    assert!(err.contains("(collector offcpu)"), "{err}");
    let _ = std::fs::remove_dir_all(&lock);
}
