//! The convolution weight gradient's matrix product `d_W = d_out · colᵀ`
//! (`[C_out, P] · [P, K]`, both factors running along the positions) through
//! `gemm` in three layouts, on the zoo models' shapes, one thread:
//!
//! * `row-major dst`: `d_W` written `[C_out, K]`, as the product was first
//!   called: gemm vectorizes along `K` and packs the column matrix by
//!   gathering a 64-row panel (AVX-512) out of rows `P` floats apart;
//! * `channel-major dst`: `d_W` written `[K, C_out]` (what
//!   `kernels::im2col::backward` does now, then transposes once a batch);
//! * `transpose, then gemm`: the column matrix transposed in tiles first,
//!   so every operand is read along its rows.
//!
//! `cargo bench -p cohort-train --bench gemm_layouts`; each line is the
//! shape and GFLOP/s of each layout, best of 5.

mod common;

use common::{product, seconds};

fn main() {
    println!(
        "# d_W = d_out · colᵀ, GFLOP/s: row-major dst, channel-major dst, transpose then gemm"
    );
    // (C_out, K = C_in·kh·kw, P = positions): resnet_20's three stages and
    // first layer, cnn's two convolutions (FashionMNIST).
    let shapes = [
        (16, 27, 1024),
        (16, 144, 1024),
        (32, 288, 256),
        (64, 576, 64),
        (32, 25, 784),
        (64, 800, 196),
    ];
    for (c_out, k, p) in shapes {
        let grad: Vec<f32> = (0..c_out * p).map(|i| (i % 7) as f32 * 0.1).collect();
        let col: Vec<f32> = (0..k * p).map(|i| (i % 5) as f32 * 0.1).collect();
        let mut d_w = vec![0.0f32; c_out * k];
        let mut col_t = vec![0.0f32; k * p];
        let flops = 2.0 * (c_out * k * p) as f64;
        let grad_op = (&grad[..], (p, 1));
        let col_t_view = (&col[..], (1, p));
        let row_major = seconds(20, || {
            product((c_out, k, p), &mut d_w, (k, 1), false, grad_op, col_t_view)
        });
        let channel_major = seconds(20, || {
            product(
                (c_out, k, p),
                &mut d_w,
                (1, c_out),
                false,
                grad_op,
                col_t_view,
            )
        });
        let transposed = seconds(20, || {
            const TILE: usize = 32;
            for r0 in (0..k).step_by(TILE) {
                for c0 in (0..p).step_by(TILE) {
                    for r in r0..(r0 + TILE).min(k) {
                        for c in c0..(c0 + TILE).min(p) {
                            col_t[c * k + r] = col[r * p + c];
                        }
                    }
                }
            }
            product(
                (c_out, k, p),
                &mut d_w,
                (k, 1),
                false,
                grad_op,
                (&col_t[..], (k, 1)),
            );
        });
        println!(
            "C_out={c_out} K={k} P={p}: {:.1} {:.1} {:.1}",
            flops / row_major / 1e9,
            flops / channel_major / 1e9,
            flops / transposed / 1e9
        );
    }
}
