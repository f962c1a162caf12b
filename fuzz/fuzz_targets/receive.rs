//! The whole path a server runs on a client's update: the receiving pipeline
//! (zstd_decompress → safetensor_decode → fp16_dequantize), then the layout
//! check against the global model. The first byte picks the input's form:
//! the remaining bytes as the raw frame; wrapped in a valid zstd frame, so
//! that mutations reach the decoder behind the decompressor; or
//! structure-aware, a float16 safetensors file whose names the fuzzer shapes
//! (deep, long, repeated, prefixes of one another) and whose values are any
//! bit pattern, compressed, then checked against a global model that has
//! all but its last name.
#![no_main]

#[path = "structured.rs"]
mod structured;

use cohort_core::codec::{DecodeLimits, decode};
use cohort_core::processors::Pipeline;
use cohort_core::tree::{DTypeRule, check_schema};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&form, rest)) = data.split_first() else {
        return;
    };
    let steps = ["zstd_decompress", "safetensor_decode", "fp16_dequantize"].map(String::from);
    let pipeline = Pipeline::receiver("fuzz", &steps).expect("a valid pipeline");
    let limits = DecodeLimits {
        max_bytes: 1 << 20,
        max_tensors: 1_000,
    };
    match form % 3 {
        0 => {
            let _ = pipeline.receive(rest, &limits);
        }
        1 => {
            let framed = zstd::bulk::compress(rest, 1).expect("zstd compresses any bytes");
            let _ = pipeline.receive(&framed, &limits);
        }
        _ => {
            let names = structured::names(rest);
            let update = structured::file(&names, Some(rest));
            let framed = zstd::bulk::compress(&update, 1).expect("zstd compresses any bytes");
            let Ok(tree) = pipeline.receive(&framed, &limits) else {
                return;
            };
            assert!(check_schema(&tree, &tree, DTypeRule::Exact).is_ok());
            let global = structured::file(&names[..names.len() - 1], None);
            if let Ok(global) = decode(&global, &limits) {
                let _ = check_schema(&global, &tree, DTypeRule::AnyFloat);
            }
        }
    }
});
