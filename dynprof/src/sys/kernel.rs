//! Probes what the running kernel offers to dynprof's eBPF programs, the
//! way libbpf does: by loading a tiny program that calls a helper, creating
//! a map of a type, and reading the uprobe PMU's formats. The decision what
//! to do with the answers is `compat::choose`, testable without a kernel.
use std::path::Path;

use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported, is_map_supported},
};

use crate::compat::KernelFeatures;

const UPROBE_PMU: &str = "/sys/bus/event_source/devices/uprobe";

/// Probes the running kernel. Needs the privileges to load BPF programs;
/// without them every probe answers "no", and `preflight` says why first.
pub fn probe() -> KernelFeatures {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".into());
    let pmu = Path::new(UPROBE_PMU);
    let helper = |h| matches!(is_helper_supported(ProgramType::KProbe, h), Ok(true));
    let f = aya::features();
    let features = KernelFeatures {
        release,
        uprobe_pmu: pmu.join("type").exists(),
        uretprobe_pmu: pmu.join("format/retprobe").exists(),
        ref_ctr_offset: pmu.join("format/ref_ctr_offset").exists(),
        btf: Path::new("/sys/kernel/btf/vmlinux").exists(),
        global_data: f.bpf_global_data(),
        probe_read_kernel: f.bpf_probe_read_kernel()
            && helper(BpfHelper::BPF_FUNC_probe_read_user_str),
        ringbuf: matches!(is_map_supported(MapType::RingBuf), Ok(true)),
        attach_cookie: helper(BpfHelper::BPF_FUNC_get_attach_cookie),
        perf_link: f.bpf_perf_link(),
        task_pt_regs: helper(BpfHelper::BPF_FUNC_get_current_task_btf)
            && helper(BpfHelper::BPF_FUNC_task_pt_regs),
        // Measured by the loader where needed (it loads a program).
        task_stack_regs: crate::compat::TaskStackRegs::NotMeasured,
    };
    log::debug!("kernel features: {features:?}");
    features
}
