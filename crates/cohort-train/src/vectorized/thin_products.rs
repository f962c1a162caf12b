//! Two matrix products per client whose outputs are too thin for a tiled
//! product, each one GPU thread an output element:
//!
//! * [`transposed_product`], `lhsᵀ · rhs` (`[K, rows, m]ᵀ · [K, rows, n]` →
//!   `[K, m, n]`) where `rows` is long and `m · n` small: a convolution's
//!   weight gradient, whose reduction runs over every position of every
//!   sample of a client's batch (25,088 rows for LeNet-5's first layer at
//!   batch 32) into a few hundred outputs (25 × 6);
//! * [`narrow_product`], `lhs · rhs` (`[K, rows, m] · [K, m, n]`) where `m`
//!   and `n` are both small: a first convolution's forward product, whose
//!   patches have one or three channels (25 or 75 values) and whose output
//!   has a few channels.
//!
//! A tiled product gives each thread a tile of the output, and burn's
//! default kernel without the autotuner (cubek's `SimpleUnit`) picks tiles
//! wider than 6 or 16 columns, so most of its threads idle on these shapes;
//! splitting the weight gradient by sample instead gives 3,200 products of
//! `[25 × 784] · [784 × 6]`, each smaller than one tile, and summing it
//! column by column from scaled copies of the patches moves them through
//! memory once per output channel (docs/BENCHMARKS.md: LeNet-5's two weight
//! gradients took 4.4 ms and its first forward product 1.4 ms of a 10.3 ms
//! step on an H100). Here each output element is one thread's, which reads
//! its operands from the caches: the transposed product sums one chunk of
//! [`CHUNK_ROWS`] rows per thread, so each client's reduction is spread
//! over `m · n × chunks` threads, and a second pass (burn's sum, in
//! [`transposed_product`]) adds the chunks' partial sums.
//!
//! Every thread adds its terms in order and the chunks are summed in order:
//! the same bits on every run, as the rest of the untuned build.
//!
//! The stacked nets call them where `COHORT_GPU_THIN_PRODUCTS=1`
//! ([`crate::switches::TrainSwitches::thin_gpu_products`]): off by default
//! until whole runs on a GPU have measured them (docs/BENCHMARKS.md, "Thin
//! products in cohort's own kernels"). Shapes whose launch grid would pass a
//! GPU's limits take burn's product instead.

use burn::tensor::Tensor;

/// Rows one thread sums: long enough that the second pass is short (98
/// partial sums for LeNet-5's first layer), short enough that a client's
/// reduction becomes thousands of threads.
const CHUNK_ROWS: usize = 256;

/// Workgroups along one dimension of a launch grid at most: Vulkan
/// guarantees 65,535.
const MAX_GRID: usize = 65_535;

/// Elements the kernels index at most: their indices are 32-bit.
const MAX_ELEMENTS: usize = u32::MAX as usize;

/// Threads of a workgroup at most; a workgroup holds the outputs of one
/// chunk of one client, as many as fit.
const MAX_GROUP: usize = 256;

/// `lhsᵀ · rhs` per client, `[K, m, n]`, for `lhs` `[K, rows, m]` and `rhs`
/// `[K, rows, n]`: on a GPU of the wgpu backend through the chunked kernel
/// (untracked tensors only, as the written-out backward pass passes it),
/// elsewhere burn's product of the transposed `lhs`.
pub fn transposed_product(lhs: Tensor<3>, rhs: Tensor<3>) -> Tensor<3> {
    let [batches, rows, m] = lhs.dims();
    let [rhs_batches, rhs_rows, n] = rhs.dims();
    if !kernel_may_run(&lhs, &rhs)
        || batches != rhs_batches
        || rows != rhs_rows
        || !chunked_fits(batches, rows, m, n)
    {
        return lhs.swap_dims(1, 2).matmul(rhs);
    }
    #[cfg(feature = "wgpu-base")]
    {
        use burn::backend::Dispatch;
        use gpu::ChunkedProduct;
        let partials = Tensor::<3>::from_dispatch(<Dispatch as ChunkedProduct>::chunk_sums(
            lhs.into_dispatch(),
            rhs.into_dispatch(),
        ));
        super::net::sum_rows(partials).reshape([batches, m, n])
    }
    #[cfg(not(feature = "wgpu-base"))]
    {
        lhs.swap_dims(1, 2).matmul(rhs)
    }
}

/// `lhs · rhs` per client, `[K, rows, n]`, for `lhs` `[K, rows, m]` and `rhs`
/// `[K, m, n]`: on a GPU of the wgpu backend one thread an output element
/// (untracked tensors only), elsewhere burn's product. For small `m · n`
/// only: each thread reads a row of `m` values and a column of `rhs`.
pub fn narrow_product(lhs: Tensor<3>, rhs: Tensor<3>) -> Tensor<3> {
    let [batches, rows, m] = lhs.dims();
    let [rhs_batches, rhs_m, n] = rhs.dims();
    if !kernel_may_run(&lhs, &rhs)
        || batches != rhs_batches
        || m != rhs_m
        || !narrow_fits(batches, rows, m, n)
    {
        return lhs.matmul(rhs);
    }
    #[cfg(feature = "wgpu-base")]
    {
        use burn::backend::Dispatch;
        use gpu::ChunkedProduct;
        Tensor::from_dispatch(<Dispatch as ChunkedProduct>::narrow_matmul(
            lhs.into_dispatch(),
            rhs.into_dispatch(),
        ))
    }
    #[cfg(not(feature = "wgpu-base"))]
    {
        lhs.matmul(rhs)
    }
}

/// Whether the operands are where the kernels run: on a GPU (the wgpu
/// backend's; burn's product elsewhere), and not recorded by autodiff, since
/// the kernels have no backward pass of their own.
fn kernel_may_run(lhs: &Tensor<3>, rhs: &Tensor<3>) -> bool {
    !crate::device::is_cpu(&lhs.device()) && !lhs.is_tracked() && !rhs.is_tracked()
}

/// Whether [`transposed_product`]'s kernel can launch on these shapes: some
/// work, a grid within [`MAX_GRID`] and operands within [`MAX_ELEMENTS`].
fn chunked_fits(batches: usize, rows: usize, m: usize, n: usize) -> bool {
    let outputs = m.saturating_mul(n);
    let largest = batches.saturating_mul(rows).saturating_mul(m.max(n));
    rows > 0
        && outputs > 0
        && batches <= MAX_GRID
        && chunks(rows) <= MAX_GRID
        && outputs.div_ceil(group_size(outputs)) <= MAX_GRID
        && largest <= MAX_ELEMENTS
        && batches.saturating_mul(chunks(rows)).saturating_mul(outputs) <= MAX_ELEMENTS
}

/// Whether [`narrow_product`]'s kernel can launch on these shapes.
fn narrow_fits(batches: usize, rows: usize, m: usize, n: usize) -> bool {
    let elements = rows.saturating_mul(n);
    rows > 0
        && elements > 0
        && batches <= MAX_GRID
        && elements.div_ceil(MAX_GROUP) <= MAX_GRID
        && batches.saturating_mul(rows).saturating_mul(m.max(n)) <= MAX_ELEMENTS
        && batches.saturating_mul(m).saturating_mul(n) <= MAX_ELEMENTS
}

/// Chunks a reduction over `rows` is split into.
fn chunks(rows: usize) -> usize {
    rows.div_ceil(CHUNK_ROWS)
}

/// The workgroup size for `outputs` outputs: whole warps of 32 threads, at
/// most [`MAX_GROUP`].
fn group_size(outputs: usize) -> usize {
    outputs
        .div_ceil(32)
        .max(1)
        .saturating_mul(32)
        .min(MAX_GROUP)
}

#[cfg(feature = "wgpu-base")]
mod gpu {
    use super::{CHUNK_ROWS, MAX_GROUP, chunks, group_size};
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{Backend, backend_extension};
    use burn::tensor::{DType, Shape};
    use burn_cubecl::CubeBackend;
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::ops::numeric::empty_device_dtype;
    use burn_cubecl::tensor::CubeTensor;

    /// The two thin products' kernels.
    #[backend_extension(Cube, Fusion)]
    pub trait ChunkedProduct: Backend {
        /// The partial sums of a chunked `lhsᵀ · rhs`, `[K, chunks, m · n]`.
        #[fusion(dtype = lhs, shape = partials_shape(lhs, rhs))]
        fn chunk_sums(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self>;

        /// `lhs · rhs`, `[K, rows, n]`, one thread an element.
        #[fusion(dtype = lhs, shape = narrow_shape(lhs, rhs))]
        fn narrow_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self>;
    }

    fn narrow_shape(lhs: &Shape, rhs: &Shape) -> Shape {
        Shape::new([lhs[0], lhs[1], rhs[2]])
    }

    fn partials_shape(lhs: &Shape, rhs: &Shape) -> Shape {
        Shape::new([lhs[0], chunks(lhs[1]), lhs[2] * rhs[2]])
    }

    /// One thread's output `(i, j)` of batch `CUBE_POS_Z` summed over chunk
    /// `CUBE_POS_Y`'s rows, in order.
    #[cube(launch)]
    fn chunk_sums_kernel(
        lhs: &Tensor<f32>,
        rhs: &Tensor<f32>,
        partials: &mut Tensor<f32>,
        #[comptime] rows: usize,
        #[comptime] m: usize,
        #[comptime] n: usize,
        #[comptime] group: usize,
        #[comptime] chunk_rows: usize,
        #[comptime] chunk_count: usize,
    ) {
        let outputs = comptime!(m * n);
        let output = usize::cast_from(CUBE_POS_X) * group + usize::cast_from(UNIT_POS_X);
        if output < outputs {
            let i = output / n;
            let j = output % n;
            let chunk = usize::cast_from(CUBE_POS_Y);
            let batch = usize::cast_from(CUBE_POS_Z);
            let lhs_start = batch * rows * m + i;
            let rhs_start = batch * rows * n + j;
            let first = chunk * chunk_rows;
            let mut sum = f32::new(0.0);
            for step in 0..chunk_rows {
                let row = first + step;
                if row < rows {
                    sum += lhs[lhs_start + row * m] * rhs[rhs_start + row * n];
                }
            }
            partials[(batch * chunk_count + chunk) * outputs + output] = sum;
        }
    }

    /// Element `(row, j)` of batch `CUBE_POS_Z`'s `lhs · rhs`, its `m`
    /// terms in order.
    #[cube(launch)]
    fn narrow_kernel(
        lhs: &Tensor<f32>,
        rhs: &Tensor<f32>,
        out: &mut Tensor<f32>,
        #[comptime] rows: usize,
        #[comptime] m: usize,
        #[comptime] n: usize,
        #[comptime] group: usize,
    ) {
        let element = usize::cast_from(CUBE_POS_X) * group + usize::cast_from(UNIT_POS_X);
        if element < comptime!(rows * n) {
            let batch = usize::cast_from(CUBE_POS_Z);
            let row = element / n;
            let j = element % n;
            let lhs_start = (batch * rows + row) * m;
            let rhs_start = batch * m * n + j;
            let mut sum = f32::new(0.0);
            for i in 0..m {
                sum += lhs[lhs_start + i] * rhs[rhs_start + i * n];
            }
            out[batch * rows * n + element] = sum;
        }
    }

    /// `value` as a dimension of a launch grid.
    fn grid(value: usize) -> u32 {
        u32::try_from(value).expect("a workgroup count fits the GPU's 32-bit grid")
    }

    /// Both kernels' operands as they read them (float32, contiguous) with
    /// their shapes `[K, rows, m]` and the last dimension of `rhs`, and an
    /// empty float32 output of `out_shape` on their device.
    fn operands(
        lhs: CubeTensor,
        rhs: CubeTensor,
        out_shape: impl FnOnce([usize; 3], usize) -> Shape,
    ) -> (CubeTensor, CubeTensor, CubeTensor, [usize; 3], usize) {
        assert!(
            lhs.dtype == DType::F32 && rhs.dtype == DType::F32,
            "the thin products are written for float32 operands"
        );
        let dims = lhs.meta.shape().dims();
        let n = rhs.meta.shape().dims::<3>()[2];
        let (lhs, rhs) = (into_contiguous(lhs), into_contiguous(rhs));
        let out = empty_device_dtype(
            lhs.client.clone(),
            lhs.device.clone(),
            out_shape(dims, n),
            DType::F32,
        );
        (lhs, rhs, out, dims, n)
    }

    impl ChunkedProduct for CubeBackend {
        fn chunk_sums(lhs: CubeTensor, rhs: CubeTensor) -> CubeTensor {
            let (lhs, rhs, partials, [batches, rows, m], n) =
                operands(lhs, rhs, |[batches, rows, m], n| {
                    Shape::new([batches, chunks(rows), m * n])
                });
            let chunk_count = chunks(rows);
            let outputs = m * n;
            let group = group_size(outputs);
            chunk_sums_kernel::launch(
                &partials.client,
                CubeCount::Static(
                    grid(outputs.div_ceil(group)),
                    grid(chunk_count),
                    grid(batches),
                ),
                CubeDim::new_1d(grid(group)),
                lhs.into_tensor_arg(),
                rhs.into_tensor_arg(),
                partials.clone().into_tensor_arg(),
                rows,
                m,
                n,
                group,
                CHUNK_ROWS,
                chunk_count,
            );
            partials
        }

        fn narrow_matmul(lhs: CubeTensor, rhs: CubeTensor) -> CubeTensor {
            let (lhs, rhs, out, [batches, rows, m], n) =
                operands(lhs, rhs, |[batches, rows, _], n| {
                    Shape::new([batches, rows, n])
                });
            let group = MAX_GROUP;
            narrow_kernel::launch(
                &out.client,
                CubeCount::Static(grid((rows * n).div_ceil(group)), 1, grid(batches)),
                CubeDim::new_1d(grid(group)),
                lhs.into_tensor_arg(),
                rhs.into_tensor_arg(),
                out.clone().into_tensor_arg(),
                rows,
                m,
                n,
                group,
            );
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    #[test]
    fn groups_are_whole_warps_up_to_the_largest() {
        assert_eq!(group_size(150), 160);
        assert_eq!(group_size(1), 32);
        assert_eq!(group_size(2400), MAX_GROUP);
        assert_eq!(chunks(25_088), 98);
        assert_eq!(chunks(3_200), 13);
        assert_eq!(chunks(256), 1);
    }

    #[test]
    fn shapes_past_the_launch_limits_are_left_to_burn() {
        // LeNet-5's two layers at 100 clients of batch 32, and cnn's first.
        assert!(chunked_fits(100, 25_088, 25, 6));
        assert!(chunked_fits(100, 3_200, 150, 16));
        assert!(narrow_fits(100, 25_088, 25, 6));
        assert!(narrow_fits(100, 6_272, 25, 32));
        assert!(!chunked_fits(100, 0, 25, 6), "no rows");
        assert!(!chunked_fits(100, 25_088, 0, 6), "no outputs");
        assert!(!chunked_fits(70_000, 256, 25, 6), "clients past the grid");
        assert!(
            !chunked_fits(1_000, 5_000_000, 25, 6),
            "past 32-bit indices"
        );
        assert!(!narrow_fits(1, 1_000_000, 25, 32), "rows past the grid");
        assert!(!narrow_fits(1, 0, 25, 6), "no rows");
    }

    #[test]
    fn on_the_cpu_it_is_the_product_of_the_transpose() {
        let device = crate::device::cpu();
        let values = |len: usize, seed: usize| -> Vec<f32> {
            (0..len)
                .map(|i| ((i * 7 + seed) % 11) as f32 - 5.0)
                .collect()
        };
        let lhs = Tensor::<3>::from_data(TensorData::new(values(2 * 5 * 3, 1), [2, 5, 3]), &device);
        let rhs = Tensor::<3>::from_data(TensorData::new(values(2 * 5 * 4, 2), [2, 5, 4]), &device);
        let got = transposed_product(lhs.clone(), rhs.clone());
        assert_eq!(got.dims(), [2, 3, 4]);
        let lhs = lhs.into_data().try_to_vec::<f32>().unwrap();
        let rhs = rhs.into_data().try_to_vec::<f32>().unwrap();
        let mut want = vec![0.0f32; 2 * 3 * 4];
        for b in 0..2 {
            for i in 0..3 {
                for j in 0..4 {
                    want[(b * 3 + i) * 4 + j] = (0..5)
                        .map(|r| lhs[(b * 5 + r) * 3 + i] * rhs[(b * 5 + r) * 4 + j])
                        .sum();
                }
            }
        }
        assert_eq!(got.into_data().try_to_vec::<f32>().unwrap(), want);
    }
}
