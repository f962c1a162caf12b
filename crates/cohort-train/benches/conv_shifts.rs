//! Whether a 3×3 stride-1 convolution would gain from not building a column
//! matrix: its forward pass, batch 32, on resnet_20's three stages, as
//!
//! * `im2col+gemm`: each image's column matrix `[C_in·9, P]` (the rows
//!   copied as `kernels::im2col` copies them, whole runs and zeroed edges),
//!   then one product `[C_out, C_in·9] · [C_in·9, P]`, as cohort computes it;
//! * `gemm alone`: that product without building the columns, the bound an
//!   im2col-free convolution of the same product shape could approach;
//! * `shifts`: no column matrix. The input is laid out padded, rows of
//!   `W + 1` (the last a zero that serves as both neighbours' border) and
//!   one zero row between images, so that each of the nine kernel offsets is
//!   the same matrix shifted by `ky·(W+1) + kx`; the output is nine products
//!   `[C_out, C_in] · [C_in, columns]` accumulated, then its border columns
//!   dropped. Several images share a product where they are small (about
//!   `COLS` columns, 512 unless the variable says otherwise).
//!
//! `cargo bench -p cohort-train --bench conv_shifts`; GFLOP/s, best of 5.

mod common;

use common::{product, seconds};

fn main() {
    let batch = 32;
    for (c, side, per) in [(16, 32, 1), (32, 16, 2), (64, 8, 8)] {
        let (h, w) = (side, side);
        let p = h * w;
        let input: Vec<f32> = (0..batch * c * p).map(|i| (i % 13) as f32 * 0.1).collect();
        let weight: Vec<f32> = (0..c * c * 9).map(|i| (i % 7) as f32 * 0.01).collect();
        let mut out = vec![0.0f32; batch * c * p];
        let flops = 2.0 * (batch * c * c * 9 * p) as f64;
        // (a) im2col, `per` images a product.
        let width = per * p;
        let mut col = vec![0.0f32; c * 9 * width];
        let mut out_group = vec![0.0f32; c * width];
        let im2col_all = |col: &mut [f32], first: usize| {
            for ci in 0..c {
                for ky in 0..3 {
                    for kx in 0..3 {
                        let row = &mut col[((ci * 3 + ky) * 3 + kx) * width..][..width];
                        for (b, dst) in row.chunks_exact_mut(p).enumerate() {
                            let image = &input[((first + b) * c + ci) * p..][..p];
                            for oy in 0..h {
                                let iy = oy as isize + ky as isize - 1;
                                let line = &mut dst[oy * w..][..w];
                                if iy < 0 || iy >= h as isize {
                                    line.fill(0.0);
                                    continue;
                                }
                                let src = &image[iy as usize * w..][..w];
                                match kx {
                                    0 => {
                                        line[0] = 0.0;
                                        line[1..].copy_from_slice(&src[..w - 1]);
                                    }
                                    1 => line.copy_from_slice(src),
                                    _ => {
                                        line[..w - 1].copy_from_slice(&src[1..]);
                                        line[w - 1] = 0.0;
                                    }
                                }
                            }
                        }
                    }
                }
            }
        };
        let gemm_only = seconds(5, || {
            for first in (0..batch).step_by(per) {
                product(
                    (c, width, c * 9),
                    &mut out_group,
                    (width, 1),
                    false,
                    (&weight, (c * 9, 1)),
                    (&col, (width, 1)),
                );
                std::hint::black_box(first);
            }
        });
        let with_im2col = seconds(5, || {
            for first in (0..batch).step_by(per) {
                im2col_all(&mut col, first);
                product(
                    (c, width, c * 9),
                    &mut out_group,
                    (width, 1),
                    false,
                    (&weight, (c * 9, 1)),
                    (&col, (width, 1)),
                );
                for b in 0..per {
                    for co in 0..c {
                        out[((first + b) * c + co) * p..][..p]
                            .copy_from_slice(&out_group[co * width + b * p..][..p]);
                    }
                }
            }
        });
        // (b) shifted views: rows of `w + 1` (the last a zero shared by both
        // neighbours), one zero row between images and above the first,
        // a zero before everything and a margin after.
        let wp = w + 1;
        let image_rows = h + 1;
        let columns_wanted =
            std::env::var("COLS").map_or(512, |v| v.parse().expect("COLS: a count"));
        let group = (columns_wanted / (image_rows * wp)).clamp(1, batch);
        let cols = group * image_rows * wp;
        let cs = cols + 2 * wp + 2;
        let mut padded = vec![0.0f32; c * cs];
        // Weight per shift: [9][C_out][C_in].
        let mut shifted_w = vec![0.0f32; 9 * c * c];
        for co in 0..c {
            for ci in 0..c {
                for s in 0..9 {
                    shifted_w[(s * c + co) * c + ci] = weight[(co * c + ci) * 9 + s];
                }
            }
        }
        let mut wide = vec![0.0f32; c * cols];
        let shifts = seconds(5, || {
            for first in (0..batch).step_by(group) {
                let n = group.min(batch - first);
                for ci in 0..c {
                    let chan = &mut padded[ci * cs..][..cs];
                    for b in 0..n {
                        let image = &input[((first + b) * c + ci) * p..][..p];
                        for y in 0..h {
                            let at = 1 + (b * image_rows + 1 + y) * wp;
                            chan[at..at + w].copy_from_slice(&image[y * w..][..w]);
                        }
                    }
                }
                for s in 0..9 {
                    let (ky, kx) = (s / 3, s % 3);
                    let off = ky * wp + kx;
                    product(
                        (c, cols, c),
                        &mut wide,
                        (cols, 1),
                        s > 0,
                        (&shifted_w[s * c * c..][..c * c], (c, 1)),
                        (&padded[off..], (cs, 1)),
                    );
                }
                for b in 0..n {
                    for co in 0..c {
                        let dst = &mut out[((first + b) * c + co) * p..][..p];
                        for y in 0..h {
                            dst[y * w..][..w].copy_from_slice(
                                &wide[co * cols + (b * image_rows + y) * wp..][..w],
                            );
                        }
                    }
                }
            }
        });
        println!(
            "C={c} {side}×{side}: im2col+gemm {:.1} GFLOP/s (gemm alone {:.1}), shifts {:.1} (group {group})",
            flops / with_im2col / 1e9,
            flops / gemm_only / 1e9,
            flops / shifts / 1e9,
        );
    }
}
