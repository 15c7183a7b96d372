//! `profiler_config.json` (the `--config-dir` trigger; writable by the job's
//! user), what the msprof collector derives from such a config, and the
//! torch_npu dynamic-profiling log dynprof reads back.
#![no_main]

use dynprof::{
    collect::{msprof, torch_npu_dp},
    window::trigger::config_file,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        let _ = torch_npu_dp::parse_dp_log(&String::from_utf8_lossy(data));
        return;
    };
    if let Ok(parsed) = config_file::parse(text) {
        let _ = config_file::key_paths(&parsed.raw);
        let _ = msprof::args_from_profiler_config(&parsed.raw);
    }
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(text) {
        let _ = msprof::args_from_profiler_config(&v);
    }
    let _ = torch_npu_dp::parse_dp_log(text);
});
