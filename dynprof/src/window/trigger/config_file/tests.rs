//! Parsing, directory rules and log rotation, without a session.
use super::{logs::*, parse::*, *};
use crate::types::Builtin;

#[test]
fn template_parses_to_no_collection() {
    let p = parse(&template().to_string()).unwrap();
    assert_eq!(p.plan.start_step, 0);
    assert_eq!(p.collect, vec![Builtin::Api, Builtin::Cpu]);
    assert!(p.unknown.is_empty() && p.no_effect.is_empty());
}

#[test]
fn fields_map_and_validate() {
    let p = parse(r#"{"start_step": -1, "warmup": 2, "active": 3, "with_stack": true, "activities": ["CPU"], "metadata": {"a": 1}, "foo": 1, "analyse": true}"#).unwrap();
    assert_eq!(
        p.plan,
        Plan {
            start_step: -1,
            warmup: 2,
            active: 3,
            repeat: 0,
            gap: 0
        }
    );
    assert_eq!(p.collect, vec![Builtin::Cpu, Builtin::Offcpu]);
    assert_eq!(p.unknown, vec!["foo"]);
    assert_eq!(p.no_effect, vec!["analyse"]);
    assert!(p.metadata.is_some());
    assert!(parse("{").unwrap_err().to_string().contains("invalid JSON"));
    assert!(
        parse(r#"{"active": 0}"#)
            .unwrap_err()
            .to_string()
            .contains("`active`")
    );
    assert!(
        parse(r#"{"start_step": "5"}"#)
            .unwrap_err()
            .to_string()
            .contains("`start_step`")
    );
    assert!(
        parse(r#"{"activities": ["GPU"]}"#)
            .unwrap_err()
            .to_string()
            .contains("activities")
    );
}

#[test]
fn dir_rules() {
    let base = std::env::temp_dir().join(format!("dynprof-cfgdir-{}", std::process::id()));
    fs::create_dir_all(&base).unwrap();
    assert!(check_dir(&base.join("good_dir-1")).is_ok());
    assert!(
        check_dir(&base.join("bad.dir"))
            .unwrap_err()
            .to_string()
            .contains("letters, digits")
    );
    fs::create_dir_all(base.join("real")).unwrap();
    let _ = std::os::unix::fs::symlink(base.join("real"), base.join("link"));
    assert!(
        check_dir(&base.join("link").join("cfg"))
            .unwrap_err()
            .to_string()
            .contains("symbolic link")
    );
    let _ = fs::remove_dir_all(&base);
}

#[test]
fn log_rotates() {
    let base = std::env::temp_dir().join(format!("dynprof-cfglog-{}", std::process::id()));
    fs::create_dir_all(&base).unwrap();
    let mut l = RotatingLog::new(&hostfs::open_dir_nofollow(&base).unwrap(), "x.log").unwrap();
    l.max = 100;
    for i in 0..10 {
        l.write(
            "INFO",
            &format!("line {i} with some padding to grow the file"),
        );
    }
    assert!(base.join("x.log.1").is_file());
    assert!(fs::metadata(base.join("x.log")).unwrap().len() < 200);
    // A newline in a message stays on its line.
    let _ = fs::remove_file(base.join("x.log"));
    l.write("WARNING", "field `\ntouch X; id > X #` ignored");
    let text = fs::read_to_string(base.join("x.log")).unwrap();
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(
        text.contains("field `\\ntouch X; id > X #` ignored"),
        "{text}"
    );
    // A symlink planted at the log's name is not written through.
    let victim = base.join("victim");
    fs::write(&victim, "keep").unwrap();
    let _ = fs::remove_file(base.join("x.log"));
    std::os::unix::fs::symlink(&victim, base.join("x.log")).unwrap();
    l.write("INFO", "hello");
    assert_eq!(fs::read_to_string(&victim).unwrap(), "keep");
    let _ = fs::remove_dir_all(&base);
}
