//! Small helpers around `std::process::Command` and workspace paths.

use std::{
    path::PathBuf,
    process::{Command, Output},
};

use anyhow::{Context as _, Result, bail};

/// The workspace root (the parent of `xtask/`).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask has a parent directory")
        .to_path_buf()
}

/// Cargo's target directory: `$CARGO_TARGET_DIR` or `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) if !d.is_empty() => {
            let d = PathBuf::from(d);
            if d.is_absolute() {
                d
            } else {
                workspace_root().join(d)
            }
        }
        _ => workspace_root().join("target"),
    }
}

/// Human-readable rendering of a command line, for messages.
pub fn display(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        let a = a.to_string_lossy();
        if a.contains(' ') || a.is_empty() {
            s.push_str(&format!(" '{a}'"));
        } else {
            s.push(' ');
            s.push_str(&a);
        }
    }
    s
}

/// Runs a command with inherited stdio; fails unless it exits 0.
pub fn run(cmd: &mut Command) -> Result<()> {
    let shown = display(cmd);
    let status = cmd
        .status()
        .with_context(|| format!("could not start `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// Runs a command capturing its output; `Ok(None)` if the program does not exist.
pub fn try_output(cmd: &mut Command) -> Result<Option<Output>> {
    let shown = display(cmd);
    match cmd.output() {
        Ok(o) => Ok(Some(o)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("could not start `{shown}`")),
    }
}

/// Runs a command, captures stdout, and fails (showing stderr) unless it exits 0.
pub fn stdout_of(cmd: &mut Command) -> Result<String> {
    let shown = display(cmd);
    let out = cmd
        .output()
        .with_context(|| format!("could not start `{shown}`"))?;
    if !out.status.success() {
        bail!(
            "`{shown}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A `cargo` command for a child build, without the variables that the outer
/// `cargo run` (of xtask itself) put into our environment.
pub fn cargo() -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace_root());
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if k.starts_with("CARGO_PKG_")
            || k.starts_with("CARGO_BIN_")
            || k == "CARGO_MANIFEST_DIR"
            || k == "CARGO_MANIFEST_PATH"
            || k == "CARGO_CRATE_NAME"
            || k == "CARGO_PRIMARY_PACKAGE"
        {
            cmd.env_remove(k.as_ref());
        }
    }
    cmd
}
