use super::*;

fn root(tag: &str, uprobe: bool, btf: bool) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("dynprof-preflight-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    if uprobe {
        std::fs::create_dir_all(d.join("sys/bus/event_source/devices/uprobe")).unwrap();
    }
    if btf {
        std::fs::create_dir_all(d.join("sys/kernel/btf")).unwrap();
        std::fs::write(d.join("sys/kernel/btf/vmlinux"), b"").unwrap();
    }
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn err(root: &Path, caps: u64) -> String {
    let e = preflight_at(root, caps).unwrap_err().to_string();
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(e.contains("hint"), "{e}");
    e
}

#[test]
fn each_missing_piece_gets_one_line_with_a_hint() {
    let all = u64::MAX;
    let e = err(&root("none", false, true), all);
    assert!(
        e.contains("no uprobe support") && e.contains("CONFIG_UPROBE_EVENTS"),
        "{e}"
    );
    let e = err(&root("nobtf", true, false), all);
    assert!(
        e.contains("no BTF") && e.contains("CONFIG_DEBUG_INFO_BTF"),
        "{e}"
    );
    let ok = root("ok", true, true);
    let e = err(&ok, 0);
    assert!(e.contains("CAP_BPF and CAP_PERFMON"), "{e}");
    let e = err(&ok, 1 << 39);
    assert!(e.contains("missing privileges: CAP_PERFMON ("), "{e}");
    assert!(
        preflight_at(&ok, 1 << 21).is_ok(),
        "CAP_SYS_ADMIN is enough"
    );
    assert!(
        preflight_at(&ok, (1 << 38) | (1 << 39)).is_ok(),
        "CAP_BPF+CAP_PERFMON is enough"
    );
    for t in ["none", "nobtf", "ok"] {
        let _ = std::fs::remove_dir_all(root(t, false, false));
    }
}
