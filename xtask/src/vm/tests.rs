use super::*;

#[test]
fn modules_load_after_their_dependencies() {
    let deps = |m: &str| -> Result<Vec<String>> {
        Ok(match m {
            "9p" => vec!["9pnet".into(), "netfs".into()],
            "9pnet_virtio" => vec!["9pnet".into(), "virtio_ring".into()],
            "virtio_pci" => vec!["virtio_pci_modern_dev".into(), "virtio".into()],
            _ => vec![],
        })
    };
    let order = load_order(&["virtio_pci", "9pnet_virtio", "9p"], deps).unwrap();
    assert_eq!(
        order,
        [
            "virtio_pci_modern_dev",
            "virtio",
            "virtio_pci",
            "9pnet",
            "virtio_ring",
            "9pnet_virtio",
            "netfs",
            "9p"
        ]
    );
    let modinfo = b"\0license=GPL\0depends=9pnet,netfs,fscache\0vermagic=6.1\0";
    assert_eq!(depends_in(modinfo), ["9pnet", "netfs", "fscache"]);
    assert!(depends_in(b"\0depends=\0x").is_empty());
}

#[test]
fn suites_of_kernel_versions() {
    assert_eq!(suite_of("5.10.0-30").unwrap(), "bullseye");
    assert_eq!(suite_of("6.1.0-28").unwrap(), "bookworm");
    assert!(
        suite_of("5.4.0-1")
            .unwrap_err()
            .to_string()
            .contains("hint")
    );
}

#[test]
fn script_runs_each_binary_with_its_exact_names() {
    let s = script(
        &[
            (PathBuf::from("/t/a-1"), &["x", "y"][..]),
            (PathBuf::from("/t/b-2"), &[][..]),
        ],
        Some(Path::new("/f")),
        1,
    );
    assert!(s.contains("export DYNPROF_FIXTURES_DIR='/f'\n"), "{s}");
    assert!(s.contains("export DYNPROF_TEST_EMULATED=1\n"), "{s}");
    assert!(
        s.contains("'/t/a-1' --test-threads=1 --exact 'x' 'y' || fail=1\n"),
        "{s}"
    );
    assert!(s.contains("'/t/b-2' --test-threads=1 || fail=1\n"), "{s}");
    assert!(s.ends_with("echo $fail > /vm-out/rc\n"), "{s}");
}

#[test]
fn script_repeats_each_binary_in_order() {
    let s = script(
        &[
            (PathBuf::from("/t/a-1"), &[][..]),
            (PathBuf::from("/t/b-2"), &[][..]),
        ],
        None,
        2,
    );
    let runs: Vec<&str> = s.lines().filter(|l| l.starts_with("'/t/")).collect();
    assert_eq!(
        runs,
        [
            "'/t/a-1' --test-threads=1 || fail=1",
            "'/t/a-1' --test-threads=1 || fail=1",
            "'/t/b-2' --test-threads=1 || fail=1",
            "'/t/b-2' --test-threads=1 || fail=1",
        ]
    );
}

#[test]
fn guest_uptimes_are_read_after_their_marker() {
    let c = "noise\r\n[vm] VM-READY 3.25\nTESTS-END 99.5 12\n";
    assert_eq!(marker_time(c, "VM-READY"), Some(3.25));
    assert_eq!(marker_time(c, "TESTS-END"), Some(99.5));
    assert_eq!(marker_time(c, "VM-DONE"), None);
}
