//! /proc/PID/cgroup: container ids, runtimes and Kubernetes pod uids.
#![no_main]

use dynprof::target::container;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Some(c) = container::parse_cgroup_file(&text) {
        let _ = c.short();
        let _ = c.matches_prefix(&c.id[..c.id.len().min(container::MIN_PREFIX_LEN)]);
    }
    let _ = container::parse_cgroup_path(&text);
    let _ = container::looks_like_id_prefix(&text);
});
