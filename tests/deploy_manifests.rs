//! The deployment files agree with the agent: the Kubernetes manifests
//! (parsed) probe the agent's routes on the port it listens on, pass flags
//! it accepts, mount what it writes, and ask for exactly the capabilities
//! docs/capabilities.md lists; the systemd unit passes `systemd-analyze
//! verify` and bounds the same set.
mod common;

use std::{collections::BTreeSet, path::Path, process::Command};

use clap::Parser;
use dynprof::{agent::http, commands::agent::AgentArgs};
use serde_yaml::Value;

#[derive(Parser)]
struct Wrap {
    #[command(flatten)]
    a: AgentArgs,
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

/// The full set docs/capabilities.md gives for attach with every built-in
/// collector (the line after "So the full set … is:").
fn documented_caps() -> BTreeSet<String> {
    let doc = std::fs::read_to_string(root().join("docs/capabilities.md")).unwrap();
    let mut lines = doc.lines();
    lines
        .by_ref()
        .find(|l| l.starts_with("So the full set for attach with every built-in collector"))
        .expect("docs/capabilities.md names the full set");
    let set: BTreeSet<String> = lines
        .find(|l| l.trim().starts_with("CAP_"))
        .unwrap()
        .split_whitespace()
        .map(str::to_string)
        .collect();
    assert!(set.len() >= 4, "{set:?}");
    set
}

fn docs() -> Vec<Value> {
    let text = std::fs::read_to_string(root().join("deploy/kubernetes/daemonset.yaml")).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| <Value as serde::Deserialize>::deserialize(d).unwrap())
        .collect()
}

fn kind<'a>(docs: &'a [Value], k: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"].as_str() == Some(k))
        .unwrap_or_else(|| panic!("no {k} in daemonset.yaml"))
}

fn s(v: &Value) -> &str {
    v.as_str().unwrap_or_else(|| panic!("not a string: {v:?}"))
}

#[test]
fn daemonset_matches_the_agent() {
    let docs = docs();
    let ds = kind(&docs, "DaemonSet");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(
        pod["hostPID"].as_bool(),
        Some(true),
        "the jobs are in the host's PID namespace"
    );
    assert_eq!(
        ds["spec"]["selector"]["matchLabels"],
        ds["spec"]["template"]["metadata"]["labels"]
    );
    let c = &pod["containers"][0];

    // The flags parse as `dynprof agent` parses them.
    let args: Vec<String> = c["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|v| s(v).to_string())
        .collect();
    assert_eq!(args[0], "agent");
    let w = Wrap::try_parse_from(
        std::iter::once("dynprof").chain(args[1..].iter().map(String::as_str)),
    )
    .unwrap_or_else(|e| panic!("the DaemonSet's args: {e}"));
    let a = w.a;
    assert!(
        a.listen.ip().is_loopback() || a.token_file.is_some(),
        "beyond loopback the agent needs --token-file"
    );

    // Ports and probes.
    let port = &c["ports"][0];
    assert_eq!(
        port["containerPort"].as_u64(),
        Some(u64::from(a.listen.port()))
    );
    let port_name = s(&port["name"]);
    assert_eq!(s(&c["livenessProbe"]["httpGet"]["path"]), http::HEALTHZ);
    assert_eq!(s(&c["readinessProbe"]["httpGet"]["path"]), http::READYZ);
    for p in ["livenessProbe", "readinessProbe"] {
        assert_eq!(s(&c[p]["httpGet"]["port"]), port_name, "{p}");
    }
    let svc = kind(&docs, "Service");
    assert_eq!(
        svc["spec"]["selector"],
        ds["spec"]["template"]["metadata"]["labels"]
    );
    assert_eq!(s(&svc["spec"]["ports"][0]["targetPort"]), port_name);
    let pm = kind(&docs, "PodMonitor");
    assert_eq!(
        pm["spec"]["selector"]["matchLabels"],
        ds["spec"]["template"]["metadata"]["labels"]
    );
    assert_eq!(
        s(&pm["spec"]["podMetricsEndpoints"][0]["path"]),
        http::METRICS
    );
    assert_eq!(s(&pm["spec"]["podMetricsEndpoints"][0]["port"]), port_name);

    // The node label comes from the node's name.
    let env = c["env"].as_sequence().unwrap();
    let node = env
        .iter()
        .find(|e| e["name"].as_str() == Some("NODE_NAME"))
        .expect("NODE_NAME");
    assert_eq!(
        s(&node["valueFrom"]["fieldRef"]["fieldPath"]),
        "spec.nodeName"
    );

    // Security: no privileged, read-only root, exactly the documented set.
    let sc = &c["securityContext"];
    assert_ne!(sc["privileged"].as_bool(), Some(true));
    assert_eq!(sc["readOnlyRootFilesystem"].as_bool(), Some(true));
    assert_eq!(sc["allowPrivilegeEscalation"].as_bool(), Some(false));
    let drop: Vec<&str> = sc["capabilities"]["drop"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(s)
        .collect();
    assert_eq!(drop, ["ALL"]);
    let add: BTreeSet<String> = sc["capabilities"]["add"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|v| format!("CAP_{}", s(v)))
        .collect();
    assert_eq!(add, documented_caps());

    // Everything the agent writes is a mount (the root is read-only), and
    // each mount is a declared volume; hostPath volumes only where needed.
    let mounts = c["volumeMounts"].as_sequence().unwrap();
    let mounted = |p: &Path| {
        mounts
            .iter()
            .any(|m| p.starts_with(s(&m["mountPath"])) && m["readOnly"].as_bool() != Some(true))
    };
    assert!(
        mounted(&a.output),
        "--output {} is not a writable mount",
        a.output.display()
    );
    assert!(
        mounted(&dynprof::sys::lock::lock_dir()),
        "the lock dir is not a writable mount"
    );
    let token = a.token_file.as_ref().unwrap();
    assert!(
        mounts.iter().any(|m| token.starts_with(s(&m["mountPath"]))),
        "the token file is mounted"
    );
    // The socket's directory is a writable mount (a hostPath, so the node's
    // root reaches it); the config dir is the ConfigMap, read-only.
    let sock = a.socket.as_ref().expect("the DaemonSet gives --socket");
    assert!(
        mounted(sock.parent().unwrap()),
        "--socket {} is not in a writable mount",
        sock.display()
    );
    let cfg = a
        .config_dir
        .as_ref()
        .expect("the DaemonSet gives --config-dir");
    let cfg_mount = mounts
        .iter()
        .find(|m| Path::new(s(&m["mountPath"])) == cfg.as_path())
        .expect("--config-dir is a mount");
    assert_eq!(cfg_mount["readOnly"].as_bool(), Some(true));
    let volumes = pod["volumes"].as_sequence().unwrap();
    let cfg_vol = volumes
        .iter()
        .find(|v| v["name"] == cfg_mount["name"])
        .unwrap();
    assert!(
        cfg_vol["configMap"]["name"].as_str().is_some(),
        "--config-dir is a ConfigMap volume: {cfg_vol:?}"
    );
    for m in mounts {
        assert!(
            volumes.iter().any(|v| v["name"] == m["name"]),
            "{m:?} has no volume"
        );
    }
    let host_paths: BTreeSet<&str> = volumes
        .iter()
        .filter_map(|v| v["hostPath"]["path"].as_str())
        .collect();
    assert_eq!(
        host_paths,
        BTreeSet::from([
            "/run/dynprof",
            "/var/lib/dynprof/captures",
            "/sys/kernel/tracing"
        ])
    );
}

#[test]
fn systemd_unit_verifies_and_bounds_the_documented_caps() {
    let unit =
        std::fs::read_to_string(root().join("deploy/systemd/dynprof-agent.service")).unwrap();
    let get = |k: &str| {
        unit.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("no {k}= in the unit"))
    };
    let bound: BTreeSet<String> = get("CapabilityBoundingSet")
        .split_whitespace()
        .map(str::to_string)
        .collect();
    assert_eq!(bound, documented_caps());
    assert_eq!(get("NoNewPrivileges"), "yes");
    assert_eq!(get("ProtectSystem"), "strict");
    let exec = get("ExecStart");
    let mut argv = exec.split_whitespace();
    let bin = argv.next().unwrap();
    assert_eq!(argv.next(), Some("agent"));
    let w = Wrap::try_parse_from(std::iter::once("dynprof").chain(argv))
        .unwrap_or_else(|e| panic!("ExecStart: {e}"));
    assert!(w.a.listen.ip().is_loopback() || w.a.token_file.is_some());
    let rw: Vec<&str> = get("ReadWritePaths").split_whitespace().collect();
    let sock_dir =
        w.a.socket
            .as_deref()
            .and_then(Path::parent)
            .expect("the unit gives --socket");
    for p in [
        w.a.output.as_path(),
        dynprof::sys::lock::lock_dir().as_path(),
        sock_dir,
    ] {
        assert!(
            rw.iter().any(|r| p.starts_with(r)),
            "{} is not writable under ProtectSystem=strict",
            p.display()
        );
    }

    // systemd's own check, with ExecStart pointing at this build.
    let dir = common::scratch_dir("unit_verify");
    let copy = dir.join("dynprof-agent.service");
    std::fs::write(
        &copy,
        unit.replace(bin, common::dynprof_bin().to_str().unwrap()),
    )
    .unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&copy)
        .output()
        .expect("systemd-analyze (Debian's systemd; cargo xtask setup installs it)");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.trim().is_empty(),
        "systemd-analyze verify: {err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Where `cargo xtask setup` installs kubernetes-validate (xtask's
/// `K8S_VALIDATE_VENV`).
const K8S_VALIDATE: &str = "/var/cache/dynprof/venv-kubernetes-validate/bin/kubernetes-validate";

/// A real schema check: kubernetes-validate (PyPI, the Kubernetes OpenAPI
/// schemas bundled, offline) passes every built-in kind in the file,
/// strictly (no unknown field); and the same file with one field misspelt
/// fails, so the check is not a no-op. The PodMonitor is a CRD with no
/// bundled schema: only warned about. Required under CI.
#[test]
fn daemonset_passes_the_kubernetes_schema() {
    if !Path::new(K8S_VALIDATE).exists() {
        let msg = format!("{K8S_VALIDATE} is missing: run `cargo xtask setup`");
        if std::env::var_os("CI").is_some() {
            panic!("{msg}");
        }
        eprintln!("skipping: {msg}");
        return;
    }
    let file = root().join("deploy/kubernetes/daemonset.yaml");
    let run = |f: &Path| {
        let out = Command::new(K8S_VALIDATE)
            .args(["--strict", "--no-warn"])
            .arg(f)
            .output()
            .expect("running kubernetes-validate");
        (
            out.status.code(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    };
    let (code, text) = run(&file);
    assert_eq!(code, Some(0), "{text}");
    for r in [
        "namespace/dynprof",
        "daemonset/dynprof-agent",
        "service/dynprof-agent",
    ] {
        assert!(
            text.contains(&format!("passed for resource {r}")),
            "{r} not validated: {text}"
        );
    }
    let dir = common::scratch_dir("k8s_validate");
    let bad = dir.join("daemonset.yaml");
    let yaml = std::fs::read_to_string(&file).unwrap();
    std::fs::write(
        &bad,
        yaml.replacen("readOnlyRootFilesystem:", "readOnlyRootFileSystem:", 1),
    )
    .unwrap();
    let (code, text) = run(&bad);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("'readOnlyRootFileSystem' was unexpected"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
