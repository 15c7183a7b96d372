//! Which processes are the job's ranks, and their rank numbers.
//!
//! A job is named by its launcher (every AI process below it), by a PID
//! namespace or container (every AI process in it), or by an explicit PID
//! list. Launchers themselves (torchrun, mpirun, …) are never ranks.
use std::collections::{BTreeSet, HashMap};

use anyhow::{Result, bail};
use serde::Serialize;

use super::Rank;
use crate::{
    target::{RankEnv, pidns},
    types::HostPid,
};

/// How `--job` named the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobRef {
    /// A launcher (or any ancestor): its AI descendants are the ranks.
    Launcher(HostPid),
    /// A PID namespace or container (`pid:[INODE]`, a path, a container id).
    Namespace(pidns::PidNsRef),
    /// `--pids A,B,C`: exactly these processes.
    Pids(Vec<HostPid>),
}

impl JobRef {
    /// Parses `--job REF`: a decimal PID is a launcher; anything else is a
    /// namespace reference as `--in-pidns` takes it.
    pub fn parse(s: &str) -> Result<Self> {
        let t = s.trim();
        if !t.is_empty() && t.len() < 12 && t.bytes().all(|b| b.is_ascii_digit()) {
            let pid: u32 = t
                .parse()
                .map_err(|_| anyhow::anyhow!("--job `{s}`: not a PID"))?;
            if pid == 0 || pid > crate::cli::PID_MAX {
                bail!("--job `{s}`: a PID is in 1..={}", crate::cli::PID_MAX);
            }
            return Ok(JobRef::Launcher(HostPid(pid)));
        }
        match pidns::PidNsRef::parse(t) {
            Ok(r) => Ok(JobRef::Namespace(r)),
            Err(_) => bail!(
                "--job `{s}`: expected a launcher PID, pid:[INODE], a /proc/PID/ns/pid path or a container id (>= 12 hex digits)"
            ),
        }
    }

    /// `--pids A,B,C`.
    pub fn pids(list: &[u32]) -> Result<Self> {
        if list.is_empty() {
            bail!("--pids: give at least one PID");
        }
        let mut seen = BTreeSet::new();
        for p in list {
            if !seen.insert(*p) {
                bail!("--pids: PID {p} is listed twice");
            }
        }
        Ok(JobRef::Pids(list.iter().map(|p| HostPid(*p)).collect()))
    }
}

/// One process as discovery sees it (read from /proc by the caller).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub host_pid: HostPid,
    pub ppid: Option<HostPid>,
    /// Loads a framework or device runtime.
    pub ai: bool,
    /// torchrun, mpirun, …: never a rank.
    pub launcher: bool,
    pub env: RankEnv,
}

/// Where a member's rank number came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RankSource {
    /// RANK (or RANK_ID, OMPI_COMM_WORLD_RANK, PMI_RANK).
    Rank,
    /// LOCAL_RANK (RANK absent or repeated, e.g. one node of several).
    LocalRank,
    /// Neither names every member once: ascending host PID.
    Order,
}

/// One rank of the job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Member {
    pub rank: Rank,
    pub host_pid: HostPid,
    pub world_size: Option<u32>,
}

/// The AI processes below `root` (through any wrappers), launchers excluded,
/// ascending host PID.
pub fn descendants(cands: &[Candidate], root: HostPid) -> Vec<HostPid> {
    let parent: HashMap<HostPid, Option<HostPid>> =
        cands.iter().map(|c| (c.host_pid, c.ppid)).collect();
    let mut out: Vec<HostPid> = cands
        .iter()
        .filter(|c| c.ai && !c.launcher && c.host_pid != root)
        .filter(|c| {
            let mut cur = c.ppid;
            // A cycle cannot happen in /proc, but a snapshot read while PIDs
            // are reused could show one: the hop limit ends the walk.
            for _ in 0..64 {
                match cur {
                    Some(p) if p == root => return true,
                    Some(p) if p.0 > 1 => cur = parent.get(&p).copied().flatten(),
                    _ => return false,
                }
            }
            false
        })
        .map(|c| c.host_pid)
        .collect();
    out.sort();
    out
}

/// Rank numbers for `members` (ascending host PID): RANK when it names
/// every member once, else LOCAL_RANK when that does, else their order.
pub fn assign_ranks(members: &[Candidate]) -> (Vec<Member>, RankSource) {
    let mut m: Vec<&Candidate> = members.iter().collect();
    m.sort_by_key(|c| c.host_pid);
    let unique = |get: &dyn Fn(&Candidate) -> Option<u32>| -> Option<Vec<u32>> {
        let v: Vec<u32> = m.iter().map(|c| get(c)).collect::<Option<_>>()?;
        let set: BTreeSet<u32> = v.iter().copied().collect();
        (set.len() == v.len()).then_some(v)
    };
    let (ranks, source) = if let Some(v) = unique(&|c| c.env.rank) {
        (v, RankSource::Rank)
    } else if let Some(v) = unique(&|c| c.env.local_rank) {
        (v, RankSource::LocalRank)
    } else {
        ((0..m.len() as u32).collect(), RankSource::Order)
    };
    let mut out: Vec<Member> = m
        .iter()
        .zip(ranks)
        .map(|(c, r)| Member {
            rank: Rank(r),
            host_pid: c.host_pid,
            world_size: c.env.world_size,
        })
        .collect();
    out.sort_by_key(|x| x.rank);
    (out, source)
}

/// The job has no rank process (yet: a job still starting has not loaded
/// its framework).
#[derive(Debug)]
pub struct NoRanksYet;

impl std::fmt::Display for NoRanksYet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(
            "the job has no rank processes (no process in it loads PyTorch, CANN or CUDA); \
             see `dynprof ps --jobs`, or wait for a starting job with --wait-for-marker SECS",
        )
    }
}

impl std::error::Error for NoRanksYet {}

/// How many ranks are still missing: WORLD_SIZE, when every member names the
/// same one, minus the members found. None when the job does not say.
pub fn missing(members: &[Member]) -> Option<u32> {
    let ws = members.first()?.world_size?;
    if members.iter().any(|m| m.world_size != Some(ws)) {
        return None;
    }
    Some(ws.saturating_sub(members.len() as u32))
}

/// Reads the candidates from /proc (the acting half of discovery).
pub fn candidates(pids: &[HostPid]) -> Vec<Candidate> {
    pids.iter()
        .filter_map(|p| crate::discover::inspect(*p))
        .map(|i| Candidate {
            host_pid: i.host_pid,
            ppid: i.ppid,
            ai: i.ai,
            launcher: i.is_launcher(),
            env: RankEnv {
                rank: i.rank,
                local_rank: i.local_rank,
                world_size: i.world_size,
            },
        })
        .collect()
}

/// The job's ranks, read from /proc now.
pub fn discover(r: &JobRef) -> Result<(Vec<Member>, RankSource)> {
    let me = HostPid(std::process::id());
    let chosen: Vec<Candidate> = match r {
        JobRef::Pids(p) => {
            let c = candidates(p);
            if let Some(gone) = p.iter().find(|p| !c.iter().any(|c| c.host_pid == **p)) {
                bail!("--pids: no process with PID {gone}");
            }
            c
        }
        JobRef::Launcher(root) => {
            if !std::path::Path::new(&format!("/proc/{root}")).exists() {
                bail!("--job {root}: no process with PID {root}");
            }
            let all = candidates(&crate::target::all_pids());
            let below = descendants(&all, *root);
            all.into_iter()
                .filter(|c| below.contains(&c.host_pid))
                .collect()
        }
        JobRef::Namespace(pidns::PidNsRef::Container(prefix)) => {
            // A container is its cgroup: the ranks are its processes. Its
            // PID namespace alone would bring in the whole host when the
            // container shares the host's, or when a process of it (a
            // runtime's helper, `unshare` itself) sits outside its own.
            let (_, pids) = crate::target::container::find_container(prefix)?;
            candidates(&pids)
                .into_iter()
                .filter(|c| c.ai && !c.launcher)
                .collect()
        }
        JobRef::Namespace(nsref) => {
            let ns = pidns::find_pidns(nsref)?;
            let (sure, _) = pidns::find_in_ns(&ns, None);
            let pids: Vec<HostPid> = sure.iter().map(|s| s.host_pid).collect();
            candidates(&pids)
                .into_iter()
                .filter(|c| c.ai && !c.launcher)
                .collect()
        }
    };
    let chosen: Vec<Candidate> = chosen.into_iter().filter(|c| c.host_pid != me).collect();
    if chosen.is_empty() {
        return Err(NoRanksYet.into());
    }
    Ok(assign_ranks(&chosen))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(pid: u32, ppid: u32, ai: bool, launcher: bool, rank: Option<u32>) -> Candidate {
        Candidate {
            host_pid: HostPid(pid),
            ppid: Some(HostPid(ppid)),
            ai,
            launcher,
            env: RankEnv {
                rank,
                local_rank: rank,
                world_size: Some(4),
            },
        }
    }

    #[test]
    fn descendants_through_wrappers_skip_launchers_and_strangers() {
        let cands = vec![
            c(100, 1, false, true, None),      // torchrun
            c(101, 100, true, false, Some(1)), // rank
            c(102, 100, false, false, None),   // sh wrapper
            c(103, 102, true, false, Some(0)), // rank under sh
            c(104, 100, false, false, None),   // not AI
            c(200, 1, true, false, Some(0)),   // another job
            c(105, 100, true, true, None),     // nested launcher: not a rank
        ];
        assert_eq!(
            descendants(&cands, HostPid(100)),
            vec![HostPid(101), HostPid(103)]
        );
        assert!(descendants(&cands, HostPid(999)).is_empty());
    }

    #[test]
    fn ranks_from_env_then_local_rank_then_order() {
        let (m, src) = assign_ranks(&[
            c(10, 1, true, false, Some(2)),
            c(11, 1, true, false, Some(0)),
            c(12, 1, true, false, Some(1)),
        ]);
        assert_eq!(src, RankSource::Rank);
        let got: Vec<(u32, u32)> = m.iter().map(|x| (x.rank.0, x.host_pid.0)).collect();
        assert_eq!(got, vec![(0, 11), (1, 12), (2, 10)]);

        // RANK repeated (two nodes' views), LOCAL_RANK unique.
        let mut a = c(20, 1, true, false, Some(5));
        a.env.local_rank = Some(1);
        let mut b = c(21, 1, true, false, Some(5));
        b.env.local_rank = Some(0);
        let (m, src) = assign_ranks(&[a, b]);
        assert_eq!(src, RankSource::LocalRank);
        assert_eq!(m[0].host_pid, HostPid(21));

        // One member without RANK: order of host PIDs.
        let (m, src) = assign_ranks(&[c(31, 1, true, false, None), c(30, 1, true, false, Some(1))]);
        assert_eq!(src, RankSource::Order);
        let got: Vec<(u32, u32)> = m.iter().map(|x| (x.rank.0, x.host_pid.0)).collect();
        assert_eq!(got, vec![(0, 30), (1, 31)]);
    }

    #[test]
    fn missing_ranks_from_world_size() {
        let (m, _) = assign_ranks(&[
            c(10, 1, true, false, Some(0)),
            c(11, 1, true, false, Some(2)),
        ]);
        assert_eq!(missing(&m), Some(2));
        let (m, _) = assign_ranks(
            &(0..4)
                .map(|r| c(10 + r, 1, true, false, Some(r)))
                .collect::<Vec<_>>(),
        );
        assert_eq!(missing(&m), Some(0));
        let mut odd = c(12, 1, true, false, Some(1));
        odd.env.world_size = Some(8);
        let (m, _) = assign_ranks(&[c(10, 1, true, false, Some(0)), odd]);
        assert_eq!(missing(&m), None);
        assert_eq!(missing(&[]), None);
    }

    #[test]
    fn job_refs() {
        assert_eq!(
            JobRef::parse("4242").unwrap(),
            JobRef::Launcher(HostPid(4242))
        );
        assert!(matches!(
            JobRef::parse("pid:[4026532179]").unwrap(),
            JobRef::Namespace(pidns::PidNsRef::Inode(4026532179))
        ));
        assert!(matches!(
            JobRef::parse("3f2a9c1b7d4e").unwrap(),
            JobRef::Namespace(pidns::PidNsRef::Container(_))
        ));
        for bad in ["", "0", "pid:[x]", "zz", "99999999"] {
            assert!(JobRef::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert!(JobRef::pids(&[]).is_err());
        let e = JobRef::pids(&[3, 4, 3]).unwrap_err().to_string();
        assert!(e.contains("PID 3 is listed twice"), "{e}");
    }
}
