//! [`fedavg`](super::fedavg) one client at a time: a server that cannot
//! hold every update of a round (they wait on disk) folds each into the sum
//! as it reads it back, and gets the same bits.
//!
//! The bits are the same because nothing about an element's sequence of
//! operations changes: `fedavg` walks blocks of elements and, inside a
//! block, clients in order; here the client is the outer loop, but each
//! element still starts from the first client's store (or `0.0 +` for a
//! float16 first input), then adds `(wᵢ/W)·xᵢ` in float32 in selection
//! order, with the coefficients and the total computed as `fedavg` computes
//! them. Every check and every error is `fedavg`'s, in the order `fedavg`
//! would report them.

use std::collections::BTreeMap;

use rayon::prelude::*;

use super::{AggregationError, Contribution, FedAvgOutcome, PARALLEL_MIN_ELEMENTS, validate};
use crate::tree::{Array, ArrayData, DType, FlatTree, ParamTree};

/// The sample-weighted mean of a round's updates, added one at a time in
/// selection order: [`MeanFold::new`] with every update's weight, then
/// [`MeanFold::add`] for each update in the same order, then
/// [`MeanFold::finish`]. Only the running sum is held, never the updates.
pub struct MeanFold<'g> {
    global: &'g ParamTree,
    weights: Vec<(u32, f64)>,
    /// `Σ wᵢ`, summed as `fedavg` sums it (all weights, in order).
    total: f64,
    /// How many updates were added so far.
    added: usize,
    /// Whether an update of non-zero weight was folded yet: the first one
    /// stores instead of adding, as in `fedavg`.
    started: bool,
    sums: Vec<LeafSum>,
}

/// One leaf of the reference model, as far as the fold has got.
enum LeafSum {
    Float {
        sum: Vec<f32>,
        /// Per element, the first client whose value there was not finite
        /// (what `fedavg` names when the average is not finite): empty for
        /// every update the server admits.
        first_bad: BTreeMap<usize, (u32, f32)>,
    },
    /// Integer leaves are averaged in float64, as `fedavg` does.
    Integer(Vec<f64>),
    /// The first contributing client's value, and the first who disagreed.
    Bool {
        first: Option<(u32, ArrayData)>,
        disagreeing: Option<u32>,
    },
}

impl<'g> MeanFold<'g> {
    /// A fold over updates of these `(client id, weight)`, in the order they
    /// will be added; a weight that is not finite and non-negative is
    /// refused here, as `fedavg` refuses it before anything else.
    pub fn new(global: &'g ParamTree, weights: Vec<(u32, f64)>) -> Result<Self, AggregationError> {
        if let Some(&(client_id, weight)) = weights
            .iter()
            .find(|(_, weight)| !weight.is_finite() || *weight < 0.0)
        {
            return Err(AggregationError::InvalidWeight { client_id, weight });
        }
        let total: f64 = weights.iter().map(|&(_, weight)| weight).sum();
        let sums = global
            .leaves()
            .into_iter()
            .map(|(_, reference)| match reference.dtype() {
                DType::F32 | DType::F16 => LeafSum::Float {
                    sum: vec![0.0; reference.len()],
                    first_bad: BTreeMap::new(),
                },
                DType::Bool => LeafSum::Bool {
                    first: None,
                    disagreeing: None,
                },
                _ => LeafSum::Integer(vec![0.0; reference.len()]),
            })
            .collect();
        Ok(Self {
            global,
            weights,
            total,
            added: 0,
            started: false,
            sums,
        })
    }

    /// Adds the next update (the one whose weight is next in `new`'s list),
    /// checked against the global model as `fedavg` checks each update.
    pub fn add(&mut self, tree: &ParamTree) -> Result<(), AggregationError> {
        let Some(&(client_id, weight)) = self.weights.get(self.added) else {
            return Err(AggregationError::CountMismatch {
                reports: self.weights.len(),
                payloads: self.added + 1,
            });
        };
        validate(
            self.global,
            &[Contribution {
                client_id,
                weight,
                tree,
            }],
        )?;
        self.added += 1;
        // Zero-weight clients contribute nothing, as in `fedavg` (which
        // also adds nothing when the total is zero).
        if weight == 0.0 || self.total == 0.0 {
            return Ok(());
        }
        let coefficient = weight / self.total;
        let first = !self.started;
        for (sum, (_, array)) in self.sums.iter_mut().zip(tree.leaves()) {
            sum.add(client_id, coefficient, array, first);
        }
        self.started = true;
        Ok(())
    }

    /// The mean, or [`FedAvgOutcome::Unchanged`] when the total weight is
    /// zero; the first leaf (in the model's order) whose average fails
    /// fails it, with `fedavg`'s error.
    pub fn finish(self) -> Result<FedAvgOutcome, AggregationError> {
        if self.added != self.weights.len() {
            return Err(AggregationError::CountMismatch {
                reports: self.weights.len(),
                payloads: self.added,
            });
        }
        if self.total == 0.0 || self.weights.is_empty() {
            return Ok(FedAvgOutcome::Unchanged);
        }
        let mut leaves = Vec::with_capacity(self.sums.len());
        for ((path, reference), sum) in self.global.leaves().into_iter().zip(self.sums) {
            let data = match sum {
                LeafSum::Float { sum, first_bad } => {
                    if let Some(index) = sum.iter().position(|x| !x.is_finite()) {
                        return Err(match first_bad.get(&index) {
                            Some(&(client_id, value)) => AggregationError::NonFinite {
                                client_id,
                                path,
                                index,
                                value,
                            },
                            None => AggregationError::Overflow { path, index },
                        });
                    }
                    match reference.dtype() {
                        DType::F32 => ArrayData::F32(sum),
                        _ => ArrayData::F16(sum.into_iter().map(half::f16::from_f32).collect()),
                    }
                }
                LeafSum::Integer(sum) => {
                    let rounded = sum.into_iter().map(f64::round_ties_even);
                    match reference.dtype() {
                        DType::I64 => ArrayData::I64(rounded.map(|x| x as i64).collect()),
                        DType::I32 => ArrayData::I32(rounded.map(|x| x as i32).collect()),
                        _ => ArrayData::U8(rounded.map(|x| x as u8).collect()),
                    }
                }
                LeafSum::Bool { first, disagreeing } => {
                    let (first_client, value) = first.expect("a client of non-zero weight");
                    if let Some(other_client) = disagreeing {
                        return Err(AggregationError::BoolDisagreement {
                            path,
                            first_client,
                            other_client,
                        });
                    }
                    value
                }
            };
            let array = Array::new(reference.shape().to_vec(), data)
                .expect("same element count as the reference");
            leaves.push((path, array));
        }
        let out = FlatTree {
            skeleton: self.global.skeleton(),
            leaves,
        }
        .unflatten()
        .expect("one averaged leaf per reference leaf");
        Ok(FedAvgOutcome::Updated(out))
    }
}

impl LeafSum {
    /// `coefficient · array` into this leaf: `first` when no client of
    /// non-zero weight came before.
    fn add(&mut self, client_id: u32, coefficient: f64, array: &Array, first: bool) {
        match self {
            LeafSum::Float { sum, first_bad } => {
                note_non_finite(first_bad, client_id, array.data());
                add_floats(sum, coefficient as f32, array.data(), first);
            }
            LeafSum::Integer(sum) => {
                let values: Box<dyn Iterator<Item = f64>> = match array.data() {
                    ArrayData::I64(v) => Box::new(v.iter().map(|&x| x as f64)),
                    ArrayData::I32(v) => Box::new(v.iter().map(|&x| x as f64)),
                    ArrayData::U8(v) => Box::new(v.iter().map(|&x| x as f64)),
                    _ => unreachable!("schema check guarantees the reference dtype"),
                };
                for (acc, x) in sum.iter_mut().zip(values) {
                    *acc += coefficient * x;
                }
            }
            LeafSum::Bool { first, disagreeing } => match first {
                None => *first = Some((client_id, array.data().clone())),
                Some((_, value)) => {
                    if disagreeing.is_none() && value != array.data() {
                        *disagreeing = Some(client_id);
                    }
                }
            },
        }
    }
}

/// Remembers, for each element not yet named, `client_id` when its value
/// there is not finite. The scan is one cheap pass; the map grows only for
/// updates no admitted client sends.
fn note_non_finite(first_bad: &mut BTreeMap<usize, (u32, f32)>, client_id: u32, data: &ArrayData) {
    let values: Box<dyn Iterator<Item = f32>> = match data {
        ArrayData::F32(values) if values.iter().all(|x| x.is_finite()) => return,
        ArrayData::F32(values) => Box::new(values.iter().copied()),
        ArrayData::F16(values) => Box::new(values.iter().map(|x| x.to_f32())),
        _ => unreachable!("schema check allows only float32 and float16 here"),
    };
    for (index, value) in values.enumerate() {
        if !value.is_finite() {
            first_bad.entry(index).or_insert((client_id, value));
        }
    }
}

/// `fedavg`'s per-element step for one client: a float32 first client
/// stores, every other input adds.
fn add_floats(sum: &mut [f32], coefficient: f32, data: &ArrayData, first: bool) {
    let step = |chunk: (&mut [f32], usize)| {
        let (sum, start) = chunk;
        let end = start + sum.len();
        match data {
            ArrayData::F32(values) if first => {
                for (acc, &x) in sum.iter_mut().zip(&values[start..end]) {
                    *acc = coefficient * x;
                }
            }
            ArrayData::F32(values) => {
                for (acc, &x) in sum.iter_mut().zip(&values[start..end]) {
                    *acc += coefficient * x;
                }
            }
            ArrayData::F16(values) => {
                for (acc, x) in sum.iter_mut().zip(&values[start..end]) {
                    *acc += coefficient * x.to_f32();
                }
            }
            _ => unreachable!("schema check allows only float32 and float16 here"),
        }
    };
    const CHUNK: usize = PARALLEL_MIN_ELEMENTS / 4;
    if sum.len() >= PARALLEL_MIN_ELEMENTS {
        sum.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(i, chunk)| step((chunk, i * CHUNK)));
    } else {
        step((sum, 0));
    }
}

#[cfg(test)]
mod tests {
    use super::super::fedavg;
    use super::*;
    use proptest::prelude::*;

    /// `fedavg` and the fold over the same round, as results and errors.
    fn both(
        global: &ParamTree,
        trees: &[ParamTree],
        weights: &[f64],
    ) -> (
        Result<FedAvgOutcome, AggregationError>,
        Result<FedAvgOutcome, AggregationError>,
    ) {
        let contributions: Vec<Contribution<'_>> = trees
            .iter()
            .zip(weights)
            .enumerate()
            .map(|(i, (tree, &weight))| Contribution {
                client_id: i as u32 + 1,
                weight,
                tree,
            })
            .collect();
        let whole = fedavg(global, &contributions);
        let ids = (1..).zip(weights.iter().copied()).collect();
        let folded = MeanFold::new(global, ids).and_then(|mut fold| {
            trees.iter().try_for_each(|tree| fold.add(tree))?;
            fold.finish()
        });
        (whole, folded)
    }

    /// Bits, not values: `-0.0 == 0.0` and `NaN != NaN` would hide a
    /// difference or invent one.
    fn bits(outcome: &Result<FedAvgOutcome, AggregationError>) -> String {
        match outcome {
            Ok(FedAvgOutcome::Updated(tree)) => tree
                .leaves()
                .iter()
                .map(|(path, array)| format!("{path}:{:?}", array.data().to_le_bytes()))
                .collect::<Vec<_>>()
                .join(";"),
            other => format!("{other:?}"),
        }
    }

    /// A round: one schema of 1–3 leaves (a dtype each), its global model,
    /// and 1–6 updates whose float leaves are float32 or float16 each.
    fn round() -> impl Strategy<Value = (ParamTree, Vec<ParamTree>, Vec<f64>)> {
        let leaf = (0usize..6, 1usize..40);
        proptest::collection::vec(leaf, 1..4).prop_flat_map(|leaves| {
            let count = 1usize..7;
            (Just(leaves), count).prop_flat_map(|(leaves, count)| {
                let trees = proptest::collection::vec(tree_of(leaves.clone()), count + 1);
                let weights = proptest::collection::vec(
                    prop_oneof![3 => 0.0f64..1e4, 1 => Just(0.0), 1 => (1u32..100).prop_map(f64::from)],
                    count,
                );
                (trees, weights).prop_map(|(mut trees, weights)| {
                    let global = trees.remove(0);
                    (global, trees, weights)
                })
            })
        })
    }

    /// A tree of `leaves` (`kind`, length): kinds 0–1 float (either float
    /// dtype in each tree), 2 i64, 3 i32, 4 u8, 5 bool, drawn from few
    /// values so that clients often agree on booleans.
    fn tree_of(leaves: Vec<(usize, usize)>) -> impl Strategy<Value = ParamTree> {
        let arrays: Vec<_> = leaves
            .into_iter()
            .map(|(kind, len)| {
                let data: BoxedStrategy<ArrayData> = match kind {
                    0 | 1 => prop_oneof![
                        3 => proptest::collection::vec(
                            prop_oneof![8 => -1e3f32..1e3, 1 => Just(-0.0f32), 1 => any::<f32>()],
                            len
                        )
                        .prop_map(ArrayData::F32),
                        1 => proptest::collection::vec(any::<u16>(), len).prop_map(|v| {
                            ArrayData::F16(v.into_iter().map(half::f16::from_bits).collect())
                        }),
                    ]
                    .boxed(),
                    2 => proptest::collection::vec(-1000i64..1000, len)
                        .prop_map(ArrayData::I64)
                        .boxed(),
                    3 => proptest::collection::vec(any::<i32>(), len)
                        .prop_map(ArrayData::I32)
                        .boxed(),
                    4 => proptest::collection::vec(any::<u8>(), len)
                        .prop_map(ArrayData::U8)
                        .boxed(),
                    _ => proptest::collection::vec(proptest::bool::weighted(0.97), len)
                        .prop_map(ArrayData::Bool)
                        .boxed(),
                };
                data.prop_map(move |data| Array::new(vec![len], data).unwrap())
            })
            .collect();
        arrays.prop_map(|arrays| {
            ParamTree::Map(
                arrays
                    .into_iter()
                    .enumerate()
                    .map(|(i, array)| (format!("l{i}"), ParamTree::Leaf(array)))
                    .collect(),
            )
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        /// Same bits, or the same error, on any round: weights with zeros,
        /// float16 and float32 inputs, integer and boolean leaves, values
        /// that are not finite.
        #[test]
        fn folding_one_at_a_time_is_fedavg_bit_for_bit((global, trees, weights) in round()) {
            let (whole, folded) = both(&global, &trees, &weights);
            prop_assert_eq!(bits(&whole), bits(&folded));
        }
    }

    #[test]
    fn a_large_leaf_split_across_threads_gives_the_same_bits() {
        let len = PARALLEL_MIN_ELEMENTS + 123;
        let tree = |seed: u32| {
            let values = (0..len as u32)
                .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 10_007) as f32 * 1e-3 - 5.0)
                .collect();
            ParamTree::Leaf(Array::f32(vec![len], values).unwrap())
        };
        let trees = [tree(1), tree(2), tree(3)];
        let (whole, folded) = both(&tree(0), &trees, &[3.0, 0.0, 7.5]);
        assert!(matches!(whole, Ok(FedAvgOutcome::Updated(_))));
        assert_eq!(bits(&whole), bits(&folded));
    }

    #[test]
    fn errors_are_fedavgs_and_in_its_order() {
        let leaf = |values: &[f32]| {
            ParamTree::from_dotted([(
                "w".to_owned(),
                Array::f32(vec![2], values.to_vec()).unwrap(),
            )])
        };
        let global = leaf(&[0.0, 0.0]);
        // A bad weight is named before anything else.
        let (whole, folded) = both(&global, &[leaf(&[1.0, 1.0])], &[f64::NAN]);
        assert!(matches!(whole, Err(AggregationError::InvalidWeight { .. })));
        assert_eq!(bits(&whole), bits(&folded));
        // The first client whose value is not finite, not the first sum.
        let trees = [
            leaf(&[1.0, 1.0]),
            leaf(&[f32::NAN, 1.0]),
            leaf(&[f32::INFINITY, 1.0]),
        ];
        let (whole, folded) = both(&global, &trees, &[1.0, 1.0, 1.0]);
        assert_eq!(
            whole.as_ref().unwrap_err().to_string(),
            "client 2: element 0 of `w` is NaN"
        );
        assert_eq!(bits(&whole), bits(&folded));
        // Fewer updates than weights, or more.
        let mut fold = MeanFold::new(&global, vec![(1, 1.0), (2, 1.0)]).unwrap();
        fold.add(&leaf(&[1.0, 1.0])).unwrap();
        assert!(matches!(
            fold.finish(),
            Err(AggregationError::CountMismatch {
                reports: 2,
                payloads: 1
            })
        ));
        let mut fold = MeanFold::new(&global, vec![(1, 1.0)]).unwrap();
        fold.add(&leaf(&[1.0, 1.0])).unwrap();
        assert!(fold.add(&leaf(&[1.0, 1.0])).is_err());
    }
}
