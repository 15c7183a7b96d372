//! Finding msprof in the target's filesystem (its mount namespace), through a
//! [`TargetRoot`] descriptor, following symlinks inside that root only:
//! an absolute symlink such as `latest -> /usr/local/Ascend/ascend-toolkit/8.0`
//! must resolve against the container's root, not the host's.
use std::path::PathBuf;

use crate::{
    sys::{rootfs::TargetRoot, targetdir},
    target::env_value,
};

/// Where msprof was found.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Found {
    /// The path as the target sees it (what is executed inside its namespace).
    pub path: String,
    /// The same file named from the host (/proc/PID/root + its canonical
    /// path inside the root), for messages; never opened through.
    pub host_path: PathBuf,
    /// Which rule found it (`--msprof`, `PATH`, `ASCEND_HOME_PATH`, ...).
    pub via: String,
}

fn executable_in(root: &TargetRoot, path: &str) -> Option<(String, PathBuf)> {
    // The resolution happens inside the target's root (openat2
    // RESOLVE_IN_ROOT): a link to `/` or `..` never reaches the host.
    let resolved = targetdir::canonical(root, path).ok()?;
    targetdir::is_executable_file(root, &resolved).then(|| {
        (
            path.to_string(),
            root.path.join(resolved.trim_start_matches('/')),
        )
    })
}

/// The places msprof is looked for, in order, as (rule, target-view path).
pub fn candidates(explicit: Option<&str>, env: &[(String, String)]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    if let Some(p) = explicit {
        if p.contains('/') {
            out.push(("--msprof".to_string(), p.to_string()));
            return out;
        }
        // A bare command name: search the target's PATH for it.
        for dir in env_value(env, "PATH")
            .unwrap_or("")
            .split(':')
            .filter(|d| d.starts_with('/'))
        {
            out.push((
                "--msprof (in the target's PATH)".to_string(),
                format!("{}/{p}", dir.trim_end_matches('/')),
            ));
        }
        return out;
    }
    for dir in env_value(env, "PATH")
        .unwrap_or("")
        .split(':')
        .filter(|d| d.starts_with('/'))
    {
        out.push((
            "the target's PATH".to_string(),
            format!("{}/msprof", dir.trim_end_matches('/')),
        ));
    }
    for var in ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"] {
        if let Some(home) = env_value(env, var).filter(|h| h.starts_with('/')) {
            let home = home.trim_end_matches('/');
            out.push((var.to_string(), format!("{home}/bin/msprof")));
            out.push((var.to_string(), format!("{home}/tools/profiler/bin/msprof")));
        }
    }
    let mut std_roots = vec![
        "/usr/local/Ascend/ascend-toolkit/latest".to_string(),
        "/usr/local/Ascend/cann/latest".to_string(),
        "/usr/local/Ascend/latest".to_string(),
    ];
    if let Some(home) = env_value(env, "HOME").filter(|h| h.starts_with('/')) {
        std_roots.push(format!(
            "{}/Ascend/ascend-toolkit/latest",
            home.trim_end_matches('/')
        ));
    }
    for r in std_roots {
        out.push((
            "standard toolkit path".to_string(),
            format!("{r}/bin/msprof"),
        ));
        out.push((
            "standard toolkit path".to_string(),
            format!("{r}/tools/profiler/bin/msprof"),
        ));
    }
    out
}

/// Finds msprof for a target whose filesystem is at `root`, or explains
/// where it looked.
pub fn locate(
    root: &TargetRoot,
    explicit: Option<&str>,
    env: &[(String, String)],
) -> Result<Found, String> {
    let cands = candidates(explicit, env);
    for (via, path) in &cands {
        if let Some((path, host_path)) = executable_in(root, path) {
            return Ok(Found {
                path,
                host_path,
                via: via.clone(),
            });
        }
    }
    let mut looked: Vec<&str> = cands.iter().map(|(_, p)| p.as_str()).collect();
    looked.dedup();
    Err(format!(
        "msprof not found in the target's filesystem ({}); looked at: {}. \
         Pass --msprof PATH (a path inside the target's container), or set ASCEND_HOME_PATH in the job's environment",
        root.path.display(),
        looked.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn symlinks_resolve_inside_the_root() {
        let root = std::env::temp_dir().join(format!("dynprof-locate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let real = root.join("usr/local/Ascend/ascend-toolkit/8.0/bin");
        std::fs::create_dir_all(&real).unwrap();
        let exe = real.join("msprof");
        std::fs::write(&exe, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        // An absolute link: must resolve inside `root`, not on the host.
        std::os::unix::fs::symlink(
            "/usr/local/Ascend/ascend-toolkit/8.0",
            root.join("usr/local/Ascend/ascend-toolkit/latest"),
        )
        .unwrap();
        // A link that would lead to the host's /bin/sh if followed from the host.
        std::fs::create_dir_all(root.join("opt/bin")).unwrap();
        std::os::unix::fs::symlink("/bin/sh", root.join("opt/bin/msprof")).unwrap();
        let env = vec![("PATH".to_string(), "/opt/bin".to_string())];
        let troot = TargetRoot::open(&root).unwrap();
        let f = locate(&troot, None, &env).unwrap();
        assert_eq!(f.path, "/usr/local/Ascend/ascend-toolkit/latest/bin/msprof");
        assert_eq!(f.host_path, exe);
        let env = vec![("ASCEND_HOME_PATH".to_string(), "/nowhere".to_string())];
        std::fs::create_dir_all(root.join("nothing")).unwrap();
        let err = locate(
            &TargetRoot::open(&root.join("nothing")).unwrap(),
            None,
            &env,
        )
        .unwrap_err();
        assert!(err.contains("/nowhere/bin/msprof"), "{err}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
