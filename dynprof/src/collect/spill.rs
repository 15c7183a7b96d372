//! Bounded event buffers: what keeps dynprof's memory flat in dense windows.
//!
//! A collector sees every event of its window before the window closes
//! (off-CPU intervals of a thread ping-pong arrive by the hundred thousand
//! per second). Instead of growing a `Vec` in memory for the whole window,
//! each collector appends fixed-size [`Record`]s to an [`EventBuf`]: a small
//! in-memory chunk that is spilled to an unnamed temporary file (O_TMPFILE,
//! no name on disk, gone when dynprof exits however it exits) each time it
//! fills up. RSS does not grow with the window's events; the page cache
//! holds the spilled records.
//!
//! What is kept is bounded too: the [`MemoryBudget`] (`--memory-budget`)
//! sets how many events one window may keep in total ([`EventPool`], shared
//! by the window's collectors), sized so that turning them into output
//! (symbolized spans, the trace slices, the folded stacks) fits the budget.
//! Past the cap, events are counted and dropped, and the window says so
//! (`meta.json` `memory.dropped_over_budget`, `summary.json`, `report`)
//! rather than taking the host's memory.
use std::{
    cell::Cell,
    fs::File,
    io::{BufReader, Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
    rc::Rc,
    str::FromStr,
};

use anyhow::{Result, bail};
use dynprof_common::{ApiEvent, EventHeader, OffCpuEvent, SampleEvent};

/// `--memory-budget` default.
pub const DEFAULT_BUDGET: u64 = 256 << 20;
/// Smallest budget accepted: dynprof itself (code, eBPF maps' user side,
/// symbolizer caches) needs about [`RESERVED`] before any window data.
pub const MIN_BUDGET: u64 = 64 << 20;
/// Largest budget accepted (a typo guard: 1 TiB).
pub const MAX_BUDGET: u64 = 1 << 40;
/// Part of the budget that is dynprof's own, not window data: its peak RSS
/// with an empty window (measured: ~30 MiB for a debug build on an
/// off-CPU window, see docs/reliability.md), with margin.
pub const RESERVED: u64 = 40 << 20;
/// Peak bytes one kept event costs from the ring to the written files: the
/// raw record read back from the spill file, its symbolized span (shared
/// stack), its trace slice for nesting, and allocator slack. Measured
/// ~110 B on the off-CPU ping-pong window (docs/reliability.md); rounded up.
pub const EVENT_COST: u64 = 256;
/// Records an [`EventBuf`] keeps in memory before spilling them.
pub const CHUNK_BYTES: usize = 256 << 10;

/// dynprof's memory budget for window data (`--memory-budget`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryBudget {
    bytes: u64,
}

impl Default for MemoryBudget {
    fn default() -> Self {
        Self {
            bytes: DEFAULT_BUDGET,
        }
    }
}

impl MemoryBudget {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Events one window may keep, over all its collectors.
    pub fn events_cap(&self) -> u64 {
        (self.bytes.saturating_sub(RESERVED) / EVENT_COST).max(1)
    }

    /// A budget of `bytes`, validated against the accepted range.
    pub fn from_bytes(bytes: u64) -> Result<Self> {
        if !(MIN_BUDGET..=MAX_BUDGET).contains(&bytes) {
            bail!(
                "--memory-budget must be between {} and {} (got {})",
                human(MIN_BUDGET),
                human(MAX_BUDGET),
                human(bytes)
            );
        }
        Ok(Self { bytes })
    }
}

/// `256MiB`, `1.5GiB`, `300M`, `65536K`, `268435456`: a number (decimal
/// allowed) and an optional binary unit (K/KiB/KB, M/MiB/MB, G/GiB/GB,
/// T/TiB/TB are all powers of 1024; no unit = bytes).
impl FromStr for MemoryBudget {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim();
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let shift = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 0,
            "k" | "kb" | "kib" => 10,
            "m" | "mb" | "mib" => 20,
            "g" | "gb" | "gib" => 30,
            "t" | "tb" | "tib" => 40,
            _ => bail!(
                "--memory-budget: unknown unit in {s:?} (use a number with K, M, G or T, e.g. 256MiB)"
            ),
        };
        let value: f64 = match num.parse() {
            Ok(v) => v,
            Err(_) => bail!("--memory-budget: {s:?} is not a size (e.g. 256MiB, 1GiB)"),
        };
        let bytes = value * (1u64 << shift) as f64;
        // `num` holds digits and dots only, so inf/nan cannot be spelled, but
        // a long digit string still overflows u64.
        if !bytes.is_finite() || bytes >= MAX_BUDGET as f64 * 2.0 {
            bail!(
                "--memory-budget: {s:?} is out of range (at most {})",
                human(MAX_BUDGET)
            );
        }
        Self::from_bytes(bytes as u64)
    }
}

fn human(b: u64) -> String {
    match b {
        b if b >= 1 << 40 && b % (1 << 40) == 0 => format!("{} TiB", b >> 40),
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b => format!("{b} bytes"),
    }
}

/// The count of events a window keeps, shared by its collectors (one cap
/// for the window, whichever collector is dense).
#[derive(Clone, Debug)]
pub struct EventPool {
    used: Rc<Cell<u64>>,
    budget: MemoryBudget,
}

impl EventPool {
    pub fn new(budget: MemoryBudget) -> Self {
        Self {
            used: Rc::new(Cell::new(0)),
            budget,
        }
    }
    pub fn budget(&self) -> MemoryBudget {
        self.budget
    }
    fn try_take(&self) -> bool {
        let u = self.used.get();
        if u >= self.budget.events_cap() {
            return false;
        }
        self.used.set(u + 1);
        true
    }
    fn give_back(&self, n: u64) {
        self.used.set(self.used.get().saturating_sub(n));
    }
}

/// An event with a fixed-size, explicit little-endian encoding (no
/// transmute: the spill file is plain bytes).
pub trait Record: Copy {
    const SIZE: usize;
    fn encode(&self, out: &mut Vec<u8>);
    fn decode(b: &[u8]) -> Self;
    fn ts_ns(&self) -> u64;
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"))
}
fn hdr_encode(h: &EventHeader, out: &mut Vec<u8>) {
    out.extend_from_slice(&h.kind.to_le_bytes());
    out.extend_from_slice(&h.tid.to_le_bytes());
    out.extend_from_slice(&h.ts_ns.to_le_bytes());
}
fn hdr_decode(b: &[u8]) -> EventHeader {
    EventHeader {
        kind: u32_at(b, 0),
        tid: u32_at(b, 4),
        ts_ns: u64_at(b, 8),
    }
}

impl Record for OffCpuEvent {
    const SIZE: usize = 36;
    fn encode(&self, out: &mut Vec<u8>) {
        hdr_encode(&self.hdr, out);
        out.extend_from_slice(&self.dur_ns.to_le_bytes());
        out.extend_from_slice(&self.user_stack.to_le_bytes());
        out.extend_from_slice(&self.kernel_stack.to_le_bytes());
        out.extend_from_slice(&self.runnable.to_le_bytes());
    }
    fn decode(b: &[u8]) -> Self {
        Self {
            hdr: hdr_decode(b),
            dur_ns: u64_at(b, 16),
            user_stack: u32_at(b, 24) as i32,
            kernel_stack: u32_at(b, 28) as i32,
            runnable: u32_at(b, 32),
            _pad: 0,
        }
    }
    fn ts_ns(&self) -> u64 {
        self.hdr.ts_ns
    }
}

impl Record for SampleEvent {
    const SIZE: usize = 32;
    fn encode(&self, out: &mut Vec<u8>) {
        hdr_encode(&self.hdr, out);
        out.extend_from_slice(&self.user_stack.to_le_bytes());
        out.extend_from_slice(&self.kernel_stack.to_le_bytes());
        out.extend_from_slice(&self.cpu.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
    }
    fn decode(b: &[u8]) -> Self {
        Self {
            hdr: hdr_decode(b),
            user_stack: u32_at(b, 16) as i32,
            kernel_stack: u32_at(b, 20) as i32,
            cpu: u32_at(b, 24),
            _pad: 0,
        }
    }
    fn ts_ns(&self) -> u64 {
        self.hdr.ts_ns
    }
}

impl Record for ApiEvent {
    const SIZE: usize = 40;
    fn encode(&self, out: &mut Vec<u8>) {
        hdr_encode(&self.hdr, out);
        out.extend_from_slice(&self.api.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&self.dur_ns.to_le_bytes());
        out.extend_from_slice(&self.ret.to_le_bytes());
    }
    fn decode(b: &[u8]) -> Self {
        Self {
            hdr: hdr_decode(b),
            api: u32_at(b, 16),
            _pad: 0,
            dur_ns: u64_at(b, 24),
            ret: u64_at(b, 32) as i64,
        }
    }
    fn ts_ns(&self) -> u64 {
        self.hdr.ts_ns
    }
}

/// What [`EventBuf::take_window`] hands over.
pub struct Taken<T> {
    /// The events of `[start, end)`, in arrival order.
    pub events: Vec<T>,
    /// Events refused since the last take because the window's pool was
    /// full (or the spill file could not be written).
    pub over_budget: u64,
}

/// A collector's events while armed: a bounded chunk in memory, the rest in
/// an unnamed temporary file.
pub struct EventBuf<T: Record> {
    pool: EventPool,
    mem: Vec<T>,
    chunk: usize,
    file: Option<File>,
    /// Records in `file`.
    spilled: u64,
    /// Where the spill file goes (the window's directory once it is open).
    spill_dir: Option<PathBuf>,
    over_budget: u64,
    spill_failed: bool,
    scratch: Vec<u8>,
}

impl<T: Record> EventBuf<T> {
    pub fn new(pool: EventPool) -> Self {
        Self {
            pool,
            mem: Vec::new(),
            chunk: (CHUNK_BYTES / T::SIZE).max(1),
            file: None,
            spilled: 0,
            spill_dir: None,
            over_budget: 0,
            spill_failed: false,
            scratch: Vec::new(),
        }
    }

    pub fn pool(&self) -> &EventPool {
        &self.pool
    }

    /// Spill into `dir` from now on (the file is unnamed: nothing appears
    /// there). A file already open stays where it is.
    pub fn set_spill_dir(&mut self, dir: &Path) {
        self.spill_dir = Some(dir.to_path_buf());
    }

    pub fn is_empty(&self) -> bool {
        self.mem.is_empty() && self.spilled == 0
    }

    /// Keeps `e`, unless the window already holds as many events as its
    /// budget allows: then it is counted as dropped.
    pub fn push(&mut self, e: T) {
        if self.spill_failed || !self.pool.try_take() {
            self.over_budget += 1;
            return;
        }
        self.mem.push(e);
        if self.mem.len() >= self.chunk
            && let Err(err) = self.spill()
        {
            // Bounded memory wins over completeness: what is in memory is
            // kept, what comes next is counted as dropped.
            log::warn!(
                "spilling window events to disk failed ({err:#}); further events of this window are dropped and counted"
            );
            self.spill_failed = true;
        }
    }

    fn spill(&mut self) -> Result<()> {
        if self.file.is_none() {
            let dir = self.spill_dir.clone().unwrap_or_else(std::env::temp_dir);
            self.file = Some(crate::sys::memory::unnamed_temp_file(&dir)?);
        }
        let f = self.file.as_mut().expect("just opened");
        self.scratch.clear();
        for e in &self.mem {
            e.encode(&mut self.scratch);
        }
        f.write_all(&self.scratch)?;
        self.spilled += self.mem.len() as u64;
        self.mem.clear();
        // Keeps the chunk's capacity for the next one, not more.
        self.scratch.clear();
        self.scratch.shrink_to(CHUNK_BYTES);
        Ok(())
    }

    /// Moves the events of `[start, end)` out (by timestamp), drops older
    /// ones (warmup, or calls that began before the window) and keeps newer
    /// ones for the next window. The spill file is read back sequentially
    /// and emptied.
    pub fn take_window(&mut self, start: u64, end: u64) -> Result<Taken<T>> {
        let mut inside = Vec::new();
        let mut later = Vec::new();
        let mut removed = 0u64;
        let mut sort = |e: T| {
            let t = e.ts_ns();
            if t >= end {
                later.push(e);
            } else {
                removed += 1;
                if t >= start {
                    inside.push(e);
                }
            }
        };
        let mut read_err = None;
        if let Some(f) = self.file.as_mut() {
            let r = (|| -> Result<()> {
                f.seek(SeekFrom::Start(0))?;
                let mut rd = BufReader::with_capacity(CHUNK_BYTES, &mut *f);
                let mut b = vec![0u8; T::SIZE];
                for _ in 0..self.spilled {
                    rd.read_exact(&mut b)?;
                    sort(T::decode(&b));
                }
                Ok(())
            })();
            if let Err(e) = r {
                read_err = Some(e);
            }
            // Emptied for the next window (the file is reused, unnamed).
            let _ = f.set_len(0).and_then(|_| f.seek(SeekFrom::Start(0)));
        }
        for e in self.mem.drain(..) {
            sort(e);
        }
        let spilled = std::mem::take(&mut self.spilled);
        if read_err.is_some() {
            // Records never read back are lost; count them with the rest.
            removed = removed.max(spilled);
        }
        self.pool.give_back(removed);
        self.mem = later;
        self.mem.shrink_to(self.chunk);
        self.spill_failed = false;
        let taken = Taken {
            events: inside,
            over_budget: std::mem::take(&mut self.over_budget),
        };
        match read_err {
            Some(e) => Err(e.context(format!(
                "reading {} spilled events back ({} kept)",
                spilled,
                taken.events.len()
            ))),
            None => Ok(taken),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(ts: u64, tid: u32) -> OffCpuEvent {
        OffCpuEvent {
            hdr: EventHeader {
                kind: dynprof_common::kind::OFFCPU,
                tid,
                ts_ns: ts,
            },
            dur_ns: ts * 3,
            user_stack: -14,
            kernel_stack: tid as i32,
            runnable: tid & 1,
            _pad: 0,
        }
    }

    #[test]
    fn budgets_parse_and_refuse_nonsense() {
        let b = |s: &str| s.parse::<MemoryBudget>().map(|b| b.bytes());
        assert_eq!(b("256MiB").unwrap(), 256 << 20);
        assert_eq!(b("256M").unwrap(), 256 << 20);
        assert_eq!(b(" 1.5GiB ").unwrap(), 3 << 29);
        assert_eq!(b("65536k").unwrap(), 64 << 20);
        assert_eq!(b("268435456").unwrap(), 256 << 20);
        assert_eq!(MemoryBudget::default().bytes(), 256 << 20);
        for bad in [
            "",
            "inf",
            "nan",
            "-1",
            "-256MiB",
            "1e300",
            "256XB",
            "1.2.3M",
            "0",
            "1MiB",
            "2TiB",
            "99999999999999999999999999G",
        ] {
            let e = b(bad).unwrap_err().to_string();
            assert!(e.contains("--memory-budget"), "{bad:?}: {e}");
        }
        assert!(
            b("1MiB")
                .unwrap_err()
                .to_string()
                .contains("between 64 MiB and 1 TiB")
        );
        // 256 MiB keeps ~885k events per window.
        assert_eq!(
            MemoryBudget::default().events_cap(),
            ((256 << 20) - RESERVED) / EVENT_COST
        );
    }

    #[test]
    fn records_round_trip() {
        let o = ev(123_456_789_012, 77);
        let mut v = Vec::new();
        o.encode(&mut v);
        assert_eq!(v.len(), OffCpuEvent::SIZE);
        let back = OffCpuEvent::decode(&v);
        assert_eq!(
            (
                back.hdr.ts_ns,
                back.hdr.tid,
                back.dur_ns,
                back.user_stack,
                back.kernel_stack,
                back.runnable
            ),
            (123_456_789_012, 77, 370_370_367_036, -14, 77, 1)
        );
        let s = SampleEvent {
            hdr: o.hdr,
            user_stack: 5,
            kernel_stack: -17,
            cpu: 1,
            _pad: 0,
        };
        v.clear();
        s.encode(&mut v);
        let back = SampleEvent::decode(&v);
        assert_eq!((back.user_stack, back.kernel_stack, back.cpu), (5, -17, 1));
        let a = ApiEvent {
            hdr: o.hdr,
            api: 9,
            _pad: 0,
            dur_ns: 10,
            ret: -3,
        };
        v.clear();
        a.encode(&mut v);
        assert_eq!(v.len(), ApiEvent::SIZE);
        let back = ApiEvent::decode(&v);
        assert_eq!((back.api, back.dur_ns, back.ret), (9, 10, -3));
    }

    /// Events past the in-memory chunk go to the file and come back in
    /// order; the window split keeps later events for the next window; the
    /// pool's cap is shared and counts what it refused.
    #[test]
    fn spills_splits_and_caps() {
        let dir = crate::output::tests_support::tempdir("spill");
        let budget = MemoryBudget::from_bytes(MIN_BUDGET).unwrap();
        let pool = EventPool::new(budget);
        let mut a: EventBuf<OffCpuEvent> = EventBuf::new(pool.clone());
        a.set_spill_dir(&dir);
        let n = a.chunk as u64 * 3 + 5;
        for i in 0..n {
            a.push(ev(i, 1));
        }
        assert_eq!(a.spilled, a.chunk as u64 * 3);
        assert_eq!(a.mem.len(), 5);
        // Unnamed: nothing visible in the directory.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        let t = a.take_window(10, n - 2).unwrap();
        assert_eq!(t.over_budget, 0);
        let ts: Vec<u64> = t.events.iter().map(|e| e.hdr.ts_ns).collect();
        assert_eq!(ts, (10..n - 2).collect::<Vec<_>>());
        assert_eq!(t.events[7].dur_ns, 17 * 3);
        // The two later events stay, and still count against the pool.
        assert_eq!(a.mem.len(), 2);
        assert_eq!(a.spilled, 0);
        assert_eq!(pool.used.get(), 2);

        // The cap is shared with another collector's buffer.
        let cap = budget.events_cap();
        let mut b: EventBuf<OffCpuEvent> = EventBuf::new(pool.clone());
        b.set_spill_dir(&dir);
        for i in 0..cap + 100 {
            b.push(ev(n + i, 2));
        }
        let tb = b.take_window(0, u64::MAX).unwrap();
        assert_eq!(tb.events.len() as u64, cap - 2);
        assert_eq!(tb.over_budget, 102);
        let ta = a.take_window(0, u64::MAX).unwrap();
        assert_eq!(ta.events.len(), 2);
        assert_eq!(pool.used.get(), 0);
        // The next window starts with a clean count.
        b.push(ev(1, 2));
        assert_eq!(b.take_window(0, 10).unwrap().over_budget, 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
