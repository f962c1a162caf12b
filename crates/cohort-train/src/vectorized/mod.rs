//! Vectorized clients: K logical clients trained as one batched computation
//! (`trainer.vectorized_clients`).
//!
//! The contract: each client's result is what [`LocalTrainer`](crate::trainer::LocalTrainer) gives for it
//! alone on the same device, up to floating-point reduction order. Every
//! per-client quantity has its own slice of a stacked tensor with a leading
//! client dimension: parameters, velocity, learning rate, gradient norm and
//! clipping scale, and its seeded sample order (the same
//! [`training_stream`](cohort_core::seeds::training_stream) per client, round and epoch as alone). What alone
//! depends on and stacking could mix is kept apart:
//!
//! * **the loss** is each client's mean over its own valid samples (a mask
//!   weights each sample by `1/n` of its client's batch, 0 for padding), and
//!   the clients' losses are summed, so client k's gradient is the gradient
//!   of its own mean loss: clients share no parameter;
//! * **unequal partitions and the last partial batch**: every step has the
//!   shape `[K, B]`; a client with fewer samples pads its batch (weight 0),
//!   and a client whose epoch is over is inactive: its learning rate and
//!   velocity update are masked to zero, so it stays exactly where alone it
//!   ended the epoch;
//! * **clipping** (`trainer.clip_grad_norm`) scales each client by its own
//!   global norm; a client whose norm is not finite is frozen from that step
//!   and reported with the same error as alone, without a host round trip
//!   per step;
//! * **augmentation** (`data.augment`, CIFAR's crops and flips): each
//!   client's batch is cropped and flipped on the host from its own
//!   [`augmentation_stream`](cohort_core::seeds::augmentation_stream), one
//!   draw a batch it takes, as alone, and the step's samples are uploaded
//!   instead of gathered from the device's copy of the images.
//!
//! What it does not prove: bitwise equality (matrix products and sums reduce
//! in another order than burn's convolution kernels), so results agree within
//! a tolerance measured in the tests, not exactly. It supports the LeNet-5
//! models, McMahan et al.'s CNN (and LEAF's FEMNIST CNN) on one-channel
//! images, the multilayer perceptron, `resnet_20` with GroupNorm on images
//! of any channels and size, and MLX SGD (momentum, dampening, Nesterov,
//! weight decay) without a strategy's gradient terms;
//! [`VectorizedTrainer::supports`] says which plans, and callers train the
//! others alone.

mod evaluate;
mod net;
mod product;
mod resnet;
mod thin_products;

pub use evaluate::StackedEvaluator;
pub use product::{ProductChoice, Role, Routine, with_routine};
pub use thin_products::{narrow_product, transposed_product};

use std::time::Instant;

use crate::model::{Accelerated, Stackable};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use cohort_core::data::Dataset;
use cohort_core::optim::OptimizerSpec;
use cohort_core::seeds::{epoch_rng, shuffle_for_epoch};
use cohort_core::tree::{Array, ParamTree};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::local::LocalPlan;
use crate::params::LoadError;
use crate::trainer::{
    Augmentation, ClientTask, LocalUpdate, TrainError, TrainSettings, augmentation_stream,
};
use cohort_core::data::augment::augment_batch;
use net::StackedNet;
use rand::RngCore;

#[cfg(test)]
mod tests;

/// Why a config cannot train clients vectorized.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Unsupported {
    #[error(
        "trainer.vectorized_clients supports trainer.model_name = \"lenet5\", \
         \"lenet5_compact\", \"multilayer\", \"resnet_20\" with \
         parameters.model.norm = \"group\", and \"cnn\" or \"cnn_femnist\" on \
         one-channel images whose sides divide by 4; not \"{0}\" on this data set \
         with these options"
    )]
    Model(String),
    #[error("trainer.vectorized_clients supports trainer.optimizer = \"sgd\" only, not \"{0}\"")]
    Optimizer(String),
}

/// One client of a vectorized batch.
#[derive(Debug, Clone, Copy)]
pub struct Job<'a> {
    pub task: ClientTask,
    pub global: &'a ParamTree,
    pub partition: &'a [u32],
    pub plan: &'a LocalPlan,
}

/// MLX SGD's constants (`crate::optim::MlxSgd`), applied to stacked tensors.
#[derive(Debug, Clone, Copy)]
struct Sgd {
    momentum: f32,
    weight_decay: f32,
    dampening: f32,
    nesterov: bool,
}

/// Trains batches of clients on one device; one instance per physical worker.
pub struct VectorizedTrainer {
    device: Device,
    settings: TrainSettings,
    model: Stackable,
    classes: usize,
    sgd: Sgd,
    /// The stacked net and the training images on the device: a step sends
    /// the device only the rows it reads, not the images.
    held: OnDevice,
    /// Differentiate with burn's autodiff instead of the written-out
    /// backward pass (`COHORT_VECTORIZED_AUTODIFF=1`, for comparisons).
    recorded_backward: bool,
}

/// Bytes of memory the default (`"auto"`) batch may use where the device's
/// memory is not known (the CPU, or a GPU backend that does not say).
pub const AUTO_MEMORY_BUDGET: u64 = 4 << 30;

/// Bytes each of `workers` sharing a device may give its batch of clients
/// under `"auto"`: half of the device's memory between them where it is
/// known, else [`AUTO_MEMORY_BUDGET`] each. Half, because the first time a
/// shape runs, burn's autotuner holds candidates' buffers beside the
/// batch's own (peak 4.2 GiB against 2.2 GiB in later rounds, 100 LeNet-5
/// clients on an H200).
pub fn memory_budget(device_memory: Option<u64>, workers: u32) -> u64 {
    match device_memory {
        Some(bytes) => (bytes / 2 / u64::from(workers.max(1))).max(1),
        None => AUTO_MEMORY_BUDGET,
    }
}

impl VectorizedTrainer {
    /// A trainer for the model `model_name` (which `accelerated` says whether
    /// the trainer implements) with `settings`, or why it cannot have one.
    pub fn new(
        model_name: &str,
        accelerated: Option<Accelerated>,
        device: &Device,
        settings: TrainSettings,
    ) -> Result<Self, Unsupported> {
        let Accelerated { net, classes } = check(model_name, accelerated, &settings.optimizer)?;
        let OptimizerSpec::Sgd {
            momentum,
            weight_decay,
            dampening,
            nesterov,
            ..
        } = settings.optimizer
        else {
            unreachable!("check accepts SGD only");
        };
        Ok(Self {
            device: device.clone(),
            settings,
            model: net,
            classes,
            sgd: Sgd {
                momentum: momentum as f32,
                weight_decay: weight_decay as f32,
                dampening: dampening as f32,
                nesterov,
            },
            held: OnDevice::default(),
            recorded_backward: crate::switches::get().vectorized_autodiff,
        })
    }

    /// Whether `plan` can be trained vectorized: gradient terms (FedProx,
    /// SCAFFOLD) are not stacked, so such clients train alone.
    pub fn supports(plan: &LocalPlan) -> bool {
        // Destructured field by field, so that an instruction added later does
        // not train vectorized until it is implemented here.
        let LocalPlan {
            learning_rate: _,
            proximal_mu,
            gradient_correction,
            update_clip_norm: _,
        } = plan;
        *proximal_mu <= 0.0 && gradient_correction.is_none()
    }

    /// Trains `jobs` together; one result per job, in order.
    pub fn train(
        &mut self,
        jobs: &[Job<'_>],
        data: &Dataset,
    ) -> Vec<Result<LocalUpdate, TrainError>> {
        let started = Instant::now();
        self.prepare_for(data);
        let mut results: Vec<Option<Result<LocalUpdate, TrainError>>> = vec![None; jobs.len()];
        let mut batch = Vec::new();
        for (slot, job) in jobs.iter().enumerate() {
            let ClientTask { client_id, round } = job.task;
            debug_assert!(
                Self::supports(job.plan),
                "callers train gradient terms alone"
            );
            if job.partition.is_empty() {
                results[slot] = Some(Err(TrainError::EmptyPartition { client_id, round }));
            } else {
                batch.push(slot);
            }
        }
        let net = self.held.net();
        let stacked = match stack(net, batch.iter().map(|&s| jobs[s].global)) {
            Ok(stacked) => stacked,
            Err((index, source)) => {
                // One bad tree fails its client; the others retry without it.
                let job = jobs[batch[index]];
                results[batch[index]] = Some(Err(TrainError::Load {
                    client_id: job.task.client_id,
                    round: job.task.round,
                    source,
                }));
                let rest: Vec<Job<'_>> = batch
                    .iter()
                    .enumerate()
                    .filter(|&(i, _)| i != index)
                    .map(|(_, &s)| jobs[s])
                    .collect();
                let mut retried = self.train(&rest, data).into_iter();
                for (i, &slot) in batch.iter().enumerate() {
                    if i != index {
                        results[slot] = retried.next();
                    }
                }
                return results
                    .into_iter()
                    .map(|r| r.expect("every slot filled"))
                    .collect();
            }
        };
        if !batch.is_empty() {
            let chosen: Vec<Job<'_>> = batch.iter().map(|&s| jobs[s]).collect();
            let trained = self.run(&chosen, stacked, data, started);
            for (slot, result) in batch.iter().zip(trained) {
                results[*slot] = Some(result);
            }
        }
        results
            .into_iter()
            .map(|r| r.expect("every slot filled"))
            .collect()
    }

    /// Builds the stacked net for `data`'s image size and uploads its images
    /// (not where batches are augmented: each step uploads its own), each
    /// once for as long as the data stays the same.
    fn prepare_for(&mut self, data: &Dataset) {
        self.held
            .build_net(&self.model, self.classes, data, &self.device);
        if self.settings.augmentation.is_some() {
            // Each step uploads its augmented samples; no copy is read.
            self.held.images = None;
            return;
        }
        self.held.upload(data, &self.device);
    }
}

/// A stacked net built for a data set's image size, and the data set's
/// samples on the device (`[samples + 1, values]`, the last row zeros: what
/// a padded row reads), each made again only when the data set changes.
#[derive(Default)]
struct OnDevice {
    net: Option<(StackedNet, [usize; 3])>,
    images: Option<(DataKey, Tensor<2>)>,
}

impl OnDevice {
    fn build_net(&mut self, model: &Stackable, classes: usize, data: &Dataset, device: &Device) {
        let image = image_of(data);
        if self.net.as_ref().is_none_or(|(_, built)| *built != image) {
            self.net = Some((StackedNet::new(model, classes, image, device), image));
        }
    }

    fn upload(&mut self, data: &Dataset, device: &Device) {
        let key = DataKey::of(data);
        if self.images.as_ref().is_none_or(|(held, _)| *held != key) {
            self.images = Some((key, upload_images(data, device)));
        }
    }

    fn net(&self) -> &StackedNet {
        &self.net.as_ref().expect("built before use").0
    }

    fn images(&self) -> &Tensor<2> {
        &self.images.as_ref().expect("uploaded before use").1
    }
}

/// `data`'s samples on `device` as `[samples + 1, values]`, the last row
/// zeros.
fn upload_images(data: &Dataset, device: &Device) -> Tensor<2> {
    let (samples, pixels) = (data.labels.len(), data.values_per_sample());
    let mut rows = Vec::with_capacity((samples + 1) * pixels);
    rows.extend_from_slice(&data.inputs[..samples * pixels]);
    rows.resize((samples + 1) * pixels, 0.0);
    Tensor::<2>::from_data(TensorData::new(rows, [samples + 1, pixels]), device)
}

/// What tells one dataset from another for the device's copy of its images:
/// where it lives, its sizes, and a fingerprint of its labels and of every
/// 61st pixel, so that a dataset allocated where a freed one lived is not
/// mistaken for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DataKey {
    address: usize,
    samples: usize,
    shape: [usize; 3],
    fingerprint: u64,
}

impl DataKey {
    fn of(data: &Dataset) -> Self {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        data.labels.hash(&mut hasher);
        for pixel in data.inputs.iter().step_by(61) {
            pixel.to_bits().hash(&mut hasher);
        }
        Self {
            address: data.inputs.as_ptr() as usize,
            samples: data.labels.len(),
            shape: image_of(data),
            fingerprint: hasher.finish(),
        }
    }
}

/// The channels, height and width of a data set of images; for any other
/// sample shape, `[1, 1, values per sample]`, which a perceptron reads as it
/// reads a flattened image.
pub fn image_of(data: &Dataset) -> [usize; 3] {
    image_of_shape(&data.sample_shape)
}

/// [`image_of`] for samples of `shape`.
pub fn image_of_shape(shape: &[usize]) -> [usize; 3] {
    match shape {
        &[channels, height, width] => [channels, height, width],
        shape => [1, 1, shape.iter().product()],
    }
}

/// What the vectorized trainer implements of the model `model_name` and
/// `optimizer`, or why it cannot train them.
pub fn check(
    model_name: &str,
    accelerated: Option<Accelerated>,
    optimizer: &OptimizerSpec,
) -> Result<Accelerated, Unsupported> {
    let Some(accelerated) = accelerated else {
        return Err(Unsupported::Model(model_name.to_owned()));
    };
    match optimizer {
        OptimizerSpec::Sgd { .. } => Ok(accelerated),
        OptimizerSpec::Adam { .. } => Err(Unsupported::Optimizer("adam".to_owned())),
        OptimizerSpec::AdamW { .. } => Err(Unsupported::Optimizer("adamw".to_owned())),
        OptimizerSpec::RmsProp { .. } => Err(Unsupported::Optimizer("rmsprop".to_owned())),
        OptimizerSpec::Lion { .. } => Err(Unsupported::Optimizer("lion".to_owned())),
    }
}

/// How many clients one batch may hold within `budget` bytes (`"auto"`):
/// per client, the activations of a batch (forward and their gradients, with
/// the im2col patches the backward pass keeps) and four copies of the
/// parameters (weights, gradient, velocity, the update in flight), and no more
/// than [`clients_per_buffer`] allows. At least 1 by memory, 0 where one
/// client's largest tensor exceeds a buffer. The training images on the
/// device are not counted: one copy per worker, whatever K is.
pub fn clients_for_memory(
    model: Option<Accelerated>,
    image: [usize; 3],
    batch_size: usize,
    budget: u64,
    max_buffer_bytes: Option<u64>,
) -> usize {
    let Some(net) = stacked_net(model, image) else {
        return 1;
    };
    let floats = 2 * batch_size * net.activation_elements() + 4 * net.parameter_count();
    let per_client = (floats * std::mem::size_of::<f32>()) as u64;
    let by_memory = (budget / per_client.max(1)).max(1) as usize;
    by_memory.min(fit_in_buffer(&net, batch_size, max_buffer_bytes))
}

/// The most clients whose largest tensor fits in one buffer of
/// `max_buffer_bytes` (a GPU's limit on a single allocation: 2 GiB under
/// Vulkan on an H200, where a batch of 4,000 LeNet-5 clients failed to
/// allocate a 7.68 GB tensor); unbounded without a limit; 0 where not even
/// one client's fits (a batch size too large for the device).
pub fn clients_per_buffer(
    model: Option<Accelerated>,
    image: [usize; 3],
    batch_size: usize,
    max_buffer_bytes: Option<u64>,
) -> usize {
    match stacked_net(model, image) {
        Some(net) => fit_in_buffer(&net, batch_size, max_buffer_bytes),
        None => usize::MAX,
    }
}

/// [`clients_per_buffer`] for a net already built.
fn fit_in_buffer(net: &StackedNet, batch_size: usize, max_buffer_bytes: Option<u64>) -> usize {
    let Some(limit) = max_buffer_bytes else {
        return usize::MAX;
    };
    // cubecl rounds a pool's largest page down to the allocation alignment
    // (at most 256 bytes on the GPUs wgpu runs on).
    let limit = limit - limit % 256;
    let per_client = (net.largest_tensor_elements(batch_size) * std::mem::size_of::<f32>()) as u64;
    usize::try_from(limit / per_client.max(1)).unwrap_or(usize::MAX)
}

/// The stacked net on the CPU, for counting its tensors.
fn stacked_net(model: Option<Accelerated>, image: [usize; 3]) -> Option<StackedNet> {
    let Accelerated { net, classes } = model?;
    Some(StackedNet::new(&net, classes, image, &crate::device::cpu()))
}

/// The stacked parameters of a batch: weight and bias of each layer, on the host.
struct Stacked {
    values: Vec<Vec<f32>>,
}

/// Each tree in the stacked layout; `Err((index, error))` names the first
/// tree that does not fit the model.
fn stack<'a>(
    net: &StackedNet,
    trees: impl ExactSizeIterator<Item = &'a ParamTree>,
) -> Result<Stacked, (usize, LoadError)> {
    let params = net.params();
    let count = trees.len();
    let mut values: Vec<Vec<f32>> = params
        .iter()
        .map(|p| Vec::with_capacity(count * p.rows * p.cols))
        .collect();
    for (index, tree) in trees.enumerate() {
        // Ordered, so that a tree with several extra leaves is refused
        // naming the same one every time.
        let leaves: std::collections::BTreeMap<String, &Array> = tree
            .leaves()
            .into_iter()
            .map(|(path, array)| (path.to_string(), array))
            .collect();
        if let Some(extra) = leaves
            .keys()
            .find(|path| !params.iter().any(|p| p.name == **path))
        {
            return Err((index, LoadError::Unexpected(extra.clone())));
        }
        for (param, stacked) in params.iter().zip(values.iter_mut()) {
            let tree = leaf(&leaves, &param.name, &param.torch_shape).map_err(|e| (index, e))?;
            match param.transposed {
                // The tree's [cols, rows] transposed to [rows, cols].
                true => {
                    for row in 0..param.rows {
                        stacked.extend((0..param.cols).map(|col| tree[col * param.rows + row]));
                    }
                }
                false => stacked.extend_from_slice(tree),
            }
        }
    }
    Ok(Stacked { values })
}

fn leaf<'a>(
    leaves: &std::collections::BTreeMap<String, &'a Array>,
    path: &str,
    shape: &[usize],
) -> Result<&'a [f32], LoadError> {
    let array = leaves
        .get(path)
        .ok_or_else(|| LoadError::Missing(path.to_owned()))?;
    if array.shape() != shape {
        return Err(LoadError::Shape {
            path: path.to_owned(),
            model: shape.to_vec(),
            tree: array.shape().to_vec(),
        });
    }
    array.as_f32().ok_or_else(|| LoadError::DType {
        path: path.to_owned(),
        dtype: array.dtype(),
    })
}

/// One step's inputs for every client of the batch, built on the host.
struct StepInputs {
    /// `[K·B]` rows of the device's copy of the images; the zero row past the
    /// last sample where a client has no sample.
    rows: Vec<i64>,
    /// `[K, B, classes]`: `1/n` at each valid sample's label, `n` its
    /// client's samples this step.
    weights: Vec<f32>,
    /// `[K]`: samples each client has this step (0: inactive).
    counts: Vec<f32>,
    /// `[K·B, values]` augmented samples, zeros where a client has none,
    /// in place of `rows` of the device's copy.
    pixels: Option<Vec<f32>>,
}

impl StepInputs {
    fn new(orders: &[Vec<u32>], step: usize, batch: usize, classes: usize, data: &Dataset) -> Self {
        let k = orders.len();
        let mut inputs = StepInputs {
            rows: vec![data.labels.len() as i64; k * batch],
            weights: vec![0.0; k * batch * classes],
            counts: vec![0.0; k],
            pixels: None,
        };
        for (client, order) in orders.iter().enumerate() {
            let samples = batch_of(order, step, batch);
            let share = 1.0 / samples.len().max(1) as f32;
            inputs.counts[client] = samples.len() as f32;
            for (row, &index) in samples.iter().enumerate() {
                let at = client * batch + row;
                inputs.rows[at] = i64::from(index);
                // Labels are below num_classes: checked when the data loads.
                let label = data.labels[index as usize] as usize;
                inputs.weights[at * classes + label.min(classes - 1)] = share;
            }
        }
        inputs
    }
}

/// The samples a client's `order` gives to step `step` (0-based): empty once
/// its epoch is over, the last batch partial.
fn batch_of(order: &[u32], step: usize, batch: usize) -> &[u32] {
    let start = (step * batch).min(order.len());
    &order[start..((step + 1) * batch).min(order.len())]
}

/// A step's samples of every client, each client's batch cropped and
/// flipped from its own stream as alone (one draw a batch it takes), zeros
/// where a client has no sample.
fn augmented(
    orders: &[Vec<u32>],
    step: usize,
    batch: usize,
    data: &Dataset,
    augmentation: &Augmentation,
    crops: &mut [ChaCha8Rng],
) -> Vec<f32> {
    let values = data.values_per_sample();
    let mut pixels = vec![0.0; orders.len() * batch * values];
    let clients = pixels
        .chunks_exact_mut(batch * values)
        .zip(orders)
        .zip(crops);
    for ((client, order), crops) in clients {
        let samples = batch_of(order, step, batch);
        if samples.is_empty() {
            continue;
        }
        let rows = &mut client[..samples.len() * values];
        for (row, &index) in rows.chunks_exact_mut(values).zip(samples) {
            let at = index as usize * values;
            row.copy_from_slice(&data.inputs[at..at + values]);
        }
        augment_batch(
            augmentation.augment,
            rows,
            &data.sample_shape,
            &augmentation.black,
            crops.next_u64(),
        )
        .expect("the shape and padding values were checked before training");
    }
    pixels
}

/// The state of a batch during training, on the device.
struct Run {
    params: Vec<Tensor<3>>,
    velocity: Vec<Tensor<3>>,
    /// `[K, 1, 1]` base learning rates.
    rates: Tensor<3>,
    /// `[K, 1, 1]`: 1 while a client's gradients are finite, 0 after.
    alive: Tensor<3>,
    /// `[K, 1, 1]`: the step a client's norm stopped being finite, and that norm.
    failed_step: Tensor<3>,
    failed_norm: Tensor<3>,
    /// `[K, 1, 1]`: Σ loss · samples.
    loss: Tensor<3>,
}

fn column(values: Vec<f32>, device: &Device) -> Tensor<3> {
    let k = values.len();
    Tensor::<3>::from_data(TensorData::new(values, [k, 1, 1]), device)
}

impl VectorizedTrainer {
    fn run(
        &self,
        jobs: &[Job<'_>],
        stacked: Stacked,
        data: &Dataset,
        started: Instant,
    ) -> Vec<Result<LocalUpdate, TrainError>> {
        if let Some(problem) = self.augmentation_problem(data) {
            return jobs
                .iter()
                .map(|job| {
                    Err(TrainError::Augmentation {
                        client_id: job.task.client_id,
                        round: job.task.round,
                        problem: problem.clone(),
                    })
                })
                .collect();
        }
        let net = self.held.net();
        let k = jobs.len();
        let batch = self.settings.batch_size;
        let device = &self.device;
        let params: Vec<Tensor<3>> = net
            .params()
            .iter()
            .zip(stacked.values)
            .map(|(p, values)| {
                Tensor::<3>::from_data(TensorData::new(values, [k, p.rows, p.cols]), device)
            })
            .collect();
        let mut run = Run {
            velocity: params.iter().map(|p| p.zeros_like()).collect(),
            params,
            rates: column(
                jobs.iter().map(|j| j.plan.learning_rate as f32).collect(),
                device,
            ),
            alive: column(vec![1.0; k], device),
            failed_step: column(vec![0.0; k], device),
            failed_norm: column(vec![0.0; k], device),
            loss: column(vec![0.0; k], device),
        };
        let augmentation = self.settings.augmentation.as_ref();
        let mut orders: Vec<Vec<u32>> = jobs.iter().map(|j| j.partition.to_vec()).collect();
        // (epoch, step within the epoch) of each global step, 1-based.
        let mut steps: Vec<(u32, usize)> = Vec::new();
        for epoch in 1..=self.settings.epochs {
            for (job, order) in jobs.iter().zip(orders.iter_mut()) {
                let mut rng = match self.settings.training_seed {
                    Some(seed) => epoch_rng(seed, job.task.client_id, job.task.round, epoch),
                    None => ChaCha8Rng::from_os_rng(),
                };
                shuffle_for_epoch(order, &mut rng);
            }
            let mut crops: Vec<ChaCha8Rng> = match augmentation {
                Some(_) => jobs
                    .iter()
                    .map(|job| augmentation_stream(self.settings.training_seed, job.task, epoch))
                    .collect(),
                None => Vec::new(),
            };
            let longest = orders
                .iter()
                .map(|o| o.len().div_ceil(batch))
                .max()
                .unwrap_or(0);
            for step in 0..longest {
                steps.push((epoch, step + 1));
                let mut inputs = StepInputs::new(&orders, step, batch, net.classes(), data);
                if let Some(augmentation) = augmentation {
                    let pixels = augmented(&orders, step, batch, data, augmentation, &mut crops);
                    inputs.pixels = Some(pixels);
                }
                self.step(net, &mut run, inputs, steps.len());
            }
        }
        self.finish(net, jobs, run, &steps, started)
    }

    /// Why the settings' augmentation cannot crop `data`'s samples (the
    /// shape and padding values every batch's would check), if it cannot.
    fn augmentation_problem(&self, data: &Dataset) -> Option<String> {
        let augmentation = self.settings.augmentation.as_ref()?;
        augment_batch(
            augmentation.augment,
            &mut [],
            &data.sample_shape,
            &augmentation.black,
            0,
        )
        .err()
    }

    /// One optimizer step of every client.
    fn step(&self, net: &StackedNet, run: &mut Run, inputs: StepInputs, number: usize) {
        let device = &self.device;
        let k = inputs.counts.len();
        let batch = self.settings.batch_size;
        let images = match inputs.pixels {
            Some(pixels) => {
                let values = pixels.len() / (k * batch);
                Tensor::<2>::from_data(TensorData::new(pixels, [k * batch, values]), device)
            }
            None => {
                let rows = TensorData::new(inputs.rows, [k * batch]);
                let rows = Tensor::<1, Int>::from_data(rows, device);
                self.held.images().clone().select(0, rows)
            }
        };
        let weights = Tensor::<3>::from_data(
            TensorData::new(inputs.weights, [k, batch, net.classes()]),
            device,
        );
        let active = column(
            inputs
                .counts
                .iter()
                .map(|&c| if c > 0.0 { 1.0 } else { 0.0 })
                .collect(),
            device,
        );
        let counts = column(inputs.counts, device);
        let (per_client, mut grads) = match self.recorded_backward {
            false => written_out_step(net, &run.params, images, weights),
            true => recorded_step(net, &run.params, images, weights),
        };
        run.loss = run.loss.clone() + per_client * counts;
        let mut active = active;
        if let Some(max_norm) = self.settings.clip_grad_norm {
            active = self.clip(run, &mut grads, active, max_norm as f32, number);
        }
        let rates = run.rates.clone() * active.clone();
        for ((param, velocity), grad) in run
            .params
            .iter_mut()
            .zip(run.velocity.iter_mut())
            .zip(grads)
        {
            let (p, v) = self
                .sgd
                .apply(param.clone(), grad, velocity.clone(), &rates, &active);
            *param = p;
            *velocity = v;
        }
    }

    /// Scales each client's gradients to its own global norm `max_norm`;
    /// freezes clients whose norm is not finite. Returns the clients still
    /// taking this step.
    fn clip(
        &self,
        run: &mut Run,
        grads: &mut [Tensor<3>],
        active: Tensor<3>,
        max_norm: f32,
        number: usize,
    ) -> Tensor<3> {
        let squared = grads
            .iter()
            .map(|g| g.clone().square().sum_dim(2).sum_dim(1))
            .reduce(|a, b| a + b)
            .expect("the model has parameters");
        let norm = squared.sqrt();
        let finite = norm.clone().is_finite();
        // A client fails where it takes a step with a non-finite norm.
        let failing = active
            .clone()
            .greater_elem(0.5)
            .bool_and(finite.clone().bool_not());
        let newly = run.alive.clone().greater_elem(0.5).bool_and(failing);
        run.failed_step = run
            .failed_step
            .clone()
            .mask_fill(newly.clone(), number as f32);
        run.failed_norm = run
            .failed_norm
            .clone()
            .mask_where(newly.clone(), norm.clone());
        run.alive = run.alive.clone().mask_fill(newly, 0.0);
        // max_norm / norm, capped at 1 (norm 0 gives ∞, capped); limit 0
        // freezes every client, as alone.
        let scale = if max_norm > 0.0 {
            norm.recip().mul_scalar(max_norm).clamp_max(1.0)
        } else {
            norm.zeros_like()
        };
        let scale = scale.mask_fill(finite.bool_not(), 0.0);
        for grad in grads.iter_mut() {
            let clean = grad
                .clone()
                .mask_fill(grad.clone().is_finite().bool_not(), 0.0);
            *grad = clean * scale.clone();
        }
        active * run.alive.clone()
    }

    /// Host snapshots of every client, with their results.
    fn finish(
        &self,
        net: &StackedNet,
        jobs: &[Job<'_>],
        run: Run,
        steps: &[(u32, usize)],
        started: Instant,
    ) -> Vec<Result<LocalUpdate, TrainError>> {
        let host = |t: Tensor<3>| -> Vec<f32> {
            t.into_data()
                .try_to_vec::<f32>()
                .expect("float32 parameters convert to f32")
        };
        let values: Vec<Vec<f32>> = run.params.into_iter().map(host).collect();
        let losses = host(run.loss);
        let failed_step = host(run.failed_step);
        let failed_norm = host(run.failed_norm);
        // The batch's time, shared evenly: the clients' times add up to it.
        let share = started.elapsed().as_secs_f64() / jobs.len() as f64;
        let batch = self.settings.batch_size;
        jobs.iter()
            .enumerate()
            .map(|(client, job)| {
                let ClientTask { client_id, round } = job.task;
                if failed_step[client] > 0.0 {
                    let (epoch, step) = steps[failed_step[client] as usize - 1];
                    return Err(TrainError::NonFiniteGradient {
                        client_id,
                        round,
                        epoch,
                        step,
                        norm: failed_norm[client] as f64,
                    });
                }
                let tree = unstack(net, &values, client);
                let tree = match job.plan.update_clip_norm {
                    Some(max_norm) => crate::local::clip_update(job.global, tree, max_norm),
                    None => tree,
                };
                let n = job.partition.len();
                let epochs = self.settings.epochs as usize;
                Ok(LocalUpdate {
                    tree,
                    num_samples: n as u64,
                    loss: losses[client] as f64 / (n * epochs).max(1) as f64,
                    training_time: share,
                    local_steps: (epochs * n.div_ceil(batch)) as u64,
                })
            })
            .collect()
    }
}

/// Client `client`'s slice of the stacked `values`, in PyTorch's layout.
fn unstack(net: &StackedNet, values: &[Vec<f32>], client: usize) -> ParamTree {
    let leaves = net
        .params()
        .into_iter()
        .zip(values)
        .map(|(param, stacked)| {
            let (rows, cols) = (param.rows, param.cols);
            let mine = &stacked[client * rows * cols..(client + 1) * rows * cols];
            let tree = match param.transposed {
                true => {
                    let mut tree = vec![0.0; rows * cols];
                    for row in 0..rows {
                        for col in 0..cols {
                            tree[col * rows + row] = mine[row * cols + col];
                        }
                    }
                    tree
                }
                false => mine.to_vec(),
            };
            let array = Array::f32(param.torch_shape, tree).expect("sizes match the parameter");
            (param.name, array)
        });
    ParamTree::from_dotted(leaves)
}

/// Each client's mean cross-entropy over its own samples (`[K, 1, 1]`) and
/// the gradient of every parameter, by [`StackedNet::backward`]. The loss's
/// gradient is `softmax · (the sample's weight) − weights`.
fn written_out_step(
    net: &StackedNet,
    params: &[Tensor<3>],
    images: Tensor<2>,
    weights: Tensor<3>,
) -> (Tensor<3>, Vec<Tensor<3>>) {
    let k = params[0].dims()[0];
    let (logits, saved) = net.forward_train(params, images, k);
    let log_probs = log_softmax(logits, 2);
    let per_client = client_losses(log_probs.clone(), weights.clone());
    let logits_grad = log_probs.exp() * weights.clone().sum_dim(2) - weights;
    (per_client, net.backward(params, saved, logits_grad))
}

/// `[K, 1, 1]`: each client's cross-entropy, weighted by `weights`
/// (`[K, B, classes]`, `1/n` at each valid sample's label).
fn client_losses(log_probs: Tensor<3>, weights: Tensor<3>) -> Tensor<3> {
    (log_probs * weights).sum_dim(2).sum_dim(1).neg()
}

/// [`written_out_step`] recorded and differentiated by burn's autodiff
/// (`COHORT_VECTORIZED_AUTODIFF=1`), for comparisons.
fn recorded_step(
    net: &StackedNet,
    params: &[Tensor<3>],
    images: Tensor<2>,
    weights: Tensor<3>,
) -> (Tensor<3>, Vec<Tensor<3>>) {
    let k = params[0].dims()[0];
    let leaves: Vec<Tensor<3>> = params
        .iter()
        .map(|p| p.clone().autodiff().require_grad())
        .collect();
    let logits = net.forward(&leaves, images, k);
    let per_client = client_losses(log_softmax(logits, 2), weights);
    let gradients = per_client.clone().sum().backward();
    let grads = leaves
        .iter()
        .map(|leaf| {
            leaf.grad(&gradients)
                .expect("every parameter takes part in the loss")
        })
        .collect();
    (per_client.inner(), grads)
}

impl Sgd {
    /// MLX SGD on stacked tensors: `g += wd·p`; `v = μ·v + (1 − d)·g`;
    /// `p −= lr·(g + μ·v)` (Nesterov) or `lr·v`, with `rates` the per-client
    /// learning rate (0 for an inactive client) and `active` masking the
    /// velocity so an inactive client keeps it.
    fn apply(
        &self,
        param: Tensor<3>,
        grad: Tensor<3>,
        velocity: Tensor<3>,
        rates: &Tensor<3>,
        active: &Tensor<3>,
    ) -> (Tensor<3>, Tensor<3>) {
        let grad = if self.weight_decay != 0.0 {
            grad + param.clone().mul_scalar(self.weight_decay)
        } else {
            grad
        };
        if self.momentum <= 0.0 {
            return (param - grad * rates.clone(), velocity);
        }
        let scaled = if self.dampening > 0.0 {
            grad.clone().mul_scalar(1.0 - self.dampening)
        } else {
            grad.clone()
        };
        // Alone, the velocity starts at zero, so its first value is `scaled`
        // exactly: 0·μ + scaled.
        let moved = velocity.clone().mul_scalar(self.momentum) + scaled;
        let kept = active.clone().neg().add_scalar(1.0);
        let velocity = moved * active.clone() + velocity * kept;
        let update = if self.nesterov {
            grad + velocity.clone().mul_scalar(self.momentum)
        } else {
            velocity.clone()
        };
        (param - update * rates.clone(), velocity)
    }
}
