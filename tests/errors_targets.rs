//! Targets with nothing to profile get their own sentence and a prompt exit
//! (1), instead of a silent poll (`--pid 1`, `--pid 2`: maps read as empty,
//! forever), a misleading message (zombies) or a bare errno (a target that
//! exits while dynprof attaches).
#[path = "attach_util.rs"]
mod attach_util;
mod common;

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use attach_util::*;
use common::*;

/// Long enough for a loaded CI machine; the old code never returned at all.
const T: Duration = Duration::from_secs(60);

fn refused(pid: u32) -> Finished {
    let f = run_attach(pid, &["--marker", "exe:optimizer_step"], T);
    assert_eq!(f.status.code(), Some(1), "{f}");
    assert!(f.events.is_empty(), "{f}");
    let errors: Vec<&str> = f
        .stderr
        .lines()
        .filter(|l| l.starts_with("dynprof: error:"))
        .collect();
    assert_eq!(errors.len(), 1, "one error line: {f}");
    f
}

#[test]
fn targets_kernel_threads_are_refused() {
    require_privileges!();
    // kthreadd is PID 2 on every Linux; any other kernel thread too.
    let f = refused(2);
    assert!(
        f.stderr.contains("PID 2 (kthreadd) is a kernel thread")
            && f.stderr.contains("no user-space memory"),
        "{f}"
    );
    let kworker = all_kernel_threads().into_iter().find(|p| *p != 2);
    let pid = kworker.expect("a kernel thread besides kthreadd");
    let f = refused(pid);
    assert!(f.stderr.contains("is a kernel thread"), "{f}");
}

/// PIDs whose /proc/PID/stat has PF_KTHREAD.
fn all_kernel_threads() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|s| {
                    let rest = s.rsplit_once(')')?.1.to_string();
                    rest.split_whitespace().nth(6)?.parse::<u64>().ok()
                })
                .is_some_and(|flags| flags & 0x0020_0000 != 0)
        })
        .collect()
}

#[test]
fn targets_pid_1_is_refused_with_the_reason() {
    require_privileges!();
    // PID 1 of dynprof's own PID namespace is init: either its map cannot be
    // read (here: a non-dumpable init) or it has nothing to profile. Both
    // are said, and dynprof exits instead of polling.
    let f = refused(1);
    assert!(f.stderr.contains("PID 1 ("), "{f}");
    assert!(
        f.stderr.contains("init process of dynprof's PID namespace")
            || f.stderr.contains("no user-space mappings"),
        "{f}"
    );
}

#[test]
fn targets_zombie_gets_its_own_message() {
    require_privileges!();
    // The parent forks a child that exits at once, and never reaps it.
    let mut parent = Proc::spawn(
        Command::new(PYTHON3)
            .args([
                "-c",
                "import os, sys, time\n\
                 pid = os.fork()\n\
                 if pid == 0:\n    os._exit(0)\n\
                 print(pid, flush=True)\n\
                 time.sleep(300)",
            ])
            .stderr(Stdio::null()),
    );
    let zombie: u32 = {
        use std::io::BufRead as _;
        let mut line = String::new();
        std::io::BufReader::new(parent.child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        line.trim().parse().unwrap()
    };
    let deadline = Instant::now() + T;
    while !std::fs::read_to_string(format!("/proc/{zombie}/stat"))
        .unwrap()
        .rsplit_once(')')
        .unwrap()
        .1
        .trim_start()
        .starts_with('Z')
    {
        assert!(
            Instant::now() < deadline,
            "PID {zombie} never became a zombie"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let f = refused(zombie);
    assert!(
        f.stderr
            .contains(&format!("PID {zombie} (python3) is a zombie"))
            && f.stderr
                .contains(&format!("parent (PID {}) to reap it", parent.host_pid())),
        "{f}"
    );
    drop(parent);
}

#[test]
fn targets_exit_during_attach_is_said_not_a_bare_errno() {
    // The sentence dynprof gives when an attach step fails and the target
    // is gone by then (the race itself cannot be timed from a test).
    let mut c = Command::new("sleep").arg("300").spawn().unwrap();
    let t = dynprof::target::Target::open(dynprof::types::HostPid(c.id())).unwrap();
    let alive = dynprof::target::exited_during(&t, "attaching", anyhow::anyhow!("ESRCH"));
    assert_eq!(
        format!("{alive:#}"),
        "ESRCH",
        "a live target keeps the error"
    );
    c.kill().unwrap();
    c.wait().unwrap();
    let gone = dynprof::target::exited_during(
        &t,
        "attaching its step markers",
        anyhow::anyhow!("perf_event_open failed: No such process (os error 3)"),
    );
    let msg = format!("{gone:#}");
    assert!(
        msg.starts_with(&format!(
            "PID {} (sleep) exited while dynprof was attaching its step markers",
            c.id()
        )),
        "{msg}"
    );
    assert!(msg.contains("nothing stays attached"), "{msg}");
}
