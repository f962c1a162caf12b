//! Byzantine-robust aggregation: the coordinate-wise median and trimmed mean
//! (Yin et al. 2018, "Byzantine-Robust Distributed Learning: Towards Optimal
//! Statistical Rates"), Krum and Multi-Krum (Blanchard et al. 2017, "Machine
//! Learning with Adversaries: Byzantine Tolerant Gradient Descent").
//!
//! Under FedAvg one client can move the global model anywhere it likes. These
//! rules bound what a few arbitrary ("Byzantine") updates can do, at the price
//! of some statistical efficiency when every client is honest.
//!
//! # Rules
//!
//! With `n` updates in the round:
//!
//! * **`median`**: per coordinate, the median of the `n` values; for an even
//!   `n`, the mean of the two middle values.
//! * **`trimmed_mean`** (option `beta`, in `[0, 0.5)`): per coordinate, drop
//!   the `k = ⌊beta · n⌋` smallest and the `k` largest values and average the
//!   `n − 2k` that remain. `beta = 0` is the plain unweighted mean.
//! * **`krum`** (option `byzantine`, `f`): the score of update `i` is the sum
//!   of the squared L2 distances from `i` to its `n − f − 2` nearest other
//!   updates; the update with the lowest score becomes the global model. Needs
//!   `n ≥ 2f + 3`.
//! * **`multi_krum`** (options `byzantine` and `selected`, `m`, default
//!   `n − f`): the `m` updates with the lowest Krum scores, scored once over all
//!   `n`, averaged.
//!
//! All four are **unweighted**: sample counts are reported by the clients
//! themselves, and a Byzantine client could claim a huge count to dominate any
//! weighted rule.
//!
//! Clients send models, not deltas. Krum measures distances between the
//! models; since every client started from the same global model `g`,
//! `‖wᵢ − wⱼ‖ = ‖(wᵢ − g) − (wⱼ − g)‖`, so these are the distances between the
//! deltas the paper scores, and picking a model picks its delta.
//!
//! Only float leaves are aggregated, and every value must be finite (a NaN
//! would poison every comparison); otherwise the round is refused and the
//! global model is unchanged, as for every error here. The new model has the
//! global model's dtypes.
//!
//! # Determinism
//!
//! Sums and means are accumulated in float64. The median and the trimmed mean
//! do not depend on the order of the updates, bit for bit: values are ordered
//! with `f32::total_cmp` and summed in ascending order. Krum's distances are
//! summed in ascending order too, and equal scores go to the earlier update in
//! selection order.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::flat::{FlatRound, flatten_round, mean};
use super::registry::{OptionError, RunShape};
use super::{Aggregated, ClientUpdate, RoundContext, Strategy, StrategyError};
use crate::tree::ParamTree;

/// Models with at least this many elements are split across threads.
const PARALLEL_MIN_ELEMENTS: usize = 1 << 16;
/// Coordinates per task, each task reusing one scratch buffer.
const BLOCK_ELEMENTS: usize = 1 << 12;

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------

/// `type = "median"`: no options.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MedianConfig {}

/// `type = "trimmed_mean"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrimmedMeanConfig {
    /// Fraction of the updates trimmed from each side of every coordinate, in
    /// `[0, 0.5)`: `⌊beta · n⌋` smallest and as many largest values are
    /// dropped. Set it at least to the expected fraction of Byzantine clients.
    pub beta: f64,
}

impl Default for TrimmedMeanConfig {
    fn default() -> Self {
        Self { beta: 0.1 }
    }
}

impl TrimmedMeanConfig {
    /// `beta` is a fraction below one half, and a round of the fewest updates
    /// the run allows keeps at least one value per coordinate.
    pub fn check(&self, run: &RunShape) -> Result<(), OptionError> {
        let beta = self.beta;
        if !(beta.is_finite() && (0.0..0.5).contains(&beta)) {
            return Err(OptionError {
                option: "beta",
                message: format!("must be a fraction in [0, 0.5), got {beta}"),
            });
        }
        // Below one half, trimmed_per_side always leaves a value; the trap is
        // the other end: a beta that trims nothing from the smallest rounds
        // would be a plain mean there, without a word.
        let n = run.min_per_round as usize;
        if beta > 0.0 && trimmed_per_side(beta, n) == 0 {
            return Err(OptionError {
                option: "beta",
                message: format!(
                    "beta = {beta} trims nothing from a round of clients.min_per_round = {n} \
                     updates (⌊beta · n⌋ = 0), which would make it a plain mean; raise beta to \
                     at least {:.3} or set beta = 0 for the mean on purpose",
                    1.0 / n.max(1) as f64
                ),
            });
        }
        Ok(())
    }
}

/// `type = "krum"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KrumConfig {
    /// `f`: how many Byzantine clients a round is assumed to hold at most.
    /// Every round needs at least `2f + 3` updates.
    pub byzantine: u32,
}

impl Default for KrumConfig {
    fn default() -> Self {
        Self { byzantine: 1 }
    }
}

impl KrumConfig {
    /// Every round the run allows has the `2f + 3` updates Krum needs.
    pub fn check(&self, run: &RunShape) -> Result<(), OptionError> {
        check_byzantine(self.byzantine, run)
    }
}

/// `type = "multi_krum"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MultiKrumConfig {
    /// `f`: how many Byzantine clients a round is assumed to hold at most.
    /// Every round needs at least `2f + 3` updates.
    pub byzantine: u32,
    /// `m`: how many updates with the best Krum scores are averaged; default
    /// `n − f` for a round of `n` updates.
    pub selected: Option<u32>,
}

impl Default for MultiKrumConfig {
    fn default() -> Self {
        Self {
            byzantine: 1,
            selected: None,
        }
    }
}

impl MultiKrumConfig {
    /// As [`KrumConfig::check`], and `selected` is at least 1 and no more than
    /// the fewest updates a round may have (`clients.min_per_round`, itself at
    /// most `per_round`), so no round fails for lack of updates.
    pub fn check(&self, run: &RunShape) -> Result<(), OptionError> {
        check_byzantine(self.byzantine, run)?;
        match self.selected {
            Some(0) => Err(OptionError {
                option: "selected",
                message: "must be at least 1: Multi-Krum averages the selected updates".to_owned(),
            }),
            Some(m) if m > run.min_per_round => Err(OptionError {
                option: "selected",
                message: format!(
                    "selected = {m} updates cannot be picked from a round of \
                     clients.min_per_round = {} updates; lower selected or raise \
                     clients.min_per_round",
                    run.min_per_round
                ),
            }),
            _ => Ok(()),
        }
    }
}

fn check_byzantine(byzantine: u32, run: &RunShape) -> Result<(), OptionError> {
    let needed = krum_minimum(byzantine as usize);
    if (run.min_per_round as usize) < needed {
        return Err(OptionError {
            option: "byzantine",
            message: format!(
                "byzantine = {byzantine} needs at least 2f + 3 = {needed} updates in every \
                 round, but clients.min_per_round is {}; lower byzantine or raise \
                 clients.min_per_round",
                run.min_per_round
            ),
        });
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The math, on flat vectors
// ---------------------------------------------------------------------------

/// Coordinate-wise median of equally long vectors, at least one.
///
/// # Panics
/// When `updates` is empty or the lengths differ.
pub fn median(updates: &[&[f32]]) -> Vec<f32> {
    per_coordinate(updates, median_of)
}

fn median_of(values: &mut [f32]) -> f32 {
    let count = values.len();
    let (lower, &mut upper_middle, _) = values.select_nth_unstable_by(count / 2, f32::total_cmp);
    if count % 2 == 1 {
        return upper_middle;
    }
    // The selection leaves the lower half unordered; its largest value is the
    // other middle one.
    let lower_middle = lower
        .iter()
        .copied()
        .max_by(f32::total_cmp)
        .expect("an even count of at least two has a lower half");
    ((lower_middle as f64 + upper_middle as f64) / 2.0) as f32
}

/// How many values the trimmed mean drops from each side of `n`: `⌊beta · n⌋`.
pub fn trimmed_per_side(beta: f64, n: usize) -> usize {
    // beta is written in decimal and multiplied in binary: 0.29 · 100 comes out
    // as 28.999999999999996. A relative nudge far above float64 rounding and
    // far below any step a person writes recovers the count they expect.
    // NaN and negative beta saturate to 0.
    let trim = (beta * n as f64 * (1.0 + 1e-12)).floor() as usize;
    if beta < 0.5 {
        // ⌊beta · n⌋ < n / 2 for every beta below one half; the nudge must not
        // push a beta a hair under 0.5 to n / 2.
        trim.min(n.saturating_sub(1) / 2)
    } else {
        trim
    }
}

/// Coordinate-wise mean after dropping the `trim` smallest and `trim` largest
/// values of each coordinate.
///
/// # Panics
/// When fewer than `2 · trim + 1` vectors are given or the lengths differ.
pub fn trimmed_mean(updates: &[&[f32]], trim: usize) -> Vec<f32> {
    assert!(
        updates.len() > 2 * trim,
        "trimming {trim} per side of {} values leaves none",
        updates.len()
    );
    per_coordinate(updates, |values| {
        // A full sort rather than two selections: the kept values must be
        // summed in one canonical order for the result not to depend on the
        // order of the updates, and ordering them is most of a sort anyway.
        values.sort_unstable_by(f32::total_cmp);
        let kept = &values[trim..values.len() - trim];
        let sum: f64 = kept.iter().map(|&x| x as f64).sum();
        (sum / kept.len() as f64) as f32
    })
}

/// `reduce` applied to each coordinate's values across `updates`, gathered
/// into a scratch buffer that `reduce` may reorder.
fn per_coordinate<F>(updates: &[&[f32]], reduce: F) -> Vec<f32>
where
    F: Fn(&mut [f32]) -> f32 + Sync,
{
    let len = common_len(updates);
    let fill = |(block_index, block): (usize, &mut [f32])| {
        let start = block_index * BLOCK_ELEMENTS;
        let mut scratch = vec![0.0f32; updates.len()];
        for (offset, out) in block.iter_mut().enumerate() {
            for (slot, update) in scratch.iter_mut().zip(updates) {
                *slot = update[start + offset];
            }
            *out = reduce(&mut scratch);
        }
    };
    let mut out = vec![0.0f32; len];
    if len >= PARALLEL_MIN_ELEMENTS {
        out.par_chunks_mut(BLOCK_ELEMENTS)
            .enumerate()
            .for_each(fill);
    } else {
        out.chunks_mut(BLOCK_ELEMENTS).enumerate().for_each(fill);
    }
    out
}

fn common_len(updates: &[&[f32]]) -> usize {
    let len = updates.first().expect("at least one update").len();
    assert!(
        updates.iter().all(|u| u.len() == len),
        "updates of different lengths"
    );
    len
}

/// Updates Krum needs to tolerate `byzantine` of them: `2f + 3`.
pub fn krum_minimum(byzantine: usize) -> usize {
    2 * byzantine + 3
}

/// Krum's score of every update: the sum of the squared L2 distances to its
/// `n − f − 2` nearest other updates, in float64.
///
/// # Panics
/// When fewer than [`krum_minimum`] vectors are given or the lengths differ.
pub fn krum_scores(updates: &[&[f32]], byzantine: usize) -> Vec<f64> {
    let n = updates.len();
    assert!(
        n >= krum_minimum(byzantine),
        "Krum with f = {byzantine} needs at least {} updates, got {n}",
        krum_minimum(byzantine)
    );
    common_len(updates); // for its length check
    let pairs: Vec<(usize, usize)> = (0..n)
        .flat_map(|i| (i + 1..n).map(move |j| (i, j)))
        .collect();
    // The O(n² · d) part: one pair per task, each distance summed serially so
    // it does not depend on the thread count.
    let distances: Vec<f64> = pairs
        .par_iter()
        .map(|&(i, j)| squared_distance(updates[i], updates[j]))
        .collect();
    let mut matrix = vec![0.0f64; n * n];
    for (&(i, j), &d) in pairs.iter().zip(&distances) {
        matrix[i * n + j] = d;
        matrix[j * n + i] = d;
    }
    let neighbours = n - byzantine - 2;
    (0..n)
        .map(|i| {
            let mut row: Vec<f64> = (0..n)
                .filter(|&j| j != i)
                .map(|j| matrix[i * n + j])
                .collect();
            // Sorted, not selected: the nearest are then summed in one order
            // whatever the order of the updates.
            row.sort_unstable_by(f64::total_cmp);
            row[..neighbours].iter().sum()
        })
        .collect()
}

fn squared_distance(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| {
            let d = x as f64 - y as f64;
            d * d
        })
        .sum()
}

/// The index of the update Krum picks: the lowest score, the earliest on ties.
///
/// # Panics
/// As [`krum_scores`].
pub fn krum(updates: &[&[f32]], byzantine: usize) -> usize {
    multi_krum(updates, byzantine, 1)[0]
}

/// The indices of the `selected` updates with the lowest Krum scores, best
/// first, the earlier update first on equal scores.
///
/// # Panics
/// As [`krum_scores`], and when `selected` is 0 or more than the updates.
pub fn multi_krum(updates: &[&[f32]], byzantine: usize, selected: usize) -> Vec<usize> {
    assert!(
        (1..=updates.len()).contains(&selected),
        "Multi-Krum cannot select {selected} of {} updates",
        updates.len()
    );
    let scores = krum_scores(updates, byzantine);
    let mut order: Vec<usize> = (0..updates.len()).collect();
    // Stable, so equal scores keep selection order.
    order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    order.truncate(selected);
    order
}

// ---------------------------------------------------------------------------
// The strategies
// ---------------------------------------------------------------------------

/// Coordinate-wise median. See the module documentation.
#[derive(Debug, Clone, Copy, Default)]
pub struct Median;

/// Why the robust rules refuse asynchronous runs.
const ROBUST_ASYNC: &str = "its guarantee counts Byzantine updates among honest ones trained from \
     one global model; a buffer of updates from different versions differs by staleness, which \
     a rule by distances or ranks reads as attack";

impl Strategy for Median {
    fn name(&self) -> &'static str {
        "median"
    }

    fn asynchronous(&self) -> Result<(), String> {
        Err(ROBUST_ASYNC.to_owned())
    }

    fn aggregate(
        &mut self,
        ctx: &RoundContext,
        global: &ParamTree,
        updates: &[ClientUpdate<'_>],
    ) -> Result<Aggregated, StrategyError> {
        require(self.name(), ctx, 1, updates.len(), String::new())?;
        let round = flatten_round(self.name(), global, updates)?;
        let values = median(&slices(&round));
        Ok(Aggregated::model(round.layout.rebuild(global, &values)))
    }
}

/// Coordinate-wise trimmed mean. See the module documentation.
#[derive(Debug, Clone)]
pub struct TrimmedMean {
    config: TrimmedMeanConfig,
}

impl TrimmedMean {
    /// Trusts a checked config: a `beta` of one half or more makes rounds with
    /// too few updates fail instead.
    pub fn new(config: TrimmedMeanConfig) -> Self {
        Self { config }
    }
}

impl Strategy for TrimmedMean {
    fn name(&self) -> &'static str {
        "trimmed_mean"
    }

    fn asynchronous(&self) -> Result<(), String> {
        Err(ROBUST_ASYNC.to_owned())
    }

    fn aggregate(
        &mut self,
        ctx: &RoundContext,
        global: &ParamTree,
        updates: &[ClientUpdate<'_>],
    ) -> Result<Aggregated, StrategyError> {
        let beta = self.config.beta;
        let trim = trimmed_per_side(beta, updates.len());
        let why = format!(" (beta = {beta} trims {trim} per side)");
        require(self.name(), ctx, 2 * trim + 1, updates.len(), why)?;
        let round = flatten_round(self.name(), global, updates)?;
        let values = trimmed_mean(&slices(&round), trim);
        Ok(Aggregated::model(round.layout.rebuild(global, &values)))
    }
}

/// Krum: the update closest to its neighbours becomes the global model. See
/// the module documentation.
#[derive(Debug, Clone)]
pub struct Krum {
    config: KrumConfig,
}

impl Krum {
    pub fn new(config: KrumConfig) -> Self {
        Self { config }
    }
}

impl Strategy for Krum {
    fn name(&self) -> &'static str {
        "krum"
    }

    fn asynchronous(&self) -> Result<(), String> {
        Err(ROBUST_ASYNC.to_owned())
    }

    fn aggregate(
        &mut self,
        ctx: &RoundContext,
        global: &ParamTree,
        updates: &[ClientUpdate<'_>],
    ) -> Result<Aggregated, StrategyError> {
        let f = self.config.byzantine as usize;
        require_krum(self.name(), ctx, f, updates.len())?;
        let round = flatten_round(self.name(), global, updates)?;
        let chosen = krum(&slices(&round), f);
        Ok(Aggregated {
            selected: Some(vec![updates[chosen].client_id]),
            ..Aggregated::model(round.layout.rebuild(global, &round.updates[chosen]))
        })
    }
}

/// Multi-Krum: the mean of the updates with the best Krum scores. See the
/// module documentation.
#[derive(Debug, Clone)]
pub struct MultiKrum {
    config: MultiKrumConfig,
}

impl MultiKrum {
    /// # Panics
    /// When `config.selected` is `Some(0)`, which [`MultiKrumConfig::check`]
    /// refuses: there is no mean of nothing.
    pub fn new(config: MultiKrumConfig) -> Self {
        assert_ne!(
            config.selected,
            Some(0),
            "multi_krum: selected = 0 picks no update"
        );
        Self { config }
    }
}

impl Strategy for MultiKrum {
    fn name(&self) -> &'static str {
        "multi_krum"
    }

    fn asynchronous(&self) -> Result<(), String> {
        Err(ROBUST_ASYNC.to_owned())
    }

    fn aggregate(
        &mut self,
        ctx: &RoundContext,
        global: &ParamTree,
        updates: &[ClientUpdate<'_>],
    ) -> Result<Aggregated, StrategyError> {
        let f = self.config.byzantine as usize;
        let n = updates.len();
        require_krum(self.name(), ctx, f, n)?;
        let m = match self.config.selected {
            Some(m) => {
                let m = m as usize;
                require(self.name(), ctx, m, n, format!(" (selected = {m})"))?;
                m
            }
            None => n - f,
        };
        let round = flatten_round(self.name(), global, updates)?;
        let chosen = multi_krum(&slices(&round), f, m);
        let vectors: Vec<&[f32]> = chosen.iter().map(|&i| &round.updates[i][..]).collect();
        Ok(Aggregated {
            selected: Some(chosen.iter().map(|&i| updates[i].client_id).collect()),
            ..Aggregated::model(round.layout.rebuild(global, &mean(&vectors)))
        })
    }
}

fn slices(round: &FlatRound) -> Vec<&[f32]> {
    round.updates.iter().map(Vec::as_slice).collect()
}

fn require(
    strategy: &'static str,
    ctx: &RoundContext,
    needed: usize,
    got: usize,
    why: String,
) -> Result<(), StrategyError> {
    if got < needed {
        return Err(StrategyError::TooFewUpdates {
            strategy,
            round: ctx.round,
            needed,
            got,
            why,
        });
    }
    Ok(())
}

fn require_krum(
    strategy: &'static str,
    ctx: &RoundContext,
    byzantine: usize,
    got: usize,
) -> Result<(), StrategyError> {
    let why = format!(" (f = {byzantine} Byzantine clients need n ≥ 2f + 3)");
    require(strategy, ctx, krum_minimum(byzantine), got, why)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::AlgorithmConfig;
    use crate::tree::strategies::same_schema_f32_trees;
    use crate::tree::{Array, DTypeRule, check_schema};
    use proptest::prelude::{Just, prop_assert, prop_assert_eq, proptest};
    use proptest::strategy::Strategy as _;

    fn tree(values: &[f32]) -> ParamTree {
        ParamTree::from_dotted([(
            "w".to_owned(),
            Array::f32(vec![values.len()], values.to_vec()).unwrap(),
        )])
    }

    fn ctx() -> RoundContext {
        RoundContext {
            round: 3,
            learning_rate: 0.1,
            per_round: 10,
            total_clients: 20,
        }
    }

    /// Client `i` has id `10 + i` and `100 · (i + 1)` samples: weighting by
    /// samples would change every hand-computed result below.
    fn aggregate_trees(
        strategy: &mut dyn Strategy,
        global: &ParamTree,
        trees: &[ParamTree],
    ) -> Result<Aggregated, StrategyError> {
        let updates: Vec<ClientUpdate<'_>> = trees
            .iter()
            .enumerate()
            .map(|(i, tree)| ClientUpdate {
                client_id: 10 + i as u32,
                num_samples: 100 * (i as u64 + 1),
                local_steps: 1,
                tree,
            })
            .collect();
        strategy.aggregate(&ctx(), global, &updates)
    }

    fn aggregate(
        strategy: &mut dyn Strategy,
        clients: &[&[f32]],
    ) -> Result<Aggregated, StrategyError> {
        let trees: Vec<ParamTree> = clients.iter().map(|c| tree(c)).collect();
        let global = tree(&vec![0.0; clients.first().map_or(1, |c| c.len())]);
        aggregate_trees(strategy, &global, &trees)
    }

    fn values(aggregated: &Aggregated) -> Vec<f32> {
        let model = aggregated.model.as_ref().expect("a new model");
        model.leaves()[0].1.as_f32().unwrap().to_vec()
    }

    fn run(min_per_round: u32) -> RunShape {
        RunShape {
            total_clients: 20,
            per_round: 10,
            min_per_round,
            local_optimizer: "sgd",
        }
    }

    /// Five points in the plane: the outlier first, then a tight cluster
    /// around (0.5, 0.5). Squared distances:
    ///
    /// ```text
    ///            c0=(10,10)  c1=(0,0)  c2=(1,0)  c3=(.5,.5)  c4=(0,1)
    /// c0              -        200       181       180.5       181
    /// c1            200         -         1         0.5          1
    /// c2            181         1         -         0.5          2
    /// c3            180.5       0.5       0.5        -          0.5
    /// c4            181         1         2         0.5          -
    /// ```
    ///
    /// With f = 1 each score sums the n − f − 2 = 2 nearest: c0 180.5 + 181 =
    /// 361.5, c1 0.5 + 1 = 1.5, c2 0.5 + 1 = 1.5, c3 0.5 + 0.5 = 1, c4 0.5 + 1
    /// = 1.5. Best first: c3, then c1, c2, c4 (tied, selection order), then c0.
    const PLANE: [&[f32]; 5] = [
        &[10.0, 10.0],
        &[0.0, 0.0],
        &[1.0, 0.0],
        &[0.5, 0.5],
        &[0.0, 1.0],
    ];

    #[test]
    fn median_of_three_ignores_the_outlier() {
        // Column 0 sorted: 1, 2, 1000 → 2. Column 1 sorted: −1000, 4, 5 → 4.
        let out = aggregate(&mut Median, &[&[1.0, 4.0], &[2.0, 5.0], &[1000.0, -1000.0]]).unwrap();
        assert_eq!(values(&out), [2.0, 4.0]);
        assert_eq!(out.selected, None);
    }

    #[test]
    fn median_of_an_even_count_averages_the_middle_two() {
        // Column 0 sorted: 1, 2, 3, 100 → (2 + 3) / 2 = 2.5.
        // Column 1 sorted: −1, 0, 7, 8 → (0 + 7) / 2 = 3.5.
        let clients: [&[f32]; 4] = [&[1.0, -1.0], &[3.0, 0.0], &[2.0, 7.0], &[100.0, 8.0]];
        let out = aggregate(&mut Median, &clients).unwrap();
        assert_eq!(values(&out), [2.5, 3.5]);
    }

    #[test]
    fn trimmed_mean_of_five_drops_one_per_side() {
        // beta = 0.2, n = 5: k = ⌊0.2 · 5⌋ = 1.
        // Column 0 sorted: −1000, 1, 2, 3, 4 → mean(1, 2, 3) = 2.
        // Column 1 sorted: 10, 20, 30, 40, 1000 → mean(20, 30, 40) = 30.
        let clients: [&[f32]; 5] = [
            &[1.0, 10.0],
            &[2.0, 20.0],
            &[3.0, 30.0],
            &[4.0, 40.0],
            &[-1000.0, 1000.0],
        ];
        let mut strategy = TrimmedMean::new(TrimmedMeanConfig { beta: 0.2 });
        assert_eq!(
            values(&aggregate(&mut strategy, &clients).unwrap()),
            [2.0, 30.0]
        );
    }

    #[test]
    fn krum_picks_the_update_nearest_its_neighbours() {
        // See PLANE: c3 scores 1, the lowest.
        let mut strategy = Krum::new(KrumConfig { byzantine: 1 });
        let out = aggregate(&mut strategy, &PLANE).unwrap();
        assert_eq!(values(&out), [0.5, 0.5]);
        assert_eq!(out.selected, Some(vec![13]));
        assert_eq!(krum_scores(&PLANE, 1), [361.5, 1.5, 1.5, 1.0, 1.5]);
    }

    #[test]
    fn krum_ties_go_to_the_earliest_update() {
        // The unit square's corners each have two neighbours at squared
        // distance 1: all four score 1 + 1 = 2; (1, 1) comes first.
        let clients: [&[f32]; 5] = [
            &[10.0, 10.0],
            &[1.0, 1.0],
            &[0.0, 0.0],
            &[1.0, 0.0],
            &[0.0, 1.0],
        ];
        let out = aggregate(&mut Krum::new(KrumConfig::default()), &clients).unwrap();
        assert_eq!(values(&out), [1.0, 1.0]);
        assert_eq!(out.selected, Some(vec![11]));
    }

    #[test]
    fn multi_krum_averages_the_best_scores() {
        // Default m = n − f = 4: c3, c1, c2, c4.
        // Mean: ((0.5 + 0 + 1 + 0) / 4, (0.5 + 0 + 0 + 1) / 4) = (0.375, 0.375).
        let mut strategy = MultiKrum::new(MultiKrumConfig::default());
        let out = aggregate(&mut strategy, &PLANE).unwrap();
        assert_eq!(values(&out), [0.375, 0.375]);
        assert_eq!(out.selected, Some(vec![13, 11, 12, 14]));

        // m = 2: c3 and c1, mean (0.25, 0.25).
        let mut strategy = MultiKrum::new(MultiKrumConfig {
            byzantine: 1,
            selected: Some(2),
        });
        let out = aggregate(&mut strategy, &PLANE).unwrap();
        assert_eq!(values(&out), [0.25, 0.25]);
        assert_eq!(out.selected, Some(vec![13, 11]));
    }

    #[test]
    fn krum_refuses_fewer_than_2f_plus_3_updates() {
        let error = aggregate(&mut Krum::new(KrumConfig { byzantine: 2 }), &PLANE);
        assert_eq!(
            error.unwrap_err().to_string(),
            "krum needs at least 7 updates in a round (f = 2 Byzantine clients need \
             n ≥ 2f + 3), but round 3 has 5"
        );
        let error = aggregate(&mut MultiKrum::new(MultiKrumConfig::default()), &PLANE[..4]);
        assert_eq!(
            error.unwrap_err().to_string(),
            "multi_krum needs at least 5 updates in a round (f = 1 Byzantine clients need \
             n ≥ 2f + 3), but round 3 has 4"
        );
    }

    #[test]
    fn multi_krum_refuses_to_select_more_than_arrived() {
        let mut strategy = MultiKrum::new(MultiKrumConfig {
            byzantine: 1,
            selected: Some(6),
        });
        assert_eq!(
            aggregate(&mut strategy, &PLANE).unwrap_err().to_string(),
            "multi_krum needs at least 6 updates in a round (selected = 6), but round 3 has 5"
        );
    }

    #[test]
    fn trimmed_mean_refuses_a_round_it_would_trim_away() {
        // An unchecked beta = 0.5 trims ⌊0.5 · 4⌋ = 2 per side of 4: none left.
        let mut strategy = TrimmedMean::new(TrimmedMeanConfig { beta: 0.5 });
        let error = aggregate(&mut strategy, &PLANE[..4]).unwrap_err();
        assert_eq!(
            error.to_string(),
            "trimmed_mean needs at least 5 updates in a round (beta = 0.5 trims 2 per side), \
             but round 3 has 4"
        );
    }

    #[test]
    fn an_empty_round_is_refused_not_a_panic() {
        let error = aggregate(&mut Median, &[]).unwrap_err();
        assert!(
            matches!(
                error,
                StrategyError::TooFewUpdates {
                    needed: 1,
                    got: 0,
                    ..
                }
            ),
            "{error}"
        );
    }

    #[test]
    fn non_finite_values_are_refused_by_every_strategy() {
        let mut clients = PLANE;
        clients[2] = &[f32::NAN, 0.0];
        clients[4] = &[0.0, f32::INFINITY];
        for mut strategy in all_strategies() {
            let error = aggregate(strategy.as_mut(), &clients).unwrap_err();
            assert_eq!(
                error.to_string(),
                "client 12: element 0 of the update is NaN",
                "{}",
                strategy.name()
            );
        }
    }

    #[test]
    fn names_match_the_algorithm_types() {
        let configs = [
            AlgorithmConfig::Median(MedianConfig::default()),
            AlgorithmConfig::TrimmedMean(TrimmedMeanConfig::default()),
            AlgorithmConfig::Krum(KrumConfig::default()),
            AlgorithmConfig::MultiKrum(MultiKrumConfig::default()),
        ];
        for config in configs {
            assert_eq!(config.build().unwrap().name(), config.name());
        }
    }

    #[test]
    fn options_have_defaults_and_refuse_unknown_keys() {
        assert_eq!(toml::from_str::<TrimmedMeanConfig>("").unwrap().beta, 0.1);
        assert_eq!(toml::from_str::<KrumConfig>("").unwrap().byzantine, 1);
        assert_eq!(
            toml::from_str::<MultiKrumConfig>("selected = 3").unwrap(),
            MultiKrumConfig {
                byzantine: 1,
                selected: Some(3)
            }
        );
        assert!(toml::from_str::<KrumConfig>("f = 2").is_err());
        assert!(toml::from_str::<MedianConfig>("beta = 0.1").is_err());
    }

    #[test]
    fn trimmed_mean_check_wants_beta_in_0_to_half() {
        for beta in [0.0, 0.1, 0.49] {
            assert_eq!(TrimmedMeanConfig { beta }.check(&run(10)), Ok(()), "{beta}");
        }
        // 0.1 of 9 updates trims nothing: refused, not a silent plain mean.
        let error = TrimmedMeanConfig { beta: 0.1 }.check(&run(9)).unwrap_err();
        assert!(error.message.contains("trims nothing"), "{}", error.message);
        for beta in [-0.1, 0.5, 0.7, f64::NAN, f64::INFINITY] {
            let error = TrimmedMeanConfig { beta }.check(&run(5)).unwrap_err();
            assert_eq!(error.option, "beta");
            assert!(error.message.contains("[0, 0.5)"), "{}", error.message);
        }
    }

    #[test]
    fn krum_checks_want_2f_plus_3_updates_per_round() {
        assert_eq!(KrumConfig { byzantine: 1 }.check(&run(5)), Ok(()));
        let error = KrumConfig { byzantine: 2 }.check(&run(6)).unwrap_err();
        assert_eq!(error.option, "byzantine");
        assert_eq!(
            error.message,
            "byzantine = 2 needs at least 2f + 3 = 7 updates in every round, but \
             clients.min_per_round is 6; lower byzantine or raise clients.min_per_round"
        );
        let multi = MultiKrumConfig {
            byzantine: 2,
            selected: None,
        };
        assert_eq!(multi.check(&run(6)).unwrap_err().option, "byzantine");
        assert_eq!(multi.check(&run(7)), Ok(()));
    }

    #[test]
    fn multi_krum_check_wants_selected_within_the_smallest_round() {
        let with = |selected| MultiKrumConfig {
            byzantine: 1,
            selected: Some(selected),
        };
        assert_eq!(with(1).check(&run(5)), Ok(()));
        assert_eq!(with(5).check(&run(5)), Ok(()));
        let error = with(0).check(&run(5)).unwrap_err();
        assert_eq!(error.option, "selected");
        let error = with(6).check(&run(5)).unwrap_err();
        assert_eq!(error.option, "selected");
        assert!(
            error.message.contains("min_per_round = 5"),
            "{}",
            error.message
        );
    }

    #[test]
    #[should_panic(expected = "selected = 0")]
    fn multi_krum_of_zero_cannot_be_built() {
        MultiKrum::new(MultiKrumConfig {
            byzantine: 1,
            selected: Some(0),
        });
    }

    #[test]
    fn trimming_counts_beta_as_written_in_decimal() {
        assert_eq!(trimmed_per_side(0.1, 10), 1);
        assert_eq!(trimmed_per_side(0.1, 9), 0);
        assert_eq!(trimmed_per_side(0.3, 10), 3);
        // 0.29 · 100 is 28.999999999999996 in float64.
        assert_eq!(trimmed_per_side(0.29, 100), 29);
        assert_eq!(trimmed_per_side(0.57, 100), 57);
        assert_eq!(trimmed_per_side(0.5 - 1e-15, 2), 0);
        assert_eq!(trimmed_per_side(0.0, 7), 0);
    }

    fn all_strategies() -> Vec<Box<dyn Strategy>> {
        vec![
            Box::new(Median),
            Box::new(TrimmedMean::new(TrimmedMeanConfig { beta: 0.2 })),
            Box::new(Krum::new(KrumConfig { byzantine: 1 })),
            Box::new(MultiKrum::new(MultiKrumConfig::default())),
        ]
    }

    /// `count` clients (a range) of `len` coordinates (a range), each in ±100.
    fn client_vectors(
        count: std::ops::Range<usize>,
        len: std::ops::Range<usize>,
    ) -> impl proptest::strategy::Strategy<Value = Vec<Vec<f32>>> {
        (count, len).prop_flat_map(|(count, len)| {
            proptest::collection::vec(proptest::collection::vec(-100.0f32..100.0, len), count)
        })
    }

    fn as_slices(clients: &[Vec<f32>]) -> Vec<&[f32]> {
        clients.iter().map(Vec::as_slice).collect()
    }

    proptest! {
        #[test]
        fn trimmed_mean_with_nothing_trimmed_is_the_mean(clients in client_vectors(1..8, 1..5)) {
            let slices = as_slices(&clients);
            let scale = clients.iter().flatten().fold(1.0f32, |m, x| m.max(x.abs()));
            for (got, want) in trimmed_mean(&slices, 0).iter().zip(mean(&slices)) {
                prop_assert!((got - want).abs() <= 1e-5 * scale, "{got} vs {want}");
            }
        }

        #[test]
        fn median_and_trimmed_mean_ignore_client_order(
            (clients, shuffled) in client_vectors(1..8, 1..5)
                .prop_flat_map(|c| (Just(c.clone()), Just(c).prop_shuffle())),
            beta in 0.0f64..0.5,
        ) {
            let (a, b) = (as_slices(&clients), as_slices(&shuffled));
            prop_assert_eq!(median(&a), median(&b));
            let trim = trimmed_per_side(beta, a.len());
            prop_assert_eq!(trimmed_mean(&a, trim), trimmed_mean(&b, trim));
        }

        #[test]
        fn median_and_trimmed_mean_of_identical_inputs_are_that_input(
            one in proptest::collection::vec(-100.0f32..100.0, 1..5),
            count in 1usize..8,
        ) {
            let copies = vec![one.as_slice(); count];
            prop_assert_eq!(&median(&copies), &one);
            prop_assert_eq!(&trimmed_mean(&copies, (count - 1) / 2), &one);
        }

        #[test]
        fn krum_returns_one_of_the_inputs_with_the_best_score(
            (clients, byzantine) in client_vectors(3..9, 1..4)
                .prop_flat_map(|c| { let most = (c.len() - 3) / 2; (Just(c), 0..=most) }),
        ) {
            let slices = as_slices(&clients);
            let mut strategy = Krum::new(KrumConfig { byzantine: byzantine as u32 });
            let out = aggregate(&mut strategy, &slices).unwrap();
            let chosen = out.selected.as_ref().unwrap()[0] as usize - 10;
            prop_assert_eq!(&values(&out), &clients[chosen]);
            let scores = krum_scores(&slices, byzantine);
            prop_assert!(scores.iter().all(|&s| s >= scores[chosen]));
            prop_assert!(scores[..chosen].iter().all(|&s| s > scores[chosen]));
        }

        #[test]
        fn multi_krum_of_one_is_krum(
            (clients, byzantine) in client_vectors(3..9, 1..4)
                .prop_flat_map(|c| { let most = (c.len() - 3) / 2; (Just(c), 0..=most) }),
        ) {
            let slices = as_slices(&clients);
            let f = byzantine as u32;
            let krum = aggregate(&mut Krum::new(KrumConfig { byzantine: f }), &slices).unwrap();
            let mut multi = MultiKrum::new(MultiKrumConfig { byzantine: f, selected: Some(1) });
            let multi = aggregate(&mut multi, &slices).unwrap();
            prop_assert_eq!(krum, multi);
        }

        #[test]
        fn every_strategy_keeps_the_global_schema(trees in same_schema_f32_trees(5)) {
            for mut strategy in all_strategies() {
                let out = aggregate_trees(strategy.as_mut(), &trees[0], &trees).unwrap();
                let model = out.model.unwrap();
                prop_assert!(check_schema(&trees[0], &model, DTypeRule::Exact).is_ok());
            }
        }
    }
}
