//! The target process as /proc shows it: host PID, PID-namespace chain,
//! mappings, environment and mount root.
use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use serde::Serialize;

use crate::types::{HostPid, NsPid};

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
    /// Container id when the cgroup path names one.
    pub container: Option<String>,
    /// RANK from the target's environment, when readable.
    pub rank: Option<u32>,
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
        let comm = fs::read_to_string(proc_dir.join("comm")).unwrap_or_default().trim().to_string();
        let cmdline = fs::read(proc_dir.join("cmdline"))
            .map(|b| {
                b.split(|c| *c == 0)
                    .filter(|s| !s.is_empty())
                    .map(|s| String::from_utf8_lossy(s).into_owned())
                    .collect()
            })
            .unwrap_or_default();
        let rank = read_environ(pid)
            .ok()
            .and_then(|env| env_value(&env, "RANK").and_then(|v| v.parse().ok()));
        let container = fs::read_to_string(proc_dir.join("cgroup"))
            .ok()
            .and_then(|c| container_id_from_cgroup(&c));
        Ok(Self { host_pid: pid, ns_pids, comm, cmdline, container, rank })
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
            Ok(stat) => !stat.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'),
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

/// Turns `--pid N [--in-pidns REF]` into a host PID.
pub fn resolve_pid(pid: u32, in_pidns: Option<&str>) -> Result<HostPid> {
    match in_pidns {
        None => Ok(HostPid(pid)),
        Some(r) => bail!("--in-pidns {r}: not implemented yet"),
    }
}

pub fn read_environ(pid: HostPid) -> Result<Vec<(String, String)>> {
    let raw = fs::read(format!("/proc/{pid}/environ"))
        .with_context(|| format!("reading /proc/{pid}/environ"))?;
    Ok(raw
        .split(|c| *c == 0)
        .filter_map(|kv| {
            let kv = String::from_utf8_lossy(kv);
            let (k, v) = kv.split_once('=')?;
            Some((k.to_string(), v.to_string()))
        })
        .collect())
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

/// Best-effort container id from /proc/PID/cgroup (docker, containerd/CRI,
/// cri-o, podman): the last 64-hex-digit run in the path.
pub fn container_id_from_cgroup(cgroup: &str) -> Option<String> {
    for line in cgroup.lines() {
        let path = line.splitn(3, ':').nth(2).unwrap_or("");
        let bytes = path.as_bytes();
        let mut i = 0;
        let mut found = None;
        while i < bytes.len() {
            if bytes[i].is_ascii_hexdigit() {
                let s = i;
                while i < bytes.len() && bytes[i].is_ascii_hexdigit() {
                    i += 1;
                }
                if i - s == 64 {
                    found = Some(path[s..i].to_string());
                }
            } else {
                i += 1;
            }
        }
        if found.is_some() {
            return found;
        }
    }
    None
}

/// Does this path exist in the target's mount namespace?
pub fn exists_in(root: &Path, target_path: &str) -> bool {
    root.join(target_path.trim_start_matches('/')).exists()
}
