//! When each client is online, on the simulated clock.
//!
//! `always` (the default), a seeded on/off model (each client alternates
//! online and offline spells of exponential length with the configured
//! means, starting online with the stationary probability
//! `mean_online / (mean_online + mean_offline)`, from its own ChaCha8 stream
//! of `(seed, client)`), or a trace file of `client,online_from,online_until`
//! intervals (seconds; a client with no interval is never online). Spells
//! are half-open: online at `from`, offline at `until`.
//!
//! The on/off spells are drawn as far as a question needs them and kept:
//! they depend on the seed and the client alone, so a resumed run draws the
//! same ones again and nothing of them is checkpointed.

use std::collections::BTreeSet;
use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::{CsvTable, FileError};

/// `clients.availability.model`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AvailabilityModel {
    /// Every client is online all the time.
    #[default]
    Always,
    /// Seeded online and offline spells of exponential length.
    OnOff,
    /// The intervals of `trace_file`.
    Trace,
}

/// `[clients.availability]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AvailabilityConfig {
    /// `always` (default), `on_off` or `trace`.
    pub model: AvailabilityModel,
    /// `on_off`: mean seconds of an online spell. Default 3600.
    pub mean_online: f64,
    /// `on_off`: mean seconds of an offline spell. Default 3600.
    pub mean_offline: f64,
    /// `on_off`: seed of the spells. Default 1.
    pub seed: u64,
    /// `trace`: a CSV file `client,online_from,online_until` (relative to the
    /// config file that sets it). Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_file: Option<std::path::PathBuf>,
}

impl Default for AvailabilityConfig {
    fn default() -> Self {
        Self {
            model: AvailabilityModel::Always,
            mean_online: 3600.0,
            mean_offline: 3600.0,
            seed: 1,
            trace_file: None,
        }
    }
}

/// The shortest mean spell: shorter ones would make a long run draw
/// millions of spells per client.
pub const MIN_MEAN_SPELL: f64 = 1.0;
/// The longest mean spell: about 30 years.
pub const MAX_MEAN_SPELL: f64 = 1e9;
/// The latest time a trace may name.
pub const MAX_TRACE_SECONDS: f64 = 1e12;

impl AvailabilityConfig {
    /// Every problem, as (key inside `[clients.availability]`, message).
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut problems = Vec::new();
        if self.model == AvailabilityModel::OnOff {
            for (key, value) in [
                ("mean_online", self.mean_online),
                ("mean_offline", self.mean_offline),
            ] {
                if !(value.is_finite() && (MIN_MEAN_SPELL..=MAX_MEAN_SPELL).contains(&value)) {
                    problems.push((
                        key,
                        format!(
                            "must be a number of seconds in [{MIN_MEAN_SPELL}, {}], got {}",
                            crate::number::shown(MAX_MEAN_SPELL),
                            crate::number::shown(value)
                        ),
                    ));
                }
            }
        }
        match (self.model, &self.trace_file) {
            (AvailabilityModel::Trace, None) => problems.push((
                "trace_file",
                "model = \"trace\" needs a trace_file of client,online_from,online_until rows"
                    .to_owned(),
            )),
            (AvailabilityModel::Always | AvailabilityModel::OnOff, Some(_)) => problems.push((
                "trace_file",
                "is read only with model = \"trace\"".to_owned(),
            )),
            _ => {}
        }
        problems
    }
}

/// A spell online: from `from` (included) to `until` (excluded), seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Interval {
    pub from: f64,
    pub until: f64,
}

/// When every client is online. See the module documentation.
#[derive(Debug, Clone)]
pub enum Availability {
    Always,
    OnOff(OnOff),
    /// Client `c`'s sorted, disjoint spells at index `c − 1`.
    Trace(Vec<Vec<Interval>>),
}

/// The on/off model, its spells drawn as far as asked.
#[derive(Debug, Clone)]
pub struct OnOff {
    mean_online: f64,
    mean_offline: f64,
    seed: u64,
    clients: Vec<Option<Drawn>>,
}

#[derive(Debug, Clone)]
struct Drawn {
    rng: ChaCha8Rng,
    spells: Vec<Interval>,
    /// Everything before this time is decided.
    until: f64,
    /// Whether the spell that starts at `until` is an online one.
    next_online: bool,
}

impl Availability {
    /// The model `config` describes for `total_clients`; a trace is read
    /// from `trace` (the file's text and its name).
    pub fn new(
        config: &AvailabilityConfig,
        total_clients: u32,
        trace: Option<(&str, &Path)>,
    ) -> Result<Self, FileError> {
        Ok(match config.model {
            AvailabilityModel::Always => Availability::Always,
            AvailabilityModel::OnOff => Availability::OnOff(OnOff {
                mean_online: config.mean_online,
                mean_offline: config.mean_offline,
                seed: config.seed,
                clients: vec![None; total_clients as usize],
            }),
            AvailabilityModel::Trace => {
                let (text, file) = trace.ok_or_else(|| FileError {
                    file: "clients.availability.trace_file".to_owned(),
                    line: 0,
                    column: None,
                    problem: "model = \"trace\" needs a trace file".to_owned(),
                })?;
                Availability::Trace(read_trace(text, file, total_clients)?)
            }
        })
    }

    /// The end of the online spell `client` is in at `time` (`f64::INFINITY`
    /// when it never ends); `None` when it is offline then.
    pub fn online_until(&mut self, client: u32, time: f64) -> Option<f64> {
        match self {
            Availability::Always => Some(f64::INFINITY),
            Availability::Trace(spells) => {
                spell_at(spells.get(client as usize - 1)?, time).map(|s| s.until)
            }
            Availability::OnOff(model) => {
                let drawn = model.drawn_past(client, time);
                spell_at(&drawn.spells, time).map(|s| s.until)
            }
        }
    }

    /// The earliest time from `time` on when `client` is online; `None` when
    /// it never is again.
    pub fn next_online(&mut self, client: u32, time: f64) -> Option<f64> {
        match self {
            Availability::Always => Some(time),
            Availability::Trace(spells) => spells
                .get(client as usize - 1)?
                .iter()
                .find(|s| s.until > time)
                .map(|s| s.from.max(time)),
            Availability::OnOff(model) => {
                // Spells are drawn until one ends after `time`; each pass
                // draws at least one more, and they alternate.
                let mut horizon = time;
                loop {
                    let drawn = model.drawn_past(client, horizon);
                    let later = drawn.spells.partition_point(|s| s.until <= time);
                    if let Some(spell) = drawn.spells.get(later) {
                        return Some(spell.from.max(time));
                    }
                    horizon = drawn.until;
                }
            }
        }
    }
}

/// Which clients are online, kept up to date as the clock moves forward,
/// so the questions an asynchronous server asks at every event (who is
/// online to take a free place, when is the next one) cost what the
/// clients that changed and the places number, not a pass over every
/// client's spells.
///
/// It holds each client's state (online or not) and the time until which
/// that state lasts, both from [`Availability::online_until`] and
/// [`Availability::next_online`], so its answers are theirs exactly; a
/// question about a time before the last one rebuilds it.
#[derive(Debug, Clone, Default)]
pub struct OnlineIndex {
    /// The time the states hold at; `None` until first asked.
    at: Option<f64>,
    /// Index `c − 1`: whether client `c` is online at `at`.
    online: Vec<bool>,
    /// (the time client's state changes, as bits, client), earliest first:
    /// the times are never negative, so their bits sort as they do.
    changes: BTreeSet<(u64, u32)>,
}

impl OnlineIndex {
    /// The clients of `1..=total` online at `time`, except those in `busy`,
    /// in ascending order: the ones a selection may draw from.
    pub fn online_clients(
        &mut self,
        availability: &mut Availability,
        total: u32,
        time: f64,
        busy: &[u32],
    ) -> Vec<u32> {
        self.advance(availability, total, time);
        // A copy of the states with the busy ones cleared, then one pass:
        // bytes, not branches, for each of the federation's clients.
        let mut idle_online = self.online.clone();
        for &client in busy {
            if let Some(state) = (client as usize)
                .checked_sub(1)
                .and_then(|i| idle_online.get_mut(i))
            {
                *state = false;
            }
        }
        idle_online
            .iter()
            .zip(1..=total)
            .filter_map(|(&online, client)| online.then_some(client))
            .collect()
    }

    /// The earliest time from `time` on when a client of `1..=total` not in
    /// `busy` is online; `None` when none ever is again.
    pub fn next_online_client(
        &mut self,
        availability: &mut Availability,
        total: u32,
        time: f64,
        busy: &[u32],
    ) -> Option<f64> {
        self.advance(availability, total, time);
        let mut busy = busy.to_vec();
        busy.sort_unstable();
        let idle = |client: &u32| busy.binary_search(client).is_err();
        if (1..=total).any(|c| self.online[c as usize - 1] && idle(&c)) {
            return Some(time);
        }
        // Every idle client is offline: the earliest change among them is
        // when one comes online (only finite changes are kept).
        self.changes
            .iter()
            .find(|(_, client)| idle(client))
            .map(|&(bits, _)| f64::from_bits(bits))
    }

    /// The states at `time`: from scratch the first time (or for a time
    /// before the last), else by replaying the changes up to it.
    fn advance(&mut self, availability: &mut Availability, total: u32, time: f64) {
        let fresh = match self.at {
            Some(at) => time < at || self.online.len() != total as usize,
            None => true,
        };
        if fresh {
            self.online = vec![false; total as usize];
            self.changes.clear();
            for client in 1..=total {
                self.refresh(availability, client, time);
            }
        } else {
            while let Some(&(bits, client)) = self.changes.first() {
                if f64::from_bits(bits) > time {
                    break;
                }
                self.changes.pop_first();
                self.refresh(availability, client, time);
            }
        }
        self.at = Some(time);
    }

    /// Client `client`'s state at `time` and when it changes.
    fn refresh(&mut self, availability: &mut Availability, client: u32, time: f64) {
        let (online, until) = match availability.online_until(client, time) {
            Some(until) => (true, until),
            None => (
                false,
                availability
                    .next_online(client, time)
                    .unwrap_or(f64::INFINITY),
            ),
        };
        self.online[client as usize - 1] = online;
        if until.is_finite() {
            self.changes.insert((until.to_bits(), client));
        }
    }
}

/// The spell of sorted, disjoint `spells` that holds `time`.
fn spell_at(spells: &[Interval], time: f64) -> Option<&Interval> {
    let after = spells.partition_point(|s| s.from <= time);
    spells[..after].last().filter(|s| time < s.until)
}

impl OnOff {
    /// Client `client`'s spells, drawn until past `time`.
    fn drawn_past(&mut self, client: u32, time: f64) -> &Drawn {
        let (mean_online, mean_offline, seed) = (self.mean_online, self.mean_offline, self.seed);
        let slot = &mut self.clients[client as usize - 1];
        let drawn = slot.get_or_insert_with(|| {
            let stream = crate::seeds::derive_seed(seed, "availability", &[u64::from(client)]);
            let mut rng = ChaCha8Rng::seed_from_u64(stream);
            let online = rng.random::<f64>() < mean_online / (mean_online + mean_offline);
            Drawn {
                rng,
                spells: Vec::new(),
                until: 0.0,
                next_online: online,
            }
        });
        while drawn.until <= time {
            let mean = if drawn.next_online {
                mean_online
            } else {
                mean_offline
            };
            // 1 − U is in (0, 1]: the spell is finite and never negative.
            let length = -mean * (1.0 - drawn.rng.random::<f64>()).ln();
            let end = drawn.until + length;
            if drawn.next_online && length > 0.0 {
                drawn.spells.push(Interval {
                    from: drawn.until,
                    until: end,
                });
            }
            drawn.until = end;
            drawn.next_online = !drawn.next_online;
        }
        drawn
    }
}

/// A trace file's spells per client, sorted, overlapping and touching ones
/// merged.
fn read_trace(
    text: &str,
    file: &Path,
    total_clients: u32,
) -> Result<Vec<Vec<Interval>>, FileError> {
    const COLUMNS: [&str; 3] = ["client", "online_from", "online_until"];
    let table = CsvTable::parse(text, file, &COLUMNS, &COLUMNS)?;
    let mut spells = vec![Vec::new(); total_clients as usize];
    for row in table.rows() {
        let client = row.client(total_clients)?;
        let from = row
            .number("online_from", 0.0, MAX_TRACE_SECONDS)?
            .expect("required");
        let until = row
            .number("online_until", 0.0, MAX_TRACE_SECONDS)?
            .expect("required");
        if until <= from {
            let index = row.index("online_until").expect("required");
            return Err(row.error(
                index,
                format!(
                    "online_until = {} is not after online_from = {}",
                    crate::number::shown(until),
                    crate::number::shown(from)
                ),
            ));
        }
        spells[client as usize - 1].push(Interval { from, until });
    }
    for client in &mut spells {
        client.sort_by(|a, b| a.from.total_cmp(&b.from));
        let mut merged: Vec<Interval> = Vec::with_capacity(client.len());
        for spell in client.drain(..) {
            match merged.last_mut() {
                Some(last) if spell.from <= last.until => last.until = last.until.max(spell.until),
                _ => merged.push(spell),
            }
        }
        *client = merged;
    }
    Ok(spells)
}
