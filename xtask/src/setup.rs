//! `cargo xtask setup`: make this machine able to build and test dynprof.
//!
//! Idempotent: every step first checks, and only acts when something is
//! missing. Each step prints one `[setup] <what>: <state>` line.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::util::{self, stdout_of, try_output};

/// Debian packages that building and testing need.
pub const DEBIAN_PACKAGES: &[(&str, &str)] = &[
    ("gcc", "C fixtures"),
    ("g++", "C++ fixtures"),
    ("make", "fixture builds"),
    ("util-linux", "unshare, flock"),
    ("procps", "ps, kill"),
    ("systemtap-sdt-dev", "sys/sdt.h for USDT probes in fixtures"),
    ("python3", "Debian's /usr/bin/python3 with USDT probes"),
    ("python3-torch", "PyTorch for the real-training tests"),
    (
        "python3.11-dev",
        "CPython 3.11's internal headers: the Python frame offsets test",
    ),
    (
        "bpftool",
        "the attach/detach leak test lists loaded eBPF programs, links and maps",
    ),
    (
        "prometheus",
        "tests/agent.rs: a real Prometheus scrapes `dynprof agent`",
    ),
    (
        "systemd",
        "tests/deploy_manifests.rs: systemd-analyze verify of the agent's unit",
    ),
    (
        "gcc-aarch64-linux-gnu",
        "the aarch64 cross build (linker for aarch64-unknown-linux-gnu; docs/portability.md)",
    ),
    (
        "libc6-dev-arm64-cross",
        "the aarch64 cross build (arm64 glibc to link against)",
    ),
];

/// The Rust target of the aarch64 cross build; its linker is set in
/// .cargo/config.toml.
pub const AARCH64_TARGET: &str = "aarch64-unknown-linux-gnu";

pub fn say(what: &str, state: &str) {
    println!("[setup] {what}: {state}");
}

pub fn run() -> Result<()> {
    nightly()?;
    rust_src()?;
    bpf_linker()?;
    debian_packages()?;
    aarch64_target()?;
    tracefs();
    py_spy_venv();
    crate::pyroots::python_roots();
    kubernetes_validate_venv();
    cargo_fuzz()?;
    println!("[setup] done");
    Ok(())
}

fn rustup() -> Command {
    Command::new("rustup")
}

pub fn nightly() -> Result<()> {
    let what = "nightly toolchain";
    let list = try_output(rustup().args(["toolchain", "list"]))?.context(
        "`rustup` not found on PATH: install rustup (https://rustup.rs) and put ~/.cargo/bin on PATH",
    )?;
    if !list.status.success() {
        bail!(
            "`rustup toolchain list` failed: {}",
            String::from_utf8_lossy(&list.stderr).trim()
        );
    }
    let have = String::from_utf8_lossy(&list.stdout)
        .lines()
        .any(|l| l.starts_with("nightly-") || l.starts_with("nightly "));
    if have {
        say(what, "ok (already installed)");
        return Ok(());
    }
    say(
        what,
        "missing, installing (rustup toolchain install nightly --profile minimal)",
    );
    util::run(rustup().args(["toolchain", "install", "nightly", "--profile", "minimal"])).context(
        "could not install the nightly toolchain; check network access to static.rust-lang.org, \
         or install it by hand: rustup toolchain install nightly --profile minimal",
    )?;
    say(what, "ok (installed)");
    Ok(())
}

fn rust_src() -> Result<()> {
    let what = "rust-src for nightly";
    let installed =
        stdout_of(rustup().args(["component", "list", "--toolchain", "nightly", "--installed"]))?;
    if installed.lines().any(|l| l.trim().starts_with("rust-src")) {
        say(what, "ok (already installed)");
        return Ok(());
    }
    say(what, "missing, installing");
    util::run(rustup().args(["component", "add", "rust-src", "--toolchain", "nightly"])).context(
        "could not add rust-src; try: rustup component add rust-src --toolchain nightly",
    )?;
    say(what, "ok (installed)");
    Ok(())
}

/// `rustup target add aarch64-unknown-linux-gnu` for the default toolchain
/// (user space; the eBPF object is built by the nightly for `bpfel`).
fn aarch64_target() -> Result<()> {
    let what = format!("rust target {AARCH64_TARGET}");
    let installed = stdout_of(rustup().args(["target", "list", "--installed"]))?;
    if installed.lines().any(|l| l.trim() == AARCH64_TARGET) {
        say(&what, "ok (already installed)");
        return Ok(());
    }
    say(&what, "missing, installing");
    util::run(rustup().args(["target", "add", AARCH64_TARGET])).with_context(|| {
        format!(
            "could not add the {AARCH64_TARGET} target; try: rustup target add {AARCH64_TARGET}"
        )
    })?;
    say(&what, "ok (installed)");
    Ok(())
}

/// LLVM of the nightly toolchain: (major, full version).
fn nightly_llvm() -> Result<(u32, String)> {
    let vv = stdout_of(Command::new("rustc").args(["+nightly", "-vV"]))?;
    let version = vv
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version:"))
        .map(|v| v.trim().to_string())
        .context("`rustc +nightly -vV` printed no `LLVM version:` line")?;
    let major = version
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .with_context(|| format!("cannot parse the LLVM major from `{version}`"))?;
    Ok((major, version))
}

fn cargo_home() -> PathBuf {
    if let Some(h) = std::env::var_os("CARGO_HOME").filter(|h| !h.is_empty()) {
        return h.into();
    }
    PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cargo")
}

/// bpf-linker does not print its LLVM version, so we remember it here.
fn stamp_path() -> PathBuf {
    cargo_home().join("bpf-linker.llvm-major")
}

fn which(prog: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(prog))
        .find(|p| p.is_file())
}

/// The LLVM major that the installed bpf-linker uses: from the libLLVM it is
/// dynamically linked against (the `no-llvm-linking` build), else from the
/// stamp file written when we installed it.
fn installed_bpf_linker_llvm(bin: &Path) -> Option<u32> {
    if let Ok(out) = Command::new("ldd").arg(bin).output() {
        let text = String::from_utf8_lossy(&out.stdout);
        for line in text.lines().filter(|l| !l.contains("not found")) {
            let name = line.split_whitespace().next().unwrap_or("");
            // libLLVM.so.22.1-rust-1.97.0-nightly, libLLVM-22-rust-...so, libLLVM-22.so
            let rest = name
                .strip_prefix("libLLVM.so.")
                .or_else(|| name.strip_prefix("libLLVM-"));
            if let Some(rest) = rest {
                let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
                if let Ok(m) = digits.parse() {
                    return Some(m);
                }
            }
        }
    }
    std::fs::read_to_string(stamp_path())
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn bpf_linker() -> Result<()> {
    let what = "bpf-linker";
    let (major, llvm_version) = nightly_llvm()?;
    let version_out = try_output(Command::new("bpf-linker").arg("--version"))?;
    let runs = version_out.as_ref().is_some_and(|o| o.status.success());
    if runs {
        let bin = which("bpf-linker").unwrap_or_else(|| cargo_home().join("bin/bpf-linker"));
        match installed_bpf_linker_llvm(&bin) {
            Some(m) if m == major => {
                // Make the check cheap and explicit next time.
                let _ = std::fs::write(stamp_path(), format!("{major}\n"));
                say(
                    what,
                    &format!("ok (already installed, LLVM {major} = nightly's LLVM)"),
                );
                return Ok(());
            }
            Some(m) => say(
                what,
                &format!("built for LLVM {m}, nightly has LLVM {llvm_version}: rebuilding"),
            ),
            None => say(
                what,
                &format!("installed, LLVM unknown: rebuilding for LLVM {major}"),
            ),
        }
    } else if version_out.is_some() {
        say(
            what,
            "installed but does not run (its libLLVM is probably gone): rebuilding",
        );
    } else {
        say(
            what,
            &format!("missing: building against the nightly's LLVM {llvm_version}"),
        );
    }

    let sysroot = stdout_of(Command::new("rustc").args(["+nightly", "--print", "sysroot"]))?;
    let tl = PathBuf::from(sysroot.trim()).join("lib");
    let lib = std::fs::read_dir(&tl)
        .with_context(|| format!("reading {}", tl.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with(&format!("libLLVM-{major}")) && n.ends_with(".so"))
        .with_context(|| {
            format!(
                "no libLLVM-{major}*.so in {}; the nightly toolchain should ship it \
                 (try: rustup component add llvm-tools --toolchain nightly, or reinstall nightly)",
                tl.display()
            )
        })?;
    let libname = lib
        .strip_prefix("lib")
        .and_then(|n| n.strip_suffix(".so"))
        .unwrap_or(&lib);
    let tl_s = tl.display().to_string();
    let rustflags = format!("-L {tl_s} -l dylib={libname} -C link-arg=-Wl,-rpath,{tl_s}");
    let features = format!("llvm-{major},no-llvm-linking");
    let mut cmd = util::cargo();
    cmd.args([
        "install",
        "--force",
        "bpf-linker",
        "--no-default-features",
        "--features",
        &features,
    ])
    .env("RUSTFLAGS", &rustflags)
    .env_remove("CARGO_TARGET_DIR")
    .env_remove("RUSTUP_TOOLCHAIN");
    println!("[setup] RUSTFLAGS=\"{rustflags}\" {}", util::display(&cmd));
    util::run(&mut cmd).with_context(|| {
        format!(
            "building bpf-linker against {libname} failed; it needs crates.io access and a C toolchain. \
             Retry by hand with: RUSTFLAGS=\"{rustflags}\" cargo install bpf-linker --no-default-features --features {features}"
        )
    })?;
    std::fs::write(stamp_path(), format!("{major}\n"))
        .with_context(|| format!("writing {}", stamp_path().display()))?;
    let check = try_output(Command::new("bpf-linker").arg("--version"))?;
    if !check.is_some_and(|o| o.status.success()) {
        bail!(
            "bpf-linker was installed but `bpf-linker --version` does not run; is {} on PATH?",
            cargo_home().join("bin").display()
        );
    }
    say(what, &format!("ok (installed, LLVM {major})"));
    Ok(())
}

/// cargo-fuzz, which builds and runs the libFuzzer targets in `fuzz/`
/// (`cargo xtask fuzz`, and `cargo xtask test` runs them; docs/fuzzing.md).
pub fn cargo_fuzz() -> Result<()> {
    let what = "cargo-fuzz";
    let runs = |out: Option<std::process::Output>| out.is_some_and(|o| o.status.success());
    if runs(try_output(Command::new("cargo-fuzz").arg("--version"))?) {
        say(what, "ok (already installed)");
        return Ok(());
    }
    say(
        what,
        "missing, installing (cargo install cargo-fuzz --locked)",
    );
    let mut cmd = util::cargo();
    cmd.args(["install", "cargo-fuzz", "--locked"])
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTUP_TOOLCHAIN");
    util::run(&mut cmd).context(
        "installing cargo-fuzz failed; it needs crates.io access. Retry by hand with: \
         cargo install cargo-fuzz --locked",
    )?;
    if !runs(try_output(Command::new("cargo-fuzz").arg("--version"))?) {
        bail!(
            "cargo-fuzz was installed but `cargo-fuzz --version` does not run; is {} on PATH?",
            cargo_home().join("bin").display()
        );
    }
    say(what, "ok (installed)");
    Ok(())
}

pub fn dpkg_installed(pkg: &str) -> Result<bool> {
    let out = try_output(Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg]))?
        .context("dpkg-query not found")?;
    Ok(out.status.success()
        && String::from_utf8_lossy(&out.stdout).trim() == "install ok installed")
}

fn debian_packages() -> Result<()> {
    ensure_packages(DEBIAN_PACKAGES)
}

/// Installs the missing ones of `packages` (name, why) with apt-get.
pub fn ensure_packages(packages: &[(&str, &str)]) -> Result<()> {
    let names: Vec<&str> = packages.iter().map(|(p, _)| *p).collect();
    if try_output(Command::new("dpkg-query").arg("--version"))?.is_none() {
        bail!(
            "this is not a Debian-based system (no dpkg-query); install the equivalents of these \
             Debian packages by hand: {}",
            names.join(" ")
        );
    }
    let mut missing = Vec::new();
    for (pkg, why) in packages {
        if dpkg_installed(pkg)? {
            say(&format!("package {pkg}"), "ok (already installed)");
        } else {
            say(&format!("package {pkg}"), &format!("missing ({why})"));
            missing.push(*pkg);
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    let root = is_root();
    if !root {
        bail!(
            "missing Debian packages: {m}; run as root, or: sudo apt-get update && sudo apt-get install -y {m}",
            m = missing.join(" ")
        );
    }
    println!("[setup] apt-get update");
    util::run(
        Command::new("apt-get")
            .args(["update", "-q"])
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
    .context("`apt-get update` failed; check access to the Debian mirrors")?;
    println!("[setup] apt-get install -y {}", missing.join(" "));
    util::run(
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
    .with_context(|| format!("`apt-get install {}` failed", missing.join(" ")))?;
    for pkg in &missing {
        if !dpkg_installed(pkg)? {
            bail!("package {pkg} is still not installed after apt-get install");
        }
        say(&format!("package {pkg}"), "ok (installed)");
    }
    Ok(())
}

pub(crate) fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|u| u.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

fn tracefs() {
    let what = "tracefs at /sys/kernel/tracing";
    let mounted = std::fs::read_to_string("/proc/mounts")
        .map(|m| {
            m.lines().any(|l| {
                let mut f = l.split_whitespace();
                let (_, mp, fs) = (f.next(), f.next(), f.next());
                mp == Some("/sys/kernel/tracing") && fs == Some("tracefs")
            })
        })
        .unwrap_or(false);
    if mounted {
        say(what, "ok (already mounted)");
        return;
    }
    match Command::new("mount")
        .args(["-t", "tracefs", "nodev", "/sys/kernel/tracing"])
        .output()
    {
        Ok(o) if o.status.success() => say(what, "ok (mounted)"),
        Ok(o) => say(
            what,
            &format!(
                "WARNING: not mounted and `mount -t tracefs nodev /sys/kernel/tracing` failed: {} \
                 (uprobes via perf_event still work; some diagnostics may not)",
                String::from_utf8_lossy(&o.stderr).trim()
            ),
        ),
        Err(e) => say(
            what,
            &format!("WARNING: not mounted, could not run mount: {e}"),
        ),
    }
}

mod venvs;
pub use venvs::*;
