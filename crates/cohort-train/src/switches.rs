//! Process-wide switches of the training layer, for comparisons and GPU
//! caches. The library reads no environment variable: the program that
//! embeds it sets these once, before the first device starts (the `cohort`
//! command reads them from `COHORT_NATIVE_KERNELS`, `COHORT_VECTORIZED_AUTODIFF`,
//! `COHORT_KERNEL_CACHE` and `COHORT_GPU_PRODUCTS`).

use std::sync::OnceLock;

use crate::device::KernelCache;
use crate::vectorized::ProductChoice;

/// How this process trains where more than one path computes the same thing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainSwitches {
    /// cohort's own CPU kernels for the models they support; `false` trains
    /// through burn's CPU backend instead (to compare against it).
    pub native_kernels: bool,
    /// Vectorized clients through burn's recorded autodiff instead of the
    /// written-out backward pass (to compare against it).
    pub vectorized_autodiff: bool,
    /// Where GPU runs keep tuning results and compiled kernels.
    pub kernel_cache: KernelCache,
    /// How the vectorized clients' GPU products choose their kernels.
    pub gpu_products: ProductChoice,
    /// cohort's own GPU kernels for the stacked convolutions' thin products
    /// (`vectorized::transposed_product` for weight gradients of few
    /// outputs, `vectorized::narrow_product` for a first layer's forward
    /// product) in place of burn's products and the column-by-column sums.
    /// Off by default until whole runs on a GPU have measured them
    /// (docs/BENCHMARKS.md); the GPU profile checks their results either way.
    pub thin_gpu_products: bool,
}

impl Default for TrainSwitches {
    fn default() -> Self {
        Self {
            native_kernels: true,
            vectorized_autodiff: false,
            kernel_cache: KernelCache::Off,
            gpu_products: ProductChoice::Shipped,
            thin_gpu_products: false,
        }
    }
}

static SWITCHES: OnceLock<TrainSwitches> = OnceLock::new();

/// Sets this process's switches. The first call wins, since kernels and
/// caches chosen under one setting must not change mid-run: `false` when they
/// were set (or read) already.
pub fn set(switches: TrainSwitches) -> bool {
    SWITCHES.set(switches).is_ok()
}

/// This process's switches: those [`set`] gave, else the defaults.
pub fn get() -> &'static TrainSwitches {
    SWITCHES.get_or_init(TrainSwitches::default)
}
