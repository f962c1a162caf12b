//! Partial sums: how ranks of a distributed simulation combine the updates
//! of strategies whose server step sees the round only through the
//! sample-weighted mean (`fedavg`, `fedprox`, and the server optimizers
//! `fedavgm`, `fedadam`, `fedyogi`, `fedadagrad`, which step from it). Each rank sums `nᵢ · xᵢ` over
//! its own clients' checked updates in float64 with the total `Σ nᵢ`; the
//! ranks exchange those partials (one model's worth each, whatever their
//! number of clients) and every rank adds them in rank order and divides.
//!
//! The result equals the single-process FedAvg up to rounding, not bit for
//! bit: FedAvg accumulates `(nᵢ/n)·xᵢ` in float32 in selection order, and
//! partial sums change both the precision and the order of the additions.

use super::flat::{FloatLayout, flatten_round, float_layout};
use super::{ClientUpdate, StrategyError};
use crate::tree::ParamTree;

/// One rank's share of a round: `Σ nᵢ·xᵢ` over its float elements, and `Σ nᵢ`.
#[derive(Debug, Clone, PartialEq)]
pub struct PartialSum {
    pub weight: f64,
    pub sums: Vec<f64>,
}

impl PartialSum {
    /// The partial of `updates`, checked as FedAvg checks a round (schema,
    /// dtypes, weights, finite values) before any arithmetic. No updates give
    /// a zero partial.
    pub fn of(global: &ParamTree, updates: &[ClientUpdate<'_>]) -> Result<Self, StrategyError> {
        if updates.is_empty() {
            let layout = float_layout("partial sums", global)?;
            return Ok(Self {
                weight: 0.0,
                sums: vec![0.0; layout.len()],
            });
        }
        let round = flatten_round("partial sums", global, updates)?;
        let mut sums = vec![0.0f64; round.layout.len()];
        let mut weight = 0.0f64;
        for (update, values) in updates.iter().zip(&round.updates) {
            let n = update.num_samples as f64;
            weight += n;
            for (sum, &x) in sums.iter_mut().zip(values) {
                *sum += n * f64::from(x);
            }
        }
        Ok(Self { weight, sums })
    }

    /// Little-endian: the weight, the element count, the sums.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + 8 * self.sums.len());
        out.extend_from_slice(&self.weight.to_le_bytes());
        out.extend_from_slice(&(self.sums.len() as u64).to_le_bytes());
        for sum in &self.sums {
            out.extend_from_slice(&sum.to_le_bytes());
        }
        out
    }

    /// Reads what [`PartialSum::encode`] wrote for a model of `elements`
    /// float elements; anything else (another length, a weight or sum that is
    /// not finite, a negative weight) is refused.
    pub fn decode(bytes: &[u8], elements: usize) -> Result<Self, String> {
        let expected = 16 + 8 * elements;
        if bytes.len() != expected {
            return Err(format!(
                "{} bytes, expected {expected} for {elements} elements",
                bytes.len()
            ));
        }
        let word =
            |i: usize| u64::from_le_bytes(bytes[8 * i..8 * i + 8].try_into().expect("8 bytes"));
        let weight = f64::from_bits(word(0));
        if word(1) != elements as u64 {
            return Err(format!("{} elements, expected {elements}", word(1)));
        }
        if !(weight.is_finite() && weight >= 0.0) {
            return Err(format!("a total weight of {weight}"));
        }
        let sums: Vec<f64> = (0..elements).map(|i| f64::from_bits(word(2 + i))).collect();
        if let Some(index) = sums.iter().position(|s| !s.is_finite()) {
            return Err(format!("sum {index} is {}", sums[index]));
        }
        Ok(Self { weight, sums })
    }
}

/// The float elements of `global`'s partial sums, for [`PartialSum::decode`].
pub fn partial_layout(global: &ParamTree) -> Result<FloatLayout, StrategyError> {
    float_layout("partial sums", global)
}

/// The sample-weighted mean of the whole round from every rank's partial,
/// added in the order given (rank order, the same on every rank), or `None`
/// when the total weight is zero.
pub fn combine(
    global: &ParamTree,
    partials: &[PartialSum],
) -> Result<Option<ParamTree>, StrategyError> {
    let layout = partial_layout(global)?;
    let mut sums = vec![0.0f64; layout.len()];
    let mut weight = 0.0f64;
    for partial in partials {
        if partial.sums.len() != layout.len() {
            return Err(StrategyError::BadUpdate {
                client_id: 0,
                problem: format!(
                    "a partial sum of {} elements for a model of {}",
                    partial.sums.len(),
                    layout.len()
                ),
            });
        }
        weight += partial.weight;
        for (sum, &s) in sums.iter_mut().zip(&partial.sums) {
            *sum += s;
        }
    }
    if weight == 0.0 {
        return Ok(None);
    }
    let mean: Vec<f32> = sums.iter().map(|s| (s / weight) as f32).collect();
    Ok(Some(layout.rebuild(global, &mean)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::fedavg::tests::tree;
    use crate::strategy::fedavg::weighted_average;

    fn update(client_id: u32, num_samples: u64, tree: &ParamTree) -> ClientUpdate<'_> {
        ClientUpdate {
            client_id,
            num_samples,
            local_steps: 1,
            tree,
        }
    }

    /// Two ranks: {a (1 sample), b (3)} and {c (4)}: mean = (1a + 3b + 4c) / 8.
    #[test]
    fn partials_of_two_ranks_give_the_weighted_mean_by_hand() {
        let global = tree(&[0.0, 0.0]);
        let (a, b, c) = (tree(&[8.0, 0.0]), tree(&[0.0, 8.0]), tree(&[2.0, 4.0]));
        let first = PartialSum::of(&global, &[update(1, 1, &a), update(2, 3, &b)]).unwrap();
        let second = PartialSum::of(&global, &[update(3, 4, &c)]).unwrap();
        assert_eq!(
            first,
            PartialSum {
                weight: 4.0,
                sums: vec![8.0, 24.0]
            }
        );
        let mean = combine(&global, &[first, second]).unwrap().unwrap();
        // (8 + 0 + 8) / 8 = 2, (0 + 24 + 16) / 8 = 5
        assert_eq!(mean, tree(&[2.0, 5.0]));
        let single = weighted_average(
            &global,
            &[update(1, 1, &a), update(2, 3, &b), update(3, 4, &c)],
        )
        .unwrap()
        .unwrap();
        assert_eq!(mean, single);
    }

    /// The server-optimizer strategies step from the mean alone: fed the
    /// partials' mean, they follow their own aggregation over two rounds
    /// (state carried) to float rounding.
    #[test]
    fn server_optimizers_step_the_same_from_the_mean() {
        use crate::strategy::{AlgorithmConfig, RoundContext};
        let ctx = RoundContext {
            round: 1,
            learning_rate: 0.1,
            per_round: 2,
            total_clients: 2,
        };
        let configs = [
            AlgorithmConfig::Fedavgm(Default::default()),
            AlgorithmConfig::Fedadam(Default::default()),
            AlgorithmConfig::Fedyogi(Default::default()),
            AlgorithmConfig::Fedadagrad(Default::default()),
            AlgorithmConfig::Fedprox(Default::default()),
        ];
        for config in configs {
            let (mut whole, mut by_mean) = (config.build().unwrap(), config.build().unwrap());
            assert!(by_mean.aggregates_by_mean(), "{}", whole.name());
            let (mut a, mut b) = (tree(&[0.5, -1.0, 2.0]), tree(&[0.5, -1.0, 2.0]));
            for round in 0..2 {
                let shift = round as f32;
                let x = tree(&[1.0 + shift, 0.0, 3.0]);
                let y = tree(&[0.0, -2.0 - shift, 1.0]);
                let updates = [update(1, 3, &x), update(2, 1, &y)];
                let next_a = whole.aggregate(&ctx, &a, &updates).unwrap().model.unwrap();
                let partial = PartialSum::of(&b, &updates).unwrap();
                let mean = combine(&b, &[partial]).unwrap();
                let next_b = by_mean
                    .aggregate_mean(&ctx, &b, mean)
                    .unwrap()
                    .model
                    .unwrap();
                let (fa, fb) = (next_a.clone().flatten(), next_b.clone().flatten());
                for ((_, x), (_, y)) in fa.leaves.iter().zip(&fb.leaves) {
                    let (crate::tree::ArrayData::F32(x), crate::tree::ArrayData::F32(y)) =
                        (x.data(), y.data())
                    else {
                        panic!("float32 leaves");
                    };
                    for (p, q) in x.iter().zip(y) {
                        assert!(
                            (p - q).abs() <= 1e-6 * p.abs().max(1.0),
                            "{}: {p} vs {q}",
                            whole.name()
                        );
                    }
                }
                (a, b) = (next_a, next_b);
            }
        }
        // The strategies that need every update say so.
        let median = AlgorithmConfig::Median(Default::default()).build().unwrap();
        assert!(!median.aggregates_by_mean());
    }

    #[test]
    fn empty_ranks_and_zero_weight() {
        let global = tree(&[1.0, 2.0]);
        let empty = PartialSum::of(&global, &[]).unwrap();
        assert_eq!(empty.sums, [0.0, 0.0]);
        assert_eq!(combine(&global, &[empty.clone(), empty]).unwrap(), None);
    }

    #[test]
    fn updates_are_checked_before_any_arithmetic() {
        let global = tree(&[0.0, 0.0]);
        let short = tree(&[1.0]);
        assert!(PartialSum::of(&global, &[update(1, 1, &short)]).is_err());
        let poisoned = tree(&[f32::NAN, 0.0]);
        assert!(PartialSum::of(&global, &[update(2, 1, &poisoned)]).is_err());
    }

    #[test]
    fn encoding_round_trips_and_refuses_what_it_did_not_write() {
        let partial = PartialSum {
            weight: 3.0,
            sums: vec![1.5, -2.0],
        };
        let bytes = partial.encode();
        assert_eq!(PartialSum::decode(&bytes, 2).unwrap(), partial);
        assert!(PartialSum::decode(&bytes, 3).is_err());
        assert!(PartialSum::decode(&bytes[..bytes.len() - 1], 2).is_err());
        let mut bad = bytes.clone();
        bad[..8].copy_from_slice(&f64::NAN.to_le_bytes());
        assert!(PartialSum::decode(&bad, 2).unwrap_err().contains("weight"));
        let mut bad = bytes;
        bad[16..24].copy_from_slice(&f64::INFINITY.to_le_bytes());
        assert!(PartialSum::decode(&bad, 2).unwrap_err().contains("sum 0"));
    }
}
