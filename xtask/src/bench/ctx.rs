//! What every section needs: the release dynprof, the fixtures, the bench
//! helpers, the machine's description, and what this dynprof can do.

use std::{path::PathBuf, process::Command, time::Duration};

use anyhow::{Context as _, Result, bail};

use super::{Opts, json::Json, procs::read_trimmed, say};
use crate::util::{self, stdout_of};

pub struct Ctx {
    pub opts: Opts,
    pub dynprof: PathBuf,
    pub fixtures: PathBuf,
    /// <workspace>/bench: scripts and C sources of the bench.
    pub src: PathBuf,
    /// <target>/bench: scratch (venv, outputs, logs).
    pub work: PathBuf,
    pub python: PathBuf,
    pub hitloop: PathBuf,
    /// `py-spy`, when it installed from PyPI into <target>/bench/venv.
    pub pyspy: Result<PathBuf, String>,
    pub version: String,
    pub git: String,
    /// PyTorch bare steps/s measured by the overhead section (0 = not yet).
    pub torch_sps: std::cell::Cell<f64>,
    /// Marker program (with its string filter) per trap at
    /// ConstantString::create, ns, from section 7 (0 = not yet).
    pub cs_trap_ns: std::cell::Cell<f64>,
    /// Marker program per trap at Engine::execute, ns, from section 7.
    pub bw_trap_ns: std::cell::Cell<f64>,
}

impl Ctx {
    pub fn prepare(opts: &Opts) -> Result<Ctx> {
        if unsafe { geteuid() } != 0 {
            bail!("the bench attaches eBPF programs: run it as root (sudo -E cargo xtask bench)");
        }
        if opts.no_build {
            say("--no-build: using the existing release dynprof");
        } else {
            say("building dynprof (release)");
            util::run(util::cargo().args(["build", "--release", "-p", "dynprof"]))
                .context("building dynprof in release")?;
        }
        let dynprof = util::target_dir().join("release/dynprof");
        say("building the fixtures");
        let fixtures = crate::fixtures::build()?.dir;
        let src = util::workspace_root().join("bench");
        let work = util::target_dir().join("bench");
        std::fs::create_dir_all(&work)?;
        let hitloop = work.join("hitloop");
        util::run(
            Command::new("gcc")
                .args(["-O2", "-g", "-fno-omit-frame-pointer", "-o"])
                .arg(&hitloop)
                .arg(src.join("hitloop.c")),
        )
        .context("compiling bench/hitloop.c")?;
        let python = PathBuf::from("/usr/bin/python3");
        let version = stdout_of(Command::new(&dynprof).arg("--version"))?
            .trim()
            .to_string();
        let head = stdout_of(
            Command::new("git")
                .current_dir(util::workspace_root())
                .args(["rev-parse", "--short=12", "HEAD"]),
        )
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
        let dirty = stdout_of(
            Command::new("git")
                .current_dir(util::workspace_root())
                .args(["status", "--porcelain", "--untracked-files=no"]),
        )
        .map(|s| !s.trim().is_empty())
        .unwrap_or(false);
        let git = if dirty { format!("{head}+dirty") } else { head };
        let pyspy = pyspy(&work);
        match &pyspy {
            Ok(p) => say(format!("py-spy: {}", p.display())),
            Err(e) => say(format!("py-spy: unavailable ({e})")),
        }
        Ok(Ctx {
            opts: opts.clone(),
            dynprof,
            fixtures,
            src,
            work,
            python,
            hitloop,
            pyspy,
            version,
            git,
            torch_sps: Default::default(),
            cs_trap_ns: Default::default(),
            bw_trap_ns: Default::default(),
        })
    }

    pub fn quick(&self) -> bool {
        self.opts.quick
    }
    pub fn reps(&self) -> usize {
        self.opts.reps
    }

    pub fn dynprof_cmd(&self) -> Command {
        let mut c = Command::new(&self.dynprof);
        c.env("RUST_LOG", "warn");
        c
    }

    pub fn version_line(&self) -> String {
        format!(
            "{} ({})",
            self.version.trim_start_matches("dynprof ").trim(),
            self.git
        )
    }

    pub fn version_json(&self) -> Json {
        Json::obj(vec![
            ("version", Json::s(&self.version)),
            ("git", Json::s(&self.git)),
            ("binary", Json::s(self.dynprof.display().to_string())),
        ])
    }

    pub fn machine_line(&self) -> String {
        let m = machine();
        format!(
            "{} × {} cores, {} GiB, kernel {}, {}",
            m.cpu,
            m.cores,
            m.mem_kb / 1024 / 1024,
            m.kernel,
            m.os
        )
    }

    pub fn machine_json(&self) -> Json {
        let m = machine();
        let torch = Command::new(&self.python)
            .args([
                "-c",
                "import torch,sys;print(torch.__version__, sys.version.split()[0])",
            ])
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default();
        let rustc = stdout_of(Command::new("rustc").arg("--version")).unwrap_or_default();
        Json::obj(vec![
            ("cpu_model", Json::s(m.cpu)),
            ("cores", Json::int(m.cores as u64)),
            ("kernel", Json::s(m.kernel)),
            ("memory_kb", Json::int(m.mem_kb)),
            ("os", Json::s(m.os)),
            (
                "loadavg_at_end",
                Json::s(read_trimmed("/proc/loadavg").unwrap_or_default()),
            ),
            ("torch_python", Json::s(torch)),
            ("rustc", Json::s(rustc.trim())),
            ("python", Json::s(self.python.display().to_string())),
        ])
    }
}

unsafe extern "C" {
    fn geteuid() -> u32;
}

struct Machine {
    cpu: String,
    cores: usize,
    kernel: String,
    mem_kb: u64,
    os: String,
}

fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .and_then(|r| r.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let kernel = read_trimmed("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mem_kb = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("MemTotal:")
                    .map(|v| v.trim().trim_end_matches("kB").trim().parse().unwrap_or(0))
            })
        })
        .unwrap_or(0);
    let os = std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("PRETTY_NAME=")
                    .map(|v| v.trim_matches('"').to_string())
            })
        })
        .unwrap_or_default();
    Machine {
        cpu,
        cores,
        kernel,
        mem_kb,
        os,
    }
}

/// py-spy from PyPI into <target>/bench/venv (Debian's python3 -m venv).
fn pyspy(work: &std::path::Path) -> Result<PathBuf, String> {
    let venv = work.join("venv");
    let bin = venv.join("bin/py-spy");
    if bin.is_file() {
        return Ok(bin);
    }
    say("installing py-spy into target/bench/venv (pip install py-spy)");
    let ok = Command::new("/usr/bin/python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        return Err("python3 -m venv failed (is python3-venv installed?)".into());
    }
    let mut pip = Command::new(venv.join("bin/pip"));
    pip.args([
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "py-spy",
    ]);
    match run_with_timeout(&mut pip, Duration::from_secs(180)) {
        Ok(true) if bin.is_file() => Ok(bin),
        Ok(_) => Err("`pip install py-spy` failed here".into()),
        Err(e) => Err(format!("`pip install py-spy`: {e}")),
    }
}

fn run_with_timeout(cmd: &mut Command, t: Duration) -> Result<bool> {
    let mut child = cmd.spawn()?;
    let end = std::time::Instant::now() + t;
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(s.success());
        }
        if std::time::Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            bail!("timed out after {t:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
