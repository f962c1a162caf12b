//! Federated strategies: what each selected client is asked to do in a round,
//! and how the round's updates become the next global model.
//!
//! A [`Strategy`] is plain Rust over host trees: no tensors, no I/O. The round
//! loop (`cohort-runtime`) asks it for each selected client's
//! [`ClientInstructions`] (learning rate, proximal coefficient, gradient
//! correction, update clipping), hands the updates that arrived, in selection
//! order and after the server hooks, to [`Strategy::aggregate`], and saves
//! [`Strategy::state`] with every checkpoint so `--resume` continues
//! bit-identically.
//!
//! The math of each strategy is a set of pure functions in its own file; the
//! strategy objects around them are thin. Which strategy a run uses is the
//! `[algorithm]` section of the config ([`AlgorithmConfig`]).
//!
//! | `type` | file | paper |
//! |---|---|---|
//! | `fedavg` | [`fedavg`](mod@fedavg) | McMahan et al. 2017 |
//! | `fedavgm` | [`fedavgm`](mod@fedavgm) | Hsu et al. 2019 |
//! | `fedadam`, `fedyogi`, `fedadagrad` | [`fedopt`] | Reddi et al. 2021 |
//! | `fedprox` | [`fedprox`] | Li et al. 2020 |
//! | `scaffold` | [`scaffold`] | Karimireddy et al. 2020 |
//! | `median`, `trimmed_mean`, `krum`, `multi_krum` | [`robust`] | Yin et al. 2018, Blanchard et al. 2017 |
//! | `dp_fedavg` | [`dp`] | McMahan et al. 2018 |
//! | `fedasync` | [`fedasync`] | Xie et al. 2019 |
//! | `fedbuff` | [`fedbuff`] | Nguyen et al. 2022 |
//!
//! Asynchronous runs hand [`Strategy::aggregate_stale`] updates trained from
//! older models ([`stale`]); the strategies that refuse them say why in
//! [`Strategy::asynchronous`].

pub mod dp;
pub mod fedasync;
pub mod fedavg;
pub mod fedavgm;
pub mod fedbuff;
pub mod fedopt;
pub mod fedprox;
mod flat;
pub mod partial;
pub mod privacy;
mod registry;
pub mod robust;
pub mod scaffold;
pub mod stale;

use std::collections::BTreeMap;
use std::path::Path;

pub use flat::{FloatLayout, float_layout};
pub use registry::{AlgorithmConfig, OptionError, RegisteredAlgorithm, RunShape};

use crate::aggregate::AggregationError;
use crate::tree::ParamTree;

/// Facts about the round a strategy works in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoundContext {
    pub round: u32,
    /// The local learning rate of this round, after the schedule.
    pub learning_rate: f64,
    /// `clients.per_round`: how many clients were asked.
    pub per_round: u32,
    /// `clients.total_clients`.
    pub total_clients: u32,
}

/// What one selected client is asked to do this round, beside training on its
/// data. Travels with the task, over the wire too.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientInstructions {
    /// Learning rate of the local optimizer.
    pub learning_rate: f64,
    /// FedProx's μ: the local objective gains `μ/2 · ‖w − w_global‖²`. 0 is off.
    pub proximal_mu: f64,
    /// SCAFFOLD's `c − cᵢ`, added to every local gradient. Same layout as the
    /// global model.
    pub gradient_correction: Option<ParamTree>,
    /// Clip the update `w − w_global` to this L2 norm before sending it
    /// (differential privacy).
    pub update_clip_norm: Option<f64>,
}

impl ClientInstructions {
    /// Plain local training at `learning_rate`.
    pub fn plain(learning_rate: f64) -> Self {
        Self {
            learning_rate,
            proximal_mu: 0.0,
            gradient_correction: None,
            update_clip_norm: None,
        }
    }
}

/// One client's update as a strategy sees it.
#[derive(Debug, Clone, Copy)]
pub struct ClientUpdate<'a> {
    pub client_id: u32,
    pub num_samples: u64,
    /// Local optimizer steps the client took (SCAFFOLD needs them).
    pub local_steps: u64,
    /// The client's model after local training.
    pub tree: &'a ParamTree,
}

/// What aggregation produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Aggregated {
    /// The next global model; `None` leaves it unchanged (zero total weight).
    pub model: Option<ParamTree>,
    /// Privacy spent so far, for strategies that account for it.
    pub privacy: Option<PrivacySpent>,
    /// For selecting aggregators (Krum): the clients whose updates were used.
    pub selected: Option<Vec<u32>>,
}

impl Aggregated {
    pub fn model(model: ParamTree) -> Self {
        Self {
            model: Some(model),
            ..Self::unchanged()
        }
    }

    /// The global model stays as it is (zero total weight).
    pub fn unchanged() -> Self {
        Self {
            model: None,
            privacy: None,
            selected: None,
        }
    }
}

/// `value` when it is a finite number above 0, else the option's error.
pub(crate) fn positive(option: &'static str, value: f64) -> Result<(), OptionError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(OptionError {
            option,
            message: format!("must be a finite number > 0, got {value}"),
        })
    }
}

/// `update` moved relative to `anchor`: every float element becomes
/// `a + factor · (x − a)`, in float64, stored in the leaf's dtype; other
/// leaves, and leaves whose size differs from the anchor's, stay as they are.
/// Scaling an update (`factor < 1` clips, `factor < 0` flips) is this.
pub fn scale_update(anchor: &ParamTree, update: ParamTree, factor: f64) -> ParamTree {
    use crate::tree::ArrayData;
    let anchors: Vec<Option<Vec<f32>>> = anchor
        .leaves()
        .iter()
        .map(|(_, array)| match array.data() {
            ArrayData::F32(values) => Some(values.clone()),
            ArrayData::F16(values) => Some(values.iter().map(|x| x.to_f32()).collect()),
            _ => None,
        })
        .collect();
    let moved = |x: f32, a: f32| (a as f64 + factor * (x as f64 - a as f64)) as f32;
    let mut update = update;
    for (array, anchor) in update.leaves_mut().into_iter().zip(&anchors) {
        let Some(anchor) = anchor.as_ref().filter(|a| a.len() == array.len()) else {
            continue;
        };
        match array.data_mut() {
            ArrayData::F32(values) => {
                for (x, &a) in values.iter_mut().zip(anchor) {
                    *x = moved(*x, a);
                }
            }
            ArrayData::F16(values) => {
                for (x, &a) in values.iter_mut().zip(anchor) {
                    *x = half::f16::from_f32(moved(x.to_f32(), a));
                }
            }
            _ => {}
        }
    }
    update
}

/// `(ε, δ)` after the rounds so far.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrivacySpent {
    pub epsilon: f64,
    pub delta: f64,
}

/// What a strategy carries from round to round: small values as JSON, tensors
/// (momentum, moments, control variates) as named trees. The checkpoint writes
/// the tensors to a safetensors file beside the sidecar.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StrategyState {
    pub scalars: serde_json::Value,
    /// Names are plain identifiers (letters, digits, `_`).
    pub tensors: BTreeMap<String, ParamTree>,
}

impl StrategyState {
    pub fn is_empty(&self) -> bool {
        self.scalars.is_null() && self.tensors.is_empty()
    }
}

/// Why a strategy refused a round or a state. The global model is unchanged
/// when one of these is returned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StrategyError {
    #[error(transparent)]
    Aggregation(#[from] AggregationError),
    #[error(
        "{strategy} needs at least {needed} updates in a round{why}, but round {round} has {got}"
    )]
    TooFewUpdates {
        strategy: &'static str,
        round: u32,
        needed: usize,
        got: usize,
        why: String,
    },
    #[error(
        "{strategy} aggregates floating-point leaves only, but leaf `{path}` is {dtype}; \
         use fedavg for models with integer or boolean leaves"
    )]
    NonFloatLeaf {
        strategy: &'static str,
        path: String,
        dtype: crate::tree::DType,
    },
    #[error("client {client_id}: {problem}")]
    BadUpdate { client_id: u32, problem: String },
    #[error("{strategy} cannot aggregate asynchronously: {reason}")]
    NotAsynchronous {
        strategy: &'static str,
        reason: String,
    },
    #[error("cannot restore the {strategy} state from the checkpoint: {problem}")]
    State {
        strategy: &'static str,
        problem: String,
    },
    /// A strategy written outside cohort (in another language, behind a
    /// foreign call) failed in its own code: a bug of its author's, so the
    /// run stops with its message rather than dropping a client.
    #[error("strategy {strategy} failed: {message}")]
    Failed {
        strategy: &'static str,
        message: String,
    },
}

/// A federated strategy. See the module documentation.
pub trait Strategy: Send {
    /// The `algorithm.type` this strategy was built from.
    fn name(&self) -> &'static str;

    /// What `client_id` is asked to do in this round. `global` is the model it
    /// will receive.
    fn configure(
        &self,
        ctx: &RoundContext,
        _client_id: u32,
        _global: &ParamTree,
    ) -> Result<ClientInstructions, StrategyError> {
        Ok(ClientInstructions::plain(ctx.learning_rate))
    }

    /// The next global model from the round's updates (validated against
    /// `global`, in selection order, at least one).
    fn aggregate(
        &mut self,
        ctx: &RoundContext,
        global: &ParamTree,
        updates: &[ClientUpdate<'_>],
    ) -> Result<Aggregated, StrategyError>;

    /// Whether the next model depends on the round only through the
    /// sample-weighted mean of the updates. Such a strategy lets the ranks of
    /// a distributed simulation exchange partial sums ([`partial`]) instead
    /// of every update.
    fn aggregates_by_mean(&self) -> bool {
        false
    }

    /// The next global model from the round's sample-weighted mean (`None`:
    /// zero total weight), for strategies that [`aggregates_by_mean`].
    ///
    /// [`aggregates_by_mean`]: Strategy::aggregates_by_mean
    fn aggregate_mean(
        &mut self,
        _ctx: &RoundContext,
        _global: &ParamTree,
        _mean: Option<ParamTree>,
    ) -> Result<Aggregated, StrategyError> {
        Err(StrategyError::State {
            strategy: self.name(),
            problem: "this strategy needs every update, not their mean".to_owned(),
        })
    }

    /// Whether [`Strategy::aggregate`] is [`Strategy::aggregate_mean`] of
    /// FedAvg's mean of the updates ([`crate::aggregate::fedavg`]) bit for
    /// bit, so a server may fold the updates into that mean one at a time
    /// ([`crate::aggregate::MeanFold`]) instead of holding them all. The
    /// server optimizers aggregate by a mean computed in float64 over flat
    /// vectors, whose bits differ, so they say no.
    fn aggregates_by_fedavg_mean(&self) -> bool {
        false
    }

    /// Whether this strategy can aggregate updates trained from older global
    /// models (`server.synchronous = false`), and if not, why. By default
    /// those that [`aggregates_by_mean`] can, after [`stale::rebase`].
    ///
    /// [`aggregates_by_mean`]: Strategy::aggregates_by_mean
    fn asynchronous(&self) -> Result<(), String> {
        if self.aggregates_by_mean() {
            Ok(())
        } else {
            Err(format!(
                "`{}` needs every update of a round trained from the same global model",
                self.name()
            ))
        }
    }

    /// The next global model from updates that trained from older models
    /// (in arrival order, at least one). By default, for strategies that
    /// [`aggregates_by_mean`]: [`Strategy::aggregate`] of the updates
    /// rebased onto `global` ([`stale::rebase`]), staleness not discounted.
    ///
    /// [`aggregates_by_mean`]: Strategy::aggregates_by_mean
    fn aggregate_stale(
        &mut self,
        ctx: &RoundContext,
        global: &ParamTree,
        updates: &[stale::StaleUpdate<'_>],
    ) -> Result<Aggregated, StrategyError> {
        if let Err(reason) = self.asynchronous() {
            return Err(StrategyError::NotAsynchronous {
                strategy: self.name(),
                reason,
            });
        }
        let rebased = stale::rebase(self.name(), global, updates)?;
        let updates: Vec<ClientUpdate<'_>> = updates
            .iter()
            .zip(&rebased)
            .map(|(stale, tree)| ClientUpdate {
                tree,
                ..stale.update
            })
            .collect();
        self.aggregate(ctx, global, &updates)
    }

    /// The state to checkpoint after a round. Stateless strategies keep none.
    fn state(&self) -> StrategyState {
        StrategyState::default()
    }

    /// A folder of the run's own where per-client state may go once every
    /// client's would pass `memory_budget` bytes (`server.client_state_memory`);
    /// strategies without per-client state ignore it. Given before
    /// [`Strategy::restore`].
    fn keep_client_state(&mut self, _folder: &Path, _memory_budget: u64) {}

    /// The state [`Strategy::state`] last gave is in a checkpoint now, so
    /// nothing older will be restored.
    fn checkpointed(&mut self) -> Result<(), StrategyError> {
        Ok(())
    }

    /// Continues from a checkpointed state.
    fn restore(&mut self, state: StrategyState) -> Result<(), StrategyError> {
        if state.is_empty() {
            Ok(())
        } else {
            Err(StrategyError::State {
                strategy: self.name(),
                problem: "this strategy keeps no state, but the checkpoint holds some".to_owned(),
            })
        }
    }
}

/// Builds the strategy an `[algorithm]` section describes (`None`: one a
/// program registered, which its registry builds).
pub fn build(config: &AlgorithmConfig) -> Option<Box<dyn Strategy>> {
    config.build()
}

/// A state of named flat vectors (absent ones are left out), each stored as a
/// one-dimensional float32 tensor.
pub(crate) fn state_of_vectors<'a>(
    named: impl IntoIterator<Item = (&'a str, Option<&'a [f32]>)>,
) -> StrategyState {
    let tensors = named
        .into_iter()
        .filter_map(|(name, vector)| {
            let vector = vector?;
            let array = crate::tree::Array::f32(vec![vector.len()], vector.to_vec())
                .expect("a vector has its own length");
            Some((name.to_owned(), ParamTree::Leaf(array)))
        })
        .collect();
    StrategyState {
        scalars: serde_json::Value::Null,
        tensors,
    }
}

/// The vectors `names` of a state written by [`state_of_vectors`]; a missing
/// one is `None`, an unexpected one is an error.
pub(crate) fn vectors_of_state<const N: usize>(
    strategy: &'static str,
    mut state: StrategyState,
    names: [&str; N],
) -> Result<[Option<Vec<f32>>; N], StrategyError> {
    let vectors = names.map(|name| state.tensors.remove(name));
    if let Some(extra) = state.tensors.keys().next() {
        return Err(StrategyError::State {
            strategy,
            problem: format!("unexpected tensor `{extra}`"),
        });
    }
    let mut out = names.map(|_| None);
    for ((slot, tree), name) in out.iter_mut().zip(vectors).zip(names) {
        *slot = tree
            .map(|tree| vector_of(strategy, name, tree))
            .transpose()?;
    }
    Ok(out)
}

/// A one-dimensional float32 tensor of a state as a vector.
pub(crate) fn vector_of(
    strategy: &'static str,
    name: &str,
    tree: ParamTree,
) -> Result<Vec<f32>, StrategyError> {
    match tree {
        ParamTree::Leaf(array) if array.shape().len() == 1 => match array.into_data() {
            crate::tree::ArrayData::F32(values) => Ok(values),
            other => Err(StrategyError::State {
                strategy,
                problem: format!("tensor `{name}` is {}, expected float32", other.dtype()),
            }),
        },
        _ => Err(StrategyError::State {
            strategy,
            problem: format!("`{name}` is not a one-dimensional tensor"),
        }),
    }
}
