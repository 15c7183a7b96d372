//! `/tmp/perf-PID.map`: the names a JIT runtime publishes for the code it
//! generates (perf's convention, one `START SIZE NAME` line per symbol, hex
//! without `0x`). oneDNN writes it with `ONEDNN_JIT_PROFILE=1` (older:
//! `DNNL_JIT_PROFILE`), CPython 3.12+ with `-X perf`, the JVM and V8 with
//! their perf-map agents. Without it, such code is `[jit]`.
//!
//! The file is the target's: every line is checked, names are cut to
//! [`MAX_NAME`] characters and made safe for folded stacks (no `;`, no
//! control characters), and at most [`MAX_ENTRIES`] entries are kept.

/// Longest name kept, in characters.
pub const MAX_NAME: usize = 256;
/// Most entries kept from one file.
pub const MAX_ENTRIES: usize = 1 << 20;
/// Most bytes read from one file.
pub const MAX_BYTES: usize = 64 << 20;

/// A parsed perf map: address ranges with names, sorted by start.
#[derive(Debug, Default, Clone)]
pub struct PerfMap {
    entries: Vec<(u64, u64, String)>,
}

impl PerfMap {
    /// Parses the file's text; bad lines are skipped. A runtime that
    /// recompiles appends a new line for the same address: the last one wins.
    pub fn parse(text: &[u8]) -> Self {
        let mut entries: Vec<(u64, u64, String)> = Vec::new();
        for line in text.split(|b| *b == b'\n') {
            if entries.len() >= MAX_ENTRIES {
                break;
            }
            let line = String::from_utf8_lossy(line);
            let mut it = line.trim_end_matches('\r').splitn(3, ' ');
            let (Some(start), Some(size), Some(name)) = (it.next(), it.next(), it.next()) else {
                continue;
            };
            let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
            let (Some(start), Some(size)) = (hex(start), hex(size)) else {
                continue;
            };
            let Some(end) = start.checked_add(size).filter(|_| size > 0) else {
                continue;
            };
            let name = sanitize(name);
            if name.is_empty() {
                continue;
            }
            entries.push((start, end, name));
        }
        // Stable: of equal starts, the later line stays last; keep it.
        entries.sort_by_key(|e| e.0);
        let mut out: Vec<(u64, u64, String)> = Vec::with_capacity(entries.len());
        for e in entries {
            match out.last_mut() {
                Some(last) if last.0 == e.0 => *last = e,
                _ => out.push(e),
            }
        }
        Self { entries: out }
    }

    /// The name of the symbol holding `addr`.
    pub fn lookup(&self, addr: u64) -> Option<&str> {
        let i = self.entries.partition_point(|e| e.0 <= addr);
        let (_, end, name) = self.entries.get(i.checked_sub(1)?)?;
        (addr < *end).then_some(name.as_str())
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// A name safe to put in a folded stack and a report: `;` separates frames
/// there and a newline ends the stack.
fn sanitize(name: &str) -> String {
    name.trim()
        .chars()
        .take(MAX_NAME)
        .map(|c| if c == ';' || c.is_control() { '_' } else { c })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_name_their_ranges() {
        let m = PerfMap::parse(
            b"7f0000001000 40 jit_avx2_conv_fwd_kernel\n7f0000002000 0x10 py::train_step:/t.py\n",
        );
        assert_eq!(m.len(), 2);
        assert_eq!(m.lookup(0x7f00_0000_1000), Some("jit_avx2_conv_fwd_kernel"));
        assert_eq!(m.lookup(0x7f00_0000_103f), Some("jit_avx2_conv_fwd_kernel"));
        assert_eq!(m.lookup(0x7f00_0000_1040), None);
        assert_eq!(m.lookup(0x7f00_0000_2008), Some("py::train_step:/t.py"));
        assert_eq!(m.lookup(0x10), None);
    }

    #[test]
    fn hostile_lines_are_skipped_or_defused() {
        let long = "x".repeat(10_000);
        let text = format!(
            "zz 10 bad_hex\nffffffffffffffff 10 wraps\n1000 0 empty\n1000\n\
             2000 10 a;b\u{7}c\n3000 10 {long}\n4000 10   \n"
        );
        let m = PerfMap::parse(text.as_bytes());
        assert_eq!(m.len(), 2, "{m:?}");
        assert_eq!(m.lookup(0x2000), Some("a_b_c"));
        assert_eq!(m.lookup(0x3000).unwrap().chars().count(), MAX_NAME);
    }

    #[test]
    fn a_recompiled_address_takes_the_last_name() {
        let m = PerfMap::parse(b"1000 10 old\n1000 20 new\n");
        assert_eq!(m.len(), 1);
        assert_eq!(m.lookup(0x1018), Some("new"));
    }
}
