//! `cargo xtask`: developer and CI tasks for dynprof.
//!
//! - `setup`: idempotent machine setup (nightly + rust-src, bpf-linker built
//!   against the nightly's LLVM, Debian packages the tests need, tracefs,
//!   and a cached PyTorch 2.x venv outside the checkout).
//! - `test`:  setup, build, then every test in the workspace, then every
//!   fuzz target for a bounded time.
//! - `demo`:  setup, build, start the sample trainer, attach to it for 5 s.
//! - `bench`: overhead, trigger precision, attach time, throughput and
//!   footprint, side by side with the alternatives (`bench --quick` < 5 min).
//! - `fuzz`:  the libFuzzer targets for parsers of target-controlled input.
//! - `vm-test`: boot a Debian kernel (5.10, 6.1; x86-64 or aarch64) under
//!   QEMU and run the kernel-sensitive integration tests in it.

mod bench;
mod demo;
mod fixtures;
mod fuzz;
mod pyroots;
mod setup;
mod test;
mod util;
mod vm;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "dynprof developer tasks",
    bin_name = "cargo xtask"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install/verify everything the build and the tests need (idempotent).
    Setup,
    /// Run setup, build the workspace, then run every test (unit + privileged
    /// integration), then each fuzz target for 20 s, then the VM kernel
    /// matrix (`vm-test` on x86-64 5.10 and 6.1).
    ///
    /// Arguments after `--` go to `cargo test`; a second `--` passes the rest
    /// to the test harness, e.g. `cargo xtask test -- -p dynprof --test fixtures_smoke -- --nocapture`.
    /// Such a selected run skips the fuzz targets.
    Test {
        /// Do not run the fuzz targets.
        #[arg(long)]
        no_fuzz: bool,
        /// Do not run the kernel matrix in QEMU (`vm-test`, about 5 min).
        #[arg(long)]
        no_vm: bool,
        /// Extra arguments for `cargo test`.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Run setup, build, start the sample trainer and attach dynprof to it for a few seconds.
    Demo,
    /// Benchmarks: prints one table (figures beside their targets) and writes
    /// bench/results.json. `cargo xtask bench --quick` finishes in < 5 min.
    /// Options: --quick, --reps N, --only probe,torch,attach,api,trigger, --out FILE.
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Run the libFuzzer targets (fuzz/, docs/fuzzing.md) for a bounded time:
    /// `cargo xtask fuzz [--seconds N] [--list] [TARGET]...` (default 20 s each, all targets).
    Fuzz {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Boot a Debian kernel package under QEMU (TCG) with the host's root
    /// over 9p and run the kernel-sensitive integration tests inside
    /// (docs/portability.md). Kernels are cached in /var/cache/dynprof/vm.
    VmTest {
        #[arg(long, value_enum, default_value = "x86_64")]
        arch: vm::Arch,
        /// Debian kernel ABI version: 5.10.0-N (bullseye) or 6.1.0-N (bookworm).
        #[arg(long, default_value = "5.10.0-30")]
        kernel: String,
        /// Stop the VM after this many minutes.
        #[arg(long, default_value_t = 30)]
        timeout_min: u64,
        /// Run only this test binary (repeatable), e.g. `--only kernel_compat`.
        #[arg(long)]
        only: Vec<String>,
        /// Run each chosen test binary this many times in the one boot (to
        /// chase a failure seen once in CI).
        #[arg(long, default_value_t = 1)]
        repeat: u32,
        /// Instead of the tests: the per-hit probe cost (bench/hitloop and
        /// `dynprof __probe-cost --hitloop`), printed as marker ÷ empty
        /// ratios per site (what `cargo xtask bench` section 12 reports).
        #[arg(long)]
        probe_cost: bool,
        /// With --probe-cost: repetitions and calls per timed loop.
        #[arg(long, default_value_t = 5)]
        reps: usize,
        #[arg(long, default_value_t = 20_000)]
        n: u64,
    },
}

fn main() {
    let cli = Cli::parse();
    let result: Result<()> = match cli.cmd {
        Cmd::Setup => setup::run_with_torch2(),
        Cmd::Test {
            no_fuzz,
            no_vm,
            args,
        } => test::run(
            &args,
            !no_fuzz && args.is_empty(),
            !no_vm && args.is_empty(),
        ),
        Cmd::Demo => demo::run(),
        Cmd::Bench { args } => bench::run(&args),
        Cmd::Fuzz { args } => fuzz::run(&args),
        Cmd::VmTest {
            arch,
            kernel,
            timeout_min,
            only,
            repeat,
            probe_cost,
            reps,
            n,
        } => {
            let o = vm::Options {
                arch,
                kernel,
                timeout: std::time::Duration::from_secs(timeout_min * 60),
                only,
                repeat,
            };
            if probe_cost {
                vm::probe_cost::run(&o, reps, n).map(|samples| {
                    for l in &samples {
                        println!("{l}");
                    }
                    for r in vm::probe_cost::ratios(&samples) {
                        println!(
                            "[vm-test] {} ({}): marker ÷ empty {:?}",
                            r.site, r.first_insn, r.ratios
                        );
                    }
                })
            } else {
                vm::run(&o)
            }
        }
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
