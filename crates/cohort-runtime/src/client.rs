//! One logical client's side of a round, the same in process and over the
//! network: unpack the global model through `clients.inbound_processors`, train
//! on the client's partition, pack the update through
//! `clients.outbound_processors`.

use std::path::Path;
use std::sync::{Arc, Weak};
use std::time::Instant;

use anyhow::Context;

use cohort_core::codec::{self, DecodeLimits};
use cohort_core::config::LoadedConfig;
use cohort_core::data::{Dataset, Fetch, Splits};
use cohort_core::processors::{Pipeline, ProcessError};
use cohort_core::tree::ParamTree;
use cohort_train::device::Selected;
use cohort_train::local::LocalPlan;
use cohort_train::registry::{DataRequest, Registry, RunModel};
use cohort_train::task::Score;
use cohort_train::trainer::{ClientTask, ClientTrainer, LocalUpdate, TrainError, TrainSettings};
use cohort_train::vectorized::{Job, VectorizedTrainer};

use crate::transport::{LocalLoss, TaskInstructions};

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
    /// The update, as it goes on the wire. `Bytes`, so that the network
    /// server keeps a received update as the slice tonic decoded it into,
    /// and a client process sends it in slices, neither copying it.
    pub payload: bytes::Bytes,
    /// The tree `payload` was packed from, where the client ran in the
    /// server's own process (never on the wire): a server whose inbound
    /// pipeline gives back exactly the tree packed takes it instead of
    /// unpacking the payload
    /// ([`Pipeline::receive_own`](cohort_core::processors::Pipeline::receive_own)).
    pub packed_from: Option<ParamTree>,
    /// The payload's length where it was not written (`payload` empty): a
    /// client that hands `packed_from` to a server in its own process, whose
    /// pipelines are the codec alone, counts the bytes without writing
    /// them ([`ClientRunner::hand_over_updates`]).
    pub unwritten_len: Option<u64>,
}

impl ClientReply {
    /// The update's bytes on the wire, written or not: what the traffic
    /// counts and the simulated links carry.
    pub fn payload_bytes(&self) -> u64 {
        self.unwritten_len.unwrap_or(self.payload.len() as u64)
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ClientError {
    #[error("cannot unpack the global model: {0}")]
    GlobalPayload(#[source] ProcessError),
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error("cannot pack the update: {0}")]
    UpdatePayload(#[source] ProcessError),
    #[error("cannot evaluate the global model on the client's data: {0}")]
    Evaluation(#[source] cohort_train::trainer::EvalError),
    #[error("cannot unpack the strategy's gradient correction: {0}")]
    Correction(#[source] cohort_core::codec::CodecError),
    /// The task's numbers are not ones to train by; nothing was trained.
    #[error("refused to train: {0}")]
    Instructions(String),
}

/// The training settings of a config, shared by the server's in-process
/// workers and by client processes.
pub fn train_settings(loaded: &LoadedConfig) -> TrainSettings {
    let trainer = &loaded.config().trainer;
    TrainSettings {
        epochs: trainer.epochs,
        batch_size: trainer.batch_size,
        optimizer: loaded.optimizer().clone(),
        clip_grad_norm: trainer.clip_grad_norm,
        training_seed: trainer.training_seed,
        augmentation: None,
    }
}

/// Every client's indices into the training set (client `c` at index `c − 1`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
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
/// test split is read: the training set is empty (no samples, the test set's
/// sample shape) and every partition is an empty list, so a server needs no
/// training files.
pub fn load_data(
    loaded: &LoadedConfig,
    registry: &Registry,
    data_root: Option<&Path>,
) -> anyhow::Result<(Splits, ClientPartitions)> {
    let data = load_data_for(loaded, registry, data_root, None)?;
    Ok((data.splits, data.partitions))
}

/// The training data a process holds when it trains only some clients: the
/// samples of their partitions.
#[derive(Debug, Clone)]
pub struct HeldRows {
    /// The training samples the split holds, ascending: its row `i` is
    /// training sample `rows[i]`.
    pub rows: Vec<u32>,
    /// Every training sample's label, for what the server knows of every
    /// client (label histograms).
    pub labels: Vec<u32>,
}

/// [`load_data_for`]'s data.
#[derive(Debug, Clone)]
pub struct LoadedData {
    /// Both splits; the training split holds only [`LoadedData::held`]'s rows
    /// when there are any.
    pub splits: Splits,
    /// Every client's partitions, as training-sample numbers of the whole
    /// training set.
    pub partitions: ClientPartitions,
    pub held: Option<HeldRows>,
}

impl LoadedData {
    /// Every training sample's label.
    pub fn train_labels(&self) -> &[u32] {
        self.held
            .as_ref()
            .map_or(&self.splits.train.labels, |held| &held.labels)
    }

    /// The training set's size, counting the samples not held.
    pub fn train_samples(&self) -> usize {
        self.train_labels().len()
    }

    /// The training split as held, the test split, and partitions that
    /// index the training split as held: a client whose samples are not held
    /// has empty partitions (it is trained elsewhere).
    pub fn into_local(self) -> (Dataset, Dataset, ClientPartitions) {
        let Splits { train, test, .. } = self.splits;
        let Some(held) = self.held else {
            return (train, test, self.partitions);
        };
        let local = |parts: Vec<Vec<u32>>| -> Vec<Vec<u32>> {
            parts
                .into_iter()
                .map(|part| {
                    let positions: Option<Vec<u32>> = part
                        .iter()
                        .map(|sample| held.rows.binary_search(sample).ok().map(|i| i as u32))
                        .collect();
                    positions.unwrap_or_default()
                })
                .collect()
        };
        let partitions = ClientPartitions {
            train: local(self.partitions.train),
            test: local(self.partitions.test),
        };
        (train, test, partitions)
    }
}

/// [`load_data`]; with `clients` (a range of client ids), only the training
/// samples of their partitions are read into memory: the partitions are
/// computed from the labels before the images are converted.
pub fn load_data_for(
    loaded: &LoadedConfig,
    registry: &Registry,
    data_root: Option<&Path>,
    clients: Option<std::ops::RangeInclusive<u32>>,
) -> anyhow::Result<LoadedData> {
    let config = &loaded.config();
    let source = &config.data.datasource;
    let test_only = config.clients.all_own_data();
    // What the chooser learns from the labels (or why it could not choose),
    // for after the load.
    type Chosen = anyhow::Result<(ClientPartitions, HeldRows)>;
    let chosen: std::sync::Arc<std::sync::Mutex<Option<Chosen>>> = Default::default();
    let train_rows = clients.filter(|_| !test_only).map(|clients| {
        let (loaded, chosen) = (loaded.clone(), chosen.clone());
        cohort_train::registry::TrainRows::new(move |labels, users| {
            let choice = partitions_of(&loaded, labels, users).map(|partitions| {
                let rows = rows_of(&partitions, &clients);
                let labels = labels.to_vec();
                (partitions, HeldRows { rows, labels })
            });
            let answer = match &choice {
                Ok((_, held)) => Ok(held.rows.clone()),
                Err(error) => Err(format!("{error:#}")),
            };
            *chosen.lock().unwrap_or_else(|e| e.into_inner()) = Some(choice);
            answer
        })
    });
    let request = DataRequest {
        root: data_root.unwrap_or(&config.data.data_path).to_path_buf(),
        fetch: if config.data.download {
            Fetch::FromMirrors(config.data.mirrors.clone().unwrap_or_default())
        } else {
            Fetch::Never
        },
        test_only,
        train_rows,
    };
    let loading = Instant::now();
    let loaded_splits = registry.load_data(loaded, &request);
    let chosen = chosen.lock().unwrap_or_else(|e| e.into_inner()).take();
    // The partitioner's own error, with its context, rather than the
    // loader's wrapping of its text.
    let chosen = chosen.transpose()?;
    let splits = loaded_splits.map_err(anyhow::Error::from_boxed)?;
    if request.test_only {
        tracing::info!(
            test = splits.test.len(),
            seconds = loading.elapsed().as_secs_f64(),
            "loaded the test set of {source} from {} (every client brings its own training data)",
            request.root.display()
        );
        let none = vec![Vec::new(); config.clients.total_clients as usize];
        let partitions = ClientPartitions {
            train: none.clone(),
            test: none,
        };
        let train = Dataset {
            inputs: Vec::new(),
            labels: Vec::new(),
            sample_shape: splits.test.sample_shape.clone(),
        };
        let splits = Splits {
            train,
            test: splits.test,
            train_users: None,
        };
        return Ok(LoadedData {
            splits,
            partitions,
            held: None,
        });
    }
    let data = match chosen {
        Some((partitions, held)) => LoadedData {
            splits,
            partitions,
            held: Some(held),
        },
        None => {
            let users = splits.train_users.as_deref();
            let partitions = partitions_of(loaded, &splits.train.labels, users)?;
            LoadedData {
                splits,
                partitions,
                held: None,
            }
        }
    };
    tracing::info!(
        train = data.train_samples(),
        held = data.splits.train.len(),
        test = data.splits.test.len(),
        seconds = loading.elapsed().as_secs_f64(),
        "loaded {source} from {}",
        request.root.display()
    );
    Ok(data)
}

/// Every client's partitions of a training set with these labels (and users).
fn partitions_of(
    loaded: &LoadedConfig,
    labels: &[u32],
    users: Option<&[u32]>,
) -> anyhow::Result<ClientPartitions> {
    let config = loaded.config();
    let partitions = loaded.partitions(labels, users).context(
        "config `data.sampler` and its options / `clients.total_clients` do not fit the training set",
    )?;
    let clients = &config.clients;
    Ok(if clients.do_test {
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
    })
}

/// The training samples that `clients`' partitions use, ascending.
fn rows_of(partitions: &ClientPartitions, clients: &std::ops::RangeInclusive<u32>) -> Vec<u32> {
    let mut rows: Vec<u32> = clients
        .clone()
        .filter_map(|id| (id as usize).checked_sub(1))
        .filter_map(|index| partitions.train.get(index).zip(partitions.test.get(index)))
        .flat_map(|(train, test)| train.iter().chain(test).copied())
        .collect();
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// The trainer's plan for a task, from its instructions as they arrived:
/// refused before anything is unpacked or trained when the numbers are not
/// ones to train by ([`TaskInstructions::check`]).
fn local_plan(
    instructions: &TaskInstructions,
    limits: &DecodeLimits,
) -> Result<LocalPlan, ClientError> {
    instructions.check().map_err(ClientError::Instructions)?;
    Ok(LocalPlan {
        learning_rate: instructions.learning_rate,
        proximal_mu: instructions.proximal_mu,
        update_clip_norm: instructions.update_clip_norm,
        gradient_correction: instructions
            .correction
            .as_deref()
            .map(|bytes| codec::decode(bytes, limits))
            .transpose()
            .map_err(ClientError::Correction)?,
    })
}

/// A physical worker: one model instance reused for every logical client it runs.
pub struct ClientRunner {
    trainer: Box<dyn ClientTrainer>,
    inbound: Pipeline,
    outbound: Pipeline,
    limits: DecodeLimits,
    last_global: LastGlobal,
    /// [`ClientRunner::hand_over_updates`].
    hand_over: bool,
}

/// The global model a worker unpacked last, and which shared payload it came
/// from: a round's tasks on one worker share one payload, so
/// [`ClientRunner::run_shared`] unpacks it once a round, not once a client
/// (the inbound processors are functions of the bytes alone). The payload is
/// named by its allocation, held weakly: nothing is compared, and while the
/// `Weak` lives no other payload can take that address.
#[derive(Default)]
struct LastGlobal {
    payload: Weak<Vec<u8>>,
    tree: Option<ParamTree>,
}

impl ClientRunner {
    /// A worker of `model` on `device`, its settings from the config.
    pub fn new(loaded: &LoadedConfig, model: &RunModel, device: &Selected) -> anyhow::Result<Self> {
        let pipelines = loaded.pipelines();
        let trainer = model
            .trainer(&device.device, train_settings(loaded))
            .with_context(|| format!("model `{}`", model.name()))?;
        Ok(Self {
            trainer,
            inbound: pipelines.client_inbound,
            outbound: pipelines.client_outbound,
            limits: loaded.decode_limits(),
            last_global: LastGlobal::default(),
            hand_over: false,
        })
    }

    /// Replies carry their update as the tree alone, its payload counted but
    /// not written, where the outbound pipeline is the codec alone: for a
    /// server in the same process whose inbound pipeline is the codec alone
    /// too, and that needs no bytes (no ranks, no secure aggregation), which
    /// takes the tree as decoding would give it back
    /// (`Pipeline::receive_own`). Writing 248 KB a client only to count it
    /// was most of a simulated client's processing time.
    pub fn hand_over_updates(&mut self) {
        self.hand_over = self.outbound.is_codec_alone();
    }

    /// Runs one task: evaluates the global model on `held_out` (when not
    /// empty), then trains on `partition`.
    pub fn run(
        &mut self,
        task: &BatchTask<'_>,
        global_payload: &[u8],
        data: &Dataset,
    ) -> Result<ClientReply, ClientError> {
        let unpacking = Instant::now();
        let plan = self.plan(task.instructions)?;
        let global = self.unpack(global_payload)?;
        let processing_time = unpacking.elapsed().as_secs_f64();
        self.train_from(task, &plan, &global, data, processing_time)
    }

    /// [`ClientRunner::run`] from a payload that the round's other tasks
    /// share: unpacked only when it is not the one this worker unpacked last.
    pub fn run_shared(
        &mut self,
        task: &BatchTask<'_>,
        global_payload: &Arc<Vec<u8>>,
        data: &Dataset,
    ) -> Result<ClientReply, ClientError> {
        let unpacking = Instant::now();
        let plan = self.plan(task.instructions)?;
        let last = std::mem::take(&mut self.last_global);
        let global = match last.tree {
            Some(tree) if Weak::ptr_eq(&last.payload, &Arc::downgrade(global_payload)) => tree,
            stale => {
                // The last round's model goes before this one is unpacked.
                drop(stale);
                self.unpack(global_payload)?
            }
        };
        let processing_time = unpacking.elapsed().as_secs_f64();
        let reply = self.train_from(task, &plan, &global, data, processing_time);
        self.last_global = LastGlobal {
            payload: Arc::downgrade(global_payload),
            tree: Some(global),
        };
        reply
    }

    fn train_from(
        &mut self,
        task: &BatchTask<'_>,
        plan: &LocalPlan,
        global: &ParamTree,
        data: &Dataset,
        processing_time: f64,
    ) -> Result<ClientReply, ClientError> {
        let test = self.held_out(global, data, task.held_out)?;
        let update = self
            .trainer
            .train(task.task, global, data, task.partition, plan)?;
        self.reply(update, processing_time, test)
    }

    /// The loss of the global model in `global_payload` on `partition`,
    /// nothing trained: power-of-choice's evaluation of a candidate. The
    /// model is unpacked as a task's is, so the loss is of the model the
    /// client would train from.
    pub fn local_loss(
        &mut self,
        global_payload: &[u8],
        data: &Dataset,
        partition: &[u32],
    ) -> Result<LocalLoss, ClientError> {
        let global = self.unpack(global_payload)?;
        let score = self
            .trainer
            .score(&global, data, partition)
            .map_err(ClientError::Evaluation)?;
        Ok(LocalLoss {
            rows: score.rows,
            loss: score.loss_sum / score.rows.max(1) as f64,
        })
    }

    fn unpack(&self, global_payload: &[u8]) -> Result<ParamTree, ClientError> {
        self.inbound
            .receive(global_payload, &self.limits)
            .map_err(ClientError::GlobalPayload)
    }

    fn plan(&self, instructions: &TaskInstructions) -> Result<LocalPlan, ClientError> {
        local_plan(instructions, &self.limits)
    }

    /// The task's score of `global` on `held_out` (nothing when empty).
    fn held_out(
        &mut self,
        global: &ParamTree,
        data: &Dataset,
        held_out: &[u32],
    ) -> Result<Score, ClientError> {
        if held_out.is_empty() {
            return Ok(Score::default());
        }
        self.trainer
            .score(global, data, held_out)
            .map_err(ClientError::Evaluation)
    }

    /// Packs `update` as the reply; `processing_time` is what unpacking took,
    /// `test` the score on the held-out data (its rows are the samples of a
    /// classification task).
    fn reply(
        &self,
        update: LocalUpdate,
        processing_time: f64,
        test: Score,
    ) -> Result<ClientReply, ClientError> {
        let packing = Instant::now();
        // Handed over unwritten only where the pipeline is the codec alone
        // (`sent_len` is `Some`); any other pipeline packs the bytes.
        let handed_over = match self.hand_over {
            true => self.outbound.sent_len(&update.tree),
            false => None,
        };
        let (payload, unwritten_len) = match handed_over {
            Some(len) => {
                let len = len.map_err(ClientError::UpdatePayload)?;
                (Vec::new(), Some(len as u64))
            }
            None => {
                let payload = self.outbound.send(&update.tree);
                (payload.map_err(ClientError::UpdatePayload)?, None)
            }
        };
        Ok(ClientReply {
            num_samples: update.num_samples,
            loss: update.loss,
            training_time: update.training_time,
            processing_time: processing_time + packing.elapsed().as_secs_f64(),
            local_steps: update.local_steps,
            test_samples: test.rows,
            test_correct: test.correct,
            payload: payload.into(),
            packed_from: Some(update.tree),
            unwritten_len,
        })
    }
}

/// One task: the client, its instructions, its data (alone, or one of a
/// vectorized batch).
pub struct BatchTask<'a> {
    pub task: ClientTask,
    pub instructions: &'a TaskInstructions,
    pub partition: &'a [u32],
    pub held_out: &'a [u32],
}

/// A physical worker that trains up to K clients at once
/// (`trainer.vectorized_clients`); clients whose plan it cannot stack
/// (gradient terms) train alone on the same device, one after the other.
pub struct BatchRunner {
    single: ClientRunner,
    vectorized: VectorizedTrainer,
}

impl BatchRunner {
    /// See [`ClientRunner::hand_over_updates`].
    pub fn hand_over_updates(&mut self) {
        self.single.hand_over_updates();
    }

    pub fn new(loaded: &LoadedConfig, model: &RunModel, device: &Selected) -> anyhow::Result<Self> {
        // The data set's crops and flips, as `RunModel::trainer` gives a
        // client trained alone.
        let settings = TrainSettings {
            augmentation: model.augmentation.clone(),
            ..train_settings(loaded)
        };
        let vectorized =
            VectorizedTrainer::new(model.name(), model.accelerated()?, &device.device, settings)?;
        Ok(Self {
            single: ClientRunner::new(loaded, model, device)?,
            vectorized,
        })
    }

    /// See [`ClientRunner::local_loss`]: one client at a time, as the pass
    /// is one forward over each candidate's data.
    pub fn local_loss(
        &mut self,
        global_payload: &[u8],
        data: &Dataset,
        partition: &[u32],
    ) -> Result<LocalLoss, ClientError> {
        self.single.local_loss(global_payload, data, partition)
    }

    /// Runs `tasks` from one global model; one reply per task, in order.
    pub fn run(
        &mut self,
        tasks: &[BatchTask<'_>],
        global_payload: &[u8],
        data: &Dataset,
    ) -> Vec<Result<ClientReply, ClientError>> {
        let unpacking = Instant::now();
        let global = match self.single.unpack(global_payload) {
            Ok(global) => global,
            Err(error) => return tasks.iter().map(|_| Err(error.clone())).collect(),
        };
        let unpack_time = unpacking.elapsed().as_secs_f64() / tasks.len().max(1) as f64;
        let mut results: Vec<Option<Result<ClientReply, ClientError>>> =
            tasks.iter().map(|_| None).collect();
        let mut prepared = Vec::new();
        for (slot, task) in tasks.iter().enumerate() {
            let checked = self.single.plan(task.instructions).and_then(|plan| {
                let correct = self.single.held_out(&global, data, task.held_out)?;
                Ok((plan, correct))
            });
            match checked {
                Ok((plan, correct)) if VectorizedTrainer::supports(&plan) => {
                    prepared.push((slot, plan, correct))
                }
                Ok((plan, correct)) => {
                    let reply = self
                        .single
                        .trainer
                        .train(task.task, &global, data, task.partition, &plan)
                        .map_err(ClientError::from)
                        .and_then(|u| self.single.reply(u, unpack_time, correct));
                    results[slot] = Some(reply);
                }
                Err(error) => results[slot] = Some(Err(error)),
            }
        }
        let jobs: Vec<Job<'_>> = prepared
            .iter()
            .map(|(slot, plan, _)| Job {
                task: tasks[*slot].task,
                global: &global,
                partition: tasks[*slot].partition,
                plan,
            })
            .collect();
        let trained = self.vectorized.train(&jobs, data);
        for ((slot, _, correct), update) in prepared.iter().zip(trained) {
            results[*slot] = Some(
                update
                    .map_err(ClientError::from)
                    .and_then(|u| self.single.reply(u, unpack_time, *correct)),
            );
        }
        results
            .into_iter()
            .map(|r| r.expect("every task has a result"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_with_a_nan_or_negative_number_becomes_no_plan() {
        let limits = DecodeLimits::default();
        let plan = local_plan(&TaskInstructions::plain(0.05), &limits).unwrap();
        assert_eq!(plan.learning_rate, 0.05);
        let refused = |instructions: TaskInstructions| {
            local_plan(&instructions, &limits).unwrap_err().to_string()
        };
        assert_eq!(
            refused(TaskInstructions::plain(f64::NAN)),
            "refused to train: the task's `learning_rate` is NaN; expected a finite number >= 0"
        );
        let negative_mu = TaskInstructions {
            proximal_mu: -0.5,
            ..TaskInstructions::plain(0.05)
        };
        assert!(refused(negative_mu).contains("`proximal_mu` is -0.5"));
        let nan_clip = TaskInstructions {
            update_clip_norm: Some(f64::NAN),
            ..TaskInstructions::plain(0.05)
        };
        assert!(refused(nan_clip).contains("`update_clip_norm` is NaN"));
    }
}
