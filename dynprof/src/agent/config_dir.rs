//! `--config-dir DIR`: one `profiler_config.json` (the torch_npu schema)
//! shared by every node's agent, on shared storage. Each save starts a
//! capture on every job of every node, on the same iterations:
//!
//! - the window is `start_step` (steps after the common instant's first
//!   boundary; default 10), `warmup`, `active`; `activities`/`with_stack`
//!   choose the collectors as for `attach --config-dir`;
//! - `is_rank: true` with `rank_list` limits it to those ranks;
//! - the common instant is `metadata.dynprof_start_at` (UNIX seconds) when
//!   the file gives one, else the file's modification time plus
//!   `--config-lead`: shared storage shows every node the same mtime.
//!
//! The directory may be a Kubernetes ConfigMap volume (kubelet's
//! `..data` links, followed only when root owns the whole layout:
//! [`configmap`]); then the file's time is no common instant and
//! `metadata.dynprof_start_at` is required.
//!
//! The agent only reads the file (never writes a template or logs there:
//! many nodes share it). A file already there when the agent starts is
//! taken as the baseline, not as a request.
use std::{path::PathBuf, time::Duration};

use anyhow::Result;

use super::capture::Request;
use crate::{
    sys::{
        configmap::{self, Found},
        hostfs::MAX_CONFIG_BYTES,
    },
    types::Builtin,
    window::trigger::config_file::{self, CONFIG_FILE},
};

/// What a save asks for.
#[derive(Debug)]
pub struct Asked {
    pub req: Request,
    /// `rank_list` when `is_rank` is true.
    pub ranks: Option<Vec<i64>>,
}

pub struct ConfigDir {
    dir: PathBuf,
    file: PathBuf,
    lead: Duration,
    /// What the last read found (text, time, `..data` target, or the
    /// refusal); None before the first read.
    last: Option<String>,
}

impl ConfigDir {
    pub fn new(dir: &std::path::Path, lead: Duration) -> Result<Self> {
        let dir = config_file::check_dir(dir)?;
        Ok(Self {
            file: dir.join(CONFIG_FILE),
            dir,
            lead,
            last: None,
        })
    }

    pub fn file(&self) -> &std::path::Path {
        &self.file
    }

    /// Reads the file (plain, or a ConfigMap's `..data` layout:
    /// [`configmap`]); a new version gives what it asks for, or why it
    /// cannot be acted on. A refusal is reported once per state.
    pub fn poll(&mut self) -> Option<Result<Asked, String>> {
        let found = configmap::read(&self.dir, CONFIG_FILE, MAX_CONFIG_BYTES);
        let seen = format!("{found:?}");
        let first = self.last.is_none();
        if self.last.as_deref() == Some(seen.as_str()) {
            return None;
        }
        self.last = Some(seen);
        match found {
            Err(why) => Some(Err(why)),
            Ok(Found::Missing) => None,
            Ok(Found::Plain { text, .. } | Found::AtomicWriter { text, .. })
                if first || text.trim().is_empty() =>
            {
                None
            }
            Ok(Found::Plain { text, mtime }) => Some(asked(&text, Some(mtime), self.lead)),
            // kubelets sync a ConfigMap on their own schedules: the file's
            // time differs per node and cannot be the common instant.
            Ok(Found::AtomicWriter { text, .. }) => Some(asked(&text, None, self.lead)),
        }
    }
}

/// The request a saved file makes.
pub fn asked(
    text: &str,
    mtime: Option<std::time::SystemTime>,
    lead: Duration,
) -> Result<Asked, String> {
    let p = config_file::parse(text).map_err(|e| format!("{e:#}"))?;
    let explicit = p
        .metadata
        .as_ref()
        .and_then(|m| m.get("dynprof_start_at"))
        .map(|v| {
            v.as_f64()
                .ok_or_else(|| format!("metadata.dynprof_start_at: expected UNIX seconds, got {v}"))
        })
        .transpose()?;
    let start_at = match (explicit, mtime) {
        (Some(t), _) => t,
        (None, Some(m)) => (m + lead)
            .duration_since(std::time::UNIX_EPOCH)
            .map_err(|_| "the file's modification time is before 1970".to_string())?
            .as_secs_f64(),
        (None, None) => {
            return Err("no common start instant: a ConfigMap reaches each node when its kubelet syncs, so its file times differ per node; give metadata.dynprof_start_at (UNIX seconds, e.g. now + 120)".into());
        }
    };
    let mut collect: Vec<String> = p.collect.iter().map(|b| b.name().to_string()).collect();
    if collect.is_empty() {
        // Job mode records the step thread's off-CPU time in any case.
        collect.push(Builtin::Offcpu.name().to_string());
    }
    Ok(Asked {
        req: Request {
            job: None,
            pid: None,
            active: p.plan.active,
            warmup: p.plan.warmup,
            start_step: (p.plan.start_step > 0).then_some(p.plan.start_step as u64),
            collect: Some(collect),
            start_at: Some(start_at),
            timeout_s: None,
        },
        ranks: p.is_rank.then_some(p.rank_list),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{SystemTime, UNIX_EPOCH};

    #[test]
    fn start_instant_from_mtime_or_metadata() {
        let m = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let a = asked(
            r#"{"start_step": 40, "active": 3, "warmup": 1}"#,
            Some(m),
            Duration::from_secs(15),
        )
        .unwrap();
        assert_eq!(a.req.start_at, Some(1_800_000_015.0));
        assert_eq!(
            (a.req.start_step, a.req.warmup, a.req.active),
            (Some(40), 1, 3)
        );
        assert_eq!(a.ranks, None);
        // The torch_npu default activities (CPU, NPU) → cpu and api.
        assert_eq!(
            a.req.collect.as_deref(),
            Some(&["api".to_string(), "cpu".to_string()][..])
        );
        let a = asked(
            r#"{"active": 2, "activities": [], "is_rank": true, "rank_list": [1, 3], "metadata": {"dynprof_start_at": 1800000100.5}}"#,
            Some(m),
            Duration::from_secs(15),
        )
        .unwrap();
        assert_eq!(a.req.start_at, Some(1_800_000_100.5));
        assert_eq!(a.ranks, Some(vec![1, 3]));
        assert_eq!(a.req.collect.as_deref(), Some(&["offcpu".to_string()][..]));
    }

    #[test]
    fn bad_files_say_why() {
        let m = Some(SystemTime::now());
        for bad in [
            "{not json",
            r#"{"active": 0}"#,
            r#"{"active": 1, "metadata": {"dynprof_start_at": "soon"}}"#,
            r#"[1]"#,
        ] {
            assert!(asked(bad, m, Duration::from_secs(1)).is_err(), "{bad}");
        }
    }
}
