//! Uprobes opened by hand, for what aya 0.14 does not expose: the USDT
//! semaphore as a kernel-owned reference counter (`ref_ctr_offset`).
//!
//! The uprobe PMU (`/sys/bus/event_source/devices/uprobe`) takes the probed
//! file in `config1`, the probe's file offset in `config2` and, since 4.20,
//! the semaphore's file offset in `config` bits 63:32. The kernel then
//! raises the semaphore in every process where it installs the breakpoint
//! and lowers it when the event goes away, which happens when its last
//! file descriptor closes: however dynprof ends, SIGKILL included. This is
//! what libbpf's `perf_event_open_probe(..., ref_ctr_off, ...)` does.
//!
//! The loaded program goes onto the event with `BPF_LINK_CREATE`
//! (`BPF_PERF_EVENT`, 5.15+), which also carries the attach cookie that
//! `bpf_get_attach_cookie` returns; older kernels get
//! `PERF_EVENT_IOC_SET_BPF`, which has no cookie.
//!
//! Also here: the `/proc/PID/mem` semaphore write kept as the fallback for
//! kernels without `ref_ctr_offset`, and process start times (to recognise
//! a PID again).
use std::{
    ffi::CString,
    fs::OpenOptions,
    os::{
        fd::{AsFd, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::{ffi::OsStrExt as _, fs::FileExt as _},
    },
    path::Path,
};

use anyhow::{Context as _, Result, anyhow, bail};

use crate::types::HostPid;

const UPROBE_PMU: &str = "/sys/bus/event_source/devices/uprobe";
/// `PERF_UPROBE_REF_CTR_OFFSET_SHIFT` (kernel/events/core.c).
const REF_CTR_OFFSET_SHIFT: u32 = 32;
/// The kernel keeps the offset in 32 bits.
const REF_CTR_OFFSET_MAX: u64 = u32::MAX as u64;

/// `struct perf_event_attr` up to `PERF_ATTR_SIZE_VER5` (112 bytes); only
/// the fields a uprobe needs are named, the rest stays zero.
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    type_: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
    config2: u64,
    rest: [u64; 5],
}
const _: () = assert!(std::mem::size_of::<PerfEventAttr>() == 112);

const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 1 << 3;
/// `_IO('$', 0)`.
const PERF_EVENT_IOC_ENABLE: libc::c_ulong = 0x2400;
/// `_IOW('$', 8, __u32)`.
const PERF_EVENT_IOC_SET_BPF: libc::c_ulong = 0x4004_2408;
const BPF_LINK_CREATE: libc::c_long = 28;
/// `enum bpf_attach_type`: BPF_PERF_EVENT.
const BPF_PERF_EVENT: u32 = 41;

/// Whether this kernel's uprobe PMU takes a reference-counter offset
/// (Linux 4.20+): it then lists `format/ref_ctr_offset`.
pub fn kernel_owns_semaphores() -> bool {
    Path::new(UPROBE_PMU).join("format/ref_ctr_offset").exists()
}

fn uprobe_pmu_type() -> Result<u32> {
    let p = Path::new(UPROBE_PMU).join("type");
    let s = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
    s.trim()
        .parse()
        .with_context(|| format!("parsing {} ({s:?})", p.display()))
}

/// Why an attach failed, kept apart so the caller can tell "this kernel
/// refuses the semaphore offset" from everything else.
#[derive(Debug)]
pub struct OpenError {
    pub errno: i32,
    pub source: std::io::Error,
    /// What the errno most likely means here, when dynprof can tell.
    pub hint: Option<String>,
}

/// Opens an entry uprobe at `offset` of `path`, in process `pid` only, with
/// the kernel owning the USDT semaphore at file offset `ref_ctr_offset`.
pub fn open_uprobe(
    path: &Path,
    offset: u64,
    ref_ctr_offset: Option<u64>,
    pid: HostPid,
) -> Result<OwnedFd> {
    open_probe(path, offset, ref_ctr_offset, pid, false)
}

/// Opens a return uprobe (uretprobe) at `offset` of `path`, in `pid` only.
pub fn open_uretprobe(path: &Path, offset: u64, pid: HostPid) -> Result<OwnedFd> {
    open_probe(path, offset, None, pid, true)
}

/// The `config` bit that makes a uprobe PMU event a return probe, from the
/// PMU's `format/retprobe` (`config:0` on every kernel so far).
fn retprobe_bit() -> Result<u64> {
    let p = Path::new(UPROBE_PMU).join("format/retprobe");
    let s = std::fs::read_to_string(&p).with_context(|| {
        format!(
            "reading {} (return uprobes through perf_event_open need Linux 4.17+)",
            p.display()
        )
    })?;
    parse_config_bit(&s).with_context(|| format!("parsing {} ({s:?})", p.display()))
}

/// `config:N` -> `1 << N`.
fn parse_config_bit(format: &str) -> Result<u64> {
    let bit: u32 = format
        .trim()
        .strip_prefix("config:")
        .ok_or_else(|| anyhow!("not a config bit"))?
        .parse()?;
    if bit >= REF_CTR_OFFSET_SHIFT {
        bail!("bit {bit} collides with ref_ctr_offset");
    }
    Ok(1 << bit)
}

fn open_probe(
    path: &Path,
    offset: u64,
    ref_ctr_offset: Option<u64>,
    pid: HostPid,
    retprobe: bool,
) -> Result<OwnedFd> {
    let pmu = uprobe_pmu_type()?;
    let cpath = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| anyhow!("{} contains a NUL byte", path.display()))?;
    let mut attr = PerfEventAttr {
        type_: pmu,
        size: std::mem::size_of::<PerfEventAttr>() as u32,
        sample_period: 1,
        wakeup_events: 1,
        config1: cpath.as_ptr() as u64,
        config2: offset,
        ..Default::default()
    };
    if let Some(r) = ref_ctr_offset {
        if r > REF_CTR_OFFSET_MAX {
            bail!("USDT semaphore offset {r:#x} does not fit the kernel's 32 bits");
        }
        attr.config = r << REF_CTR_OFFSET_SHIFT;
    }
    if retprobe {
        attr.config |= retprobe_bit()?;
    }
    // SAFETY: perf_event_open(2) reads `attr` (size given inside) and the
    // NUL-terminated path `cpath` points to; both outlive the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &mut attr as *mut PerfEventAttr,
            pid.0 as libc::pid_t,
            -1 as libc::c_int,
            -1 as libc::c_int,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        let errno = e.raw_os_error().unwrap_or(0);
        // A target can shrink a file it maps after dynprof has read it. The
        // kernel then refuses a probe past the file's end (EINVAL), or
        // fails to read the probed instruction from the page cache (EIO)
        // when the cut comes between its size check and that read.
        let hint = match errno {
            libc::EINVAL => super::rootfs::stat_path(path)
                .ok()
                .filter(|id| id.size <= offset)
                .map(|id| {
                    format!(
                        "the file is now {} bytes, shorter than the probe offset {offset:#x}: \
                         it was truncated or replaced after dynprof read it",
                        id.size
                    )
                }),
            libc::EIO => Some(format!(
                "the kernel could not read the instruction at offset {offset:#x} from the \
                 file: it was truncated or replaced after dynprof read it"
            )),
            _ => None,
        };
        return Err(anyhow::Error::new(OpenError {
            errno,
            source: e,
            hint,
        }));
    }
    // SAFETY: the kernel just returned this descriptor to us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "perf_event_open(uprobe): {}", self.source)?;
        match &self.hint {
            Some(h) => write!(f, " ({h})"),
            None => Ok(()),
        }
    }
}
impl std::error::Error for OpenError {}

/// How a program sits on a perf event. Dropping it detaches: the link (or
/// the event itself) is closed and, with it, the kernel's uprobe.
#[derive(Debug)]
pub struct PerfAttachment {
    /// `BPF_LINK_CREATE`'s link, absent on the ioctl path.
    _link: Option<OwnedFd>,
    _event: OwnedFd,
    /// Whether the attach cookie reaches `bpf_get_attach_cookie`.
    pub cookie_delivered: bool,
}

/// Puts program `prog` on perf event `event` with `cookie`: a bpf link where
/// the kernel has perf links (5.15+), else `PERF_EVENT_IOC_SET_BPF` (no
/// cookie). Takes ownership of the event.
pub fn attach_program(prog: BorrowedFd<'_>, event: OwnedFd, cookie: u64) -> Result<PerfAttachment> {
    // union bpf_attr.link_create: prog_fd, target_fd, attach_type, flags,
    // then perf_event.bpf_cookie at byte 16.
    let mut attr = [0u64; 8];
    attr[0] = (prog.as_raw_fd() as u32 as u64) | ((event.as_raw_fd() as u32 as u64) << 32);
    attr[1] = BPF_PERF_EVENT as u64;
    attr[2] = cookie;
    // SAFETY: bpf(2) reads `size_of_val(&attr)` bytes of `attr`.
    let link = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_LINK_CREATE,
            attr.as_mut_ptr(),
            std::mem::size_of_val(&attr),
        )
    };
    let (link, cookie_delivered) = if link >= 0 {
        // SAFETY: the kernel just returned this descriptor to us.
        (Some(unsafe { OwnedFd::from_raw_fd(link as i32) }), true)
    } else {
        let e = std::io::Error::last_os_error();
        // Kernels before perf links reject the attach type with EINVAL.
        if e.raw_os_error() != Some(libc::EINVAL) {
            return Err(e).context("bpf(BPF_LINK_CREATE, BPF_PERF_EVENT)");
        }
        // SAFETY: ioctl on a perf event fd we own, passing a program fd.
        let rc = unsafe {
            libc::ioctl(
                event.as_raw_fd(),
                PERF_EVENT_IOC_SET_BPF as _,
                prog.as_raw_fd(),
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error()).context("ioctl(PERF_EVENT_IOC_SET_BPF)");
        }
        (None, false)
    };
    // SAFETY: ioctl on a perf event fd we own.
    if unsafe { libc::ioctl(event.as_raw_fd(), PERF_EVENT_IOC_ENABLE as _, 0) } != 0 {
        return Err(std::io::Error::last_os_error()).context("ioctl(PERF_EVENT_IOC_ENABLE)");
    }
    Ok(PerfAttachment {
        _link: link,
        _event: event,
        cookie_delivered,
    })
}

impl AsFd for PerfAttachment {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self._event.as_fd()
    }
}

/// Every runtime address at which the instruction at `file_offset` of
/// `path` is mapped in `pid`: what a uprobe handler sees as its instruction
/// pointer there. A mapping is the file's when it has the file's device and
/// inode, or when its path is `object` (the path as the target sees it): on
/// overlayfs (containers) /proc/PID/maps shows the lower file's device and
/// inode while stat(2) shows the overlay's. A file mapped twice yields two
/// addresses.
pub fn probe_addresses(
    pid: HostPid,
    path: &Path,
    object: &str,
    file_offset: u64,
) -> Result<Vec<u64>> {
    let st = rustix::fs::stat(path).with_context(|| format!("stat {}", path.display()))?;
    let dev = (
        rustix::fs::major(st.st_dev as u64),
        rustix::fs::minor(st.st_dev as u64),
    );
    let maps = procfs::process::Process::new(pid.0 as i32)
        .and_then(|p| p.maps())
        .with_context(|| format!("reading /proc/{pid}/maps"))?;
    let maps = maps.iter().map(|m| MapRange {
        start: m.address.0,
        end: m.address.1,
        offset: m.offset,
        dev: (m.dev.0 as u32, m.dev.1 as u32),
        inode: m.inode,
        named: matches!(&m.pathname, procfs::process::MMapPath::Path(p) if p.as_os_str() == object),
    });
    Ok(addresses_in(maps, dev, st.st_ino as u64, file_offset))
}

/// One line of /proc/PID/maps, as [`addresses_in`] needs it.
#[derive(Clone, Copy, Debug)]
struct MapRange {
    start: u64,
    end: u64,
    offset: u64,
    dev: (u32, u32),
    inode: u64,
    /// Its path is the object's.
    named: bool,
}

fn addresses_in(
    maps: impl Iterator<Item = MapRange>,
    dev: (u32, u32),
    inode: u64,
    file_offset: u64,
) -> Vec<u64> {
    let mut out: Vec<u64> = maps
        .filter(|m| m.named || (m.dev == dev && m.inode == inode && inode != 0))
        .filter(|m| file_offset >= m.offset && file_offset - m.offset < m.end - m.start)
        .map(|m| m.start + (file_offset - m.offset))
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Adds `delta` to a USDT semaphore (u16) in `pid` through /proc/PID/mem,
/// as bcc does; returns the new value. Saturates at 0 and u16::MAX.
pub fn adjust_semaphore_in_memory(pid: HostPid, addr: u64, delta: i32) -> Result<u16> {
    let path = format!("/proc/{pid}/mem");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {path}"))?;
    let mut buf = [0u8; 2];
    f.read_exact_at(&mut buf, addr)
        .with_context(|| format!("reading semaphore at {addr:#x}"))?;
    let v = (u16::from_le_bytes(buf) as i32 + delta).clamp(0, u16::MAX as i32) as u16;
    f.write_all_at(&v.to_le_bytes(), addr)
        .with_context(|| format!("writing semaphore at {addr:#x}"))?;
    Ok(v)
}

/// A process's start time (clock ticks since boot, /proc/PID/stat field
/// 22): with the PID, it names one process even after PID reuse. `None`
/// when no such process exists.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // comm (field 2) may hold spaces and parentheses: fields restart after
    // the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether process `pid` started at `start` still runs (a zombie no longer
/// does anything, so it counts as dead).
pub fn is_running(pid: u32, start: u64) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let Some(close) = stat.rfind(')') else {
        return false;
    };
    let mut f = stat[close + 1..].split_whitespace();
    let state = f.next();
    let st = f.nth(18).and_then(|v| v.parse::<u64>().ok());
    st == Some(start) && !matches!(state, Some("Z" | "X" | "x"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retprobe_format_is_a_config_bit() {
        assert_eq!(parse_config_bit("config:0\n").unwrap(), 1);
        assert_eq!(parse_config_bit("config:5").unwrap(), 32);
        assert!(parse_config_bit("config1:0").is_err());
        assert!(parse_config_bit("config:32").is_err());
    }

    #[test]
    fn probe_address_is_the_mapping_start_plus_the_offset_into_it() {
        let m = |start, end, offset, inode| MapRange {
            start,
            end,
            offset,
            dev: (8, 1),
            inode,
            named: false,
        };
        let maps = [
            m(0x5000_0000, 0x5000_1000, 0, 7),      // ELF header page
            m(0x5000_1000, 0x5000_3000, 0x1000, 7), // text
            m(0x7000_1000, 0x7000_3000, 0x1000, 7), // same file mapped again
            m(0x6000_1000, 0x6000_3000, 0x1000, 9), // another file
        ];
        assert_eq!(
            addresses_in(maps.into_iter(), (8, 1), 7, 0x1234),
            vec![0x5000_1234, 0x7000_1234]
        );
        // Same inode on another device is another file.
        assert!(addresses_in(maps.into_iter(), (8, 2), 7, 0x1234).is_empty());
        // An offset past every mapping of the file.
        assert!(addresses_in(maps.into_iter(), (8, 1), 7, 0x3000).is_empty());
        // overlayfs: maps shows another inode, but the path names the file.
        let overlay = [MapRange {
            named: true,
            ..m(0x5000_1000, 0x5000_3000, 0x1000, 99)
        }];
        assert_eq!(
            addresses_in(overlay.into_iter(), (8, 1), 7, 0x1234),
            vec![0x5000_1234]
        );
    }
}
