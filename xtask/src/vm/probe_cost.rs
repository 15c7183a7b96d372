//! `cargo xtask vm-test --probe-cost`: the per-hit probe cost in the VM, as
//! ratios only (TCG emulates the CPU, so absolute times mean nothing).
//!
//! bench/hitloop and dynprof are built for the VM's architecture on the
//! host; inside, `dynprof __probe-cost --hitloop` times each site bare,
//! with the empty uprobe and with the marker program (through the kernel's
//! own path: attach cookies or, below 5.15, the probe address), and prints
//! one JSON `sample` line per loop. `cargo xtask bench` (section 12) calls
//! [`run`] and reports marker ÷ empty per site.
use serde_json::Value;

use super::*;

/// Boots the VM of `o`, runs the measurement, returns its `sample` lines.
pub fn run(o: &Options, reps: usize, n: u64) -> Result<Vec<Value>> {
    let b = prepare(o)?;
    say("building dynprof and bench/hitloop for the VM");
    let (dynprof, hitloop) = build(o.arch)?;
    let script = format!(
        "cd '{root}'\nexport PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root\n\
         read up _ < /proc/uptime; echo \"TESTS-START $up\"\n\
         '{dynprof}' __probe-cost --hitloop '{hitloop}' --n {n} --reps {reps} \
         > /vm-out/probe-cost.jsonl 2> /vm-out/probe-cost.err\n\
         echo $? > /vm-out/rc\n\
         read up _ < /proc/uptime; echo \"TESTS-END $up\"\n",
        root = util::workspace_root().display(),
        dynprof = dynprof.display(),
        hitloop = hitloop.display(),
    );
    let dir = run_dir(&b, &script)?;
    say(&format!(
        "booting Debian {}'s {} under {} (TCG) for the probe cost",
        b.suite,
        b.release,
        o.arch.qemu()
    ));
    qemu(o, &b.vmlinuz, &b.initrd, &dir)?;
    let out = std::fs::read_to_string(dir.join("probe-cost.jsonl")).unwrap_or_default();
    let err = std::fs::read_to_string(dir.join("probe-cost.err")).unwrap_or_default();
    let rc = std::fs::read_to_string(dir.join("rc")).ok();
    let _ = std::fs::remove_dir_all(&dir);
    let samples: Vec<Value> = out
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "sample")
        .collect();
    match rc.as_deref().map(str::trim) {
        Some("0") if !samples.is_empty() => Ok(samples),
        Some(code) => bail!(
            "__probe-cost in the VM failed (exit {code}): {}",
            err.lines().rev().take(5).collect::<Vec<_>>().join(" | ")
        ),
        None => bail!("the VM produced no result (it did not boot, or timed out)"),
    }
}

/// dynprof and hitloop for `arch`.
fn build(arch: Arch) -> Result<(PathBuf, PathBuf)> {
    let mut cmd = util::cargo();
    cmd.args(["build", "-p", "dynprof"]);
    let mut dir = util::target_dir();
    if let Some(t) = arch.rust_target() {
        cmd.args(["--target", t]);
        dir = dir.join(t);
    }
    util::run(&mut cmd).context("building dynprof for the VM")?;
    let bench = dir.join("bench");
    std::fs::create_dir_all(&bench)?;
    let hitloop = bench.join("hitloop");
    let cc = match arch {
        Arch::X86_64 => "gcc",
        Arch::Aarch64 => "aarch64-linux-gnu-gcc",
    };
    util::run(
        Command::new(cc)
            .args(["-O2", "-g", "-fno-omit-frame-pointer", "-o"])
            .arg(&hitloop)
            .arg(util::workspace_root().join("bench/hitloop.c")),
    )
    .with_context(|| format!("compiling bench/hitloop.c with {cc}"))?;
    Ok((dir.join("debug/dynprof"), hitloop))
}

/// marker ÷ empty uprobe at one site, one value per repetition.
#[derive(Debug, PartialEq)]
pub struct SiteRatio {
    pub site: String,
    /// The class dynprof decoded (`push`, `nop`, `branch`, `other`, …).
    pub first_insn: String,
    pub ratios: Vec<f64>,
}

/// Per repetition and site: (t_marker − t_bare) ÷ (t_empty − t_bare), on
/// the looping thread's CPU time.
pub fn ratios(samples: &[Value]) -> Vec<SiteRatio> {
    let mut out: Vec<SiteRatio> = Vec::new();
    let t = |rep: &Value, site: &str, cond: &str| -> Option<f64> {
        samples
            .iter()
            .find(|s| s["rep"] == *rep && s["site"] == site && s["cond"] == cond)?["thread_ns"]
            .as_f64()
    };
    for s in samples.iter().filter(|s| s["cond"] == "marker") {
        let site = s["site"].as_str().unwrap_or("?");
        let (Some(bare), Some(empty), Some(marker)) = (
            t(&s["rep"], site, "bare"),
            t(&s["rep"], site, "empty"),
            t(&s["rep"], site, "marker"),
        ) else {
            continue;
        };
        let r = (marker - bare) / (empty - bare);
        match out.iter_mut().find(|o| o.site == site) {
            Some(o) => o.ratios.push(r),
            None => out.push(SiteRatio {
                site: site.to_string(),
                first_insn: s["first_insn"].as_str().unwrap_or("?").to_string(),
                ratios: vec![r],
            }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_per_repetition_and_site() {
        let line = |rep: u64, site: &str, cond: &str, ns: u64| {
            serde_json::json!({"event": "sample", "rep": rep, "site": site, "cond": cond,
                "thread_ns": ns, "first_insn": if cond == "bare" { Value::Null } else { "push".into() }})
        };
        let s = vec![
            line(0, "push", "bare", 100),
            line(0, "push", "empty", 300),
            line(0, "push", "marker", 350),
            line(1, "push", "marker", 500),
            line(1, "push", "bare", 100),
            line(1, "push", "empty", 300),
            // A site without its empty loop yields nothing.
            line(0, "nop5", "bare", 100),
            line(0, "nop5", "marker", 200),
        ];
        assert_eq!(
            ratios(&s),
            vec![SiteRatio {
                site: "push".into(),
                first_insn: "push".into(),
                ratios: vec![1.25, 2.0],
            }]
        );
    }
}
