//! Updates that trained from an older global model: what the asynchronous
//! server (`server.synchronous = false`) hands a strategy.
//!
//! An update's staleness is how many aggregations happened between the
//! version its client received and the one it joins: `τ = t − τ₀`. Each
//! [`StaleUpdate`] carries the model its client started from (`base`), so a
//! strategy can take the client's step `wᵢ − baseᵢ` rather than its model.
//!
//! A strategy that averages models ([`super::Strategy::aggregates_by_mean`])
//! aggregates stale updates by default after [`rebase`]: each update becomes
//! `x + (wᵢ − baseᵢ)`, the client's step applied to the current model, which
//! for staleness 0 is the update itself, so a buffer of fresh updates
//! aggregates exactly as a synchronous round. Staleness itself does not
//! discount them; `fedasync` and `fedbuff` are the strategies that do.

use super::flat::{FlatRound, flatten_round};
use super::{ClientUpdate, StrategyError};
use crate::tree::ParamTree;

/// One update of an asynchronous aggregation.
#[derive(Debug, Clone, Copy)]
pub struct StaleUpdate<'a> {
    pub update: ClientUpdate<'a>,
    /// The global model the client trained from.
    pub base: &'a ParamTree,
    /// Aggregations since `base` was the global model.
    pub staleness: u32,
}

/// A synchronous round's updates as asynchronous ones: each trained from
/// `global`, none stale; how a staleness-aware strategy runs a plain round.
pub fn fresh<'a>(global: &'a ParamTree, updates: &[ClientUpdate<'a>]) -> Vec<StaleUpdate<'a>> {
    updates
        .iter()
        .map(|&update| StaleUpdate {
            update,
            base: global,
            staleness: 0,
        })
        .collect()
}

/// The updates' models and their bases as flat vectors, each checked as a
/// round's update is (schema, dtypes, finite values).
pub(crate) struct FlatStale {
    pub round: FlatRound,
    pub bases: Vec<Vec<f32>>,
}

pub(crate) fn flatten_stale(
    strategy: &'static str,
    global: &ParamTree,
    stale: &[StaleUpdate<'_>],
) -> Result<FlatStale, StrategyError> {
    let updates: Vec<ClientUpdate<'_>> = stale.iter().map(|s| s.update).collect();
    let round = flatten_round(strategy, global, &updates)?;
    let bases: Vec<ClientUpdate<'_>> = stale
        .iter()
        .map(|s| ClientUpdate {
            tree: s.base,
            ..s.update
        })
        .collect();
    let bases = flatten_round(strategy, global, &bases)?.updates;
    Ok(FlatStale { round, bases })
}

/// Each update's step applied to the current model: `x + (wᵢ − baseᵢ)`,
/// in float64, as trees of the global model's layout.
pub fn rebase(
    strategy: &'static str,
    global: &ParamTree,
    stale: &[StaleUpdate<'_>],
) -> Result<Vec<ParamTree>, StrategyError> {
    let flat = flatten_stale(strategy, global, stale)?;
    let FlatRound {
        layout,
        global: current,
        updates,
    } = &flat.round;
    Ok(updates
        .iter()
        .zip(&flat.bases)
        .map(|(update, base)| {
            let moved: Vec<f32> = current
                .iter()
                .zip(update)
                .zip(base)
                .map(|((&x, &w), &b)| (x as f64 + (w as f64 - b as f64)) as f32)
                .collect();
            layout.rebuild(global, &moved)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(values: &[f32]) -> ParamTree {
        ParamTree::from_dotted([(
            "w".to_owned(),
            crate::tree::Array::f32(vec![values.len()], values.to_vec()).unwrap(),
        )])
    }

    #[test]
    fn rebasing_moves_the_clients_step_onto_the_current_model() {
        let global = leaf(&[10.0, 20.0]);
        let base = leaf(&[1.0, 2.0]);
        let trained = leaf(&[1.5, 1.0]);
        let fresh = leaf(&[11.0, 19.0]);
        let stale = [
            StaleUpdate {
                update: ClientUpdate {
                    client_id: 1,
                    num_samples: 1,
                    local_steps: 1,
                    tree: &trained,
                },
                base: &base,
                staleness: 2,
            },
            // Staleness 0: its base is the global model, it stays as it is.
            StaleUpdate {
                update: ClientUpdate {
                    client_id: 2,
                    num_samples: 1,
                    local_steps: 1,
                    tree: &fresh,
                },
                base: &global,
                staleness: 0,
            },
        ];
        let rebased = rebase("fedavg", &global, &stale).unwrap();
        // 10 + (1.5 − 1), 20 + (1 − 2).
        assert_eq!(rebased[0], leaf(&[10.5, 19.0]));
        assert_eq!(rebased[1], fresh);
        let poisoned = leaf(&[f32::NAN, 0.0]);
        let bad = [StaleUpdate {
            base: &poisoned,
            ..stale[0]
        }];
        assert!(rebase("fedavg", &global, &bad).is_err());
    }
}
