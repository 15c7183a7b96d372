//! Starting a process *as the target*, the way `runc exec` / `docker exec`
//! do: in the target's cgroups and every one of its namespaces, chrooted to
//! its root, in its cwd, with its uid/gid/groups, capability sets and
//! `no_new_privs`. dynprof is root; the tools it starts in a job's world
//! (msprof) must never be.
//!
//! Everything is prepared in the parent ([`AsTarget::prepare`]: fds of the
//! namespaces, the root, the cwd and the cgroup.procs files; translated ids;
//! capability masks). The `pre_exec` closure only makes raw, async-signal-safe
//! syscalls, in this order:
//!
//! 1. join the cgroups (write `0` to each `cgroup.procs`), while still root;
//! 2. when the user namespace differs: set the supplementary groups (host
//!    gids) now, because inside a rootless container `setgroups` is denied;
//! 3. `setns` every namespace that differs from ours except user
//!    (util-linux nsenter's order), then the user namespace last;
//! 4. `fchdir(root)`, `chroot(".")`, `fchdir(cwd)`;
//! 5. drop the bounding set to the target's;
//! 6. `PR_SET_KEEPCAPS`, setgroups (same user namespace), setresgid,
//!    setresuid, with ids translated into the target's user namespace;
//! 7. capset the target's effective/permitted/inheritable sets, raise its
//!    ambient set, `PR_SET_NO_NEW_PRIVS` if it has it; not dumpable. In the
//!    target's own user namespace only what dynprof still holds can be set:
//!    after the drop at attach, a root target's tool runs with the target's
//!    sets less the capabilities dynprof gave up ([`AsTarget::withheld_caps`]);
//!    never with more than the target has;
//! 8. when the PID (or time) namespace differs, fork so the exec'd process is
//!    inside it. Credentials are dropped *before* that fork: no root process
//!    lingers. The intermediate closes its fds, waits, and exits with the
//!    child's status (or re-raises its signal).
//!
//! Not reproducible, so refused unless the operator opts in: a seccomp
//! filter (it cannot be read back), an LSM label other than ours. Refused
//! always: seccomp strict mode, a fs uid/gid other than the effective one,
//! ids not mapped in the target's user namespace.
use std::{
    ffi::CString,
    fs::File,
    io::{self, Read as _},
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
        unix::process::CommandExt as _,
    },
    process::Command,
};

use anyhow::{Context as _, Result, anyhow, bail};
use rustix::fs::{Mode, OFlags};

use super::creds::{Creds, NsKind, SeccompMode, TargetCreds};
use crate::types::HostPid;

/// What the operator allows dynprof to leave out.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExecOptions {
    /// Run even though the target has a seccomp filter or an LSM label that
    /// dynprof cannot copy (the tool then runs without them, but still with
    /// the target's ids, capabilities and namespaces).
    pub allow_unconfined: bool,
}

/// The steps of the child's setup, reported back when one fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Step {
    Cgroup = 1,
    HostGroups,
    Setns,
    SetnsUser,
    Chroot,
    Bounding,
    KeepCaps,
    Groups,
    Gid,
    Uid,
    Capset,
    Ambient,
    NoNewPrivs,
    Fork,
}

impl Step {
    const ALL: [Step; 14] = [
        Step::Cgroup,
        Step::HostGroups,
        Step::Setns,
        Step::SetnsUser,
        Step::Chroot,
        Step::Bounding,
        Step::KeepCaps,
        Step::Groups,
        Step::Gid,
        Step::Uid,
        Step::Capset,
        Step::Ambient,
        Step::NoNewPrivs,
        Step::Fork,
    ];

    fn describe(self) -> &'static str {
        match self {
            Step::Cgroup => "joining the target's cgroup (writing its cgroup.procs)",
            Step::HostGroups | Step::Groups => "setting the target's supplementary groups",
            Step::Setns => "entering the target's namespaces",
            Step::SetnsUser => "entering the target's user namespace",
            Step::Chroot => "changing to the target's root and working directory",
            Step::Bounding => "dropping the capability bounding set to the target's",
            Step::KeepCaps => "PR_SET_KEEPCAPS",
            Step::Gid => "setresgid to the target's gids",
            Step::Uid => "setresuid to the target's uids",
            Step::Capset => "setting the target's capability sets",
            Step::Ambient => "raising the target's ambient capabilities",
            Step::NoNewPrivs => "PR_SET_NO_NEW_PRIVS",
            Step::Fork => "forking into the target's PID namespace",
        }
    }
}

/// A prepared "run as the target": apply it to a `Command` before spawning.
#[derive(Debug)]
pub struct AsTarget {
    pub pid: HostPid,
    cgroup_procs: Vec<OwnedFd>,
    /// Namespaces other than user, in nsenter's order, with their CLONE_* flag.
    ns: Vec<(OwnedFd, libc::c_int)>,
    user_ns: Option<OwnedFd>,
    root: OwnedFd,
    cwd: OwnedFd,
    /// Host gids, set before entering a foreign user namespace.
    host_groups: Option<Vec<libc::gid_t>>,
    /// Gids as the target's user namespace names them (same user namespace).
    groups: Option<Vec<libc::gid_t>>,
    uid: u32,
    gid: u32,
    uids: [u32; 3],
    gids: [u32; 3],
    /// Capabilities to remove from the bounding set.
    bounding_drop: Vec<u32>,
    effective: u64,
    permitted: u64,
    inheritable: u64,
    ambient: Vec<u32>,
    /// The target's permitted capabilities the child will not have:
    /// dynprof no longer holds them (see `CapSets::grantable_by`).
    withheld: u64,
    no_new_privs: bool,
    fork: bool,
    /// Reports a failed step (one byte) back to the parent.
    err_rd: File,
    err_wr: OwnedFd,
    /// What was reproduced, for msprof_meta.json.
    pub creds: TargetCreds,
}

fn open_path(p: &str, flags: OFlags) -> Result<OwnedFd> {
    rustix::fs::open(p, flags | OFlags::CLOEXEC, Mode::empty())
        .with_context(|| format!("opening {p}"))
}

fn clone_flag(k: NsKind) -> libc::c_int {
    match k {
        NsKind::User => libc::CLONE_NEWUSER,
        NsKind::Cgroup => libc::CLONE_NEWCGROUP,
        NsKind::Ipc => libc::CLONE_NEWIPC,
        NsKind::Uts => libc::CLONE_NEWUTS,
        NsKind::Net => libc::CLONE_NEWNET,
        NsKind::Pid => libc::CLONE_NEWPID,
        NsKind::Mnt => libc::CLONE_NEWNS,
        // CLONE_NEWTIME (not in every libc version).
        NsKind::Time => 0x80,
    }
}

fn bits(mask: u64, last_cap: u32) -> impl Iterator<Item = u32> {
    (0..=last_cap.min(63)).filter(move |c| mask & (1u64 << c) != 0)
}

impl AsTarget {
    /// Reads the target's credentials and opens everything the child needs.
    /// Refuses what cannot be reproduced (see the module docs).
    pub fn prepare(pid: HostPid, opts: ExecOptions) -> Result<Self> {
        // Held across every read below: if the process is still alive at the
        // end, its PID was not reused by another process in between.
        let pidfd = rustix::process::pidfd_open(
            rustix::process::Pid::from_raw(pid.0 as i32)
                .ok_or_else(|| anyhow!("invalid PID {pid}"))?,
            rustix::process::PidfdFlags::empty(),
        )
        .with_context(|| format!("pidfd_open({pid})"))?;
        let tc = TargetCreds::read(pid)?;
        let (uids, gids) = reproducible_ids(&tc, opts)?;
        let c = &tc.creds;
        let foreign_user = tc.foreign_ns.contains(&NsKind::User);
        let (host_groups, groups) = if foreign_user {
            (Some(c.groups.clone()), None)
        } else {
            (None, Some(c.groups.clone()))
        };
        let p = pid.to_string();
        let mut cgroup_procs = Vec::new();
        for path in tc.cgroup_procs()? {
            let fd = rustix::fs::open(&path, OFlags::WRONLY | OFlags::CLOEXEC, Mode::empty())
                .with_context(|| {
                    format!("opening {} to join the target's cgroup", path.display())
                })?;
            cgroup_procs.push(fd);
        }
        let mut ns = Vec::new();
        let mut user_ns = None;
        for &k in &tc.foreign_ns {
            let fd = open_path(&format!("/proc/{p}/ns/{k}"), OFlags::RDONLY)?;
            // The namespace held must still be one that differs from ours
            // (the target may have moved since its credentials were read).
            let ours = rustix::fs::stat(format!("/proc/self/ns/{k}"))?;
            let held = rustix::fs::fstat(&fd)?;
            if (ours.st_dev, ours.st_ino) == (held.st_dev, held.st_ino) {
                bail!(
                    "PID {pid} changed its {k} namespace while dynprof was reading it; try again"
                );
            }
            if k == NsKind::User {
                user_ns = Some(fd);
            } else {
                ns.push((fd, clone_flag(k)));
            }
        }
        let root = open_path(&format!("/proc/{p}/root"), OFlags::PATH | OFlags::DIRECTORY)?;
        let cwd = open_path(&format!("/proc/{p}/cwd"), OFlags::PATH | OFlags::DIRECTORY)?;
        let last_cap: u32 = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
            .context("reading /proc/sys/kernel/cap_last_cap")?
            .trim()
            .parse()
            .context("parsing /proc/sys/kernel/cap_last_cap")?;
        // Entering the target's user namespace gives the child every
        // capability there to set the target's from. Staying in ours, it
        // can set only what dynprof still holds (after attach, the kept set).
        let (caps, withheld) = if foreign_user {
            (c.caps, 0)
        } else {
            let own = std::fs::read_to_string("/proc/thread-self/status")
                .context("reading dynprof's own capabilities")
                .and_then(|t| Creds::parse_status(&t))?;
            c.caps.grantable_by(&own.caps)
        };
        let bounding_drop = bits(!caps.bounding, last_cap).collect();
        let ambient = bits(caps.ambient, last_cap).collect();
        let fork = tc.foreign_ns.contains(&NsKind::Pid) || tc.foreign_ns.contains(&NsKind::Time);
        // SAFETY: pidfd_send_signal with signal 0 only checks the process exists.
        let alive = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                pidfd.as_raw_fd(),
                0,
                std::ptr::null::<libc::siginfo_t>(),
                0u32,
            )
        } == 0;
        if !alive {
            bail!("PID {pid} exited while dynprof was reading its credentials");
        }
        let mut fds = [0 as RawFd; 2];
        // SAFETY: pipe2 writes two fds into the array we pass.
        // Non-blocking: spawn() may fail after our steps (exec), with nothing written.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
            return Err(io::Error::last_os_error()).context("pipe2");
        }
        // SAFETY: both fds were just created and are owned by nobody else.
        let (err_rd, err_wr) = unsafe { (File::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        Ok(Self {
            pid,
            cgroup_procs,
            ns,
            user_ns,
            root,
            cwd,
            host_groups,
            groups,
            uid: uids[1],
            gid: gids[1],
            uids,
            gids,
            bounding_drop,
            effective: caps.effective,
            permitted: caps.permitted,
            inheritable: caps.inheritable,
            ambient,
            withheld,
            no_new_privs: c.no_new_privs,
            fork,
            err_rd,
            err_wr,
            creds: tc,
        })
    }

    /// The target's permitted capabilities the child will run without
    /// (a bit mask; 0 when it gets all of them).
    pub fn withheld_caps(&self) -> u64 {
        self.withheld
    }

    /// The uid the process will have inside the target's user namespace.
    pub fn inner_uid(&self) -> u32 {
        self.uid
    }

    /// The gid the process will have inside the target's user namespace.
    pub fn inner_gid(&self) -> u32 {
        self.gid
    }

    /// Spawns `cmd` as the target. Other `pre_exec` hooks registered on `cmd`
    /// before (setsid, the controlling tty) run first, as root.
    pub fn spawn(self, cmd: &mut Command) -> Result<std::process::Child> {
        let AsTarget { err_rd, err_wr, .. } = &self;
        let mut err_rd = err_rd.try_clone()?;
        let wr = err_wr.as_raw_fd();
        let plan = std::sync::Arc::new(self);
        let p2 = plan.clone();
        // SAFETY: the closure only makes raw syscalls on data prepared in the
        // parent (no allocation, no locks): async-signal-safe after fork.
        unsafe {
            cmd.pre_exec(move || {
                p2.enter().map_err(|(step, err)| {
                    let b = [step as u8];
                    libc::write(wr, b.as_ptr().cast(), 1);
                    err
                })
            });
        }
        let res = cmd.spawn();
        // The closure (and the plan's fds) stay with `cmd`; the caller drops it.
        drop(plan);
        res.map_err(|e| {
            // The child wrote the failed step before exiting (nothing when
            // exec itself failed); the pipe is non-blocking.
            let mut b = [0u8; 1];
            let step = match err_rd.read(&mut b) {
                Ok(1) => Step::ALL.iter().find(|s| **s as u8 == b[0]).copied(),
                _ => None,
            };
            match step {
                Some(s) => anyhow!("{}: {e}", s.describe()),
                None => anyhow!(e),
            }
        })
    }

    /// Runs in the child between fork and exec. Raw syscalls only.
    ///
    /// # Safety
    /// Only call from a `pre_exec` hook (single-threaded child).
    unsafe fn enter(&self) -> Result<(), (Step, io::Error)> {
        let err = |s: Step| (s, io::Error::last_os_error());
        let ok = |rc: libc::c_long, s: Step| if rc < 0 { Err(err(s)) } else { Ok(()) };
        // SAFETY (whole body): raw syscalls on fds and buffers we own.
        unsafe {
            // Every fd still open becomes close-on-exec (fds opened without
            // O_CLOEXEC elsewhere never reach the target's tool).
            libc::syscall(
                libc::SYS_close_range,
                3u32,
                u32::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            );
            for fd in &self.cgroup_procs {
                if libc::write(fd.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                    return Err(err(Step::Cgroup));
                }
            }
            if let Some(g) = &self.host_groups {
                ok(
                    libc::syscall(libc::SYS_setgroups, g.len(), g.as_ptr()),
                    Step::HostGroups,
                )?;
            }
            for (fd, flag) in &self.ns {
                ok(libc::setns(fd.as_raw_fd(), *flag) as _, Step::Setns)?;
            }
            if let Some(fd) = &self.user_ns {
                ok(
                    libc::setns(fd.as_raw_fd(), libc::CLONE_NEWUSER) as _,
                    Step::SetnsUser,
                )?;
            }
            ok(libc::fchdir(self.root.as_raw_fd()) as _, Step::Chroot)?;
            ok(libc::chroot(c".".as_ptr()) as _, Step::Chroot)?;
            ok(libc::fchdir(self.cwd.as_raw_fd()) as _, Step::Chroot)?;
            for &cap in &self.bounding_drop {
                ok(
                    libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) as _,
                    Step::Bounding,
                )?;
            }
            ok(
                libc::prctl(libc::PR_SET_KEEPCAPS, 1 as libc::c_ulong, 0, 0, 0) as _,
                Step::KeepCaps,
            )?;
            if let Some(g) = &self.groups {
                ok(
                    libc::syscall(libc::SYS_setgroups, g.len(), g.as_ptr()),
                    Step::Groups,
                )?;
            }
            // Raw syscalls: glibc's wrappers would broadcast to other threads.
            ok(
                libc::syscall(
                    libc::SYS_setresgid,
                    self.gids[0],
                    self.gids[1],
                    self.gids[2],
                ),
                Step::Gid,
            )?;
            ok(
                libc::syscall(
                    libc::SYS_setresuid,
                    self.uids[0],
                    self.uids[1],
                    self.uids[2],
                ),
                Step::Uid,
            )?;
            let hdr = libc_cap_header();
            let data = [
                CapData {
                    effective: self.effective as u32,
                    permitted: self.permitted as u32,
                    inheritable: self.inheritable as u32,
                },
                CapData {
                    effective: (self.effective >> 32) as u32,
                    permitted: (self.permitted >> 32) as u32,
                    inheritable: (self.inheritable >> 32) as u32,
                },
            ];
            ok(
                libc::syscall(libc::SYS_capset, &hdr as *const CapHeader, data.as_ptr()),
                Step::Capset,
            )?;
            ok(
                libc::prctl(libc::PR_SET_KEEPCAPS, 0 as libc::c_ulong, 0, 0, 0) as _,
                Step::KeepCaps,
            )?;
            for &cap in &self.ambient {
                ok(
                    libc::prctl(
                        libc::PR_CAP_AMBIENT,
                        libc::PR_CAP_AMBIENT_RAISE as libc::c_ulong,
                        cap as libc::c_ulong,
                        0,
                        0,
                    ) as _,
                    Step::Ambient,
                )?;
            }
            if self.no_new_privs {
                ok(
                    libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1 as libc::c_ulong, 0, 0, 0) as _,
                    Step::NoNewPrivs,
                )?;
            }
            // Until exec, this process holds dynprof's memory: keep the
            // target's user from ptracing it or reading /proc/PID/fd.
            libc::prctl(libc::PR_SET_DUMPABLE, 0 as libc::c_ulong, 0, 0, 0);
            if self.fork {
                let child = libc::fork();
                if child < 0 {
                    return Err(err(Step::Fork));
                }
                if child == 0 {
                    // The process that execs: dies with its intermediate.
                    libc::prctl(
                        libc::PR_SET_PDEATHSIG,
                        libc::SIGKILL as libc::c_ulong,
                        0,
                        0,
                        0,
                    );
                    return Ok(());
                }
                intermediate(child);
            }
        }
        Ok(())
    }
}

/// The target's real/effective/saved uids and gids as its own user namespace
/// names them, or why it cannot be reproduced. Pure: decides from `tc` only.
pub fn reproducible_ids(tc: &TargetCreds, opts: ExecOptions) -> Result<([u32; 3], [u32; 3])> {
    let c = &tc.creds;
    let pid = tc.pid;
    match c.seccomp {
        SeccompMode::Disabled => {}
        SeccompMode::Strict => {
            bail!("PID {pid} runs in seccomp strict mode; nothing can be run as it")
        }
        SeccompMode::Filter if opts.allow_unconfined => log::warn!(
            "PID {pid} has a seccomp filter that dynprof cannot copy; running the vendor tool \
                 without it (--msprof-allow-unconfined)"
        ),
        SeccompMode::Filter => bail!(
            "PID {pid} runs under a seccomp filter, which dynprof cannot copy to the vendor \
                 tool; refusing to run it less confined than the job. Pass \
                 --msprof-allow-unconfined to run it anyway (with the job's ids, capabilities \
                 and namespaces, but no seccomp filter)"
        ),
    }
    if let Some(label) = &tc.lsm_label {
        if !opts.allow_unconfined {
            bail!(
                "PID {pid} runs under the LSM label {label:?}, which dynprof does not \
                     reproduce; refusing to run the vendor tool less confined than the job. Pass \
                     --msprof-allow-unconfined to run it anyway (without that label)"
            );
        }
        log::warn!("PID {pid}: running the vendor tool without its LSM label {label:?}");
    }
    if c.uids.fs != c.uids.effective || c.gids.fs != c.gids.effective {
        bail!(
            "PID {pid} has a filesystem uid/gid ({}/{}) other than its effective one \
                 ({}/{}); dynprof cannot reproduce that",
            c.uids.fs,
            c.gids.fs,
            c.uids.effective,
            c.gids.effective
        );
    }
    let inside = |map: &super::creds::IdMap, what: &str, id: u32| {
        map.to_inside(id).ok_or_else(|| {
            anyhow!("PID {pid}'s {what} {id} is not mapped in its user namespace; refusing")
        })
    };
    let uids = [
        inside(&tc.uid_map, "uid", c.uids.real)?,
        inside(&tc.uid_map, "uid", c.uids.effective)?,
        inside(&tc.uid_map, "uid", c.uids.saved)?,
    ];
    let gids = [
        inside(&tc.gid_map, "gid", c.gids.real)?,
        inside(&tc.gid_map, "gid", c.gids.effective)?,
        inside(&tc.gid_map, "gid", c.gids.saved)?,
    ];
    Ok((uids, gids))
}

/// The parent of the process forked into the PID namespace: closes what it
/// holds (the exec-error pipe stays with the child), waits, and ends the way
/// the child ended.
unsafe fn intermediate(child: libc::pid_t) -> ! {
    // SAFETY: raw syscalls; this process never returns to Rust code.
    unsafe {
        libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
        let mut status = 0;
        loop {
            let r = libc::waitpid(child, &mut status, 0);
            if r == child {
                break;
            }
            if r < 0 && *libc::__errno_location() != libc::EINTR {
                libc::_exit(127);
            }
        }
        if libc::WIFSIGNALED(status) {
            let sig = libc::WTERMSIG(status);
            libc::signal(sig, libc::SIG_DFL);
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, sig);
            libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
            libc::kill(libc::getpid(), sig);
            libc::_exit(128 + sig);
        }
        libc::_exit(libc::WEXITSTATUS(status));
    }
}

/// `struct __user_cap_header_struct`.
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

/// `struct __user_cap_data_struct`.
#[repr(C)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

fn libc_cap_header() -> CapHeader {
    CapHeader {
        // _LINUX_CAPABILITY_VERSION_3: two 32-bit words per set.
        version: 0x2008_0522,
        pid: 0,
    }
}

/// `cmd` for a program named as the target names it (an absolute path in its
/// root): the path is resolved after the chroot, in the child.
pub fn command_in_target(program: &str) -> Result<Command> {
    if !program.starts_with('/') {
        bail!("{program:?}: a program run as the target needs an absolute path");
    }
    // Interior NULs would be cut by execve.
    CString::new(program).map_err(|_| anyhow!("{program:?} contains a NUL byte"))?;
    Ok(Command::new(program))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::creds::{CapSets, Creds, IdMap, IdMapRange, IdSet};

    fn ids(v: u32) -> IdSet {
        IdSet {
            real: v,
            effective: v,
            saved: v,
            fs: v,
        }
    }

    fn target(uid: u32, seccomp: SeccompMode, map: IdMap) -> TargetCreds {
        TargetCreds {
            pid: HostPid(42),
            creds: Creds {
                uids: ids(uid),
                gids: ids(uid),
                groups: vec![],
                caps: CapSets {
                    inheritable: 0,
                    permitted: 0,
                    effective: 0,
                    bounding: u64::MAX,
                    ambient: 0,
                },
                no_new_privs: false,
                seccomp,
            },
            foreign_ns: vec![NsKind::User],
            uid_map: map.clone(),
            gid_map: map,
            cgroups: vec![],
            lsm_label: None,
        }
    }

    fn rootless() -> IdMap {
        IdMap(vec![IdMapRange {
            inside: 0,
            outside: 65534,
            count: 1,
        }])
    }

    #[test]
    fn ids_are_translated_into_the_targets_user_namespace() {
        let t = target(65534, SeccompMode::Disabled, rootless());
        let (u, g) = reproducible_ids(&t, ExecOptions::default()).unwrap();
        assert_eq!((u, g), ([0, 0, 0], [0, 0, 0]));
        // An id outside the map is refused, never guessed.
        let mut t = target(65534, SeccompMode::Disabled, rootless());
        t.creds.uids.saved = 0;
        let e = reproducible_ids(&t, ExecOptions::default()).unwrap_err();
        assert!(format!("{e}").contains("uid 0 is not mapped"), "{e}");
        let mut t = target(65534, SeccompMode::Disabled, rootless());
        t.creds.gids.fs = 7;
        let e = reproducible_ids(&t, ExecOptions::default()).unwrap_err();
        assert!(format!("{e}").contains("filesystem uid/gid"), "{e}");
    }

    #[test]
    fn seccomp_and_lsm_are_refused_unless_the_operator_opts_in() {
        let allow = ExecOptions {
            allow_unconfined: true,
        };
        let t = target(65534, SeccompMode::Filter, rootless());
        let e = reproducible_ids(&t, ExecOptions::default()).unwrap_err();
        assert!(format!("{e}").contains("--msprof-allow-unconfined"), "{e}");
        assert!(reproducible_ids(&t, allow).is_ok());
        let t = target(65534, SeccompMode::Strict, rootless());
        assert!(reproducible_ids(&t, allow).is_err(), "strict: never");
        let mut t = target(65534, SeccompMode::Disabled, rootless());
        t.lsm_label = Some("docker-default (enforce)".into());
        let e = reproducible_ids(&t, ExecOptions::default()).unwrap_err();
        assert!(format!("{e}").contains("docker-default"), "{e}");
        assert!(reproducible_ids(&t, allow).is_ok());
    }
}
