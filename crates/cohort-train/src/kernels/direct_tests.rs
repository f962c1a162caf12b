//! The column-free convolution against im2col's on ragged shapes: output
//! channels that fill no whole tile, kernels of other sides than 3, no
//! padding, non-square images, batches of several groups; and its AVX-512
//! micro-kernel against the same sums in plain loops, bit for bit.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::direct::{Kernel, applies, backward, forward, wide};
use super::im2col::{self, Geometry, Grads};
use super::{shifted, winograd};

fn geometry(
    batch: usize,
    (c_in, c_out): (usize, usize),
    size: [usize; 2],
    kernel: [usize; 2],
    pad: [usize; 2],
) -> Geometry {
    Geometry {
        batch,
        c_in,
        height: size[0],
        width: size[1],
        c_out,
        kernel,
        stride: [1, 1],
        pad: [(pad[0], pad[0]), (pad[1], pad[1])],
    }
}

/// Output, input gradient, weight gradient and bias gradient.
pub(super) type Results = [Vec<f32>; 4];

fn random(len: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Which path computes a case.
pub(super) enum Path {
    ColumnFree(Kernel),
    Shifted,
    Winograd,
    Columns,
}

/// `g` on seeded inputs, through the direct convolution (`Some(kernel)`) or
/// im2col (`None`).
fn run(g: &Geometry, seed: u64, kernel: Option<Kernel>) -> Results {
    run_on(g, seed, kernel.map_or(Path::Columns, Path::ColumnFree))
}

/// `g` on seeded inputs through `path`.
pub(super) fn run_on(g: &Geometry, seed: u64, path: Path) -> Results {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let input = random(g.batch * g.input_len(), &mut rng);
    let weight = random(g.weight_len(), &mut rng);
    let bias = random(g.c_out, &mut rng);
    let d_out = random(g.batch * g.output_len(), &mut rng);
    let mut out = vec![f32::NAN; d_out.len()];
    let mut d_input = vec![f32::NAN; input.len()];
    let mut d_weight = vec![f32::NAN; weight.len()];
    let mut d_bias = vec![f32::NAN; g.c_out];
    let grads = Grads {
        input: Some(&mut d_input),
        weight: Some(&mut d_weight),
        bias: Some(&mut d_bias),
    };
    match path {
        Path::ColumnFree(kernel) => {
            forward(g, &input, &weight, Some(&bias), &mut out, kernel);
            backward(g, &input, &weight, &d_out, grads, kernel);
        }
        Path::Shifted => {
            shifted::forward(g, &input, &weight, Some(&bias), &mut out);
            shifted::backward(g, &input, &weight, &d_out, grads);
        }
        Path::Winograd => {
            winograd::forward(g, &input, &weight, Some(&bias), &mut out);
            winograd::backward(g, &input, &weight, &d_out, grads);
        }
        Path::Columns => {
            im2col::forward(g, &input, &weight, Some(&bias), &mut out);
            im2col::backward(g, &input, &weight, &d_out, grads);
        }
    }
    [out, d_input, d_weight, d_bias]
}

/// Each value within `1e-5` of the largest magnitude of im2col's tensor:
/// the same sums of at most a few thousand products in another order.
pub(super) fn assert_close(ours: &Results, theirs: &Results, g: &Geometry) {
    let names = [
        "output",
        "input gradient",
        "weight gradient",
        "bias gradient",
    ];
    for ((a, b), name) in ours.iter().zip(theirs).zip(names) {
        assert_eq!(a.len(), b.len(), "{name} of {g:?}");
        let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * scale.max(1.0),
                "{name} of {g:?} at {i}: {x} against im2col's {y}"
            );
        }
    }
}

fn cases() -> Vec<Geometry> {
    vec![
        // resnet_20's stages, shortened batches.
        geometry(2, (16, 16), [32, 32], [3, 3], [1, 1]),
        geometry(3, (32, 32), [16, 16], [3, 3], [1, 1]),
        // 8 × 8 images, 72 laid-out positions each: 56 a group, so two
        // groups, the second of 5 (with the first's masks).
        geometry(61, (8, 7), [8, 8], [3, 3], [1, 1]),
        // Output channels that fill no whole tile of eight; a lone channel.
        geometry(2, (9, 13), [5, 7], [3, 3], [1, 1]),
        geometry(1, (8, 1), [6, 6], [3, 3], [1, 1]),
        // cnn's second layer: 5 × 5, padding 2.
        geometry(2, (32, 64), [14, 14], [5, 5], [2, 2]),
        // No padding; a non-square kernel with its own padding per axis.
        geometry(3, (10, 5), [9, 11], [3, 3], [0, 0]),
        geometry(2, (8, 6), [10, 7], [3, 5], [1, 2]),
        geometry(2, (8, 4), [7, 9], [2, 2], [0, 0]),
        // Padding wider than the kernel's half: the output rows (9) are
        // longer than the input's (7), and the laid-out rows take theirs.
        geometry(2, (8, 5), [6, 7], [3, 3], [2, 2]),
        // Two chunks of inputs (64 and 6), the second carried through the
        // output.
        geometry(2, (70, 8), [6, 6], [3, 3], [1, 1]),
        // Fewer input channels than the dispatch sends here: still right.
        geometry(2, (3, 8), [12, 12], [3, 3], [1, 1]),
    ]
}

#[test]
fn the_portable_kernel_gives_im2cols_results() {
    for (i, g) in cases().iter().enumerate() {
        let ours = run(g, i as u64, Some(Kernel::Portable));
        let theirs = run(g, i as u64, None);
        assert_close(&ours, &theirs, g);
    }
}

/// The AVX-512 micro-kernel sums each output in the portable loops' order
/// with the same fused multiply-adds: the same bits. On a CPU without
/// AVX-512F, what holds instead: the dispatch never takes it.
#[test]
fn the_wide_kernel_is_the_portable_kernel_bit_for_bit_where_the_cpu_has_it() {
    for (i, g) in cases().iter().enumerate() {
        if !wide() {
            assert!(
                !applies(g),
                "{g:?} sent to the wide kernel without AVX-512F"
            );
            continue;
        }
        let wide = run(g, i as u64, Some(Kernel::Wide));
        let portable = run(g, i as u64, Some(Kernel::Portable));
        let bits = |r: &Results| -> Vec<Vec<u32>> {
            r.iter()
                .map(|v| v.iter().map(|f| f.to_bits()).collect())
                .collect()
        };
        assert_eq!(bits(&wide), bits(&portable), "{g:?}");
    }
}

#[test]
fn applies_to_stride_one_with_padding_the_kernel_covers() {
    let g = geometry(1, (16, 16), [8, 8], [3, 3], [1, 1]);
    assert_eq!(applies(&g), wide());
    let strided = Geometry {
        stride: [2, 2],
        ..g
    };
    let uneven = Geometry {
        pad: [(1, 0), (1, 1)],
        ..g
    };
    let too_much = geometry(1, (16, 16), [8, 8], [3, 3], [3, 1]);
    let pointwise = geometry(1, (16, 16), [8, 8], [1, 1], [0, 0]);
    let few_channels = geometry(1, (3, 16), [8, 8], [3, 3], [1, 1]);
    // Outputs 16 of the padded image's 25 positions.
    let small_maps = geometry(1, (16, 16), [4, 4], [3, 3], [1, 1]);
    let many_channels = geometry(1, (64, 128), [16, 16], [3, 3], [1, 1]);
    for g in [
        strided,
        uneven,
        too_much,
        pointwise,
        few_channels,
        small_maps,
        many_channels,
    ] {
        assert!(!applies(&g), "{g:?}");
    }
}

/// A backward pass parts into the input's gradient with the bias's and the
/// weight's, and a part with nothing to compute says so.
#[test]
fn gradients_split_into_the_inputs_and_the_weights() {
    let (mut d_input, mut d_weight, mut d_bias) = ([0.0f32; 1], [0.0f32; 2], [0.0f32; 3]);
    let lens = |g: &Grads<'_>| {
        [&g.input, &g.weight, &g.bias].map(|part| part.as_ref().map(|values| values.len()))
    };
    let [input_part, weight_part] = Grads {
        input: Some(&mut d_input),
        weight: Some(&mut d_weight),
        bias: Some(&mut d_bias),
    }
    .split();
    assert_eq!(lens(&input_part), [Some(1), None, Some(3)]);
    assert_eq!(lens(&weight_part), [None, Some(2), None]);
    let [input_part, weight_part] = Grads {
        input: None,
        weight: Some(&mut d_weight),
        bias: None,
    }
    .split();
    assert!(!input_part.any());
    assert!(weight_part.any());
}
