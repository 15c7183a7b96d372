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

fn is_root() -> bool {
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

// ---- PyTorch 2.x venv for tests/pytorch2_attach.rs -------------------------
//
// Debian ships torch 1.13; the 2.x tests need a venv. PyPI has only the
// default wheel for Linux, which pulls the CUDA libraries (5.3 GB installed,
// 2.5 to 9.5 min here): `import torch` refuses to start without them even on a
// machine with no GPU, and the smaller CPU-only wheel lives on an index that
// this project's machines cannot reach. So it is installed once, into a cache
// outside the checkout, and reused by every later run.

/// The torch release the 2.x tests were verified on. Pinned so that CI is
/// reproducible and a cached venv is reused only while it matches.
pub const TORCH2_VERSION: &str = "2.15.0";

/// The venv's default home; tests/pytorch2_attach.rs has the same default.
/// py-spy 0.4, for tests/python_frames.rs's comparison (which skips, with
/// a message, without it).
pub const PY_SPY_VENV: &str = "/var/cache/dynprof/pyspy-venv";

/// Installs py-spy from PyPI into [`PY_SPY_VENV`]. Not fatal: only one
/// comparison test needs it.
fn py_spy_venv() {
    let what = format!("py-spy venv at {PY_SPY_VENV}");
    let dir = Path::new(PY_SPY_VENV);
    if dir.join("bin/py-spy").is_file() {
        say(&what, "ok (already installed)");
        return;
    }
    let installed = (|| -> Result<()> {
        python3_venv_package()?;
        if let Some(parent) = dir.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        util::run(
            Command::new("/usr/bin/python3")
                .args(["-m", "venv"])
                .arg(dir),
        )?;
        util::run(Command::new(dir.join("bin/pip")).args([
            "install",
            "--no-cache-dir",
            "--progress-bar",
            "off",
            "py-spy>=0.4,<0.5",
        ]))
    })();
    match installed {
        Ok(()) => say(&what, "installed"),
        Err(e) => say(
            &what,
            &format!("not installed ({e:#}); the py-spy comparison test will skip"),
        ),
    }
}

/// kubernetes-validate (PyPI): the Kubernetes OpenAPI schemas, bundled,
/// checked offline. tests/deploy_manifests.rs runs it on the DaemonSet.
pub const K8S_VALIDATE_VENV: &str = "/var/cache/dynprof/venv-kubernetes-validate";

/// Installs kubernetes-validate into [`K8S_VALIDATE_VENV`]. Not fatal
/// here; the manifest test says what is missing (and fails under CI).
fn kubernetes_validate_venv() {
    let what = format!("kubernetes-validate venv at {K8S_VALIDATE_VENV}");
    let dir = Path::new(K8S_VALIDATE_VENV);
    if dir.join("bin/kubernetes-validate").is_file() {
        say(&what, "ok (already installed)");
        return;
    }
    let installed = (|| -> Result<()> {
        python3_venv_package()?;
        if let Some(parent) = dir.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        util::run(
            Command::new("/usr/bin/python3")
                .args(["-m", "venv"])
                .arg(dir),
        )?;
        util::run(Command::new(dir.join("bin/pip")).args([
            "install",
            "--no-cache-dir",
            "--progress-bar",
            "off",
            "kubernetes-validate>=1.37,<2",
        ]))
    })();
    match installed {
        Ok(()) => say(&what, "installed"),
        Err(e) => say(
            &what,
            &format!("not installed ({e:#}); the manifest schema test will fail under CI"),
        ),
    }
}

pub const TORCH2_VENV_DEFAULT: &str = "/var/cache/dynprof/venv-torch2";

/// Written last, so that a venv left half-installed is never taken as done.
const TORCH2_STAMP: &str = ".dynprof-torch2-complete";

/// `$DYNPROF_TORCH2_VENV`, else [`TORCH2_VENV_DEFAULT`].
pub fn torch2_venv_dir() -> PathBuf {
    std::env::var_os("DYNPROF_TORCH2_VENV")
        .filter(|d| !d.is_empty())
        .map_or_else(|| TORCH2_VENV_DEFAULT.into(), PathBuf::from)
}

fn torch2_skipped() -> bool {
    std::env::var("DYNPROF_SKIP_TORCH2").is_ok_and(|v| v == "1")
}

/// Tells the torch 2.x tests where the venv is and that they must not skip
/// (unless the developer opted out with DYNPROF_SKIP_TORCH2=1).
pub fn torch2_test_env(cmd: &mut Command) {
    if torch2_skipped() {
        return;
    }
    cmd.env(
        "DYNPROF_TORCH2_PYTHON",
        torch2_venv_dir().join("bin/python"),
    )
    .env("DYNPROF_REQUIRE_TORCH2", "1");
}

/// The torch version `python` imports, or why it could not.
fn torch_version(python: &Path) -> std::result::Result<String, String> {
    let out = Command::new(python)
        .args([
            "-c",
            "import sys, torch; sys.stdout.write(torch.__version__)",
        ])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(err.lines().last().unwrap_or("").trim().to_string());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// `2.15.0+cu132` → `2.15.0`.
fn release_of(version: &str) -> &str {
    version.split('+').next().unwrap_or(version)
}

/// `setup` plus the PyTorch 2.x venv: what `cargo xtask setup` and
/// `cargo xtask test` run. The demo runs only [`run`], so that a newcomer's
/// first command does not wait for a 5 GB download.
pub fn run_with_torch2() -> Result<()> {
    run()?;
    torch2_venv()
}

/// torchvision and its two run-time needs, for the ResNet test
/// (tests/fixtures/resnet_train.py). Pinned, and installed without
/// dependencies, so that pip never swaps the venv's torch.
const TORCH2_EXTRAS: [&str; 3] = ["torchvision==0.29.2", "numpy==2.4.6", "pillow==13.0.0"];

pub fn torch2_venv() -> Result<()> {
    torch2_core()?;
    if torch2_skipped() {
        return Ok(());
    }
    torch2_extras()
}

fn torch2_extras() -> Result<()> {
    let python = torch2_venv_dir().join("bin/python");
    let what = format!("PyTorch 2.x venv extras ({})", TORCH2_EXTRAS.join(", "));
    let check = "import sys, torchvision, numpy, PIL; \
                 sys.stdout.write(f'{torchvision.__version__} {numpy.__version__} {PIL.__version__}')";
    let want = TORCH2_EXTRAS
        .iter()
        .map(|s| s.split_once("==").map_or(*s, |(_, v)| v))
        .collect::<Vec<_>>();
    let have = || -> Option<String> {
        let out = Command::new(&python).args(["-c", check]).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let matches = |v: &str| {
        let got: Vec<&str> = v.split(' ').map(release_of).collect();
        got == want
    };
    if have().is_some_and(|v| matches(&v)) {
        say(&what, "ok (already installed)");
        return Ok(());
    }
    let mut pip = Command::new(&python);
    pip.args([
        "-m",
        "pip",
        "install",
        "--no-cache-dir",
        "--progress-bar",
        "off",
        "--no-deps",
    ])
    .args(TORCH2_EXTRAS);
    println!("[setup] {}", util::display(&pip));
    util::run(&mut pip).context("installing torchvision into the PyTorch 2.x venv from PyPI")?;
    match have() {
        Some(v) if matches(&v) => {
            say(&what, &format!("ok (installed {v})"));
            Ok(())
        }
        other => bail!("installed {TORCH2_EXTRAS:?} but the venv reports {other:?}"),
    }
}

fn torch2_core() -> Result<()> {
    let dir = torch2_venv_dir();
    let what = format!("PyTorch {TORCH2_VERSION} venv at {}", dir.display());
    if torch2_skipped() {
        say(
            &what,
            "SKIPPED (DYNPROF_SKIP_TORCH2=1): the torch 2.x tests will skip",
        );
        return Ok(());
    }
    let python = dir.join("bin/python");
    if dir.join(TORCH2_STAMP).is_file() {
        match torch_version(&python) {
            Ok(v) if release_of(&v) == TORCH2_VERSION => {
                say(&what, &format!("ok (already installed, torch {v})"));
                return Ok(());
            }
            Ok(v) => say(&what, &format!("has torch {v}: reinstalling")),
            Err(e) => say(&what, &format!("broken ({e}): reinstalling")),
        }
    } else if dir.exists() {
        say(
            &what,
            "present but never completed (no stamp): reinstalling",
        );
    } else {
        say(
            &what,
            "missing, installing (one time: ~5 GB with the CUDA libraries PyPI's wheel requires)",
        );
    }

    let parent = dir
        .parent()
        .with_context(|| format!("{} has no parent directory", dir.display()))?;
    std::fs::create_dir_all(parent).with_context(|| {
        format!(
            "cannot create {}; run as root, or set DYNPROF_TORCH2_VENV to a writable directory",
            parent.display()
        )
    })?;
    // Two setups at once (two checkouts on one machine) take turns.
    let lock_path = dir.with_extension("lock");
    let lock = std::fs::File::create(&lock_path)
        .with_context(|| format!("creating {}", lock_path.display()))?;
    lock.lock()
        .with_context(|| format!("locking {}", lock_path.display()))?;
    if dir.join(TORCH2_STAMP).is_file()
        && torch_version(&python).is_ok_and(|v| release_of(&v) == TORCH2_VERSION)
    {
        say(&what, "ok (installed by another setup meanwhile)");
        return Ok(());
    }
    if dir.exists() {
        // Never remove a directory we did not make: DYNPROF_TORCH2_VENV may
        // point anywhere.
        if !dir.join("pyvenv.cfg").is_file() {
            bail!(
                "{} exists and is not a Python venv (no pyvenv.cfg); move it away or set \
                 DYNPROF_TORCH2_VENV to another directory",
                dir.display()
            );
        }
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }

    python3_venv_package()?;
    let base = Path::new("/usr/bin/python3");
    util::run(Command::new(base).arg("-m").arg("venv").arg(&dir)).with_context(|| {
        format!(
            "`{} -m venv {}` failed; is python3-venv installed?",
            base.display(),
            dir.display()
        )
    })?;
    let spec = format!("torch=={TORCH2_VERSION}");
    let mut pip = Command::new(&python);
    pip.args([
        "-m",
        "pip",
        "install",
        "--no-cache-dir",
        "--progress-bar",
        "off",
        &spec,
    ]);
    println!("[setup] {}", util::display(&pip));
    let started = std::time::Instant::now();
    util::run(&mut pip).with_context(|| {
        format!(
            "installing {spec} from PyPI failed; check access to PyPI and free disk space \
             (~6 GB under {}), or set DYNPROF_SKIP_TORCH2=1 to let the torch 2.x tests skip",
            parent.display()
        )
    })?;
    let v = torch_version(&python)
        .map_err(|e| anyhow::anyhow!("the new venv cannot import torch: {e}"))?;
    if release_of(&v) != TORCH2_VERSION {
        bail!("asked pip for {spec} but the venv has torch {v}");
    }
    std::fs::write(dir.join(TORCH2_STAMP), format!("{v}\n"))
        .with_context(|| format!("writing {}", dir.join(TORCH2_STAMP).display()))?;
    say(
        &what,
        &format!(
            "ok (installed torch {v} in {:.0} s)",
            started.elapsed().as_secs_f64()
        ),
    );
    Ok(())
}

/// Debian's python3 makes venvs (with pip) only with python3-venv.
fn python3_venv_package() -> Result<()> {
    let pkg = "python3-venv";
    if dpkg_installed(pkg)? {
        return Ok(());
    }
    if !is_root() {
        bail!("missing Debian package {pkg}; run as root, or: sudo apt-get install -y {pkg}");
    }
    say(
        &format!("package {pkg}"),
        "missing (venv for PyTorch 2.x), installing",
    );
    util::run(
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends", pkg])
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
    .with_context(|| format!("`apt-get install {pkg}` failed; try apt-get update first"))?;
    say(&format!("package {pkg}"), "ok (installed)");
    Ok(())
}
