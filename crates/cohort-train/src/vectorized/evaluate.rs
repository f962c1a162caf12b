//! The global model scored by the vectorized clients' own net: the test set
//! cut into batches of the training's batch size, K of them a pass, so that
//! evaluation runs the kernels training compiled, at the shapes training
//! runs them (`[K·B, values]`), the last pass padded.
//!
//! Why: on a GPU without the autotuner, the model's own forward pass at
//! `trainer.eval_batch_size` runs burn's convolution at shapes of its own,
//! compiled on first use. On a fresh H100 that was 3.36 s of a 12.44 s
//! first round, and 0.5 to 1.3 s of every later one, for 10,000
//! Fashion-MNIST images and LeNet-5 (`bench/gpu_cold.sh`, the build of
//! 6f40be0).

use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use cohort_core::data::Dataset;
use cohort_core::tree::ParamTree;

use super::net::StackedNet;
use super::{OnDevice, client_losses, stack};
use crate::model::{Accelerated, Stackable};
use crate::task::{Evaluation, Score};
use crate::trainer::{EvalError, ModelEvaluator, Predictions, sum_in_order};

/// Scores batches of `batch` samples, `clients` of them a pass, with the
/// stacked net; the model's own evaluator gives its initial parameters and
/// per-sample predictions.
pub struct StackedEvaluator {
    plain: Box<dyn ModelEvaluator>,
    model: Stackable,
    classes: usize,
    device: Device,
    batch: usize,
    clients: usize,
    /// The stacked net and the test images on the device.
    held: OnDevice,
}

impl StackedEvaluator {
    /// An evaluator of the stackable `accelerated` model in batches of
    /// `batch` samples, `clients` batches a pass, on `device`; `plain` is
    /// the model's own evaluator.
    pub fn new(
        plain: Box<dyn ModelEvaluator>,
        accelerated: Accelerated,
        device: &Device,
        batch: usize,
        clients: usize,
    ) -> Self {
        Self {
            plain,
            model: accelerated.net,
            classes: accelerated.classes,
            device: device.clone(),
            batch: batch.max(1),
            clients: clients.max(1),
            held: OnDevice::default(),
        }
    }

    /// `tree`'s parameters on the device, the same for each of the pass's
    /// `clients` slots.
    fn params(&self, net: &StackedNet, tree: &ParamTree) -> Result<Vec<Tensor<3>>, EvalError> {
        let stacked =
            stack(net, std::iter::once(tree)).map_err(|(_, error)| EvalError::Load(error))?;
        Ok(net
            .params()
            .iter()
            .zip(stacked.values)
            .map(|(p, values)| {
                let one = TensorData::new(values, [1, p.rows, p.cols]);
                Tensor::<3>::from_data(one, &self.device).repeat_dim(0, self.clients)
            })
            .collect())
    }

    /// The loss sums and correct rows (`[clients, 1, 1]` each, on the
    /// device) of the batches `first..first + clients` of `data`, in one
    /// pass of the stacked net; slots past the last batch score nothing.
    fn pass(
        &self,
        net: &StackedNet,
        params: &[Tensor<3>],
        data: &Dataset,
        first: usize,
    ) -> (Tensor<3>, Tensor<3>) {
        let (k, batch, classes) = (self.clients, self.batch, net.classes());
        let samples = data.labels.len();
        // Padded rows read the zero row past the last sample, weigh nothing
        // and have no label a prediction can equal.
        let mut rows = vec![samples as i64; k * batch];
        let mut targets = vec![-1.0f32; k * batch];
        let mut weights = vec![0.0f32; k * batch * classes];
        for slot in 0..k {
            let start = ((first + slot) * batch).min(samples);
            let end = (start + batch).min(samples);
            for (row, index) in (start..end).enumerate() {
                let at = slot * batch + row;
                let label = data.labels[index] as usize;
                rows[at] = index as i64;
                targets[at] = label as f32;
                weights[at * classes + label] = 1.0;
            }
        }
        let device = &self.device;
        let rows = Tensor::<1, Int>::from_data(TensorData::new(rows, [k * batch]), device);
        let images = self.held.images().clone().select(0, rows);
        let (logits, _) = net.forward_train(params, images, k);
        let weights = Tensor::<3>::from_data(TensorData::new(weights, [k, batch, classes]), device);
        let targets = Tensor::<3>::from_data(TensorData::new(targets, [k, batch, 1]), device);
        // Weights of 1 (not training's 1/n): each batch's loss summed, as
        // a `Score` holds it.
        let losses = client_losses(log_softmax(logits.clone(), 2), weights);
        // A batch has at most `batch` correct rows: exact in f32.
        let correct = logits.argmax(2).float().equal(targets).float().sum_dim(1);
        (losses, correct)
    }
}

/// `tensors` joined along their first dimension and read back to the host
/// at once: one wait for the device for a whole test set, not one a pass.
fn joined_on_host(tensors: Vec<Tensor<3>>) -> Vec<f32> {
    Tensor::cat(tensors, 0)
        .into_data()
        .try_to_vec::<f32>()
        .expect("float32 scores convert to f32")
}

impl ModelEvaluator for StackedEvaluator {
    fn parameters(&self) -> ParamTree {
        self.plain.parameters()
    }

    fn evaluate(&mut self, tree: &ParamTree, data: &Dataset) -> Result<Evaluation, EvalError> {
        Ok(sum_in_order(self.batch_scores(tree, data)?).finish())
    }

    fn evaluation_batch(&self) -> Option<usize> {
        Some(self.batch)
    }

    fn batch_scores(&mut self, tree: &ParamTree, data: &Dataset) -> Result<Vec<Score>, EvalError> {
        // The tree first, as the model's own evaluator loads it first.
        self.held
            .build_net(&self.model, self.classes, data, &self.device);
        let params = self.params(self.held.net(), tree)?;
        if let Some(index) = data.labels.iter().position(|&l| l as usize >= self.classes) {
            return Err(EvalError::LabelOutOfRange {
                index,
                label: data.labels[index],
                classes: self.classes,
            });
        }
        let samples = data.labels.len();
        if samples == 0 {
            return Ok(Vec::new());
        }
        self.held.upload(data, &self.device);
        let batches = samples.div_ceil(self.batch);
        let (losses, correct): (Vec<_>, Vec<_>) = (0..batches)
            .step_by(self.clients)
            .map(|first| self.pass(self.held.net(), &params, data, first))
            .unzip();
        let (losses, correct) = (joined_on_host(losses), joined_on_host(correct));
        Ok((0..batches)
            .map(|index| Score {
                loss_sum: f64::from(losses[index]),
                correct: correct[index] as u64,
                rows: (samples - index * self.batch).min(self.batch) as u64,
            })
            .collect())
    }

    fn predictions(
        &mut self,
        tree: &ParamTree,
        data: &Dataset,
        indices: &[u32],
    ) -> Result<Predictions, EvalError> {
        self.plain.predictions(tree, data, indices)
    }
}
