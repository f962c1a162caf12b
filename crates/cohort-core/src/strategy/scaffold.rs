//! `scaffold`: stochastic controlled averaging (Karimireddy et al. 2020,
//! "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning",
//! Algorithm 1 with option II).
//!
//! The server keeps a control variate `c`, and one `cᵢ` per client (all zero
//! at first). A selected client corrects every local gradient by `c − cᵢ`:
//! `yᵢ ← yᵢ − η_l (gᵢ(yᵢ) − cᵢ + c)`. After `K` local steps, option II sets
//!
//! ```text
//! cᵢ⁺ = cᵢ − c + (x − yᵢ) / (K · η_l)
//! x   ← x + η_g · (1/|S|) Σᵢ (yᵢ − x)
//! c   ← c + (1/N) Σᵢ (cᵢ⁺ − cᵢ)
//! ```
//!
//! over the clients `S` whose updates arrived, `N` clients in all.
//!
//! cohort's clients are stateless (any worker or process may train any logical
//! client), so the server keeps every `cᵢ` and sends `c − cᵢ` with the task
//! (one model-sized tree more on the way down); option II is a function of
//! what the server already knows (`x`, `c`, `cᵢ`, the returned `yᵢ`, the
//! client's step count `K` and the round's `η_l`), so nothing extra comes back
//! up. All control variates are the strategy's state and are checkpointed.
//! Option II assumes plain local SGD: the config must use `trainer.optimizer =
//! "sgd"`.
//!
//! The `cᵢ` are kept in memory while every client's would fit the memory
//! budget the run gives ([`Strategy::keep_client_state`]); beyond it they
//! live in a [`VectorLog`] in the run folder, and a checkpoint holds `c` and
//! the log's position instead of every `cᵢ`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::flat::{difference, flatten_round, float_layout, mean};
use super::registry::{OptionError, RunShape};
use super::{
    Aggregated, ClientInstructions, ClientUpdate, RoundContext, Strategy, StrategyError,
    StrategyState,
};
use crate::tree::ParamTree;
use crate::vector_log::{LogError, LogMark, VectorLog};

/// Options of `scaffold`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScaffoldConfig {
    /// η_g, the server learning rate. Default 1.0.
    pub server_learning_rate: f64,
}

impl Default for ScaffoldConfig {
    fn default() -> Self {
        Self {
            server_learning_rate: 1.0,
        }
    }
}

impl ScaffoldConfig {
    pub fn check(&self, run: &RunShape) -> Result<(), OptionError> {
        super::positive("server_learning_rate", self.server_learning_rate)?;
        if run.local_optimizer != "sgd" {
            return Err(OptionError {
                option: "type",
                message: format!(
                    "scaffold's control variates (option II) assume plain local SGD, but the \
                     local optimizer is {}; set trainer.optimizer = \"sgd\" without momentum",
                    run.local_optimizer
                ),
            });
        }
        Ok(())
    }
}

/// SCAFFOLD's server side: the control variates and the averaging.
#[derive(Debug)]
pub struct Scaffold {
    config: ScaffoldConfig,
    /// `c`; `None` is zero.
    server: Option<Vec<f32>>,
    /// `cᵢ` of every client that has trained; absent ones are zero.
    clients: Variates,
    /// Where the `cᵢ` go once they pass the memory budget; `None`: memory.
    spill: Option<Spill>,
}

#[derive(Debug, Clone)]
struct Spill {
    folder: PathBuf,
    memory_budget: u64,
}

/// Where the `cᵢ` are.
#[derive(Debug)]
enum Variates {
    Memory(BTreeMap<u32, Vec<f32>>),
    Log(VectorLog),
}

impl Variates {
    fn get(&self, client: u32) -> Result<Option<Vec<f32>>, StrategyError> {
        match self {
            Variates::Memory(map) => Ok(map.get(&client).cloned()),
            Variates::Log(log) => log.get(client).map_err(log_error),
        }
    }

    fn put(&mut self, client: u32, variate: Vec<f32>) -> Result<(), StrategyError> {
        match self {
            Variates::Memory(map) => {
                map.insert(client, variate);
                Ok(())
            }
            Variates::Log(log) => log
                .put_all([(client, variate.as_slice())])
                .map_err(log_error),
        }
    }
}

fn log_error(error: LogError) -> StrategyError {
    StrategyError::State {
        strategy: "scaffold",
        problem: format!("the control variates' file {error}"),
    }
}

/// The state's scalar naming the log's position, when the `cᵢ` are in one.
const LOG_MARK: &str = "client_log";

impl Scaffold {
    pub fn new(config: ScaffoldConfig) -> Self {
        Self {
            config,
            server: None,
            clients: Variates::Memory(BTreeMap::new()),
            spill: None,
        }
    }
}

impl Scaffold {
    /// A restored state must fit the model: a variate of another length would
    /// be silently zipped short.
    fn check_sizes(&self, len: usize) -> Result<(), StrategyError> {
        let clients_fit = match &self.clients {
            Variates::Memory(map) => map.values().all(|c| c.len() == len),
            Variates::Log(log) => log.width() == len,
        };
        if self.server.as_ref().is_none_or(|c| c.len() == len) && clients_fit {
            Ok(())
        } else {
            Err(StrategyError::State {
                strategy: "scaffold",
                problem: format!("the control variates do not have the model's {len} elements"),
            })
        }
    }

    /// Moves the `cᵢ` into a log once every client's would pass the budget.
    fn spill_if_over_budget(
        &mut self,
        width: usize,
        total_clients: u32,
    ) -> Result<(), StrategyError> {
        let (Some(spill), Variates::Memory(map)) = (&self.spill, &self.clients) else {
            return Ok(());
        };
        let all_clients = u64::from(total_clients).saturating_mul(4 * width as u64);
        if all_clients <= spill.memory_budget {
            return Ok(());
        }
        let mut log = VectorLog::create(&spill.folder, width).map_err(log_error)?;
        log.put_all(map.iter().map(|(id, c)| (*id, c.as_slice())))
            .map_err(log_error)?;
        tracing::info!(
            clients = total_clients,
            bytes = all_clients,
            budget = spill.memory_budget,
            folder = %spill.folder.display(),
            "SCAFFOLD's client control variates go to a file: all clients' would pass the memory budget"
        );
        self.clients = Variates::Log(log);
        Ok(())
    }
}

/// Option II's new client control variate:
/// `cᵢ⁺ = cᵢ − c + (x − yᵢ) / (K · η_l)`.
pub fn client_variate(
    client: Option<&[f32]>,
    server: Option<&[f32]>,
    global: &[f32],
    local: &[f32],
    steps: u64,
    learning_rate: f64,
) -> Vec<f32> {
    let scale = 1.0 / (steps as f64 * learning_rate);
    (0..global.len())
        .map(|j| {
            let ci = client.map_or(0.0, |c| c[j] as f64);
            let c = server.map_or(0.0, |c| c[j] as f64);
            (ci - c + (global[j] as f64 - local[j] as f64) * scale) as f32
        })
        .collect()
}

impl Strategy for Scaffold {
    fn name(&self) -> &'static str {
        "scaffold"
    }

    fn asynchronous(&self) -> Result<(), String> {
        Err(
            "its control variates are updated as if every client trained from the current \
             global model with the current server variate; a stale client's correction is \
             older than the model it is applied to, which breaks the variance reduction"
                .to_owned(),
        )
    }

    fn configure(
        &self,
        ctx: &RoundContext,
        client_id: u32,
        global: &ParamTree,
    ) -> Result<ClientInstructions, StrategyError> {
        let layout = float_layout(self.name(), global)?;
        self.check_sizes(layout.len())?;
        let zeros = layout.zeros();
        let server = self.server.as_deref().unwrap_or(&zeros);
        let client = self.clients.get(client_id)?;
        let client = client.as_deref().unwrap_or(&zeros);
        Ok(ClientInstructions {
            gradient_correction: Some(layout.rebuild(global, &difference(server, client))),
            ..ClientInstructions::plain(ctx.learning_rate)
        })
    }

    fn aggregate(
        &mut self,
        ctx: &RoundContext,
        global: &ParamTree,
        updates: &[ClientUpdate<'_>],
    ) -> Result<Aggregated, StrategyError> {
        let round = flatten_round(self.name(), global, updates)?;
        self.check_sizes(round.global.len())?;
        self.spill_if_over_budget(round.global.len(), ctx.total_clients)?;
        if let Some(update) = updates.iter().find(|u| u.local_steps == 0) {
            return Err(StrategyError::BadUpdate {
                client_id: update.client_id,
                problem: "reports 0 local steps; SCAFFOLD's control variate needs K ≥ 1".to_owned(),
            });
        }
        let deltas: Vec<Vec<f32>> = round
            .updates
            .iter()
            .map(|local| difference(local, &round.global))
            .collect();
        let delta_refs: Vec<&[f32]> = deltas.iter().map(Vec::as_slice).collect();
        let step = mean(&delta_refs);
        let eta = self.config.server_learning_rate;
        let next: Vec<f32> = round
            .global
            .iter()
            .zip(&step)
            .map(|(&x, &d)| (x as f64 + eta * d as f64) as f32)
            .collect();

        // c ← c + (1/N) Σ (cᵢ⁺ − cᵢ), with every cᵢ⁺ computed from the old c.
        // Each client appears once, so its cᵢ⁺ can be stored at once: the
        // others still read their old cᵢ.
        let mut server_change = vec![0.0f64; round.global.len()];
        for (update, local) in updates.iter().zip(&round.updates) {
            let old = self.clients.get(update.client_id)?;
            let old = old.as_deref();
            let new = client_variate(
                old,
                self.server.as_deref(),
                &round.global,
                local,
                update.local_steps,
                ctx.learning_rate,
            );
            for (j, change) in server_change.iter_mut().enumerate() {
                *change += new[j] as f64 - old.map_or(0.0, |c| c[j] as f64);
            }
            self.clients.put(update.client_id, new)?;
        }
        let total = ctx.total_clients as f64;
        let server = self.server.get_or_insert_with(|| round.layout.zeros());
        for (c, change) in server.iter_mut().zip(server_change) {
            *c = (*c as f64 + change / total) as f32;
        }
        if let Variates::Log(log) = &mut self.clients {
            if log.wants_compaction() {
                log.compact().map_err(log_error)?;
            }
            log.sync().map_err(log_error)?;
        }
        Ok(Aggregated::model(round.layout.rebuild(global, &next)))
    }

    fn keep_client_state(&mut self, folder: &Path, memory_budget: u64) {
        self.spill = Some(Spill {
            folder: folder.join("scaffold"),
            memory_budget,
        });
    }

    fn checkpointed(&mut self) -> Result<(), StrategyError> {
        match &self.clients {
            Variates::Log(log) => log.forget_others().map_err(log_error),
            Variates::Memory(_) => Ok(()),
        }
    }

    fn state(&self) -> StrategyState {
        let map = match &self.clients {
            Variates::Memory(map) => map,
            Variates::Log(log) => {
                let mut state = super::state_of_vectors([("server", self.server.as_deref())]);
                state.scalars = serde_json::json!({ LOG_MARK: log.mark() });
                return state;
            }
        };
        let names: Vec<String> = map.keys().map(|id| format!("client_{id}")).collect();
        let named = std::iter::once(("server", self.server.as_deref())).chain(
            names
                .iter()
                .zip(map.values())
                .map(|(name, c)| (name.as_str(), Some(c.as_slice()))),
        );
        super::state_of_vectors(named)
    }

    fn restore(&mut self, state: StrategyState) -> Result<(), StrategyError> {
        let mark = state
            .scalars
            .get(LOG_MARK)
            .map(|mark| serde_json::from_value::<LogMark>(mark.clone()))
            .transpose()
            .map_err(|e| StrategyError::State {
                strategy: "scaffold",
                problem: format!("`{LOG_MARK}` is not a position in a log: {e}"),
            })?;
        let mut server = None;
        let mut clients = BTreeMap::new();
        let mut expected_len = mark.map(|m| m.width);
        for (name, tree) in state.tensors {
            let vector = super::vector_of("scaffold", &name, tree)?;
            if *expected_len.get_or_insert(vector.len()) != vector.len() {
                return Err(StrategyError::State {
                    strategy: "scaffold",
                    problem: format!("control variate `{name}` has another size"),
                });
            }
            if name == "server" {
                server = Some(vector);
            } else if let Some(id) = name.strip_prefix("client_").and_then(|id| id.parse().ok())
                && mark.is_none()
            {
                clients.insert(id, vector);
            } else {
                return Err(StrategyError::State {
                    strategy: "scaffold",
                    problem: format!("unexpected tensor `{name}`"),
                });
            }
        }
        if mark.is_some() && server.is_none() {
            // The server's variate is what bounds the width a mark claims.
            return Err(StrategyError::State {
                strategy: "scaffold",
                problem: format!("`{LOG_MARK}` without the server's control variate"),
            });
        }
        self.clients = match mark {
            None => Variates::Memory(clients),
            Some(mark) => {
                let spill = self.spill.as_ref().ok_or_else(|| StrategyError::State {
                    strategy: "scaffold",
                    problem: "the checkpoint keeps the client control variates in a file, but \
                              this run gives the strategy no folder for it"
                        .to_owned(),
                })?;
                Variates::Log(VectorLog::open_at(&spill.folder, mark).map_err(log_error)?)
            }
        };
        self.server = server;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::fedavg::tests::{tree, values};

    fn ctx() -> RoundContext {
        RoundContext {
            round: 1,
            learning_rate: 0.5,
            per_round: 2,
            total_clients: 4,
        }
    }

    #[test]
    fn one_round_by_hand() {
        let mut strategy = Scaffold::new(ScaffoldConfig::default());
        let global = tree(&[1.0]);
        // Round 1: c = cᵢ = 0, so the correction is 0.
        let instructions = strategy.configure(&ctx(), 1, &global).unwrap();
        assert_eq!(values(&instructions.gradient_correction.unwrap()), [0.0]);
        let (a, b) = (tree(&[0.0]), tree(&[3.0]));
        let updates = [
            ClientUpdate {
                client_id: 1,
                num_samples: 10,
                local_steps: 2,
                tree: &a,
            },
            ClientUpdate {
                client_id: 2,
                num_samples: 30,
                local_steps: 4,
                tree: &b,
            },
        ];
        let out = strategy.aggregate(&ctx(), &global, &updates).unwrap();
        // x = 1 + ((0 − 1) + (3 − 1)) / 2 = 1.5 (unweighted, as in the paper).
        assert_eq!(values(&out.model.unwrap()), [1.5]);
        // c₁⁺ = (1 − 0) / (2 · 0.5) = 1; c₂⁺ = (1 − 3) / (4 · 0.5) = −1.
        assert_eq!(strategy.clients.get(1).unwrap().unwrap(), [1.0]);
        assert_eq!(strategy.clients.get(2).unwrap().unwrap(), [-1.0]);
        // c = 0 + (1 + (−1)) / 4 = 0.
        assert_eq!(strategy.server.as_deref(), Some(&[0.0][..]));
        // Client 1's next correction: c − c₁ = −1; an unseen client's: 0.
        let next = strategy.configure(&ctx(), 1, &global).unwrap();
        assert_eq!(values(&next.gradient_correction.unwrap()), [-1.0]);
        let unseen = strategy.configure(&ctx(), 3, &global).unwrap();
        assert_eq!(values(&unseen.gradient_correction.unwrap()), [0.0]);
    }

    #[test]
    fn server_variate_moves_by_one_over_n() {
        let mut strategy = Scaffold::new(ScaffoldConfig::default());
        let (global, local) = (tree(&[2.0]), tree(&[0.0]));
        let updates = [ClientUpdate {
            client_id: 3,
            num_samples: 1,
            local_steps: 1,
            tree: &local,
        }];
        strategy.aggregate(&ctx(), &global, &updates).unwrap();
        // c₃⁺ = (2 − 0) / (1 · 0.5) = 4; c = 4 / 4 clients = 1.
        assert_eq!(strategy.server.as_deref(), Some(&[1.0][..]));
        let mut restored = Scaffold::new(ScaffoldConfig::default());
        restored.restore(strategy.state()).unwrap();
        assert_eq!(restored.server, strategy.server);
        assert_eq!(restored.state(), strategy.state());
    }

    /// Round `round`'s update of client `id`: the global model moved by a
    /// step that differs by client and round.
    fn local_of(global: &ParamTree, id: u32, round: u32) -> ParamTree {
        let step = ((id * 7 + round * 3) % 11) as f32 * 0.125 - 0.5;
        tree(&values(global).iter().map(|v| v + step).collect::<Vec<_>>())
    }

    /// Five rounds of four of ten clients, from `strategy`'s state; the
    /// models and every client's next correction.
    fn five_rounds(strategy: &mut Scaffold, from: u32) -> Vec<Vec<f32>> {
        let ctx = RoundContext {
            total_clients: 10,
            ..ctx()
        };
        let mut global = tree(&[1.0, -2.0, 0.5]);
        let mut seen = Vec::new();
        for round in from..from + 5 {
            let ids: Vec<u32> = (0..4).map(|k| 1 + (round * 3 + k * 2) % 10).collect();
            let locals: Vec<ParamTree> =
                ids.iter().map(|&id| local_of(&global, id, round)).collect();
            let updates: Vec<ClientUpdate<'_>> = ids
                .iter()
                .zip(&locals)
                .map(|(&client_id, tree)| ClientUpdate {
                    client_id,
                    num_samples: 5,
                    local_steps: u64::from(1 + client_id % 3),
                    tree,
                })
                .collect();
            global = strategy
                .aggregate(&ctx, &global, &updates)
                .unwrap()
                .model
                .unwrap();
            seen.push(values(&global));
            for id in 1..=10 {
                let next = strategy.configure(&ctx, id, &global).unwrap();
                seen.push(values(&next.gradient_correction.unwrap()));
            }
        }
        seen
    }

    #[test]
    fn variates_in_a_file_give_the_same_bits_and_resume_from_a_mark() {
        let mut in_memory = Scaffold::new(ScaffoldConfig::default());
        let expected = five_rounds(&mut in_memory, 1);
        let dir = tempfile::tempdir().unwrap();
        let mut spilled = Scaffold::new(ScaffoldConfig::default());
        // 10 clients × 3 floats × 4 bytes pass a budget of 100 bytes.
        spilled.keep_client_state(dir.path(), 100);
        assert_eq!(five_rounds(&mut spilled, 1), expected);
        assert!(matches!(spilled.clients, Variates::Log(_)));
        assert_eq!(spilled.state().tensors.len(), 1, "only `c` is copied");

        // A checkpoint after five rounds, five more, then back to it: the
        // same five rounds again.
        let checkpoint = spilled.state();
        spilled.checkpointed().unwrap();
        let after = five_rounds(&mut spilled, 6);
        let mut resumed = Scaffold::new(ScaffoldConfig::default());
        resumed.keep_client_state(dir.path(), 100);
        resumed.restore(checkpoint.clone()).unwrap();
        assert_eq!(five_rounds(&mut resumed, 6), after);
        // A state in memory restores the same way.
        let mut memory_resumed = Scaffold::new(ScaffoldConfig::default());
        memory_resumed.restore(in_memory.state()).unwrap();
        assert_eq!(five_rounds(&mut memory_resumed, 6), after);
        // Without the folder, a file-backed checkpoint is refused by name.
        let error = Scaffold::new(ScaffoldConfig::default())
            .restore(checkpoint)
            .unwrap_err();
        assert!(
            error
                .to_string()
                .contains("keeps the client control variates in a file"),
            "{error}"
        );
    }

    #[test]
    fn zero_steps_and_adam_are_refused() {
        let mut strategy = Scaffold::new(ScaffoldConfig::default());
        let (global, local) = (tree(&[2.0]), tree(&[0.0]));
        let updates = [ClientUpdate {
            client_id: 3,
            num_samples: 1,
            local_steps: 0,
            tree: &local,
        }];
        assert!(strategy.aggregate(&ctx(), &global, &updates).is_err());
        let run = RunShape {
            total_clients: 4,
            per_round: 2,
            min_per_round: 2,
            local_optimizer: "adam",
        };
        let error = ScaffoldConfig::default().check(&run).unwrap_err();
        assert!(
            error.message.contains("plain local SGD"),
            "{}",
            error.message
        );
    }
}
