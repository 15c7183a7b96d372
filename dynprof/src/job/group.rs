//! `dynprof ps --jobs`: the AI processes of a host grouped into jobs, each
//! with the `--job` reference that attaches to exactly it.
//!
//! A rank belongs to the job of its nearest launcher ancestor (torchrun,
//! mpirun, msrun, …); failing that, to its PID namespace when that is not
//! dynprof's own (a container); failing that, to its parent process (ranks
//! started by hand or by a script share it).
use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use super::discover::{Candidate, Member, RankSource, assign_ranks};
use crate::types::HostPid;

/// One process as grouping sees it.
#[derive(Clone, Debug)]
pub struct Proc {
    pub cand: Candidate,
    pub launcher: Option<&'static str>,
    /// `pid:[INODE]` when the process is in a PID namespace below dynprof's.
    pub child_pidns: Option<String>,
    pub container: Option<String>,
    pub comm: String,
}

/// What holds a job together.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum JobKey {
    Launcher { pid: HostPid, launcher: String },
    PidNamespace { pid_ns: String },
    Parent { pid: HostPid, comm: String },
}

impl JobKey {
    /// The `--job` argument that selects this job.
    pub fn job_ref(&self) -> String {
        match self {
            JobKey::Launcher { pid, .. } | JobKey::Parent { pid, .. } => pid.to_string(),
            JobKey::PidNamespace { pid_ns } => pid_ns.clone(),
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct JobGroup {
    pub key: JobKey,
    /// `--job` argument for this job.
    pub job_ref: String,
    pub container: Option<String>,
    /// WORLD_SIZE when the ranks agree on one.
    pub world_size: Option<u32>,
    pub rank_source: RankSource,
    pub ranks: Vec<Member>,
}

/// What grouping needs of each process `dynprof ps` found (shared by
/// `ps --jobs` and `dynprof agent`).
pub fn procs_of(infos: &[crate::discover::ProcInfo]) -> Vec<Proc> {
    infos
        .iter()
        .map(|i| Proc {
            cand: Candidate {
                host_pid: i.host_pid,
                ppid: i.ppid,
                ai: i.ai,
                launcher: i.is_launcher(),
                env: crate::target::RankEnv {
                    rank: i.rank,
                    local_rank: i.local_rank,
                    world_size: i.world_size,
                },
            },
            launcher: i.launcher,
            child_pidns: if i.ns_pids.len() > 1 {
                i.pid_ns.clone()
            } else {
                None
            },
            container: i.container.as_ref().map(|c| c.short().to_string()),
            comm: i.comm.clone(),
        })
        .collect()
}

/// Groups the AI processes of `procs` into jobs (see the module doc).
pub fn group(procs: &[Proc]) -> Vec<JobGroup> {
    let by_pid: HashMap<HostPid, &Proc> = procs.iter().map(|p| (p.cand.host_pid, p)).collect();
    let mut jobs: BTreeMap<JobKey, Vec<&Proc>> = BTreeMap::new();
    for p in procs.iter().filter(|p| p.cand.ai && p.launcher.is_none()) {
        let mut key = None;
        let mut cur = p.cand.ppid;
        for _ in 0..64 {
            let Some(pp) = cur.filter(|x| x.0 > 1) else {
                break;
            };
            let Some(parent) = by_pid.get(&pp) else { break };
            if let Some(kind) = parent.launcher {
                key = Some(JobKey::Launcher {
                    pid: pp,
                    launcher: kind.to_string(),
                });
                break;
            }
            cur = parent.cand.ppid;
        }
        let key = key.unwrap_or_else(|| match (&p.child_pidns, p.cand.ppid) {
            (Some(ns), _) => JobKey::PidNamespace { pid_ns: ns.clone() },
            (None, Some(pp)) => JobKey::Parent {
                pid: pp,
                comm: by_pid.get(&pp).map(|x| x.comm.clone()).unwrap_or_default(),
            },
            (None, None) => JobKey::Parent {
                pid: p.cand.host_pid,
                comm: p.comm.clone(),
            },
        });
        jobs.entry(key).or_default().push(p);
    }
    jobs.into_iter()
        .map(|(key, members)| {
            let cands: Vec<Candidate> = members.iter().map(|p| p.cand.clone()).collect();
            let (ranks, rank_source) = assign_ranks(&cands);
            let mut ws: Vec<u32> = ranks.iter().filter_map(|m| m.world_size).collect();
            ws.dedup();
            let mut containers: Vec<&String> = members
                .iter()
                .filter_map(|p| p.container.as_ref())
                .collect();
            containers.dedup();
            JobGroup {
                job_ref: key.job_ref(),
                key,
                container: (containers.len() == 1).then(|| containers[0].clone()),
                world_size: (ws.len() == 1 && ranks.iter().all(|m| m.world_size.is_some()))
                    .then(|| ws[0]),
                rank_source,
                ranks,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::target::RankEnv;

    fn p(pid: u32, ppid: u32, ai: bool, launcher: Option<&'static str>, rank: Option<u32>) -> Proc {
        Proc {
            cand: Candidate {
                host_pid: HostPid(pid),
                ppid: Some(HostPid(ppid)),
                ai,
                launcher: launcher.is_some(),
                env: RankEnv {
                    rank,
                    local_rank: rank,
                    world_size: rank.map(|_| 2),
                },
            },
            launcher,
            child_pidns: None,
            container: None,
            comm: format!("p{pid}"),
        }
    }

    #[test]
    fn launcher_then_namespace_then_parent() {
        let mut in_ns = p(300, 299, true, None, Some(0));
        in_ns.child_pidns = Some("pid:[4026532999]".into());
        in_ns.container = Some("3f2a9c1b7d4e".into());
        let procs = vec![
            p(100, 1, false, Some("torchrun"), None),
            p(101, 100, true, None, Some(1)),
            p(102, 100, false, None, None), // sh
            p(103, 102, true, None, Some(0)),
            p(200, 50, true, None, Some(0)), // started by hand from shell 50
            p(201, 50, true, None, Some(1)),
            p(50, 1, false, None, None),
            in_ns,
            p(400, 1, false, None, None), // not AI: no job
        ];
        let g = group(&procs);
        type Summary = (String, Vec<(u32, u32)>, Option<u32>);
        let summary: Vec<Summary> = g
            .iter()
            .map(|j| {
                (
                    j.job_ref.clone(),
                    j.ranks.iter().map(|m| (m.rank.0, m.host_pid.0)).collect(),
                    j.world_size,
                )
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                ("100".to_string(), vec![(0, 103), (1, 101)], Some(2)),
                ("pid:[4026532999]".to_string(), vec![(0, 300)], Some(2)),
                ("50".to_string(), vec![(0, 200), (1, 201)], Some(2)),
            ]
        );
        assert!(matches!(&g[0].key, JobKey::Launcher { launcher, .. } if launcher == "torchrun"));
        assert_eq!(g[1].container.as_deref(), Some("3f2a9c1b7d4e"));
        assert!(matches!(&g[2].key, JobKey::Parent { comm, .. } if comm == "p50"));
    }
}
