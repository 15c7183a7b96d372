//! Every numeric flag and every name with a length limit is checked while
//! the command line is parsed: `inf`, `nan`, `-1`, `1e300` and over-long
//! names are usage errors (exit 2) that name the flag, never a panic (101)
//! and never an error found later, after the target was touched.
#[path = "attach_util.rs"]
mod attach_util;
mod common;

use std::process::Command;

use attach_util::run_dynprof;
use common::dynprof_bin;

/// A PID the parser accepts (the kernel's PID_MAX_LIMIT) but no process
/// has: if a bad value slipped through, dynprof would fail on the PID with
/// exit 1, not 2.
const NO_PID: &str = "4194304";

/// (flag, whether -1 is a meaningful value of it).
const ATTACH_NUMERIC: &[(&str, bool)] = &[
    ("--steps", false),
    ("--duration", false),
    ("--ring-buffer-kb", false),
    ("--ring-wake-kb", false),
    ("--start-step", true),
    ("--warmup", false),
    ("--active", false),
    ("--repeat", false),
    ("--gap", false),
    ("--idle-timeout", false),
    ("--wait-for-marker", false),
    ("--cpu-hz", false),
    ("--msprof-max-commands", false),
    ("--msprof-timeout", false),
    ("--dp-step-offset", true),
    ("--dp-lead-steps", false),
    ("--dp-active", false),
    ("--hook-timeout", false),
    ("--hook-wait", false),
];

const BAD: &[&str] = &["inf", "nan", "-1", "1e300", "18446744073709551616"];

fn assert_usage_error(args: &[&str], flag: &str) {
    let (st, out, err) = run_dynprof(Command::new(dynprof_bin()).args(args));
    assert_eq!(
        st.code(),
        Some(2),
        "{args:?}: expected a usage error (exit 2), got {st}\nstderr: {err}"
    );
    assert!(out.is_empty(), "{args:?}: stdout {out}");
    assert!(
        err.contains(&format!("'{flag} ")),
        "{args:?}: the error does not name {flag}:\n{err}"
    );
    assert!(!err.contains("panicked"), "{args:?}: {err}");
}

#[test]
fn flags_attach_numeric_values_out_of_range_are_usage_errors() {
    for &(flag, negative_ok) in ATTACH_NUMERIC {
        for &v in BAD {
            if v == "-1" && negative_ok {
                continue;
            }
            assert_usage_error(&["attach", "--pid", NO_PID, flag, v], flag);
        }
        // `-inf` does not look like a number to clap: given as --flag=-inf.
        assert_usage_error(&["attach", "--pid", NO_PID, &format!("{flag}=-inf")], flag);
    }
    for &v in BAD {
        assert_usage_error(&["attach", "--pid", v], "--pid");
    }
    // Values that are numbers but mean nothing here.
    for (flag, v) in [
        ("--ring-buffer-kb", "4194304"), // 4 GiB: overflowed `kb * 1024`
        ("--ring-buffer-kb", "6"),       // not a power of two
        ("--start-step", "-2"),
        ("--dp-step-offset", "-1000000000001"),
        ("--active", "0"),
        ("--cpu-hz", "0"),
        ("--msprof-max-commands", "101"),
        ("--duration", "0"),
    ] {
        assert_usage_error(&["attach", "--pid", NO_PID, flag, v], flag);
    }
}

#[test]
fn flags_the_error_gives_the_range() {
    let (st, _, err) = run_dynprof(Command::new(dynprof_bin()).args([
        "attach",
        "--pid",
        NO_PID,
        "--hook-wait",
        "1e300",
    ]));
    assert_eq!(st.code(), Some(2), "{err}");
    assert!(err.contains("0 ..= 2592000"), "{err}");
    let (st, _, err) = run_dynprof(
        Command::new(dynprof_bin()).args(["attach", "--pid", NO_PID, "--warmup", "1e300"]),
    );
    assert_eq!(st.code(), Some(2), "{err}");
    assert!(err.contains("0..=1000000000000"), "{err}");
}

#[test]
fn flags_launch_checks_before_starting_the_program() {
    let dir = common::scratch_dir("flags-launch");
    let marker = dir.join("started");
    let cmd = format!("touch {}", marker.display());
    for &(flag, negative_ok) in ATTACH_NUMERIC {
        for &v in BAD {
            if v == "-1" && negative_ok {
                continue;
            }
            assert_usage_error(&["launch", flag, v, "--", "sh", "-c", &cmd], flag);
        }
    }
    assert!(!marker.exists(), "the program was started");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn flags_over_long_names_are_usage_errors() {
    let long = [
        // 64 bytes: one more than the kernel's 64-byte buffer holds with its NUL.
        format!("python:{}", "a".repeat(64)),
        // 32 two-byte characters: 64 bytes too.
        format!("python:{}", "é".repeat(32)),
        format!("python:{}", "x".repeat(100_000)),
        format!("exe:step,name={}", "n".repeat(257)),
        format!("exe:step,arg=0:cstr,eq={}", "e".repeat(64)),
        format!("exe:step,arg=0:cstr,prefix={}", "p".repeat(65)),
        format!("exe:{}", "s".repeat(5000)),
    ];
    for spec in &long {
        assert_usage_error(&["attach", "--pid", NO_PID, "--marker", spec], "--marker");
        assert_usage_error(&["launch", "--marker", spec, "--", "true"], "--marker");
    }
    // The largest that fit still parse: the error is then about the PID.
    let (st, _, err) = run_dynprof(Command::new(dynprof_bin()).args([
        "attach",
        "--pid",
        NO_PID,
        "--marker",
        &format!("python:{}", "é".repeat(31)),
    ]));
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("no process with PID {NO_PID}")),
        "{err}"
    );
}

/// `--follow` follows a REF; with `--pids` (or `--pid`) it is refused
/// before any process is touched, naming what it needs.
#[test]
fn flags_follow_needs_a_job_ref() {
    for who in [["--pids", NO_PID], ["--pid", NO_PID]] {
        let (st, out, err) = run_dynprof(
            Command::new(dynprof_bin())
                .arg("attach")
                .args(who)
                .args(["--follow", "--active", "1"]),
        );
        assert_eq!(st.code(), Some(1), "{who:?}: {st}\n{err}");
        assert!(out.is_empty(), "{out}");
        assert!(err.contains("--follow needs --job REF"), "{who:?}: {err}");
    }
}

/// A --debug-dir that is not a directory is refused before the target is
/// looked at (the PID does not exist).
#[test]
fn flags_debug_dir_must_be_a_directory() {
    let (st, out, err) = run_dynprof(Command::new(dynprof_bin()).arg("attach").args([
        "--pid",
        NO_PID,
        "--debug-dir",
        "/nonexistent/dynprof-debug",
        "--active",
        "1",
    ]));
    assert_eq!(st.code(), Some(1), "{st}\n{err}");
    assert!(out.is_empty(), "{out}");
    assert!(
        err.contains("--debug-dir /nonexistent/dynprof-debug: not a directory"),
        "{err}"
    );
}
