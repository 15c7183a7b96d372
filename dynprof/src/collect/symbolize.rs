//! Address → frame name for one target process, through blazesym.
//!
//! Kernel addresses go through `/proc/kallsyms`. User addresses are
//! symbolized from the target's mapped files, which the target controls:
//!
//! - blazesym `mmap`s each file it symbolizes. A target that truncates its
//!   mapped library while dynprof reads it would kill dynprof with SIGBUS
//!   (seen in 2 of 20 attaches). So blazesym never sees the target's file:
//!   dynprof reads the parts symbolization needs (headers, symbol and string
//!   tables; `symbols::elf`, with its caps and deadline) through
//!   `/proc/PID/map_files/<range>` (the very inode mapped, in any mount
//!   namespace), copies them into a sealed memfd of its own at their
//!   offsets ([`rootfs::sealed_sparse_copy`]) and hands blazesym that copy,
//!   with file offsets computed from the maps.
//!   Rejected alternatives: a read lease (`F_SETLEASE F_RDLCK`) cannot be
//!   taken while the target holds the file open for writing, and its break
//!   gives dynprof only `lease-break-time` to stop using the mapping, while
//!   the target's own `truncate` blocks meanwhile; a full copy costs the
//!   whole file (libtorch_cpu: 120–450 MB) where the tables are a few MB.
//! - Names are demangled by `symbols::demangle` (length and recursion caps),
//!   not by blazesym, whose demangler has no output cap.
//!
//! A copy also outlives the process, so a window written after the target
//! exited still names the frames of files it had already seen.
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use blazesym::MaybeDefault;
use blazesym::symbolize::source::{Elf, Kernel, Source};
use blazesym::symbolize::{Input, Sym, Symbolized, Symbolizer as Blaze};

use crate::output::model::ModuleRef;
use crate::symbols::perfmap::{self, PerfMap};
use crate::symbols::{
    DebugLink, ElfImage, demangle, elf,
    elf::UnwindSections,
    unwind::{self, Lookup},
};
use crate::sys::{
    rootfs::{self, TargetRoot},
    targetdir,
};

/// The frame name of code in anonymous executable memory.
pub const JIT_FRAME: &str = "[jit]";

/// The maps name of the vDSO (a file's name there starts with `/`).
const VDSO: &str = "[vdso]";

/// The frame name of a PLT stub (the jump to a function in another
/// object).
pub const PLT_FRAME: &str = "[plt]";

/// What a frame named from the vDSO ends with.
pub const VDSO_SUFFIX: &str = " [vdso]";

/// One executable mapping of the target, kept so that an address blazesym
/// cannot name can still be reported as `[unknown] module+0xoffset`, and so
/// that this still works once the process has exited.
#[derive(Clone, Debug)]
struct Mapping {
    start: u64,
    end: u64,
    offset: u64,
    /// `major:minor inode` from the maps line: which file this is.
    file_key: String,
    module: String,
}

/// A mapped file's symbol tables in memory dynprof owns (see the module doc).
struct Snapshot {
    /// Holds the memfd that `source`'s path names.
    _file: File,
    source: Source<'static>,
    /// Set when `source` is a separate debug file: the mapped file's
    /// loadable segments, to turn its file offsets into the virtual
    /// addresses both files share.
    segments: Option<Vec<(u64, u64, u64)>>,
    /// The mapped file's build id, loadable segments and debug link, for
    /// `modules.json`.
    build_id: Option<String>,
    load_segments: Vec<(u64, u64, u64)>,
    debuglink: Option<DebugLink>,
    /// The mapped file's PLT sections, by file offset.
    plt: Vec<std::ops::Range<u64>>,
}

pub struct Symbolizer {
    pid: u32,
    /// `--debug-dir`: searched first for separate debug files by build id.
    debug_dirs: Vec<PathBuf>,
    blaze: Blaze,
    kernel_src: Source<'static>,
    /// Per mapped file (`file_key`); `None` when it could not be read.
    snapshots: HashMap<String, Option<Snapshot>>,
    /// Per mapped file (`file_key`), read with its snapshot: the unwind
    /// tables, `None` when the file has none or could not be read.
    unwind_tables: HashMap<String, Option<UnwindSections>>,
    /// Frames per (adjusted) address; a training job's hot loop touches few
    /// distinct IPs, so after warm-up nearly every lookup is a hit.
    user_cache: HashMap<u64, Vec<String>>,
    kernel_cache: HashMap<u64, Vec<String>>,
    maps: Vec<Mapping>,
    /// Set once /proc/PID is gone: stop reading files (each attempt is a
    /// failed open) and answer from the snapshots and the maps.
    exited: bool,
    /// When the unwinder last re-read the maps for an address outside
    /// them: a garbage return address in every sample must not cost a
    /// maps read each (thousands of lines in a PyTorch job).
    unwind_maps_read: Option<std::time::Instant>,
    /// The target's `/tmp/perf-NSPID.map` (names of JIT code), and when it
    /// was last read: again at most once a second, on a miss.
    perf_map: Option<PerfMap>,
    perf_map_read: Option<std::time::Instant>,
    /// Files some frame was named in only by offset, by file name.
    unresolved: std::collections::BTreeMap<String, ModuleRef>,
}

impl Symbolizer {
    /// Fails only if the process has no readable maps at construction (it
    /// does not exist, or we lack permission); later failures degrade to
    /// `[unknown]` frames instead.
    pub fn new(host_pid: u32, debug_dirs: &[PathBuf]) -> Result<Self> {
        let maps = read_maps(host_pid).with_context(|| format!("reading /proc/{host_pid}/maps"))?;
        let blaze = Blaze::builder()
            .enable_code_info(false)
            .enable_inlined_fns(true)
            .enable_demangling(false)
            .build();
        let kernel = Kernel {
            // A vmlinux with DWARF is rarely present and slow to load;
            // kallsyms names every kernel function a stack can contain.
            // dynprof's own read of it after attach would show no addresses
            // (no CAP_SYSLOG left): the copy taken before is read instead.
            kallsyms: match crate::sys::kallsyms::snapshot() {
                Some(p) => MaybeDefault::Some(p),
                None => MaybeDefault::Default,
            },
            vmlinux: MaybeDefault::None,
            debug_syms: false,
            ..Kernel::default()
        };
        Ok(Self {
            pid: host_pid,
            debug_dirs: debug_dirs.to_vec(),
            blaze,
            kernel_src: Source::Kernel(kernel),
            snapshots: HashMap::new(),
            unwind_tables: HashMap::new(),
            user_cache: HashMap::new(),
            kernel_cache: HashMap::new(),
            maps,
            exited: false,
            unwind_maps_read: None,
            perf_map: None,
            perf_map_read: None,
            unresolved: Default::default(),
        })
    }

    /// Frames of a user stack as a BPF stack map returns it (leaf first,
    /// zero-terminated), root first. Should DWARF be consulted (it is not by
    /// default, see `new`), inlined functions become frames of their own.
    pub fn user_stack(&mut self, ips: &[u64]) -> Vec<String> {
        self.user_groups(ips).into_iter().rev().flatten().collect()
    }

    /// The frames of each address of a user stack, leaf first: one group
    /// per address (the function, then what was inlined into it there),
    /// up to the first 0.
    pub fn user_groups(&mut self, ips: &[u64]) -> Vec<Vec<String>> {
        let addrs = adjusted(ips);
        let missing: Vec<u64> = addrs
            .iter()
            .copied()
            .filter(|a| !self.user_cache.contains_key(a))
            .collect();
        if !missing.is_empty() {
            self.resolve_user(&missing);
        }
        addrs.iter().map(|a| self.user_cache[a].clone()).collect()
    }

    /// Resolves the new addresses of many stacks in one blazesym call per
    /// source. Each call re-reads /proc/PID/maps and looks up its ELF
    /// files, which on a framework with hundreds of mappings costs far
    /// more than the lookups: one call per stack made closing a window of
    /// a few thousand PyTorch samples take ~0.4 s.
    pub fn warm(&mut self, user: &[&[u64]], kernel: &[&[u64]]) {
        let missing = uncached(user, &self.user_cache);
        if !missing.is_empty() {
            self.resolve_user(&missing);
        }
        let missing = uncached(kernel, &self.kernel_cache);
        if !missing.is_empty() {
            self.resolve_kernel(&missing);
        }
    }

    /// Frames of a kernel stack, root first, each suffixed `_[k]`.
    pub fn kernel_stack(&mut self, ips: &[u64]) -> Vec<String> {
        let addrs = adjusted(ips);
        let missing: Vec<u64> = addrs
            .iter()
            .copied()
            .filter(|a| !self.kernel_cache.contains_key(a))
            .collect();
        if !missing.is_empty() {
            self.resolve_kernel(&missing);
        }
        addrs
            .iter()
            .rev()
            .flat_map(|a| self.kernel_cache[a].iter().cloned())
            .collect()
    }

    fn resolve_kernel(&mut self, missing: &[u64]) {
        {
            let results = match self
                .blaze
                .symbolize(&self.kernel_src, Input::AbsAddr(missing))
            {
                Ok(r) => Some(r),
                Err(e) => {
                    log::debug!("symbolizing {} kernel addresses: {e:#}", missing.len());
                    None
                }
            };
            for (i, a) in missing.iter().enumerate() {
                let frames = match results.as_ref().and_then(|r| r.get(i)) {
                    Some(Symbolized::Sym(sym)) => sym_frames(sym),
                    other => {
                        log::debug!("kernel address {a:#x}: {other:?}");
                        vec!["[unknown]".to_string()]
                    }
                };
                let frames = frames.into_iter().map(|f| format!("{f}_[k]")).collect();
                self.kernel_cache.insert(*a, frames);
            }
        }
    }

    fn resolve_user(&mut self, addrs: &[u64]) {
        if !self.exited && !Path::new(&format!("/proc/{}", self.pid)).exists() {
            self.exited = true;
        }
        // A miss may come from a library loaded after the snapshot (dlopen
        // of a CUDA or CANN plugin, say): refresh once per batch.
        if !self.exited
            && addrs.iter().any(|a| self.mapping(*a).is_none())
            && let Ok(m) = read_maps(self.pid)
        {
            self.maps = m;
        }
        // File offsets, grouped by mapped file.
        let mut by_file: HashMap<String, Vec<(u64, u64)>> = HashMap::new();
        for &a in addrs {
            if let Some(m) = self.mapping(a) {
                let off = a - m.start + m.offset;
                by_file
                    .entry(m.file_key.clone())
                    .or_default()
                    .push((a, off));
            }
        }
        for (key, group) in by_file {
            self.ensure_snapshot(&key);
            let Some(Some(snap)) = self.snapshots.get(&key) else {
                continue;
            };
            let offsets: Vec<u64> = group.iter().map(|(_, o)| *o).collect();
            let result = match &snap.segments {
                None => self
                    .blaze
                    .symbolize(&snap.source, Input::FileOffset(&offsets)),
                Some(segs) => {
                    // A debug file's segments hold no code: address it by
                    // the mapped file's virtual addresses (0 when outside).
                    let vaddrs: Vec<u64> = offsets
                        .iter()
                        .map(|o| elf::offset_to_vaddr(segs, *o).unwrap_or(0))
                        .collect();
                    self.blaze
                        .symbolize(&snap.source, Input::VirtOffset(&vaddrs))
                }
            };
            match result {
                Ok(results) => {
                    for ((a, off), r) in group.iter().zip(results.iter()) {
                        // A PLT stub has no symbol of its own; the one
                        // before it (`_init`) would be named instead.
                        if snap.plt.iter().any(|p| p.contains(off)) {
                            self.user_cache.insert(*a, vec![PLT_FRAME.to_string()]);
                            continue;
                        }
                        if let Symbolized::Sym(sym) = r {
                            // Past the end of the symbol found: not in it
                            // (padding, code no symbol covers).
                            if sym.size.is_some_and(|n| n > 0 && sym.offset >= n) {
                                continue;
                            }
                            let mut frames = sym_frames(sym);
                            if key == VDSO {
                                // `clock_gettime [vdso]`, as JIT code is
                                // `NAME [jit]`: not libc's of the same name.
                                frames.iter_mut().for_each(|f| f.push_str(VDSO_SUFFIX));
                            }
                            self.user_cache.insert(*a, frames);
                        }
                    }
                }
                Err(e) => log::debug!("symbolizing {} addresses of {key}: {e:#}", offsets.len()),
            }
        }
        for a in addrs {
            if !self.user_cache.contains_key(a) {
                let u = match self.jit_name(*a) {
                    Some(name) => name,
                    None => {
                        self.note_unresolved(*a);
                        self.unknown(*a)
                    }
                };
                self.user_cache.insert(*a, vec![u]);
            }
        }
    }

    /// For the native unwinder: the executable mapping at `addr` and its
    /// unwind module, read (once per file) with the file's snapshot.
    pub fn unwind_lookup(&mut self, addr: u64) -> Lookup {
        let stale = self
            .unwind_maps_read
            .is_none_or(|t| t.elapsed() >= std::time::Duration::from_millis(500));
        if self.mapping(addr).is_none() && !self.exited && stale {
            self.unwind_maps_read = Some(std::time::Instant::now());
            if let Ok(m) = read_maps(self.pid) {
                self.maps = m;
            }
        }
        let Some(m) = self.mapping(addr).cloned() else {
            return Lookup::Nothing;
        };
        if !m.module.starts_with('/') && m.module != VDSO {
            // JIT code: no file, so no tables (see `snapshot`).
            return Lookup::Anonymous(m.start..m.end);
        }
        self.ensure_snapshot(&m.file_key);
        let module = self
            .unwind_tables
            .get(&m.file_key)
            .and_then(Option::as_ref)
            .and_then(|t| unwind::module(&m.module, m.start..m.end, m.offset, t));
        Lookup::Mapping(m.start..m.end, module)
    }

    /// Reads a mapped file's symbol and unwind tables, once.
    fn ensure_snapshot(&mut self, key: &str) {
        if self.snapshots.contains_key(key) {
            return;
        }
        let (snap, tables) = match self.snapshot(key) {
            Some((s, t)) => (Some(s), t),
            None => (None, None),
        };
        self.snapshots.insert(key.to_string(), snap);
        self.unwind_tables.insert(key.to_string(), tables);
    }

    /// Reads a mapped file's tables into a sealed copy (see the module doc),
    /// and its unwind tables.
    fn snapshot(&self, key: &str) -> Option<(Snapshot, Option<UnwindSections>)> {
        if self.exited {
            return None;
        }
        let m = self.maps.iter().find(|m| m.file_key == key)?;
        let img = if m.module == VDSO {
            self.vdso_image(m)?
        } else if !m.module.starts_with('/') || key.ends_with(" 0") {
            // Anonymous code (JIT): no file to read.
            return None;
        } else {
            self.mapped_image(m, key)?
        };
        let tables = img.unwind_sections();
        // A stripped file (no .symtab): its separate debug file, by build
        // id, names what .dynsym does not (static functions).
        let debug = if img.has_symtab() {
            None
        } else {
            let search = crate::symbols::debug_files::Search {
                pid: self.pid,
                exited: self.exited,
                dirs: &self.debug_dirs,
            };
            let id = img.build_id();
            id.as_deref()
                .and_then(|id| search.by_build_id(id))
                .or_else(|| {
                    let link = img.debuglink()?;
                    search.by_debuglink(&link, id.as_deref(), &m.module)
                })
                .map(|(debug, _)| debug)
        };
        let segments = debug.as_ref().map(|_| img.load_segments());
        let named = debug.as_ref().unwrap_or(&img);
        let sparse = named.sparse();
        let copy =
            rootfs::sealed_sparse_copy("dynprof-sym", sparse.file_len(), sparse.symbol_chunks());
        let (file, path) = match copy {
            Ok(c) => c,
            Err(e) => {
                log::debug!("symbolize: copying {}: {e:#}", m.module);
                return None;
            }
        };
        let mut elf = Elf::new(path);
        // DWARF of a big framework (libtorch) costs seconds and hundreds of
        // MiB to parse; ELF symbols already name the functions we need
        // (and the copy holds no DWARF).
        elf.debug_syms = false;
        Some((
            Snapshot {
                _file: file,
                source: Source::Elf(elf),
                segments,
                build_id: img.build_id(),
                load_segments: img.load_segments(),
                debuglink: img.debuglink(),
                plt: img.plt_ranges(),
            },
            tables,
        ))
    }

    /// The target's `[vdso]`: dynprof's own image (`sys::vdso`), when the
    /// target's mapping is as long (a 32-bit target's is another image).
    fn vdso_image(&self, m: &Mapping) -> Option<ElfImage> {
        let own = crate::sys::vdso::own_image()?;
        if own.len() as u64 != m.end - m.start || m.offset != 0 {
            log::debug!(
                "symbolize: the target's [vdso] is {} bytes, dynprof's {}: not read",
                m.end - m.start,
                own.len()
            );
            return None;
        }
        ElfImage::from_bytes(Path::new(VDSO), own)
            .map_err(|e| log::debug!("symbolize: [vdso]: {e:#}"))
            .ok()
    }

    /// The file behind an executable mapping, read through
    /// `/proc/PID/map_files` (or inside the target's root).
    fn mapped_image(&self, m: &Mapping, key: &str) -> Option<ElfImage> {
        let by_map = PathBuf::from(format!(
            "/proc/{}/map_files/{:x}-{:x}",
            self.pid, m.start, m.end
        ));
        let img = ElfImage::open(&by_map).or_else(|e| {
            // map_files needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE: the
            // name inside the target's root, if it is still the same file.
            let (pid, name) = (self.pid, m.module.clone());
            let inode: Option<u64> = key.split_once(' ').and_then(|(_, i)| i.parse().ok());
            ElfImage::read_bounded(Path::new(&m.module), move || {
                let root = TargetRoot::open(&PathBuf::from(format!("/proc/{pid}/root")))?;
                let f = root.open_regular(&name)?;
                if inode.is_some_and(|ino| ino != f.ino) {
                    anyhow::bail!("{name} was replaced since it was mapped");
                }
                Ok(f)
            })
            .map_err(|e2| e.context(format!("{e2:#}")))
        });
        match img {
            Ok(i) => Some(i),
            Err(e) => {
                log::debug!("symbolize: {}: {e:#}", m.module);
                None
            }
        }
    }

    /// The mapping holding `addr`; `maps` is sorted by start (as
    /// /proc/PID/maps lists them) and the ranges do not overlap, so this is
    /// a binary search: the JIT stack scan asks for every word it reads.
    fn mapping(&self, addr: u64) -> Option<&Mapping> {
        let i = self.maps.partition_point(|m| m.start <= addr);
        let m = self.maps.get(i.checked_sub(1)?)?;
        (addr < m.end).then_some(m)
    }

    /// Remembers the file of an address named only by offset.
    fn note_unresolved(&mut self, addr: u64) {
        let Some(m) = self.mapping(addr).filter(|m| m.module.starts_with('/')) else {
            return;
        };
        let name = m.module.rsplit('/').next().unwrap_or(&m.module).to_string();
        if self.unresolved.contains_key(&name) {
            return;
        }
        let snap = self.snapshots.get(&m.file_key).and_then(|s| s.as_ref());
        let module = ModuleRef {
            name: name.clone(),
            path: m.module.clone(),
            build_id: snap.and_then(|s| s.build_id.clone()),
            segments: snap.map(|s| s.load_segments.clone()).unwrap_or_default(),
            debuglink: snap.and_then(|s| s.debuglink.clone()),
        };
        self.unresolved.insert(name, module);
    }

    /// The files named only by offset in some frame so far.
    pub fn unresolved_modules(&self) -> Vec<ModuleRef> {
        self.unresolved.values().cloned().collect()
    }

    /// `NAME [jit]` for code in anonymous executable memory that the
    /// target's perf map names.
    fn jit_name(&mut self, addr: u64) -> Option<String> {
        if !self.mapping(addr).is_some_and(|m| m.module.is_empty()) {
            return None;
        }
        let known = |s: &Self| s.perf_map.as_ref().and_then(|m| m.lookup(addr)).is_some();
        let due = self
            .perf_map_read
            .is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(1));
        if !known(self) && !self.exited && due {
            self.perf_map_read = Some(std::time::Instant::now());
            if let Some(m) = self.read_perf_map() {
                self.perf_map = Some(m);
            }
        }
        let name = self.perf_map.as_ref()?.lookup(addr)?;
        Some(format!("{name} {JIT_FRAME}"))
    }

    /// Reads `/tmp/perf-NSPID.map` inside the target's root (the PID as
    /// the target sees it; capped and bounded, a FIFO or a link out of the
    /// root refused).
    fn read_perf_map(&self) -> Option<PerfMap> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).ok()?;
        let ns_pid = crate::target::parse_nspid(&status)?.last()?.0;
        let root = TargetRoot::open(&PathBuf::from(format!("/proc/{}/root", self.pid))).ok()?;
        let path = format!("/tmp/perf-{ns_pid}.map");
        match targetdir::read_capped(&root, &path, 0, perfmap::MAX_BYTES) {
            Ok((bytes, _)) => {
                let m = PerfMap::parse(&bytes);
                log::debug!("symbolize: {path}: {} JIT symbols", m.len());
                Some(m)
            }
            Err(e) => {
                log::debug!("symbolize: {path}: {e}");
                None
            }
        }
    }

    fn unknown(&self, addr: u64) -> String {
        match self.mapping(addr) {
            Some(m) if !m.module.is_empty() => {
                let base = m.module.rsplit('/').next().unwrap_or(&m.module);
                format!("[unknown] {base}+{:#x}", addr - m.start + m.offset)
            }
            // Executable memory with no file: code generated at run time
            // (oneDNN's kernels in PyTorch, a JIT compiler).
            Some(_) => JIT_FRAME.to_string(),
            _ => "[unknown]".to_string(),
        }
    }
}

/// Drops the zero terminator BPF stack maps pad with, and moves every frame
/// but the leaf back by one byte: those are return addresses, which point
/// after the call and, when the call is a function's last instruction,
/// into the next function.
fn adjusted(ips: &[u64]) -> Vec<u64> {
    ips.iter()
        .take_while(|&&ip| ip != 0)
        .enumerate()
        .map(|(i, &ip)| if i == 0 { ip } else { ip - 1 })
        .collect()
}

/// The distinct adjusted addresses of `stacks` that `cache` lacks.
fn uncached(stacks: &[&[u64]], cache: &HashMap<u64, Vec<String>>) -> Vec<u64> {
    let mut v: Vec<u64> = stacks
        .iter()
        .flat_map(|ips| adjusted(ips))
        .filter(|a| !cache.contains_key(a))
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The function, then the functions inlined into it at this address,
/// outermost first: root-first, like the stack they are part of.
/// Offline (`report --symbolize`): the function at each virtual address
/// of `debug_file` (a separate debug file, or any ELF with `.symtab`),
/// `None` where it names none. The file is the operator's, read in place.
pub fn name_offline(debug_file: &Path, vaddrs: &[u64]) -> Result<Vec<Option<String>>> {
    let blaze = Blaze::builder()
        .enable_code_info(false)
        .enable_inlined_fns(false)
        .enable_demangling(false)
        .build();
    let mut elf = Elf::new(debug_file);
    elf.debug_syms = false;
    let results = blaze
        .symbolize(&Source::Elf(elf), Input::VirtOffset(vaddrs))
        .with_context(|| format!("symbolizing with {}", debug_file.display()))?;
    Ok(results
        .iter()
        .map(|r| match r {
            Symbolized::Sym(sym) => Some(demangle::frame(&sym.name)),
            _ => None,
        })
        .collect())
}

fn sym_frames(sym: &Sym<'_>) -> Vec<String> {
    let mut v = vec![demangle::frame(&sym.name)];
    v.extend(sym.inlined.iter().map(|f| demangle::frame(&f.name)));
    v
}

fn read_maps(pid: u32) -> std::io::Result<Vec<Mapping>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let mut out = Vec::new();
    for line in text.lines() {
        // start-end perms offset dev inode path
        let mut it = line.split_ascii_whitespace();
        let (Some(range), Some(perms), Some(off)) = (it.next(), it.next(), it.next()) else {
            continue;
        };
        if !perms.contains('x') {
            continue;
        }
        let (Some(dev), Some(inode)) = (it.next(), it.next()) else {
            continue;
        };
        let module = it.collect::<Vec<_>>().join(" ");
        // The vDSO shares "00:00 0" with anonymous (JIT) memory, but has
        // tables and names of its own (`snapshot`).
        let file_key = if module == VDSO {
            VDSO.to_string()
        } else {
            format!("{dev} {inode}")
        };
        let Some((s, e)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end), Ok(offset)) = (
            u64::from_str_radix(s, 16),
            u64::from_str_radix(e, 16),
            u64::from_str_radix(off, 16),
        ) else {
            continue;
        };
        out.push(Mapping {
            start,
            end,
            offset,
            file_key,
            module,
        });
    }
    // The kernel lists them in address order; `mapping` relies on it.
    out.sort_by_key(|m| m.start);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[inline(never)]
    #[unsafe(no_mangle)]
    pub(crate) extern "C" fn dynprof_symbolize_test_target(x: u64) -> u64 {
        std::hint::black_box(x.wrapping_mul(31).wrapping_add(7))
    }

    #[inline(never)]
    fn rust_mangled_target(x: u64) -> u64 {
        std::hint::black_box(x ^ 0x55)
    }

    #[test]
    fn names_functions_of_this_process() {
        let mut s = Symbolizer::new(std::process::id(), &[]).unwrap();
        let leaf = dynprof_symbolize_test_target as *const () as u64;
        let caller = rust_mangled_target as *const () as u64;
        // Leaf first, as the kernel gives it; caller "return address" +1 so
        // the -1 adjustment lands inside the function.
        let frames = s.user_stack(&[leaf, caller + 1, 0, 0]);
        assert_eq!(frames.len(), 2, "{frames:?}");
        assert!(
            frames[1].contains("dynprof_symbolize_test_target"),
            "{frames:?}"
        );
        assert!(frames[0].contains("rust_mangled_target"), "{frames:?}");
        // Demangled: no `_ZN`/`_R` prefix left.
        assert!(
            !frames[0].starts_with("_ZN") && !frames[0].starts_with("_R"),
            "{frames:?}"
        );
        // Cached: the same answer again.
        assert_eq!(s.user_stack(&[leaf, caller + 1]), frames);
        assert_eq!(
            dynprof_symbolize_test_target(1) + rust_mangled_target(1),
            38 + 0x54
        );
    }

    #[test]
    fn unknown_addresses_and_exited_process() {
        let mut s = Symbolizer::new(std::process::id(), &[]).unwrap();
        assert_eq!(s.user_stack(&[0x10]), vec!["[unknown]".to_string()]);
        assert!(s.user_stack(&[]).is_empty());

        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let mut s = Symbolizer::new(child.id(), &[]).unwrap();
        let (start, module) = {
            let m = &s.maps[0];
            (m.start, m.module.clone())
        };
        child.kill().unwrap();
        child.wait().unwrap();
        let frames = s.user_stack(&[start + 0x10]);
        assert_eq!(frames.len(), 1);
        let base = module.rsplit('/').next().unwrap();
        assert!(
            frames[0].starts_with(&format!("[unknown] {base}+0x")),
            "{frames:?}"
        );
    }

    /// blazesym maps what it symbolizes; were it the target's file, the
    /// target truncating it would kill this test process with SIGBUS.
    #[test]
    fn a_library_truncated_after_the_first_lookup_is_still_read_from_the_copy() {
        let dir = std::env::temp_dir().join(format!("dynprof-sym-trunc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A library `sleep` maps but never calls into (a running
        // executable cannot be opened for writing).
        let exe = dir.join("libm-copy.so");
        std::fs::copy("/lib/x86_64-linux-gnu/libm.so.6", &exe).unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .env("LD_PRELOAD", &exe)
            .env("LD_BIND_NOW", "1")
            .spawn()
            .unwrap();
        let path = exe.to_string_lossy().into_owned();
        let mut text = None;
        for _ in 0..500 {
            let maps = read_maps(child.id()).unwrap_or_default();
            if let Some(m) = maps.iter().find(|m| m.module == path) {
                // Executable mappings only are kept: this is libm's code.
                text = Some((m.start, m.end));
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let (start, end) = text.expect("the copy is mapped");
        let (a1, a2) = (start + 0x10, end - 0x10);
        let reference = Symbolizer::new(child.id(), &[]).unwrap().user_stack(&[a2]);
        let mut s = Symbolizer::new(child.id(), &[]).unwrap();
        s.user_stack(&[a1]);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&exe)
            .unwrap()
            .set_len(0)
            .unwrap();
        assert_eq!(s.user_stack(&[a2]), reference);
        child.kill().unwrap();
        child.wait().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn kernel_frames_are_suffixed() {
        let mut s = Symbolizer::new(std::process::id(), &[]).unwrap();
        let frames = s.kernel_stack(&[0xffff_ffff_ffff_0000]);
        assert_eq!(frames.len(), 1);
        assert!(frames[0].ends_with("_[k]"), "{frames:?}");
        // A real kernel function, when kallsyms shows addresses (root).
        let Ok(text) = std::fs::read_to_string("/proc/kallsyms") else {
            return;
        };
        let Some((addr, name)) = text.lines().find_map(|l| {
            let mut it = l.split_whitespace();
            let a = u64::from_str_radix(it.next()?, 16).ok()?;
            let t = it.next()?;
            let n = it.next()?;
            (a != 0 && (t == "T" || t == "t") && n == "schedule").then(|| (a, n.to_string()))
        }) else {
            return;
        };
        let frames = s.kernel_stack(&[addr + 4]);
        assert_eq!(frames, vec![format!("{name}_[k]")]);
    }
}
