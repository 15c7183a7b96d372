//! A target's credentials, as `/proc/PID` shows them to the host: user and
//! group ids, supplementary groups, capability sets, `no_new_privs`, seccomp
//! mode, namespaces and cgroups. [`crate::sys::exec`] reproduces them for the
//! vendor tools dynprof starts in the target's world (msprof).
//!
//! The parsers are pure (text in, values out) and unit-tested; only the
//! `read*` functions touch `/proc`.
use std::{
    fmt,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, anyhow, bail};
use procfs::{
    FromBufRead as _,
    process::{MountInfos, Status},
};
use serde::Serialize;

use crate::types::HostPid;

/// Real, effective, saved and filesystem ids (as the host sees them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct IdSet {
    pub real: u32,
    pub effective: u32,
    pub saved: u32,
    pub fs: u32,
}

/// The five capability sets of `/proc/PID/status`, as bit masks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct CapSets {
    pub inheritable: u64,
    pub permitted: u64,
    pub effective: u64,
    pub bounding: u64,
    pub ambient: u64,
}

impl CapSets {
    /// The target's sets as a process holding `own` can give them to a
    /// child that stays in its user namespace (capset(2) grants nothing
    /// beyond the caller's permitted set): each cut to `own.permitted`, the
    /// ambient set also to the cut permitted ∩ inheritable. Returns them
    /// with the target's permitted capabilities left out. A root dynprof
    /// has given up most capabilities after attach, so a tool it starts
    /// later as a root target gets the target's set less those: never more
    /// than the target, and the start does not fail.
    pub fn grantable_by(&self, own: &CapSets) -> (CapSets, u64) {
        let permitted = self.permitted & own.permitted;
        let inheritable = self.inheritable & own.permitted;
        let granted = CapSets {
            inheritable,
            permitted,
            effective: self.effective & permitted,
            bounding: self.bounding,
            ambient: self.ambient & permitted & inheritable,
        };
        (granted, self.permitted & !own.permitted)
    }
}

/// `Seccomp:` in `/proc/PID/status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SeccompMode {
    Disabled,
    /// SECCOMP_MODE_STRICT: read/write/exit only.
    Strict,
    /// SECCOMP_MODE_FILTER: a BPF filter, which cannot be read back and copied.
    Filter,
}

/// What `/proc/PID/status` says about a process's privileges.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Creds {
    pub uids: IdSet,
    pub gids: IdSet,
    /// Supplementary groups (host gids).
    pub groups: Vec<u32>,
    pub caps: CapSets,
    pub no_new_privs: bool,
    pub seccomp: SeccompMode,
}

impl Creds {
    /// Parses the text of `/proc/PID/status`.
    pub fn parse_status(text: &str) -> Result<Self> {
        let st = Status::from_buf_read(text.as_bytes())
            .map_err(|e| anyhow!("unreadable /proc status: {e}"))?;
        let groups = st
            .groups
            .iter()
            .map(|g| u32::try_from(*g).map_err(|_| anyhow!("negative group id {g}")))
            .collect::<Result<Vec<u32>>>()?;
        // Kernels older than these fields cannot be reproduced faithfully.
        let bounding = st
            .capbnd
            .ok_or_else(|| anyhow!("no CapBnd line in /proc status"))?;
        let seccomp = match st.seccomp {
            None | Some(0) => SeccompMode::Disabled,
            Some(1) => SeccompMode::Strict,
            Some(2) => SeccompMode::Filter,
            Some(m) => bail!("unknown seccomp mode {m}"),
        };
        Ok(Self {
            uids: IdSet {
                real: st.ruid,
                effective: st.euid,
                saved: st.suid,
                fs: st.fuid,
            },
            gids: IdSet {
                real: st.rgid,
                effective: st.egid,
                saved: st.sgid,
                fs: st.fgid,
            },
            groups,
            caps: CapSets {
                inheritable: st.capinh,
                permitted: st.capprm,
                effective: st.capeff,
                bounding,
                ambient: st.capamb.unwrap_or(0),
            },
            no_new_privs: st.nonewprivs.unwrap_or(0) != 0,
            seccomp,
        })
    }
}

/// One line of `/proc/PID/uid_map` or `gid_map`: `inside outside count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdMapRange {
    pub inside: u32,
    pub outside: u32,
    pub count: u32,
}

/// A user namespace's id map, read from the host (so `outside` is a host id).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct IdMap(pub Vec<IdMapRange>);

impl IdMap {
    pub fn parse(text: &str) -> Result<Self> {
        let mut v = Vec::new();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let [inside, outside, count] = f[..] else {
                bail!("malformed id map line {line:?}");
            };
            let num = |s: &str| {
                s.parse::<u32>()
                    .map_err(|_| anyhow!("malformed id map line {line:?}"))
            };
            v.push(IdMapRange {
                inside: num(inside)?,
                outside: num(outside)?,
                count: num(count)?,
            });
        }
        Ok(Self(v))
    }

    /// The id inside the namespace of host id `host`; None when unmapped.
    pub fn to_inside(&self, host: u32) -> Option<u32> {
        self.0.iter().find_map(|r| {
            let off = host.checked_sub(r.outside)?;
            (off < r.count).then(|| r.inside + off)
        })
    }
}

/// A namespace kind, in util-linux nsenter's order (user first; it is
/// entered last when dropping privileges, see [`crate::sys::exec`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NsKind {
    User,
    Cgroup,
    Ipc,
    Uts,
    Net,
    Pid,
    Mnt,
    Time,
}

impl NsKind {
    pub const ALL: [NsKind; 8] = [
        NsKind::User,
        NsKind::Cgroup,
        NsKind::Ipc,
        NsKind::Uts,
        NsKind::Net,
        NsKind::Pid,
        NsKind::Mnt,
        NsKind::Time,
    ];

    /// The file name under `/proc/PID/ns/`.
    pub fn proc_name(self) -> &'static str {
        match self {
            NsKind::User => "user",
            NsKind::Cgroup => "cgroup",
            NsKind::Ipc => "ipc",
            NsKind::Uts => "uts",
            NsKind::Net => "net",
            NsKind::Pid => "pid",
            NsKind::Mnt => "mnt",
            NsKind::Time => "time",
        }
    }
}

impl fmt::Display for NsKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.proc_name())
    }
}

/// A namespace's identity: the (device, inode) of its `/proc/PID/ns` file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct NsId {
    pub dev: u64,
    pub ino: u64,
}

/// One line of `/proc/PID/cgroup`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CgroupEntry {
    /// 0 for the v2 hierarchy.
    pub hierarchy: u32,
    /// v1 controllers (`memory`, `name=systemd`); empty for v2.
    pub controllers: Vec<String>,
    /// Path inside the hierarchy (relative to our cgroup namespace's root).
    pub path: String,
}

impl CgroupEntry {
    pub fn is_v2(&self) -> bool {
        self.hierarchy == 0 && self.controllers.is_empty()
    }
}

/// Parses `/proc/PID/cgroup` (v2 `0::/path` and v1 `N:ctrl,ctrl:/path`).
pub fn parse_cgroups(text: &str) -> Result<Vec<CgroupEntry>> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        let mut it = line.splitn(3, ':');
        let (Some(h), Some(c), Some(p)) = (it.next(), it.next(), it.next()) else {
            bail!("malformed cgroup line {line:?}");
        };
        let hierarchy = h
            .parse()
            .map_err(|_| anyhow!("malformed cgroup line {line:?}"))?;
        if !p.starts_with('/') {
            bail!("cgroup path is not absolute in {line:?}");
        }
        out.push(CgroupEntry {
            hierarchy,
            controllers: c
                .split(',')
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect(),
            path: p.to_string(),
        });
    }
    Ok(out)
}

/// A mounted cgroup hierarchy (from our mountinfo).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupMount {
    /// The hierarchy's directory mounted (mountinfo's `root`).
    pub root: String,
    pub mount_point: PathBuf,
    /// None for cgroup2; else the v1 controllers and `name=` of the mount.
    pub v1_controllers: Option<Vec<String>>,
}

/// The cgroup mounts in a mountinfo text.
pub fn parse_cgroup_mounts(mountinfo: &str) -> Result<Vec<CgroupMount>> {
    let infos = MountInfos::from_buf_read(mountinfo.as_bytes())
        .map_err(|e| anyhow!("unreadable mountinfo: {e}"))?;
    Ok(infos
        .0
        .into_iter()
        .filter_map(|m| match m.fs_type.as_str() {
            "cgroup2" => Some(CgroupMount {
                root: m.root,
                mount_point: m.mount_point,
                v1_controllers: None,
            }),
            "cgroup" => {
                let ctrls = m
                    .super_options
                    .iter()
                    .map(|(k, v)| match v {
                        Some(v) => format!("{k}={v}"),
                        None => k.clone(),
                    })
                    .collect();
                Some(CgroupMount {
                    root: m.root,
                    mount_point: m.mount_point,
                    v1_controllers: Some(ctrls),
                })
            }
            _ => None,
        })
        .collect())
}

/// The `cgroup.procs` file, among `mounts`, of the cgroup `e` names; None
/// when its hierarchy is not mounted here (or not at a place that holds it).
pub fn cgroup_procs_path(e: &CgroupEntry, mounts: &[CgroupMount]) -> Option<PathBuf> {
    mounts.iter().find_map(|m| {
        let matches = match &m.v1_controllers {
            None => e.is_v2(),
            Some(have) => !e.is_v2() && e.controllers.iter().all(|c| have.iter().any(|h| h == c)),
        };
        if !matches {
            return None;
        }
        let rel = if m.root == "/" {
            e.path.as_str()
        } else {
            let rest = e.path.strip_prefix(m.root.as_str())?;
            if !(rest.is_empty() || rest.starts_with('/')) {
                return None;
            }
            rest
        };
        let rel = rel.trim_start_matches('/');
        // A path the target's cgroup names never climbs out of the mount.
        if rel.split('/').any(|c| c == "..") {
            return None;
        }
        Some(m.mount_point.join(rel).join("cgroup.procs"))
    })
}

/// Everything dynprof reproduces of a target (see [`crate::sys::exec`]).
#[derive(Clone, Debug, Serialize)]
pub struct TargetCreds {
    pub pid: HostPid,
    pub creds: Creds,
    /// Namespaces that differ from dynprof's own, in [`NsKind::ALL`] order.
    pub foreign_ns: Vec<NsKind>,
    /// The target's user namespace maps (identity when it shares ours).
    #[serde(skip)]
    pub uid_map: IdMap,
    #[serde(skip)]
    pub gid_map: IdMap,
    pub cgroups: Vec<CgroupEntry>,
    /// The LSM label (`/proc/PID/attr/current`) when one is active and it
    /// differs from dynprof's own.
    pub lsm_label: Option<String>,
}

/// The namespace of `kind` of process `pid` (a number, or "self").
pub fn ns_id(pid: &str, kind: NsKind) -> Option<NsId> {
    let m = std::fs::metadata(format!("/proc/{pid}/ns/{}", kind.proc_name())).ok()?;
    Some(NsId {
        dev: m.dev(),
        ino: m.ino(),
    })
}

fn read(path: impl AsRef<Path>) -> Result<String> {
    let p = path.as_ref();
    std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
}

fn lsm_label(pid: &str) -> Option<String> {
    // EINVAL when no LSM provides a label (this host); "unconfined" for AppArmor.
    std::fs::read_to_string(format!("/proc/{pid}/attr/current"))
        .ok()
        .map(|s| s.trim_end_matches(['\n', '\0']).to_string())
}

impl TargetCreds {
    /// Reads everything from `/proc/<pid>`.
    pub fn read(pid: HostPid) -> Result<Self> {
        let p = pid.to_string();
        let creds = Creds::parse_status(&read(format!("/proc/{p}/status"))?)
            .with_context(|| format!("parsing /proc/{p}/status"))?;
        let mut foreign_ns = Vec::new();
        for kind in NsKind::ALL {
            match (ns_id("self", kind), ns_id(&p, kind)) {
                (Some(a), Some(b)) if a == b => {}
                (None, None) => {} // this kernel lacks the namespace kind
                (Some(_), Some(_)) => foreign_ns.push(kind),
                (_, None) => bail!("cannot read /proc/{p}/ns/{kind} (has PID {p} exited?)"),
                (None, Some(_)) => bail!("cannot read /proc/self/ns/{kind}"),
            }
        }
        let (uid_map, gid_map) = if foreign_ns.contains(&NsKind::User) {
            (
                IdMap::parse(&read(format!("/proc/{p}/uid_map"))?)?,
                IdMap::parse(&read(format!("/proc/{p}/gid_map"))?)?,
            )
        } else {
            let id = IdMap(vec![IdMapRange {
                inside: 0,
                outside: 0,
                count: u32::MAX,
            }]);
            (id.clone(), id)
        };
        let cgroups = parse_cgroups(&read(format!("/proc/{p}/cgroup"))?)?;
        let label = lsm_label(&p);
        let lsm_label = match (label, lsm_label("self")) {
            (Some(t), Some(ours)) if t == ours => None,
            (t, _) => t,
        };
        Ok(Self {
            pid,
            creds,
            foreign_ns,
            uid_map,
            gid_map,
            cgroups,
            lsm_label,
        })
    }

    /// The `cgroup.procs` files (on the host) of the target's cgroups.
    /// Hierarchies not mounted here are skipped: no process can be placed
    /// in them other than at their root, which is where we are too.
    pub fn cgroup_procs(&self) -> Result<Vec<PathBuf>> {
        let mounts = parse_cgroup_mounts(&read("/proc/self/mountinfo")?)?;
        let mut out = Vec::new();
        for e in &self.cgroups {
            match cgroup_procs_path(e, &mounts) {
                Some(p) => out.push(p),
                None if e.path == "/" => {}
                None if e.is_v2() => bail!(
                    "the target's cgroup v2 {} is not reachable from dynprof's mounts",
                    e.path
                ),
                None => log::debug!(
                    "cgroup v1 hierarchy {} ({}) not mounted here; not joined",
                    e.hierarchy,
                    e.controllers.join(",")
                ),
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {

    /// What capset(2) would allow: nothing beyond the caller's permitted
    /// set, ambient only within permitted ∩ inheritable; what is cut is
    /// named; a caller that holds everything gives the target's sets as
    /// they are.
    #[test]
    fn grantable_sets_never_exceed_the_target_or_the_giver() {
        let all = (1u64 << 41) - 1;
        let target = CapSets {
            inheritable: 0b0110,
            permitted: all,
            effective: all,
            bounding: all,
            ambient: 0b0110,
        };
        let own = CapSets {
            inheritable: 0,
            permitted: 0b0011,
            effective: 0b0011,
            bounding: 0b0011,
            ambient: 0,
        };
        let (g, cut) = target.grantable_by(&own);
        assert_eq!(g.permitted, 0b0011);
        assert_eq!(g.effective, 0b0011);
        assert_eq!(g.inheritable, 0b0010);
        assert_eq!(g.ambient, 0b0010);
        assert_eq!(g.bounding, all, "the child lowers its own bounding set");
        assert_eq!(cut, all & !0b0011);
        let root = CapSets {
            inheritable: 0,
            permitted: all,
            effective: all,
            bounding: all,
            ambient: 0,
        };
        assert_eq!(target.grantable_by(&root), (target, 0));
        // A non-root target with no capabilities loses nothing.
        let none = CapSets {
            inheritable: 0,
            permitted: 0,
            effective: 0,
            bounding: all,
            ambient: 0,
        };
        assert_eq!(none.grantable_by(&own), (none, 0));
    }

    use super::*;

    const STATUS: &str = "Name:\ttrainer
Umask:\t0022
State:\tS (sleeping)
Tgid:\t4242
Ngid:\t0
Pid:\t4242
PPid:\t1
TracerPid:\t0
Uid:\t65534\t65534\t65534\t65534
Gid:\t65533\t65534\t65535\t65532
FDSize:\t64
Groups:\t4 27 65534 
NStgid:\t4242\t1
NSpid:\t4242\t1
NSpgid:\t4242\t1
NSsid:\t4242\t1
Threads:\t1
SigQ:\t0/7823
SigPnd:\t0000000000000000
ShdPnd:\t0000000000000000
SigBlk:\t0000000000000000
SigIgn:\t0000000000000000
SigCgt:\t0000000000000000
CapInh:\t0000000000000400
CapPrm:\t0000000000000400
CapEff:\t0000000000000400
CapBnd:\t000001fffeffdfff
CapAmb:\t0000000000000400
NoNewPrivs:\t1
Seccomp:\t2
Seccomp_filters:\t1
Speculation_Store_Bypass:\tthread vulnerable
Cpus_allowed:\t3
Cpus_allowed_list:\t0-1
Mems_allowed:\t1
Mems_allowed_list:\t0
voluntary_ctxt_switches:\t1
nonvoluntary_ctxt_switches:\t0
";

    #[test]
    fn status_gives_every_id_cap_and_flag() {
        let c = Creds::parse_status(STATUS).unwrap();
        assert_eq!(
            c.uids,
            IdSet {
                real: 65534,
                effective: 65534,
                saved: 65534,
                fs: 65534
            }
        );
        assert_eq!(
            c.gids,
            IdSet {
                real: 65533,
                effective: 65534,
                saved: 65535,
                fs: 65532
            }
        );
        assert_eq!(c.groups, [4, 27, 65534]);
        assert_eq!(
            c.caps,
            CapSets {
                inheritable: 0x400,
                permitted: 0x400,
                effective: 0x400,
                bounding: 0x1fffeffdfff,
                ambient: 0x400
            }
        );
        assert!(c.no_new_privs);
        assert_eq!(c.seccomp, SeccompMode::Filter);
        let plain = STATUS
            .replace("NoNewPrivs:\t1", "NoNewPrivs:\t0")
            .replace("Seccomp:\t2", "Seccomp:\t0");
        let c = Creds::parse_status(&plain).unwrap();
        assert!(!c.no_new_privs);
        assert_eq!(c.seccomp, SeccompMode::Disabled);
    }

    #[test]
    fn hostile_status_is_an_error_not_a_panic() {
        for bad in [
            "",
            "Uid:\tx\n",
            &STATUS.replace("CapBnd:\t000001fffeffdfff\n", ""),
            &STATUS.replace("Seccomp:\t2", "Seccomp:\t7"),
        ] {
            assert!(Creds::parse_status(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn id_maps_translate_host_ids_and_refuse_unmapped() {
        let m =
            IdMap::parse("         0      65534          1\n      1000     100000      65536\n")
                .unwrap();
        assert_eq!(m.to_inside(65534), Some(0));
        assert_eq!(m.to_inside(100000), Some(1000));
        assert_eq!(m.to_inside(165535), Some(66535));
        assert_eq!(m.to_inside(165536), None);
        assert_eq!(m.to_inside(0), None);
        assert_eq!(m.to_inside(65533), None);
        assert!(IdMap::parse("0 1\n").is_err());
        assert!(IdMap::parse("0 1 x\n").is_err());
        assert_eq!(IdMap::parse("").unwrap().to_inside(0), None);
    }

    const MOUNTINFO: &str = "\
25 30 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
31 25 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
32 31 0:27 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
33 31 0:28 / /sys/fs/cgroup/systemd rw,nosuid,nodev,noexec,relatime shared:11 - cgroup cgroup rw,xattr,name=systemd
36 31 0:31 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:15 - cgroup cgroup rw,memory
37 31 0:32 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:16 - cgroup cgroup rw,cpu,cpuacct
38 31 0:33 /sub /mnt/pids rw,relatime shared:17 - cgroup cgroup rw,pids
";

    #[test]
    fn hybrid_cgroups_map_to_their_mounts() {
        let cg = parse_cgroups(
            "9:name=systemd:/\n8:pids:/sub/job\n4:memory:/process_api/07a6\n2:cpu,cpuacct:/j\n3:cpuset:/x\n0::/user.slice/job\n",
        )
        .unwrap();
        assert_eq!(cg.len(), 6);
        assert!(cg[5].is_v2());
        let mounts = parse_cgroup_mounts(MOUNTINFO).unwrap();
        assert_eq!(mounts.len(), 5);
        let p = |i: usize| cgroup_procs_path(&cg[i], &mounts);
        assert_eq!(
            p(0),
            Some(PathBuf::from("/sys/fs/cgroup/systemd/cgroup.procs"))
        );
        assert_eq!(p(1), Some(PathBuf::from("/mnt/pids/job/cgroup.procs")));
        assert_eq!(
            p(2),
            Some(PathBuf::from(
                "/sys/fs/cgroup/memory/process_api/07a6/cgroup.procs"
            ))
        );
        assert_eq!(
            p(3),
            Some(PathBuf::from("/sys/fs/cgroup/cpu,cpuacct/j/cgroup.procs"))
        );
        assert_eq!(p(4), None, "cpuset is not mounted");
        assert_eq!(
            p(5),
            Some(PathBuf::from(
                "/sys/fs/cgroup/unified/user.slice/job/cgroup.procs"
            ))
        );
        // A path that climbs out, or outside a bind mount's root, is not joined.
        let up = parse_cgroups("0::/../../etc\n8:pids:/other\n").unwrap();
        assert_eq!(cgroup_procs_path(&up[0], &mounts), None);
        assert_eq!(cgroup_procs_path(&up[1], &mounts), None);
        for bad in ["x::/", "0:/", "0::relative"] {
            assert!(parse_cgroups(bad).is_err(), "{bad}");
        }
    }
}
