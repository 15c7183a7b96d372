use super::*;

/// A well-formed 3.`minor` table: every section's size 4096, every field
/// `8 * (its index + 1)`, with `set` overrides.
fn table(minor: u8, set: &[(&str, &str, u64)]) -> Vec<u8> {
    let mut t = vec![0u8; debug_offsets_len(minor).unwrap()];
    t[..8].copy_from_slice(b"xdebugpy");
    let version: u64 = (3 << 24) | (u64::from(minor) << 16) | 0x05f0;
    t[8..16].copy_from_slice(&version.to_le_bytes());
    let mut pos = 24;
    for (_, fields) in schema(minor).unwrap() {
        t[pos..pos + 8].copy_from_slice(&4096u64.to_le_bytes());
        for i in 0..fields.len() {
            let p = pos + 8 * (i + 1);
            t[p..p + 8].copy_from_slice(&(8 * (i as u64 + 1)).to_le_bytes());
        }
        pos += 8 * (fields.len() + 1);
    }
    for (s, f, v) in set {
        let p = field_position(minor, s, f).unwrap();
        t[p..p + 8].copy_from_slice(&v.to_le_bytes());
    }
    t
}

#[test]
fn debug_offsets_are_read_by_name() {
    for minor in [13, 14] {
        let t = table(
            minor,
            &[
                ("thread_state", "native_thread_id", 1000),
                ("interpreter_frame", "owner", 70),
                ("unicode_object", "asciiobject_size", 40),
                ("code_object", "co_code_adaptive", 200),
            ],
        );
        let l = from_debug_offsets(&t, minor).unwrap();
        assert_eq!(l.offsets.tstate_native_thread_id, 1000);
        assert_eq!(l.offsets.frame_is_entry, 70);
        assert_eq!(l.offsets.flags, 0, "3.13+ has no _PyCFrame");
        assert_eq!((l.str_ascii_data, l.str_compact_data), (40, 56));
        assert_eq!(l.code_code_adaptive, 200);
        assert_eq!(l.code_tagged, minor == 14);
        assert_eq!(l.entry, EntryMark::ShimOwner);
    }
}

#[test]
fn hostile_debug_offsets_are_refused() {
    let err = |t: &[u8], minor| format!("{:#}", from_debug_offsets(t, minor).unwrap_err());
    let mut t = table(13, &[]);
    t[0] = b'X';
    assert!(err(&t, 13).contains("cookie"), "{}", err(&t, 13));
    // The table says 3.14, the ELF's name 3.13.
    let t = table(14, &[]);
    assert!(err(&t[..debug_offsets_len(13).unwrap()], 13).contains("version"));
    let mut t = table(13, &[]);
    t[16] = 1;
    assert!(err(&t, 13).contains("free-threaded"));
    let t = table(13, &[("thread_state", "current_frame", 1 << 40)]);
    assert!(err(&t, 13).contains("thread_state.current_frame"));
    let t = table(13, &[("thread_state", "size", u64::MAX)]);
    assert!(err(&t, 13).contains("thread_state.size"));
    let t = table(14, &[("unicode_object", "asciiobject_size", 1 << 20)]);
    assert!(err(&t, 14).contains("asciiobject_size"));
    let t = table(13, &[]);
    assert!(err(&t[..100], 13).contains("cut short"));
    assert!(from_debug_offsets(&t, 15).is_err());
}

/// [`schema`]'s positions against the real interpreters' own headers
/// (`libpython3.X-dev` in the root filesystems `cargo xtask setup`
/// builds), when they and a C compiler are present.
#[test]
fn debug_offsets_schema_matches_the_headers() {
    for minor in [13u8, 14] {
        let root =
            std::path::PathBuf::from(format!("/var/cache/dynprof/python-rootfs/python3.{minor}"));
        let inc = root.join(format!("usr/include/python3.{minor}"));
        // `pyconfig.h` includes <x86_64-linux-gnu/python3.X/pyconfig.h>; after
        // the host's own directories, so that libc's headers stay the host's.
        let arch_inc = root.join("usr/include");
        if !inc.join("Python.h").exists() {
            eprintln!(
                "SKIPPED: no CPython 3.{minor} headers under {}",
                root.display()
            );
            continue;
        }
        let mut fields = Vec::new();
        let mut pos = 24;
        for (section, names) in schema(minor).unwrap() {
            fields.push((format!("{section}.size"), pos));
            for (i, f) in names.iter().enumerate() {
                fields.push((format!("{section}.{f}"), pos + 8 * (i + 1)));
            }
            pos += 8 * (names.len() + 1);
        }
        let header = if minor == 13 {
            "internal/pycore_runtime.h"
        } else {
            "internal/pycore_debug_offsets.h"
        };
        let prints: String = fields
            .iter()
            .map(|(f, _)| format!("  printf(\"%zu\\n\", offsetof(_Py_DebugOffsets, {f}));\n"))
            .collect();
        let src = format!(
            "#define Py_BUILD_CORE 1\n#include <Python.h>\n#include <{header}>\n\
             #include <stddef.h>\n#include <stdio.h>\nint main(void) {{\n{prints}  return 0;\n}}\n"
        );
        let dir =
            std::env::temp_dir().join(format!("dynprof-pydebugoff-{minor}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("off.c"), src).unwrap();
        let exe = dir.join("off");
        let cc = std::process::Command::new("gcc")
            .arg("-I")
            .arg(&inc)
            .arg("-idirafter")
            .arg(&arch_inc)
            .arg("-o")
            .arg(&exe)
            .arg(dir.join("off.c"))
            .output()
            .expect("gcc");
        assert!(
            cc.status.success(),
            "{}",
            String::from_utf8_lossy(&cc.stderr)
        );
        let out = std::process::Command::new(&exe).output().unwrap();
        let got: Vec<usize> = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(|v| v.parse().unwrap())
            .collect();
        let want: Vec<usize> = fields.iter().map(|f| f.1).collect();
        assert_eq!(got, want, "3.{minor}: {fields:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
