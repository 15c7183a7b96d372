//! The labels of an attached process, from what the host shows of it.
//!
//! - `container` and `pod_uid` come from its cgroup path (the host's
//!   `/proc/PID/cgroup`, parsed by [`crate::target::container`]): Kubernetes
//!   names a pod's cgroup `kubepods-<qos>-pod<uid>.slice` (systemd driver) or
//!   `pod<uid>` (cgroupfs driver). The pod UID is all the cgroup says about
//!   the pod.
//! - `pod` and `namespace` names are not in the cgroup path. They are
//!   taken from the container's environment when the pod spec exposes them
//!   (`POD_NAME`/`POD_NAMESPACE` through the downward API, a common
//!   convention), and `pod` falls back to `HOSTNAME`, which the kubelet sets
//!   to the pod name unless the spec overrides it. The environment belongs
//!   to the job, so a value is used only when it is a valid Kubernetes name
//!   (a lowercase DNS subdomain of at most 253 characters); anything else is
//!   left empty rather than exported.
use crate::types::ContainerId;

/// What Kubernetes names a pod or namespace: lowercase alphanumerics, `-`
/// and `.`, starting and ending alphanumeric, at most 253 characters.
pub fn is_k8s_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 253
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-' || *c == b'.')
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

/// Pod and namespace names for a process: from its environment, and only
/// for a process in a Kubernetes pod (a pod UID in its cgroup path).
pub fn pod_names(
    container: Option<&ContainerId>,
    env: &[(String, String)],
) -> (Option<String>, Option<String>) {
    if container.and_then(|c| c.pod_uid.as_ref()).is_none() {
        return (None, None);
    }
    let get = |k: &str| {
        env.iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
            .filter(|v| is_k8s_name(v))
            .map(str::to_string)
    };
    let pod = get("POD_NAME").or_else(|| get("HOSTNAME"));
    let ns = get("POD_NAMESPACE");
    (pod, ns)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::target::container::parse_cgroup_line;

    fn env(kv: &[(&str, &str)]) -> Vec<(String, String)> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    const ID: &str = "3f2a9c1b7d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8";

    #[test]
    fn kubepods_systemd_gives_pod_uid_and_env_names() {
        let line = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2c3d4e_5f60_4718_9293_a4b5c6d7e8f9.slice/cri-containerd-{ID}.scope"
        );
        let c = parse_cgroup_line(&line).unwrap();
        assert_eq!(
            c.pod_uid.as_deref(),
            Some("1b2c3d4e-5f60-4718-9293-a4b5c6d7e8f9")
        );
        let (pod, ns) = pod_names(
            Some(&c),
            &env(&[("HOSTNAME", "train-worker-3"), ("POD_NAMESPACE", "ml")]),
        );
        assert_eq!(pod.as_deref(), Some("train-worker-3"));
        assert_eq!(ns.as_deref(), Some("ml"));
        // The downward API's POD_NAME wins over HOSTNAME.
        let (pod, _) = pod_names(
            Some(&c),
            &env(&[("HOSTNAME", "custom-host"), ("POD_NAME", "train-0")]),
        );
        assert_eq!(pod.as_deref(), Some("train-0"));
    }

    #[test]
    fn kubepods_cgroupfs_gives_pod_uid() {
        let line = format!("0::/kubepods/besteffort/pod1b2c3d4e-5f60-4718-9293-a4b5c6d7e8f9/{ID}");
        let c = parse_cgroup_line(&line).unwrap();
        assert_eq!(
            c.pod_uid.as_deref(),
            Some("1b2c3d4e-5f60-4718-9293-a4b5c6d7e8f9")
        );
    }

    #[test]
    fn no_pod_names_outside_kubernetes() {
        let c = parse_cgroup_line(&format!("0::/system.slice/docker-{ID}.scope")).unwrap();
        assert_eq!(c.pod_uid, None);
        assert_eq!(
            pod_names(
                Some(&c),
                &env(&[("HOSTNAME", "abc"), ("POD_NAMESPACE", "x")])
            ),
            (None, None)
        );
        assert_eq!(pod_names(None, &env(&[("HOSTNAME", "abc")])), (None, None));
    }

    #[test]
    fn hostile_env_values_are_not_exported() {
        let line = format!("0::/kubepods/pod1b2c3d4e-5f60-4718-9293-a4b5c6d7e8f9/{ID}");
        let c = parse_cgroup_line(&line).unwrap();
        for bad in [
            "Upper",
            "a\"b",
            "with space",
            "-lead",
            "trail-",
            "new\nline",
            "",
            &"a".repeat(254),
        ] {
            let (pod, ns) = pod_names(Some(&c), &env(&[("HOSTNAME", bad), ("POD_NAMESPACE", bad)]));
            assert_eq!((pod, ns), (None, None), "{bad:?}");
        }
        assert!(is_k8s_name(&"a".repeat(253)));
        assert!(is_k8s_name("kube-system"));
    }
}
