//! Local training of one logical client, and evaluation.
//!
//! A [`LocalTrainer`] belongs to one physical worker and owns that worker's
//! model instance; it trains whichever logical client it is handed, so memory
//! grows with workers, not with clients. Each run loads the global weights,
//! creates a fresh optimizer (as the seed does), trains `epochs` over the
//! client's partition in shuffled mini-batches with the task's loss
//! ([`crate::task`], softmax cross-entropy for classification), and returns a
//! host snapshot of the weights.

use std::sync::Arc;
use std::time::Instant;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Int, Tensor, TensorData};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use cohort_core::data::Dataset;
use cohort_core::optim::OptimizerSpec;
use cohort_core::seeds::epoch_rng;
use cohort_core::tree::ParamTree;

use crate::kernels::{Native, argmax};
use crate::local::{GradientTerms, LocalPlan};
use crate::model::{FederatedModel, Inputs, Randomness};
use crate::params::{self, LoadError};
use crate::task::{Classification, Evaluation, Score, Task, cross_entropy_of_row};

/// What local training needs besides the data.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSettings {
    pub epochs: u32,
    pub batch_size: usize,
    pub optimizer: OptimizerSpec,
    /// Global gradient-norm clipping; `None` is off.
    pub clip_grad_norm: Option<f64>,
    /// Base of the shuffling streams; `None` shuffles from OS entropy.
    pub training_seed: Option<u64>,
    /// Crops and flips of each training batch (the data set's, unless
    /// `data.augment = false`); `None` trains on the samples as they are.
    pub augmentation: Option<Augmentation>,
}

/// A data set's augmentation of training batches, with the padding value of
/// each channel (a black pixel, normalized as the samples are).
#[derive(Debug, Clone, PartialEq)]
pub struct Augmentation {
    pub augment: cohort_core::data::augment::Augment,
    pub black: Vec<f32>,
}

/// Which logical client trains in which round; names errors and seeds streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientTask {
    pub client_id: u32,
    pub round: u32,
}

/// The result of one local run.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalUpdate {
    pub tree: ParamTree,
    pub num_samples: u64,
    /// The task's loss averaged over all output rows of all epochs (without
    /// a strategy's proximal term).
    pub loss: f64,
    pub training_time: f64,
    /// Optimizer steps taken.
    pub local_steps: u64,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TrainError {
    #[error("client {client_id}, round {round}: cannot load the global model: {source}")]
    Load {
        client_id: u32,
        round: u32,
        #[source]
        source: LoadError,
    },
    #[error(
        "client {client_id}, round {round}, epoch {epoch}, step {step}: gradient norm is {norm}; \
         the update was not applied"
    )]
    NonFiniteGradient {
        client_id: u32,
        round: u32,
        epoch: u32,
        step: usize,
        norm: f64,
    },
    #[error(
        "client {client_id}, round {round}: the strategy's instructions do not fit the model: {source}"
    )]
    Plan {
        client_id: u32,
        round: u32,
        #[source]
        source: LoadError,
    },
    #[error("client {client_id}, round {round}, epoch {epoch}, step {step}: {problem}")]
    Outputs {
        client_id: u32,
        round: u32,
        epoch: u32,
        step: usize,
        problem: String,
    },
    #[error("client {client_id}, round {round}: the partition is empty")]
    EmptyPartition { client_id: u32, round: u32 },
    #[error("client {client_id}, round {round}: cannot augment a batch: {problem}")]
    Augmentation {
        client_id: u32,
        round: u32,
        problem: String,
    },
}

/// One physical worker's trainer of a model of type `M`.
pub struct LocalTrainer<M: FederatedModel> {
    /// `None` only while a run has taken it.
    model: Option<M>,
    device: Device,
    settings: TrainSettings,
    images: Vec<f32>,
    labels: Vec<i64>,
    task: Arc<dyn Task>,
    /// cohort's own kernels, where they implement the model and the task on
    /// this device.
    native: Option<Native>,
    /// Whether a plain SGD run on the native kernels keeps its parameters
    /// on the host ([`LocalTrainer::host_sgd`]), and SGD's steps through
    /// burn's gradients run on the host ([`LocalTrainer::host_steps`]); off
    /// only in the tests that hold the two ways to the same bits.
    host_runs: bool,
}

impl<M: FederatedModel> LocalTrainer<M> {
    /// A trainer with its own model instance, which `build` makes on the
    /// autodiff version of `device`.
    pub fn new(build: impl FnOnce(&Device) -> M, device: &Device, settings: TrainSettings) -> Self {
        let device = device.clone().autodiff();
        let model = build(&device);
        Self {
            native: Native::for_model(model.accelerated(), &device),
            model: Some(model),
            device,
            settings,
            images: Vec::new(),
            labels: Vec::new(),
            task: Arc::new(Classification),
            host_runs: true,
        }
    }

    /// Trains for `task` instead of classification.
    pub fn with_task(mut self, task: Arc<dyn Task>) -> Self {
        if !task.is_builtin_classification() {
            self.native = None;
        }
        self.task = task;
        self
    }

    /// Trains the client on `partition` (indices into `data`) from `global`,
    /// as the strategy's `plan` says (learning rate, gradient terms, update
    /// clipping; see [`crate::local`]).
    pub fn train(
        &mut self,
        task: ClientTask,
        global: &ParamTree,
        data: &Dataset,
        partition: &[u32],
        plan: &LocalPlan,
    ) -> Result<LocalUpdate, TrainError> {
        let learning_rate = plan.learning_rate;
        let ClientTask { client_id, round } = task;
        if partition.is_empty() {
            return Err(TrainError::EmptyPartition { client_id, round });
        }
        let started = Instant::now();
        let (mut model, terms) = self.take_loaded(task, global, plan)?;
        let mut local_steps = 0u64;
        let mut host_run = self.host_run(terms.is_none());
        if let (Some(_), Some(native)) = (&host_run, self.native.as_mut()) {
            native.begin_host_run(&model);
        }
        // Built at the first step that needs one: a run on the host takes
        // neither, and burn's optimizer is only for the rules the host lacks.
        let mut host_steps = None;
        let mut optimizer = None;
        let mut order = partition.to_vec();
        let mut loss_sum = LossSum::new(&self.device);
        let mut seen = 0usize;
        let mut failure = None;
        'training: for epoch in 1..=self.settings.epochs {
            let mut rng = epoch_stream(self.settings.training_seed, task, epoch);
            cohort_core::seeds::shuffle_for_epoch(&mut order, &mut rng);
            let mut crops = augmentation_stream(self.settings.training_seed, task, epoch);
            for (step, batch) in order.chunks(self.settings.batch_size).enumerate() {
                data.gather(batch, &mut self.images, &mut self.labels);
                if let Err(problem) = self.augment(&data.sample_shape, &mut crops) {
                    failure = Some(TrainError::Augmentation {
                        client_id,
                        round,
                        problem,
                    });
                    break 'training;
                }
                if let (Some(rule), Some(native)) = (host_run.as_mut(), self.native.as_mut()) {
                    let rows = self.labels.len();
                    let loss = native.host_step(rule, learning_rate, &self.images, &self.labels);
                    loss_sum.host += loss * rows as f32;
                    seen += rows;
                    local_steps += 1;
                    continue;
                }
                let computed =
                    self.batch_gradients(&model, &data.sample_shape, &mut rng, &mut loss_sum);
                let (mut grads, rows) = match computed {
                    Ok(computed) => computed,
                    Err(problem) => {
                        failure = Some(TrainError::Outputs {
                            client_id,
                            round,
                            epoch,
                            step: step + 1,
                            problem,
                        });
                        break 'training;
                    }
                };
                seen += rows;
                if let Some(terms) = &terms {
                    grads = terms.apply(&model, grads);
                }
                grads = match clipped(&model, grads, self.settings.clip_grad_norm) {
                    Ok(grads) => grads,
                    Err(norm) => {
                        failure = Some(TrainError::NonFiniteGradient {
                            client_id,
                            round,
                            epoch,
                            step: step + 1,
                            norm,
                        });
                        break 'training;
                    }
                };
                if local_steps == 0 {
                    host_steps = self.host_steps(&model);
                }
                model = match host_steps.as_mut() {
                    Some(host) => host.step(learning_rate, model, grads),
                    None => optimizer
                        .get_or_insert_with(|| crate::optim::build(&self.settings.optimizer))
                        .step(learning_rate, model, grads),
                };
                local_steps += 1;
            }
        }
        if let (Some(_), Some(native)) = (&host_run, self.native.as_mut()) {
            model = native.end_host_run(model);
        }
        // `valid()` folds BatchNorm's pending running-statistics updates into
        // the module first; reading the training module would miss the last step.
        let tree = params::extract(&model.valid());
        self.model = Some(model);
        if let Some(error) = failure {
            return Err(error);
        }
        let tree = match plan.update_clip_norm {
            Some(max_norm) => crate::local::clip_update(global, tree, max_norm),
            None => tree,
        };
        let loss = loss_sum.total() as f64 / seen.max(1) as f64;
        Ok(LocalUpdate {
            tree,
            num_samples: partition.len() as u64,
            loss,
            training_time: started.elapsed().as_secs_f64(),
            local_steps,
        })
    }
}

impl<M: FederatedModel> LocalTrainer<M> {
    /// The rule a run takes on the host (SGD, Adam or AdamW), with the
    /// parameters kept there from its first step to its last
    /// ([`Native::begin_host_run`]): where the native kernels train the
    /// model and no gradient term or clipping needs burn's gradients. The
    /// same bits as the steps through burn
    /// (`the_host_run_is_the_burn_run_bit_for_bit`).
    fn host_run(&self, no_terms: bool) -> Option<crate::optim::HostOptimizer> {
        let plain = no_terms && self.settings.clip_grad_norm.is_none() && self.host_runs;
        self.native.as_ref().filter(|_| plain)?;
        crate::optim::HostOptimizer::for_spec(&self.settings.optimizer)
    }

    /// The optimizer's steps on the host for a model trained through burn's
    /// gradients on the CPU ([`crate::optim::HostOptimizer`]: SGD, Adam and
    /// AdamW), where burn's optimizer would take the rule through tensor
    /// operations.
    fn host_steps(&self, model: &M) -> Option<crate::optim::HostOptimizer> {
        if !self.host_runs {
            return None;
        }
        crate::optim::HostOptimizer::for_model(&self.settings.optimizer, model)
    }

    /// Crops and flips the gathered batch, when the settings ask for it.
    fn augment(&mut self, shape: &[usize], crops: &mut ChaCha8Rng) -> Result<(), String> {
        let Some(augmentation) = &self.settings.augmentation else {
            return Ok(());
        };
        cohort_core::data::augment::augment_batch(
            augmentation.augment,
            &mut self.images,
            shape,
            &augmentation.black,
            crops.next_u64(),
        )
    }

    /// The trainer's model with `global` loaded, and the strategy's gradient
    /// terms for it. On an error the instance stays, so the worker stays
    /// usable.
    fn take_loaded(
        &mut self,
        task: ClientTask,
        global: &ParamTree,
        plan: &LocalPlan,
    ) -> Result<(M, Option<GradientTerms>), TrainError> {
        let ClientTask { client_id, round } = task;
        let model = self
            .model
            .take()
            .expect("a trainer runs one client at a time");
        let model = match params::load(model.clone(), global) {
            Ok(loaded) => loaded,
            Err(source) => {
                self.model = Some(model);
                return Err(TrainError::Load {
                    client_id,
                    round,
                    source,
                });
            }
        };
        match GradientTerms::new(&model, plan, global) {
            Ok(terms) => Ok((model, terms)),
            Err(source) => {
                self.model = Some(model);
                Err(TrainError::Plan {
                    client_id,
                    round,
                    source,
                })
            }
        }
    }
}

/// The stream an epoch of `task` shuffles and draws dropout from: seeded by
/// (seed, client, round, epoch) so every run draws the same, else fresh.
fn epoch_stream(seed: Option<u64>, task: ClientTask, epoch: u32) -> ChaCha8Rng {
    match seed {
        Some(seed) => epoch_rng(seed, task.client_id, task.round, epoch),
        None => ChaCha8Rng::from_os_rng(),
    }
}

/// The stream each batch's crops and flips are drawn from: its own purpose
/// (`seeds::augmentation_stream`), so augmenting leaves the shuffle as it
/// was.
pub(crate) fn augmentation_stream(seed: Option<u64>, task: ClientTask, epoch: u32) -> ChaCha8Rng {
    match seed {
        Some(seed) => ChaCha8Rng::seed_from_u64(cohort_core::seeds::augmentation_stream(
            seed,
            task.client_id,
            task.round,
            epoch,
        )),
        None => ChaCha8Rng::from_os_rng(),
    }
}

/// `trainer.clip_grad_norm`: the gradients scaled to at most `max_norm`;
/// their norm when it is not finite.
fn clipped<M: Module>(
    model: &M,
    grads: GradientsParams,
    max_norm: Option<f64>,
) -> Result<GradientsParams, f64> {
    let Some(max_norm) = max_norm else {
        return Ok(grads);
    };
    match clip_scale(global_norm(model, &grads), max_norm)? {
        Some(scale) => Ok(scale_gradients(model, grads, scale)),
        None => Ok(grads),
    }
}

/// The sum of every batch's mean loss times its size: burn's batches add on
/// the device (no read-back per step), the native ones on the host.
struct LossSum {
    device: Tensor<1>,
    host: f32,
}

impl LossSum {
    fn new(device: &Device) -> Self {
        Self {
            device: Tensor::<1>::zeros([1], device),
            host: 0.0,
        }
    }

    fn total(self) -> f32 {
        self.device.into_scalar::<f32>() + self.host
    }
}

impl<M: FederatedModel> LocalTrainer<M> {
    /// The gradients of the batch in `self.images`/`self.labels` (samples of
    /// `sample_shape`) at `model`, with the output rows it scored, its loss
    /// added to `loss_sum`: through the native kernels where they cover the
    /// model and the task, else burn's autodiff. Outputs that do not fit the
    /// task's targets (a row count or a class count of their own) are an
    /// error, not a panic inside the loss.
    fn batch_gradients(
        &mut self,
        model: &M,
        sample_shape: &[usize],
        rng: &mut ChaCha8Rng,
        loss_sum: &mut LossSum,
    ) -> Result<(GradientsParams, usize), String> {
        if let Some(native) = self.native.as_mut() {
            let rows = self.labels.len();
            let (loss, grads) = native.step(model, &self.images, &self.labels);
            loss_sum.host += loss * rows as f32;
            return Ok((grads, rows));
        }
        let targets = self.task.targets(
            &self.images,
            &self.labels,
            sample_shape,
            model.rows_per_sample(sample_shape),
        );
        let rows = targets.len();
        let inputs = Inputs::from_host(self.images.clone(), sample_shape, &self.device);
        let outputs = model.forward(inputs, &mut Randomness::from_stream(rng));
        let [output_rows, classes] = outputs.dims();
        if output_rows != rows {
            return Err(format!(
                "the model gives {output_rows} output rows for {} samples; {} needs {rows}",
                self.labels.len(),
                self.task.name()
            ));
        }
        if let Some(target) = targets.iter().find(|&&t| t < 0 || t as usize >= classes) {
            return Err(format!(
                "target {target} of {}, but the model gives {classes} outputs per row",
                self.task.name()
            ));
        }
        let targets = Tensor::<1, Int>::from_data(TensorData::new(targets, [rows]), &self.device);
        let loss = self.task.loss(outputs, targets);
        loss_sum.device = loss_sum.device.clone() + loss.clone().detach().mul_scalar(rows as f32);
        Ok((GradientsParams::from_grads(loss.backward(), model), rows))
    }
}

impl<M: FederatedModel> LocalTrainer<M> {
    /// The task's score of `global` on the samples `indices` of `data` (a
    /// client's held-out data), in evaluation mode.
    pub fn score(
        &mut self,
        global: &ParamTree,
        data: &Dataset,
        indices: &[u32],
    ) -> Result<Score, EvalError> {
        let model = self
            .model
            .take()
            .expect("a trainer runs one client at a time");
        let batch_size = self.settings.batch_size.max(256);
        let result = params::load(model.clone(), global)
            .map_err(EvalError::Load)
            .and_then(|loaded| score(&loaded, &*self.task, data, indices, batch_size));
        self.model = Some(model);
        result
    }
}

/// What global-norm clipping does with a step's gradient norm: `Ok(None)`
/// leaves the gradients alone, `Ok(Some(scale))` scales them by `scale`, and
/// `Err(norm)` (a non-finite norm) stops before the update.
fn clip_scale(norm: f64, max_norm: f64) -> Result<Option<f32>, f64> {
    if !norm.is_finite() {
        return Err(norm);
    }
    if norm <= max_norm {
        return Ok(None);
    }
    // Guards 0/0 when clipping to zero: every gradient becomes 0.
    Ok(Some(if norm > 0.0 {
        (max_norm / norm) as f32
    } else {
        0.0
    }))
}

struct SquaredNorm<'a> {
    grads: &'a GradientsParams,
    total: f64,
}

impl ModuleVisitor for SquaredNorm<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(grad) = self.grads.get::<D>(param.id) {
            self.total += squared_sum(grad) as f64;
        }
    }
}

/// The sum of `tensor`'s squares, in two levels (each row of the first
/// dimension, then the rows): one float32 sum over a large layer's million
/// values in a row drifts by about 1e-3 of the total (fc1 of `cnn`, 1.6
/// million values), which would move the clipping scale by as much.
fn squared_sum<const D: usize>(tensor: Tensor<D>) -> f32 {
    let squares = tensor.square();
    let rows = squares.dims()[0];
    let by_row = match D {
        1 => squares.reshape([1, rows]),
        _ => squares.reshape([rows as i32, -1]),
    };
    by_row.sum_dim(1).sum().into_scalar::<f32>()
}

/// L2 norm over all gradients together.
fn global_norm<M: Module>(model: &M, grads: &GradientsParams) -> f64 {
    let mut visitor = SquaredNorm { grads, total: 0.0 };
    model.visit(&mut visitor);
    visitor.total.sqrt()
}

struct Scale {
    grads: GradientsParams,
    factor: f32,
}

impl ModuleVisitor for Scale {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(grad) = self.grads.remove::<D>(param.id) {
            self.grads.register(param.id, grad.mul_scalar(self.factor));
        }
    }
}

fn scale_gradients<M: Module>(model: &M, grads: GradientsParams, factor: f32) -> GradientsParams {
    let mut visitor = Scale { grads, factor };
    model.visit(&mut visitor);
    visitor.grads
}

/// Test-set evaluation on a model without autodiff.
pub struct Evaluator<M: FederatedModel> {
    model: Option<M>,
    batch_size: usize,
    task: Arc<dyn Task>,
}

impl<M: FederatedModel> Evaluator<M> {
    /// Evaluates classification through `model` (built on a plain device),
    /// `batch_size` samples at a time.
    pub fn new(model: M, batch_size: usize) -> Self {
        Self {
            model: Some(model),
            batch_size,
            task: Arc::new(Classification),
        }
    }

    /// Evaluates `task` instead of classification.
    pub fn with_task(mut self, task: Arc<dyn Task>) -> Self {
        self.task = task;
        self
    }

    /// The initial parameters of this evaluator's model instance.
    pub fn parameters(&self) -> ParamTree {
        params::extract(self.model.as_ref().expect("evaluator holds its model"))
    }

    /// `tree` loaded into this evaluator's model instance, which is kept
    /// whatever happens.
    fn loaded(&mut self, tree: &ParamTree) -> Result<M, EvalError> {
        let model = self.model.take().expect("evaluator holds its model");
        let loaded = params::load(model.clone(), tree);
        self.model = Some(model);
        loaded.map_err(EvalError::Load)
    }

    /// The task's loss and accuracy of `tree` on all of `data`, its batches
    /// spread over the current rayon pool (see [`score_batches`]).
    pub fn evaluate(&mut self, tree: &ParamTree, data: &Dataset) -> Result<Evaluation, EvalError> {
        Ok(sum_in_order(self.batch_scores(tree, data)?).finish())
    }

    /// The score of each evaluation batch of `data`, in order: what
    /// [`Evaluator::evaluate`] adds up. A distributed run's ranks each
    /// score their own batches and add everyone's in this order.
    pub fn batch_scores(
        &mut self,
        tree: &ParamTree,
        data: &Dataset,
    ) -> Result<Vec<Score>, EvalError> {
        let model = self.loaded(tree)?;
        let all: Vec<u32> = (0..data.len() as u32).collect();
        batch_scores(&model, &*self.task, data, &all, self.batch_size)
    }

    /// The accuracy of [`Evaluator::evaluate`].
    pub fn accuracy(&mut self, tree: &ParamTree, data: &Dataset) -> Result<f64, EvalError> {
        Ok(self.evaluate(tree, data)?.accuracy)
    }
}

/// A model's outputs on some samples: rows of logits with their targets, and
/// how many rows' top class (the first, on a tie) is the target.
#[derive(Debug, Clone, PartialEq)]
pub struct Predictions {
    /// `[rows, classes]`, row-major: one row per sample for classification.
    pub logits: Vec<f32>,
    pub classes: usize,
    /// The task's target of each row.
    pub labels: Vec<u32>,
    pub correct: u64,
}

impl<M: FederatedModel> Evaluator<M> {
    /// The logits of `tree` on the samples `indices` of `data`, in evaluation
    /// mode, and how many rows it predicts correctly, counted exactly as
    /// [`Evaluator::evaluate`] does.
    pub fn predictions(
        &mut self,
        tree: &ParamTree,
        data: &Dataset,
        indices: &[u32],
    ) -> Result<Predictions, EvalError> {
        let loaded = self.loaded(tree)?;
        let correct = score(&loaded, &*self.task, data, indices, self.batch_size)?.correct;
        let model = loaded.valid();
        let device = device_of(&model);
        let (mut images, mut labels) = (Vec::new(), Vec::new());
        let mut logits = Vec::with_capacity(indices.len() * 10);
        let mut targets = Vec::with_capacity(indices.len());
        let mut classes = 0;
        for batch in indices.chunks(self.batch_size.max(1)) {
            data.gather(batch, &mut images, &mut labels);
            let batch_targets = self.task.targets(
                &images,
                &labels,
                &data.sample_shape,
                model.rows_per_sample(&data.sample_shape),
            );
            targets.extend(batch_targets.iter().map(|&t| t as u32));
            let input = Inputs::from_host(images.clone(), &data.sample_shape, &device);
            let output = model.forward(input, &mut Randomness::none());
            classes = output.dims()[1];
            logits.extend(
                output
                    .into_data()
                    .try_to_vec::<f32>()
                    .expect("a float32 model's logits convert to f32"),
            );
        }
        Ok(Predictions {
            logits,
            classes,
            labels: targets,
            correct,
        })
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EvalError {
    // Not `#[from]`: that makes the load error the source as well, and a
    // chain printed with `{:#}` would say it twice.
    #[error("cannot load the model to evaluate: {0}")]
    Load(LoadError),
    #[error("test sample {index} has target {label}, but the model has {classes} classes")]
    LabelOutOfRange {
        index: usize,
        label: u32,
        classes: usize,
    },
    #[error("the model gives {rows} output rows for {samples} samples; {task} needs {targets}")]
    OutputRows {
        task: String,
        samples: usize,
        rows: usize,
        targets: usize,
    },
    /// An evaluator of the caller's failed (`cohort.simulate`'s
    /// `evaluate_fn` raised); the text is its own.
    #[error("{0}")]
    Failed(String),
}

impl From<LoadError> for EvalError {
    fn from(error: LoadError) -> Self {
        EvalError::Load(error)
    }
}

fn device_of<M: Module>(model: &M) -> burn::tensor::Device {
    model
        .devices()
        .into_iter()
        .next()
        .unwrap_or_else(crate::device::cpu)
}

/// Classification accuracy of `model` on `data`, in evaluation mode (see
/// [`score`]).
pub fn evaluate<M: FederatedModel>(
    model: &M,
    data: &Dataset,
    batch_size: usize,
) -> Result<f64, EvalError> {
    let all: Vec<u32> = (0..data.len() as u32).collect();
    Ok(score(model, &Classification, data, &all, batch_size)?
        .finish()
        .accuracy)
}

/// The loss and correct rows of `model` for `task` on the samples `indices`
/// of `data`, in evaluation mode: on a plain device, so BatchNorm uses its
/// running statistics and dropout is off. The caller's model, training mode
/// included, is left exactly as it was, also when evaluation stops with an
/// error halfway (it only ever sees a `valid()` copy).
pub fn score<M: FederatedModel>(
    model: &M,
    task: &dyn Task,
    data: &Dataset,
    indices: &[u32],
    batch_size: usize,
) -> Result<Score, EvalError> {
    let model = model.valid();
    if task.is_builtin_classification()
        && let Some(mut native) = Native::for_net(&model)
    {
        return score_native(&mut native, &model, data, indices, batch_size);
    }
    let device = device_of(&model);
    let mut correct = Tensor::<1, Int>::zeros([1], &device);
    let mut loss_sum = Tensor::<1>::zeros([1], &device);
    let mut rows = 0usize;
    let (mut images, mut labels) = (Vec::new(), Vec::new());
    for (batch_index, batch) in indices.chunks(batch_size.max(1)).enumerate() {
        data.gather(batch, &mut images, &mut labels);
        let targets = task.targets(
            &images,
            &labels,
            &data.sample_shape,
            model.rows_per_sample(&data.sample_shape),
        );
        let input = Inputs::from_host(images.clone(), &data.sample_shape, &device);
        let logits = model.forward(input, &mut Randomness::none());
        let [batch_rows, classes] = logits.dims();
        if batch_rows != targets.len() {
            return Err(EvalError::OutputRows {
                task: task.name().to_owned(),
                samples: batch.len(),
                rows: batch_rows,
                targets: targets.len(),
            });
        }
        check_labels(&targets, classes, batch_index * batch_size.max(1))?;
        let targets = Tensor::<1, Int>::from_data(TensorData::new(targets, [batch_rows]), &device);
        let predicted = logits.clone().argmax(1).flatten::<1>(0, 1);
        correct = correct + predicted.equal(targets.clone()).int().sum();
        loss_sum = loss_sum + task.loss(logits, targets).mul_scalar(batch_rows as f32);
        rows += batch_rows;
    }
    Ok(Score {
        loss_sum: f64::from(loss_sum.into_scalar::<f32>()),
        correct: correct.into_scalar::<i64>() as u64,
        rows: rows as u64,
    })
}

/// [`score`], one batch of `batch_size` samples at a time on the current
/// rayon pool's threads, each batch on its own copy of `model` (a copy
/// shares the weights; burn's modules are `Send` but not `Sync`). The
/// batches' scores are added in batch order, so the result is the same bits
/// with one thread or many: a test set of 10,000 images is 10 batches of
/// the default evaluation batch, and a server with idle cores evaluates
/// them at once instead of one after another.
pub fn score_batches<M: FederatedModel>(
    model: &M,
    task: &dyn Task,
    data: &Dataset,
    indices: &[u32],
    batch_size: usize,
) -> Result<Score, EvalError> {
    Ok(sum_in_order(batch_scores(
        model, task, data, indices, batch_size,
    )?))
}

/// The scores added in their order: the one order every evaluation sums in,
/// so that any split of the batches over threads or ranks gives the same bits.
pub fn sum_in_order(scores: impl IntoIterator<Item = Score>) -> Score {
    let mut total = Score::default();
    for score in scores {
        total.add(score);
    }
    total
}

/// [`score_batches`]'s per-batch scores, in batch order, before they are
/// added.
pub fn batch_scores<M: FederatedModel>(
    model: &M,
    task: &dyn Task,
    data: &Dataset,
    indices: &[u32],
    batch_size: usize,
) -> Result<Vec<Score>, EvalError> {
    use rayon::prelude::*;
    let batch_size = batch_size.max(1);
    let batches: Vec<(M, usize, &[u32])> = indices
        .chunks(batch_size)
        .enumerate()
        .map(|(number, batch)| (model.clone(), number * batch_size, batch))
        .collect();
    batches
        .into_par_iter()
        .map(|(model, first, batch)| {
            score(&model, task, data, batch, batch_size).map_err(|error| match error {
                EvalError::LabelOutOfRange {
                    index,
                    label,
                    classes,
                } => EvalError::LabelOutOfRange {
                    index: first + index,
                    label,
                    classes,
                },
                other => other,
            })
        })
        .collect()
}

/// Images the native evaluation runs through the network at once: its
/// working set stays in the core's L2 cache, whatever the batch size.
const NATIVE_EVAL_CHUNK: usize = 32;

/// [`score`] of classification through the native kernels.
fn score_native<M: FederatedModel>(
    native: &mut Native,
    model: &M,
    data: &Dataset,
    indices: &[u32],
    batch_size: usize,
) -> Result<Score, EvalError> {
    let (mut images, mut labels) = (Vec::new(), Vec::new());
    let mut score = Score::default();
    for (batch_index, batch) in indices.chunks(batch_size.max(1)).enumerate() {
        data.gather(batch, &mut images, &mut labels);
        check_labels(&labels, native.classes(), batch_index * batch_size.max(1))?;
        native.predict(model, &images, NATIVE_EVAL_CHUNK, |i, logits| {
            let label = labels[i] as usize;
            score.correct += u64::from(label == argmax(logits));
            score.loss_sum += cross_entropy_of_row(logits, label);
        });
        score.rows += batch.len() as u64;
    }
    Ok(score)
}

/// The first target of a batch that starts at sample `first` that the model
/// has no class for, as an error.
fn check_labels(labels: &[i64], classes: usize, first: usize) -> Result<(), EvalError> {
    match labels.iter().position(|&l| l < 0 || l as usize >= classes) {
        Some(offset) => Err(EvalError::LabelOutOfRange {
            index: first + offset,
            label: labels[offset] as u32,
            classes,
        }),
        None => Ok(()),
    }
}

/// A worker's trainer of whichever model the registry built: what the
/// runtime holds, so that it never names a model type.
pub trait ClientTrainer: Send {
    /// See [`LocalTrainer::train`].
    fn train(
        &mut self,
        task: ClientTask,
        global: &ParamTree,
        data: &Dataset,
        partition: &[u32],
        plan: &LocalPlan,
    ) -> Result<LocalUpdate, TrainError>;

    /// See [`LocalTrainer::score`].
    fn score(
        &mut self,
        global: &ParamTree,
        data: &Dataset,
        indices: &[u32],
    ) -> Result<Score, EvalError>;
}

impl<M: FederatedModel> ClientTrainer for LocalTrainer<M> {
    fn train(
        &mut self,
        task: ClientTask,
        global: &ParamTree,
        data: &Dataset,
        partition: &[u32],
        plan: &LocalPlan,
    ) -> Result<LocalUpdate, TrainError> {
        LocalTrainer::train(self, task, global, data, partition, plan)
    }

    fn score(
        &mut self,
        global: &ParamTree,
        data: &Dataset,
        indices: &[u32],
    ) -> Result<Score, EvalError> {
        LocalTrainer::score(self, global, data, indices)
    }
}

/// The evaluator of whichever model the registry built.
pub trait ModelEvaluator: Send {
    /// See [`Evaluator::parameters`].
    fn parameters(&self) -> ParamTree;

    /// See [`Evaluator::evaluate`].
    fn evaluate(&mut self, tree: &ParamTree, data: &Dataset) -> Result<Evaluation, EvalError>;

    /// The batch size [`ModelEvaluator::batch_scores`] scores in, for an
    /// evaluator whose test set can be split over ranks on batch bounds;
    /// `None` (the default) for one that scores the test set as a whole,
    /// which rank 0 then evaluates alone.
    fn evaluation_batch(&self) -> Option<usize> {
        None
    }

    /// The score of each batch of `data`, in order (see
    /// [`Evaluator::batch_scores`]); only called where
    /// [`ModelEvaluator::evaluation_batch`] is `Some`.
    fn batch_scores(
        &mut self,
        _tree: &ParamTree,
        _data: &Dataset,
    ) -> Result<Vec<Score>, EvalError> {
        Err(EvalError::Failed(
            "this evaluator scores the test set only as a whole".to_owned(),
        ))
    }

    /// See [`Evaluator::predictions`].
    fn predictions(
        &mut self,
        tree: &ParamTree,
        data: &Dataset,
        indices: &[u32],
    ) -> Result<Predictions, EvalError>;
}

impl<M: FederatedModel> ModelEvaluator for Evaluator<M> {
    fn parameters(&self) -> ParamTree {
        Evaluator::parameters(self)
    }

    fn evaluate(&mut self, tree: &ParamTree, data: &Dataset) -> Result<Evaluation, EvalError> {
        Evaluator::evaluate(self, tree, data)
    }

    fn evaluation_batch(&self) -> Option<usize> {
        Some(self.batch_size.max(1))
    }

    fn batch_scores(&mut self, tree: &ParamTree, data: &Dataset) -> Result<Vec<Score>, EvalError> {
        Evaluator::batch_scores(self, tree, data)
    }

    fn predictions(
        &mut self,
        tree: &ParamTree,
        data: &Dataset,
        indices: &[u32],
    ) -> Result<Predictions, EvalError> {
        Evaluator::predictions(self, tree, data, indices)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{CnnBn, LeNet5};
    use cohort_core::tree::ParamTree;

    /// 64 random-looking 28×28 images with labels, enough for two batches of 32.
    fn dataset(poison: bool) -> Dataset {
        let count = 64;
        let mut images: Vec<f32> = (0..count * 784)
            .map(|i| ((i * 7919) % 255) as f32 / 255.0 - 0.5)
            .collect();
        if poison {
            images[5] = f32::NAN;
        }
        Dataset {
            inputs: images,
            labels: (0..count).map(|i| (i % 10) as u32).collect(),
            sample_shape: vec![1, 28, 28],
        }
    }

    fn sgd(clip: Option<f64>) -> TrainSettings {
        TrainSettings {
            epochs: 1,
            batch_size: 32,
            optimizer: OptimizerSpec::Sgd {
                learning_rate: 1.0,
                momentum: 0.0,
                weight_decay: 0.0,
                dampening: 0.0,
                nesterov: false,
            },
            clip_grad_norm: clip,
            training_seed: Some(1),
            augmentation: None,
        }
    }

    fn distance(a: &ParamTree, b: &ParamTree) -> f64 {
        a.leaves()
            .iter()
            .zip(b.leaves())
            .flat_map(|((_, x), (_, y))| {
                x.as_f32()
                    .unwrap()
                    .iter()
                    .zip(y.as_f32().unwrap())
                    .map(|(p, q)| ((p - q) as f64).powi(2))
                    .collect::<Vec<_>>()
            })
            .sum::<f64>()
            .sqrt()
    }

    fn one_step(clip: Option<f64>, poison: bool) -> (ParamTree, Result<LocalUpdate, TrainError>) {
        let device = crate::device::cpu();
        let mut trainer = LocalTrainer::new(|d| LeNet5::new(10, d), &device, sgd(clip));
        let global =
            crate::init::seeded_parameters(&params::extract(trainer.model.as_ref().unwrap()), 3);
        let data = dataset(poison);
        // One batch of 32: exactly one optimizer step.
        let partition: Vec<u32> = (0..32).collect();
        let result = trainer.train(
            ClientTask {
                client_id: 7,
                round: 2,
            },
            &global,
            &data,
            &partition,
            &LocalPlan::plain(1.0),
        );
        (global, result)
    }

    /// SGD at learning rate 1 for `steps` epochs of one batch of 32 (the same
    /// samples every step), as `plan` says.
    fn sgd_steps(steps: u32, plan: &LocalPlan) -> (ParamTree, LocalUpdate) {
        let device = crate::device::cpu();
        let settings = TrainSettings {
            epochs: steps,
            ..sgd(None)
        };
        let mut trainer = LocalTrainer::new(|d| LeNet5::new(10, d), &device, settings);
        let global =
            crate::init::seeded_parameters(&params::extract(trainer.model.as_ref().unwrap()), 3);
        let partition: Vec<u32> = (0..32).collect();
        let task = ClientTask {
            client_id: 7,
            round: 2,
        };
        let update = trainer
            .train(task, &global, &dataset(false), &partition, plan)
            .unwrap();
        (global, update)
    }

    fn map_leaves(tree: &ParamTree, f: impl Fn(f32) -> f32) -> ParamTree {
        ParamTree::from_dotted(tree.leaves().into_iter().map(|(path, array)| {
            let values = array.as_f32().unwrap().iter().map(|&x| f(x)).collect();
            (
                path.to_string(),
                cohort_core::tree::Array::f32(array.shape().to_vec(), values).unwrap(),
            )
        }))
    }

    fn max_difference(a: &ParamTree, b: &ParamTree) -> f32 {
        a.leaves()
            .iter()
            .zip(b.leaves())
            .flat_map(|((_, x), (_, y))| {
                x.as_f32()
                    .unwrap()
                    .iter()
                    .zip(y.as_f32().unwrap())
                    .map(|(p, q)| (p - q).abs())
                    .collect::<Vec<_>>()
            })
            .fold(0.0, f32::max)
    }

    #[test]
    fn a_gradient_correction_shifts_every_step_by_it() {
        // One SGD step at rate 1: w₁ = w₀ − (g + c), so with c = 0.25
        // everywhere the model ends exactly 0.25 below the plain step.
        let (global, plain) = sgd_steps(1, &LocalPlan::plain(1.0));
        let correction = map_leaves(&global, |_| 0.25);
        let plan = LocalPlan {
            gradient_correction: Some(correction),
            ..LocalPlan::plain(1.0)
        };
        let (_, corrected) = sgd_steps(1, &plan);
        let expected = map_leaves(&plain.tree, |x| x - 0.25);
        assert!(max_difference(&corrected.tree, &expected) <= 1e-6);
        assert_eq!(corrected.local_steps, 1);
    }

    #[test]
    fn the_proximal_term_pulls_the_second_step_towards_the_global_model() {
        // Step 1 is the same with or without the term (w₀ = w_global). Step 2,
        // on the same batch, differs by −η·μ·(w₁ − w_global) (up to the
        // summation order of the reshuffled batch).
        let mu = 0.5;
        let (global, one) = sgd_steps(1, &LocalPlan::plain(1.0));
        let (_, plain) = sgd_steps(2, &LocalPlan::plain(1.0));
        let plan = LocalPlan {
            proximal_mu: mu,
            ..LocalPlan::plain(1.0)
        };
        let (_, proximal) = sgd_steps(2, &plan);
        assert_eq!(proximal.local_steps, 2);
        let pull: Vec<f32> = one
            .tree
            .leaves()
            .iter()
            .zip(global.leaves())
            .flat_map(|((_, w1), (_, wg))| {
                w1.as_f32()
                    .unwrap()
                    .iter()
                    .zip(wg.as_f32().unwrap())
                    .map(|(a, b)| -(mu as f32) * (a - b))
                    .collect::<Vec<_>>()
            })
            .collect();
        let observed: Vec<f32> = proximal
            .tree
            .leaves()
            .iter()
            .zip(plain.tree.leaves())
            .flat_map(|((_, p), (_, q))| {
                p.as_f32()
                    .unwrap()
                    .iter()
                    .zip(q.as_f32().unwrap())
                    .map(|(a, b)| a - b)
                    .collect::<Vec<_>>()
            })
            .collect();
        let worst = pull
            .iter()
            .zip(&observed)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(worst <= 1e-5, "largest deviation {worst}");
        assert!(
            pull.iter().any(|x| x.abs() > 1e-3),
            "the test needs a real pull"
        );
    }

    #[test]
    fn update_clipping_bounds_the_distance_to_the_global_model() {
        let (global, free) = sgd_steps(2, &LocalPlan::plain(1.0));
        let norm = distance(&global, &free.tree);
        let plan = LocalPlan {
            update_clip_norm: Some(norm / 3.0),
            ..LocalPlan::plain(1.0)
        };
        let (_, clipped) = sgd_steps(2, &plan);
        let clipped_norm = distance(&global, &clipped.tree);
        assert!(
            (clipped_norm - norm / 3.0).abs() <= 1e-4 * norm,
            "{clipped_norm} vs {}",
            norm / 3.0
        );
    }

    #[test]
    fn clipping_bounds_the_global_norm_of_the_step() {
        // With SGD at learning rate 1, the step is the (clipped) gradient itself.
        let (global, unclipped) = one_step(None, false);
        let free_norm = distance(&global, &unclipped.unwrap().tree);
        let max_norm = free_norm / 4.0;
        let (_, clipped) = one_step(Some(max_norm), false);
        let clipped_norm = distance(&global, &clipped.unwrap().tree);
        assert!(
            (clipped_norm - max_norm).abs() <= 1e-3 * max_norm,
            "{clipped_norm} vs {max_norm}"
        );
        // A bound above the norm leaves the step alone.
        let (_, loose) = one_step(Some(free_norm * 2.0), false);
        assert!((distance(&global, &loose.unwrap().tree) - free_norm).abs() <= 1e-4 * free_norm);
    }

    #[test]
    fn clip_decisions_cover_every_case() {
        assert_eq!(clip_scale(0.5, 1.0), Ok(None), "below the limit");
        assert_eq!(clip_scale(1.0, 1.0), Ok(None), "at the limit");
        assert_eq!(clip_scale(4.0, 1.0), Ok(Some(0.25)), "above the limit");
        assert_eq!(clip_scale(3.0, 0.0), Ok(Some(0.0)), "limit 0");
        assert_eq!(clip_scale(0.0, 0.0), Ok(None), "zero gradient, limit 0");
        assert_eq!(clip_scale(f64::INFINITY, 1.0), Err(f64::INFINITY));
        assert!(clip_scale(f64::NAN, 1.0).unwrap_err().is_nan());
    }

    #[test]
    fn an_infinite_gradient_gives_an_infinite_global_norm() {
        struct FirstBias<'a>(&'a mut Option<burn::module::ParamId>);
        impl ModuleVisitor for FirstBias<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if D == 1 && self.0.is_none() {
                    *self.0 = Some(param.id);
                }
            }
        }
        let device = crate::device::cpu().autodiff();
        let model = LeNet5::new(10, &device);
        let mut first = None;
        model.visit(&mut FirstBias(&mut first));
        let mut values = vec![1.0f32; 6];
        values[2] = f32::INFINITY;
        let mut grads = GradientsParams::new();
        grads.register(
            first.unwrap(),
            Tensor::<1>::from_data(TensorData::new(values, [6]), &crate::device::cpu()),
        );
        let norm = global_norm(&model, &grads);
        assert_eq!(norm, f64::INFINITY);
        assert_eq!(clip_scale(norm, 1.0), Err(f64::INFINITY));
    }

    #[test]
    fn clipping_to_zero_freezes_the_model() {
        let (global, result) = one_step(Some(0.0), false);
        assert_eq!(result.unwrap().tree, global);
    }

    #[test]
    fn non_finite_gradient_stops_before_the_update_and_names_where() {
        let (_, result) = one_step(Some(1.0), true);
        let error = result.unwrap_err();
        assert!(
            matches!(
                error,
                TrainError::NonFiniteGradient {
                    client_id: 7,
                    round: 2,
                    epoch: 1,
                    step: 1,
                    ..
                }
            ),
            "{error}"
        );
        assert!(
            error
                .to_string()
                .starts_with("client 7, round 2, epoch 1, step 1: gradient norm is NaN"),
            "{error}"
        );
    }

    /// Classification that writes down which samples each batch held, by
    /// the sample number `numbered` puts in its first pixel.
    #[derive(Debug, Default)]
    struct RecordsSamples(std::sync::Mutex<Vec<u32>>);

    impl Task for RecordsSamples {
        fn name(&self) -> &str {
            "classification, recorded"
        }

        fn targets(&self, inputs: &[f32], labels: &[i64], shape: &[usize], _: usize) -> Vec<i64> {
            let size: usize = shape.iter().product();
            let mut seen = self.0.lock().unwrap();
            seen.extend(inputs.chunks(size).map(|sample| sample[0] as u32));
            labels.to_vec()
        }
    }

    #[test]
    fn the_trainer_visits_the_samples_in_the_published_epoch_orders() {
        let mut data = dataset(false);
        for (index, sample) in data.inputs.chunks_mut(784).enumerate() {
            sample[0] = index as f32;
        }
        let settings = TrainSettings {
            epochs: 3,
            batch_size: 5,
            ..sgd(None)
        };
        let recorder = Arc::new(RecordsSamples::default());
        let mut trainer =
            LocalTrainer::new(|d| LeNet5::new(10, d), &crate::device::cpu(), settings)
                .with_task(recorder.clone());
        let global = params::extract(trainer.model.as_ref().unwrap());
        let partition: Vec<u32> = vec![40, 3, 17, 8, 22, 61, 5, 30, 11, 49, 2, 57];
        let task = ClientTask {
            client_id: 4,
            round: 6,
        };
        trainer
            .train(task, &global, &data, &partition, &LocalPlan::plain(0.01))
            .unwrap();
        let published = cohort_core::seeds::epoch_orders(&partition, 1, 4, 6, 3).concat();
        assert_eq!(*recorder.0.lock().unwrap(), published);
    }

    #[test]
    fn training_streams_do_not_depend_on_the_trainer_instance() {
        let (_, a) = one_step(None, false);
        let (_, b) = one_step(None, false);
        assert_eq!(a.unwrap().tree, b.unwrap().tree);
    }

    /// Each LeNet trained by SGD (every combination of the rule's terms),
    /// Adam and AdamW with its parameters on the host, and through burn's
    /// optimizer: the same update, bit for bit, the same loss and steps.
    #[test]
    fn the_host_run_is_the_burn_run_bit_for_bit() {
        for mut settings in [
            sgd_variant((0.0, 0.0, 0.0, false)),
            sgd_variant((0.9, 0.0, 0.0, false)),
            sgd_variant((0.9, 0.01, 0.1, false)),
            sgd_variant((0.9, 0.01, 0.0, true)),
            adam_variant(0.0, false),
            adam_variant(0.01, true),
        ] {
            settings.epochs = 2;
            let cpu = crate::device::cpu();
            let trainer = LocalTrainer::new(|d| LeNet5::new(10, d), &cpu, settings.clone());
            assert!(
                trainer.native.is_some(),
                "the native kernels train the LeNets"
            );
            assert!(
                trainer.host_run(true).is_some(),
                "{settings:?} runs on the host"
            );
            let plan = LocalPlan::plain(0.05);
            let runs = [
                (
                    host_and_burn(|d| LeNet5::new(10, d), &settings, &plan),
                    "lenet5",
                ),
                (
                    host_and_burn(
                        |d| crate::model::LeNet5Compact::new(10, d),
                        &settings,
                        &plan,
                    ),
                    "lenet5_compact",
                ),
            ];
            assert_same_runs(runs, &settings);
        }
    }

    /// Models that burn's gradients train (the zoo's, and a LeNet under a
    /// gradient term): SGD's and Adam's steps on the host give burn's
    /// optimizer's bits, BatchNorm's running statistics and dropout
    /// included.
    #[test]
    fn host_steps_are_the_burn_optimizers_bit_for_bit() {
        use crate::model::{Activation, Cnn, Multilayer, NormKind, ResNet20};
        for settings in [
            sgd_variant((0.0, 0.0, 0.0, false)),
            sgd_variant((0.9, 0.01, 0.1, false)),
            sgd_variant((0.9, 0.0, 0.0, true)),
            adam_variant(0.0, false),
            adam_variant(0.01, true),
        ] {
            let plain = LocalPlan::plain(0.05);
            let proximal = LocalPlan {
                proximal_mu: 0.1,
                ..LocalPlan::plain(0.05)
            };
            let runs = [
                (
                    host_and_burn(|d| Cnn::new([1, 28, 28], 16, 10, d), &settings, &plain),
                    "cnn",
                ),
                (
                    host_and_burn(|d| CnnBn::new(10, d), &settings, &plain),
                    "cnn_bn",
                ),
                (
                    host_and_burn(
                        |d| Multilayer::new(784, &[32, 16], 10, Activation::Relu, d),
                        &settings,
                        &plain,
                    ),
                    "multilayer",
                ),
                (
                    host_and_burn(
                        |d| ResNet20::new(1, 10, NormKind::Group(2), d),
                        &settings,
                        &plain,
                    ),
                    "resnet_20",
                ),
                (
                    host_and_burn(|d| LeNet5::new(10, d), &settings, &proximal),
                    "lenet5 under FedProx",
                ),
            ];
            assert_same_runs(runs, &settings);
        }
    }

    /// SGD at rate 0.05 with `(momentum, weight_decay, dampening, nesterov)`.
    fn sgd_variant(
        (momentum, weight_decay, dampening, nesterov): (f64, f64, f64, bool),
    ) -> TrainSettings {
        let mut settings = sgd(None);
        settings.optimizer = OptimizerSpec::Sgd {
            learning_rate: 0.05,
            momentum,
            weight_decay,
            dampening,
            nesterov,
        };
        settings
    }

    fn adam_variant(weight_decay: f64, bias_correction: bool) -> TrainSettings {
        let mut settings = sgd(None);
        settings.optimizer = OptimizerSpec::AdamW {
            learning_rate: 0.01,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay,
            bias_correction,
        };
        settings
    }

    /// Each pair of runs (host, burn) gave the same update, bit for bit, the
    /// same loss and the same number of steps.
    fn assert_same_runs<const N: usize>(
        runs: [((LocalUpdate, LocalUpdate), &str); N],
        settings: &TrainSettings,
    ) {
        for ((host, burn), model) in runs {
            let what = format!("{model}, {settings:?}");
            assert_eq!(host.tree, burn.tree, "{what}");
            assert_eq!(host.loss.to_bits(), burn.loss.to_bits(), "{what}");
            assert_eq!(host.local_steps, burn.local_steps, "{what}");
        }
    }

    /// One client of 50 samples (a partial last batch) trained by `plan`
    /// from the same seeded model with its parameters on the host, then
    /// through burn.
    fn host_and_burn<M: FederatedModel>(
        build: impl Fn(&Device) -> M,
        settings: &TrainSettings,
        plan: &LocalPlan,
    ) -> (LocalUpdate, LocalUpdate) {
        let data = dataset(false);
        let partition: Vec<u32> = (0..50).collect();
        let task = ClientTask {
            client_id: 2,
            round: 1,
        };
        let run = |host_runs: bool| {
            let mut trainer = LocalTrainer::new(&build, &crate::device::cpu(), settings.clone());
            trainer.host_runs = host_runs;
            let steps = trainer.host_steps(trainer.model.as_ref().unwrap());
            assert_eq!(steps.is_some(), host_runs, "SGD's steps on the host");
            let template = params::extract(trainer.model.as_ref().unwrap());
            let global = crate::init::seeded_parameters(&template, 4);
            trainer
                .train(task, &global, &data, &partition, plan)
                .unwrap()
        };
        (run(true), run(false))
    }

    fn bn_trainer(seed: u64) -> (LocalTrainer<CnnBn>, ParamTree) {
        let mut settings = sgd(None);
        settings.optimizer = OptimizerSpec::Sgd {
            learning_rate: 0.05,
            momentum: 0.0,
            weight_decay: 0.0,
            dampening: 0.0,
            nesterov: false,
        };
        settings.training_seed = Some(seed);
        let trainer = LocalTrainer::new(|d| CnnBn::new(10, d), &crate::device::cpu(), settings);
        let global =
            crate::init::seeded_parameters(&params::extract(trainer.model.as_ref().unwrap()), 5);
        (trainer, global)
    }

    fn bn_train(trainer: &mut LocalTrainer<CnnBn>, global: &ParamTree) -> ParamTree {
        let partition: Vec<u32> = (0..64).collect();
        let task = ClientTask {
            client_id: 3,
            round: 1,
        };
        trainer
            .train(
                task,
                global,
                &dataset(false),
                &partition,
                &LocalPlan::plain(0.05),
            )
            .unwrap()
            .tree
    }

    fn rows(logits: Tensor<2>) -> Vec<f32> {
        logits.into_data().try_to_vec::<f32>().unwrap()
    }

    fn leaf(tree: &ParamTree, path: &str) -> Vec<f32> {
        tree.leaves()
            .into_iter()
            .find(|(p, _)| p.to_string() == path)
            .unwrap_or_else(|| panic!("no leaf {path}"))
            .1
            .as_f32()
            .unwrap()
            .to_vec()
    }

    #[test]
    fn the_native_kernels_are_chosen_for_the_lenets_on_the_cpu_only() {
        let cpu = crate::device::cpu();
        let lenet = LocalTrainer::new(|d| LeNet5::new(10, d), &cpu, sgd(None));
        let compact =
            LocalTrainer::new(|d| crate::model::LeNet5Compact::new(10, d), &cpu, sgd(None));
        let bn = LocalTrainer::new(|d| CnnBn::new(10, d), &cpu, sgd(None));
        assert!(lenet.native.is_some() && compact.native.is_some());
        assert!(bn.native.is_none());
    }

    #[test]
    fn running_statistics_travel_in_the_tree_and_training_updates_them() {
        let (mut trainer, global) = bn_trainer(1);
        assert_eq!(leaf(&global, "bn1.running_mean"), vec![0.0; 16]);
        assert_eq!(leaf(&global, "bn1.running_var"), vec![1.0; 16]);
        // PyTorch's names: weight and bias, not burn's gamma and beta.
        assert_eq!(leaf(&global, "bn1.weight"), vec![1.0; 16]);
        assert_eq!(leaf(&global, "bn1.bias"), vec![0.0; 16]);
        let trained = bn_train(&mut trainer, &global);
        assert_ne!(leaf(&trained, "bn1.running_mean"), vec![0.0; 16]);
        assert_ne!(leaf(&trained, "bn2.running_var"), vec![1.0; 32]);
    }

    #[test]
    fn training_mode_uses_batch_statistics_and_dropout_evaluation_mode_neither() {
        let (trainer, global) = bn_trainer(1);
        let model = params::load(trainer.model.clone().unwrap(), &global).unwrap();
        let device = crate::device::cpu().autodiff();
        let data = dataset(false);
        let batch = |n: usize, device: &Device| {
            Inputs::from_host(data.inputs[..n * 784].to_vec(), &[1, 28, 28], device)
        };
        let none = || Randomness::none();
        // Training mode, dropout off: a sample's output depends on its batch.
        let small = rows(model.forward(batch(4, &device), &mut none()));
        let large = rows(model.forward(batch(8, &device), &mut none()));
        assert_ne!(small[..10], large[..10]);
        // Dropout masks come from the stream: same stream, same output.
        let mut rng_a = ChaCha8Rng::seed_from_u64(9);
        let mut rng_b = ChaCha8Rng::seed_from_u64(9);
        let mut rng_c = ChaCha8Rng::seed_from_u64(10);
        let a = rows(model.forward(batch(4, &device), &mut Randomness::from_stream(&mut rng_a)));
        let b = rows(model.forward(batch(4, &device), &mut Randomness::from_stream(&mut rng_b)));
        let c = rows(model.forward(batch(4, &device), &mut Randomness::from_stream(&mut rng_c)));
        assert_eq!(a, b);
        assert_ne!(a, c);
        // Evaluation mode: per-sample outputs, whatever the batch or the stream.
        let eval = model.valid();
        let plain = crate::device::cpu();
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let small = rows(eval.forward(batch(4, &plain), &mut Randomness::from_stream(&mut rng)));
        let large = rows(eval.forward(batch(8, &plain), &mut none()));
        for (x, y) in small.iter().zip(&large[..40]) {
            assert!((x - y).abs() <= 1e-5, "{x} vs {y}");
        }
    }

    /// `score_batches` of `model` on a pool of `threads`.
    fn score_on<M: FederatedModel>(model: &M, data: &Dataset, threads: usize) -> Score {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        // Moved in: a model is `Send`, not `Sync`.
        let model = model.clone();
        pool.install(move || score_batches(&model, &Classification, data, &all_of(data), 10))
            .unwrap()
    }

    fn all_of(data: &Dataset) -> Vec<u32> {
        (0..data.len() as u32).collect()
    }

    #[test]
    fn evaluation_spread_over_threads_is_the_sum_of_its_batches_in_order_on_any_pool() {
        let (trainer, global) = bn_trainer(1);
        let burn_path = params::load(trainer.model.clone().unwrap(), &global).unwrap();
        let native_path = LeNet5::new(10, &crate::device::cpu());
        let data = dataset(false);
        // 64 samples in batches of 10: six full batches and a last of four.
        let by_hand = |model: &dyn Fn(&[u32]) -> Score| {
            let mut total = Score::default();
            for batch in all_of(&data).chunks(10) {
                total.add(model(batch));
            }
            total
        };
        let burn_alone =
            by_hand(&|batch| score(&burn_path, &Classification, &data, batch, 10).unwrap());
        let native_alone =
            by_hand(&|batch| score(&native_path, &Classification, &data, batch, 10).unwrap());
        assert_eq!(burn_alone.rows, 64);
        assert!(burn_alone.loss_sum > 0.0 && native_alone.loss_sum > 0.0);
        for threads in [1, 3] {
            let burn = score_on(&burn_path, &data, threads);
            let native = score_on(&native_path, &data, threads);
            assert_eq!(
                burn.loss_sum.to_bits(),
                burn_alone.loss_sum.to_bits(),
                "{threads}"
            );
            assert_eq!((burn.correct, burn.rows), (burn_alone.correct, 64));
            assert_eq!(native.loss_sum.to_bits(), native_alone.loss_sum.to_bits());
            assert_eq!((native.correct, native.rows), (native_alone.correct, 64));
        }
        // A bad label in a later batch is named by its sample, not its place
        // in the batch.
        let mut bad = dataset(false);
        bad.labels[43] = 11;
        let error = score_batches(&burn_path, &Classification, &bad, &all_of(&bad), 10);
        assert_eq!(
            error.unwrap_err(),
            EvalError::LabelOutOfRange {
                index: 43,
                label: 11,
                classes: 10
            }
        );
    }

    #[test]
    fn evaluation_leaves_the_model_as_it_was_also_when_it_fails_halfway() {
        let (mut trainer, global) = bn_trainer(1);
        bn_train(&mut trainer, &global);
        let model = trainer.model.take().unwrap();
        let before = params::extract(&model.valid());
        let mut data = dataset(false);
        data.labels[40] = 12;
        let error = evaluate(&model, &data, 32).unwrap_err();
        assert_eq!(
            error,
            EvalError::LabelOutOfRange {
                index: 40,
                label: 12,
                classes: 10
            }
        );
        assert_eq!(
            error.to_string(),
            "test sample 40 has target 12, but the model has 10 classes"
        );
        assert_eq!(params::extract(&model.valid()), before);
        // Still in training mode: on the autodiff device, and a forward pass
        // still moves the running statistics.
        assert!(model.devices()[0].is_autodiff());
        let input = Inputs::from_host(
            data.inputs[..8 * 784].to_vec(),
            &[1, 28, 28],
            &model.devices()[0],
        );
        let _ = model.forward(input, &mut Randomness::none());
        assert_ne!(
            leaf(&params::extract(&model.valid()), "bn1.running_mean"),
            leaf(&before, "bn1.running_mean")
        );
        // A successful evaluation leaves it alone too.
        let before = params::extract(&model.valid());
        data.labels[40] = 1;
        let accuracy = evaluate(&model, &data, 32).unwrap();
        assert!((0.0..=1.0).contains(&accuracy));
        assert_eq!(params::extract(&model.valid()), before);
    }

    #[test]
    fn dropout_model_replays_bitwise_and_training_seeds_matter() {
        let (mut first, global) = bn_trainer(1);
        let (mut second, _) = bn_trainer(1);
        let (mut other, _) = bn_trainer(2);
        let a = bn_train(&mut first, &global);
        assert_eq!(a, bn_train(&mut second, &global));
        assert_ne!(a, bn_train(&mut other, &global));
    }
}
