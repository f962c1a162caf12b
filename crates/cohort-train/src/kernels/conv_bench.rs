//! The convolution's three paths, one pass at a time, for
//! `benches/conv_passes.rs`: the kernels are private to the crate, and
//! which path computes which pass (`kernels::conv2d`'s routes) was chosen
//! from these timings.

use std::time::Instant;

use super::im2col::{self, Geometry, Grads};
use super::{direct, shifted, winograd};

/// The paths, by name: the column-free kernel (`kernels::direct`, on CPUs
/// with AVX-512 only), the shifted copies (`kernels::shifted`, 32 input
/// channels or more), Winograd's F(2 × 2, 3 × 3) (`kernels::winograd`, 3 ×
/// 3 kernels of padding 1, 8 input channels or more) and im2col.
pub const PATHS: [&str; 4] = ["column-free", "shifted", "winograd", "im2col"];

/// A 3 × 3-or-other square convolution of stride 1 and "same" padding,
/// with inputs and gradients to run it on.
pub struct Case {
    g: Geometry,
    input: Vec<f32>,
    weight: Vec<f32>,
    out: Vec<f32>,
    d_input: Vec<f32>,
    d_weight: Vec<f32>,
}

impl Case {
    /// `batch` images of `c_in` channels of `side × side`, to `c_out`
    /// channels through a `kernel × kernel` kernel (an odd side: padding
    /// `kernel / 2`) of stride `stride`.
    pub fn new(
        batch: usize,
        (c_in, c_out): (usize, usize),
        side: usize,
        kernel: usize,
        stride: usize,
    ) -> Self {
        let pad = kernel / 2;
        let g = Geometry {
            batch,
            c_in,
            height: side,
            width: side,
            c_out,
            kernel: [kernel, kernel],
            stride: [stride, stride],
            pad: [(pad, pad), (pad, pad)],
        };
        let values = |len: usize, m: usize| (0..len).map(|i| (i % m) as f32 * 0.01).collect();
        Self {
            input: values(batch * g.input_len(), 13),
            weight: values(g.weight_len(), 7),
            out: vec![0.0; batch * g.output_len()],
            d_input: vec![0.0; batch * g.input_len()],
            d_weight: vec![0.0; g.weight_len()],
            g,
        }
    }

    /// Multiply-adds of one pass, times two.
    pub fn flop(&self) -> f64 {
        let g = &self.g;
        2.0 * (g.batch * g.c_in * g.c_out * g.kernel[0] * g.kernel[1] * g.positions()) as f64
    }

    /// Whether `path` (an index into `PATHS`) can run this case here.
    pub fn runs_on(&self, path: usize) -> bool {
        match path {
            0 => direct::wide() && self.g.stride == [1, 1],
            1 => shifted::applies(&self.g),
            2 => winograd::applies(&self.g),
            _ => true,
        }
    }

    /// Seconds of the forward pass, the input gradient alone, the weight
    /// gradient alone, and both gradients in one call (as a model's backward
    /// pass asks for them) through `path`, once each.
    pub fn time(&mut self, path: usize) -> [f64; 4] {
        assert!(
            self.runs_on(path),
            "{} cannot run {:?}",
            PATHS[path],
            self.g
        );
        let Self {
            g,
            input,
            weight,
            out,
            d_input,
            d_weight,
        } = self;
        let start = Instant::now();
        super::simd::dispatch(
            #[inline(always)]
            || match path {
                0 => direct::forward(g, input, weight, None, out, direct::Kernel::Wide),
                1 => shifted::forward(g, input, weight, None, out),
                2 => winograd::forward(g, input, weight, None, out),
                _ => im2col::forward(g, input, weight, None, out),
            },
        );
        let forward = start.elapsed().as_secs_f64();
        let gradient = |grads: Grads<'_>| {
            let start = Instant::now();
            super::simd::dispatch(
                #[inline(always)]
                || match path {
                    0 => direct::backward(g, input, weight, out, grads, direct::Kernel::Wide),
                    1 => shifted::backward(g, input, weight, out, grads),
                    2 => winograd::backward(g, input, weight, out, grads),
                    _ => im2col::backward(g, input, weight, out, grads),
                },
            );
            start.elapsed().as_secs_f64()
        };
        let input_gradient = gradient(Grads {
            input: Some(d_input),
            weight: None,
            bias: None,
        });
        let weight_gradient = gradient(Grads {
            input: None,
            weight: Some(d_weight),
            bias: None,
        });
        let both = gradient(Grads {
            input: Some(d_input),
            weight: Some(d_weight),
            bias: None,
        });
        [forward, input_gradient, weight_gradient, both]
    }
}
