//! The separate debug file of a stripped mapped file: by build id, then by
//! `.gnu_debuglink` (docs/stacks.md, "Symbols of stripped binaries").
//! Every name here comes from the target's file and every file opened in
//! the target's root goes through `TargetRoot` (never following a link
//! out of it), with the read caps and deadline of the target's own files.
use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::symbols::{DebugLink, ElfImage, elf};
use crate::sys::rootfs::{self, TargetRoot};

/// Where distributions install separate debug files (GDB's default).
pub const DEFAULT_DEBUG_DIR: &str = "/usr/lib/debug";

/// Where to look, for one target.
pub struct Search<'a> {
    pub pid: u32,
    /// The target is gone: nothing is opened in its root.
    pub exited: bool,
    /// `--debug-dir`.
    pub dirs: &'a [PathBuf],
}

impl Search<'_> {
    /// The separate debug file of build id `id` with its `.symtab`: in each
    /// `--debug-dir`, then under `/usr/lib/debug` inside the target's root
    /// (opened there, never following a link out), then on the host. A
    /// file whose own build id differs is not used.
    /// Returns it with its path (inside the target's root when found
    /// there).
    pub fn by_build_id(&self, id: &str) -> Option<(ElfImage, PathBuf)> {
        let rel = crate::symbols::build_id_path(id)?;
        let usable = |img: ElfImage| {
            (img.build_id().as_deref() == Some(id) && img.has_symtab()).then_some(img)
        };
        for dir in self.dirs {
            let path = dir.join(&rel);
            if path.exists()
                && let Some(img) = ElfImage::open(&path).ok().and_then(usable)
            {
                log::debug!("symbolize: build id {id}: {}", path.display());
                return Some((img, path));
            }
        }
        let in_root = Path::new(DEFAULT_DEBUG_DIR).join(&rel);
        if !self.exited {
            let pid = self.pid;
            let name = in_root.clone();
            let img = ElfImage::read_bounded(&in_root, move || {
                let root = TargetRoot::open(&PathBuf::from(format!("/proc/{pid}/root")))?;
                Ok(root.open_regular(&name.to_string_lossy())?)
            });
            if let Some(img) = img.ok().and_then(usable) {
                log::debug!(
                    "symbolize: build id {id}: {} in the target",
                    in_root.display()
                );
                return Some((img, in_root));
            }
        }
        if in_root.exists() {
            return ElfImage::open(&in_root)
                .ok()
                .and_then(usable)
                .map(|img| (img, in_root));
        }
        None
    }

    /// The separate debug file that a mapped file's `.gnu_debuglink`
    /// names, where GDB looks for it: next to the file, in its `.debug/`,
    /// and under `/usr/lib/debug/DIR/` (all inside the target's root, never
    /// following a link out), then in each `--debug-dir` (by name, and
    /// under the file's directory), then under this host's
    /// `/usr/lib/debug/DIR/`. Used only when it has a `.symtab` and is that
    /// file's: the same build id (`id`, the mapped file's) where both have
    /// one, else the CRC-32 of its content that the link records. Returns
    /// it with its path (inside the target's root when found there).
    pub fn by_debuglink(
        &self,
        link: &DebugLink,
        id: Option<&str>,
        module: &str,
    ) -> Option<(ElfImage, PathBuf)> {
        use std::path::Component;
        if !link.is_plain() {
            return None;
        }
        let (name, crc) = (&link.name, link.crc);
        // The maps name is absolute and canonical; any other is not joined
        // to a directory (the name itself is a plain file name).
        let dir = Path::new(module).parent()?;
        let canonical = dir.is_absolute()
            && dir
                .components()
                .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
        if !canonical {
            return None;
        }
        let rel_dir = dir.strip_prefix("/").ok()?;
        let mut candidates: Vec<(PathBuf, bool)> = Vec::new();
        if !self.exited {
            candidates.push((dir.join(name), true));
            candidates.push((dir.join(".debug").join(name), true));
            candidates.push((Path::new(DEFAULT_DEBUG_DIR).join(rel_dir).join(name), true));
        }
        for d in self.dirs {
            candidates.push((d.join(name), false));
            candidates.push((d.join(rel_dir).join(name), false));
        }
        candidates.push((Path::new(DEFAULT_DEBUG_DIR).join(rel_dir).join(name), false));
        let pid = self.pid;
        for (path, in_root) in candidates {
            if !in_root && !path.exists() {
                continue;
            }
            let open = move |p: PathBuf| -> Result<rootfs::RegularFile> {
                if in_root {
                    let root = TargetRoot::open(&PathBuf::from(format!("/proc/{pid}/root")))?;
                    Ok(root.open_regular(&p.to_string_lossy())?)
                } else {
                    Ok(rootfs::open_regular(&p)?)
                }
            };
            let p = path.clone();
            let Ok(candidate) = ElfImage::read_bounded(&path, move || open(p)) else {
                continue;
            };
            if !candidate.has_symtab() {
                continue;
            }
            let same = match (id, candidate.build_id()) {
                (Some(a), Some(b)) => a == b,
                _ => {
                    let p = path.clone();
                    crc32_of(move || open(p)) == Some(crc)
                }
            };
            if same {
                log::debug!("symbolize: {module}: debug link {}", path.display());
                return Some((candidate, path));
            }
            log::debug!(
                "symbolize: {}: not the debug file of {module} (build id or CRC differs)",
                path.display()
            );
        }
        None
    }
}

/// For `report --symbolize`, on any host and after the job: the debug file
/// of a mapped file (at `path` in the target) that a window named only by
/// offset, by its recorded build id, then by its recorded
/// `.gnu_debuglink`, in each of `dirs`, then under this host's
/// `/usr/lib/debug`.
pub fn offline(
    build_id: Option<&str>,
    link: Option<&DebugLink>,
    path: &str,
    dirs: &[PathBuf],
) -> Option<PathBuf> {
    let search = Search {
        pid: 0,
        exited: true,
        dirs,
    };
    build_id
        .and_then(|id| search.by_build_id(id))
        .or_else(|| search.by_debuglink(link?, build_id, path))
        .map(|(_, path)| path)
}

/// The CRC-32 of a whole file (what `.gnu_debuglink` records), read within
/// the file deadline; `None` when it cannot be read or is larger than
/// [`elf::limits::DEBUGLINK_CRC_READ`].
fn crc32_of(open: impl FnOnce() -> Result<rootfs::RegularFile> + Send + 'static) -> Option<u32> {
    use std::os::unix::fs::FileExt as _;
    let read = move || -> Result<u32> {
        let f = open()?;
        let cap = elf::limits::DEBUGLINK_CRC_READ;
        anyhow::ensure!(f.size <= cap, "{} bytes, over {cap}", f.size);
        let mut crc = flate2::Crc::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut off = 0u64;
        loop {
            let n = f.file.read_at(&mut buf, off)?;
            if n == 0 {
                return Ok(crc.sum());
            }
            crc.update(&buf[..n]);
            off += n as u64;
            anyhow::ensure!(off <= cap, "grew past {cap} bytes while read");
        }
    };
    match rootfs::within(rootfs::FILE_DEADLINE, "reading a debug file's CRC", read) {
        Ok(Ok(crc)) => Some(crc),
        Ok(Err(e)) => {
            log::debug!("symbolize: debug link CRC: {e:#}");
            None
        }
        Err(e) => {
            log::debug!("symbolize: debug link CRC: {e}");
            None
        }
    }
}
