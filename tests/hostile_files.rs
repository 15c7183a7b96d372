//! Files the target controls are hostile (issue 18 items 3–5, issue 11
//! items 3 and 7): a FIFO in place of a mapped library, a library truncated
//! in a loop while dynprof attaches, a huge `.note.stapsdt`, symbols crafted
//! to demangle slowly, a symbolic link inside the target's root pointing at
//! a host file. Each asserts what the attach printed and that dynprof ended
//! as asked (SIGINT after the first steps, or its own error exit), never
//! hung or crashed. Needs root (BPF).

mod common;
#[path = "containers_util.rs"]
mod containers_util;

use std::{
    io::{BufRead as _, BufReader, Read as _},
    os::unix::process::ExitStatusExt as _,
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use common::*;
use containers_util::*;
use serde_json::Value;

/// What an attach ended SIGINT'ed printed.
struct Ended {
    status: ExitStatus,
    events: Vec<Value>,
    stderr: String,
}

impl Ended {
    fn of(&self, kind: &str) -> Vec<&Value> {
        self.events.iter().filter(|e| e["event"] == kind).collect()
    }
}

/// `dynprof attach --pid PID --json ARGS`, SIGINT once `steps` steps were
/// printed, then waits for it to exit. A dynprof stuck before its first
/// step (the old FIFO hang) keeps this waiting: run it under a timeout.
fn attach_then_sigint(pid: u32, steps: usize, args: &[&str]) -> Ended {
    let pid = pid.to_string();
    let mut all = vec!["attach", "--pid", &pid, "--json", "--duration", "60"];
    all.extend(args);
    let mut child = Command::new(dynprof_bin())
        .args(&all)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning dynprof");
    let mut err = child.stderr.take().unwrap();
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let mut events = Vec::new();
    let mut seen = 0;
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let Ok(line) = line else { break };
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        if v["event"] == "step" {
            seen += 1;
            if seen == steps {
                // SAFETY: kill(2) on our own unreaped child.
                unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
            }
        }
        events.push(v);
    }
    let status = child.wait().expect("waiting for dynprof");
    Ended {
        status,
        events,
        stderr: err_reader.join().unwrap(),
    }
}

fn gcc(args: &[&str]) {
    let out = Command::new("gcc").args(args).output().expect("gcc");
    assert!(
        out.status.success(),
        "gcc {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The trainer and its library, copied into `dir`.
fn copy_trainer(dir: &Path) {
    let fx = fixtures();
    for f in [&fx.trainer, &fx.libfixture_backward] {
        std::fs::copy(f, dir.join(f.file_name().unwrap())).unwrap();
    }
}

/// The trainer with `preload` mapped (LD_PRELOAD: it is never called).
fn trainer_with(dir: &Path, preload: &Path) -> Proc {
    let log = dir.join("trainer.log");
    Proc::spawn_ready(
        Command::new(&fixtures().trainer)
            .args(["--log", &log.to_string_lossy(), "--step-ms", "20"])
            .env("LD_PRELOAD", preload)
            // Every symbol looked up at start: later lazy look-ups would
            // read the preloaded library's hash table, which one test cuts.
            .env("LD_BIND_NOW", "1"),
    )
}

fn assert_clean_exit(e: &Ended) {
    assert_eq!(
        e.status.signal(),
        None,
        "dynprof died of a signal: {}",
        e.stderr
    );
    assert!(!e.stderr.contains("panicked"), "{}", e.stderr);
}

#[test]
fn fifo_in_place_of_a_mapped_library() {
    require_privileges!();
    let dir = scratch_dir("fifo_in_place_of_a_mapped_library");
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
    // Opening this for reading blocks until a writer comes: none will.
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &lib,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();

    let e = attach_then_sigint(
        p.host_pid(),
        3,
        &["--marker", "libfixture_backward:backward"],
    );
    assert_clean_exit(&e);
    assert!(e.status.success(), "{}", e.stderr);
    assert!(
        e.stderr
            .contains(&format!("{} was replaced on disk", lib.display())),
        "{}",
        e.stderr
    );
    assert!(e.stderr.contains("(a FIFO is there now)"), "{}", e.stderr);
    let m = &e.of("attached")[0]["markers"][0];
    assert_eq!(m["object"], lib.to_string_lossy().as_ref(), "{m}");
    assert!(e.stderr.contains("through /proc/"), "{}", e.stderr);
    assert!(e.stderr.contains("/map_files/"), "{}", e.stderr);
    assert!(e.of("step").len() >= 3, "{}", e.stderr);
}

/// A library with `n` exported functions (`hostile_fn_<i>`), so that
/// reading its symbol table takes a while.
fn many_symbols_library(dir: &Path, n: usize) -> PathBuf {
    let mut c = String::new();
    for i in 0..n {
        c.push_str(&format!(
            "int hostile_fn_{i}(int x) {{ return x + {i}; }}\n"
        ));
    }
    let src = dir.join("libhostile.c");
    std::fs::write(&src, c).unwrap();
    let lib = dir.join("libhostile.so");
    gcc(&[
        "-O0",
        "-shared",
        "-fPIC",
        "-o",
        &lib.to_string_lossy(),
        &src.to_string_lossy(),
    ]);
    lib
}

#[test]
fn library_truncated_in_a_loop_while_attaching() {
    require_privileges!();
    let dir = scratch_dir("library_truncated_in_a_loop_while_attaching");
    let lib = many_symbols_library(&dir, 20_000);
    let bytes = std::fs::read(&lib).unwrap();
    let p = trainer_with(&dir, &lib);
    // The target's accomplice: full size, then cut to one page, again and
    // again (the trainer never runs that library's code, so it survives).
    let stop = Arc::new(AtomicBool::new(false));
    let cutter = {
        let (stop, lib) = (stop.clone(), lib.clone());
        std::thread::spawn(move || {
            let mut rounds = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let f = std::fs::OpenOptions::new().write(true).open(&lib).unwrap();
                use std::os::unix::fs::FileExt as _;
                f.write_all_at(&bytes, 0).unwrap();
                f.set_len(4096).unwrap();
                rounds += 1;
            }
            rounds
        })
    };
    let (mut resolved, mut cut_before_attach) = (0, 0);
    for i in 0..20 {
        let e = attach_then_sigint(
            p.host_pid(),
            1,
            &[
                "--marker",
                "exe:optimizer_step",
                "--marker",
                "libhostile:hostile_fn_19999,role=aux",
            ],
        );
        assert_clean_exit(&e);
        // Read whole, then cut before the uprobe went in: the kernel refuses
        // a probe past the file's end (EINVAL) or cannot read the probed
        // instruction (EIO), and dynprof must say so plainly.
        if !e.status.success() {
            assert!(
                e.stderr.contains("hostile_fn_19999")
                    && e.stderr
                        .contains("truncated or replaced after dynprof read it"),
                "attach {i}: {}",
                e.stderr
            );
            cut_before_attach += 1;
            continue;
        }
        let markers = e.of("attached")[0]["markers"].as_array().unwrap().clone();
        // The aux marker resolves when the read saw a whole file, and is
        // reported as not resolved when it did not: both are fine.
        if markers.len() == 2 {
            resolved += 1;
        } else {
            assert!(
                e.stderr
                    .contains("marker `libhostile:hostile_fn_19999,role=aux` did not resolve"),
                "attach {i}: {}",
                e.stderr
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    let rounds = cutter.join().unwrap();
    assert!(rounds > 20, "the library was cut {rounds} times");
    eprintln!(
        "20 attaches, {resolved} resolved the aux marker, {cut_before_attach} refused \
         (cut between read and attach), {rounds} truncations"
    );
}

/// Assembler for a library with `n` `.note.stapsdt` notes named `hostile:tick`.
fn notes_library(dir: &Path, name: &str, n: usize) -> PathBuf {
    let s = format!(
        r#"
        .text
        .globl hostile_tick
hostile_tick:
        nop
        ret
        .pushsection .note.stapsdt,"?","note"
        .rept {n}
        .balign 4
        .4byte 8, 2f-1f, 3
        .asciz "stapsdt"
1:      .8byte hostile_tick, 0, 0
        .asciz "hostile"
        .asciz "tick"
        .asciz "8@%rdi"
2:      .balign 4
        .endr
        .popsection
"#
    );
    let src = dir.join(format!("{name}.s"));
    std::fs::write(&src, s).unwrap();
    let lib = dir.join(format!("{name}.so"));
    gcc(&[
        "-shared",
        "-nostdlib",
        "-o",
        &lib.to_string_lossy(),
        &src.to_string_lossy(),
    ]);
    lib
}

#[test]
fn huge_stapsdt_notes_are_refused_before_any_probe_is_built() {
    require_privileges!();
    let dir = scratch_dir("huge_stapsdt_notes_are_refused");
    // ~8 MiB of notes (140,000), over the 4 MiB cap.
    let huge = notes_library(&dir, "libhugenotes", 140_000);
    assert!(std::fs::metadata(&huge).unwrap().len() > 8 << 20);
    let p = trainer_with(&dir, &huge);
    let r = dynprof(&[
        "attach",
        "--pid",
        &p.host_pid().to_string(),
        "--json",
        "--steps",
        "2",
        "--marker",
        "usdt:libhugenotes:hostile:tick",
    ]);
    assert!(!r.ok, "{r:#?}");
    assert!(r.stderr.contains("no step marker resolved"), "{}", r.stderr);
    assert!(
        r.stderr
            .contains("its .note.stapsdt section is 8 MiB, over dynprof's cap of 4 MiB: not read"),
        "{}",
        r.stderr
    );
    drop(p);

    // 200 notes of one name: more sites than markers, refused at the 65th.
    let many = notes_library(&dir, "libmanynotes", 200);
    let p = trainer_with(&dir, &many);
    let r = dynprof(&[
        "attach",
        "--pid",
        &p.host_pid().to_string(),
        "--json",
        "--steps",
        "2",
        "--marker",
        "usdt:libmanynotes:hostile:tick",
    ]);
    assert!(!r.ok, "{r:#?}");
    assert!(
        r.stderr.contains(
            "more than 64 USDT probe sites match; dynprof attaches at most 64 markers (hostile:tick)"
        ),
        "{}",
        r.stderr
    );
}

#[test]
fn symbols_crafted_to_demangle_slowly() {
    require_privileges!();
    let dir = scratch_dir("symbols_crafted_to_demangle_slowly");
    // 100 names that all pass the `train::step` pre-filter and whose
    // demangled text doubles 40+ times; and the real `train::step()`.
    let mut c =
        String::from("void real(void) __asm__(\"_ZN5train4stepEv\");\nvoid real(void) {}\n");
    for i in 0..100 {
        let name = dynprof::symbols::demangle::doubling_name("_ZN5train4stepE", 1, 40 + i);
        c.push_str(&format!(
            "void f{i}(void) __asm__(\"{name}\");\nvoid f{i}(void) {{}}\n"
        ));
    }
    let src = dir.join("libslow.c");
    std::fs::write(&src, c).unwrap();
    let lib = dir.join("libslow.so");
    gcc(&[
        "-shared",
        "-fPIC",
        "-o",
        &lib.to_string_lossy(),
        &src.to_string_lossy(),
    ]);
    let p = trainer_with(&dir, &lib);
    let e = attach_then_sigint(
        p.host_pid(),
        2,
        &[
            "--marker",
            "exe:optimizer_step",
            "--marker",
            "libslow:train::step,role=aux",
        ],
    );
    assert_clean_exit(&e);
    assert!(e.status.success(), "{}", e.stderr);
    let markers = e.of("attached")[0]["markers"].as_array().unwrap().clone();
    assert_eq!(markers.len(), 2, "{markers:?} {}", e.stderr);
    let slow: Vec<_> = markers
        .iter()
        .filter(|m| m["object"].as_str().unwrap().ends_with("libslow.so"))
        .collect();
    assert_eq!(slow.len(), 1, "{markers:?}");
    assert_eq!(slow[0]["symbol"], "train::step()", "{markers:?}");
}

/// A chroot holding the trainer, its library and what the loader needs.
fn chroot_with_trainer(root: &Path) {
    let fx = fixtures();
    let out = Command::new("ldd").arg(&fx.trainer).output().unwrap();
    let mut files: Vec<PathBuf> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with('/'))
        .map(PathBuf::from)
        .collect();
    files.push(fx.trainer.clone());
    for f in files {
        let dst = root.join(f.strip_prefix("/").unwrap());
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(&f, &dst).unwrap();
    }
}

#[test]
fn symlink_inside_the_root_to_a_host_file_is_never_read() {
    require_privileges!();
    let dir = scratch_dir("symlink_inside_the_root_to_a_host_file");
    let root = dir.join("root");
    chroot_with_trainer(&root);
    let fx = fixtures();
    // A host file, outside the root, with a build id of its own.
    let host_file = dir.join("host-only.so");
    std::fs::copy(&fx.libfixture_marker, &host_file).unwrap();
    let host_id = dynprof::symbols::ElfImage::open(&host_file)
        .unwrap()
        .build_id()
        .unwrap();
    let inner_lib = fx.libfixture_backward.clone();
    // A container root: its own mount namespace whose root is `root`
    // (pivot_root), so that maps names files as the container sees them.
    // No /proc inside: the loader cannot expand $ORIGIN, so say where.
    let q = |p: &Path| sh_quote(&p.to_string_lossy());
    let script = format!(
        "mount --bind {r} {r} && cd {r} && mkdir -p .old && pivot_root . .old && \
         exec {t} --log /trainer.log --step-ms 20",
        r = q(&root),
        t = q(&fx.trainer),
    );
    let p = Proc::spawn_ready(
        Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .env("LD_LIBRARY_PATH", inner_lib.parent().unwrap()),
    );
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", p.host_pid())).unwrap();
    assert!(
        maps.contains(&format!(" {}\n", inner_lib.display())),
        "the container names its library {}: {maps}",
        inner_lib.display()
    );
    // Inside the root, the library's name now points at the host file's
    // absolute path (which, inside the root, leads nowhere).
    let in_root = root.join(inner_lib.strip_prefix("/").unwrap());
    std::fs::remove_file(&in_root).unwrap();
    std::os::unix::fs::symlink(&host_file, &in_root).unwrap();

    let e = attach_then_sigint(
        p.host_pid(),
        3,
        &["--marker", "libfixture_backward:backward"],
    );
    assert_clean_exit(&e);
    assert!(e.status.success(), "{}", e.stderr);
    assert!(
        !e.stderr.contains(&host_id),
        "the host file was read: {}",
        e.stderr
    );
    assert!(
        !serde_json::to_string(&e.events).unwrap().contains(&host_id),
        "the host file was read"
    );
    assert!(
        e.stderr
            .contains(&format!("{} was deleted", inner_lib.display())),
        "{}",
        e.stderr
    );
    assert!(e.of("step").len() >= 3, "{}", e.stderr);
}
