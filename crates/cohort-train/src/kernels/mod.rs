//! cohort's own CPU kernels for the LeNet models: the whole forward and
//! backward pass of one mini-batch on host buffers, in place of burn flex's
//! convolution, pooling and autodiff graph, which took ~85 % of a CPU run
//! (docs/BENCHMARKS.md has the profile before and after).
//!
//! The contract:
//! * **Same numbers as burn, up to rounding.** The gradients and logits are
//!   those of the burn model ([`crate::model::LeNet5`], [`crate::model::LeNet5Compact`]) on the same
//!   parameters; the tests below hold the two against each other on random
//!   inputs to a few ulps of the values involved. Only the order of the sums
//!   differs.
//! * **Deterministic.** One thread computes a batch, in an order fixed by the
//!   shapes (see [`gemm`]); no sum depends on the worker or thread count.
//! * **burn stays the model's home.** Parameters are read from the burn module
//!   each step, and gradients go back as burn [`GradientsParams`], so gradient
//!   terms, clipping and every optimizer work unchanged.
//! * **No allocation in the kernels.** Buffers live in a [`lenet::Workspace`]
//!   reused from step to step; only the gradient tensors handed to burn are new.
//!
//! Beside the LeNets' whole-network path, five layers for any model, each a
//! burn operation with its own backward pass ([`conv2d()`], [`group_norm()`],
//! [`max_pool2d()`], [`linear()`], [`lstm()`] and [`tanh()`]): the zoo
//! models call them in place of burn's layers.
//!
//! The kernels run on burn's CPU device only (a GPU keeps burn's path), and
//! `TrainSwitches::native_kernels` (`COHORT_NATIVE_KERNELS=0` for the
//! `cohort` command) turns them off, for comparing against burn.

mod activation;
mod batch_norm;
mod conv;
mod conv2d;
mod direct;
mod direct_weight;
mod flex;
mod gemm;
mod group_norm;
mod im2col;
mod lenet;
mod linear;
mod lstm;
mod math;
mod max_pool;
mod shifted;
mod simd;
mod winograd;

pub mod conv_bench;

pub use activation::tanh;
pub use batch_norm::{batch_norm, batch_norm_relu};
pub use conv2d::conv2d;
pub(crate) use gemm::transposed;
pub use group_norm::{group_norm, group_norm_relu};
pub use linear::linear;
pub use lstm::lstm;
pub use max_pool::max_pool2d;

use crate::model::{Accelerated, FederatedModel, Stackable};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};
use lenet::{Arch, NativeLeNet};

/// Whether the native kernels may run on `device` (burn's CPU backend,
/// unless [`crate::switches`] turn them off).
pub(crate) fn enabled_on(device: &Device) -> bool {
    crate::switches::get().native_kernels && device.clone().inner() == crate::device::cpu()
}

/// A model's training and inference through the native kernels.
pub(crate) struct Native {
    net: NativeLeNet,
    params: Vec<Vec<f32>>,
    grads: Vec<Vec<f32>>,
    /// Where gradient tensors are made: the model's device without autodiff.
    device: Device,
}

impl Native {
    /// The native path for a model that names it, on `device`.
    pub(crate) fn for_model(model: Option<Accelerated>, device: &Device) -> Option<Self> {
        if !enabled_on(device) {
            return None;
        }
        // The native kernels are the LeNets'; other stacked models train
        // through burn on the CPU.
        let Accelerated {
            net: Stackable::LeNet(lenet),
            classes,
        } = model?
        else {
            return None;
        };
        let arch = Arch::of(lenet, classes);
        let count = arch.param_lens().len();
        Some(Self {
            net: NativeLeNet::new(arch),
            params: vec![Vec::new(); count],
            grads: vec![Vec::new(); count],
            device: device.clone().inner(),
        })
    }

    /// The native path for running `model` as it is, where there is one.
    pub(crate) fn for_net<M: FederatedModel>(model: &M) -> Option<Self> {
        let device = model.devices().into_iter().next()?;
        Self::for_model(model.accelerated(), &device)
    }

    /// Copies `model`'s parameters in.
    ///
    /// # Panics
    /// When `model` is not the architecture this path was made for.
    fn read<M: Module>(&mut self, model: &M) {
        let mut reader = Reader {
            slots: &mut self.params,
            next: 0,
        };
        model.visit(&mut reader);
        let lens: Vec<usize> = self.params.iter().map(Vec::len).collect();
        assert_eq!(lens, self.net.arch().param_lens(), "not the native model");
    }

    /// Mean cross-entropy of one batch and the gradients of `model`'s
    /// parameters, as `loss.backward()` on the burn model would give them.
    pub(crate) fn step<M: Module>(
        &mut self,
        model: &M,
        images: &[f32],
        labels: &[i64],
    ) -> (f32, GradientsParams) {
        self.read(model);
        self.net.forward(&self.params, images, labels.len());
        let loss = self.net.backward(&self.params, labels, &mut self.grads);
        let mut register = Register {
            grads: &mut self.grads,
            next: 0,
            device: &self.device,
            out: GradientsParams::new(),
        };
        model.visit(&mut register);
        (loss, register.out)
    }

    /// Starts a local run whose parameters stay on the host until
    /// [`Native::end_host_run`]: `model`'s read once. Per step,
    /// [`Native::step`] read the whole model out of burn and the update went
    /// through burn's tensors: 13 % of a worker's time with clients of 60
    /// samples.
    pub(crate) fn begin_host_run<M: Module>(&mut self, model: &M) {
        self.read(model);
    }

    /// One batch of a host run: the gradients as [`Native::step`] computes
    /// them, then `optimizer`'s step on every parameter (its moments are the
    /// run's: a fresh optimizer for each run); the batch's mean loss.
    pub(crate) fn host_step(
        &mut self,
        optimizer: &mut crate::optim::HostOptimizer,
        learning_rate: f64,
        images: &[f32],
        labels: &[i64],
    ) -> f32 {
        self.net.forward(&self.params, images, labels.len());
        let loss = self.net.backward(&self.params, labels, &mut self.grads);
        let slots = self.params.iter_mut().zip(&self.grads).enumerate();
        for (slot, (param, grad)) in slots {
            optimizer.update(slot, learning_rate, param, grad);
        }
        loss
    }

    /// `model` with the host run's parameters in place of its own.
    pub(crate) fn end_host_run<M: Module>(&mut self, model: M) -> M {
        model.map(&mut Writer {
            values: &mut self.params,
            next: 0,
        })
    }

    pub(crate) fn classes(&self) -> usize {
        self.net.arch().classes()
    }

    /// The logits of each image of `model`, through `predict(row, logits)`
    /// in sample order; images in chunks of `chunk`.
    pub(crate) fn predict<M: Module>(
        &mut self,
        model: &M,
        images: &[f32],
        chunk: usize,
        mut predict: impl FnMut(usize, &[f32]),
    ) {
        self.read(model);
        let image_len = self.net.arch().image_len();
        let classes = self.net.arch().classes();
        let count = images.len() / image_len;
        for start in (0..count).step_by(chunk.max(1)) {
            let n = chunk.min(count - start);
            let logits = self.net.forward(
                &self.params,
                &images[start * image_len..][..n * image_len],
                n,
            );
            for (i, row) in logits.chunks_exact(classes).enumerate() {
                predict(start + i, row);
            }
        }
    }
}

/// The top class of a row of logits, the first on a tie (as burn's argmax).
pub(crate) fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

struct Reader<'a> {
    slots: &'a mut [Vec<f32>],
    next: usize,
}

impl ModuleVisitor for Reader<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let data = param.val().into_data();
        let values = data.as_slice::<f32>().expect("LeNet trains in float32");
        let slot = &mut self.slots[self.next];
        slot.clear();
        slot.extend_from_slice(values);
        self.next += 1;
    }
}

/// Puts host values back into a model's parameters, in visit order.
struct Writer<'a> {
    values: &'a mut [Vec<f32>],
    next: usize,
}

impl ModuleMapper for Writer<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let values = std::mem::take(&mut self.values[self.next]);
        self.next += 1;
        let (shape, device) = (param.lazy_shape().to_vec(), param.lazy_device());
        let tensor = Tensor::<D>::from_data(TensorData::new(values, shape), &device);
        let id = param.id;
        param.transform_for_load(tensor, id)
    }
}

struct Register<'a> {
    grads: &'a mut [Vec<f32>],
    next: usize,
    device: &'a Device,
    out: GradientsParams,
}

impl ModuleVisitor for Register<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let values = std::mem::take(&mut self.grads[self.next]);
        self.next += 1;
        let shape = param.val().dims();
        let grad = Tensor::<D>::from_data(TensorData::new(values, shape), self.device);
        self.out.register(param.id, grad);
    }
}

#[cfg(test)]
mod conv2d_tests;
#[cfg(test)]
mod direct_tests;
#[cfg(test)]
mod shifted_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod winograd_tests;
