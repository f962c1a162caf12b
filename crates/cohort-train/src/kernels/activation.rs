//! tanh as one burn operation on the CPU, forward and backward, through
//! [`super::math::tanh`]: burn flex calls libm's `tanhf` an element, which
//! was a sixth of `multilayer`'s (Plato's tanh MLP) training step.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Backend, Flex, backend_extension, tensor::FloatTensor};
use burn::tensor::{DType, Tensor};

use super::flex::{host, tensor};

/// tanh on burn's CPU backend, with or without autodiff.
#[backend_extension(Flex, Autodiff)]
pub trait NativeTanh: Backend {
    /// `tanh(x)`, element by element.
    fn native_tanh(x: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// `burn::tensor::activation::tanh(x)`, through cohort's kernel where it
/// applies (float32 on burn's CPU device with the native kernels on), else
/// through burn's.
pub fn tanh<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    if !super::enabled_on(&x.device()) || x.dtype() != DType::F32 {
        return burn::tensor::activation::tanh(x);
    }
    type B = burn::backend::Dispatch;
    Tensor::from_dispatch(<B as NativeTanh>::native_tanh(x.into_dispatch()))
}

/// `tanh` of every element of `values`, in place.
fn forward(values: &mut [f32]) {
    super::simd::dispatch(
        #[inline(always)]
        || {
            for v in values.iter_mut() {
                *v = super::math::tanh(*v);
            }
        },
    );
}

impl NativeTanh for Flex {
    fn native_tanh(x: FlexTensor) -> FlexTensor {
        let shape = x.layout().shape().to_vec();
        let x = x.to_contiguous();
        let mut values = host(&x).to_vec();
        forward(&mut values);
        tensor(values, shape)
    }
}

/// The output, from which the way back reads `1 − y²`.
#[derive(Debug, Clone)]
struct Saved {
    output: FlexTensor,
}

#[derive(Debug)]
struct TanhBackward;

impl Backward<Flex, 1> for TanhBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Saved, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<Flex>(&ops.node).to_contiguous();
        let [parent] = ops.parents;
        let Some(parent) = parent else { return };
        let output = ops.state.output;
        let mut d_x = host(&grad).to_vec();
        super::simd::dispatch(
            #[inline(always)]
            || {
                for (d, &y) in d_x.iter_mut().zip(host(&output)) {
                    *d *= 1.0 - y * y;
                }
            },
        );
        let shape = output.layout().shape().to_vec();
        grads.register::<Flex>(parent.id, tensor(d_x, shape));
    }
}

type AdTensor = FloatTensor<Autodiff<Flex>>;

impl<C: CheckpointStrategy> NativeTanh for Autodiff<Flex, C> {
    fn native_tanh(x: AdTensor) -> AdTensor {
        let output = Flex::native_tanh(x.primitive().clone());
        match TanhBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let state = Saved {
                    output: output.clone(),
                };
                prep.finish(state, output)
            }
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }
}

#[cfg(test)]
mod tests {
    //! Against burn's tanh under autodiff: output and input gradient within
    //! 2.5e-7 (the kernel's own error, `math`'s tests).

    use burn::tensor::{Tensor, TensorData};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn output_and_gradient_match_burns_tanh() {
        let device = crate::device::cpu().autodiff();
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let mut random = |n: usize, scale: f32| -> Vec<f32> {
            (0..n).map(|_| rng.random_range(-scale..scale)).collect()
        };
        let (x, r) = (random(7 * 33, 6.0), random(7 * 33, 1.0));
        let results = [true, false].map(|native| {
            let x =
                Tensor::<2>::from_data(TensorData::new(x.clone(), [7, 33]), &device).require_grad();
            let y = if native {
                super::tanh(x.clone())
            } else {
                burn::tensor::activation::tanh(x.clone())
            };
            let r = Tensor::<2>::from_data(TensorData::new(r.clone(), [7, 33]), &device);
            let grads = (y.clone() * r).sum().backward();
            let host = |t: Tensor<2>| t.into_data().try_to_vec::<f32>().unwrap();
            [host(y), host(x.grad(&grads).unwrap())]
        });
        for (what, (a, b)) in ["output", "gradient"]
            .iter()
            .zip(results[0].iter().zip(&results[1]))
        {
            let worst = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0f32, f32::max);
            assert!(worst <= 5e-7, "{what} off by {worst}");
        }
    }
}
