//! Validated, sample-weighted federated averaging.
//!
//! [`fedavg`] is the one aggregation path of cohort: the simulation, the network
//! server and every test go through it. It validates everything before any
//! arithmetic, so a failing round leaves the global model untouched:
//!
//! 1. reports and payloads have equal counts;
//! 2. every weight is finite and non-negative;
//! 3. every payload has the schema of the global (reference) tree: container
//!    kinds, keys, sequence lengths, leaf shapes; no bfloat16 leaf anywhere.
//!
//! Then it streams through the client trees once, block by block, accumulating
//! in place into the output tree (no per-client temporaries), on all cores for
//! large leaves.
//!
//! # Leaf rules
//!
//! * **Float leaves** (float32 or float16 in a payload) are averaged by weight:
//!   `out = Σ (wᵢ / W) · xᵢ`, accumulated in float32, and stored in the
//!   reference leaf's dtype. The coefficients `wᵢ / W` are computed in float64
//!   and rounded once to float32.
//! * **Integer leaves** (counters such as BatchNorm's `num_batches_tracked`) are
//!   averaged by weight in float64 and rounded to the nearest integer (ties to
//!   even). The mean of values of a type always fits that type.
//! * **Boolean leaves** are not averaged: all clients with a non-zero weight
//!   must agree, and the agreed value is taken. Disagreement is an error.
//! * **Zero total weight** leaves the global model unchanged: no update, no error.
//!
//! [`MeanFold`] computes the same bits one update at a time, for a server
//! that keeps a round's updates on disk rather than in memory.

use rayon::prelude::*;

mod fold;
pub use fold::MeanFold;

use crate::tree::{
    Array, ArrayData, DType, DTypeRule, FlatTree, ParamTree, SchemaMismatch, TreePath, check_schema,
};

/// Leaves at least this large are split across threads.
const PARALLEL_MIN_ELEMENTS: usize = 1 << 16;
/// Smaller leaves of more than one block are split too once their
/// multiply-adds (elements × clients) reach this: a LeNet-5 leaf of 48,000
/// values over 1,000 clients is 48 million of them, which one core takes
/// about 15 ms for while the workers wait for the new model.
const PARALLEL_MIN_WORK: usize = 1 << 20;
/// Elements per block: small enough that the output block stays in cache while
/// every client's matching block streams past it.
const BLOCK_ELEMENTS: usize = 1 << 13;

/// Why aggregation refused a round. The global model is never changed when one
/// of these is returned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AggregationError {
    #[error("{reports} reports but {payloads} payloads: each report needs exactly one payload")]
    CountMismatch { reports: usize, payloads: usize },
    #[error("client {client_id}: sample weight {weight} is not finite and non-negative")]
    InvalidWeight { client_id: u32, weight: f64 },
    #[error("client {client_id}: payload does not match the global model: {mismatch}")]
    Schema {
        client_id: u32,
        #[source]
        mismatch: SchemaMismatch,
    },
    #[error(
        "client {client_id}: leaf `{path}` is bfloat16, which aggregation does not accept; \
         send float32 or float16 (nothing is cast silently)"
    )]
    BFloat16 { client_id: u32, path: TreePath },
    #[error(
        "leaf `{path}` is boolean and clients disagree on it (client {first_client} vs client \
         {other_client}); boolean leaves are taken, not averaged"
    )]
    BoolDisagreement {
        path: TreePath,
        first_client: u32,
        other_client: u32,
    },
    #[error("client {client_id}: element {index} of `{path}` is {value}")]
    NonFinite {
        client_id: u32,
        path: TreePath,
        index: usize,
        value: f32,
    },
    #[error(
        "the weighted average of element {index} of `{path}` overflows float32, though every \
         update is finite"
    )]
    Overflow { path: TreePath, index: usize },
}

/// One client's contribution: who sent it, how much it weighs, and the tree.
#[derive(Debug, Clone, Copy)]
pub struct Contribution<'a> {
    pub client_id: u32,
    pub weight: f64,
    pub tree: &'a ParamTree,
}

/// Result of [`fedavg`].
#[derive(Debug, Clone, PartialEq)]
pub enum FedAvgOutcome {
    Updated(ParamTree),
    /// The total weight was zero: the global model stays as it is.
    Unchanged,
}

/// Pairs reports (client id, weight) with payloads positionally, after checking
/// the counts agree.
pub fn pair_contributions<'a>(
    weights: &[(u32, f64)],
    payloads: &'a [ParamTree],
) -> Result<Vec<Contribution<'a>>, AggregationError> {
    if weights.len() != payloads.len() {
        return Err(AggregationError::CountMismatch {
            reports: weights.len(),
            payloads: payloads.len(),
        });
    }
    Ok(weights
        .iter()
        .zip(payloads)
        .map(|(&(client_id, weight), tree)| Contribution {
            client_id,
            weight,
            tree,
        })
        .collect())
}

/// Validates every contribution against `global` and returns their
/// sample-weighted average, or [`FedAvgOutcome::Unchanged`] when the total
/// weight is zero.
pub fn fedavg(
    global: &ParamTree,
    contributions: &[Contribution<'_>],
) -> Result<FedAvgOutcome, AggregationError> {
    validate(global, contributions)?;
    let total: f64 = contributions.iter().map(|c| c.weight).sum();
    if total == 0.0 || contributions.is_empty() {
        return Ok(FedAvgOutcome::Unchanged);
    }
    // Clients with zero weight contribute nothing; skipping them saves a pass.
    let active: Vec<ActiveClient<'_>> = contributions
        .iter()
        .filter(|c| c.weight > 0.0)
        .map(|c| ActiveClient {
            client_id: c.client_id,
            coefficient: c.weight / total,
            leaves: c
                .tree
                .leaves()
                .into_iter()
                .map(|(_, array)| array)
                .collect(),
        })
        .collect();

    // The output is built from the skeleton and fresh leaves: the global tree
    // is only read, never copied.
    let mut leaves = Vec::new();
    for (leaf_index, (path, reference)) in global.leaves().into_iter().enumerate() {
        let inputs: Vec<(u32, f64, &Array)> = active
            .iter()
            .map(|client| {
                (
                    client.client_id,
                    client.coefficient,
                    client.leaves[leaf_index],
                )
            })
            .collect();
        let averaged = average_leaf(reference, &path, &inputs)?;
        leaves.push((path, averaged));
    }
    let out = FlatTree {
        skeleton: global.skeleton(),
        leaves,
    }
    .unflatten()
    .expect("one averaged leaf per reference leaf");
    Ok(FedAvgOutcome::Updated(out))
}

struct ActiveClient<'a> {
    client_id: u32,
    /// `weight / total weight`.
    coefficient: f64,
    /// Leaves in depth-first order, as the reference's.
    leaves: Vec<&'a Array>,
}

/// Runs every check of [`fedavg`] without computing anything.
pub fn validate(
    global: &ParamTree,
    contributions: &[Contribution<'_>],
) -> Result<(), AggregationError> {
    for contribution in contributions {
        if !contribution.weight.is_finite() || contribution.weight < 0.0 {
            return Err(AggregationError::InvalidWeight {
                client_id: contribution.client_id,
                weight: contribution.weight,
            });
        }
    }
    for contribution in contributions {
        let mut bf16_path = None;
        contribution.tree.for_each_leaf(&mut |path, array| {
            if array.dtype() == DType::BF16 && bf16_path.is_none() {
                bf16_path = Some(path.clone());
            }
        });
        if let Some(path) = bf16_path {
            return Err(AggregationError::BFloat16 {
                client_id: contribution.client_id,
                path,
            });
        }
        check_schema(global, contribution.tree, DTypeRule::AnyFloat).map_err(|mismatch| {
            AggregationError::Schema {
                client_id: contribution.client_id,
                mismatch,
            }
        })?;
    }
    Ok(())
}

/// The average of `inputs` as a new array of the reference's shape and dtype.
fn average_leaf(
    reference: &Array,
    path: &TreePath,
    inputs: &[(u32, f64, &Array)],
) -> Result<Array, AggregationError> {
    let data = match reference.dtype() {
        DType::F32 | DType::F16 => {
            let mut accumulator = vec![0.0f32; reference.len()];
            accumulate_floats(&mut accumulator, inputs);
            // One pass over the output instead of one over every input: a
            // non-finite value anywhere makes its average non-finite.
            if let Some(index) = accumulator.iter().position(|x| !x.is_finite()) {
                return Err(non_finite(path, index, inputs));
            }
            match reference.dtype() {
                DType::F32 => ArrayData::F32(accumulator),
                _ => ArrayData::F16(accumulator.into_iter().map(half::f16::from_f32).collect()),
            }
        }
        DType::I64 | DType::I32 | DType::U8 => {
            let mut accumulator = vec![0.0f64; reference.len()];
            for (_, coefficient, array) in inputs {
                match array.data() {
                    ArrayData::I64(v) => {
                        axpy_f64(&mut accumulator, *coefficient, v.iter().map(|&x| x as f64))
                    }
                    ArrayData::I32(v) => {
                        axpy_f64(&mut accumulator, *coefficient, v.iter().map(|&x| x as f64))
                    }
                    ArrayData::U8(v) => {
                        axpy_f64(&mut accumulator, *coefficient, v.iter().map(|&x| x as f64))
                    }
                    _ => unreachable!("schema check guarantees the reference dtype"),
                }
            }
            let rounded = accumulator.into_iter().map(f64::round_ties_even);
            match reference.dtype() {
                DType::I64 => ArrayData::I64(rounded.map(|x| x as i64).collect()),
                DType::I32 => ArrayData::I32(rounded.map(|x| x as i32).collect()),
                _ => ArrayData::U8(rounded.map(|x| x as u8).collect()),
            }
        }
        DType::Bool => {
            let (first_client, _, first) = inputs[0];
            for (other_client, _, other) in &inputs[1..] {
                if other.data() != first.data() {
                    return Err(AggregationError::BoolDisagreement {
                        path: path.clone(),
                        first_client,
                        other_client: *other_client,
                    });
                }
            }
            first.data().clone()
        }
        DType::BF16 => unreachable!("validation rejects bfloat16 leaves"),
    };
    Ok(Array::new(reference.shape().to_vec(), data).expect("same element count as the reference"))
}

/// Who made element `index` of `path`'s average non-finite: the first
/// client whose value there is not finite, or the sum itself.
fn non_finite(path: &TreePath, index: usize, inputs: &[(u32, f64, &Array)]) -> AggregationError {
    for (client_id, _, array) in inputs {
        let value = match array.data() {
            ArrayData::F32(values) => values[index],
            ArrayData::F16(values) => values[index].to_f32(),
            _ => continue,
        };
        if !value.is_finite() {
            return AggregationError::NonFinite {
                client_id: *client_id,
                path: path.clone(),
                index,
                value,
            };
        }
    }
    AggregationError::Overflow {
        path: path.clone(),
        index,
    }
}

fn axpy_f64(accumulator: &mut [f64], coefficient: f64, values: impl Iterator<Item = f64>) {
    for (acc, x) in accumulator.iter_mut().zip(values) {
        *acc += coefficient * x;
    }
}

/// The float32 hot loop: block by block, every client's block is added into the
/// output block while it is in cache.
fn accumulate_floats(accumulator: &mut [f32], inputs: &[(u32, f64, &Array)]) {
    let coefficients: Vec<f32> = inputs.iter().map(|(_, c, _)| *c as f32).collect();
    let sources: Vec<&ArrayData> = inputs.iter().map(|(_, _, a)| a.data()).collect();
    let process_block = |(block_index, block): (usize, &mut [f32])| {
        let start = block_index * BLOCK_ELEMENTS;
        for (position, (coefficient, source)) in coefficients.iter().zip(&sources).enumerate() {
            match source {
                // The first client stores instead of adding: one pass less over the block.
                ArrayData::F32(values) if position == 0 => {
                    let values = &values[start..start + block.len()];
                    for (acc, &x) in block.iter_mut().zip(values) {
                        *acc = coefficient * x;
                    }
                }
                ArrayData::F32(values) => {
                    let values = &values[start..start + block.len()];
                    for (acc, &x) in block.iter_mut().zip(values) {
                        *acc += coefficient * x;
                    }
                }
                ArrayData::F16(values) => {
                    let values = &values[start..start + block.len()];
                    for (acc, x) in block.iter_mut().zip(values) {
                        *acc += coefficient * x.to_f32();
                    }
                }
                _ => unreachable!("schema check allows only float32 and float16 here"),
            }
        }
    };
    let work = accumulator.len().saturating_mul(inputs.len());
    let blocks = accumulator.len().div_ceil(BLOCK_ELEMENTS);
    if accumulator.len() >= PARALLEL_MIN_ELEMENTS || (blocks > 1 && work >= PARALLEL_MIN_WORK) {
        accumulator
            .par_chunks_mut(BLOCK_ELEMENTS)
            .enumerate()
            .for_each(process_block);
    } else {
        accumulator
            .chunks_mut(BLOCK_ELEMENTS)
            .enumerate()
            .for_each(process_block);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::strategies::same_schema_f32_trees;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn tree(values: &[f32]) -> ParamTree {
        ParamTree::Map(BTreeMap::from([(
            "w".to_owned(),
            ParamTree::Leaf(Array::f32(vec![values.len()], values.to_vec()).unwrap()),
        )]))
    }

    fn contributions<'a>(trees: &'a [ParamTree], weights: &[f64]) -> Vec<Contribution<'a>> {
        trees
            .iter()
            .zip(weights)
            .enumerate()
            .map(|(i, (tree, &weight))| Contribution {
                client_id: i as u32 + 1,
                weight,
                tree,
            })
            .collect()
    }

    fn values(outcome: FedAvgOutcome) -> Vec<f32> {
        match outcome {
            FedAvgOutcome::Updated(tree) => tree.leaves()[0].1.as_f32().unwrap().to_vec(),
            FedAvgOutcome::Unchanged => panic!("expected an update"),
        }
    }

    #[test]
    fn matches_hand_computed_weighted_mean() {
        let global = tree(&[0.0, 0.0]);
        let trees = [tree(&[1.0, 2.0]), tree(&[5.0, 10.0])];
        // 300 and 100 samples: (0.75·1 + 0.25·5, 0.75·2 + 0.25·10) = (2, 4).
        let result = fedavg(&global, &contributions(&trees, &[300.0, 100.0])).unwrap();
        assert_eq!(values(result), [2.0, 4.0]);
    }

    #[test]
    fn count_mismatch_is_refused() {
        let trees = [tree(&[1.0])];
        let error = pair_contributions(&[(1, 1.0), (2, 1.0)], &trees).unwrap_err();
        assert_eq!(
            error,
            AggregationError::CountMismatch {
                reports: 2,
                payloads: 1
            }
        );
    }

    #[test]
    fn nan_infinite_and_negative_weights_are_refused() {
        let global = tree(&[0.0]);
        let trees = [tree(&[1.0]), tree(&[2.0])];
        for bad in [f64::NAN, f64::INFINITY, -1.0] {
            let error = fedavg(&global, &contributions(&trees, &[1.0, bad])).unwrap_err();
            assert!(
                matches!(error, AggregationError::InvalidWeight { client_id: 2, .. }),
                "{error}"
            );
        }
    }

    #[test]
    fn non_finite_values_and_overflow_are_refused_naming_who_and_where() {
        let global = tree(&[0.0, 0.0]);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let trees = [tree(&[1.0, 2.0]), tree(&[3.0, bad])];
            let error = fedavg(&global, &contributions(&trees, &[1.0, 1.0])).unwrap_err();
            assert_eq!(
                error.to_string(),
                format!("client 2: element 1 of `w` is {bad}")
            );
        }
        // Where every input is finite, the sum itself is named (float32
        // rounding keeps even averages of maxima finite, so it is asked
        // directly).
        let finite = Array::f32(vec![2], vec![f32::MAX, 0.0]).unwrap();
        let path = global.leaves()[0].0.clone();
        let error = non_finite(&path, 0, &[(1, 1.0, &finite), (2, 1.0, &finite)]);
        assert!(
            matches!(error, AggregationError::Overflow { index: 0, .. }),
            "{error}"
        );
    }

    #[test]
    fn zero_total_weight_leaves_the_model_unchanged() {
        let global = tree(&[7.0]);
        let trees = [tree(&[1.0]), tree(&[2.0])];
        assert_eq!(
            fedavg(&global, &contributions(&trees, &[0.0, 0.0])).unwrap(),
            FedAvgOutcome::Unchanged
        );
    }

    #[test]
    fn bfloat16_leaf_is_refused_with_its_path() {
        let global = tree(&[0.0]);
        let bf16_tree = ParamTree::Map(BTreeMap::from([(
            "w".to_owned(),
            ParamTree::Leaf(Array::new(vec![1], ArrayData::BF16(vec![half::bf16::ONE])).unwrap()),
        )]));
        let trees = [bf16_tree];
        let error = fedavg(&global, &contributions(&trees, &[1.0])).unwrap_err();
        assert!(error.to_string().contains("`w` is bfloat16"), "{error}");
    }

    #[test]
    fn float16_payload_aggregates_into_float32_reference() {
        let global = tree(&[0.0]);
        let f16_tree = ParamTree::Map(BTreeMap::from([(
            "w".to_owned(),
            ParamTree::Leaf(
                Array::new(vec![1], ArrayData::F16(vec![half::f16::from_f32(3.0)])).unwrap(),
            ),
        )]));
        let trees = [f16_tree, tree(&[1.0])];
        assert_eq!(
            values(fedavg(&global, &contributions(&trees, &[1.0, 1.0])).unwrap()),
            [2.0]
        );
    }

    #[test]
    fn integer_leaves_take_the_rounded_weighted_mean() {
        let counter = |n: i64| {
            ParamTree::Map(BTreeMap::from([(
                "count".to_owned(),
                ParamTree::Leaf(Array::new(vec![], ArrayData::I64(vec![n])).unwrap()),
            )]))
        };
        let global = counter(0);
        let trees = [counter(10), counter(13)];
        let FedAvgOutcome::Updated(out) =
            fedavg(&global, &contributions(&trees, &[1.0, 1.0])).unwrap()
        else {
            panic!("expected update")
        };
        // (10 + 13) / 2 = 11.5, ties to even: 12.
        assert_eq!(out.leaves()[0].1.data(), &ArrayData::I64(vec![12]));
    }

    #[test]
    fn boolean_leaves_must_agree() {
        let flag = |b: bool| {
            ParamTree::Map(BTreeMap::from([(
                "flag".to_owned(),
                ParamTree::Leaf(Array::new(vec![1], ArrayData::Bool(vec![b])).unwrap()),
            )]))
        };
        let global = flag(false);
        let trees = [flag(true), flag(false)];
        let error = fedavg(&global, &contributions(&trees, &[1.0, 1.0])).unwrap_err();
        assert!(matches!(error, AggregationError::BoolDisagreement { .. }));
    }

    #[test]
    fn schema_mismatch_names_client_and_path() {
        let global = tree(&[0.0, 0.0]);
        let trees = [tree(&[1.0, 2.0]), tree(&[1.0])];
        let error = fedavg(&global, &contributions(&trees, &[1.0, 1.0])).unwrap_err();
        assert_eq!(
            error.to_string(),
            "client 2: payload does not match the global model: at `w`: expected shape [2], found [1]"
        );
    }

    #[test]
    fn large_leaves_take_the_parallel_path_and_agree_with_the_serial_one() {
        let n = PARALLEL_MIN_ELEMENTS * 3 + 17;
        let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..n).map(|i| -(i as f32) * 0.5).collect();
        let trees = [tree(&a), tree(&b)];
        let out =
            values(fedavg(&tree(&vec![0.0; n]), &contributions(&trees, &[3.0, 1.0])).unwrap());
        for i in [0, 1, BLOCK_ELEMENTS, n - 1] {
            let expected = 0.75f32 * a[i] + 0.25f32 * b[i];
            assert_eq!(out[i], expected, "element {i}");
        }
    }

    #[test]
    fn many_clients_split_a_leaf_of_a_few_blocks_with_the_serial_bits() {
        // 2 blocks and a bit, 128 clients: past PARALLEL_MIN_WORK, below
        // PARALLEL_MIN_ELEMENTS.
        let n = BLOCK_ELEMENTS * 2 + 5;
        let clients = 128;
        assert!(n < PARALLEL_MIN_ELEMENTS && n * clients >= PARALLEL_MIN_WORK);
        let trees: Vec<ParamTree> = (0..clients)
            .map(|c| {
                let values = (0..n).map(|i| ((i * 31 + c * 17) % 97) as f32 * 0.013 - 0.6);
                tree(&values.collect::<Vec<_>>())
            })
            .collect();
        let weights: Vec<f64> = (0..clients).map(|c| 1.0 + (c % 7) as f64).collect();
        let out = values(fedavg(&tree(&vec![0.0; n]), &contributions(&trees, &weights)).unwrap());
        let total: f64 = weights.iter().sum();
        for i in [
            0,
            1,
            BLOCK_ELEMENTS - 1,
            BLOCK_ELEMENTS,
            2 * BLOCK_ELEMENTS + 4,
        ] {
            let mut expected = 0.0f32;
            for (c, t) in trees.iter().enumerate() {
                let coefficient = (weights[c] / total) as f32;
                let x = t.leaves()[0].1.as_f32().unwrap()[i];
                expected = if c == 0 {
                    coefficient * x
                } else {
                    expected + coefficient * x
                };
            }
            assert_eq!(out[i].to_bits(), expected.to_bits(), "element {i}");
        }
    }

    proptest! {
        #[test]
        fn aggregating_identical_trees_returns_the_tree(
            trees in same_schema_f32_trees(1),
            weights in proptest::collection::vec(0.1f64..1000.0, 1..6),
        ) {
            let copies = vec![trees[0].clone(); weights.len()];
            let out = values_of(fedavg(&trees[0], &contributions(&copies, &weights)).unwrap());
            for (got, want) in out.iter().zip(flat(&trees[0])) {
                prop_assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "{got} vs {want}");
            }
        }

        #[test]
        fn permuting_clients_with_their_weights_changes_nothing(
            trees in same_schema_f32_trees(4),
            weights in proptest::collection::vec(0.0f64..1000.0, 4),
            rotation in 0usize..4,
        ) {
            prop_assume!(weights.iter().sum::<f64>() > 0.0);
            let base = values_of(fedavg(&trees[0], &contributions(&trees, &weights)).unwrap());
            let mut rotated_trees = trees.clone();
            rotated_trees.rotate_left(rotation);
            let mut rotated_weights = weights.clone();
            rotated_weights.rotate_left(rotation);
            let permuted = values_of(fedavg(&trees[0], &contributions(&rotated_trees, &rotated_weights)).unwrap());
            for (a, b) in base.iter().zip(&permuted) {
                prop_assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0), "{a} vs {b}");
            }
        }

        #[test]
        fn scaling_all_weights_changes_nothing(
            trees in same_schema_f32_trees(3),
            weights in proptest::collection::vec(0.1f64..1000.0, 3),
            scale in 0.001f64..1000.0,
        ) {
            let base = values_of(fedavg(&trees[0], &contributions(&trees, &weights)).unwrap());
            let scaled: Vec<f64> = weights.iter().map(|w| w * scale).collect();
            let other = values_of(fedavg(&trees[0], &contributions(&trees, &scaled)).unwrap());
            for (a, b) in base.iter().zip(&other) {
                prop_assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0), "{a} vs {b}");
            }
        }
    }

    fn flat(tree: &ParamTree) -> Vec<f32> {
        tree.leaves()
            .iter()
            .flat_map(|(_, a)| a.as_f32().unwrap().to_vec())
            .collect()
    }

    fn values_of(outcome: FedAvgOutcome) -> Vec<f32> {
        match outcome {
            FedAvgOutcome::Updated(tree) => flat(&tree),
            FedAvgOutcome::Unchanged => panic!("expected an update"),
        }
    }
}
