//! CPython layouts: fixed tables for 3.11 and 3.12, and the interpreter's
//! own `_Py_DebugOffsets` for 3.13+ (`Include/internal/pycore_runtime.h`
//! in 3.13, `pycore_debug_offsets.h` in 3.14), which sits at the start of
//! `_PyRuntime`: the cookie `xdebugpy`, `PY_VERSION_HEX`, `free_threaded`,
//! then sections of `u64` fields, each section starting with the size of
//! the structure it describes.
//!
//! The target writes those bytes: [`from_debug_offsets`] checks the
//! cookie, that the version is the one the ELF's name says, that the
//! build has a GIL, and that every offset used lies inside its structure
//! (whose size is bounded), and refuses the table otherwise.
use anyhow::{Result, bail, ensure};
use dynprof_common::unwind::{PY_FRAME_VIA_CFRAME, PyOffsets};

use crate::symbols::elf::Arch;

/// How a version marks the frames that start one C-level
/// `_PyEval_EvalFrameDefault` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryMark {
    /// 3.11: the first frame of the call has `is_entry` set.
    IsEntry,
    /// 3.12+: the call pushes a shim frame (`owner` 3,
    /// `FRAME_OWNED_BY_CSTACK`, 3.14's `FRAME_OWNED_BY_INTERPRETER`)
    /// before its first frame; owners above 3 (3.14's C-stack frames) are
    /// not Python frames either.
    ShimOwner,
}

/// One CPython version's layout (x86-64 and other LP64 targets).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// 3.minor.
    pub minor: u8,
    /// `offsetof(_PyRuntimeState, gilstate.tstate_current)` (3.11 only).
    pub runtime_tstate_current: Option<u64>,
    /// `offsetof(_PyRuntimeState, interpreters.head)`.
    pub runtime_interp_head: u64,
    /// `offsetof(PyInterpreterState, _gil.last_holder)` (3.12+).
    pub interp_gil_holder: Option<u64>,
    /// What the `cpu` program reads (the addresses and the PID namespace
    /// are filled in per target).
    pub offsets: PyOffsets,
    pub entry: EntryMark,
    /// `f_executable` is a `_PyStackRef` with tag bits (3.14).
    pub code_tagged: bool,
    pub code_filename: u64,
    pub code_name: u64,
    pub code_qualname: u64,
    pub code_firstlineno: u64,
    pub code_linetable: u64,
    /// `co_code_adaptive`: the first instruction (`_PyCode_CODE`).
    pub code_code_adaptive: u64,
    /// `PyASCIIObject.length`, `.state`, and `sizeof(PyASCIIObject)`
    /// (where compact ASCII data starts); compact latin-1 data starts 16
    /// bytes later in 3.12+ (`utf8_length`, `utf8`), 24 in 3.11 (`wstr_length`).
    pub str_length: u64,
    pub str_state: u64,
    pub str_ascii_data: u64,
    pub str_compact_data: u64,
    /// `PyBytesObject.ob_size`, `.ob_sval`.
    pub bytes_size: u64,
    pub bytes_data: u64,
}

/// CPython 3.11 (checked against the headers by
/// `python311_offsets_match_the_headers`).
pub const PY311: Layout = Layout {
    minor: 11,
    runtime_tstate_current: Some(576),
    runtime_interp_head: 40,
    interp_gil_holder: None,
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
        flags: PY_FRAME_VIA_CFRAME,
        pidns_dev: 0,
        pidns_ino: 0,
    },
    entry: EntryMark::IsEntry,
    code_tagged: false,
    code_filename: 112,
    code_name: 120,
    code_qualname: 128,
    code_firstlineno: 72,
    code_linetable: 136,
    code_code_adaptive: 184,
    str_length: 16,
    str_state: 32,
    str_ascii_data: 48,
    str_compact_data: 72,
    bytes_size: 16,
    bytes_data: 32,
};

/// CPython 3.12, from the 3.12 headers' structures (`_PyRuntimeState`,
/// `PyInterpreterState.threads`, `PyThreadState`, `_PyCFrame`,
/// `_PyInterpreterFrame`, `PyCodeObject`). Tested by running one build,
/// pyenv's 3.12.1 (tests/python_versions.rs), and the same on arm64 by the
/// cross compiler (computed, not run: no arm64 3.12 is available), both by
/// `python312_offsets_match_the_headers`. 3.12 has no `_Py_DebugOffsets`
/// to check it against at run time.
pub const PY312: Layout = Layout {
    minor: 12,
    runtime_tstate_current: None,
    runtime_interp_head: 40,
    interp_gil_holder: Some(1048),
    offsets: PyOffsets {
        tstate_current: 0,
        interp_head: 0,
        interp_threads_head: 72,
        tstate_next: 8,
        tstate_native_thread_id: 144,
        tstate_cframe: 56,
        cframe_current_frame: 0,
        frame_code: 0,
        frame_previous: 8,
        frame_prev_instr: 56,
        frame_is_entry: 70,
        flags: PY_FRAME_VIA_CFRAME,
        pidns_dev: 0,
        pidns_ino: 0,
    },
    entry: EntryMark::ShimOwner,
    code_tagged: false,
    code_filename: 112,
    code_name: 120,
    code_qualname: 128,
    code_firstlineno: 68,
    code_linetable: 136,
    code_code_adaptive: 192,
    str_length: 16,
    str_state: 32,
    str_ascii_data: 40,
    str_compact_data: 56,
    bytes_size: 16,
    bytes_data: 32,
};

/// The `_Py_DebugOffsets` sections and their fields in order, per minor
/// version (3.13: `pycore_runtime.h`; 3.14: `pycore_debug_offsets.h`).
/// Only the sections up to the last one read are listed.
fn schema(minor: u8) -> Option<&'static [(&'static str, &'static [&'static str])]> {
    const RUNTIME: (&str, &[&str]) = ("runtime_state", &["finalizing", "interpreters_head"]);
    const THREAD: (&str, &[&str]) = (
        "thread_state",
        &[
            "prev",
            "next",
            "interp",
            "current_frame",
            "thread_id",
            "native_thread_id",
            "datastack_chunk",
            "status",
        ],
    );
    const OBJECT: (&str, &[&str]) = ("pyobject", &["ob_type"]);
    const TYPE: (&str, &[&str]) = ("type_object", &["tp_name", "tp_repr", "tp_flags"]);
    const TUPLE: (&str, &[&str]) = ("tuple_object", &["ob_item", "ob_size"]);
    const LIST: (&str, &[&str]) = ("list_object", &["ob_item", "ob_size"]);
    const DICT: (&str, &[&str]) = ("dict_object", &["ma_keys", "ma_values"]);
    const FLOAT: (&str, &[&str]) = ("float_object", &["ob_fval"]);
    const LONG: (&str, &[&str]) = ("long_object", &["lv_tag", "ob_digit"]);
    const BYTES: (&str, &[&str]) = ("bytes_object", &["ob_size", "ob_sval"]);
    const UNICODE: (&str, &[&str]) = ("unicode_object", &["state", "length", "asciiobject_size"]);
    const CODE: &[&str] = &[
        "filename",
        "name",
        "qualname",
        "linetable",
        "firstlineno",
        "argcount",
        "localsplusnames",
        "localspluskinds",
        "co_code_adaptive",
    ];
    match minor {
        13 => Some(&[
            RUNTIME,
            (
                "interpreter_state",
                &[
                    "id",
                    "next",
                    "threads_head",
                    "gc",
                    "imports_modules",
                    "sysdict",
                    "builtins",
                    "ceval_gil",
                    "gil_runtime_state",
                    "gil_runtime_state_enabled",
                    "gil_runtime_state_locked",
                    "gil_runtime_state_holder",
                ],
            ),
            THREAD,
            (
                "interpreter_frame",
                &["previous", "executable", "instr_ptr", "localsplus", "owner"],
            ),
            ("code_object", CODE),
            OBJECT,
            TYPE,
            TUPLE,
            LIST,
            DICT,
            FLOAT,
            LONG,
            BYTES,
            UNICODE,
        ]),
        14 => Some(&[
            RUNTIME,
            (
                "interpreter_state",
                &[
                    "id",
                    "next",
                    "threads_head",
                    "threads_main",
                    "gc",
                    "imports_modules",
                    "sysdict",
                    "builtins",
                    "ceval_gil",
                    "gil_runtime_state",
                    "gil_runtime_state_enabled",
                    "gil_runtime_state_locked",
                    "gil_runtime_state_holder",
                    "code_object_generation",
                    "tlbc_generation",
                ],
            ),
            THREAD,
            (
                "interpreter_frame",
                &[
                    "previous",
                    "executable",
                    "instr_ptr",
                    "localsplus",
                    "owner",
                    "stackpointer",
                    "tlbc_index",
                ],
            ),
            (
                "code_object",
                &[
                    "filename",
                    "name",
                    "qualname",
                    "linetable",
                    "firstlineno",
                    "argcount",
                    "localsplusnames",
                    "localspluskinds",
                    "co_code_adaptive",
                    "co_tlbc",
                ],
            ),
            OBJECT,
            TYPE,
            TUPLE,
            LIST,
            ("set_object", &["used", "table", "mask"]),
            DICT,
            FLOAT,
            LONG,
            BYTES,
            UNICODE,
        ]),
        _ => None,
    }
}

/// Byte position of `section.field` in `_Py_DebugOffsets` (`"size"`: the
/// section's first word), per [`schema`].
pub fn field_position(minor: u8, section: &str, field: &str) -> Option<usize> {
    // cookie, version, free_threaded.
    let mut pos = 24;
    for (name, fields) in schema(minor)? {
        if *name == section {
            if field == "size" {
                return Some(pos);
            }
            return fields
                .iter()
                .position(|f| *f == field)
                .map(|i| pos + 8 * (i + 1));
        }
        pos += 8 * (fields.len() + 1);
    }
    None
}

/// Bytes of `_Py_DebugOffsets` read: up to the end of the last section
/// listed.
pub fn debug_offsets_len(minor: u8) -> Option<usize> {
    Some(
        24 + schema(minor)?
            .iter()
            .map(|(_, f)| 8 * (f.len() + 1))
            .sum::<usize>(),
    )
}

/// The largest structure size believed (`PyInterpreterState` is the
/// largest, a few hundred KiB at most).
const MAX_STRUCT: u64 = 1 << 22;
/// The largest `PyObject` header size believed.
const MAX_OBJECT: u64 = 4096;

/// The layout of a CPython 3.`minor` (13+) from its `_Py_DebugOffsets`
/// (`table`, read from the start of `_PyRuntime`).
pub fn from_debug_offsets(table: &[u8], minor: u8) -> Result<Layout> {
    let Some(len) = debug_offsets_len(minor) else {
        bail!("no _Py_DebugOffsets schema for CPython 3.{minor}");
    };
    ensure!(
        table.len() >= len,
        "table cut short ({} bytes)",
        table.len()
    );
    ensure!(
        &table[..8] == b"xdebugpy",
        "no _Py_DebugOffsets cookie at _PyRuntime"
    );
    let word = |pos: usize| u64::from_le_bytes(table[pos..pos + 8].try_into().unwrap());
    let version = word(8);
    let (major, got_minor) = (version >> 24, (version >> 16) & 0xff);
    ensure!(
        major == 3 && got_minor == u64::from(minor),
        "_Py_DebugOffsets says version {version:#x}, the ELF is CPython 3.{minor}"
    );
    ensure!(
        word(16) == 0,
        "a free-threaded build (no GIL): not supported"
    );
    let get = |section: &str, field: &str| -> Result<u64> {
        let size = word(field_position(minor, section, "size").expect("schema section"));
        ensure!(
            (8..=MAX_STRUCT).contains(&size),
            "{section}.size {size} out of bounds"
        );
        let pos = field_position(minor, section, field).expect("schema field");
        let v = word(pos);
        ensure!(
            v.checked_add(8).is_some_and(|end| end <= size),
            "{section}.{field} = {v} is outside its structure ({size} bytes)"
        );
        Ok(v)
    };
    // Object headers: bounded by a small size, not by their section's.
    let obj = |section: &str, field: &str| -> Result<u64> {
        let v = word(field_position(minor, section, field).expect("schema field"));
        ensure!(v < MAX_OBJECT, "{section}.{field} = {v} out of bounds");
        Ok(v)
    };
    let ascii = obj("unicode_object", "asciiobject_size")?;
    Ok(Layout {
        minor,
        runtime_tstate_current: None,
        runtime_interp_head: get("runtime_state", "interpreters_head")?,
        interp_gil_holder: Some(get("interpreter_state", "gil_runtime_state_holder")?),
        offsets: PyOffsets {
            tstate_current: 0,
            interp_head: 0,
            interp_threads_head: get("interpreter_state", "threads_head")?,
            tstate_next: get("thread_state", "next")?,
            tstate_native_thread_id: get("thread_state", "native_thread_id")?,
            tstate_cframe: get("thread_state", "current_frame")?,
            cframe_current_frame: 0,
            frame_code: get("interpreter_frame", "executable")?,
            frame_previous: get("interpreter_frame", "previous")?,
            frame_prev_instr: get("interpreter_frame", "instr_ptr")?,
            frame_is_entry: get("interpreter_frame", "owner")?,
            flags: 0,
            pidns_dev: 0,
            pidns_ino: 0,
        },
        entry: EntryMark::ShimOwner,
        code_tagged: minor >= 14,
        code_filename: get("code_object", "filename")?,
        code_name: get("code_object", "name")?,
        code_qualname: get("code_object", "qualname")?,
        code_firstlineno: get("code_object", "firstlineno")?,
        code_linetable: get("code_object", "linetable")?,
        // The instructions follow the header: at its end, not inside it.
        code_code_adaptive: {
            let size = word(field_position(minor, "code_object", "size").expect("schema"));
            let v = word(field_position(minor, "code_object", "co_code_adaptive").expect("schema"));
            ensure!(
                v <= size && size <= MAX_OBJECT,
                "code_object.co_code_adaptive = {v} out of bounds"
            );
            v
        },
        str_length: obj("unicode_object", "length")?,
        str_state: obj("unicode_object", "state")?,
        str_ascii_data: ascii,
        str_compact_data: ascii + 16,
        bytes_size: obj("bytes_object", "ob_size")?,
        bytes_data: obj("bytes_object", "ob_sval")?,
    })
}

/// CPython 3.11 built for arm64: `_PyRuntime.gilstate` comes after the
/// GIL's two `pthread_mutex_t`, 8 bytes longer each than on x86-64 (checked
/// against Debian's arm64 headers by `python311_arm64_offsets_match_the_headers`
/// and on Debian's arm64 interpreter in the arm64 VM). Nothing else that
/// dynprof reads moves.
pub const PY311_AARCH64: Layout = Layout {
    runtime_tstate_current: Some(592),
    ..PY311
};

/// The layout of CPython 3.`minor` built for `arch`, without reading the
/// target (3.11, 3.12); `None` for 3.13+ (their own table) and unknown
/// versions. 3.12's fields are where they are on x86-64 (its GIL moved
/// into the interpreter, past every field read here).
pub fn fixed(minor: u8, arch: Arch) -> Option<Layout> {
    match (minor, arch) {
        (11, Arch::X86_64) => Some(PY311),
        (11, Arch::Aarch64) => Some(PY311_AARCH64),
        (12, _) => Some(PY312),
        _ => None,
    }
}

#[cfg(test)]
#[path = "layout_tests.rs"]
mod tests;
