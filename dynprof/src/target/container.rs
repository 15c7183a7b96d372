//! Container ids from `/proc/PID/cgroup`, for docker, containerd (plain,
//! nerdctl and Kubernetes CRI under the systemd and cgroupfs drivers),
//! cri-o and podman, on cgroup v1 and v2.
//!
//! Real line formats this understands (`HIERARCHY:CONTROLLERS:PATH`):
//! ```text
//! 0::/system.slice/docker-<id>.scope                                   docker, systemd driver
//! 12:memory:/docker/<id>                                               docker, cgroupfs driver (v1)
//! 0::/kubepods.slice/kubepods-burstable.slice/
//!     kubepods-burstable-pod<uid_with_underscores>.slice/cri-containerd-<id>.scope   k8s containerd, systemd
//! 0::/kubepods/burstable/pod<uid>/<id>                                 k8s, cgroupfs driver
//! 0::/kubepods.slice/.../crio-<id>.scope                               cri-o (crio-conmon-<id> is the monitor)
//! 0::/machine.slice/libpod-<id>.scope/container                        podman (libpod-conmon-<id> is the monitor)
//! 0::/system.slice/nerdctl-<id>.scope, 0::/k8s.io/<id>, 0::/default/<id>   containerd
//! ```
//! Nested containers (docker in docker: `/docker/<a>/docker/<b>`) give the
//! innermost id. A process inside a private cgroup namespace sees `0::/` and
//! has no id from here; its host PID's cgroup file (read from the host) does.
use std::fs;

use anyhow::{Result, bail};

use crate::types::{ContainerId, ContainerRuntime, HostPid};

/// Length of a full container id.
pub const FULL_ID_LEN: usize = 64;
/// Shortest prefix `--in-pidns` accepts.
pub const MIN_PREFIX_LEN: usize = 12;

fn is_hex(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn is_full_id(s: &str) -> bool {
    s.len() == FULL_ID_LEN && is_hex(s)
}

/// Parses the whole content of a `/proc/PID/cgroup` file. The first line
/// that names a container wins (on v1 every hierarchy names the same one).
pub fn parse_cgroup_file(content: &str) -> Option<ContainerId> {
    content.lines().find_map(parse_cgroup_line)
}

/// Parses one `HIERARCHY:CONTROLLERS:PATH` line (or a bare path).
pub fn parse_cgroup_line(line: &str) -> Option<ContainerId> {
    let path = match line.splitn(3, ':').nth(2) {
        Some(p) => p,
        None if line.starts_with('/') => line,
        None => return None,
    };
    parse_cgroup_path(path.trim())
}

/// Parses a cgroup path; the innermost container component wins.
pub fn parse_cgroup_path(path: &str) -> Option<ContainerId> {
    let comps: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
    let pod_uid = comps.iter().rev().find_map(|c| pod_uid_of(c));
    for (i, comp) in comps.iter().enumerate().rev() {
        let c = comp.strip_suffix(".scope").unwrap_or(comp);
        // The monitors run outside the container.
        if c.starts_with("crio-conmon-") || c.starts_with("libpod-conmon-") {
            return None;
        }
        const PREFIXED: &[(&str, ContainerRuntime)] = &[
            ("docker-", ContainerRuntime::Docker),
            ("cri-containerd-", ContainerRuntime::Containerd),
            ("nerdctl-", ContainerRuntime::Containerd),
            ("crio-", ContainerRuntime::CriO),
            ("libpod-", ContainerRuntime::Podman),
        ];
        for (prefix, runtime) in PREFIXED {
            if let Some(id) = c.strip_prefix(prefix)
                && is_full_id(id)
            {
                return Some(ContainerId {
                    id: id.to_ascii_lowercase(),
                    runtime: *runtime,
                    pod_uid,
                });
            }
        }
        if is_full_id(c) {
            let parents = &comps[..i];
            let runtime = if parents.iter().any(|p| p.starts_with("kubepods")) {
                ContainerRuntime::Cri
            } else if parents.last() == Some(&"docker") {
                ContainerRuntime::Docker
            } else if parents
                .iter()
                .any(|p| *p == "libpod_parent" || p.starts_with("libpod"))
            {
                ContainerRuntime::Podman
            } else if matches!(
                parents.last(),
                Some(&"k8s.io") | Some(&"default") | Some(&"moby")
            ) {
                ContainerRuntime::Containerd
            } else {
                ContainerRuntime::Unknown
            };
            return Some(ContainerId {
                id: c.to_ascii_lowercase(),
                runtime,
                pod_uid,
            });
        }
    }
    None
}

/// `pod<uid>` (cgroupfs) or `kubepods-<qos>-pod<uid_with_underscores>.slice` (systemd).
fn pod_uid_of(comp: &str) -> Option<String> {
    let c = comp.strip_suffix(".slice").unwrap_or(comp);
    let uid = if let Some(u) = c.strip_prefix("pod") {
        u
    } else if c.starts_with("kubepods") {
        &c[c.rfind("-pod")? + 4..]
    } else {
        return None;
    };
    let uid = uid.replace('_', "-");
    (uid.len() >= 32 && uid.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')).then_some(uid)
}

/// The container of a host PID, from its cgroup file.
pub fn container_of(pid: HostPid) -> Option<ContainerId> {
    fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .ok()
        .and_then(|c| parse_cgroup_file(&c))
}

/// Is `s` shaped like a container id or an id prefix `--in-pidns` accepts?
pub fn looks_like_id_prefix(s: &str) -> bool {
    s.len() >= MIN_PREFIX_LEN && s.len() <= FULL_ID_LEN && is_hex(s)
}

/// Every process (host PID) of every container whose id starts with
/// `prefix`, grouped by container. Errors when the prefix is malformed, no
/// container matches, or more than one does.
pub fn find_container(prefix: &str) -> Result<(ContainerId, Vec<HostPid>)> {
    if !looks_like_id_prefix(prefix) {
        bail!(
            "`{prefix}` is not a container id: want {MIN_PREFIX_LEN} to {FULL_ID_LEN} hex digits \
             (the short id `docker ps` shows is 12)"
        );
    }
    let mut found: Vec<(ContainerId, Vec<HostPid>)> = Vec::new();
    for pid in super::all_pids() {
        let Some(c) = container_of(pid) else { continue };
        if !c.matches_prefix(prefix) {
            continue;
        }
        match found.iter_mut().find(|(k, _)| k.id == c.id) {
            Some((_, pids)) => pids.push(pid),
            None => found.push((c, vec![pid])),
        }
    }
    match found.len() {
        0 => bail!(
            "no running process is in a container whose id starts with `{prefix}` \
             (looked at /proc/*/cgroup for docker, containerd/CRI, cri-o and podman; `dynprof ps` lists containers)"
        ),
        1 => Ok(found.pop().expect("one")),
        _ => {
            let list: Vec<String> = found
                .iter()
                .map(|(c, pids)| format!("{} ({}, {} processes)", c.id, c.runtime, pids.len()))
                .collect();
            bail!(
                "container id prefix `{prefix}` is ambiguous; it starts {} containers:\n  {}\nuse more digits",
                found.len(),
                list.join("\n  ")
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3f4e5a6b7c8d9e0f1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f7081";
    const UID: &str = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";

    fn p(line: &str) -> Option<(String, ContainerRuntime, Option<String>)> {
        parse_cgroup_file(line).map(|c| (c.id, c.runtime, c.pod_uid))
    }

    #[test]
    fn docker_and_podman_shapes() {
        use ContainerRuntime::*;
        let cases = [
            (format!("0::/system.slice/docker-{ID}.scope"), Docker),
            (format!("12:memory:/docker/{ID}"), Docker),
            (
                format!("0::/machine.slice/libpod-{ID}.scope/container"),
                Podman,
            ),
            (format!("0::/libpod_parent/libpod-{ID}"), Podman),
            (format!("0::/system.slice/nerdctl-{ID}.scope"), Containerd),
            (format!("0::/k8s.io/{ID}"), Containerd),
        ];
        for (line, rt) in cases {
            assert_eq!(p(&line), Some((ID.to_string(), rt, None)), "{line}");
        }
    }

    #[test]
    fn kubernetes_pod_uid() {
        let u = UID.replace('-', "_");
        let line = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-{ID}.scope"
        );
        assert_eq!(
            p(&line),
            Some((
                ID.to_string(),
                ContainerRuntime::Containerd,
                Some(UID.to_string())
            ))
        );
        let line = format!("0::/kubepods/burstable/pod{UID}/{ID}");
        assert_eq!(
            p(&line),
            Some((ID.to_string(), ContainerRuntime::Cri, Some(UID.to_string())))
        );
    }

    #[test]
    fn monitors_host_and_garbage() {
        assert_eq!(
            p(&format!("0::/machine.slice/libpod-conmon-{ID}.scope")),
            None
        );
        assert_eq!(
            p(&format!("0::/kubepods.slice/crio-conmon-{ID}.scope")),
            None
        );
        assert_eq!(p("0::/"), None);
        assert_eq!(p("0::/user.slice/user-1000.slice/session-2.scope"), None);
        assert_eq!(p(&format!("0::/docker/{}", &ID[..63])), None);
        assert_eq!(p(""), None);
    }

    #[test]
    fn docker_in_docker_gives_innermost() {
        let inner = "a".repeat(64);
        assert_eq!(
            p(&format!("0::/docker/{ID}/docker/{inner}")).unwrap().0,
            inner
        );
    }

    #[test]
    fn prefixes() {
        assert!(looks_like_id_prefix(&ID[..12]));
        assert!(!looks_like_id_prefix(&ID[..11]));
        assert!(!looks_like_id_prefix("zzzzzzzzzzzzzz"));
        let c = parse_cgroup_line(&format!("0::/docker/{ID}")).unwrap();
        assert!(c.matches_prefix(&ID[..12].to_uppercase()));
        assert_eq!(c.short(), &ID[..12]);
    }
}
