//! One logical client's side of a round, the same in process and over the
//! network: unpack the global model through `clients.inbound_processors`, train
//! on the client's partition, pack the update through
//! `clients.outbound_processors`.

use std::path::Path;
use std::time::Instant;

use anyhow::Context;

use cohort_core::codec::{self, DecodeLimits};
use cohort_core::config::LoadedConfig;
use cohort_core::data::{self, Dataset, Fetch, Splits};
use cohort_core::processors::{Pipeline, ProcessError};
use cohort_train::device::Selected;
use cohort_train::local::LocalPlan;
use cohort_train::trainer::{ClientTask, LocalTrainer, TrainError, TrainSettings};

use crate::transport::TaskInstructions;

/// What a client sends back for one task.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientReply {
    pub num_samples: u64,
    pub loss: f64,
    pub training_time: f64,
    /// Seconds in the client's processors (unpacking the model, packing the update).
    pub processing_time: f64,
    /// Local optimizer steps taken.
    pub local_steps: u64,
    /// Held-out samples the client evaluated the global model on
    /// (`clients.do_test`), and how many it got right; 0 and 0 without.
    pub test_samples: u64,
    pub test_correct: u64,
    /// The update, as it goes on the wire.
    pub payload: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ClientError {
    #[error("cannot unpack the global model: {0}")]
    GlobalPayload(#[source] ProcessError),
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error("cannot pack the update: {0}")]
    UpdatePayload(#[source] ProcessError),
    #[error("cannot evaluate the global model on the held-out data: {0}")]
    Evaluation(#[source] cohort_train::trainer::EvalError),
    #[error("cannot unpack the strategy's gradient correction: {0}")]
    Correction(#[source] cohort_core::codec::CodecError),
}

/// The training settings of a config, shared by the server's in-process
/// workers and by client processes.
pub fn train_settings(loaded: &LoadedConfig) -> TrainSettings {
    let trainer = &loaded.config.trainer;
    TrainSettings {
        epochs: trainer.epochs,
        batch_size: trainer.batch_size,
        optimizer: loaded.optimizer.clone(),
        clip_grad_norm: trainer.clip_grad_norm,
        training_seed: trainer.training_seed,
    }
}

/// Every client's indices into the training set (client `c` at index `c − 1`).
#[derive(Debug, Clone, Default)]
pub struct ClientPartitions {
    /// What each client trains on.
    pub train: Vec<Vec<u32>>,
    /// What each client holds out to evaluate the global model it receives
    /// (`clients.do_test`); empty lists otherwise.
    pub test: Vec<Vec<u32>>,
}

/// The config's data set (from `data_root`, else `data.data_path`; downloaded
/// when the config allows) and every client's partition of its training set.
/// The server and each client process call this, so they agree on partitions.
///
/// When every client brings its own data (`Clients::all_own_data`), only the
/// test split is read: the training set is empty (no images, the test set's
/// image size) and every partition is an empty list, so a server needs no
/// training files.
pub fn load_data(
    loaded: &LoadedConfig,
    data_root: Option<&Path>,
) -> anyhow::Result<(Splits, ClientPartitions)> {
    let config = &loaded.config;
    let source = config.data.datasource;
    let data_root = data_root.unwrap_or(&config.data.data_path);
    let fetch = if config.data.download {
        Fetch::FromMirrors(config.data.mirrors.clone().unwrap_or_default())
    } else {
        Fetch::Never
    };
    let loading = Instant::now();
    if config.clients.all_own_data() {
        let test = data::load_test(source, data_root, &fetch)?;
        tracing::info!(
            test = test.len(),
            seconds = loading.elapsed().as_secs_f64(),
            "loaded the test set of {:?} from {} (every client brings its own training data)",
            source,
            data_root.display()
        );
        let train = Dataset {
            images: Vec::new(),
            labels: Vec::new(),
            rows: test.rows,
            cols: test.cols,
        };
        let none = vec![Vec::new(); config.clients.total_clients as usize];
        let partitions = ClientPartitions {
            train: none.clone(),
            test: none,
        };
        return Ok((Splits { train, test }, partitions));
    }
    let splits = data::load(source, data_root, &fetch)?;
    tracing::info!(
        train = splits.train.len(),
        test = splits.test.len(),
        seconds = loading.elapsed().as_secs_f64(),
        "loaded {:?} from {}",
        source,
        data_root.display()
    );
    let partitions = loaded.partitions(&splits.train.labels).context(
        "config `data.sampler` and its options / `clients.total_clients` do not fit the training set",
    )?;
    let clients = &config.clients;
    let partitions = if clients.do_test {
        let (train, test) = partitions
            .iter()
            .enumerate()
            .map(|(index, part)| {
                cohort_core::partition::holdout(
                    part,
                    clients.test_fraction,
                    config.data.random_seed,
                    index as u32 + 1,
                )
            })
            .unzip();
        ClientPartitions { train, test }
    } else {
        ClientPartitions {
            test: vec![Vec::new(); partitions.len()],
            train: partitions,
        }
    };
    Ok((splits, partitions))
}

/// A physical worker: one model instance reused for every logical client it runs.
pub struct ClientRunner {
    trainer: LocalTrainer,
    inbound: Pipeline,
    outbound: Pipeline,
    limits: DecodeLimits,
}

impl ClientRunner {
    pub fn new(loaded: &LoadedConfig, device: &Selected) -> Self {
        let pipelines = loaded.pipelines();
        Self {
            trainer: LocalTrainer::new(
                loaded.config.trainer.model_name,
                loaded.config.parameters.model.num_classes,
                &device.device,
                train_settings(loaded),
            ),
            inbound: pipelines.client_inbound,
            outbound: pipelines.client_outbound,
            limits: loaded.decode_limits(),
        }
    }

    /// Runs one task: evaluates the global model on `held_out` (when not
    /// empty), then trains on `partition`.
    pub fn run(
        &mut self,
        task: ClientTask,
        instructions: &TaskInstructions,
        global_payload: &[u8],
        data: &Dataset,
        partition: &[u32],
        held_out: &[u32],
    ) -> Result<ClientReply, ClientError> {
        let unpacking = Instant::now();
        let global = self
            .inbound
            .receive(global_payload, &self.limits)
            .map_err(ClientError::GlobalPayload)?;
        let plan = LocalPlan {
            learning_rate: instructions.learning_rate,
            proximal_mu: instructions.proximal_mu,
            update_clip_norm: instructions.update_clip_norm,
            gradient_correction: instructions
                .correction
                .as_deref()
                .map(|bytes| codec::decode(bytes, &self.limits))
                .transpose()
                .map_err(ClientError::Correction)?,
        };
        let mut processing_time = unpacking.elapsed().as_secs_f64();
        let test_correct = if held_out.is_empty() {
            0
        } else {
            self.trainer
                .count_correct(&global, data, held_out)
                .map_err(ClientError::Evaluation)?
        };
        let update = self.trainer.train(task, &global, data, partition, &plan)?;
        let packing = Instant::now();
        let payload = self
            .outbound
            .send(&update.tree)
            .map_err(ClientError::UpdatePayload)?;
        processing_time += packing.elapsed().as_secs_f64();
        Ok(ClientReply {
            num_samples: update.num_samples,
            loss: update.loss,
            training_time: update.training_time,
            processing_time,
            local_steps: update.local_steps,
            test_samples: held_out.len() as u64,
            test_correct,
            payload,
        })
    }
}
