//! The simulated clock of an asynchronous run: which task in flight finishes
//! next.
//!
//! A task's simulated finish is known only once it has trained (its upload
//! takes as long as its update's bytes), while the workers train in whatever
//! order the machine lets them. [`InFlight`] keeps every task with the
//! earliest it can finish (start, download, compute and the upload's
//! latency) until its finish is settled, and names the next event only when
//! nothing unsettled could come before it: events are taken in the order of
//! (simulated time, task number), the same whatever the number of workers or
//! the order they finish in. That is conservative discrete-event simulation:
//! the bound is exact because an upload takes at least its latency.
//!
//! Times are seconds since the run started, finite and not negative.

use std::collections::BTreeMap;

/// One task on the clock.
#[derive(Debug, Clone, PartialEq)]
pub struct Flight<T> {
    /// Its finish once settled; until then the earliest it can finish.
    pub at: f64,
    pub settled: bool,
    pub item: T,
}

/// What comes next on the clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Task `n` finishes next: take it.
    Ready(u64),
    /// Task `n` may finish next, but its finish is not settled: wait for a
    /// task to train, settle it, and ask again.
    Unsettled(u64),
    /// Nothing is in flight.
    Empty,
}

/// Tasks in flight by task number. See the module documentation.
#[derive(Debug, Clone, PartialEq)]
pub struct InFlight<T> {
    flights: BTreeMap<u64, Flight<T>>,
}

impl<T> Default for InFlight<T> {
    fn default() -> Self {
        Self {
            flights: BTreeMap::new(),
        }
    }
}

/// A time the clock cannot take.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ClockError {
    #[error("task {task}: time {at} is not a finite number of seconds >= 0")]
    BadTime { task: u64, at: f64 },
    #[error("task {task} settles at {at}, before the earliest it could finish, {earliest}")]
    BeforeEarliest { task: u64, at: f64, earliest: f64 },
    #[error("task {task} is not in flight")]
    Unknown { task: u64 },
    #[error("task {task} is in flight already")]
    Twice { task: u64 },
}

fn check_time(task: u64, at: f64) -> Result<(), ClockError> {
    if at.is_finite() && at >= 0.0 {
        Ok(())
    } else {
        Err(ClockError::BadTime { task, at })
    }
}

impl<T> InFlight<T> {
    /// Task `task` is in flight and finishes at `earliest` at the soonest;
    /// `settled` when that is its finish already (a client known to go
    /// offline first).
    pub fn insert(
        &mut self,
        task: u64,
        earliest: f64,
        settled: bool,
        item: T,
    ) -> Result<(), ClockError> {
        check_time(task, earliest)?;
        if self.flights.contains_key(&task) {
            return Err(ClockError::Twice { task });
        }
        self.flights.insert(
            task,
            Flight {
                at: earliest,
                settled,
                item,
            },
        );
        Ok(())
    }

    /// Task `task` finishes at `at`, no earlier than its bound.
    pub fn settle(&mut self, task: u64, at: f64) -> Result<(), ClockError> {
        check_time(task, at)?;
        let flight = self
            .flights
            .get_mut(&task)
            .ok_or(ClockError::Unknown { task })?;
        if at < flight.at {
            return Err(ClockError::BeforeEarliest {
                task,
                at,
                earliest: flight.at,
            });
        }
        flight.at = at;
        flight.settled = true;
        Ok(())
    }

    /// The task whose event comes next, by (time, task number).
    pub fn next(&self) -> Next {
        let first = self
            .flights
            .iter()
            .min_by(|(a_task, a), (b_task, b)| a.at.total_cmp(&b.at).then(a_task.cmp(b_task)));
        match first {
            None => Next::Empty,
            Some((&task, flight)) if flight.settled => Next::Ready(task),
            Some((&task, _)) => Next::Unsettled(task),
        }
    }

    /// Task `task`, out of flight.
    pub fn take(&mut self, task: u64) -> Option<Flight<T>> {
        self.flights.remove(&task)
    }

    pub fn get(&self, task: u64) -> Option<&Flight<T>> {
        self.flights.get(&task)
    }

    pub fn get_mut(&mut self, task: u64) -> Option<&mut Flight<T>> {
        self.flights.get_mut(&task)
    }

    pub fn len(&self) -> usize {
        self.flights.len()
    }

    pub fn is_empty(&self) -> bool {
        self.flights.is_empty()
    }

    /// Every task in flight, by task number.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &Flight<T>)> {
        self.flights.iter().map(|(&task, flight)| (task, flight))
    }
}

/// How a synchronous round's task ended on the clock.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TaskEnd {
    /// Its update arrives at this time.
    Arrives(f64),
    /// Its client went offline at this time, before its update arrived.
    Lost(f64),
}

/// What became of a task when its round closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Aggregated,
    Lost,
    /// Its update would have arrived after the round closed.
    Late,
}

/// When a synchronous round closes and what became of each of its tasks
/// (given in selection order). The round closes when every task has ended,
/// at `start + deadline` (`server.round_deadline`) if that is earlier, and,
/// with over-selection, as soon as `quota` updates (`clients.per_round`)
/// have arrived: the first `quota` to arrive, ties to the earlier slot, are
/// aggregated, as in Bonawitz et al. 2019. A loss after the close is a late
/// task, not a loss.
pub fn close_round(
    start: f64,
    tasks: &[TaskEnd],
    deadline: Option<f64>,
    quota: Option<usize>,
) -> (f64, Vec<Verdict>) {
    let cutoff = deadline.map_or(f64::INFINITY, |d| start + d);
    let mut arrivals: Vec<(f64, usize)> = tasks
        .iter()
        .enumerate()
        .filter_map(|(slot, end)| match *end {
            TaskEnd::Arrives(at) if at <= cutoff => Some((at, slot)),
            _ => None,
        })
        .collect();
    arrivals.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let natural = tasks
        .iter()
        .map(|end| match *end {
            TaskEnd::Arrives(at) | TaskEnd::Lost(at) => at,
        })
        .fold(start, f64::max);
    let quota_reached = quota
        .filter(|&q| q > 0 && arrivals.len() >= q)
        .map(|q| arrivals[q - 1].0);
    let end = natural
        .min(cutoff)
        .min(quota_reached.unwrap_or(f64::INFINITY));
    let kept: Vec<usize> = arrivals
        .iter()
        .take(quota.unwrap_or(usize::MAX))
        .filter(|(at, _)| *at <= end)
        .map(|&(_, slot)| slot)
        .collect();
    let verdicts = tasks
        .iter()
        .enumerate()
        .map(|(slot, task)| match *task {
            TaskEnd::Lost(at) if at <= end => Verdict::Lost,
            TaskEnd::Lost(_) => Verdict::Late,
            TaskEnd::Arrives(_) if kept.contains(&slot) => Verdict::Aggregated,
            TaskEnd::Arrives(_) => Verdict::Late,
        })
        .collect();
    (end, verdicts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rounds_close_at_the_quota_the_deadline_or_the_last_task_by_hand() {
        use TaskEnd::{Arrives, Lost};
        use Verdict::{Aggregated, Late};
        let tasks = [
            Arrives(5.0),
            Arrives(3.0),
            Lost(2.0),
            Arrives(9.0),
            Arrives(3.0),
        ];
        // No deadline, no over-selection: the last task ends it at 9.
        let (end, verdicts) = close_round(1.0, &tasks, None, None);
        assert_eq!(end, 9.0);
        assert_eq!(
            verdicts,
            [
                Aggregated,
                Aggregated,
                Verdict::Lost,
                Aggregated,
                Aggregated
            ]
        );
        // Over-selected for 2: slots 1 and 4 arrive first (3, tie to slot 1
        // then 4); the round closes at 3 and the others are late.
        let (end, verdicts) = close_round(1.0, &tasks, None, Some(2));
        assert_eq!(end, 3.0);
        assert_eq!(
            verdicts,
            [Late, Aggregated, Verdict::Lost, Late, Aggregated]
        );
        // A deadline of 5 s from 1: closes at 6, 9 is late.
        let (end, verdicts) = close_round(1.0, &tasks, Some(5.0), None);
        assert_eq!(end, 6.0);
        assert_eq!(
            verdicts,
            [Aggregated, Aggregated, Verdict::Lost, Late, Aggregated]
        );
        // A deadline before the loss: the loss is a late task.
        let (end, verdicts) = close_round(0.0, &tasks, Some(1.5), None);
        assert_eq!(end, 1.5);
        assert_eq!(verdicts, [Late, Late, Late, Late, Late]);
        // The quota out of reach: the deadline or the last task closes it.
        let (end, _) = close_round(0.0, &tasks, Some(4.0), Some(3));
        assert_eq!(end, 4.0);
    }

    #[test]
    fn an_unsettled_task_that_may_come_first_holds_the_clock() {
        let mut clock = InFlight::default();
        clock.insert(1, 5.0, false, "a").unwrap();
        clock.insert(2, 3.0, false, "b").unwrap();
        assert_eq!(clock.next(), Next::Unsettled(2));
        // Task 2 trains to finish at 7: task 1 could still finish before.
        clock.settle(2, 7.0).unwrap();
        assert_eq!(clock.next(), Next::Unsettled(1));
        clock.settle(1, 6.0).unwrap();
        assert_eq!(clock.next(), Next::Ready(1));
        assert_eq!(clock.take(1).unwrap().item, "a");
        assert_eq!(clock.next(), Next::Ready(2));
        clock.take(2);
        assert_eq!(clock.next(), Next::Empty);
        // A tie goes to the lower task number.
        clock.insert(4, 1.0, true, "d").unwrap();
        clock.insert(3, 1.0, true, "c").unwrap();
        assert_eq!(clock.next(), Next::Ready(3));
    }

    #[test]
    fn impossible_times_are_refused() {
        let mut clock = InFlight::default();
        assert!(clock.insert(1, f64::NAN, false, ()).is_err());
        clock.insert(1, 2.0, false, ()).unwrap();
        assert_eq!(
            clock.insert(1, 2.0, false, ()),
            Err(ClockError::Twice { task: 1 })
        );
        assert!(matches!(
            clock.settle(1, 1.0),
            Err(ClockError::BeforeEarliest { .. })
        ));
        assert_eq!(clock.settle(9, 1.0), Err(ClockError::Unknown { task: 9 }));
        assert!(clock.settle(1, f64::INFINITY).is_err());
    }

    proptest! {
        /// Whatever order the workers finish training in, events come in the
        /// order of (finish, task number).
        #[test]
        fn events_come_in_simulated_order_whatever_order_training_ends(
            tasks in proptest::collection::vec((0u32..50, 0u32..20), 1..40),
            training_order in proptest::collection::vec(any::<u16>(), 40),
        ) {
            let mut clock = InFlight::default();
            for (task, &(earliest, _)) in tasks.iter().enumerate() {
                clock.insert(task as u64, f64::from(earliest), false, ()).unwrap();
            }
            let finish = |task: u64| {
                let (earliest, extra) = tasks[task as usize];
                f64::from(earliest) + f64::from(extra)
            };
            // The workers' order: a permutation of the tasks.
            let mut trained: Vec<u64> = (0..tasks.len() as u64).collect();
            trained.sort_by_key(|&t| training_order[t as usize]);
            let mut trained = trained.into_iter();
            let mut seen = Vec::new();
            loop {
                match clock.next() {
                    Next::Empty => break,
                    Next::Ready(task) => {
                        clock.take(task);
                        seen.push(task);
                    }
                    Next::Unsettled(_) => {
                        // Wait for whichever worker finishes next.
                        let task = trained
                            .by_ref()
                            .find(|&t| clock.get(t).is_some_and(|f| !f.settled))
                            .expect("an unsettled task is still training");
                        clock.settle(task, finish(task)).unwrap();
                    }
                }
            }
            let mut expected: Vec<u64> = (0..tasks.len() as u64).collect();
            expected.sort_by(|&a, &b| finish(a).total_cmp(&finish(b)).then(a.cmp(&b)));
            prop_assert_eq!(seen, expected);
        }
    }
}
