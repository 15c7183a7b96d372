//! `--pid N --in-pidns REF`: a PID as some PID namespace sees it → host PID.
//!
//! REF names the namespace: the host PID of any process in it, a
//! `/proc/X/ns/pid` path (or any bind mount of one), `pid:[INODE]`, or a
//! container id (full, or a prefix of at least 12 hex digits).
//!
//! Resolution scans the `NSpid:` lines of `/proc/*/status`. A namespace
//! nested `level` deep below ours shows its PIDs at index `level` of that
//! line; a process matches when that entry is N and its own namespace, walked
//! up to that level with `NS_GET_PARENT`, is the named one. That makes
//! nested namespaces work and tells sibling namespaces apart.
use std::{
    fs::{self, File},
    os::{
        fd::{AsRawFd as _, FromRawFd as _},
        unix::fs::MetadataExt as _,
    },
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};

use super::{all_pids, container};
use crate::types::{ContainerId, HostPid, NsPid};

/// `NS_GET_PARENT` from `<linux/nsfs.h>`: `_IO(0xb7, 0x2)`.
const NS_GET_PARENT: libc::c_ulong = 0xb702;

/// How `--in-pidns` named a namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PidNsRef {
    /// A host PID of a process in it.
    HostPid(HostPid),
    /// A path to a PID namespace file (`/proc/X/ns/pid`, or a bind mount).
    Path(PathBuf),
    /// `pid:[INODE]`.
    Inode(u64),
    /// A container id or id prefix (at least 12 hex digits).
    Container(String),
}

impl PidNsRef {
    /// Parses REF. Decimal numbers shorter than 12 digits are host PIDs
    /// (Linux PIDs have at most 7); 12 to 64 hex digits are container ids.
    pub fn parse(s: &str) -> Result<Self> {
        let s = s.trim();
        if s.starts_with('/') {
            return Ok(PidNsRef::Path(PathBuf::from(s)));
        }
        if let Some(rest) = s.strip_prefix("pid:[") {
            if let Some(ino) = rest.strip_suffix(']').and_then(|n| n.parse().ok()) {
                return Ok(PidNsRef::Inode(ino));
            }
            bail!(
                "invalid --in-pidns `{s}`: expected pid:[INODE] with a decimal inode, e.g. pid:[4026532179]"
            );
        }
        if !s.is_empty()
            && s.len() < container::MIN_PREFIX_LEN
            && s.bytes().all(|b| b.is_ascii_digit())
        {
            let pid: u32 = s
                .parse()
                .with_context(|| format!("invalid --in-pidns `{s}`"))?;
            return Ok(PidNsRef::HostPid(HostPid(pid)));
        }
        if container::looks_like_id_prefix(s) {
            return Ok(PidNsRef::Container(s.to_ascii_lowercase()));
        }
        bail!(
            "invalid --in-pidns `{s}`: expected the host PID of a process in the namespace, \
             a /proc/PID/ns/pid path, pid:[INODE], or a container id (at least {} hex digits)",
            container::MIN_PREFIX_LEN
        )
    }
}

/// A PID namespace, identified by its nsfs inode, `level` namespaces below
/// the one dynprof runs in (0 = dynprof's own, normally the host's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PidNs {
    pub inode: u64,
    pub level: usize,
    /// Set when REF was a container id.
    pub container: Option<ContainerId>,
}

impl PidNs {
    pub fn name(&self) -> String {
        format!("pid:[{}]", self.inode)
    }
}

/// `pid:[INODE]` → INODE.
pub fn parse_ns_link(link: &str) -> Option<u64> {
    link.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
}

/// The inode of a process's PID namespace (readlink /proc/PID/ns/pid).
pub fn pidns_inode(pid: HostPid) -> Result<u64> {
    let link = fs::read_link(format!("/proc/{pid}/ns/pid"))
        .with_context(|| format!("reading /proc/{pid}/ns/pid"))?;
    parse_ns_link(&link.to_string_lossy())
        .with_context(|| format!("/proc/{pid}/ns/pid links to {}", link.display()))
}

fn fd_inode(f: &File) -> Result<u64> {
    Ok(f.metadata()?.ino())
}

/// The parent of a namespace, or None at the top of dynprof's view.
fn ns_parent(f: &File) -> Option<File> {
    // SAFETY: NS_GET_PARENT takes no argument and returns a new fd or -1.
    let fd = unsafe { libc::ioctl(f.as_raw_fd(), NS_GET_PARENT as _) };
    // SAFETY: a non-negative return is a fresh descriptor we now own.
    (fd >= 0).then(|| unsafe { File::from_raw_fd(fd) })
}

/// How many namespaces lie above this one, up to dynprof's own.
fn ns_level(f: &File) -> usize {
    let mut level = 0;
    let mut cur = ns_parent(f);
    while let Some(p) = cur {
        level += 1;
        cur = ns_parent(&p);
    }
    level
}

/// The inode of the namespace `up` levels above the one `f` names.
fn ancestor_inode(f: File, up: usize) -> Option<u64> {
    let mut cur = f;
    for _ in 0..up {
        cur = ns_parent(&cur)?;
    }
    fd_inode(&cur).ok()
}

fn open_ns_file(path: &Path) -> Result<File> {
    let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    // Only nsfs files answer NS_GET_NSTYPE; check it is a PID namespace.
    // SAFETY: NS_GET_NSTYPE (_IO(0xb7, 0x3)) takes no argument.
    let ty = unsafe { libc::ioctl(f.as_raw_fd(), 0xb703 as _) };
    if ty < 0 {
        bail!(
            "{} is not a namespace file (want /proc/PID/ns/pid)",
            path.display()
        );
    }
    if ty != libc::CLONE_NEWPID {
        bail!(
            "{} is a namespace, but not a PID namespace (want /proc/PID/ns/pid)",
            path.display()
        );
    }
    Ok(f)
}

/// Status fields dynprof reads for every process.
pub(crate) fn read_nspid(pid: HostPid) -> Option<Vec<NsPid>> {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| super::parse_nspid(&s))
}

/// Resolves REF to a namespace.
pub fn find_pidns(r: &PidNsRef) -> Result<PidNs> {
    let (file, container) = match r {
        PidNsRef::HostPid(p) => {
            let path = PathBuf::from(format!("/proc/{p}/ns/pid"));
            if !Path::new(&format!("/proc/{p}")).exists() {
                bail!("--in-pidns {p}: no process with host PID {p}");
            }
            (
                open_ns_file(&path).with_context(|| format!("--in-pidns {p}"))?,
                None,
            )
        }
        PidNsRef::Path(path) => (open_ns_file(path)?, None),
        PidNsRef::Inode(ino) => {
            let holder = all_pids()
                .into_iter()
                .find(|p| pidns_inode(*p).ok() == Some(*ino));
            let Some(holder) = holder else {
                bail!("--in-pidns pid:[{ino}]: no running process is in that PID namespace");
            };
            (
                open_ns_file(Path::new(&format!("/proc/{holder}/ns/pid")))?,
                None,
            )
        }
        PidNsRef::Container(prefix) => {
            let (cid, pids) = container::find_container(prefix)?;
            // The container's own namespace is the outermost one its processes use.
            let best = pids
                .iter()
                .filter_map(|p| Some((read_nspid(*p)?.len(), *p)))
                .min()
                .map(|(_, p)| p)
                .with_context(|| format!("container {}: its processes have exited", cid.short()))?;
            (
                open_ns_file(Path::new(&format!("/proc/{best}/ns/pid")))?,
                Some(cid),
            )
        }
    };
    Ok(PidNs {
        inode: fd_inode(&file)?,
        level: ns_level(&file),
        container,
    })
}

/// One process seen in a namespace.
#[derive(Clone, Debug)]
pub struct Seen {
    pub host_pid: HostPid,
    pub ns_pids: Vec<NsPid>,
    pub comm: String,
}

fn comm(pid: HostPid) -> String {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// Every process whose NSpid chain has `ns_pid` at `ns.level` and whose
/// namespace is, or is nested in, `ns`. Processes whose ancestry could not
/// be checked are returned separately.
pub fn find_in_ns(ns: &PidNs, ns_pid: Option<NsPid>) -> (Vec<Seen>, Vec<Seen>) {
    let mut sure = Vec::new();
    let mut unsure = Vec::new();
    for p in all_pids() {
        let Some(chain) = read_nspid(p) else { continue };
        if chain.len() <= ns.level || ns_pid.is_some_and(|n| chain[ns.level] != n) {
            continue;
        }
        let up = chain.len() - 1 - ns.level;
        let anc = if ns.level == 0 {
            // Every process /proc shows is in (or below) dynprof's own namespace.
            Some(ns.inode)
        } else if up == 0 {
            pidns_inode(p).ok()
        } else {
            File::open(format!("/proc/{p}/ns/pid"))
                .ok()
                .and_then(|f| ancestor_inode(f, up))
        };
        let seen = Seen {
            host_pid: p,
            ns_pids: chain,
            comm: comm(p),
        };
        match anc {
            Some(i) if i == ns.inode => sure.push(seen),
            Some(_) => {}
            None => unsure.push(seen),
        }
    }
    (sure, unsure)
}

fn describe(list: &[Seen], level: usize) -> String {
    const MAX: usize = 20;
    let mut s: Vec<String> = list
        .iter()
        .take(MAX)
        .map(|p| {
            let chain: Vec<String> = p.ns_pids.iter().map(|n| n.to_string()).collect();
            format!(
                "PID {} there = host PID {} ({}; NSpid {})",
                p.ns_pids[level],
                p.host_pid,
                p.comm,
                chain.join(" ")
            )
        })
        .collect();
    if list.len() > MAX {
        s.push(format!("... and {} more", list.len() - MAX));
    }
    s.join("\n  ")
}

/// Turns `--pid N [--in-pidns REF]` into a host PID. Without REF, N is a
/// host PID.
pub fn resolve_pid(pid: u32, in_pidns: Option<&str>) -> Result<HostPid> {
    let Some(r) = in_pidns else {
        return Ok(HostPid(pid));
    };
    let ns = find_pidns(&PidNsRef::parse(r)?)?;
    resolve_in(NsPid(pid), &ns).with_context(|| format!("--pid {pid} --in-pidns {r}"))
}

/// Finds the process that `ns` calls `pid`.
pub fn resolve_in(pid: NsPid, ns: &PidNs) -> Result<HostPid> {
    let (sure, unsure) = find_in_ns(ns, Some(pid));
    let host = match (sure.as_slice(), unsure.as_slice()) {
        ([one], _) => one.host_pid,
        ([], []) => {
            let (members, _) = find_in_ns(ns, None);
            let what = match &ns.container {
                Some(c) => format!(
                    "container {} ({}), namespace {}",
                    c.short(),
                    c.runtime,
                    ns.name()
                ),
                None => format!("PID namespace {}", ns.name()),
            };
            if members.is_empty() {
                bail!("no process with PID {pid} in {what}, which has no processes left");
            }
            bail!(
                "no process with PID {pid} in {what} (hint: a thread id is not a process id); \
                 processes there:\n  {}",
                describe(&members, ns.level)
            );
        }
        _ => {
            let mut all = sure.clone();
            all.extend(unsure.iter().cloned());
            bail!(
                "PID {pid} in namespace {} is ambiguous; candidates:\n  {}\npass the host PID with --pid instead",
                ns.name(),
                describe(&all, ns.level)
            );
        }
    };
    if let Some(c) = &ns.container
        && ns.level == 0
        && container::container_of(host).as_ref().map(|h| &h.id) != Some(&c.id)
    {
        bail!(
            "container {} shares the host PID namespace, and host PID {host} is not in it; \
             pass one of the container's PIDs",
            c.short()
        );
    }
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_refs() {
        assert_eq!(
            PidNsRef::parse("4242").unwrap(),
            PidNsRef::HostPid(HostPid(4242))
        );
        assert_eq!(
            PidNsRef::parse("pid:[4026532179]").unwrap(),
            PidNsRef::Inode(4026532179)
        );
        assert_eq!(
            PidNsRef::parse("/proc/1/ns/pid").unwrap(),
            PidNsRef::Path("/proc/1/ns/pid".into())
        );
        assert_eq!(
            PidNsRef::parse("3F4E5A6B7C8D").unwrap(),
            PidNsRef::Container("3f4e5a6b7c8d".into())
        );
        assert_eq!(
            PidNsRef::parse("123456789012").unwrap(),
            PidNsRef::Container("123456789012".into())
        );
        for bad in [
            "",
            "abc",
            "pid:[x]",
            "net:[4026531840]",
            "3f4e5a6b7c8",
            "zz4e5a6b7c8d9",
            "-1",
        ] {
            let e = PidNsRef::parse(bad).unwrap_err().to_string();
            assert!(
                e.contains("invalid --in-pidns") || e.contains("not a container id"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn own_namespace_is_level_zero() {
        let me = HostPid(std::process::id());
        let ns = find_pidns(&PidNsRef::HostPid(me)).unwrap();
        assert_eq!(ns.level, 0);
        assert_eq!(ns.inode, pidns_inode(me).unwrap());
        let chain = read_nspid(me).unwrap();
        assert_eq!(resolve_in(chain[0], &ns).unwrap(), me);
    }

    #[test]
    fn not_a_pid_namespace() {
        let e = find_pidns(&PidNsRef::Path("/proc/self/ns/net".into()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a PID namespace"), "{e}");
        let e = find_pidns(&PidNsRef::Path("/etc/hostname".into()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a namespace file"), "{e}");
    }
}
