//! The full receiving pipeline a server runs on a client's update
//! (zstd_decompress → safetensor_decode → fp16_dequantize) on arbitrary bytes:
//! once as the raw frame, and once wrapped in a valid zstd frame so that the
//! mutations reach the decoder behind the decompressor.
#![no_main]

use cohort_core::codec::DecodeLimits;
use cohort_core::processors::Pipeline;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let steps = ["zstd_decompress", "safetensor_decode", "fp16_dequantize"].map(String::from);
    let pipeline = Pipeline::receiver("fuzz", &steps).expect("a valid pipeline");
    let limits = DecodeLimits {
        max_bytes: 1 << 20,
        max_tensors: 1_000,
    };
    let _ = pipeline.receive(data, &limits);
    let framed = zstd::bulk::compress(data, 1).expect("zstd compresses any bytes");
    let _ = pipeline.receive(&framed, &limits);
});
