//! Tree building from tensor names, structure-aware: the input chooses how
//! many tensors a safetensors file holds and, for each, how many segments its
//! name has (up to 100,000), how long the segments are and which characters
//! they use (dots, empty segments, UTF-8), so deep and long names, names that
//! are prefixes of others and repeats are all reached quickly. The decoder
//! must refuse or build every such file, never overflow the stack, hang or
//! allocate without bound, and what it builds must encode and decode again
//! to the same tree.
#![no_main]

use cohort_core::codec::{DecodeLimits, decode, encode};
use libfuzzer_sys::fuzz_target;

/// Alphabet of segment characters: plain, the separator, and multi-byte.
const PIECES: [&str; 6] = ["a", "b", "0", ".", "é", "_"];

fn names(data: &[u8]) -> Vec<String> {
    let mut bytes = data.iter().copied();
    let count = bytes.next().map_or(1, |b| 1 + (b % 8) as usize);
    (0..count)
        .map(|_| {
            let depth_hi = bytes.next().unwrap_or(0) as usize;
            let depth_lo = bytes.next().unwrap_or(1) as usize;
            // Most names near the limit, some far past it.
            let segments = 1 + ((depth_hi << 8 | depth_lo) * 3 / 2) % 1_000;
            let length = 1 + bytes.next().unwrap_or(0) as usize % 4;
            let piece = PIECES[bytes.next().unwrap_or(0) as usize % PIECES.len()];
            let segment = piece.repeat(length);
            vec![segment; segments].join(".")
        })
        .collect()
}

/// A safetensors file with one float32 scalar per name, written by hand so
/// that any name, valid or not, reaches the decoder.
fn file(names: &[String]) -> Vec<u8> {
    let entries: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let name = name.replace('\\', "\\\\").replace('"', "\\\"");
            format!(
                "\"{name}\":{{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[{},{}]}}",
                4 * i,
                4 * i + 4
            )
        })
        .collect();
    let header = format!("{{{}}}", entries.join(","));
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend(std::iter::repeat_n(0u8, 4 * names.len()));
    bytes
}

fuzz_target!(|data: &[u8]| {
    let bytes = file(&names(data));
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
