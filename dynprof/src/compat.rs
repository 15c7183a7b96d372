//! Which kernel features dynprof needs, from which Linux version, and which
//! path it takes on the running kernel.
//!
//! `sys::kernel::probe` finds out what the kernel offers (as libbpf does:
//! tiny probe programs and maps, PMU formats); [`choose`] turns that into
//! [`KernelPaths`], or into one error that names every missing feature and
//! the version that brought it. A feature that has a fallback is never
//! dropped silently: the fallback is listed in `KernelPaths::fallbacks`,
//! which goes to the `attached` event and to every window's meta.json.
use anyhow::{Result, bail};
use serde::Serialize;

/// What the running kernel offers. Each field names the version that
/// introduced it upstream (distribution kernels may backport).
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct KernelFeatures {
    /// `uname -r`.
    pub release: String,
    /// The uprobe perf PMU (`/sys/bus/event_source/devices/uprobe`), 4.17.
    pub uprobe_pmu: bool,
    /// Its `format/retprobe` bit (return probes through the PMU), 4.17.
    pub uretprobe_pmu: bool,
    /// Its `format/ref_ctr_offset` (kernel-owned USDT semaphores), 4.20.
    pub ref_ctr_offset: bool,
    /// `/sys/kernel/btf/vmlinux`, 5.4 (CONFIG_DEBUG_INFO_BTF).
    pub btf: bool,
    /// Global data (`.rodata`/`.bss` maps: the target tgid), 5.2.
    pub global_data: bool,
    /// `bpf_probe_read_kernel`/`_user`/`_user_str`, 5.5.
    pub probe_read_kernel: bool,
    /// `BPF_MAP_TYPE_RINGBUF` (the event path), 5.8.
    pub ringbuf: bool,
    /// `bpf_get_attach_cookie`, 5.15.
    pub attach_cookie: bool,
    /// `BPF_LINK_CREATE` on perf events (carries the cookie), 5.15.
    pub perf_link: bool,
    /// `bpf_get_current_task_btf` (5.11) and `bpf_task_pt_regs` (5.15):
    /// the user registers saved at kernel entry.
    pub task_pt_regs: bool,
    /// Without `task_pt_regs`: where those registers are found instead.
    /// Not probed with the rest (it loads a program): `NotMeasured` until
    /// the loader measures it, only on kernels that need it.
    pub task_stack_regs: TaskStackRegs,
}

/// The user registers at the top of a task's kernel stack, where
/// `task_pt_regs()` puts them, for kernels without `bpf_task_pt_regs`.
#[derive(Clone, Debug, Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum TaskStackRegs {
    /// Not looked for (the kernel has `bpf_task_pt_regs`).
    #[default]
    NotMeasured,
    /// Turned off by `DYNPROF_KERNEL_FEATURES=no_task_stack_regs`.
    Disabled,
    /// At `task_struct.stack` (byte `stack_offset`, from BTF) +
    /// `regs_delta` (measured at a system call of dynprof's own).
    Found { stack_offset: u32, regs_delta: u32 },
    /// Looked for and not found: why.
    Failed(String),
}

/// The largest distance from a task's stack base to its saved user
/// registers that is believed: `THREAD_SIZE` is 16 KiB on x86-64 and
/// arm64 (32 KiB with KASAN, 64 KiB with arm64's 64 KiB pages).
pub const MAX_REGS_DELTA: u64 = 256 * 1024;

/// The measured distance from `task->stack` to `task_pt_regs(task)`, or
/// why it is not believed (a wrong `task_struct.stack` offset reads some
/// other pointer).
pub fn regs_delta(stack: u64, regs: u64) -> Result<u32> {
    if stack == 0 || regs == 0 {
        bail!(
            "the measuring program read no stack base or registers (stack {stack:#x}, regs {regs:#x})"
        );
    }
    let Some(delta) = regs
        .checked_sub(stack)
        .filter(|d| *d > 0 && *d < MAX_REGS_DELTA)
    else {
        bail!(
            "the saved registers ({regs:#x}) are not within {} KiB above task_struct.stack ({stack:#x})",
            MAX_REGS_DELTA / 1024
        );
    };
    if delta % 8 != 0 {
        bail!("the saved registers are at an unaligned distance ({delta}) from the task's stack");
    }
    Ok(delta as u32)
}

/// One kernel feature dynprof uses: the row of docs/portability.md's table.
pub struct Requirement {
    pub what: &'static str,
    pub since: &'static str,
    /// What dynprof does without it.
    pub without: &'static str,
}

pub const UPROBE_PMU: Requirement = Requirement {
    what: "uprobe perf PMU (perf_event_open on /sys/bus/event_source/devices/uprobe)",
    since: "4.17",
    without: "cannot attach (CONFIG_UPROBE_EVENTS=y is needed too)",
};
pub const URETPROBE_PMU: Requirement = Requirement {
    what: "return uprobes through the uprobe PMU (format/retprobe)",
    since: "4.17",
    without: "cannot time runtime APIs (api collector)",
};
pub const REF_CTR_OFFSET: Requirement = Requirement {
    what: "kernel-owned USDT semaphores (uprobe ref_ctr_offset)",
    since: "4.20",
    without: "raises USDT semaphores through /proc/PID/mem, with a ledger for repair",
};
pub const BTF: Requirement = Requirement {
    what: "kernel BTF (/sys/kernel/btf/vmlinux, CONFIG_DEBUG_INFO_BTF=y)",
    since: "5.4",
    without: "refuses to start",
};
pub const GLOBAL_DATA: Requirement = Requirement {
    what: "BPF global data (read-only .rodata maps)",
    since: "5.2",
    without: "cannot load (the target's tgid is a global)",
};
pub const PROBE_READ_KERNEL: Requirement = Requirement {
    what: "bpf_probe_read_kernel / bpf_probe_read_user(_str) helpers",
    since: "5.5",
    without: "cannot load (marker registers and string arguments are read with them)",
};
pub const RINGBUF: Requirement = Requirement {
    what: "BPF ring buffer (BPF_MAP_TYPE_RINGBUF, bpf_ringbuf_reserve/submit/query)",
    since: "5.8",
    without: "cannot load (all events go through it; a perf-buffer path is not written)",
};
pub const ATTACH_COOKIE: Requirement = Requirement {
    what: "BPF attach cookies (bpf_get_attach_cookie, BPF_LINK_CREATE on perf events)",
    since: "5.15",
    without: "identifies markers and APIs by their probed address (the uprobe's instruction pointer) \
              in a map; APIs' returns are paired with entries on a per-thread stack",
};

pub const TASK_PT_REGS: Requirement = Requirement {
    what: "bpf_task_pt_regs (the user registers saved at kernel entry)",
    since: "5.15",
    without: "reads those registers at the top of the task's kernel stack (task_struct.stack \
              from BTF, the distance measured at load); where that fails, user stacks of CPU \
              samples taken in the kernel and of off-CPU intervals are frame-pointer walks only \
              (no .eh_frame unwinding); Python frames are kept",
};

/// How the user stack of a CPU sample taken in kernel mode (a syscall, a
/// page fault) and of an off-CPU interval is found.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum KernelModeStacks {
    /// Unwound from the user registers saved at kernel entry, like user-mode
    /// samples (`bpf_task_pt_regs`).
    Unwound,
    /// The same, with the registers read at the top of the task's kernel
    /// stack ([`TaskStackRegs::Found`]), before 5.15.
    UnwoundFromTaskStack,
    /// The frame-pointer walk of `bpf_get_stackid` alone.
    FramePointers,
}

/// How a program knows which marker or API fired.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ProbeIdentity {
    /// The attach cookie (the marker or API index), 5.15+.
    Cookie,
    /// The probed address, looked up in a map user space fills.
    Address,
}

/// How the markers' USDT semaphores are held.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SemaphorePath {
    /// `ref_ctr_offset`: the kernel raises and lowers them.
    Kernel,
    /// dynprof writes /proc/PID/mem.
    ProcMem,
}

/// The paths dynprof takes on this kernel; serialized as `kernel` in the
/// `attached` event and in meta.json.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct KernelPaths {
    pub release: String,
    /// `major.minor.patch` parsed from the release, when it parses.
    pub version: Option<String>,
    pub probe_identity: ProbeIdentity,
    pub semaphores: SemaphorePath,
    pub kernel_mode_stacks: KernelModeStacks,
    /// One line per feature this kernel lacks and what dynprof does instead.
    pub fallbacks: Vec<String>,
}

/// Environment variable that makes dynprof act as if the kernel lacked a
/// feature, so that the fallback paths run (and are tested) on any kernel.
pub const FEATURES_ENV: &str = "DYNPROF_KERNEL_FEATURES";

/// Applies [`FEATURES_ENV`]: a comma-separated list of `no_attach_cookie`,
/// `no_ref_ctr_offset`, `no_task_pt_regs` (the registers are then read
/// from the task's stack, as before 5.15) and `no_task_stack_regs` (not
/// that either: frame pointers). Returns the note for `KernelPaths::fallbacks`.
pub fn apply_override(f: &mut KernelFeatures, value: &str) -> Result<Option<String>> {
    let mut forced = Vec::new();
    for item in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match item {
            "no_attach_cookie" => f.attach_cookie = false,
            "no_ref_ctr_offset" => f.ref_ctr_offset = false,
            "no_task_pt_regs" => f.task_pt_regs = false,
            "no_task_stack_regs" => f.task_stack_regs = TaskStackRegs::Disabled,
            other => bail!(
                "{FEATURES_ENV}: unknown item {other:?} (hint: use no_attach_cookie, no_ref_ctr_offset, no_task_pt_regs, no_task_stack_regs)"
            ),
        }
        forced.push(item);
    }
    Ok((!forced.is_empty())
        .then(|| format!("{FEATURES_ENV}={}: fallbacks forced", forced.join(","))))
}

/// `5.10.0-30-amd64` -> (5, 10, 0).
pub fn parse_version(release: &str) -> Option<(u32, u32, u32)> {
    let mut it = release
        .split(|c: char| !c.is_ascii_digit())
        .take(3)
        .map(|p| p.parse::<u32>().ok());
    let major = it.next()??;
    let minor = it.next()??;
    let patch = it.next().flatten().unwrap_or(0);
    Some((major, minor, patch))
}

fn line(r: &Requirement) -> String {
    format!("{} (Linux {}+)", r.what, r.since)
}

/// The paths for `f`, or one error naming each missing feature, the
/// version that brought it, and what it is needed for.
pub fn choose(f: &KernelFeatures) -> Result<KernelPaths> {
    let missing: Vec<String> = [
        (f.uprobe_pmu, &UPROBE_PMU),
        (f.btf, &BTF),
        (f.global_data, &GLOBAL_DATA),
        (f.probe_read_kernel, &PROBE_READ_KERNEL),
        (f.ringbuf, &RINGBUF),
    ]
    .into_iter()
    .filter(|(has, _)| !has)
    .map(|(_, r)| format!("{}: {}", line(r), r.without))
    .collect();
    if !missing.is_empty() {
        bail!(
            "kernel {} lacks what dynprof needs: {} (hint: dynprof needs Linux 5.8+ with BTF; see docs/portability.md)",
            f.release,
            missing.join("; ")
        );
    }
    let mut fallbacks = Vec::new();
    let probe_identity = if f.attach_cookie && f.perf_link {
        ProbeIdentity::Cookie
    } else {
        let lacking = match (f.attach_cookie, f.perf_link) {
            (false, false) => "bpf_get_attach_cookie and perf-event bpf links",
            (false, true) => "bpf_get_attach_cookie",
            _ => "perf-event bpf links",
        };
        fallbacks.push(format!(
            "no {lacking} (Linux {}+): {}",
            ATTACH_COOKIE.since, ATTACH_COOKIE.without
        ));
        ProbeIdentity::Address
    };
    let semaphores = if f.ref_ctr_offset {
        SemaphorePath::Kernel
    } else {
        fallbacks.push(format!(
            "no {}: dynprof {}",
            line(&REF_CTR_OFFSET),
            REF_CTR_OFFSET.without
        ));
        SemaphorePath::ProcMem
    };
    if !f.uretprobe_pmu {
        fallbacks.push(format!(
            "no {}: the api collector {}",
            line(&URETPROBE_PMU),
            "cannot run"
        ));
    }
    let kernel_mode_stacks = match (&f.task_pt_regs, &f.task_stack_regs) {
        (true, _) => KernelModeStacks::Unwound,
        (
            false,
            TaskStackRegs::Found {
                stack_offset,
                regs_delta,
            },
        ) => {
            fallbacks.push(format!(
                "no {}: the user registers of kernel-mode samples and off-CPU switch-outs are \
                 read at task_struct.stack + {regs_delta} (the member at byte {stack_offset} \
                 from BTF, the distance measured at load)",
                line(&TASK_PT_REGS)
            ));
            KernelModeStacks::UnwoundFromTaskStack
        }
        (false, other) => {
            let why = match other {
                TaskStackRegs::Failed(why) => format!(" (not found on the task's stack: {why})"),
                TaskStackRegs::Disabled => {
                    " (reading them from the task's stack turned off)".into()
                }
                _ => String::new(),
            };
            fallbacks.push(format!(
                "no {}{why}: user stacks of CPU samples taken in the kernel and of off-CPU \
                 intervals are frame-pointer walks only (no .eh_frame unwinding); Python frames \
                 are kept",
                line(&TASK_PT_REGS)
            ));
            KernelModeStacks::FramePointers
        }
    };
    Ok(KernelPaths {
        release: f.release.clone(),
        version: parse_version(&f.release).map(|(a, b, c)| format!("{a}.{b}.{c}")),
        probe_identity,
        semaphores,
        kernel_mode_stacks,
        fallbacks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn linux_6_1() -> KernelFeatures {
        KernelFeatures {
            release: "6.1.0-18-amd64".into(),
            uprobe_pmu: true,
            uretprobe_pmu: true,
            ref_ctr_offset: true,
            btf: true,
            global_data: true,
            probe_read_kernel: true,
            ringbuf: true,
            attach_cookie: true,
            perf_link: true,
            task_pt_regs: true,
            task_stack_regs: TaskStackRegs::NotMeasured,
        }
    }

    /// What Debian bullseye's 5.10.0-30 reports (measured in the VM).
    fn linux_5_10() -> KernelFeatures {
        KernelFeatures {
            release: "5.10.0-30-amd64".into(),
            attach_cookie: false,
            perf_link: false,
            task_pt_regs: false,
            ..linux_6_1()
        }
    }

    #[test]
    fn versions_parse_from_distribution_releases() {
        assert_eq!(parse_version("5.10.0-30-amd64"), Some((5, 10, 0)));
        assert_eq!(
            parse_version("5.10.0-60.18.0.50.oe2203.aarch64"),
            Some((5, 10, 0))
        );
        assert_eq!(parse_version("6.18.44-fc-v1045"), Some((6, 18, 44)));
        assert_eq!(parse_version("4.19"), Some((4, 19, 0)));
        assert_eq!(parse_version("garbage"), None);
        assert_eq!(parse_version(""), None);
    }

    #[test]
    fn a_current_kernel_uses_cookies_and_kernel_semaphores_without_fallbacks() {
        let p = choose(&linux_6_1()).unwrap();
        assert_eq!(p.probe_identity, ProbeIdentity::Cookie);
        assert_eq!(p.semaphores, SemaphorePath::Kernel);
        assert!(p.fallbacks.is_empty(), "{:?}", p.fallbacks);
        assert_eq!(p.version.as_deref(), Some("6.1.0"));
    }

    #[test]
    fn linux_5_10_identifies_probes_by_address_and_says_why() {
        let p = choose(&linux_5_10()).unwrap();
        assert_eq!(p.probe_identity, ProbeIdentity::Address);
        assert_eq!(p.semaphores, SemaphorePath::Kernel);
        assert_eq!(p.kernel_mode_stacks, KernelModeStacks::FramePointers);
        assert_eq!(p.fallbacks.len(), 2, "{:?}", p.fallbacks);
        let f = &p.fallbacks[0];
        assert!(
            f.contains("bpf_get_attach_cookie") && f.contains("5.15") && f.contains("address"),
            "{f}"
        );
        let f = &p.fallbacks[1];
        assert!(
            f.contains("bpf_task_pt_regs") && f.contains("5.15") && f.contains("frame-pointer"),
            "{f}"
        );
    }

    /// Debian's 5.10 once the loader has found the registers on the task's
    /// stack (x86-64: 16 KiB stacks, 168-byte pt_regs).
    #[test]
    fn linux_5_10_reads_user_registers_from_the_task_stack_and_says_where() {
        let p = choose(&KernelFeatures {
            task_stack_regs: TaskStackRegs::Found {
                stack_offset: 24,
                regs_delta: 16384 - 168,
            },
            ..linux_5_10()
        })
        .unwrap();
        assert_eq!(p.kernel_mode_stacks, KernelModeStacks::UnwoundFromTaskStack);
        let f = &p.fallbacks[1];
        assert!(
            f.contains("bpf_task_pt_regs")
                && f.contains("task_struct.stack + 16216")
                && f.contains("byte 24")
                && !f.contains("frame-pointer"),
            "{f}"
        );
        // A kernel with the helper never uses the measurement.
        let p = choose(&KernelFeatures {
            task_stack_regs: TaskStackRegs::Found {
                stack_offset: 24,
                regs_delta: 16216,
            },
            ..linux_6_1()
        })
        .unwrap();
        assert_eq!(p.kernel_mode_stacks, KernelModeStacks::Unwound);
        assert!(p.fallbacks.is_empty(), "{:?}", p.fallbacks);
    }

    #[test]
    fn a_failed_or_disabled_measurement_falls_back_to_frame_pointers_and_says_why() {
        for (how, says) in [
            (
                TaskStackRegs::Failed("no struct task_struct".into()),
                "no struct task_struct",
            ),
            (TaskStackRegs::Disabled, "turned off"),
        ] {
            let p = choose(&KernelFeatures {
                task_stack_regs: how,
                ..linux_5_10()
            })
            .unwrap();
            assert_eq!(p.kernel_mode_stacks, KernelModeStacks::FramePointers);
            let f = &p.fallbacks[1];
            assert!(f.contains(says) && f.contains("frame-pointer"), "{f}");
        }
        let mut f = linux_6_1();
        apply_override(&mut f, "no_task_pt_regs,no_task_stack_regs").unwrap();
        assert!(!f.task_pt_regs);
        assert_eq!(f.task_stack_regs, TaskStackRegs::Disabled);
    }

    #[test]
    fn only_a_plausible_register_distance_is_believed() {
        let base = 0xffff_c900_0010_0000u64;
        assert_eq!(regs_delta(base, base + 16384 - 168).unwrap(), 16216);
        // arm64, 64 KiB pages.
        assert_eq!(regs_delta(base, base + 65536 - 336).unwrap(), 65200);
        for (stack, regs, says) in [
            (0, base, "read no stack base"),
            (base, 0, "read no stack base"),
            (base, base - 8, "not within"),
            (base, base, "not within"),
            (base, base + MAX_REGS_DELTA, "not within"),
            (base, base + 16383, "unaligned"),
        ] {
            let e = regs_delta(stack, regs).unwrap_err().to_string();
            assert!(e.contains(says), "{stack:#x} {regs:#x}: {e}");
        }
    }

    #[test]
    fn a_cookie_helper_without_perf_links_cannot_deliver_cookies() {
        let p = choose(&KernelFeatures {
            perf_link: false,
            ..linux_6_1()
        })
        .unwrap();
        assert_eq!(p.probe_identity, ProbeIdentity::Address);
        assert!(p.fallbacks[0].contains("perf-event bpf links"), "{p:?}");
    }

    #[test]
    fn no_ref_ctr_offset_falls_back_to_proc_mem_and_says_so() {
        let p = choose(&KernelFeatures {
            ref_ctr_offset: false,
            ..linux_5_10()
        })
        .unwrap();
        assert_eq!(p.semaphores, SemaphorePath::ProcMem);
        assert!(
            p.fallbacks
                .iter()
                .any(|f| f.contains("ref_ctr_offset") && f.contains("4.20")),
            "{:?}",
            p.fallbacks
        );
    }

    #[test]
    fn the_override_forces_fallbacks_and_rejects_unknown_items() {
        let mut f = linux_6_1();
        let note = apply_override(&mut f, "no_attach_cookie").unwrap().unwrap();
        assert!(note.contains("no_attach_cookie"), "{note}");
        assert_eq!(choose(&f).unwrap().probe_identity, ProbeIdentity::Address);
        let mut f = linux_6_1();
        apply_override(&mut f, " no_ref_ctr_offset , no_attach_cookie").unwrap();
        let p = choose(&f).unwrap();
        assert_eq!(p.semaphores, SemaphorePath::ProcMem);
        assert_eq!(p.probe_identity, ProbeIdentity::Address);
        let mut f = linux_6_1();
        assert_eq!(apply_override(&mut f, "").unwrap(), None);
        assert_eq!(f, linux_6_1());
        let e = apply_override(&mut f, "no_ringbuf")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no_ringbuf") && e.contains("hint"), "{e}");
    }

    #[test]
    fn missing_mandatory_features_are_all_named_with_their_version() {
        // Roughly 4.19 (Kylin V10, EulerOS): no ring buffer, no
        // probe_read_kernel, no BTF.
        let e = choose(&KernelFeatures {
            release: "4.19.90-24.4.v2101.ky10.aarch64".into(),
            btf: false,
            probe_read_kernel: false,
            ringbuf: false,
            ..linux_5_10()
        })
        .unwrap_err()
        .to_string();
        assert_eq!(e.lines().count(), 1, "{e}");
        for needle in [
            "4.19.90-24.4.v2101.ky10.aarch64",
            "BTF",
            "5.4",
            "bpf_probe_read_kernel",
            "5.5",
            "ring buffer",
            "5.8",
            "hint",
        ] {
            assert!(e.contains(needle), "{needle} missing from: {e}");
        }
        assert!(!e.contains("global data"), "{e}");
    }
}
