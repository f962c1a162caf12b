//! `cluster.reduce = partial`: each rank reduces its own updates to one
//! partial sum, the ranks swap partials (and rows), and every rank adds them
//! in rank order, so the mean is the same on every rank and equal to a
//! single process's.

use anyhow::Context;

use cohort_core::strategy::ClientUpdate;

use super::{Aggregated, RoundLoop};
use crate::updates::{Collected, Dropped, shared_drop, shared_row, unshared_row};

impl RoundLoop<'_> {
    /// `cluster.reduce = partial`: this rank's checked updates become one
    /// partial sum; the ranks swap partials and rows, and every rank adds the
    /// partials in rank order into the round's mean and the strategy's step.
    pub(super) fn reduce_partials(
        &mut self,
        round: u32,
        selected: usize,
        mut collected: Collected,
    ) -> anyhow::Result<Aggregated> {
        use cohort_core::strategy::partial::{PartialSum, combine, partial_layout};
        let dropped = std::mem::take(&mut collected.failures);
        let updates: Vec<ClientUpdate<'_>> = collected
            .updates
            .iter()
            .map(|a| ClientUpdate {
                client_id: a.report.client_id,
                num_samples: a.report.num_samples,
                local_steps: a.report.local_steps,
                tree: &a.tree,
            })
            .collect();
        let partial = PartialSum::of(&self.global, &updates)
            .with_context(|| format!("round {round}: this rank's updates"))?;
        let share = crate::distributed::RankShare {
            rows: collected.updates.iter().map(shared_row).collect(),
            dropped: dropped.iter().map(shared_drop).collect(),
            partial: partial.encode(),
        };
        let elements = partial_layout(&self.global)?.len();
        let partial_bytes = 16 + 8 * elements;
        let peers = &self
            .ranks
            .as_ref()
            .context("partial reduce without peers")?
            .peers;
        let blocks = peers.borrow_mut().all_gather(
            share.encode(),
            crate::distributed::RankShare::max_bytes(selected, partial_bytes),
        )?;
        let mut rows = Vec::new();
        let mut all_dropped = Vec::new();
        let mut partials = Vec::with_capacity(blocks.len());
        for (rank, block) in blocks.iter().enumerate() {
            let share = crate::distributed::RankShare::decode(block, selected, partial_bytes)
                .and_then(|s| Ok((PartialSum::decode(&s.partial, elements)?, s)))
                .map_err(|e| anyhow::anyhow!("round {round}: rank {rank}'s share: {e}"))?;
            partials.push(share.0);
            rows.extend(share.1.rows);
            all_dropped.extend(share.1.dropped.into_iter().map(|d| Dropped {
                client_id: d.client_id,
                worker: Some(d.worker as usize),
                reason: d.reason,
                simulated: None,
                staleness: None,
                wall: None,
            }));
        }
        rows.sort_by_key(|r| r.slot);
        self.require_min(round, rows.len(), selected, &all_dropped)?;
        let mean = combine(&self.global, &partials)?;
        let before = self.strategy.state();
        let aggregated = self
            .strategy
            .aggregate_mean(&self.context(round), &self.global, mean);
        let outcome = self.adopt(round, aggregated, before)?;
        let (reports, arrivals) = rows.iter().map(unshared_row).unzip();
        Ok(Aggregated {
            reports,
            arrivals,
            dropped: all_dropped,
            privacy: outcome.privacy,
            secagg: None,
            simulated_end: None,
        })
    }
}
