//! Result files of a run: `results.csv` (one row per round) and `clients.csv`
//! (one row per client per round); beside them, only in runs that have
//! such rows, `secagg.csv` (secure aggregation's costs) and `candidates.csv`
//! (power-of-choice's evaluated candidates). Each is rewritten atomically
//! after every round, so a crash never leaves a torn file.

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::fsutil::atomic_write;

/// One round's row of `results.csv`. Times are seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundRow {
    pub round: u32,
    pub accuracy: f64,
    /// Wall time since the run started, at the end of this round.
    pub elapsed_time: f64,
    pub round_time: f64,
    /// Sum of the local training times of this round's clients.
    pub training_time: f64,
    pub evaluation_time: f64,
    /// Encoded global-model bytes sent to the round's clients.
    pub bytes_to_clients: u64,
    /// Encoded client-update bytes sent back to the server.
    pub bytes_to_server: u64,
    /// Mean training loss over the round's clients, weighted by samples.
    pub train_loss: f64,
    /// Simulated seconds since the start (`server.simulate_wall_time`), as if
    /// the selected clients had run in parallel: each round lasts as long as its
    /// slowest client's training, payload processing and communication. With
    /// `simulate_wall_time = false` it repeats `elapsed_time`.
    pub simulated_time: f64,
    /// Bytes sent to the clients beside the global model (SCAFFOLD's
    /// corrections); included in `bytes_to_clients`.
    #[serde(default)]
    pub extra_bytes_to_clients: u64,
    /// Sample-weighted accuracy of the global model on the selected clients'
    /// held-out data (`clients.do_test`).
    #[serde(default)]
    pub federated_accuracy: Option<f64>,
    /// Privacy spent so far, for strategies that account for it (`dp_fedavg`).
    #[serde(default)]
    pub epsilon: Option<f64>,
    /// The task's loss of the global model on the test set, averaged over
    /// its output rows (blank in files written before it was recorded).
    #[serde(default)]
    pub test_loss: Option<f64>,
    /// Simulated seconds at the round's start, with a `[clients.profile]`:
    /// the previous round's end (synchronous), or the previous aggregation
    /// (asynchronous). `simulated_time` is its end.
    #[serde(default)]
    pub simulated_start: Option<f64>,
    /// The round's secure-aggregation costs (`[secure_aggregation]`), for
    /// `secagg.csv`; `None` in rounds aggregated in the clear.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secagg: Option<SecAggRow>,
    /// The candidates that evaluated the global model before the round's
    /// choice (`clients.power_of_choice.loss = "evaluated"`), in the order
    /// drawn, for `candidates.csv`; empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub candidates: Vec<CandidateRow>,
}

/// One power-of-choice candidate's evaluation of the global model on its
/// training data, before its round's choice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CandidateRow {
    pub client_id: u32,
    /// Samples it evaluated the model on (its training partition).
    pub samples: u64,
    /// The model's mean loss on them; written exactly, as it may be
    /// infinite or not a number. Meaningless when `failed`.
    #[serde(with = "crate::selection::exact")]
    pub loss: f64,
    /// Whether the choice took it to train in the round.
    pub selected: bool,
    /// Its evaluation on the simulated clock (model down, one forward pass
    /// over its samples, the loss up), with a `[clients.profile]`.
    #[serde(default)]
    pub simulated: Option<SimulatedTask>,
    /// Why it brought no loss (it then ranked after every candidate that did).
    #[serde(default)]
    pub failed: Option<String>,
}

/// The run folder's evaluated power-of-choice candidates.
pub const CANDIDATES_FILE: &str = "candidates.csv";
/// `failed` stays last: a reason may hold commas.
pub const CANDIDATES_HEADER: &str = "round,client_id,samples,loss,selected,sim_start,sim_download,sim_compute,sim_upload,sim_end,failed";

/// `candidates.csv`: a line per candidate of every round that evaluated
/// candidates.
pub fn render_candidates(rows: &[RoundRow]) -> String {
    let mut out = format!("{CANDIDATES_HEADER}\n");
    for row in rows {
        for c in &row.candidates {
            let simulated = match &c.simulated {
                Some(t) => format!(
                    "{:.3},{:.3},{:.3},{:.3},{:.3}",
                    t.start,
                    t.download,
                    t.compute,
                    t.upload,
                    t.end()
                ),
                None => ",,,,".to_owned(),
            };
            let (samples, loss, failed) = match &c.failed {
                Some(reason) => (String::new(), String::new(), csv_field(reason)),
                None => (
                    c.samples.to_string(),
                    format!("{:.6}", c.loss),
                    String::new(),
                ),
            };
            let _ = writeln!(
                out,
                "{},{},{samples},{loss},{},{simulated},{failed}",
                row.round,
                c.client_id,
                u8::from(c.selected),
            );
        }
    }
    out
}

/// One round of secure aggregation: who is in the sum and what the
/// protocol cost, each stage's bytes summed over clients (`up`: client →
/// server, `down`: server → client; stages as in [`crate::secagg`]).
/// Times are seconds of compute, encoding and decoding excluded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SecAggRow {
    /// Clients the round selected, all of whom started the protocol.
    pub selected: u32,
    /// Clients whose updates are in the sum.
    pub contributors: u32,
    pub advertise_up: u64,
    pub share_down: u64,
    pub share_up: u64,
    pub input_down: u64,
    pub input_up: u64,
    pub unmask_down: u64,
    pub unmask_up: u64,
    /// The clients' protocol compute, summed over clients.
    pub client_time: f64,
    pub server_time: f64,
}

/// The run folder's per-round secure-aggregation costs.
pub const SECAGG_FILE: &str = "secagg.csv";
pub const SECAGG_HEADER: &str = "round,selected,contributors,advertise_up,share_down,share_up,input_down,input_up,unmask_down,unmask_up,client_time,server_time";

/// `secagg.csv`: a line per round that was aggregated securely.
pub fn render_secagg(rows: &[RoundRow]) -> String {
    let mut out = format!("{SECAGG_HEADER}\n");
    for (round, s) in rows.iter().filter_map(|r| Some((r.round, r.secagg?))) {
        let _ = writeln!(
            out,
            "{round},{},{},{},{},{},{},{},{},{},{:.6},{:.6}",
            s.selected,
            s.contributors,
            s.advertise_up,
            s.share_down,
            s.share_up,
            s.input_down,
            s.input_up,
            s.unmask_down,
            s.unmask_up,
            s.client_time,
            s.server_time,
        );
    }
    out
}

/// One client's training in one round.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClientRow {
    pub round: u32,
    pub client_id: u32,
    pub worker: usize,
    pub samples: u64,
    pub loss: f64,
    pub training_time: f64,
    /// Seconds in payload processors (both sides) for this client's task.
    #[serde(default)]
    pub processing_time: f64,
    /// Seconds on the wire (measured over the network, or from the configured
    /// bandwidths; 0 in process without bandwidths).
    #[serde(default)]
    pub comm_time: f64,
    /// Bytes of the update payload the client sent.
    #[serde(default)]
    pub payload_bytes: u64,
    /// The client's training samples per label.
    #[serde(default)]
    pub label_histogram: Vec<u64>,
    /// Accuracy of the global model on the client's held-out data
    /// (`clients.do_test`).
    #[serde(default)]
    pub test_accuracy: Option<f64>,
    /// Why the client's update did not join the round (it failed, vanished,
    /// timed out or sent something refused); `None` for updates that were
    /// aggregated. The numbers of a dropped row are left blank in the file.
    #[serde(default)]
    pub dropped: Option<String>,
    /// The task on the simulated clock (a `[clients.profile]`).
    #[serde(default)]
    pub simulated: Option<SimulatedTask>,
    /// Asynchronous runs: aggregations between the model the client trained
    /// from and the aggregation its update joined.
    #[serde(default)]
    pub staleness: Option<u32>,
    /// The task on the server's real clock, where that clock orders the run
    /// (an asynchronous run in network mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wall: Option<WallTask>,
}

/// A client's task on the simulated clock: when it started and how long
/// each part took, from its device profile. It ended at `end()`, or was
/// lost at its row's drop.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SimulatedTask {
    pub start: f64,
    pub download: f64,
    pub compute: f64,
    pub upload: f64,
}

/// A task on the server's real clock: seconds since the run started (its
/// `results.csv` `elapsed_time` scale) when the server sent it and when its
/// answer arrived.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WallTask {
    pub start: f64,
    pub end: f64,
}

impl SimulatedTask {
    pub fn end(&self) -> f64 {
        self.start + self.download + self.compute + self.upload
    }
}

impl ClientRow {
    /// A row with only its round and client filled in.
    pub fn empty(round: u32, client_id: u32) -> Self {
        Self {
            round,
            client_id,
            worker: 0,
            samples: 0,
            loss: 0.0,
            training_time: 0.0,
            processing_time: 0.0,
            comm_time: 0.0,
            payload_bytes: 0,
            label_histogram: Vec::new(),
            test_accuracy: None,
            dropped: None,
            simulated: None,
            staleness: None,
            wall: None,
        }
    }
}

pub const RESULTS_HEADER: &str = "round,accuracy,elapsed_time,round_time,training_time,evaluation_time,bytes_to_clients,bytes_to_server,train_loss,simulated_time,extra_bytes_to_clients,federated_accuracy,epsilon,test_loss,simulated_start";
/// The header before the simulated start; such files still parse.
const RESULTS_HEADER_V3: &str = "round,accuracy,elapsed_time,round_time,training_time,evaluation_time,bytes_to_clients,bytes_to_server,train_loss,simulated_time,extra_bytes_to_clients,federated_accuracy,epsilon,test_loss";
/// The header before the test loss; such files still parse.
const RESULTS_HEADER_V2: &str = "round,accuracy,elapsed_time,round_time,training_time,evaluation_time,bytes_to_clients,bytes_to_server,train_loss,simulated_time,extra_bytes_to_clients,federated_accuracy,epsilon";
/// The header before the strategy columns; such files still parse.
const RESULTS_HEADER_V1: &str = "round,accuracy,elapsed_time,round_time,training_time,evaluation_time,bytes_to_clients,bytes_to_server,train_loss,simulated_time";
/// `dropped` stays the last column: a reason may hold commas, and an
/// aggregated row ends with its empty field.
pub const CLIENTS_HEADER: &str = "round,client_id,worker,samples,loss,training_time,processing_time,comm_time,payload_bytes,label_histogram,test_accuracy,sim_start,sim_download,sim_compute,sim_upload,sim_end,staleness,wall_start,wall_end,dropped";

/// Every row a run has recorded, its resumed rounds' included: what
/// `results.csv` and `clients.csv` hold and what a checkpoint keeps.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunRows {
    pub rounds: Vec<RoundRow>,
    pub clients: Vec<ClientRow>,
    /// Where the checkpoint these rows were resumed from keeps its client
    /// rows (none for a run started afresh): the next checkpoint writes only
    /// the rows after it.
    pub checkpointed_clients: Option<crate::checkpoint::ClientRowsLink>,
}

impl RunRows {
    /// Appends a round and its clients' rows.
    pub fn push(&mut self, round: RoundRow, clients: Vec<ClientRow>) {
        self.rounds.push(round);
        self.clients.extend(clients);
    }

    /// The rows of `round` in `clients`.
    pub fn clients_of(&self, round: u32) -> &[ClientRow] {
        let first = self.clients.partition_point(|c| c.round < round);
        let end = self.clients.partition_point(|c| c.round <= round);
        &self.clients[first..end]
    }

    /// Rewrites `results.csv` and `clients.csv` in `run_dir`, each atomically.
    pub fn write_files(&self, run_dir: &Path) -> std::io::Result<()> {
        self.append_files(run_dir, None).map(|_| ())
    }

    /// [`RunRows::write_files`], except that where `clients.csv` already
    /// holds the first `written` client rows (written by this process) only
    /// the rows after them are appended: a run of many rounds would
    /// otherwise rewrite every earlier client row each round, a cost that
    /// grows with the run (a million rows after 1,000 rounds of 1,000
    /// clients). The other files are rewritten, atomically; they hold a row
    /// per round. Returns the client rows `clients.csv` holds now. An append
    /// cut short leaves a torn last line, which `--resume` replaces: it
    /// rewrites the file from its checkpoint.
    pub fn append_files(&self, run_dir: &Path, written: Option<usize>) -> std::io::Result<usize> {
        atomic_write(
            &run_dir.join(RESULTS_FILE),
            render_results(&self.rounds).as_bytes(),
        )?;
        let clients_path = run_dir.join(CLIENTS_FILE);
        match written.filter(|&written| written <= self.clients.len()) {
            Some(written) => {
                let mut lines = String::new();
                render_client_lines(&self.clients[written..], &mut lines);
                let mut file = std::fs::OpenOptions::new()
                    .append(true)
                    .open(&clients_path)?;
                std::io::Write::write_all(&mut file, lines.as_bytes())?;
            }
            None => atomic_write(&clients_path, render_clients(&self.clients).as_bytes())?,
        }
        if self.rounds.iter().any(|r| r.secagg.is_some()) {
            atomic_write(
                &run_dir.join(SECAGG_FILE),
                render_secagg(&self.rounds).as_bytes(),
            )?;
        }
        if self.rounds.iter().any(|r| !r.candidates.is_empty()) {
            atomic_write(
                &run_dir.join(CANDIDATES_FILE),
                render_candidates(&self.rounds).as_bytes(),
            )?;
        }
        Ok(self.clients.len())
    }
}

/// The run folder's per-round results.
pub const RESULTS_FILE: &str = "results.csv";
/// The run folder's per-client results.
pub const CLIENTS_FILE: &str = "clients.csv";

pub fn render_results(rows: &[RoundRow]) -> String {
    let mut out = format!("{RESULTS_HEADER}\n");
    for r in rows {
        let _ = writeln!(
            out,
            "{},{:.4},{:.3},{:.3},{:.3},{:.3},{},{},{:.6},{:.3},{},{},{},{},{}",
            r.round,
            r.accuracy,
            r.elapsed_time,
            r.round_time,
            r.training_time,
            r.evaluation_time,
            r.bytes_to_clients,
            r.bytes_to_server,
            r.train_loss,
            r.simulated_time,
            r.extra_bytes_to_clients,
            optional(r.federated_accuracy, 4),
            optional(r.epsilon, 6),
            optional(r.test_loss, 6),
            optional(r.simulated_start, 3),
        );
    }
    out
}

/// A number with `decimals` decimals, or nothing.
fn optional(value: Option<f64>, decimals: usize) -> String {
    value.map_or_else(String::new, |v| format!("{v:.decimals$}"))
}

/// A `results.csv` that cannot be read back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: line {line}: {problem}")]
pub struct ParseError {
    pub file: String,
    pub line: usize,
    pub problem: String,
}

/// Reads `results.csv` text as written by [`RunRows::write_files`]; `file` names it in errors.
pub fn parse_results(text: &str, file: &str) -> Result<Vec<RoundRow>, ParseError> {
    let error = |line: usize, problem: String| ParseError {
        file: file.to_owned(),
        line,
        problem,
    };
    let mut lines = text.lines().enumerate();
    let columns = match lines.next() {
        Some((_, header)) if header == RESULTS_HEADER => 15,
        Some((_, header)) if header == RESULTS_HEADER_V3 => 14,
        Some((_, header)) if header == RESULTS_HEADER_V2 => 13,
        Some((_, header)) if header == RESULTS_HEADER_V1 => 10,
        Some((_, header)) => {
            return Err(error(
                1,
                format!("header `{header}` is not `{RESULTS_HEADER}`"),
            ));
        }
        None => return Err(error(1, "the file is empty".to_owned())),
    };
    lines
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(index, line)| {
            let fields: Vec<&str> = line.split(',').collect();
            if fields.len() != columns {
                return Err(error(
                    index + 1,
                    format!("{} fields, expected {columns}", fields.len()),
                ));
            }
            let number = |i: usize| -> Result<f64, ParseError> {
                fields[i].parse::<f64>().map_err(|_| {
                    error(
                        index + 1,
                        format!("field {} `{}` is not a number", i + 1, fields[i]),
                    )
                })
            };
            let integer = |i: usize| -> Result<u64, ParseError> {
                fields[i].parse::<u64>().map_err(|_| {
                    error(
                        index + 1,
                        format!("field {} `{}` is not a whole number", i + 1, fields[i]),
                    )
                })
            };
            let optional_number = |i: usize| -> Result<Option<f64>, ParseError> {
                match fields.get(i) {
                    None | Some(&"") => Ok(None),
                    Some(_) => number(i).map(Some),
                }
            };
            Ok(RoundRow {
                round: integer(0)? as u32,
                accuracy: number(1)?,
                elapsed_time: number(2)?,
                round_time: number(3)?,
                training_time: number(4)?,
                evaluation_time: number(5)?,
                bytes_to_clients: integer(6)?,
                bytes_to_server: integer(7)?,
                train_loss: number(8)?,
                simulated_time: number(9)?,
                extra_bytes_to_clients: if columns > 10 { integer(10)? } else { 0 },
                federated_accuracy: optional_number(11)?,
                epsilon: optional_number(12)?,
                test_loss: optional_number(13)?,
                secagg: None,
                simulated_start: optional_number(14)?,
                candidates: Vec::new(),
            })
        })
        .collect()
}

pub fn render_clients(rows: &[ClientRow]) -> String {
    let mut out = format!("{CLIENTS_HEADER}\n");
    render_client_lines(rows, &mut out);
    out
}

/// `rows` as lines of `clients.csv`, without its header.
fn render_client_lines(rows: &[ClientRow], out: &mut String) {
    for r in rows {
        let histogram = r
            .label_histogram
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(" ");
        let timing = simulated_fields(r);
        if let Some(reason) = &r.dropped {
            let _ = writeln!(
                out,
                "{},{},{},,,,,,,{histogram},,{timing},{}",
                r.round,
                r.client_id,
                r.worker,
                csv_field(reason)
            );
            continue;
        }
        let _ = writeln!(
            out,
            "{},{},{},{},{:.6},{:.3},{:.4},{:.4},{},{histogram},{},{timing},",
            r.round,
            r.client_id,
            r.worker,
            r.samples,
            r.loss,
            r.training_time,
            r.processing_time,
            r.comm_time,
            r.payload_bytes,
            optional(r.test_accuracy, 4),
        );
    }
}

/// `sim_start,sim_download,sim_compute,sim_upload,sim_end,staleness,
/// wall_start,wall_end`, blank where the run has no such numbers.
fn simulated_fields(row: &ClientRow) -> String {
    let staleness = row.staleness.map_or(String::new(), |s| s.to_string());
    let wall = row
        .wall
        .map_or(",".to_owned(), |w| format!("{:.3},{:.3}", w.start, w.end));
    let simulated = match &row.simulated {
        Some(t) => format!(
            "{:.3},{:.3},{:.3},{:.3},{:.3},{staleness}",
            t.start,
            t.download,
            t.compute,
            t.upload,
            t.end()
        ),
        None => format!(",,,,,{staleness}"),
    };
    format!("{simulated},{wall}")
}

/// `text` as one CSV field (RFC 4180): quoted when it holds a comma, a
/// quote or a line break, with quotes doubled. Reasons quote client input.
fn csv_field(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendered_results_parse_back() {
        let row = RoundRow {
            round: 1,
            accuracy: 0.75,
            elapsed_time: 2.5,
            round_time: 2.5,
            training_time: 2.0,
            evaluation_time: 0.5,
            bytes_to_clients: 10,
            bytes_to_server: 11,
            train_loss: 0.125,
            simulated_time: 1.5,
            extra_bytes_to_clients: 7,
            federated_accuracy: Some(0.5),
            epsilon: None,
            test_loss: Some(0.75),
            secagg: None,
            simulated_start: Some(0.5),
            candidates: Vec::new(),
        };
        assert_eq!(
            parse_results(&render_results(std::slice::from_ref(&row)), "r.csv").unwrap(),
            [row]
        );
        let error = parse_results("round,accuracy\n", "r.csv").unwrap_err();
        assert_eq!(error.line, 1);
        let legacy = format!("{RESULTS_HEADER_V1}\n1,0.5,1,1,1,1,1,1,1,1\n");
        assert_eq!(parse_results(&legacy, "r.csv").unwrap()[0].epsilon, None);
        let before_test_loss = format!("{RESULTS_HEADER_V2}\n1,0.5,1,1,1,1,1,1,1,1,0,,0.5\n");
        let row = &parse_results(&before_test_loss, "r.csv").unwrap()[0];
        assert_eq!((row.epsilon, row.test_loss), (Some(0.5), None));
        let before_start = format!("{RESULTS_HEADER_V3}\n1,0.5,1,1,1,1,1,1,1,1,0,,,0.5\n");
        let row = &parse_results(&before_start, "r.csv").unwrap()[0];
        assert_eq!((row.test_loss, row.simulated_start), (Some(0.5), None));
        let bad = format!("{RESULTS_HEADER}\n1,x,1,1,1,1,1,1,1,1,0,,,,\n");
        let error = parse_results(&bad, "r.csv").unwrap_err();
        assert_eq!(
            error.to_string(),
            "r.csv: line 2: field 2 `x` is not a number"
        );
    }

    #[test]
    fn files_hold_every_recorded_row() {
        let dir = tempfile::tempdir().unwrap();
        let mut rows = RunRows::default();
        for round in 1..=2 {
            let row = RoundRow {
                round,
                accuracy: 0.5,
                elapsed_time: 1.0,
                round_time: 1.0,
                training_time: 0.8,
                evaluation_time: 0.1,
                bytes_to_clients: 10,
                bytes_to_server: 20,
                train_loss: 0.25,
                simulated_time: 0.5,
                extra_bytes_to_clients: 0,
                federated_accuracy: None,
                epsilon: None,
                test_loss: None,
                secagg: None,
                simulated_start: Some(1.0),
                candidates: Vec::new(),
            };
            let client = ClientRow {
                round,
                client_id: 3,
                worker: 0,
                samples: 6,
                loss: 0.25,
                training_time: 0.4,
                processing_time: 0.01,
                comm_time: 0.0,
                payload_bytes: 1000,
                label_histogram: vec![4, 2],
                test_accuracy: None,
                dropped: None,
                simulated: Some(SimulatedTask {
                    start: 1.0,
                    download: 0.5,
                    compute: 2.0,
                    upload: 0.25,
                }),
                staleness: Some(2),
                wall: Some(WallTask {
                    start: 4.0,
                    end: 6.5,
                }),
            };
            let dropped = ClientRow {
                worker: 1,
                label_histogram: vec![1, 0],
                dropped: Some("update refused: reports \"5\" samples, not 6".to_owned()),
                ..ClientRow::empty(round, 4)
            };
            rows.push(row, vec![client, dropped]);
            rows.write_files(dir.path()).unwrap();
            assert_eq!(rows.clients_of(round).len(), 2);
        }
        assert!(rows.clients_of(3).is_empty());
        // Appending round by round gives the file a rewrite gives.
        let appended = tempfile::tempdir().unwrap();
        let mut so_far = RunRows::default();
        let mut written = None;
        for round in 1..=2 {
            so_far.push(
                rows.rounds[round as usize - 1].clone(),
                rows.clients_of(round).to_vec(),
            );
            written = Some(so_far.append_files(appended.path(), written).unwrap());
        }
        assert_eq!(written, Some(4));
        assert_eq!(
            std::fs::read(appended.path().join(CLIENTS_FILE)).unwrap(),
            std::fs::read(dir.path().join(CLIENTS_FILE)).unwrap()
        );
        let csv = std::fs::read_to_string(dir.path().join("results.csv")).unwrap();
        assert_eq!(csv.lines().count(), 3);
        assert!(csv.lines().nth(2).unwrap().starts_with("2,0.5000,"));
        let clients = std::fs::read_to_string(dir.path().join("clients.csv")).unwrap();
        assert_eq!(
            clients.lines().nth(1).unwrap(),
            "1,3,0,6,0.250000,0.400,0.0100,0.0000,1000,4 2,,1.000,0.500,2.000,0.250,3.750,2,4.000,\
             6.500,"
        );
        // A dropped client's row: no numbers, the reason as one quoted field.
        assert_eq!(
            clients.lines().nth(2).unwrap(),
            "1,4,1,,,,,,,1 0,,,,,,,,,,\"update refused: reports \"\"5\"\" samples, not 6\""
        );
        let columns = CLIENTS_HEADER.split(',').count();
        assert_eq!(clients.lines().nth(1).unwrap().split(',').count(), columns);
    }

    #[test]
    fn candidates_are_written_only_for_runs_that_evaluated_some() {
        let dir = tempfile::tempdir().unwrap();
        let row = |round: u32, candidates: Vec<CandidateRow>| RoundRow {
            candidates,
            ..parse_results(
                &format!("{RESULTS_HEADER}\n{round},0.5,1,1,1,1,1,1,1,1,0,,,,\n"),
                "r",
            )
            .unwrap()
            .remove(0)
        };
        let mut rows = RunRows::default();
        rows.push(row(1, Vec::new()), Vec::new());
        rows.write_files(dir.path()).unwrap();
        assert!(!dir.path().join(CANDIDATES_FILE).exists());
        let candidate = |client_id: u32, loss: f64, selected: bool| CandidateRow {
            client_id,
            samples: 40,
            loss,
            selected,
            simulated: None,
            failed: None,
        };
        let failed = CandidateRow {
            failed: Some("cannot unpack the global model: bad, truly".to_owned()),
            ..candidate(3, f64::NEG_INFINITY, false)
        };
        let timed = CandidateRow {
            simulated: Some(SimulatedTask {
                start: 2.0,
                download: 0.5,
                compute: 0.25,
                upload: 0.125,
            }),
            ..candidate(2, f64::INFINITY, true)
        };
        let second = vec![candidate(5, 0.75, true), timed, failed];
        rows.push(row(2, second.clone()), Vec::new());
        rows.write_files(dir.path()).unwrap();
        let csv = std::fs::read_to_string(dir.path().join(CANDIDATES_FILE)).unwrap();
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(
            lines,
            [
                CANDIDATES_HEADER,
                "2,5,40,0.750000,1,,,,,,",
                "2,2,40,inf,1,2.000,0.500,0.250,0.125,2.875,",
                "2,3,,,0,,,,,,\"cannot unpack the global model: bad, truly\"",
            ]
        );
        // A checkpoint keeps them, infinite losses exactly.
        let json = serde_json::to_string(&rows.rounds[1]).unwrap();
        let back: RoundRow = serde_json::from_str(&json).unwrap();
        assert_eq!(back.candidates[1].loss, f64::INFINITY);
        assert_eq!(back.candidates, second);
        let plain = serde_json::to_string(&rows.rounds[0]).unwrap();
        assert!(!plain.contains("candidates"), "{plain}");
    }
}
