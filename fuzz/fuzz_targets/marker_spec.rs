//! `--marker SPEC` and `--in-pidns REF`: operator input, but also what
//! `--marker auto` builds from names found in the target.
#![no_main]

use dynprof::{
    probes::spec::{self, MarkerArg},
    target::pidns::PidNsRef,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(MarkerArg::Spec(s)) = spec::parse(&text) {
        let _ = s.label();
    }
    let _ = PidNsRef::parse(&text);
});
