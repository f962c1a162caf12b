//! `dp_fedavg`: federated averaging with central, client-level differential
//! privacy (McMahan, Ramage, Talwar, Zhang 2018, "Learning Differentially
//! Private Recurrent Language Models", DP-FedAvg with the fixed-denominator
//! estimator).
//!
//! # The round
//!
//! 1. Every selected client is asked to clip its update `Δᵢ = wᵢ − w` (its
//!    model after training minus the global model it received) to L2 norm `S`
//!    ([`ClientInstructions::update_clip_norm`]).
//! 2. The server clips again, `Δᵢ · min(1, S / ‖Δᵢ‖)`: the guarantee must not
//!    rest on clients following instructions.
//! 3. The clipped updates are summed, Gaussian noise `N(0, (z·S)²)` is added
//!    to every coordinate (`z`: the noise multiplier), and the result is
//!    divided by `m = clients.per_round`.
//! 4. The next global model is `w + that`.
//!
//! Arithmetic is in float64 from the float32/float16 values; the result is
//! stored in each leaf's dtype.
//!
//! # Why a fixed denominator, and no sample weights
//!
//! `m` is the number of clients *asked*, not the number that answered, and
//! every client weighs the same. Then adding or removing one client moves the
//! sum by at most `S` and the average by at most `S / m`, whoever else
//! answered: the noise on the average, of standard deviation `z·S / m`, is `z`
//! times that sensitivity. Dividing by the number of answers would make the
//! sensitivity depend on dropouts, and weighting by reported sample counts
//! would let a client scale its own influence. The price: a round with
//! dropouts is shrunk towards the current model by `answered / m`.
//!
//! # Accounting
//!
//! Round `t` (counted from 1) is the `t`-th step of a sampled Gaussian
//! mechanism with sampling rate `q = per_round / total_clients` and noise
//! multiplier `z`; [`Aggregated::privacy`] reports
//! [`epsilon_after`]`(q, z, t, δ)` with the configured `δ` (see
//! [`privacy`](super::privacy), which agrees with Opacus). Read it with these
//! assumptions in mind:
//!
//! * **Sampling.** cohort selects a fixed-size cohort without replacement;
//!   the accountant assumes each client is in a round independently with
//!   probability `q` (Poisson sampling). This is the usual approximation
//!   (the paper's, and Opacus's with fixed-size batches), not a proof for
//!   fixed-size sampling.
//! * **Unit of privacy.** One client's whole data set (add or remove a
//!   client), over all rounds.
//! * **Trust.** Central DP: the server sees each clipped update. The
//!   guarantee protects what the server releases (every global model).
//! * **The noise key.** The noise is a deterministic function of a 256-bit
//!   key and the round. By default the key comes from the operating system's
//!   entropy when the run starts and lives only in the server's checkpoints
//!   (so `--resume` continues identically), never in the config that client
//!   processes receive. `noise_seed` derives the key from a number instead,
//!   for reproducible experiments: whoever knows it can regenerate the noise
//!   and subtract it, so the guarantee then holds only against parties that
//!   do not know it (and client processes do: they receive the config).
//! * **Re-released rounds.** A run that crashes after writing a round's
//!   model but before its checkpoint redoes that round on `--resume` with the
//!   same noise; if the clients' updates differ the second time (unseeded
//!   training), both releases together reveal their difference without
//!   noise. Keep `trainer.training_seed` set, or do not publish models of
//!   rounds whose checkpoint is missing.
//! * **Floating point.** Noise sampled in float64 and models stored in
//!   float32 are not an exact Gaussian mechanism (Mironov 2012, "On
//!   Significance of the Least Significant Bits for Differential Privacy");
//!   like Opacus and TF Privacy, the accountant ignores this.
//! * A round refused with an error releases nothing but is still counted by
//!   the next round's number: the report errs on the safe side.
//!
//! # State
//!
//! Round `t`'s noise comes from its own stream, seeded with
//! `SHA-256("dp-noise" ‖ key ‖ t)` ([`round_stream`]), and the privacy spent
//! from `t` alone: the key is the whole state, checkpointed as the strategy's
//! scalar state.
//!
//! # The noise stream
//!
//! A ChaCha8 generator seeded with the round's 256-bit seed gives pairs of float64
//! uniforms `u₁, u₂` in `[0, 1)` (53 random bits each, `rand`'s
//! `random::<f64>()`); Box–Muller turns each pair into two independent
//! standard normals, `√(−2 ln(1 − u₁)) · (cos 2πu₂, sin 2πu₂)`, for
//! coordinates `2k` and `2k + 1` of the flat model (float leaves in tree
//! order). The stream depends on nothing but the seed; `ln`, `cos` and `sin`
//! come from the platform's math library, so the last bits may differ
//! between platforms.

use std::f64::consts::TAU;

use rand::{Rng, SeedableRng, TryRngCore};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::flat::flatten_round;
use super::privacy::epsilon_after;
use super::registry::{OptionError, RunShape};
use super::{
    Aggregated, ClientInstructions, ClientUpdate, PrivacySpent, RoundContext, Strategy,
    StrategyError, StrategyState,
};
use crate::tree::ParamTree;
use sha2::{Digest, Sha256};

const NAME: &str = "dp_fedavg";

/// Options of `dp_fedavg` (`[algorithm]` with `type = "dp_fedavg"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DpFedAvgConfig {
    /// `S`: the largest L2 norm of one client's update `w − w_global`,
    /// enforced by the client and again by the server. Default 1.0.
    pub clip_norm: f64,
    /// `z`: the noise on the sum of clipped updates has standard deviation
    /// `z·S` per coordinate. Default 1.0.
    pub noise_multiplier: f64,
    /// `δ` of the reported `(ε, δ)`; should be well below
    /// `1 / clients.total_clients`. Default 1e-5.
    pub delta: f64,
    /// Derive the noise key from this number instead of the operating
    /// system's entropy: reproducible runs, but anyone who knows it (client
    /// processes receive the config) can remove the noise. Default: unset.
    pub noise_seed: Option<u64>,
}

impl Default for DpFedAvgConfig {
    fn default() -> Self {
        Self {
            clip_norm: 1.0,
            noise_multiplier: 1.0,
            delta: 1e-5,
            noise_seed: None,
        }
    }
}

impl DpFedAvgConfig {
    /// Checks every option, and that the sampling rate the accountant uses,
    /// `per_round / total_clients`, is a probability.
    pub fn check(&self, run: &RunShape) -> Result<(), OptionError> {
        super::positive("clip_norm", self.clip_norm)?;
        super::positive("noise_multiplier", self.noise_multiplier)?;
        if !(self.delta > 0.0 && self.delta < 1.0) {
            return Err(OptionError {
                option: "delta",
                message: format!(
                    "delta must be between 0 and 1 (exclusive), got {}",
                    self.delta
                ),
            });
        }
        if run.per_round == 0 || run.per_round > run.total_clients {
            return Err(OptionError {
                option: "type",
                message: format!(
                    "dp_fedavg accounts for privacy with the sampling rate \
                     clients.per_round / clients.total_clients = {} / {}, which must be \
                     above 0 and at most 1",
                    run.per_round, run.total_clients
                ),
            });
        }
        Ok(())
    }
}

/// The `dp_fedavg` strategy. See the module documentation.
pub struct DpFedAvg {
    config: DpFedAvgConfig,
    /// The noise key.
    key: [u8; 32],
}

impl DpFedAvg {
    /// Options are assumed checked ([`DpFedAvgConfig::check`]). Without
    /// `noise_seed` the key comes from the operating system's entropy.
    pub fn new(config: DpFedAvgConfig) -> Self {
        let key = match config.noise_seed {
            Some(seed) => key_from_seed(seed),
            None => {
                let mut key = [0u8; 32];
                rand::rngs::OsRng
                    .try_fill_bytes(&mut key)
                    .expect("the operating system provides entropy");
                key
            }
        };
        Self { config, key }
    }
}

/// A noise key from a number (`noise_seed`).
pub fn key_from_seed(seed: u64) -> [u8; 32] {
    Sha256::new()
        .chain_update(b"dp-noise-key")
        .chain_update(seed.to_le_bytes())
        .finalize()
        .into()
}

/// The seed of round `round`'s noise stream under `key`.
pub fn round_stream(key: &[u8; 32], round: u32) -> [u8; 32] {
    Sha256::new()
        .chain_update(b"dp-noise")
        .chain_update(key)
        .chain_update(round.to_le_bytes())
        .finalize()
        .into()
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn key_from_hex(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 || !text.is_ascii() {
        return None;
    }
    let mut key = [0u8; 32];
    for (byte, pair) in key.iter_mut().zip(text.as_bytes().chunks(2)) {
        *byte = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(key)
}

impl Strategy for DpFedAvg {
    fn name(&self) -> &'static str {
        NAME
    }

    fn asynchronous(&self) -> Result<(), String> {
        Err(
            "its accountant assumes each round is a uniform sample of clients.per_round \
             clients from all of them (privacy amplification by sampling); asynchronous \
             selection from the clients online replacing those that finished is not that \
             sample, so the ε it would report would not hold"
                .to_owned(),
        )
    }

    fn configure(
        &self,
        ctx: &RoundContext,
        _client_id: u32,
        _global: &ParamTree,
    ) -> Result<ClientInstructions, StrategyError> {
        Ok(ClientInstructions {
            learning_rate: ctx.learning_rate,
            proximal_mu: 0.0,
            gradient_correction: None,
            update_clip_norm: Some(self.config.clip_norm),
        })
    }

    fn aggregate(
        &mut self,
        ctx: &RoundContext,
        global: &ParamTree,
        updates: &[ClientUpdate<'_>],
    ) -> Result<Aggregated, StrategyError> {
        let round = flatten_round(NAME, global, updates)?;
        let config = &self.config;
        // The runtime never hands over more updates than it asked for; if it
        // did, dividing by their count would still keep each one's influence
        // at most S / per_round, and the denominator is never 0.
        let denominator = ctx.per_round.max(updates.len() as u32);
        let next = private_mean_step(
            &round.global,
            &round.updates,
            &NoisyMean {
                clip_norm: config.clip_norm,
                noise_multiplier: config.noise_multiplier,
                denominator,
                stream_seed: round_stream(&self.key, ctx.round),
            },
        );
        Ok(Aggregated {
            model: Some(round.layout.rebuild(global, &next)),
            privacy: Some(PrivacySpent {
                epsilon: spent(ctx, config),
                delta: config.delta,
            }),
            selected: None,
        })
    }

    fn state(&self) -> StrategyState {
        StrategyState {
            scalars: serde_json::json!({ "noise_key": to_hex(&self.key) }),
            tensors: Default::default(),
        }
    }

    fn restore(&mut self, state: StrategyState) -> Result<(), StrategyError> {
        let problem = |problem: &str| StrategyError::State {
            strategy: NAME,
            problem: problem.to_owned(),
        };
        if !state.tensors.is_empty() {
            return Err(problem("dp_fedavg keeps no tensors"));
        }
        let key = state
            .scalars
            .get("noise_key")
            .and_then(serde_json::Value::as_str)
            .and_then(key_from_hex)
            .ok_or_else(|| problem("no valid `noise_key` (64 hex digits)"))?;
        self.key = key;
        Ok(())
    }
}

/// ε after `ctx.round` rounds. The checked options make `q` a probability;
/// were it not one, ∞ is the honest answer (and no panic inside a round).
fn spent(ctx: &RoundContext, config: &DpFedAvgConfig) -> f64 {
    let q = f64::from(ctx.per_round) / f64::from(ctx.total_clients);
    let z = config.noise_multiplier;
    let valid = (0.0..=1.0).contains(&q) && z.is_finite() && z >= 0.0;
    if !valid {
        return f64::INFINITY;
    }
    epsilon_after(q, z, u64::from(ctx.round), config.delta)
}

/// The parameters of one [`private_mean_step`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NoisyMean {
    /// `S`, the L2 bound of each update.
    pub clip_norm: f64,
    /// `z`; 0 adds no noise (not a valid option, but handy for checking the
    /// clipping and averaging by hand).
    pub noise_multiplier: f64,
    /// `m`, the fixed denominator (at least 1).
    pub denominator: u32,
    /// Seed of the ChaCha8 stream of the noise ([`round_stream`]).
    pub stream_seed: [u8; 32],
}

/// `global + (Σᵢ clip_S(modelᵢ − global) + N(0, (z·S)²)) / m` on flat vectors,
/// in float64; see the module documentation.
pub fn private_mean_step(global: &[f32], models: &[Vec<f32>], step: &NoisyMean) -> Vec<f32> {
    let mut sum = vec![0.0f64; global.len()];
    for model in models {
        let deltas = || model.iter().zip(global).map(|(&x, &g)| x as f64 - g as f64);
        let norm = deltas().map(|d| d * d).sum::<f64>().sqrt();
        let scale = clip_scale(norm, step.clip_norm);
        for (total, delta) in sum.iter_mut().zip(deltas()) {
            *total += scale * delta;
        }
    }
    let noise_std = step.noise_multiplier * step.clip_norm;
    if noise_std > 0.0 {
        for (total, normal) in sum.iter_mut().zip(standard_normals(step.stream_seed)) {
            *total += noise_std * normal;
        }
    }
    let m = f64::from(step.denominator);
    global
        .iter()
        .zip(&sum)
        .map(|(&g, &total)| (g as f64 + total / m) as f32)
        .collect()
}

/// `min(1, S / norm)`: what an update of L2 norm `norm` is multiplied by to
/// be at most `clip_norm` long (1 for a zero update).
pub fn clip_scale(norm: f64, clip_norm: f64) -> f64 {
    if norm > clip_norm {
        clip_norm / norm
    } else {
        1.0
    }
}

/// The endless stream of standard normals of a seed (Box–Muller on ChaCha8,
/// see the module documentation).
pub fn standard_normals(seed: [u8; 32]) -> impl Iterator<Item = f64> {
    let mut rng = ChaCha8Rng::from_seed(seed);
    std::iter::repeat_with(move || {
        // 1 − u₁ is in (0, 1]: its logarithm is finite.
        let radius = (-2.0 * (1.0 - rng.random::<f64>()).ln()).sqrt();
        let angle = TAU * rng.random::<f64>();
        [radius * angle.cos(), radius * angle.sin()]
    })
    .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::Array;

    fn no_noise(clip_norm: f64, denominator: u32) -> NoisyMean {
        NoisyMean {
            clip_norm,
            noise_multiplier: 0.0,
            denominator,
            stream_seed: [0; 32],
        }
    }

    fn leaf(values: Vec<f32>) -> ParamTree {
        ParamTree::Leaf(Array::f32(vec![values.len()], values).unwrap())
    }

    fn values(tree: &ParamTree) -> Vec<f32> {
        match tree {
            ParamTree::Leaf(array) => array.as_f32().unwrap().to_vec(),
            _ => panic!("a leaf"),
        }
    }

    fn ctx(round: u32, per_round: u32, total_clients: u32) -> RoundContext {
        RoundContext {
            round,
            learning_rate: 0.05,
            per_round,
            total_clients,
        }
    }

    fn update(client_id: u32, tree: &ParamTree) -> ClientUpdate<'_> {
        ClientUpdate {
            client_id,
            num_samples: 10 + 90 * client_id as u64, // ignored: uniform weights
            local_steps: 1,
            tree,
        }
    }

    #[test]
    fn clipping_and_the_fixed_denominator_by_hand() {
        // Client 0: Δ = (3, 4), norm 5, clipped to S = 1: (0.6, 0.8).
        // Client 1: Δ = (0.5, 0), inside the ball: kept.
        // Four clients were asked, two answered: (1.1, 0.8) / 4.
        let global = [1.0f32, 2.0];
        let models = [vec![4.0f32, 6.0], vec![1.5, 2.0]];
        let next = private_mean_step(&global, &models, &no_noise(1.0, 4));
        let expected = [1.275f32, 2.2];
        assert!(
            next.iter()
                .zip(&expected)
                .all(|(x, e)| (x - e).abs() < 1e-6),
            "{next:?}"
        );
    }

    #[test]
    fn the_server_clips_an_oversized_update() {
        // A client that ignored its instructions: norm 1e4 instead of 2.
        let global = vec![0.5f32; 100];
        let models = [global.iter().map(|g| g + 1000.0).collect::<Vec<f32>>()];
        let next = private_mean_step(&global, &models, &no_noise(2.0, 1));
        let moved: Vec<f64> = next
            .iter()
            .zip(&global)
            .map(|(x, g)| (x - g) as f64)
            .collect();
        let norm = moved.iter().map(|d| d * d).sum::<f64>().sqrt();
        assert!((norm - 2.0).abs() < 1e-6, "{norm}");
        assert!(moved.iter().all(|&d| (d - 0.2).abs() < 1e-6), "{moved:?}");
        assert_eq!(clip_scale(0.0, 1.0), 1.0);
        assert_eq!(clip_scale(4.0, 1.0), 0.25);
    }

    #[test]
    fn noise_depends_on_the_seed_and_the_round_only() {
        let (k1, k2) = (key_from_seed(1), key_from_seed(2));
        let a: Vec<f64> = standard_normals(k1).take(5).collect();
        assert_eq!(a, standard_normals(k1).take(5).collect::<Vec<_>>());
        assert_ne!(a, standard_normals(k2).take(5).collect::<Vec<_>>());
        assert_eq!(round_stream(&k1, 3), round_stream(&k1, 3));
        assert_ne!(round_stream(&k1, 3), round_stream(&k1, 4));
        assert_ne!(round_stream(&k1, 3), round_stream(&k2, 3));

        let global = leaf(vec![0.0; 64]);
        let model = leaf(vec![0.1; 64]);
        let seeded = DpFedAvgConfig {
            noise_seed: Some(1),
            ..DpFedAvgConfig::default()
        };
        let run = |round| {
            let mut strategy = DpFedAvg::new(seeded.clone());
            let out = strategy
                .aggregate(&ctx(round, 2, 10), &global, &[update(0, &model)])
                .unwrap();
            values(&out.model.unwrap())
        };
        assert_eq!(run(3), run(3));
        assert_ne!(run(3), run(4));
    }

    #[test]
    fn noise_on_the_mean_has_standard_deviation_z_s_over_m() {
        // No update moves: the step is the noise alone, N(0, (z·S/m)²).
        let n = 200_000;
        let global = vec![0.0f32; n];
        let (z, s, m) = (1.5, 0.5, 4);
        let step = NoisyMean {
            clip_norm: s,
            noise_multiplier: z,
            denominator: m,
            stream_seed: round_stream(&key_from_seed(11), 1),
        };
        let next = private_mean_step(&global, std::slice::from_ref(&global), &step);
        let expected = z * s / f64::from(m);
        let mean = next.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        let var = next.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        // Standard errors: σ/√n for the mean, σ/√(2n) ≈ 0.16% for the std.
        assert!(mean.abs() < 5.0 * expected / (n as f64).sqrt(), "{mean}");
        assert!((var.sqrt() / expected - 1.0).abs() < 0.01, "{}", var.sqrt());
        // And it is Gaussian: ~68.27% within one standard deviation.
        let inside = next
            .iter()
            .filter(|&&x| (x as f64).abs() < expected)
            .count();
        assert!((inside as f64 / n as f64 - 0.6827).abs() < 0.005);
    }

    #[test]
    fn the_strategy_asks_for_clipping_and_reports_privacy() {
        let config = DpFedAvgConfig {
            clip_norm: 0.7,
            noise_multiplier: 1.1,
            delta: 1e-6,
            noise_seed: Some(5),
        };
        let mut strategy = DpFedAvg::new(config.clone());
        assert_eq!(strategy.name(), "dp_fedavg");
        let global = leaf(vec![0.0; 3]);
        let instructions = strategy.configure(&ctx(9, 10, 100), 4, &global).unwrap();
        assert_eq!(
            instructions,
            ClientInstructions {
                learning_rate: 0.05,
                proximal_mu: 0.0,
                gradient_correction: None,
                update_clip_norm: Some(0.7),
            }
        );
        let model = leaf(vec![0.3, -0.2, 0.1]);
        let out = strategy
            .aggregate(&ctx(9, 10, 100), &global, &[update(1, &model)])
            .unwrap();
        let privacy = out.privacy.unwrap();
        assert_eq!(privacy.delta, 1e-6);
        assert_eq!(privacy.epsilon, epsilon_after(0.1, 1.1, 9, 1e-6));
        assert!(privacy.epsilon > 0.0 && privacy.epsilon.is_finite());
    }

    #[test]
    fn the_entropy_key_is_the_state_and_resumes_the_same_noise() {
        let global = leaf(vec![0.0; 16]);
        let model = leaf(vec![0.1; 16]);
        let mut first = DpFedAvg::new(DpFedAvgConfig::default());
        let mut other = DpFedAvg::new(DpFedAvgConfig::default());
        assert_ne!(first.key, other.key, "fresh keys come from entropy");
        let mut restored = DpFedAvg::new(DpFedAvgConfig::default());
        restored.restore(first.state()).unwrap();
        let step = |s: &mut DpFedAvg| {
            s.aggregate(&ctx(4, 2, 10), &global, &[update(0, &model)])
                .unwrap()
                .model
        };
        assert_eq!(step(&mut first), step(&mut restored));
        assert_ne!(step(&mut first), step(&mut other));
        let broken = StrategyState {
            scalars: serde_json::json!({ "noise_key": "zz" }),
            tensors: Default::default(),
        };
        assert!(restored.restore(broken).is_err());
    }

    #[test]
    fn the_strategy_divides_by_the_clients_asked() {
        let mut strategy = DpFedAvg::new(DpFedAvgConfig {
            noise_multiplier: 0.0,
            ..DpFedAvgConfig::default()
        });
        let global = leaf(vec![1.0, 1.0]);
        let (a, b) = (leaf(vec![1.4, 1.0]), leaf(vec![1.0, 0.8]));
        let out = strategy
            .aggregate(&ctx(1, 5, 50), &global, &[update(0, &a), update(1, &b)])
            .unwrap();
        // (0.4, 0) + (0, −0.2), both inside S = 1, over m = 5 (not 2).
        let next = values(&out.model.unwrap());
        assert!((next[0] - 1.08).abs() < 1e-6 && (next[1] - 0.96).abs() < 1e-6);
        // No noise, no privacy.
        assert_eq!(out.privacy.unwrap().epsilon, f64::INFINITY);
    }

    #[test]
    fn options_have_defaults_and_are_checked() {
        let run = RunShape {
            total_clients: 100,
            per_round: 10,
            min_per_round: 1,
            local_optimizer: "sgd",
        };
        let config: DpFedAvgConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(config, DpFedAvgConfig::default());
        assert_eq!(config.check(&run), Ok(()));
        assert!(serde_json::from_str::<DpFedAvgConfig>(r#"{"clip": 1}"#).is_err());

        let bad = |config: DpFedAvgConfig, run: &RunShape| config.check(run).unwrap_err().option;
        let with = |f: fn(&mut DpFedAvgConfig)| {
            let mut config = DpFedAvgConfig::default();
            f(&mut config);
            config
        };
        assert_eq!(bad(with(|c| c.clip_norm = 0.0), &run), "clip_norm");
        assert_eq!(
            bad(with(|c| c.clip_norm = f64::INFINITY), &run),
            "clip_norm"
        );
        assert_eq!(
            bad(with(|c| c.noise_multiplier = -1.0), &run),
            "noise_multiplier"
        );
        assert_eq!(
            bad(with(|c| c.noise_multiplier = f64::NAN), &run),
            "noise_multiplier"
        );
        assert_eq!(bad(with(|c| c.delta = 1.0), &run), "delta");
        assert_eq!(bad(with(|c| c.delta = 0.0), &run), "delta");
        let crowded = RunShape {
            per_round: 101,
            ..run
        };
        let error = DpFedAvgConfig::default().check(&crowded).unwrap_err();
        assert_eq!(error.option, "type");
        assert!(error.message.contains("101 / 100"), "{}", error.message);
    }
}
