//! `cargo xtask demo`: start the sample trainer and watch dynprof find its steps.

use std::{
    io::{BufRead as _, BufReader},
    process::{Child, Command, Stdio},
};

use anyhow::{Context as _, Result, bail};

use crate::{fixtures, setup, util};

/// Kills (SIGTERM, then SIGKILL) and reaps the trainer however the demo ends.
struct Trainer(Child);

impl Drop for Trainer {
    fn drop(&mut self) {
        let pid = self.0.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        for _ in 0..50 {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn run() -> Result<()> {
    setup::run()?;

    println!("[demo] cargo build -p dynprof");
    util::run(util::cargo().args(["build", "-p", "dynprof"])).context("building dynprof failed")?;
    let dynprof = util::target_dir().join("debug/dynprof");

    println!("[demo] building the sample trainer (tests/fixtures)");
    let fx = fixtures::build()?;
    let trainer_bin = fx.path("trainer");
    let mut trainer = Trainer(
        Command::new(&trainer_bin)
            .args(["--steps", "0", "--step-ms", "50"])
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", trainer_bin.display()))?,
    );
    let mut line = String::new();
    BufReader::new(trainer.0.stdout.take().expect("piped"))
        .read_line(&mut line)
        .context("reading the trainer's `ready` line")?;
    let pid: u32 = line
        .strip_prefix("ready ")
        .and_then(|p| p.trim().parse().ok())
        .with_context(|| {
            format!(
                "the trainer printed `{}` instead of `ready <pid>`",
                line.trim()
            )
        })?;
    println!("[demo] trainer running as pid {pid} (one step every ~50 ms)");

    let mut cmd = Command::new(&dynprof);
    cmd.args(["attach", "--pid", &pid.to_string()])
        .args(["--marker", "exe:optimizer_step"])
        .args(["--marker", "libfixture_backward:backward,role=aux"])
        .args(["--duration", "5"]);
    println!("[demo] {}", util::display(&cmd));
    let status = cmd
        .status()
        .with_context(|| format!("starting {}", dynprof.display()))?;
    drop(trainer);
    if !status.success() {
        bail!("dynprof attach failed ({status})");
    }
    println!("[demo] done: dynprof exited 0");
    Ok(())
}
