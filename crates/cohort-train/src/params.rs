//! Moving parameters between a burn module and a host [`ParamTree`].
//!
//! This is the one place where burn's layout meets cohort's. Every tree outside
//! a burn module (what strategies aggregate, what travels on the wire, model
//! files and checkpoints) is in **PyTorch's layout**: a module's `state_dict`
//! names and shapes. burn differs in two ways, both undone here and nowhere
//! else:
//!
//! * a linear layer's weight is `[in, out]` in burn and `[out, in]` in PyTorch:
//!   transposed on the way out and back on the way in. A transpose only moves
//!   elements, so element-wise aggregation gives the same numbers either way;
//! * BatchNorm's and GroupNorm's affine parameters are `gamma`/`beta` in
//!   burn and `weight`/`bias` in PyTorch: renamed. BatchNorm's `running_mean`
//!   and `running_var` have the same names in both; GroupNorm has no buffers.
//!
//! PyTorch's `num_batches_tracked` counter has no burn counterpart and is not in
//! the tree; model files add it ([`cohort_core::layout`]).
//!
//! Extraction copies every float parameter to host memory, so the tree is a
//! snapshot that later training cannot change. Loading checks that the tree has
//! exactly the module's parameters, with PyTorch's shapes, in float32 (the
//! training dtype; nothing is cast silently), before the module is changed.

use std::collections::{BTreeMap, BTreeSet};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Tensor, TensorData};
use cohort_core::tree::{Array, DType, ParamTree};

use crate::kernels::transposed;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    #[error("the model has parameter `{0}` but the tree has no such leaf")]
    Missing(String),
    #[error("the tree has leaf `{leaf}`, which the model does not have{hint}", leaf = .0, hint = renamed_hint(.0))]
    Unexpected(String),
    #[error(
        "parameter `{path}`: the model's shape in PyTorch layout is {model:?}, the tree's is \
         {tree:?}{}",
        transposed_hint(model, tree)
    )]
    Shape {
        path: String,
        model: Vec<usize>,
        tree: Vec<usize>,
    },
    #[error("parameter `{path}` is {dtype} in the tree; models load float32 only")]
    DType { path: String, dtype: DType },
}

/// BatchNorm's burn names are what a model file written before cohort used
/// PyTorch's layout holds.
fn renamed_hint(path: &str) -> String {
    let pytorch = if path.ends_with(".gamma") {
        "weight"
    } else if path.ends_with(".beta") {
        "bias"
    } else {
        return String::new();
    };
    format!(
        " (BatchNorm's `{}` is `{pytorch}` in PyTorch's layout, which cohort uses; files \
         written by cohort before it used PyTorch's layout have burn's names)",
        path.rsplit('.').next().unwrap_or_default()
    )
}

/// A weight stored the other way round is what a model file written before
/// cohort used PyTorch's layout holds; say so rather than leave the user to
/// spot the swapped numbers.
fn transposed_hint(model: &[usize], tree: &[usize]) -> &'static str {
    if model.len() == 2 && model.iter().rev().eq(tree.iter()) {
        " (transposed: a linear weight must be [out, in], PyTorch's layout; files written \
         by cohort before it used PyTorch's layout hold [in, out])"
    } else {
        ""
    }
}

/// Dotted paths of a module's fields in PyTorch's naming, without enum variant
/// names, so the same layer has the same name whichever variant of a model
/// enum holds it.
#[derive(Default)]
pub(crate) struct PathStack {
    entries: Vec<Entry>,
}

/// One entered field: burn calls `enter_module(field, holder)`.
struct Entry {
    /// The field's name in PyTorch's naming.
    name: String,
    /// The type holding the field (`Struct:Linear`, `Vec`, `Enum:Norm`).
    holder: String,
    /// An enum variant: no part of the name.
    skipped: bool,
}

/// Where a parameter of a burn `Lstm` lives in PyTorch's `nn.LSTM`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LstmSlot {
    /// PyTorch's name of the stacked tensor, such as `lstm.weight_ih_l1`.
    pub(crate) name: String,
    /// The gate's block of rows in it: PyTorch stacks i, f, g, o.
    pub(crate) gate: usize,
}

/// PyTorch's order of an LSTM's gates (`weight_ih_l0` is
/// `[W_ii | W_if | W_ig | W_io]`) in burn's names.
const LSTM_GATES: [&str; 4] = ["input_gate", "forget_gate", "cell_gate", "output_gate"];

impl PathStack {
    pub(crate) fn enter(&mut self, name: &str, container_type: &str) {
        let name = match (container_type, name) {
            ("Struct:BatchNorm" | "Struct:GroupNorm", "gamma") => "weight",
            ("Struct:BatchNorm" | "Struct:GroupNorm", "beta") => "bias",
            _ => name,
        };
        self.entries.push(Entry {
            name: name.to_owned(),
            holder: container_type.to_owned(),
            skipped: container_type.starts_with("Enum:"),
        });
    }

    pub(crate) fn exit(&mut self) {
        self.entries.pop();
    }

    /// The dotted name of the first `count` entries.
    fn joined(&self, count: usize) -> String {
        let names: Vec<&str> = self.entries[..count]
            .iter()
            .filter(|e| !e.skipped)
            .map(|e| e.name.as_str())
            .collect();
        names.join(".")
    }

    /// The current parameter's name in PyTorch's layout (for a parameter of
    /// an LSTM, burn's path; see [`PathStack::lstm_slot`]).
    pub(crate) fn current(&self) -> String {
        self.joined(self.entries.len())
    }

    /// Whether the current parameter is a linear layer's weight, which burn
    /// stores transposed.
    pub(crate) fn in_burn_order(&self) -> bool {
        self.entries
            .last()
            .is_some_and(|e| e.holder == "Struct:Linear" && e.name == "weight")
    }

    /// For a parameter of a burn `Lstm` (`{gate}.{input,hidden}_transform.
    /// {weight,bias}`), its place in PyTorch's `nn.LSTM`: a `Vec<Lstm>` field
    /// `lstm` is one `nn.LSTM` named `lstm` with a layer per element
    /// (`lstm.weight_ih_l{k}`), a lone `Lstm` field one with a single layer.
    pub(crate) fn lstm_slot(&self) -> Option<LstmSlot> {
        let at = self
            .entries
            .iter()
            .position(|e| e.holder == "Struct:Lstm")?;
        let gate = LSTM_GATES
            .iter()
            .position(|g| *g == self.entries[at].name)?;
        let transform = match self.entries.get(at + 1)?.name.as_str() {
            "input_transform" => "ih",
            "hidden_transform" => "hh",
            _ => return None,
        };
        let kind = self.entries.get(at + 2)?.name.clone();
        let (prefix, layer) = match at.checked_sub(1).map(|i| &self.entries[i]) {
            Some(e) if e.holder == "Vec" => (self.joined(at - 1), e.name.clone()),
            _ => (self.joined(at), "0".to_owned()),
        };
        let prefix = if prefix.is_empty() {
            String::new()
        } else {
            format!("{prefix}.")
        };
        Some(LstmSlot {
            name: format!("{prefix}{kind}_{transform}_l{layer}"),
            gate,
        })
    }
}

/// A burn parameter of `shape` holding `data` as the tree holds it,
/// without copying `data` again: a linear weight transposed straight from
/// it, any other parameter its values themselves (every client's update is
/// read so, once a round).
fn to_external(shape: Vec<usize>, data: TensorData, linear_weight: bool) -> Array {
    const FLOAT32: &str = "float parameters of a float32 model convert to f32";
    let (shape, values) = match (linear_weight, shape.as_slice()) {
        (true, &[input, output]) => {
            let values = data.as_slice::<f32>().expect(FLOAT32);
            (vec![output, input], transposed(values, input, output))
        }
        _ => (shape, data.try_into_vec::<f32>().expect(FLOAT32)),
    };
    Array::f32(shape, values).expect("burn tensors hold shape-product elements")
}

/// The values of the tree's leaf `array` in burn's order for the parameter
/// `path` of burn shape `model_shape`, after checking shape and dtype.
pub(crate) fn to_burn(
    path: &str,
    model_shape: &[usize],
    array: &Array,
    linear_weight: bool,
) -> Result<Vec<f32>, LoadError> {
    let external: Vec<usize> = match (linear_weight, model_shape) {
        (true, &[input, output]) => vec![output, input],
        _ => model_shape.to_vec(),
    };
    if array.shape() != external.as_slice() {
        return Err(LoadError::Shape {
            path: path.to_owned(),
            model: external,
            tree: array.shape().to_vec(),
        });
    }
    let Some(values) = array.as_f32() else {
        return Err(LoadError::DType {
            path: path.to_owned(),
            dtype: array.dtype(),
        });
    };
    Ok(match (linear_weight, model_shape) {
        (true, &[input, output]) => transposed(values, output, input),
        _ => values.to_vec(),
    })
}

/// The values, in burn's order, of the parameter at `path` (of burn shape
/// `model_shape`) from the tree's leaves (PyTorch's layout, looked up by
/// `leaf`), with the name of the leaf they came from: for an LSTM's
/// parameter, its gate's rows of PyTorch's stacked tensor.
pub(crate) fn leaf_values<'a>(
    path: &PathStack,
    model_shape: &[usize],
    leaf: impl Fn(&str) -> Option<&'a Array>,
) -> Result<(String, Vec<f32>), LoadError> {
    let linear = path.in_burn_order();
    let Some(slot) = path.lstm_slot() else {
        let name = path.current();
        let array = leaf(&name).ok_or_else(|| LoadError::Missing(name.clone()))?;
        return to_burn(&name, model_shape, array, linear).map(|values| (name, values));
    };
    let array = leaf(&slot.name).ok_or_else(|| LoadError::Missing(slot.name.clone()))?;
    let rows = lstm_gate_rows(&slot, model_shape, linear, array)?;
    to_burn(&slot.name, model_shape, &rows, linear).map(|values| (slot.name, values))
}

/// The rows of `slot`'s gate in PyTorch's stacked LSTM tensor `array`, which
/// must be `[4·rows, …]` for a gate parameter of burn shape `model_shape`.
fn lstm_gate_rows(
    slot: &LstmSlot,
    model_shape: &[usize],
    linear: bool,
    array: &Array,
) -> Result<Array, LoadError> {
    let gate: Vec<usize> = match (linear, model_shape) {
        (true, &[input, output]) => vec![output, input],
        _ => model_shape.to_vec(),
    };
    let mut stacked = gate.clone();
    stacked[0] *= LSTM_GATES.len();
    if array.shape() != stacked.as_slice() {
        return Err(LoadError::Shape {
            path: slot.name.clone(),
            model: stacked,
            tree: array.shape().to_vec(),
        });
    }
    let Some(values) = array.as_f32() else {
        return Err(LoadError::DType {
            path: slot.name.clone(),
            dtype: array.dtype(),
        });
    };
    let block: usize = gate.iter().product();
    let rows = values[slot.gate * block..(slot.gate + 1) * block].to_vec();
    Ok(Array::f32(gate, rows).expect("a gate's block has its shape's elements"))
}

/// An LSTM's four gate blocks, each `[rows, …]` in PyTorch's layout, as
/// PyTorch's one `[4·rows, …]` tensor in its gate order.
fn stack_gates(name: &str, gates: [Option<Array>; 4]) -> Array {
    let gates: Vec<Array> = gates
        .into_iter()
        .map(|gate| {
            gate.unwrap_or_else(|| {
                panic!(
                    "`{name}`: an LSTM without all four gates (burn's `input_forget`) has no \
                     PyTorch layout"
                )
            })
        })
        .collect();
    let mut shape = gates[0].shape().to_vec();
    shape[0] *= gates.len();
    let values: Vec<f32> = gates
        .iter()
        .flat_map(|gate| gate.as_f32().expect("extracted float32").iter().copied())
        .collect();
    Array::f32(shape, values).expect("four blocks of one shape")
}

struct Extractor {
    path: PathStack,
    leaves: Vec<(String, Array)>,
    /// LSTM parameters by PyTorch's stacked name, one block per gate.
    lstm: BTreeMap<String, [Option<Array>; 4]>,
}

impl ModuleVisitor for Extractor {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.enter(name, container_type);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let tensor = param.val();
        let shape = tensor.dims().to_vec();
        let array = to_external(shape, tensor.into_data(), self.path.in_burn_order());
        match self.path.lstm_slot() {
            Some(slot) => self.lstm.entry(slot.name).or_default()[slot.gate] = Some(array),
            None => self.leaves.push((self.path.current(), array)),
        }
    }
}

/// A host snapshot of every float parameter of `module`, in PyTorch's layout.
pub fn extract<M: Module>(module: &M) -> ParamTree {
    let mut extractor = Extractor {
        path: PathStack::default(),
        leaves: Vec::new(),
        lstm: BTreeMap::new(),
    };
    module.visit(&mut extractor);
    let lstm = std::mem::take(&mut extractor.lstm);
    let stacked = lstm
        .into_iter()
        .map(|(name, gates)| (name.clone(), stack_gates(&name, gates)));
    ParamTree::from_dotted(extractor.leaves.into_iter().chain(stacked))
}

struct Loader<'a> {
    path: PathStack,
    leaves: BTreeMap<String, &'a Array>,
    used: BTreeSet<String>,
    error: Option<LoadError>,
}

impl ModuleMapper for Loader<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.enter(name, container_type);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.error.is_some() {
            return param;
        }
        let model_shape = param.lazy_shape().to_vec();
        let found = leaf_values(&self.path, &model_shape, |name| {
            self.leaves.get(name).copied()
        });
        let (path, values) = match found {
            Ok(found) => found,
            Err(error) => {
                self.error = Some(error);
                return param;
            }
        };
        let device = param.lazy_device();
        let tensor = Tensor::<D>::from_data(TensorData::new(values, model_shape), &device);
        let id = param.id;
        self.used.insert(path);
        param.transform_for_load(tensor, id)
    }
}

/// Checks `tree` (PyTorch's layout) against the module's parameters, then
/// loads it. On error the returned module is not produced, and the caller's
/// module was consumed: keep a clone when a failure must leave the model usable.
pub fn load<M: Module>(module: M, tree: &ParamTree) -> Result<M, LoadError> {
    let leaves: BTreeMap<String, &Array> = tree
        .leaves()
        .into_iter()
        .map(|(path, array)| (path.to_string(), array))
        .collect();
    // burn's BatchNorm names never appear in PyTorch's layout: name the old
    // file's leaf rather than the new name it lacks.
    if let Some(old) = leaves
        .keys()
        .find(|k| k.ends_with(".gamma") || k.ends_with(".beta"))
    {
        return Err(LoadError::Unexpected(old.clone()));
    }
    let mut loader = Loader {
        path: PathStack::default(),
        leaves,
        used: BTreeSet::new(),
        error: None,
    };
    let loaded = module.map(&mut loader);
    if let Some(error) = loader.error {
        return Err(error);
    }
    if let Some(extra) = loader.leaves.keys().find(|k| !loader.used.contains(*k)) {
        return Err(LoadError::Unexpected(extra.clone()));
    }
    Ok(loaded)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{CnnBn, LeNet5, LeNet5Compact};

    #[test]
    fn extract_load_round_trip_and_names() {
        let device = crate::device::cpu();
        let a = LeNet5::new(10, &device);
        let b = LeNet5::new(10, &device);
        let tree = extract(&a);
        let names: Vec<String> = tree.leaves().iter().map(|(p, _)| p.to_string()).collect();
        assert!(names.contains(&"conv1.weight".to_owned()), "{names:?}");
        assert!(names.contains(&"fc5.bias".to_owned()), "{names:?}");
        assert_eq!(tree.num_elements(), 61_706);
        let b = load(b, &tree).unwrap();
        assert_eq!(extract(&b), tree);
    }

    #[test]
    fn every_model_round_trips_in_pytorch_names_and_shapes() {
        let device = crate::device::cpu();
        fn round_trip<M: burn::module::Module>(a: M, b: M, name: &str) {
            let tree = extract(&a);
            let names: Vec<String> = tree.leaves().iter().map(|(p, _)| p.to_string()).collect();
            assert!(
                names
                    .iter()
                    .all(|n| !n.ends_with("gamma") && !n.ends_with("beta")),
                "{name}: {names:?}"
            );
            let b = load(b, &tree).unwrap();
            assert_eq!(extract(&b), tree, "{name}");
        }
        round_trip(LeNet5::new(10, &device), LeNet5::new(10, &device), "lenet5");
        round_trip(
            LeNet5Compact::new(10, &device),
            LeNet5Compact::new(10, &device),
            "lenet5_compact",
        );
        round_trip(CnnBn::new(10, &device), CnnBn::new(10, &device), "cnn_bn");
        let shapes: BTreeMap<String, Vec<usize>> = extract(&CnnBn::new(10, &device))
            .leaves()
            .into_iter()
            .map(|(p, a)| (p.to_string(), a.shape().to_vec()))
            .collect();
        assert_eq!(shapes["fc3.weight"], vec![128, 1568]);
        assert_eq!(shapes["bn2.weight"], vec![32]);
        assert_eq!(shapes["bn2.bias"], vec![32]);
    }

    #[test]
    fn a_linear_weight_is_out_by_in_as_pytorch_computes_x_w_transposed_plus_b() {
        let device = crate::device::cpu();
        let model = LeNet5::new(10, &device);
        let tree = extract(&model);
        let leaf = |path: &str| {
            tree.leaves()
                .into_iter()
                .find(|(p, _)| p.to_string() == path)
                .map(|(_, a)| a.clone())
                .unwrap()
        };
        let (weight, bias) = (leaf("fc5.weight"), leaf("fc5.bias"));
        assert_eq!(weight.shape(), &[10, 84]);
        let lenet = &model;
        let x: Vec<f32> = (0..84).map(|i| (i as f32 * 0.37).sin()).collect();
        let burn_out = lenet
            .fc5_for_tests()
            .forward(Tensor::<2>::from_data(
                TensorData::new(x.clone(), [1, 84]),
                &device,
            ))
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        let (w, b) = (weight.as_f32().unwrap(), bias.as_f32().unwrap());
        for (o, &burn) in burn_out.iter().enumerate() {
            let torch: f32 = (0..84).map(|i| x[i] * w[o * 84 + i]).sum::<f32>() + b[o];
            assert!((burn - torch).abs() < 1e-5, "output {o}: {burn} vs {torch}");
        }
    }

    #[test]
    fn files_in_burn_layout_are_refused_naming_what_changed() {
        let device = crate::device::cpu();
        let tree = extract(&CnnBn::new(10, &device));
        let burn_layout = ParamTree::from_dotted(tree.leaves().into_iter().map(|(p, a)| {
            let name = p
                .to_string()
                .replace("bn1.weight", "bn1.gamma")
                .replace("bn1.bias", "bn1.beta");
            (name, a.clone())
        }));
        let error = load(CnnBn::new(10, &device), &burn_layout)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("bn1.beta") && error.contains("PyTorch's layout"),
            "{error}"
        );
        let transposed = ParamTree::from_dotted(tree.leaves().into_iter().map(|(p, a)| {
            let array = if p.to_string() == "fc3.weight" {
                Array::f32(vec![1568, 128], a.as_f32().unwrap().to_vec()).unwrap()
            } else {
                a.clone()
            };
            (p.to_string(), array)
        }));
        let error = load(CnnBn::new(10, &device), &transposed)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("fc3.weight") && error.contains("[out, in]"),
            "{error}"
        );
    }

    #[test]
    fn extraction_is_a_snapshot() {
        let device = crate::device::cpu();
        let model = LeNet5::new(10, &device);
        let before = extract(&model);
        let zeros = ParamTree::from_dotted(before.leaves().into_iter().map(|(p, a)| {
            (
                p.to_string(),
                Array::f32(a.shape().to_vec(), vec![0.0; a.len()]).unwrap(),
            )
        }));
        let model = load(model, &zeros).unwrap();
        assert_ne!(extract(&model), before);
        assert!(
            before
                .leaves()
                .iter()
                .any(|(_, a)| a.as_f32().unwrap().iter().any(|&x| x != 0.0))
        );
    }

    #[test]
    fn groupnorm_is_named_as_pytorch_and_an_lstm_as_one_nn_lstm() {
        use crate::model::{LstmShakespeare, ModelOptions, ModelSpec, ResNet20};
        let device = crate::device::cpu();
        let table: toml::Table = "norm = \"group\"".parse().unwrap();
        let spec = ModelSpec::new(vec![3, 32, 32], 10)
            .with_options(ModelOptions::new(table.into_iter().collect()));
        let tree = extract(&ResNet20::build(&spec, &device).unwrap());
        let names: BTreeSet<String> = tree.leaves().iter().map(|(p, _)| p.to_string()).collect();
        assert!(names.contains("layer1.0.bn2.weight") && names.contains("bn1.bias"));
        assert!(
            !names
                .iter()
                .any(|n| n.contains("gamma") || n.contains("running"))
        );

        let lstm = LstmShakespeare::build(&ModelSpec::new(vec![4], 80), &device).unwrap();
        let tree = extract(&lstm);
        // A stacked tensor of the wrong height is refused with PyTorch's shape.
        let short = ParamTree::from_dotted(tree.leaves().into_iter().map(|(p, a)| {
            let name = p.to_string();
            let array = if name == "lstm.weight_ih_l0" {
                Array::f32(vec![512, 8], vec![0.0; 512 * 8]).unwrap()
            } else {
                a.clone()
            };
            (name, array)
        }));
        let error = load(lstm, &short).unwrap_err().to_string();
        assert!(
            error.contains("lstm.weight_ih_l0") && error.contains("[1024, 8]"),
            "{error}"
        );
    }

    #[test]
    fn wrong_trees_are_refused() {
        let device = crate::device::cpu();
        let tree = extract(&LeNet5Compact::new(10, &device));
        let error = load(LeNet5::new(10, &device), &tree).unwrap_err();
        assert!(
            matches!(error, LoadError::Shape { .. } | LoadError::Missing(_)),
            "{error}"
        );
    }
}
