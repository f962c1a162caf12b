//! A round aggregated one update at a time: the updates the round kept (in
//! memory, or on disk past `server.max_inflight_bytes`, `spill.rs`) are
//! read back in selection order and folded into FedAvg's mean
//! (`cohort_core::aggregate::MeanFold`, the same bits as `fedavg`), and the
//! strategy steps from the mean (`Strategy::aggregate_mean`). Only for
//! strategies whose aggregation is that mean's step
//! (`Strategy::aggregates_by_fedavg_mean`), so the model is the one
//! `RoundLoop::aggregate` would make, bit for bit.

use cohort_core::aggregate::{AggregationError, FedAvgOutcome, MeanFold};
use cohort_core::strategy::StrategyError;
use cohort_core::tree::ParamTree;

use super::{Aggregated, RoundLoop};
use crate::spill::UpdateStore;
use crate::updates::{Arrived, Collected};

impl RoundLoop<'_> {
    /// [`RoundLoop::aggregate`] for a round whose updates wait in `store`.
    pub(super) fn aggregate_folded(
        &mut self,
        round: u32,
        mut collected: Collected,
        mut store: UpdateStore,
    ) -> anyhow::Result<Aggregated> {
        let dropped = std::mem::take(&mut collected.failures);
        let mean = self.folded_mean(&mut collected.updates, &mut store)?;
        // The file goes as soon as every update is read back.
        drop(store);
        let before = self.strategy.state();
        let context = self.context(round);
        let aggregated = mean
            .map_err(StrategyError::from)
            .and_then(|mean| self.strategy.aggregate_mean(&context, &self.global, mean));
        let outcome = self.adopt(round, aggregated, before)?;
        if let Some(selected) = &outcome.selected {
            tracing::info!(round, clients = ?selected, "updates the strategy used");
        }
        let (reports, arrivals) = collected
            .updates
            .into_iter()
            .map(|arrived| (arrived.report, arrived.arrival))
            .unzip();
        Ok(Aggregated {
            reports,
            arrivals,
            dropped,
            privacy: outcome.privacy,
            secagg: None,
            simulated_end: collected.simulated_end,
        })
    }

    /// FedAvg's mean of `updates` (sample-weighted, `None` at zero total
    /// weight), each read back and folded in turn, so at most one update
    /// from disk is in memory at a time. The outer error is the spill
    /// file's; the inner one FedAvg's refusal, which `adopt` judges.
    fn folded_mean(
        &self,
        updates: &mut [Arrived],
        store: &mut UpdateStore,
    ) -> anyhow::Result<Result<Option<ParamTree>, AggregationError>> {
        let weights = updates
            .iter()
            .map(|arrived| (arrived.report.client_id, arrived.report.num_samples as f64))
            .collect();
        let mut fold = match MeanFold::new(&self.global, weights) {
            Ok(fold) => fold,
            Err(refused) => return Ok(Err(refused)),
        };
        for arrived in updates {
            let tree = store.take(arrived)?;
            if let Err(refused) = fold.add(&tree) {
                return Ok(Err(refused));
            }
        }
        Ok(fold.finish().map(|outcome| match outcome {
            FedAvgOutcome::Updated(mean) => Some(mean),
            FedAvgOutcome::Unchanged => None,
        }))
    }
}
