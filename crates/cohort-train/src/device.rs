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
    /// Bytes of memory the device has, where its backend says: cubecl reads
    /// Vulkan's largest device-local heap and Metal's recommended working
    /// set. `None` for the CPU, CUDA and a wgpu API without either.
    pub memory_bytes: Option<u64>,
    /// The largest buffer the device allocates (under Vulkan, the smaller of
    /// its buffer and storage-binding limits). `None` where there is none.
    pub max_buffer_bytes: Option<u64>,
}

impl Selected {
    /// Whether this is burn's CPU backend rather than a GPU.
    pub fn is_cpu(&self) -> bool {
        is_cpu(&self.device)
    }
}

/// Whether `device` is burn's CPU backend rather than a GPU.
pub fn is_cpu(device: &Device) -> bool {
    *device == cpu()
}

/// burn's pure-Rust CPU backend.
pub fn cpu() -> Device {
    Device::flex()
}

pub fn select(request: DeviceRequest) -> Result<Selected, DeviceError> {
    let cpu = || Selected {
        device: cpu(),
        name: "cpu (burn flex)",
        memory_bytes: None,
        max_buffer_bytes: None,
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

/// A GPU device this build can offer: the device, its name for the log, and
/// how to ask its backend for the device's memory and largest buffer once it
/// has started.
#[cfg(any(feature = "wgpu-base", feature = "cuda"))]
struct Candidate {
    device: Device,
    name: &'static str,
    memory: fn() -> Memory,
}

/// What a GPU's backend says of its memory: `(device memory, largest buffer)`.
#[cfg(any(feature = "wgpu-base", feature = "cuda"))]
type Memory = (Option<u64>, Option<u64>);

/// The GPU devices this build can offer, most specific first.
#[cfg(any(feature = "wgpu-base", feature = "cuda"))]
// Which pushes exist depends on the features, so no single `vec![]`.
#[allow(clippy::vec_init_then_push)]
fn gpu_candidates() -> Vec<Candidate> {
    #[allow(unused_mut)]
    let mut candidates = Vec::new();
    #[cfg(feature = "cuda")]
    candidates.push(Candidate {
        device: Device::cuda(0usize),
        name: "gpu (burn cuda)",
        memory: || (None, None),
    });
    #[cfg(feature = "vulkan-base")]
    candidates.push(Candidate {
        device: Device::vulkan(burn::tensor::DeviceKind::DefaultDevice),
        name: "gpu (burn wgpu, Vulkan)",
        memory: || wgpu_memory(burn::backend::wgpu::WgpuBackend::Vulkan),
    });
    #[cfg(feature = "metal")]
    candidates.push(Candidate {
        device: Device::metal(burn::tensor::DeviceKind::DefaultDevice),
        name: "gpu (burn wgpu, Metal)",
        memory: || wgpu_memory(burn::backend::wgpu::WgpuBackend::Metal),
    });
    #[cfg(all(
        feature = "wgpu-base",
        not(any(feature = "vulkan-base", feature = "metal"))
    ))]
    candidates.push(Candidate {
        device: Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
        name: "gpu (burn wgpu)",
        memory: || wgpu_memory(burn::backend::wgpu::WgpuBackend::Auto),
    });
    candidates
}

/// The memory cubecl read for the default wgpu device on `api`: the same
/// device (and so the same cubecl client) as `Device::vulkan`,
/// `Device::metal` or `Device::wgpu` with `DeviceKind::DefaultDevice` start.
#[cfg(feature = "wgpu-base")]
fn wgpu_memory(api: burn::backend::wgpu::WgpuBackend) -> Memory {
    use burn::backend::wgpu::{AutoCompiler, WgpuDevice, WgpuRuntime};
    use cubecl_runtime::runtime::Runtime;
    let device = WgpuDevice::default().on(api);
    let client = WgpuRuntime::<AutoCompiler>::client(&device);
    let memory = &client.properties().memory;
    (memory.max_memory(), Some(memory.max_page_size))
}

#[cfg(any(feature = "wgpu-base", feature = "cuda"))]
fn gpu() -> Result<Selected, DeviceError> {
    #[cfg(feature = "wgpu-base")]
    configure_kernel_caches(crate::switches::get().kernel_cache.clone());
    let mut failures = Vec::new();
    for candidate in gpu_candidates() {
        match probe(&candidate.device) {
            Ok(()) => {
                let (memory_bytes, max_buffer_bytes) = (candidate.memory)();
                return Ok(Selected {
                    device: candidate.device,
                    name: candidate.name,
                    memory_bytes,
                    max_buffer_bytes,
                });
            }
            Err(reason) => failures.push(format!("{}: {reason}", candidate.name)),
        }
    }
    Err(DeviceError::NoGpuDevice(failures.join("; ")))
}

/// GPU devices start lazily and panic when no adapter exists; one small
/// operation turns a missing GPU into an error now instead of a crash mid-run.
#[cfg(any(feature = "wgpu-base", feature = "cuda"))]
fn probe(device: &Device) -> Result<(), String> {
    use burn::tensor::Tensor;
    let probe = device.clone();
    let started =
        std::panic::catch_unwind(move || Tensor::<1>::ones([4], &probe).sum().into_scalar::<f32>());
    match started {
        Ok(4.0) => Ok(()),
        Ok(sum) => Err(format!("probe computed {sum} instead of 4")),
        Err(panic) => Err(panic_message(&panic)),
    }
}

#[cfg(any(feature = "wgpu-base", feature = "cuda"))]
fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "the backend panicked while starting".to_owned())
}

/// A directory where GPU runs keep tuning results and compiled kernels
/// between processes (a subdirectory per configuration); unset: the user's
/// cache folder; `off` keeps none.
pub const KERNEL_CACHE_VAR: &str = "COHORT_KERNEL_CACHE";

/// What `COHORT_KERNEL_CACHE` asks for.
///
/// Without a cache, every process tunes and compiles its kernels again: about
/// 100 s for a vectorized LeNet-5 run on a fresh H200, 40 s once the driver's
/// own shader cache is warm. With one, a second run of the same configuration
/// starts its first round in 1.6 s. Each configuration has a subdirectory of
/// its own ([`key_kernel_cache`]): with one directory for all shapes, cubecl
/// 0.11.3 computed wrong results (accuracy 0.10 instead of 0.71 after a
/// round) for a run whose cache a run of other shapes had filled
/// (docs/BENCHMARKS.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelCache {
    /// `off`, `0`, `false` or empty: nothing is kept on disk.
    Off,
    /// That directory (by default the user's cache folder's
    /// `cohort/kernels`), for tuning results and kernels alike.
    Directory(std::path::PathBuf),
}

impl KernelCache {
    /// The cache `COHORT_KERNEL_CACHE`'s `value` asks for; unset, the
    /// `default` directory (none: no cache).
    pub fn from_env(
        value: Option<&std::ffi::OsStr>,
        default: Option<std::path::PathBuf>,
    ) -> KernelCache {
        match value {
            None => default.map_or(KernelCache::Off, KernelCache::Directory),
            Some(value)
                if ["", "off", "0", "false"].contains(&value.to_string_lossy().as_ref()) =>
            {
                KernelCache::Off
            }
            Some(value) => KernelCache::Directory(value.into()),
        }
    }
}

/// The configuration this process's kernels are for: a subdirectory of the
/// kernel cache of its own (see [`key_kernel_cache`]).
static CACHE_KEY: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Keys this process's kernel cache by `configuration`, a hash of everything
/// in the run that can change a kernel (cohort passes the config's result
/// hash): the cache directory then holds one subdirectory per configuration
/// and cohort version, so runs of different shapes never share tuning
/// results or compiled kernels. Call it before the first GPU device starts;
/// `false` when a key was set already. A process that sets no key keeps no
/// kernel cache.
pub fn key_kernel_cache(configuration: &str) -> bool {
    let safe: String = configuration
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(32)
        .collect();
    CACHE_KEY
        .set(format!("cohort-{}-{safe}", env!("CARGO_PKG_VERSION")))
        .is_ok()
}

/// `cache` narrowed to this process's configuration: its key's subdirectory,
/// or no cache where no key was set.
#[cfg_attr(not(feature = "wgpu-base"), allow(dead_code))]
fn keyed(cache: KernelCache, key: Option<&str>) -> KernelCache {
    match (cache, key) {
        (KernelCache::Directory(root), Some(key)) => KernelCache::Directory(root.join(key)),
        (KernelCache::Directory(root), None) => {
            tracing::debug!(
                root = %root.display(),
                "no configuration keys this process's kernels; no kernel cache"
            );
            KernelCache::Off
        }
        (KernelCache::Off, _) => KernelCache::Off,
    }
}

/// burn's GPU builds (with its `persistence` feature) would keep autotune
/// results, throughput probes and records of each tuning on disk, under the
/// `target/` of whatever cargo workspace holds the working directory, and
/// compile every kernel again in each process. cubecl's configuration can be
/// set once, before the first device starts: this reads it as cubecl would
/// (`cubecl.toml` up the tree, then `CUBECL_*`) and sets what `cache` asks:
/// no store at all, or every store, compiled kernels included, in the
/// directory given. `COHORT_KERNEL_CACHE` decides these settings whatever
/// `cubecl.toml` or `CUBECL_AUTOTUNE_CACHE` say; cubecl's other settings are
/// kept. A process whose cubecl configuration was already read keeps it
/// (`try_set` refuses).
#[cfg(feature = "wgpu-base")]
fn configure_kernel_caches(cache: KernelCache) {
    use cubecl_environment::records::RecordLevel;
    use cubecl_runtime::config::{CubeClRuntimeConfig, RuntimeConfig, cache::CacheConfig};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let cache = usable(keyed(cache, CACHE_KEY.get().map(String::as_str)));
        let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
        let keep = matches!(cache, KernelCache::Directory(_));
        config.compilation.cache = keep;
        config.autotune.disable_cache = !keep;
        config.throughput.disable_cache = !keep;
        match &cache {
            KernelCache::Directory(dir) => {
                config.environment.path = CacheConfig::Directory(dir.clone());
            }
            // Each tuning otherwise opens the environment's database to
            // record itself, creating it where none was asked for.
            KernelCache::Off => config.environment.records.level = RecordLevel::Off,
        }
        if CubeClRuntimeConfig::try_set(config) {
            tracing::debug!(?cache, "GPU kernel cache");
        } else {
            tracing::warn!(
                ?cache,
                "cubecl's configuration was already read; its caches are as it set them"
            );
        }
    });
}

/// `cache`, or `Off` with a warning naming the variable where its directory
/// cannot be created: cubecl would otherwise only log a failure deep in its
/// store, and a cache is never worth failing a run for.
#[cfg_attr(not(feature = "wgpu-base"), allow(dead_code))]
fn usable(cache: KernelCache) -> KernelCache {
    if let KernelCache::Directory(dir) = &cache
        && let Err(error) = std::fs::create_dir_all(dir)
    {
        tracing::warn!(
            "{KERNEL_CACHE_VAR}={}: cannot create the directory ({error}); \
                 running without a kernel cache",
            dir.display()
        );
        return KernelCache::Off;
    }
    cache
}

#[cfg(not(any(feature = "wgpu-base", feature = "cuda")))]
fn gpu() -> Result<Selected, DeviceError> {
    Err(DeviceError::NoGpuBackend)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_says_it_is_the_cpu() {
        assert!(select(DeviceRequest::Cpu).unwrap().is_cpu());
    }

    #[test]
    fn a_kernel_cache_directory_that_cannot_be_made_is_left_off() {
        let dir = std::env::temp_dir().join(format!("cohort-kernel-cache-{}", std::process::id()));
        let cache = KernelCache::Directory(dir.join("kernels"));
        assert_eq!(usable(cache.clone()), cache);
        assert!(dir.join("kernels").is_dir());
        // A file where the directory should be.
        let file = dir.join("a-file");
        std::fs::write(&file, b"").unwrap();
        assert_eq!(
            usable(KernelCache::Directory(file.join("kernels"))),
            KernelCache::Off
        );
        assert_eq!(usable(KernelCache::Off), KernelCache::Off);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn kernel_cache_follows_the_environment_variable() {
        use std::ffi::OsStr;
        let home = Some(std::path::PathBuf::from("/home/u/.cache/cohort/kernels"));
        assert_eq!(KernelCache::from_env(None, None), KernelCache::Off);
        assert_eq!(
            KernelCache::from_env(None, home.clone()),
            KernelCache::Directory("/home/u/.cache/cohort/kernels".into())
        );
        for off in ["", "off", "0", "false"] {
            assert_eq!(
                KernelCache::from_env(Some(OsStr::new(off)), home.clone()),
                KernelCache::Off
            );
        }
        assert_eq!(
            KernelCache::from_env(Some(OsStr::new("/scratch/kernels")), home),
            KernelCache::Directory("/scratch/kernels".into())
        );
    }

    #[test]
    fn each_configuration_gets_a_cache_directory_of_its_own() {
        let root = KernelCache::Directory("/scratch/kernels".into());
        assert_eq!(
            keyed(root.clone(), Some("cohort-0.1.0-ab12")),
            KernelCache::Directory("/scratch/kernels/cohort-0.1.0-ab12".into())
        );
        assert_eq!(keyed(root, None), KernelCache::Off);
        assert_eq!(keyed(KernelCache::Off, Some("k")), KernelCache::Off);
    }

    #[cfg(not(any(feature = "wgpu-base", feature = "cuda")))]
    #[test]
    fn gpu_request_without_backend_is_a_clear_error() {
        assert_eq!(
            select(DeviceRequest::Gpu).unwrap_err(),
            DeviceError::NoGpuBackend
        );
        assert_eq!(select(DeviceRequest::Auto).unwrap().name, "cpu (burn flex)");
    }
}
