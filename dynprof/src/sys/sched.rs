//! The event loop's CPU priority while attached.
//!
//! Windows open and close in the kernel, exactly at the step boundary, but
//! what answers a boundary in user space (msprof's `start`, hook commands,
//! arming the collectors at the lead-in) runs on dynprof's event loop. On a
//! host whose training job keeps every CPU busy, a nice-0 event loop waits
//! behind it for hundreds of milliseconds (docs/performance.md, section 3).
//! So once attached, the event-loop thread alone runs at nice −10: it is
//! asleep in `epoll_wait` nearly all the time, so this costs the job nothing
//! until a boundary needs dynprof. `SCHED_RESET_ON_FORK` keeps the raise out
//! of everything dynprof starts: threads and children (hooks, msprof) are
//! created at nice 0. Not a real-time policy: a stuck loop must not be able
//! to starve the job.

use serde::Serialize;

/// The nice value the event loop runs at unless told otherwise.
pub const DEFAULT_NICE: i32 = -10;
/// Environment variable: the event loop's nice value (−20 … 19), or `off`
/// to leave it as started.
pub const NICE_ENV: &str = "DYNPROF_EVENT_LOOP_NICE";

/// What [`wanted`] decided from the environment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wanted {
    Nice(i32),
    Off,
}

/// `DYNPROF_EVENT_LOOP_NICE`: unset → [`DEFAULT_NICE`]; `off`/`no`/`false`
/// → leave the priority alone; an integer in −20 … 19 → that nice value.
/// Anything else is an error that names the variable.
pub fn wanted(v: Option<&str>) -> Result<Wanted, String> {
    let Some(v) = v.map(str::trim) else {
        return Ok(Wanted::Nice(DEFAULT_NICE));
    };
    match v.to_ascii_lowercase().as_str() {
        "off" | "no" | "false" => return Ok(Wanted::Off),
        _ => {}
    }
    match v.parse::<i32>() {
        Ok(n) if (-20..=19).contains(&n) => Ok(Wanted::Nice(n)),
        _ => Err(format!(
            "{NICE_ENV}={v:?}: expected a nice value from -20 to 19, or `off`"
        )),
    }
}

/// What the event loop runs at, for the `attached` line.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct EventLoopPriority {
    /// The thread's nice value now.
    pub nice: i32,
    /// Why it is not the one asked for, if it is not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_raised: Option<String>,
}

/// Sets the calling thread (the event loop) to `SCHED_OTHER` with
/// `SCHED_RESET_ON_FORK` at the nice value the environment asks for. Needs
/// `CAP_SYS_NICE` to go below the current value, so it runs before the
/// capabilities are dropped. A failure is reported, never fatal.
pub fn raise_event_loop() -> Result<EventLoopPriority, String> {
    let want = wanted(std::env::var(NICE_ENV).ok().as_deref())?;
    let not_raised = match want {
        Wanted::Off => Some(format!("{NICE_ENV}=off")),
        Wanted::Nice(n) => set_this_thread(n).err(),
    };
    Ok(EventLoopPriority {
        nice: this_thread_nice(),
        not_raised,
    })
}

fn set_this_thread(nice: i32) -> Result<(), String> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param.
    let r = unsafe {
        libc::sched_setscheduler(0, libc::SCHED_OTHER | libc::SCHED_RESET_ON_FORK, &param)
    };
    if r != 0 {
        return Err(format!(
            "sched_setscheduler(SCHED_RESET_ON_FORK): {}",
            std::io::Error::last_os_error()
        ));
    }
    // PRIO_PROCESS with a thread id sets that thread alone on Linux.
    // SAFETY: plain syscall on the calling thread's id.
    let r = unsafe {
        libc::setpriority(
            libc::PRIO_PROCESS,
            libc::gettid() as libc::id_t,
            nice as libc::c_int,
        )
    };
    if r != 0 {
        return Err(format!(
            "setpriority({nice}): {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

fn this_thread_nice() -> i32 {
    // getpriority can return -1 as a value: clear errno first.
    // SAFETY: errno is thread-local; plain syscall on the calling thread.
    unsafe {
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_picks_the_nice_value() {
        assert_eq!(wanted(None), Ok(Wanted::Nice(DEFAULT_NICE)));
        assert_eq!(wanted(Some("-5")), Ok(Wanted::Nice(-5)));
        assert_eq!(wanted(Some(" 0 ")), Ok(Wanted::Nice(0)));
        assert_eq!(wanted(Some("19")), Ok(Wanted::Nice(19)));
        for off in ["off", "OFF", "no", "false"] {
            assert_eq!(wanted(Some(off)), Ok(Wanted::Off), "{off}");
        }
        for bad in ["-21", "20", "high", "", "-10.5"] {
            let e = wanted(Some(bad)).unwrap_err();
            assert!(
                e.contains(NICE_ENV) && e.contains("-20 to 19"),
                "{bad}: {e}"
            );
        }
    }
}
