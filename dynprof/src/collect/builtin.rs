//! The built-in eBPF collectors as a set: `--collect api,cpu,offcpu`,
//! `--cpu-hz`, `--api`, and [`build_collectors`], which the window
//! scheduler registers (it arms, drains and disarms them through the
//! [`Collector`] trait only).
use anyhow::{Result, bail};
use clap::Args;

use super::{
    Collector,
    api::ApiCollector,
    apis::{self, ApiSet, ApiSpec},
    cpu::{self, CpuCollector},
    offcpu::OffCpuCollector,
    stacks::StackStore,
};
use crate::{
    bpf::Kernel,
    output::{Collectors, model::Drops},
};

/// Names `--collect` accepts, in output order.
pub const NAMES: &[&str] = &["api", "cpu", "offcpu"];

/// Options of the built-in collectors (`attach`/`launch` flags).
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Collectors")]
pub struct CollectArgs {
    /// CPU sampling frequency of the `cpu` collector, per CPU (Hz).
    #[arg(long, value_name = "HZ", default_value_t = cpu::DEFAULT_HZ, allow_negative_numbers = true,
          value_parser = crate::cli::int(1u64, 10_000))]
    pub cpu_hz: u64,

    /// Trace another function as a runtime API (repeatable):
    /// OBJECT:SYMBOL[,name=LABEL][,wait] with the object grammar of --marker
    /// (exe, /path/in/target, library-name fragment). `,wait` counts its
    /// time as device wait, like the synchronize calls.
    #[arg(long = "api", value_name = "OBJECT:SYMBOL")]
    pub apis: Vec<String>,
}

impl Default for CollectArgs {
    fn default() -> Self {
        Self {
            cpu_hz: cpu::DEFAULT_HZ,
            apis: Vec::new(),
        }
    }
}

impl CollectArgs {
    pub fn options(&self) -> Result<CollectorOptions> {
        if self.cpu_hz == 0 || self.cpu_hz > 10_000 {
            bail!("--cpu-hz must be between 1 and 10000 (got {})", self.cpu_hz);
        }
        Ok(CollectorOptions {
            cpu_hz: self.cpu_hz,
            apis: self
                .apis
                .iter()
                .map(|s| apis::parse_api_spec(s))
                .collect::<Result<_>>()?,
            api_sets: apis::BUILTIN_SETS.to_vec(),
        })
    }
}

/// What [`build_collectors`] needs.
#[derive(Clone, Debug)]
pub struct CollectorOptions {
    pub cpu_hz: u64,
    /// User-added APIs (`--api`).
    pub apis: Vec<ApiSpec>,
    /// Built-in API sets to probe (default: CANN, CUDA runtime, CUDA driver).
    pub api_sets: Vec<ApiSet>,
}

impl Default for CollectorOptions {
    fn default() -> Self {
        Self {
            cpu_hz: cpu::DEFAULT_HZ,
            apis: Vec::new(),
            api_sets: apis::BUILTIN_SETS.to_vec(),
        }
    }
}

/// Parses a `--collect` list (`api,cpu,offcpu`, any subset, any order).
pub fn parse_collect(list: &str) -> Result<Collectors> {
    collectors_from_names(list.split(',').map(str::trim).filter(|s| !s.is_empty()))
}

/// The set named by `names`; an unknown name is an error.
pub fn collectors_from_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<Collectors> {
    let mut c = Collectors::NONE;
    for n in names {
        match n {
            "api" => c.api = true,
            "cpu" => c.cpu = true,
            "offcpu" => c.offcpu = true,
            "all" => c = Collectors::ALL,
            _ => bail!(
                "--collect: unknown collector `{n}` (known: {})",
                NAMES.join(",")
            ),
        }
    }
    Ok(c)
}

/// One boxed collector per member of `which`, in the order api, cpu,
/// offcpu. `cpu` and `offcpu` share the stack store (the kernel's stack map
/// is global), so build them together.
pub fn build_collectors(which: &Collectors, opts: &CollectorOptions) -> Vec<Box<dyn Collector>> {
    let store = StackStore::shared();
    let mut out: Vec<Box<dyn Collector>> = Vec::new();
    if which.api {
        out.push(Box::new(ApiCollector::new(
            opts.api_sets.clone(),
            opts.apis.clone(),
        )));
    }
    if which.cpu {
        out.push(Box::new(CpuCollector::new(opts.cpu_hz, store.clone())));
    }
    if which.offcpu {
        out.push(Box::new(OffCpuCollector::new(store)));
    }
    out
}

/// Kernel losses since a collector was armed (or last drained). Armed at
/// least one boundary before the gate opens, a collector's programs emit
/// nothing until then, so `take` at the window's end counts exactly the
/// window's losses of that collector's slots (each collector fills only its
/// own: `api`+`api_nesting`, `cpu`+`cpu_stack`, `offcpu`+`offcpu_stack`).
#[derive(Default)]
pub struct DropBase {
    base: Option<Drops>,
    disarmed: bool,
}

impl DropBase {
    pub fn arm(&mut self, kernel: &Kernel) {
        if self.base.is_none() || self.disarmed {
            self.base = kernel.drops().ok();
            self.disarmed = false;
        }
    }

    /// Losses since `arm` or the previous `take`; restarts the count.
    pub fn take(&mut self, kernel: &Kernel) -> Drops {
        let Ok(now) = kernel.drops() else {
            return Drops::default();
        };
        let then = self
            .base
            .replace(now.clone())
            .unwrap_or_else(|| now.clone());
        Drops {
            step: now.step.saturating_sub(then.step),
            api: now.api.saturating_sub(then.api),
            cpu: now.cpu.saturating_sub(then.cpu),
            offcpu: now.offcpu.saturating_sub(then.offcpu),
            cpu_stack: now.cpu_stack.saturating_sub(then.cpu_stack),
            offcpu_stack: now.offcpu_stack.saturating_sub(then.offcpu_stack),
            api_nesting: now.api_nesting.saturating_sub(then.api_nesting),
        }
    }

    /// Disarmed: the next `arm` starts a new count (losses between windows
    /// belong to none), while a `take` before it still sees this one.
    pub fn disarm(&mut self) {
        self.disarmed = true;
    }
}

/// Moves the events of `[start, end)` out of `buf` (by `ts`), drops older
/// ones (warmup, or calls that began before the window), and keeps newer
/// ones for the next window.
pub fn take_window<T>(buf: &mut Vec<T>, start: u64, end: u64, ts: impl Fn(&T) -> u64) -> Vec<T> {
    let mut inside = Vec::new();
    let mut later = Vec::new();
    for e in buf.drain(..) {
        let t = ts(&e);
        if t >= end {
            later.push(e);
        } else if t >= start {
            inside.push(e);
        }
    }
    *buf = later;
    inside
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collect_lists() {
        assert_eq!(parse_collect("api,cpu,offcpu").unwrap(), Collectors::ALL);
        let c = parse_collect("cpu").unwrap();
        assert!(c.cpu && !c.api && !c.offcpu);
        let c = parse_collect(" offcpu , api ").unwrap();
        assert!(c.api && c.offcpu && !c.cpu);
        assert!(parse_collect("gpu").is_err());
        let names: Vec<&str> = build_collectors(&Collectors::ALL, &CollectorOptions::default())
            .iter()
            .map(|c| c.name())
            .collect();
        assert_eq!(names, NAMES);
        assert_eq!(
            build_collectors(
                &parse_collect("offcpu").unwrap(),
                &CollectorOptions::default()
            )
            .len(),
            1
        );
    }

    #[test]
    fn window_split() {
        let mut buf = vec![5u64, 10, 15, 20, 25];
        assert_eq!(take_window(&mut buf, 10, 20, |x| *x), vec![10, 15]);
        assert_eq!(buf, vec![20, 25]);
    }

    #[test]
    fn options_validate() {
        let a = CollectArgs {
            cpu_hz: 0,
            apis: vec![],
        };
        assert!(a.options().is_err());
        let a = CollectArgs {
            cpu_hz: 99,
            apis: vec!["exe:f,wait".into()],
        };
        let o = a.options().unwrap();
        assert!(o.apis[0].device_wait);
    }
}
