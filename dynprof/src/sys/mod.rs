//! The one room for OS plumbing: everything that talks to the kernel through
//! raw syscalls, `/proc` or `unsafe` lives here (or in `bpf.rs` for the eBPF
//! objects), so that domain code stays safe and testable without root.
//!
//! | module | job |
//! |---|---|
//! | `rootfs` | open files *inside* a target's root, never following a link out of it |
//! | `creds` | a target's credentials (uids, gids, groups, capabilities, no_new_privs, namespaces, cgroup) |
//! | `exec` | start a process with a target's credentials in its namespaces and cgroup |
//! | `hostfs` | create files on the host without following links planted by others |
//! | `clock` | local wall-clock time for directory names and logs |
//! | `caps` | dynprof's own capabilities: check, and drop after attach |
//! | `targetdir` | make, check and list directories in a target's world, through `rootfs` |
//! | `uprobe` | uprobe perf events with kernel-owned USDT semaphores; the /proc/PID/mem fallback |
//! | `lock` | one controller per target: the flock under /run/dynprof |
//! | `kallsyms` | a copy of `/proc/kallsyms` taken before the capabilities are dropped |
//! | `kernel` | probe the running kernel's BPF features (helpers, map types, PMU formats) |
//! | `mapmem` | a BPF array map's values mapped into dynprof (the idle step log) |
//! | `memory` | dynprof's peak RSS; unnamed spill files for window events |
//! | `procmem` | read a target's memory (`/proc/PID/mem`): CPython code objects |
//! | `signal` | SIGTERM to dynprof's own children (the agent's captures) |
//! | `configmap` | read a `--config-dir` file, plain or through a ConfigMap's root-owned `..data` links |
//! | `unixsock` | the agent's root-only unix socket: checked parent, stale-socket replacement |
//! | `btf` | member offsets from the kernel's BTF (`task_struct.stack`) |
//! | `sched` | the event loop's short time slice (6.12+); the writer's background priority |
//! | `vdso` | dynprof's own vDSO image, the target's `[vdso]` frames' tables and names |
pub mod btf;
pub mod caps;
pub mod clock;
pub mod configmap;
pub mod creds;
pub mod exec;
pub mod hostfs;
pub mod kallsyms;
pub mod kernel;
pub mod lock;
pub mod mapmem;
pub mod memory;
pub mod procmem;
pub mod rootfs;
pub mod sched;
pub mod signal;
pub mod targetdir;
pub mod unixsock;
pub mod uprobe;
pub mod vdso;
