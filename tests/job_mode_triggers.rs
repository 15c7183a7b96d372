//! Job mode's other triggers on four native ranks (`hccl_rank` on the
//! libhccl.so stand-in, RANK in their environment): a profiler_config.json
//! save starts one job window on the same job steps on every rank it names
//! (`is_rank` + `rank_list`), the console's `capture` does the same and
//! refuses `start` with the reason, and `--repeat` gives one job directory
//! per window, `gap` job steps apart. Each recorded step is checked against
//! every rank's own log of optimizer_step() calls.
mod common;
#[path = "windows_util.rs"]
mod windows_util;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use common::*;
use windows_util::{T, spawn};

const WORLD: u32 = 4;
const SLOW: u32 = 2;

/// One 4-rank job at a time: the host has two cores.
static ONE_JOB: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_job() -> std::sync::MutexGuard<'static, ()> {
    ONE_JOB.lock().unwrap_or_else(|e| e.into_inner())
}

struct Ranks {
    procs: Vec<Proc>,
    shm: String,
    dir: PathBuf,
}

impl Drop for Ranks {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(format!("/dev/shm{}", self.shm));
    }
}

impl Ranks {
    /// Four ranks in lockstep (HcclAllReduce is a barrier); rank 2 computes
    /// 150 ms per step, the others 20 ms. A long step keeps the ranks'
    /// start spread (tens of ms when this 2-core host is loaded: a rank
    /// woken from the barrier waits for a core) well within half a step,
    /// the bound of the verification.
    fn start(dir: &Path, tag: &str) -> Ranks {
        let bin = fixtures().dir.join("hccl/hccl_rank");
        let shm = format!("/dynprof-{tag}-{}", std::process::id());
        let mut procs: Vec<Proc> = (0..WORLD)
            .map(|r| {
                let mut cmd = Command::new(&bin);
                cmd.args(["--rank", &r.to_string(), "--world", &WORLD.to_string()])
                    .args(["--shm", &shm])
                    .args(["--cpu-us", if r == SLOW { "150000" } else { "20000" }])
                    .arg("--log")
                    .arg(dir.join(format!("rank{r}.log")))
                    .env("RANK", r.to_string())
                    .env("WORLD_SIZE", WORLD.to_string());
                Proc::spawn(&mut cmd)
            })
            .collect();
        for p in &mut procs {
            p.pid = wait_ready(&mut p.child).expect("rank ready");
        }
        Ranks {
            procs,
            shm,
            dir: dir.to_path_buf(),
        }
    }

    fn pids(&self) -> String {
        self.procs
            .iter()
            .map(|p| p.pid.to_string())
            .collect::<Vec<_>>()
            .join(",")
    }
}

#[derive(Debug)]
struct Row {
    rank: u32,
    step: u64,
    start: u64,
    end: u64,
}

fn rows(job: &Path) -> Vec<Row> {
    let text = std::fs::read_to_string(job.join("job_steps.csv"))
        .unwrap_or_else(|e| panic!("{}: {e}", job.display()));
    text.lines()
        .skip(1)
        .map(|l| {
            let f: Vec<u64> = l.split(',').map(|x| x.parse().unwrap()).collect();
            Row {
                rank: f[0] as u32,
                step: f[1],
                start: f[2],
                end: f[3],
            }
        })
        .collect()
}

/// The job directories under `out`, oldest first (they are numbered).
fn job_dirs(out: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(out)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("PROF_JOB_"))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort_by_key(|p| {
        p.file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .rsplit('_')
            .next()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    });
    v
}

fn wait_log(path: &Path, ts: u64) -> Vec<LogLine> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let l = log_lines_of(path, "step");
        if l.last().is_some_and(|x| x.after >= ts) {
            return l;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{}: no step after {ts}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The job window records `active` job steps on exactly `ranks`, the same
/// job steps on each, and each job step is the same optimizer_step()
/// iteration on every rank, by the ranks' own logs. Returns the job steps.
fn check_window(job: &Path, ranks: &Ranks, on: &[u32], active: u64) -> Vec<u64> {
    let rows = rows(job);
    let mut by_rank: BTreeMap<u32, Vec<&Row>> = BTreeMap::new();
    for r in &rows {
        by_rank.entry(r.rank).or_default().push(r);
    }
    assert_eq!(
        by_rank.keys().copied().collect::<Vec<_>>(),
        on,
        "{}: {rows:?}",
        job.display()
    );
    // Only the covered ranks have a directory.
    for r in 0..WORLD {
        assert_eq!(
            job.join(format!("rank{r}")).exists(),
            on.contains(&r),
            "{}: rank{r}",
            job.display()
        );
    }
    let steps: Vec<u64> = by_rank[&on[0]].iter().map(|r| r.step).collect();
    assert_eq!(steps.len() as u64, active, "{rows:?}");
    assert_eq!(steps, (steps[0]..steps[0] + active).collect::<Vec<_>>());
    let mut iterations: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for r in on {
        let mine: Vec<u64> = by_rank[r].iter().map(|x| x.step).collect();
        assert_eq!(mine, steps, "rank {r} recorded other job steps");
        let last_end = by_rank[r].iter().map(|x| x.end).max().unwrap();
        let log = wait_log(&ranks.dir.join(format!("rank{r}.log")), last_end);
        for row in &by_rank[r] {
            let what = format!("rank {r} job step {}", row.step);
            let it = iteration_at(&log, row.start, &what);
            assert_eq!(iteration_at(&log, row.end, &what), it + 1, "{what}");
            iterations.entry(row.step).or_default().push(it);
        }
    }
    for (step, its) in &iterations {
        assert!(
            its.iter().all(|i| *i == its[0]),
            "job step {step} is iterations {its:?} on ranks {on:?}"
        );
    }
    let meta = job_meta(job);
    assert_eq!(meta["verification"]["ok"], true, "{meta:#}");
    assert_eq!(meta["complete"], true, "{meta:#}");
    steps
}

fn job_meta(job: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(job.join("job_meta.json")).unwrap()).unwrap()
}

/// Replaces profiler_config.json the way an editor does (write, rename).
fn save_config(dir: &Path, v: &serde_json::Value) {
    let tmp = dir.join(".profiler_config.json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(v).unwrap()).unwrap();
    std::fs::rename(&tmp, dir.join("profiler_config.json")).unwrap();
}

/// One profiler_config.json save with `is_rank` and `rank_list [1, 3]`
/// starts one job window on ranks 1 and 3 only, on the same iterations;
/// the next save without the filter starts one on all four ranks. The
/// monitor log says which ranks each change took effect on.
#[test]
fn config_file_starts_one_job_window_on_the_ranks_of_rank_list() {
    require_privileges!();
    let _one = one_job();
    let dir = scratch_dir("job_mode_triggers-config");
    let ranks = Ranks::start(&dir, "jmt-config");
    let cfg = dir.join("prof_cfg");
    let out = dir.join("out");
    let pids = ranks.pids();
    let mut d = spawn(
        &[
            "attach",
            "--pids",
            &pids,
            "--marker",
            "exe:optimizer_step",
            "--config-dir",
            cfg.to_str().unwrap(),
            "--collect",
            "offcpu",
            "--duration",
            "300",
            "-o",
            out.to_str().unwrap(),
        ],
        false,
    );
    d.wait_for("edit it to start a job window", T);
    let template: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(cfg.join("profiler_config.json")).unwrap())
            .unwrap();
    let mut c = template.clone();
    c["start_step"] = (-1).into();
    c["warmup"] = 1.into();
    c["active"] = 3.into();
    c["is_rank"] = true.into();
    c["rank_list"] = serde_json::json!([1, 3]);
    c["metadata"] = serde_json::json!({"ticket": "JOB-1"});
    save_config(&cfg, &c);
    let i = d.wait_for("dynprof: job window written", T);
    let mut c2 = template.clone();
    c2["start_step"] = (-1).into();
    c2["active"] = 2.into();
    save_config(&cfg, &c2);
    d.wait_for_from(i + 1, "dynprof: job window written", T);
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGINT) };
    let st = d.wait_exit(T);
    assert!(st.success(), "{st}\n{}", d.transcript());

    let jobs = job_dirs(&out);
    assert_eq!(jobs.len(), 2, "{jobs:?}\n{}", d.transcript());
    let first = check_window(&jobs[0], &ranks, &[1, 3], 3);
    let meta = job_meta(&jobs[0]);
    assert_eq!(meta["trigger"], "config_file", "{meta:#}");
    assert_eq!(meta["rank_list"], serde_json::json!([1, 3]), "{meta:#}");
    assert_eq!(meta["metadata"]["ticket"], "JOB-1", "{meta:#}");
    let second = check_window(&jobs[1], &ranks, &[0, 1, 2, 3], 2);
    assert!(second[0] > first[2], "{first:?} then {second:?}");

    let log_dir = cfg.join("log");
    let monitor = std::fs::read_dir(&log_dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .find(|e| {
            let n = e.file_name().to_string_lossy().to_string();
            n.starts_with("monitor_dp_") && n.ends_with("_job.log")
        })
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .unwrap_or_else(|| panic!("no job monitor log in {}", log_dir.display()));
    let took: Vec<&str> = monitor
        .lines()
        .filter(|l| l.contains("took effect: job window"))
        .collect();
    assert_eq!(took.len(), 2, "{monitor}");
    assert!(
        took[0].contains(&format!(
            "change 1 took effect: job window 1 records job steps {}..={} on rank(s) 1,3",
            first[0], first[2]
        )),
        "{monitor}"
    );
    assert!(took[1].contains("on rank(s) 0,1,2,3"), "{monitor}");
    drop(ranks);
}

/// `dynprof attach --pids … --interactive --collect offcpu` on the ranks,
/// once its console is ready.
fn console_job(ranks: &Ranks, out: &Path) -> windows_util::Running {
    let mut d = spawn(
        &[
            "attach",
            "--pids",
            &ranks.pids(),
            "--marker",
            "exe:optimizer_step",
            "--interactive",
            "--collect",
            "offcpu",
            "-o",
            out.to_str().unwrap(),
        ],
        true,
    );
    d.wait_for("dynprof console ready", T);
    d
}

/// The console in job mode: `capture 2 warmup 1` records the same job
/// steps on every rank; `status` counts the window; `quit` detaches.
#[test]
fn console_capture_records_one_job_window() {
    require_privileges!();
    let _one = one_job();
    let dir = scratch_dir("job_mode_triggers-console");
    let ranks = Ranks::start(&dir, "jmt-console");
    let out = dir.join("out");
    let mut d = console_job(&ranks, &out);
    d.send("capture 2 warmup 1");
    d.wait_for("job window written", T);
    d.send("status");
    d.wait_for("job windows written 1", T);
    d.send("quit");
    let st = d.wait_exit(T);
    assert!(st.success(), "{st}\n{}", d.transcript());
    let jobs = job_dirs(&out);
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    check_window(&jobs[0], &ranks, &[0, 1, 2, 3], 2);
    assert_eq!(job_meta(&jobs[0])["trigger"], "console");
    drop(ranks);
}

/// The job step a console answer names after `needle` ("… steps 41.. until
/// `stop`", "… ends after job step 57 …").
fn step_after(line: &str, needle: &str) -> u64 {
    let rest = &line[line
        .find(needle)
        .unwrap_or_else(|| panic!("{needle:?} in {line}"))
        + needle.len()..];
    rest.chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .unwrap_or_else(|_| panic!("a step after {needle:?} in {line}"))
}

/// `start` and `stop` in job mode: the window opens and ends on the same
/// job steps on every rank (checked against each rank's own log), and
/// holds exactly the steps from the one `start` named to the one `stop`
/// named. `quit` with a `start` window open ends it the same way, writes
/// it complete, then detaches.
#[test]
fn console_start_and_stop_end_on_the_same_job_step_on_every_rank() {
    require_privileges!();
    let _one = one_job();
    let dir = scratch_dir("job_mode_triggers-startstop");
    let ranks = Ranks::start(&dir, "jmt-startstop");
    let out = dir.join("out");
    let mut d = console_job(&ranks, &out);
    let mut from = 0;
    for (n, end_with) in [(1, "stop"), (2, "quit")] {
        d.send("start");
        let i = d.wait_for_from(from, &format!("job window {n} records job steps"), T);
        let first = step_after(&d.lines[i].1, "records job steps ");
        assert!(d.lines[i].1.contains("until `stop`"), "{}", d.lines[i].1);
        d.send(end_with);
        let i = d.wait_for_from(i, &format!("job window {n} ends after job step "), T);
        let last = step_after(&d.lines[i].1, "ends after job step ");
        assert!(last >= first, "{}", d.transcript());
        from = d.wait_for_from(i, "job window written", T);
        let jobs = job_dirs(&out);
        assert_eq!(jobs.len(), n, "{jobs:?}");
        let steps = check_window(&jobs[n - 1], &ranks, &[0, 1, 2, 3], last - first + 1);
        assert_eq!(steps.first(), Some(&first), "{steps:?}");
    }
    let st = d.wait_exit(T);
    assert!(st.success(), "{st}\n{}", d.transcript());
    drop(ranks);
}

/// `dynprof attach --pids …` on the ranks with the plan flags `plan`, into
/// `out`, run to its end (a success).
fn flags_job(ranks: &Ranks, out: &Path, plan: &[&str]) -> windows_util::Running {
    let pids = ranks.pids();
    let mut args = vec!["attach", "--pids", &pids, "--marker", "exe:optimizer_step"];
    args.extend_from_slice(plan);
    args.extend_from_slice(&["--duration", "300", "-o", out.to_str().unwrap()]);
    let mut d = spawn(&args, false);
    let st = d.wait_exit(T);
    assert!(st.success(), "{st}\n{}", d.transcript());
    d
}

/// `--repeat 2 --gap 20`: three job directories, each window `2 + 20` job
/// steps after the one before, each on the same iterations on every rank.
#[test]
fn repeat_gives_one_job_window_per_repeat() {
    require_privileges!();
    let _one = one_job();
    let dir = scratch_dir("job_mode_triggers-repeat");
    let ranks = Ranks::start(&dir, "jmt-repeat");
    let out = dir.join("out");
    let d = flags_job(
        &ranks,
        &out,
        &[
            "--active",
            "2",
            "--repeat",
            "2",
            "--gap",
            "20",
            "--collect",
            "offcpu",
        ],
    );
    let jobs = job_dirs(&out);
    assert_eq!(jobs.len(), 3, "{jobs:?}\n{}", d.transcript());
    let starts: Vec<u64> = jobs
        .iter()
        .map(|j| check_window(j, &ranks, &[0, 1, 2, 3], 2)[0])
        .collect();
    assert_eq!(starts[1], starts[0] + 22, "{starts:?}");
    assert_eq!(starts[2], starts[0] + 44, "{starts:?}");
    drop(ranks);
}

/// `--collect none` in job mode records step timing only, as for one PID:
/// the job adds no offcpu collector (it used to, after dropping the
/// capabilities that collector needs, and every window was incomplete),
/// every rank's window is complete with no collector, and the collective
/// wait is marked as not recorded.
#[test]
fn collect_none_records_complete_windows_of_step_timing() {
    require_privileges!();
    let _one = one_job();
    let dir = scratch_dir("job_mode_triggers-none");
    let ranks = Ranks::start(&dir, "jmt-none");
    let out = dir.join("out");
    let d = flags_job(&ranks, &out, &["--active", "2", "--collect", "none"]);
    assert!(
        !d.transcript().contains("could not be armed"),
        "{}",
        d.transcript()
    );
    let jobs = job_dirs(&out);
    assert_eq!(jobs.len(), 1, "{jobs:?}\n{}", d.transcript());
    check_window(&jobs[0], &ranks, &[0, 1, 2, 3], 2);
    let meta = job_meta(&jobs[0]);
    for r in meta["ranks"].as_array().unwrap() {
        assert_eq!(r["collective_wait_from"], "not_recorded", "{r}");
        let wdir = jobs[0].join(r["window_dir"].as_str().unwrap());
        let m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(wdir.join("meta.json")).unwrap())
                .unwrap();
        assert_eq!(m["complete"], true, "{m:#}");
        assert_eq!(
            m["collectors"],
            serde_json::json!({"api": false, "cpu": false, "offcpu": false}),
            "{m:#}"
        );
    }
    drop(ranks);
}

/// `rank N [label n, …]` from the job console's `status` answer.
fn rank_hits(status: &str, rank: u32, label: &str) -> u64 {
    let list = status
        .split("marker hits:")
        .nth(1)
        .unwrap_or_else(|| panic!("no marker hits in {status:?}"));
    let of_rank = list
        .split(&format!("rank {rank} ["))
        .nth(1)
        .and_then(|x| x.split(']').next())
        .unwrap_or_else(|| panic!("no rank {rank} in {status:?}"));
    of_rank
        .split(',')
        .map(str::trim)
        .find_map(|e| e.strip_prefix(label)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {label} for rank {rank} in {status:?}"))
}

/// An aux marker (HcclAllReduce, once per step) is attached on the ranks
/// only around job windows: over twenty idle steps it counts nothing on any
/// rank, and each recorded job step of every rank counts exactly one call.
#[test]
fn aux_marker_only_around_job_windows() {
    require_privileges!();
    let _one = one_job();
    let dir = scratch_dir("job_mode_triggers-aux");
    let ranks = Ranks::start(&dir, "jmt-aux");
    let out = dir.join("out");
    let pids = ranks.pids();
    let mut d = spawn(
        &[
            "attach",
            "--pids",
            &pids,
            "--marker",
            "exe:optimizer_step",
            "--marker",
            "libhccl:HcclAllReduce,role=aux",
            "--interactive",
            "--collect",
            "offcpu",
            "-o",
            out.to_str().unwrap(),
        ],
        true,
    );
    d.wait_for("dynprof console ready", T);
    // Twenty idle steps on every rank with the markers attached (the ranks
    // are in lockstep: rank 0's log stands for all).
    let log0 = dir.join("rank0.log");
    let have = log_lines_of(&log0, "step").len();
    wait_for_log_lines(&log0, "step", have + 20, T);
    // The hits are read on each session tick: ask until every rank's step
    // marker shows idle steps.
    let deadline = std::time::Instant::now() + T;
    let mut from = 0;
    let idle = loop {
        d.send("status");
        let i = d.wait_for_from(from, "marker hits:", T);
        from = i + 1;
        let line = d.lines[i].1.clone();
        if (0..WORLD).all(|r| rank_hits(&line, r, "optimizer_step") >= 20) {
            break line;
        }
        assert!(std::time::Instant::now() < deadline, "{}", d.transcript());
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(idle.contains("no window"), "{idle}");
    for r in 0..WORLD {
        assert_eq!(rank_hits(&idle, r, "HcclAllReduce"), 0, "rank {r}: {idle}");
    }
    d.send("capture 3 warmup 1");
    d.wait_for("job window written", T);
    d.send("quit");
    let st = d.wait_exit(T);
    assert!(st.success(), "{st}\n{}", d.transcript());
    let jobs = job_dirs(&out);
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    check_window(&jobs[0], &ranks, &[0, 1, 2, 3], 3);
    for r in 0..WORLD {
        let rank_dir = jobs[0].join(format!("rank{r}"));
        let prof = std::fs::read_dir(&rank_dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("PROF_"))
            })
            .unwrap_or_else(|| panic!("no PROF_ dir in {}", rank_dir.display()));
        let csv = std::fs::read_to_string(prof.join("steps.csv")).unwrap();
        let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
        let col = header
            .iter()
            .position(|h| *h == "aux_HcclAllReduce")
            .unwrap_or_else(|| panic!("rank {r}: no HcclAllReduce column: {csv}"));
        let rows: Vec<&str> = csv.lines().skip(1).collect();
        assert_eq!(rows.len(), 3, "rank {r}: {csv}");
        for row in rows {
            assert_eq!(row.split(',').nth(col), Some("1"), "rank {r}: {csv}");
        }
    }
    drop(ranks);
}

/// The children of `pid`, from /proc.
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// An elastic restart under `--job LAUNCHER --follow`: a launcher shell
/// runs four ranks (loading the CANN runtime stand-in, as NPU ranks do),
/// and when they die, four new ones with the same RANKs and a new
/// barrier. A console `capture` before the restart records the first
/// workers; after the test kills them, dynprof attaches the new workers
/// as they appear, aligns them again, and a second `capture` records the
/// same iterations on every new worker (by their own logs). job_meta.json
/// names the replaced processes.
#[test]
fn follow_attaches_the_workers_of_an_elastic_restart() {
    use std::os::unix::process::CommandExt as _;
    require_privileges!();
    let _one = one_job();
    let dir = scratch_dir("job_mode_triggers-follow");
    let bin = fixtures().dir.join("hccl/hccl_rank");
    let acl = fixtures().dir.join("libascendcl.so");
    let shm = |g: u32| format!("/dynprof-jmt-follow-{}-{g}", std::process::id());
    let _shm = [
        Ranks {
            procs: Vec::new(),
            shm: shm(1),
            dir: dir.join("gen1"),
        },
        Ranks {
            procs: Vec::new(),
            shm: shm(2),
            dir: dir.join("gen2"),
        },
    ];
    for g in ["gen1", "gen2"] {
        std::fs::create_dir_all(dir.join(g)).unwrap();
    }
    // One generation: WORLD ranks in the background, then wait for all.
    let script = format!(
        r#"gen() {{
             for r in 0 1 2 3; do
               RANK=$r WORLD_SIZE={WORLD} LD_PRELOAD='{acl}' '{bin}' --rank $r --world {WORLD} \
                 --shm "$2" --cpu-us $( [ $r = {SLOW} ] && echo 150000 || echo 20000 ) \
                 --log "$1/rank$r.log" >/dev/null &
             done
             wait
           }}
           gen '{d}/gen1' '{s1}'
           gen '{d}/gen2' '{s2}'"#,
        acl = acl.display(),
        bin = bin.display(),
        d = dir.display(),
        s1 = shm(1),
        s2 = shm(2),
    );
    let mut launcher = Command::new("sh")
        .args(["-c", &script])
        .process_group(0)
        .spawn()
        .expect("starting the launcher");
    struct KillGroup(i32);
    impl Drop for KillGroup {
        fn drop(&mut self) {
            // SAFETY: kill(2) on the process group this test made.
            unsafe { libc::kill(-self.0, libc::SIGKILL) };
        }
    }
    let _group = KillGroup(launcher.id() as i32);
    let sh = launcher.id();
    for r in 0..WORLD {
        wait_for_log_lines(dir.join(format!("gen1/rank{r}.log")), "step", 1, T);
    }
    let gen1 = children(sh);
    assert_eq!(gen1.len(), WORLD as usize, "{gen1:?}");

    let out = dir.join("out");
    let mut d = spawn(
        &[
            "attach",
            "--job",
            &sh.to_string(),
            "--follow",
            "--marker",
            "exe:optimizer_step",
            "--interactive",
            "--collect",
            "offcpu",
            "-o",
            out.to_str().unwrap(),
        ],
        true,
    );
    d.wait_for("dynprof console ready", T);
    d.send("capture 2 warmup 1");
    d.wait_for("job window written", T);

    // The restart: the first workers die; the launcher starts new ones.
    for p in &gen1 {
        // SAFETY: kill(2) on the ranks this test's launcher started.
        unsafe { libc::kill(*p as i32, libc::SIGKILL) };
    }
    let mut from = 0;
    for _ in 0..WORLD {
        from = d.wait_for_from(from, "(late)", T) + 1;
    }
    let gen2 = children(sh);
    assert_eq!(gen2.len(), WORLD as usize, "{gen2:?}");
    assert!(gen2.iter().all(|p| !gen1.contains(p)), "{gen1:?} {gen2:?}");
    for p in &gen2 {
        assert!(
            d.transcript()
                .contains(&format!("attached to PID {p} (late)")),
            "{p} not attached late:\n{}",
            d.transcript()
        );
    }
    d.send("capture 2 warmup 1");
    d.wait_for_from(from, "job window written", T);
    d.send("quit");
    let st = d.wait_exit(T);
    assert!(st.success(), "{st}\n{}", d.transcript());

    let jobs = job_dirs(&out);
    assert_eq!(jobs.len(), 2, "{jobs:?}\n{}", d.transcript());
    let on: Vec<u32> = (0..WORLD).collect();
    for (job, g, pids) in [(&jobs[0], "gen1", &gen1), (&jobs[1], "gen2", &gen2)] {
        let ranks = Ranks {
            procs: Vec::new(),
            shm: String::new(),
            dir: dir.join(g),
        };
        check_window(job, &ranks, &on, 2);
        let meta = job_meta(job);
        let mut got: Vec<u64> = meta["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["host_pid"].as_u64().unwrap())
            .collect();
        got.sort();
        let mut want: Vec<u64> = pids.iter().map(|p| *p as u64).collect();
        want.sort();
        assert_eq!(got, want, "{g}: {meta:#}");
    }
    let replaced: Vec<u64> = job_meta(&jobs[1])["replaced"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["host_pid"].as_u64().unwrap())
        .collect();
    let mut want: Vec<u64> = gen1.iter().map(|p| *p as u64).collect();
    want.sort();
    let mut replaced_sorted = replaced.clone();
    replaced_sorted.sort();
    assert_eq!(replaced_sorted, want);
    let _ = launcher.kill();
    let _ = launcher.wait();
}
