//! Moving parameters between a burn module and a host [`ParamTree`].
//!
//! Extraction copies every float parameter to host memory, so the tree is a
//! snapshot that later training cannot change. Loading checks that the tree has
//! exactly the module's parameters, with the same shapes, in float32 (the
//! training dtype; nothing is cast silently), before the module is changed.

use std::collections::{BTreeMap, BTreeSet};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Tensor, TensorData};
use cohort_core::tree::{Array, DType, ParamTree};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    #[error("the model has parameter `{0}` but the tree has no such leaf")]
    Missing(String),
    #[error("the tree has leaf `{0}`, which the model does not have")]
    Unexpected(String),
    #[error("parameter `{path}`: model shape {model:?}, tree shape {tree:?}")]
    Shape {
        path: String,
        model: Vec<usize>,
        tree: Vec<usize>,
    },
    #[error("parameter `{path}` is {dtype} in the tree; models load float32 only")]
    DType { path: String, dtype: DType },
}

/// Dotted paths of a module's fields, without enum variant names, so the same
/// layer has the same name whichever [`crate::model::Net`] variant holds it.
#[derive(Default)]
pub(crate) struct PathStack {
    segments: Vec<String>,
    skipped: Vec<bool>,
}

impl PathStack {
    pub(crate) fn enter(&mut self, name: &str, container_type: &str) {
        let skip = container_type.starts_with("Enum:");
        self.skipped.push(skip);
        if !skip {
            self.segments.push(name.to_owned());
        }
    }

    pub(crate) fn exit(&mut self) {
        if !self.skipped.pop().unwrap_or(false) {
            self.segments.pop();
        }
    }

    pub(crate) fn current(&self) -> String {
        self.segments.join(".")
    }
}

struct Extractor {
    path: PathStack,
    leaves: Vec<(String, Array)>,
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
        let data = tensor.into_data();
        let values = data
            .try_to_vec::<f32>()
            .expect("float parameters of a float32 model convert to f32");
        let array = Array::f32(shape, values).expect("burn tensors hold shape-product elements");
        self.leaves.push((self.path.current(), array));
    }
}

/// A host snapshot of every float parameter of `module`.
pub fn extract<M: Module>(module: &M) -> ParamTree {
    let mut extractor = Extractor {
        path: PathStack::default(),
        leaves: Vec::new(),
    };
    module.visit(&mut extractor);
    ParamTree::from_dotted(extractor.leaves)
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
        let path = self.path.current();
        let Some(array) = self.leaves.get(&path) else {
            self.error = Some(LoadError::Missing(path));
            return param;
        };
        let model_shape = param.lazy_shape().to_vec();
        if array.shape() != model_shape.as_slice() {
            self.error = Some(LoadError::Shape {
                path,
                model: model_shape,
                tree: array.shape().to_vec(),
            });
            return param;
        }
        let Some(values) = array.as_f32() else {
            self.error = Some(LoadError::DType {
                path,
                dtype: array.dtype(),
            });
            return param;
        };
        let device = param.lazy_device();
        let tensor = Tensor::<D>::from_data(TensorData::new(values.to_vec(), model_shape), &device);
        let id = param.id;
        self.used.insert(path);
        param.transform_for_load(tensor, id)
    }
}

/// Checks `tree` against the module's parameters, then loads it. On error the
/// returned module is not produced, and the caller's module was consumed: keep a
/// clone when a failure must leave the model usable.
pub fn load<M: Module>(module: M, tree: &ParamTree) -> Result<M, LoadError> {
    let leaves: BTreeMap<String, &Array> = tree
        .leaves()
        .into_iter()
        .map(|(path, array)| (path.to_string(), array))
        .collect();
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
    use crate::model::Net;
    use cohort_core::config::ModelName;

    #[test]
    fn extract_load_round_trip_and_names() {
        let device = crate::device::cpu();
        let a = Net::build(ModelName::Lenet5, 10, &device);
        let b = Net::build(ModelName::Lenet5, 10, &device);
        let tree = extract(&a);
        let names: Vec<String> = tree.leaves().iter().map(|(p, _)| p.to_string()).collect();
        assert!(names.contains(&"conv1.weight".to_owned()), "{names:?}");
        assert!(names.contains(&"fc5.bias".to_owned()), "{names:?}");
        assert_eq!(tree.num_elements(), 61_706);
        let b = load(b, &tree).unwrap();
        assert_eq!(extract(&b), tree);
    }

    #[test]
    fn extraction_is_a_snapshot() {
        let device = crate::device::cpu();
        let model = Net::build(ModelName::Lenet5, 10, &device);
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
    fn wrong_trees_are_refused() {
        let device = crate::device::cpu();
        let tree = extract(&Net::build(ModelName::Lenet5Compact, 10, &device));
        let error = load(Net::build(ModelName::Lenet5, 10, &device), &tree).unwrap_err();
        assert!(
            matches!(error, LoadError::Shape { .. } | LoadError::Missing(_)),
            "{error}"
        );
    }
}
