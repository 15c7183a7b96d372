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

/// Debian bookworm's arm64 CPython 3.11 (with its headers), unpacked under
/// [`PYTHON_ROOTFS_DIR`] for tests/python_versions.rs in the arm64 VM and
/// the arm64 layout check of `symbols::python`. Unpacked, not installed:
/// its packages are Multi-Arch: same, and installing them would move the
/// host's own python3.11 to their version. The binary runs from here (it
/// finds its standard library beside itself) with the host's libc6:arm64
/// and this tree's zlib and expat on `LD_LIBRARY_PATH`.
pub const PYTHON311_ARM64: &str = "python3.11-arm64";
const PYTHON311_ARM64_DEBS: &[&str] = &[
    "python3.11-minimal:arm64",
    "libpython3.11-minimal:arm64",
    "libpython3.11-stdlib:arm64",
    "libpython3.11-dev:arm64",
    "zlib1g:arm64",
    "libexpat1:arm64",
];

/// Debian bookworm's arm64 PyTorch 1.13 (`python3-torch`) with its whole
/// dependency closure (388 packages, ~950 MB unpacked), unpacked under
/// [`PYTHON_ROOTFS_DIR`] for the real-PyTorch tests in the arm64 VM
/// (Kunpeng hosts are arm64). Unpacked, not installed, for the reason
/// given at [`PYTHON311_ARM64`]: the tests run its python3.11 in place
/// with the tree's libraries on `LD_LIBRARY_PATH`.
pub const TORCH_ARM64: &str = "torch1.13-arm64";

/// Builds the missing root filesystems. Not fatal: without them the
/// version tests skip for a developer (and fail under CI).
pub fn python_roots() {
    report(
        "arm64 python3.11 (bookworm, unpacked)",
        python311_arm64(),
        "not unpacked",
        "its tests skip (fail under CI)",
    );
    report(
        "arm64 PyTorch 1.13 (bookworm, unpacked)",
        torch_arm64(),
        "not unpacked",
        "its tests skip (fail under CI)",
    );
    for (suite, version) in PYTHON_ROOTS {
        report(
            &format!("python{version} root filesystem ({suite})"),
            one(suite, version),
            "not built",
            "tests/python_versions.rs will skip (fail under CI)",
        );
    }
}

/// One line of setup's summary: the tree's state, or why it is missing
/// and what that costs.
fn report(what: &str, r: Result<String>, failed: &str, consequence: &str) {
    match r {
        Ok(state) => setup::say(what, &state),
        Err(e) => setup::say(what, &format!("{failed} ({e:#}); {consequence}")),
    }
}

/// Creates `base` and holds `base/NAME.lock` until the returned file is
/// dropped, so that two setups (CI and a developer's, say) never build
/// the same tree at once.
fn lock_tree(base: &Path, name: &str) -> Result<std::fs::File> {
    std::fs::create_dir_all(base).with_context(|| format!("creating {}", base.display()))?;
    let path = base.join(format!("{name}.lock"));
    let lock =
        std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    lock.lock()
        .with_context(|| format!("locking {}", path.display()))?;
    Ok(lock)
}

fn one(suite: &str, version: &str) -> Result<String> {
    let base = Path::new(PYTHON_ROOTFS_DIR);
    let dir = base.join(format!("python{version}"));
    let python = format!("usr/bin/python{version}");
    if dir.join(STAMP).is_file() && dir.join(&python).is_file() {
        return Ok("ok (already built)".into());
    }
    setup::ensure_packages(&[("mmdebstrap", "root filesystems with python3.13/3.14")])?;
    let _lock = lock_tree(base, &format!("python{version}"))?;
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

fn python311_arm64() -> Result<String> {
    let base = Path::new(PYTHON_ROOTFS_DIR);
    let dir = base.join(PYTHON311_ARM64);
    if dir.join(STAMP).is_file() {
        return Ok("ok (already unpacked)".into());
    }
    let debs = crate::vm::arm64_debs(PYTHON311_ARM64_DEBS)?;
    // A fixed name of ours: a half-unpacked tree is removed, never reused.
    let tmp = base.join(format!("{PYTHON311_ARM64}.tmp"));
    for d in [&tmp, &dir] {
        if d.exists() {
            std::fs::remove_dir_all(d).with_context(|| format!("removing {}", d.display()))?;
        }
    }
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    for deb in &debs {
        util::run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(&tmp))
            .with_context(|| format!("unpacking {}", deb.display()))?;
    }
    let python = tmp.join("usr/bin/python3.11");
    if !python.is_file() {
        bail!("unpacked, but {} is missing", python.display());
    }
    std::fs::rename(&tmp, &dir)
        .with_context(|| format!("renaming {} to {}", tmp.display(), dir.display()))?;
    std::fs::write(
        dir.join(STAMP),
        format!(
            "bookworm arm64 python3.11: {}\n",
            PYTHON311_ARM64_DEBS.join(" ")
        ),
    )
    .with_context(|| format!("writing {}", dir.join(STAMP).display()))?;
    Ok(format!("ok (unpacked {} packages)", debs.len()))
}

fn torch_arm64() -> Result<String> {
    let base = Path::new(PYTHON_ROOTFS_DIR);
    let dir = base.join(TORCH_ARM64);
    if dir.join(STAMP).is_file() {
        return Ok("ok (already unpacked)".into());
    }
    let _lock = lock_tree(base, TORCH_ARM64)?;
    if dir.join(STAMP).is_file() {
        return Ok("ok (unpacked by another setup meanwhile)".into());
    }
    let started = std::time::Instant::now();
    let debs_dir = base.join(format!("{TORCH_ARM64}.debs"));
    let debs = crate::vm::arm64_closure("python3-torch", &debs_dir)?;
    // Fixed names of ours: a half-unpacked tree is removed, never reused.
    let tmp = base.join(format!("{TORCH_ARM64}.tmp"));
    for d in [&tmp, &dir] {
        if d.exists() {
            std::fs::remove_dir_all(d).with_context(|| format!("removing {}", d.display()))?;
        }
    }
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    // Not glibc: the binaries run with the host's libc6:arm64 and its
    // loader (/lib/ld-linux-aarch64.so.1), which a libc.so.6 of another
    // build on LD_LIBRARY_PATH would not match.
    let mut unpacked = 0;
    for deb in &debs {
        let name = deb.file_name().unwrap_or_default().to_string_lossy();
        if name.starts_with("libc6_") {
            continue;
        }
        util::run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(&tmp))
            .with_context(|| format!("unpacking {}", deb.display()))?;
        unpacked += 1;
    }
    // What update-alternatives would have linked: the reference BLAS and
    // LAPACK that libtorch and numpy load by their sonames.
    let multiarch = tmp.join("usr/lib/aarch64-linux-gnu");
    for (sub, lib) in [("blas", "libblas.so.3"), ("lapack", "liblapack.so.3")] {
        if multiarch.join(sub).join(lib).exists() && !multiarch.join(lib).exists() {
            std::os::unix::fs::symlink(format!("{sub}/{lib}"), multiarch.join(lib))
                .with_context(|| format!("linking {lib}"))?;
        }
    }
    for want in [
        "usr/bin/python3.11",
        "usr/lib/python3/dist-packages/torch/__init__.py",
        "usr/lib/aarch64-linux-gnu/libtorch_cpu.so.1.13",
    ] {
        if !tmp.join(want).exists() {
            bail!("unpacked, but {} is missing", tmp.join(want).display());
        }
    }
    std::fs::rename(&tmp, &dir)
        .with_context(|| format!("renaming {} to {}", tmp.display(), dir.display()))?;
    std::fs::write(
        dir.join(STAMP),
        "bookworm arm64 python3-torch and its dependencies\n",
    )
    .with_context(|| format!("writing {}", dir.join(STAMP).display()))?;
    // The tree is what the tests use; the 220 MB of packages are not kept.
    let _ = std::fs::remove_dir_all(&debs_dir);
    Ok(format!(
        "ok (unpacked {unpacked} packages in {:.0} s)",
        started.elapsed().as_secs_f64()
    ))
}
