//! CLI flags of the boundary-driven hooks (msprof, torch_npu dynamic_profile,
//! user hooks) and [`build_hooks`], which turns them into [`WindowHook`]s for
//! the window scheduler.
use std::time::Duration;

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};

use super::{
    WindowHook,
    hooks::UserHooks,
    msprof::{MsprofConfig, MsprofHook, args_from_profiler_config},
    torch_npu_dp::{DpConfig, TorchNpuDp},
};
use crate::{
    cli::{STEPS_MAX, Zero, check_secs, int, secs_f64},
    target::Target,
};

/// msprof's own limit of start+stop commands per connection.
const MSPROF_MAX_COMMANDS: u32 = 100;

/// Seconds held as `f64` (the struct is also built by code, not only by
/// clap) as a `Duration`, with the flag's name in the error.
fn flag_secs(flag: &str, v: f64, zero: Zero) -> Result<Duration> {
    check_secs(v, zero).map_err(|e| anyhow::anyhow!("{flag}: {e}"))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum VendorCollector {
    /// Ascend msprof in attach mode (`msprof --dynamic=on --pid=N`), driven at the boundaries.
    Msprof,
    /// torch_npu dynamic_profile: dynprof writes the job's profiler_config.json.
    TorchNpuDp,
}

#[derive(Args, Debug, Clone)]
pub struct VendorArgs {
    /// Vendor collector driven at the window boundaries (repeatable, or comma-separated):
    /// `msprof` (needs the job started with PROFILING_MODE=dynamic), `torch-npu-dp`.
    /// Runs alongside the built-in collectors.
    #[arg(
        long = "collector",
        value_enum,
        value_delimiter = ',',
        value_name = "NAME"
    )]
    pub collectors: Vec<VendorCollector>,

    /// msprof to run: a path inside the target's filesystem (container), or a
    /// command name looked up in the target's PATH. Default: the target's PATH,
    /// $ASCEND_HOME_PATH, $ASCEND_TOOLKIT_HOME, /usr/local/Ascend/ascend-toolkit/latest.
    #[arg(long, value_name = "PATH")]
    pub msprof: Option<String>,

    /// msprof collection switches, e.g. "--task-time=l1 --aicpu=on" (split on
    /// whitespace). Default: mapped from profiler_config.json in config mode,
    /// else "--model-execution=on --runtime-api=on --aicpu=on".
    #[arg(long, value_name = "ARGS", allow_hyphen_values = true)]
    pub msprof_args: Option<String>,

    /// msprof's --output, as the target sees it (resolved inside its root). Created
    /// for the job's uid if missing; an existing directory must belong to the job's uid.
    /// Default: a fresh /tmp/dynprof_msprof_<hostpid>_<random>.
    #[arg(long, value_name = "DIR")]
    pub msprof_output: Option<String>,

    /// msprof runs as the job (its uid, gids, capabilities, namespaces, cgroup). A job
    /// under a seccomp filter or an LSM label (AppArmor/SELinux) cannot be reproduced
    /// exactly, so dynprof refuses to start msprof for it; this flag runs msprof anyway,
    /// as the job but without that filter or label.
    #[arg(long)]
    pub msprof_allow_unconfined: bool,

    /// Extra environment for msprof (repeatable); it otherwise gets the job's own.
    #[arg(long = "msprof-env", value_name = "KEY=VALUE")]
    pub msprof_env: Vec<String>,

    /// start+stop commands per msprof connection before dynprof reconnects (msprof's limit: 100).
    #[arg(long, default_value_t = 100, value_name = "N", allow_negative_numbers = true,
          value_parser = int(2, MSPROF_MAX_COMMANDS))]
    pub msprof_max_commands: u32,

    /// Seconds to wait for msprof's prompt (connect, stop).
    #[arg(long, default_value_t = 30.0, value_name = "SECS", allow_negative_numbers = true,
          value_parser = secs_f64(Zero::Refused))]
    pub msprof_timeout: f64,

    /// The job's dynamic_profile directory (its dp.init(DIR) / PROF_CONFIG_PATH), as the
    /// target sees it. Implies --collector torch-npu-dp.
    #[arg(long, value_name = "DIR")]
    pub dp_config_dir: Option<String>,

    /// torch_npu's step number minus dynprof's step index (dp.step() calls made
    /// before dynprof attached). 0 when dynprof launched the job.
    #[arg(
        long,
        default_value_t = 0,
        value_name = "N",
        allow_negative_numbers = true,
        value_parser = int(-(STEPS_MAX as i64), STEPS_MAX as i64)
    )]
    pub dp_step_offset: i64,

    /// Steps ahead of the observed step to ask torch_npu to start, covering its
    /// config poll. 0 writes start_step = -1 ("the step after torch_npu reads it").
    #[arg(long, default_value_t = 0, value_name = "N", allow_negative_numbers = true,
          value_parser = int(0, STEPS_MAX))]
    pub dp_lead_steps: u64,

    /// `active` written to profiler_config.json (steps torch_npu records).
    #[arg(long, default_value_t = 1, value_name = "N", allow_negative_numbers = true,
          value_parser = int(1, STEPS_MAX))]
    pub dp_active: u64,

    /// Shell command run (sh -c) when a window opens. Env: DYNPROF_HOST_PID, DYNPROF_NS_PID,
    /// DYNPROF_CONTAINER, DYNPROF_STEP, DYNPROF_WINDOW, DYNPROF_WINDOW_DIR (and _FINAL_DIR).
    #[arg(long, value_name = "CMD")]
    pub on_window_start: Option<String>,

    /// Shell command run (sh -c) when a window closes (same environment).
    #[arg(long, value_name = "CMD")]
    pub on_window_end: Option<String>,

    /// Seconds before a hook's process group is killed (SIGTERM, then SIGKILL).
    #[arg(long, default_value_t = 30.0, value_name = "SECS", allow_negative_numbers = true,
          value_parser = secs_f64(Zero::Refused))]
    pub hook_timeout: f64,

    /// Seconds a window's end waits for its hooks before writing meta.json;
    /// results that come later go to <window>/hooks/hooks.json. The wait holds
    /// up dynprof's event loop (not the target), so keep it short.
    #[arg(long, default_value_t = 0.25, value_name = "SECS", allow_negative_numbers = true,
          value_parser = secs_f64(Zero::Allowed))]
    pub hook_wait: f64,

    /// The parsed profiler_config.json (not a flag): msprof's collection
    /// switches come from its `activities` and `experimental_config` when
    /// --msprof-args is not given.
    #[arg(skip)]
    pub profiler_config: Option<serde_json::Value>,

    /// Config-file mode (not a flag; set from --config-dir): the
    /// profiler_config.json msprof's switches follow, re-read after each window.
    #[arg(skip)]
    pub profiler_config_path: Option<std::path::PathBuf>,

    /// prof_dir written to profiler_config.json (as the target sees it; relative
    /// paths are the job's cwd). Default: the template's.
    #[arg(long, value_name = "DIR")]
    pub dp_prof_dir: Option<String>,
}

impl Default for VendorArgs {
    fn default() -> Self {
        Self {
            collectors: Vec::new(),
            msprof: None,
            msprof_args: None,
            msprof_output: None,
            msprof_allow_unconfined: false,
            msprof_env: Vec::new(),
            msprof_max_commands: 100,
            msprof_timeout: 30.0,
            dp_config_dir: None,
            dp_step_offset: 0,
            dp_lead_steps: 0,
            dp_active: 1,
            on_window_start: None,
            on_window_end: None,
            hook_timeout: 30.0,
            hook_wait: 0.25,
            profiler_config: None,
            profiler_config_path: None,
            dp_prof_dir: None,
        }
    }
}

impl VendorArgs {
    pub fn wants(&self, c: VendorCollector) -> bool {
        self.collectors.contains(&c)
            || (c == VendorCollector::TorchNpuDp && self.dp_config_dir.is_some())
    }

    /// The msprof hook's configuration.
    pub fn msprof_config(&self) -> Result<MsprofConfig> {
        let collection_args = match (&self.msprof_args, &self.profiler_config) {
            (Some(a), _) => a.split_whitespace().map(String::from).collect(),
            (None, Some(cfg)) => args_from_profiler_config(cfg),
            (None, None) => Vec::new(),
        };
        let mut env = Vec::new();
        for kv in &self.msprof_env {
            let Some((k, v)) = kv.split_once('=') else {
                bail!("--msprof-env {kv:?}: expected KEY=VALUE")
            };
            env.push((k.to_string(), v.to_string()));
        }
        let timeout = flag_secs("--msprof-timeout", self.msprof_timeout, Zero::Refused)?;
        if self.msprof_max_commands < 2 {
            bail!("--msprof-max-commands must be at least 2 (one start and one stop)");
        }
        Ok(MsprofConfig {
            msprof: self.msprof.clone(),
            collection_args,
            output: self.msprof_output.clone(),
            env,
            profiler_config_path: if self.msprof_args.is_none() && self.profiler_config.is_none() {
                self.profiler_config_path.clone()
            } else {
                None
            },
            max_commands: self.msprof_max_commands,
            timeout,
            allow_unconfined: self.msprof_allow_unconfined,
        })
    }
}

/// The hooks the flags ask for, in the order they should be called at a
/// boundary (msprof first: its `start` is the latency-critical write).
/// `prepare` has not been called on them yet.
pub fn build_hooks(args: &VendorArgs, _target: &Target) -> Result<Vec<Box<dyn WindowHook>>> {
    let mut hooks: Vec<Box<dyn WindowHook>> = Vec::new();
    if args.wants(VendorCollector::Msprof) {
        hooks.push(Box::new(MsprofHook::new(args.msprof_config()?)));
    }
    if args.wants(VendorCollector::TorchNpuDp) {
        let Some(dir) = args.dp_config_dir.clone() else {
            bail!(
                "--collector torch-npu-dp needs --dp-config-dir DIR (the job's dp.init directory)"
            )
        };
        hooks.push(Box::new(TorchNpuDp::new(DpConfig {
            config_dir: dir,
            step_offset: args.dp_step_offset,
            lead_steps: args.dp_lead_steps,
            active: args.dp_active,
            prof_dir: args.dp_prof_dir.clone(),
        })));
    }
    if args.on_window_start.is_some() || args.on_window_end.is_some() {
        let timeout = flag_secs("--hook-timeout", args.hook_timeout, Zero::Refused)?;
        let wait = flag_secs("--hook-wait", args.hook_wait, Zero::Allowed)?;
        hooks.push(Box::new(UserHooks::new(
            args.on_window_start.clone(),
            args.on_window_end.clone(),
            timeout,
            wait,
        )));
    }
    Ok(hooks)
}
