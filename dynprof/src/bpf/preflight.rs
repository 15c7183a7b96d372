//! Before bpf(2): the kernel features and privileges dynprof needs, each
//! missing one named in one line.
use std::path::Path;

use anyhow::{Context as _, Result, bail};

/// Checks the kernel and our privileges before touching bpf(2), so the
/// user gets one actionable line instead of an EPERM from deep inside aya.
pub fn preflight() -> Result<()> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let cap_eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    preflight_at(Path::new("/"), cap_eff)
}

/// [`preflight`] against a root directory holding `sys/` and a CapEff mask
/// (separate so the messages can be tested without such a kernel).
pub(super) fn preflight_at(root: &Path, cap_eff: u64) -> Result<()> {
    if !root.join("sys/bus/event_source/devices/uprobe").exists() {
        bail!(
            "this kernel has no uprobe support (/sys/bus/event_source/devices/uprobe is missing) \
             (hint: dynprof needs a kernel built with CONFIG_UPROBE_EVENTS=y)"
        );
    }
    if !root.join("sys/kernel/btf/vmlinux").exists() {
        bail!(
            "this kernel exposes no BTF (/sys/kernel/btf/vmlinux is missing) \
             (hint: dynprof needs a kernel built with CONFIG_DEBUG_INFO_BTF=y)"
        );
    }
    let has = |bit: u32| cap_eff & (1u64 << bit) != 0;
    const CAP_SYS_ADMIN: u32 = 21;
    const CAP_PERFMON: u32 = 38;
    const CAP_BPF: u32 = 39;
    if !has(CAP_SYS_ADMIN) {
        let missing: Vec<&str> = [(CAP_BPF, "CAP_BPF"), (CAP_PERFMON, "CAP_PERFMON")]
            .iter()
            .filter(|(b, _)| !has(*b))
            .map(|(_, n)| *n)
            .collect();
        if !missing.is_empty() {
            bail!(
                "missing privileges: {} (hint: run with sudo, or grant CAP_BPF+CAP_PERFMON+CAP_SYS_PTRACE)",
                missing.join(" and ")
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
