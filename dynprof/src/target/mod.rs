//! The target process as /proc shows it: host PID, PID-namespace chain,
//! container, mappings, environment and mount root.
//!
//! - [`pidns`]: `--pid N --in-pidns REF` → host PID ([`resolve_pid`]).
//! - [`container`]: container ids from `/proc/PID/cgroup`.
//! - [`mount`]: opening mapped files across mount namespaces.
//! - [`ps`]: finding AI jobs (`dynprof ps`).
pub mod container;
pub mod mount;
pub mod pidns;
pub mod ps;

pub use pidns::resolve_pid;

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use serde::Serialize;

use crate::types::{ContainerId, HostPid, NsPid};

/// One line of /proc/PID/maps that maps a file.
#[derive(Clone, Debug)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub offset: u64,
    pub perms: String,
    pub inode: u64,
    /// The path as the target sees it (its own mount namespace).
    pub path: String,
    /// The kernel appends " (deleted)" when the file was unlinked/replaced.
    pub deleted: bool,
}

/// An attached-to process.
#[derive(Clone, Debug, Serialize)]
pub struct Target {
    pub host_pid: HostPid,
    /// NSpid chain from /proc/PID/status: the host PID first, the PID in the
    /// innermost namespace last.
    pub ns_pids: Vec<NsPid>,
    pub comm: String,
    pub cmdline: Vec<String>,
    /// The full container id (`container_id`'s string form), when the cgroup
    /// path names one.
    pub container: Option<String>,
    /// The container with its engine and Kubernetes pod UID.
    #[serde(skip)]
    pub container_id: Option<ContainerId>,
    /// The inode of the target's own PID namespace (`pid:[INODE]`).
    pub pid_ns: Option<u64>,
    /// RANK from the target's environment, when readable.
    pub rank: Option<u32>,
    /// LOCAL_RANK from the target's environment, when readable.
    pub local_rank: Option<u32>,
    /// WORLD_SIZE from the target's environment, when readable.
    pub world_size: Option<u32>,
}

impl Target {
    /// Opens a target by host PID.
    pub fn open(pid: HostPid) -> Result<Self> {
        let proc_dir = PathBuf::from(format!("/proc/{pid}"));
        if !proc_dir.exists() {
            bail!(
                "no process with PID {pid} (hint: `dynprof ps` lists AI jobs; \
                 for a PID seen inside a container use `--in-pidns`)"
            );
        }
        let status = fs::read_to_string(proc_dir.join("status"))
            .with_context(|| format!("reading /proc/{pid}/status"))?;
        let ns_pids = parse_nspid(&status).unwrap_or_else(|| vec![NsPid(pid.0)]);
        let comm = fs::read_to_string(proc_dir.join("comm"))
            .unwrap_or_default()
            .trim()
            .to_string();
        let cmdline = fs::read(proc_dir.join("cmdline"))
            .map(|b| parse_cmdline(&b))
            .unwrap_or_default();
        let ranks = read_environ(pid)
            .map(|env| RankEnv::from_env(&env))
            .unwrap_or_default();
        let container_id = container::container_of(pid);
        let container = container_id.as_ref().map(|c| c.id.clone());
        let pid_ns = pidns::pidns_inode(pid).ok();
        Ok(Self {
            host_pid: pid,
            ns_pids,
            comm,
            cmdline,
            container,
            container_id,
            pid_ns,
            rank: ranks.rank,
            local_rank: ranks.local_rank,
            world_size: ranks.world_size,
        })
    }

    /// The container's engine (`docker`, `containerd`, `cri-o`, `podman`, `cri`), if any.
    pub fn container_runtime(&self) -> Option<&'static str> {
        self.container_id.as_ref().map(|c| c.runtime.as_str())
    }

    /// The innermost namespace PID (what `ps` inside the container shows).
    pub fn inner_pid(&self) -> NsPid {
        *self.ns_pids.last().unwrap_or(&NsPid(self.host_pid.0))
    }

    /// `/proc/PID/root`: the target's view of the filesystem.
    pub fn root(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root", self.host_pid))
    }

    /// Host path of a file as the target names it.
    pub fn host_path(&self, target_path: &str) -> PathBuf {
        self.root().join(target_path.trim_start_matches('/'))
    }

    pub fn is_alive(&self) -> bool {
        // A zombie still has /proc/PID; it has no mappings left to profile.
        match fs::read_to_string(format!("/proc/{}/stat", self.host_pid)) {
            Ok(stat) => parse_stat_state(&stat) != Some('Z'),
            Err(_) => false,
        }
    }

    pub fn maps(&self) -> Result<Vec<Mapping>> {
        let text = fs::read_to_string(format!("/proc/{}/maps", self.host_pid))
            .with_context(|| format!("reading /proc/{}/maps", self.host_pid))?;
        Ok(parse_maps(&text))
    }

    pub fn environ(&self) -> Result<Vec<(String, String)>> {
        read_environ(self.host_pid)
    }
}

pub fn read_environ(pid: HostPid) -> Result<Vec<(String, String)>> {
    let raw = fs::read(format!("/proc/{pid}/environ"))
        .with_context(|| format!("reading /proc/{pid}/environ"))?;
    Ok(parse_environ(&raw))
}

/// `KEY=VALUE` pairs of a /proc/PID/environ image (NUL-separated; entries
/// without `=` are skipped, invalid UTF-8 is replaced).
pub fn parse_environ(raw: &[u8]) -> Vec<(String, String)> {
    raw.split(|c| *c == 0)
        .filter_map(|kv| {
            let kv = String::from_utf8_lossy(kv);
            let (k, v) = kv.split_once('=')?;
            Some((k.to_string(), v.to_string()))
        })
        .collect()
}

/// The arguments of a /proc/PID/cmdline image (NUL-separated, empty ones dropped).
pub fn parse_cmdline(raw: &[u8]) -> Vec<String> {
    raw.split(|c| *c == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

/// The state letter of a /proc/PID/stat line (`R`, `S`, `Z`, ...): the first
/// field after the last `)`, since comm may itself contain `)` and spaces.
pub fn parse_stat_state(stat: &str) -> Option<char> {
    stat.rsplit(')').next()?.trim_start().chars().next()
}

pub fn env_value<'a>(env: &'a [(String, String)], key: &str) -> Option<&'a str> {
    env.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

/// The `NSpid:` line of /proc/PID/status, outermost first.
pub fn parse_nspid(status: &str) -> Option<Vec<NsPid>> {
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    let pids: Vec<NsPid> = line["NSpid:".len()..]
        .split_whitespace()
        .filter_map(|p| p.parse().ok().map(NsPid))
        .collect();
    (!pids.is_empty()).then_some(pids)
}

pub fn parse_maps(text: &str) -> Vec<Mapping> {
    text.lines()
        .filter_map(|line| {
            let mut it = line.splitn(6, ' ');
            let range = it.next()?;
            let perms = it.next()?.to_string();
            let offset = u64::from_str_radix(it.next()?, 16).ok()?;
            let _dev = it.next()?;
            let inode: u64 = it.next()?.parse().ok()?;
            let path = it.next()?.trim_start();
            if inode == 0 || !path.starts_with('/') {
                return None;
            }
            let (start, end) = range.split_once('-')?;
            let (path, deleted) = match path.strip_suffix(" (deleted)") {
                Some(p) => (p, true),
                None => (path, false),
            };
            Some(Mapping {
                start: u64::from_str_radix(start, 16).ok()?,
                end: u64::from_str_radix(end, 16).ok()?,
                offset,
                perms,
                inode,
                path: path.to_string(),
                deleted,
            })
        })
        .collect()
}

/// Rank variables of a distributed job, from its environment: torchrun /
/// DeepSpeed / accelerate (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`), Ascend
/// (`RANK_ID`, `RANK_SIZE`), Open MPI and PMI.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RankEnv {
    pub rank: Option<u32>,
    pub local_rank: Option<u32>,
    pub world_size: Option<u32>,
}

impl RankEnv {
    pub fn from_env(env: &[(String, String)]) -> Self {
        let first = |keys: &[&str]| {
            keys.iter()
                .find_map(|k| env_value(env, k)?.trim().parse().ok())
        };
        Self {
            rank: first(&["RANK", "RANK_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"]),
            local_rank: first(&[
                "LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "MPI_LOCALRANKID",
            ]),
            world_size: first(&[
                "WORLD_SIZE",
                "RANK_SIZE",
                "OMPI_COMM_WORLD_SIZE",
                "PMI_SIZE",
            ]),
        }
    }
}

/// Every process (thread-group leader) in /proc, ascending.
pub fn all_pids() -> Vec<HostPid> {
    let mut v: Vec<HostPid> = fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok().map(HostPid))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The `PPid:` of /proc/PID/status.
pub fn parse_ppid(status: &str) -> Option<HostPid> {
    let line = status.lines().find(|l| l.starts_with("PPid:"))?;
    line["PPid:".len()..].trim().parse().ok().map(HostPid)
}

/// Does this path exist in the target's mount namespace?
pub fn exists_in(root: &Path, target_path: &str) -> bool {
    root.join(target_path.trim_start_matches('/')).exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_state_follows_the_last_parenthesis() {
        // comm is the target's to choose: `)`, spaces and state letters included.
        assert_eq!(parse_stat_state("42 (a) Z (b) S 1 42"), Some('S'));
        assert_eq!(parse_stat_state("42 (python3) Z 1 42"), Some('Z'));
        assert_eq!(parse_stat_state("42 (python3)"), None);
        assert_eq!(parse_stat_state(""), None);
    }

    #[test]
    fn environ_and_cmdline_images() {
        let env = parse_environ(b"A=1\0NOEQ\0B=x=y\0\0C=\xff\0");
        assert_eq!(
            env,
            vec![
                ("A".to_string(), "1".to_string()),
                ("B".to_string(), "x=y".to_string()),
                ("C".to_string(), "\u{fffd}".to_string()),
            ]
        );
        assert_eq!(
            parse_cmdline(b"python3\0\0-m\0torch.distributed.run\0"),
            vec!["python3", "-m", "torch.distributed.run"]
        );
        assert!(parse_cmdline(b"").is_empty());
    }
}
