//! A dense layer of a batch of rows (`x · W + b`, burn's `[in, out]`
//! weight) as one burn operation on the CPU, forward and backward.
//!
//! burn flex computes the input gradient `dy · Wᵀ` with the weight read
//! across its rows, and gemm gathers its packed panels element by element
//! out of rows `out` floats apart: a fifth of `cnn_femnist`'s step went to
//! packing its 3,136 × 2,048 layer. Here that product is written with the
//! batch dimension contiguous, so gemm vectorizes along the batch and reads
//! the weight a few rows at a time, and the small `[in, B]` result is
//! transposed after.

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Backend, Flex, backend_extension, tensor::FloatTensor};
use burn::nn::Linear;
use burn::tensor::{DType, Tensor};

use super::flex::{host, register_gradients, tensor};
use super::gemm::{MatRef, Strides, matmul, product, transposed};

/// `rows` rows of `input` values through an `[input, output]` weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Dims {
    pub rows: usize,
    pub input: usize,
    pub output: usize,
}

/// `x · w + bias`.
pub(crate) fn forward(d: &Dims, x: &[f32], w: &[f32], bias: &[f32]) -> Vec<f32> {
    assert_eq!(x.len(), d.rows * d.input, "input length");
    assert_eq!(w.len(), d.input * d.output, "weight length");
    assert_eq!(bias.len(), d.output, "bias length");
    let mut out = vec![0.0f32; d.rows * d.output];
    for row in out.chunks_exact_mut(d.output.max(1)) {
        row.copy_from_slice(bias);
    }
    let (x, w) = (
        MatRef::row_major(x, d.input),
        MatRef::row_major(w, d.output),
    );
    let shape = (d.rows, d.output, d.input);
    matmul(shape, &mut out, Strides::row_major(d.output), true, x, w);
    out
}

/// The input's, weight's and bias's gradients, each where asked for.
pub(crate) struct LinearGrads {
    pub input: Option<Vec<f32>>,
    pub weight: Option<Vec<f32>>,
    pub bias: Option<Vec<f32>>,
}

/// The gradients of [`forward`] given the output's `d_out`; `wants` says
/// which of input, weight and bias need one.
pub(crate) fn backward(
    d: &Dims,
    x: &[f32],
    w: &[f32],
    d_out: &[f32],
    wants: [bool; 3],
) -> LinearGrads {
    assert_eq!(d_out.len(), d.rows * d.output, "output gradient length");
    let dy = MatRef::row_major(d_out, d.output);
    let input = wants[0].then(|| {
        // `dxᵀ` `[in, B]`: the batch contiguous, then transposed.
        let w_t = MatRef {
            data: w,
            strides: Strides::row_major(d.output).t(),
        };
        let batch_major = Strides::row_major(d.rows).t();
        let d_x_t = product((d.rows, d.input, d.output), batch_major, dy, w_t);
        transposed(&d_x_t, d.input, d.rows)
    });
    let weight = wants[1].then(|| {
        let x_t = MatRef {
            data: x,
            strides: Strides::row_major(d.input).t(),
        };
        let shape = (d.input, d.output, d.rows);
        product(shape, Strides::row_major(d.output), x_t, dy)
    });
    let bias = wants[2].then(|| {
        let mut d_b = vec![0.0f32; d.output];
        for row in d_out.chunks_exact(d.output.max(1)) {
            for (sum, v) in d_b.iter_mut().zip(row) {
                *sum += v;
            }
        }
        d_b
    });
    LinearGrads {
        input,
        weight,
        bias,
    }
}

/// A dense layer on burn's CPU backend, with or without autodiff.
#[backend_extension(Flex, Autodiff)]
pub trait NativeLinear: Backend {
    /// `x` `[B, in]` times `weight` `[in, out]` plus `bias` `[out]`.
    fn native_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// `layer.forward(x)` for rows `x` `[B, in]`, through cohort's kernel where
/// it applies (float32 on burn's CPU device with the native kernels on, a
/// bias), else through burn's.
pub fn linear(layer: &Linear, x: Tensor<2>) -> Tensor<2> {
    let Some(bias) = &layer.bias else {
        return layer.forward(x);
    };
    let weight = layer.weight.val();
    if !super::enabled_on(&x.device())
        || x.dtype() != DType::F32
        || weight.dtype() != DType::F32
        || x.dims()[1] != weight.dims()[0]
    {
        return layer.forward(x);
    }
    type D = burn::backend::Dispatch;
    Tensor::from_dispatch(<D as NativeLinear>::native_linear(
        x.into_dispatch(),
        weight.into_dispatch(),
        bias.val().into_dispatch(),
    ))
}

fn dims_of(x: &FlexTensor, weight: &FlexTensor) -> Dims {
    let [rows, input] = x.layout().shape().dims();
    let [w_in, output] = weight.layout().shape().dims();
    assert_eq!(
        input, w_in,
        "linear: input has {input} features, weight {w_in}"
    );
    Dims {
        rows,
        input,
        output,
    }
}

impl NativeLinear for Flex {
    fn native_linear(x: FlexTensor, weight: FlexTensor, bias: FlexTensor) -> FlexTensor {
        let d = dims_of(&x, &weight);
        let (x, weight, bias) = (
            x.to_contiguous(),
            weight.to_contiguous(),
            bias.to_contiguous(),
        );
        let out = forward(&d, host(&x), host(&weight), host(&bias));
        tensor(out, vec![d.rows, d.output])
    }
}

#[derive(Debug, Clone)]
struct Saved {
    x: NodeId,
    weight: NodeId,
}

#[derive(Debug)]
struct LinearBackward;

impl Backward<Flex, 3> for LinearBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Saved, 3>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<Flex>(&ops.node).to_contiguous();
        let x = checkpointer.retrieve_node_output::<FlexTensor>(ops.state.x);
        let weight = checkpointer.retrieve_node_output::<FlexTensor>(ops.state.weight);
        let d = dims_of(&x, &weight);
        let (x, weight) = (x.to_contiguous(), weight.to_contiguous());
        let wants = ops.parents.each_ref().map(Option::is_some);
        let g = backward(&d, host(&x), host(&weight), host(&grad), wants);
        let gradients = [
            (g.input, vec![d.rows, d.input]),
            (g.weight, vec![d.input, d.output]),
            (g.bias, vec![d.output]),
        ];
        register_gradients(grads, ops.parents.map(|p| p.map(|n| n.id)), gradients);
    }
}

type AdTensor = FloatTensor<Autodiff<Flex>>;

impl<C: CheckpointStrategy> NativeLinear for Autodiff<Flex, C> {
    fn native_linear(x: AdTensor, weight: AdTensor, bias: AdTensor) -> AdTensor {
        let forward = || {
            let (p, w, b) = (
                x.primitive().clone(),
                weight.primitive().clone(),
                bias.primitive().clone(),
            );
            Flex::native_linear(p, w, b)
        };
        match LinearBackward
            .prepare::<C>([x.node(), weight.node(), bias.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = Saved {
                    x: prep.checkpoint(&x),
                    weight: prep.checkpoint(&weight),
                };
                prep.finish(state, forward())
            }
            OpsKind::UnTracked(prep) => prep.finish(forward()),
        }
    }
}

#[cfg(test)]
mod tests {
    //! Against burn-nn's `Linear` under autodiff on random inputs: output
    //! and every gradient within `2e-5` of the largest magnitude of burn's.

    use crate::kernels::flex::testing::{assert_close, values as host};
    use burn::nn::LinearConfig;
    use burn::tensor::{Tensor, TensorData};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn output_and_gradients_match_burns_linear() {
        let device = crate::device::cpu().autodiff();
        for (seed, [rows, input, output]) in [[1, 1, 1], [3, 5, 7], [32, 70, 9], [17, 33, 64]]
            .into_iter()
            .enumerate()
        {
            let mut rng = ChaCha8Rng::seed_from_u64(seed as u64);
            let layer = LinearConfig::new(input, output).init(&device);
            let mut random =
                |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect() };
            let (x, r) = (random(rows * input), random(rows * output));
            let results = [true, false].map(|native| {
                let x = Tensor::<2>::from_data(TensorData::new(x.clone(), [rows, input]), &device)
                    .require_grad();
                let out = if native {
                    super::linear(&layer, x.clone())
                } else {
                    layer.forward(x.clone())
                };
                let r = Tensor::<2>::from_data(TensorData::new(r.clone(), [rows, output]), &device);
                let grads = (out.clone() * r).sum().backward();
                let bias = layer.bias.as_ref().unwrap();
                [
                    host(out),
                    host(x.grad(&grads).unwrap()),
                    host(layer.weight.val().grad(&grads).unwrap()),
                    host(bias.val().grad(&grads).unwrap()),
                ]
            });
            for (what, (a, b)) in results[0].iter().zip(&results[1]).enumerate() {
                assert_close(
                    a,
                    b,
                    2e-5,
                    &format!("tensor {what} of {rows}×{input}→{output}"),
                );
            }
        }
    }
}
