//! CPython frames: finding the interpreter's state in a target, naming the
//! frames the `cpu` program read at a sample, and splicing them into the
//! native stack where `_PyEval_EvalFrameDefault` runs. See docs/stacks.md.
//!
//! Only CPython 3.11 is supported (Debian 12's; the only one on the
//! machines this is tested on). Its layout, from the interpreter's own
//! headers (`Include/internal/pycore_frame.h`, `pycore_runtime.h`,
//! `cpython/pystate.h`, `cpython/code.h`; checked by the
//! `python311_offsets_match_the_headers` test, which compiles `offsetof`s
//! against the installed headers), is [`PY311`].
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

use super::ElfImage;
use crate::sys::procmem::ProcMem;

/// CPython 3.11 on x86-64 and other LP64 targets.
pub const PY311: Layout = Layout {
    runtime_tstate_current: 576,
    runtime_interp_head: 40,
    offsets: PyOffsets {
        tstate_current: 0,
        interp_head: 0,
        interp_threads_head: 16,
        tstate_next: 8,
        tstate_native_thread_id: 160,
        tstate_cframe: 56,
        cframe_current_frame: 8,
        frame_code: 32,
        frame_previous: 48,
        frame_prev_instr: 56,
        frame_is_entry: 68,
    },
    code_filename: 112,
    code_name: 120,
    code_qualname: 128,
    code_firstlineno: 72,
    code_linetable: 136,
    code_code_adaptive: 184,
};

/// One CPython version's layout.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    /// `offsetof(_PyRuntimeState, gilstate.tstate_current)`.
    pub runtime_tstate_current: u64,
    /// `offsetof(_PyRuntimeState, interpreters.head)`.
    pub runtime_interp_head: u64,
    /// What the `cpu` program reads (`tstate_current` and `interp_head`
    /// are filled in per target).
    pub offsets: PyOffsets,
    pub code_filename: u64,
    pub code_name: u64,
    pub code_qualname: u64,
    pub code_firstlineno: u64,
    pub code_linetable: u64,
    /// `co_code_adaptive`: the first instruction (`_PyCode_CODE`).
    pub code_code_adaptive: u64,
}

/// Frame name used when prefixing Python frames.
pub const PY_PREFIX: &str = "[py] ";
/// The native frame that runs Python frames.
pub const EVAL_FRAME: &str = "_PyEval_EvalFrameDefault";

/// The offsets for a target whose interpreter is CPython 3.11, with
/// `_PyRuntime`'s address in it; `None` (logged at debug) for any other
/// process.
pub fn detect(host_pid: u32) -> Option<PyOffsets> {
    let maps = std::fs::read_to_string(format!("/proc/{host_pid}/maps")).ok()?;
    // libpython first: a python3.11 that links it has no _PyRuntime.
    let mut candidates: Vec<(u64, u64, u64, String)> = Vec::new();
    for line in maps.lines() {
        let mut it = line.split_ascii_whitespace();
        let (Some(range), Some(_perms), Some(off), Some(_dev), Some(_ino)) =
            (it.next(), it.next(), it.next(), it.next(), it.next())
        else {
            continue;
        };
        let path = it.collect::<Vec<_>>().join(" ");
        let base = path.rsplit('/').next().unwrap_or("");
        if !(base.starts_with("libpython3.11.so") || base == "python3.11") {
            continue;
        }
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
            candidates.push((s, e, off, path));
        }
    }
    candidates.sort_by_key(|c| !c.3.contains("libpython"));
    for (start, end, off, path) in candidates {
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
        let mut o = PY311.offsets;
        o.tstate_current = runtime + PY311.runtime_tstate_current;
        o.interp_head = runtime + PY311.runtime_interp_head;
        log::debug!("python: CPython 3.11 in PID {host_pid} ({path}), _PyRuntime at {runtime:#x}");
        return Some(o);
    }
    None
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
        off >= o && off < o + size.max(1)
    })?;
    let (seg_off, _) = seg.file_range();
    let vaddr_at_start = seg.address() + (off - seg_off);
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
    layout: Layout,
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
            layout: PY311,
            code: HashMap::new(),
            names: HashMap::new(),
        }
    }

    /// `[py] qualname (file.py:LINE)`, or `[py] ?` for an unreadable code
    /// object.
    pub fn frame_name(&mut self, f: &PyFrameRaw) -> String {
        if let Some(n) = self.names.get(&(f.code, f.instr)) {
            return n.clone();
        }
        if self.names.len() >= MAX_CACHED {
            self.names.clear();
        }
        let n = self.name_uncached(f);
        self.names.insert((f.code, f.instr), n.clone());
        n
    }

    fn name_uncached(&mut self, f: &PyFrameRaw) -> String {
        if self.code.len() >= MAX_CACHED {
            self.code.clear();
        }
        if !self.code.contains_key(&f.code) {
            let info = self.read_code(f.code);
            self.code.insert(f.code, info);
        }
        let Some(info) = self.code.get(&f.code).and_then(Option::as_ref) else {
            return format!("{PY_PREFIX}?");
        };
        let first = f.code + self.layout.code_code_adaptive;
        let line = if f.instr < first {
            // Not started yet (`prev_instr` is one before the first).
            info.firstlineno
        } else {
            line_of(&info.linetable, info.firstlineno, (f.instr - first) / 2)
                .unwrap_or(info.firstlineno)
        };
        let file = info.filename.rsplit('/').next().unwrap_or(&info.filename);
        format!("{PY_PREFIX}{} ({file}:{line})", info.qualname)
    }

    fn read_code(&self, code: u64) -> Option<CodeInfo> {
        let mem = self.mem.as_ref()?;
        let l = &self.layout;
        let ptr = |off: u64| mem.u64(code + off).ok();
        let first = mem.read(code + l.code_firstlineno, 4).ok()?;
        let firstlineno = i32::from_le_bytes(first.try_into().ok()?);
        let qualname =
            read_str(mem, ptr(l.code_qualname)?).or_else(|| read_str(mem, ptr(l.code_name)?))?;
        let filename = read_str(mem, ptr(l.code_filename)?).unwrap_or_else(|| "?".into());
        let linetable = read_bytes(mem, ptr(l.code_linetable)?).unwrap_or_default();
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
fn read_str(mem: &ProcMem, obj: u64) -> Option<String> {
    // PyASCIIObject: length at 16, state at 32, ASCII data at 48;
    // PyCompactUnicodeObject data at 72.
    let head = mem.read(obj, 48).ok()?;
    let len = i64::from_le_bytes(head[16..24].try_into().ok()?);
    let state = u32::from_le_bytes(head[32..36].try_into().ok()?);
    let (kind, compact, ascii) = ((state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1);
    if !(0..=MAX_STR as i64).contains(&len) || compact != 1 || kind != 1 {
        return None;
    }
    let data = if ascii == 1 { obj + 48 } else { obj + 72 };
    let bytes = mem.read(data, len as usize).ok()?;
    Some(bytes.iter().map(|&b| b as char).collect())
}

/// A `bytes` object's contents (ob_size at 16, data at 32).
fn read_bytes(mem: &ProcMem, obj: u64) -> Option<Vec<u8>> {
    let size = i64::from_le_bytes(mem.read(obj + 16, 8).ok()?.try_into().ok()?);
    if !(0..=MAX_LINETABLE as i64).contains(&size) {
        return None;
    }
    mem.read(obj + 32, size as usize).ok()
}

/// The line of code unit `index` from a CPython 3.11 location table
/// (`Objects/locations.md`): entries of `(byte & 7) + 1` code units whose
/// code `(byte >> 3) & 15` says how the line changes.
pub fn line_of(table: &[u8], firstlineno: i32, index: u64) -> Option<i32> {
    let mut line = firstlineno;
    let mut addr = 0u64;
    let mut i = 0usize;
    while i < table.len() {
        let b = table[i];
        if b & 0x80 == 0 {
            return None;
        }
        i += 1;
        let code = (b >> 3) & 15;
        let len = u64::from(b & 7) + 1;
        let varint = |i: &mut usize| -> Option<u32> {
            let mut v = 0u32;
            let mut shift = 0;
            loop {
                let c = *table.get(*i)?;
                *i += 1;
                v |= u32::from(c & 63).checked_shl(shift)?;
                if c & 64 == 0 {
                    return Some(v);
                }
                shift += 6;
            }
        };
        let svarint = |v: u32| -> i32 {
            if v & 1 == 1 {
                -((v >> 1) as i32)
            } else {
                (v >> 1) as i32
            }
        };
        let mut this_line = Some(line);
        match code {
            15 => this_line = None,
            14 => {
                line = line.wrapping_add(svarint(varint(&mut i)?));
                this_line = Some(line);
                varint(&mut i)?;
                varint(&mut i)?;
                varint(&mut i)?;
            }
            13 => {
                line = line.wrapping_add(svarint(varint(&mut i)?));
                this_line = Some(line);
            }
            10..=12 => {
                line = line.wrapping_add(i32::from(code) - 10);
                this_line = Some(line);
                i += 2;
            }
            _ => i += 1,
        }
        if index < addr + len {
            return this_line;
        }
        addr += len;
    }
    None
}

/// Splices Python frames (innermost first, with their `is_entry` flags)
/// into a native stack (root first): each run of frames up to an entry
/// frame belongs to one `_PyEval_EvalFrameDefault` call, the innermost run
/// to the innermost call. Runs left over (the native stack was cut short)
/// go at the root; with no evaluator frame at all, every run does.
pub fn splice(native: Vec<String>, py: &[(String, bool)]) -> Vec<String> {
    if py.is_empty() {
        return native;
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
    let evals: Vec<usize> = native
        .iter()
        .enumerate()
        .filter(|(_, f)| f.as_str() == EVAL_FRAME)
        .map(|(i, _)| i)
        .collect();
    let mut out = native;
    // Innermost run ↔ last evaluator frame; insert from the leaf end so
    // that earlier positions stay valid.
    let mut runs = runs.into_iter();
    for &pos in evals.iter().rev() {
        let Some(run) = runs.next() else { break };
        out.splice(pos + 1..pos + 1, run);
    }
    let rest: Vec<Vec<String>> = runs.collect();
    if !rest.is_empty() {
        let mut head: Vec<String> = rest.into_iter().rev().flatten().collect();
        head.extend(out);
        out = head;
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
    fn splice_runs_under_their_evaluator_calls() {
        let native = s(&["main", EVAL_FRAME, "call", EVAL_FRAME, "leaf_c"]);
        // Innermost first: hot and caller in the inner call, outer in the
        // outer one.
        let py = vec![
            ("[py] hot".to_string(), false),
            ("[py] caller".to_string(), true),
            ("[py] <module>".to_string(), true),
        ];
        assert_eq!(
            splice(native, &py),
            s(&[
                "main",
                EVAL_FRAME,
                "[py] <module>",
                "call",
                EVAL_FRAME,
                "[py] caller",
                "[py] hot",
                "leaf_c"
            ])
        );
        // A native stack cut short: the outer run goes at the root.
        let native = s(&[EVAL_FRAME, "leaf_c"]);
        assert_eq!(
            splice(native, &py),
            s(&[
                "[py] <module>",
                EVAL_FRAME,
                "[py] caller",
                "[py] hot",
                "leaf_c"
            ])
        );
        assert_eq!(splice(s(&["a"]), &[]), s(&["a"]));
    }

    #[test]
    fn location_table_lines() {
        // firstlineno 10. Entry 1: code 13 (no columns), +1 line, 2 units.
        // Entry 2: code 11 (one-line form, +1), 1 unit, two column bytes.
        // Entry 3: code 14 (long form), -2 lines, 3 units.
        // Entry 4: code 15 (no location), 1 unit.
        let table = [
            0x80 | (13 << 3) | 1,
            2, // svarint +1
            0x80 | (11 << 3),
            0,
            0,
            0x80 | (14 << 3) | 2,
            5, // svarint -2
            0,
            0,
            0,
            0x80 | (15 << 3),
        ];
        assert_eq!(line_of(&table, 10, 0), Some(11));
        assert_eq!(line_of(&table, 10, 1), Some(11));
        assert_eq!(line_of(&table, 10, 2), Some(12));
        assert_eq!(line_of(&table, 10, 3), Some(10));
        assert_eq!(line_of(&table, 10, 5), Some(10));
        assert_eq!(line_of(&table, 10, 6), None);
        assert_eq!(line_of(&table, 10, 7), None);
        // Garbage: no entry marker.
        assert_eq!(line_of(&[0x01, 0x02], 10, 0), None);
    }

    /// The table above against the installed interpreter's own headers
    /// (python3.11-dev), when they and a C compiler are present.
    #[test]
    fn python311_offsets_match_the_headers() {
        let inc = std::path::Path::new("/usr/include/python3.11");
        if !inc.join("internal/pycore_frame.h").exists() {
            eprintln!("SKIPPED: no CPython 3.11 headers");
            return;
        }
        let dir = std::env::temp_dir().join(format!("dynprof-pyoff-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("off.c");
        std::fs::write(
            &src,
            r#"#define Py_BUILD_CORE 1
#include <Python.h>
#include <internal/pycore_frame.h>
#include <internal/pycore_runtime.h>
#include <internal/pycore_interp.h>
#include <stddef.h>
#include <stdio.h>
int main(void) {
  printf("%zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu\n",
    offsetof(_PyRuntimeState, gilstate.tstate_current),
    offsetof(_PyRuntimeState, interpreters.head),
    offsetof(PyInterpreterState, threads.head), offsetof(PyThreadState, next),
    offsetof(PyThreadState, native_thread_id), offsetof(PyThreadState, cframe),
    offsetof(_PyCFrame, current_frame), offsetof(_PyInterpreterFrame, f_code),
    offsetof(_PyInterpreterFrame, previous), offsetof(_PyInterpreterFrame, prev_instr),
    offsetof(_PyInterpreterFrame, is_entry), offsetof(PyCodeObject, co_filename),
    offsetof(PyCodeObject, co_name), offsetof(PyCodeObject, co_qualname),
    offsetof(PyCodeObject, co_firstlineno), offsetof(PyCodeObject, co_linetable),
    offsetof(PyCodeObject, co_code_adaptive));
  return 0;
}
"#,
        )
        .unwrap();
        let exe = dir.join("off");
        let cc = std::process::Command::new("gcc")
            .arg("-I")
            .arg(inc)
            .arg("-o")
            .arg(&exe)
            .arg(&src)
            .output()
            .expect("gcc");
        assert!(
            cc.status.success(),
            "{}",
            String::from_utf8_lossy(&cc.stderr)
        );
        let out = std::process::Command::new(&exe).output().unwrap();
        let got: Vec<u64> = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(|v| v.parse().unwrap())
            .collect();
        let l = PY311;
        let o = l.offsets;
        assert_eq!(
            got,
            vec![
                l.runtime_tstate_current,
                l.runtime_interp_head,
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
            ]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
