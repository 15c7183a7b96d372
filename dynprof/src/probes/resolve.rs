//! MarkerSpec (what the user wrote) → ResolvedProbe (object, file offset,
//! kernel config), through the target's /proc/PID/maps and mount namespace.
use std::{collections::HashMap, path::PathBuf, rc::Rc};

use anyhow::{Result, bail};
use dynprof_common::{MarkerConfig, arg_mode, reg, role};
use serde::Serialize;

use super::{
    presets,
    spec::{Location, MarkerArg, MarkerSpec, ObjectRef, Role, StrKind},
};
use crate::{
    symbols::{ElfImage, SymbolHit, debug_files, usdt},
    target::{Mapping, Target},
};

/// Integer argument registers of this architecture's C ABI, in order.
const ARG_REGS: &[u32] = &reg::ARGS;

/// A USDT semaphore to hold up while attached: the kernel does it from the
/// file offset (`ref_ctr_offset`); the /proc/PID/mem fallback writes the
/// runtime address.
#[derive(Clone, Debug, Serialize)]
pub struct Semaphore {
    pub runtime_addr: u64,
    /// Offset in the probed object's file (the same file as the probe).
    pub file_offset: u64,
}

/// One attach point, ready for the kernel.
#[derive(Clone, Debug, Serialize)]
pub struct ResolvedProbe {
    /// Index into the kernel's MARKERS map; the uprobe's attach cookie.
    pub index: u32,
    pub label: String,
    pub role: Role,
    pub spec: String,
    /// Path as the target sees it.
    pub object: String,
    /// Path dynprof opens and attaches to (through /proc/PID/root or map_files).
    #[serde(serialize_with = "ser_path")]
    pub attach_path: PathBuf,
    pub build_id: Option<String>,
    pub symbol: String,
    pub file_offset: u64,
    #[serde(skip)]
    pub config: MarkerConfig,
    pub semaphore: Option<Semaphore>,
    /// The class of the probed instruction: the kernel emulates some and
    /// single-steps the rest, 10–35× dearer per hit (docs/performance.md).
    pub first_insn: Option<super::insn::InsnClass>,
}

fn ser_path<S: serde::Serializer>(p: &std::path::Path, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&p.to_string_lossy())
}

/// Why a spec did not resolve, for the error message.
#[derive(Debug)]
pub struct Miss {
    pub spec: String,
    pub tried: Vec<String>,
    /// No mapped object matched: it may still be loaded later.
    pub not_mapped: bool,
}

/// Resolves `--marker` arguments, expanding `auto`. Fails with every object
/// and symbol tried when no step marker resolves. A symbol that a stripped
/// file lacks is looked for in its separate debug file (in `debug_dirs`,
/// `--debug-dir`, and where GDB looks).
pub fn resolve_markers(
    target: &Target,
    args: &[MarkerArg],
    debug_dirs: &[PathBuf],
) -> Result<Vec<ResolvedProbe>> {
    resolve_markers_cached(target, args, debug_dirs, &mut FileCache::default())
}

/// [`resolve_markers`] with the files read kept in `files`, for a caller
/// that resolves again as the target maps more (`--wait-for-marker`).
pub fn resolve_markers_cached(
    target: &Target,
    args: &[MarkerArg],
    debug_dirs: &[PathBuf],
    files: &mut FileCache,
) -> Result<Vec<ResolvedProbe>> {
    let maps = target.maps()?;
    let mut out: Vec<ResolvedProbe> = Vec::new();
    let mut misses: Vec<Miss> = Vec::new();
    for arg in args {
        match arg {
            MarkerArg::Spec(spec) => {
                match resolve_spec_cached(target, &maps, spec, out.len() as u32, files, debug_dirs)
                {
                    Ok(mut v) => out.append(&mut v),
                    Err(m) => misses.push(m),
                }
            }
            MarkerArg::Auto => {
                let groups = presets::auto_markers(&maps)?;
                let mut step_found = false;
                for group in groups {
                    for spec in group {
                        if spec.role == Role::Step && step_found {
                            continue;
                        }
                        if spec.role == Role::Aux && out.iter().any(|p| p.spec == spec.raw) {
                            continue;
                        }
                        match resolve_spec_cached(
                            target,
                            &maps,
                            &spec,
                            out.len() as u32,
                            files,
                            debug_dirs,
                        ) {
                            Ok(mut v) => {
                                step_found |= spec.role == Role::Step;
                                out.append(&mut v);
                            }
                            Err(m) => misses.push(m),
                        }
                    }
                }
            }
        }
    }
    if !out.iter().any(|p| p.role == Role::Step) {
        let mut msg = String::from("no step marker resolved in the target; tried:");
        for m in &misses {
            msg.push_str(&format!("\n  {}:", m.spec));
            for t in &m.tried {
                msg.push_str(&format!("\n    - {t}"));
            }
        }
        msg.push_str("\nhint: check the symbol with `nm -D --defined-only OBJECT`, or name another with --marker");
        bail!(msg);
    }
    for m in misses {
        log::warn!(
            "marker `{}` did not resolve: {}",
            m.spec,
            m.tried.join("; ")
        );
    }
    for p in out
        .iter()
        .filter(|p| p.first_insn.is_some_and(|c| c.single_stepped()))
    {
        log::warn!(
            "marker `{}` ({}): the kernel single-steps its first instruction, 10–35× the cost of an emulated \
             `push` per hit (docs/performance.md); a marker at SYMBOL+OFF on a push or nop is cheaper",
            p.spec,
            p.symbol
        );
    }
    Ok(out)
}

/// The order in which to attach resolved probes: aux markers first, then
/// step markers. Step 1 begins at the first step hit after attach; were an
/// aux marker attached later, a step boundary could slip in between and
/// step 1 would miss its first aux hits (seen as 10 backward passes over 11
/// steps with the DataLoader, where attaching Engine::execute is slow).
/// Where windows are possible, `attach`/`launch` leave aux markers to the
/// window scheduler, which attaches them when a plan is submitted, before
/// its kernel plan, for the same reason (docs/performance.md).
pub fn attach_order(probes: &[ResolvedProbe]) -> impl Iterator<Item = &ResolvedProbe> {
    let aux = probes.iter().filter(|p| p.role == Role::Aux);
    aux.chain(probes.iter().filter(|p| p.role != Role::Aux))
}

/// Objects the spec may refer to: (path in target, a mapping of it).
fn candidates<'a>(target: &Target, maps: &'a [Mapping], obj: &ObjectRef) -> Vec<&'a Mapping> {
    let mut seen: Vec<&str> = Vec::new();
    let mut out = Vec::new();
    let exe = std::fs::read_link(format!("/proc/{}/exe", target.host_pid))
        .map(|p| {
            p.to_string_lossy()
                .trim_end_matches(" (deleted)")
                .to_string()
        })
        .unwrap_or_default();
    for m in maps {
        let base = m.path.rsplit('/').next().unwrap_or("");
        let ok = match obj {
            ObjectRef::Exe => m.path == exe,
            ObjectRef::Path(p) => &m.path == p,
            ObjectRef::Lib(frag) => base.contains(frag.as_str()),
        };
        if ok && !seen.contains(&m.path.as_str()) {
            seen.push(&m.path);
            out.push(m);
        }
    }
    out
}

/// The host path through which dynprof reads and attaches to a mapped file:
/// the target's root normally; map_files when the file was deleted/replaced
/// or is otherwise not reachable by name.
/// A replaced or deleted file is reported once (see `target::mount`).
pub fn host_path_for(target: &Target, m: &Mapping) -> PathBuf {
    crate::target::mount::locate_and_warn(target, m).path
}

/// A mapped file as resolution knows it: its host path and inode, so a
/// file replaced at the same path between two resolutions is read anew.
type FileKey = (PathBuf, u64);

/// The target's files read while resolving: several specs (the torch
/// presets) look into the same large library, and a waiting attach
/// resolves again at every change of the target's map. Holds the ELF
/// images, and for each stripped one its separate debug file or the
/// finding that there is none (a search of several directories).
#[derive(Default)]
pub struct FileCache {
    images: HashMap<FileKey, Rc<ElfImage>>,
    debug: HashMap<FileKey, Option<(Rc<ElfImage>, PathBuf)>>,
    /// Searches for debug files made (not answered from the cache).
    debug_searches: usize,
}

impl FileCache {
    /// How many times a separate debug file was searched for (each
    /// stripped file once, however often it is resolved again).
    pub fn debug_searches(&self) -> usize {
        self.debug_searches
    }
}

pub fn resolve_spec_cached(
    target: &Target,
    maps: &[Mapping],
    spec: &MarkerSpec,
    first_index: u32,
    files: &mut FileCache,
    debug_dirs: &[PathBuf],
) -> Result<Vec<ResolvedProbe>, Miss> {
    let objects = candidates(target, maps, &spec.object);
    let what = match &spec.location {
        Location::Symbol { name, .. } => format!("symbol `{name}`"),
        Location::Usdt { provider, name } => format!("USDT probe {provider}:{name}"),
    };
    if objects.is_empty() {
        let obj = match &spec.object {
            ObjectRef::Exe => "the main executable".to_string(),
            ObjectRef::Path(p) => format!("`{p}`"),
            ObjectRef::Lib(f) => format!("a library matching `{f}`"),
        };
        return Err(Miss {
            spec: spec.raw.clone(),
            tried: vec![format!("{obj} is not mapped by PID {}", target.host_pid)],
            not_mapped: true,
        });
    }
    let mut tried = Vec::new();
    for m in objects {
        let mapped = crate::target::mount::locate_and_warn(target, m);
        let host = mapped.path.clone();
        let key: FileKey = (host.clone(), m.inode);
        let img = match files
            .images
            .get(&key)
            .cloned()
            .map(Ok)
            .unwrap_or_else(|| mapped.open_elf().map(Rc::new))
        {
            Ok(i) => {
                files.images.insert(key.clone(), i.clone());
                i
            }
            Err(e) => {
                tried.push(format!("{}: {e:#}", m.path));
                continue;
            }
        };
        let found = match &spec.location {
            Location::Symbol { name, offset } => {
                let mut hits = img.find_function(name);
                if hits.is_empty() && !img.has_symtab() {
                    match in_debug_file(target, &img, key, &m.path, name, debug_dirs, files) {
                        Some(h) => hits = h,
                        None => {
                            tried.push(format!(
                                "{}: no {what}; the file is stripped (no .symtab) and no \
                                 separate debug file of it was found (by build id or \
                                 .gnu_debuglink; name a directory holding it with --debug-dir)",
                                m.path
                            ));
                            continue;
                        }
                    }
                }
                if hits.len() > 1 && spec.role == Role::Step {
                    tried.push(format!(
                        "{}: {what} is ambiguous, write the full signature; candidates: {}",
                        m.path,
                        hits.iter()
                            .map(|h| h.demangled.as_str())
                            .collect::<Vec<_>>()
                            .join(" | ")
                    ));
                    continue;
                }
                hits.into_iter()
                    .map(|h| (h.demangled, h.file_offset + offset, None, None))
                    .collect::<Vec<_>>()
            }
            Location::Usdt { provider, name } => match usdt::find(&img, provider, name) {
                Ok(ps) => ps
                    .into_iter()
                    .map(|p| {
                        let sem = (p.semaphore_vaddr != 0)
                            .then(|| semaphore_addr(&img, maps, &m.path, p.semaphore_vaddr))
                            .flatten();
                        (
                            format!("{provider}:{name}"),
                            p.file_offset,
                            Some(p.args),
                            sem,
                        )
                    })
                    .collect(),
                Err(e) => {
                    tried.push(format!("{}: reading USDT notes: {e:#}", m.path));
                    continue;
                }
            },
        };
        if found.is_empty() {
            tried.push(format!("{}: no {what}", m.path));
            continue;
        }
        let mut out = Vec::new();
        for (i, (symbol, file_offset, usdt_args, sem)) in found.into_iter().enumerate() {
            let config = match kernel_config(spec, usdt_args.as_deref()) {
                Ok(c) => c,
                Err(e) => {
                    tried.push(format!("{}: {e}", m.path));
                    continue;
                }
            };
            out.push(ResolvedProbe {
                index: first_index + i as u32,
                label: spec.label(),
                role: spec.role,
                spec: spec.raw.clone(),
                object: m.path.clone(),
                attach_path: host.clone(),
                build_id: img.build_id(),
                symbol,
                file_offset,
                config,
                semaphore: sem.map(|(runtime_addr, file_offset)| Semaphore {
                    runtime_addr,
                    file_offset,
                }),
                first_insn: super::insn::at_offset(&host, file_offset),
            });
        }
        if !out.is_empty() {
            return Ok(out);
        }
    }
    Err(Miss {
        spec: spec.raw.clone(),
        tried,
        not_mapped: false,
    })
}

/// The function `name` in the separate debug file of the stripped `img`
/// (mapped at `path` in the target): a static function that only the debug
/// file's `.symtab` lists. Its addresses are the stripped file's too, so
/// the file offsets are `img`'s.
fn in_debug_file(
    target: &Target,
    img: &ElfImage,
    key: FileKey,
    path: &str,
    name: &str,
    debug_dirs: &[PathBuf],
    files: &mut FileCache,
) -> Option<Vec<SymbolHit>> {
    let (debug, at) = files
        .debug
        .entry(key)
        .or_insert_with(|| {
            files.debug_searches += 1;
            let search = debug_files::Search {
                pid: target.host_pid.0,
                exited: false,
                dirs: debug_dirs,
            };
            let id = img.build_id();
            id.as_deref()
                .and_then(|id| search.by_build_id(id))
                .or_else(|| search.by_debuglink(&img.debuglink()?, id.as_deref(), path))
                .map(|(debug, at)| (Rc::new(debug), at))
        })
        .clone()?;
    let hits: Vec<SymbolHit> = debug
        .find_function(name)
        .into_iter()
        .filter_map(|h| {
            let file_offset = img.vaddr_to_offset(h.vaddr)?;
            Some(SymbolHit { file_offset, ..h })
        })
        .collect();
    if !hits.is_empty() {
        log::info!("{path}: `{name}` found in its debug file {}", at.display());
    }
    Some(hits)
}

/// Runtime address and file offset of a USDT semaphore: its file offset
/// located in one of the object's mappings.
fn semaphore_addr(img: &ElfImage, maps: &[Mapping], path: &str, vaddr: u64) -> Option<(u64, u64)> {
    let off = img.vaddr_to_offset(vaddr)?;
    maps.iter()
        .find(|m| m.path == path && off >= m.offset && off < m.offset + (m.end - m.start))
        .map(|m| (m.start + (off - m.offset), off))
}

fn kernel_config(
    spec: &MarkerSpec,
    usdt_args: Option<&[(i32, usdt::ArgLoc)]>,
) -> Result<MarkerConfig, String> {
    let mut c = MarkerConfig::zeroed();
    c.role = match spec.role {
        Role::Step => role::STEP,
        Role::Aux => role::AUX,
    };
    let Some(f) = &spec.filter else { return Ok(c) };
    c.arg_mode = match f.kind {
        StrKind::CStr => arg_mode::CSTR,
        StrKind::StdString => arg_mode::STD_STRING,
    };
    match usdt_args {
        None => c.arg_reg = ARG_REGS[f.arg as usize],
        Some(args) => match args.get(f.arg as usize) {
            Some((_, usdt::ArgLoc::Reg(r))) => c.arg_reg = *r,
            Some((_, usdt::ArgLoc::Mem { base, offset })) => {
                c.arg_reg = *base;
                c.arg_in_memory = 1;
                c.arg_offset = *offset;
            }
            Some((_, usdt::ArgLoc::Const(_))) => {
                return Err(format!(
                    "USDT argument {} is a constant, not a string",
                    f.arg
                ));
            }
            None => return Err(format!("the USDT probe has no argument {}", f.arg)),
        },
    }
    let mut bytes = f.text.as_bytes().to_vec();
    if f.exact {
        // Comparing the terminating NUL too turns the prefix test into equality.
        bytes.push(0);
    }
    c.prefix_len = bytes.len() as u32;
    c.prefix[..bytes.len()].copy_from_slice(&bytes);
    Ok(c)
}
