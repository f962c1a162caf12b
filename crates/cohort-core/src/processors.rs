//! Payload processors: what happens to a model between one side's tree and
//! the other side's tree.
//!
//! A sending pipeline (`clients.outbound_processors`, `server.outbound_processors`)
//! starts from a [`ParamTree`] and must end in bytes; a receiving pipeline
//! (`server.inbound_processors`, `clients.inbound_processors`) starts from bytes
//! and must end in a tree, and must undo the sender's steps in reverse order.
//! Both rules are checked when the config loads ([`Pipeline::sender`],
//! [`Pipeline::receiver`], [`check_pair`]), so a pipeline that cannot work never
//! reaches a round.
//!
//! | processor | takes | gives |
//! |---|---|---|
//! | `safetensor_encode` / `safetensor_decode` | tree / bytes | bytes / tree |
//! | `zstd_compress` / `zstd_decompress` | bytes | bytes |
//! | `fp16_quantize` / `fp16_dequantize` | tree | tree |
//!
//! Receiving treats bytes as untrusted: decompression stops at the payload
//! limit instead of allocating whatever a frame claims, and decoding applies
//! [`DecodeLimits`].

use std::borrow::Cow;
use std::fmt;
use std::io::Read;

use half::f16;

use crate::codec::{self, CodecError, DecodeLimits};
use crate::tree::{Array, ArrayData, ParamTree};

/// zstd level for `zstd_compress`: level 3 is zstd's own default, a good
/// speed/ratio trade for float payloads, which compress little at any level.
pub const ZSTD_LEVEL: i32 = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Processor {
    SafetensorEncode,
    SafetensorDecode,
    ZstdCompress,
    ZstdDecompress,
    Fp16Quantize,
    Fp16Dequantize,
}

/// What a payload is between two steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Tree,
    Bytes,
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stage::Tree => "a parameter tree",
            Stage::Bytes => "bytes",
        })
    }
}

impl Processor {
    pub const ALL: [Processor; 6] = [
        Processor::SafetensorEncode,
        Processor::SafetensorDecode,
        Processor::ZstdCompress,
        Processor::ZstdDecompress,
        Processor::Fp16Quantize,
        Processor::Fp16Dequantize,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Processor::SafetensorEncode => "safetensor_encode",
            Processor::SafetensorDecode => "safetensor_decode",
            Processor::ZstdCompress => "zstd_compress",
            Processor::ZstdDecompress => "zstd_decompress",
            Processor::Fp16Quantize => "fp16_quantize",
            Processor::Fp16Dequantize => "fp16_dequantize",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    pub fn input(self) -> Stage {
        match self {
            Processor::SafetensorEncode | Processor::Fp16Quantize | Processor::Fp16Dequantize => {
                Stage::Tree
            }
            _ => Stage::Bytes,
        }
    }

    pub fn output(self) -> Stage {
        match self {
            Processor::SafetensorDecode | Processor::Fp16Quantize | Processor::Fp16Dequantize => {
                Stage::Tree
            }
            _ => Stage::Bytes,
        }
    }

    /// The step the other side runs to undo this one.
    pub fn inverse(self) -> Self {
        match self {
            Processor::SafetensorEncode => Processor::SafetensorDecode,
            Processor::SafetensorDecode => Processor::SafetensorEncode,
            Processor::ZstdCompress => Processor::ZstdDecompress,
            Processor::ZstdDecompress => Processor::ZstdCompress,
            Processor::Fp16Quantize => Processor::Fp16Dequantize,
            Processor::Fp16Dequantize => Processor::Fp16Quantize,
        }
    }
}

/// A pipeline that cannot work, found when the config loads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {reason}")]
pub struct PipelineError {
    pub key: String,
    pub reason: String,
}

/// An error while running a pipeline on a payload.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProcessError {
    #[error(transparent)]
    Codec(#[from] CodecError),
    #[error("zstd_compress failed: {0}")]
    Compress(String),
    #[error("zstd_decompress: malformed zstd frame: {0}")]
    Decompress(String),
    #[error("zstd_decompress: the payload decompresses past the limit of {limit} bytes")]
    DecompressedTooLarge { limit: usize },
    #[error(
        "fp16_quantize: leaf `{path}` holds {value}, outside float16's range (±65504); \
         drop fp16_quantize for this model"
    )]
    Fp16Overflow { path: String, value: f32 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pipeline {
    steps: Vec<Processor>,
}

fn parse(key: &str, names: &[String]) -> Result<Vec<Processor>, PipelineError> {
    names
        .iter()
        .map(|name| {
            Processor::from_name(name).ok_or_else(|| PipelineError {
                key: key.to_owned(),
                reason: format!(
                    "unknown processor `{name}`{}; expected some of: {}",
                    crate::suggest::did_you_mean(name, Processor::ALL.iter().map(|p| p.name())),
                    Processor::ALL.map(|p| p.name()).join(", ")
                ),
            })
        })
        .collect()
}

/// Walks the stages from `start`; the payload must end as `end`.
fn check_flow(
    key: &str,
    steps: &[Processor],
    start: Stage,
    end: Stage,
) -> Result<(), PipelineError> {
    let fail = |reason: String| PipelineError {
        key: key.to_owned(),
        reason,
    };
    let mut stage = start;
    for (position, step) in steps.iter().enumerate() {
        if step.input() != stage {
            let fix = match stage {
                Stage::Tree => "put `safetensor_encode` before it",
                Stage::Bytes => "put `safetensor_decode` before it",
            };
            return Err(fail(format!(
                "`{}` (step {}) takes {}, but the payload is {} there; {fix}",
                step.name(),
                position + 1,
                step.input(),
                stage
            )));
        }
        stage = step.output();
    }
    if stage != end {
        let fix = match end {
            Stage::Bytes => "end it with `safetensor_encode` (bytes go on the wire)",
            Stage::Tree => "end it with `safetensor_decode` (the model needs a tree)",
        };
        return Err(fail(format!(
            "the pipeline leaves {stage}, but it must give {end}; {fix}"
        )));
    }
    Ok(())
}

impl Pipeline {
    /// A sending pipeline: tree in, bytes out.
    pub fn sender(key: &str, names: &[String]) -> Result<Self, PipelineError> {
        let steps = parse(key, names)?;
        check_flow(key, &steps, Stage::Tree, Stage::Bytes)?;
        Ok(Self { steps })
    }

    /// A receiving pipeline: bytes in, tree out.
    pub fn receiver(key: &str, names: &[String]) -> Result<Self, PipelineError> {
        let steps = parse(key, names)?;
        check_flow(key, &steps, Stage::Bytes, Stage::Tree)?;
        Ok(Self { steps })
    }

    pub fn steps(&self) -> &[Processor] {
        &self.steps
    }

    /// Runs a sending pipeline.
    pub fn send(&self, tree: &ParamTree) -> Result<Vec<u8>, ProcessError> {
        let mut current_tree: Cow<'_, ParamTree> = Cow::Borrowed(tree);
        let mut bytes: Vec<u8> = Vec::new();
        for step in &self.steps {
            match step {
                Processor::SafetensorEncode => bytes = codec::encode(&current_tree)?,
                Processor::ZstdCompress => {
                    bytes = zstd::bulk::compress(&bytes, ZSTD_LEVEL)
                        .map_err(|e| ProcessError::Compress(e.to_string()))?
                }
                Processor::Fp16Quantize => current_tree = Cow::Owned(quantize(&current_tree)?),
                Processor::Fp16Dequantize => current_tree = Cow::Owned(dequantize(&current_tree)),
                Processor::SafetensorDecode | Processor::ZstdDecompress => {
                    unreachable!("a sender pipeline was checked to never take bytes back to a tree")
                }
            }
        }
        Ok(bytes)
    }

    /// Runs a receiving pipeline on untrusted bytes.
    pub fn receive(
        &self,
        payload: &[u8],
        limits: &DecodeLimits,
    ) -> Result<ParamTree, ProcessError> {
        let mut bytes: Cow<'_, [u8]> = Cow::Borrowed(payload);
        let mut tree: Option<ParamTree> = None;
        for step in &self.steps {
            match step {
                Processor::ZstdDecompress => {
                    bytes = Cow::Owned(decompress(&bytes, limits.max_bytes)?)
                }
                Processor::SafetensorDecode => tree = Some(codec::decode(&bytes, limits)?),
                Processor::Fp16Dequantize => tree = tree.map(|t| dequantize(&t)),
                Processor::Fp16Quantize => {
                    tree = match tree {
                        Some(t) => Some(quantize(&t)?),
                        None => None,
                    }
                }
                Processor::SafetensorEncode | Processor::ZstdCompress => {
                    unreachable!("a receiver pipeline was checked to end in a tree")
                }
            }
        }
        Ok(tree.expect("a receiver pipeline was checked to produce a tree"))
    }

    /// Whether the pipeline is the codec alone (`safetensor_encode` or
    /// `safetensor_decode`): what it gives back is what the other side had,
    /// bit for bit.
    pub fn is_codec_alone(&self) -> bool {
        matches!(
            self.steps[..],
            [Processor::SafetensorEncode] | [Processor::SafetensorDecode]
        )
    }

    /// The length [`Self::send`] would give, without writing the payload,
    /// for a pipeline that is the codec alone; `None` for any other.
    pub fn sent_len(&self, tree: &ParamTree) -> Option<Result<usize, ProcessError>> {
        (self.steps == [Processor::SafetensorEncode])
            .then(|| codec::encoded_len(tree).map_err(ProcessError::from))
    }

    /// [`Self::receive`] of a payload this process packed from `tree` through
    /// the paired sender (a client that ran beside the server), `payload_len`
    /// bytes long (`payload` itself may be left unwritten, [`Self::sent_len`]).
    /// Where this pipeline is the codec alone, decoding would give `tree`
    /// back bit for bit, so it is given back under the codec's bounds
    /// ([`codec::decode_own`]) and no bytes are read; any other pipeline
    /// unpacks `payload`.
    pub fn receive_own(
        &self,
        payload: &[u8],
        payload_len: usize,
        tree: ParamTree,
        limits: &DecodeLimits,
    ) -> Result<ParamTree, ProcessError> {
        if self.steps == [Processor::SafetensorDecode] {
            return Ok(codec::decode_own(payload_len, tree, limits)?);
        }
        self.receive(payload, limits)
    }
}

/// Checks that `receiver` undoes `sender`: the sender's steps reversed, each
/// replaced by its inverse.
pub fn check_pair(
    sender_key: &str,
    sender: &Pipeline,
    receiver_key: &str,
    receiver: &Pipeline,
) -> Result<(), PipelineError> {
    let expected: Vec<Processor> = sender.steps.iter().rev().map(|p| p.inverse()).collect();
    if expected != receiver.steps {
        let names = |steps: &[Processor]| {
            let names: Vec<String> = steps.iter().map(|p| format!("\"{}\"", p.name())).collect();
            format!("[{}]", names.join(", "))
        };
        return Err(PipelineError {
            key: receiver_key.to_owned(),
            reason: format!(
                "must undo {sender_key} = {} step by step in reverse order, i.e. be {}, but it is {}",
                names(&sender.steps),
                names(&expected),
                names(&receiver.steps)
            ),
        });
    }
    Ok(())
}

fn decompress(bytes: &[u8], limit: usize) -> Result<Vec<u8>, ProcessError> {
    let decoder = zstd::stream::read::Decoder::new(bytes)
        .map_err(|e| ProcessError::Decompress(e.to_string()))?;
    let mut out = Vec::new();
    // One byte past the limit tells "exactly at the limit" from "over it"
    // without ever holding more than that.
    decoder
        .take(limit as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| ProcessError::Decompress(e.to_string()))?;
    if out.len() > limit {
        return Err(ProcessError::DecompressedTooLarge { limit });
    }
    Ok(out)
}

/// float32 leaves to float16; other dtypes pass unchanged.
fn quantize(tree: &ParamTree) -> Result<ParamTree, ProcessError> {
    let mut out = tree.clone();
    let paths: Vec<String> = tree.leaves().iter().map(|(p, _)| p.to_string()).collect();
    for (array, path) in out.leaves_mut().into_iter().zip(paths) {
        if let Some(values) = array.as_f32() {
            let mut halves = Vec::with_capacity(values.len());
            for &value in values {
                let half = f16::from_f32(value);
                if value.is_finite() && !half.is_finite() {
                    return Err(ProcessError::Fp16Overflow { path, value });
                }
                halves.push(half);
            }
            *array = Array::new(array.shape().to_vec(), ArrayData::F16(halves))
                .expect("same element count");
        }
    }
    Ok(out)
}

/// float16 leaves back to float32 (exact: every float16 is a float32).
fn dequantize(tree: &ParamTree) -> ParamTree {
    let mut out = tree.clone();
    for array in out.leaves_mut() {
        if let ArrayData::F16(values) = array.data() {
            let floats = values.iter().map(|h| h.to_f32()).collect();
            *array = Array::f32(array.shape().to_vec(), floats).expect("same element count");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::DType;
    use crate::tree::strategies::tree as arb_tree;
    use proptest::prelude::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn pair(sender: &[&str]) -> (Pipeline, Pipeline) {
        let sender = Pipeline::sender("s", &names(sender)).unwrap();
        let receiver_steps: Vec<String> = sender
            .steps()
            .iter()
            .rev()
            .map(|p| p.inverse().name().to_owned())
            .collect();
        (sender, Pipeline::receiver("r", &receiver_steps).unwrap())
    }

    #[test]
    fn compress_before_encode_is_refused_with_the_fix() {
        let error = Pipeline::sender(
            "clients.outbound_processors",
            &names(&["zstd_compress", "safetensor_encode"]),
        )
        .unwrap_err();
        assert_eq!(
            error.to_string(),
            "clients.outbound_processors: `zstd_compress` (step 1) takes bytes, but the payload \
             is a parameter tree there; put `safetensor_encode` before it"
        );
    }

    #[test]
    fn a_sender_must_end_in_bytes_and_a_receiver_in_a_tree() {
        let error = Pipeline::sender("k", &names(&["fp16_quantize"])).unwrap_err();
        assert!(
            error.reason.contains("end it with `safetensor_encode`"),
            "{error}"
        );
        let error = Pipeline::receiver("k", &names(&["zstd_decompress"])).unwrap_err();
        assert!(
            error.reason.contains("end it with `safetensor_decode`"),
            "{error}"
        );
        let error = Pipeline::sender("k", &names(&[])).unwrap_err();
        assert!(error.reason.contains("leaves a parameter tree"), "{error}");
    }

    #[test]
    fn unknown_names_get_a_suggestion() {
        let error = Pipeline::sender("k", &names(&["safetensors_encode"])).unwrap_err();
        assert!(
            error.reason.contains("did you mean `safetensor_encode`"),
            "{error}"
        );
    }

    #[test]
    fn a_receiver_must_undo_the_sender() {
        let sender = Pipeline::sender(
            "clients.outbound_processors",
            &names(&["safetensor_encode", "zstd_compress"]),
        )
        .unwrap();
        let receiver =
            Pipeline::receiver("server.inbound_processors", &names(&["safetensor_decode"]))
                .unwrap();
        let error = check_pair(
            "clients.outbound_processors",
            &sender,
            "server.inbound_processors",
            &receiver,
        )
        .unwrap_err();
        assert_eq!(
            error.to_string(),
            "server.inbound_processors: must undo clients.outbound_processors = \
             [\"safetensor_encode\", \"zstd_compress\"] step by step in reverse order, i.e. be \
             [\"zstd_decompress\", \"safetensor_decode\"], but it is [\"safetensor_decode\"]"
        );
    }

    #[test]
    fn decompression_stops_at_the_limit() {
        let (sender, receiver) = pair(&["safetensor_encode", "zstd_compress"]);
        let tree = ParamTree::from_dotted([(
            "w".to_owned(),
            Array::f32(vec![100_000], vec![0.0; 100_000]).unwrap(),
        )]);
        let bytes = sender.send(&tree).unwrap();
        assert!(bytes.len() < 10_000, "zeros compress well");
        let limits = DecodeLimits {
            max_bytes: 50_000,
            ..Default::default()
        };
        assert_eq!(
            receiver.receive(&bytes, &limits),
            Err(ProcessError::DecompressedTooLarge { limit: 50_000 })
        );
        assert!(matches!(
            receiver.receive(b"not zstd", &DecodeLimits::default()),
            Err(ProcessError::Decompress(_))
        ));
    }

    #[test]
    fn fp16_overflow_is_an_error_not_infinity() {
        let (sender, _) = pair(&["fp16_quantize", "safetensor_encode"]);
        let tree = ParamTree::from_dotted([(
            "w".to_owned(),
            Array::f32(vec![2], vec![1.0, 1e6]).unwrap(),
        )]);
        assert_eq!(
            sender.send(&tree),
            Err(ProcessError::Fp16Overflow {
                path: "w".to_owned(),
                value: 1e6
            })
        );
    }

    #[test]
    fn fp16_halves_the_float_bytes() {
        let tree = ParamTree::from_dotted([(
            "w".to_owned(),
            Array::f32(vec![1000], vec![0.25; 1000]).unwrap(),
        )]);
        let (plain, _) = pair(&["safetensor_encode"]);
        let (half, receiver) = pair(&["fp16_quantize", "safetensor_encode"]);
        let (plain, half_bytes) = (plain.send(&tree).unwrap(), half.send(&tree).unwrap());
        assert!(half_bytes.len() < plain.len() - 1900);
        assert_eq!(
            receiver
                .receive(&half_bytes, &DecodeLimits::default())
                .unwrap(),
            tree
        );
    }

    fn chains() -> Vec<Vec<&'static str>> {
        vec![
            vec!["safetensor_encode"],
            vec!["safetensor_encode", "zstd_compress"],
            vec!["safetensor_encode", "zstd_compress", "zstd_compress"],
        ]
    }

    /// The same tree, bit for bit (`==` is false on a NaN).
    fn same_bits(a: &ParamTree, b: &ParamTree) -> bool {
        let leaves = |t: &ParamTree| -> Vec<(String, Vec<usize>, DType, Vec<u8>)> {
            t.leaves()
                .into_iter()
                .map(|(path, array)| {
                    let bytes = array.data().le_bytes().into_owned();
                    (
                        path.to_string(),
                        array.shape().to_vec(),
                        array.dtype(),
                        bytes,
                    )
                })
                .collect()
        };
        a.skeleton() == b.skeleton() && leaves(a) == leaves(b)
    }

    #[test]
    fn an_own_update_meets_the_codecs_bounds_as_its_payload_would() {
        let tree = ParamTree::from_dotted([
            (
                "a.w".to_owned(),
                Array::f32(vec![2], vec![1.0, 2.0]).unwrap(),
            ),
            ("b".to_owned(), Array::f32(vec![1], vec![3.0]).unwrap()),
        ]);
        let (sender, receiver) = pair(&["safetensor_encode"]);
        let bytes = sender.send(&tree).unwrap();
        let tight = [
            DecodeLimits {
                max_bytes: bytes.len() - 1,
                max_tensors: 2,
            },
            DecodeLimits {
                max_bytes: bytes.len(),
                max_tensors: 1,
            },
        ];
        for limits in tight {
            let own = receiver.receive_own(&bytes, bytes.len(), tree.clone(), &limits);
            let decoded = receiver.receive(&bytes, &limits);
            assert!(own.is_err(), "{limits:?}");
            assert_eq!(
                own.unwrap_err().to_string(),
                decoded.unwrap_err().to_string()
            );
        }
        let long = "x".repeat(codec::MAX_NAME_BYTES + 1);
        let named = ParamTree::from_dotted([(long, Array::f32(vec![1], vec![0.0]).unwrap())]);
        let bytes = sender.send(&named).unwrap();
        let limits = DecodeLimits::default();
        assert_eq!(
            receiver
                .receive_own(&bytes, bytes.len(), named, &limits)
                .unwrap_err()
                .to_string(),
            receiver.receive(&bytes, &limits).unwrap_err().to_string()
        );
    }

    proptest! {
        #[test]
        fn an_own_update_is_what_its_payload_decodes_to(tree in arb_tree(), chain in 0usize..3) {
            let (sender, receiver) = pair(&chains()[chain]);
            let Ok(bytes) = sender.send(&tree) else { return Ok(()) };
            let limits = DecodeLimits::default();
            let decoded = receiver.receive(&bytes, &limits).unwrap();
            let own = receiver.receive_own(&bytes, bytes.len(), tree.clone(), &limits).unwrap();
            prop_assert!(same_bits(&own, &decoded), "{own:?} against {decoded:?}");
        }

        #[test]
        fn every_lossless_chain_round_trips_bit_for_bit(tree in arb_tree(), chain in 0usize..3) {
            let (sender, receiver) = pair(&chains()[chain]);
            let bytes = sender.send(&tree).unwrap();
            let back = receiver.receive(&bytes, &DecodeLimits::default()).unwrap();
            prop_assert_eq!(codec::encode(&back).unwrap(), codec::encode(&tree).unwrap());
        }

        #[test]
        fn fp16_chains_round_trip_what_float16_can_hold(tree in arb_tree(), compress in any::<bool>()) {
            // Quantizing first: whatever fits float16 (exactly representable
            // values) comes back bit for bit through every fp16 chain.
            let Ok(representable) = quantize(&tree).map(|t| dequantize(&t)) else { return Ok(()) };
            let mut chain = vec!["fp16_quantize", "safetensor_encode"];
            if compress { chain.push("zstd_compress"); }
            let (sender, receiver) = pair(&chain);
            let bytes = sender.send(&representable).unwrap();
            let back = receiver.receive(&bytes, &DecodeLimits::default()).unwrap();
            prop_assert_eq!(codec::encode(&back).unwrap(), codec::encode(&representable).unwrap());
        }
    }
}
