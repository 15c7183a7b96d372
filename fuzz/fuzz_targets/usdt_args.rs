//! USDT argument specs (`8@%rdi -4@-20(%rbp) 4@$3`) from a `.note.stapsdt` note.
#![no_main]

use dynprof::symbols::usdt;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let spec = String::from_utf8_lossy(data);
    let _ = usdt::parse_args(&spec);
});
