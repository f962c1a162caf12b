//! One LSTM layer over a whole batch of sequences as one burn operation on
//! the CPU, forward and backward (backpropagation through time).
//!
//! burn-nn's `Lstm` runs eight small linear layers and a dozen element-wise
//! operations per time step, each an autodiff node, and copies the whole
//! output tensor at every step to place that step's hidden state; LEAF's
//! Shakespeare model trained at 0.15–0.3× eager PyTorch on it. Here the four
//! gates are stacked PyTorch's way (`i, f, g, o`), so:
//! * the input's share of every step's gates is one product,
//!   `X · W_ih + b` (`[B·T, I] · [I, 4H]`), before the recurrence;
//! * each step adds `h_{t−1} · W_hh` in place and applies the gates in one
//!   pass;
//! * the way back runs the recurrence backwards with one product a step
//!   (`dA_t · W_hhᵀ`), and the weight and input gradients are three products
//!   over all steps at the end.
//!
//! The activated gates and cell states of the forward pass are kept for the
//! backward pass (`5·B·T·H` floats). The activations use
//! [`super::math`]'s exponential, which vectorizes.

use std::sync::Arc;

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Backend, Flex, backend_extension, tensor::FloatTensor};
use burn::nn::activation::Activation;
use burn::nn::{GateController, Lstm};
use burn::tensor::{DType, Tensor};

use super::flex::{host, register_gradients, tensor};
use super::gemm::{MatRef, Strides, matmul, transposed};
use super::math::{sigmoid, tanh};

/// The sizes of one layer's run: `batch` sequences of `steps` inputs of
/// `input` values, `hidden` units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Dims {
    pub batch: usize,
    pub steps: usize,
    pub input: usize,
    pub hidden: usize,
}

impl Dims {
    fn rows(&self) -> usize {
        self.batch * self.steps
    }
    fn gates(&self) -> usize {
        4 * self.hidden
    }
}

/// What the forward pass leaves for the backward pass, row `b·T + t`.
#[derive(Debug)]
pub(crate) struct Trace {
    /// Activated gates `[B·T, 4H]`: `σ(a_i), σ(a_f), tanh(a_g), σ(a_o)`.
    gates: Vec<f32>,
    /// Cell states `[B·T, H]`.
    cells: Vec<f32>,
    /// Hidden states `[B·T, H]`: the layer's output.
    hidden: Vec<f32>,
}

/// The layer over `x` (`[B, T, I]`) from zero states: `w_ih` `[I, 4H]`,
/// `w_hh` `[H, 4H]`, `bias` `[4H]` (both of burn's biases summed).
///
/// Inlined into [`super::simd::dispatch`]'s caller, so the element-wise
/// loops are compiled for the CPU's vector width (one caller).
#[inline(always)]
pub(crate) fn forward(d: &Dims, x: &[f32], w_ih: &[f32], w_hh: &[f32], bias: &[f32]) -> Trace {
    let (rows, h, g4) = (d.rows(), d.hidden, d.gates());
    assert_eq!(x.len(), rows * d.input, "input length");
    assert_eq!(w_ih.len(), d.input * g4, "input weight length");
    assert_eq!(w_hh.len(), h * g4, "hidden weight length");
    assert_eq!(bias.len(), g4, "bias length");
    // Every row starts as the bias: written once, not zeroed first.
    let mut gates = Vec::with_capacity(rows * g4);
    for _ in 0..rows {
        gates.extend_from_slice(bias);
    }
    let (x_rows, w_ih) = (MatRef::row_major(x, d.input), MatRef::row_major(w_ih, g4));
    matmul(
        (rows, g4, d.input),
        &mut gates,
        Strides::row_major(g4),
        true,
        x_rows,
        w_ih,
    );
    let mut cells = vec![0.0f32; rows * h];
    let mut hidden = vec![0.0f32; rows * h];
    let step_rows = Strides {
        rows: d.steps * g4,
        cols: 1,
    };
    for t in 0..d.steps {
        if t > 0 {
            let previous = MatRef {
                data: &hidden[(t - 1) * h..],
                strides: Strides {
                    rows: d.steps * h,
                    cols: 1,
                },
            };
            let dst = &mut gates[t * g4..];
            matmul(
                (d.batch, g4, h),
                dst,
                step_rows,
                true,
                previous,
                MatRef::row_major(w_hh, g4),
            );
        }
        for b in 0..d.batch {
            activate(
                d,
                b * d.steps + t,
                t == 0,
                &mut gates,
                &mut cells,
                &mut hidden,
            );
        }
    }
    Trace {
        gates,
        cells,
        hidden,
    }
}

/// One row's gates activated in place, its cell state from the row before
/// (the same sequence's previous step; zero at `first`) and its hidden
/// state.
#[inline(always)]
fn activate(
    d: &Dims,
    row: usize,
    first: bool,
    gates: &mut [f32],
    cells: &mut [f32],
    hidden: &mut [f32],
) {
    let h = d.hidden;
    let gate = &mut gates[row * d.gates()..][..d.gates()];
    let (ifo, rest) = gate.split_at_mut(2 * h);
    let (g, o) = rest.split_at_mut(h);
    // Three plain loops, not one over a chained iterator: `Chain::fold` is
    // not inlined into the AVX2 caller and ran four lanes wide (8 % of the
    // LSTM's step).
    ifo.iter_mut().for_each(|v| *v = sigmoid(*v));
    o.iter_mut().for_each(|v| *v = sigmoid(*v));
    g.iter_mut().for_each(|v| *v = tanh(*v));
    let (i, f) = ifo.split_at(h);
    let (done, now) = cells.split_at_mut(row * h);
    let cell = &mut now[..h];
    if first {
        for ((c, &i), &g) in cell.iter_mut().zip(i.iter()).zip(g.iter()) {
            *c = i * g;
        }
    } else {
        let prev = &done[(row - 1) * h..][..h];
        for k in 0..h {
            cell[k] = f[k] * prev[k] + i[k] * g[k];
        }
    }
    let out = &mut hidden[row * h..][..h];
    for ((out, &o), &c) in out.iter_mut().zip(o.iter()).zip(cell.iter()) {
        *out = o * tanh(c);
    }
}

/// Gradients of [`forward`] given the output's gradient `d_out` (`[B, T,
/// H]`): the input's `[B, T, I]`, `W_ih`'s, `W_hh`'s and the bias's.
pub(crate) struct LstmGrads {
    pub input: Vec<f32>,
    pub w_ih: Vec<f32>,
    pub w_hh: Vec<f32>,
    pub bias: Vec<f32>,
}

/// Backpropagation through time (inlined as [`forward`] is).
#[inline(always)]
pub(crate) fn backward(
    d: &Dims,
    x: &[f32],
    w_ih: &[f32],
    w_hh: &[f32],
    trace: &Trace,
    d_out: &[f32],
) -> LstmGrads {
    let (rows, h, g4) = (d.rows(), d.hidden, d.gates());
    assert_eq!(d_out.len(), rows * h, "output gradient length");
    // Gradients of the gates' pre-activations, row b·T + t.
    let mut d_gates = vec![0.0f32; rows * g4];
    let mut d_hidden_next = vec![0.0f32; d.batch * h];
    let mut d_cell_next = vec![0.0f32; d.batch * h];
    let zeros = vec![0.0f32; h];
    // W_hhᵀ `[4H, H]`, so the per-step product reads it along its rows.
    let w_hh_t = transposed(w_hh, h, g4);
    for t in (0..d.steps).rev() {
        for b in 0..d.batch {
            let (row, at) = (b * d.steps + t, b * h..(b + 1) * h);
            let c_prev = match t {
                0 => &zeros[..],
                _ => &trace.cells[(row - 1) * h..][..h],
            };
            let next = (&d_hidden_next[at.clone()], &mut d_cell_next[at]);
            gate_gradients(
                d,
                trace,
                row,
                c_prev,
                &d_out[row * h..][..h],
                next,
                &mut d_gates,
            );
        }
        if t > 0 {
            let step = MatRef {
                data: &d_gates[t * g4..],
                strides: Strides {
                    rows: d.steps * g4,
                    cols: 1,
                },
            };
            let w = MatRef::row_major(&w_hh_t, h);
            let dst = &mut d_hidden_next;
            matmul((d.batch, h, g4), dst, Strides::row_major(h), false, step, w);
        }
    }
    parameter_gradients(d, x, w_ih, trace, &d_gates)
}

/// Row `row`'s gradients of the gates' pre-activations, from the output's
/// gradient there (`d_h`), the next step's hidden and cell gradients and
/// the previous cell state; the cell gradient is passed back in place.
#[inline(always)]
fn gate_gradients(
    d: &Dims,
    trace: &Trace,
    row: usize,
    c_prev: &[f32],
    d_h: &[f32],
    (d_h_next, d_c_next): (&[f32], &mut [f32]),
    d_gates: &mut [f32],
) {
    let (h, g4) = (d.hidden, d.gates());
    let gate = &trace.gates[row * g4..][..g4];
    let (i, f, g, o) = (
        &gate[..h],
        &gate[h..2 * h],
        &gate[2 * h..3 * h],
        &gate[3 * h..],
    );
    let cell = &trace.cells[row * h..][..h];
    let dst = &mut d_gates[row * g4..][..g4];
    let (d_i, rest) = dst.split_at_mut(h);
    let (d_f, rest) = rest.split_at_mut(h);
    let (d_g, d_o) = rest.split_at_mut(h);
    for k in 0..h {
        let dh = d_h[k] + d_h_next[k];
        let tanh_c = tanh(cell[k]);
        let dc = dh * o[k] * (1.0 - tanh_c * tanh_c) + d_c_next[k];
        d_o[k] = dh * tanh_c * o[k] * (1.0 - o[k]);
        d_i[k] = dc * g[k] * i[k] * (1.0 - i[k]);
        d_f[k] = dc * c_prev[k] * f[k] * (1.0 - f[k]);
        d_g[k] = dc * i[k] * (1.0 - g[k] * g[k]);
        d_c_next[k] = dc * f[k];
    }
}

/// The weights', bias's and input's gradients from every row's gate
/// gradients: three products over all steps and a column sum.
fn parameter_gradients(
    d: &Dims,
    x: &[f32],
    w_ih: &[f32],
    trace: &Trace,
    d_gates: &[f32],
) -> LstmGrads {
    let (rows, h, g4) = (d.rows(), d.hidden, d.gates());
    let all = MatRef::row_major(d_gates, g4);
    // h_{t−1} for every row (zero at t = 0), for W_hh's gradient.
    let mut previous = vec![0.0f32; rows * h];
    for b in 0..d.batch {
        let from = &trace.hidden[b * d.steps * h..][..d.steps.saturating_sub(1) * h];
        previous[(b * d.steps + 1) * h..][..from.len()].copy_from_slice(from);
    }
    let mut d_w_hh = vec![0.0f32; h * g4];
    let prev_t = MatRef {
        data: &previous,
        strides: Strides::row_major(h).t(),
    };
    matmul(
        (h, g4, rows),
        &mut d_w_hh,
        Strides::row_major(g4),
        false,
        prev_t,
        all,
    );
    let mut d_w_ih = vec![0.0f32; d.input * g4];
    let x_t = MatRef {
        data: x,
        strides: Strides::row_major(d.input).t(),
    };
    matmul(
        (d.input, g4, rows),
        &mut d_w_ih,
        Strides::row_major(g4),
        false,
        x_t,
        all,
    );
    let mut d_input = vec![0.0f32; rows * d.input];
    let w_ih_t = transposed(w_ih, d.input, g4);
    let w = MatRef::row_major(&w_ih_t, d.input);
    matmul(
        (rows, d.input, g4),
        &mut d_input,
        Strides::row_major(d.input),
        false,
        all,
        w,
    );
    let mut d_bias = vec![0.0f32; g4];
    for row in d_gates.chunks_exact(g4) {
        for (sum, v) in d_bias.iter_mut().zip(row) {
            *sum += v;
        }
    }
    LstmGrads {
        input: d_input,
        w_ih: d_w_ih,
        w_hh: d_w_hh,
        bias: d_bias,
    }
}

/// An LSTM layer on burn's CPU backend, with or without autodiff.
#[backend_extension(Flex, Autodiff)]
pub trait NativeLstm: Backend {
    /// `x` `[B, T, I]` through the layer of stacked weights `w_ih` `[I, 4H]`,
    /// `w_hh` `[H, 4H]` and `bias` `[4H]` (gates `i, f, g, o`), from zero
    /// states: the hidden states `[B, T, H]`.
    fn native_lstm(
        x: FloatTensor<Self>,
        w_ih: FloatTensor<Self>,
        w_hh: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// `layer.forward(x, None).0`, through cohort's kernel where it applies
/// (float32 on burn's CPU device with the native kernels on; batch first,
/// forward in time, biases, sigmoid gates and tanh cell and output, no
/// clipping, an uncoupled forget gate), else through burn's.
pub fn lstm(layer: &Lstm, x: Tensor<3>) -> Tensor<3> {
    let gates = [
        Some(&layer.input_gate),
        layer.forget_gate.as_ref(),
        Some(&layer.cell_gate),
        Some(&layer.output_gate),
    ];
    let applies = super::enabled_on(&x.device())
        && x.dtype() == DType::F32
        && layer.batch_first
        && !layer.reverse
        && layer.clip.is_none()
        && !layer.input_forget
        && matches!(layer.gate_activation, Activation::Sigmoid(_))
        && matches!(layer.cell_activation, Activation::Tanh(_))
        && matches!(layer.hidden_activation, Activation::Tanh(_))
        && x.dims()[1] > 0
        && gates.iter().all(|gate| gate.is_some_and(has_biases));
    if !applies {
        return layer.forward(x, None).0;
    }
    let gates = gates.map(|gate| gate.expect("checked above"));
    let weight = |pick: fn(&GateController) -> &burn::nn::Linear| {
        Tensor::cat(gates.iter().map(|g| pick(g).weight.val()).collect(), 1)
    };
    let w_ih = weight(|g| &g.input_transform);
    let w_hh = weight(|g| &g.hidden_transform);
    let bias = |pick: fn(&GateController) -> &burn::nn::Linear| {
        let biases = gates
            .iter()
            .map(|g| pick(g).bias.as_ref().expect("checked by has_biases").val());
        Tensor::cat(biases.collect(), 0)
    };
    let bias = bias(|g| &g.input_transform) + bias(|g| &g.hidden_transform);
    type D = burn::backend::Dispatch;
    Tensor::from_dispatch(<D as NativeLstm>::native_lstm(
        x.into_dispatch(),
        w_ih.into_dispatch(),
        w_hh.into_dispatch(),
        bias.into_dispatch(),
    ))
}

fn has_biases(gate: &GateController) -> bool {
    gate.input_transform.bias.is_some() && gate.hidden_transform.bias.is_some()
}

fn dims_of(x: &FlexTensor, w_hh: &FlexTensor) -> Dims {
    let [batch, steps, input] = x.layout().shape().dims();
    let [hidden, gates] = w_hh.layout().shape().dims();
    assert_eq!(gates, 4 * hidden, "lstm: W_hh is [H, 4H]");
    Dims {
        batch,
        steps,
        input,
        hidden,
    }
}

/// The forward pass of contiguous copies of the operands.
fn run_forward(
    x: &FlexTensor,
    w_ih: &FlexTensor,
    w_hh: &FlexTensor,
    bias: &FlexTensor,
) -> (Dims, Trace) {
    let d = dims_of(x, w_hh);
    let (x, w_ih, w_hh, bias) = (
        x.to_contiguous(),
        w_ih.to_contiguous(),
        w_hh.to_contiguous(),
        bias.to_contiguous(),
    );
    let trace = super::simd::dispatch(
        #[inline(always)]
        || forward(&d, host(&x), host(&w_ih), host(&w_hh), host(&bias)),
    );
    (d, trace)
}

impl NativeLstm for Flex {
    fn native_lstm(
        x: FlexTensor,
        w_ih: FlexTensor,
        w_hh: FlexTensor,
        bias: FlexTensor,
    ) -> FlexTensor {
        let (d, trace) = run_forward(&x, &w_ih, &w_hh, &bias);
        tensor(trace.hidden, vec![d.batch, d.steps, d.hidden])
    }
}

#[derive(Debug, Clone)]
struct Saved {
    x: NodeId,
    w_ih: NodeId,
    w_hh: NodeId,
    trace: Arc<Trace>,
}

#[derive(Debug)]
struct LstmBackward;

impl Backward<Flex, 4> for LstmBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Saved, 4>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<Flex>(&ops.node).to_contiguous();
        let saved = ops.state;
        let x = checkpointer.retrieve_node_output::<FlexTensor>(saved.x);
        let w_ih = checkpointer.retrieve_node_output::<FlexTensor>(saved.w_ih);
        let w_hh = checkpointer.retrieve_node_output::<FlexTensor>(saved.w_hh);
        let d = dims_of(&x, &w_hh);
        let (x, w_ih, w_hh) = (
            x.to_contiguous(),
            w_ih.to_contiguous(),
            w_hh.to_contiguous(),
        );
        let g = super::simd::dispatch(
            #[inline(always)]
            || {
                backward(
                    &d,
                    host(&x),
                    host(&w_ih),
                    host(&w_hh),
                    &saved.trace,
                    host(&grad),
                )
            },
        );
        let gradients = [
            (Some(g.input), vec![d.batch, d.steps, d.input]),
            (Some(g.w_ih), vec![d.input, d.gates()]),
            (Some(g.w_hh), vec![d.hidden, d.gates()]),
            (Some(g.bias), vec![d.gates()]),
        ];
        register_gradients(grads, ops.parents.map(|p| p.map(|n| n.id)), gradients);
    }
}

type AdTensor = FloatTensor<Autodiff<Flex>>;

impl<C: CheckpointStrategy> NativeLstm for Autodiff<Flex, C> {
    fn native_lstm(x: AdTensor, w_ih: AdTensor, w_hh: AdTensor, bias: AdTensor) -> AdTensor {
        let nodes = [x.node(), w_ih.node(), w_hh.node(), bias.node()];
        match LstmBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(mut prep) => {
                let (d, trace) = run_forward(
                    x.primitive(),
                    w_ih.primitive(),
                    w_hh.primitive(),
                    bias.primitive(),
                );
                let out = tensor(trace.hidden.clone(), vec![d.batch, d.steps, d.hidden]);
                let state = Saved {
                    x: prep.checkpoint(&x),
                    w_ih: prep.checkpoint(&w_ih),
                    w_hh: prep.checkpoint(&w_hh),
                    trace: Arc::new(trace),
                };
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => {
                let (x, w_ih, w_hh, bias) = (
                    x.primitive().clone(),
                    w_ih.primitive().clone(),
                    w_hh.primitive().clone(),
                    bias.primitive().clone(),
                );
                prep.finish(Flex::native_lstm(x, w_ih, w_hh, bias))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Against burn-nn's `Lstm` under autodiff on random inputs and weights:
    //! outputs and every gradient within `2e-5` of the largest magnitude of
    //! burn's values.

    use crate::kernels::flex::testing::{assert_close, values as host};
    use burn::nn::{Lstm, LstmConfig};
    use burn::tensor::{Tensor, TensorData};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// A layer, an input and an output gradient for `dims` (`[B, T, I, H]`).
    fn case(dims: [usize; 4], seed: u64) -> (Lstm, Vec<f32>, Vec<f32>) {
        let [batch, steps, input, hidden] = dims;
        let device = crate::device::cpu().autodiff();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let layer = LstmConfig::new(input, hidden, true)
            .with_batch_first(true)
            .init(&device);
        let mut random = |n: usize, scale: f32| -> Vec<f32> {
            (0..n).map(|_| rng.random_range(-scale..scale)).collect()
        };
        let x = random(batch * steps * input, 1.5);
        let r = random(batch * steps * hidden, 1.0);
        (layer, x, r)
    }

    /// Output, input gradient and the gradients of every weight and bias of
    /// `layer` (loss `Σ out ⊙ r`), through the native kernel or burn's.
    fn run(layer: &Lstm, dims: [usize; 4], x: &[f32], r: &[f32], native: bool) -> Vec<Vec<f32>> {
        let [batch, steps, input, hidden] = dims;
        let device = crate::device::cpu().autodiff();
        let x = Tensor::<3>::from_data(TensorData::new(x.to_vec(), [batch, steps, input]), &device)
            .require_grad();
        let out = if native {
            super::lstm(layer, x.clone())
        } else {
            layer.forward(x.clone(), None).0
        };
        let r =
            Tensor::<3>::from_data(TensorData::new(r.to_vec(), [batch, steps, hidden]), &device);
        let grads = (out.clone() * r).sum().backward();
        let mut all = vec![host(out), host(x.grad(&grads).unwrap())];
        let forget = layer.forget_gate.as_ref().unwrap();
        for gate in [
            &layer.input_gate,
            forget,
            &layer.cell_gate,
            &layer.output_gate,
        ] {
            for linear in [&gate.input_transform, &gate.hidden_transform] {
                all.push(host(linear.weight.val().grad(&grads).unwrap()));
                all.push(host(
                    linear.bias.as_ref().unwrap().val().grad(&grads).unwrap(),
                ));
            }
        }
        all
    }

    #[test]
    fn output_and_gradients_match_burns_lstm() {
        for (i, dims) in [[2, 5, 3, 4], [3, 1, 8, 16], [1, 7, 2, 3], [4, 6, 16, 32]]
            .into_iter()
            .enumerate()
        {
            let (layer, x, r) = case(dims, i as u64);
            let ours = run(&layer, dims, &x, &r, true);
            let burns = run(&layer, dims, &x, &r, false);
            for (what, (a, b)) in ours.iter().zip(&burns).enumerate() {
                assert_close(a, b, 2e-5, &format!("tensor {what} of {dims:?}"));
            }
        }
    }

    #[test]
    fn the_same_inputs_give_the_same_bits() {
        let bits = |r: Vec<Vec<f32>>| -> Vec<Vec<u32>> {
            r.iter()
                .map(|v| v.iter().map(|f| f.to_bits()).collect())
                .collect()
        };
        let dims = [3, 4, 5, 8];
        let (layer, x, r) = case(dims, 9);
        assert_eq!(
            bits(run(&layer, dims, &x, &r, true)),
            bits(run(&layer, dims, &x, &r, true))
        );
    }
}
