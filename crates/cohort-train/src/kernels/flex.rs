//! What every native layer does at burn flex's boundary: read a float32
//! tensor's values, and make a tensor of computed values.

use burn::backend::Flex;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::flex::FlexTensor;
use burn::tensor::TensorData;

/// The values of a contiguous float32 tensor.
///
/// # Panics
/// When the tensor is not contiguous float32 (the callers make it so with
/// `to_contiguous` on float32 inputs, which their entry points check).
pub(super) fn host(tensor: &FlexTensor) -> &[f32] {
    tensor
        .as_slice::<f32>()
        .expect("a contiguous float32 tensor")
}

/// A contiguous float32 tensor of `tensor`'s shape and values whose
/// storage nothing else holds, so [`values_mut`] can overwrite it: the
/// tensor itself where that is so already (a gradient on its way back,
/// usually), else a copy.
///
/// # Panics
/// When the tensor is not float32 (as [`host`]).
pub(super) fn owned(tensor: FlexTensor) -> FlexTensor {
    let whole = tensor.layout().contiguous_offsets() == Some((0, tensor.storage::<f32>().len()));
    if whole && tensor.is_unique() {
        return tensor;
    }
    let dims = tensor.layout().shape().to_vec();
    let tensor = tensor.to_contiguous();
    self::tensor(host(&tensor).to_vec(), dims)
}

/// The values of a tensor from [`owned`], to overwrite.
///
/// # Panics
/// When the tensor did not come from [`owned`] (shared, or not float32).
pub(super) fn values_mut(tensor: &mut FlexTensor) -> &mut [f32] {
    tensor
        .try_storage_mut::<f32>()
        .expect("a float32 tensor nothing else holds")
}

/// A tensor of `shape` holding `values`.
pub(super) fn tensor(values: Vec<f32>, shape: Vec<usize>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// Gives each parent autodiff tracks (`parents`: `ops.parents` mapped to
/// their ids) its gradient, the values and shape computed for it; a value
/// left `None` was not computed, its parent being untracked.
pub(super) fn register_gradients<const N: usize>(
    grads: &mut Gradients,
    parents: [Option<NodeId>; N],
    gradients: [(Option<Vec<f32>>, Vec<usize>); N],
) {
    for (parent, (values, shape)) in parents.into_iter().zip(gradients) {
        if let (Some(id), Some(values)) = (parent, values) {
            grads.register::<Flex>(id, tensor(values, shape));
        }
    }
}

/// Helpers of the layers' tests against burn's own layers.
#[cfg(test)]
pub(super) mod testing {
    use burn::tensor::Tensor;

    /// A tensor's values on the host.
    pub(in crate::kernels) fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data().try_to_vec::<f32>().unwrap()
    }

    /// The largest difference between `a` and `b` and `b`'s largest
    /// magnitude (at least 1e-30), the scale a tolerance is relative to.
    pub(in crate::kernels) fn difference(a: &[f32], b: &[f32]) -> (f32, f32) {
        let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-30);
        let worst = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        (worst, scale)
    }

    /// `a` equals `b` up to `tolerance` of `b`'s largest magnitude.
    pub(in crate::kernels) fn assert_close(a: &[f32], b: &[f32], tolerance: f32, what: &str) {
        assert_eq!(a.len(), b.len(), "{what}: length");
        let (worst, scale) = difference(a, b);
        assert!(
            worst <= tolerance * scale,
            "{what}: largest difference {worst} against scale {scale}"
        );
    }
}
