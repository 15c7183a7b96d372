//! Local wall-clock time for names and logs (libc `localtime_r`: the
//! time zone as the host's C library resolves it).

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
