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
    spill::{EventPool, MemoryBudget},
    stacks::StackStore,
};
use crate::{
    bpf::Kernel,
    output::{
        Collectors,
        model::{Drops, OverBudget, WindowData},
    },
    types::Builtin,
};

/// Options of the built-in collectors (`attach`/`launch` flags).
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Collectors")]
pub struct CollectArgs {
    /// CPU sampling frequency of the `cpu` collector, per CPU (Hz).
    #[arg(long, value_name = "HZ", default_value_t = cpu::DEFAULT_HZ, allow_negative_numbers = true,
          value_parser = crate::cli::int(1u64, 10_000))]
    pub cpu_hz: u64,

    /// Trace another function as a runtime API (repeatable):
    /// OBJECT:SYMBOL[,name=LABEL][,wait|,collective] with the object grammar
    /// of --marker (exe, /path/in/target, library-name fragment). `,wait`
    /// counts its time as device wait, like the synchronize calls;
    /// `,collective` as collective wait, like c10d's work wait.
    #[arg(long = "api", value_name = "OBJECT:SYMBOL")]
    pub apis: Vec<String>,

    /// Memory dynprof may use for one window's data, e.g. 256MiB, 1GiB
    /// (64MiB to 1TiB). Events are spilled to an unnamed file while the
    /// window runs; a window denser than the budget keeps the events that
    /// fit and counts the rest (meta.json `memory.dropped_over_budget`).
    #[arg(long, value_name = "SIZE", default_value = "256MiB", value_parser = parse_budget)]
    pub memory_budget: MemoryBudget,

    /// Also look for separate debug files here (repeatable), by build id:
    /// DIR/.build-id/ab/cdef….debug, as GDB installs them; else by the
    /// name in the file's .gnu_debuglink (DIR/NAME, DIR/FILE-DIR/NAME).
    /// Stripped libraries and executables get their full symbol tables
    /// from them: for stack frames, and for --marker at a function they do
    /// not export. By build id, always searched after these: /usr/lib/debug
    /// inside the target's root, then on the host. By debug link, searched
    /// after the file's own directory, its .debug/ and
    /// /usr/lib/debug/FILE-DIR/ inside the target's root, as GDB does.
    #[arg(long = "debug-dir", value_name = "DIR")]
    pub debug_dirs: Vec<std::path::PathBuf>,
}

impl Default for CollectArgs {
    fn default() -> Self {
        Self {
            cpu_hz: cpu::DEFAULT_HZ,
            apis: Vec::new(),
            memory_budget: MemoryBudget::default(),
            debug_dirs: Vec::new(),
        }
    }
}

impl CollectArgs {
    pub fn options(&self) -> Result<CollectorOptions> {
        if self.cpu_hz == 0 || self.cpu_hz > 10_000 {
            bail!("--cpu-hz must be between 1 and 10000 (got {})", self.cpu_hz);
        }
        for d in &self.debug_dirs {
            if !d.is_dir() {
                bail!(
                    "--debug-dir {}: not a directory (hint: name the directory that holds .build-id/)",
                    d.display()
                );
            }
        }
        Ok(CollectorOptions {
            memory_budget: self.memory_budget,
            cpu_hz: self.cpu_hz,
            apis: self
                .apis
                .iter()
                .map(|s| apis::parse_api_spec(s))
                .collect::<Result<_>>()?,
            api_sets: apis::BUILTIN_SETS.to_vec(),
            debug_dirs: self.debug_dirs.clone(),
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
    /// Memory for one window's data (`--memory-budget`).
    pub memory_budget: MemoryBudget,
    /// Separate debug files' directories (`--debug-dir`).
    pub debug_dirs: Vec<std::path::PathBuf>,
}

impl Default for CollectorOptions {
    fn default() -> Self {
        Self {
            memory_budget: MemoryBudget::default(),
            cpu_hz: cpu::DEFAULT_HZ,
            apis: Vec::new(),
            api_sets: apis::BUILTIN_SETS.to_vec(),
            debug_dirs: Vec::new(),
        }
    }
}

/// Parses a `--collect` list (`api,cpu,offcpu`, any subset, any order, or
/// `all`).
pub fn parse_collect(list: &str) -> Result<Collectors> {
    let mut c = Collectors::NONE;
    for n in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match Builtin::from_name(n) {
            Some(b) => c.insert(b),
            None if n == "all" => c = Collectors::ALL,
            None => bail!(
                "--collect: unknown collector `{n}` (known: {})",
                Builtin::names()
            ),
        }
    }
    Ok(c)
}

/// One boxed collector per member of `which`, in the order api, cpu,
/// offcpu. `cpu` and `offcpu` share the stack store (the kernel's stack map
/// is global), so build them together; all share one [`EventPool`], the
/// window's event cap under `--memory-budget`.
pub fn build_collectors(which: &Collectors, opts: &CollectorOptions) -> Vec<Box<dyn Collector>> {
    let store = StackStore::shared(opts.debug_dirs.clone());
    let pool = EventPool::new(opts.memory_budget);
    let mut out: Vec<Box<dyn Collector>> = Vec::new();
    if which.has(Builtin::Api) {
        out.push(Box::new(ApiCollector::new(
            opts.api_sets.clone(),
            opts.apis.clone(),
            pool.clone(),
        )));
    }
    if which.has(Builtin::Cpu) {
        out.push(Box::new(CpuCollector::new(
            opts.cpu_hz,
            store.clone(),
            pool.clone(),
        )));
    }
    if which.has(Builtin::Offcpu) {
        out.push(Box::new(OffCpuCollector::new(store, pool)));
    }
    out
}

/// Records the budget a collector ran under, and (through `set`) its own
/// slot of events dropped past the cap.
pub fn note_budget(data: &mut WindowData, pool: &EventPool, set: impl FnOnce(&mut OverBudget)) {
    let b = pool.budget();
    data.budget.budget_bytes = b.bytes();
    data.budget.events_cap = b.events_cap();
    set(&mut data.budget.dropped_over_budget);
}

/// `--memory-budget` at parse time: a bad size is refused before attaching.
fn parse_budget(s: &str) -> Result<MemoryBudget> {
    s.parse()
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
        let kinds: Vec<Builtin> = build_collectors(&Collectors::ALL, &CollectorOptions::default())
            .iter()
            .map(|c| c.kind())
            .collect();
        assert_eq!(kinds, Builtin::ALL);
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
    fn options_validate() {
        let a = CollectArgs {
            cpu_hz: 0,
            ..Default::default()
        };
        assert!(a.options().is_err());
        let a = CollectArgs {
            cpu_hz: 99,
            apis: vec!["exe:f,wait".into()],
            ..Default::default()
        };
        let o = a.options().unwrap();
        assert_eq!(o.apis[0].class, crate::output::model::ApiClass::DeviceWait);
        assert_eq!(o.memory_budget.bytes(), 256 << 20);
        for bad in ["inf", "nan", "-1", "1e300", "12XB", "1MiB"] {
            let e = parse_budget(bad).unwrap_err().to_string();
            assert!(e.contains("--memory-budget"), "{bad}: {e}");
        }
        assert_eq!(parse_budget("1GiB").unwrap().bytes(), 1 << 30);
    }
}
