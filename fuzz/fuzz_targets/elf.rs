//! ELF files the target maps: what `--marker` resolution, build-id checks
//! and USDT discovery read from them.
//!
//! Bytes go through a memfd opened as an attach opens a mapped file
//! (`rootfs::open_regular`: O_PATH, fstat, reopen) and `ElfImage::from_file`,
//! so the fuzzer drives the same bounded-pread parse as an attach. Only the
//! deadline thread of `ElfImage::open` is left out: a thread that outlives
//! one input reads to LeakSanitizer as a leak of its TLS destructor list.
#![no_main]

use std::{
    fs::File,
    os::unix::fs::FileExt as _,
    path::PathBuf,
    sync::{Mutex, OnceLock},
};

use dynprof::symbols::{ElfImage, elf, usdt};
use libfuzzer_sys::fuzz_target;

struct Scratch {
    file: File,
    path: PathBuf,
}

fn scratch() -> &'static Mutex<Scratch> {
    static S: OnceLock<Mutex<Scratch>> = OnceLock::new();
    S.get_or_init(|| {
        let fd = rustix::fs::memfd_create("dynprof-fuzz-elf", rustix::fs::MemfdFlags::CLOEXEC)
            .expect("memfd_create");
        let file = File::from(fd);
        let path = PathBuf::from(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&file)
        ));
        Mutex::new(Scratch { file, path })
    })
}

fuzz_target!(|data: &[u8]| {
    let s = scratch().lock().unwrap();
    s.file.set_len(0).unwrap();
    s.file.write_all_at(data, 0).unwrap();
    let Ok(f) = dynprof::sys::rootfs::open_regular(&s.path) else {
        return;
    };
    let Ok(img) = ElfImage::from_file(&s.path, f) else {
        return;
    };
    let _ = img.build_id();
    // What symbolization reads of the target's files besides symbols.
    let _ = img.debuglink();
    let _ = img.plt_ranges();
    let _ = img.unwind_sections();
    // A C name, a demangled C++ name (the needle pre-filter and the
    // demangler) and a mangled one.
    for spec in ["main", "torch::autograd::Engine::execute", "_Z3foov"] {
        for hit in img.find_function(spec) {
            let _ = elf::strip_params(&hit.demangled);
        }
    }
    if let Ok(probes) = usdt::probes(&img) {
        for p in probes {
            let _ = img.vaddr_to_offset(p.semaphore_vaddr);
        }
    }
    for vaddr in [0, 0x1000, 0x40_0000, u64::MAX / 2, u64::MAX] {
        let _ = img.vaddr_to_offset(vaddr);
    }
});
