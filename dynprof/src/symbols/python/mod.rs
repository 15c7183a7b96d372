//! CPython frames: finding the interpreter's state in a target, naming the
//! frames the `cpu` program read at a sample, and splicing them into the
//! native stack where `_PyEval_EvalFrameDefault` runs. See docs/stacks.md.
//!
//! Versions ([`layout`]): 3.11 (Debian 12's) and 3.12 from fixed tables,
//! 3.13 and 3.14 from the interpreter's own `_Py_DebugOffsets`. 3.11,
//! 3.13 and 3.14 are tested on real interpreters; 3.12 is not (none on
//! the machines this is tested on).
//!
//! Where frames are read: in eBPF, at the sample (as the OpenTelemetry
//! profiler does). Read later from user space the interpreter would have
//! moved on, so a copy of the stack is not enough: the frames live on the
//! interpreter's own data stack, not the C stack. Names (code objects) are
//! read from user space when the sample arrives, through `/proc/PID/mem`;
//! code objects live as long as their function, so this is nearly always
//! the object sampled. The target controls all of this memory: every
//! length is capped and a failed read names the frame `[py] ?`.
use std::{collections::HashMap, path::PathBuf};

use dynprof_common::unwind::{PyFrameRaw, PyOffsets};
use object::{Object, ObjectSegment, ObjectSymbol};

use super::{ElfImage, elf::Arch};
use crate::sys::{
    creds::{NsKind, ns_id},
    procmem::ProcMem,
};

pub mod layout;
mod lines;

pub use layout::{EntryMark, Layout, PY311, PY311_AARCH64, PY312};
pub use lines::line_of;

/// Frame name used when prefixing Python frames.
pub const PY_PREFIX: &str = "[py] ";
/// The native frame that runs Python frames.
pub const EVAL_FRAME: &str = "_PyEval_EvalFrameDefault";

/// A recognised interpreter in a target.
#[derive(Clone, Copy, Debug)]
pub struct Interpreter {
    /// For the `cpu` program.
    pub offsets: PyOffsets,
    /// For naming frames.
    pub layout: Layout,
}

/// The minor version `N` of a file named `python3.N` or `libpython3.N.so…`
/// (`None` for anything else, free-threaded `3.Nt` builds included).
fn minor_of(base: &str) -> Option<u8> {
    let rest = base
        .strip_prefix("libpython3.")
        .filter(|r| r.contains(".so"))
        .or_else(|| base.strip_prefix("python3."))?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    let after = &rest[digits.len()..];
    if digits.is_empty() || !(after.is_empty() || after.starts_with(".so")) {
        return None;
    }
    digits.parse().ok()
}

/// Turns the frame walk off (`0`/`off`): samples keep their native stacks
/// only. For measuring what the walk costs per sample (docs/performance.md)
/// and for a target where its cost is not wanted.
pub const FRAMES_ENV: &str = "DYNPROF_PYTHON_FRAMES";

/// Whether `DYNPROF_PYTHON_FRAMES`'s value `v` (unset: `None`) asks for
/// Python frames; anything unrecognised keeps them, with the reason.
pub fn frames_wanted(v: Option<&str>) -> (bool, Option<String>) {
    match v.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        None | Some("1" | "on" | "yes" | "true") => (true, None),
        Some("0" | "off" | "no" | "false") => (false, None),
        Some(other) => (
            true,
            Some(format!(
                "{FRAMES_ENV}={other:?} is not on or off; Python frames stay on"
            )),
        ),
    }
}

/// The interpreter of a target whose CPython is a supported version, with
/// `_PyRuntime`'s address in it; `None` for any other process (logged:
/// at debug for no CPython, as a warning for a CPython refused).
pub fn detect(host_pid: u32) -> Option<Interpreter> {
    let maps = std::fs::read_to_string(format!("/proc/{host_pid}/maps")).ok()?;
    // libpython first: a python3.X that links it has no _PyRuntime.
    let mut candidates: Vec<(u64, u64, u64, String, u8)> = Vec::new();
    for line in maps.lines() {
        let mut it = line.split_ascii_whitespace();
        let (Some(range), Some(_perms), Some(off), Some(_dev), Some(_ino)) =
            (it.next(), it.next(), it.next(), it.next(), it.next())
        else {
            continue;
        };
        let path = it.collect::<Vec<_>>().join(" ");
        let base = path.rsplit('/').next().unwrap_or("");
        let Some(minor) = minor_of(base) else {
            continue;
        };
        let Some((s, e)) = range.split_once('-') else {
            continue;
        };
        let (Ok(s), Ok(e), Ok(off)) = (
            u64::from_str_radix(s, 16),
            u64::from_str_radix(e, 16),
            u64::from_str_radix(off, 16),
        ) else {
            continue;
        };
        if !candidates.iter().any(|c| c.3 == path) {
            candidates.push((s, e, off, path, minor));
        }
    }
    candidates.sort_by_key(|c| !c.3.contains("libpython"));
    for (start, end, off, path, minor) in candidates {
        let by_map = PathBuf::from(format!("/proc/{host_pid}/map_files/{start:x}-{end:x}"));
        let img = match ElfImage::open(&by_map) {
            Ok(i) => i,
            Err(e) => {
                log::debug!("python: {path}: {e:#}");
                continue;
            }
        };
        let Some(runtime) = runtime_address(&img, start, off) else {
            log::debug!("python: {path} has no _PyRuntime symbol");
            continue;
        };
        let Some(arch) = img.arch() else {
            log::warn!("python: PID {host_pid}: {path}: built for a machine dynprof does not read");
            return None;
        };
        return interpreter(host_pid, &path, minor, arch, runtime);
    }
    None
}

/// The interpreter at `runtime` (`_PyRuntime`) in CPython 3.`minor`,
/// built for `arch`.
fn interpreter(
    host_pid: u32,
    path: &str,
    minor: u8,
    arch: Arch,
    runtime: u64,
) -> Option<Interpreter> {
    let mem = ProcMem::open(host_pid)
        .map_err(|e| log::warn!("python: PID {host_pid}: /proc/{host_pid}/mem: {e}"))
        .ok()?;
    let layout = if minor >= 13 {
        let len = layout::debug_offsets_len(minor);
        let table = len.and_then(|len| mem.read(runtime, len).ok());
        let parsed = match (len, table) {
            (None, _) => Err(anyhow::anyhow!("not a supported version")),
            (_, None) => Err(anyhow::anyhow!("_PyRuntime is unreadable")),
            (_, Some(t)) => layout::from_debug_offsets(&t, minor),
        };
        match parsed {
            Ok(l) => l,
            Err(e) => {
                log::warn!(
                    "python: PID {host_pid}: {path} (CPython 3.{minor}): {e:#}; \
                     no Python frames for this target"
                );
                return None;
            }
        }
    } else if let Some(l) = layout::fixed(minor, arch) {
        l
    } else {
        log::warn!(
            "python: PID {host_pid}: {path}: CPython 3.{minor} is not supported \
             (3.11 to 3.14 are); no Python frames for this target"
        );
        return None;
    };
    let mut o = layout.offsets;
    // Addresses from the target's ELF and memory: wrapping, never a panic
    // (a wrong address only makes the program's reads fail).
    o.interp_head = runtime.wrapping_add(layout.runtime_interp_head);
    if let Some(t) = layout.runtime_tstate_current {
        o.tstate_current = runtime.wrapping_add(t);
    }
    // 3.12+: the main interpreter (static, inside _PyRuntime) owns its GIL;
    // its last holder is the likely sampled thread (checked by thread id).
    if let (Some(h), Ok(interp)) = (layout.interp_gil_holder, mem.u64(o.interp_head))
        && interp != 0
    {
        o.tstate_current = interp.wrapping_add(h);
    }
    // Thread ids as the target sees them, when its PID namespace is not ours.
    if let (Some(theirs), Some(ours)) = (
        ns_id(&host_pid.to_string(), NsKind::Pid),
        ns_id("self", NsKind::Pid),
    ) && theirs != ours
    {
        o.pidns_dev = theirs.dev;
        o.pidns_ino = theirs.ino;
    }
    log::debug!("python: CPython 3.{minor} in PID {host_pid} ({path}), _PyRuntime at {runtime:#x}");
    Some(Interpreter { offsets: o, layout })
}

/// `_PyRuntime`'s address in the target, from a mapping of the file at
/// `start` whose first byte is at file offset `off`.
fn runtime_address(img: &ElfImage, start: u64, off: u64) -> Option<u64> {
    let file = img.file();
    let sym = file
        .dynamic_symbols()
        .chain(file.symbols())
        .find(|s| s.name() == Ok("_PyRuntime") && !s.is_undefined())?;
    let seg = file.segments().find(|seg| {
        let (o, size) = seg.file_range();
        // Checked: the target's file is hostile until proven otherwise.
        off >= o && o.checked_add(size.max(1)).is_some_and(|end| off < end)
    })?;
    let (seg_off, _) = seg.file_range();
    let vaddr_at_start = seg.address().checked_add(off - seg_off)?;
    let bias = start.checked_sub(vaddr_at_start)?;
    sym.address().checked_add(bias)
}

/// What naming a frame needs from its code object.
#[derive(Clone, Debug)]
struct CodeInfo {
    qualname: String,
    filename: String,
    firstlineno: i32,
    linetable: Vec<u8>,
}

/// Longest name or file name read, and largest line table.
const MAX_STR: usize = 1024;
const MAX_LINETABLE: usize = 1 << 20;

/// Names Python frames of one target.
pub struct PyNames {
    mem: Option<ProcMem>,
    /// `None`: the target's interpreter was not recognised (its frames,
    /// had any been read, are named `[py] ?`).
    layout: Option<Layout>,
    code: HashMap<u64, Option<CodeInfo>>,
    /// (code, instr) → name: a line table is scanned once per place, not
    /// once per sample (the target sizes it, up to [`MAX_LINETABLE`]).
    names: HashMap<(u64, u64), String>,
}

/// Code objects and named places remembered at most; past it the caches
/// start over (a long job that keeps making code, e.g. `exec` in a loop).
const MAX_CACHED: usize = 1 << 16;

impl PyNames {
    pub fn new(host_pid: u32) -> Self {
        let mem = ProcMem::open(host_pid)
            .map_err(|e| log::debug!("python: /proc/{host_pid}/mem: {e}"))
            .ok();
        Self {
            mem,
            layout: detect(host_pid).map(|i| i.layout),
            code: HashMap::new(),
            names: HashMap::new(),
        }
    }

    /// The frames read at one sample (innermost first), named, each with
    /// whether it is the outermost of its `_PyEval_EvalFrameDefault` call
    /// (for [`splice`]). 3.12+'s shim frames are dropped: each marks the
    /// frame before it as its call's outermost.
    pub fn frames(&mut self, raw: &[PyFrameRaw]) -> Vec<(String, bool)> {
        self.frames_and_shims(raw).0
    }

    /// [`frames`](Self::frames), and the address of the shim frame that
    /// ends each run (3.12+; innermost first; empty for 3.11). The shim is
    /// a local of its `_PyEval_EvalFrameDefault` call, so its address
    /// names the native frame the run belongs to ([`splice`]).
    pub fn frames_and_shims(&mut self, raw: &[PyFrameRaw]) -> (Vec<(String, bool)>, Vec<u64>) {
        let entry = self.layout.map_or(EntryMark::IsEntry, |l| l.entry);
        let mut out: Vec<(String, bool)> = Vec::with_capacity(raw.len());
        let mut shims = Vec::new();
        for f in raw {
            match entry {
                EntryMark::IsEntry => out.push((self.frame_name(f), f.is_entry != 0)),
                EntryMark::ShimOwner if f.is_entry == 3 => {
                    // A shim with no frame since the last one starts no run.
                    if let Some(last) = out.last_mut().filter(|l| !l.1) {
                        last.1 = true;
                        shims.push(f.addr);
                    }
                }
                EntryMark::ShimOwner if f.is_entry > 3 => {}
                EntryMark::ShimOwner => out.push((self.frame_name(f), false)),
            }
        }
        (out, shims)
    }

    /// `[py] qualname (file.py:LINE)`, or `[py] ?` for an unreadable code
    /// object.
    pub fn frame_name(&mut self, f: &PyFrameRaw) -> String {
        let code = match self.layout {
            // A `_PyStackRef`'s tag bits (objects are 8-byte aligned).
            Some(l) if l.code_tagged => f.code & !7,
            _ => f.code,
        };
        if let Some(n) = self.names.get(&(code, f.instr)) {
            return n.clone();
        }
        if self.names.len() >= MAX_CACHED {
            self.names.clear();
        }
        let n = self.name_uncached(code, f.instr);
        self.names.insert((code, f.instr), n.clone());
        n
    }

    fn name_uncached(&mut self, code: u64, instr: u64) -> String {
        let Some(layout) = self.layout else {
            return format!("{PY_PREFIX}?");
        };
        if self.code.len() >= MAX_CACHED {
            self.code.clear();
        }
        if !self.code.contains_key(&code) {
            let info = self.read_code(&layout, code);
            self.code.insert(code, info);
        }
        let Some(info) = self.code.get(&code).and_then(Option::as_ref) else {
            return format!("{PY_PREFIX}?");
        };
        let first = code.wrapping_add(layout.code_code_adaptive);
        let line = if instr < first {
            // Not started yet (3.11's `prev_instr` is one before the first).
            info.firstlineno
        } else {
            line_of(&info.linetable, info.firstlineno, (instr - first) / 2)
                .unwrap_or(info.firstlineno)
        };
        let file = info.filename.rsplit('/').next().unwrap_or(&info.filename);
        format!("{PY_PREFIX}{} ({file}:{line})", info.qualname)
    }

    fn read_code(&self, l: &Layout, code: u64) -> Option<CodeInfo> {
        let mem = self.mem.as_ref()?;
        let ptr = |off: u64| mem.u64(code.checked_add(off)?).ok();
        let first = mem.read(code.checked_add(l.code_firstlineno)?, 4).ok()?;
        let firstlineno = i32::from_le_bytes(first.try_into().ok()?);
        let qualname = read_str(mem, l, ptr(l.code_qualname)?)
            .or_else(|| read_str(mem, l, ptr(l.code_name)?))?;
        let filename = read_str(mem, l, ptr(l.code_filename)?).unwrap_or_else(|| "?".into());
        let linetable = read_bytes(mem, l, ptr(l.code_linetable)?).unwrap_or_default();
        Some(CodeInfo {
            qualname,
            filename,
            firstlineno,
            linetable,
        })
    }
}

/// A `str` object's text: compact ASCII or compact latin-1 only (what
/// identifiers and paths nearly always are); `None` otherwise.
fn read_str(mem: &ProcMem, l: &Layout, obj: u64) -> Option<String> {
    let len = i64::from_le_bytes(
        mem.read(obj.checked_add(l.str_length)?, 8)
            .ok()?
            .try_into()
            .ok()?,
    );
    let state = u32::from_le_bytes(
        mem.read(obj.checked_add(l.str_state)?, 4)
            .ok()?
            .try_into()
            .ok()?,
    );
    // `interned:2, kind:3, compact:1, ascii:1` (3.11 to 3.14).
    let (kind, compact, ascii) = ((state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1);
    if !(0..=MAX_STR as i64).contains(&len) || compact != 1 || kind != 1 {
        return None;
    }
    let data = if ascii == 1 {
        l.str_ascii_data
    } else {
        l.str_compact_data
    };
    let bytes = mem.read(obj.checked_add(data)?, len as usize).ok()?;
    Some(bytes.iter().map(|&b| b as char).collect())
}

/// A `bytes` object's contents.
fn read_bytes(mem: &ProcMem, l: &Layout, obj: u64) -> Option<Vec<u8>> {
    let size = i64::from_le_bytes(
        mem.read(obj.checked_add(l.bytes_size)?, 8)
            .ok()?
            .try_into()
            .ok()?,
    );
    if !(0..=MAX_LINETABLE as i64).contains(&size) {
        return None;
    }
    mem.read(obj.checked_add(l.bytes_data)?, size as usize).ok()
}

/// Splices Python frames (innermost first, with their `is_entry` flags)
/// into a native stack, given leaf first, one group of names per address
/// (a function and the functions inlined into it there). Returns the
/// joined stack, root first.
///
/// Each run of frames up to an entry frame belongs to one
/// `_PyEval_EvalFrameDefault` call, the innermost run to the innermost
/// call. Where the run's call is known by its stack frame (`anchors[k]`,
/// the leaf-first index of the group whose stack memory holds run `k`'s
/// shim), the run goes right above that frame, whatever its name: a
/// PGO-split evaluator has no symbol. Runs without an anchor go under the
/// evaluator frames (by name) rootward of the last anchored one, innermost
/// to innermost. Runs left over (the native stack was cut short, or has no
/// evaluator frame) go at the root. Anchors that are not in order are
/// ignored.
pub fn splice(
    native: Vec<Vec<String>>,
    py: &[(String, bool)],
    anchors: &[Option<usize>],
) -> Vec<String> {
    let flat = |native: Vec<Vec<String>>| native.into_iter().rev().flatten().collect();
    if py.is_empty() {
        return flat(native);
    }
    // Runs, innermost first; each run root first.
    let mut runs: Vec<Vec<String>> = Vec::new();
    let mut cur = Vec::new();
    for (name, is_entry) in py {
        cur.push(name.clone());
        if *is_entry {
            cur.reverse();
            runs.push(std::mem::take(&mut cur));
        }
    }
    if !cur.is_empty() {
        cur.reverse();
        runs.push(cur);
    }
    // The group each run goes above, leaf-first index.
    let mut at: Vec<Option<usize>> = vec![None; runs.len()];
    let anchored: Vec<(usize, usize)> = anchors
        .iter()
        .take(runs.len())
        .enumerate()
        .filter_map(|(k, a)| a.filter(|&i| i < native.len()).map(|i| (k, i)))
        .collect();
    // Anchors must be a prefix of the runs, each strictly rootward of the
    // one before.
    let in_order = anchored.iter().enumerate().all(|(j, (k, _))| j == *k)
        && anchored.windows(2).all(|w| w[0].1 < w[1].1);
    let mut next = 0;
    let mut from = 0;
    if in_order {
        for (k, i) in &anchored {
            at[*k] = Some(*i);
            next = k + 1;
            from = i + 1;
        }
    }
    let is_eval = |g: &Vec<String>| g.iter().any(|f| f == EVAL_FRAME);
    let mut evals = (from..native.len()).filter(|&i| is_eval(&native[i]));
    for slot in at.iter_mut().skip(next) {
        match evals.next() {
            Some(i) => *slot = Some(i),
            None => break,
        }
    }
    // Root first: the runs with no place, outermost first, then each
    // group followed by the runs placed above it (outermost first).
    let mut out: Vec<String> = Vec::new();
    for (k, run) in runs.iter().enumerate().rev() {
        if at[k].is_none() {
            out.extend(run.iter().cloned());
        }
    }
    for (i, group) in native.into_iter().enumerate().rev() {
        let here: Vec<usize> = (0..runs.len())
            .rev()
            .filter(|&k| at[k] == Some(i))
            .collect();
        if here.is_empty() {
            out.extend(group);
            continue;
        }
        // Right after the evaluator's own name where the group has it (an
        // inlined callee comes after the Python frames it runs for).
        let split = group
            .iter()
            .position(|f| f == EVAL_FRAME)
            .map_or(1, |p| p + 1);
        let mut group = group.into_iter();
        out.extend(group.by_ref().take(split));
        for k in here {
            out.extend(runs[k].iter().cloned());
        }
        out.extend(group);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn python_frames_switch_reads_on_and_off() {
        assert_eq!(frames_wanted(None), (true, None));
        for on in ["1", "on", " ON ", "yes", "true"] {
            assert_eq!(frames_wanted(Some(on)), (true, None), "{on}");
        }
        for off in ["0", "off", "Off", "no", "false\n"] {
            assert_eq!(frames_wanted(Some(off)), (false, None), "{off}");
        }
        let (on, why) = frames_wanted(Some("maybe"));
        assert!(on);
        assert!(why.unwrap().contains("DYNPROF_PYTHON_FRAMES=\"maybe\""));
    }

    #[test]
    fn interpreter_file_names() {
        assert_eq!(minor_of("python3.11"), Some(11));
        assert_eq!(minor_of("python3.13"), Some(13));
        assert_eq!(minor_of("libpython3.14.so.1.0"), Some(14));
        assert_eq!(minor_of("libpython3.12.so"), Some(12));
        // Free-threaded builds, and files that are not the interpreter.
        assert_eq!(minor_of("python3.13t"), None);
        assert_eq!(minor_of("libpython3.13t.so.1.0"), None);
        assert_eq!(minor_of("python3"), None);
        assert_eq!(minor_of("python3.11-config"), None);
        assert_eq!(minor_of("libpython3.11.a"), None);
    }

    /// 3.12+: each `_PyEval_EvalFrameDefault` call's shim frame (owner 3)
    /// ends a run and is dropped; owners above 3 (3.14's C-stack frames)
    /// are dropped too. Without a layout, frames are named `[py] ?`.
    #[test]
    fn shim_frames_mark_runs() {
        let mut n = PyNames {
            mem: None,
            layout: Some(PY312),
            code: HashMap::new(),
            names: HashMap::new(),
        };
        let f = |code, owner| PyFrameRaw {
            code,
            instr: 0,
            is_entry: owner,
            _pad: 0,
            addr: 0,
        };
        let got = n.frames(&[f(1, 0), f(2, 0), f(0, 3), f(3, 4), f(4, 0), f(0, 3)]);
        let entries: Vec<bool> = got.iter().map(|g| g.1).collect();
        assert_eq!(entries, vec![false, true, true]);
        let mut n311 = PyNames {
            layout: Some(PY311),
            ..n
        };
        let got = n311.frames(&[f(1, 0), f(2, 1), f(3, 0)]);
        let entries: Vec<bool> = got.iter().map(|g| g.1).collect();
        assert_eq!(entries, vec![false, true, false]);
    }

    /// A root-first list of names as leaf-first groups of one.
    fn groups(v: &[&str]) -> Vec<Vec<String>> {
        v.iter().rev().map(|x| vec![x.to_string()]).collect()
    }

    #[test]
    fn splice_runs_under_their_evaluator_calls() {
        let native = groups(&["main", EVAL_FRAME, "call", EVAL_FRAME, "leaf_c"]);
        // Innermost first: hot and caller in the inner call, outer in the
        // outer one.
        let py = vec![
            ("[py] hot".to_string(), false),
            ("[py] caller".to_string(), true),
            ("[py] <module>".to_string(), true),
        ];
        let joined = s(&[
            "main",
            EVAL_FRAME,
            "[py] <module>",
            "call",
            EVAL_FRAME,
            "[py] caller",
            "[py] hot",
            "leaf_c",
        ]);
        assert_eq!(splice(native.clone(), &py, &[]), joined);
        // Anchored where the evaluators are: the same.
        assert_eq!(splice(native.clone(), &py, &[Some(1), Some(3)]), joined);
        // Anchors out of order are ignored.
        assert_eq!(splice(native, &py, &[Some(3), Some(1)]), joined);
        // A native stack cut short: the outer run goes at the root.
        let native = groups(&[EVAL_FRAME, "leaf_c"]);
        assert_eq!(
            splice(native, &py, &[]),
            s(&[
                "[py] <module>",
                EVAL_FRAME,
                "[py] caller",
                "[py] hot",
                "leaf_c"
            ])
        );
        assert_eq!(splice(groups(&["a"]), &[], &[]), s(&["a"]));
    }

    /// A PGO-split evaluator (Debian's 3.14): the evaluation loop has no
    /// symbol, so names find no evaluator frame, but each run's shim lies
    /// in a known frame. The inner run is anchored; the outer run's shim is
    /// beyond the copy, and goes under the evaluator named rootward.
    #[test]
    fn splice_by_anchor_without_evaluator_symbols() {
        let native = groups(&[
            "main",
            EVAL_FRAME,
            "call",
            "[unknown] python3.14+0x10",
            "leaf_c",
        ]);
        let py = vec![
            ("[py] hot".to_string(), false),
            ("[py] caller".to_string(), true),
            ("[py] <module>".to_string(), true),
        ];
        assert_eq!(
            splice(native.clone(), &py, &[Some(1), None]),
            s(&[
                "main",
                EVAL_FRAME,
                "[py] <module>",
                "call",
                "[unknown] python3.14+0x10",
                "[py] caller",
                "[py] hot",
                "leaf_c"
            ])
        );
        // Without anchors (the old result): the inner run is taken for the
        // named evaluator's, and the outer one goes at the root.
        assert_eq!(
            splice(native, &py, &[]),
            s(&[
                "[py] <module>",
                "main",
                EVAL_FRAME,
                "[py] caller",
                "[py] hot",
                "call",
                "[unknown] python3.14+0x10",
                "leaf_c"
            ])
        );
        // An inlined group: the run goes after the evaluator's name in it.
        let native = vec![
            vec!["leaf_c".to_string()],
            vec![EVAL_FRAME.to_string(), "inl".to_string()],
        ];
        assert_eq!(
            splice(native, &py[..2], &[Some(1)]),
            s(&[EVAL_FRAME, "[py] caller", "[py] hot", "inl", "leaf_c"])
        );
    }

    /// 3.12+ shims give one address per run; a repeated shim starts none.
    #[test]
    fn shim_addresses_follow_the_runs() {
        let mut n = PyNames {
            mem: None,
            layout: Some(PY312),
            code: HashMap::new(),
            names: HashMap::new(),
        };
        let f = |code, owner, addr| PyFrameRaw {
            code,
            instr: 0,
            is_entry: owner,
            _pad: 0,
            addr,
        };
        let (frames, shims) = n.frames_and_shims(&[
            f(0, 3, 0x10),
            f(1, 0, 0x20),
            f(0, 3, 0x30),
            f(0, 3, 0x40),
            f(2, 0, 0x50),
            f(0, 3, 0x60),
        ]);
        assert_eq!(frames.len(), 2);
        assert_eq!(shims, vec![0x30, 0x60]);
    }

    /// The offsets that 3.11 and 3.12 share the C expressions of, from
    /// `PyInterpreterState.threads.head` on (see the C arrays below).
    fn shared_fields(l: &Layout) -> Vec<u64> {
        let o = l.offsets;
        vec![
            o.interp_threads_head,
            o.tstate_next,
            o.tstate_native_thread_id,
            o.tstate_cframe,
            o.cframe_current_frame,
            o.frame_code,
            o.frame_previous,
            o.frame_prev_instr,
            o.frame_is_entry,
            l.code_filename,
            l.code_name,
            l.code_qualname,
            l.code_firstlineno,
            l.code_linetable,
            l.code_code_adaptive,
            l.str_length,
            l.str_state,
            l.str_ascii_data,
            l.str_compact_data,
            l.bytes_size,
            l.bytes_data,
        ]
    }

    /// The offsets of [`PY311`] and [`PY311_AARCH64`], in the order of
    /// [`PY311_C`].
    fn py311_fields(l: &Layout) -> Vec<u64> {
        let mut v = vec![l.runtime_tstate_current.unwrap(), l.runtime_interp_head];
        v.extend(shared_fields(l));
        v
    }

    /// The 3.11 fields of [`py311_fields`], as C.
    const PY311_C: &str = "
    offsetof(_PyRuntimeState, gilstate.tstate_current),
    offsetof(_PyRuntimeState, interpreters.head),
    offsetof(PyInterpreterState, threads.head), offsetof(PyThreadState, next),
    offsetof(PyThreadState, native_thread_id), offsetof(PyThreadState, cframe),
    offsetof(_PyCFrame, current_frame), offsetof(_PyInterpreterFrame, f_code),
    offsetof(_PyInterpreterFrame, previous), offsetof(_PyInterpreterFrame, prev_instr),
    offsetof(_PyInterpreterFrame, is_entry), offsetof(PyCodeObject, co_filename),
    offsetof(PyCodeObject, co_name), offsetof(PyCodeObject, co_qualname),
    offsetof(PyCodeObject, co_firstlineno), offsetof(PyCodeObject, co_linetable),
    offsetof(PyCodeObject, co_code_adaptive),
    offsetof(PyASCIIObject, length), offsetof(PyASCIIObject, state),
    sizeof(PyASCIIObject), sizeof(PyCompactUnicodeObject),
    offsetof(PyBytesObject, ob_base.ob_size), offsetof(PyBytesObject, ob_sval)";

    /// The offsets that `cc` computes for the C expressions `fields` with
    /// `includes` (first the directory of the target's `pyconfig.h`, then
    /// the headers), read from the assembly of a constant array: nothing
    /// is run, so a cross compiler gives the other machine's layout.
    fn offsets_by(cc: &str, includes: &[&std::path::Path], fields: &str) -> Vec<u64> {
        let dir = std::env::temp_dir().join(format!(
            "dynprof-pyoff-{}-{cc}-{}",
            std::process::id(),
            fields.len()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("off.c");
        std::fs::write(
            &src,
            format!(
                "#define Py_BUILD_CORE 1
#include <Python.h>
#include <internal/pycore_frame.h>
#include <internal/pycore_runtime.h>
#include <internal/pycore_interp.h>
#include <stddef.h>
unsigned long dynprof_offsets[] = {{{fields}}};
"
            ),
        )
        .unwrap();
        let mut cmd = std::process::Command::new(cc);
        for i in includes {
            cmd.arg("-I").arg(i);
        }
        let out = cmd.arg("-S").arg("-o").arg("-").arg(&src).output();
        let _ = std::fs::remove_dir_all(&dir);
        let out = out.unwrap_or_else(|e| panic!("{cc}: {e}"));
        assert!(
            out.status.success(),
            "{cc}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // GCC writes each element as `.quad N` (x86-64) or `.xword N` (arm64).
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| {
                let mut w = l.split_whitespace();
                matches!(w.next(), Some(".quad" | ".xword")).then(|| w.next()?.parse().ok())?
            })
            .collect()
    }

    fn have_cross_cc() -> bool {
        std::process::Command::new("aarch64-linux-gnu-gcc")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    }

    /// [`PY312`] against pyenv's 3.12 headers (the build
    /// tests/python_versions.rs runs), compiled for x86-64 and, when the
    /// cross compiler is there, for arm64 (3.12's pyconfig.h holds nothing
    /// these structures depend on; glibc's types come from the compiler).
    #[test]
    fn python312_offsets_match_the_headers() {
        let inc = std::path::Path::new("/root/.pyenv/versions/3.12.1/include/python3.12");
        if !inc.join("internal/pycore_frame.h").exists() {
            eprintln!("SKIPPED: no CPython 3.12 headers at {}", inc.display());
            return;
        }
        let fields = "
    offsetof(_PyRuntimeState, interpreters.head),
    offsetof(PyInterpreterState, _gil.last_holder),
    offsetof(PyInterpreterState, threads.head), offsetof(PyThreadState, next),
    offsetof(PyThreadState, native_thread_id), offsetof(PyThreadState, cframe),
    offsetof(_PyCFrame, current_frame), offsetof(_PyInterpreterFrame, f_code),
    offsetof(_PyInterpreterFrame, previous), offsetof(_PyInterpreterFrame, prev_instr),
    offsetof(_PyInterpreterFrame, owner), offsetof(PyCodeObject, co_filename),
    offsetof(PyCodeObject, co_name), offsetof(PyCodeObject, co_qualname),
    offsetof(PyCodeObject, co_firstlineno), offsetof(PyCodeObject, co_linetable),
    offsetof(PyCodeObject, co_code_adaptive),
    offsetof(PyASCIIObject, length), offsetof(PyASCIIObject, state),
    sizeof(PyASCIIObject), sizeof(PyCompactUnicodeObject),
    offsetof(PyBytesObject, ob_base.ob_size), offsetof(PyBytesObject, ob_sval)";
        let mut want = vec![PY312.runtime_interp_head, PY312.interp_gil_holder.unwrap()];
        want.extend(shared_fields(&PY312));
        assert_eq!(offsets_by("gcc", &[inc], fields), want);
        if have_cross_cc() {
            assert_eq!(offsets_by("aarch64-linux-gnu-gcc", &[inc], fields), want);
        } else {
            eprintln!("SKIPPED (arm64 part): no aarch64-linux-gnu-gcc");
        }
    }

    /// [`PY311`] against the installed interpreter's own headers
    /// (python3.11-dev), when they and a C compiler are present.
    #[test]
    fn python311_offsets_match_the_headers() {
        let inc = std::path::Path::new("/usr/include/python3.11");
        if !inc.join("internal/pycore_frame.h").exists() {
            eprintln!("SKIPPED: no CPython 3.11 headers");
            return;
        }
        let got = offsets_by("gcc", &[inc], PY311_C);
        assert_eq!(got, py311_fields(&PY311));
        assert_eq!(layout::fixed(11, Arch::X86_64), Some(PY311));
    }

    /// [`PY311_AARCH64`] against Debian's arm64 `pyconfig.h`
    /// (libpython3.11-dev:arm64, unpacked by `cargo xtask setup` beside the
    /// arm64 interpreter that the arm64 VM runs) and the cross compiler's
    /// glibc. Required under CI; a developer without them gets a skip line.
    #[test]
    fn python311_arm64_offsets_match_the_headers() {
        let arm64 =
            std::path::Path::new("/var/cache/dynprof/python-rootfs/python3.11-arm64/usr/include");
        let inc = std::path::Path::new("/usr/include/python3.11");
        let have_cc = have_cross_cc();
        if !arm64
            .join("aarch64-linux-gnu/python3.11/pyconfig.h")
            .is_file()
            || !inc.join("internal/pycore_frame.h").exists()
            || !have_cc
        {
            let msg = format!(
                "no arm64 CPython 3.11 headers in {} (cargo xtask setup), no host 3.11 \
                 headers, or no aarch64-linux-gnu-gcc",
                arm64.display()
            );
            assert!(std::env::var_os("CI").is_none(), "{msg}; required under CI");
            eprintln!("SKIPPED: {msg}");
            return;
        }
        let got = offsets_by("aarch64-linux-gnu-gcc", &[arm64, inc], PY311_C);
        assert_eq!(got, py311_fields(&PY311_AARCH64));
        assert_eq!(layout::fixed(11, Arch::Aarch64), Some(PY311_AARCH64));
        // The one field that moves: the test would pass for a wrong table
        // only if both machines agreed.
        assert_ne!(py311_fields(&PY311), got);
    }
}
