//! The native kernels against burn's own ops on the same parameters and
//! random inputs: logits, loss and every gradient.

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::GradientsParams;
use burn::tensor::{Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::Native;
use super::conv::{ConvShape, col2im, im2col, pad};
use super::flex::testing::assert_close;
use crate::init::seeded_parameters;
use crate::model::{CnnBn, FederatedModel, Inputs, LeNet5, LeNet5Compact, Randomness};
use crate::params::{extract, load};

fn random(len: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn batch(n: usize, seed: u64) -> (Vec<f32>, Vec<i64>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let images = random(n * 784, &mut rng);
    let labels = (0..n).map(|_| rng.random_range(0..10i64)).collect();
    (images, labels)
}

/// Every parameter's gradient in visit order, from burn's `GradientsParams`.
struct Collect<'a> {
    grads: &'a GradientsParams,
    out: Vec<Vec<f32>>,
}

impl ModuleVisitor for Collect<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let grad = self
            .grads
            .get::<D>(param.id)
            .expect("every parameter has a gradient");
        self.out.push(grad.into_data().try_to_vec::<f32>().unwrap());
    }
}

fn collect<M: Module>(model: &M, grads: &GradientsParams) -> Vec<Vec<f32>> {
    let mut visitor = Collect {
        grads,
        out: Vec::new(),
    };
    model.visit(&mut visitor);
    visitor.out
}

fn logits<M: FederatedModel>(
    model: &M,
    images: &[f32],
    device: &burn::tensor::Device,
) -> Tensor<2> {
    let input = Inputs::from_host(images.to_vec(), &[1, 28, 28], device);
    model.forward(input, &mut Randomness::none())
}

fn burn_step<M: FederatedModel>(model: &M, images: &[f32], labels: &[i64]) -> (f32, Vec<Vec<f32>>) {
    let device = crate::device::cpu().autodiff();
    let n = labels.len();
    let targets = Tensor::<1, Int>::from_data(TensorData::new(labels.to_vec(), [n]), &device);
    let loss = CrossEntropyLossConfig::new()
        .init(&device)
        .forward(logits(model, images, &device), targets);
    let value = loss.clone().into_scalar::<f32>();
    let grads = GradientsParams::from_grads(loss.backward(), model);
    (value, collect(model, &grads))
}

/// The parameters are seeded, not drawn from burn's generator, which the
/// tests running beside this one draw from too. A ReLU's input or a pooling
/// window's runner-up within rounding of the cut sends one sample's gradient
/// another way in the two computations (both right: the function has no
/// derivative there); about one model in a hundred has such a point on these
/// batches, so an unseeded model made this test fail now and then.
#[test]
fn gradients_match_burns_for_both_lenets_and_odd_batches() {
    let device = crate::device::cpu().autodiff();
    gradients_match_burns(seeded(LeNet5::new(10, &device)), "lenet5");
    gradients_match_burns(seeded(LeNet5Compact::new(10, &device)), "lenet5_compact");
}

fn seeded<M: Module>(model: M) -> M {
    let tree = seeded_parameters(&extract(&model), 7);
    load(model, &tree).expect("its own layout")
}

fn gradients_match_burns<M: FederatedModel>(model: M, model_name: &str) {
    {
        let mut native = Native::for_net(&model).expect("a CPU path");
        for (n, seed) in [(32, 1), (7, 2), (1, 3)] {
            let (images, labels) = batch(n, seed);
            let (loss, expected) = burn_step(&model, &images, &labels);
            let (native_loss, grads) = native.step(&model, &images, &labels);
            let got = collect(&model, &grads);
            assert!(
                (native_loss - loss).abs() <= 1e-5 * loss.abs(),
                "{model_name} batch {n}: loss {native_loss} vs {loss}"
            );
            for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
                assert_close(g, e, 2e-5, &format!("{model_name} batch {n} parameter {i}"));
            }
        }
    }
}

#[test]
fn predictions_match_burns_logits() {
    let device = crate::device::cpu();
    predictions_match_burns(LeNet5::new(10, &device), "lenet5");
    predictions_match_burns(LeNet5Compact::new(10, &device), "lenet5_compact");
}

fn predictions_match_burns<M: FederatedModel>(model: M, model_name: &str) {
    let device = crate::device::cpu();
    {
        let mut native = Native::for_net(&model).unwrap();
        let (images, _) = batch(45, 4);
        let logits = logits(&model, &images, &device)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        native.read(&model);
        let got = native.net.forward(&native.params, &images, 45).to_vec();
        assert_close(&got, &logits, 1e-5, &format!("{model_name} logits"));
        let mut predicted = vec![usize::MAX; 45];
        native.predict(&model, &images, 16, |i, row| {
            predicted[i] = super::argmax(row)
        });
        let expected: Vec<usize> = logits.chunks(10).map(super::argmax).collect();
        assert_eq!(predicted, expected, "{model_name}");
    }
}

#[test]
fn the_same_step_gives_the_same_bits() {
    let device = crate::device::cpu().autodiff();
    let model = LeNet5::new(10, &device);
    let (images, labels) = batch(32, 5);
    let mut first = Native::for_net(&model).unwrap();
    let mut second = Native::for_net(&model).unwrap();
    // A smaller batch first, so the second instance reuses larger buffers.
    let (small, small_labels) = batch(3, 6);
    second.step(&model, &small, &small_labels);
    let (la, ga) = first.step(&model, &images, &labels);
    let (lb, gb) = second.step(&model, &images, &labels);
    assert_eq!(la.to_bits(), lb.to_bits());
    assert_eq!(collect(&model, &ga), collect(&model, &gb));
}

#[test]
fn no_native_path_for_batchnorm_models() {
    assert!(Native::for_net(&CnnBn::new(10, &crate::device::cpu())).is_none());
}

#[test]
fn col2im_is_the_adjoint_of_im2col() {
    // <im2col(x), c> = <x, col2im(c)> for every x and c.
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for size in [8, 14] {
        let shape = ConvShape {
            c_in: 3,
            c_out: 1,
            size,
            pad: 0,
        };
        let batch = 2;
        let x = random(batch * shape.input_len(), &mut rng);
        let c = random(shape.patch() * batch * shape.positions(), &mut rng);
        let mut col = vec![0.0; c.len()];
        im2col(&shape, batch, &x, &mut col);
        let mut back = vec![0.0; x.len()];
        col2im(&shape, batch, &c, &mut back);
        let lhs: f64 = col.iter().zip(&c).map(|(a, b)| (a * b) as f64).sum();
        let rhs: f64 = x.iter().zip(&back).map(|(a, b)| (a * b) as f64).sum();
        assert!(
            (lhs - rhs).abs() <= 1e-4 * lhs.abs().max(1.0),
            "{lhs} vs {rhs}"
        );
    }
}

#[test]
fn padding_surrounds_each_image_with_zeros() {
    let shape = ConvShape {
        c_in: 2,
        c_out: 1,
        size: 3,
        pad: 2,
    };
    let input: Vec<f32> = (1..=18).map(|v| v as f32).collect();
    let mut padded = vec![f32::NAN; 2 * 49];
    pad(&shape, 1, &input, &mut padded);
    for (c, image) in padded.chunks(49).enumerate() {
        for (i, &v) in image.iter().enumerate() {
            let (y, x) = (i / 7, i % 7);
            let inside = (2..5).contains(&y) && (2..5).contains(&x);
            let expected = if inside {
                input[c * 9 + (y - 2) * 3 + (x - 2)]
            } else {
                0.0
            };
            assert_eq!(v, expected, "channel {c} at ({y}, {x})");
        }
    }
}
