//! The native convolution against burn's own `conv2d` under autodiff, on
//! random inputs: output, input gradient, weight and bias gradients.
//!
//! Tolerance: each value may differ from burn's by `2e-5` of the largest
//! magnitude among burn's values of that tensor. Both compute the same sums
//! of at most a few thousand float32 products in different orders; the
//! rounding of such a sum is a few ulps of its terms' magnitude, well inside
//! that bound, while an index or padding error shows up at the scale of the
//! values themselves.

use burn::nn::PaddingConfig2d;
use burn::nn::conv::Conv2dConfig;
use burn::tensor::module::conv2d as burn_conv2d;
use burn::tensor::ops::ConvOptions;
use burn::tensor::{Device, Tensor, TensorData};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// One convolution: shapes and options.
#[derive(Debug, Clone, Copy)]
struct Case {
    batch: usize,
    c_in: usize,
    c_out: usize,
    size: [usize; 2],
    kernel: [usize; 2],
    stride: [usize; 2],
    pad: [(usize, usize); 2],
    bias: bool,
}

const fn square(batch: usize, c_in: usize, c_out: usize, size: usize, k: usize) -> Case {
    Case {
        batch,
        c_in,
        c_out,
        size: [size, size],
        kernel: [k, k],
        stride: [1, 1],
        pad: [(0, 0), (0, 0)],
        bias: true,
    }
}

impl Case {
    const fn stride(self, s: usize) -> Self {
        Self {
            stride: [s, s],
            ..self
        }
    }
    const fn pad(self, p: usize) -> Self {
        Self {
            pad: [(p, p), (p, p)],
            ..self
        }
    }
    const fn no_bias(self) -> Self {
        Self {
            bias: false,
            ..self
        }
    }
}

/// Every tensor a case compares, as host values.
#[derive(Debug, PartialEq)]
struct Results {
    output: Vec<f32>,
    d_input: Vec<f32>,
    d_weight: Vec<f32>,
    d_bias: Option<Vec<f32>>,
}

fn random(len: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

/// The case through `conv` on random inputs (the same for a seed), with a
/// random gradient of the output (`loss = Σ out ⊙ r`).
fn run(
    case: Case,
    seed: u64,
    conv: impl Fn(Tensor<4>, Tensor<4>, Option<Tensor<1>>) -> Tensor<4>,
) -> Results {
    let device = crate::device::cpu().autodiff();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let [h, w] = case.size;
    let [kh, kw] = case.kernel;
    let x_shape = [case.batch, case.c_in, h, w];
    let w_shape = [case.c_out, case.c_in, kh, kw];
    let tensor = |shape: [usize; 4], rng: &mut ChaCha8Rng| {
        let values = random(shape.iter().product(), rng);
        Tensor::<4>::from_data(TensorData::new(values, shape), &device).require_grad()
    };
    let x = tensor(x_shape, &mut rng);
    let weight = tensor(w_shape, &mut rng);
    let bias = case.bias.then(|| {
        let values = random(case.c_out, &mut rng);
        Tensor::<1>::from_data(TensorData::new(values, [case.c_out]), &device).require_grad()
    });
    let out = conv(x.clone(), weight.clone(), bias.clone());
    let r = random(out.dims().iter().product(), &mut rng);
    let r = Tensor::<4>::from_data(TensorData::new(r, out.dims()), &device);
    let grads = (out.clone() * r).sum().backward();
    Results {
        output: host(out),
        d_input: host(x.grad(&grads).expect("an input gradient")),
        d_weight: host(weight.grad(&grads).expect("a weight gradient")),
        d_bias: bias.map(|b| host(b.grad(&grads).expect("a bias gradient"))),
    }
}

fn native(x: Tensor<4>, w: Tensor<4>, b: Option<Tensor<1>>, case: Case) -> Tensor<4> {
    super::conv2d::native(x, w, b, case.stride, case.pad)
}

fn burns(x: Tensor<4>, w: Tensor<4>, b: Option<Tensor<1>>, case: Case) -> Tensor<4> {
    let options = ConvOptions::new_with_padding(case.stride, case.pad, [1, 1], 1);
    burn_conv2d(x, w, b, options)
}

/// `a` equals `b` up to `2e-5` of `b`'s largest magnitude.
fn assert_close(a: &[f32], b: &[f32], what: &str) -> Result<(), String> {
    if a.len() != b.len() {
        return Err(format!("{what}: {} values against {}", a.len(), b.len()));
    }
    let (worst, scale) = super::flex::testing::difference(a, b);
    if worst.is_nan() || worst > 2e-5 * scale {
        return Err(format!(
            "{what}: largest difference {worst} against scale {scale}"
        ));
    }
    Ok(())
}

fn compare(case: Case, seed: u64) -> Result<(), String> {
    let ours = run(case, seed, |x, w, b| native(x, w, b, case));
    let theirs = run(case, seed, |x, w, b| burns(x, w, b, case));
    let what = |name: &str| format!("{name} of {case:?}");
    assert_close(&ours.output, &theirs.output, &what("output"))?;
    assert_close(&ours.d_input, &theirs.d_input, &what("input gradient"))?;
    assert_close(&ours.d_weight, &theirs.d_weight, &what("weight gradient"))?;
    match (&ours.d_bias, &theirs.d_bias) {
        (Some(a), Some(b)) => assert_close(a, b, &what("bias gradient")),
        (None, None) => Ok(()),
        _ => Err(what("bias gradient presence")),
    }
}

#[test]
fn output_and_gradients_match_burns_on_a_spread_of_shapes() {
    let cases = [
        square(1, 1, 1, 5, 1),
        square(4, 16, 32, 8, 1),
        square(2, 16, 32, 8, 1).stride(2).no_bias(),
        square(3, 3, 16, 12, 3).pad(1),
        square(8, 16, 16, 8, 3).pad(1).no_bias(),
        square(2, 16, 32, 9, 3).pad(1).stride(2).no_bias(),
        square(2, 64, 64, 4, 3).pad(1),
        square(5, 1, 32, 14, 5).pad(2),
        square(2, 32, 64, 7, 5).pad(2),
        square(1, 6, 16, 14, 5),
        square(3, 4, 8, 11, 5).stride(2).pad(1),
        square(2, 2, 3, 3, 3).pad(2).stride(2),
        // Stride 2 with lines of 18 and 16 outputs: the vector moves of
        // im2col's stride-2 lines, with and without a tail.
        square(2, 3, 5, 36, 3).pad(1).stride(2),
        square(2, 4, 8, 32, 1).stride(2),
        // 196 positions: groups of 3 images, the last of 2.
        square(5, 3, 8, 14, 3).pad(1),
        square(5, 4, 6, 14, 1),
        // 529 positions: one image a product, pointwise without a copy.
        square(3, 4, 6, 23, 1),
    ];
    for (i, case) in cases.into_iter().enumerate() {
        compare(case, i as u64).unwrap();
    }
}

fn any_case() -> impl Strategy<Value = Case> {
    let side = (1usize..=5, 1usize..=3, 0usize..=2, 0usize..=2, 0usize..=6);
    (
        1usize..=4,
        1usize..=12,
        1usize..=12,
        side.clone(),
        side,
        any::<bool>(),
    )
        .prop_map(
            |(batch, c_in, c_out, (kh, sh, pt, pb, eh), (kw, sw, pl, pr, ew), bias)| Case {
                batch,
                c_in,
                c_out,
                // At least the kernel, so every case is a valid convolution.
                size: [kh + eh, kw + ew],
                kernel: [kh, kw],
                stride: [sh, sw],
                pad: [(pt, pb), (pl, pr)],
                bias,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn output_and_gradients_match_burns_on_random_shapes(case in any_case(), seed in 0u64..1000) {
        compare(case, seed).map_err(TestCaseError::fail)?;
    }
}

#[test]
fn the_same_inputs_give_the_same_bits() {
    let case = square(8, 16, 32, 10, 3).pad(1).stride(2);
    let first = run(case, 9, |x, w, b| native(x, w, b, case));
    // Another shape in between, so the second run reuses a larger buffer.
    run(square(2, 32, 8, 16, 5), 1, |x, w, b| {
        native(x, w, b, square(2, 32, 8, 16, 5))
    });
    let second = run(case, 9, |x, w, b| native(x, w, b, case));
    let bits = |r: &Results| -> Vec<Vec<u32>> {
        let mut all = vec![&r.output, &r.d_input, &r.d_weight];
        all.extend(&r.d_bias);
        all.iter()
            .map(|v| v.iter().map(|f| f.to_bits()).collect())
            .collect()
    };
    assert_eq!(bits(&first), bits(&second));
}

#[test]
fn without_autodiff_the_forward_is_the_same() {
    let case = square(3, 5, 7, 9, 3).pad(1);
    let device = crate::device::cpu();
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let tensor = |shape: [usize; 4], rng: &mut ChaCha8Rng| {
        let values = random(shape.iter().product(), rng);
        Tensor::<4>::from_data(TensorData::new(values, shape), &device)
    };
    let x = tensor([3, 5, 9, 9], &mut rng);
    let w = tensor([7, 5, 3, 3], &mut rng);
    let b = Tensor::<1>::from_data(TensorData::new(random(7, &mut rng), [7]), &device);
    let ours = host(native(x.clone(), w.clone(), Some(b.clone()), case));
    let theirs = host(burns(x, w, Some(b), case));
    assert_close(&ours, &theirs, "inference output").unwrap();
}

/// The model-facing `conv2d` against `Conv2d::forward` for burn's padding
/// configurations ("same" with an even kernel pads one more at the end), and
/// the fallback for what the native path does not cover (dilation, groups).
#[test]
fn conv2d_is_conv2d_forward_for_every_padding_and_falls_back_elsewhere() {
    let device: Device = crate::device::cpu().autodiff();
    let x = Tensor::<4>::from_data(
        TensorData::new(
            random(2 * 4 * 9 * 8, &mut ChaCha8Rng::seed_from_u64(3)),
            [2, 4, 9, 8],
        ),
        &device,
    );
    let configs = [
        Conv2dConfig::new([4, 6], [4, 4]).with_padding(PaddingConfig2d::Same),
        Conv2dConfig::new([4, 6], [3, 2])
            .with_stride([2, 1])
            .with_padding(PaddingConfig2d::Explicit(1, 0, 2, 1)),
        Conv2dConfig::new([4, 6], [3, 3]).with_padding(PaddingConfig2d::Valid),
        Conv2dConfig::new([4, 6], [3, 3]).with_dilation([2, 2]),
        Conv2dConfig::new([4, 6], [3, 3]).with_groups(2),
    ];
    for config in configs {
        let conv = config.init(&device);
        let ours = host(super::conv2d(&conv, x.clone()));
        let theirs = host(conv.forward(x.clone()));
        assert_close(&ours, &theirs, &format!("{config:?}")).unwrap();
    }
}
