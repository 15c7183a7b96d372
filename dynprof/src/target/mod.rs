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
        check_attachable(pid)?;
        let status = fs::read_to_string(proc_dir.join("status"))
            .map_err(|e| gone_or(pid, e, "reading its /proc status"))?;
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
            Ok(stat) => parse_stat(&stat).map(|s| s.state) != Some('Z'),
            Err(_) => false,
        }
    }

    /// The target's threads now (host tids), ascending; empty once it is
    /// gone.
    pub fn threads(&self) -> Vec<u32> {
        let mut tids: Vec<u32> = fs::read_dir(format!("/proc/{}/task", self.host_pid))
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| e.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        tids.sort_unstable();
        tids
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

/// The kernel's PF_KTHREAD in /proc/PID/stat's `flags`.
const PF_KTHREAD: u64 = 0x0020_0000;

/// What /proc/PID/stat says about a process before dynprof attaches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcStat {
    pub comm: String,
    /// R, S, D, T, t, Z, X, I...
    pub state: char,
    pub ppid: u32,
    pub kernel_thread: bool,
}

/// Parses /proc/PID/stat (comm may hold spaces and parentheses: it runs to
/// the last `)`).
pub fn parse_stat(stat: &str) -> Option<ProcStat> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?.to_string();
    let rest: Vec<&str> = stat[close + 1..].split_whitespace().collect();
    let state = rest.first()?.chars().next()?;
    let ppid = rest.get(1)?.parse().ok()?;
    let flags: u64 = rest.get(6)?.parse().ok()?;
    Some(ProcStat {
        comm,
        state,
        ppid,
        kernel_thread: flags & PF_KTHREAD != 0,
    })
}

/// Why a process cannot be attached to, if it cannot: the checks that turn
/// a silent poll (`--pid 2`: its maps read as empty, forever) or a bare
/// errno into a sentence.
pub fn not_attachable(
    pid: HostPid,
    st: &ProcStat,
    maps: std::io::Result<String>,
) -> Option<String> {
    let who = format!("PID {pid} ({})", st.comm);
    if st.kernel_thread {
        return Some(format!(
            "{who} is a kernel thread: it has no user-space memory, so there is no \
             training step to put a uprobe on (hint: `dynprof ps` lists AI jobs)"
        ));
    }
    match st.state {
        'Z' => {
            return Some(format!(
                "{who} is a zombie: it has exited and only waits for its parent \
                 (PID {}) to reap it, so nothing is left to profile",
                st.ppid
            ));
        }
        'X' => return Some(format!("{who} has exited")),
        _ => {}
    }
    let init = if pid.0 == 1 {
        " It is the init process of dynprof's PID namespace, not a job \
         (for PID 1 of a container, add `--in-pidns`)."
    } else {
        ""
    };
    match maps {
        Ok(m) if m.trim().is_empty() => Some(format!(
            "{who} has no user-space mappings (/proc/{pid}/maps is empty): \
             there is nothing to put a uprobe on.{init} (hint: `dynprof ps` lists AI jobs)"
        )),
        Ok(_) => None,
        Err(e) if matches!(e.raw_os_error(), Some(libc::EACCES) | Some(libc::EPERM)) => {
            Some(format!(
                "dynprof may not read the memory map of {who} (/proc/{pid}/maps: {e}): \
             the kernel refuses ptrace-read access to it (it is not dumpable, or it \
             belongs to a user namespace where dynprof lacks CAP_SYS_PTRACE).{init} \
             (hint: `dynprof ps` lists AI jobs; see docs/capabilities.md)"
            ))
        }
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ESRCH)) => {
            Some(format!("{who} exited while dynprof was opening it"))
        }
        Err(e) => Some(format!("reading /proc/{pid}/maps of {who}: {e}")),
    }
}

/// Refuses, with a sentence, a PID that has nothing to profile.
pub fn check_attachable(pid: HostPid) -> Result<()> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_err(|e| gone_or(pid, e, "reading its /proc stat"))?;
    let Some(st) = parse_stat(&stat) else {
        bail!("/proc/{pid}/stat is not in the kernel's format: {stat:?}");
    };
    let maps = fs::read_to_string(format!("/proc/{pid}/maps"));
    match not_attachable(pid, &st, maps) {
        Some(why) => bail!(why),
        None => Ok(()),
    }
}

/// An error reading /proc/PID: "exited" when the process is gone (ENOENT,
/// ESRCH), else the error with what was being done.
pub fn gone_or(pid: HostPid, e: std::io::Error, doing: &str) -> anyhow::Error {
    if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ESRCH)) {
        anyhow::anyhow!("PID {pid} exited while dynprof was attaching ({doing})")
    } else {
        anyhow::anyhow!("PID {pid}: {doing}: {e}")
    }
}

/// `e`, or — when the target is no longer alive — a sentence saying it
/// exited during `stage`, so that an errno from deep inside (ESRCH from
/// perf_event_open, ENOENT from /proc) is not all the user sees.
pub fn exited_during(target: &Target, stage: &str, e: anyhow::Error) -> anyhow::Error {
    if target.is_alive() {
        return e;
    }
    let zombie = fs::read_to_string(format!("/proc/{}/stat", target.host_pid))
        .ok()
        .and_then(|s| parse_stat(&s))
        .is_some_and(|s| s.state == 'Z');
    anyhow::anyhow!(
        "PID {} ({}) exited while dynprof was {stage}{}; nothing stays attached \
         (detail: {e:#})",
        target.host_pid,
        target.comm,
        if zombie { " (it is now a zombie)" } else { "" }
    )
}

/// At most this much of a target's environment is read: the target sets
/// its length (a legitimate one is bounded by ARG_MAX, ~2 MiB by default).
pub const MAX_ENVIRON: usize = 4 << 20;

/// The target's environment, read under a cap and a deadline (a read of
/// another process's memory can be stalled by it, e.g. with userfaultfd).
pub fn read_environ(pid: HostPid) -> Result<Vec<(String, String)>> {
    let (mut raw, cut) = crate::sys::rootfs::read_proc_capped(
        Path::new(&format!("/proc/{pid}/environ")),
        MAX_ENVIRON,
    )
    .with_context(|| format!("reading /proc/{pid}/environ"))?;
    if cut {
        log::warn!(
            "PID {pid}'s environment is over {} MiB; only its first {} MiB is read",
            MAX_ENVIRON >> 20,
            MAX_ENVIRON >> 20
        );
        // The last entry may be cut in the middle.
        let keep = raw.iter().rposition(|c| *c == 0).unwrap_or(0);
        raw.truncate(keep);
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn io(errno: i32) -> std::io::Result<String> {
        Err(std::io::Error::from_raw_os_error(errno))
    }

    #[test]
    fn stat_with_spaces_and_parentheses_in_comm() {
        let s = "42 (a (b) c) S 7 42 42 0 -1 4194560 0 0";
        let st = parse_stat(s).unwrap();
        assert_eq!(st.comm, "a (b) c");
        assert_eq!((st.state, st.ppid, st.kernel_thread), ('S', 7, false));
        let k = parse_stat("2 (kthreadd) S 0 0 0 0 -1 2129984 0").unwrap();
        assert!(k.kernel_thread);
        assert!(parse_stat("garbage").is_none());
    }

    #[test]
    fn each_refusal_says_why() {
        let st = |state, kt| ProcStat {
            comm: "job".into(),
            state,
            ppid: 9,
            kernel_thread: kt,
        };
        let p = HostPid(5);
        let ok = || Ok("00400000-00401000 r-xp 0 08:01 1 /bin/job\n".to_string());
        assert_eq!(not_attachable(p, &st('S', false), ok()), None);
        let why = |s, m| not_attachable(p, &s, m).unwrap();
        assert!(why(st('S', true), ok()).contains("is a kernel thread"));
        assert!(
            why(st('Z', false), ok()).contains("zombie")
                && why(st('Z', false), ok()).contains("(PID 9)")
        );
        assert!(why(st('S', false), Ok(String::new())).contains("no user-space mappings"));
        assert!(why(st('S', false), io(libc::EACCES)).contains("CAP_SYS_PTRACE"));
        assert!(why(st('S', false), io(libc::ESRCH)).contains("exited while"));
        let init = not_attachable(HostPid(1), &st('S', false), io(libc::EACCES)).unwrap();
        assert!(init.contains("init process"), "{init}");
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
