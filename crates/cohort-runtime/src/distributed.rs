//! Distributed simulation: the ranks of a plan each train the selected
//! clients of their own block (the same block every round, so data stays
//! put) on their own worker pool, then all-gather the round's outcomes, so
//! every rank sees every update in the selection order and runs the same
//! checks, hooks and strategy as a single process would. That makes the model
//! of every rank equal, bit for bit, to a single-process run's, for every
//! strategy (median and Krum included), at the cost of each rank receiving
//! every update of the round: the same bytes the star of network mode moves
//! to its one server. Each rank scores its slice of the test set and the
//! ranks add all slices' scores in batch order (so every rank knows the
//! accuracy and they stop at the same round); rank 0 writes the results.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::Arc;

use anyhow::{Context, bail};
use cohort_core::cluster::ClientBlock;
use cohort_train::task::Score;
use cohort_train::trainer::{ClientTask, sum_in_order};

use crate::client::ClientReply;
use crate::collective::Collective;
use crate::transport::{
    ClientOutcome, Delivered, MAX_REASON_BYTES, TaskSpec, Transport, truncated,
};

/// The collective of a run, shared by the transport and the round loop, both
/// on the thread that runs the rounds.
pub type SharedCollective = Rc<RefCell<Box<dyn Collective>>>;

/// Worker ids of rank r start at r × this in `clients.csv` (rank 2's third
/// worker is 2002); a rank has fewer workers than this.
pub const WORKER_ID_STRIDE: usize = 1000;

/// Bytes an outcome takes beside its payload and reason.
const OUTCOME_HEAD_BYTES: u64 = 128;

/// A [`Transport`] for one rank: its own clients go to `local`, and the
/// outcomes of all ranks come back.
pub struct DistributedTransport {
    local: Box<dyn Transport>,
    collective: SharedCollective,
    block: ClientBlock,
    rank: u32,
    /// Worker ids of rank r start at r × this, so `clients.csv` tells them apart.
    workers_per_rank: usize,
    /// Largest update payload a rank may pass on.
    max_payload_bytes: u64,
    /// `cluster.reduce = partial`: outcomes stay on their rank; the round
    /// loop exchanges partial sums instead.
    local_only: bool,
    round: Option<Round>,
}

struct Round {
    tasks: usize,
    local: usize,
    gathered: Option<VecDeque<ClientOutcome>>,
}

impl DistributedTransport {
    pub fn new(
        local: Box<dyn Transport>,
        collective: SharedCollective,
        block: ClientBlock,
        workers_per_rank: usize,
        max_payload_bytes: u64,
        local_only: bool,
    ) -> Self {
        let rank = collective.borrow().rank();
        Self {
            local,
            collective,
            block,
            rank,
            workers_per_rank,
            max_payload_bytes,
            local_only,
            round: None,
        }
    }

    /// Waits for this rank's outcomes, then swaps them for everyone's.
    fn gather(&mut self, tasks: usize, local: usize) -> anyhow::Result<VecDeque<ClientOutcome>> {
        let mut mine = Vec::with_capacity(local);
        for _ in 0..local {
            let mut outcome = self.local.next_outcome()?;
            outcome.worker += self.rank as usize * self.workers_per_rank;
            mine.push(outcome);
        }
        let bytes = encode_outcomes(&mine);
        let per_outcome = self.max_payload_bytes + OUTCOME_HEAD_BYTES + MAX_REASON_BYTES as u64;
        let limit = per_outcome.saturating_mul(tasks as u64).saturating_add(8);
        let blocks = self.collective.borrow_mut().all_gather(bytes, limit)?;
        let mut all = Vec::with_capacity(tasks);
        for (rank, block) in blocks.iter().enumerate() {
            let outcomes = decode_outcomes(block, tasks, self.max_payload_bytes).map_err(|e| {
                anyhow::anyhow!("rank {rank} sent outcomes that do not decode: {e}")
            })?;
            all.extend(outcomes);
        }
        check_slots(&all, tasks)?;
        Ok(all.into())
    }
}

/// Every slot of the round exactly once: no rank skipped or repeated a task.
fn check_slots(outcomes: &[ClientOutcome], tasks: usize) -> anyhow::Result<()> {
    let mut seen = vec![false; tasks];
    for outcome in outcomes {
        match seen.get_mut(outcome.slot) {
            Some(seen) if !*seen => *seen = true,
            Some(_) => bail!("two ranks returned slot {} of the round", outcome.slot),
            None => bail!(
                "a rank returned slot {} of a {tasks}-task round",
                outcome.slot
            ),
        }
    }
    if let Some(missing) = seen.iter().position(|s| !s) {
        bail!("no rank returned slot {missing} of the round: the ranks' client blocks disagree");
    }
    Ok(())
}

impl Transport for DistributedTransport {
    fn dispatch(
        &mut self,
        global_payload: Arc<Vec<u8>>,
        tasks: Vec<TaskSpec>,
    ) -> anyhow::Result<()> {
        let count = tasks.len();
        let mine: Vec<TaskSpec> = tasks
            .into_iter()
            .filter(|t| self.block.contains(t.task.client_id))
            .collect();
        let local = mine.len();
        self.local.dispatch(global_payload, mine)?;
        self.round = Some(Round {
            tasks: count,
            local,
            gathered: None,
        });
        Ok(())
    }

    fn next_outcome(&mut self) -> anyhow::Result<ClientOutcome> {
        let Some(round) = self.round.as_ref() else {
            bail!("no round was dispatched");
        };
        if self.local_only {
            let mut outcome = self.local.next_outcome()?;
            outcome.worker += self.rank as usize * self.workers_per_rank;
            return Ok(outcome);
        }
        if round.gathered.is_none() {
            let (tasks, local) = (round.tasks, round.local);
            let gathered = self.gather(tasks, local)?;
            if let Some(round) = self.round.as_mut() {
                round.gathered = Some(gathered);
            }
        }
        self.round
            .as_mut()
            .and_then(|r| r.gathered.as_mut())
            .and_then(VecDeque::pop_front)
            .context("more outcomes asked for than the round had tasks")
    }

    fn cancel(&mut self) {
        self.local.cancel();
    }
}

/// Outcomes as bytes: a count, then each outcome's fields, little-endian.
fn encode_outcomes(outcomes: &[ClientOutcome]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(outcomes.len() as u64).to_le_bytes());
    for outcome in outcomes {
        out.extend_from_slice(&(outcome.slot as u64).to_le_bytes());
        out.extend_from_slice(&outcome.task.client_id.to_le_bytes());
        out.extend_from_slice(&outcome.task.round.to_le_bytes());
        out.extend_from_slice(&(outcome.worker as u64).to_le_bytes());
        match &outcome.result {
            Ok(delivered) => {
                let reply = &delivered.reply;
                out.push(1);
                for value in [
                    reply.num_samples,
                    reply.local_steps,
                    reply.test_samples,
                    reply.test_correct,
                ] {
                    out.extend_from_slice(&value.to_le_bytes());
                }
                for value in [
                    reply.loss,
                    reply.training_time,
                    reply.processing_time,
                    delivered.comm_time,
                ] {
                    out.extend_from_slice(&value.to_le_bytes());
                }
                out.extend_from_slice(&(reply.payload.len() as u64).to_le_bytes());
                out.extend_from_slice(&reply.payload);
            }
            Err(reason) => {
                out.push(0);
                let reason = truncated(reason, MAX_REASON_BYTES);
                out.extend_from_slice(&(reason.len() as u64).to_le_bytes());
                out.extend_from_slice(reason.as_bytes());
            }
        }
    }
    out
}

/// Reads what [`encode_outcomes`] wrote, refusing more than `max_outcomes`
/// outcomes, payloads over `max_payload_bytes` and anything truncated.
fn decode_outcomes(
    bytes: &[u8],
    max_outcomes: usize,
    max_payload_bytes: u64,
) -> Result<Vec<ClientOutcome>, String> {
    let mut reader = Reader { bytes, at: 0 };
    let count = reader.u64()?;
    if count > max_outcomes as u64 {
        return Err(format!(
            "{count} outcomes in a round of {max_outcomes} tasks"
        ));
    }
    let mut outcomes = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let slot = usize::try_from(reader.u64()?).map_err(|_| "slot out of range")?;
        let task = ClientTask {
            client_id: reader.u32()?,
            round: reader.u32()?,
        };
        let worker = usize::try_from(reader.u64()?).map_err(|_| "worker out of range")?;
        let result = match reader.byte()? {
            1 => Ok(read_delivered(&mut reader, max_payload_bytes)?),
            0 => {
                let length = reader.u64()?;
                if length > MAX_REASON_BYTES as u64 {
                    return Err(format!("a failure reason of {length} bytes"));
                }
                let text = reader.take(length as usize)?;
                Err(String::from_utf8_lossy(text).into_owned())
            }
            other => return Err(format!("outcome tag {other}")),
        };
        outcomes.push(ClientOutcome {
            slot,
            task,
            worker,
            result,
        });
    }
    if reader.at != bytes.len() {
        return Err(format!(
            "{} bytes after the last outcome",
            bytes.len() - reader.at
        ));
    }
    Ok(outcomes)
}

fn read_delivered(reader: &mut Reader<'_>, max_payload_bytes: u64) -> Result<Delivered, String> {
    let [num_samples, local_steps, test_samples, test_correct] =
        [reader.u64()?, reader.u64()?, reader.u64()?, reader.u64()?];
    let [loss, training_time, processing_time, comm_time] =
        [reader.f64()?, reader.f64()?, reader.f64()?, reader.f64()?];
    let length = reader.u64()?;
    if length > max_payload_bytes {
        return Err(format!(
            "an update of {length} bytes, over server.max_payload_bytes = {max_payload_bytes}"
        ));
    }
    let payload = bytes::Bytes::copy_from_slice(reader.take(length as usize)?);
    Ok(Delivered {
        reply: ClientReply {
            num_samples,
            loss,
            training_time,
            processing_time,
            local_steps,
            test_samples,
            test_correct,
            payload,
            packed_from: None,
            unwritten_len: None,
        },
        comm_time,
        declared: None,
    })
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, count: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(count)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| format!("truncated at byte {} (wanted {count} more)", self.at))?;
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }

    fn byte(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    fn f64(&mut self) -> Result<f64, String> {
        Ok(f64::from_bits(self.u64()?))
    }
}

/// One accepted update of a rank's clients, as `cluster.reduce = partial`
/// shares it: the numbers of its results row, not its tree.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedRow {
    pub slot: u64,
    pub client_id: u32,
    pub worker: u64,
    pub num_samples: u64,
    pub local_steps: u64,
    pub payload_bytes: u64,
    pub test_samples: u64,
    pub test_correct: u64,
    pub loss: f64,
    pub training_time: f64,
    pub processing_time: f64,
    pub comm_time: f64,
}

/// A client a rank dropped, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedDrop {
    pub client_id: u32,
    pub worker: u64,
    pub reason: String,
}

/// A rank's round under `cluster.reduce = partial`: its rows, its drops and
/// its partial sum (already encoded).
#[derive(Debug, Clone, PartialEq)]
pub struct RankShare {
    pub rows: Vec<SharedRow>,
    pub dropped: Vec<SharedDrop>,
    pub partial: Vec<u8>,
}

impl RankShare {
    pub fn encode(&self) -> Vec<u8> {
        fn put(out: &mut Vec<u8>, value: u64) {
            out.extend_from_slice(&value.to_le_bytes());
        }
        let mut out = Vec::new();
        put(&mut out, self.rows.len() as u64);
        for r in &self.rows {
            let integers = [
                r.slot,
                u64::from(r.client_id),
                r.worker,
                r.num_samples,
                r.local_steps,
                r.payload_bytes,
                r.test_samples,
                r.test_correct,
            ];
            for value in integers {
                put(&mut out, value);
            }
            for value in [r.loss, r.training_time, r.processing_time, r.comm_time] {
                put(&mut out, value.to_bits());
            }
        }
        put(&mut out, self.dropped.len() as u64);
        for d in &self.dropped {
            let reason = truncated(&d.reason, MAX_REASON_BYTES);
            for value in [u64::from(d.client_id), d.worker, reason.len() as u64] {
                put(&mut out, value);
            }
            out.extend_from_slice(reason.as_bytes());
        }
        out.extend_from_slice(&(self.partial.len() as u64).to_le_bytes());
        out.extend_from_slice(&self.partial);
        out
    }

    /// Reads a share of a round of `tasks` clients whose partial sum takes
    /// `partial_bytes`; refuses anything else.
    pub fn decode(bytes: &[u8], tasks: usize, partial_bytes: usize) -> Result<Self, String> {
        let mut reader = Reader { bytes, at: 0 };
        let count = reader.u64()?;
        if count > tasks as u64 {
            return Err(format!("{count} rows in a round of {tasks} tasks"));
        }
        let mut rows = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let [
                slot,
                client_id,
                worker,
                num_samples,
                local_steps,
                payload_bytes,
                test_samples,
                test_correct,
            ] = [(); 8].map(|()| reader.u64());
            let [loss, training_time, processing_time, comm_time] = [(); 4].map(|()| reader.f64());
            rows.push(SharedRow {
                slot: slot?,
                client_id: u32::try_from(client_id?).map_err(|_| "client id out of range")?,
                worker: worker?,
                num_samples: num_samples?,
                local_steps: local_steps?,
                payload_bytes: payload_bytes?,
                test_samples: test_samples?,
                test_correct: test_correct?,
                loss: loss?,
                training_time: training_time?,
                processing_time: processing_time?,
                comm_time: comm_time?,
            });
        }
        let count = reader.u64()?;
        if count > tasks as u64 {
            return Err(format!(
                "{count} dropped clients in a round of {tasks} tasks"
            ));
        }
        let mut dropped = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let client_id = u32::try_from(reader.u64()?).map_err(|_| "client id out of range")?;
            let worker = reader.u64()?;
            let length = reader.u64()?;
            if length > MAX_REASON_BYTES as u64 {
                return Err(format!("a reason of {length} bytes"));
            }
            let reason = String::from_utf8_lossy(reader.take(length as usize)?).into_owned();
            dropped.push(SharedDrop {
                client_id,
                worker,
                reason,
            });
        }
        if reader.u64()? != partial_bytes as u64 {
            return Err(format!(
                "a partial sum of another size than {partial_bytes} bytes"
            ));
        }
        let partial = reader.take(partial_bytes)?.to_vec();
        if reader.at != bytes.len() {
            return Err(format!(
                "{} bytes after the partial sum",
                bytes.len() - reader.at
            ));
        }
        Ok(Self {
            rows,
            dropped,
            partial,
        })
    }

    /// Largest encoding of a share in a round of `tasks` clients.
    pub fn max_bytes(tasks: usize, partial_bytes: usize) -> u64 {
        let per_task = 12 * 8 + 3 * 8 + MAX_REASON_BYTES as u64;
        per_task * tasks as u64 + 24 + partial_bytes as u64
    }
}

/// Rank 0's accuracy of the round, on every rank: the ranks stop together.
pub fn share_accuracy(collective: &SharedCollective, mine: Option<f64>) -> anyhow::Result<f64> {
    let bytes = mine.map_or_else(Vec::new, |a| a.to_le_bytes().to_vec());
    let blocks = collective.borrow_mut().all_gather(bytes, 8)?;
    let leader: [u8; 8] = blocks
        .first()
        .and_then(|b| b.as_slice().try_into().ok())
        .context("rank 0 did not send the round's accuracy")?;
    Ok(f64::from_le_bytes(leader))
}

/// Bytes of one batch's score between ranks: loss sum, correct rows, rows.
const SCORE_BYTES: usize = 24;

/// Every rank's per-batch test scores (`batches[r]` of them from rank `r`),
/// added in rank order, which is the batches' order: on every rank, the
/// single process's sum, bit for bit. A rank whose evaluation failed sends
/// its error instead and every rank stops with it, so none waits for scores
/// that will not come.
pub fn share_scores(
    collective: &SharedCollective,
    mine: Result<Vec<Score>, String>,
    batches: &[usize],
) -> anyhow::Result<Score> {
    let most = batches.iter().copied().max().unwrap_or(0);
    let max_bytes = 1 + (most * SCORE_BYTES).max(MAX_REASON_BYTES);
    let blocks = collective
        .borrow_mut()
        .all_gather(encode_scores(&mine), max_bytes as u64)?;
    if blocks.len() != batches.len() {
        bail!(
            "{} ranks sent test scores, the plan has {}",
            blocks.len(),
            batches.len()
        );
    }
    let mut scores = Vec::with_capacity(batches.iter().sum());
    for (rank, (block, &expected)) in blocks.iter().zip(batches).enumerate() {
        let rank_scores = decode_scores(block, expected)
            .map_err(|e| anyhow::anyhow!("rank {rank}'s test-set scores: {e}"))?;
        scores.extend(rank_scores);
    }
    Ok(sum_in_order(scores))
}

fn encode_scores(scores: &Result<Vec<Score>, String>) -> Vec<u8> {
    match scores {
        Ok(scores) => {
            let mut out = Vec::with_capacity(1 + scores.len() * SCORE_BYTES);
            out.push(0);
            for score in scores {
                out.extend(score.loss_sum.to_le_bytes());
                out.extend(score.correct.to_le_bytes());
                out.extend(score.rows.to_le_bytes());
            }
            out
        }
        Err(message) => {
            let mut out = vec![1];
            out.extend(truncated(message, MAX_REASON_BYTES).as_bytes());
            out
        }
    }
}

fn decode_scores(block: &[u8], batches: usize) -> Result<Vec<Score>, String> {
    match block.split_first() {
        Some((0, scores)) if scores.len() == batches * SCORE_BYTES => Ok(scores
            .chunks_exact(SCORE_BYTES)
            .map(|s| {
                let word = |at: usize| <[u8; 8]>::try_from(&s[at..at + 8]).expect("8 bytes");
                Score {
                    loss_sum: f64::from_le_bytes(word(0)),
                    correct: u64::from_le_bytes(word(8)),
                    rows: u64::from_le_bytes(word(16)),
                }
            })
            .collect()),
        Some((0, scores)) => Err(format!(
            "{} bytes, expected {batches} batches of {SCORE_BYTES}",
            scores.len()
        )),
        Some((1, message)) => Err(format!(
            "it could not evaluate its slice: {}",
            String::from_utf8_lossy(message)
        )),
        _ => Err("not a block of test scores".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_round_trip_and_bounds_hold() {
        let scores = vec![
            Score {
                loss_sum: 1.25,
                correct: 3,
                rows: 4,
            },
            Score {
                loss_sum: f64::NAN,
                correct: 0,
                rows: 2,
            },
        ];
        let decoded = decode_scores(&encode_scores(&Ok(scores.clone())), 2).unwrap();
        assert_eq!(decoded[0], scores[0]);
        assert!(decoded[1].loss_sum.is_nan() && decoded[1].rows == 2);
        let wrong_count = decode_scores(&encode_scores(&Ok(scores)), 3).unwrap_err();
        assert!(wrong_count.contains("expected 3 batches"), "{wrong_count}");
        let failed = decode_scores(&encode_scores(&Err("label 12".to_owned())), 2).unwrap_err();
        assert!(
            failed.contains("could not evaluate its slice: label 12"),
            "{failed}"
        );
        assert!(decode_scores(&[], 0).is_err() && decode_scores(&[7], 0).is_err());
    }

    fn outcome(slot: usize, client_id: u32, payload: Result<Vec<u8>, &str>) -> ClientOutcome {
        ClientOutcome {
            slot,
            task: ClientTask {
                client_id,
                round: 3,
            },
            worker: 1,
            result: payload
                .map(|payload| Delivered {
                    reply: ClientReply {
                        num_samples: 12,
                        loss: 0.25,
                        training_time: 1.5,
                        processing_time: 0.125,
                        local_steps: 3,
                        test_samples: 4,
                        test_correct: 2,
                        payload: payload.into(),
                        packed_from: None,
                        unwritten_len: None,
                    },
                    comm_time: 0.5,
                    declared: None,
                })
                .map_err(str::to_owned),
        }
    }

    #[test]
    fn outcomes_round_trip_and_bounds_hold() {
        let outcomes = vec![
            outcome(0, 7, Ok(vec![1, 2, 3])),
            outcome(1, 9, Err("it died")),
        ];
        let bytes = encode_outcomes(&outcomes);
        let back = decode_outcomes(&bytes, 2, 3).unwrap();
        assert_eq!(back.len(), 2);
        let delivered = back[0].result.as_ref().unwrap();
        assert_eq!(delivered.reply.payload, [1, 2, 3][..]);
        assert_eq!(
            (delivered.reply.num_samples, delivered.reply.loss),
            (12, 0.25)
        );
        assert_eq!(delivered.comm_time, 0.5);
        assert_eq!(back[1].result.as_ref().unwrap_err(), "it died");
        assert_eq!(
            (back[1].slot, back[1].task.client_id, back[1].task.round),
            (1, 9, 3)
        );

        assert!(
            decode_outcomes(&bytes, 1, 3)
                .unwrap_err()
                .contains("2 outcomes")
        );
        assert!(
            decode_outcomes(&bytes, 2, 2)
                .unwrap_err()
                .contains("update of 3 bytes")
        );
        for cut in [0, 5, bytes.len() - 1] {
            assert!(
                decode_outcomes(&bytes[..cut], 2, 3).is_err(),
                "cut at {cut}"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(
            decode_outcomes(&longer, 2, 3)
                .unwrap_err()
                .contains("after the last")
        );
    }

    #[test]
    fn shares_round_trip_and_bounds_hold() {
        let share = RankShare {
            rows: vec![SharedRow {
                slot: 3,
                client_id: 7,
                worker: 2,
                num_samples: 40,
                local_steps: 4,
                payload_bytes: 900,
                test_samples: 0,
                test_correct: 0,
                loss: 0.5,
                training_time: 1.25,
                processing_time: 0.0,
                comm_time: 0.0,
            }],
            dropped: vec![SharedDrop {
                client_id: 9,
                worker: 1,
                reason: "it died".to_owned(),
            }],
            partial: vec![1, 2, 3, 4],
        };
        let bytes = share.encode();
        assert!(bytes.len() as u64 <= RankShare::max_bytes(2, 4));
        assert_eq!(RankShare::decode(&bytes, 2, 4).unwrap(), share);
        assert!(RankShare::decode(&bytes, 2, 5).is_err());
        assert!(
            RankShare::decode(&bytes, 0, 4)
                .unwrap_err()
                .contains("1 rows")
        );
        assert!(RankShare::decode(&bytes[..bytes.len() - 1], 2, 4).is_err());
    }

    #[test]
    fn every_slot_exactly_once() {
        let ok = [outcome(1, 1, Err("x")), outcome(0, 2, Err("x"))];
        assert!(check_slots(&ok, 2).is_ok());
        let twice = [outcome(0, 1, Err("x")), outcome(0, 2, Err("x"))];
        assert!(
            check_slots(&twice, 2)
                .unwrap_err()
                .to_string()
                .contains("two ranks")
        );
        let missing = [outcome(0, 1, Err("x"))];
        assert!(
            check_slots(&missing, 2)
                .unwrap_err()
                .to_string()
                .contains("slot 1")
        );
        let outside = [outcome(5, 1, Err("x"))];
        assert!(check_slots(&outside, 1).is_err());
    }
}
