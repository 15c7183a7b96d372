//! Section 12: the per-hit probe cost in QEMU VMs (Linux 5.10 on x86-64 and
//! on aarch64), as ratios only: TCG emulates the CPU, so its absolute
//! times say nothing about hardware. Each VM runs bench/hitloop and
//! `dynprof __probe-cost --hitloop` (`cargo xtask vm-test --probe-cost`):
//! marker ÷ empty uprobe per site, where 5.10 has no attach cookies and the
//! marker is the `_ip` program that finds its marker by probe address.
//!
//! The sites are the same four functions; what the kernel does at each
//! differs by architecture:
//! - x86-64: `push %rbx` is emulated; the 5-byte nop (emulated only in
//!   newer kernels), the rip-relative `mov` and `endbr64` are single-stepped
//!   out of line on 5.10;
//! - arm64: `stp x29, x30, [sp, #-16]!` (the usual prologue) and `nop`
//!   are single-stepped out of line on 5.10, `adrp` and `b` simulated.

use std::time::Duration;

use anyhow::Result;

use super::{
    Ctx, Section,
    fig::{Figure, Goal, Unit},
    json::{self, Json},
    say,
};
use crate::vm::{self, Arch};

/// (arch, Debian kernel ABI, name, per-site description).
const VMS: [(Arch, &str, &str, [&str; 4]); 2] = [
    (
        Arch::X86_64,
        "5.10.0-30",
        "5.10 x86-64",
        [
            "push %rbx (emulated)",
            "5-byte nop (single-stepped on 5.10)",
            "rip-relative mov (single-stepped)",
            "endbr64 (single-stepped)",
        ],
    ),
    (
        Arch::Aarch64,
        "5.10.0-30",
        "5.10 aarch64",
        [
            "stp x29, x30 prologue (single-stepped)",
            "nop (single-stepped on 5.10)",
            "adrp (simulated)",
            "b (simulated)",
        ],
    ),
];
const SITES: [&str; 4] = ["push", "nop5", "riprel", "endbr"];

pub fn run(ctx: &Ctx) -> Result<Section> {
    let mut s = Section::new("");
    let reps = ctx.reps();
    let n = if ctx.quick() { 5_000 } else { 20_000 };
    let mut raw = Vec::new();
    for (arch, kernel, name, what) in VMS {
        let o = vm::Options {
            arch,
            kernel: kernel.to_string(),
            timeout: Duration::from_secs(45 * 60),
            only: Vec::new(),
            repeat: 1,
        };
        say(format!(
            "later: {name}: {reps} repetitions of {n} calls per site"
        ));
        let key = name.replace([' ', '.', '-'], "_");
        match vm::probe_cost::run(&o, reps, n) {
            Ok(samples) => {
                for r in vm::probe_cost::ratios(&samples) {
                    let i = SITES.iter().position(|x| *x == r.site).unwrap_or(0);
                    s.figures.push(
                        Figure::new(
                            &format!("vm_{key}_{}_marker_over_empty", r.site),
                            &format!("{name} VM: marker ÷ empty uprobe, {}", what[i]),
                            Unit::Ratio,
                            Goal::Info,
                            "",
                        )
                        .samples(r.ratios)
                        .note(match r.first_insn.as_str() {
                            "?" => {
                                "QEMU TCG, ratio only; dynprof decodes first_insn on x86-64 only"
                                    .to_string()
                            }
                            c => format!("QEMU TCG, ratio only; dynprof decoded the site as `{c}`"),
                        }),
                    );
                }
                let text = format!(
                    "[{}]",
                    samples
                        .iter()
                        .map(|v| v.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                );
                raw.push((key, json::parse(&text).unwrap_or(Json::Arr(Vec::new()))));
            }
            Err(e) => {
                say(format!("later: {name}: {e:#}"));
                s.figures.push(
                    Figure::new(
                        &format!("vm_{key}_probe_ratios"),
                        &format!("{name} VM: marker ÷ empty uprobe"),
                        Unit::Ratio,
                        Goal::Info,
                        "",
                    )
                    .missing(format!("could not run: {e:#}")),
                );
                raw.push((key, Json::obj(vec![("error", Json::s(format!("{e:#}")))])));
            }
        }
    }
    s.raw = Json::Obj(raw);
    Ok(s)
}
