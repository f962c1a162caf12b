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

#[cfg(test)]
mod tests {
    //! [`owned`] is what lets a norm's backward pass overwrite its output
    //! gradient: where the gradient is shared (a residual block's, handed
    //! to the shortcut too), writing into it would change another layer's
    //! gradient without a word.

    use super::*;

    fn values(tensor: &FlexTensor) -> Vec<f32> {
        host(&tensor.to_contiguous()).to_vec()
    }

    #[test]
    fn a_tensor_nothing_else_holds_is_overwritten_in_place() {
        let lone = tensor(vec![1.0, 2.0, 3.0, 4.0], vec![2, 2]);
        let before = host(&lone).as_ptr();
        let mut owned = owned(lone);
        assert_eq!(values_mut(&mut owned).as_ptr(), before, "no copy");
        values_mut(&mut owned)[0] = 9.0;
        assert_eq!(values(&owned), [9.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn a_shared_tensor_is_copied_and_left_as_it_was() {
        let shared = tensor(vec![1.0, 2.0, 3.0, 4.0], vec![2, 2]);
        let mut owned = owned(shared.clone());
        values_mut(&mut owned).fill(0.0);
        assert_eq!(values(&shared), [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(owned.layout().shape().to_vec(), [2, 2]);
    }

    #[test]
    fn a_view_is_copied_in_its_own_order() {
        let base = tensor((0..6).map(|v| v as f32).collect(), vec![2, 3]);
        let transposed = base.transpose(0, 1);
        let narrowed = base.narrow(1, 1, 2);
        drop(base);
        for (view, expected) in [
            (transposed, vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]),
            (narrowed, vec![1.0, 2.0, 4.0, 5.0]),
        ] {
            let shape = view.layout().shape().to_vec();
            let mut owned = owned(view);
            assert_eq!(values_mut(&mut owned), expected.as_slice());
            assert_eq!(owned.layout().shape().to_vec(), shape);
        }
    }
}
