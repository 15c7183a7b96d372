//! Attach and detach 20 times against one running trainer: the trainer keeps
//! running and, afterwards, none of dynprof's programs stays loaded.
//!
//! Kept alone in its own test binary so that no other dynprof runs while it
//! enumerates the kernel's programs.
#[path = "attach_util.rs"]
mod attach_util;
mod common;

use std::{
    os::fd::{AsFd as _, AsRawFd as _},
    process::Command,
    time::Duration,
};

use attach_util::*;
use aya::{maps::MapInfo, programs::loaded_programs};
use common::*;

const T: Duration = Duration::from_secs(120);
const ROUNDS: usize = 20;

/// dynprof's eBPF program names as the kernel keeps them (15 chars at most):
/// dynprof_marker, dynprof_empty, dynprof_api_ent(er), dynprof_api_exi(t),
/// dynprof_cpu, dynprof_sched_s(witch).
fn is_dynprof_name(name: &str) -> bool {
    name.starts_with("dynprof_")
}

/// Reads element 0 of an array map by id (bpf(BPF_MAP_LOOKUP_ELEM)).
fn map_value(info: &MapInfo) -> Option<Vec<u8>> {
    let fd = info.fd().ok()?;
    let mut value = vec![0u8; info.value_size() as usize];
    let key = 0u32;
    let mut attr = [0u64; 4];
    attr[0] = fd.as_fd().as_raw_fd() as u64; // map_fd (u32) + pad
    attr[1] = &key as *const u32 as u64;
    attr[2] = value.as_mut_ptr() as u64;
    // SAFETY: BPF_MAP_LOOKUP_ELEM (1) reads key_size bytes at `key` and writes
    // value_size bytes to `value`, both valid for this call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            1 as libc::c_long,
            attr.as_mut_ptr(),
            std::mem::size_of_val(&attr),
        )
    };
    (rc == 0).then_some(value)
}

/// dynprof's programs loaded in the kernel: (id, name, target tgid found in
/// its read-only data — dynprof bakes the target's tgid into `TARGET_TGID`).
fn dynprof_programs() -> Vec<(u32, String, Vec<u32>)> {
    let mut out = Vec::new();
    for p in loaded_programs() {
        let Ok(p) = p else { continue };
        let Some(name) = p.name_as_str() else {
            continue;
        };
        if !is_dynprof_name(name) {
            continue;
        }
        let mut tgids = Vec::new();
        for id in p.map_ids().ok().flatten().unwrap_or_default() {
            let Ok(m) = MapInfo::from_id(id) else {
                continue;
            };
            if !m.name_as_str().is_some_and(|n| n.contains("rodata")) {
                continue;
            }
            if let Some(v) = map_value(&m) {
                tgids.extend(
                    v.chunks_exact(4)
                        .map(|c| u32::from_le_bytes(c.try_into().unwrap())),
                );
            }
        }
        out.push((p.id(), name.to_string(), tgids));
    }
    out
}

fn read_byte(pid: u32, addr: u64) -> u8 {
    use std::os::unix::fs::FileExt as _;
    let f = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, addr).unwrap();
    b[0]
}

/// File offset of a defined function symbol, through its PT_LOAD segment.
fn file_offset_of(data: &[u8], name: &str) -> u64 {
    use object::{Object as _, ObjectSegment as _, ObjectSymbol as _};
    let f = object::File::parse(data).unwrap();
    let addr = f
        .dynamic_symbols()
        .chain(f.symbols())
        .find(|s| s.name() == Ok(name))
        .unwrap()
        .address();
    f.segments()
        .find_map(|seg| {
            let (fo, _) = seg.file_range();
            (addr >= seg.address() && addr < seg.address() + seg.size())
                .then(|| addr - seg.address() + fo)
        })
        .unwrap()
}

/// PIDs of running processes whose comm is `dynprof`.
fn dynprof_processes() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim() == "dynprof")
        })
        .collect()
}

#[test]
fn attach_repeat_20_times_leaves_target_running_and_no_program_loaded() {
    require_privileges!();
    let fx = fixtures();
    let log = scratch_dir("attach_repeat").join("trainer.log");
    let mut p = Proc::spawn_ready(
        Command::new(&fx.trainer)
            .args(["--steps", "0", "--step-ms", "5", "--log"])
            .arg(&log),
    );
    wait_for_log_lines(&log, "step", 1, T);
    let pid = p.pid;

    let mut last_ts = 0;
    let mut probe_site = None;
    for round in 0..ROUNDS {
        let mut d = Dynprof::attach(pid, &["--marker", "exe:optimizer_step", "--steps", "2"]);
        if round == 0 {
            // Positive control: while attached, our programs are visible and
            // carry this target's tgid, so the final check is not vacuous.
            let att = d.wait_event("attached", T);
            let fo = att["markers"][0]["file_offset"].as_u64().unwrap();
            probe_site = Some(runtime_addr(pid, &fx.trainer, fo));
            assert_eq!(
                read_byte(pid, probe_site.unwrap()),
                0xcc,
                "the uprobe's int3 is in place while attached"
            );
            let progs = dynprof_programs();
            assert!(
                progs
                    .iter()
                    .any(|(_, n, tgids)| n == "dynprof_marker" && tgids.contains(&pid)),
                "while attached, dynprof_marker for tgid {pid} must be loaded: {progs:?}"
            );
        }
        let run = d.finish(T);
        run.assert_success();
        let steps = run.steps();
        assert_eq!(steps.len(), 2, "round {round}: {run}");
        assert!(steps[0].1 > last_ts, "round {round}: events must be new");
        last_ts = steps[1].1;
        assert!(p.is_running(), "round {round}: the trainer died");
    }

    // The trainer keeps stepping after the last detach.
    let before = log_lines_of(&log, "step").len();
    wait_for_log_lines(&log, "step", before + 5, T);
    assert!(p.is_running());
    let lines = log_lines_of(&log, "step");
    for w in lines.windows(2) {
        assert_eq!(
            w[1].index,
            w[0].index + 1,
            "the trainer's step log must have no gap"
        );
    }

    // The probed instruction is the file's again (no int3 left behind).
    let file = std::fs::read(&fx.trainer).unwrap();
    let sym_fo = file_offset_of(&file, "optimizer_step");
    let site = probe_site.unwrap();
    assert_eq!(
        site,
        runtime_addr(pid, &fx.trainer, sym_fo),
        "dynprof probed optimizer_step's first instruction"
    );
    assert_eq!(
        read_byte(pid, site),
        file[sym_fo as usize],
        "the original instruction byte must be restored after detach"
    );

    // Nothing of ours is left in the kernel.
    let progs = dynprof_programs();
    let ours: Vec<_> = progs.iter().filter(|(_, _, t)| t.contains(&pid)).collect();
    assert!(
        ours.is_empty(),
        "programs still loaded for target {pid}: {ours:?}"
    );
    if !progs.is_empty() {
        // A loaded program needs an owner holding its fd: only another live
        // dynprof (e.g. a concurrent developer run) may explain these. With
        // none running they were leaked.
        let others = dynprof_processes();
        assert!(
            !others.is_empty(),
            "dynprof programs loaded with no dynprof process alive: {progs:?}"
        );
        eprintln!(
            "note: dynprof programs of other dynprof processes {others:?} are loaded: {progs:?}"
        );
    }
    assert!(p.terminate().success());
}
