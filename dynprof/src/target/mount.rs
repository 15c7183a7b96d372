//! Files as the target sees them, across mount namespaces.
//!
//! A mapped object is opened through `/proc/PID/root/<path>` (the target's
//! own view: container image, tmpfs, private mounts; a path that does not
//! exist on the host is the normal case), or through
//! `/proc/PID/map_files/<start>-<end>` (the very file that is mapped) when
//! the name no longer leads there: deleted, or replaced on disk since it was
//! mapped. Uprobes attach to an inode, so attaching to a replaced file by
//! name would never fire.
use std::{
    collections::HashSet,
    fs,
    os::unix::fs::MetadataExt as _,
    path::PathBuf,
    sync::{Mutex, OnceLock},
};

use serde::Serialize;

use super::{Mapping, Target};
use crate::symbols::ElfImage;

/// Through which view a mapped file is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Via {
    /// `/proc/PID/root/<path>`.
    Root,
    /// `/proc/PID/map_files/<range>`.
    MapFiles,
}

/// What happened to a mapped file on disk.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum FileState {
    /// The path leads to the mapped file.
    Intact,
    /// Unlinked after it was mapped (maps says "(deleted)"), nothing at the path now.
    Deleted,
    /// Another file is at the path now.
    Replaced {
        mapped_build_id: Option<String>,
        on_disk_build_id: Option<String>,
    },
}

#[derive(Clone, Debug, Serialize)]
pub struct MappedFile {
    pub path: PathBuf,
    pub via: Via,
    #[serde(flatten)]
    pub state: FileState,
}

fn map_files_path(target: &Target, m: &Mapping) -> PathBuf {
    PathBuf::from(format!(
        "/proc/{}/map_files/{:x}-{:x}",
        target.host_pid, m.start, m.end
    ))
}

fn build_id_of(p: &std::path::Path) -> Option<String> {
    ElfImage::open(p).ok().and_then(|i| i.build_id())
}

/// Decides how to open a mapped file; see the module doc.
pub fn locate(target: &Target, m: &Mapping) -> MappedFile {
    let by_root = target.host_path(&m.path);
    let by_map = map_files_path(target, m);
    let root_meta = fs::metadata(&by_root).ok();
    let map_meta = fs::metadata(&by_map).ok();
    let Some(map_meta) = map_meta else {
        // map_files needs CAP_SYS_ADMIN (or CAP_CHECKPOINT_RESTORE); fall back to the name.
        return MappedFile {
            path: by_root,
            via: Via::Root,
            state: if m.deleted {
                FileState::Deleted
            } else {
                FileState::Intact
            },
        };
    };
    let same = root_meta
        .as_ref()
        .is_some_and(|r| r.dev() == map_meta.dev() && r.ino() == map_meta.ino());
    if same && !m.deleted {
        return MappedFile {
            path: by_root,
            via: Via::Root,
            state: FileState::Intact,
        };
    }
    let state = if root_meta.is_some() {
        FileState::Replaced {
            mapped_build_id: build_id_of(&by_map),
            on_disk_build_id: build_id_of(&by_root),
        }
    } else {
        FileState::Deleted
    };
    MappedFile {
        path: by_map,
        via: Via::MapFiles,
        state,
    }
}

/// [`locate`], warning once per (PID, path) when the file is not intact.
pub fn locate_and_warn(target: &Target, m: &Mapping) -> MappedFile {
    let f = locate(target, m);
    static WARNED: OnceLock<Mutex<HashSet<(u32, String)>>> = OnceLock::new();
    if f.state != FileState::Intact {
        let key = (target.host_pid.0, m.path.clone());
        let first = WARNED
            .get_or_init(Default::default)
            .lock()
            .map(|mut w| w.insert(key))
            .unwrap_or(true);
        if first {
            log::warn!("{}", describe(target, m, &f));
        }
    }
    f
}

/// The warning text for a file that is not intact.
pub fn describe(target: &Target, m: &Mapping, f: &MappedFile) -> String {
    let pid = target.host_pid;
    let how = match f.via {
        Via::MapFiles => format!("attaching to the mapped copy through {}", f.path.display()),
        Via::Root => format!(
            "attaching by name through {} (map_files is not readable: needs CAP_SYS_ADMIN); \
             probes may not fire",
            f.path.display()
        ),
    };
    match &f.state {
        FileState::Intact => format!("{} is intact", m.path),
        FileState::Deleted => {
            format!(
                "{} was deleted after PID {pid} mapped it (maps says \"(deleted)\"); {how}",
                m.path
            )
        }
        FileState::Replaced {
            mapped_build_id,
            on_disk_build_id,
        } => {
            let ids = match (mapped_build_id, on_disk_build_id) {
                (Some(a), Some(b)) if a != b => format!(" (build id mapped {a}, on disk now {b})"),
                (Some(a), Some(_)) => format!(" (same build id {a}, but a different file)"),
                _ => String::new(),
            };
            format!(
                "{} was replaced on disk since PID {pid} mapped it{ids}; the new file is not what runs; {how}",
                m.path
            )
        }
    }
}
