//! The tensor layout of every model outside the trainer: PyTorch's.
//!
//! A model tree, on the wire, in a strategy, in a checkpoint or in a model
//! file, has the names and shapes of the matching PyTorch module's
//! `state_dict` (`crates/cohort-train/src/params.rs` converts at the burn
//! boundary; nothing here or in any strategy, codec or checkpoint code knows
//! burn's layout). Its leaves are float32.
//!
//! One PyTorch tensor is not in the tree: BatchNorm's `num_batches_tracked`,
//! an int64 counter. cohort's BatchNorm (burn's) keeps no counter, and with a
//! momentum (0.1, PyTorch's default and cohort's) PyTorch never reads it, so
//! there is nothing to aggregate; carried in the tree it would be the one
//! integer leaf, which every strategy but FedAvg refuses. Model files need it,
//! though: PyTorch's `load_state_dict(strict=True)` expects every buffer. So
//! [`to_model_file`] adds it, int64 and 0 (a fresh PyTorch module's value),
//! beside every BatchNorm's `running_var` when a model file is written, and
//! [`from_model_file`] drops it, whatever its value (a file saved from PyTorch
//! holds its own count), when one is read.
//!
//! What this cannot check: that a file's tensors are the layout of the model
//! a run trains. Loading into the trainer does that, naming the leaf.

use std::collections::BTreeMap;

use crate::tree::{Array, ArrayData, ParamTree};

/// PyTorch's name for BatchNorm's counter of training batches.
pub const BATCH_COUNTER: &str = "num_batches_tracked";

/// The sibling leaf that marks a map as a BatchNorm layer.
const RUNNING_VAR: &str = "running_var";

/// `tree` as a model file holds it: with an int64 scalar
/// `num_batches_tracked` = 0 beside each BatchNorm's `running_var`, so the
/// file is a complete PyTorch `state_dict`. `None` when the tree has no
/// BatchNorm layer without one, so callers can write the tree's own bytes.
pub fn to_model_file(tree: &ParamTree) -> Option<ParamTree> {
    fn needs(node: &ParamTree) -> bool {
        match node {
            ParamTree::Map(map) => {
                (is_batch_norm(map) && !map.contains_key(BATCH_COUNTER)) || map.values().any(needs)
            }
            ParamTree::List(items) | ParamTree::Tuple(items) => items.iter().any(needs),
            ParamTree::Leaf(_) | ParamTree::None => false,
        }
    }
    fn add(node: &mut ParamTree) {
        match node {
            ParamTree::Map(map) => {
                map.values_mut().for_each(add);
                if is_batch_norm(map) && !map.contains_key(BATCH_COUNTER) {
                    let zero = Array::new(Vec::new(), ArrayData::I64(vec![0]))
                        .expect("a scalar holds one element");
                    map.insert(BATCH_COUNTER.to_owned(), ParamTree::Leaf(zero));
                }
            }
            ParamTree::List(items) | ParamTree::Tuple(items) => items.iter_mut().for_each(add),
            ParamTree::Leaf(_) | ParamTree::None => {}
        }
    }
    if !needs(tree) {
        return None;
    }
    let mut tree = tree.clone();
    add(&mut tree);
    Some(tree)
}

/// A model file's tree without BatchNorm's `num_batches_tracked`: what a run
/// trains and aggregates. Only an integer scalar of that name beside a
/// `running_var` is dropped; anything else stays, for the trainer's layout
/// check to name.
pub fn from_model_file(mut tree: ParamTree) -> ParamTree {
    fn strip(node: &mut ParamTree) {
        match node {
            ParamTree::Map(map) => {
                if is_batch_norm(map)
                    && map.get(BATCH_COUNTER).is_some_and(
                        |counter| matches!(counter, ParamTree::Leaf(a) if is_integer_scalar(a)),
                    )
                {
                    map.remove(BATCH_COUNTER);
                }
                map.values_mut().for_each(strip);
            }
            ParamTree::List(items) | ParamTree::Tuple(items) => items.iter_mut().for_each(strip),
            ParamTree::Leaf(_) | ParamTree::None => {}
        }
    }
    strip(&mut tree);
    tree
}

fn is_batch_norm(map: &BTreeMap<String, ParamTree>) -> bool {
    matches!(map.get(RUNNING_VAR), Some(ParamTree::Leaf(_)))
}

fn is_integer_scalar(array: &Array) -> bool {
    array.len() == 1 && matches!(array.data(), ArrayData::I64(_) | ArrayData::I32(_))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(shape: Vec<usize>, values: Vec<f32>) -> Array {
        Array::f32(shape, values).unwrap()
    }

    fn batch_norm_model() -> ParamTree {
        ParamTree::from_dotted([
            (
                "conv1.weight".to_owned(),
                leaf(vec![2, 1, 1, 1], vec![1.0, 2.0]),
            ),
            ("bn1.weight".to_owned(), leaf(vec![2], vec![1.0, 1.0])),
            ("bn1.bias".to_owned(), leaf(vec![2], vec![0.0, 0.0])),
            ("bn1.running_mean".to_owned(), leaf(vec![2], vec![0.0, 0.0])),
            ("bn1.running_var".to_owned(), leaf(vec![2], vec![1.0, 1.0])),
        ])
    }

    #[test]
    fn model_files_gain_an_int64_counter_per_batch_norm_and_lose_it_on_reading() {
        let tree = batch_norm_model();
        let file = to_model_file(&tree).expect("a BatchNorm layer gains its counter");
        let counter = file
            .leaves()
            .into_iter()
            .find(|(p, _)| p.to_string() == "bn1.num_batches_tracked")
            .map(|(_, a)| a.clone())
            .expect("the counter is in the file");
        assert_eq!(counter.shape(), &[] as &[usize]);
        assert_eq!(counter.data(), &ArrayData::I64(vec![0]));
        assert_eq!(from_model_file(file.clone()), tree);
        // A file that has it already (one PyTorch saved) is left alone.
        assert!(to_model_file(&file).is_none());
    }

    #[test]
    fn models_without_batch_norm_are_written_as_they_are() {
        let tree =
            ParamTree::from_dotted([("fc.weight".to_owned(), leaf(vec![1, 2], vec![1.0, 2.0]))]);
        assert!(to_model_file(&tree).is_none());
        assert_eq!(from_model_file(tree.clone()), tree);
    }

    #[test]
    fn a_counter_from_pytorch_is_dropped_whatever_its_count_but_nothing_else_is() {
        let mut with_count = batch_norm_model();
        if let ParamTree::Map(map) = &mut with_count
            && let Some(ParamTree::Map(bn)) = map.get_mut("bn1")
        {
            bn.insert(
                BATCH_COUNTER.to_owned(),
                ParamTree::Leaf(Array::new(vec![], ArrayData::I64(vec![938])).unwrap()),
            );
        }
        assert_eq!(from_model_file(with_count), batch_norm_model());
        // A float leaf of that name is not a counter: the trainer names it.
        let odd = ParamTree::from_dotted([
            ("bn1.running_var".to_owned(), leaf(vec![1], vec![1.0])),
            (
                "bn1.num_batches_tracked".to_owned(),
                leaf(vec![1], vec![3.0]),
            ),
        ]);
        assert_eq!(from_model_file(odd.clone()), odd);
    }
}
