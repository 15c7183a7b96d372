//! /proc/PID/{maps,status,stat,environ,cmdline} as a target can shape them
//! (its paths, comm, environment and arguments are its own), and what
//! dynprof derives from them: runtimes and `--marker auto` presets from the
//! maps, ranks from the environment, launchers from the command line. And
//! the target's `/tmp/perf-PID.map` (JIT symbol names), also its own.
#![no_main]

use dynprof::{
    discover as ps,
    probes::presets,
    symbols::perfmap::PerfMap,
    target::{self, RankEnv},
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let maps = target::parse_maps(&text);
    let rt = presets::detect(&maps);
    let _ = rt.names();
    let _ = ps::auto_marker_summary(&rt, &maps);
    let _ = target::parse_nspid(&text);
    let _ = target::parse_ppid(&text);
    let _ = target::parse_stat(&text);
    let env = target::parse_environ(data);
    let _ = RankEnv::from_env(&env);
    let cmdline = target::parse_cmdline(data);
    let _ = ps::launcher_kind(&cmdline);
    let perf = PerfMap::parse(data);
    for m in maps.iter().take(16) {
        let _ = perf.lookup(m.start);
    }
});
