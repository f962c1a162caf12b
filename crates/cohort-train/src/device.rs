//! Choosing where tensors live.
//!
//! Backends are compiled in by cargo features and chosen at run time, so a GPU
//! backend plugs in without touching the rest of cohort. The CPU backend is
//! burn's `flex`, always present.

use burn::tensor::Device;

/// What the user asked for on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceRequest {
    /// `--cpu`.
    Cpu,
    /// `--gpu`: fail when no GPU backend was built in or no device is present.
    Gpu,
    /// Neither flag: a GPU when the build has one and a device answers, else the CPU.
    #[default]
    Auto,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    #[error(
        "--gpu was given, but this cohort binary was built without a GPU backend; rebuild with \
         `cargo build --release --features vulkan` (Linux), `--features metal` (Apple) or `--features cuda`"
    )]
    NoGpuBackend,
    #[error("--gpu was given, but no GPU device could be started: {0}")]
    NoGpuDevice(String),
}

/// The inference device chosen, with a name for the log.
#[derive(Debug, Clone)]
pub struct Selected {
    pub device: Device,
    pub name: &'static str,
}

/// burn's pure-Rust CPU backend.
pub fn cpu() -> Device {
    Device::flex()
}

pub fn select(request: DeviceRequest) -> Result<Selected, DeviceError> {
    let cpu = || Selected {
        device: cpu(),
        name: "cpu (burn flex)",
    };
    match request {
        DeviceRequest::Cpu => Ok(cpu()),
        DeviceRequest::Gpu => gpu(),
        DeviceRequest::Auto => Ok(gpu().unwrap_or_else(|error| {
            tracing::debug!(%error, "no GPU, using the CPU");
            cpu()
        })),
    }
}

/// The GPU devices this build can offer, most specific first, with their log names.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn gpu_candidates() -> Vec<(Device, &'static str)> {
    #[allow(unused_mut)]
    let mut candidates: Vec<(Device, &'static str)> = Vec::new();
    #[cfg(feature = "cuda")]
    candidates.push((Device::cuda(0usize), "gpu (burn cuda)"));
    #[cfg(feature = "vulkan")]
    candidates.push((
        Device::vulkan(burn::tensor::DeviceKind::DefaultDevice),
        "gpu (burn wgpu, Vulkan)",
    ));
    #[cfg(feature = "metal")]
    candidates.push((
        Device::metal(burn::tensor::DeviceKind::DefaultDevice),
        "gpu (burn wgpu, Metal)",
    ));
    #[cfg(all(feature = "wgpu", not(any(feature = "vulkan", feature = "metal"))))]
    candidates.push((
        Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
        "gpu (burn wgpu)",
    ));
    candidates
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn gpu() -> Result<Selected, DeviceError> {
    #[cfg(feature = "wgpu")]
    keep_compiled_kernels(KernelCache::from_env(
        std::env::var_os(KERNEL_CACHE_VAR).as_deref(),
    ));
    let mut failures = Vec::new();
    for (device, name) in gpu_candidates() {
        match probe(&device) {
            Ok(()) => return Ok(Selected { device, name }),
            Err(reason) => failures.push(format!("{name}: {reason}")),
        }
    }
    Err(DeviceError::NoGpuDevice(failures.join("; ")))
}

/// GPU devices start lazily and panic when no adapter exists; one small
/// operation turns a missing GPU into an error now instead of a crash mid-run.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn probe(device: &Device) -> Result<(), String> {
    use burn::tensor::Tensor;
    let probe = device.clone();
    let started =
        std::panic::catch_unwind(move || Tensor::<1>::ones([4], &probe).sum().into_scalar::<f32>());
    match started {
        Ok(sum) if sum == 4.0 => Ok(()),
        Ok(sum) => Err(format!("probe computed {sum} instead of 4")),
        Err(panic) => Err(panic_message(&panic)),
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "the backend panicked while starting".to_owned())
}

/// Where compiled GPU kernels are kept between runs; `off` keeps none.
pub const KERNEL_CACHE_VAR: &str = "COHORT_KERNEL_CACHE";

/// What `COHORT_KERNEL_CACHE` asks for.
///
/// Without a cache, every process compiles each of its kernels again (about
/// 100 for a vectorized LeNet-5 round, 8 s on an H200, a matrix product up to
/// 1 s) on top of the autotuner's results, which cubecl keeps on disk anyway.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelCache {
    /// Unset: the user's cache directory (`$XDG_CACHE_HOME/cubecl` or
    /// `~/.cache/cubecl` on Linux), whatever the working directory.
    UserCacheDir,
    /// `off`, `0` or `false`: compile every kernel in every process.
    Off,
    /// Any other value: that directory, for tuning results and kernels alike.
    Directory(std::path::PathBuf),
}

impl KernelCache {
    pub fn from_env(value: Option<&std::ffi::OsStr>) -> KernelCache {
        match value {
            None => KernelCache::UserCacheDir,
            Some(value) if value.is_empty() => KernelCache::UserCacheDir,
            Some(value) if ["off", "0", "false"].contains(&value.to_string_lossy().as_ref()) => {
                KernelCache::Off
            }
            Some(value) => KernelCache::Directory(value.into()),
        }
    }
}

/// cubecl keeps autotune results on disk but compiles every kernel again in
/// each process unless its compilation cache is on, and puts its files under
/// the `target/` of whatever cargo workspace holds the working directory. Its
/// configuration can be set once, before the first device starts: this reads
/// it as cubecl would (`cubecl.toml` up the tree, then `CUBECL_*`), turns the
/// compilation cache on and fixes the directory. A process whose cubecl
/// configuration was already read keeps it (`try_set` refuses), which only
/// costs the compilations.
#[cfg(feature = "wgpu")]
fn keep_compiled_kernels(cache: KernelCache) {
    use burn::cubecl::config::{CubeClRuntimeConfig, RuntimeConfig, cache::CacheConfig};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
        match &cache {
            KernelCache::Off => config.compilation.cache = false,
            KernelCache::UserCacheDir => {
                config.compilation.cache = true;
                config.environment.path = CacheConfig::Global;
            }
            KernelCache::Directory(dir) => {
                config.compilation.cache = true;
                config.environment.path = CacheConfig::Directory(dir.clone());
            }
        }
        let root = config.environment.path.root();
        if CubeClRuntimeConfig::try_set(config) {
            tracing::debug!(?cache, root = %root.display(), "GPU kernel cache");
        } else {
            tracing::debug!(
                "cubecl's configuration was already read; its kernel cache is as it set it"
            );
        }
    });
}

#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
fn gpu() -> Result<Selected, DeviceError> {
    Err(DeviceError::NoGpuBackend)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_cache_follows_the_environment_variable() {
        use std::ffi::OsStr;
        assert_eq!(KernelCache::from_env(None), KernelCache::UserCacheDir);
        assert_eq!(
            KernelCache::from_env(Some(OsStr::new(""))),
            KernelCache::UserCacheDir
        );
        for off in ["off", "0", "false"] {
            assert_eq!(
                KernelCache::from_env(Some(OsStr::new(off))),
                KernelCache::Off
            );
        }
        assert_eq!(
            KernelCache::from_env(Some(OsStr::new("/scratch/kernels"))),
            KernelCache::Directory("/scratch/kernels".into())
        );
    }

    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    #[test]
    fn gpu_request_without_backend_is_a_clear_error() {
        assert_eq!(
            select(DeviceRequest::Gpu).unwrap_err(),
            DeviceError::NoGpuBackend
        );
        assert_eq!(select(DeviceRequest::Auto).unwrap().name, "cpu (burn flex)");
    }
}
