//! Symbol lookup in one ELF object, by mangled or demangled name.
//!
//! The object is a file the target controls (its own libraries, through
//! `/proc/PID/map_files` or its root), so it is read, never mapped: a
//! target that truncates a mapped file under a reader's `mmap` kills the
//! reader with SIGBUS. Only the parts dynprof uses are read, each with
//! `pread` at its own offset into a [`Sparse`] image, and each against a
//! cap ([`limits`]): a section that claims 2^60 bytes, or more than the file
//! holds, is an error before anything is allocated.
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, anyhow, bail};
use object::{Endianness, Object, ObjectSection, ObjectSegment, elf};

mod debugdata;
mod find;
mod read;
use crate::sys::rootfs::{self, RegularFile};
pub use find::{demangle, strip_params};
#[cfg(test)]
use find::{is_cold_fragment, mangled_needles};
pub use read::Sparse;
use read::{Loader, Source, StapsdtNotes, load_parts};

/// Caps on what one ELF file may make dynprof read or do.
pub mod limits {
    use std::time::Duration;
    /// Program or section header table.
    pub const HEADER_TABLE: u64 = 4 << 20;
    /// `.shstrtab`.
    pub const SECTION_NAMES: u64 = 1 << 20;
    /// One symbol table (24 bytes a symbol: 5.6 M symbols).
    pub const SYMBOL_TABLE: u64 = 128 << 20;
    /// One string table (libtorch_cpu's `.dynstr` is 2.7 MiB).
    pub const STRING_TABLE: u64 = 256 << 20;
    /// `.note.stapsdt` (a note is ~100 bytes; libc has ~80 of them).
    pub const STAPSDT_NOTES: u64 = 4 << 20;
    /// Any other note section (build id, ABI tag).
    pub const OTHER_NOTES: u64 = 64 << 10;
    /// `.eh_frame` or `.eh_frame_hdr`, for unwinding (libtorch_cpu's
    /// `.eh_frame` is tens of MiB). A larger one is not read: stacks
    /// through that file fall back to frame pointers.
    pub const EH_FRAME: u64 = 192 << 20;
    /// `.gnu_debugdata` (MiniDebugInfo: an xz-compressed ELF with the
    /// local function symbols a stripped binary lost; a few MiB even for
    /// big libraries).
    pub const DEBUGDATA: u64 = 64 << 20;
    /// What `.gnu_debugdata` may decompress to. Checked by decompressing
    /// it once before blazesym does, so an xz bomb is refused, not expanded.
    pub const DEBUGDATA_OUT: u64 = 256 << 20;
    /// `.gnu_debuglink` (a file name, padding and a CRC).
    pub const DEBUGLINK: u64 = 4 << 10;
    /// A separate debug file found by `.gnu_debuglink` is checked by the
    /// CRC of its whole content when neither file has a build id: one
    /// larger than this is not read for that, and not used.
    pub const DEBUGLINK_CRC_READ: u64 = 1 << 30;
    /// Everything read from one file.
    pub const TOTAL: u64 = 512 << 20;
    /// Demangling while looking names up in one file.
    pub const DEMANGLE_TIME: Duration = Duration::from_secs(2);
}

/// A function symbol found in an object, with the file offset uprobes need.
#[derive(Clone, Debug)]
pub struct SymbolHit {
    pub mangled: String,
    pub demangled: String,
    pub vaddr: u64,
    pub file_offset: u64,
}

/// A `.gnu_debuglink`: the separate debug file's name (a plain file name,
/// never a path) and the CRC-32 of that file's content.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DebugLink {
    pub name: String,
    pub crc: u32,
}

impl DebugLink {
    /// Is the name one file name (no `/`, not `.` or `..`, no control
    /// characters)? It comes from a target's file, or from a
    /// `modules.json`, and is joined to directories.
    pub fn is_plain(&self) -> bool {
        let name = &self.name;
        !name.is_empty()
            && name.len() <= 255
            && name != "."
            && name != ".."
            && !name.contains('/')
            && !name.chars().any(char::is_control)
    }
}

/// `.gnu_debuglink`'s content: a NUL-terminated file name, padding to 4
/// bytes, and the CRC-32 (in the file's byte order) of the debug file.
fn parse_debuglink(data: &[u8], little_endian: bool) -> Option<DebugLink> {
    let nul = data.iter().position(|b| *b == 0)?;
    let name = std::str::from_utf8(&data[..nul]).ok()?;
    let at = (nul + 1).next_multiple_of(4);
    let crc: [u8; 4] = data.get(at..at + 4)?.try_into().ok()?;
    let crc = if little_endian {
        u32::from_le_bytes(crc)
    } else {
        u32::from_be_bytes(crc)
    };
    let link = DebugLink {
        name: name.to_string(),
        crc,
    };
    link.is_plain().then_some(link)
}

/// What unwinding through one file needs: its unwind tables at their
/// section addresses, and its `PT_LOAD` segments to turn the file offset of
/// a mapping into a section address.
#[derive(Clone, Debug)]
pub struct UnwindSections {
    pub cfi: Cfi,
    pub text: Option<std::ops::Range<u64>>,
    /// (file offset, file size, virtual address) of each loadable segment.
    pub load_segments: Vec<(u64, u64, u64)>,
}

/// The one table of call frame information a file is unwound with
/// (framehop reads one per module).
#[derive(Clone, Debug)]
pub enum Cfi {
    /// `.eh_frame` at its section addresses, with its binary-search index
    /// `.eh_frame_hdr` where the file has one.
    EhFrame {
        eh_frame: (std::ops::Range<u64>, SectionData),
        hdr: Option<(std::ops::Range<u64>, SectionData)>,
    },
    /// `.debug_frame` (not loaded; its FDEs hold absolute addresses).
    DebugFrame(SectionData),
}

/// A section's bytes, shared: the unwinder's modules hold the same bytes
/// as the tables they were built from (libtorch_cpu's `.eh_frame` alone is
/// 9.5 MiB, and a copy per module doubled it).
pub type SectionData = std::sync::Arc<[u8]>;

impl Cfi {
    /// Which of a file's tables to unwind it with. Code built with
    /// `-fno-unwind-tables -fno-asynchronous-unwind-tables -g` has its
    /// functions' tables in `.debug_frame`, while its `.eh_frame` still
    /// holds the C runtime's few entries (`_start`); a compiler that emits both for the same code
    /// emits the same rules. So the larger table is the one that covers the
    /// code (`.debug_frame`'s FDEs are larger, so a tie goes to it too, and
    /// that choice is also complete).
    pub fn choose(
        eh_frame: Option<(std::ops::Range<u64>, SectionData)>,
        hdr: Option<(std::ops::Range<u64>, SectionData)>,
        debug_frame: Option<SectionData>,
    ) -> Option<Cfi> {
        match (eh_frame, debug_frame) {
            (Some(e), Some(d)) if d.len() > e.1.len() => Some(Cfi::DebugFrame(d)),
            (Some(e), _) => Some(Cfi::EhFrame { eh_frame: e, hdr }),
            (None, Some(d)) => Some(Cfi::DebugFrame(d)),
            (None, None) => None,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Cfi::EhFrame { .. } => ".eh_frame",
            Cfi::DebugFrame(_) => ".debug_frame",
        }
    }
}

impl UnwindSections {
    /// The section address of file offset `off`, through the loadable
    /// segment that holds it.
    pub fn offset_to_vaddr(&self, off: u64) -> Option<u64> {
        offset_to_vaddr(&self.load_segments, off)
    }
}

/// The virtual address of file offset `off` through `segments`, (file
/// offset, file size, virtual address) each.
pub fn offset_to_vaddr(segments: &[(u64, u64, u64)], off: u64) -> Option<u64> {
    segments
        .iter()
        .find(|(o, size, _)| off >= *o && off - o < (*size).max(1))
        .and_then(|(o, _, vaddr)| vaddr.checked_add(off - o))
}

/// An instruction set dynprof reads: a USDT note's operand syntax and
/// registers, and the structure layout of a C program built for it (glibc's
/// `pthread_mutex_t` is 40 bytes on x86-64 and 48 on arm64, which moves
/// fields that come after one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    X86_64,
    Aarch64,
}

impl Arch {
    /// dynprof's own: a probe is read through this kernel's `pt_regs`.
    pub const HOST: Arch = if cfg!(target_arch = "aarch64") {
        Arch::Aarch64
    } else {
        Arch::X86_64
    };
}

/// An ELF file's headers, symbol tables and notes, read into memory.
pub struct ElfImage {
    pub path: PathBuf,
    sparse: Sparse,
    build_id: Option<String>,
    stapsdt: StapsdtNotes,
}

impl std::fmt::Debug for ElfImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ElfImage")
            .field("path", &self.path)
            .field("bytes_read", &self.sparse.total)
            .finish()
    }
}

impl ElfImage {
    /// Opens and reads an ELF file named by a host path dynprof built
    /// itself (`/proc/PID/map_files/…`, a test binary). A FIFO or device is
    /// refused unopened, and the whole read is bounded by
    /// [`rootfs::FILE_DEADLINE`]. Files named by the target go through
    /// [`crate::target::mount`], which opens them inside its root.
    pub fn open(path: &Path) -> Result<Self> {
        let owned = path.to_path_buf();
        Self::read_bounded(path, move || {
            rootfs::open_regular(&owned).with_context(|| format!("opening ELF {}", owned.display()))
        })
    }

    /// Like [`open`](Self::open), with the file opened by `open` (on the
    /// reading thread, so that a stuck open is bounded too).
    pub fn read_bounded(
        path: &Path,
        open: impl FnOnce() -> Result<RegularFile> + Send + 'static,
    ) -> Result<Self> {
        let owned = path.to_path_buf();
        let what = format!("reading ELF {}", path.display());
        rootfs::within(rootfs::FILE_DEADLINE, &what, move || {
            let f = open()?;
            Self::from_file(&owned, f)
        })?
    }

    /// Reads an already opened regular file.
    pub fn from_file(path: &Path, f: RegularFile) -> Result<Self> {
        Self::read(path, &f.file, f.size)
    }

    /// Parses an ELF file held in memory, with the same checks and caps as
    /// a file (for fuzzing and tests).
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Self> {
        Self::read(path, &bytes, bytes.len() as u64)
    }

    fn read(path: &Path, src: &dyn Source, len: u64) -> Result<Self> {
        let mut loader = Loader {
            path,
            src,
            sparse: Sparse {
                len,
                ..Sparse::default()
            },
        };
        let ident = {
            loader.load("ELF identification", 0, 16.min(len), 16)?;
            loader.sparse.chunk(0, 16.min(len)).unwrap_or(&[]).to_vec()
        };
        let result = match (ident.get(..4), ident.get(4)) {
            (Some(b"\x7fELF"), Some(&elf::ELFCLASS64)) => {
                load_parts::<elf::FileHeader64<Endianness>>(&mut loader)
            }
            (Some(b"\x7fELF"), Some(&elf::ELFCLASS32)) => {
                load_parts::<elf::FileHeader32<Endianness>>(&mut loader)
            }
            _ => Err(anyhow!("no ELF magic")),
        };
        let stapsdt =
            result.with_context(|| format!("{} is not a valid ELF object", path.display()))?;
        let mut img = Self {
            path: path.to_path_buf(),
            sparse: loader.sparse,
            build_id: None,
            stapsdt,
        };
        // Everything `file()` and the lookups touch must be there now.
        let build_id = {
            let file = object::File::parse(&img.sparse)
                .map_err(|e| anyhow!("{e}"))
                .with_context(|| format!("{} is not a valid ELF object", path.display()))?;
            file.build_id()
                .ok()
                .flatten()
                .map(|id| id.iter().map(|b| format!("{b:02x}")).collect())
        };
        img.build_id = build_id;
        Ok(img)
    }

    /// The machine the file was built for, when dynprof reads that one.
    pub fn arch(&self) -> Option<Arch> {
        match self.file().architecture() {
            object::Architecture::X86_64 => Some(Arch::X86_64),
            object::Architecture::Aarch64 => Some(Arch::Aarch64),
            _ => None,
        }
    }

    pub fn file(&self) -> object::File<'_, &Sparse> {
        // Parsed once in `read`, from the same bytes, so this cannot fail.
        object::File::parse(&self.sparse).expect("validated in ElfImage::read")
    }

    /// The parts of the file that were read, to rebuild a copy of it that
    /// dynprof owns (see `collect::symbolize`).
    pub fn sparse(&self) -> &Sparse {
        &self.sparse
    }

    /// The sections a native unwinder needs, copied out of the image
    /// (`None` for a file without a readable `.eh_frame`).
    pub fn unwind_sections(&self) -> Option<UnwindSections> {
        let file = self.file();
        let section = |name: &str| {
            let s = file.section_by_name(name)?;
            let data = s.data().ok().filter(|d| !d.is_empty())?;
            Some((address_range(&s)?, SectionData::from(data)))
        };
        let cfi = Cfi::choose(
            section(".eh_frame"),
            section(".eh_frame_hdr"),
            section(".debug_frame").map(|d| d.1),
        )?;
        let text = file
            .section_by_name(".text")
            .and_then(|s| address_range(&s));
        Some(UnwindSections {
            cfi,
            text,
            load_segments: self.load_segments(),
        })
    }

    pub fn build_id(&self) -> Option<String> {
        self.build_id.clone()
    }

    /// `.gnu_debuglink`: the file name of the separate debug file and the
    /// CRC-32 of its content. `None` when there is none, or when the name
    /// is not a plain file name (it comes from the target's file: no `/`,
    /// `.`, `..`, control characters, or more than 255 bytes).
    pub fn debuglink(&self) -> Option<DebugLink> {
        let file = self.file();
        let data = file.section_by_name(".gnu_debuglink")?.data().ok()?;
        parse_debuglink(data, file.is_little_endian())
    }

    /// Does the file have a `.symtab` with symbols (not stripped)?
    pub fn has_symtab(&self) -> bool {
        self.file().symbols().next().is_some()
    }

    /// File offset ranges of the PLT sections (`.plt`, `.plt.sec`,
    /// `.plt.got`, `.iplt`): stubs that no symbol covers, which symbolizers
    /// otherwise name after the symbol before them (`_init`).
    pub fn plt_ranges(&self) -> Vec<std::ops::Range<u64>> {
        self.file()
            .sections()
            .filter(|s| matches!(s.name(), Ok(".plt" | ".plt.sec" | ".plt.got" | ".iplt")))
            .filter_map(|s| {
                let (off, size) = s.file_range()?;
                Some(off..off.checked_add(size)?)
            })
            .collect()
    }

    /// (file offset, file size, virtual address) of each loadable segment.
    pub fn load_segments(&self) -> Vec<(u64, u64, u64)> {
        self.file()
            .segments()
            .map(|seg| {
                let (off, size) = seg.file_range();
                (off, size, seg.address())
            })
            .collect()
    }

    /// `.note.stapsdt`'s bytes and `.stapsdt.base`'s address; `None` when
    /// the object has no such section.
    pub fn stapsdt_notes(&self) -> Result<Option<(&[u8], Option<u64>)>> {
        match &self.stapsdt {
            StapsdtNotes::Absent => Ok(None),
            StapsdtNotes::Read { offset, size, base } => Ok(Some((
                self.sparse.chunk(*offset, *size).unwrap_or(&[]),
                *base,
            ))),
            StapsdtNotes::OverCap { size } => bail!(
                "its .note.stapsdt section is {} MiB, over dynprof's cap of {} MiB: not read",
                size >> 20,
                limits::STAPSDT_NOTES >> 20
            ),
        }
    }

    /// Translates a virtual address to a file offset through the PT_LOAD
    /// segment containing it (what the kernel's uprobe API takes).
    pub fn vaddr_to_offset(&self, vaddr: u64) -> Option<u64> {
        self.file().segments().find_map(|seg| {
            let (start, size) = (seg.address(), seg.size());
            let (file_off, _) = seg.file_range();
            // Checked: the file's program headers may claim any address and
            // size, e.g. a segment that ends past 2^64.
            let delta = vaddr.checked_sub(start).filter(|d| *d < size)?;
            file_off.checked_add(delta)
        })
    }
}

/// A section's virtual address range; `None` when a hostile file's
/// address + size overflows.
fn address_range<'d>(s: &impl ObjectSection<'d>) -> Option<std::ops::Range<u64>> {
    Some(s.address()..s.address().checked_add(s.size())?)
}

#[cfg(test)]
mod tests;
