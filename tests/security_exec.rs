//! `--collector msprof` starts msprof *as the target* (issue 11): with the
//! target's uid/gids/capabilities, in its namespaces, and never creates,
//! writes or lists anything on the host through a path inside the target's
//! root. The msprof stand-in (tests/fixtures/msprof_standin.py) plays msprof;
//! with `MSPROF_STANDIN_SELF=DIR` it writes what it runs as (its own
//! /proc/self/status, namespace links, cgroups) to `DIR/self.<pid>`.

mod common;
#[path = "containers_util.rs"]
mod containers_util;

use std::{
    collections::BTreeMap,
    os::unix::fs::{MetadataExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use common::*;
use dynprof::{
    collect::{
        WindowHook, WindowInfo,
        vendor_args::{VendorArgs, VendorCollector, build_hooks},
    },
    target::Target,
    types::{HostPid, StepIndex, WindowId},
};

/// A directory anyone may write (the targets here run as uid 65534).
fn open_dir(p: &Path) -> PathBuf {
    std::fs::create_dir_all(p).unwrap();
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o777)).unwrap();
    p.to_path_buf()
}

/// `bin/msprof` -> the stand-in.
fn standin_bin(scratch: &Path) -> PathBuf {
    let bin = scratch.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(
        fixtures().src_dir.join("msprof_standin.py"),
        bin.join("msprof"),
    )
    .unwrap();
    bin
}

fn window(id: u32, dir: &Path) -> WindowInfo {
    let dir = dir.join(format!(".PROF_test_{id}_tmp"));
    std::fs::create_dir_all(&dir).unwrap();
    WindowInfo {
        id: WindowId(id),
        first_step: StepIndex(id as u64),
        first_recorded: StepIndex(id as u64),
        open_ts_ns: 0,
        start_ts_ns: 0,
        end_ts_ns: 0,
        dir,
    }
}

/// Waits (60 s at most) for the stand-in's self-report in `dir`.
/// Returns (its status, its namespaces and cwd, its /proc/self/cgroup).
fn wait_self(dir: &Path) -> (BTreeMap<String, String>, BTreeMap<String, String>, String) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let found = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                let n = p.file_name().unwrap().to_string_lossy().into_owned();
                n.starts_with("self.") && !n.ends_with(".tmp")
            });
        if let Some(p) = found {
            let text = std::fs::read_to_string(&p).unwrap();
            let mut parts = text.split("--\n");
            let status = status_fields(parts.next().unwrap());
            let extra = parts
                .next()
                .unwrap()
                .lines()
                .filter_map(|l| l.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let cgroups = parts.next().unwrap().to_string();
            return (status, extra, cgroups);
        }
        assert!(
            Instant::now() < deadline,
            "msprof never reported itself in {}",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `Key:\tvalue` lines of a /proc status text (values with whitespace folded).
fn status_fields(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| {
            (
                k.to_string(),
                v.split_whitespace().collect::<Vec<_>>().join(" "),
            )
        })
        .collect()
}

fn proc_status(pid: u32) -> BTreeMap<String, String> {
    status_fields(&std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap())
}

fn ns_link(pid: u32, ns: &str) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/{ns}"))
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

/// Host pids whose command line contains `needle`.
fn pids_with(needle: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cl) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        if String::from_utf8_lossy(&cl)
            .replace('\0', " ")
            .contains(needle)
        {
            out.push(pid);
        }
    }
    out
}

/// The first child of `pid` (the job `unshare --fork` started).
fn first_child(pid: u32) -> u32 {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

fn args(shared: &Path) -> VendorArgs {
    VendorArgs {
        collectors: vec![VendorCollector::Msprof],
        msprof_env: vec![
            format!("MSPROF_STANDIN_LOG={}", shared.join("msprof.log").display()),
            format!("MSPROF_STANDIN_SELF={}", shared.display()),
            // Not /tmp: a stale root-owned lock there would refuse uid 65534.
            format!("MSPROF_STANDIN_LOCK_DIR={}", shared.display()),
        ],
        ..Default::default()
    }
}

fn one_hook(args: &VendorArgs, target: &Target) -> Box<dyn WindowHook> {
    let mut hooks = build_hooks(args, target).unwrap();
    assert_eq!(hooks.len(), 1);
    hooks.pop().unwrap()
}

/// One window: its msprof metadata (the PROF dir must be there).
fn one_window(
    hook: &mut Box<dyn WindowHook>,
    target: &Target,
    scratch: &Path,
) -> serde_json::Value {
    let w = window(1, scratch);
    hook.on_window_start(&w, target).unwrap();
    let meta = hook
        .on_window_end(&w, target)
        .unwrap_or_else(|e| panic!("{e:#}"));
    let dirs = meta["prof_dirs"].as_array().unwrap();
    assert_eq!(dirs.len(), 1, "{meta:#}");
    let name = dirs[0]["name"].as_str().unwrap();
    assert!(name.starts_with("PROF_"));
    assert_eq!(
        dirs[0]["link"],
        format!("msprof/{name}"),
        "relative to the window"
    );
    assert!(
        w.dir.join("msprof").join(name).join("end_info").is_file(),
        "{meta:#}"
    );
    meta
}

const CAP_KEYS: [&str; 5] = ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"];

#[test]
fn msprof_of_a_uid_65534_job_runs_as_65534_with_the_jobs_capabilities_only() {
    require_privileges!();
    let scratch = scratch_dir("security_exec_uid");
    let shared = open_dir(&scratch.join("shared"));
    let bin = standin_bin(&scratch);
    let log = shared.join("trainer.log");
    // The job: uid/gid 65534, group 100, one ambient capability, a trimmed
    // bounding set, no_new_privs, and its own `msprof` first in its PATH.
    let mut job = Proc::spawn_ready(
        Command::new("setpriv")
            .args([
                "--reuid=65534",
                "--regid=65534",
                "--groups=100",
                "--inh-caps=+net_bind_service",
                "--ambient-caps=+net_bind_service",
                "--bounding-set=-sys_admin,-net_raw",
                "--no-new-privs",
            ])
            .arg(&fixtures().trainer)
            .args(["--steps", "0", "--step-ms", "20", "--log"])
            .arg(&log)
            .env("PROFILING_MODE", "dynamic")
            .env("PATH", format!("{}:/usr/bin:/bin", bin.display())),
    );
    let pid = job.host_pid();
    // The job in a cgroup of its own (msprof must join it, not stay in ours).
    let cg = containers_util::make_cgroup("sec", "job").expect("a writable cgroup hierarchy");
    std::fs::write(cg.dir.join("cgroup.procs"), pid.to_string()).unwrap();
    let job_cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    assert_ne!(
        job_cgroups,
        std::fs::read_to_string("/proc/self/cgroup").unwrap()
    );
    let target = Target::open(HostPid(pid)).unwrap();
    let want = proc_status(pid);
    assert_eq!(want["Uid"], "65534 65534 65534 65534");
    assert_eq!(want["CapEff"], "0000000000000400");
    assert_eq!(want["NoNewPrivs"], "1");

    let mut hook = one_hook(&args(&shared), &target);
    hook.prepare(&target).unwrap();
    let (got, _, cgroups) = wait_self(&shared);
    assert_eq!(cgroups, job_cgroups, "msprof is in the job's cgroups");
    assert_eq!(got["Uid"], "65534 65534 65534 65534", "never uid 0");
    assert_eq!(got["Gid"], "65534 65534 65534 65534");
    assert_eq!(got["Groups"], want["Groups"]);
    assert_eq!(got["Groups"], "100");
    for k in CAP_KEYS {
        assert_eq!(got[k], want[k], "{k}");
    }
    assert_eq!(got["NoNewPrivs"], want["NoNewPrivs"]);
    let meta = one_window(&mut hook, &target, &scratch);
    // The default output: fresh, unpredictable, owned by the job's uid.
    let out = meta["output_in_target"].as_str().unwrap();
    let name = Path::new(out)
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let prefix = format!("dynprof_msprof_{pid}_");
    let suffix = name
        .strip_prefix(&prefix)
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        suffix.len() == 16 && suffix.chars().all(|c| c.is_ascii_hexdigit()),
        "{out}"
    );
    let md = std::fs::metadata(out).unwrap();
    assert_eq!((md.uid(), md.mode() & 0o777), (65534, 0o750), "{out}");
    hook.shutdown(&target).unwrap();
    assert!(job.is_running(), "the job is never disturbed");
    std::fs::remove_dir_all(out).unwrap();
    drop(job); // before its cgroup is removed
    drop(cg);
}

#[test]
fn msprof_refuses_an_output_dir_owned_by_another_user() {
    require_privileges!();
    let scratch = scratch_dir("security_exec_owner");
    let shared = open_dir(&scratch.join("shared"));
    let bin = standin_bin(&scratch);
    // Made in advance by root: the uid-65534 job does not own it.
    let planted = scratch.join("planted");
    std::fs::create_dir_all(&planted).unwrap();
    let mut job = Proc::spawn_ready(
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&fixtures().trainer)
            .args(["--steps", "0", "--step-ms", "20", "--log"])
            .arg(shared.join("trainer.log"))
            .env("PROFILING_MODE", "dynamic")
            .env("PATH", format!("{}:/usr/bin:/bin", bin.display())),
    );
    let target = Target::open(HostPid(job.host_pid())).unwrap();
    let mut a = args(&shared);
    a.msprof_output = Some(planted.display().to_string());
    let mut hook = one_hook(&a, &target);
    hook.prepare(&target).unwrap();
    let w = window(1, &scratch);
    hook.on_window_start(&w, &target).unwrap();
    let err = format!("{:#}", hook.on_window_end(&w, &target).unwrap_err());
    assert!(
        err.contains("owned by uid 0, not by the job's uid 65534"),
        "{err}"
    );
    assert!(!shared.join("msprof.log").exists(), "msprof never started");
    hook.shutdown(&target).unwrap();
    assert!(job.is_running());
}

#[test]
fn msprof_of_a_rootless_container_runs_in_its_user_pid_and_mount_namespaces() {
    require_privileges!();
    let scratch = scratch_dir("security_exec_userns");
    let shared = open_dir(&scratch.join("shared"));
    let bin = standin_bin(&scratch);
    // uid 65534 makes a user namespace (root inside, 65534 outside) with its
    // own PID and mount namespaces: a rootless container.
    let ns = Proc::spawn_ready(
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .args([
                "unshare",
                "--user",
                "--map-root-user",
                "--pid",
                "--fork",
                "--mount-proc",
                "--kill-child",
            ])
            .arg(&fixtures().trainer)
            .args(["--steps", "0", "--step-ms", "20", "--log"])
            .arg(shared.join("trainer.log"))
            .env("PROFILING_MODE", "dynamic")
            .env("PATH", format!("{}:/usr/bin:/bin", bin.display())),
    );
    assert_eq!(ns.pid, 1, "the trainer is PID 1 of its namespace");
    let host = first_child(ns.host_pid());
    for n in ["user", "pid", "mnt"] {
        assert_ne!(ns_link(host, n), ns_link(std::process::id(), n), "{n}");
    }
    let target = Target::open(HostPid(host)).unwrap();
    let want = proc_status(host);
    assert_eq!(
        want["Uid"], "65534 65534 65534 65534",
        "as the host sees it"
    );

    let mut hook = one_hook(&args(&shared), &target);
    hook.prepare(&target).unwrap();
    let (got, links, _) = wait_self(&shared);
    for n in ["user", "cgroup", "ipc", "uts", "net", "pid", "mnt"] {
        assert_eq!(links[n], ns_link(host, n), "{n} namespace");
    }
    // Root inside its user namespace, as the job is; the job's capabilities.
    assert_eq!(got["Uid"], "0 0 0 0");
    for k in CAP_KEYS {
        assert_eq!(got[k], want[k], "{k}");
    }
    // From the host: the tool and the process that forked it into the PID
    // namespace both run as 65534, never as root.
    let out_dir = hook_output(&mut hook, &target, &scratch);
    let out = format!("--output={out_dir}");
    let ms = pids_with(&out);
    assert_eq!(ms.len(), 1, "{ms:?}");
    let st = proc_status(ms[0]);
    assert_eq!(st["Uid"], "65534 65534 65534 65534");
    let parent: u32 = st["PPid"].parse().unwrap();
    assert_eq!(proc_status(parent)["Uid"], "65534 65534 65534 65534");
    for k in CAP_KEYS {
        assert_eq!(st[k], want[k], "{k}");
    }
    hook.shutdown(&target).unwrap();
    std::fs::remove_dir_all(out_dir).unwrap();
}

/// Runs one window and returns msprof's --output (as the target names it).
fn hook_output(hook: &mut Box<dyn WindowHook>, target: &Target, scratch: &Path) -> String {
    let meta = one_window(hook, target, scratch);
    meta["output_in_target"].as_str().unwrap().to_string()
}

#[test]
fn a_symlink_in_the_targets_root_never_leads_dynprof_to_the_host() {
    require_privileges!();
    // Outside /tmp even when the checkout is under /tmp (a CI clone made
    // with mktemp): the container's /tmp is the link under test, so nothing
    // the container needs may live below the host's /tmp.
    let scratch = PathBuf::from(format!(
        "/var/tmp/dynprof-test-security_exec_symlink-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    let shared = open_dir(&scratch.join("shared"));
    // The host directory the container's /tmp points at (an absolute link):
    // it exists on the host, with something in it.
    let victim = scratch.join("victim");
    std::fs::create_dir_all(victim.join("PROF_host_planted")).unwrap();
    // The container's root: /usr from the host, /tmp -> <victim> (which the
    // container has too, empty), the fixtures and the shared dir at their paths.
    let root = scratch.join("root");
    for d in ["usr", "proc"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    for l in ["bin", "lib", "lib64", "sbin"] {
        std::os::unix::fs::symlink(format!("usr/{l}"), root.join(l)).unwrap();
    }
    let inside = |p: &Path| root.join(p.strip_prefix("/").unwrap());
    std::fs::create_dir_all(inside(&victim)).unwrap();
    std::os::unix::fs::symlink(&victim, root.join("tmp")).unwrap();
    let fx = fixtures();
    // The fixtures at fixed paths in the container (their own paths may be
    // under the host's /tmp); `shared` at its own path, which msprof's
    // environment names.
    let binds = [
        (fx.dir.clone(), PathBuf::from("/fx")),
        (fx.src_dir.clone(), PathBuf::from("/fxsrc")),
        (shared.clone(), shared.clone()),
    ];
    let mut script = format!(
        "mount --rbind /usr {} && mount -t proc proc {}",
        root.join("usr").display(),
        root.join("proc").display()
    );
    for (from, to) in &binds {
        std::fs::create_dir_all(inside(to)).unwrap();
        script += &format!(
            " && mount --bind {} {}",
            from.display(),
            inside(to).display()
        );
    }
    script += &format!(
        " && exec chroot {} /fx/{} --steps 0 --step-ms 20 --log {}",
        root.display(),
        fx.trainer.file_name().unwrap().to_string_lossy(),
        shared.join("trainer.log").display()
    );
    let ns = Proc::spawn_ready(
        Command::new("unshare")
            .args([
                "--mount",
                "--pid",
                "--fork",
                "--kill-child",
                "sh",
                "-c",
                &script,
            ])
            .env("PROFILING_MODE", "dynamic"),
    );
    let host = first_child(ns.host_pid());
    let target = Target::open(HostPid(host)).unwrap();
    let mut a = args(&shared);
    a.msprof = Some("/fxsrc/msprof_standin.py".to_string());
    let mut hook = one_hook(&a, &target);
    hook.prepare(&target).unwrap();
    let w = window(1, &scratch);
    hook.on_window_start(&w, &target).unwrap();
    // A new PROF dir on the host during the window: listing the host's
    // directory would attribute it to the window.
    std::fs::create_dir(victim.join("PROF_host_during")).unwrap();
    let meta = hook
        .on_window_end(&w, &target)
        .unwrap_or_else(|e| panic!("{e:#}"));
    hook.shutdown(&target).unwrap();
    let dirs = meta["prof_dirs"].as_array().unwrap();
    assert_eq!(dirs.len(), 1, "{meta:#}");
    let name = dirs[0]["name"].as_str().unwrap();
    assert!(!name.contains("host"), "{meta:#}");
    assert!(w.dir.join("msprof").join(name).join("end_info").is_file());
    let out = meta["output_in_target"].as_str().unwrap().to_string();
    // The default /tmp/dynprof_msprof_* resolved inside the container's root.
    assert!(
        out.starts_with(&format!("{}/dynprof_msprof_", victim.display())),
        "{out}"
    );
    let host_names: Vec<String> = std::fs::read_dir(&victim)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let mut host_names = host_names;
    host_names.sort();
    assert_eq!(
        host_names,
        ["PROF_host_during", "PROF_host_planted"],
        "nothing made on the host"
    );
    let made = inside(Path::new(&out));
    let profs: Vec<String> = std::fs::read_dir(&made)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        profs.len(),
        1,
        "msprof wrote inside the container: {profs:?}"
    );
    drop(ns);
    let _ = std::fs::remove_dir_all(&scratch);
}

#[test]
fn a_job_under_a_seccomp_filter_gets_no_msprof_unless_the_operator_opts_in() {
    require_privileges!();
    let scratch = scratch_dir("security_exec_seccomp");
    let shared = open_dir(&scratch.join("shared"));
    let bin = standin_bin(&scratch);
    let mut job = Proc::spawn_ready(
        Command::new(fixtures().src_dir.join("seccomp_exec.py"))
            .arg(&fixtures().trainer)
            .args(["--steps", "0", "--step-ms", "20", "--log"])
            .arg(shared.join("trainer.log"))
            .env("PROFILING_MODE", "dynamic")
            .env("PATH", format!("{}:/usr/bin:/bin", bin.display())),
    );
    let pid = job.host_pid();
    assert_eq!(proc_status(pid)["Seccomp"], "2");
    let target = Target::open(HostPid(pid)).unwrap();
    let mut hook = one_hook(&args(&shared), &target);
    hook.prepare(&target).unwrap();
    let w = window(1, &scratch);
    hook.on_window_start(&w, &target).unwrap();
    let err = format!("{:#}", hook.on_window_end(&w, &target).unwrap_err());
    assert!(
        err.contains("seccomp filter") && err.contains("--msprof-allow-unconfined"),
        "{err}"
    );
    hook.shutdown(&target).unwrap();
    assert!(!shared.join("msprof.log").exists(), "msprof never started");

    // The operator opts in: msprof runs as the job, without the filter.
    let mut a = args(&shared);
    a.msprof_allow_unconfined = true;
    let mut hook = one_hook(&a, &target);
    hook.prepare(&target).unwrap();
    let (got, _, _) = wait_self(&shared);
    assert_eq!(got["Seccomp"], "0");
    assert_eq!(got["NoNewPrivs"], "1", "the job's no_new_privs is kept");
    let meta = one_window(&mut hook, &target, &scratch.join("second"));
    assert_eq!(meta["runs_as"]["seccomp"], "filter", "{meta:#}");
    hook.shutdown(&target).unwrap();
    assert!(job.is_running());
    std::fs::remove_dir_all(meta["output_in_target"].as_str().unwrap()).unwrap();
}
