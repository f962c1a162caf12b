//! The stacked nets' matrix products, each with a kernel chosen by its shape.
//!
//! Without burn's autotuner every f32 product on the GPU runs cubek's
//! `SimpleUnit` routine at its largest tile, whatever its shape: the
//! products of a vectorized step are batched per client and mostly narrow
//! (LeNet-5's first layer `[18,432 × 25] · [25 × 6]` for each of 100
//! clients) or short (the linear layers, 32 rows), where another of
//! cubek's routines does the same product in less time. The autotuner finds
//! that routine by compiling and timing every candidate, which is what
//! makes a tuned build's first round last minutes. Here the routine is
//! chosen from the product's shape by a table measured once
//! (`benches/gpu_products.rs`, docs/BENCHMARKS.md), the way a vendor's BLAS
//! picks its kernels by heuristics: no timing, so a first round compiles
//! one kernel per product and every process computes the same bits.
//!
//! [`product`] is what the nets call; on the CPU, or where the table names
//! no routine, it is burn's own `matmul`.

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
    /// The patches' transpose times the output's gradient, one sample a
    /// product (`[fan_in, positions] · [positions, out]`).
    ConvWeightGradient,
    /// Rows times the weight: `[B, in] · [in, out]`.
    LinearForward,
    /// The output's gradient times the weight's transpose.
    LinearInputGradient,
    /// The input's transpose times the output's gradient: `[in, B] · [B, out]`.
    LinearWeightGradient,
}

impl Role {
    pub const ALL: [Role; 6] = [
        Role::ConvForward,
        Role::ConvInputGradient,
        Role::ConvWeightGradient,
        Role::LinearForward,
        Role::LinearInputGradient,
        Role::LinearWeightGradient,
    ];

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

/// The routine of each [`Role`]'s products (`None`: burn's own `matmul`):
/// how the stacked nets' GPU products choose their kernels, a process-wide
/// switch ([`crate::switches::TrainSwitches::gpu_products`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProductChoice {
    routines: [Option<Routine>; 6],
}

impl Default for ProductChoice {
    fn default() -> Self {
        Self::SHIPPED
    }
}

impl ProductChoice {
    /// The table measured on an H100 (docs/BENCHMARKS.md).
    pub const SHIPPED: ProductChoice = ProductChoice {
        routines: [None; 6],
    };

    /// burn's `matmul` for every product (to compare against).
    pub const BURN: ProductChoice = ProductChoice {
        routines: [None; 6],
    };

    /// The routine for `role`'s products, `None` for burn's. A build with
    /// burn's autotuner keeps burn's for the shipped table: it times the
    /// candidates itself.
    pub fn routine(&self, role: Role) -> Option<Routine> {
        if cfg!(feature = "wgpu") && *self == Self::SHIPPED {
            return None;
        }
        self.routines[role.index()]
    }

    /// The choice `COHORT_GPU_PRODUCTS`'s `value` names: `shape` or nothing
    /// (the shipped table), `burn`, a routine's [`Routine::name`] (every
    /// product through it), or `role=routine` pairs separated by commas,
    /// each a [`Role::name`] and a routine's name or `burn`, over the
    /// shipped table.
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
            "" | "shape" => return Ok(Self::SHIPPED),
            "burn" => return Ok(Self::BURN),
            name if !name.contains('=') => {
                return routine_named(name).map(|routine| ProductChoice {
                    routines: [routine; 6],
                });
            }
            _ => {}
        }
        let mut choice = Self::SHIPPED;
        for pair in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((role, routine)) = pair.split_once('=') else {
                return Err(format!("`{pair}` is not role=routine"));
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
            choice.routines[role.index()] = routine_named(routine.trim())?;
        }
        Ok(choice)
    }
}

/// `lhs · rhs` per client (`[K, m, k] · [K, k, n]`), a product of `role`,
/// through the routine this process's [`ProductChoice`] gives that role on
/// a GPU, else burn's `matmul`. Not for tensors autodiff records: the
/// routines have no backward pass of their own.
pub fn product(lhs: Tensor<3>, rhs: Tensor<3>, role: Role) -> Tensor<3> {
    match crate::switches::get().gpu_products.routine(role) {
        Some(routine) if !crate::device::is_cpu(&lhs.device()) => with_routine(lhs, rhs, routine),
        _ => lhs.matmul(rhs),
    }
}

/// `lhs · rhs` through `routine` (on a GPU of the wgpu backend; elsewhere,
/// and where the routine refuses the shape, burn's `matmul`).
pub fn with_routine(lhs: Tensor<3>, rhs: Tensor<3>, routine: Routine) -> Tensor<3> {
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
        let _ = routine.code();
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
                &out.client.clone(),
                InputBinding::new(lhs.clone().binding(), storage),
                InputBinding::new(rhs.clone().binding(), storage),
                out.clone().binding(),
                &mut dtypes,
            );
            match launched {
                Ok(()) => out,
                Err(refusal) => {
                    // A routine may refuse a shape or a layout it has no
                    // tiling for; the product is still due.
                    tracing::debug!(
                        routine = routine.name(),
                        ?refusal,
                        "GPU product routine refused; burn's default runs it"
                    );
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
    fn the_choice_is_read_from_its_names() {
        assert_eq!(ProductChoice::parse("shape"), Ok(ProductChoice::SHIPPED));
        assert_eq!(ProductChoice::parse(""), Ok(ProductChoice::SHIPPED));
        assert_eq!(ProductChoice::parse("burn"), Ok(ProductChoice::BURN));
        let every = ProductChoice::parse("gemm").unwrap();
        assert!(
            Role::ALL
                .iter()
                .all(|r| every.routines[r.index()] == Some(Routine::Gemm))
        );
        let pairs = ProductChoice::parse("conv_forward=naive, linear_forward=burn").unwrap();
        assert_eq!(
            pairs.routines[Role::ConvForward.index()],
            Some(Routine::Naive)
        );
        assert_eq!(pairs.routines[Role::LinearForward.index()], None);
        let shipped = |role: Role| ProductChoice::SHIPPED.routines[role.index()];
        assert_eq!(
            pairs.routines[Role::ConvWeightGradient.index()],
            shipped(Role::ConvWeightGradient)
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
