//! Builds the native test fixtures (tests/fixtures/Makefile) into
//! `<target>/fixtures`, under the same lock file that the integration tests
//! (tests/common/mod.rs) take, so a demo and a test run never race.

use std::{path::PathBuf, process::Command};

use anyhow::{Context as _, Result};

use crate::util;

pub struct Fixtures {
    pub dir: PathBuf,
}

impl Fixtures {
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

pub fn build() -> Result<Fixtures> {
    let src = util::workspace_root().join("tests/fixtures");
    let dir = util::target_dir().join("fixtures");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let lock = dir.join(".build.lock");
    // flock(1) (util-linux) holds the same advisory lock as the tests' flock(2).
    let mut cmd = Command::new("flock");
    cmd.arg(&lock)
        .arg("make")
        .arg("--no-print-directory")
        .arg("-C")
        .arg(&src)
        .arg(format!("OUT={}", dir.display()));
    util::run(&mut cmd).context("building the test fixtures (needs gcc, g++, make, systemtap-sdt-dev: run `cargo xtask setup`)")?;
    Ok(Fixtures { dir })
}
