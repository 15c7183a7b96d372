//! MiniDebugInfo (`.gnu_debugdata`): checked before blazesym expands it.
use anyhow::{Context as _, Result, bail};

/// Does the xz stream `data` decompress, to at most `cap` bytes
/// ([`limits::DEBUGDATA_OUT`])? The output is counted, not kept.
pub(super) fn fits(data: &[u8], cap: u64) -> Result<u64> {
    use std::io::Read as _;
    let mut dec = xz2::read::XzDecoder::new(data).take(cap + 1);
    let n = std::io::copy(&mut dec, &mut std::io::sink()).context("not a valid xz stream")?;
    if n > cap {
        bail!("it decompresses to over dynprof's cap of {} MiB", cap >> 20);
    }
    Ok(n)
}
