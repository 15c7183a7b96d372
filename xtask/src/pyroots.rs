//! Root filesystems with newer CPythons than the host's, for
//! tests/python_versions.rs: Debian trixie (python3.13) and sid
//! (python3.14). They cannot be installed on a Debian 12 host (newer
//! libc), but run fine chrooted: the tests start the interpreter with
//! `unshare --mount --pid --fork chroot DIR python3.X`, a container-like
//! target that dynprof attaches to by host PID.
//!
//! Built once with mmdebstrap into [`PYTHON_ROOTFS_DIR`] (outside the
//! checkout), with `libpython3.X-dev` for the header check of the
//! `_Py_DebugOffsets` schema. A stamp written last marks a finished
//! build; a lock file lets two setups take turns.

use std::{path::Path, process::Command};

use anyhow::{Context as _, Result, bail};

use crate::{setup, util};

/// tests/python_versions.rs and `symbols::python::layout`'s header test
/// use the same paths.
pub const PYTHON_ROOTFS_DIR: &str = "/var/cache/dynprof/python-rootfs";
/// (Debian suite, CPython version).
pub const PYTHON_ROOTS: &[(&str, &str)] = &[("trixie", "3.13"), ("sid", "3.14")];
const STAMP: &str = ".dynprof-rootfs-complete";
const MIRROR: &str = "http://deb.debian.org/debian";

/// Builds the missing root filesystems. Not fatal: without them the
/// version tests skip for a developer (and fail under CI).
pub fn python_roots() {
    for (suite, version) in PYTHON_ROOTS {
        let what = format!("python{version} root filesystem ({suite})");
        match one(suite, version) {
            Ok(state) => setup::say(&what, &state),
            Err(e) => setup::say(
                &what,
                &format!("not built ({e:#}); tests/python_versions.rs will skip (fail under CI)"),
            ),
        }
    }
}

fn one(suite: &str, version: &str) -> Result<String> {
    let base = Path::new(PYTHON_ROOTFS_DIR);
    let dir = base.join(format!("python{version}"));
    let python = format!("usr/bin/python{version}");
    if dir.join(STAMP).is_file() && dir.join(&python).is_file() {
        return Ok("ok (already built)".into());
    }
    setup::ensure_packages(&[("mmdebstrap", "root filesystems with python3.13/3.14")])?;
    std::fs::create_dir_all(base).with_context(|| format!("creating {}", base.display()))?;
    let lock_path = base.join(format!("python{version}.lock"));
    let lock = std::fs::File::create(&lock_path)
        .with_context(|| format!("creating {}", lock_path.display()))?;
    lock.lock()
        .with_context(|| format!("locking {}", lock_path.display()))?;
    if dir.join(STAMP).is_file() && dir.join(&python).is_file() {
        return Ok("ok (built by another setup meanwhile)".into());
    }
    // Both paths are ours (fixed names under our cache directory): a
    // half-built tree from an interrupted run is removed, never reused.
    let tmp = base.join(format!("python{version}.tmp"));
    for d in [&tmp, &dir] {
        if d.exists() {
            std::fs::remove_dir_all(d).with_context(|| format!("removing {}", d.display()))?;
        }
    }
    let started = std::time::Instant::now();
    let mut cmd = Command::new("mmdebstrap");
    cmd.args([
        "--variant=apt",
        "--quiet",
        // The mirror may serve a snapshot whose sid Release is past its
        // Valid-Until date; signatures are still checked.
        "--aptopt=Acquire::Check-Valid-Until \"false\"",
        &format!("--include=python{version},libpython{version}-dev"),
        suite,
    ])
    .arg(&tmp)
    .arg(MIRROR);
    println!("[setup] {}", util::display(&cmd));
    util::run(&mut cmd).with_context(|| {
        format!("mmdebstrap {suite} failed; check access to {MIRROR} and free disk space")
    })?;
    if !tmp.join(&python).is_file() {
        bail!(
            "mmdebstrap finished but {} is missing",
            tmp.join(&python).display()
        );
    }
    std::fs::rename(&tmp, &dir)
        .with_context(|| format!("renaming {} to {}", tmp.display(), dir.display()))?;
    std::fs::write(dir.join(STAMP), format!("{suite} python{version}\n"))
        .with_context(|| format!("writing {}", dir.join(STAMP).display()))?;
    Ok(format!(
        "ok (built in {:.0} s)",
        started.elapsed().as_secs_f64()
    ))
}
