//! A 5×5 convolution stage as LeNet uses it: im2col, one matrix product,
//! then bias, ReLU and 2×2/2 max pooling fused in one pass; and the way back.
//!
//! Layouts (batch `B`, `P = out_h · out_w` output positions per image):
//! the stage's input is `[B, C_in, H, W]` (NCHW, as burn and PyTorch);
//! the column matrix is `[C_in·25, B·P]`; the convolution's output is
//! `[C_out, B·P]` (channel-major, what the product writes); the pooled output
//! is `[B, C_out, out_h/2, out_w/2]`, NCHW again for the next stage.

/// Kernel side.
pub(crate) const K: usize = 5;

/// One convolution stage's shape: square `size × size` input, 5×5 kernel,
/// stride 1, symmetric zero padding, followed by 2×2 max pooling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ConvShape {
    pub c_in: usize,
    pub c_out: usize,
    pub size: usize,
    pub pad: usize,
}

impl ConvShape {
    pub(crate) const fn out(&self) -> usize {
        self.size + 2 * self.pad - K + 1
    }
    pub(crate) const fn positions(&self) -> usize {
        self.out() * self.out()
    }
    pub(crate) const fn pooled(&self) -> usize {
        self.out() / 2
    }
    /// Rows of the column matrix (the product's inner dimension).
    pub(crate) const fn patch(&self) -> usize {
        self.c_in * K * K
    }
    pub(crate) const fn input_len(&self) -> usize {
        self.c_in * self.size * self.size
    }
    pub(crate) const fn pooled_len(&self) -> usize {
        self.c_out * self.pooled() * self.pooled()
    }
    /// Side of the input with its zero padding.
    pub(crate) const fn padded(&self) -> usize {
        self.size + 2 * self.pad
    }
}

/// `input` (`[B, C_in, H, W]`) with its zero border (`[B, C_in, H+2p, W+2p]`),
/// so that [`im2col`] only ever copies whole runs.
#[inline(always)]
pub(crate) fn pad(shape: &ConvShape, batch: usize, input: &[f32], padded: &mut [f32]) {
    let (size, side, pad) = (shape.size, shape.padded(), shape.pad);
    let padded = &mut padded[..batch * shape.c_in * side * side];
    padded.fill(0.0);
    for (dst, src) in padded
        .chunks_exact_mut(side * side)
        .zip(input.chunks_exact(size * size))
    {
        for (line, row) in dst[pad * side..]
            .chunks_exact_mut(side)
            .zip(src.chunks_exact(size))
        {
            line[pad..pad + size].copy_from_slice(row);
        }
    }
}

/// `input` (`[B, C_in, S, S]`, already padded: `S = size + 2·pad`) as the
/// column matrix `[C_in·25, B·P]`.
#[inline(always)]
pub(crate) fn im2col(shape: &ConvShape, batch: usize, input: &[f32], col: &mut [f32]) {
    let (out, side) = (shape.out(), shape.padded());
    let p = shape.positions();
    let width = batch * p;
    let col = &mut col[..shape.patch() * width];
    for ci in 0..shape.c_in {
        for ky in 0..K {
            for kx in 0..K {
                let row = &mut col[((ci * K + ky) * K + kx) * width..][..width];
                for (b, dst) in row.chunks_exact_mut(p).enumerate() {
                    let image = &input[(b * shape.c_in + ci) * side * side..][..side * side];
                    let image = &image[ky * side + kx..];
                    for (line, src) in dst.chunks_exact_mut(out).zip(image.chunks(side)) {
                        copy_short(line, &src[..out]);
                    }
                }
            }
        }
    }
}

/// `dst = src` for the runs of 10–28 values im2col copies, tens of thousands
/// per step: as a vector loop rather than a `memcpy` call each (the call was
/// 14 % of a training step). Adding `+0.0` keeps the compiler from turning
/// the loop back into `memcpy`; it changes only the sign of a zero, which no
/// product or sum downstream can see.
#[inline(always)]
fn copy_short(dst: &mut [f32], src: &[f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = *s + 0.0;
    }
}

/// The adjoint of [`im2col`] for an unpadded input (the only stage whose
/// input gradient is needed is unpadded in both LeNets): `d_input = Σ` of
/// every column entry that read it. Overwrites `d_input` (`[B, C_in, H, W]`).
#[inline(always)]
pub(crate) fn col2im(shape: &ConvShape, batch: usize, d_col: &[f32], d_input: &mut [f32]) {
    assert_eq!(shape.pad, 0, "col2im of a padded input");
    let (out, size) = (shape.out(), shape.size);
    let p = shape.positions();
    let width = batch * p;
    let d_input = &mut d_input[..batch * shape.input_len()];
    d_input.fill(0.0);
    for (b, images) in d_input.chunks_exact_mut(shape.input_len()).enumerate() {
        for (ci, image) in images.chunks_exact_mut(size * size).enumerate() {
            for ky in 0..K {
                for kx in 0..K {
                    let row = &d_col[((ci * K + ky) * K + kx) * width + b * p..][..p];
                    let image = &mut image[ky * size + kx..];
                    for (dst, src) in image.chunks_mut(size).zip(row.chunks_exact(out)) {
                        for (d, s) in dst[..out].iter_mut().zip(src) {
                            *d += s;
                        }
                    }
                }
            }
        }
    }
}

/// Bias, ReLU and 2×2 max pooling of the convolution's output `z`
/// (`[C_out, B·P]`, without bias) into `pooled` (`[B, C_out, out/2, out/2]`).
///
/// Rounding is monotone, so `max(zᵢ) + b = max(zᵢ + b)` and pooling before the
/// bias and the ReLU gives burn's values with a quarter of the additions. No
/// winner is stored: [`pool_backward`] finds it again in `z`, which the
/// backward pass keeps anyway, so inference writes nothing it does not need.
#[inline(always)]
pub(crate) fn bias_relu_pool(
    shape: &ConvShape,
    batch: usize,
    z: &[f32],
    bias: &[f32],
    pooled: &mut [f32],
) {
    let (out, half) = (shape.out(), shape.pooled());
    let p = shape.positions();
    for co in 0..shape.c_out {
        let plane = &z[co * batch * p..][..batch * p];
        let b_co = bias[co];
        for b in 0..batch {
            let image = &plane[b * p..][..p];
            let at = (b * shape.c_out + co) * half * half;
            let dst = &mut pooled[at..][..half * half];
            for (py, row) in dst.chunks_exact_mut(half).enumerate() {
                let top = &image[2 * py * out..][..2 * half];
                let bottom = &image[(2 * py + 1) * out..][..2 * half];
                for (px, d) in row.iter_mut().enumerate() {
                    let m = top[2 * px]
                        .max(top[2 * px + 1])
                        .max(bottom[2 * px].max(bottom[2 * px + 1]));
                    *d = (m + b_co).max(0.0);
                }
            }
        }
    }
}

/// The way back through [`bias_relu_pool`]: the gradient of the pooled output
/// (`[B, C_out, out/2, out/2]`) as the gradient of the pre-activation
/// (`[C_out, B·P]`, every element written), and the bias gradient. Each
/// window's gradient goes to its first largest element of `z` (row-major
/// order), and nowhere when the ReLU cut the window's maximum.
#[inline(always)]
pub(crate) fn pool_backward(
    shape: &ConvShape,
    batch: usize,
    z: &[f32],
    bias: &[f32],
    d_pooled: &[f32],
    d_z: &mut [f32],
    d_bias: &mut [f32],
) {
    let (out, half) = (shape.out(), shape.pooled());
    let p = shape.positions();
    for co in 0..shape.c_out {
        let plane = &z[co * batch * p..][..batch * p];
        let d_plane = &mut d_z[co * batch * p..][..batch * p];
        let mut bias_sum = 0.0f32;
        for b in 0..batch {
            let image = &plane[b * p..][..p];
            let d_image = &mut d_plane[b * p..][..p];
            let at = (b * shape.c_out + co) * half * half;
            let grads = &d_pooled[at..][..half * half];
            for py in 0..half {
                let (top, bottom) = image[2 * py * out..][..2 * out].split_at(out);
                let (d_top, d_bottom) = d_image[2 * py * out..][..2 * out].split_at_mut(out);
                for px in 0..half {
                    let window = [
                        top[2 * px],
                        top[2 * px + 1],
                        bottom[2 * px],
                        bottom[2 * px + 1],
                    ];
                    let mut best = 0;
                    for i in 1..4 {
                        if window[i] > window[best] {
                            best = i;
                        }
                    }
                    let alive = window[best] + bias[co] > 0.0;
                    let g = if alive { grads[py * half + px] } else { 0.0 };
                    bias_sum += g;
                    d_top[2 * px] = if best == 0 { g } else { 0.0 };
                    d_top[2 * px + 1] = if best == 1 { g } else { 0.0 };
                    d_bottom[2 * px] = if best == 2 { g } else { 0.0 };
                    d_bottom[2 * px + 1] = if best == 3 { g } else { 0.0 };
                }
            }
        }
        d_bias[co] = bias_sum;
    }
}
