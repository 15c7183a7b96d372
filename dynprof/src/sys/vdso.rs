//! dynprof's own vDSO image, to name and unwind a target's frames in its
//! `[vdso]` mapping, which has no file behind it.
//!
//! The kernel builds the vDSO image in and maps that same image into every
//! native process (the 32-bit compat one differs), so the bytes dynprof
//! finds at its own `AT_SYSINFO_EHDR` are the target's: trusted input,
//! from the kernel, unlike anything read from the target. Callers check
//! that the target's mapping has the same size before using it.
use std::sync::OnceLock;

/// A vDSO larger than this is not read (x86-64 and arm64 map 8 KiB).
const MAX_BYTES: usize = 1 << 20;

/// The bytes of dynprof's own vDSO, read once; `None` when the process has
/// none (`vdso=0` on the kernel command line) or it could not be read.
pub fn own_image() -> Option<&'static [u8]> {
    static IMAGE: OnceLock<Option<Vec<u8>>> = OnceLock::new();
    IMAGE
        .get_or_init(|| match read_own() {
            Ok(b) => b,
            Err(e) => {
                log::debug!("vdso: {e}");
                None
            }
        })
        .as_deref()
}

fn read_own() -> std::io::Result<Option<Vec<u8>>> {
    // SAFETY: getauxval reads the auxiliary vector the kernel gave this
    // process; it has no preconditions.
    let base = unsafe { libc::getauxval(libc::AT_SYSINFO_EHDR) };
    if base == 0 {
        return Ok(None);
    }
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    let Some(len) = mapping_len(&maps, base) else {
        return Ok(None);
    };
    if len > MAX_BYTES {
        return Ok(None);
    }
    let mem = super::procmem::ProcMem::open(std::process::id())?;
    mem.read(base, len).map(Some)
}

/// The length of the `[vdso]` mapping that starts at `base`, from a maps
/// file's text.
fn mapping_len(maps: &str, base: u64) -> Option<usize> {
    maps.lines().find_map(|line| {
        if line.split_ascii_whitespace().nth(5) != Some("[vdso]") {
            return None;
        }
        let (s, e) = line.split_ascii_whitespace().next()?.split_once('-')?;
        let (s, e) = (
            u64::from_str_radix(s, 16).ok()?,
            u64::from_str_radix(e, 16).ok()?,
        );
        (s == base && e > s).then(|| usize::try_from(e - s).ok())?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_vdso_line_at_its_base() {
        let maps = "\
7f0000000000-7f0000002000 r--p 00000000 00:00 0                          [vvar]
7f0000002000-7f0000004000 r-xp 00000000 00:00 0                          [vdso]
7f0000010000-7f0000011000 r-xp 00000000 08:01 42                         /tmp/[vdso]
";
        assert_eq!(mapping_len(maps, 0x7f0000002000), Some(0x2000));
        assert_eq!(mapping_len(maps, 0x7f0000000000), None);
        assert_eq!(mapping_len(maps, 0x7f0000010000), None);
    }

    #[test]
    fn own_image_is_an_elf_object() {
        let img = own_image().expect("this test process has a vDSO");
        assert_eq!(&img[..4], b"\x7fELF");
    }
}
