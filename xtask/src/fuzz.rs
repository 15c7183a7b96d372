//! `cargo xtask fuzz [--seconds N] [TARGET]...`: run the libFuzzer targets in
//! `fuzz/` (one per parser of target-controlled input, docs/fuzzing.md) for
//! a bounded time each.
//!
//! A run fails on a panic, a hang longer than [`TIMEOUT_S`], memory past
//! [`RSS_LIMIT_MB`], or one allocation past [`MALLOC_LIMIT_MB`] (so a size
//! read from a file and passed to `Vec::with_capacity` fails here). The
//! input that did it is saved under `fuzz/artifacts/<target>/` and its path
//! printed.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context as _, Result, bail};

use crate::{setup, util};

/// The fuzz targets (`fuzz/fuzz_targets/<name>.rs`), with the input each
/// one stands for and the largest input it is given.
pub const TARGETS: &[(&str, &str, usize)] = &[
    (
        "elf",
        "ELF files: build id, symbols, .note.stapsdt",
        64 * 1024,
    ),
    ("usdt_args", "USDT argument specs", 4096),
    ("demangle", "C++ symbol names", 4096),
    ("cgroup", "/proc/PID/cgroup, container ids", 4096),
    (
        "proc_files",
        "/proc/PID/{maps,status,stat,environ,cmdline}",
        16 * 1024,
    ),
    (
        "config_json",
        "profiler_config.json, msprof args, dp logs",
        16 * 1024,
    ),
    ("marker_spec", "--marker SPEC, --in-pidns REF", 4096),
];

/// What `cargo xtask test` gives each target.
pub const CI_SECONDS: u64 = 20;
/// A single input that runs longer than this is a hang.
pub const TIMEOUT_S: u64 = 10;
/// Peak RSS a target may reach. AddressSanitizer's shadow memory and
/// quarantine alone take 250–400 MB.
pub const RSS_LIMIT_MB: u64 = 1024;
/// The largest single allocation: no input of these sizes (at most 64 KiB)
/// needs more, so a bigger one is a size taken from the input.
pub const MALLOC_LIMIT_MB: u64 = 256;

pub fn fuzz_dir() -> PathBuf {
    util::workspace_root().join("fuzz")
}

/// `cargo xtask fuzz` arguments: `[--seconds N] [TARGET]...`.
pub fn run(args: &[String]) -> Result<()> {
    let mut seconds = CI_SECONDS;
    let mut names: Vec<String> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seconds" => {
                let v = it.next().context("--seconds needs a number")?;
                seconds = v
                    .parse()
                    .with_context(|| format!("--seconds `{v}` is not a number of seconds"))?;
            }
            "--list" => {
                for (name, what, _) in TARGETS {
                    println!("{name:<12} {what}");
                }
                return Ok(());
            }
            s if s.starts_with('-') => bail!(
                "unknown option `{s}`; usage: cargo xtask fuzz [--seconds N] [--list] [TARGET]..."
            ),
            s => names.push(s.to_string()),
        }
    }
    for n in &names {
        if !TARGETS.iter().any(|(t, _, _)| t == n) {
            bail!(
                "no fuzz target `{n}`; the targets are: {}",
                TARGETS
                    .iter()
                    .map(|(t, _, _)| *t)
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    setup::nightly()?;
    setup::cargo_fuzz()?;
    run_targets(&names, seconds)
}

/// Builds the fuzz crate, then runs `names` (all when empty) for `seconds`
/// each, one after the other. Every target runs even when an earlier one
/// failed; the error names each failure and its reproducer.
pub fn run_targets(names: &[String], seconds: u64) -> Result<()> {
    let chosen: Vec<&(&str, &str, usize)> = TARGETS
        .iter()
        .filter(|(t, _, _)| names.is_empty() || names.iter().any(|n| n == t))
        .collect();

    let mut build = cargo_fuzz_cmd();
    build.arg("build");
    if let [(one, _, _)] = chosen.as_slice() {
        build.arg(one);
    }
    println!("[fuzz] {}", util::display(&build));
    util::run(&mut build).context("building the fuzz targets failed")?;

    let mut failures: Vec<String> = Vec::new();
    for (name, what, max_len) in chosen {
        println!("[fuzz] {name} ({what}): {seconds} s");
        match run_one(name, *max_len, seconds) {
            Ok(()) => println!("[fuzz] {name}: ok"),
            Err(e) => {
                println!("[fuzz] {name}: FAILED: {e:#}");
                failures.push(format!("{name}: {e:#}"));
            }
        }
    }
    if !failures.is_empty() {
        bail!(
            "{} fuzz target(s) failed:\n  {}\n(docs/fuzzing.md: reproduce with \
             `cargo +nightly fuzz run TARGET ARTIFACT`, then add the input as a unit test)",
            failures.len(),
            failures.join("\n  ")
        );
    }
    Ok(())
}

/// `cargo +nightly fuzz ...` from the workspace root. `+nightly` works only
/// through rustup's `cargo` proxy on PATH, not through the toolchain binary
/// that `$CARGO` names.
fn cargo_fuzz_cmd() -> Command {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(util::workspace_root());
    // Drop what the outer `cargo run` of xtask set, as util::cargo does.
    for (k, v) in util::cargo().get_envs() {
        if v.is_none() {
            cmd.env_remove(k);
        }
    }
    // Sanitizer builds never share the workspace's target directory.
    cmd.env_remove("CARGO")
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("RUSTFLAGS");
    cmd.args(["+nightly", "fuzz"]);
    cmd
}

fn run_one(name: &str, max_len: usize, seconds: u64) -> Result<()> {
    let dir = fuzz_dir();
    // libFuzzer writes what it learns to the first corpus directory (kept
    // locally, not committed); the committed seeds are only read.
    let corpus = dir.join("corpus").join(name);
    let seeds = dir.join("seeds").join(name);
    let artifacts = dir.join("artifacts").join(name);
    for d in [&corpus, &artifacts] {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let started = SystemTime::now();
    // The binary `cargo fuzz build` made, run directly: `cargo fuzz run`
    // would print a failing input as a Debug byte list, 64 KiB of noise.
    let bin = target_dir().join(name);
    if !bin.is_file() {
        bail!("{} was not built", bin.display());
    }
    let mut cmd = Command::new(&bin);
    cmd.arg(&corpus)
        .arg(&seeds)
        .arg(format!("-max_total_time={seconds}"))
        .arg(format!("-timeout={TIMEOUT_S}"))
        .arg(format!("-rss_limit_mb={RSS_LIMIT_MB}"))
        .arg(format!("-malloc_limit_mb={MALLOC_LIMIT_MB}"))
        .arg(format!("-max_len={max_len}"))
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .arg("-print_final_stats=1");
    println!("[fuzz] {}", util::display(&cmd));
    let t0 = Instant::now();
    let status = cmd
        .status()
        .with_context(|| format!("could not start `{}`", util::display(&cmd)))?;
    let took = t0.elapsed();
    if status.success() {
        // libFuzzer exits 0 after -max_total_time; make sure it did run.
        if took < Duration::from_secs(seconds.min(2)) {
            bail!(
                "libFuzzer exited after {:.1} s, before its {seconds} s",
                took.as_secs_f64()
            );
        }
        return Ok(());
    }
    let found = new_artifacts(&artifacts, started);
    if found.is_empty() {
        bail!("{} failed ({status}) and saved no input", bin.display());
    }
    let list: Vec<String> = found.iter().map(|p| p.display().to_string()).collect();
    bail!(
        "{status}; reproducer: {}\n    rerun: cargo +nightly fuzz run {name} {}",
        list.join(", "),
        list[0]
    )
}

/// Where `cargo fuzz build` puts the target binaries: release (with debug
/// assertions), host triple, under the fuzz crate's own `fuzz/target/`.
fn target_dir() -> PathBuf {
    let triple = format!("{}-unknown-linux-gnu", std::env::consts::ARCH);
    fuzz_dir().join("target").join(triple).join("release")
}

/// Inputs libFuzzer saved (crash-*, oom-*, timeout-*, leak-*, slow-unit-*)
/// since `since`.
fn new_artifacts(dir: &Path, since: SystemTime) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| {
                    e.metadata()
                        .and_then(|m| m.modified())
                        .is_ok_and(|m| m >= since)
                })
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}
