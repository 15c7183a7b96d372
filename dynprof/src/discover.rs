//! Finding AI jobs (`dynprof ps`), above `target` (/proc) and `probes`
//! (the `--marker auto` presets): which processes load a device runtime or a framework,
//! where they live (PID namespaces, container), their rank, which step
//! markers `--marker auto` would use, and which are launchers (torchrun,
//! mpirun, ...) whose children are the real workers.
use std::{collections::HashMap, fs};

use serde::Serialize;

use crate::{
    probes::presets,
    target::{
        Mapping, RankEnv, all_pids, container, parse_cmdline, parse_maps, parse_nspid, parse_ppid,
        pidns, read_environ,
    },
    types::{ContainerId, HostPid, NsPid},
};

/// One process as `dynprof ps` reports it.
#[derive(Clone, Debug, Serialize)]
pub struct ProcInfo {
    pub host_pid: HostPid,
    pub ppid: Option<HostPid>,
    /// NSpid chain, host PID first.
    pub ns_pids: Vec<NsPid>,
    /// The innermost PID (what `ps` inside the container shows).
    pub ns_pid: NsPid,
    /// `pid:[INODE]` of the process's PID namespace.
    pub pid_ns: Option<String>,
    pub container: Option<ContainerId>,
    pub container_runtime: Option<&'static str>,
    pub pod_uid: Option<String>,
    pub rank: Option<u32>,
    pub local_rank: Option<u32>,
    pub world_size: Option<u32>,
    /// False when /proc/PID/environ could not be read (other user, no ptrace right).
    pub environ_readable: bool,
    /// `torch`, `torch_npu`, `cann`, `cuda`, `python`.
    pub runtimes: Vec<&'static str>,
    /// Loads a device runtime or framework (what `ps` lists without --all).
    pub ai: bool,
    /// What `--marker auto` would attach to, or what to name instead.
    pub markers: String,
    /// The launcher kind (`torchrun`, `mpirun`, ...) when this process only
    /// spawns the workers: profile those instead.
    pub launcher: Option<&'static str>,
    /// For a launcher: the AI processes below it.
    pub workers: Vec<HostPid>,
    pub comm: String,
    pub cmdline: Vec<String>,
}

impl ProcInfo {
    pub fn is_launcher(&self) -> bool {
        self.launcher.is_some()
    }

    /// The command line joined by spaces (comm when it is empty: kernel threads).
    pub fn command(&self) -> String {
        if self.cmdline.is_empty() {
            format!("[{}]", self.comm)
        } else {
            self.cmdline.join(" ")
        }
    }
}

fn basename(s: &str) -> &str {
    s.rsplit('/').next().unwrap_or(s)
}

/// Recognises launchers from a command line: torchrun /
/// `python -m torch.distributed.run|launch`, mpirun / mpiexec / orterun /
/// prterun, deepspeed, `accelerate launch`, msrun (MindSpore), horovodrun.
/// Python entry-point scripts (`python3 /usr/bin/torchrun ...`) count too.
pub fn launcher_kind(cmdline: &[String]) -> Option<&'static str> {
    let argv0 = basename(cmdline.first()?);
    let mut name: &str = argv0;
    let mut rest = &cmdline[1..];
    if argv0.starts_with("python") {
        let mut i = 0;
        name = "";
        while i < rest.len() {
            let a = rest[i].as_str();
            if a == "-m" {
                name = rest.get(i + 1).map(String::as_str).unwrap_or("");
                rest = &rest[(i + 2).min(rest.len())..];
                break;
            } else if let Some(m) = a.strip_prefix("-m") {
                name = m;
                rest = &rest[i + 1..];
                break;
            } else if a == "-c" {
                return None;
            } else if a == "-X" || a == "-W" || a == "--check-hash-based-pycs" {
                i += 2;
            } else if a.starts_with('-') {
                i += 1;
            } else {
                name = basename(a);
                rest = &rest[i + 1..];
                break;
            }
        }
    }
    let name = name.strip_suffix(".py").unwrap_or(name);
    let next = rest.first().map(String::as_str);
    Some(match name {
        "torchrun" | "torch.distributed.run" => "torchrun",
        "torch.distributed.launch" => "torch.distributed.launch",
        "mpirun" | "mpiexec" | "orterun" | "prterun" | "mpiexec.hydra" => "mpirun",
        "deepspeed" | "deepspeed.launcher.runner" | "deepspeed.launcher.launch" => "deepspeed",
        "accelerate" if next == Some("launch") => "accelerate launch",
        "accelerate.commands.launch" => "accelerate launch",
        "msrun" | "mindspore.parallel.cluster.run" => "msrun",
        "horovodrun" => "horovodrun",
        _ => return None,
    })
}

/// What `--marker auto` would use on a process with these runtimes, for
/// the MARKERS column: the labels of its first preset group, or a hint.
pub fn auto_marker_summary(rt: &presets::Runtimes, maps: &[Mapping]) -> String {
    if let Ok(groups) = presets::auto_markers(maps)
        && let Some(first) = groups.first()
    {
        let mut labels: Vec<String> = Vec::new();
        for s in first {
            let l = s.label();
            if !labels.contains(&l) {
                labels.push(l);
            }
        }
        return labels.join("+");
    }
    if rt.python {
        "name one (python:FUNC)".into()
    } else if rt.cann || rt.cuda {
        "name one (exe:SYMBOL)".into()
    } else {
        "-".into()
    }
}

/// Reads one process. None when it vanished.
pub fn inspect(pid: HostPid) -> Option<ProcInfo> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let ns_pids = parse_nspid(&status).unwrap_or_else(|| vec![NsPid(pid.0)]);
    let comm = fs::read_to_string(format!("/proc/{pid}/comm"))
        .unwrap_or_default()
        .trim()
        .to_string();
    let cmdline: Vec<String> = fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| parse_cmdline(&b))
        .unwrap_or_default();
    let maps = fs::read_to_string(format!("/proc/{pid}/maps"))
        .map(|t| parse_maps(&t))
        .unwrap_or_default();
    let rt = presets::detect(&maps);
    let ai = rt.torch || rt.torch_npu || rt.cann || rt.cuda;
    let env = read_environ(pid).ok();
    let ranks = env.as_deref().map(RankEnv::from_env).unwrap_or_default();
    let container = container::container_of(pid);
    Some(ProcInfo {
        host_pid: pid,
        ppid: parse_ppid(&status),
        ns_pid: *ns_pids.last().unwrap_or(&NsPid(pid.0)),
        ns_pids,
        pid_ns: pidns::pidns_inode(pid).ok().map(|i| format!("pid:[{i}]")),
        container_runtime: container.as_ref().map(|c| c.runtime.as_str()),
        pod_uid: container.as_ref().and_then(|c| c.pod_uid.clone()),
        container,
        rank: ranks.rank,
        local_rank: ranks.local_rank,
        world_size: ranks.world_size,
        environ_readable: env.is_some(),
        runtimes: rt.names(),
        markers: if ai || rt.python {
            auto_marker_summary(&rt, &maps)
        } else {
            "-".into()
        },
        ai,
        launcher: launcher_kind(&cmdline),
        workers: Vec::new(),
        comm,
        cmdline,
    })
}

/// Every process that loads a device runtime or framework, plus the
/// launchers above them; with `all`, every process. Sorted by host PID.
pub fn scan(all: bool) -> Vec<ProcInfo> {
    let me = HostPid(std::process::id());
    let mut procs: Vec<ProcInfo> = all_pids()
        .into_iter()
        .filter(|p| *p != me)
        .filter_map(inspect)
        .collect();
    let index: HashMap<HostPid, usize> = procs
        .iter()
        .enumerate()
        .map(|(i, p)| (p.host_pid, i))
        .collect();
    // Give each launcher the AI processes below it (through any wrappers:
    // unshare, sh, the container runtime's init).
    let mut workers: Vec<(usize, HostPid)> = Vec::new();
    for p in procs.iter().filter(|p| p.ai && !p.is_launcher()) {
        let mut cur = p.ppid;
        let mut hops = 0;
        while let Some(pp) = cur
            && pp.0 > 1
            && hops < 64
        {
            let Some(&i) = index.get(&pp) else { break };
            if procs[i].is_launcher() {
                workers.push((i, p.host_pid));
                break;
            }
            cur = procs[i].ppid;
            hops += 1;
        }
    }
    for (i, w) in workers {
        procs[i].workers.push(w);
    }
    if !all {
        procs.retain(|p| p.ai || (p.is_launcher() && !p.workers.is_empty()));
    }
    procs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn launchers() {
        let cases = [
            ("torchrun --nproc-per-node 8 train.py", Some("torchrun")),
            (
                "/usr/bin/python3 /usr/local/bin/torchrun --nnodes 2 train.py",
                Some("torchrun"),
            ),
            (
                "python -u -m torch.distributed.run --nproc_per_node=8 train.py",
                Some("torchrun"),
            ),
            (
                "python3.11 -m torch.distributed.launch train.py",
                Some("torch.distributed.launch"),
            ),
            ("mpirun -np 8 python train.py", Some("mpirun")),
            ("/opt/hpcx/ompi/bin/mpiexec -n 2 ./a.out", Some("mpirun")),
            (
                "/usr/bin/python3 /usr/local/bin/deepspeed train.py",
                Some("deepspeed"),
            ),
            ("accelerate launch train.py", Some("accelerate launch")),
            ("/usr/bin/python3 /usr/local/bin/accelerate env", None),
            ("msrun --worker_num=8 train.py", Some("msrun")),
            ("python train.py --launcher torchrun", None),
            ("python -c import torch", None),
            (
                "/usr/bin/python3 -X importtime -m torchrun",
                Some("torchrun"),
            ),
            ("./trainer --steps 10", None),
        ];
        for (cmd, want) in cases {
            assert_eq!(launcher_kind(&v(cmd)), want, "{cmd}");
        }
        assert_eq!(launcher_kind(&[]), None);
    }
}
