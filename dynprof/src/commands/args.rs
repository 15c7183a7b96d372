//! Plan and trigger flags shared by `attach` and `launch`.
use std::{path::PathBuf, time::Duration};

use anyhow::{Result, bail};
use clap::Args;

use crate::{
    cli::{SECS_MAX, STEPS_MAX, int},
    collect::vendor_args::build_hooks,
    target::Target,
    types::Builtin,
    window::{
        Plan,
        collector::WindowHook,
        profdir::Owner,
        trigger::{PlanRequest, Source},
    },
};

/// A step count flag: `min..=STEPS_MAX`.
fn steps(min: u64) -> impl Fn(&str) -> Result<u64, String> + Clone + Send + Sync + 'static {
    int(min, STEPS_MAX)
}

#[derive(Args, Debug, Clone, Default)]
#[command(next_help_heading = "Windows and triggers")]
pub struct WindowArgs {
    /// Vendor collectors (msprof, torch_npu dynamic_profile) and user hooks
    /// driven at the window boundaries (see docs/ascend.md).
    #[command(flatten)]
    pub vendor: crate::collect::vendor_args::VendorArgs,

    /// First step of the window (warmup included): a step number counted
    /// from attach (hit k of the step marker begins step k), or -1 for the
    /// next boundary. Recorded steps: S+W .. S+W+A-1.
    #[arg(long, value_name = "S", allow_negative_numbers = true,
          value_parser = int(-1, STEPS_MAX as i64))]
    pub start_step: Option<i64>,

    /// Steps inside the window that are not recorded.
    #[arg(long, value_name = "W", allow_negative_numbers = true, value_parser = steps(0))]
    pub warmup: Option<u64>,

    /// Steps recorded per window.
    #[arg(long, value_name = "A", allow_negative_numbers = true, value_parser = steps(1))]
    pub active: Option<u64>,

    /// Windows after the first one (0 = once).
    #[arg(long, value_name = "R", allow_negative_numbers = true, value_parser = steps(0))]
    pub repeat: Option<u64>,

    /// Steps between the end of one window and the start of the next.
    #[arg(long, value_name = "G", allow_negative_numbers = true, value_parser = steps(0))]
    pub gap: Option<u64>,

    /// Where PROF_<time>_<pid>_<n>/ window directories are written.
    #[arg(long, short = 'o', value_name = "DIR", default_value = ".")]
    pub output: PathBuf,

    /// Hand each finished window (directory and files) to the job's owner
    /// (`target`: the target's effective uid and gid) or to UID[:GID]
    /// (GID defaults to UID's primary group). Default: windows stay owned by
    /// the user running dynprof, mode 0750/0640.
    #[arg(long, value_name = "target|UID[:GID]", value_parser = parse_chown)]
    pub chown: Option<Chown>,

    /// Interactive console (`dynprof>` prompt: start, stop, capture, status,
    /// quit, help). Default when no plan flags are given and stdin is a TTY.
    #[arg(long)]
    pub interactive: bool,

    /// Console: detach after this many seconds without a command or a
    /// window (0 disables it).
    #[arg(long, value_name = "SECS", default_value_t = 1800, allow_negative_numbers = true,
          value_parser = int(0, SECS_MAX))]
    pub idle_timeout: u64,

    /// torch_npu dynamic_profile trigger: write DIR/profiler_config.json and
    /// start a window each time it is saved (see docs/windows.md).
    #[arg(long, value_name = "DIR")]
    pub config_dir: Option<PathBuf>,

    /// Collectors armed around windows: any of api,cpu,offcpu, or `none` for
    /// step timing only (default: all).
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub collect: Option<Vec<String>>,

    /// Wait up to SECS for the step marker's library to be loaded when it is
    /// not mapped yet (a job still starting up). `launch` waits as long as
    /// the program runs.
    #[arg(long, value_name = "SECS", allow_negative_numbers = true,
          value_parser = crate::cli::secs(crate::cli::Zero::Allowed))]
    pub wait_for_marker: Option<Duration>,

    /// Wait for each window boundary at real-time priority (SCHED_FIFO 1),
    /// for hosts whose CPUs the job keeps busy: the boundary's wakeup then
    /// preempts a busy thread at once, so a hook's start and stop
    /// (msprof, torch_npu) and the step read are not a time slice late.
    /// Raised only while a boundary is due, sleeping, never while
    /// spinning; back to normal priority before a closed window is
    /// drained. Keeps CAP_SYS_NICE. See docs/collectors.md.
    #[arg(long)]
    pub realtime_boundaries: bool,

    /// Options of the built-in collectors (`--cpu-hz`, `--api`).
    #[command(flatten)]
    pub collector_opts: crate::collect::CollectArgs,
}

/// `--chown`: who finished windows are handed to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Chown {
    /// The target's own (effective) uid and gid.
    Target,
    Id {
        uid: u32,
        gid: Option<u32>,
    },
}

fn parse_chown(s: &str) -> std::result::Result<Chown, String> {
    if s == "target" {
        return Ok(Chown::Target);
    }
    let num = |v: &str, what: &str| {
        v.parse::<u32>()
            .ok()
            .filter(|n| *n != u32::MAX)
            .ok_or_else(|| {
                format!("`{v}` is not a numeric {what} (expected `target` or UID[:GID])")
            })
    };
    let (u, g) = match s.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (s, None),
    };
    Ok(Chown::Id {
        uid: num(u, "uid")?,
        gid: g.map(|g| num(g, "gid")).transpose()?,
    })
}

/// Which trigger drives the session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// No windows: follow steps only (the attach issue's behaviour).
    None,
    Flags,
    Console {
        plain: bool,
    },
    ConfigFile(PathBuf),
}

impl WindowArgs {
    pub fn has_plan_flags(&self) -> bool {
        self.start_step.is_some()
            || self.warmup.is_some()
            || self.active.is_some()
            || self.repeat.is_some()
            || self.gap.is_some()
    }

    /// Picks the trigger. `other_limits`: --steps/--duration/--json given,
    /// which keep the plain step-following mode on a TTY.
    pub fn mode(&self, stdin_tty: bool, other_limits: bool) -> Result<Mode> {
        let n = [
            self.has_plan_flags(),
            self.interactive,
            self.config_dir.is_some(),
        ]
        .iter()
        .filter(|b| **b)
        .count();
        if n > 1 {
            bail!("choose one trigger: plan flags (--start-step …), --interactive or --config-dir");
        }
        Ok(if let Some(d) = &self.config_dir {
            Mode::ConfigFile(d.clone())
        } else if self.has_plan_flags() {
            Mode::Flags
        } else if self.interactive {
            Mode::Console { plain: !stdin_tty }
        } else if stdin_tty && !other_limits {
            Mode::Console { plain: false }
        } else {
            Mode::None
        })
    }

    /// The flags plan.
    pub fn plan(&self) -> Result<Plan> {
        let start = self.start_step.unwrap_or(-1);
        if start == 0 {
            bail!(
                "--start-step 0 means no collection; use -1 (next boundary) or a step number >= 1"
            );
        }
        let plan = Plan {
            start_step: start,
            warmup: self.warmup.unwrap_or(0),
            active: self.active.unwrap_or(1),
            repeat: self.repeat.unwrap_or(0),
            gap: self.gap.unwrap_or(0),
        };
        plan.validate()?;
        Ok(plan)
    }

    /// `--collect`: the built-in collectors windows arm (`None`: all; empty
    /// for `none`, step timing only).
    pub fn collectors(&self) -> Result<Option<Vec<Builtin>>> {
        let Some(c) = &self.collect else {
            return Ok(None);
        };
        // `none`: windows with step timing only (steps.csv, trace, summary).
        if c.len() == 1 && c[0] == "none" {
            return Ok(Some(Vec::new()));
        }
        c.iter()
            .map(|n| {
                Builtin::from_name(n).ok_or_else(|| {
                    anyhow::anyhow!(
                        "--collect: unknown collector `{n}` (known: {}, or `none` for step timing only)",
                        Builtin::names()
                    )
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    pub fn flags_request(&self) -> Result<PlanRequest> {
        let mut r = PlanRequest::new(self.plan()?, Source::Flags);
        r.collect = self.collectors()?;
        Ok(r)
    }

    /// The owner `--chown` names, resolved against the target.
    pub fn chown_owner(&self, target: crate::types::HostPid) -> Result<Option<Owner>> {
        Ok(match self.chown {
            None => None,
            Some(Chown::Target) => {
                let (uid, gid) = crate::sys::hostfs::process_owner(target.0)?;
                Some(Owner {
                    uid,
                    gid: Some(gid),
                })
            }
            Some(Chown::Id { uid, gid }) => Some(Owner {
                uid,
                gid: gid.or_else(|| crate::sys::hostfs::primary_gid(uid)),
            }),
        })
    }

    pub fn idle_timeout(&self) -> Option<Duration> {
        (self.idle_timeout > 0).then(|| Duration::from_secs(self.idle_timeout))
    }

    /// The hooks for `attach`/`launch` ([`build_hooks`]): in config-file mode
    /// (`--config-dir`) msprof's collection switches follow that directory's
    /// profiler_config.json.
    pub fn build_hooks(&self, target: &Target) -> Result<Vec<Box<dyn WindowHook>>> {
        let mut v = self.vendor.clone();
        if let Some(d) = &self.config_dir
            && v.profiler_config_path.is_none()
        {
            v.profiler_config_path = Some(d.join("profiler_config.json"));
        }
        build_hooks(&v, target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chown_values() {
        assert_eq!(parse_chown("target"), Ok(Chown::Target));
        assert_eq!(
            parse_chown("1000"),
            Ok(Chown::Id {
                uid: 1000,
                gid: None
            })
        );
        assert_eq!(
            parse_chown("1000:50"),
            Ok(Chown::Id {
                uid: 1000,
                gid: Some(50)
            })
        );
        for bad in ["", "alice", "-1", "1:x", "4294967295"] {
            assert!(parse_chown(bad).is_err(), "{bad}");
        }
    }
}
