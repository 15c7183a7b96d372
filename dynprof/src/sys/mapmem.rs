//! A BPF array map's values mapped into dynprof (`BPF_F_MMAPABLE`, Linux
//! 5.5): words the eBPF programs and dynprof share without a syscall.
use std::{
    io,
    os::fd::BorrowedFd,
    ptr::NonNull,
    sync::atomic::{AtomicU64, Ordering},
};

/// `len` 64-bit words of an mmap-able array map whose values are `u64`.
pub struct MappedWords {
    ptr: NonNull<AtomicU64>,
    len: usize,
    bytes: usize,
}

// SAFETY: the mapping is plain shared memory, accessed only through atomics.
unsafe impl Send for MappedWords {}

impl MappedWords {
    /// Maps the first `len` values of the array map `fd`.
    pub fn map(fd: BorrowedFd<'_>, len: usize) -> io::Result<MappedWords> {
        let page = rustix::param::page_size();
        let bytes = (len * 8).div_ceil(page) * page;
        // SAFETY: a fresh shared mapping of the map's value area (offset 0
        // of an array map's fd); nothing else aliases it in this process.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                bytes,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                fd,
                0,
            )
        }?;
        let ptr = NonNull::new(ptr.cast::<AtomicU64>())
            .ok_or_else(|| io::Error::other("mmap returned NULL"))?;
        Ok(MappedWords { ptr, len, bytes })
    }

    /// Word `i`, or 0 past the end.
    pub fn load(&self, i: usize) -> u64 {
        if i >= self.len {
            return 0;
        }
        // SAFETY: i < len, inside the mapping, 8-byte aligned (page-aligned
        // base); the kernel writes these words with single stores.
        unsafe { self.ptr.add(i).as_ref() }.load(Ordering::Acquire)
    }

    /// Sets word `i` (ignored past the end).
    pub fn store(&self, i: usize, v: u64) {
        if i < self.len {
            // SAFETY: as in `load`.
            unsafe { self.ptr.add(i).as_ref() }.store(v, Ordering::Release);
        }
    }
}

impl Drop for MappedWords {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.bytes) };
    }
}
