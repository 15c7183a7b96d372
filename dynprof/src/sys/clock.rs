//! Clocks: local wall-clock time for names and logs (libc `localtime_r`:
//! the time zone as the host's C library resolves it), and CLOCK_MONOTONIC,
//! the clock of the kernel's boundary timestamps.

/// Local wall-clock time as `YYYYmmddHHMMSSmmm`.
pub fn local_timestamp() -> String {
    let (tm, ms) = local_tm();
    format!(
        "{:04}{:02}{:02}{:02}{:02}{:02}{:03}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec,
        ms
    )
}

/// Local wall-clock time as `YYYY-mm-dd HH:MM:SS.mmm`.
pub fn local_timestamp_human() -> String {
    let (tm, ms) = local_tm();
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}.{:03}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec,
        ms
    )
}

fn local_tm() -> (libc::tm, u32) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = now.as_secs() as libc::time_t;
    // SAFETY: localtime_r writes into the tm we pass; tzset reads the environment.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    unsafe {
        libc::localtime_r(&secs, &mut tm);
    }
    (tm, now.subsec_millis())
}

/// CLOCK_MONOTONIC in ns (the clock of the kernel's boundary timestamps).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
