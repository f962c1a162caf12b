//! The safetensors payload decoder on arbitrary bytes: it must return a value
//! or an error, never panic, hang or allocate without bound.
#![no_main]

use cohort_core::codec::{DecodeLimits, decode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = DecodeLimits {
        max_bytes: 1 << 20,
        max_tensors: 1_000,
    };
    if let Ok(tree) = decode(data, &limits) {
        // Whatever decodes must encode again.
        let _ = cohort_core::codec::encode(&tree);
    }
});
