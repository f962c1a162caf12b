//! Tree building from tensor names, structure-aware: the input chooses how
//! many tensors a safetensors file holds and, for each, how many segments its
//! name has (up to 1,000), how long the segments are and which characters
//! they use (dots, empty segments, UTF-8), so deep and long names, names that
//! are prefixes of others and repeats are all reached quickly. The decoder
//! must refuse or build every such file, never overflow the stack, hang or
//! allocate without bound, and what it builds must encode and decode again
//! to the same tree.
#![no_main]

#[path = "structured.rs"]
mod structured;

use cohort_core::codec::{DecodeLimits, decode, encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let bytes = structured::file(&structured::names(data), None);
    let limits = DecodeLimits {
        max_bytes: 1 << 24,
        max_tensors: 1_000,
    };
    if let Ok(tree) = decode(&bytes, &limits) {
        let again = encode(&tree).expect("a decoded tree encodes");
        let round_trip = decode(&again, &limits).expect("an encoded tree decodes");
        assert_eq!(round_trip, tree);
    }
});
