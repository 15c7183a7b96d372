//! The built-in collectors driven through the command line (`dynprof attach`
//! with windows from flags), `dynprof report` on what they wrote, and the
//! API sets of other runtimes (a fake CUDA) and user-defined APIs.

#[path = "collectors_util.rs"]
mod collectors_util;
mod common;
#[path = "windows_util.rs"]
mod windows_util;

use std::{
    collections::BTreeMap,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use collectors_util::*;
use common::*;
use dynprof::{
    collect::{CollectorOptions, parse_collect},
    output::chrome_trace::validate_trace,
};

/// Runs `dynprof attach` on `pid` at the trainer's `optimizer_step` with
/// `args` (plus `-o out`) to completion and returns the one PROF directory
/// it wrote.
fn cli_window(pid: u32, out: &Path, args: &[&str]) -> PathBuf {
    cli_window_at(pid, out, "exe:optimizer_step", args)
}

/// [`cli_window`] at another step marker.
fn cli_window_at(pid: u32, out: &Path, marker: &str, args: &[&str]) -> PathBuf {
    let (dirs, stderr) = cli_windows(pid, out, marker, args);
    assert_eq!(dirs.len(), 1, "{dirs:?}\n{stderr}");
    dirs.into_iter().next().unwrap()
}

/// Runs `dynprof attach` to completion; the PROF directories it wrote, in
/// order, and its stderr.
fn cli_windows(pid: u32, out: &Path, marker: &str, args: &[&str]) -> (Vec<PathBuf>, String) {
    let o = Command::new(dynprof_bin())
        .args([
            "attach",
            "--pid",
            &pid.to_string(),
            "--marker",
            marker,
            "--json",
            "-o",
        ])
        .arg(out)
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "dynprof attach failed: {stderr}");
    (windows_util::prof_dirs(out), stderr)
}

fn json_file(p: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .unwrap()
}

/// `--ring-buffer-kb 4`: a one-page ring, thousands of API calls per step.
/// The window's summary and meta.json count every lost event:
/// calls recorded + api drops == calls made, exactly.
#[test]
fn collectors_cli_small_ring_buffer() {
    require_privileges!();
    let _g = serial();
    let dir = scratch_dir("collectors_cli_small_ring_buffer");
    let calls_per_step = 4000u64;
    // 20 ms of host work per step leaves the scheduler time to arm.
    let (p, _) = acl_trainer(
        &dir,
        &[
            "--calls-per-step",
            &calls_per_step.to_string(),
            "--cpu-us",
            "20000",
        ],
    );
    let prof = cli_window(
        p.pid,
        &dir.join("out"),
        &[
            "--start-step",
            "10",
            "--active",
            "3",
            "--collect",
            "api",
            "--ring-buffer-kb",
            "4",
            // Woken only at boundaries and ticks: a 4 KiB ring must overflow.
            "--ring-wake-kb",
            "1024",
        ],
    );
    let summary = json_file(&prof.join("summary.json"));
    let meta = json_file(&prof.join("meta.json"));
    let recorded = summary["api_calls"].as_u64().unwrap();
    let dropped = summary["drops"]["api"].as_u64().unwrap();
    eprintln!(
        "recorded {recorded} + dropped {dropped} of {} calls",
        3 * (calls_per_step + 2)
    );
    assert!(dropped > 0, "{summary}");
    assert_eq!(recorded + dropped, 3 * (calls_per_step + 2), "{summary}");
    assert_eq!(meta["drops"]["api"].as_u64(), Some(dropped), "{meta}");
    // `report` says so too.
    let o = Command::new(dynprof_bin())
        .arg("report")
        .arg(&prof)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains(&format!("api={dropped}")), "{text}");
}

/// The default collectors through `dynprof attach` and `dynprof report`.
#[test]
fn collectors_cli_window_and_report() {
    require_privileges!();
    let _g = serial();
    let dir = scratch_dir("collectors_cli_window_and_report");
    let (p, _) = acl_trainer(
        &dir,
        &["--launches", "8", "--kernel-us", "4000", "--cpu-us", "2000"],
    );
    let prof = cli_window(
        p.pid,
        &dir.join("out"),
        &[
            "--start-step",
            "5",
            "--warmup",
            "1",
            "--active",
            "4",
            "--cpu-hz",
            "499",
        ],
    );
    for f in [
        "steps.csv",
        "api_summary.csv",
        "cpu.folded",
        "flamegraph.svg",
        "offcpu.folded",
        "offcpu.svg",
        "trace.json",
        "summary.json",
        "meta.json",
    ] {
        assert!(prof.join(f).is_file(), "{f} missing in {}", prof.display());
    }
    let trace = json_file(&prof.join("trace.json"));
    validate_trace(&trace).unwrap();
    let rows = steps_csv(&prof);
    assert_eq!(rows.len(), 4);
    assert!(rows.iter().all(|r| r["api_calls"] == 10), "{rows:?}");
    let o = Command::new(dynprof_bin())
        .arg("report")
        .arg(&prof)
        .arg("--json")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let r = if r.is_array() { r[0].clone() } else { r };
    assert_eq!(r["verdict"]["bound"], "device-bound", "{r}");
}

/// Two api windows back to back (`--gap 0`): the probes stay attached
/// across the first close (the next window starts at once). Every step of
/// both windows has exactly its 5 launches, 1 copy and 1 synchronize:
/// nothing of the first window is late into the second or lost at the
/// close. (An experiment that held each thread's events in a batch of 8
/// failed this: the second window's first calls filled the batch that
/// held the first window's last ones, and it reached the ring after the
/// first close; docs/performance.md.)
#[test]
fn collectors_cli_api_windows_back_to_back() {
    require_privileges!();
    let _g = serial();
    let dir = scratch_dir("collectors_cli_api_windows_back_to_back");
    let (p, _) = acl_trainer(
        &dir,
        &["--launches", "5", "--kernel-us", "1000", "--cpu-us", "1000"],
    );
    let (dirs, stderr) = cli_windows(
        p.pid,
        &dir.join("out"),
        "exe:optimizer_step",
        &[
            "--collect",
            "api",
            "--start-step",
            "5",
            "--active",
            "3",
            "--repeat",
            "1",
            "--gap",
            "0",
        ],
    );
    assert_eq!(dirs.len(), 2, "{dirs:?}\n{stderr}");
    for (i, d) in dirs.iter().enumerate() {
        let meta = json_file(&d.join("meta.json"));
        assert_eq!(meta["complete"], true, "{meta}");
        assert_eq!(meta["drops"]["api"], 0, "{meta}");
        let rows = steps_csv(d);
        let steps: Vec<u64> = rows.iter().map(|r| r["step"]).collect();
        let first = 5 + 3 * i as u64;
        assert_eq!(
            steps,
            (first..first + 3).collect::<Vec<_>>(),
            "{}",
            d.display()
        );
        assert!(
            rows.iter().all(|r| r["api_calls"] == 7),
            "window {}: {rows:?}",
            i + 1
        );
    }
}

// ------------------------------------------------------------ CUDA tables

/// A stand-in CUDA runtime (`libcudart.so.12`) and driver (`libcuda.so.1`)
/// with the real entry-point names, and a trainer that uses them: the CUDA
/// API tables resolve by library and symbol name exactly as on a GPU host.
const FAKE_CUDA_C: &str = r#"
#include <time.h>
#include <stddef.h>
static void sleep_us(long us) { struct timespec ts = { us / 1000000, (us % 1000000) * 1000 }; nanosleep(&ts, 0); }
#define API __attribute__((visibility("default"), noinline))
#ifdef RUNTIME
API int cudaLaunchKernel(const void *f, unsigned gx, unsigned bx, void **args, size_t shm, void *s) { return 0; }
API int cudaMemcpy(void *d, const void *s, size_t n, int kind) { return 0; }
API int cudaMemcpyAsync(void *d, const void *s, size_t n, int kind, void *st) { return 0; }
API int cudaStreamSynchronize(void *s) { sleep_us(2000); return 0; }
API int cudaDeviceSynchronize(void) { sleep_us(1000); return 0; }
API int cudaEventSynchronize(void *e) { return 0; }
API int cudaMalloc(void **p, size_t n) { *p = 0; return 0; }
API int cudaFree(void *p) { return 0; }
#else
API int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       unsigned shm, void *s, void **args, void **extra) { return 0; }
#endif
"#;

const CUDA_TRAINER_C: &str = r#"
#include <stdio.h>
#include <stddef.h>
#include <time.h>
#include <unistd.h>
int cudaLaunchKernel(const void *, unsigned, unsigned, void **, size_t, void *);
int cudaMemcpyAsync(void *, const void *, size_t, int, void *);
int cudaStreamSynchronize(void *);
int cudaMalloc(void **, size_t);
int cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
volatile int sink;
__attribute__((noinline, visibility("default"))) void train_step(int i) { sink = i; }
__attribute__((noinline, visibility("default"))) void my_allreduce(void) {
    struct timespec ts = { 0, 500000 }; nanosleep(&ts, 0);
}
int main(void) {
    void *p; char buf[64];
    cudaMalloc(&p, 64);
    printf("ready %d\n", getpid()); fflush(stdout);
    for (int i = 1;; i++) {
        for (int k = 0; k < 4; k++) cudaLaunchKernel(0, 1, 1, 0, 0, 0);
        cuLaunchKernel(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
        cuLaunchKernel(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
        cudaMemcpyAsync(p, buf, sizeof buf, 1, 0);
        cudaStreamSynchronize(0);
        my_allreduce();
        train_step(i);
    }
}
"#;

fn build_fake_cuda(dir: &Path) -> PathBuf {
    let src = dir.join("fake_cuda.c");
    std::fs::write(&src, FAKE_CUDA_C).unwrap();
    let tsrc = dir.join("cuda_trainer.c");
    std::fs::write(&tsrc, CUDA_TRAINER_C).unwrap();
    let gcc = |args: &[&str]| {
        let o = Command::new("gcc")
            .current_dir(dir)
            .args(args)
            .output()
            .expect("gcc");
        assert!(
            o.status.success(),
            "gcc {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    let flags = ["-O2", "-g", "-fno-omit-frame-pointer", "-shared", "-fPIC"];
    gcc(&[
        &flags[..],
        &[
            "-DRUNTIME",
            "-Wl,-soname,libcudart.so.12",
            "-o",
            "libcudart.so.12",
            "fake_cuda.c",
        ],
    ]
    .concat());
    gcc(&[
        &flags[..],
        &[
            "-Wl,-soname,libcuda.so.1",
            "-o",
            "libcuda.so.1",
            "fake_cuda.c",
        ],
    ]
    .concat());
    gcc(&[
        "-O2",
        "-g",
        "-fno-omit-frame-pointer",
        "-o",
        "cuda_trainer",
        "cuda_trainer.c",
        "-L.",
        "-l:libcudart.so.12",
        "-l:libcuda.so.1",
        "-Wl,-rpath,$ORIGIN",
    ]);
    dir.join("cuda_trainer")
}

#[test]
fn collectors_cuda_tables_and_user_api() {
    require_privileges!();
    let _g = serial();
    let dir = scratch_dir("collectors_cuda_tables_and_user_api");
    let exe = build_fake_cuda(&dir);
    let p = Proc::spawn_ready(&mut Command::new(&exe));
    let opts = CollectorOptions {
        apis: vec![dynprof::collect::apis::parse_api_spec("exe:my_allreduce,wait").unwrap()],
        ..Default::default()
    };
    let run = record_window(
        p.pid,
        exe_marker("train_step"),
        parse_collect("api").unwrap(),
        opts,
        (3, 7),
        4096,
        &dir,
        None,
    );
    let d = &run.data;
    assert_eq!(d.steps.len(), 4);
    let rows = steps_csv(&run.dir);
    for (i, s) in d.steps.iter().enumerate() {
        let ours: Vec<_> = d
            .api_calls
            .iter()
            .filter(|c| c.start_ts_ns >= s.start_ts_ns && c.start_ts_ns < s.end_ts_ns)
            .collect();
        let counts = count_by(ours.iter().map(|c| c.api.as_str()));
        let expected: BTreeMap<String, u64> = [
            ("cudaLaunchKernel".to_string(), 4),
            ("cuLaunchKernel".to_string(), 2),
            ("cudaMemcpyAsync".to_string(), 1),
            ("cudaStreamSynchronize".to_string(), 1),
            ("my_allreduce".to_string(), 1),
        ]
        .into();
        assert_eq!(counts, expected, "step {}", s.step);
        for c in &ours {
            assert_eq!(
                c.class == dynprof::output::model::ApiClass::DeviceWait,
                c.api == "cudaStreamSynchronize" || c.api == "my_allreduce",
                "{c:?}"
            );
        }
        // 2 ms synchronize + 0.5 ms user wait, both slept for at least that.
        assert!(rows[i]["device_wait_ns"] >= 2_500_000, "{:?}", rows[i]);
    }
}

/// Off-CPU time of one window of `deepstack` (`pid`), from `trace.json`'s
/// off-CPU slices: (µs while runnable, µs while blocked).
fn offcpu_split(pid: u32, out: &Path) -> (f64, f64) {
    let prof = cli_window_at(
        pid,
        out,
        "exe:step_marker",
        &[
            "--collect",
            "offcpu",
            "--start-step",
            "3",
            "--warmup",
            "0",
            "--active",
            "25",
        ],
    );
    let trace = json_file(&prof.join("trace.json"));
    let (mut runnable, mut blocked) = (0.0, 0.0);
    for e in trace["traceEvents"].as_array().unwrap() {
        if e["cat"] != "offcpu" {
            continue;
        }
        let dur = e["dur"].as_f64().unwrap();
        match e["args"]["runnable"].as_bool() {
            Some(true) => runnable += dur,
            Some(false) => blocked += dur,
            None => panic!("an off-CPU slice without args.runnable: {e}"),
        }
    }
    (runnable, blocked)
}

/// The offcpu collector tells a thread that was preempted (still runnable)
/// from one that blocked: `deepstack` burning CPU on a CPU it shares with
/// another one leaves it only runnable; `deepstack --sleep` leaves it to
/// sleep. Job mode counts only blocked time as a rank's wait.
#[test]
fn collectors_offcpu_tells_preempted_from_blocked() {
    require_privileges!();
    let _g = serial();
    let dir = scratch_dir("collectors_offcpu_tells_preempted_from_blocked");
    let deepstack = fixtures().deepstack.clone();
    // Two burners pinned to CPU 0 take turns on it. (Pinned in the child
    // before exec, not by taskset: the arm64 VM runs the host's x86-64
    // binaries' root.)
    let pinned = || {
        let mut cmd = Command::new(&deepstack);
        cmd.args(["--step-ms", "20"]);
        // SAFETY: sched_setaffinity is a plain system call, safe between
        // fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(0, &mut set);
                if libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        };
        Proc::spawn_ready(&mut cmd)
    };
    let mut burner = pinned();
    let mut rival = pinned();
    let (runnable, blocked) = offcpu_split(burner.pid, &dir.join("burner"));
    burner.terminate();
    rival.terminate();
    eprintln!("burner: {runnable:.0} µs off-CPU runnable, {blocked:.0} µs blocked");
    // 25 steps of 20 ms of CPU at half a CPU: about 500 ms runnable.
    assert!(runnable >= 100_000.0, "only {runnable:.0} µs runnable");
    assert!(
        blocked <= 0.02 * (runnable + blocked),
        "a thread that never blocks was blocked {blocked:.0} of {:.0} µs",
        runnable + blocked
    );

    let mut sleeper =
        Proc::spawn_ready(Command::new(&deepstack).args(["--step-ms", "20", "--sleep"]));
    let (runnable, blocked) = offcpu_split(sleeper.pid, &dir.join("sleeper"));
    sleeper.terminate();
    eprintln!("sleeper: {runnable:.0} µs off-CPU runnable, {blocked:.0} µs blocked");
    assert!(blocked >= 200_000.0, "only {blocked:.0} µs blocked");
    assert!(
        runnable <= 0.1 * (runnable + blocked),
        "a sleeping thread was runnable {runnable:.0} of {:.0} µs",
        runnable + blocked
    );
    let _ = std::fs::remove_dir_all(&dir);
}
