use super::*;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _, symlink};

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("dynprof-hostfs-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
    d
}

#[test]
fn escapes_control_characters() {
    assert_eq!(escape_untrusted("plain"), "plain");
    assert_eq!(
        escape_untrusted("\ntouch X; id > X #\x1b[2J"),
        "\\ntouch X; id > X #\\u{1b}[2J"
    );
    assert!(!escape_untrusted("a\u{2028}b\r").contains(['\n', '\r', '\u{2028}']));
}

#[test]
fn confines_relative_paths() {
    assert_eq!(confine_relative("./").unwrap(), PathBuf::new());
    assert_eq!(confine_relative("a/./b").unwrap(), PathBuf::from("a/b"));
    assert!(
        confine_relative("/anywhere")
            .unwrap_err()
            .contains("absolute")
    );
    assert!(confine_relative("../x").unwrap_err().contains(".."));
    assert!(confine_relative("a/../../x").unwrap_err().contains(".."));
    assert!(confine_relative("a\nb").is_err());
}

#[test]
fn refuses_symlinks_and_foreign_or_open_dirs() {
    let base = tempdir("root");
    let real = base.join("real");
    std::fs::create_dir(&real).unwrap();
    symlink(&real, base.join("link")).unwrap();
    let e = format!(
        "{:#}",
        OutputRoot::open(&base.join("link/out")).unwrap_err()
    );
    assert!(e.contains("link") && e.contains("symbolic link"), "{e}");

    let open = base.join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = format!("{:#}", OutputRoot::open(&open.join("out")).unwrap_err());
    assert!(e.contains("sticky") && e.contains("open"), "{e}");

    // The same mode with the sticky bit (a /tmp) is fine.
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let r = OutputRoot::open(&open.join("out")).unwrap();
    assert_eq!(r.path(), open.join("out"));
    assert_eq!(
        std::fs::metadata(open.join("out")).unwrap().mode() & 0o7777,
        0o755
    );
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn files_are_new_and_never_through_links() {
    let base = tempdir("files");
    let victim = base.join("victim");
    std::fs::write(&victim, "secret").unwrap();
    let d = open_dir_nofollow(&base).unwrap();
    symlink(&victim, base.join("planted")).unwrap();
    assert!(d.create_file("planted").is_err());
    assert!(d.open_append("planted", None, FILE_MODE).is_err());
    d.write_atomic("planted", b"data").unwrap();
    // The link itself was replaced; its target is untouched.
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "secret");
    assert_eq!(
        std::fs::read_to_string(base.join("planted")).unwrap(),
        "data"
    );
    let m = std::fs::symlink_metadata(base.join("planted")).unwrap();
    assert!(m.is_file() && m.mode() & 0o777 == FILE_MODE);
    // Nothing else stays behind.
    let mut names = d.names().unwrap();
    names.sort();
    assert_eq!(names, vec!["planted", "victim"]);
    assert!(d.create_file("../x").is_err());
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn temp_names_differ() {
    assert_ne!(random_name("a"), random_name("a"));
}
