//! The stacked nets' matrix products, each with a kernel chosen by what it
//! computes.
//!
//! Without burn's autotuner every f32 product on the GPU runs cubek's
//! `SimpleUnit` routine at its largest tile, whatever its shape: the
//! products of a vectorized step are batched per client and mostly narrow
//! (LeNet-5's first layer `[18,432 × 25] · [25 × 6]` for each of 100
//! clients) or short (the linear layers, 32 rows), where another of
//! cubek's routines does the same product in less time. The autotuner finds
//! that routine by compiling and timing every candidate, which is what
//! makes a tuned build's first round last minutes. Here the routine comes
//! from a table keyed by the product's [`Role`] (whose products share a
//! layout and a like shape across the stackable models), the way a vendor's
//! BLAS picks its kernels by heuristics: no timing, so a first round
//! compiles one kernel per product and every process computes the same
//! bits. The shipped table names burn's kernel for every role: whole runs
//! found no other routine that pays for its compilation within ten rounds
//! (docs/BENCHMARKS.md); `COHORT_GPU_PRODUCTS` names others for long runs.
//!
//! [`product`] is what the written-out steps call; on the CPU, for tensors
//! autodiff records, or where the table names no routine, it is burn's own
//! `matmul`.

use burn::tensor::Tensor;

/// A routine of cubek's for an f32 product on a GPU without tensor cores'
/// f32 path (the Vulkan backend), as the autotuner's candidates name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routine {
    /// One unit (thread) a tile of the output, the largest tile the shape
    /// allows: what the untuned build runs for every product.
    SimpleUnitLargeTile,
    /// One unit a tile, the smallest tile.
    SimpleUnitSmallTile,
    /// One unit a tile, loading the next slice of the inner dimension while
    /// it multiplies the last, the largest tile.
    DoubleUnitLargeTile,
    /// The same, the smallest tile.
    DoubleUnitSmallTile,
    /// cubek's plane-level product without shared-memory stages.
    Gemm,
    /// One thread an output element.
    Naive,
}

impl Routine {
    /// Every routine, in the order the bench reports them.
    pub const ALL: [Routine; 6] = [
        Routine::SimpleUnitLargeTile,
        Routine::SimpleUnitSmallTile,
        Routine::DoubleUnitLargeTile,
        Routine::DoubleUnitSmallTile,
        Routine::Gemm,
        Routine::Naive,
    ];

    /// The name `COHORT_GPU_PRODUCTS` and the bench use.
    pub fn name(self) -> &'static str {
        match self {
            Routine::SimpleUnitLargeTile => "simple_unit_large",
            Routine::SimpleUnitSmallTile => "simple_unit_small",
            Routine::DoubleUnitLargeTile => "double_unit_large",
            Routine::DoubleUnitSmallTile => "double_unit_small",
            Routine::Gemm => "gemm",
            Routine::Naive => "naive",
        }
    }

    /// The routine called `name`, if any.
    pub fn named(name: &str) -> Option<Routine> {
        Routine::ALL
            .into_iter()
            .find(|routine| routine.name() == name)
    }

    #[cfg_attr(not(feature = "wgpu-base"), allow(dead_code))]
    fn code(self) -> u8 {
        Routine::ALL
            .iter()
            .position(|routine| *routine == self)
            .expect("every routine is in ALL") as u8
    }

    #[cfg_attr(not(feature = "wgpu-base"), allow(dead_code))]
    fn from_code(code: u8) -> Option<Routine> {
        Routine::ALL.get(usize::from(code)).copied()
    }
}

/// What a product computes in a stacked net's step: the key of the table of
/// routines (each role's products have the same layout and a like shape
/// across the stackable models).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// im2col patches times the weight: `[B·positions, fan_in] · [fan_in, out]`.
    ConvForward,
    /// The output's gradient times the weight's transpose.
    ConvInputGradient,
    /// The patches' transpose times the output's gradient: one sample a
    /// product (`[fan_in, positions] · [positions, out]`) where a sample has
    /// many positions, else one client a product (`conv_weight_grad`).
    ConvWeightGradient,
    /// Rows times the weight: `[B, in] · [in, out]`.
    LinearForward,
    /// The output's gradient times the weight's transpose.
    LinearInputGradient,
    /// The input's transpose times the output's gradient: `[in, B] · [B, out]`.
    LinearWeightGradient,
}

impl Role {
    /// Every role, in the order the table holds them.
    pub const ALL: [Role; 6] = [
        Role::ConvForward,
        Role::ConvInputGradient,
        Role::ConvWeightGradient,
        Role::LinearForward,
        Role::LinearInputGradient,
        Role::LinearWeightGradient,
    ];

    /// The name `COHORT_GPU_PRODUCTS`'s pairs use.
    pub fn name(self) -> &'static str {
        match self {
            Role::ConvForward => "conv_forward",
            Role::ConvInputGradient => "conv_input_gradient",
            Role::ConvWeightGradient => "conv_weight_gradient",
            Role::LinearForward => "linear_forward",
            Role::LinearInputGradient => "linear_input_gradient",
            Role::LinearWeightGradient => "linear_weight_gradient",
        }
    }

    fn index(self) -> usize {
        Role::ALL
            .iter()
            .position(|role| *role == self)
            .expect("every role is in ALL")
    }
}

/// How the stacked nets' GPU products choose their kernels, a process-wide
/// switch ([`crate::switches::TrainSwitches::gpu_products`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProductChoice {
    /// The table cohort ships (`SHIPPED_TABLE`); a build with burn's
    /// autotuner keeps burn's `matmul` instead, which times the candidates
    /// itself.
    #[default]
    Shipped,
    /// The routine of each role's products, in [`Role::ALL`]'s order (`None`:
    /// burn's own `matmul`), as given.
    Table([Option<Routine>; Role::ALL.len()]),
}

/// The shipped table: burn's `matmul` for every role. Whole runs on an
/// H100 found no role whose other routine shortens a ten-round first run:
/// each small-tile kernel's compilation costs the first round more than ten
/// rounds gain back (docs/BENCHMARKS.md, "A product's kernel chosen without
/// timing").
pub const SHIPPED_TABLE: [Option<Routine>; Role::ALL.len()] = [None; Role::ALL.len()];

impl ProductChoice {
    /// burn's `matmul` for every product (to compare against).
    pub const BURN: ProductChoice = ProductChoice::Table([None; Role::ALL.len()]);

    /// The routine for `role`'s products, `None` for burn's.
    pub fn routine(&self, role: Role) -> Option<Routine> {
        match self {
            ProductChoice::Shipped => Self::base()[role.index()],
            ProductChoice::Table(routines) => routines[role.index()],
        }
    }

    /// What the shipped choice means in this build, and what `role=routine`
    /// pairs are laid over.
    fn base() -> [Option<Routine>; Role::ALL.len()] {
        match cfg!(feature = "wgpu") {
            true => [None; Role::ALL.len()],
            false => SHIPPED_TABLE,
        }
    }

    /// The choice `COHORT_GPU_PRODUCTS`'s `value` names: `shape` or nothing
    /// (the shipped table), `burn`, a routine's [`Routine::name`] (every
    /// product through it), or `role=routine` pairs separated by commas,
    /// each a [`Role::name`] and a routine's name or `burn`, over the
    /// shipped choice.
    pub fn parse(value: &str) -> Result<ProductChoice, String> {
        let routine_named = |name: &str| -> Result<Option<Routine>, String> {
            if name == "burn" {
                return Ok(None);
            }
            Routine::named(name).map(Some).ok_or_else(|| {
                let names: Vec<&str> = Routine::ALL.iter().map(|r| r.name()).collect();
                format!(
                    "`{name}` is not a routine: expected burn or one of {}",
                    names.join(", ")
                )
            })
        };
        match value.trim() {
            "" | "shape" => return Ok(Self::Shipped),
            "burn" => return Ok(Self::BURN),
            name if !name.contains('=') => {
                return routine_named(name)
                    .map(|routine| ProductChoice::Table([routine; Role::ALL.len()]));
            }
            _ => {}
        }
        let mut routines = Self::base();
        for pair in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((role, routine)) = pair.split_once('=') else {
                return Err(format!(
                    "`{pair}` is not role=routine (a list of pairs cannot hold a lone routine)"
                ));
            };
            let role = Role::ALL
                .into_iter()
                .find(|r| r.name() == role.trim())
                .ok_or_else(|| {
                    let names: Vec<&str> = Role::ALL.iter().map(|r| r.name()).collect();
                    format!(
                        "`{}` is not a product's role: expected one of {}",
                        role.trim(),
                        names.join(", ")
                    )
                })?;
            routines[role.index()] = routine_named(routine.trim())?;
        }
        Ok(ProductChoice::Table(routines))
    }
}

/// `lhs · rhs` per client (`[K, m, k] · [K, k, n]`), a product of `role`,
/// through the routine this process's [`ProductChoice`] gives that role on
/// a GPU, else burn's `matmul`.
pub fn product(lhs: Tensor<3>, rhs: Tensor<3>, role: Role) -> Tensor<3> {
    match crate::switches::get().gpu_products.routine(role) {
        Some(routine) => with_routine(lhs, rhs, routine),
        None => lhs.matmul(rhs),
    }
}

/// `lhs · rhs` through `routine` on a GPU of the wgpu backend; burn's
/// `matmul` elsewhere (the CPU's products run at full speed at any shape),
/// for tensors autodiff records (the routines have no
/// backward pass of their own), for operands whose batch or inner
/// dimensions disagree (burn's checks and broadcasting say what is wrong),
/// and where the routine refuses the shape.
pub fn with_routine(lhs: Tensor<3>, rhs: Tensor<3>, routine: Routine) -> Tensor<3> {
    let [batches, _, inner] = lhs.dims();
    let [rhs_batches, rhs_inner, _] = rhs.dims();
    if crate::device::is_cpu(&lhs.device())
        || lhs.is_tracked()
        || rhs.is_tracked()
        || batches != rhs_batches
        || inner != rhs_inner
    {
        return lhs.matmul(rhs);
    }
    #[cfg(feature = "wgpu-base")]
    {
        use burn::backend::Dispatch;
        use gpu::ChosenProduct;
        Tensor::from_dispatch(<Dispatch as ChosenProduct>::chosen_matmul(
            lhs.into_dispatch(),
            rhs.into_dispatch(),
            routine.code(),
        ))
    }
    #[cfg(not(feature = "wgpu-base"))]
    {
        let _ = routine;
        lhs.matmul(rhs)
    }
}

#[cfg(feature = "wgpu-base")]
mod gpu {
    use super::Routine;
    use burn::backend::ops::FloatTensorOps;
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{Backend, backend_extension};
    use burn_cubecl::CubeBackend;
    use burn_cubecl::tensor::CubeTensor;
    use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
    use cubek::matmul::multi_level::Strategy;
    use cubek::matmul::multi_level::routines::TileSizeSelection;
    use cubek::matmul::multi_level::routines::batch::double_unit::DoubleUnitSelectionArgs;
    use cubek::matmul::multi_level::routines::batch::simple_unit::SimpleUnitSelectionArgs;
    use cubek::matmul::multi_level::routines::gemm::GemmStrategy;
    use cubek::matmul::routine::BlueprintStrategy;
    use cubek::std::InputBinding;

    /// A matrix product through a routine named by its code.
    #[backend_extension(Cube, Fusion)]
    pub trait ChosenProduct: Backend {
        #[fusion(dtype = lhs, shape = product_shape(lhs, rhs))]
        fn chosen_matmul(
            lhs: FloatTensor<Self>,
            rhs: FloatTensor<Self>,
            routine: u8,
        ) -> FloatTensor<Self>;
    }

    fn product_shape(lhs: &burn::tensor::Shape, rhs: &burn::tensor::Shape) -> burn::tensor::Shape {
        let mut shape = lhs.clone();
        let last = shape.num_dims() - 1;
        shape[last] = rhs[last];
        shape
    }

    fn strategy(routine: Routine) -> Strategy {
        let unit = |tile_size| SimpleUnitSelectionArgs { tile_size };
        let double = |tile_size| DoubleUnitSelectionArgs { tile_size };
        match routine {
            Routine::SimpleUnitLargeTile => Strategy::SimpleUnit(BlueprintStrategy::Inferred(
                unit(TileSizeSelection::MaxTileSize),
            )),
            Routine::SimpleUnitSmallTile => Strategy::SimpleUnit(BlueprintStrategy::Inferred(
                unit(TileSizeSelection::MinTileSize),
            )),
            Routine::DoubleUnitLargeTile => Strategy::DoubleUnit(BlueprintStrategy::Inferred(
                double(TileSizeSelection::MaxTileSize),
            )),
            Routine::DoubleUnitSmallTile => Strategy::DoubleUnit(BlueprintStrategy::Inferred(
                double(TileSizeSelection::MinTileSize),
            )),
            Routine::Gemm => Strategy::Gemm(BlueprintStrategy::Inferred(GemmStrategy {
                target_num_planes: None,
            })),
            Routine::Naive => Strategy::Naive,
        }
    }

    impl ChosenProduct for CubeBackend {
        fn chosen_matmul(lhs: CubeTensor, rhs: CubeTensor, routine: u8) -> CubeTensor {
            let Some(routine) = Routine::from_code(routine) else {
                return CubeBackend::float_matmul(lhs, rhs);
            };
            // Quantized operands need their scales bound beside the data,
            // which burn's own product does.
            if lhs.qparams.is_some() || rhs.qparams.is_some() {
                return CubeBackend::float_matmul(lhs, rhs);
            }
            let dtype = lhs.dtype;
            let storage = burn::backend::cubecl::dtype_to_storage_type(dtype);
            let out = burn_cubecl::kernel::matmul::init_matmul_output(&lhs, &rhs, dtype);
            let mut dtypes = MatmulElems::from_globals(&MatmulGlobalElems {
                lhs: storage,
                rhs: storage,
                out: storage,
            });
            let launched = cubek::matmul::launch::launch_ref(
                &strategy(routine).into(),
                &out.client,
                InputBinding::new(lhs.clone().binding(), storage),
                InputBinding::new(rhs.clone().binding(), storage),
                out.clone().binding(),
                &mut dtypes,
            );
            match launched {
                Ok(()) => out,
                Err(refusal) => {
                    // A routine may refuse a shape or a layout it has no
                    // tiling for; the product is still due. Said once: a
                    // measurement of the routine would otherwise read as
                    // burn's without a word.
                    static SAID: std::sync::Once = std::sync::Once::new();
                    SAID.call_once(|| {
                        tracing::warn!(
                            routine = routine.name(),
                            ?refusal,
                            "a GPU product's routine refused its shape; burn's kernel runs it \
                             (said once a process)"
                        );
                    });
                    CubeBackend::float_matmul(lhs, rhs)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_routine_is_named_and_coded_once() {
        for routine in Routine::ALL {
            assert_eq!(Routine::named(routine.name()), Some(routine));
            assert_eq!(Routine::from_code(routine.code()), Some(routine));
        }
    }

    #[test]
    fn a_product_through_a_routine_is_the_product_on_the_cpu() {
        let device = crate::device::cpu();
        let values = |count: usize| -> Vec<f32> {
            (0..count)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 4.0)
                .collect()
        };
        let tensor = |shape: [usize; 3]| {
            let count = shape.iter().product();
            Tensor::<3>::from_data(burn::tensor::TensorData::new(values(count), shape), &device)
        };
        // Broadcast batches (the left operand's one against three) take
        // burn's product, which broadcasts, wherever they run.
        for (lhs, rhs) in [
            (tensor([3, 4, 5]), tensor([3, 5, 2])),
            (tensor([1, 4, 5]), tensor([3, 5, 2])),
        ] {
            let expected = lhs.clone().matmul(rhs.clone()).into_data();
            for routine in Routine::ALL {
                with_routine(lhs.clone(), rhs.clone(), routine)
                    .into_data()
                    .assert_eq(&expected, true);
            }
        }
    }

    #[test]
    fn the_choice_is_read_from_its_names() {
        assert_eq!(ProductChoice::parse("shape"), Ok(ProductChoice::Shipped));
        assert_eq!(ProductChoice::parse(""), Ok(ProductChoice::Shipped));
        assert_eq!(ProductChoice::parse("burn"), Ok(ProductChoice::BURN));
        let every = ProductChoice::parse("gemm").unwrap();
        assert!(
            Role::ALL
                .iter()
                .all(|r| every.routine(*r) == Some(Routine::Gemm))
        );
        let pairs = ProductChoice::parse("conv_forward=naive, linear_forward=burn").unwrap();
        assert_eq!(pairs.routine(Role::ConvForward), Some(Routine::Naive));
        assert_eq!(pairs.routine(Role::LinearForward), None);
        assert_eq!(
            pairs.routine(Role::ConvWeightGradient),
            ProductChoice::Shipped.routine(Role::ConvWeightGradient)
        );
        for (value, named) in [
            ("fastest", "`fastest`"),
            ("conv_forward=fastest", "`fastest`"),
            ("conv=gemm", "`conv`"),
            ("conv_forward", "`conv_forward`"),
            ("gemm,conv_forward=naive", "`gemm`"),
        ] {
            let refusal = ProductChoice::parse(value).unwrap_err();
            assert!(refusal.contains(named), "{value}: {refusal}");
        }
    }
}
