//! The asynchronous server on the real clock (network mode,
//! `clients.comm_simulation = false`): the same server as `asynchronous.rs`
//! with the order of events taken from the transport instead of the
//! simulated clock.
//!
//! Each update is taken when it really arrives from its client process,
//! checked as a synchronous network round checks its updates (the report
//! against the partition or own-data declaration, the model's layout and
//! finite values, the times it claims against `server.payload_timeout`)
//! and for staleness: the aggregations between the version its client was
//! sent and the one it would join. A client that fails, times out, vanishes
//! or is refused is dropped with the reason and its place refilled at once;
//! it is not drawn again until another update joins the buffer, so a client
//! that fails at once cannot take every place. The run stops with an error
//! only when every client failed in a row and none is left to draw.
//!
//! Times are seconds since the run started (`results.csv`'s
//! `elapsed_time`): each task's send and arrival go to `clients.csv`
//! (`wall_start`, `wall_end`), each aggregation's start and end to
//! `results.csv` (`simulated_start`, `simulated_time`). What cannot be the
//! same from run to run is the order of arrivals, so neither the model nor
//! a resumed run is bit for bit: `--resume` sends the tasks in flight at
//! the checkpoint again, from the models they were sent, and goes on.

use anyhow::{Context, bail};

use cohort_core::results::WallTask;

use super::RoundLoop;
use super::asynchronous::{AsyncRun, AsyncSettings, Flight, Verdict};
use crate::transport::ClientOutcome;
use crate::updates::unpack;

/// Reasons quoted when the run stops for lack of clients.
const REASONS_SHOWN: usize = 5;

impl RoundLoop<'_> {
    /// Whether the asynchronous server runs on the real clock.
    pub(super) fn real_time(&self) -> bool {
        self.settings.asynchronous.is_some_and(|a| a.real_time)
    }

    /// Seconds since the run started, across resumes.
    pub(super) fn real_now(&self) -> f64 {
        self.clock.elapsed_before + self.clock.run_started.elapsed().as_secs_f64()
    }

    /// Runs every remaining aggregation on the real clock; `true` when the
    /// target accuracy was reached.
    pub(super) fn run_async_real_time(&mut self, settings: AsyncSettings) -> anyhow::Result<bool> {
        let mut run = self.async_start()?;
        loop {
            self.refill_real_time(&mut run)?;
            if run.flights.is_empty() {
                bail!(
                    "round {}: every client's task failed or was refused since the last update \
                     was admitted, and no client is left to draw; the global model stays at \
                     version {}. Dropped: {}",
                    run.version + 1,
                    run.version,
                    last_reasons(&run)
                );
            }
            let outcome = self.transport.next_outcome()?;
            let flight = self.received(&mut run, outcome)?;
            let client = flight.client;
            match self.arrive(&mut run, flight) {
                Verdict::Buffered => run.failed.clear(),
                Verdict::Failed => {
                    run.failed.insert(client);
                }
                // Slow, not broken: it may be drawn again.
                Verdict::TooStale => {}
            }
            if let Some(reached) = self.aggregate_if_full(&mut run, settings)? {
                return Ok(reached);
            }
        }
    }

    /// Fills the free places in flight with clients not in flight and not
    /// failed since the last update was admitted.
    fn refill_real_time(&mut self, run: &mut AsyncRun) -> anyhow::Result<()> {
        let selection = self.settings.selection;
        let free = (selection.per_round as usize).saturating_sub(run.flights.len());
        if free == 0 {
            return Ok(());
        }
        let busy: Vec<u32> = run.flights.iter().map(|(_, f)| f.item.client).collect();
        let candidates: Vec<u32> = (1..=selection.total_clients)
            .filter(|client| !busy.contains(client) && !run.failed.contains(client))
            .collect();
        // The places refilled now count towards the next aggregation.
        for client in self.selector.select(run.version + 1, &candidates, free) {
            self.dispatch_one(run, client)?;
        }
        Ok(())
    }

    /// The task `outcome` answers, out of flight, with its update unpacked
    /// (or why there is none) and its times on the run's clock.
    fn received(&mut self, run: &mut AsyncRun, outcome: ClientOutcome) -> anyhow::Result<Flight> {
        let task = outcome.slot as u64;
        let mut flight = run
            .flights
            .take(task)
            .with_context(|| format!("an outcome of task {task}, which is not in flight"))?
            .item;
        run.now = self.real_now();
        let wall = WallTask {
            start: flight.start,
            end: run.now,
        };
        let unpacked = unpack(outcome, &self.settings.inbound, &self.settings.limits);
        flight.outcome = Some(match unpacked {
            Ok(mut arrived) => {
                arrived.arrival.wall = Some(wall);
                Ok(arrived)
            }
            Err(mut dropped) => {
                dropped.wall = Some(wall);
                Err(dropped)
            }
        });
        Ok(flight)
    }
}

/// The last few drops since the last aggregation, for an error.
fn last_reasons(run: &AsyncRun) -> String {
    let shown: Vec<String> = run
        .dropped
        .iter()
        .rev()
        .take(REASONS_SHOWN)
        .map(ToString::to_string)
        .collect();
    let more = run.dropped.len().saturating_sub(REASONS_SHOWN);
    match more {
        0 => shown.join("; "),
        more => format!("{} (and {more} more)", shown.join("; ")),
    }
}
