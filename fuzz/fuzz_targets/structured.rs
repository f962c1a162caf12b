//! Structure-aware inputs shared by the targets: safetensors files whose
//! tensor names the fuzzer shapes (count, depth, segment length, alphabet),
//! written by hand so that any name, valid or not, reaches the decoder.

/// Alphabet of segment characters: plain, the separator, and multi-byte.
const PIECES: [&str; 6] = ["a", "b", "0", ".", "é", "_"];

/// Up to eight names of 1 to 1,000 segments: most near the 32-segment limit,
/// some far past it, dots and empty segments included.
pub fn names(data: &[u8]) -> Vec<String> {
    let mut bytes = data.iter().copied();
    let count = bytes.next().map_or(1, |b| 1 + (b % 8) as usize);
    (0..count)
        .map(|_| {
            let depth_hi = bytes.next().unwrap_or(0) as usize;
            let depth_lo = bytes.next().unwrap_or(1) as usize;
            let segments = 1 + ((depth_hi << 8 | depth_lo) * 3 / 2) % 1_000;
            let length = 1 + bytes.next().unwrap_or(0) as usize % 4;
            let piece = PIECES[bytes.next().unwrap_or(0) as usize % PIECES.len()];
            let segment = piece.repeat(length);
            vec![segment; segments].join(".")
        })
        .collect()
}

/// A safetensors file with one scalar per name: float32 zeros, or float16
/// values taken from `values` (any bit pattern: NaN, infinities, subnormals).
pub fn file(names: &[String], float16_values: Option<&[u8]>) -> Vec<u8> {
    let (dtype, width) = match float16_values {
        Some(_) => ("F16", 2),
        None => ("F32", 4),
    };
    let entries: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let name = name.replace('\\', "\\\\").replace('"', "\\\"");
            format!(
                "\"{name}\":{{\"dtype\":\"{dtype}\",\"shape\":[],\"data_offsets\":[{},{}]}}",
                width * i,
                width * i + width
            )
        })
        .collect();
    let header = format!("{{{}}}", entries.join(","));
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    let data_len = width * names.len();
    let source = float16_values.unwrap_or(&[]);
    bytes.extend((0..data_len).map(|i| source.get(i).copied().unwrap_or(0)));
    bytes
}
