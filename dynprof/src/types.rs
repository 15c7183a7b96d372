//! Small types that carry meaning across modules.
use std::fmt;

use serde::{Deserialize, Serialize};

/// A built-in eBPF collector: the one name `--collect`, plans, config files,
/// the scheduler and summary.json use for it.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Builtin {
    /// Runtime API calls (CANN/CUDA, or `--api`).
    Api,
    /// On-CPU stack samples.
    Cpu,
    /// Off-CPU intervals (sched_switch).
    Offcpu,
}

impl Builtin {
    /// Every built-in collector, in the order they are built and listed.
    pub const ALL: [Builtin; 3] = [Builtin::Api, Builtin::Cpu, Builtin::Offcpu];

    /// The name on the command line, in config files and in output.
    pub fn name(self) -> &'static str {
        match self {
            Builtin::Api => "api",
            Builtin::Cpu => "cpu",
            Builtin::Offcpu => "offcpu",
        }
    }

    /// The collector named `name`, if any.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|b| b.name() == name)
    }

    /// `api,cpu,offcpu`, for messages.
    pub fn names() -> String {
        Self::ALL.map(Builtin::name).join(",")
    }
}

impl fmt::Display for Builtin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A PID as the host (the initial PID namespace) sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct HostPid(pub u32);

/// A PID as some (possibly nested) PID namespace sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NsPid(pub u32);

/// Step index: hit k of the step marker after attach begins step k; the step
/// in progress at attach time is step 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct StepIndex(pub u64);

/// 1-based number of a window within one dynprof run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WindowId(pub u32);

impl fmt::Display for HostPid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
impl fmt::Display for NsPid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
impl fmt::Display for StepIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
impl fmt::Display for WindowId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Which container engine a cgroup path names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ContainerRuntime {
    Docker,
    Containerd,
    CriO,
    Podman,
    /// A Kubernetes pod container under the cgroupfs driver, whose path does
    /// not name the engine (`/kubepods/<qos>/pod<uid>/<id>`).
    Cri,
    /// A 64-hex container id under an unrecognised parent.
    Unknown,
}

impl ContainerRuntime {
    pub fn as_str(self) -> &'static str {
        match self {
            ContainerRuntime::Docker => "docker",
            ContainerRuntime::Containerd => "containerd",
            ContainerRuntime::CriO => "cri-o",
            ContainerRuntime::Podman => "podman",
            ContainerRuntime::Cri => "cri",
            ContainerRuntime::Unknown => "unknown",
        }
    }
}

impl fmt::Display for ContainerRuntime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A container as its cgroup path names it: the full (64 hex, lowercase) id,
/// the engine, and the Kubernetes pod UID when the path has one.
/// Serializes (and displays) as the bare full id.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ContainerId {
    pub id: String,
    pub runtime: ContainerRuntime,
    pub pod_uid: Option<String>,
}

impl ContainerId {
    /// The first 12 hex digits, as `docker ps` shows it.
    pub fn short(&self) -> &str {
        &self.id[..self.id.len().min(12)]
    }

    /// Does `prefix` (case-insensitive) start this id?
    pub fn matches_prefix(&self, prefix: &str) -> bool {
        self.id.len() >= prefix.len() && self.id[..prefix.len()].eq_ignore_ascii_case(prefix)
    }
}

impl fmt::Display for ContainerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.id)
    }
}

impl Serialize for ContainerId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.id)
    }
}
