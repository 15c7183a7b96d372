//! Container ids from `/proc/PID/cgroup`: a table of real file shapes from
//! docker, containerd / Kubernetes (systemd and cgroupfs drivers), cri-o and
//! podman, on cgroup v1 (multi-line) and v2. Pure parsing, no privileges.

use dynprof::{
    target::container::{parse_cgroup_file, parse_cgroup_line},
    types::ContainerRuntime::{self, *},
};

const ID: &str = "8c5f2a3e9b1d4f6a7c8e9d0b1a2f3e4d5c6b7a8f9e0d1c2b3a4f5e6d7c8b9a0f";
const UID: &str = "5f7e3c1a-2b4d-4e6f-8a9b-0c1d2e3f4a5b";

fn v1_file(path: &str) -> String {
    let ctrls = [
        "hugetlb",
        "memory",
        "cpu,cpuacct",
        "pids",
        "blkio",
        "devices",
        "freezer",
        "net_cls,net_prio",
        "perf_event",
        "cpuset",
        "rdma",
    ];
    let mut s = String::new();
    for (i, c) in ctrls.iter().enumerate() {
        s.push_str(&format!("{}:{c}:{path}\n", ctrls.len() + 1 - i));
    }
    s.push_str(&format!(
        "1:name=systemd:{path}\n0::/system.slice/containerd.service\n"
    ));
    s
}

/// A cgroup file and what it names: (engine, pod UID), or None.
type Case = (String, Option<(ContainerRuntime, Option<&'static str>)>);

#[test]
fn cgroup_table() {
    let u_ = UID.replace('-', "_");
    let cases: Vec<Case> = vec![
        // docker
        (
            format!("0::/system.slice/docker-{ID}.scope\n"),
            Some((Docker, None)),
        ),
        (format!("0::/docker/{ID}\n"), Some((Docker, None))),
        (v1_file(&format!("/docker/{ID}")), Some((Docker, None))),
        (
            v1_file(&format!("/system.slice/docker-{ID}.scope")),
            Some((Docker, None)),
        ),
        // containerd outside Kubernetes (nerdctl, ctr)
        (
            format!("0::/system.slice/nerdctl-{ID}.scope\n"),
            Some((Containerd, None)),
        ),
        (format!("0::/default/{ID}\n"), Some((Containerd, None))),
        // Kubernetes + containerd, systemd driver (v2 and v1)
        (
            format!(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u_}.slice/cri-containerd-{ID}.scope\n"
            ),
            Some((Containerd, Some(UID))),
        ),
        (
            v1_file(&format!(
                "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u_}.slice/cri-containerd-{ID}.scope"
            )),
            Some((Containerd, Some(UID))),
        ),
        (
            format!("0::/kubepods.slice/kubepods-pod{u_}.slice/cri-containerd-{ID}.scope\n"),
            Some((Containerd, Some(UID))),
        ),
        // Kubernetes, cgroupfs driver: the engine is not named
        (
            format!("0::/kubepods/burstable/pod{UID}/{ID}\n"),
            Some((Cri, Some(UID))),
        ),
        (
            v1_file(&format!("/kubepods/besteffort/pod{UID}/{ID}")),
            Some((Cri, Some(UID))),
        ),
        (
            format!("0::/kubepods/pod{UID}/{ID}\n"),
            Some((Cri, Some(UID))),
        ),
        // Kubernetes + dockershim, systemd driver
        (
            format!(
                "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u_}.slice/docker-{ID}.scope\n"
            ),
            Some((Docker, Some(UID))),
        ),
        // cri-o, systemd and cgroupfs
        (
            format!(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u_}.slice/crio-{ID}.scope\n"
            ),
            Some((CriO, Some(UID))),
        ),
        (
            format!("0::/kubepods/burstable/pod{UID}/crio-{ID}\n"),
            Some((CriO, Some(UID))),
        ),
        (
            v1_file(&format!(
                "/kubepods.slice/kubepods-pod{u_}.slice/crio-{ID}.scope"
            )),
            Some((CriO, Some(UID))),
        ),
        // podman: root, rootless, cgroupfs, v1
        (
            format!("0::/machine.slice/libpod-{ID}.scope/container\n"),
            Some((Podman, None)),
        ),
        (
            format!(
                "0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope\n"
            ),
            Some((Podman, None)),
        ),
        (
            format!("0::/libpod_parent/libpod-{ID}\n"),
            Some((Podman, None)),
        ),
        (
            v1_file(&format!("/machine.slice/libpod-{ID}.scope")),
            Some((Podman, None)),
        ),
        // an unknown parent with a full id
        (format!("0::/ecs/0123abcd/{ID}\n"), Some((Unknown, None))),
        // not containers: host processes, the monitors, a private cgroup namespace
        ("0::/init.scope\n".to_string(), None),
        (
            "0::/user.slice/user-1000.slice/session-3.scope\n".to_string(),
            None,
        ),
        ("0::/\n".to_string(), None),
        (v1_file("/"), None),
        (v1_file("/user.slice"), None),
        (
            format!("0::/machine.slice/libpod-conmon-{ID}.scope\n"),
            None,
        ),
        (
            format!(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u_}.slice/crio-conmon-{ID}.scope\n"
            ),
            None,
        ),
        (
            format!("0::/system.slice/docker-{}.scope\n", &ID[..40]),
            None,
        ),
        (String::new(), None),
    ];
    for (file, want) in cases {
        let got = parse_cgroup_file(&file);
        match (got, want) {
            (None, None) => {}
            (Some(c), Some((rt, pod))) => {
                assert_eq!(c.id, ID, "{file}");
                assert_eq!(c.runtime, rt, "{file}");
                assert_eq!(c.pod_uid.as_deref(), pod, "{file}");
                assert_eq!(c.to_string(), ID);
                assert_eq!(c.short(), &ID[..12]);
                assert_eq!(
                    serde_json::to_value(&c).unwrap(),
                    ID,
                    "serializes as the bare id"
                );
            }
            (got, want) => panic!("{file}: got {got:?}, want {want:?}"),
        }
    }
}

#[test]
fn uppercase_and_bare_paths() {
    let c = parse_cgroup_line(&format!("/docker/{}", ID.to_uppercase())).unwrap();
    assert_eq!(c.id, ID, "ids are normalised to lowercase");
    assert!(c.matches_prefix(&ID[..12].to_uppercase()));
    assert!(!c.matches_prefix("ffffffffffff"));
    assert_eq!(Docker.to_string(), "docker");
    assert_eq!(CriO.to_string(), "cri-o");
}
