//! Value parsers shared by every subcommand's flags.
//!
//! Each number is checked (finite, in range) while clap parses it, so a bad
//! value is a usage error (exit 2) that names the flag and its range, never a
//! panic later (`Duration::from_secs_f64(inf)`, `u32` overflow in `kb * 1024`,
//! `Instant + 1e300 s`).
use std::{fmt, ops::RangeInclusive, str::FromStr, time::Duration};

/// The longest time any flag accepts: 30 days. Longer ones are typos
/// (`1e300`), and every deadline computed from them (`Instant + d`) must
/// stay far from overflow.
pub const SECS_MAX: u64 = 30 * 24 * 3600;

/// The largest step number or step count a flag accepts: no job runs 10^12
/// steps, and sums of these (start + warmup + active) stay far from overflow.
pub const STEPS_MAX: u64 = 1_000_000_000_000;

/// The largest PID a flag accepts: the kernel's PID_MAX_LIMIT (2^22).
pub const PID_MAX: u32 = 1 << 22;

/// Whether a duration flag accepts 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Zero {
    /// 0 is meaningful (no wait, no timeout).
    Allowed,
    /// 0 would end at once: the flag needs a positive number.
    Refused,
}

/// The seconds a duration flag accepts, for messages.
#[derive(Clone, Copy, Debug)]
pub struct SecsRange(pub Zero);

impl fmt::Display for SecsRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Zero::Allowed => write!(f, "0 ..= {SECS_MAX}"),
            Zero::Refused => write!(f, "more than 0 and at most {SECS_MAX}"),
        }
    }
}

/// Checks seconds already held as `f64` (flags of structs that code builds
/// too) and turns them into a `Duration` without any way to panic.
pub fn check_secs(v: f64, zero: Zero) -> Result<Duration, String> {
    let low_ok = match zero {
        Zero::Allowed => v >= 0.0,
        Zero::Refused => v > 0.0,
    };
    // NaN fails every comparison, so `low_ok` is false for it too.
    if !v.is_finite() || !low_ok || v > SECS_MAX as f64 {
        return Err(format!(
            "{v:?} is not a number of seconds in {} (30 days)",
            SecsRange(zero)
        ));
    }
    Duration::try_from_secs_f64(v).map_err(|e| format!("{v} seconds: {e}"))
}

fn parse_f64(s: &str, zero: Zero) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|_| {
        format!(
            "`{s}` is not a number of seconds (expected {})",
            SecsRange(zero)
        )
    })?;
    check_secs(v, zero)?;
    Ok(v)
}

/// The one duration parser: SECS (decimal, e.g. `0.25`) as a `Duration`.
pub fn secs(
    zero: Zero,
) -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync + 'static {
    move |s| parse_f64(s, zero).and_then(|v| check_secs(v, zero))
}

/// [`secs`] for flags kept as `f64` seconds (structs that code builds too,
/// which convert with [`check_secs`]).
pub fn secs_f64(
    zero: Zero,
) -> impl Fn(&str) -> Result<f64, String> + Clone + Send + Sync + 'static {
    move |s| parse_f64(s, zero)
}

/// The one integer parser: a whole number in `lo..=hi`, with the range in
/// every error (clap's own says only "invalid digit" for `1e300`).
pub fn int<T>(lo: T, hi: T) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static
where
    T: FromStr + PartialOrd + fmt::Display + Copy + Send + Sync + 'static,
{
    move |s| match s.trim().parse::<T>() {
        Ok(v) if v >= lo && v <= hi => Ok(v),
        _ => Err(format!("`{s}` is not a whole number in {lo}..={hi}")),
    }
}

/// `--ring-buffer-kb`: the eBPF ring's size in KiB, a power of two (the
/// kernel's rule for ring buffers) from one page to 1 GiB.
pub const RING_KB: RangeInclusive<u32> = 4..=1024 * 1024;

pub fn ring_kb(s: &str) -> Result<u32, String> {
    let kb: u32 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a size in KiB"))?;
    if !RING_KB.contains(&kb) || !kb.is_power_of_two() {
        return Err(format!(
            "{kb} KiB is not a power of two in {}..={} (4 KiB to 1 GiB)",
            RING_KB.start(),
            RING_KB.end()
        ));
    }
    Ok(kb)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secs_refuses_what_would_panic() {
        let p = secs(Zero::Refused);
        for bad in [
            "inf", "-inf", "nan", "NaN", "1e300", "-1", "0", "", "x", "2592001",
        ] {
            assert!(p(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(p("0.25").unwrap(), Duration::from_millis(250));
        assert_eq!(p("2592000").unwrap(), Duration::from_secs(SECS_MAX));
        let z = secs(Zero::Allowed);
        assert_eq!(z("0").unwrap(), Duration::ZERO);
        assert!(z("-0.5").is_err());
        let e = z("1e300").unwrap_err();
        assert!(e.contains("0 ..= 2592000"), "{e}");
        assert_eq!(secs_f64(Zero::Allowed)("1.5").unwrap(), 1.5);
        assert!(check_secs(f64::NAN, Zero::Allowed).is_err());
    }

    #[test]
    fn ring_kb_is_a_bounded_power_of_two() {
        for bad in ["0", "2", "6", "4294967295", "2097152", "-4", "inf"] {
            assert!(ring_kb(bad).is_err(), "{bad:?} accepted");
        }
        let p = int(1u64, 10);
        assert_eq!(p("10").unwrap(), 10);
        for bad in [
            "0",
            "11",
            "-1",
            "1e300",
            "inf",
            "nan",
            "18446744073709551616",
        ] {
            let e = p(bad).unwrap_err();
            assert!(e.contains("1..=10"), "{bad:?}: {e}");
        }
        assert_eq!(ring_kb("4").unwrap(), 4);
        assert_eq!(ring_kb("1048576").unwrap(), 1 << 20);
    }
}
