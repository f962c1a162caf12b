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

#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
fn gpu() -> Result<Selected, DeviceError> {
    Err(DeviceError::NoGpuBackend)
}

#[cfg(test)]
mod tests {
    use super::*;

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
