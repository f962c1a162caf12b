//! Tensors across the boundary: `(name, dtype, shape, bytes)` tuples, the
//! bytes little-endian and C-ordered as NumPy's `tobytes()` writes them.
//! The Python side makes and reads them; here they become a
//! [`ParamTree`] with dotted names (`conv1.weight`), as a model file's are.

use std::path::Path;

use anyhow::{Context, anyhow};
use cohort_core::tree::{Array, ArrayData, DType, ParamTree};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// One tensor as Python gives it (the bytes are read in place, not copied
/// into a list first).
pub(crate) type TensorIn<'py> = (String, String, Vec<usize>, Bound<'py, PyBytes>);

/// One tensor as Python receives it.
pub(crate) type TensorOut<'py> = (String, &'static str, Vec<usize>, Bound<'py, PyBytes>);

/// NumPy's name for each dtype a tree may hold. bfloat16 has none: the
/// Python side widens it to float32.
const DTYPES: [(DType, &str); 7] = [
    (DType::F32, "float32"),
    (DType::F16, "float16"),
    (DType::BF16, "bfloat16"),
    (DType::I64, "int64"),
    (DType::I32, "int32"),
    (DType::U8, "uint8"),
    (DType::Bool, "bool"),
];

pub(crate) fn dtype_of(name: &str) -> Option<DType> {
    DTYPES.iter().find(|(_, n)| *n == name).map(|(d, _)| *d)
}

pub(crate) fn name_of(dtype: DType) -> &'static str {
    DTYPES
        .iter()
        .find(|(d, _)| *d == dtype)
        .map_or("unknown", |(_, n)| n)
}

/// The tree of `tensors`, each checked: a known dtype, bytes that fill the
/// shape exactly, names that do not collide as dotted paths.
pub(crate) fn tree_of(tensors: Vec<TensorIn<'_>>) -> anyhow::Result<ParamTree> {
    let pairs = tensors
        .into_iter()
        .map(|(name, dtype, shape, bytes)| {
            let bytes = bytes.as_bytes();
            let kind = dtype_of(&dtype).ok_or_else(|| {
                let known: Vec<&str> = DTYPES.iter().map(|(_, n)| *n).collect();
                anyhow!(
                    "tensor `{name}`: dtype {dtype} is not one of {}",
                    known.join(", ")
                )
            })?;
            let data = ArrayData::from_le_bytes(kind, bytes).ok_or_else(|| {
                anyhow!(
                    "tensor `{name}`: {} bytes are not whole {dtype} elements",
                    bytes.len()
                )
            })?;
            let array = Array::new(shape, data).with_context(|| format!("tensor `{name}`"))?;
            Ok((name, array))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(ParamTree::try_from_dotted(pairs)?)
}

/// Every leaf of `tree` with its dotted name, in the tree's order.
pub(crate) fn tensors_of<'py>(py: Python<'py>, tree: &ParamTree) -> Vec<TensorOut<'py>> {
    let mut out = Vec::new();
    tree.for_each_leaf(&mut |path, array| {
        out.push((
            path.to_string(),
            name_of(array.dtype()),
            array.shape().to_vec(),
            PyBytes::new(py, &array.data().to_le_bytes()),
        ));
    });
    out
}

/// A model file (safetensors, PyTorch's layout) as it is on disk,
/// BatchNorm's counters included: what `torch.load_state_dict` takes.
pub(crate) fn read_model_file(path: &Path) -> anyhow::Result<ParamTree> {
    use cohort_core::{codec, fsutil};
    let bytes = fsutil::read_bounded(path, fsutil::MAX_READ_BYTES)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let limits = codec::DecodeLimits {
        max_bytes: bytes.len(),
        ..Default::default()
    };
    codec::decode(&bytes, &limits)
        .with_context(|| format!("{} is not a readable safetensors model", path.display()))
}
