//! `dynprof report --symbolize PROF_DIR [--debug-dir DIR]…`: names, after
//! the fact and off the training node, the frames a window could name only
//! as `[unknown] FILE+0xOFFSET` (a stripped library whose debug file was
//! not installed where the job ran).
//!
//! The window's `modules.json` gives each such file's build id,
//! `.gnu_debuglink` and loadable segments. Its separate debug file is looked
//! for by build id (`DIR/.build-id/ab/cdef….debug`) in each `--debug-dir`,
//! then in `/usr/lib/debug`, then by its debug link
//! (`symbols::debug_files::offline`); one whose own build id (or,
//! without one, the CRC-32 the link records) differs is not used. The
//! folded stacks (and their flame graphs), `trace.json` and
//! `summary.json` are rewritten in place, each atomically, and meta.json
//! records what was done under `symbolized`.
use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::Value;

use crate::{
    output::{
        MODULES_FILE,
        flame::{self, CPU_FOLDED, OFFCPU_FOLDED},
        model::ModuleRef,
        write_atomic,
    },
    symbols::{
        build_id_path,
        debug_files::{self, DEFAULT_DEBUG_DIR},
        elf,
    },
    window::meta::META_FILE,
};

/// One folded stack: frames root first, and its count.
type Folded = (Vec<String>, u64);

/// What one directory's symbolization did.
#[derive(Debug, Default, Serialize)]
pub struct Symbolized {
    /// Distinct `[unknown] FILE+0x…` frames before.
    pub unknown_frames: usize,
    /// How many of them got a name.
    pub named: usize,
    /// Per file: the debug file used, or why none.
    pub modules: BTreeMap<String, String>,
}

/// `[unknown] FILE+0xOFFSET` → (FILE, OFFSET).
pub fn parse_unknown(frame: &str) -> Option<(&str, u64)> {
    let rest = frame.strip_prefix("[unknown] ")?;
    let (file, off) = rest.rsplit_once("+0x")?;
    Some((file, u64::from_str_radix(off, 16).ok()?))
}

/// The stacks with each frame found in `names` renamed; stacks that become
/// the same are merged (their counts added).
pub fn rename_stacks(
    stacks: Vec<Folded>,
    names: &HashMap<String, String>,
) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for (frames, n) in stacks {
        let key = frames
            .iter()
            .map(|f| names.get(f).unwrap_or(f).as_str())
            .collect::<Vec<_>>()
            .join(";");
        *out.entry(key).or_insert(0) += n;
    }
    out
}

/// Renames, in every string of `v`, each `;`-separated part found in
/// `names`; returns how many strings changed.
pub fn rename_json(v: &mut Value, names: &HashMap<String, String>) -> usize {
    match v {
        Value::String(s) => {
            if !s.contains("[unknown] ") {
                return 0;
            }
            let renamed: Vec<&str> = s
                .split(';')
                .map(|p| names.get(p).map(String::as_str).unwrap_or(p))
                .collect();
            let renamed = renamed.join(";");
            let changed = renamed != *s;
            *s = renamed;
            usize::from(changed)
        }
        Value::Array(a) => a.iter_mut().map(|x| rename_json(x, names)).sum(),
        Value::Object(o) => o.values_mut().map(|x| rename_json(x, names)).sum(),
        _ => 0,
    }
}

/// Symbolizes one PROF directory in place.
pub fn symbolize_dir(dir: &Path, debug_dirs: &[PathBuf]) -> Result<Symbolized> {
    let mut done = Symbolized::default();
    let modules = match std::fs::read(dir.join(MODULES_FILE)) {
        Ok(b) => {
            let v: Value = serde_json::from_slice(&b)
                .with_context(|| format!("{}: not JSON", dir.join(MODULES_FILE).display()))?;
            serde_json::from_value::<Vec<ModuleRef>>(v["modules"].clone()).with_context(|| {
                format!("{}: no `modules` list", dir.join(MODULES_FILE).display())
            })?
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e).context(format!("reading {}", dir.join(MODULES_FILE).display())),
    };
    let folded: Vec<(&str, Vec<Folded>)> = [CPU_FOLDED, OFFCPU_FOLDED]
        .into_iter()
        .filter_map(|name| {
            let text = std::fs::read_to_string(dir.join(name)).ok()?;
            Some(flame::parse_folded(&text).map(|s| (name, s)))
        })
        .collect::<Result<_>>()
        .context("reading the folded stacks")?;
    // Distinct unknown frames, by file.
    let mut by_file: BTreeMap<&str, Vec<(&str, u64)>> = BTreeMap::new();
    for (_, stacks) in &folded {
        for (frames, _) in stacks {
            for f in frames {
                if let Some((file, off)) = parse_unknown(f) {
                    by_file.entry(file).or_default().push((f.as_str(), off));
                }
            }
        }
    }
    let mut names: HashMap<String, String> = HashMap::new();
    for (file, mut frames) in by_file {
        frames.sort_unstable();
        frames.dedup();
        done.unknown_frames += frames.len();
        let why = match modules.iter().find(|m| m.name == file) {
            None => "not in modules.json".to_string(),
            Some(ModuleRef {
                build_id: None,
                debuglink: None,
                ..
            }) => "no build id or debug link recorded".to_string(),
            Some(m) => match debug_files::offline(
                m.build_id.as_deref(),
                m.debuglink.as_ref(),
                &m.path,
                debug_dirs,
            ) {
                None => not_found(m),
                Some(path) => {
                    let vaddrs: Vec<u64> = frames
                        .iter()
                        .map(|(_, off)| elf::offset_to_vaddr(&m.segments, *off).unwrap_or(0))
                        .collect();
                    let found = crate::collect::symbolize::name_offline(&path, &vaddrs)?;
                    for ((frame, _), name) in frames.iter().zip(found) {
                        if let Some(name) = name {
                            names.insert(frame.to_string(), name);
                            done.named += 1;
                        }
                    }
                    path.display().to_string()
                }
            },
        };
        done.modules.insert(file.to_string(), why);
    }
    if names.is_empty() {
        return Ok(done);
    }
    for (name, stacks) in folded {
        let renamed = rename_stacks(stacks, &names);
        if name == CPU_FOLDED {
            flame::write_cpu_folded(dir, &renamed)?;
        } else {
            flame::write_offcpu_folded(dir, &renamed)?;
        }
    }
    for file in ["trace.json", "summary.json"] {
        rewrite_json(&dir.join(file), |v| {
            rename_json(v, &names);
        })?;
    }
    let record = serde_json::to_value(&done)?;
    rewrite_json(&dir.join(META_FILE), |v| {
        if let Value::Object(o) = v {
            o.insert("symbolized".into(), record.clone());
        }
    })?;
    Ok(done)
}

/// Why no debug file of `m` was used: where it was looked for.
fn not_found(m: &ModuleRef) -> String {
    let mut looked = Vec::new();
    if let Some(id) = &m.build_id {
        looked.push(format!(
            "build id {id} as {}",
            build_id_path(id).unwrap_or_default().display()
        ));
    }
    if let Some(link) = &m.debuglink {
        looked.push(format!(
            "debug link {} (CRC {:08x}) by name and under {}",
            link.name,
            link.crc,
            Path::new(&m.path)
                .parent()
                .unwrap_or(Path::new("/"))
                .display()
        ));
    }
    format!(
        "no debug file with a symbol table: looked for {} in each --debug-dir and {DEFAULT_DEBUG_DIR}",
        looked.join(", and ")
    )
}

/// Reads `path` as JSON (if it exists), edits it, writes it back atomically.
fn rewrite_json(path: &Path, edit: impl FnOnce(&mut Value)) -> Result<()> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).context(format!("reading {}", path.display())),
    };
    let mut v: Value =
        serde_json::from_slice(&bytes).with_context(|| format!("{}: not JSON", path.display()))?;
    edit(&mut v);
    let mut out = serde_json::to_vec(&v)?;
    out.push(b'\n');
    write_atomic(path, &out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_frames_parse_to_file_and_offset() {
        assert_eq!(
            parse_unknown("[unknown] libtorch_cpu.so+0x1a2b"),
            Some(("libtorch_cpu.so", 0x1a2b))
        );
        assert_eq!(
            parse_unknown("[unknown] my+lib.so+0x10"),
            Some(("my+lib.so", 0x10))
        );
        assert_eq!(parse_unknown("[unknown]"), None);
        assert_eq!(parse_unknown("[jit]"), None);
        assert_eq!(parse_unknown("[unknown] x.so+0xzz"), None);
        assert_eq!(parse_unknown("main"), None);
    }

    #[test]
    fn renamed_stacks_merge_and_json_strings_follow() {
        let names: HashMap<String, String> = [
            ("[unknown] a.so+0x10".to_string(), "f".to_string()),
            ("[unknown] a.so+0x20".to_string(), "f".to_string()),
        ]
        .into();
        let stacks = vec![
            (vec!["main".into(), "[unknown] a.so+0x10".into()], 3),
            (vec!["main".into(), "[unknown] a.so+0x20".into()], 4),
            (vec!["main".into(), "[unknown] b.so+0x30".into()], 1),
        ];
        let out = rename_stacks(stacks, &names);
        assert_eq!(out.get("main;f"), Some(&7));
        assert_eq!(out.get("main;[unknown] b.so+0x30"), Some(&1));

        let mut v = serde_json::json!({
            "traceEvents": [{"name": "[unknown] a.so+0x10"}, {"args": {"stack": "main;[unknown] a.so+0x20"}}],
            "top": ["[unknown] b.so+0x30", 5]
        });
        assert_eq!(rename_json(&mut v, &names), 2);
        assert_eq!(v["traceEvents"][0]["name"], "f");
        assert_eq!(v["traceEvents"][1]["args"]["stack"], "main;f");
        assert_eq!(v["top"][0], "[unknown] b.so+0x30");
    }
}
