//! Files as the target sees them, across mount namespaces.
//!
//! A mapped object is read and attached to through
//! `/proc/PID/map_files/<start>-<end>`: the kernel's link to the very inode
//! the target mapped, whatever its mount namespace, whatever now sits at its
//! name (uprobes attach to an inode, so attaching to a replaced file by name
//! would never fire). The name is looked up too, inside the target's root
//! ([`TargetRoot`]: `openat2` with `RESOLVE_IN_ROOT`, never following a
//! link out to the host), only to say whether the file is intact, deleted
//! or replaced. Without map_files (it needs CAP_SYS_ADMIN or
//! CAP_CHECKPOINT_RESTORE) the file is read inside the root, and attached by
//! its `/proc/PID/root/<path>` name only when that name leads to the same
//! inode from the host; a name that leaves the root is refused.
//!
//! Nothing here opens what is not a regular file (a FIFO put in a
//! library's place would block an `open` for reading forever), and every
//! look-up and read runs under [`rootfs::FILE_DEADLINE`].
use std::{
    collections::HashSet,
    path::PathBuf,
    sync::{Mutex, OnceLock},
};

use anyhow::{Result, bail};
use serde::Serialize;

use super::{Mapping, Target};
use crate::{
    symbols::ElfImage,
    sys::rootfs::{self, FileId, FileKind, TargetRoot},
    types::HostPid,
};

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
        /// What is at the path now when it is not a regular file (a FIFO…).
        #[serde(skip_serializing_if = "Option::is_none")]
        on_disk_kind: Option<&'static str>,
    },
    /// map_files is not readable, and the name leads elsewhere from the
    /// host than inside the target's root (a symbolic link out of it).
    OutsideRoot,
}

#[derive(Clone, Debug, Serialize)]
pub struct MappedFile {
    /// The host path dynprof attaches through.
    pub path: PathBuf,
    pub via: Via,
    #[serde(flatten)]
    pub state: FileState,
    /// The path as the target names it.
    #[serde(skip)]
    target_path: String,
    #[serde(skip)]
    host_pid: HostPid,
}

impl MappedFile {
    /// Reads the ELF file (headers and symbol tables; see `symbols::elf`).
    pub fn open_elf(&self) -> Result<ElfImage> {
        match (self.via, &self.state) {
            (_, FileState::OutsideRoot) => bail!(
                "{} leads out of PID {}'s root through a symbolic link, and /proc/{}/map_files \
                 is not readable (needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE): not read",
                self.target_path,
                self.host_pid,
                self.host_pid
            ),
            (Via::MapFiles, _) => ElfImage::open(&self.path),
            (Via::Root, _) => {
                let (pid, name) = (self.host_pid, self.target_path.clone());
                ElfImage::read_bounded(&self.path, move || {
                    let root = TargetRoot::open(&PathBuf::from(format!("/proc/{pid}/root")))?;
                    Ok(root.open_regular(&name)?)
                })
                .map_err(|e| e.context(format!("{} in PID {pid}'s root", self.target_path)))
            }
        }
    }
}

fn map_files_path(target: &Target, m: &Mapping) -> PathBuf {
    PathBuf::from(format!(
        "/proc/{}/map_files/{:x}-{:x}",
        target.host_pid, m.start, m.end
    ))
}

/// The build id of the file at `path` inside the target's root.
fn on_disk_build_id(root: &std::path::Path, path: &str) -> Option<String> {
    let (root, path) = (root.to_path_buf(), path.to_string());
    ElfImage::read_bounded(std::path::Path::new(&path.clone()), move || {
        Ok(TargetRoot::open(&root)?.open_regular(&path)?)
    })
    .ok()?
    .build_id()
}

/// (map_files, name inside the root, the name's host-side resolution),
/// looked up without opening anything, under the file deadline.
type Ids = (Option<FileId>, Option<FileId>, Option<FileId>);

fn look_up(by_map: PathBuf, root: PathBuf, path: String) -> Ids {
    let what = format!("looking up {path}");
    rootfs::within(rootfs::FILE_DEADLINE, &what, move || {
        let map = rootfs::stat_path(&by_map).ok();
        let inside = TargetRoot::open(&root).and_then(|r| r.stat(&path)).ok();
        // Only needed when map_files is not readable.
        let naive = map
            .is_none()
            .then(|| rootfs::stat_path(&root.join(path.trim_start_matches('/'))).ok())
            .flatten();
        (map, inside, naive)
    })
    .unwrap_or_else(|e| {
        log::warn!("{e}");
        (None, None, None)
    })
}

/// Decides how to open a mapped file; see the module doc.
pub fn locate(target: &Target, m: &Mapping) -> MappedFile {
    let by_root = target.host_path(&m.path);
    let by_map = map_files_path(target, m);
    let (map_id, root_id, naive_id) = look_up(by_map.clone(), target.root(), m.path.clone());
    let same = |a: &Option<FileId>, b: &FileId| a.is_some_and(|a| (a.dev, a.ino) == (b.dev, b.ino));
    let file = |path, via, state| MappedFile {
        path,
        via,
        state,
        target_path: m.path.clone(),
        host_pid: target.host_pid,
    };
    let Some(map_id) = map_id else {
        // map_files needs CAP_SYS_ADMIN (or CAP_CHECKPOINT_RESTORE); fall back to the name.
        let state = match &root_id {
            _ if m.deleted => FileState::Deleted,
            Some(inside) if !same(&naive_id, inside) => FileState::OutsideRoot,
            _ => FileState::Intact,
        };
        return file(by_root, Via::Root, state);
    };
    let state = match &root_id {
        Some(inside) if !m.deleted && same(&Some(map_id), inside) => FileState::Intact,
        Some(inside) => FileState::Replaced {
            mapped_build_id: ElfImage::open(&by_map).ok().and_then(|i| i.build_id()),
            on_disk_build_id: (inside.kind == FileKind::Regular)
                .then(|| on_disk_build_id(&target.root(), &m.path))
                .flatten(),
            on_disk_kind: (inside.kind != FileKind::Regular).then(|| inside.kind.describe()),
        },
        None => FileState::Deleted,
    };
    file(by_map, Via::MapFiles, state)
}

/// Opens a mapped file's ELF image the way [`locate`] decides (warning
/// once when it is not intact).
pub fn open_elf(target: &Target, m: &Mapping) -> Result<ElfImage> {
    locate_and_warn(target, m).open_elf()
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
        Via::Root if f.state == FileState::OutsideRoot => {
            "not probed (map_files is not readable: needs CAP_SYS_ADMIN)".to_string()
        }
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
        FileState::OutsideRoot => format!(
            "{} leads out of PID {pid}'s root through a symbolic link; {how}",
            m.path
        ),
        FileState::Replaced {
            mapped_build_id,
            on_disk_build_id,
            on_disk_kind,
        } => {
            let ids = match (mapped_build_id, on_disk_build_id) {
                (Some(a), Some(b)) if a != b => format!(" (build id mapped {a}, on disk now {b})"),
                (Some(a), Some(_)) => format!(" (same build id {a}, but a different file)"),
                _ => String::new(),
            };
            let ids = match on_disk_kind {
                Some(kind) => format!("{ids} ({kind} is there now)"),
                None => ids,
            };
            format!(
                "{} was replaced on disk since PID {pid} mapped it{ids}; the new file is not what runs; {how}",
                m.path
            )
        }
    }
}
