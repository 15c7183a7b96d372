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
#[derive(Default)]
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
    // SAFETY: `want` is a valid SchedAttr of ATTR_SIZE bytes; pid 0 is the
    // calling thread.
    let r = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &want as *const SchedAttr, 0) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
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
    // SAFETY: as in `set_slice`.
    let r = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &want as *const SchedAttr, 0) };
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
}
