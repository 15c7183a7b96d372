//! `cargo xtask vm-test [--arch x86_64|aarch64] [--kernel VERSION]`: boots a
//! Debian kernel package under QEMU (TCG: no usable KVM on CI machines) and
//! runs a privileged subset of the integration tests inside
//! (docs/portability.md).
//!
//! The VM sees the host's root read-only over 9p, under a tmpfs overlay, so
//! everything built on the host (test binaries, fixtures, python3) runs in
//! it at the same paths, and the tests may write where they write on the
//! host. A busybox initramfs loads the virtio and 9p modules of the kernel
//! package, mounts that, and chroots in. Results come back through a second,
//! writable 9p share.
//!
//! Kernel packages come from Debian through the configured mirror, with a
//! private apt state directory (the machine's own apt sources stay as they
//! are), and are cached under [`cache_dir`], never in the checkout: a
//! second run downloads nothing.
use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader, Write as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{fixtures, setup, util};

mod image;
pub mod probe_cost;
use image::*;

/// Where kernels, apt state and initramfs images are kept between runs.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("DYNPROF_VM_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/dynprof/vm"))
}

/// Downloads (once, into the VM cache's private apt state: bookworm and
/// bullseye) Debian packages for the arm64 VM; returns their .debs.
pub fn arm64_debs(pkgs: &[&str]) -> Result<Vec<PathBuf>> {
    let cache = cache_dir();
    pkgs.iter()
        .map(|p| download(&cache, p, Arch::Aarch64))
        .collect()
}

/// Downloads (once) bookworm's arm64 `pkg` and its whole dependency
/// closure into `into`; returns the .debs.
pub fn arm64_closure(pkg: &str, into: &Path) -> Result<Vec<PathBuf>> {
    image::closure_arm64(&cache_dir(), pkg, into)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Arch {
    #[value(name = "x86_64")]
    X86_64,
    #[value(name = "aarch64")]
    Aarch64,
}

impl Arch {
    fn deb(self) -> &'static str {
        match self {
            Arch::X86_64 => "amd64",
            Arch::Aarch64 => "arm64",
        }
    }
    fn qemu(self) -> &'static str {
        match self {
            Arch::X86_64 => "qemu-system-x86_64",
            Arch::Aarch64 => "qemu-system-aarch64",
        }
    }
    fn qemu_package(self) -> &'static str {
        match self {
            Arch::X86_64 => "qemu-system-x86",
            Arch::Aarch64 => "qemu-system-arm",
        }
    }
    fn machine(self) -> &'static [&'static str] {
        match self {
            // One host thread runs both vCPUs. With multi-threaded TCG the
            // x86-64 guests hung in tests that attach tracepoints (twice
            // on 5.10, in `unwind_native_offcpu_stacks_are_unwound_at_the_switch`
            // and `collectors_offcpu_tells_preempted_from_blocked`; twice
            // on 6.1): one vCPU spinning at a site whose static branch the
            // other was rewriting with x86's int3-based text_poke_bp, which
            // relies on cross-modifying code being seen at the next
            // serialising instruction — what QEMU's per-vCPU translated
            // blocks do not promise. arm64 patches text under stop_machine
            // and never hung, so it keeps a thread per vCPU.
            Arch::X86_64 => &["-accel", "tcg,thread=single"],
            Arch::Aarch64 => &["-M", "virt", "-cpu", "max"],
        }
    }
    fn console(self) -> &'static str {
        match self {
            Arch::X86_64 => "ttyS0",
            Arch::Aarch64 => "ttyAMA0",
        }
    }
    /// The Rust target the binaries in the VM must be built for; `None`
    /// builds for the host.
    pub fn rust_target(self) -> Option<&'static str> {
        match self {
            Arch::X86_64 => None,
            Arch::Aarch64 => Some("aarch64-unknown-linux-gnu"),
        }
    }
}

pub struct Options {
    pub arch: Arch,
    /// Debian's kernel ABI version, e.g. `5.10.0-30` or `6.1.0-28`.
    pub kernel: String,
    pub timeout: Duration,
    /// Run only these test binaries of [`VM_TESTS`] (all when empty).
    pub only: Vec<String>,
    /// Run each chosen test binary this many times.
    pub repeat: u32,
}

/// Debian's python3.11 running py_hot.py (tests/python_versions.rs), in
/// both architectures' VMs.
const PYTHON311_VM_TESTS: (&str, &[&str]) = (
    "python_versions",
    &[
        "python311_hot_function_under_its_caller",
        "python311_hot_function_behind_many_threads",
        "python311_offcpu_queue_wait",
    ],
);

/// The tests run in the arm64 VM: the host root's tools (make, python3,
/// flock) are x86-64 there, so only tests whose targets are the fixtures,
/// prebuilt for arm64 on the host, or the unpacked arm64 interpreters
/// (python3.11 alone, and python3.11 with torch 1.13) can run.
const VM_TESTS_AARCH64: &[(&str, &[&str])] = &[
    ("kernel_compat", &[]),
    (
        "attach_trainer",
        &["attach_trainer_one_event_per_optimizer_step_inside_its_call"],
    ),
    // The Python one on the unpacked arm64 python3.11 (`torch_python`),
    // whose USDT operands are arm64's (`8@x0`) and whose semaphore the
    // kernel raises.
    ("usdt_attach", &[]),
    ("collectors", &["collectors_acl_device_bound"]),
    (
        "windows",
        &["windows_plan_records_exactly_the_planned_steps"],
    ),
    // Python frames on Debian's own arm64 CPython 3.11 (unpacked by
    // `cargo xtask setup`): its `_PyRuntime` puts the current thread 16
    // bytes further than x86-64's, and its native frames are unwound from
    // `.eh_frame` by framehop's aarch64 unwinder. On cpu samples and at
    // off-CPU switches.
    PYTHON311_VM_TESTS,
    // arm64's registers in the stack copy (x29, x30, sp, pc, pstate) and
    // framehop's aarch64 unwinder, on the cross-built `deepstack`; in
    // kernel mode, the registers read at the top of the task's kernel
    // stack (5.10 has no bpf_task_pt_regs), as on a Kunpeng host running
    // openEuler 22.03. And the vDSO: under arm64 TCG its clock reads the
    // generic timer from user mode (on x86-64 TCG it is a system call).
    // And `.debug_frame` (built with -fno-unwind-tables
    // -fno-asynchronous-unwind-tables: arm64 gcc emits .eh_frame without
    // the first).
    (
        "unwind_native",
        &[
            "unwind_native_chain_without_frame_pointers",
            "unwind_native_chain_from_debug_frame",
            "unwind_native_kernel_mode_samples_keep_their_user_stack",
            "unwind_native_through_the_vdso",
            // A leaf in JIT code on arm64 returns through x30, not the
            // stack: the unwinder's link-register path.
            "unwind_native_through_jit_code",
            // libtorch's arm64 code unwound from its `.eh_frame`.
            "unwind_native_pytorch_stacks_are_deep",
        ],
    ),
    // Real PyTorch on arm64: bookworm's arm64 python3-torch 1.13 (unpacked
    // by `cargo xtask setup`), whose import takes minutes under TCG. The
    // step marker (`--marker auto`) resolved in arm64 libtorch, one step
    // per optimizer.step() inside its call, backward passes as aux.
    ("pytorch_attach", &["pytorch_auto_sgd"]),
];

/// The tests run in the VM: (test binary, exact test names; empty = all).
/// Chosen to cover what differs between kernels: marker attach (native
/// and USDT, with and without kernel-owned semaphores), exact windows, the
/// api collector's entry/return pairing, and the cpu program's stack copy.
const VM_TESTS: &[(&str, &[&str])] = &[
    ("kernel_compat", &[]),
    (
        "attach_trainer",
        &["attach_trainer_one_event_per_optimizer_step_inside_its_call"],
    ),
    ("usdt_attach", &[]),
    ("collectors", &["collectors_acl_device_bound"]),
    (
        "windows",
        &["windows_plan_records_exactly_the_planned_steps"],
    ),
    // Aux markers attached and detached around each window: on 5.10 by
    // probe address, registered again each time.
    (
        "aux_windows",
        &["aux_marker_attached_again_for_each_window"],
    ),
    // The CPython frame walk on Debian's python3.11 (pure Python, no
    // PyTorch, whose import takes minutes under TCG): cpu samples, the
    // GIL holder behind 70 idle threads, and off-CPU switches. These load
    // the cpu and sched_switch programs with the walk live, the largest
    // programs the 5.10 verifier sees (for other targets it prunes the
    // walk as dead code).
    PYTHON311_VM_TESTS,
    // A target in its own PID namespace (unshare), found by its inner PID.
    // (Not here: `library_only_in_the_target_mount_namespace`, whose
    // expected path is the host's, not the guest's 9p overlay path; the
    // msprof stand-in, a Python program that under TCG starts 1.4 s after
    // the window's first boundary; real PyTorch, whose import takes
    // minutes under TCG: it runs in the arm64 guest, where it matters.)
    ("containers", &["attach_by_inner_pid_in_pidns"]),
    // The stack copy, whose constant-size reads are what the 5.10 verifier
    // is strictest about. And the user stacks of kernel-mode samples:
    // unwound from bpf_task_pt_regs on 6.1, from the registers at the top
    // of the task's kernel stack on 5.10.
    (
        "unwind_native",
        &[
            "unwind_native_chain_without_frame_pointers",
            "unwind_native_kernel_mode_samples_keep_their_user_stack",
        ],
    ),
];

/// Added on every kernel, on both architectures: the switch-outs' user
/// stacks (unwound from the registers on the task's kernel stack before
/// 5.15, from bpf_task_pt_regs after), and preempted time told from
/// blocked. Both attach tracepoints while two vCPUs run system calls;
/// with multi-threaded TCG that hung the x86-64 guests now and then (see
/// `Arch::machine`).
const VM_TESTS_OFFCPU: &[(&str, &[&str])] = &[
    (
        "unwind_native",
        &["unwind_native_offcpu_stacks_are_unwound_at_the_switch"],
    ),
    // Two burners pinned to one vCPU: preempted time told from blocked,
    // read from the switched-out task's state.
    (
        "collectors_cli",
        &["collectors_offcpu_tells_preempted_from_blocked"],
    ),
];

/// What `cargo xtask test` runs (issue #12's matrix): Debian bullseye's 5.10
/// (openEuler 22.03's major) and bookworm's 6.1 on x86-64, and 5.10 on arm64.
pub const CI_KERNELS: &[(Arch, &str)] = &[
    (Arch::X86_64, "5.10.0-30"),
    (Arch::X86_64, "6.1.0-50"),
    (Arch::Aarch64, "5.10.0-30"),
];

/// Kernel modules the initramfs loads (after their dependencies) to mount
/// the host's root.
const MODULES: &[&str] = &[
    "virtio",
    "virtio_ring",
    "virtio_pci",
    "fscache",
    "9pnet",
    "9pnet_virtio",
    "9p",
    "overlay",
];

/// The Debian release that ships kernel ABI `version`.
fn suite_of(version: &str) -> Result<&'static str> {
    let mm: Vec<&str> = version.splitn(3, '.').take(2).collect();
    Ok(match mm.as_slice() {
        ["5", "10"] => "bullseye",
        ["6", "1"] => "bookworm",
        ["4", "19"] => "buster",
        _ => bail!(
            "no Debian release known for kernel {version} (hint: 5.10.0-N is bullseye, 6.1.0-N bookworm)"
        ),
    })
}

fn say(msg: &str) {
    println!("[vm-test] {msg}");
}

/// A kernel and initramfs ready to boot.
struct Boot {
    suite: &'static str,
    release: String,
    vmlinuz: PathBuf,
    initrd: PathBuf,
    cache: PathBuf,
}

/// QEMU, the kernel package and the initramfs for `o` (cached).
fn prepare(o: &Options) -> Result<Boot> {
    let suite = suite_of(&o.kernel)?;
    setup::ensure_packages(&[
        (o.arch.qemu_package(), "QEMU for vm-test"),
        ("busybox-static", "the VM's initramfs"),
    ])?;
    if o.arch == Arch::Aarch64 {
        arm64_runtime()?;
    }
    let cache = cache_dir();
    let kdir = kernel_package(&cache, suite, &o.kernel, o.arch)?;
    let release = format!("{}-{}", o.kernel, o.arch.deb());
    let vmlinuz = kdir.join(format!("boot/vmlinuz-{release}"));
    let busybox = busybox_for(&cache, o.arch)?;
    let initrd = initramfs(&cache, &kdir, &release, &busybox, o.arch)?;
    Ok(Boot {
        suite,
        release,
        vmlinuz,
        initrd,
        cache,
    })
}

/// A fresh directory shared with the VM as /vm-out, holding `script` as
/// cmd.sh.
fn run_dir(b: &Boot, script: &str) -> Result<PathBuf> {
    let run_dir = b
        .cache
        .join("runs")
        .join(format!("{}-{}", std::process::id(), b.release));
    let _ = std::fs::remove_dir_all(&run_dir);
    std::fs::create_dir_all(&run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    std::fs::write(run_dir.join("cmd.sh"), script)?;
    Ok(run_dir)
}

pub fn run(o: &Options) -> Result<()> {
    let t_all = Instant::now();
    let Boot {
        suite,
        release,
        vmlinuz,
        initrd,
        cache,
    } = prepare(o)?;

    say("building the test binaries and fixtures on the host");
    let tests = build_tests(o.arch, &o.only)?;
    let fixtures_dir = match o.arch {
        Arch::X86_64 => {
            fixtures::build()?;
            None
        }
        Arch::Aarch64 => Some(cross_fixtures()?),
    };

    let boot = Boot {
        suite,
        release: release.clone(),
        vmlinuz: vmlinuz.clone(),
        initrd: initrd.clone(),
        cache,
    };
    let run_dir = run_dir(&boot, &script(&tests, fixtures_dir.as_deref(), o.repeat))?;

    say(&format!(
        "booting Debian {suite}'s {release} under {} (TCG)",
        o.arch.qemu()
    ));
    let t_vm = Instant::now();
    let console = qemu(o, &vmlinuz, &initrd, &run_dir)?;
    let vm_secs = t_vm.elapsed().as_secs_f64();

    let log = std::fs::read_to_string(run_dir.join("log")).unwrap_or_default();
    let rc = std::fs::read_to_string(run_dir.join("rc")).ok();
    let boot = marker_time(&console, "VM-READY");
    let (t0, t1) = (
        marker_time(&log, "TESTS-START"),
        marker_time(&log, "TESTS-END"),
    );
    let results: Vec<&str> = log
        .lines()
        .filter(|l| l.starts_with("test result:") || l.contains("... FAILED"))
        .collect();
    say("---- summary ----");
    say(&format!("kernel: {release} ({suite}), arch {:?}", o.arch));
    if let Some(b) = boot {
        say(&format!("boot to the test shell: {b:.1} s (guest uptime)"));
    }
    if let (Some(a), Some(b)) = (t0, t1) {
        say(&format!("tests: {:.1} s (guest uptime)", b - a));
    }
    say(&format!(
        "VM wall time {vm_secs:.1} s; vm-test total {:.1} s",
        t_all.elapsed().as_secs_f64()
    ));
    for r in &results {
        say(r);
    }
    let _ = std::fs::remove_dir_all(&run_dir);
    match rc.as_deref().map(str::trim) {
        Some("0") => {
            say("all VM tests passed");
            Ok(())
        }
        Some(code) => bail!("VM tests failed (exit {code}); see the output above"),
        None => bail!(
            "the VM produced no result (it did not boot, or timed out after {:?}); see the console above",
            o.timeout
        ),
    }
}

/// Guest uptime printed after `marker` (`VM-READY 3.21`).
fn marker_time(text: &str, marker: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.split(marker).nth(1)?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// The script run inside: each test binary with its exact test names.
fn script(tests: &[(PathBuf, &[&str])], fixtures_dir: Option<&Path>, repeat: u32) -> String {
    let mut s = format!(
        "cd '{}'\nexport PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root\n\
         export DYNPROF_TEST_EMULATED=1\n\
         fail=0\nread up _ < /proc/uptime; echo \"TESTS-START $up\"\n",
        util::workspace_root().display()
    );
    if let Some(d) = fixtures_dir {
        s.push_str(&format!("export DYNPROF_FIXTURES_DIR='{}'\n", d.display()));
    }
    for (bin, names) in tests
        .iter()
        .flat_map(|t| std::iter::repeat_n(t, repeat.max(1) as usize))
    {
        s.push_str(&format!("'{}' --test-threads=1", bin.display()));
        if !names.is_empty() {
            s.push_str(" --exact");
            for n in *names {
                s.push_str(&format!(" '{n}'"));
            }
        }
        s.push_str(" || fail=1\n");
    }
    s.push_str("read up _ < /proc/uptime; echo \"TESTS-END $up\"\necho $fail > /vm-out/rc\n");
    s
}

/// Builds the VM's test binaries; returns them with their test names.
fn build_tests(arch: Arch, only: &[String]) -> Result<Vec<(PathBuf, &'static [&'static str])>> {
    let mut all: Vec<&(&str, &[&str])> = match arch {
        Arch::X86_64 => VM_TESTS.iter().collect(),
        Arch::Aarch64 => VM_TESTS_AARCH64.iter().collect(),
    };
    all.extend(VM_TESTS_OFFCPU);
    let chosen: Vec<&(&str, &[&str])> = all
        .iter()
        .copied()
        .filter(|(n, _)| only.is_empty() || only.iter().any(|o| o == n))
        .collect();
    if chosen.is_empty() {
        bail!(
            "--only matches none of the VM's test binaries: {}",
            all.iter().map(|t| t.0).collect::<Vec<_>>().join(", ")
        );
    }
    let mut cmd = util::cargo();
    cmd.args(["test", "-p", "dynprof", "--no-run", "--message-format=json"]);
    if let Some(t) = arch.rust_target() {
        cmd.args(["--target", t]);
    }
    for (name, _) in &chosen {
        cmd.args(["--test", name]);
    }
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo test --no-run")?;
    if !out.status.success() {
        bail!("building the VM's test binaries failed");
    }
    let mut exes = BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["reason"] == "compiler-artifact"
            && let (Some(name), Some(exe)) =
                (v["target"]["name"].as_str(), v["executable"].as_str())
        {
            exes.insert(name.to_string(), PathBuf::from(exe));
        }
    }
    chosen
        .into_iter()
        .map(|(name, names)| {
            let exe = exes
                .get(*name)
                .with_context(|| format!("cargo built no executable for test {name}"))?;
            Ok((exe.clone(), *names))
        })
        .collect()
}

/// The fixtures built for arm64 with the cross compilers, in
/// `<target>/aarch64-unknown-linux-gnu/fixtures`.
fn cross_fixtures() -> Result<PathBuf> {
    let dir = util::target_dir()
        .join(setup::AARCH64_TARGET)
        .join("fixtures");
    std::fs::create_dir_all(&dir)?;
    // sys/sdt.h (systemtap-sdt-dev) is architecture-independent, but the
    // cross compiler does not search /usr/include: hand it just those two.
    let inc = util::target_dir()
        .join(setup::AARCH64_TARGET)
        .join("sdt-include");
    std::fs::create_dir_all(inc.join("sys"))?;
    // Debian installs them under the host's multiarch directory.
    let src = ["/usr/include/x86_64-linux-gnu/sys", "/usr/include/sys"]
        .iter()
        .map(Path::new)
        .find(|d| d.join("sdt.h").is_file())
        .context("sys/sdt.h not found: install systemtap-sdt-dev (cargo xtask setup)")?;
    for h in ["sdt.h", "sdt-config.h"] {
        std::fs::copy(src.join(h), inc.join("sys").join(h))
            .with_context(|| format!("copying {}/{h}", src.display()))?;
    }
    util::run(
        Command::new("make")
            .arg("--no-print-directory")
            .arg("-C")
            .arg(util::workspace_root().join("tests/fixtures"))
            .arg(format!("OUT={}", dir.display()))
            .arg(format!(
                "CC=aarch64-linux-gnu-gcc -isystem {}",
                inc.display()
            ))
            .arg(format!(
                "CXX=aarch64-linux-gnu-g++ -isystem {}",
                inc.display()
            )),
    )
    .context("cross-building the fixtures for arm64 (needs gcc/g++-aarch64-linux-gnu)")?;
    Ok(dir)
}

/// What arm64 binaries need on the shared host root: the cross C++
/// compiler for the fixtures and, to run at all, arm64 glibc
/// (`/lib/ld-linux-aarch64.so.1`, from libc6:arm64 through dpkg multiarch).
fn arm64_runtime() -> Result<()> {
    setup::ensure_packages(&[(
        "g++-aarch64-linux-gnu",
        "the C++ fixtures, cross-built for the arm64 VM",
    )])?;
    if setup::dpkg_installed("libc6:arm64")? {
        return Ok(());
    }
    let archs = util::stdout_of(Command::new("dpkg").arg("--print-foreign-architectures"))?;
    if !archs.lines().any(|a| a.trim() == "arm64") {
        say("dpkg --add-architecture arm64 (for libc6:arm64)");
        util::run(Command::new("dpkg").args(["--add-architecture", "arm64"]))?;
        util::run(
            Command::new("apt-get")
                .args(["update", "-q"])
                .env("DEBIAN_FRONTEND", "noninteractive"),
        )?;
    }
    setup::ensure_packages(&[
        (
            "libc6:arm64",
            "arm64 glibc for the binaries run in the arm64 VM",
        ),
        ("libstdc++6:arm64", "the C++ fixtures in the arm64 VM"),
    ])
}

/// Runs the VM to its end (or the timeout), echoing the console; returns it.
fn qemu(o: &Options, vmlinuz: &Path, initrd: &Path, run_dir: &Path) -> Result<String> {
    let mut cmd = Command::new("nice");
    cmd.args(["-n", "15", o.arch.qemu()])
        .args(o.arch.machine())
        .args(["-m", "3072", "-smp", "2", "-display", "none", "-monitor", "none"])
        .args(["-serial", "stdio", "-no-reboot"])
        .arg("-kernel")
        .arg(vmlinuz)
        .arg("-initrd")
        .arg(initrd)
        .arg("-append")
        // A kernel lockup ends the VM at once (with every CPU's backtrace,
        // which `quiet` would hide) instead of at the timeout.
        .arg(format!(
            "console={} loglevel=5 panic=-1 softlockup_panic=1 softlockup_all_cpu_backtrace=1",
            o.arch.console()
        ))
        .args([
            "-virtfs",
            "local,path=/,mount_tag=hostroot,security_model=passthrough,readonly=on,multidevs=remap",
            "-virtfs",
        ])
        .arg(format!(
            "local,path={},mount_tag=out,security_model=passthrough",
            run_dir.display()
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let shown = util::display(&cmd);
    let mut child = cmd.spawn().with_context(|| format!("starting `{shown}`"))?;
    let console = Arc::new(Mutex::new(String::new()));
    let out = child.stdout.take().expect("piped");
    let reader = {
        let console = console.clone();
        std::thread::spawn(move || {
            let mut stdout = std::io::stdout();
            for line in BufReader::new(out).split(b'\n').map_while(Result::ok) {
                let line = String::from_utf8_lossy(&line).replace('\r', "");
                let _ = writeln!(stdout, "[vm] {line}");
                let mut c = console.lock().unwrap();
                c.push_str(&line);
                c.push('\n');
            }
        })
    };
    let deadline = Instant::now() + o.timeout;
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if Instant::now() >= deadline {
            say(&format!("timeout after {:?}: stopping the VM", o.timeout));
            let _ = child.kill();
            let _ = child.wait();
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = reader.join();
    let c = console.lock().unwrap().clone();
    Ok(c)
}

#[cfg(test)]
mod tests;
