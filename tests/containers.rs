//! Containers from the host, with real namespaces (`unshare`), no mocked /proc:
//! `--pid N --in-pidns REF` for every REF form, nested and sibling PID
//! namespaces, a library that exists only in the target's mount namespace,
//! deleted and replaced mapped files, container ids from real cgroups, and
//! the errors. Needs root (BPF, unshare, cgroups).

mod common;
#[path = "containers_util.rs"]
mod containers_util;

use std::process::Command;

use common::*;
use containers_util::*;
use dynprof::{
    target::{Target, resolve_pid},
    types::HostPid,
};

#[test]
fn attach_by_inner_pid_in_pidns() {
    require_privileges!();
    let dir = scratch_dir("attach_by_inner_pid_in_pidns");
    let log = dir.join("trainer.log");
    let t = NsTrainer::start(1, &log, &[]);
    let host = t.trainer();
    let sh = t.sh().to_string();
    let inode = pidns_of(host);

    // REF = the host PID of another process in that namespace.
    let r = attach_ok(
        "2",
        3,
        &["--in-pidns", &sh, "--marker", "exe:optimizer_step"],
    );
    let a = r.attached();
    assert_eq!(a["host_pid"], host, "{a}");
    assert_eq!(a["ns_pids"], serde_json::json!([host, 2]), "{a}");
    assert_eq!(a["ns_pid"], 2);
    assert_eq!(a["pid_ns"], inode.as_str());
    for s in r.of("step") {
        assert_eq!(s["host_pid"], host);
        assert_eq!(s["ns_pid"], 2);
    }
    assert_steps_in_log(&r, &log, "step", 3);

    // REF = /proc/X/ns/pid.
    let path = format!("/proc/{sh}/ns/pid");
    let r = attach_ok(
        "2",
        2,
        &["--in-pidns", &path, "--marker", "exe:optimizer_step"],
    );
    assert_eq!(r.attached()["host_pid"], host);
    assert_steps_in_log(&r, &log, "step", 2);

    // REF = pid:[INODE], and the library API.
    assert_eq!(resolve_pid(2, Some(&inode)).unwrap(), HostPid(host));
    assert_eq!(resolve_pid(1, Some(&inode)).unwrap(), HostPid(t.sh()));
    assert_eq!(resolve_pid(host, None).unwrap(), HostPid(host));
}

#[test]
fn nested_pid_namespaces() {
    require_privileges!();
    let dir = scratch_dir("nested_pid_namespaces");
    let log = dir.join("trainer.log");
    let t = NsTrainer::start(2, &log, &[]);
    // [unshare (host ns), unshare (ns1 PID 1), sh (ns2 PID 1), trainer (ns2 PID 2)]
    let [_, mid, sh, host] = t.chain[..] else {
        panic!("{:?}", t.chain)
    };
    assert_eq!(nspid(host), vec![host, 3, 2]);
    assert_eq!(nspid(sh), vec![sh, 2, 1]);

    // Innermost namespace: PID 2 is the trainer.
    assert_eq!(
        resolve_pid(2, Some(&sh.to_string())).unwrap(),
        HostPid(host)
    );
    // Middle namespace: PID 3 is the trainer, PID 2 is sh (whose own namespace is deeper).
    assert_eq!(
        resolve_pid(3, Some(&mid.to_string())).unwrap(),
        HostPid(host)
    );
    assert_eq!(resolve_pid(2, Some(&mid.to_string())).unwrap(), HostPid(sh));
    assert_eq!(resolve_pid(1, Some(&pidns_of(mid))).unwrap(), HostPid(mid));

    let r = attach_ok(
        "3",
        3,
        &[
            "--in-pidns",
            &format!("/proc/{mid}/ns/pid"),
            "--marker",
            "exe:optimizer_step",
        ],
    );
    let a = r.attached();
    assert_eq!(a["host_pid"], host);
    assert_eq!(a["ns_pids"], serde_json::json!([host, 3, 2]));
    assert_eq!(a["ns_pid"], 2, "ns_pid is the innermost PID");
    assert_steps_in_log(&r, &log, "step", 3);
}

#[test]
fn sibling_pid_namespaces_do_not_mix() {
    require_privileges!();
    let dir = scratch_dir("sibling_pid_namespaces_do_not_mix");
    let a = NsTrainer::start(1, &dir.join("a.log"), &[]);
    let b = NsTrainer::start(1, &dir.join("b.log"), &[]);
    assert_ne!(pidns_of(a.trainer()), pidns_of(b.trainer()));
    // Both trainers are PID 2 at the same nesting level.
    assert_eq!(
        resolve_pid(2, Some(&a.sh().to_string())).unwrap(),
        HostPid(a.trainer())
    );
    assert_eq!(
        resolve_pid(2, Some(&b.sh().to_string())).unwrap(),
        HostPid(b.trainer())
    );
    assert_eq!(
        resolve_pid(2, Some(&pidns_of(b.trainer()))).unwrap(),
        HostPid(b.trainer())
    );
}

#[test]
fn pid_not_in_namespace_lists_candidates() {
    require_privileges!();
    let dir = scratch_dir("pid_not_in_namespace_lists_candidates");
    let t = NsTrainer::start(1, &dir.join("trainer.log"), &[]);
    let sh = t.sh().to_string();
    let r = dynprof(&[
        "attach",
        "--pid",
        "77",
        "--in-pidns",
        &sh,
        "--marker",
        "exe:optimizer_step",
    ]);
    assert!(!r.ok, "{r:#?}");
    assert!(r.stderr.contains("no process with PID 77"), "{}", r.stderr);
    assert!(
        r.stderr
            .contains(&format!("host PID {} (trainer", t.trainer())),
        "candidates listed: {}",
        r.stderr
    );
    assert!(
        r.stderr.contains(&format!("host PID {} (sh", t.sh())),
        "{}",
        r.stderr
    );
}

#[test]
fn invalid_in_pidns_refs() {
    // No privileges needed: these fail before anything is opened.
    for (bad, want) in [
        ("notaref", "invalid --in-pidns `notaref`"),
        ("pid:[abc]", "expected pid:[INODE]"),
        ("abcdef01234", "invalid --in-pidns"),
        ("/etc/hostname", "not a namespace file"),
        ("/proc/self/ns/net", "not a PID namespace"),
        ("pid:[1]", "no running process is in that PID namespace"),
        ("4194999", "no process with host PID 4194999"),
        (
            "0123456789abcdef",
            "no running process is in a container whose id starts with `0123456789abcdef`",
        ),
    ] {
        let r = dynprof(&["attach", "--pid", "1", "--in-pidns", bad]);
        assert!(!r.ok, "{bad}: {r:#?}");
        assert!(
            r.stderr.contains(want),
            "--in-pidns {bad}: want {want:?} in {}",
            r.stderr
        );
        let e = resolve_pid(1, Some(bad)).unwrap_err();
        assert!(format!("{e:#}").contains(want), "{bad}: {e:#}");
    }
}

/// Runs a trainer in its own PID namespace inside the cgroup `cg`, as a
/// container runtime does: only the processes inside the namespace (here
/// the trainer, PID 1 there) are in the container's cgroup.
fn trainer_in_cgroup(cg: &Cgroup, log: &std::path::Path) -> Proc {
    let fx = fixtures();
    let script = format!(
        "echo $$ > {} && exec {} --log {} --step-ms 20",
        sh_quote(&cg.dir.join("cgroup.procs").to_string_lossy()),
        sh_quote(&fx.trainer.to_string_lossy()),
        sh_quote(&log.to_string_lossy()),
    );
    Proc::spawn_ready(
        Command::new("unshare")
            .args(PIDNS)
            .args(["sh", "-c", &script]),
    )
}

#[test]
fn container_ids_from_real_cgroups() {
    require_privileges!();
    let dir = scratch_dir("container_ids_from_real_cgroups");
    let prefix = "dbf0c0ffee12";
    let id_a = format!("{prefix}a{}", "0".repeat(51));
    let id_b = format!("{prefix}b{}", "1".repeat(51));
    let (Some(cg_a), Some(cg_b)) = (
        make_cgroup("a", &format!("docker-{id_a}.scope")),
        make_cgroup("b", &format!("libpod-{id_b}.scope")),
    ) else {
        eprintln!(
            "\n!!!!!!!! SKIPPED container_ids_from_real_cgroups: no writable cgroup hierarchy !!!!!!!!\n"
        );
        return;
    };
    let log_a = dir.join("a.log");
    let a = trainer_in_cgroup(&cg_a, &log_a);
    let b = trainer_in_cgroup(&cg_b, &dir.join("b.log"));
    let host_a = find_below(a.host_pid(), "trainer");
    let host_b = find_below(b.host_pid(), "trainer");

    // The parser names the container and its engine.
    let t = Target::open(HostPid(host_a)).unwrap();
    assert_eq!(t.container.as_deref(), Some(id_a.as_str()));
    assert_eq!(t.container_runtime(), Some("docker"));
    assert_eq!(
        Target::open(HostPid(host_b)).unwrap().container_runtime(),
        Some("podman")
    );

    // Full id and unique prefixes resolve; the trainer is PID 1 there.
    assert_eq!(resolve_pid(1, Some(&id_a)).unwrap(), HostPid(host_a));
    assert_eq!(
        resolve_pid(1, Some(&id_b[..13].to_uppercase())).unwrap(),
        HostPid(host_b)
    );

    // An ambiguous prefix names both containers.
    let r = dynprof(&[
        "attach",
        "--pid",
        "1",
        "--in-pidns",
        prefix,
        "--marker",
        "exe:optimizer_step",
    ]);
    assert!(!r.ok, "{r:#?}");
    assert!(r.stderr.contains("ambiguous"), "{}", r.stderr);
    assert!(
        r.stderr.contains(&id_a) && r.stderr.contains(&id_b),
        "{}",
        r.stderr
    );

    // Attach by container id: every output carries the container.
    let r = attach_ok(
        "1",
        2,
        &["--in-pidns", &id_a[..13], "--marker", "exe:optimizer_step"],
    );
    let at = r.attached();
    assert_eq!(at["host_pid"], host_a);
    assert_eq!(at["ns_pids"], serde_json::json!([host_a, 1]));
    assert_eq!(at["container"], id_a.as_str());
    assert_eq!(at["container_runtime"], "docker");
    for s in r.of("step") {
        assert_eq!(s["container"], id_a.as_str());
        assert_eq!(s["container_runtime"], "docker");
    }
    let summary = r.of("summary");
    assert_eq!(
        summary.last().unwrap()["container"],
        id_a.as_str(),
        "{r:#?}"
    );
    assert_steps_in_log(&r, &log_a, "step", 2);

    drop((a, b));
}

/// Copies the trainer and its library into `dir` (a fresh inode each).
fn copy_trainer(dir: &std::path::Path) {
    let fx = fixtures();
    std::fs::create_dir_all(dir).unwrap();
    for f in [&fx.trainer, &fx.libfixture_backward] {
        std::fs::copy(f, dir.join(f.file_name().unwrap())).unwrap();
    }
}

#[test]
fn library_only_in_the_target_mount_namespace() {
    require_privileges!();
    let dir = scratch_dir("library_only_in_the_target_mount_namespace");
    let fx = fixtures();
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let log = dir.join("trainer.log");
    // A tmpfs over `mnt` that only the target's mount namespace sees; the
    // trainer and libfixture_backward.so (found through RPATH $ORIGIN) live there.
    let q = |p: &std::path::Path| sh_quote(&p.to_string_lossy());
    let script = format!(
        "mount -t tmpfs dynprof-test {m} && cp {t} {l} {m}/ && exec {m}/trainer --log {log} --step-ms 20",
        m = q(&mnt),
        t = q(&fx.trainer),
        l = q(&fx.libfixture_backward),
        log = q(&log),
    );
    let p = Proc::spawn_ready(Command::new("unshare").args([
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        &script,
    ]));
    let host = p.host_pid();
    let lib = mnt.join("libfixture_backward.so");
    assert!(
        !lib.exists(),
        "{} must not exist on the host",
        lib.display()
    );
    let maps = std::fs::read_to_string(format!("/proc/{host}/maps")).unwrap();
    assert!(
        maps.contains(&*lib.to_string_lossy()),
        "the trainer maps {}",
        lib.display()
    );

    let r = attach_ok(
        &host.to_string(),
        3,
        &[
            "--marker",
            "libfixture_backward:backward",
            "--marker",
            "exe:optimizer_step,role=aux",
        ],
    );
    let m = &r.attached()["markers"];
    assert_eq!(m[0]["object"], lib.to_string_lossy().as_ref(), "{m}");
    assert!(
        !r.stderr.contains("replaced") && !r.stderr.contains("deleted"),
        "{}",
        r.stderr
    );
    assert_steps_in_log(&r, &log, "backward", 3);
}

#[test]
fn deleted_library_attaches_through_map_files() {
    require_privileges!();
    let dir = scratch_dir("deleted_library_attaches_through_map_files");
    copy_trainer(&dir);
    let log = dir.join("trainer.log");
    let p = Proc::spawn_ready(Command::new(dir.join("trainer")).args([
        "--log",
        &log.to_string_lossy(),
        "--step-ms",
        "20",
    ]));
    let lib = dir.join("libfixture_backward.so");
    std::fs::remove_file(&lib).unwrap();

    let r = attach_ok(
        &p.host_pid().to_string(),
        3,
        &["--marker", "libfixture_backward:backward"],
    );
    assert!(
        r.stderr.contains(&format!("{} was deleted", lib.display())),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains("map_files"), "{}", r.stderr);
    assert_steps_in_log(&r, &log, "backward", 3);
}

#[test]
fn replaced_library_is_reported_and_the_mapped_one_probed() {
    require_privileges!();
    let dir = scratch_dir("replaced_library_is_reported_and_the_mapped_one_probed");
    copy_trainer(&dir);
    let log = dir.join("trainer.log");
    let p = Proc::spawn_ready(Command::new(dir.join("trainer")).args([
        "--log",
        &log.to_string_lossy(),
        "--step-ms",
        "20",
    ]));
    // Like a package upgrade: another build renamed over the mapped file.
    let lib = dir.join("libfixture_backward.so");
    let tmp = dir.join("new.so");
    std::fs::copy(&fixtures().libfixture_marker, &tmp).unwrap();
    std::fs::rename(&tmp, &lib).unwrap();

    let r = attach_ok(
        &p.host_pid().to_string(),
        3,
        &["--marker", "libfixture_backward:backward"],
    );
    assert!(
        r.stderr
            .contains(&format!("{} was replaced on disk", lib.display())),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains("build id mapped"),
        "both build ids are shown: {}",
        r.stderr
    );
    assert!(r.stderr.contains("map_files"), "{}", r.stderr);
    assert_steps_in_log(&r, &log, "backward", 3);
}
