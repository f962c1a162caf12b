//! The safetensors payload codec: [`ParamTree`] ⇄ bytes.
//!
//! One tensor per leaf, named by its tree path (`conv1.weight`, `layers[2].bias`),
//! so any safetensors reader sees ordinary named tensors. The tree's shape
//! (container kinds, keys, `None`s, empty containers) travels as JSON in the
//! header metadata under [`SKELETON_KEY`], so decoding rebuilds the exact tree.
//! A file without that key (written by another tool) decodes into a map tree
//! built from the dotted tensor names.
//!
//! Decoding treats its input as untrusted: size and tensor-count limits are
//! checked before anything is allocated, the safetensors crate validates the
//! header and offsets, and every mismatch between metadata and tensors is an
//! error. bfloat16 is refused at this boundary in both directions: nothing is
//! ever cast silently.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};

use safetensors::tensor::{Dtype, SafeTensors, TensorView, View};

use crate::tree::{Array, ArrayData, DType, FlatTree, ParamTree, Skeleton};

/// Header metadata key holding the tree skeleton.
pub const SKELETON_KEY: &str = "cohort.skeleton";

/// Bounds on what [`decode`] accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    pub max_bytes: usize,
    pub max_tensors: usize,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        Self {
            max_bytes: 1 << 30,
            max_tensors: 100_000,
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CodecError {
    #[error("payload of {size} bytes exceeds the limit of {limit} bytes")]
    TooLarge { size: usize, limit: usize },
    #[error("payload has {count} tensors, more than the limit of {limit}")]
    TooManyTensors { count: usize, limit: usize },
    #[error("malformed safetensors payload: {0}")]
    Malformed(String),
    #[error(
        "tensor `{0}` is bfloat16, which the host transport refuses; send float32 or float16 \
         (nothing is cast silently)"
    )]
    BFloat16(String),
    #[error("tensor `{name}` has dtype {dtype}, which cohort does not carry")]
    UnsupportedDType { name: String, dtype: String },
    #[error("payload metadata does not match its tensors: {0}")]
    MetadataMismatch(String),
    #[error("two leaves share the tensor name `{0}`; rename a key so paths stay unique")]
    DuplicateName(String),
    #[error(
        "tensor name `{shown}` has {bytes} bytes and {segments} dot-separated segments; \
         names are limited to {MAX_NAME_BYTES} bytes and {MAX_NAME_SEGMENTS} segments"
    )]
    NameTooLong {
        /// The start of the name (names can be huge).
        shown: String,
        bytes: usize,
        segments: usize,
    },
}

/// Longest tensor name accepted, in bytes: a thousand times the longest name
/// of cohort's models, and small enough that no path building it costs much.
pub const MAX_NAME_BYTES: usize = 4096;
/// Most dot-separated segments in a tensor name (the depth of the tree it
/// builds): deep enough for any real model (a transformer's names have about
/// 7), shallow enough that nothing that walks, compares or drops a tree can
/// exhaust the stack, and that the skeleton cohort writes for such a tree (two
/// JSON levels per tree level) stays within the JSON parser's nesting limit of
/// 128, so every tree that decodes also encodes and decodes again (found by
/// the `names` fuzz target at 64).
pub const MAX_NAME_SEGMENTS: usize = 32;

/// Refuses a name that would build a tree deeper or a path longer than the
/// limits, before any tree is built from it.
fn check_name(name: &str) -> Result<(), CodecError> {
    let segments = name.bytes().filter(|&b| b == b'.').count() + 1;
    if name.len() <= MAX_NAME_BYTES && segments <= MAX_NAME_SEGMENTS {
        return Ok(());
    }
    let mut end = name.len().min(60);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    Err(CodecError::NameTooLong {
        shown: format!("{}…", &name[..end]),
        bytes: name.len(),
        segments,
    })
}

fn to_safetensors_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::I32 => Dtype::I32,
        DType::U8 => Dtype::U8,
        DType::Bool => Dtype::BOOL,
    }
}

fn from_safetensors_dtype(name: &str, dtype: Dtype) -> Result<DType, CodecError> {
    Ok(match dtype {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => return Err(CodecError::BFloat16(name.to_owned())),
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        Dtype::U8 => DType::U8,
        Dtype::BOOL => DType::Bool,
        other => {
            return Err(CodecError::UnsupportedDType {
                name: name.to_owned(),
                dtype: format!("{other:?}"),
            });
        }
    })
}

/// One leaf as safetensors writes it: the leaf's own storage, borrowed, so
/// the payload is the one copy of the values that encoding makes. With
/// `header_only`, no values: what [`encoded_len`] serializes.
struct LeafView<'a> {
    dtype: Dtype,
    array: &'a Array,
    header_only: bool,
}

impl View for LeafView<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        self.array.shape()
    }

    fn data(&self) -> Cow<'_, [u8]> {
        match self.header_only {
            true => Cow::Borrowed(&[]),
            false => self.array.data().le_bytes(),
        }
    }

    fn data_len(&self) -> usize {
        self.array.size_in_bytes()
    }
}

/// Encodes a tree as safetensors bytes.
pub fn encode(tree: &ParamTree) -> Result<Vec<u8>, CodecError> {
    serialize(tree, false)
}

/// `encode(tree)?.len()` without writing the values: the header that
/// [`encode`] writes, then the leaves' sizes (safetensors writes a leaf's
/// bytes after the header, as they are). The length a client that hands its
/// tree to a server in the same process counts for the payload it did not
/// write (`encoded_len_is_the_length_of_the_encoding`).
pub fn encoded_len(tree: &ParamTree) -> Result<usize, CodecError> {
    let header = serialize(tree, true)?.len();
    Ok(header + tree.size_in_bytes())
}

fn serialize(tree: &ParamTree, header_only: bool) -> Result<Vec<u8>, CodecError> {
    let skeleton = tree.skeleton();
    let leaves = tree.leaves();
    let mut views = Vec::with_capacity(leaves.len());
    let mut seen = std::collections::HashSet::new();
    for (path, array) in &leaves {
        let name = path.to_string();
        if array.dtype() == DType::BF16 {
            return Err(CodecError::BFloat16(name));
        }
        if !seen.insert(name.clone()) {
            return Err(CodecError::DuplicateName(name));
        }
        let dtype = to_safetensors_dtype(array.dtype());
        views.push((
            name,
            LeafView {
                dtype,
                array,
                header_only,
            },
        ));
    }
    // One metadata entry only: safetensors writes its metadata map in hash
    // order, and equal models must give equal bytes.
    let metadata = HashMap::from([(
        SKELETON_KEY.to_owned(),
        serde_json::to_string(&skeleton).expect("skeletons serialize"),
    )]);
    safetensors::serialize(views, Some(metadata)).map_err(|e| CodecError::Malformed(e.to_string()))
}

/// The bound [`decode`] puts on a payload's size, before it parses it.
fn check_size(payload_len: usize, limits: &DecodeLimits) -> Result<(), CodecError> {
    if payload_len > limits.max_bytes {
        return Err(CodecError::TooLarge {
            size: payload_len,
            limit: limits.max_bytes,
        });
    }
    Ok(())
}

/// The bounds [`decode`] puts on a payload's tensors, before it reads them.
fn check_tensors<'a>(
    names: impl ExactSizeIterator<Item = &'a str>,
    limits: &DecodeLimits,
) -> Result<(), CodecError> {
    let count = names.len();
    if count > limits.max_tensors {
        return Err(CodecError::TooManyTensors {
            count,
            limit: limits.max_tensors,
        });
    }
    names.into_iter().try_for_each(check_name)
}

/// `decode(payload)` where `payload` is `encode(tree)`, made in this
/// process, `payload_len` bytes long (written or not: [`encoded_len`]): the
/// same bounds checked, and `tree` itself given back instead of a copy read
/// out of the bytes (decoding gives back what was encoded, bit for bit). How
/// a server takes the update of a client that ran beside it.
pub fn decode_own(
    payload_len: usize,
    tree: ParamTree,
    limits: &DecodeLimits,
) -> Result<ParamTree, CodecError> {
    check_size(payload_len, limits)?;
    let names: Vec<String> = tree
        .leaves()
        .iter()
        .map(|(path, _)| path.to_string())
        .collect();
    check_tensors(names.iter().map(String::as_str), limits)?;
    Ok(tree)
}

/// Decodes safetensors bytes into a tree, within `limits`.
pub fn decode(bytes: &[u8], limits: &DecodeLimits) -> Result<ParamTree, CodecError> {
    check_size(bytes.len(), limits)?;
    let (_, metadata) =
        SafeTensors::read_metadata(bytes).map_err(|e| CodecError::Malformed(e.to_string()))?;
    let infos = metadata.tensors();
    let count = infos.len();
    check_tensors(infos.keys().map(String::as_str), limits)?;
    let header = metadata.metadata().clone().unwrap_or_default();
    let tensors =
        SafeTensors::deserialize(bytes).map_err(|e| CodecError::Malformed(e.to_string()))?;
    let read_leaf = |name: &str, view: &TensorView<'_>| -> Result<Array, CodecError> {
        let dtype = from_safetensors_dtype(name, view.dtype())?;
        let data = ArrayData::from_le_bytes(dtype, view.data()).ok_or_else(|| {
            CodecError::Malformed(format!("tensor `{name}`: bytes are not valid {dtype}"))
        })?;
        Array::new(view.shape().to_vec(), data)
            .map_err(|e| CodecError::Malformed(format!("tensor `{name}`: {e}")))
    };

    let Some(skeleton_json) = header.get(SKELETON_KEY) else {
        let mut pairs = Vec::with_capacity(count);
        for (name, view) in tensors.iter() {
            pairs.push((name.to_owned(), read_leaf(name, &view)?));
        }
        return ParamTree::try_from_dotted(pairs)
            .map_err(|e| CodecError::MetadataMismatch(e.to_string()));
    };
    let skeleton: Skeleton = serde_json::from_str(skeleton_json)
        .map_err(|e| CodecError::MetadataMismatch(format!("skeleton is not valid: {e}")))?;
    let paths = skeleton.leaf_paths();
    if paths.len() != count {
        return Err(CodecError::MetadataMismatch(format!(
            "skeleton has {} leaves, payload has {count} tensors",
            paths.len()
        )));
    }
    let mut leaves = Vec::with_capacity(paths.len());
    let mut names = BTreeSet::new();
    for path in paths {
        let name = path.to_string();
        if !names.insert(name.clone()) {
            return Err(CodecError::DuplicateName(name));
        }
        let view = tensors
            .tensor(&name)
            .map_err(|_| CodecError::MetadataMismatch(format!("no tensor named `{name}`")))?;
        leaves.push((path, read_leaf(&name, &view)?));
    }
    FlatTree { skeleton, leaves }
        .unflatten()
        .map_err(|e| CodecError::MetadataMismatch(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::strategies::tree;
    use proptest::prelude::*;

    fn sample() -> ParamTree {
        ParamTree::from_dotted([
            (
                "conv1.weight".to_owned(),
                Array::f32(vec![2, 2], vec![1.0, 2.0, 3.0, 4.0]).unwrap(),
            ),
            (
                "conv1.bias".to_owned(),
                Array::f32(vec![2], vec![0.5, -0.5]).unwrap(),
            ),
        ])
    }

    /// A safetensors file with one float32 scalar per name, written by hand.
    fn file_with_names(names: &[String]) -> Vec<u8> {
        let entries: Vec<String> = names
            .iter()
            .enumerate()
            .map(|(i, name)| {
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

    #[test]
    fn a_name_of_200000_segments_is_refused_before_any_tree_is_built() {
        // The 400 KB file that overflowed the stack when its tree was built
        // and dropped.
        let deep = vec!["a"; 200_000].join(".");
        let started = std::time::Instant::now();
        let error = decode(&file_with_names(&[deep]), &DecodeLimits::default()).unwrap_err();
        assert!(
            matches!(
                error,
                CodecError::NameTooLong {
                    segments: 200_000,
                    ..
                }
            ),
            "{error}"
        );
        assert!(
            error.to_string().len() < 300,
            "the message shows only the start"
        );
        // 20,000 segments took 53 s and 14.6 GB before; now it is a check.
        let medium = vec!["a"; 20_000].join(".");
        assert!(decode(&file_with_names(&[medium]), &DecodeLimits::default()).is_err());
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        // At the limits, names still decode.
        // At the limit, a tree decodes, and what cohort encodes of it (its
        // skeleton nests two JSON levels per tree level) decodes again.
        let widest = vec!["a"; MAX_NAME_SEGMENTS].join(".");
        let tree = decode(&file_with_names(&[widest]), &DecodeLimits::default()).unwrap();
        assert_eq!(tree.leaves().len(), 1);
        let again = decode(&encode(&tree).unwrap(), &DecodeLimits::default()).unwrap();
        assert_eq!(again, tree);
        let long = "x".repeat(MAX_NAME_BYTES + 1);
        assert!(matches!(
            decode(&file_with_names(&[long]), &DecodeLimits::default()),
            Err(CodecError::NameTooLong { .. })
        ));
    }

    #[test]
    fn equal_trees_encode_to_equal_bytes() {
        assert_eq!(
            encode(&sample()).unwrap(),
            encode(&sample().clone()).unwrap()
        );
    }

    #[test]
    fn tensors_are_named_by_path() {
        let bytes = encode(&sample()).unwrap();
        let tensors = SafeTensors::deserialize(&bytes).unwrap();
        let mut names = tensors.names();
        names.sort_unstable();
        assert_eq!(names, ["conv1.bias", "conv1.weight"]);
    }

    #[test]
    fn file_without_skeleton_decodes_from_dotted_names() {
        let data = [1.0f32, 2.0];
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        let view = TensorView::new(Dtype::F32, vec![2], &bytes).unwrap();
        let file = safetensors::serialize([("fc.bias", view)], None).unwrap();
        let tree = decode(&file, &DecodeLimits::default()).unwrap();
        assert_eq!(tree.leaves()[0].0.to_string(), "fc.bias");
    }

    #[test]
    fn overlapping_names_without_skeleton_are_an_error() {
        let bytes = 1.0f32.to_le_bytes();
        let a = TensorView::new(Dtype::F32, vec![1], &bytes).unwrap();
        let ab = TensorView::new(Dtype::F32, vec![1], &bytes).unwrap();
        let file = safetensors::serialize([("a", a), ("a.b", ab)], None).unwrap();
        assert!(matches!(
            decode(&file, &DecodeLimits::default()),
            Err(CodecError::MetadataMismatch(_))
        ));
    }

    #[test]
    fn limits_are_checked() {
        let bytes = encode(&sample()).unwrap();
        let small = DecodeLimits {
            max_bytes: 10,
            max_tensors: 10,
        };
        assert!(matches!(
            decode(&bytes, &small),
            Err(CodecError::TooLarge { .. })
        ));
        let few = DecodeLimits {
            max_bytes: 1 << 20,
            max_tensors: 1,
        };
        assert!(matches!(
            decode(&bytes, &few),
            Err(CodecError::TooManyTensors { count: 2, limit: 1 })
        ));
    }

    #[test]
    fn bfloat16_is_refused_both_ways() {
        let tree = ParamTree::from_dotted([(
            "w".to_owned(),
            Array::new(vec![1], ArrayData::BF16(vec![half::bf16::ONE])).unwrap(),
        )]);
        assert!(matches!(encode(&tree), Err(CodecError::BFloat16(name)) if name == "w"));
        let bytes = [0u8, 0];
        let view = TensorView::new(Dtype::BF16, vec![1], &bytes).unwrap();
        let file = safetensors::serialize([("w", view)], None).unwrap();
        assert!(matches!(
            decode(&file, &DecodeLimits::default()),
            Err(CodecError::BFloat16(_))
        ));
    }

    #[test]
    fn truncated_and_garbage_input_are_errors() {
        let bytes = encode(&sample()).unwrap();
        for cut in [0, 4, 8, 20, bytes.len() - 1] {
            assert!(
                decode(&bytes[..cut], &DecodeLimits::default()).is_err(),
                "cut at {cut}"
            );
        }
        let mut huge_header = bytes.clone();
        huge_header[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode(&huge_header, &DecodeLimits::default()).is_err());
    }

    /// A safetensors file written by hand: header JSON, then `data`.
    fn raw(header: &str, data: &[u8]) -> Vec<u8> {
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header.as_bytes());
        file.extend_from_slice(data);
        file
    }

    #[test]
    fn hand_written_well_formed_file_decodes() {
        // The control for the malformed cases below: only one thing differs in each.
        let file = raw(
            r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
            &[0; 8],
        );
        assert!(decode(&file, &DecodeLimits::default()).is_ok());
    }

    #[test]
    fn out_of_range_offsets_are_an_error() {
        let file = raw(
            r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
            &[0; 8],
        );
        assert!(matches!(
            decode(&file, &DecodeLimits::default()),
            Err(CodecError::Malformed(_))
        ));
    }

    #[test]
    fn overlapping_offsets_are_an_error() {
        let file = raw(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
            &[0; 12],
        );
        assert!(matches!(
            decode(&file, &DecodeLimits::default()),
            Err(CodecError::Malformed(_))
        ));
    }

    #[test]
    fn offsets_that_disagree_with_the_shape_are_an_error() {
        let file = raw(
            r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
            &[0; 8],
        );
        assert!(matches!(
            decode(&file, &DecodeLimits::default()),
            Err(CodecError::Malformed(_))
        ));
    }

    #[test]
    fn unknown_and_uncarried_dtypes_are_errors() {
        let unknown = raw(
            r#"{"w":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}}"#,
            &[0; 8],
        );
        assert!(matches!(
            decode(&unknown, &DecodeLimits::default()),
            Err(CodecError::Malformed(_))
        ));
        let float64 = raw(
            r#"{"w":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}"#,
            &[0; 8],
        );
        assert_eq!(
            decode(&float64, &DecodeLimits::default()),
            Err(CodecError::UnsupportedDType {
                name: "w".to_owned(),
                dtype: "F64".to_owned()
            })
        );
    }

    #[test]
    fn a_header_that_is_not_json_is_an_error() {
        let file = raw("{not json", &[]);
        assert!(matches!(
            decode(&file, &DecodeLimits::default()),
            Err(CodecError::Malformed(_))
        ));
    }

    #[test]
    fn skeleton_that_disagrees_with_tensors_is_an_error() {
        let data = [0u8; 4];
        let view = TensorView::new(Dtype::F32, vec![1], &data).unwrap();
        let metadata = HashMap::from([(
            SKELETON_KEY.to_owned(),
            r#"{"kind":"map","items":{"other":{"kind":"leaf"}}}"#.to_owned(),
        )]);
        let file = safetensors::serialize([("w", view)], Some(metadata)).unwrap();
        let error = decode(&file, &DecodeLimits::default()).unwrap_err();
        assert_eq!(
            error,
            CodecError::MetadataMismatch("no tensor named `other`".to_owned())
        );
    }

    /// Every dtype's elements, written the portable way, one byte at a time.
    fn portable_le_bytes(data: &ArrayData) -> Vec<u8> {
        match data {
            ArrayData::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ArrayData::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ArrayData::BF16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ArrayData::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ArrayData::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ArrayData::U8(v) => v.clone(),
            ArrayData::Bool(v) => v.iter().map(|&b| u8::from(b)).collect(),
        }
    }

    #[test]
    fn payloads_hold_each_dtypes_little_endian_bytes_and_decode_back() {
        use half::f16;
        let arrays = [
            ArrayData::F32(vec![1.5, -0.0, f32::MIN_POSITIVE, 3.0e38]),
            ArrayData::F16(vec![f16::from_f32(0.5), f16::from_f32(-2.0)]),
            ArrayData::I64(vec![-1, i64::MAX, 7]),
            ArrayData::I32(vec![i32::MIN, 1]),
            ArrayData::U8(vec![0, 255, 9]),
            ArrayData::Bool(vec![true, false, true]),
        ];
        let tree = ParamTree::from_dotted(arrays.iter().enumerate().map(|(i, data)| {
            let array = Array::new(vec![data.len()], data.clone()).unwrap();
            (format!("leaf{i}.values"), array)
        }));
        let bytes = encode(&tree).unwrap();
        let tensors = SafeTensors::deserialize(&bytes).unwrap();
        for (i, data) in arrays.iter().enumerate() {
            let view = tensors.tensor(&format!("leaf{i}.values")).unwrap();
            assert_eq!(view.data(), portable_le_bytes(data), "leaf {i}");
            assert_eq!(
                ArrayData::from_le_bytes(data.dtype(), view.data()).as_ref(),
                Some(data)
            );
        }
        assert_eq!(decode(&bytes, &DecodeLimits::default()).unwrap(), tree);
        // A misaligned slice of values parses as an aligned one does.
        let shifted: Vec<u8> = [0u8]
            .iter()
            .chain(&portable_le_bytes(&arrays[2]))
            .copied()
            .collect();
        assert_eq!(
            ArrayData::from_le_bytes(DType::I64, &shifted[1..]),
            Some(arrays[2].clone())
        );
        assert_eq!(ArrayData::from_le_bytes(DType::F32, &[0; 6]), None);
        assert_eq!(ArrayData::from_le_bytes(DType::Bool, &[0, 2]), None);
    }

    proptest! {
        #[test]
        fn encoded_len_is_the_length_of_the_encoding(tree in crate::tree::strategies::tree()) {
            match encode(&tree) {
                Ok(bytes) => prop_assert_eq!(encoded_len(&tree).unwrap(), bytes.len()),
                Err(error) => prop_assert_eq!(encoded_len(&tree).unwrap_err(), error),
            }
        }
    }

    proptest! {
        #[test]
        fn encode_decode_round_trips_bit_for_bit(tree in tree()) {
            // Keys of generated maps never contain '.', '[' or ']', so names are unique.
            let bytes = encode(&tree).unwrap();
            let back = decode(&bytes, &DecodeLimits::default()).unwrap();
            prop_assert_eq!(back.skeleton(), tree.skeleton());
            let bits = |t: &ParamTree| t.leaves().iter().map(|(p, a)| (p.to_string(), a.dtype(), a.shape().to_vec(), a.data().to_le_bytes())).collect::<Vec<_>>();
            prop_assert_eq!(bits(&back), bits(&tree));
        }
    }
}
