//! USDT semaphores are owned by the kernel (uprobe `ref_ctr_offset`), so a
//! SIGKILLed dynprof never leaves one raised; the /proc/PID/mem fallback
//! records what it raises so that the next attach can lower it; and many
//! attach/detach cycles leave nothing behind in the kernel or the target.
//!
//! Target: Debian's /usr/bin/python3 (USDT `python:function__return`, with
//! a semaphore) running tests/fixtures/usdt_train.py. Every check is keyed
//! on this test's own target and dynprof children, so other dynprof tests
//! running at the same time do not disturb it.
#[path = "attach_util.rs"]
mod attach_util;
mod common;

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use attach_util::*;
use common::*;
use dynprof::{
    probes::{resolve_markers, spec},
    target::Target,
    types::HostPid,
};
use serde_json::Value;

const T: Duration = Duration::from_secs(120);
const MARKER: &str = "python:train_step";

/// The semaphore's runtime address and the probe's (path, file offset),
/// resolved as dynprof resolves them, without attaching.
fn semaphore_of(pid: u32) -> (u64, PathBuf, u64) {
    let target = Target::open(HostPid(pid)).unwrap();
    let probes = resolve_markers(&target, &[spec::parse(MARKER).unwrap()], &[]).unwrap();
    let p = &probes[0];
    let s = p
        .semaphore
        .as_ref()
        .unwrap_or_else(|| panic!("no USDT semaphore resolved: {probes:?}"));
    (s.runtime_addr, p.attach_path.clone(), p.file_offset)
}

/// usdt_train.py under /usr/bin/python3 or, with `private_copy`, under a
/// copy of it: the kernel wants every uprobe on one file offset to agree on
/// its semaphore offset, so a test that forces the /proc/PID/mem fallback
/// (no offset) gets its own inode and does not collide with tests that
/// attach to the shared python3 with one.
fn python_trainer(tag: &str, private_copy: bool) -> (Proc, PathBuf, PathBuf) {
    let fx = fixtures();
    let dir = scratch_dir(tag);
    let log = dir.join("steps.log");
    let mut cmd = if private_copy {
        let exe = dir.join("python3.11");
        std::fs::copy(std::fs::canonicalize("/usr/bin/python3").unwrap(), &exe).unwrap();
        let mut c = Command::new(&exe);
        // The copy finds the standard library through PYTHONHOME.
        c.env("PYTHONHOME", "/usr").arg(&fx.usdt_train_py);
        c
    } else {
        fx.python(&fx.usdt_train_py)
    };
    let p = Proc::spawn_ready(
        cmd.args(["--steps", "0", "--step-ms", "10", "--log"])
            .arg(&log),
    );
    wait_for_log_lines(&log, "step", 1, T);
    (p, log, dir)
}

/// `dynprof attach --pid PID --json ARGS` with a private lock directory and
/// extra environment.
fn attach_env(pid: u32, locks: &Path, env: &[(&str, &str)], args: &[&str]) -> Dynprof {
    let mut all: Vec<String> = vec![
        "attach".into(),
        "--pid".into(),
        pid.to_string(),
        "--json".into(),
    ];
    all.extend(args.iter().map(|s| s.to_string()));
    let mut cmd = Command::new(dynprof_bin());
    cmd.args(&all).env("DYNPROF_LOCK_DIR", locks);
    for (k, v) in env {
        cmd.env(k, v);
    }
    Dynprof::spawn(&mut cmd, all)
}

/// Waits until the semaphore reads `want` (the kernel may finish closing a
/// killed process's perf events just after the process is reaped).
fn wait_semaphore(pid: u32, addr: u64, want: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v = read_u16(pid, addr);
        if v == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: USDT semaphore at {addr:#x} is {v}, expected {want}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// SIGKILLs dynprof and reaps it.
fn kill(d: Dynprof) {
    d.signal(libc::SIGKILL);
    let f = d.finish(T);
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&f.status),
        Some(libc::SIGKILL),
        "{f}"
    );
}

fn owners(att: &Value) -> Vec<String> {
    att["usdt_semaphores"]["markers"]
        .as_array()
        .unwrap_or_else(|| panic!("no usdt_semaphores.markers in {att}"))
        .iter()
        .map(|m| m["owner"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn usdt_semaphore_sigkill_mid_window_leaves_it_at_zero_and_next_attach_is_clean() {
    require_privileges!();
    let (p, log, dir) = python_trainer("usdt_semaphore-sigkill", false);
    let locks = dir.join("locks");
    let out = dir.join("out");
    let (addr, _, _) = semaphore_of(p.pid);
    assert_eq!(read_u16(p.pid, addr), 0, "fresh python3: semaphore down");

    for round in 1..=3 {
        // An open-ended window from step 1: dynprof dies with it open.
        let mut d = attach_env(
            p.pid,
            &locks,
            &[],
            &[
                "--marker",
                MARKER,
                "--start-step",
                "1",
                "--active",
                "100000",
                "--output",
                out.to_str().unwrap(),
            ],
        );
        let att = d.wait_event("attached", T);
        assert_eq!(att["markers"][0]["usdt_semaphore"], addr, "{att}");
        assert_eq!(owners(&att), ["kernel"], "round {round}: {att}");
        assert_eq!(
            att["usdt_semaphores"]["fallback_reason"],
            Value::Null,
            "{att}"
        );
        d.wait_event("step", T);
        d.wait_event("step", T);
        // Raised by exactly one, whatever earlier kills did.
        assert_eq!(read_u16(p.pid, addr), 1, "round {round}: while attached");
        kill(d);
        wait_semaphore(p.pid, addr, 0, &format!("round {round}: after SIGKILL"));
    }

    // The next attach is clean and counts exact steps.
    let mut d = attach_env(p.pid, &locks, &[], &["--marker", MARKER, "--steps", "15"]);
    let att = d.wait_event("attached", T);
    assert_eq!(
        att["usdt_semaphores"]["repaired"],
        serde_json::json!([]),
        "nothing to repair: {att}"
    );
    d.wait_event("step", T);
    assert_eq!(read_u16(p.pid, addr), 1, "while attached");
    let run = d.finish(T);
    run.assert_success();
    assert_eq!(read_u16(p.pid, addr), 0, "after a clean detach");
    let steps = run.steps();
    assert_eq!(steps.len(), 15, "{run}");
    let calls = wait_log_covering(&log, "step", steps.last().unwrap().1, T);
    check_steps_match_calls(&steps, &calls, "usdt_train.py train_step");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn usdt_semaphore_fallback_left_raised_by_a_killed_dynprof_is_repaired_by_the_next_attach() {
    require_privileges!();
    let (p, log, dir) = python_trainer("usdt_semaphore-repair", true);
    let locks = dir.join("locks");
    let ledger = locks.join(format!("{}.usdt.json", p.pid));
    let (addr, _, _) = semaphore_of(p.pid);
    assert_eq!(read_u16(p.pid, addr), 0);

    // The fallback (forced: this kernel has ref_ctr_offset) raises the
    // semaphore itself and writes the ledger first.
    let mut d = attach_env(
        p.pid,
        &locks,
        &[("DYNPROF_USDT_SEMAPHORE", "proc_mem")],
        &["--marker", MARKER, "--steps", "100000"],
    );
    let att = d.wait_event("attached", T);
    assert_eq!(owners(&att), ["proc_mem"], "{att}");
    assert!(
        att["usdt_semaphores"]["fallback_reason"]
            .as_str()
            .is_some_and(|r| r.contains("proc_mem")),
        "{att}"
    );
    d.wait_event("step", T);
    assert_eq!(read_u16(p.pid, addr), 1, "raised by the fallback");
    let rec: Value = serde_json::from_slice(&std::fs::read(&ledger).unwrap()).unwrap();
    assert_eq!(rec["dynprof_pid"], d.pid(), "{rec}");
    assert_eq!(rec["target_pid"], p.pid, "{rec}");
    assert_eq!(
        rec["semaphores"][format!("{addr:#x}")],
        serde_json::json!({"pending": 0, "raised": 1}),
        "{rec}"
    );
    kill(d);
    // What the fallback cannot avoid: the count stays up after a SIGKILL.
    assert_eq!(
        read_u16(p.pid, addr),
        1,
        "left raised by the killed fallback"
    );
    assert!(ledger.is_file());

    // The next attach (kernel-owned) lowers it first, then holds it itself.
    // The trainer is stopped meanwhile, so that its 10 steps cannot all pass
    // (and dynprof detach) before the count is read.
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(p.pid as i32, libc::SIGSTOP) };
    let mut d = attach_env(p.pid, &locks, &[], &["--marker", MARKER, "--steps", "10"]);
    let att = d.wait_event("attached", T);
    assert_eq!(
        att["usdt_semaphores"]["repaired"],
        serde_json::json!([{"addr": addr, "lowered_by": 1, "now": 0}]),
        "{att}"
    );
    assert_eq!(owners(&att), ["kernel"], "{att}");
    assert!(!ledger.exists(), "the ledger goes once repaired");
    assert_eq!(read_u16(p.pid, addr), 1, "held once, by the kernel");
    // SAFETY: as above.
    unsafe { libc::kill(p.pid as i32, libc::SIGCONT) };
    let run = d.finish(T);
    run.assert_success();
    assert_eq!(read_u16(p.pid, addr), 0, "after detach");
    let steps = run.steps();
    assert_eq!(steps.len(), 10, "{run}");
    let calls = wait_log_covering(&log, "step", steps.last().unwrap().1, T);
    check_steps_match_calls(&steps, &calls, "after repair");

    // A clean fallback detach lowers the semaphore and leaves no ledger;
    // its window's meta.json says who held the semaphore.
    let out = dir.join("out");
    let run = attach_env(
        p.pid,
        &locks,
        &[("DYNPROF_USDT_SEMAPHORE", "proc_mem")],
        &[
            "--marker",
            MARKER,
            "--start-step",
            "1",
            "--active",
            "2",
            "--output",
            out.to_str().unwrap(),
        ],
    )
    .finish(T);
    run.assert_success();
    assert_eq!(owners(run.attached()), ["proc_mem"]);
    assert_eq!(read_u16(p.pid, addr), 0, "after a clean fallback detach");
    assert!(!ledger.exists(), "no ledger after a clean detach");
    let windows: Vec<PathBuf> = std::fs::read_dir(&out)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("PROF_")
        })
        .collect();
    assert_eq!(windows.len(), 1, "{windows:?}\n{run}");
    let meta: Value =
        serde_json::from_slice(&std::fs::read(windows[0].join("meta.json")).unwrap()).unwrap();
    let sem = &meta["usdt_semaphores"];
    assert_eq!(sem["markers"][0]["owner"], "proc_mem", "{meta}");
    assert_eq!(sem["markers"][0]["addr"], addr, "{meta}");
    assert!(
        sem["fallback_reason"]
            .as_str()
            .is_some_and(|r| r.contains("DYNPROF_USDT_SEMAPHORE=proc_mem")),
        "{meta}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

// ------------------------------------------------------------ leak test

/// `bpftool -j ARGS` as JSON.
fn bpftool(args: &[&str]) -> Value {
    let out = Command::new("bpftool")
        .arg("-j")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running bpftool ({e}); install it with `cargo xtask setup` (Debian package bpftool)"));
    assert!(
        out.status.success(),
        "bpftool {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Loaded programs named dynprof_* (kernel names are cut at 15 chars): ids
/// and maps (the read-only data holds the target's tgid, `TARGET_TGID`).
struct LoadedProg {
    id: u64,
    name: String,
    map_ids: Vec<u64>,
}

fn dynprof_progs() -> Vec<LoadedProg> {
    bpftool(&["prog", "show"])
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| {
            p["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("dynprof_"))
        })
        .map(|p| LoadedProg {
            id: p["id"].as_u64().unwrap(),
            name: p["name"].as_str().unwrap().to_string(),
            map_ids: p["map_ids"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default(),
        })
        .collect()
}

/// `bpftool -j ARGS` about one object by id: `None` when it is gone (other
/// dynprof tests load and unload theirs all the time).
fn bpftool_by_id(args: &[&str]) -> Option<Value> {
    let out = Command::new("bpftool").arg("-j").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    serde_json::from_slice(&out.stdout).ok()
}

/// Whether map `id` is a read-only data map whose contents hold `tgid`.
fn rodata_holds(id: u64, tgid: u32) -> bool {
    let Some(m) = bpftool_by_id(&["map", "show", "id", &id.to_string()]) else {
        return false;
    };
    if !m["name"].as_str().is_some_and(|n| n.contains("rodata")) {
        return false;
    }
    let Some(dump) = bpftool_by_id(&["map", "dump", "id", &id.to_string()]) else {
        return false;
    };
    dump.as_array().into_iter().flatten().any(|e| {
        let bytes: Vec<u8> = e["value"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|b| {
                b.as_str()
                    .and_then(|s| u8::from_str_radix(s.trim_start_matches("0x"), 16).ok())
            })
            .collect();
        bytes
            .chunks_exact(4)
            .any(|c| u32::from_le_bytes(c.try_into().unwrap()) == tgid)
    })
}

/// dynprof programs loaded for target `tgid`.
fn progs_for(tgid: u32) -> Vec<(u64, String)> {
    dynprof_progs()
        .into_iter()
        .filter(|p| p.map_ids.iter().any(|m| rodata_holds(*m, tgid)))
        .map(|p| (p.id, p.name))
        .collect()
}

/// Program ids process `pid` holds a descriptor to (/proc/PID/fdinfo;
/// Debian's bpftool is built without the `pids` feature).
fn prog_ids_held_by(pid: u32) -> BTreeSet<u64> {
    std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .flat_map(|t| {
            t.lines()
                .filter_map(|l| {
                    l.strip_prefix("prog_id:")
                        .and_then(|v| v.trim().parse().ok())
                })
                .collect::<Vec<u64>>()
        })
        .collect()
}

/// Read-only data maps (by id) that hold `tgid`, whoever holds them: a map
/// that outlived its programs would show here.
fn rodata_maps_for(tgid: u32) -> Vec<u64> {
    bpftool(&["map", "show"])
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["name"].as_str().is_some_and(|n| n.contains("rodata")))
        .filter_map(|m| m["id"].as_u64())
        .filter(|id| rodata_holds(*id, tgid))
        .collect()
}

/// Links (bpftool link show) whose program is one of `prog_ids`.
fn links_of(prog_ids: &BTreeSet<u64>) -> Vec<Value> {
    bpftool(&["link", "show"])
        .as_array()
        .into_iter()
        .flatten()
        .filter(|l| {
            l["prog_id"]
                .as_u64()
                .is_some_and(|id| prog_ids.contains(&id))
        })
        .cloned()
        .collect()
}

/// Polls `f` until it returns nothing or 20 s pass; returns the last result.
fn wait_empty<T>(f: impl Fn() -> Vec<T>) -> Vec<T> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v = f();
        if v.is_empty() || Instant::now() >= deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

fn uprobe_events() -> String {
    [
        "/sys/kernel/tracing/uprobe_events",
        "/sys/kernel/debug/tracing/uprobe_events",
    ]
    .iter()
    .find_map(|p| std::fs::read_to_string(p).ok())
    .unwrap_or_default()
}

fn read_mem_byte(pid: u32, addr: u64) -> u8 {
    use std::os::unix::fs::FileExt as _;
    let f = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, addr).unwrap();
    b[0]
}

/// Cycles for the leak test: one takes ~0.4-0.65 s here (a fresh dynprof
/// loads and verifies its programs and reads python3's notes each time);
/// 1,000 took 476 s, so 200 fit the ~2 minutes a test may take on the
/// 2-core CI machine (figures in docs/reliability.md).
/// DYNPROF_LEAK_CYCLES overrides it.
fn cycles() -> usize {
    std::env::var("DYNPROF_LEAK_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CYCLES)
}
const DEFAULT_CYCLES: usize = 200;

#[test]
fn usdt_attach_detach_cycles_leak_no_program_link_uprobe_fd_or_semaphore() {
    require_privileges!();
    let (mut p, _log, dir) = python_trainer("usdt_semaphore-leak", false);
    let locks = dir.join("locks");
    let pid = p.pid;
    let (addr, probe_path, probe_fo) = semaphore_of(pid);
    let site = runtime_addr(pid, &probe_path, probe_fo);
    let original_byte = read_mem_byte(pid, site);
    assert_ne!(original_byte, 0xcc, "probe site already has a breakpoint");
    let fds_before = fd_count(pid);
    let uprobes_before = uprobe_events();
    let n = cycles();
    let t0 = Instant::now();
    for round in 0..n {
        // Round 0 stays attached until the controls are done, then ends on
        // SIGINT; the others detach after one step.
        let steps = if round == 0 { "1000000" } else { "1" };
        let mut d = attach_env(pid, &locks, &[], &["--marker", MARKER, "--steps", steps]);
        if round == 0 {
            // Positive controls: while attached, bpftool sees our program for
            // this target, held by this dynprof, on a link; the int3 is in.
            d.wait_event("attached", T);
            let progs = progs_for(pid);
            let held = prog_ids_held_by(d.pid());
            assert!(
                progs
                    .iter()
                    .any(|(id, n)| n == "dynprof_marker" && held.contains(id)),
                "while attached, bpftool must list dynprof_marker for {pid}, held by dynprof {} ({held:?}): {progs:?}",
                d.pid()
            );
            let ids: BTreeSet<u64> = progs.iter().map(|(id, _)| *id).collect();
            assert!(
                !links_of(&ids).is_empty(),
                "the marker sits on a bpf link: programs {ids:?}, links {}",
                bpftool(&["link", "show"])
            );
            assert_eq!(read_mem_byte(pid, site), 0xcc, "int3 at the probe site");
            assert_eq!(read_u16(pid, addr), 1);
            d.wait_event("step", T);
            d.signal(libc::SIGINT);
        }
        let run = d.finish(T);
        run.assert_success();
        if round > 0 {
            assert_eq!(run.steps().len(), 1, "round {round}: {run}");
        }
        assert_eq!(
            read_u16(pid, addr),
            0,
            "round {round}: semaphore after detach"
        );
        assert!(p.is_running(), "round {round}: the target died");
        if (round + 1) % 100 == 0 {
            eprintln!(
                "usdt leak test: {} cycles clean after {:.1} s",
                round + 1,
                t0.elapsed().as_secs_f64()
            );
        }
    }
    let took = t0.elapsed();
    eprintln!(
        "usdt leak test: {n} attach/detach cycles in {:.1} s",
        took.as_secs_f64()
    );

    // Every child has exited; nothing of theirs may remain.
    // The kernel frees a program's maps after an RCU grace period and a
    // work item, so a map may outlive the last dynprof by a moment: wait
    // for them to go (a leak stays).
    let progs = wait_empty(|| progs_for(pid));
    assert!(
        progs.is_empty(),
        "dynprof programs for target {pid} still loaded: {progs:?}"
    );
    let maps = wait_empty(|| rodata_maps_for(pid));
    assert!(
        maps.is_empty(),
        "dynprof read-only data maps for target {pid} remain: {maps:?}"
    );
    assert_eq!(read_u16(pid, addr), 0, "semaphore");
    assert_eq!(
        read_mem_byte(pid, site),
        original_byte,
        "probe site restored"
    );
    assert_eq!(
        uprobe_events(),
        uprobes_before,
        "tracefs uprobe_events changed"
    );
    assert_eq!(fd_count(pid), fds_before, "the target's fd count");
    assert!(
        !std::fs::read_dir(&locks)
            .map(|r| r
                .flatten()
                .any(|e| e.file_name().to_string_lossy().ends_with(".usdt.json")))
            .unwrap_or(false),
        "no USDT ledger left"
    );
    p.terminate();
    let _ = std::fs::remove_dir_all(&dir);
}
