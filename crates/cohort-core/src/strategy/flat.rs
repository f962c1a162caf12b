//! The floating-point leaves of a model as one flat `f32` vector.
//!
//! Every strategy but FedAvg does element-wise math on whole models (momentum,
//! moments, medians, distances). Doing it on one flat vector keeps that math
//! short and obviously element-wise; the layout turns vectors back into trees
//! of the global model's shape and dtypes.

use crate::aggregate::{Contribution, validate};
use crate::tree::{Array, ArrayData, DType, FlatTree, ParamTree, TreePath};

use super::{ClientUpdate, StrategyError};

/// Where each float leaf of a model lies in the flat vector.
#[derive(Debug, Clone, PartialEq)]
pub struct FloatLayout {
    leaves: Vec<(TreePath, usize)>,
    total: usize,
}

/// The layout of `global`. Integer and boolean leaves are refused: the
/// element-wise strategies have no meaning for them.
pub fn float_layout(
    strategy: &'static str,
    global: &ParamTree,
) -> Result<FloatLayout, StrategyError> {
    let mut leaves = Vec::new();
    let mut total = 0usize;
    let mut refused = None;
    global.for_each_leaf(&mut |path, array| {
        if refused.is_none() && !matches!(array.dtype(), DType::F32 | DType::F16) {
            refused = Some((path.to_string(), array.dtype()));
        }
        leaves.push((path.clone(), array.len()));
        total += array.len();
    });
    if let Some((path, dtype)) = refused {
        return Err(StrategyError::NonFloatLeaf {
            strategy,
            path,
            dtype,
        });
    }
    Ok(FloatLayout { leaves, total })
}

impl FloatLayout {
    /// Elements in the flat vector.
    pub fn len(&self) -> usize {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// The float leaves of `tree` (same schema as the layout's model),
    /// float16 widened to float32.
    pub fn flatten(&self, tree: &ParamTree) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.total);
        tree.for_each_leaf(&mut |_, array| match array.data() {
            ArrayData::F32(values) => out.extend_from_slice(values),
            ArrayData::F16(values) => out.extend(values.iter().map(|x| x.to_f32())),
            _ => unreachable!("the layout holds float leaves only"),
        });
        debug_assert_eq!(out.len(), self.total);
        out
    }

    /// A tree of `global`'s shape and dtypes holding `values`.
    pub fn rebuild(&self, global: &ParamTree, values: &[f32]) -> ParamTree {
        assert_eq!(values.len(), self.total, "one value per float element");
        let mut start = 0;
        let leaves = global
            .leaves()
            .into_iter()
            .map(|(path, reference)| {
                let part = &values[start..start + reference.len()];
                start += reference.len();
                let data = match reference.dtype() {
                    DType::F16 => {
                        ArrayData::F16(part.iter().map(|&x| half::f16::from_f32(x)).collect())
                    }
                    _ => ArrayData::F32(part.to_vec()),
                };
                let array = Array::new(reference.shape().to_vec(), data)
                    .expect("same element count as the reference");
                (path, array)
            })
            .collect();
        FlatTree {
            skeleton: global.skeleton(),
            leaves,
        }
        .unflatten()
        .expect("one leaf per reference leaf")
    }

    /// A vector of zeros of this layout.
    pub fn zeros(&self) -> Vec<f32> {
        vec![0.0; self.total]
    }

    /// Paths and lengths of the leaves, in order.
    pub fn leaves(&self) -> &[(TreePath, usize)] {
        &self.leaves
    }
}

/// The round's models as flat vectors, after every check FedAvg makes (counts,
/// schema, dtypes) and a finiteness check on every value.
pub(crate) struct FlatRound {
    pub layout: FloatLayout,
    pub global: Vec<f32>,
    pub updates: Vec<Vec<f32>>,
}

impl FlatRound {
    /// The mean of the updates weighted by their sample counts, or `None`
    /// when the counts are all zero.
    pub(crate) fn sample_weighted_mean(&self, updates: &[ClientUpdate<'_>]) -> Option<Vec<f32>> {
        let weights: Vec<f64> = updates.iter().map(|u| u.num_samples as f64).collect();
        if weights.iter().sum::<f64>() == 0.0 {
            return None;
        }
        let models: Vec<&[f32]> = self.updates.iter().map(Vec::as_slice).collect();
        Some(weighted_mean(&models, &weights))
    }
}

/// FedAvg's view of the updates: weighted by their sample counts.
pub(crate) fn contributions<'a>(updates: &[ClientUpdate<'a>]) -> Vec<Contribution<'a>> {
    updates
        .iter()
        .map(|u| Contribution {
            client_id: u.client_id,
            weight: u.num_samples as f64,
            tree: u.tree,
        })
        .collect()
}

pub(crate) fn flatten_round(
    strategy: &'static str,
    global: &ParamTree,
    updates: &[ClientUpdate<'_>],
) -> Result<FlatRound, StrategyError> {
    validate(global, &contributions(updates))?;
    let layout = float_layout(strategy, global)?;
    let flats = updates
        .iter()
        .map(|u| {
            let values = layout.flatten(u.tree);
            match values.iter().position(|x| !x.is_finite()) {
                Some(index) => Err(StrategyError::BadUpdate {
                    client_id: u.client_id,
                    problem: format!("element {index} of the update is {}", values[index]),
                }),
                None => Ok(values),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(FlatRound {
        global: layout.flatten(global),
        layout,
        updates: flats,
    })
}

/// For server steps from the round's mean (`Strategy::aggregate_mean`): the
/// layout, the global model and the mean as flat vectors.
pub(crate) fn flatten_mean(
    strategy: &'static str,
    global: &ParamTree,
    mean: &ParamTree,
) -> Result<(FloatLayout, Vec<f32>, Vec<f32>), StrategyError> {
    let layout = float_layout(strategy, global)?;
    let (current, average) = (layout.flatten(global), layout.flatten(mean));
    Ok((layout, current, average))
}

/// `a − b`, element-wise.
pub(crate) fn difference(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter().zip(b).map(|(x, y)| x - y).collect()
}

/// The unweighted mean of equally long vectors, accumulated in float64.
pub(crate) fn mean(vectors: &[&[f32]]) -> Vec<f32> {
    weighted_mean(vectors, &vec![1.0; vectors.len()])
}

/// `Σ wᵢ xᵢ / Σ wᵢ`, accumulated in float64; `weights` sum to more than 0.
pub(crate) fn weighted_mean(vectors: &[&[f32]], weights: &[f64]) -> Vec<f32> {
    let total: f64 = weights.iter().sum();
    let mut accumulator = vec![0.0f64; vectors.first().map_or(0, |v| v.len())];
    for (vector, weight) in vectors.iter().zip(weights) {
        let coefficient = weight / total;
        for (acc, &x) in accumulator.iter_mut().zip(vector.iter()) {
            *acc += coefficient * x as f64;
        }
    }
    accumulator.into_iter().map(|x| x as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn flatten_and_rebuild_round_trip_with_dtypes() {
        let tree = ParamTree::Map(BTreeMap::from([
            (
                "a".to_owned(),
                ParamTree::Leaf(Array::f32(vec![2], vec![1.0, 2.0]).unwrap()),
            ),
            (
                "b".to_owned(),
                ParamTree::Leaf(
                    Array::new(vec![1], ArrayData::F16(vec![half::f16::from_f32(3.0)])).unwrap(),
                ),
            ),
        ]));
        let layout = float_layout("test", &tree).unwrap();
        let flat = layout.flatten(&tree);
        assert_eq!(flat, [1.0, 2.0, 3.0]);
        assert_eq!(layout.rebuild(&tree, &flat), tree);
    }

    #[test]
    fn integer_leaves_are_refused_with_their_path() {
        let tree = ParamTree::from_dotted([(
            "bn.count".to_owned(),
            Array::new(vec![1], ArrayData::I64(vec![3])).unwrap(),
        )]);
        let error = float_layout("median", &tree).unwrap_err();
        assert!(error.to_string().contains("`bn.count` is"), "{error}");
    }

    #[test]
    fn means_are_hand_checked() {
        assert_eq!(mean(&[&[1.0, 2.0], &[3.0, 6.0]]), [2.0, 4.0]);
        assert_eq!(weighted_mean(&[&[1.0], &[5.0]], &[3.0, 1.0]), [2.0]);
    }
}
