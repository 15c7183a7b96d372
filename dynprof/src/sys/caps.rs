//! dynprof's own capabilities: what each part of a session needs, a check
//! at start that names a missing capability, and the drop after attach.
//!
//! The table (measured on kernel 6.18 by running dynprof as uid 65534 with
//! only a given set, and removing capabilities until it failed) is in
//! docs/capabilities.md; [`Need::at_start`] and [`Need::in_session`] are
//! that table as code.
//!
//! Capabilities are per thread, and capset(2) changes only the calling
//! one: the drop runs on every thread dynprof has at that point (a signal
//! makes each thread drop its own, as glibc does for setuid), then checks
//! that none holds more than the kept set. Threads started later inherit
//! the dropped sets.
use anyhow::{Context as _, Result, bail};
use caps::{CapSet, Capability, CapsHashSet};

/// What dynprof does that needs capabilities.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Need {
    /// Load the eBPF object, read the target's maps and ELF files, attach
    /// the step markers, raise USDT semaphores; lower them at detach.
    Attach,
    /// The `api` collector: uprobes on runtime APIs, attached per window.
    Api,
    /// Aux markers, attached around each window (uprobes, like `api`).
    AuxMarkers,
    /// Job mode `--follow`: ranks that appear later are attached in
    /// session, so attach's own capabilities are kept.
    LateRanks,
    /// The `cpu` collector: per-CPU sampling perf events, per window; stack
    /// symbolization through /proc/PID/map_files.
    Cpu,
    /// The `offcpu` collector: the sched_switch tracepoint, per window.
    Offcpu,
    /// The msprof hook: msprof started in the target's namespaces.
    Msprof,
    /// The torch_npu dynamic_profile hook: profiler_config.json written in
    /// the job's directory, through /proc/PID/root.
    TorchNpuDp,
    /// `--chown`: each finished window is handed to another uid.
    Chown,
    /// `--realtime-boundaries`: the event loop raises itself to
    /// SCHED_FIFO while a window boundary is due.
    Realtime,
    /// Added by this module, never asked for: `perf_event_paranoid` is 3
    /// or more (Debian's and Ubuntu's kernel patch), where perf_event_open
    /// needs CAP_SYS_ADMIN whatever else the caller holds.
    PerfParanoid,
    /// Added by this module, never asked for: a kernel before 5.19 with
    /// `kernel.unprivileged_bpf_disabled` set refuses every bpf(2) command
    /// to a caller without CAP_BPF (or CAP_SYS_ADMIN), map reads included.
    /// The session reads its maps to the end (lost events, hits per
    /// marker), so it keeps CAP_BPF there.
    BpfSyscall,
}

use Capability::*;

/// One capability and why a part needs it (for messages and docs).
pub type Req = (Capability, &'static str);

const BPF: Req = (CAP_BPF, "to load eBPF programs and create their maps");
const PERFMON: Req = (
    CAP_PERFMON,
    "to load tracing eBPF programs and open perf events",
);
const UPROBE_PMU: Req = (
    CAP_SYS_ADMIN,
    "to open uprobe perf events (this kernel refuses them with EACCES even with CAP_PERFMON)",
);
const PTRACE: Req = (
    CAP_SYS_PTRACE,
    "to read another user's /proc/PID/maps, root and mem (markers, ELF files, USDT semaphores)",
);
const MAP_FILES: Req = (
    CAP_CHECKPOINT_RESTORE,
    "to open /proc/PID/map_files when symbolizing stacks",
);
const LAZY_PROG: Req = (
    CAP_BPF,
    "to load the collector's eBPF program, verified when its first window opens",
);
const TRACEFS: Req = (
    CAP_DAC_READ_SEARCH,
    "to look up the sched_switch tracepoint in tracefs (mode 0700, owned by root)",
);
const SETNS: Req = (
    CAP_SYS_ADMIN,
    "to enter the target's namespaces (setns) for msprof",
);
const SETNS_MNT: Req = (
    CAP_SYS_CHROOT,
    "to enter the target's mount namespace (setns needs it besides CAP_SYS_ADMIN)",
);
const MSPROF_SETID: [Req; 2] = [
    (CAP_SETUID, "to start msprof as the job's uid (setresuid)"),
    (
        CAP_SETGID,
        "to start msprof with the job's gid and groups (setresgid, setgroups)",
    ),
];
const MSPROF_REST: [Req; 4] = [
    (CAP_SETPCAP, "to give msprof the job's bounding set"),
    (
        CAP_DAC_OVERRIDE,
        "to move msprof into the job's cgroup (cgroup.procs)",
    ),
    (
        CAP_CHOWN,
        "to hand msprof's output directory to the job's uid",
    ),
    (
        CAP_DAC_READ_SEARCH,
        "to read the job's /proc files and root for msprof",
    ),
];
const WINDOW_OWNER: Req = (
    CAP_CHOWN,
    "to hand each finished window to the uid --chown names",
);
const JOB_FILE_OWNER: Req = (
    CAP_CHOWN,
    "to give the rewritten profiler_config.json to the owner of the job's directory",
);
const PERF_PARANOID: Req = (
    CAP_SYS_ADMIN,
    "perf_event_paranoid is 3 or more on this host (a Debian/Ubuntu kernel patch): \
     perf_event_open, for the cpu and offcpu collectors, needs CAP_SYS_ADMIN",
);
const BPF_SYSCALL: Req = (
    CAP_BPF,
    "this kernel (before 5.19, kernel.unprivileged_bpf_disabled set) refuses every bpf(2) \
     command without it: reading the lost-event counters and marker hits",
);
const SYS_NICE: Req = (
    CAP_SYS_NICE,
    "to raise the event loop to SCHED_FIFO while a window boundary is due",
);
const JOB_DIR: Req = (
    CAP_DAC_OVERRIDE,
    "to write profiler_config.json into the job's directory, owned by the job's user",
);

impl Need {
    /// Needed until the markers are attached (load, resolve, attach, and
    /// everything [`Need::in_session`] needs).
    pub fn at_start(self) -> Vec<Req> {
        let mut v = match self {
            Need::Attach => vec![BPF, PERFMON, UPROBE_PMU, PTRACE],
            _ => Vec::new(),
        };
        v.extend(self.in_session());
        v
    }

    /// Still needed after attach: each window arms its collectors again,
    /// and the detach lowers USDT semaphores through /proc/PID/mem.
    pub fn in_session(self) -> Vec<Req> {
        match self {
            Need::Attach => vec![PTRACE],
            Need::LateRanks => vec![BPF, PERFMON, UPROBE_PMU, PTRACE],
            Need::Api | Need::AuxMarkers => vec![PERFMON, UPROBE_PMU, PTRACE],
            Need::Cpu => vec![LAZY_PROG, PERFMON, MAP_FILES, PTRACE],
            Need::Offcpu => vec![LAZY_PROG, PERFMON, TRACEFS, MAP_FILES],
            Need::Msprof => {
                let mut v = vec![SETNS, SETNS_MNT, PTRACE];
                v.extend(MSPROF_SETID);
                v.extend(MSPROF_REST);
                v
            }
            Need::TorchNpuDp => vec![PTRACE, JOB_DIR, JOB_FILE_OWNER],
            Need::Chown => vec![WINDOW_OWNER],
            Need::Realtime => vec![SYS_NICE],
            Need::PerfParanoid => vec![PERF_PARANOID],
            Need::BpfSyscall => vec![BPF_SYSCALL],
        }
    }
}

/// A set in the kernel's order (CAP_CHOWN = 0 first), for stable messages.
pub fn sorted(s: &CapsHashSet) -> Vec<Capability> {
    let mut v: Vec<Capability> = s.iter().copied().collect();
    v.sort_by_key(|c| *c as u8);
    v
}

/// `/proc/sys/kernel/perf_event_paranoid` (2, the upstream default, when
/// it cannot be read).
fn perf_event_paranoid() -> i32 {
    std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(2)
}

/// What the host adds to a session's needs.
#[derive(Clone, Copy, Debug)]
pub struct Host {
    /// `kernel.perf_event_paranoid`.
    pub paranoid: i32,
    /// Every bpf(2) command needs CAP_BPF (see [`Need::BpfSyscall`]).
    pub bpf_cmds_gated: bool,
}

impl Host {
    fn read() -> Host {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        // Unreadable: assume set, the distributions' default.
        let disabled = std::fs::read_to_string("/proc/sys/kernel/unprivileged_bpf_disabled")
            .map(|s| s.trim() != "0")
            .unwrap_or(true);
        Host {
            paranoid: perf_event_paranoid(),
            bpf_cmds_gated: bpf_cmds_gated(release.trim(), disabled),
        }
    }
}

/// Before 5.19 ("bpf: refine kernel.unprivileged_bpf_disabled behaviour"),
/// `__sys_bpf` returned EPERM for every command while the sysctl was set
/// and the caller lacked CAP_BPF and CAP_SYS_ADMIN. An unparsable release
/// counts as old: keeping CAP_BPF is the side that still works.
pub fn bpf_cmds_gated(release: &str, unprivileged_bpf_disabled: bool) -> bool {
    unprivileged_bpf_disabled
        && crate::compat::parse_version(release).is_none_or(|(a, b, _)| (a, b) < (5, 19))
}

/// `needs` plus what this host adds: with `perf_event_paranoid` at 3 or
/// more, the perf-event collectors need [`Need::PerfParanoid`]; where every
/// bpf(2) command is gated, the session needs [`Need::BpfSyscall`] unless
/// it keeps CAP_BPF or CAP_SYS_ADMIN anyway.
pub fn with_host_needs(needs: &[Need], host: Host) -> Vec<Need> {
    let mut v = needs.to_vec();
    if host.paranoid >= 3 && needs.iter().any(|n| matches!(n, Need::Cpu | Need::Offcpu)) {
        v.push(Need::PerfParanoid);
    }
    if host.bpf_cmds_gated {
        let kept = set_of(&v, true);
        if !kept.contains(&CAP_BPF) && !kept.contains(&CAP_SYS_ADMIN) {
            v.push(Need::BpfSyscall);
        }
    }
    v
}

/// The capabilities of `needs` (at start or in session), each once.
pub fn set_of(needs: &[Need], in_session: bool) -> CapsHashSet {
    needs
        .iter()
        .flat_map(|n| {
            if in_session {
                n.in_session()
            } else {
                n.at_start()
            }
        })
        .map(|(c, _)| c)
        .collect()
}

/// The kernel accepts CAP_SYS_ADMIN where it asks for CAP_BPF, CAP_PERFMON
/// (bpf_capable, perfmon_capable) or CAP_CHECKPOINT_RESTORE
/// (checkpoint_restore_ns_capable), as on kernels before 5.8 and 5.9,
/// which have none of these three.
fn stand_in(cap: Capability) -> Option<Capability> {
    matches!(cap, CAP_BPF | CAP_PERFMON | CAP_CHECKPOINT_RESTORE).then_some(CAP_SYS_ADMIN)
}

fn satisfied(cap: Capability, eff: &CapsHashSet) -> bool {
    eff.contains(&cap) || stand_in(cap).is_some_and(|s| eff.contains(&s))
}

/// The capabilities of `needs` missing from `eff`, with who needs each and why.
pub fn missing(needs: &[Need], eff: &CapsHashSet) -> Vec<(Capability, Vec<(Need, &'static str)>)> {
    let mut out: Vec<(Capability, Vec<(Need, &'static str)>)> = Vec::new();
    for &n in needs {
        for (cap, why) in n.at_start() {
            if satisfied(cap, eff) {
                continue;
            }
            match out.iter_mut().find(|(c, _)| *c == cap) {
                Some((_, v)) => {
                    if !v.iter().any(|(m, w)| *m == n && *w == why) {
                        v.push((n, why))
                    }
                }
                None => out.push((cap, vec![(n, why)])),
            }
        }
    }
    out.sort_by_key(|(c, _)| *c as u8);
    out
}

fn name(n: Need) -> &'static str {
    match n {
        Need::Attach => "attach",
        Need::Api => "collector api",
        Need::AuxMarkers => "aux markers around windows",
        Need::LateRanks => "job --follow: ranks attached later",
        Need::Cpu => "collector cpu",
        Need::Offcpu => "collector offcpu",
        Need::Msprof => "collector msprof",
        Need::TorchNpuDp => "collector torch-npu-dp",
        Need::Chown => "--chown",
        Need::Realtime => "--realtime-boundaries",
        Need::PerfParanoid => "perf_event_paranoid",
        Need::BpfSyscall => "unprivileged_bpf_disabled",
    }
}

/// Fails, naming each missing capability and what needs it, unless the
/// effective set holds everything `needs` asks for.
pub fn check(needs: &[Need]) -> Result<()> {
    let needs = &with_host_needs(needs, Host::read());
    let eff = caps::read(None, CapSet::Effective).context("reading dynprof's capabilities")?;
    let miss = missing(needs, &eff);
    if miss.is_empty() {
        return Ok(());
    }
    let mut msg = format!(
        "missing capabilit{}: {}",
        if miss.len() == 1 { "y" } else { "ies" },
        miss.iter()
            .map(|(c, _)| c.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    for (c, who) in &miss {
        for (n, why) in who {
            msg.push_str(&format!("\n  {c} ({}): {why}", name(*n)));
        }
    }
    msg.push_str(
        "\nhint: run with sudo, or grant the set docs/capabilities.md lists \
         (e.g. setpriv --ambient-caps); --collect chooses fewer collectors",
    );
    bail!(msg)
}

fn set_to_string(s: &CapsHashSet) -> String {
    let v: Vec<String> = sorted(s).iter().map(|c| c.to_string()).collect();
    if v.is_empty() {
        "none".into()
    } else {
        v.join(",")
    }
}

/// After load and attach: keeps only what the rest of the session needs
/// and clears everything else from the effective, permitted, inheritable
/// and ambient sets, and from the bounding set when dynprof may lower it
/// (CAP_SETPCAP; a non-root dynprof started with only the documented set
/// has a bounding set no larger than that already). Fails closed: any
/// error, or a set that reads back larger than asked, is an error.
pub fn drop_after_attach(needs: &[Need]) -> Result<Vec<Capability>> {
    if needs.iter().any(|n| matches!(n, Need::Cpu | Need::Offcpu)) {
        // Kernel stacks are named later, without CAP_SYSLOG.
        let _ = super::kallsyms::snapshot();
    }
    let needs = &with_host_needs(needs, Host::read());
    let wanted = set_of(needs, true);
    let permitted = caps::read(None, CapSet::Permitted).context("reading CapPrm")?;
    let effective = caps::read(None, CapSet::Effective).context("reading CapEff")?;
    // What we do not hold cannot be kept; where the kernel accepts
    // CAP_SYS_ADMIN instead (an older kernel), that is kept.
    let keep: CapsHashSet = wanted
        .iter()
        .filter_map(|c| {
            if permitted.contains(c) {
                Some(*c)
            } else {
                stand_in(*c).filter(|s| permitted.contains(s))
            }
        })
        .collect();
    let fail = |what: &str, e: caps::errors::CapsError| -> anyhow::Error {
        anyhow::anyhow!(
            "dropping capabilities after attach failed ({what}: {e}); \
             stopping rather than running on with more privilege than needed"
        )
    };
    // The bounding set first: lowering it needs CAP_SETPCAP, which the
    // effective set loses next.
    let may_lower_bounding = effective.contains(&CAP_SETPCAP);
    if may_lower_bounding {
        let bounding = caps::read(None, CapSet::Bounding).map_err(|e| fail("CapBnd", e))?;
        for c in bounding.difference(&keep) {
            caps::drop(None, CapSet::Bounding, *c).map_err(|e| fail("CapBnd", e))?;
        }
    }
    caps::clear(None, CapSet::Ambient).map_err(|e| fail("CapAmb", e))?;
    caps::set(None, CapSet::Inheritable, &CapsHashSet::new()).map_err(|e| fail("CapInh", e))?;
    caps::set(None, CapSet::Effective, &keep).map_err(|e| fail("CapEff", e))?;
    caps::set(None, CapSet::Permitted, &keep).map_err(|e| fail("CapPrm", e))?;

    // Read back: the kernel is the judge of what was dropped.
    for (set, name, allowed) in [
        (CapSet::Effective, "CapEff", &keep),
        (CapSet::Permitted, "CapPrm", &keep),
        (CapSet::Inheritable, "CapInh", &CapsHashSet::new()),
        (CapSet::Ambient, "CapAmb", &CapsHashSet::new()),
    ] {
        let now = caps::read(None, set).map_err(|e| fail(name, e))?;
        if !now.is_subset(allowed) {
            bail!(
                "dropping capabilities after attach failed: {name} is {} (wanted at most {}); stopping",
                set_to_string(&now),
                set_to_string(allowed)
            );
        }
    }
    if may_lower_bounding {
        let now = caps::read(None, CapSet::Bounding).map_err(|e| fail("CapBnd", e))?;
        if !now.is_subset(&keep) {
            bail!(
                "dropping capabilities after attach failed: CapBnd is {}; stopping",
                set_to_string(&now)
            );
        }
    }
    let keep_mask = sorted(&keep)
        .iter()
        .fold(0u64, |m, c| m | 1u64 << (*c as u8));
    broadcast_drop(keep_mask, may_lower_bounding);
    check_other_threads(&keep)?;
    Ok(sorted(&keep))
}

// ------------------------------------------------------- other threads

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};

static KEEP_MASK: AtomicU64 = AtomicU64::new(0);
static LOWER_BOUNDING: AtomicBool = AtomicBool::new(false);
static THREADS_DONE: AtomicUsize = AtomicUsize::new(0);

/// capset(2)'s header and data (`_LINUX_CAPABILITY_VERSION_3`: two words).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}
#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}
const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// The drop of the calling thread, with raw syscalls only: it runs in a
/// signal handler (prctl and capset are async-signal-safe).
fn drop_this_thread(keep: u64, lower_bounding: bool) {
    // SAFETY: prctl and capset with valid arguments and pointers to local
    // memory; no allocation, no lock.
    unsafe {
        if lower_bounding {
            for c in 0..64u64 {
                if keep & (1 << c) == 0 {
                    // EINVAL past the kernel's last capability: nothing to drop.
                    libc::prctl(libc::PR_CAPBSET_DROP, c, 0, 0, 0);
                }
            }
        }
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        );
        let hdr = CapHeader {
            version: LINUX_CAPABILITY_VERSION_3,
            pid: 0,
        };
        let word = |w: u32| CapData {
            effective: w,
            permitted: w,
            inheritable: 0,
        };
        let data = [word(keep as u32), word((keep >> 32) as u32)];
        libc::syscall(libc::SYS_capset, &hdr as *const CapHeader, data.as_ptr());
    }
}

extern "C" fn on_drop_signal(_: libc::c_int) {
    drop_this_thread(KEEP_MASK.load(SeqCst), LOWER_BOUNDING.load(SeqCst));
    THREADS_DONE.fetch_add(1, SeqCst);
}

/// The signal each other thread drops its capabilities on: one of the
/// real-time signals glibc leaves to programs, far from those it uses.
fn drop_signal() -> libc::c_int {
    libc::SIGRTMAX() - 3
}

/// Makes every other thread of dynprof run [`drop_this_thread`], and waits
/// (bounded) until each has, or has exited. [`check_other_threads`] then
/// reads their sets back: that is the verdict.
fn broadcast_drop(keep: u64, lower_bounding: bool) {
    let me = rustix::thread::gettid().as_raw_nonzero().get();
    let others: Vec<i32> = std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .filter(|t| *t != me)
                .collect()
        })
        .unwrap_or_default();
    if others.is_empty() {
        return;
    }
    KEEP_MASK.store(keep, SeqCst);
    LOWER_BOUNDING.store(lower_bounding, SeqCst);
    THREADS_DONE.store(0, SeqCst);
    // SAFETY: installs a handler that only makes async-signal-safe
    // syscalls and touches atomics; SA_RESTART so that interrupted reads and
    // sleeps of those threads resume. It stays installed: a late delivery
    // must not fall back to the default action (terminate).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_drop_signal as *const () as usize;
        sa.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(drop_signal(), &sa, std::ptr::null_mut());
    }
    let pid = std::process::id() as i32;
    let mut sent = 0;
    for tid in &others {
        // SAFETY: tgkill to a thread of our own process.
        if unsafe { libc::syscall(libc::SYS_tgkill, pid, *tid, drop_signal()) } == 0 {
            sent += 1;
        }
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while THREADS_DONE.load(SeqCst) < sent && std::time::Instant::now() < deadline {
        let alive = others
            .iter()
            .filter(|t| std::path::Path::new(&format!("/proc/self/task/{t}")).exists())
            .count();
        if THREADS_DONE.load(SeqCst) >= alive {
            break;
        }
        std::thread::yield_now();
    }
}

/// capset(2) changes one thread: any other thread of dynprof must not hold
/// more than `keep` (dynprof is single-threaded at this point; threads
/// started later inherit the dropped sets).
fn check_other_threads(keep: &CapsHashSet) -> Result<()> {
    let me = rustix::thread::gettid().as_raw_nonzero().get();
    let tasks = std::fs::read_dir("/proc/self/task").context("listing /proc/self/task")?;
    for t in tasks {
        let Ok(t) = t else { continue };
        let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if tid == me {
            continue;
        }
        for set in [CapSet::Effective, CapSet::Permitted] {
            // A thread that has exited meanwhile holds nothing.
            if let Ok(s) = caps::read(Some(tid), set)
                && !s.is_subset(keep)
            {
                bail!(
                    "dropping capabilities after attach failed: thread {tid} still holds {}; stopping",
                    set_to_string(&s)
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(c: &[Capability]) -> CapsHashSet {
        c.iter().copied().collect()
    }

    #[test]
    fn missing_names_each_capability_once_with_its_reasons() {
        let eff = set(&[CAP_BPF, CAP_PERFMON]);
        let m = missing(&[Need::Attach, Need::Offcpu], &eff);
        let caps: Vec<Capability> = m.iter().map(|(c, _)| *c).collect();
        assert_eq!(
            caps,
            vec![
                CAP_DAC_READ_SEARCH,
                CAP_SYS_PTRACE,
                CAP_SYS_ADMIN,
                CAP_CHECKPOINT_RESTORE
            ]
        );
        let old_kernel_root = set(&[CAP_SYS_ADMIN, CAP_SYS_PTRACE]);
        assert!(missing(&[Need::Cpu], &old_kernel_root).is_empty());
        assert!(missing(&[Need::Attach], &caps::all()).is_empty());
    }

    #[test]
    fn sys_admin_stands_in_for_bpf_and_perfmon() {
        let eff = set(&[CAP_SYS_ADMIN, CAP_SYS_PTRACE]);
        assert!(missing(&[Need::Attach], &eff).is_empty());
    }

    #[test]
    fn the_session_keeps_less_than_the_start() {
        let all = [Need::Attach, Need::Api, Need::Cpu, Need::Offcpu];
        let start = set_of(&all, false);
        let session = set_of(&all, true);
        assert!(session.is_subset(&start));
        assert!(!set_of(&[Need::Attach, Need::Api], true).contains(&CAP_BPF));
        assert_eq!(sorted(&set_of(&[Need::Attach], true)), vec![CAP_SYS_PTRACE]);
    }

    #[test]
    fn a_paranoid_3_kernel_keeps_sys_admin_for_the_perf_event_collectors() {
        let host = |paranoid| Host {
            paranoid,
            bpf_cmds_gated: false,
        };
        let plain = with_host_needs(&[Need::Attach, Need::Cpu], host(2));
        assert!(!set_of(&plain, true).contains(&CAP_SYS_ADMIN));
        let debian = with_host_needs(&[Need::Attach, Need::Cpu], host(3));
        assert!(set_of(&debian, true).contains(&CAP_SYS_ADMIN));
        // Without a perf-event collector nothing is added.
        assert_eq!(
            with_host_needs(&[Need::Attach, Need::Api], host(3)).len(),
            2
        );
    }

    #[test]
    fn a_kernel_that_gates_every_bpf_command_keeps_cap_bpf_for_the_map_reads() {
        // Debian 11 and openEuler 22.03 (5.10) with the sysctl set: gated.
        assert!(bpf_cmds_gated("5.10.0-30-amd64", true));
        assert!(bpf_cmds_gated("5.10.0-60.18.0.50.oe2203.aarch64", true));
        assert!(bpf_cmds_gated("garbage", true));
        assert!(!bpf_cmds_gated("5.10.0-30-amd64", false));
        assert!(!bpf_cmds_gated("5.19.0", true));
        assert!(!bpf_cmds_gated("6.1.0-50-amd64", true));
        let gated = Host {
            paranoid: 2,
            bpf_cmds_gated: true,
        };
        // Following steps only keeps CAP_SYS_PTRACE; there it keeps CAP_BPF.
        let steps = with_host_needs(&[Need::Attach], gated);
        assert_eq!(sorted(&set_of(&steps, true)), vec![CAP_SYS_PTRACE, CAP_BPF]);
        // A session that keeps CAP_SYS_ADMIN (api) needs nothing more.
        let api = with_host_needs(&[Need::Attach, Need::Api], gated);
        assert!(!api.contains(&Need::BpfSyscall));
    }
}
