//! The Python environments `setup` installs into caches outside the
//! checkout: the PyTorch 2.x venv (and torchvision for the ResNet test),
//! py-spy for the Python-frame comparison, kubernetes-validate for the
//! manifests' schema check.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use super::{dpkg_installed, is_root, run, say};
use crate::util;

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
pub(super) fn py_spy_venv() {
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
pub(super) fn kubernetes_validate_venv() {
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
