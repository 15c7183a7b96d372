//! Reading a target's memory through `/proc/PID/mem`, for CPython code
//! objects (`symbols::python`). Reads only: bounded, and a failed read (the
//! object was freed, the process exited) is an error, never a crash.
use std::{fs::File, io, os::unix::fs::FileExt as _};

pub struct ProcMem {
    file: File,
}

impl ProcMem {
    pub fn open(host_pid: u32) -> io::Result<Self> {
        Ok(Self {
            file: File::open(format!("/proc/{host_pid}/mem"))?,
        })
    }

    /// Exactly `len` bytes at `addr` (at most 1 MiB).
    pub fn read(&self, addr: u64, len: usize) -> io::Result<Vec<u8>> {
        if len > 1 << 20 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "read over 1 MiB",
            ));
        }
        let mut buf = vec![0u8; len];
        self.file.read_exact_at(&mut buf, addr)?;
        Ok(buf)
    }

    pub fn u64(&self, addr: u64) -> io::Result<u64> {
        let b = self.read(addr, 8)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }
}
