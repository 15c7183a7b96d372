//! The event loop's time slice. A step boundary wakes dynprof's event loop
//! (the ring buffer's forced wakeup); on a host whose CPUs the training job
//! keeps busy, the woken thread then waits for the running task's slice to
//! end (1.4 ms by default on a 2-CPU 6.18 kernel) before it runs. Since
//! Linux 6.12 (EEVDF) a task can ask for a shorter slice with
//! `sched_setattr`'s `sched_runtime`: its virtual deadline comes sooner, so
//! a wakeup preempts the running task, without a higher priority, a larger
//! share of the CPU or any privilege. Before 6.12 the field is ignored for
//! SCHED_OTHER, and reads back as 0. docs/performance.md has the
//! measurement.

use std::io;

/// The slice the event loop asks for, in µs, unless [`SLICE_ENV`] says
/// otherwise: the kernel's minimum (0.1 ms). The event loop's work per
/// wakeup is far shorter (it drains, decides and goes back to sleep).
pub const SHORT_SLICE_US: u64 = 100;
/// A slice in µs for the event loop (100–100,000; default
/// [`SHORT_SLICE_US`]); `0` leaves the kernel's default. It was opt-in
/// until the console's lost typed line, seen only with it, was explained:
/// keys read past a line's Enter went with rustyline's read buffer (now
/// kept, the `buffer-redux` feature), and the slice only changed how
/// often two lines arrived in one read.
pub const SLICE_ENV: &str = "DYNPROF_EVENT_SLICE_US";

const SCHED_OTHER: u32 = 0;
/// `SCHED_ATTR_SIZE_VER0`: the first published layout, which every
/// kernel with the syscall (3.14+) accepts.
const ATTR_SIZE: u32 = 48;

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct SchedAttr {
    size: u32,
    sched_policy: u32,
    sched_flags: u64,
    sched_nice: i32,
    sched_priority: u32,
    sched_runtime: u64,
    sched_deadline: u64,
    sched_period: u64,
}

/// What became of the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slice {
    /// The thread runs with this slice (ns), read back from the kernel.
    Set(u64),
    /// Not asked for ([`SLICE_ENV`] is `0`): the kernel's default slice.
    Off,
    /// The kernel ignores a SCHED_OTHER task's slice (before 6.12).
    Unsupported,
    /// The thread is not SCHED_OTHER (dynprof was started under `chrt`,
    /// say): left as the operator set it.
    OtherPolicy(u32),
}

/// The verdict from what the kernel reports after the request. Pure.
fn verdict(policy: u32, read_back_ns: u64, asked_ns: u64) -> Slice {
    if policy != SCHED_OTHER {
        Slice::OtherPolicy(policy)
    } else if read_back_ns == 0 || read_back_ns != asked_ns {
        // 0: a kernel without per-task slices reports none. Another value:
        // the request did not take (the kernel clamps to 0.1–100 ms, and
        // the asked value is inside that range).
        Slice::Unsupported
    } else {
        Slice::Set(read_back_ns)
    }
}

/// The slice asked for: [`SLICE_ENV`] in µs, clamped to the kernel's
/// 0.1–100 ms; [`SHORT_SLICE_US`] when unset or not a number (reported);
/// 0 (the kernel's default) for `0`.
pub fn configured_slice_us() -> u64 {
    slice_from(std::env::var(SLICE_ENV).ok().as_deref())
}

/// [`configured_slice_us`] from the variable's value. Pure.
fn slice_from(v: Option<&str>) -> u64 {
    match v.map(|v| (v, v.trim().parse::<u64>())) {
        None => SHORT_SLICE_US,
        Some((_, Ok(0))) => 0,
        Some((_, Ok(us))) => us.clamp(SHORT_SLICE_US, 100_000),
        Some((v, Err(_))) => {
            log::warn!(
                "{SLICE_ENV}={v:?} is not a number of microseconds; using {SHORT_SLICE_US} µs \
                 (0 keeps the kernel's default slice)"
            );
            SHORT_SLICE_US
        }
    }
}

fn get_attr() -> io::Result<SchedAttr> {
    let mut a = SchedAttr::default();
    // SAFETY: `a` is a writable SchedAttr of ATTR_SIZE bytes; pid 0 is the
    // calling thread.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sched_getattr,
            0,
            &mut a as *mut SchedAttr,
            ATTR_SIZE,
            0,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(a)
}

/// Asks for a `slice_us` slice for the calling thread (0: leave the
/// default), keeping its policy and nice value.
pub fn set_slice(slice_us: u64) -> io::Result<Slice> {
    if slice_us == 0 {
        return Ok(Slice::Off);
    }
    let now = get_attr()?;
    if now.sched_policy != SCHED_OTHER {
        return Ok(Slice::OtherPolicy(now.sched_policy));
    }
    let asked = slice_us * 1000;
    let want = SchedAttr {
        size: ATTR_SIZE,
        sched_policy: SCHED_OTHER,
        sched_nice: now.sched_nice,
        sched_runtime: asked,
        ..SchedAttr::default()
    };
    set_attr(&want)?;
    let after = get_attr()?;
    Ok(verdict(after.sched_policy, after.sched_runtime, asked))
}

/// For a thread whose work can wait (the window writer): nice +10, and
/// the kernel's default slice (a thread inherits its creator's, and a
/// short slice would let this CPU-heavy thread preempt the job's).
pub fn background() -> io::Result<()> {
    let now = get_attr()?;
    if now.sched_policy != SCHED_OTHER {
        // SAFETY: plain syscall on the calling thread's id.
        let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 10) };
        return if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        };
    }
    let want = SchedAttr {
        size: ATTR_SIZE,
        sched_policy: SCHED_OTHER,
        sched_nice: 10,
        ..SchedAttr::default()
    };
    set_attr(&want)
}

/// `SCHED_FIFO`, the real-time policy the boundary wait is raised to.
const SCHED_FIFO: u32 = 1;
/// Threads and processes the raised thread creates start as SCHED_OTHER
/// (nice 0 at most), not real-time: the writer thread, tokio's blocking
/// pool and the hooks' children never inherit the raise.
const SCHED_FLAG_RESET_ON_FORK: u64 = 0x01;

/// How one thread stands with `--realtime-boundaries`: how many of its
/// sessions want the raise now (job mode runs every rank's session on
/// the one event-loop thread), and what it was before the raise.
#[derive(Default)]
struct RtState {
    wanted: u32,
    /// The attributes to go back to, while raised.
    saved: Option<SchedAttr>,
    /// The raise failed (EPERM: no CAP_SYS_NICE, or a cgroup without a
    /// real-time budget) or the operator chose a policy: not tried again.
    refused: bool,
    /// Raises so far, for the session summary.
    raises: u64,
}

thread_local! {
    static RT: std::cell::RefCell<RtState> = std::cell::RefCell::new(RtState::default());
}

/// One session's share in its thread's real-time raise
/// (`--realtime-boundaries`). The thread runs SCHED_FIFO priority 1 while
/// any of its sessions wants it, which the session asks for only while a
/// waking boundary is due and it is not spinning; a wakeup at SCHED_FIFO
/// preempts the job's busy threads at once instead of waiting out a
/// slice. Dropping it gives the share back.
pub struct RealtimeShare {
    enabled: bool,
    wants: bool,
}

impl RealtimeShare {
    /// `enabled`: the flag was given. Off, [`RealtimeShare::want`] does
    /// nothing.
    pub fn new(enabled: bool) -> Self {
        Self {
            enabled,
            wants: false,
        }
    }

    /// Wants the raise (true) or not; the thread is raised or lowered to
    /// match all of its sessions. A refused raise is logged once per
    /// thread and not tried again.
    pub fn want(&mut self, yes: bool) {
        if !self.enabled || yes == self.wants {
            if self.enabled && yes {
                // Lowered meanwhile by `lower_for_work`: raise again.
                RT.with(|r| sync(&mut r.borrow_mut()));
            }
            return;
        }
        self.wants = yes;
        RT.with(|r| {
            let mut r = r.borrow_mut();
            if yes {
                r.wanted += 1;
            } else {
                r.wanted = r.wanted.saturating_sub(1);
            }
            sync(&mut r);
        });
    }

    /// This thread's raises so far (all of its sessions).
    pub fn raises(&self) -> u64 {
        RT.with(|r| r.borrow().raises)
    }
}

impl Drop for RealtimeShare {
    fn drop(&mut self) {
        self.want(false);
    }
}

/// Back to the thread's own policy before work that can wait (a closed
/// window's draining): the boundary itself has been handled. The next
/// [`RealtimeShare::want`] raises again if a boundary is still due.
pub fn lower_for_work() {
    RT.with(|r| {
        let mut r = r.borrow_mut();
        if let Some(saved) = r.saved.take() {
            restore(&saved);
        }
    });
}

fn sync(r: &mut RtState) {
    if r.wanted > 0 && r.saved.is_none() && !r.refused {
        match raise() {
            Ok(saved) => {
                r.saved = Some(saved);
                r.raises += 1;
            }
            Err(e) => {
                r.refused = true;
                log::warn!(
                    "--realtime-boundaries: this thread cannot run SCHED_FIFO ({e}); \
                     boundaries are waited for at normal priority"
                );
            }
        }
    } else if r.wanted == 0
        && let Some(saved) = r.saved.take()
    {
        restore(&saved);
    }
}

/// SCHED_FIFO priority 1, reset on fork; returns what to go back to.
/// Left alone (an error) when the thread is not SCHED_OTHER: the operator
/// chose its policy.
fn raise() -> io::Result<SchedAttr> {
    let now = get_attr()?;
    if now.sched_policy != SCHED_OTHER {
        return Err(io::Error::other(format!(
            "it already runs policy {} (chrt), left as it is",
            now.sched_policy
        )));
    }
    let want = SchedAttr {
        size: ATTR_SIZE,
        sched_policy: SCHED_FIFO,
        sched_flags: SCHED_FLAG_RESET_ON_FORK,
        sched_priority: 1,
        ..SchedAttr::default()
    };
    set_attr(&want)?;
    Ok(now)
}

/// Back to the saved SCHED_OTHER attributes (nice, and the short slice
/// on 6.12+). Never needs a privilege; a failure is logged.
fn restore(saved: &SchedAttr) {
    let back = SchedAttr {
        size: ATTR_SIZE,
        ..*saved
    };
    if let Err(e) = set_attr(&back) {
        log::warn!("--realtime-boundaries: back to normal priority failed: {e}");
    }
}

fn set_attr(a: &SchedAttr) -> io::Result<()> {
    // SAFETY: `a` is a valid SchedAttr of ATTR_SIZE bytes; pid 0 is the
    // calling thread.
    let r = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, a as *const SchedAttr, 0) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The calling thread's time spent waiting on a run queue, from
/// `/proc/thread-self/schedstat` (its second field, ns), opened once and
/// read with one pread: the boundary spin asks while it spins.
pub struct RunDelay(std::fs::File);

impl RunDelay {
    /// For the calling thread (the file names the thread that opens it).
    pub fn open() -> io::Result<Self> {
        std::fs::File::open("/proc/thread-self/schedstat").map(Self)
    }

    /// None when the kernel has no schedstat or the read fails.
    pub fn read(&self) -> Option<u64> {
        use std::os::unix::fs::FileExt as _;
        let mut buf = [0u8; 96];
        let n = self.0.read_at(&mut buf, 0).ok()?;
        std::str::from_utf8(&buf[..n])
            .ok()?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The run-queue wait of this thread: read twice, it never goes back.
    #[test]
    fn run_delay_reads_this_threads_schedstat() {
        let r = RunDelay::open().unwrap();
        let a = r.read().expect("schedstat has a run-queue wait");
        std::thread::yield_now();
        let b = r.read().unwrap();
        assert!(b >= a, "{b} < {a}");
        // The same number /proc shows for this thread by its tid.
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let text = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).unwrap();
        let c: u64 = text.split_whitespace().nth(1).unwrap().parse().unwrap();
        assert!(c >= b);
    }

    #[test]
    fn the_short_slice_is_the_default_and_0_turns_it_off() {
        assert_eq!(slice_from(None), SHORT_SLICE_US);
        assert_eq!(slice_from(Some("0")), 0);
        assert_eq!(slice_from(Some(" 0 ")), 0);
        assert_eq!(slice_from(Some("20")), 100);
        assert_eq!(slice_from(Some("500")), 500);
        assert_eq!(slice_from(Some("1000000")), 100_000);
        assert_eq!(slice_from(Some("fast")), SHORT_SLICE_US);
    }

    #[test]
    fn verdicts() {
        assert_eq!(verdict(0, 100_000, 100_000), Slice::Set(100_000));
        // A kernel before 6.12 reads a fair task's runtime back as 0.
        assert_eq!(verdict(0, 0, 100_000), Slice::Unsupported);
        assert_eq!(verdict(0, 1_400_000, 100_000), Slice::Unsupported);
        // SCHED_FIFO (chrt -f) is left alone.
        assert_eq!(verdict(1, 0, 100_000), Slice::OtherPolicy(1));
    }

    /// The kernel's own answer, on a thread of its own (the request is
    /// per thread): the slice is set on 6.12+, and reported unsupported
    /// before. The version comes from the kernel's release string, not
    /// from dynprof.
    #[test]
    fn the_calling_thread_gets_the_slice_on_6_12_and_later() {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut it = release
            .trim()
            .split(|c: char| !c.is_ascii_digit())
            .map(|p| p.parse::<u32>().unwrap_or(0));
        let version = (it.next().unwrap_or(0), it.next().unwrap_or(0));
        let got = std::thread::spawn(|| {
            let r = set_slice(250).unwrap();
            let sched = std::fs::read_to_string("/proc/thread-self/sched").unwrap_or_default();
            (r, sched)
        })
        .join()
        .unwrap();
        if version >= (6, 12) {
            assert_eq!(got.0, Slice::Set(250_000), "{}", got.1);
            // The scheduler's own view of the thread agrees.
            let slice = got
                .1
                .lines()
                .find(|l| l.starts_with("se.slice"))
                .and_then(|l| l.split(':').nth(1))
                .map(|v| v.trim().to_string());
            assert_eq!(slice.as_deref(), Some("250000"), "{}", got.1);
        } else {
            assert_eq!(got.0, Slice::Unsupported);
        }
        assert_eq!(set_slice(0).unwrap(), Slice::Off);
    }

    /// A background thread started by a thread with the short slice runs
    /// at nice 10 with the default slice again.
    #[test]
    fn background_threads_drop_the_short_slice() {
        let (nice, runtime, before) = std::thread::spawn(|| {
            let before = set_slice(100).unwrap();
            std::thread::spawn(|| {
                background().unwrap();
                let a = get_attr().unwrap();
                (a.sched_nice, a.sched_runtime)
            })
            .join()
            .map(|(n, r)| (n, r, before))
            .unwrap()
        })
        .join()
        .unwrap();
        assert_eq!(nice, 10);
        if let Slice::Set(short) = before {
            assert_ne!(runtime, short, "the short slice was inherited and kept");
        }
    }

    /// `--realtime-boundaries` on the event loop's thread: SCHED_FIFO 1
    /// while any of its sessions wants it, its own attributes (the short
    /// slice) again when none does or when a closed window's work begins;
    /// a thread started while raised is not real-time.
    #[test]
    fn the_realtime_share_raises_the_thread_only_while_wanted() {
        use ::caps::{CapSet, Capability};
        std::thread::spawn(|| {
            let _ = set_slice(100).unwrap();
            let had = get_attr().unwrap();
            let may =
                ::caps::has_cap(None, CapSet::Effective, Capability::CAP_SYS_NICE).unwrap_or(false);
            let mut a = RealtimeShare::new(true);
            let mut b = RealtimeShare::new(true);
            a.want(true);
            if !may {
                // Refused without the privilege: logged, left as it was.
                assert_eq!(get_attr().unwrap().sched_policy, SCHED_OTHER);
                assert_eq!(a.raises(), 0);
                return;
            }
            let now = get_attr().unwrap();
            assert_eq!((now.sched_policy, now.sched_priority), (SCHED_FIFO, 1));
            let child = std::thread::spawn(|| get_attr().unwrap().sched_policy)
                .join()
                .unwrap();
            assert_eq!(
                child, SCHED_OTHER,
                "a thread started while raised is real-time"
            );
            // A second session waiting too: one raise for both.
            b.want(true);
            a.want(false);
            assert_eq!(get_attr().unwrap().sched_policy, SCHED_FIFO);
            assert_eq!(a.raises(), 1);
            // A closed window's work: lowered until the next want.
            lower_for_work();
            assert_eq!(get_attr().unwrap().sched_policy, SCHED_OTHER);
            b.want(true);
            assert_eq!(get_attr().unwrap().sched_policy, SCHED_FIFO);
            assert_eq!(b.raises(), 2);
            drop(b);
            let back = get_attr().unwrap();
            assert_eq!(
                (back.sched_policy, back.sched_nice, back.sched_runtime),
                (SCHED_OTHER, had.sched_nice, had.sched_runtime)
            );
            // Without the flag nothing is ever raised.
            let mut off = RealtimeShare::new(false);
            off.want(true);
            assert_eq!(get_attr().unwrap().sched_policy, SCHED_OTHER);
        })
        .join()
        .unwrap();
    }
}
