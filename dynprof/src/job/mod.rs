//! Job mode: every rank of a training job at once.
//!
//! Pure logic lives here and is unit-tested without root:
//! - [`discover`]: which processes are the job's ranks, and their rank numbers;
//! - [`group`]: `dynprof ps --jobs`, processes grouped into jobs;
//! - [`align`]: which step of each rank is the same job iteration;
//! - [`table`]: the per-rank step table (`job_steps.csv`) built from what
//!   each rank's window recorded and the off-CPU time of its step thread;
//! - [`verdict`]: the `straggler:` line;
//! - [`trace`]: the merged `trace.json`, one track per rank;
//! - [`report`]: `dynprof report` on a job directory;
//! - [`window`]: which ranks a window covers, when the next repeat starts.
//!
//! The command that acts (attach, run the sessions, write the directory) is
//! `commands::job`; it is the only user of this module.
pub mod align;
pub mod discover;
pub mod group;
pub mod report;
pub mod table;
pub mod trace;
pub mod verdict;
pub mod window;

/// A rank number as the job names it (RANK), or its position when the
/// environment does not say.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct Rank(pub u32);

impl std::fmt::Display for Rank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// The job directory's table and metadata (names are a contract with
/// `dynprof report`).
pub const JOB_STEPS_FILE: &str = "job_steps.csv";
pub const JOB_META_FILE: &str = "job_meta.json";
/// Prefix of a job window directory under `--output`.
pub const JOB_DIR_PREFIX: &str = "PROF_JOB_";

/// The subdirectory that holds one rank's own window.
pub fn rank_dir_name(r: Rank) -> String {
    format!("rank{r}")
}
