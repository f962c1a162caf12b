//! Parameter trees: the host-side, backend-free form of a model's state.
//!
//! A [`ParamTree`] is what travels between server and clients and what every
//! aggregation algorithm works on. It mirrors the structures users put into
//! Python state dicts: nested maps with string keys, lists, tuples, array leaves
//! and `None`. Leaves are owned host arrays, so a tree extracted from a model is a
//! snapshot that later training cannot change.
//!
//! Trees flatten into a [`Skeleton`] (the containers, with placeholders where
//! leaves were) plus the leaves in depth-first order, and rebuild from the two
//! losslessly: container kinds and empty containers survive the round trip.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

/// Element type of an [`Array`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    BF16,
    I64,
    I32,
    U8,
    Bool,
}

impl DType {
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 => 8,
            DType::U8 | DType::Bool => 1,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I64 => "int64",
            DType::I32 => "int32",
            DType::U8 => "uint8",
            DType::Bool => "bool",
        };
        f.write_str(name)
    }
}

/// Typed element storage of an [`Array`].
#[derive(Debug, Clone, PartialEq)]
pub enum ArrayData {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    I64(Vec<i64>),
    I32(Vec<i32>),
    U8(Vec<u8>),
    Bool(Vec<bool>),
}

impl ArrayData {
    pub fn dtype(&self) -> DType {
        match self {
            ArrayData::F32(_) => DType::F32,
            ArrayData::F16(_) => DType::F16,
            ArrayData::BF16(_) => DType::BF16,
            ArrayData::I64(_) => DType::I64,
            ArrayData::I32(_) => DType::I32,
            ArrayData::U8(_) => DType::U8,
            ArrayData::Bool(_) => DType::Bool,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            ArrayData::F32(v) => v.len(),
            ArrayData::F16(v) => v.len(),
            ArrayData::BF16(v) => v.len(),
            ArrayData::I64(v) => v.len(),
            ArrayData::I32(v) => v.len(),
            ArrayData::U8(v) => v.len(),
            ArrayData::Bool(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Little-endian bytes of the elements, as safetensors stores them.
    pub fn to_le_bytes(&self) -> Vec<u8> {
        self.le_bytes().into_owned()
    }

    /// The elements' little-endian bytes: on a little-endian machine the
    /// storage itself, so a payload is written with one copy, not two.
    pub fn le_bytes(&self) -> Cow<'_, [u8]> {
        #[cfg(target_endian = "little")]
        fn le<T: bytemuck::NoUninit, const N: usize>(
            values: &[T],
            _: impl Fn(T) -> [u8; N],
        ) -> Cow<'_, [u8]> {
            Cow::Borrowed(bytemuck::cast_slice(values))
        }
        #[cfg(not(target_endian = "little"))]
        fn le<T: Copy, const N: usize>(values: &[T], to: impl Fn(T) -> [u8; N]) -> Cow<'_, [u8]> {
            Cow::Owned(values.iter().flat_map(|&v| to(v)).collect())
        }
        match self {
            ArrayData::F32(v) => le(v, f32::to_le_bytes),
            ArrayData::F16(v) => le(v, f16::to_le_bytes),
            ArrayData::BF16(v) => le(v, bf16::to_le_bytes),
            ArrayData::I64(v) => le(v, i64::to_le_bytes),
            ArrayData::I32(v) => le(v, i32::to_le_bytes),
            ArrayData::U8(v) => Cow::Borrowed(v),
            // `bool` is one byte, 0 or 1, which is safetensors' BOOL.
            ArrayData::Bool(v) => Cow::Borrowed(bytemuck::cast_slice(v)),
        }
    }

    /// Parses little-endian bytes; `None` when the byte count is not a multiple
    /// of the element size or a boolean byte is neither 0 nor 1.
    pub fn from_le_bytes(dtype: DType, bytes: &[u8]) -> Option<ArrayData> {
        // On a little-endian machine the bytes are the values: one pass into
        // the new storage, whatever the payload's alignment.
        #[cfg(target_endian = "little")]
        fn parse<T: bytemuck::Pod, const N: usize>(
            bytes: &[u8],
            _: impl Fn([u8; N]) -> T,
        ) -> Option<Vec<T>> {
            if !bytes.len().is_multiple_of(N) {
                return None;
            }
            // Read straight into fresh storage: a zeroed vector copied over
            // wrote every value twice (a memset, then the copy), a second
            // pass over each update the server decodes.
            let mut values = Vec::with_capacity(bytes.len() / N);
            values.extend(bytes.chunks_exact(N).map(bytemuck::pod_read_unaligned::<T>));
            Some(values)
        }
        #[cfg(not(target_endian = "little"))]
        fn parse<T, const N: usize>(bytes: &[u8], from: impl Fn([u8; N]) -> T) -> Option<Vec<T>> {
            if !bytes.len().is_multiple_of(N) {
                return None;
            }
            Some(
                bytes
                    .chunks_exact(N)
                    .map(|c| from(c.try_into().expect("chunks_exact yields N bytes")))
                    .collect(),
            )
        }
        Some(match dtype {
            DType::F32 => ArrayData::F32(parse(bytes, f32::from_le_bytes)?),
            DType::F16 => ArrayData::F16(parse(bytes, f16::from_le_bytes)?),
            DType::BF16 => ArrayData::BF16(parse(bytes, bf16::from_le_bytes)?),
            DType::I64 => ArrayData::I64(parse(bytes, i64::from_le_bytes)?),
            DType::I32 => ArrayData::I32(parse(bytes, i32::from_le_bytes)?),
            DType::U8 => ArrayData::U8(bytes.to_vec()),
            DType::Bool => ArrayData::Bool(
                bytes
                    .iter()
                    .map(|&b| match b {
                        0 => Some(false),
                        1 => Some(true),
                        _ => None,
                    })
                    .collect::<Option<Vec<bool>>>()?,
            ),
        })
    }
}

/// An owned n-dimensional host array. The element count always equals the
/// product of the shape (checked by [`Array::new`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Array {
    shape: Vec<usize>,
    data: ArrayData,
}

/// The element count does not match the shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("array of shape {shape:?} needs {expected} elements, got {actual}")]
pub struct ShapeError {
    pub shape: Vec<usize>,
    pub expected: usize,
    pub actual: usize,
}

impl Array {
    pub fn new(shape: Vec<usize>, data: ArrayData) -> Result<Self, ShapeError> {
        let expected = shape.iter().product::<usize>();
        if expected != data.len() {
            return Err(ShapeError {
                shape,
                expected,
                actual: data.len(),
            });
        }
        Ok(Self { shape, data })
    }

    pub fn f32(shape: Vec<usize>, values: Vec<f32>) -> Result<Self, ShapeError> {
        Self::new(shape, ArrayData::F32(values))
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    pub fn data(&self) -> &ArrayData {
        &self.data
    }

    pub fn data_mut(&mut self) -> &mut ArrayData {
        &mut self.data
    }

    pub fn into_data(self) -> ArrayData {
        self.data
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn size_in_bytes(&self) -> usize {
        self.len() * self.dtype().size_in_bytes()
    }

    /// The elements as `f32` when the array is float32.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            ArrayData::F32(v) => Some(v),
            _ => None,
        }
    }
}

/// One step of a path into a tree.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PathSegment {
    Key(String),
    Index(usize),
}

/// Location of a node in a tree, printed as `conv1.weight` or `layers[2].bias`.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TreePath(pub Vec<PathSegment>);

impl TreePath {
    pub fn root() -> Self {
        Self(Vec::new())
    }

    pub fn child_key(&self, key: &str) -> Self {
        let mut segments = self.0.clone();
        segments.push(PathSegment::Key(key.to_owned()));
        Self(segments)
    }

    pub fn child_index(&self, index: usize) -> Self {
        let mut segments = self.0.clone();
        segments.push(PathSegment::Index(index));
        Self(segments)
    }
}

impl fmt::Display for TreePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("<root>");
        }
        for (position, segment) in self.0.iter().enumerate() {
            match segment {
                PathSegment::Key(key) if position == 0 => write!(f, "{key}")?,
                PathSegment::Key(key) => write!(f, ".{key}")?,
                PathSegment::Index(index) => write!(f, "[{index}]")?,
            }
        }
        Ok(())
    }
}

/// A tree of model parameters.
#[derive(Debug, Clone, PartialEq)]
pub enum ParamTree {
    Map(BTreeMap<String, ParamTree>),
    List(Vec<ParamTree>),
    Tuple(Vec<ParamTree>),
    Leaf(Array),
    None,
}

/// The containers of a tree with its leaves taken out; serializable, so it can
/// travel as metadata beside the leaf bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "items", rename_all = "lowercase")]
pub enum Skeleton {
    Map(BTreeMap<String, Skeleton>),
    List(Vec<Skeleton>),
    Tuple(Vec<Skeleton>),
    Leaf,
    None,
}

/// A tree split into its skeleton and its leaves in depth-first order.
#[derive(Debug, Clone, PartialEq)]
pub struct FlatTree {
    pub skeleton: Skeleton,
    pub leaves: Vec<(TreePath, Array)>,
}

/// Rebuilding a tree from a skeleton and leaves failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnflattenError {
    #[error("the skeleton has {expected} leaves but {actual} arrays were given")]
    LeafCount { expected: usize, actual: usize },
}

impl ParamTree {
    pub fn kind(&self) -> &'static str {
        match self {
            ParamTree::Map(_) => "map",
            ParamTree::List(_) => "list",
            ParamTree::Tuple(_) => "tuple",
            ParamTree::Leaf(_) => "array",
            ParamTree::None => "None",
        }
    }

    /// Depth-first visit of every leaf with its path.
    pub fn for_each_leaf<'a>(&'a self, visit: &mut impl FnMut(&TreePath, &'a Array)) {
        fn walk<'a>(
            node: &'a ParamTree,
            path: &TreePath,
            visit: &mut impl FnMut(&TreePath, &'a Array),
        ) {
            match node {
                ParamTree::Map(map) => {
                    for (key, child) in map {
                        walk(child, &path.child_key(key), visit);
                    }
                }
                ParamTree::List(items) | ParamTree::Tuple(items) => {
                    for (index, child) in items.iter().enumerate() {
                        walk(child, &path.child_index(index), visit);
                    }
                }
                ParamTree::Leaf(array) => visit(path, array),
                ParamTree::None => {}
            }
        }
        walk(self, &TreePath::root(), visit);
    }

    /// Leaves in depth-first order, borrowed.
    pub fn leaves(&self) -> Vec<(TreePath, &Array)> {
        let mut leaves = Vec::new();
        self.for_each_leaf(&mut |path, array| leaves.push((path.clone(), array)));
        leaves
    }

    /// The L2 distance between the float leaves of `self` and `other`, in
    /// float64; `None` where their layouts differ (check the schema first).
    /// Integer and boolean leaves are not part of it.
    pub fn float_distance(&self, other: &ParamTree) -> Option<f64> {
        let (ours, theirs) = (self.leaves(), other.leaves());
        if ours.len() != theirs.len() {
            return None;
        }
        let mut sum = 0.0f64;
        for ((_, a), (_, b)) in ours.iter().zip(&theirs) {
            match (floats(a.data()), floats(b.data())) {
                (Some(x), Some(y)) if a.len() == b.len() => {
                    sum += x.zip(y).map(|(p, q)| (p - q).powi(2)).sum::<f64>();
                }
                (None, None) => {}
                _ => return None,
            }
        }
        Some(sum.sqrt())
    }

    /// The L2 norm of the float leaves (as [`ParamTree::float_distance`]
    /// from zero).
    pub fn float_norm(&self) -> f64 {
        let mut sum = 0.0f64;
        self.for_each_leaf(&mut |_, array| {
            if let Some(values) = floats(array.data()) {
                sum += values.map(|x| x * x).sum::<f64>();
            }
        });
        sum.sqrt()
    }

    /// The first float value that is NaN or infinite, depth first: its leaf
    /// and its index there. Integer and boolean leaves are always finite.
    pub fn first_non_finite(&self) -> Option<(TreePath, usize)> {
        let mut found = None;
        self.for_each_leaf(&mut |path, array| {
            if found.is_some() {
                return;
            }
            let index = match array.data() {
                ArrayData::F32(values) => first_non_finite_f32(values),
                ArrayData::F16(values) => values.iter().position(|x| !x.is_finite()),
                ArrayData::BF16(values) => values.iter().position(|x| !x.is_finite()),
                _ => None,
            };
            found = index.map(|index| (path.clone(), index));
        });
        found
    }

    /// Mutable leaves in the same depth-first order as [`ParamTree::leaves`].
    pub fn leaves_mut(&mut self) -> Vec<&mut Array> {
        fn walk<'a>(node: &'a mut ParamTree, out: &mut Vec<&'a mut Array>) {
            match node {
                ParamTree::Map(map) => map.values_mut().for_each(|child| walk(child, out)),
                ParamTree::List(items) | ParamTree::Tuple(items) => {
                    items.iter_mut().for_each(|child| walk(child, out))
                }
                ParamTree::Leaf(array) => out.push(array),
                ParamTree::None => {}
            }
        }
        let mut out = Vec::new();
        walk(self, &mut out);
        out
    }

    pub fn num_elements(&self) -> usize {
        let mut total = 0;
        self.for_each_leaf(&mut |_, array| total += array.len());
        total
    }

    pub fn size_in_bytes(&self) -> usize {
        let mut total = 0;
        self.for_each_leaf(&mut |_, array| total += array.size_in_bytes());
        total
    }

    pub fn skeleton(&self) -> Skeleton {
        match self {
            ParamTree::Map(map) => Skeleton::Map(
                map.iter()
                    .map(|(key, child)| (key.clone(), child.skeleton()))
                    .collect(),
            ),
            ParamTree::List(items) => Skeleton::List(items.iter().map(Self::skeleton).collect()),
            ParamTree::Tuple(items) => Skeleton::Tuple(items.iter().map(Self::skeleton).collect()),
            ParamTree::Leaf(_) => Skeleton::Leaf,
            ParamTree::None => Skeleton::None,
        }
    }

    pub fn flatten(self) -> FlatTree {
        let skeleton = self.skeleton();
        let mut leaves = Vec::new();
        fn take(node: ParamTree, path: TreePath, out: &mut Vec<(TreePath, Array)>) {
            match node {
                ParamTree::Map(map) => {
                    for (key, child) in map {
                        let child_path = path.child_key(&key);
                        take(child, child_path, out);
                    }
                }
                ParamTree::List(items) | ParamTree::Tuple(items) => {
                    for (index, child) in items.into_iter().enumerate() {
                        take(child, path.child_index(index), out);
                    }
                }
                ParamTree::Leaf(array) => out.push((path, array)),
                ParamTree::None => {}
            }
        }
        take(self, TreePath::root(), &mut leaves);
        FlatTree { skeleton, leaves }
    }

    /// Builds a map tree from `(dotted path, array)` pairs, as a module visitor
    /// produces them: `conv1.weight` becomes `{"conv1": {"weight": ...}}`.
    ///
    /// # Panics
    /// When two paths conflict (see [`ParamTree::try_from_dotted`]); module
    /// visitors never produce such paths. Use `try_from_dotted` for input
    /// from outside.
    pub fn from_dotted(pairs: impl IntoIterator<Item = (String, Array)>) -> Self {
        Self::try_from_dotted(pairs).unwrap_or_else(|conflict| panic!("{conflict}"))
    }

    /// Like [`ParamTree::from_dotted`], but a path that repeats another, or
    /// that is both a leaf and a prefix of another path (`a` and `a.b`), is an
    /// error instead of silently dropping one of them.
    pub fn try_from_dotted(
        pairs: impl IntoIterator<Item = (String, Array)>,
    ) -> Result<Self, DottedPathConflict> {
        let mut root = BTreeMap::new();
        for (path, array) in pairs {
            let conflict = || DottedPathConflict(path.clone());
            let mut node = &mut root;
            let mut segments = path.split('.').peekable();
            while let Some(segment) = segments.next() {
                if segments.peek().is_none() {
                    if node.contains_key(segment) {
                        return Err(conflict());
                    }
                    node.insert(segment.to_owned(), ParamTree::Leaf(array));
                    break;
                }
                let child = node
                    .entry(segment.to_owned())
                    .or_insert_with(|| ParamTree::Map(BTreeMap::new()));
                node = match child {
                    ParamTree::Map(map) => map,
                    _ => return Err(conflict()),
                };
            }
        }
        Ok(ParamTree::Map(root))
    }
}

/// Two dotted tensor names that cannot both be leaves of one tree.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tensor name `{0}` repeats another name or overlaps it as a leaf and a prefix")]
pub struct DottedPathConflict(pub String);

impl Skeleton {
    pub fn leaf_count(&self) -> usize {
        match self {
            Skeleton::Map(map) => map.values().map(Self::leaf_count).sum(),
            Skeleton::List(items) | Skeleton::Tuple(items) => {
                items.iter().map(Self::leaf_count).sum()
            }
            Skeleton::Leaf => 1,
            Skeleton::None => 0,
        }
    }

    /// Depth-first leaf paths, in the order [`ParamTree::flatten`] emits leaves.
    pub fn leaf_paths(&self) -> Vec<TreePath> {
        fn walk(node: &Skeleton, path: TreePath, out: &mut Vec<TreePath>) {
            match node {
                Skeleton::Map(map) => {
                    for (key, child) in map {
                        walk(child, path.child_key(key), out);
                    }
                }
                Skeleton::List(items) | Skeleton::Tuple(items) => {
                    for (index, child) in items.iter().enumerate() {
                        walk(child, path.child_index(index), out);
                    }
                }
                Skeleton::Leaf => out.push(path),
                Skeleton::None => {}
            }
        }
        let mut out = Vec::new();
        walk(self, TreePath::root(), &mut out);
        out
    }
}

impl FlatTree {
    pub fn unflatten(self) -> Result<ParamTree, UnflattenError> {
        let expected = self.skeleton.leaf_count();
        if expected != self.leaves.len() {
            return Err(UnflattenError::LeafCount {
                expected,
                actual: self.leaves.len(),
            });
        }
        let mut leaves = self.leaves.into_iter().map(|(_, array)| array);
        fn build(node: Skeleton, leaves: &mut impl Iterator<Item = Array>) -> ParamTree {
            match node {
                Skeleton::Map(map) => ParamTree::Map(
                    map.into_iter()
                        .map(|(key, child)| (key, build(child, leaves)))
                        .collect(),
                ),
                Skeleton::List(items) => {
                    ParamTree::List(items.into_iter().map(|c| build(c, leaves)).collect())
                }
                Skeleton::Tuple(items) => {
                    ParamTree::Tuple(items.into_iter().map(|c| build(c, leaves)).collect())
                }
                Skeleton::Leaf => ParamTree::Leaf(leaves.next().expect("leaf count checked")),
                Skeleton::None => ParamTree::None,
            }
        }
        Ok(build(self.skeleton, &mut leaves))
    }
}

/// How a tree differs in structure from a reference tree.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchemaMismatch {
    #[error("at `{path}`: expected a {expected}, found a {found}")]
    Kind {
        path: TreePath,
        expected: &'static str,
        found: &'static str,
    },
    #[error("at `{path}`: key `{key}` is missing")]
    MissingKey { path: TreePath, key: String },
    #[error("at `{path}`: unexpected key `{key}`")]
    ExtraKey { path: TreePath, key: String },
    #[error("at `{path}`: expected {expected} items, found {found}")]
    Length {
        path: TreePath,
        expected: usize,
        found: usize,
    },
    #[error("at `{path}`: expected shape {expected:?}, found {found:?}")]
    Shape {
        path: TreePath,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("at `{path}`: expected dtype {expected}, found {found}")]
    DType {
        path: TreePath,
        expected: DType,
        found: DType,
    },
}

/// Which leaf dtypes count as matching the reference during a schema check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DTypeRule {
    /// Leaves must have the reference dtype.
    Exact,
    /// A float leaf may be any float dtype the aggregation accepts (float16 or
    /// float32); non-float leaves must match exactly.
    AnyFloat,
}

/// Checks that `candidate` has the structure of `reference`: container kinds,
/// keys, sequence lengths, leaf shapes and dtypes (per `rule`). Reports the
/// first difference in depth-first order.
pub fn check_schema(
    reference: &ParamTree,
    candidate: &ParamTree,
    rule: DTypeRule,
) -> Result<(), SchemaMismatch> {
    fn walk(
        reference: &ParamTree,
        candidate: &ParamTree,
        path: &TreePath,
        rule: DTypeRule,
    ) -> Result<(), SchemaMismatch> {
        match (reference, candidate) {
            (ParamTree::Map(expected), ParamTree::Map(found)) => {
                if let Some(key) = expected.keys().find(|key| !found.contains_key(*key)) {
                    return Err(SchemaMismatch::MissingKey {
                        path: path.clone(),
                        key: key.clone(),
                    });
                }
                if let Some(key) = found.keys().find(|key| !expected.contains_key(*key)) {
                    return Err(SchemaMismatch::ExtraKey {
                        path: path.clone(),
                        key: key.clone(),
                    });
                }
                for (key, child) in expected {
                    walk(child, &found[key], &path.child_key(key), rule)?;
                }
                Ok(())
            }
            (ParamTree::List(expected), ParamTree::List(found))
            | (ParamTree::Tuple(expected), ParamTree::Tuple(found)) => {
                if expected.len() != found.len() {
                    return Err(SchemaMismatch::Length {
                        path: path.clone(),
                        expected: expected.len(),
                        found: found.len(),
                    });
                }
                for (index, (e, f)) in expected.iter().zip(found).enumerate() {
                    walk(e, f, &path.child_index(index), rule)?;
                }
                Ok(())
            }
            (ParamTree::Leaf(expected), ParamTree::Leaf(found)) => {
                if expected.shape() != found.shape() {
                    return Err(SchemaMismatch::Shape {
                        path: path.clone(),
                        expected: expected.shape().to_vec(),
                        found: found.shape().to_vec(),
                    });
                }
                let dtype_ok = match rule {
                    DTypeRule::Exact => expected.dtype() == found.dtype(),
                    DTypeRule::AnyFloat => {
                        expected.dtype() == found.dtype()
                            || (expected.dtype().is_float() && found.dtype().is_float())
                    }
                };
                if !dtype_ok {
                    return Err(SchemaMismatch::DType {
                        path: path.clone(),
                        expected: expected.dtype(),
                        found: found.dtype(),
                    });
                }
                Ok(())
            }
            (ParamTree::None, ParamTree::None) => Ok(()),
            (expected, found) => Err(SchemaMismatch::Kind {
                path: path.clone(),
                expected: expected.kind(),
                found: found.kind(),
            }),
        }
    }
    walk(reference, candidate, &TreePath::root(), rule)
}

/// The values of a float leaf in float64 (`None` for other leaves).
fn floats(data: &ArrayData) -> Option<Box<dyn Iterator<Item = f64> + '_>> {
    match data {
        ArrayData::F32(values) => Some(Box::new(values.iter().map(|&x| f64::from(x)))),
        ArrayData::F16(values) => Some(Box::new(values.iter().map(|x| f64::from(x.to_f32())))),
        _ => None,
    }
}

/// The index of the first NaN or infinity in `values`. Every update a
/// server takes is scanned, and `position(|x| !x.is_finite())` runs one
/// value at a time (its early exit keeps the compiler from vectorizing it):
/// it cost a round's thread more than the aggregation. Blocks are tested
/// without an exit (all exponent bits set is what a non-finite float is),
/// and only a block with one is searched.
fn first_non_finite_f32(values: &[f32]) -> Option<usize> {
    const EXPONENT: u32 = 0x7f80_0000;
    const BLOCK: usize = 64;
    values.chunks(BLOCK).enumerate().find_map(|(block, chunk)| {
        let any = chunk
            .iter()
            .fold(false, |any, x| any | (x.to_bits() & EXPONENT == EXPONENT));
        any.then(|| {
            let within = chunk.iter().position(|x| !x.is_finite());
            block * BLOCK + within.expect("the block holds one")
        })
    })
}

#[cfg(test)]
pub(crate) mod strategies {
    //! proptest generators for trees, shared by the tree, codec and aggregation tests.
    use super::*;
    use proptest::prelude::*;

    pub fn array_data(len: usize) -> impl Strategy<Value = ArrayData> {
        prop_oneof![
            proptest::collection::vec(any::<f32>(), len).prop_map(ArrayData::F32),
            proptest::collection::vec(any::<u16>(), len)
                .prop_map(|v| ArrayData::F16(v.into_iter().map(f16::from_bits).collect())),
            proptest::collection::vec(any::<i64>(), len).prop_map(ArrayData::I64),
            proptest::collection::vec(any::<i32>(), len).prop_map(ArrayData::I32),
            proptest::collection::vec(any::<u8>(), len).prop_map(ArrayData::U8),
            proptest::collection::vec(any::<bool>(), len).prop_map(ArrayData::Bool),
        ]
    }

    pub fn array() -> impl Strategy<Value = Array> {
        proptest::collection::vec(0usize..4, 0..3).prop_flat_map(|shape| {
            let len = shape.iter().product::<usize>();
            array_data(len).prop_map(move |data| Array::new(shape.clone(), data).unwrap())
        })
    }

    pub fn tree() -> impl Strategy<Value = ParamTree> {
        let leaf = prop_oneof![
            4 => array().prop_map(ParamTree::Leaf),
            1 => Just(ParamTree::None),
        ];
        leaf.prop_recursive(4, 32, 4, |inner| {
            prop_oneof![
                proptest::collection::btree_map("[a-z_]{1,6}", inner.clone(), 0..4)
                    .prop_map(ParamTree::Map),
                proptest::collection::vec(inner.clone(), 0..4).prop_map(ParamTree::List),
                proptest::collection::vec(inner, 0..4).prop_map(ParamTree::Tuple),
            ]
        })
    }

    /// Float32 trees of one fixed random schema, `count` of them.
    pub fn same_schema_f32_trees(count: usize) -> impl Strategy<Value = Vec<ParamTree>> {
        let shapes = proptest::collection::btree_map(
            "[a-z]{1,4}",
            proptest::collection::vec(1usize..4, 0..3),
            1..4,
        );
        shapes.prop_flat_map(move |shapes| {
            let one = shapes
                .iter()
                .map(|(key, shape)| {
                    let key = key.clone();
                    let shape = shape.clone();
                    let len = shape.iter().product::<usize>();
                    proptest::collection::vec(-100.0f32..100.0, len).prop_map(move |values| {
                        (key.clone(), Array::f32(shape.clone(), values).unwrap())
                    })
                })
                .collect::<Vec<_>>();
            proptest::collection::vec(
                one.prop_map(|pairs| {
                    ParamTree::Map(
                        pairs
                            .into_iter()
                            .map(|(k, a)| (k, ParamTree::Leaf(a)))
                            .collect(),
                    )
                }),
                count,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::strategies::*;
    use super::*;
    use proptest::prelude::*;

    /// Whether structural change `kind` applies to `node`: 0 container kind,
    /// 1 missing key, 2 extra key, 3 length, 4 shape, 5 dtype.
    fn eligible(kind: usize, node: &ParamTree) -> bool {
        match (kind, node) {
            (0, ParamTree::Map(_) | ParamTree::List(_) | ParamTree::Tuple(_)) => true,
            (1, ParamTree::Map(map)) => !map.is_empty(),
            (2, ParamTree::Map(_)) => true,
            (3, ParamTree::List(_) | ParamTree::Tuple(_)) => true,
            (4 | 5, ParamTree::Leaf(_)) => true,
            _ => false,
        }
    }

    fn count_eligible(kind: usize, node: &ParamTree) -> usize {
        let own = usize::from(eligible(kind, node));
        own + match node {
            ParamTree::Map(map) => map.values().map(|c| count_eligible(kind, c)).sum(),
            ParamTree::List(items) | ParamTree::Tuple(items) => {
                items.iter().map(|c| count_eligible(kind, c)).sum()
            }
            _ => 0,
        }
    }

    fn apply(kind: usize, node: &mut ParamTree) {
        let changed = match (kind, &*node) {
            (0, ParamTree::Map(map)) => ParamTree::List(map.values().cloned().collect()),
            (0, ParamTree::List(items)) => ParamTree::Tuple(items.clone()),
            (0, ParamTree::Tuple(items)) => ParamTree::List(items.clone()),
            (1, ParamTree::Map(map)) => {
                let mut map = map.clone();
                let first = map
                    .keys()
                    .next()
                    .cloned()
                    .expect("eligible maps are non-empty");
                map.remove(&first);
                ParamTree::Map(map)
            }
            (2, ParamTree::Map(map)) => {
                let mut map = map.clone();
                map.insert("EXTRA".to_owned(), ParamTree::None);
                ParamTree::Map(map)
            }
            (3, ParamTree::List(items)) => {
                ParamTree::List([items.clone(), vec![ParamTree::None]].concat())
            }
            (3, ParamTree::Tuple(items)) => {
                ParamTree::Tuple([items.clone(), vec![ParamTree::None]].concat())
            }
            (4, ParamTree::Leaf(array)) => {
                let shape = [array.shape(), &[1]].concat();
                ParamTree::Leaf(Array::new(shape, array.data().clone()).unwrap())
            }
            (5, ParamTree::Leaf(array)) => {
                let len = array.len();
                let data = match array.dtype() {
                    DType::U8 => ArrayData::Bool(vec![false; len]),
                    _ => ArrayData::U8(vec![0; len]),
                };
                ParamTree::Leaf(Array::new(array.shape().to_vec(), data).unwrap())
            }
            _ => unreachable!("only eligible nodes are changed"),
        };
        *node = changed;
    }

    /// Applies change `kind` to the `target`-th eligible node, depth first.
    fn apply_at(kind: usize, node: &mut ParamTree, target: &mut usize) -> bool {
        if eligible(kind, node) {
            if *target == 0 {
                apply(kind, node);
                return true;
            }
            *target -= 1;
        }
        match node {
            ParamTree::Map(map) => map.values_mut().any(|c| apply_at(kind, c, target)),
            ParamTree::List(items) | ParamTree::Tuple(items) => {
                items.iter_mut().any(|c| apply_at(kind, c, target))
            }
            _ => false,
        }
    }

    /// Applies one structural change at a node chosen by `pick`; false when the
    /// tree has no node where that change applies.
    fn mutate(tree: &mut ParamTree, kind: usize, pick: proptest::sample::Index) -> bool {
        let count = count_eligible(kind, tree);
        if count == 0 {
            return false;
        }
        apply_at(kind, tree, &mut pick.index(count))
    }

    fn leaf(values: &[f32]) -> ParamTree {
        ParamTree::Leaf(Array::f32(vec![values.len()], values.to_vec()).unwrap())
    }

    #[test]
    fn array_rejects_element_count_that_does_not_match_shape() {
        let error = Array::f32(vec![2, 3], vec![0.0; 5]).unwrap_err();
        assert_eq!(error.expected, 6);
        assert_eq!(error.actual, 5);
    }

    #[test]
    fn dotted_paths_nest_into_maps() {
        let tree = ParamTree::from_dotted([
            (
                "conv1.weight".to_owned(),
                Array::f32(vec![1], vec![1.0]).unwrap(),
            ),
            (
                "conv1.bias".to_owned(),
                Array::f32(vec![1], vec![2.0]).unwrap(),
            ),
            (
                "fc.weight".to_owned(),
                Array::f32(vec![1], vec![3.0]).unwrap(),
            ),
        ]);
        let paths: Vec<String> = tree.leaves().iter().map(|(p, _)| p.to_string()).collect();
        assert_eq!(paths, ["conv1.bias", "conv1.weight", "fc.weight"]);
    }

    #[test]
    fn conflicting_dotted_paths_are_refused_not_dropped() {
        let one = || Array::f32(vec![1], vec![1.0]).unwrap();
        for pairs in [
            vec![("a".to_owned(), one()), ("a.b".to_owned(), one())],
            vec![("a.b".to_owned(), one()), ("a".to_owned(), one())],
            vec![("a".to_owned(), one()), ("a".to_owned(), one())],
        ] {
            assert!(ParamTree::try_from_dotted(pairs).is_err());
        }
    }

    #[test]
    fn path_display_marks_indices() {
        let path = TreePath::root()
            .child_key("layers")
            .child_index(2)
            .child_key("bias");
        assert_eq!(path.to_string(), "layers[2].bias");
    }

    #[test]
    fn empty_containers_and_none_survive_flattening() {
        let tree = ParamTree::Map(BTreeMap::from([
            ("empty_list".to_owned(), ParamTree::List(vec![])),
            ("empty_tuple".to_owned(), ParamTree::Tuple(vec![])),
            ("empty_map".to_owned(), ParamTree::Map(BTreeMap::new())),
            ("nothing".to_owned(), ParamTree::None),
            (
                "pair".to_owned(),
                ParamTree::Tuple(vec![leaf(&[1.0]), ParamTree::None]),
            ),
        ]));
        assert_eq!(tree.clone().flatten().unflatten().unwrap(), tree);
    }

    #[test]
    fn schema_check_names_each_kind_of_difference() {
        let reference = ParamTree::Map(BTreeMap::from([
            ("a".to_owned(), leaf(&[1.0, 2.0])),
            ("b".to_owned(), ParamTree::List(vec![leaf(&[1.0])])),
        ]));
        let mut missing = reference.clone();
        if let ParamTree::Map(map) = &mut missing {
            map.remove("a");
        }
        assert!(matches!(
            check_schema(&reference, &missing, DTypeRule::Exact),
            Err(SchemaMismatch::MissingKey { key, .. }) if key == "a"
        ));
        let mut tuple_for_list = reference.clone();
        if let ParamTree::Map(map) = &mut tuple_for_list {
            map.insert("b".to_owned(), ParamTree::Tuple(vec![leaf(&[1.0])]));
        }
        let error = check_schema(&reference, &tuple_for_list, DTypeRule::Exact).unwrap_err();
        assert_eq!(error.to_string(), "at `b`: expected a list, found a tuple");
    }

    proptest! {
        #[test]
        fn the_blockwise_scan_finds_the_first_non_finite_value(
            len in 0usize..300,
            marks in proptest::collection::vec((0usize..300, 0u8..3), 0..4),
        ) {
            let mut values: Vec<f32> = (0..len).map(|i| i as f32 * 0.5 - 40.0).collect();
            for (at, kind) in marks {
                if at < len {
                    values[at] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][kind as usize];
                }
            }
            prop_assert_eq!(
                first_non_finite_f32(&values),
                values.iter().position(|x| !x.is_finite())
            );
        }
    }

    proptest! {
        #[test]
        fn flatten_then_unflatten_is_identity(tree in tree()) {
            let flat = tree.clone().flatten();
            prop_assert_eq!(flat.leaves.len(), flat.skeleton.leaf_count());
            let paths: Vec<TreePath> = flat.leaves.iter().map(|(p, _)| p.clone()).collect();
            prop_assert_eq!(paths, flat.skeleton.leaf_paths());
            let rebuilt = flat.unflatten().unwrap();
            // Compare bitwise: NaN payloads must survive too.
            prop_assert_eq!(format!("{:?}", rebuilt.skeleton()), format!("{:?}", tree.skeleton()));
            let bits = |t: &ParamTree| t.leaves().iter().map(|(p, a)| (p.clone(), a.shape().to_vec(), a.data().to_le_bytes())).collect::<Vec<_>>();
            prop_assert_eq!(bits(&rebuilt), bits(&tree));
        }

        #[test]
        fn every_tree_matches_its_own_schema(tree in tree()) {
            prop_assert!(check_schema(&tree, &tree.clone(), DTypeRule::Exact).is_ok());
        }

        #[test]
        fn every_kind_of_structural_mismatch_is_detected(
            tree in tree(),
            mutation in 0usize..6,
            pick in any::<proptest::sample::Index>(),
        ) {
            let mut mutated = tree.clone();
            prop_assume!(mutate(&mut mutated, mutation, pick));
            prop_assert!(check_schema(&tree, &mutated, DTypeRule::Exact).is_err(),
                "mutation {} went unnoticed", mutation);
        }

        #[test]
        fn le_bytes_round_trip(array in array()) {
            let bytes = array.data().to_le_bytes();
            let back = ArrayData::from_le_bytes(array.dtype(), &bytes).unwrap();
            prop_assert_eq!(back.to_le_bytes(), bytes);
        }
    }
}
