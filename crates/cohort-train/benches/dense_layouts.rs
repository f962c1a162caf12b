//! A dense layer's three products at batch 32 through `gemm`, on the zoo's
//! dense shapes, one thread, in the layouts `kernels::linear` uses (burn's
//! `[in, out]` weight): the forward `y = x · W` written row-major, the
//! input gradient `dxᵀ = W · dyᵀ` and the weight gradient `dW = xᵀ · dy`;
//! then the forward in the three other combinations of the weight's layout
//! (`[in, out]` or PyTorch's `[out, in]`) and the output's (row-major `[B,
//! out]` or column-major, `yᵀ`), to say what the layout costs.
//!
//! `cargo bench -p cohort-train --bench dense_layouts`; each line is the
//! shape and GFLOP/s of each product, best of 5.

mod common;

use common::{product, seconds};

fn main() {
    println!(
        "# batch × in → out: forward, input gradient, weight gradient (burn's [in, out] weight) | \
         forward with W [in, out] and yᵀ, W [out, in] and y, W [out, in] and yᵀ; GFLOP/s"
    );
    // cnn_femnist's and cnn's first dense layers, multilayer's (McMahan et
    // al.'s 200 units), lstm_shakespeare's recurrent product, a 512 × 512.
    let shapes = [
        (32, 3136, 2048),
        (32, 3136, 512),
        (32, 784, 200),
        (32, 256, 1024),
        (32, 512, 512),
    ];
    for (b, i, o) in shapes {
        let x: Vec<f32> = (0..b * i).map(|v| (v % 7) as f32 * 0.1).collect();
        let w: Vec<f32> = (0..i * o).map(|v| (v % 5) as f32 * 0.1).collect();
        let dy: Vec<f32> = (0..b * o).map(|v| (v % 3) as f32 * 0.1).collect();
        let (mut y, mut d_x_t, mut d_w) = (vec![0.0; b * o], vec![0.0; i * b], vec![0.0; i * o]);
        let flops = 2.0 * (b * i * o) as f64;
        let calls = (2e9 / flops).max(3.0) as u32;
        let gflops = |seconds: f64| flops / seconds / 1e9;
        // `w` read as [in, out] (row stride `o`) or as [out, in] (row
        // stride `i`): the same values, another matrix, the same work.
        let (w_in_out, w_out_in) = ((&w[..], (o, 1)), (&w[..], (1, i)));
        let forward = |y: &mut [f32], w: (&[f32], (usize, usize)), y_strides| {
            product((b, o, i), y, y_strides, false, (&x, (i, 1)), w)
        };
        let row_major = (o, 1);
        let column_major = (1, b);
        let times = [
            seconds(calls, || forward(&mut y, w_in_out, row_major)),
            seconds(calls, || {
                product(
                    (b, i, o),
                    &mut d_x_t,
                    (1, b),
                    false,
                    (&dy, (o, 1)),
                    (&w, (1, o)),
                )
            }),
            seconds(calls, || {
                product(
                    (i, o, b),
                    &mut d_w,
                    (o, 1),
                    false,
                    (&x, (1, i)),
                    (&dy, (o, 1)),
                )
            }),
            seconds(calls, || forward(&mut y, w_in_out, column_major)),
            seconds(calls, || forward(&mut y, w_out_in, row_major)),
            seconds(calls, || forward(&mut y, w_out_in, column_major)),
        ];
        let [f, dx, dw, f_t, f_w, f_both] = times.map(gflops);
        println!("{b} × {i} → {o}: {f:.1} {dx:.1} {dw:.1} | {f_t:.1} {f_w:.1} {f_both:.1}");
    }
}
