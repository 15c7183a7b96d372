//! msprof's collection arguments: `--msprof-args`, the switches of a
//! profiler_config.json, or the vendor documentation's default.
use super::*;

/// The collection arguments used when neither `--msprof-args` nor a
/// profiler_config.json gives any (the vendor documentation's example).
pub const DEFAULT_COLLECTION_ARGS: &[&str] =
    &["--model-execution=on", "--runtime-api=on", "--aicpu=on"];

/// Maps torch_npu `profiler_config.json` fields (`activities`,
/// `experimental_config`, `profile_memory`) to msprof collection switches.
pub fn args_from_profiler_config(cfg: &Value) -> Vec<String> {
    let mut a: Vec<String> = Vec::new();
    let acts: Vec<String> = cfg["activities"]
        .as_array()
        .map(|v| {
            v.iter()
                .filter_map(|s| s.as_str().map(str::to_uppercase))
                .collect()
        })
        .unwrap_or_else(|| vec!["CPU".into(), "NPU".into()]);
    let exp = &cfg["experimental_config"];
    if acts.iter().any(|s| s == "CPU") {
        a.push("--ascendcl=on".into());
        a.push("--runtime-api=on".into());
    }
    if acts.iter().any(|s| s == "NPU") {
        let level = exp["profiler_level"].as_str().unwrap_or("Level0");
        a.push(match level {
            "Level1" | "Level2" => "--task-time=l1".into(),
            "Level_none" | "LevelNone" => "--task-time=off".into(),
            _ => "--task-time=l0".into(),
        });
        if level == "Level2" {
            a.push("--aicpu=on".into());
        }
        match exp["aic_metrics"].as_str() {
            None | Some("AiCoreNone") | Some("") => a.push("--ai-core=off".into()),
            Some(m) => {
                a.push("--ai-core=on".into());
                a.push(format!("--aic-metrics={m}"));
            }
        }
        if exp["l2_cache"].as_bool() == Some(true) {
            a.push("--l2=on".into());
        }
    }
    if cfg["profile_memory"].as_bool() == Some(true) {
        a.push("--sys-hardware-mem=on".into());
    }
    if exp["mstx"].as_bool() == Some(true) {
        a.push("--msproftx=on".into());
    }
    if let Some(t) = exp["export_type"]
        .as_array()
        .and_then(|v| v.first())
        .and_then(|v| v.as_str())
    {
        a.push(format!("--type={t}"));
    }
    a
}

/// How the msprof hook is set up (from `VendorArgs`).
#[derive(Clone, Debug)]
pub struct MsprofConfig {
    /// `--msprof PATH` (a path inside the target's filesystem, or a command name).
    pub msprof: Option<String>,
    /// Collection arguments appended after `--output`.
    pub collection_args: Vec<String>,
    /// `--output` as the target sees it; default
    /// `/tmp/dynprof_msprof_<hostpid>_<random>` (made fresh, owned by the job's uid).
    pub output: Option<String>,
    /// Extra `KEY=VALUE`s for msprof's environment.
    pub env: Vec<(String, String)>,
    /// Config-file mode: profiler_config.json, whose `activities` and
    /// `experimental_config` give the collection switches when
    /// `collection_args` is empty. Re-read after every window; a change
    /// reconnects msprof with the new switches before the next window.
    pub profiler_config_path: Option<PathBuf>,
    /// start+stop commands per connection before dynprof reconnects (msprof: 100).
    pub max_commands: u32,
    /// How long to wait for msprof's prompt (at connect and after `stop`).
    pub timeout: Duration,
    /// `--msprof-allow-unconfined`: run msprof even though the job has a
    /// seccomp filter or LSM label dynprof cannot copy.
    pub allow_unconfined: bool,
}

impl Default for MsprofConfig {
    fn default() -> Self {
        Self {
            msprof: None,
            collection_args: Vec::new(),
            output: None,
            env: Vec::new(),
            profiler_config_path: None,
            max_commands: 100,
            timeout: Duration::from_secs(30),
            allow_unconfined: false,
        }
    }
}
