//! A snapshot of `/proc/kallsyms` taken while dynprof still holds its
//! start-up capabilities, for naming kernel frames later.
//!
//! The kernel shows kallsyms addresses only to an opener with CAP_SYSLOG
//! (or with `perf_event_paranoid` ≤ 1): everyone else reads zeros. The
//! check is made at open, with the opener's credentials, and dynprof gives
//! CAP_SYSLOG up after attach, while the symbolizer opens the file by path
//! when it first meets a kernel stack. So the text is copied once, before
//! the drop, into an anonymous memory file that the symbolizer then opens
//! as `/proc/self/fd/N`. Keeping CAP_SYSLOG for the session instead would
//! also let dynprof read the kernel log, which nothing else needs.
use std::{
    io::{Read, Seek, Write},
    os::fd::{AsRawFd, OwnedFd},
    path::PathBuf,
    sync::OnceLock,
};

use rustix::fs::{MemfdFlags, memfd_create};

static SNAPSHOT: OnceLock<Option<OwnedFd>> = OnceLock::new();

/// Kernel text above this is not kallsyms (~5-15 MiB on distribution
/// kernels with modules); the copy stops there and is not used.
const MAX_BYTES: u64 = 256 << 20;

/// Takes the snapshot (once) if the addresses are visible now, and returns
/// its path for the symbolizer (`/proc/self/fd/N`). Called before the
/// capabilities are dropped (and by each symbolizer, which may come
/// first). Failures only log: kernel frames are then `[unknown]`.
pub fn snapshot() -> Option<PathBuf> {
    let fd = SNAPSHOT.get_or_init(|| match copy() {
        Ok(fd) => fd,
        Err(e) => {
            log::info!("kernel frames will not be named: /proc/kallsyms: {e:#}");
            None
        }
    });
    let fd = fd.as_ref()?;
    Some(PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd())))
}

fn copy() -> anyhow::Result<Option<OwnedFd>> {
    let mut src = std::fs::File::open("/proc/kallsyms")?.take(MAX_BYTES + 1);
    let mut text = Vec::new();
    src.read_to_end(&mut text)?;
    if text.len() as u64 > MAX_BYTES {
        anyhow::bail!("larger than {MAX_BYTES} bytes");
    }
    if !addresses_visible(&text) {
        log::info!(
            "kernel frames will not be named: /proc/kallsyms shows no addresses to dynprof \
             (it needs CAP_SYSLOG at start, or kernel.perf_event_paranoid <= 1)"
        );
        return Ok(None);
    }
    let fd = memfd_create("dynprof-kallsyms", MemfdFlags::CLOEXEC)?;
    let mut f = std::fs::File::from(fd);
    f.write_all(&text)?;
    f.rewind()?;
    log::debug!("/proc/kallsyms copied ({} bytes)", text.len());
    Ok(Some(f.into()))
}

/// Does the text show real addresses (not the zeros of a restricted read)?
fn addresses_visible(text: &[u8]) -> bool {
    text.split(|b| *b == b'\n')
        .take(64)
        .filter_map(|l| l.split(|b| *b == b' ').next())
        .any(|a| !a.is_empty() && a.iter().any(|b| *b != b'0'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restricted_read_shows_no_addresses() {
        let zeros = b"0000000000000000 T _stext\n0000000000000000 t foo [mod]\n";
        assert!(!addresses_visible(zeros));
        let real = b"ffffffff81000000 T _stext\nffffffff81000010 T foo\n";
        assert!(addresses_visible(real));
        assert!(!addresses_visible(b""));
    }
}
