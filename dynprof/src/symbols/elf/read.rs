//! Reading a target's ELF file: only the parts dynprof uses, each with
//! `pread` at its own offset into a [`Sparse`] image and against a cap
//! ([`super::limits`]), decided from the section headers before anything
//! is read.
use std::{fs::File, os::unix::fs::FileExt as _, path::Path};

use anyhow::{Context as _, Result, anyhow, bail};
use object::{
    Endianness, elf,
    read::{
        ReadRef,
        elf::{FileHeader, SectionHeader as _},
    },
};

use super::{debugdata, limits};

/// The pieces of a file that were read, at their file offsets. Anything
/// else reads as an error, so a parser that strays outside them fails
/// instead of reading what was never checked.
#[derive(Debug, Default)]
pub struct Sparse {
    pub(super) len: u64,
    pub(super) chunks: Vec<(u64, Vec<u8>)>,
    pub(super) total: u64,
    /// Offsets of the chunks read only as unwind tables.
    pub(super) unwind_only: Vec<u64>,
}

/// What [`Loader::load`] calls the unwind tables it reads.
const UNWIND_TABLE: &str = "unwind table";

impl Sparse {
    pub(super) fn chunk(&self, offset: u64, size: u64) -> Option<&[u8]> {
        let (start, bytes) = self.covering(offset, size)?;
        Some(&bytes[(offset - start) as usize..(offset + size - start) as usize])
    }

    /// The chunk that holds `size` bytes at `offset`, with its offset.
    fn covering(&self, offset: u64, size: u64) -> Option<(u64, &[u8])> {
        let end = offset.checked_add(size)?;
        self.chunks.iter().find_map(|(start, bytes)| {
            let cend = start + bytes.len() as u64;
            (offset >= *start && end <= cend).then_some((*start, bytes.as_slice()))
        })
    }

    /// The pieces read, (file offset, bytes), less those read only as
    /// unwind tables: what a symbolization snapshot must hold. The unwind
    /// tables are kept apart ([`ElfImage::unwind_sections`]); copied into
    /// the snapshot as well, libtorch_cpu's 11 MiB would be held twice.
    pub fn symbol_chunks(&self) -> impl Iterator<Item = (u64, &[u8])> {
        self.chunks
            .iter()
            .filter(|(o, _)| !self.unwind_only.contains(o))
            .map(|(o, b)| (*o, b.as_slice()))
    }

    /// The size of the whole file.
    pub fn file_len(&self) -> u64 {
        self.len
    }

    /// Overwrites one byte of what was read (false: not read).
    fn patch(&mut self, offset: u64, byte: u8) -> bool {
        for (start, bytes) in &mut self.chunks {
            if let Some(b) = offset
                .checked_sub(*start)
                .and_then(|i| bytes.get_mut(usize::try_from(i).ok()?))
            {
                *b = byte;
                return true;
            }
        }
        false
    }
}

impl<'a> ReadRef<'a> for &'a Sparse {
    fn len(self) -> Result<u64, ()> {
        Ok(self.len)
    }

    fn read_bytes_at(self, offset: u64, size: u64) -> Result<&'a [u8], ()> {
        if size == 0 {
            return Ok(&[]);
        }
        self.chunk(offset, size).ok_or(())
    }

    fn read_bytes_at_until(
        self,
        range: std::ops::Range<u64>,
        delimiter: u8,
    ) -> Result<&'a [u8], ()> {
        let start = range.start;
        let (cstart, bytes) = self
            .chunks
            .iter()
            .find(|(s, b)| start >= *s && start < s + b.len() as u64)
            .ok_or(())?;
        // The range comes from the file's own headers: it may end before it
        // starts (found by the `elf` fuzz target: this subtraction overflowed).
        let end = range.end.min(cstart + bytes.len() as u64);
        if end < start {
            return Err(());
        }
        let from = (start - cstart) as usize;
        let to = (end - cstart) as usize;
        let tail = bytes.get(from..to).ok_or(())?;
        let n = tail.iter().position(|b| *b == delimiter).ok_or(())?;
        Ok(&tail[..n])
    }
}

/// Where the bytes of an ELF file come from while it is being read.
pub(super) trait Source {
    fn read_at(&self, offset: u64, size: usize) -> std::io::Result<Vec<u8>>;
}

impl Source for File {
    fn read_at(&self, offset: u64, size: usize) -> std::io::Result<Vec<u8>> {
        let mut buf = vec![0u8; size];
        // A short read (the file shrank since fstat) is UnexpectedEof.
        self.read_exact_at(&mut buf, offset)?;
        Ok(buf)
    }
}

impl Source for &[u8] {
    fn read_at(&self, offset: u64, size: usize) -> std::io::Result<Vec<u8>> {
        let start = usize::try_from(offset).map_err(std::io::Error::other)?;
        self.get(start..start.saturating_add(size))
            .map(<[u8]>::to_vec)
            .ok_or_else(|| std::io::ErrorKind::UnexpectedEof.into())
    }
}

pub(super) struct Loader<'s> {
    pub(super) path: &'s Path,
    pub(super) src: &'s dyn Source,
    pub(super) sparse: Sparse,
}

impl Loader<'_> {
    /// Reads `size` bytes at `offset` after checking them against the
    /// file's real size and the caps.
    pub(super) fn load(&mut self, what: &str, offset: u64, size: u64, cap: u64) -> Result<()> {
        if size == 0 {
            return Ok(());
        }
        if let Some((start, _)) = self.sparse.covering(offset, size) {
            // Read already; a hostile file's symbol table may overlay its
            // unwind table, which the snapshot then needs after all.
            if what != UNWIND_TABLE {
                self.sparse.unwind_only.retain(|o| *o != start);
            }
            return Ok(());
        }
        if size > cap {
            bail!(
                "its {what} claims {} bytes, over dynprof's cap of {} MiB",
                size,
                cap >> 20
            );
        }
        let end = offset
            .checked_add(size)
            .filter(|e| *e <= self.sparse.len)
            .ok_or_else(|| {
                anyhow!(
                    "its {what} lies past the end of the file ({size} bytes at offset {offset}, \
                     file size {}): truncated or corrupt",
                    self.sparse.len
                )
            })?;
        if self.sparse.total + size > limits::TOTAL {
            bail!(
                "reading its {what} would take dynprof past {} MiB for one file",
                limits::TOTAL >> 20
            );
        }
        let bytes = self
            .src
            .read_at(offset, size as usize)
            .with_context(|| format!("reading its {what} (bytes {offset}..{end})"))?;
        self.sparse.total += size;
        self.sparse.chunks.push((offset, bytes));
        if what == UNWIND_TABLE {
            self.sparse.unwind_only.push(offset);
        }
        Ok(())
    }
}

/// What [`ElfImage`] keeps about `.note.stapsdt`.
#[derive(Clone, Debug, Default)]
pub(super) enum StapsdtNotes {
    #[default]
    Absent,
    Read {
        offset: u64,
        size: u64,
        /// `.stapsdt.base`'s address, when the section exists.
        base: Option<u64>,
    },
    /// Present, but larger than [`limits::STAPSDT_NOTES`].
    OverCap { size: u64 },
}

/// Reads the parts of an ELF file dynprof uses: headers, section names,
/// symbol and string tables, notes.
pub(super) fn load_parts<Elf: FileHeader<Endian = Endianness>>(
    loader: &mut Loader<'_>,
) -> Result<StapsdtNotes> {
    let hsize = std::mem::size_of::<Elf>() as u64;
    loader.load("ELF header", 0, hsize, hsize)?;
    // A copy, so that the loader can grow while the header is in use.
    let header: Elf = *Elf::parse(&loader.sparse).map_err(|e| anyhow!("{e}"))?;
    let endian = header.endian().map_err(|e| anyhow!("{e}"))?;
    let shoff: u64 = header.e_shoff(endian).into();
    let shentsize = std::mem::size_of::<Elf::SectionHeader>() as u64;
    if shoff != 0 {
        // Section 0 first: it holds the real counts when they overflow the header.
        loader.load(
            "section header table",
            shoff,
            shentsize,
            limits::HEADER_TABLE,
        )?;
    }
    let phoff: u64 = header.e_phoff(endian).into();
    if phoff != 0 {
        let phnum = header
            .phnum(endian, &loader.sparse)
            .map_err(|e| anyhow!("{e}"))? as u64;
        let size = phnum.saturating_mul(u64::from(header.e_phentsize(endian)));
        loader.load("program header table", phoff, size, limits::HEADER_TABLE)?;
    }
    if shoff == 0 {
        return Ok(StapsdtNotes::Absent);
    }
    let shnum = header
        .shnum(endian, &loader.sparse)
        .map_err(|e| anyhow!("{e}"))? as u64;
    if shnum == 0 {
        return Ok(StapsdtNotes::Absent);
    }
    loader.load(
        "section header table",
        shoff,
        shnum.saturating_mul(shentsize),
        limits::HEADER_TABLE,
    )?;
    let strndx = header
        .shstrndx(endian, &loader.sparse)
        .map_err(|e| anyhow!("{e}"))? as usize;
    let names_range = header
        .section_headers(endian, &loader.sparse)
        .map_err(|e| anyhow!("{e}"))?
        .get(strndx)
        .and_then(|h| h.file_range(endian));
    if let Some((off, size)) = names_range {
        loader.load("section name table", off, size, limits::SECTION_NAMES)?;
    }
    let headers = header
        .section_headers(endian, &loader.sparse)
        .map_err(|e| anyhow!("{e}"))?;
    let file_range = |i: usize| headers.get(i).and_then(|h| h.file_range(endian));
    // Decide everything from the headers first, then read.
    let mut wanted: Vec<(&'static str, u64, u64, u64)> = Vec::new();
    let mut stapsdt = StapsdtNotes::Absent;
    let mut stapsdt_base = None;
    let mut debugdata = None;
    let sections = header
        .sections(endian, &loader.sparse)
        .map_err(|e| anyhow!("{e}"))?;
    let readable_table = |h: &Elf::SectionHeader| {
        let compressed = h.sh_flags(endian).into() & u64::from(elf::SHF_COMPRESSED) != 0;
        h.file_range(endian)
            .filter(|&(_, size)| size <= limits::EH_FRAME && !compressed)
    };
    // `Cfi::choose` keeps the larger table, so a `.debug_frame` no larger
    // than a readable `.eh_frame` would be read for nothing.
    let eh_frame_size = headers
        .iter()
        .filter(|h| sections.section_name(endian, *h).unwrap_or(&[]) == b".eh_frame")
        .find_map(|h| readable_table(h).map(|r| r.1));
    for h in headers {
        let name = sections.section_name(endian, h).unwrap_or(&[]);
        let Some((off, size)) = h.file_range(endian) else {
            if name == b".stapsdt.base" {
                stapsdt_base = Some(h.sh_addr(endian).into());
            }
            continue;
        };
        // `.debug_frame` too: code built with -fno-unwind-tables
        // -fno-asynchronous-unwind-tables and -g has its tables only there
        // (`unwind_sections` picks). Not when compressed: dynprof reads no
        // compressed sections.
        let table = name == b".eh_frame"
            || name == b".eh_frame_hdr"
            || (name == b".debug_frame" && eh_frame_size.is_none_or(|e| size > e));
        if table && readable_table(h).is_some() {
            wanted.push((UNWIND_TABLE, off, size, limits::EH_FRAME));
        }
        if name == b".gnu_debuglink" && size <= limits::DEBUGLINK {
            wanted.push((".gnu_debuglink section", off, size, limits::DEBUGLINK));
        }
        if name == b".gnu_debugdata" {
            debugdata = Some((
                off,
                size,
                names_range.map(|r| r.0 + u64::from(h.sh_name(endian))),
            ));
        }
        match h.sh_type(endian) {
            elf::SHT_SYMTAB | elf::SHT_DYNSYM => {
                wanted.push(("symbol table", off, size, limits::SYMBOL_TABLE));
                if let Some((soff, ssize)) = file_range(h.sh_link(endian) as usize) {
                    wanted.push(("string table", soff, ssize, limits::STRING_TABLE));
                }
            }
            elf::SHT_SYMTAB_SHNDX => wanted.push((
                "extended section index table",
                off,
                size,
                limits::SYMBOL_TABLE,
            )),
            elf::SHT_NOTE if name == b".note.stapsdt" => {
                if size > limits::STAPSDT_NOTES {
                    stapsdt = StapsdtNotes::OverCap { size };
                } else {
                    wanted.push((".note.stapsdt section", off, size, limits::STAPSDT_NOTES));
                    stapsdt = StapsdtNotes::Read {
                        offset: off,
                        size,
                        base: None,
                    };
                }
            }
            // Build id, ABI tag; bigger ones are not read (and not needed).
            elf::SHT_NOTE if size <= limits::OTHER_NOTES => {
                wanted.push(("note section", off, size, limits::OTHER_NOTES))
            }
            _ => {}
        }
        if name == b".stapsdt.base" {
            stapsdt_base = Some(h.sh_addr(endian).into());
        }
    }
    for (what, off, size, cap) in wanted {
        loader.load(what, off, size, cap)?;
    }
    if let Some((off, size, name_at)) = debugdata {
        // MiniDebugInfo: blazesym reads the symbols in it when `.symtab`
        // is gone. One that cannot be read or is too big is hidden from
        // blazesym (its name changed in the copy), which then names what
        // `.dynsym` can; otherwise its error would lose those too.
        let checked = loader
            .load(".gnu_debugdata section", off, size, limits::DEBUGDATA)
            .and_then(|()| {
                let data = loader.sparse.chunk(off, size).unwrap_or_default();
                debugdata::fits(data, limits::DEBUGDATA_OUT)
            });
        if let Err(e) = checked {
            log::warn!(
                "{}: ignoring its MiniDebugInfo (.gnu_debugdata): {e:#}",
                loader.path.display()
            );
            if !name_at.is_some_and(|at| loader.sparse.patch(at, b'X')) {
                bail!("its .gnu_debugdata section cannot be read or hidden: {e:#}");
            }
        }
    }
    if let StapsdtNotes::Read { base, .. } = &mut stapsdt {
        *base = stapsdt_base;
    }
    Ok(stapsdt)
}
